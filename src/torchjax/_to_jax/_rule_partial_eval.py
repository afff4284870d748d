# Splitting the one-call JVP where JAX needs its primal half apart from its tangent half.
#
# The JVP rule binds JvpFunction(fn, with_primals=True): one torch.func.jvp computes the
# outputs and their tangents (_autodiff.py). That is all jax.jvp needs. Three places need
# the halves apart, as fn(primals) and the linear JvpFunction(fn)(primals, tangents):
#   * Partial evaluation with known primals and unknown tangents (linearize, grad, the
#     autodiff of scan, cond, while, jit and shard_map bodies): the primal half must run
#     now and the tangent half be staged as an equation linear in the tangents, to be
#     transposed. JAX's default would stage the whole call, outputs included.
#     Rule: custom_partial_eval_rules (JaxprTrace).
#   * jax.checkpoint, by partial_eval_jaxpr_custom. Under a policy that recomputes, the
#     staged half is the whole call again, so the outputs are recomputed rather than saved;
#     the checkpoint's transpose partially evaluates it and the first rule splits it there.
#   * vmap over tangents only (jacfwd, hessian): the outputs do not depend on the batched
#     tangents and must come out unbatched, so fn runs once and the linear half is batched.
#     Likewise a VJP batched over its cotangents only (jacrev) runs the forward once and
#     batches the pullback (VjpFunction.ct_batch).
# Any other case (a primal unknown or batched too, everything known) is treated whole.
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from torchjax._compat import ad, core, register_linearization
from torchjax._compat import partial_eval as pe
from torchjax._primitive._params import _ARRAY, _rebuild
from torchjax._to_jax import _batching
from torchjax._to_jax._autodiff import JvpFunction, TapedFunction, VjpFunction, differentiated
from torchjax._to_jax._derivative import _inexact
from torchjax._to_jax._torch_call import torch_call_p

_prim = torch_call_p.primitive


def _combined(params: tuple) -> JvpFunction | None:
    fn = dict(params)["fn"]
    return fn if isinstance(fn, JvpFunction) and fn.with_primals else None


def _primal_operand_count(in_tree: Any, statics: tuple) -> int:
    """How many operands belong to the primals: the call's args are (primals, tangents)."""
    primal_leaves = in_tree.children()[0].num_leaves
    return sum(1 for s in statics[:primal_leaves] if s is _ARRAY)


def _partial_eval(trace: pe.JaxprTrace, *tracers: Any, **flat: Any) -> list:
    """JaxprTrace rule: known primals and unknown tangents -> known outputs, staged tangents.

    JAX calls it with the parent trace current, so binding fn(primals) here computes the
    outputs now (or stages them in the parent trace, which is what "known" means there).
    """
    fn, in_tree, statics = _combined(flat["params"]), flat["in_tree"], flat["statics"]
    known = [t.pval.is_known() for t in tracers]
    n_primal = _primal_operand_count(in_tree, statics) if fn else 0
    if fn is None or all(known) or not all(known[:n_primal]):
        return trace.default_process_primitive(_prim, tracers, flat)
    options = dict(flat["params"])["options"]
    values = [t.pval.get_known() for t in tracers[:n_primal]] + list(tracers[n_primal:])
    primals, _ = _rebuild(in_tree, statics, values)
    # The forward runs now, keeping torch's graph and RNG state for the linear half.
    taped = TapedFunction(fn.inner, fn.wrt, fn.out_mask, fn.grad_method)
    *out, handle, rng = torch_call_p.bind(*primals, fn=taped, options=options)
    outs = [trace.new_const(v) for v in out]
    residuals = (trace.new_const(handle), trace.new_const(rng))
    primals_t, tangents_t = _rebuild(in_tree, statics, tracers)
    linear = dataclasses.replace(fn, with_primals=False, taped=True)
    with core.set_current_trace(trace):
        tangents = torch_call_p.bind(primals_t, residuals, tangents_t, fn=linear, options=options)
    return [*outs, *tangents]


pe.custom_partial_eval_rules[_prim] = _partial_eval


def _linearize(
    is_vjp: bool | None, nonzeros: list, *operands: Any, in_tree, statics, signature, params
) -> Any:
    """Direct linearization (jax.grad, jax.vjp, jax.linearize), the split above without
    first tracing the JVP into a jaxpr: the forward runs now as TapedFunction, and the
    linear half is bound on the tangent trace. A linear half that will be applied forward
    (jax.linearize: is_vjp False) recomputes anyway, so no graph is kept for it. None: JAX's
    fallback (through the JVP rule) handles the call, e.g. a VJP differentiated with
    respect to its cotangents."""
    params = dict(params)
    fn, options = params["fn"], params["options"]
    if isinstance(fn, VjpFunction):
        return None
    primals = _rebuild(in_tree, statics, operands)
    leaves, tree = jax.tree_util.tree_flatten(primals)
    marks = [True if nz else None for nz in nonzeros]
    wrt = differentiated(leaves, tree.flatten_up_to(_rebuild(in_tree, statics, marks, fill=None)))
    out_avals = signature.out_avals
    out_mask = tuple(_inexact(a.dtype) for a in out_avals)
    if not wrt or not any(out_mask):
        return None
    taped = TapedFunction(fn, wrt, out_mask, options.grad_method, keep=is_vjp is not False)
    *out, handle, rng = torch_call_p.bind(*primals, fn=taped, options=options)
    linear = JvpFunction(fn, wrt, out_mask, options.grad_method, taped=True)

    def linearized(residuals: Any, *tangents: Any) -> list:
        del residuals  # the closure's: the primals, the graph's handle and the RNG state
        given = [None if type(t) is ad.Zero else t for t in tangents]
        t_leaves = tree.flatten_up_to(_rebuild(in_tree, statics, given, fill=None))
        wrt_tangents = tuple(t_leaves[i] for i in wrt)
        flat = iter(
            torch_call_p.bind(primals, (handle, rng), wrt_tangents, fn=linear, options=options)
        )
        return [
            next(flat) if m else ad.Zero(a.to_tangent_aval())
            for m, a in zip(out_mask, out_avals, strict=True)
        ]

    return out, list(out_mask), None, linearized


