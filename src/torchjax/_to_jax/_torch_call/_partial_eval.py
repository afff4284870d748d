# torch_call's partial-evaluation rules: the one-call JVP split where JAX needs its primal
# half apart from its tangent half.
#
# The JVP rule binds JvpFunction(fn, with_primals=True): one torch.func.jvp computes the
# outputs and their tangents (_torch_call/_jvp.py). That is all jax.jvp needs. Three places need
# the halves apart, as fn(primals) and the linear JvpFunction(fn)(primals, tangents):
#   * Partial evaluation with known primals and unknown tangents (linearize, grad, the
#     autodiff of scan, cond, while, jit and shard_map bodies): the primal half must run
#     now and the tangent half be staged as an equation linear in the tangents, to be
#     transposed. JAX's default would stage the whole call, outputs included.
#     Rule: custom_partial_eval_rules (JaxprTrace).
#   * jax.checkpoint, by partial_eval_jaxpr_custom. Under a policy that recomputes, the
#     staged half is the whole call again, so the outputs are recomputed rather than saved;
#     the checkpoint's transpose partially evaluates it and the first rule splits it there.
#   * direct linearization (jax.grad, jax.vjp, jax.linearize): JAX's LinearizeTrace asks
#     for a linearization rule; the forward runs now as a KeptForward, keeping torch's
#     graph for the VJP, and the linear half is bound on the tangent trace.
# The JVP of a VJP in its cotangents, VjpFunction(with_tangents=True), splits in the first
# two places the same way: the pullback of the cotangents now, that of their tangents staged.
# (vmap over tangents only is split by the batching rule, _torch_call/_batching.py.) Any other case
# (a primal unknown too, everything known) is treated whole.
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from torchjax._compat._jax import (
    ad,
    core,
    is_known,
    known_value,
    new_var,
    process_by_default,
    replace_equation,
    tangent_aval,
    trace_constant,
)
from torchjax._compat._jax import partial_eval as pe
from torchjax._primitive._params import ARRAY, as_operands, rebuild
from torchjax._to_jax._callables._autodiff import JvpFunction, VjpFunction
from torchjax._to_jax._callables._base import layout
from torchjax._to_jax._callables._kept import KeptForward
from torchjax._to_jax._torch_call._jvp import differentiated
from torchjax._to_jax._torch_call._primitive import torch_call_p
from torchjax._to_jax._torch_ops._autograd import inexact

_prim = torch_call_p.primitive


def _combined(params: tuple) -> JvpFunction | None:
    fn = dict(params)["fn"]
    return fn if isinstance(fn, JvpFunction) and fn.with_primals else None


def _primal_operand_count(fn: JvpFunction, in_tree: Any, statics: tuple) -> int:
    """How many operands belong to the primals (which lead the call's arguments)."""
    return layout(fn, in_tree)["primals"].operands(statics)[1]


def partial_eval(trace: pe.JaxprTrace, *tracers: Any, **flat: Any) -> list:
    """JaxprTrace rule: known primals and unknown tangents -> known outputs, staged tangents.

    JAX calls it with the parent trace current, so binding fn(primals) here computes the
    outputs now (or stages them in the parent trace, which is what "known" means there).
    """
    fn, in_tree, statics = _combined(flat["params"]), flat["in_tree"], flat["statics"]
    known = [is_known(t) for t in tracers]
    vjp = _vjp_with_tangents(flat["params"])
    if vjp is not None:
        halves = _tangent_halves(vjp, in_tree, statics)
        if all(known[: halves.n_known]) and not all(known):
            return _split_with_tangents(
                trace, vjp, halves, tracers, dict(flat["params"])["options"]
            )
    n_primal = _primal_operand_count(fn, in_tree, statics) if fn else 0
    if fn is None or all(known) or not all(known[:n_primal]):
        return process_by_default(trace, _prim, tracers, flat)
    options = dict(flat["params"])["options"]
    values = as_operands([known_value(t) for t in tracers[:n_primal]]) + list(tracers[n_primal:])
    primals, _ = rebuild(in_tree, statics, values)
    # The forward runs now, keeping torch's graph and RNG state for the linear half.
    forward = KeptForward(fn.inner, fn.wrt, fn.out_mask, fn.grad_method)
    *out, handle, rng = torch_call_p.bind(*primals, fn=forward, options=options)
    outs = [trace_constant(trace, v) for v in out]
    residuals = (trace_constant(trace, handle), trace_constant(trace, rng))
    primals_t, tangents_t = rebuild(in_tree, statics, tracers)
    linear = dataclasses.replace(fn, with_primals=False, with_residuals=True)
    with core.set_current_trace(trace):
        tangents = torch_call_p.bind(primals_t, residuals, tangents_t, fn=linear, options=options)
    return [*outs, *tangents]


