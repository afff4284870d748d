# torch_call's batching rule: jax.vmap of a torch call, as one batched torch call.
#
# vmap_method "torch.func" (the default) rebinds the call with BatchedFunction(fn, in_dims):
# torch.func.vmap over the batched tensor leaves, one torch call however deep the nesting.
# The other policies mirror jax.pure_callback's: "sequential" maps the unbatched call over
# the batch with lax.map; "expand_dims" and "broadcast_all" trust fn to handle a leading
# batch axis itself (LeadingAxisFunction). Three cases are split first, where only some
# inputs are batched and the outputs must stay unbatched: the combined JVP call with only
# its tangents batched (jax.jacfwd, jax.hessian: fn once, the linear half batched), a VJP
# with only its cotangents batched (jax.jacrev: one forward, the pullback batched), and
# the two pullbacks of a VJP with tangents (the JVP of a VJP) with only the second batched.
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from torchjax._errors import VmapError
from torchjax._log import describe, logger
from torchjax._primitive._params import is_operand
from torchjax._to_jax._callables._autodiff import JvpFunction, VjpFunction
from torchjax._to_jax._callables._batched import BatchedFunction, LeadingAxisFunction
from torchjax._to_jax._callables._batched_kept import BatchedKeptForward, BatchedKeptVjp
from torchjax._to_jax._callables._kept import KeptForward
from torchjax._to_jax._options import Options
from torchjax._to_jax._torch_call._primitive import torch_call_p
from torchjax._to_jax._torch_ops._vmap import LEADING_AXIS_MESSAGE

_tree = jax.tree_util


def batch(args: tuple, axes: tuple, *, fn: Any, options: Any) -> tuple[Any, Any]:
    """Batch the combined call as two when only its tangents are batched, a VJP with only
    its cotangents batched as one forward and a batched pullback; else as one call."""
    if isinstance(fn, KeptForward):
        kept = _kept_forward(args, axes, fn, options)
        if kept is not None:
            return kept
        # Batched as any call, the forward keeps no graph and no generator state (both
        # "none": zeros), so it is only the inner call, which jit drops where its outputs
        # go unused: one batched VJP call.
        out, out_axes = by_method(args, axes, fn=fn.inner, options=options)
        out = jax.tree_util.tree_leaves(out)
        nothing = tuple(jax.numpy.zeros(t.shape, t.dtype) for t in KeptForward.residual_types())
        return (*out, *nothing), (*_broadcast(out_axes, len(out)), None, None)
    if isinstance(fn, VjpFunction) and fn.with_tangents:
        *head_axes, ct_axes, more_axes = axes
        if not any(a is not None for a in jax.tree_util.tree_leaves((head_axes, ct_axes))):
            # Only the second cotangents are batched (jax.jacfwd of a VJP in its cotangents):
            # the first pullback stays unbatched, as JAX expects of a primal output.
            single = dataclasses.replace(fn, with_tangents=False)
            *head, cts, more = args
            value = torch_call_p.bind(*head, cts, fn=single, options=options)
            t_out, t_axes = batch(
                (*head, more), (*head_axes, more_axes), fn=single, options=options
            )
            t_out = jax.tree_util.tree_leaves(t_out)
            return (*value, *t_out), (*[None] * len(value), *_broadcast(t_axes, len(t_out)))
    if isinstance(fn, VjpFunction) and options.vmap_method == "torch.func":
        if not any(a is not None for a in jax.tree_util.tree_leaves(axes[:-1])):
            level = tuple(axes[-1])  # the cotangents: one array each, so one axis each
            pulled = dataclasses.replace(fn, ct_batch=(*fn.ct_batch, level))
            return torch_call_p.bind(*args, fn=pulled, options=options), 0
    if isinstance(fn, VjpFunction) and fn.with_residuals and not fn.with_tangents:
        kept = _kept_vjp(args, axes, fn, options)
        if kept is not None:
            return kept
    primals, tangents = args if isinstance(fn, JvpFunction) and fn.with_primals else ((), ())
    if not tangents or any(a is not None for a in jax.tree_util.tree_leaves(axes[0])):
        return by_method(args, axes, fn=fn, options=options)
    out = jax.tree_util.tree_leaves(torch_call_p.bind(*primals, fn=fn.inner, options=options))
    t_out, t_axes = by_method(args, axes, fn=fn.linear, options=options)
    t_axes = _broadcast(t_axes, len(t_out))
    return (*out, *t_out), (*[None] * len(out), *t_axes)


torch_call_p.def_batching(batch)


def _tensor_in_dims(args: tuple, axes: tuple) -> tuple:
    """One batch axis (or None) per operand leaf of `args`, in flattening order."""
    leaves, tree = _tree.tree_flatten(args)
    flat_axes = tree.flatten_up_to(axes)
    return tuple(a for x, a in zip(leaves, flat_axes, strict=True) if is_operand(x))


