# JAX's x64 mode, as both front ends apply it: the one place that says what a 64-bit value
# becomes at the boundary and inside.
#
# * Outputs: a value gets JAX's canonical dtype (int64 -> int32, float64 -> float32 with x64
#   off). The callback path narrows torch's results, checked (_convert.narrow_checked: a value
#   out of range raises); lowering="xla" gives each output the graph's dtype, canonicalized
#   (output_dtype).
# * int32 inputs with x64 off: torch's indexing code wants int64 (cross_entropy's targets,
#   gather, scatter, embedding's ids, PyG's edge_index), so torch sees an int64 copy (the
#   callback path's call_widening; lowering="xla" captures with int64 example tensors,
#   widened_dtype), and JAX computes in int32 all the same. The few ops that want int32 (LU
#   pivots) refuse the copy: the call runs again on the int32 tensors, and that function's
#   later calls are not widened. TORCHJAX_WIDEN_INT32=0 hands torch the int32 tensor itself.
# * Arithmetic inside: the callback path runs torch at the precision the code asks for. A
#   lowered graph has only JAX's types: with x64 off it refuses float64 or complex128
#   arithmetic (computes_wide_float; it would run in 32 bits), and names int64 arithmetic,
#   which runs in int32 and wraps past 2**31 (narrows; lowering_report lists them).
from __future__ import annotations

import math
import operator
import os
from typing import Any

import jax
import numpy as np
import torch

from torchjax._compat._jax import jax_config
from torchjax._compat._messages import wants_int32
from torchjax._compat._torch import is_op_overload, op_schema, torch_pytree
from torchjax._convert import canonical_jax_dtype

_x64 = jax_config.enable_x64  # the state object: read at each call, not jax.config's attribute


def x64_enabled() -> bool:
    return bool(_x64.value)


# -- outputs --------------------------------------------------------------------------------