torch_call_p.def_partial_eval(partial_eval)


def _vjp_with_tangents(params: tuple) -> VjpFunction | None:
    fn = dict(params)["fn"]
    return fn if isinstance(fn, VjpFunction) and fn.with_tangents else None


@dataclasses.dataclass(frozen=True)
class _TangentHalves:
    """How a VJP with tangents's call ``(*points, cotangents, more)`` (the JVP of a VJP in its
    cotangents, _torch_call/_jvp.py) splits into its two pullbacks, which is exact since a VJP is
    linear in its cotangents: ``(*points, cotangents)``, its outputs, and ``(*points,
    more)``, its tangents, linear in `more`. Operands are numbered as the call's are."""

    known_tree: Any
    known_statics: tuple
    n_known: int  # operands of (*points, cotangents), which come first
    n_points: int  # operands of the points
    staged_tree: Any
    staged_statics: tuple


def _tangent_halves(vjp: VjpFunction, in_tree: Any, statics: tuple) -> _TangentHalves:
    parts = layout(vjp, in_tree)
    cts, more = parts.pop("cotangents"), parts.pop("ct_tangents")
    points = [p.tree for p in parts.values()]  # the primals (and residuals)
    return _TangentHalves(
        known_tree=_tree_tuple([*points, cts.tree]),
        known_statics=statics[: more.start],
        n_known=more.operands(statics)[0],
        n_points=cts.operands(statics)[0],
        staged_tree=_tree_tuple([*points, more.tree]),
        staged_statics=(*statics[: cts.start], *statics[more.start :]),
    )


def _tree_tuple(kids: list) -> Any:
    return jax.tree_util.treedef_tuple(kids)


def _split_with_tangents(
    trace: Any, vjp: VjpFunction, halves: _TangentHalves, tracers: tuple, options
):
    """JaxprTrace rule for a VJP with tangents whose cotangents are known and whose
    tangents (`more`) are not: the first pullback runs now, the second is staged, linear in
    `more`. (The forward runs once for each; one forward for both is for jax.jvp alone.)"""
    single = dataclasses.replace(vjp, with_tangents=False)
    values = as_operands([known_value(t) for t in tracers[: halves.n_known]])
    out = torch_call_p.bind(
        *rebuild(halves.known_tree, halves.known_statics, values), fn=single, options=options
    )
    outs = [trace_constant(trace, v) for v in out]
    staged = [*tracers[: halves.n_points], *tracers[halves.n_known :]]
    args = rebuild(halves.staged_tree, halves.staged_statics, staged)
    with core.set_current_trace(trace):
        tangents = torch_call_p.bind(*args, fn=single, options=options)
    return [*outs, *tangents]