def _kept_forward(args: tuple, axes: tuple, fn: KeptForward, options: Options) -> Any:
    """The batched forward that keeps one graph for every example
    (_callables/_batched_kept.py), where
    it applies: the user's function, batched by torch.func, with every output batched."""
    if options.vmap_method != "torch.func" or options.grad_method == "autograd":
        return None
    if not fn.keep_graph or fn.inner is not fn.inner.root:
        return None
    in_dims = _tensor_in_dims(args, axes)
    batched = BatchedFunction(fn.inner, in_dims, options.vmap_randomness).with_out_dims(args)
    if batched.out_dims is not None:
        return None  # some output stays unbatched: a BatchedFunction handles that
    kept = BatchedKeptForward(fn, in_dims, options.vmap_randomness)
    out = torch_call_p.bind(*args, fn=kept, options=options)
    return out, (*[0] * (len(out) - 2), None, None)


def _kept_vjp(args: tuple, axes: tuple, fn: VjpFunction, options: Options) -> Any:
    """The batched VJP that pulls back through a BatchedKeptForward's graph, where its
    residuals came unbatched from one (else None: the VJP is batched as any call)."""
    if options.vmap_method != "torch.func" or fn.ct_batch or fn.method == "autograd":
        return None
    _, residual_axes, _ = axes
    if any(a is not None for a in _tree.tree_leaves(residual_axes)):
        return None
    in_dims = _tensor_in_dims(args, axes)
    kept = BatchedKeptVjp(fn, in_dims, options.vmap_randomness)
    return torch_call_p.bind(*args, fn=kept, options=options), 0


def _broadcast(axes: Any, n: int) -> list:
    return list(axes) if isinstance(axes, tuple | list) else [axes] * n


def _calls_user_directly(fn: Any) -> bool:
    """Whether fn is the user's function, perhaps under LeadingAxisFunction layers."""
    while isinstance(fn, LeadingAxisFunction):
        fn = fn.inner
    return fn is fn.root


def by_method(args: tuple, axes: tuple, *, fn: Any, options: Options) -> tuple[Any, int]:
    """Batch ``fn(*args)`` according to ``options.vmap_method``; outputs batched at axis 0
    (with "torch.func", the user's function's outputs that depend on no batched input stay
    unbatched: jax.vmap's out_axes=None).

    The general case of the batching rule (batch, above, takes out the calls with a kept
    graph and the JVP and VJP calls batched in one half only).
    """
    leaves, tree = _tree.tree_flatten(args)
    flat_axes = tree.flatten_up_to(axes)
    size = next(x.shape[a] for x, a in zip(leaves, flat_axes, strict=True) if a is not None)
    method = options.vmap_method
    if method == "torch.func":
        in_dims = _tensor_in_dims(args, axes)
        # A derivative by torch.autograd.grad (grad_mode: one is in fn) cannot be vmapped.
        per_example = options.grad_method == "autograd" and fn.grad_mode
        batched = BatchedFunction(fn, in_dims, options.vmap_randomness, per_example)
        batched = batched.with_out_dims(args)  # outputs that depend on no batched input
        out = torch_call_p.bind(*args, fn=batched, options=options)
        if batched.out_dims is None:
            return out, 0
        return out, _tree.tree_unflatten(_tree.tree_structure(out), list(batched.out_dims))

    moved = [
        jnp.moveaxis(x, a, 0) if a is not None else x
        for x, a in zip(leaves, flat_axes, strict=True)
    ]
    if method == "sequential":
        mapped = [i for i, a in enumerate(flat_axes) if a is not None]
        logger.debug("vmap of %s runs one call per example (sequential)", describe(fn))

        def one(slices: list) -> Any:
            new = list(moved)
            for i, s in zip(mapped, slices, strict=True):
                new[i] = s
            return torch_call_p.bind(*_tree.tree_unflatten(tree, new), fn=fn, options=options)

        return jax.lax.map(one, [moved[i] for i in mapped]), 0

    if method == "expand_dims" and not _calls_user_directly(fn):
        # A derivative of fn (JvpFunction, VjpFunction) is not itself batch-polymorphic: a
        # size-1 cotangent does not match the batched output it pulls back, and a VJP with
        # respect to a size-1 input sums over the batch instead of giving one row per
        # example. With every input broadcast, each example stays separate.
        method = "broadcast_all"

    def lift(x: Any, a: Any) -> Any:
        if a is not None or not is_operand(x):
            return x
        if method == "expand_dims":
            return jnp.expand_dims(x, 0)
        return jnp.broadcast_to(x, (size, *jnp.shape(x)))

    new = [lift(x, a) for x, a in zip(moved, flat_axes, strict=True)]
    lead = LeadingAxisFunction(fn, size)
    out = torch_call_p.bind(*_tree.tree_unflatten(tree, new), fn=lead, options=options)
    for path, o in _tree.tree_flatten_with_path(out)[0]:
        if not o.shape or o.shape[0] != size:
            raise VmapError(
                LEADING_AXIS_MESSAGE.format(
                    name=fn.root.name,
                    method=options.vmap_method,
                    size=size,
                    got=f"{o.dtype}{list(o.shape)}",
                    where="out" + _tree.keystr(path),
                )
            )
    return out, 0