def output_dtype(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype of an output torch computes in `dtype`."""
    return canonical_jax_dtype(dtype)


# -- int32 inputs ---------------------------------------------------------------------------
_INT32 = np.dtype(np.int32)
WIDEN_INT32 = os.environ.get("TORCHJAX_WIDEN_INT32", "1") != "0"


def widens(dtypes: Any) -> bool:
    """Whether a call with inputs of these (numpy or JAX) dtypes hands torch int64 for
    int32: x64 is off and one of them is int32."""
    return WIDEN_INT32 and not _x64.value and any(d == _INT32 for d in dtypes)


def widened_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch sees for an input of `dtype` in a call that widens."""
    return torch.int64 if dtype == torch.int32 else dtype


def call_widening(fn: Any, facts: dict, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with int32 tensors widened (widen_int32), unless `facts`
    (the user function's) say it keeps int32; a call that fails for wanting int32 runs
    again on the int32 tensors, and `facts` keep that."""
    if facts.get("keeps_int32"):
        return fn(*args, **kwargs)
    wide_args, wide_kwargs = widen_int32((args, kwargs))
    if wide_args is args and wide_kwargs is kwargs:
        return fn(*args, **kwargs)
    try:
        return fn(*wide_args, **wide_kwargs)
    except Exception as e:
        if not wants_int32(e):
            raise
    facts["keeps_int32"] = True
    return fn(*args, **kwargs)


def widen_int32(tree: Any) -> Any:
    """`tree` with its int32 tensors as int64 copies, where x64 is off (see above)."""
    if not WIDEN_INT32 or _x64.value:
        return tree
    leaves, structure = jax.tree_util.tree_flatten(tree)
    if not any(isinstance(x, torch.Tensor) and x.dtype is torch.int32 for x in leaves):
        return tree
    return jax.tree_util.tree_unflatten(
        structure,
        [x.long() if isinstance(x, torch.Tensor) and x.dtype is torch.int32 else x for x in leaves],
    )


# -- 64-bit arithmetic inside a lowered graph ----------------------------------------------
_WIDE_FLOATS = (torch.float64, torch.complex128)
# Ops that move a 64-bit float without computing with it: a conversion, a copy.
_NOT_ARITHMETIC = frozenset(
    {"_to_copy", "clone", "copy", "convert_element_type", "_assert_tensor_metadata", "detach"}
)


def computes_wide_float(node: torch.fx.Node) -> str:
    """The 64-bit float dtype ("float64", "complex128") graph node `node` computes with,
    or "". A conversion, a copy or a view of one is no computation, so `x.double()`
    returned, or cast back, is not."""
    if node.op != "call_function" or not is_op_overload(node.target):
        return ""
    inputs = [
        a.meta.get("val")
        for a in torch_pytree.tree_leaves((node.args, node.kwargs))
        if isinstance(a, torch.fx.Node)
    ]
    wide = [t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.dtype in _WIDE_FLOATS]
    if not wide or node.target.__name__.split(".")[0] in _NOT_ARITHMETIC:
        return ""
    if any(r.alias_info is not None for r in op_schema(node.target).returns):
        return ""  # a view
    return str(wide[0]).removeprefix("torch.")


# Ops whose int64 result can leave the range of their inputs (so int32 arithmetic can wrap
# where int64 would not); moving, selecting and comparing values cannot.
_ARITHMETIC = frozenset(
    "add sub rsub mul div floor_divide remainder fmod pow neg abs square sum prod cumsum "
    "cumprod mm bmm addmm dot mv matmul linear bitwise_left_shift __lshift__ mean".split()
)
_INT32_MAX = 2**31 - 1


def narrows(node: torch.fx.Node) -> bool:
    """Whether graph node `node` is int64 arithmetic, which JAX computes in int32 with x64
    off."""
    meta = node.meta.get("val") if node.op == "call_function" else None
    if not isinstance(meta, torch.Tensor) or meta.dtype != torch.int64:
        return False
    return is_op_overload(node.target) and _name(node) in _ARITHMETIC


def may_wrap(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The int64 arithmetic nodes of `graph` (narrows) whose values may leave int32's range:
    each int64 value's bound on its magnitude is followed from the inputs (int32 with x64
    off, as every constant), sizes and literals through the ops below, and a node is named
    where its bound exceeds 2**31 - 1. Position ids (an arange plus an offset, a cumsum of a
    mask) stay far below it: a transformer reports none."""
    bounds: dict[torch.fx.Node, float] = {}
    found = []
    for node in graph.nodes:
        bounds[node] = bound = _bound(node, bounds)
        if narrows(node) and bound > _INT32_MAX:
            found.append(node)
    return found


# Ops whose result is one of their inputs' values (moved, selected, copied, compared-away).
_MOVING = frozenset(
    "clone copy _to_copy view reshape _unsafe_view expand slice select index gather "
    "index_select cat stack where permute transpose t squeeze unsqueeze flip roll repeat "
    "alias detach max min amax amin maximum minimum clamp clamp_min clamp_max "
    "masked_fill embedding narrow unbind split split_with_sizes getitem take "
    "take_along_dim scatter index_put diagonal".split()
)


def _name(node: torch.fx.Node) -> str:
    return str(node.target).split(".")[1] if is_op_overload(node.target) else ""


def _bound(node: torch.fx.Node, bounds: dict) -> float:
    """A bound on the magnitude of `node`'s values (inf: unknown, or not integers)."""
    meta = node.meta.get("val")
    if isinstance(meta, bool | int):
        return abs(int(meta))
    if isinstance(meta, torch.Tensor):
        if meta.dtype == torch.bool:
            return 1
        if meta.is_floating_point() or meta.is_complex():
            return math.inf
    if isinstance(meta, tuple | list) and _name(node) not in (
        "split",
        "split_with_sizes",
        "unbind",
    ):
        return math.inf  # (max.dim's indices are no values of its input)
    if node.op == "placeholder":  # JAX's int32 (x64 off), or a constant narrowed, checked
        return _INT32_MAX
    if node.op != "call_function":
        return math.inf

    def of(value: Any) -> float:
        if isinstance(value, torch.fx.Node):
            return bounds.get(value, math.inf)
        if isinstance(value, bool | int | float):
            return abs(value)
        if isinstance(value, list | tuple):
            return max((of(v) for v in value), default=0)
        return math.inf

    args = [a for a in (*node.args, *node.kwargs.values()) if not isinstance(a, torch.dtype)]
    name = "getitem" if node.target is operator.getitem else _name(node)
    if name in _MOVING or name in ("neg", "abs", "mean"):
        return max((of(a) for a in args if isinstance(a, torch.fx.Node | list | tuple)), default=0)
    if name in ("arange", "full", "scalar_tensor", "full_like", "fill"):
        return max((of(a) for a in node.args if not isinstance(a, torch.fx.Node)), default=0)
    if name in ("zeros", "zeros_like", "ones", "ones_like", "new_zeros", "new_ones"):
        return 1
    if name in ("add", "sub", "rsub"):
        alpha = node.kwargs.get("alpha", 1)
        return of(node.args[0]) + abs(alpha) * of(node.args[1])
    if name == "mul":
        return of(node.args[0]) * of(node.args[1])
    if name in ("floor_divide", "div", "remainder", "fmod"):
        return max(of(node.args[0]), of(node.args[1]))
    if name in ("cumsum", "sum") and isinstance(meta, torch.Tensor):
        source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        count = source.numel() // max(meta.numel(), 1) if name == "sum" else None
        if name == "cumsum" and isinstance(source, torch.Tensor):
            count = source.shape[node.args[1]] if source.ndim else 1
        if isinstance(count, int):
            return of(node.args[0]) * count
    return math.inf