def linearize(
    is_vjp: bool | None, nonzeros: list, *operands: Any, in_tree, statics, signature, params
) -> Any:
    """Direct linearization (jax.grad, jax.vjp, jax.linearize), the split above without
    first tracing the JVP into a jaxpr: the forward runs now as KeptForward, and the
    linear half is bound on the tangent trace. A linear half that will be applied forward
    (jax.linearize: is_vjp False) recomputes anyway, so no graph is kept for it. None: JAX's
    fallback (through the JVP rule) handles the call, e.g. a VJP differentiated with
    respect to its cotangents."""
    params = dict(params)
    fn, options = params["fn"], params["options"]
    if isinstance(fn, VjpFunction):
        return None
    primals = rebuild(in_tree, statics, as_operands(operands))
    leaves, tree = jax.tree_util.tree_flatten(primals)
    marks = [True if nz else None for nz in nonzeros]
    wrt = differentiated(leaves, tree.flatten_up_to(rebuild(in_tree, statics, marks, fill=None)))
    out_avals = signature.out_avals
    out_mask = tuple(inexact(a.dtype) for a in out_avals)
    if not wrt or not any(out_mask):
        return None
    keep = is_vjp is not False
    forward = KeptForward(fn, wrt, out_mask, options.grad_method, keep_graph=keep)
    *out, handle, rng = torch_call_p.bind(*primals, fn=forward, options=options)
    linear = JvpFunction(fn, wrt, out_mask, options.grad_method, with_residuals=True)

    def linearized(residuals: Any, *tangents: Any) -> list:
        del residuals  # the closure's: the primals, the graph's handle and the RNG state
        given = [None if type(t) is ad.Zero else t for t in tangents]
        t_leaves = tree.flatten_up_to(rebuild(in_tree, statics, given, fill=None))
        wrt_tangents = tuple(t_leaves[i] for i in wrt)
        flat = iter(
            torch_call_p.bind(primals, (handle, rng), wrt_tangents, fn=linear, options=options)
        )
        return [
            next(flat) if m else ad.Zero(tangent_aval(a))
            for m, a in zip(out_mask, out_avals, strict=True)
        ]

    return out, list(out_mask), None, linearized


torch_call_p.def_linearization(linearize)


def partial_eval_custom(saveable: Any, unks_in: list, inst_in: list, eqn: Any) -> tuple:
    """partial_eval_jaxpr_custom rule: ``(known eqn, staged eqn, unknown outputs,
    outputs available to the staged part, residuals)``, as JAX's default would give, but
    with the combined call split when its primals are known and some tangents are not."""
    n_out = len(eqn.outvars)
    # Inputs the staged part reads but only the known part has: they become residuals.
    residuals = [v for v, inst in zip(eqn.invars, inst_in, strict=True) if _var(v) and not inst]
    fn = _combined(eqn.params["params"])
    if not any(unks_in):  # JAX's default: the policy chooses between saving and recomputing
        if _saved(saveable, eqn):
            return eqn, None, [False] * n_out, [False] * n_out, []
        return eqn, eqn, [False] * n_out, [True] * n_out, residuals
    vjp = _vjp_with_tangents(eqn.params["params"])
    if vjp is not None:
        halves = _tangent_halves(vjp, eqn.params["in_tree"], eqn.params["statics"])
        if not any(unks_in[: halves.n_known]):
            return _split_with_tangents_eqn(eqn, vjp, halves, inst_in)
    n_primal = _primal_operand_count(fn, eqn.params["in_tree"], eqn.params["statics"]) if fn else 0
    if fn is None or any(unks_in[:n_primal]):
        return None, eqn, [True] * n_out, [True] * n_out, residuals
    n_primal_out = len(fn.out_mask)
    primal_tree = eqn.params["in_tree"].children()[0]  # the call's args: (primals, tangents)
    primal_statics = eqn.params["statics"][: primal_tree.num_leaves]
    primal_eqn = torch_call_eqn(
        eqn,
        eqn.invars[:n_primal],
        eqn.outvars[:n_primal_out],
        primal_tree,
        primal_statics,
        fn.inner,
    )
    tangent_out = [True] * (n_out - n_primal_out)
    if _draws(eqn):
        return _split_replaying(eqn, fn, n_primal, n_primal_out, residuals)
    if _saved(saveable, primal_eqn):
        linear_eqn = torch_call_eqn(
            eqn,
            eqn.invars,
            eqn.outvars[n_primal_out:],
            eqn.params["in_tree"],
            eqn.params["statics"],
            fn.linear,
        )
        inst_out = [False] * n_primal_out + tangent_out
        return primal_eqn, linear_eqn, [False] * n_primal_out + tangent_out, inst_out, residuals
    # Recompute: the staged half is the whole call, outputs included.
    unks_out = [False] * n_primal_out + tangent_out
    return primal_eqn, eqn, unks_out, [True] * n_out, residuals


torch_call_p.def_partial_eval_custom(partial_eval_custom)


