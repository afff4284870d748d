# torch_call's dead-code elimination rule: what a jitted program need not run.
#
# JAX's default drops a call whose outputs are all unused and keeps the rest whole. Reverse
# mode leaves calls of which only a residual is read, and forward-over-reverse (the JVP of
# a gradient: Hessian-vector products, jax.hessian) has one such forward per call:
#   * The JVP of a VJP that follows a KeptForward (a JvpFunction of a VjpFunction with
#     residuals, maybe batched) recomputes the forward inside torch.func.jvp, where a kept
#     graph cannot serve (VjpFunction._through_kept_graph): of the residuals it reads
#     the RNG state only. Its graph-handle operand becomes a literal 0, so it stops being a
#     use of the handle (it would only have taken the graph out of the store to drop it).
#   * A KeptForward whose handle nobody reads keeps no graph (keep_graph=False).
#   * A JVP whose outputs nobody reads, only their tangents, returns the tangents alone.
#   * A KeptForward, or the JvpFunction of one (inside torch.func.jvp it keeps no graph:
#     its handle is 0), of which nothing but the residuals is read becomes a
#     ForwardResiduals call on the forward's primals alone (not the JVP's tangents, which
#     the residuals do not depend on: jax.checkpoint's transpose would take them for
#     linear): it reads torch's generator state, which is what the forward
#     would have returned, and does not run the forward (but once per function: see
#     there). So jax.jit(jax.jvp(jax.grad(f))) and jax.jit(jax.hessian(f)) run the
#     forward as often as torch.func does (tests/test_forward_over_reverse.py counts the
#     matrix products).
# Eagerly every call runs as it is bound: only a jitted program is seen whole.
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from torchjax._compat._jax import core, replace_equation
from torchjax._primitive._params import ARRAY
from torchjax._to_jax._callables._autodiff import JvpFunction, VjpFunction
from torchjax._to_jax._callables._base import layout
from torchjax._to_jax._callables._batched import BatchedFunction
from torchjax._to_jax._callables._kept import ForwardResiduals, KeptForward
from torchjax._to_jax._torch_call._partial_eval import torch_call_eqn
from torchjax._to_jax._torch_call._primitive import torch_call_p


def dce(used_outputs: list[bool], eqn: Any) -> tuple[list[bool], Any]:
    """JAX's DCE rule for torch_call: ``(used inputs, the equation to keep or None)``."""
    if not any(used_outputs):
        return [False] * len(eqn.invars), None
    fn = dict(eqn.params["params"])["fn"]
    original = eqn.invars
    if isinstance(fn, KeptForward):
        eqn = _forward_eqn(used_outputs, eqn, fn, len(used_outputs) - 2)
    elif isinstance(fn, JvpFunction) and isinstance(fn.inner, KeptForward):
        if fn.with_primals and not fn.with_residuals:
            eqn = _forward_eqn(used_outputs, eqn, fn, len(fn.out_mask) - 2)
    else:
        if _differentiates_kept_vjp(fn):
            eqn = _without_handle(eqn)
        if isinstance(fn, JvpFunction) and fn.with_primals:
            eqn = _tangents_only(used_outputs, eqn, fn)
    kept = {id(v) for v in eqn.invars if isinstance(v, core.Var)}
    return [id(v) in kept for v in original], eqn  # one per operand of the original call


torch_call_p.def_dce(dce)


def _forward_eqn(used: list[bool], eqn: Any, fn: Any, handle_at: int) -> Any:
    """A forward's equation, given which outputs are read; its outputs' handle and RNG
    state are at `handle_at` and after."""
    rest = used[:handle_at] + used[handle_at + 2 :]
    if not any(rest):
        residuals = eqn.outvars[handle_at : handle_at + 2]
        in_tree, statics, invars = eqn.params["in_tree"], eqn.params["statics"], eqn.invars
        if isinstance(fn, JvpFunction):
            # The residuals of a JVP's forward are its primals' alone: the call keeps only
            # them as operands. Left reading the tangents, it would make the residuals
            # depend on them, and a transpose (jax.checkpoint's) would take every later use
            # of the residuals for a linear one.
            primals = layout(fn, in_tree)["primals"]
            in_tree, statics = primals.tree, statics[: primals.stop]
            invars = invars[: sum(1 for s in statics if s is ARRAY)]
            fn = fn.inner
        return torch_call_eqn(eqn, invars, residuals, in_tree, statics, ForwardResiduals(fn))
    if isinstance(fn, KeptForward) and fn.keep_graph and not used[handle_at]:
        lighter = dataclasses.replace(fn, keep_graph=False)
        in_tree, statics = eqn.params["in_tree"], eqn.params["statics"]
        return torch_call_eqn(eqn, eqn.invars, eqn.outvars, in_tree, statics, lighter)
    return eqn


def _unbatched(fn: Any) -> Any:
    """The callable under every batching layer of `fn`."""
    while isinstance(fn, BatchedFunction):
        fn = fn.inner
    return fn


def _differentiated_vjp(fn: Any) -> VjpFunction:
    return _unbatched(fn).inner


def _differentiates_kept_vjp(fn: Any) -> bool:
    fn = _unbatched(fn)
    return (
        isinstance(fn, JvpFunction)
        and isinstance(fn.inner, VjpFunction)
        and fn.inner.with_residuals
    )


def _without_handle(eqn: Any) -> Any:
    """The equation with its VJP's graph handle (the leaf after the VJP's primals, which
    lead its arguments: ``((vjp primals, (handle, rng), cotangents), tangents)``) a
    literal 0."""
    in_tree, statics = eqn.params["in_tree"], eqn.params["statics"]
    fn = dict(eqn.params["params"])["fn"]
    vjp_args = layout(fn, in_tree)["primals"]  # batched or not, the JVP's primals lead
    vjp = _differentiated_vjp(fn)
    handle_leaf = vjp_args.start + layout(vjp, vjp_args.tree)["residuals"].start
    if statics[handle_leaf] is not ARRAY:
        return eqn
    operand = sum(1 for s in statics[:handle_leaf] if s is ARRAY)
    var = eqn.invars[operand]
    aval = var.aval
    if not isinstance(var, core.Var) or aval.shape != () or aval.dtype != np.int32:
        return eqn  # already a literal, or batched (a batch of handles)
    invars = list(eqn.invars)
    invars[operand] = core.Literal(np.int32(0), aval)
    return replace_equation(eqn, invars=invars)


def _tangents_only(used: list[bool], eqn: Any, fn: JvpFunction) -> Any:
    """A JVP whose outputs (not tangents) nobody reads returns its tangents alone: the same
    torch.func.jvp, without writing the outputs out (a JVP of a gradient: the gradient)."""
    n_out = len(fn.out_mask)
    if any(used[:n_out]):
        return eqn
    in_tree, statics = eqn.params["in_tree"], eqn.params["statics"]
    return torch_call_eqn(eqn, eqn.invars, eqn.outvars[n_out:], in_tree, statics, fn.linear)