register_linearization(_prim, _linearize)


def _partial_eval_custom(saveable: Any, unks_in: list, inst_in: list, eqn: Any) -> tuple:
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
    n_primal = _primal_operand_count(eqn.params["in_tree"], eqn.params["statics"]) if fn else 0
    if fn is None or any(unks_in[:n_primal]):
        return None, eqn, [True] * n_out, [True] * n_out, residuals
    n_primal_out = len(fn.out_mask)
    primal_tree = eqn.params["in_tree"].children()[0]  # the call's args: (primals, tangents)
    primal_statics = eqn.params["statics"][: primal_tree.num_leaves]
    primal_eqn = _torch_call_eqn(
        eqn,
        eqn.invars[:n_primal],
        eqn.outvars[:n_primal_out],
        primal_tree,
        primal_statics,
        fn.inner,
    )
    tangent_out = [True] * (n_out - n_primal_out)
    if _saved(saveable, primal_eqn):
        linear_eqn = _torch_call_eqn(
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


pe.partial_eval_jaxpr_custom_rules[_prim] = _partial_eval_custom


def _var(v: Any) -> bool:
    return isinstance(v, core.Var)  # not a Literal, which is inlined wherever it is used


def _saved(saveable: Any, eqn: Any) -> bool:
    policy = pe.ensure_enum(saveable(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params))
    # Offloading is a kind of saving; this rule keeps such outputs on their device.
    return not isinstance(policy, pe.RecomputeType)


def _torch_call_eqn(like: Any, invars: list, outvars: list, in_tree: Any, statics: tuple, fn):
    """An equation of torch_call_p calling `fn`, with `like`'s options and source info."""
    params = dict(like.params["params"])
    params["fn"] = fn
    user_params = tuple(sorted(params.items()))
    avals = tuple(v.aval for v in invars)
    signature = torch_call_p._signature_cache(in_tree, statics, avals, user_params)
    new = dict(in_tree=in_tree, statics=statics, signature=signature, params=user_params)
    return like.replace(invars=list(invars), outvars=list(outvars), params=new)


@torch_call_p.def_batching
def _batch(args: tuple, axes: tuple, *, fn: Any, options: Any) -> tuple[Any, Any]:
    """Batch the combined call as two when only its tangents are batched, a VJP with only
    its cotangents batched as one forward and a batched pullback; else as one call."""
    if isinstance(fn, TapedFunction):
        # Batched, the forward keeps no graph and no generator state (both "none": zeros),
        # so it is only the inner call, which jit drops where its outputs go unused, as in
        # jax.jit(jax.vmap(jax.grad(f))): one batched VJP call.
        out, out_axes = _batching.batch(args, axes, fn=fn.inner, options=options)
        out = jax.tree_util.tree_leaves(out)
        nothing = tuple(jax.numpy.zeros(t.shape, t.dtype) for t in TapedFunction.residual_types())
        return (*out, *nothing), (*_broadcast(out_axes, len(out)), None, None)
    if isinstance(fn, VjpFunction) and fn.pair:
        *head_axes, ct_axes, more_axes = axes
        if not any(a is not None for a in jax.tree_util.tree_leaves((head_axes, ct_axes))):
            # Only the second cotangents are batched (jax.jacfwd of a VJP in its cotangents):
            # the first pullback stays unbatched, as JAX expects of a primal output.
            single = dataclasses.replace(fn, pair=False)
            *head, cts, more = args
            value = torch_call_p.bind(*head, cts, fn=single, options=options)
            t_out, t_axes = _batch(
                (*head, more), (*head_axes, more_axes), fn=single, options=options
            )
            t_out = jax.tree_util.tree_leaves(t_out)
            return (*value, *t_out), (*[None] * len(value), *_broadcast(t_axes, len(t_out)))
    if isinstance(fn, VjpFunction) and options.vmap_method == "torch":
        if not any(a is not None for a in jax.tree_util.tree_leaves(axes[:-1])):
            level = tuple(axes[-1])  # the cotangents: one array each, so one axis each
            pulled = dataclasses.replace(fn, ct_batch=(*fn.ct_batch, level))
            return torch_call_p.bind(*args, fn=pulled, options=options), 0
    primals, tangents = args if isinstance(fn, JvpFunction) and fn.with_primals else ((), ())
    if not tangents or any(a is not None for a in jax.tree_util.tree_leaves(axes[0])):
        return _batching.batch(args, axes, fn=fn, options=options)
    out = jax.tree_util.tree_leaves(torch_call_p.bind(*primals, fn=fn.inner, options=options))
    t_out, t_axes = _batching.batch(args, axes, fn=fn.linear, options=options)
    t_axes = _broadcast(t_axes, len(t_out))
    return (*out, *t_out), (*[None] * len(out), *t_axes)


def _broadcast(axes: Any, n: int) -> list:
    return list(axes) if isinstance(axes, tuple | list) else [axes] * n
