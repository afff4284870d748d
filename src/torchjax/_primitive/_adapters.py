# PytreePrimitive's flat adapters: what JAX calls, and the pytree rules they call.
#
# JAX calls a primitive's rules with flat operands and the primitive's params. Each adapter
# here rebuilds the caller's pytrees from them, calls the rule registered on the
# PytreePrimitive `prim` (each is registered as functools.partial(adapter, prim)), and
# flattens and checks what the rule returns. The params of the underlying primitive are
# always the same four: `in_tree` and `statics` (bind's args, operands replaced by ARRAY),
# `signature` (the outputs, found once by abstract eval) and `params` (bind's keyword
# params, sorted (name, value) pairs).
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from torchjax._compat._jax import ad, dispatch, tangent_aval
from torchjax._errors import OutputMismatchError
from torchjax._primitive._params import (
    ARRAY,
    Linear,
    as_operand,
    as_operands,
    broadcast_prefix,
    flatten_checked,
    rebuild,
)

_tree = jax.tree_util


def flat_abstract_eval(prim: Any, *avals, signature, **_) -> list:
    """The output avals: receives the operands' avals; returns what the signature (found
    by the abstract eval rule when the call was bound) declares. No rule runs here."""
    del prim, avals
    return list(signature.out_avals)


def flat_impl(prim: Any, *operands, in_tree, statics, signature, params) -> list:
    """The eager impl JAX dispatches to: receives concrete operands; returns the flat
    outputs, checked against `signature`. Delegates to the primitive's _flat_impl (a
    subclass may compute on the flat operands directly)."""
    return prim._flat_impl(
        as_operands(operands), in_tree=in_tree, statics=statics, signature=signature, params=params
    )


def impl_on_pytrees(prim: Any, operands, in_tree, statics, signature, params) -> list:
    """PytreePrimitive's default _flat_impl: the impl rule on the rebuilt pytrees, its
    output flattened and checked; without an impl rule, the lowering compiled by JAX."""
    if prim._impl_rule is None:
        if prim._lowering_rule is None:
            raise prim._missing("impl", "eager evaluation")
        return dispatch.apply_primitive(
            prim.primitive,
            *operands,
            in_tree=in_tree,
            statics=statics,
            signature=signature,
            params=params,
        )
    args = rebuild(in_tree, statics, operands)
    kwargs = dict(params)
    if prim._impl_signature:
        kwargs["signature"] = signature
    out = prim._impl_rule(*args, **kwargs)
    return flatten_checked(prim.name, out, signature.out_tree, signature.out_avals, "impl")


def flat_lowering(prim: Any, *operands, in_tree, statics, signature, params) -> list:
    """Under jit: receives the operands as traced values; returns the flat outputs of the
    lowering rule (or, without one, of the impl rule traced as JAX code), checked."""
    if prim._lowering_rule is not None:
        rule, with_signature = prim._lowering_rule, prim._lowering_signature
    elif prim._impl_rule is not None:
        rule, with_signature = prim._impl_rule, prim._impl_signature
    else:
        raise prim._missing("lowering", "jax.jit")
    args = rebuild(in_tree, statics, operands)
    kwargs = dict(params)
    if with_signature:
        kwargs["signature"] = signature
    out = rule(*args, **kwargs)
    return flatten_checked(prim.name, out, signature.out_tree, signature.out_avals, "lowering")


def flat_batching(prim: Any, operands, dims, *, in_tree, statics, signature, params):
    """jax.vmap: receives the operands and their batch dims (an int, or JAX's not-mapped
    None); returns the flat outputs and their batch dims, from the batching rule's
    pytree of outputs and its out_axes (an int or None for all, or a pytree like out)."""
    del signature
    if prim._batching_rule is None:
        raise prim._missing("batching", "jax.vmap")
    args = rebuild(in_tree, statics, as_operands(operands))
    axes = rebuild(in_tree, statics, dims, fill=None)
    out, out_axes = prim._batching_rule(args, axes, **dict(params))
    leaves, tree = _tree.tree_flatten(out)
    flat_axes = broadcast_prefix(out_axes, tree, "batching", prim.name, "out_axes")
    dims_out = []
    for leaf, ax in zip(leaves, flat_axes, strict=True):
        if ax is None:
            dims_out.append(None)  # JAX's not-mapped marker
        else:
            dims_out.append(ax % np.ndim(leaf) if np.ndim(leaf) else ax)
    return leaves, dims_out


def flat_jvp(prim: Any, primals, tangents, *, in_tree, statics, signature, params):
    """Forward mode: receives primals and tangents (ad.Zero for symbolic zeros, handed to
    the rule as None); returns the flat outputs and their tangents (ad.Zero where the rule
    gave None, or where the output's tangent type is float0)."""
    out_tree, out_avals = signature.out_tree, signature.out_avals
    if prim._jvp_rule is None:
        raise prim._missing("jvp", "forward- and reverse-mode differentiation")
    primal_args = rebuild(in_tree, statics, as_operands(primals))
    given = [None if type(t) is ad.Zero else as_operand(t) for t in tangents]
    tangent_args = rebuild(in_tree, statics, given, fill=None)
    out, out_tangents = prim._jvp_rule(primal_args, tangent_args, **dict(params))
    out_flat = flatten_checked(prim.name, out, out_tree, out_avals, "jvp")
    if out_tangents is None:
        tangents_flat = [None] * len(out_flat)
    else:
        tangents_flat = broadcast_prefix(out_tangents, out_tree, "jvp", prim.name, "tangents")
    result = []
    for t, aval in zip(tangents_flat, out_avals, strict=True):
        t_aval = tangent_aval(aval)
        if t is None or t_aval.dtype == jax.dtypes.float0:
            result.append(ad.Zero(t_aval))
        else:
            result.append(t)
    return out_flat, result


def flat_transpose(prim: Any, cts, *operands, in_tree, statics, signature, params):
    """Reverse mode: receives the output cotangents (ad.Zero for zeros, handed to the rule
    as None) and the operands, undefined primals marked (handed to the rule as Linear);
    returns a cotangent per operand: None for a defined primal, ad.Zero for a zero one."""
    out_tree = signature.out_tree
    if prim._transpose_rule is None:
        raise prim._missing("transpose", "reverse-mode differentiation (jax.grad, jax.vjp)")
    given = [None if type(c) is ad.Zero else as_operand(c) for c in cts]
    ct_tree = _tree.tree_unflatten(out_tree, given)
    marked = [Linear(x.aval) if ad.is_undefined_primal(x) else as_operand(x) for x in operands]
    args = rebuild(in_tree, statics, marked)
    ct_args = prim._transpose_rule(ct_tree, *args, **dict(params))
    if not isinstance(ct_args, tuple | list) or len(ct_args) != len(args):
        raise OutputMismatchError(
            f"{prim.name}: the transpose rule must return a tuple with one entry per "
            f"positional argument ({len(args)}), got {type(ct_args).__name__}."
        )
    ct_leaves = []
    for arg_tree, ct in zip(in_tree.children(), ct_args, strict=True):
        if ct is None:
            ct_leaves.extend([None] * arg_tree.num_leaves)
        else:
            ct_leaves.extend(broadcast_prefix(ct, arg_tree, "transpose", prim.name, "cts"))
    result = []
    operand_iter = iter(operands)
    for static, ct in zip(statics, ct_leaves, strict=True):
        if static is not ARRAY:
            continue
        x = next(operand_iter)
        if not ad.is_undefined_primal(x):
            result.append(None)
        elif ct is None:
            result.append(ad.Zero(tangent_aval(x.aval)))
        else:
            result.append(ct)
    return result
