# The flat adapters of PytreePrimitive's transformation rules: batching, JVP, transpose.
#
# JAX calls each with the flat operands and the primitive's params; each rebuilds the
# caller's pytrees, calls the registered rule, and flattens and checks what it returns.
# Split from _core.py, which keeps bind and the evaluation adapters. `self` is the
# PytreePrimitive (each is registered as functools.partial(adapter, primitive)).
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from torchjax._compat import ad
from torchjax._errors import OutputMismatchError
from torchjax._primitive._params import (
    _ARRAY,
    Linear,
    _broadcast_prefix,
    _flatten_checked,
    _rebuild,
)

_tree = jax.tree_util


def flat_batching(self: Any, operands, dims, *, in_tree, statics, signature, params):
    del signature
    if self._batching_rule is None:
        raise self._missing("batching", "jax.vmap")
    args = _rebuild(in_tree, statics, operands)
    axes = _rebuild(in_tree, statics, dims, fill=None)
    out, out_axes = self._batching_rule(args, axes, **dict(params))
    leaves, tree = _tree.tree_flatten(out)
    flat_axes = _broadcast_prefix(out_axes, tree, "batching", self.name, "out_axes")
    dims_out = []
    for leaf, ax in zip(leaves, flat_axes, strict=True):
        if ax is None:
            dims_out.append(None)  # JAX's not-mapped marker
        else:
            dims_out.append(ax % np.ndim(leaf) if np.ndim(leaf) else ax)
    return leaves, dims_out


def flat_jvp(self: Any, primals, tangents, *, in_tree, statics, signature, params):
    out_tree, out_avals = signature.out_tree, signature.out_avals
    if self._jvp_rule is None:
        raise self._missing("jvp", "forward- and reverse-mode differentiation")
    primal_args = _rebuild(in_tree, statics, primals)
    tangent_args = _rebuild(
        in_tree, statics, [None if type(t) is ad.Zero else t for t in tangents], fill=None
    )
    out, out_tangents = self._jvp_rule(primal_args, tangent_args, **dict(params))
    out_flat = _flatten_checked(self.name, out, out_tree, out_avals, "jvp")
    if out_tangents is None:
        tangents_flat = [None] * len(out_flat)
    else:
        tangents_flat = _broadcast_prefix(out_tangents, out_tree, "jvp", self.name, "tangents")
    result = []
    for t, aval in zip(tangents_flat, out_avals, strict=True):
        tangent_aval = aval.to_tangent_aval()
        if t is None or tangent_aval.dtype == jax.dtypes.float0:
            result.append(ad.Zero(tangent_aval))
        else:
            result.append(t)
    return out_flat, result


def flat_transpose(self: Any, cts, *operands, in_tree, statics, signature, params):
    out_tree = signature.out_tree
    if self._transpose_rule is None:
        raise self._missing("transpose", "reverse-mode differentiation (jax.grad, jax.vjp)")
    ct_tree = _tree.tree_unflatten(out_tree, [None if type(c) is ad.Zero else c for c in cts])
    marked = [Linear(x.aval) if ad.is_undefined_primal(x) else x for x in operands]
    args = _rebuild(in_tree, statics, marked)
    ct_args = self._transpose_rule(ct_tree, *args, **dict(params))
    if not isinstance(ct_args, tuple | list) or len(ct_args) != len(args):
        raise OutputMismatchError(
            f"{self.name}: the transpose rule must return a tuple with one entry per "
            f"positional argument ({len(args)}), got {type(ct_args).__name__}."
        )
    ct_leaves = []
    for arg_tree, ct in zip(in_tree.children(), ct_args, strict=True):
        if ct is None:
            ct_leaves.extend([None] * arg_tree.num_leaves)
        else:
            ct_leaves.extend(_broadcast_prefix(ct, arg_tree, "transpose", self.name, "cts"))
    result = []
    operand_iter = iter(operands)
    for static, ct in zip(statics, ct_leaves, strict=True):
        if static is not _ARRAY:
            continue
        x = next(operand_iter)
        if not ad.is_undefined_primal(x):
            result.append(None)
        elif ct is None:
            result.append(ad.Zero(x.aval.to_tangent_aval()))
        else:
            result.append(ct)
    return result