def _split_with_tangents_eqn(
    eqn: Any, vjp: VjpFunction, halves: _TangentHalves, inst_in: list
) -> tuple:
    """partial_eval_jaxpr_custom's split of a VJP with tangents with known cotangents (see
    _split_with_tangents): the known equation pulls back the cotangents, the staged one `more`. The
    outputs are saved whatever the policy: a pullback draws nothing."""
    single = dataclasses.replace(vjp, with_tangents=False)
    n_half = len(eqn.outvars) // 2
    known = torch_call_eqn(
        eqn,
        eqn.invars[: halves.n_known],
        eqn.outvars[:n_half],
        halves.known_tree,
        halves.known_statics,
        single,
    )
    read = [*range(halves.n_points), *range(halves.n_known, len(eqn.invars))]
    staged_in = [eqn.invars[i] for i in read]
    staged = torch_call_eqn(
        eqn, staged_in, eqn.outvars[n_half:], halves.staged_tree, halves.staged_statics, single
    )
    residuals = [eqn.invars[i] for i in read if _var(eqn.invars[i]) and not inst_in[i]]
    unks_out = [False] * n_half + [True] * (len(eqn.outvars) - n_half)
    return known, staged, unks_out, unks_out, residuals


def _split_replaying(eqn: Any, fn: JvpFunction, n_primal: int, n_primal_out: int, residuals):
    """The split of a call that draws random numbers, whatever the policy: recomputed, the
    primal half would draw anew, and the tangents (the gradient) would be those of other
    draws than the outputs'. The known half runs as a KeptForward without a graph (the
    checkpoint's memory is kept), and its RNG state is a residual: the linear half replays
    the forward's draws, as linearization's does."""
    primal_tree, tangent_tree = eqn.params["in_tree"].children()
    n_primal_leaves = primal_tree.num_leaves
    statics = eqn.params["statics"]
    forward = KeptForward(fn.inner, fn.wrt, fn.out_mask, fn.grad_method, keep_graph=False)
    handle, rng = (new_var(core.ShapedArray(r.shape, r.dtype)) for r in forward.residual_types())
    known = torch_call_eqn(
        eqn,
        eqn.invars[:n_primal],
        [*eqn.outvars[:n_primal_out], handle, rng],
        primal_tree,
        statics[:n_primal_leaves],
        forward,
    )
    residuals_tree = jax.tree_util.tree_structure((0, 0))  # (handle, rng)
    linear = dataclasses.replace(fn, with_primals=False, with_residuals=True)
    staged = torch_call_eqn(
        eqn,
        [*eqn.invars[:n_primal], handle, rng, *eqn.invars[n_primal:]],
        eqn.outvars[n_primal_out:],
        jax.tree_util.treedef_tuple([primal_tree, residuals_tree, tangent_tree]),
        (*statics[:n_primal_leaves], ARRAY, ARRAY, *statics[n_primal_leaves:]),
        linear,
    )
    n_out = len(eqn.outvars)
    unks_out = [False] * n_primal_out + [True] * (n_out - n_primal_out)
    return known, staged, unks_out, unks_out, [*residuals, handle, rng]


def _var(v: Any) -> bool:
    return isinstance(v, core.Var)  # not a Literal, which is inlined wherever it is used


def _saved(saveable: Any, eqn: Any) -> bool:
    if _draws(eqn):
        # A recomputation would draw again (torch's generator has moved on): the backward
        # would differentiate other draws than the forward returned. Saved, as exact.
        return True
    policy = pe.ensure_enum(saveable(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params))
    # Offloading is a kind of saving; this rule keeps such outputs on their device.
    return not isinstance(policy, pe.RecomputeType)


def _draws(eqn: Any) -> bool:
    """Whether the call's function draws random numbers its inputs do not seed (seen by a
    fake run: a function with declared result_shape_dtypes has none, and counts as not)."""
    root = getattr(dict(eqn.params["params"])["fn"], "root", None)
    return root is not None and root.facts.get("draws", False)


def torch_call_eqn(like: Any, invars: list, outvars: list, in_tree: Any, statics: tuple, fn):
    """An equation of torch_call_p calling `fn`, with `like`'s options and source info."""
    params = dict(like.params["params"])
    params["fn"] = fn
    user_params = tuple(sorted(params.items()))
    avals = tuple(v.aval for v in invars)
    signature = torch_call_p._traced_signature(in_tree, statics, avals, user_params)
    new = dict(in_tree=in_tree, statics=statics, signature=signature, params=user_params)
    return replace_equation(like, invars=list(invars), outvars=list(outvars), params=new)
