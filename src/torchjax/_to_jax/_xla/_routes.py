# How lowering="xla" runs each node of a graph, decided in one place: the per-op policies
# (an op run as a torch callback and why, an op with a lowering of torchjax's own, an op kept
# whole or decomposed otherwise than torch's tables say), the refusals of a whole graph, and
# the ordered route rules Program carries out. The first rule whose predicate holds decides a
# node's route; only the op table's own lowering can still fall back while tracing (it raised
# for these arguments, or its outputs differ from torch's), for the FALLBACKS reasons below.
# docs/lowering.md lists the rules in this order (tests/test_xla_routes.py checks it).
#
# Graph form: the refusals and route rules see the decomposed, functionalized graph Program
# walks; DECOMPOSITIONS shapes that graph (_export.py reads it when it decomposes).
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from torchjax._compat._torch import has_value_dependent_size, is_higher_order_op, is_op_overload
from torchjax._to_jax._xla._own_ops import (
    linalg_inv_ex,
    linalg_lu_factor_ex,
    linalg_solve_ex,
    linalg_vector_norm,
    log_ndtr,
    nextafter,
    safe_softmax,
    slice_scatter,
)
from torchjax._to_jax._xla._value_checks import corrcoef, cov, gaussian_nll_loss
from torchjax._x64 import computes_wide_float

# -- per-op policies ----------------------------------------------------------------------

CALLBACK = "callback"  # runs as a torch callback: its lowering disagrees with torch
OWN_LOWERING = "own lowering"  # lowered by torchjax's own JAX function, kept whole
KEPT_WHOLE = "kept whole"  # not decomposed: the op table lowers it whole, or a callback runs it
DECOMPOSED_AS = "decomposed as"  # decomposed by `function` in place of torch's table
# A torch function (named by its path, "torch.cov") that validates its arguments by reading
# values, which torch.export cannot capture: captured as `function`, without the check
# (_value_checks.py).
CAPTURED_AS = "captured as"


@dataclasses.dataclass(frozen=True)
class OpPolicy:
    """What lowering="xla" does with one ATen op (`op`, e.g. "aten.digamma.default"), and
    `why`. `function`: the JAX lowering (OWN_LOWERING) or the torch decomposition
    (DECOMPOSED_AS)."""

    op: str
    kind: str
    why: str
    function: Callable[..., Any] | None = None


_DISAGREES = "its lowering disagrees with torch (make conformance, docs/conformance.md)"
_KEPT_FOR_DERIVATIVE = "JAX differentiates its decomposition otherwise than torch"


def _embedding_bag(*args: Any, **kwargs: Any) -> Any:
    """embedding_bag as torch runs it when its weight requires grad. The example tensors
    of a capture do not, so torch picks _embedding_bag_forward_only, which has no
    derivative; JAX may differentiate the lowered program, and the two agree on values."""
    return torch.ops.aten._embedding_bag.default(*args, **kwargs)


_POLICIES: tuple[OpPolicy, ...] = (
    # Ops whose lowering disagrees with torch beyond the sweep's tolerances, or fails under a
    # transform torch supports. `make conformance` (tools/conformance.py) keeps these: it
    # fails where a lowered op mismatches and is missing here, and where a listed op would now
    # pass (docs/conformance.md has the errors).
    OpPolicy(
        "aten.cholesky_inverse.default",
        CALLBACK,
        "torch reads only the lower triangle of L, the lowering all of it: wrong values for a "
        "non-triangular input, and a wrong jvp",
    ),
    OpPolicy("aten.polygamma.default", CALLBACK, "JAX's values near poles differ from torch's"),
    OpPolicy("aten.digamma.default", CALLBACK, "JAX's derivatives differ from torch's"),
    OpPolicy("aten._linalg_eigh.default", CALLBACK, "eigh's derivative differs from torch's"),
    OpPolicy(
        "aten.linalg_pinv.atol_rtol_tensor",
        CALLBACK,
        "pinv's derivative differs at rank-deficient or Hermitian inputs",
    ),
    OpPolicy("aten.linalg_cholesky_ex.default", CALLBACK, "its info output's derivative"),
    OpPolicy("aten.linalg_ldl_factor_ex.default", CALLBACK, "its info output's derivative"),
    OpPolicy("aten.linalg_householder_product.default", CALLBACK, "no derivative rule"),
    OpPolicy("aten.max_pool2d_with_indices_backward.default", CALLBACK, _DISAGREES),
    OpPolicy("aten.scatter_reduce.two", CALLBACK, "values or gradients differ from torch's"),
    OpPolicy("aten.as_strided_scatter.default", CALLBACK, _DISAGREES),
    OpPolicy("aten.logcumsumexp.default", CALLBACK, _DISAGREES),
    # Lowerings of torchjax's own, used before the op table's, each kept whole.
    OpPolicy(
        "aten.slice_scatter.default",
        OWN_LOWERING,
        "takes symbolic sizes (the op table's compares 2**63 - 1 with them)",
        slice_scatter,
    ),
    OpPolicy(
        "aten._safe_softmax.default",
        OWN_LOWERING,
        f"{_KEPT_FOR_DERIVATIVE} (a masked row's NaN)",
        safe_softmax,
    ),
    OpPolicy(
        "aten.special_log_ndtr.default",
        OWN_LOWERING,
        f"{_KEPT_FOR_DERIVATIVE} (float32 precision at extreme inputs)",
        log_ndtr,
    ),
    OpPolicy(
        "aten.linalg_vector_norm.default",
        OWN_LOWERING,
        "torch's derivatives at a zero (the subgradient 0)",
        linalg_vector_norm,
    ),
    OpPolicy("aten.nextafter.default", OWN_LOWERING, "JAX has no derivative of it", nextafter),
    OpPolicy(
        "aten._linalg_solve_ex.default",
        OWN_LOWERING,
        "the op table's lowering returns 2 of its 4 outputs (linalg.solve ran as a callback)",
        linalg_solve_ex,
    ),
    OpPolicy(
        "aten.linalg_lu_factor_ex.default",
        OWN_LOWERING,
        "the op table's lowering returns info 0 for a singular matrix, torch's > 0",
        linalg_lu_factor_ex,
    ),
    OpPolicy(
        "aten.linalg_inv_ex.default",
        OWN_LOWERING,
        "the op table's lowering returns info 0 for a singular matrix, torch's > 0",
        linalg_inv_ex,
    ),
    # Not decomposed: the op table's lowering of the whole op, or a callback where it has none.
    OpPolicy(
        "aten.max_unpool2d.default",
        KEPT_WHOLE,
        f"{_KEPT_FOR_DERIVATIVE} (a scatter with repeated indices)",
    ),
    OpPolicy(
        "aten.max_unpool3d.default",
        KEPT_WHOLE,
        f"{_KEPT_FOR_DERIVATIVE} (a scatter with repeated indices)",
    ),
    OpPolicy("aten.special_entr.default", KEPT_WHOLE, f"{_KEPT_FOR_DERIVATIVE} (at x < 0: NaN)"),
    OpPolicy(
        "aten.linear.default",
        KEPT_WHOLE,
        "one dot: decomposed, a linear on a non-contiguous 3-D input (MultiheadAttention's "
        "in-projection) becomes expand + bmm, 7x slower (docs/benchmarks.md)",
    ),
    OpPolicy("aten.matmul.default", KEPT_WHOLE, "one dot, as linear"),
    OpPolicy(
        "aten.detach.default",
        KEPT_WHOLE,
        "marks what torch does not differentiate (_gradients.py): lowered to stop_gradient",
    ),
    OpPolicy(
        "aten._embedding_bag_forward_only.default",
        DECOMPOSED_AS,
        "the op torch runs when the weight requires grad: it has a derivative",
        _embedding_bag,
    ),
    *(
        OpPolicy(path, CAPTURED_AS, f"{check}: a value check torch.export cannot capture", fn)
        for path, check, fn in (
            ("torch.cov", "weights sum to zero, or are negative", cov),
            ("torch.Tensor.cov", "weights sum to zero, or are negative", cov),
            ("torch.corrcoef", "torch.cov's", corrcoef),
            ("torch.Tensor.corrcoef", "torch.cov's", corrcoef),
            (
                "torch.nn.functional.gaussian_nll_loss",
                "var has negative entries",
                gaussian_nll_loss,
            ),
        )
    ),
)

POLICIES: dict[str, OpPolicy] = {p.op: p for p in _POLICIES}


def policy(op: str) -> OpPolicy | None:
    """The policy for ATen op `op` ("aten.add.Tensor"), or None."""
    return POLICIES.get(op)


def listed_callbacks() -> frozenset[str]:
    """The ops that run as torch callbacks because their lowering disagrees with torch."""
    return frozenset(op for op, p in POLICIES.items() if p.kind == CALLBACK)


def kept_whole(op: str) -> bool:
    """Whether the decompositions leave `op` whole."""
    p = POLICIES.get(op)
    return p is not None and p.kind in (OWN_LOWERING, KEPT_WHOLE)


def decomposed_as() -> dict[Any, Callable[..., Any]]:
    """{op overload: the decomposition used in place of torch's} for DECOMPOSED_AS ops."""
    return {_overload(op): p.function for op, p in POLICIES.items() if p.kind == DECOMPOSED_AS}


def captured_as() -> dict[Callable[..., Any], Callable[..., Any]]:
    """{torch function: the form it is captured as} for CAPTURED_AS policies."""
    return {resolve(op): p.function for op, p in POLICIES.items() if p.kind == CAPTURED_AS}


def resolve(path: str) -> Any:
    """The torch function at a dotted path ("torch.nn.functional.gaussian_nll_loss")."""
    found: Any = torch
    for part in path.split(".")[1:]:
        found = getattr(found, part)
    return found


def _overload(name: str) -> Any:
    """torch.ops.aten.add.Tensor for "aten.add.Tensor"."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


# -- torch's error checks ------------------------------------------------------------------
# torch checks some values it computed and raises (a singular matrix for linalg.inv and
# solve, a failed assert); torch.export threads an effect token through each such check,
# wrapped in with_effects. JAX raises nothing inside a compiled program, so lowered, a check
# is dropped: the values are the ones the op computes without it (inv of a singular matrix:
# inf or NaN, as jnp.linalg.inv's), and the `_ex` ops' info outputs keep torch's values, for
# code that wants to test them. Any other op behind a token (one with side effects) refuses.
ERROR_CHECKS = frozenset(
    {
        "aten._linalg_check_errors.default",
        "aten._assert_async.default",
        "aten._assert_async.msg",
        "aten._assert_scalar.default",
        "aten._functional_assert_async.msg",
        "aten._functional_assert_scalar.default",
    }
)
_WITH_EFFECTS = getattr(torch.ops.higher_order, "with_effects", None)


def wraps_effect(node: torch.fx.Node) -> bool:
    """Whether `node` is torch.export's with_effects around an op (args: token, op, ...)."""
    return _WITH_EFFECTS is not None and node.target is _WITH_EFFECTS


def _op_name(target: Any) -> str:
    return str(target) if is_op_overload(target) else getattr(target, "__name__", repr(target))


# -- refusals of a whole graph ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GraphContext:
    x64: bool  # JAX's x64 mode when the program is made


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A graph lowering="xla" cannot run: `applies(node, context)` flags its nodes, and the
    LoweringError says `message` (formatted with name, op, ops, where, dtype, layout)."""

    name: str
    applies: Callable[[torch.fx.Node, GraphContext], bool]
    message: str


_WIDE_FLOAT = """\
lowering="xla": {name} computes in {dtype} ({ops}{where}) while JAX's x64 mode is off. JAX
holds no {dtype} value then: lowered, this arithmetic would run in float32, without the
precision the code asks for (a NaN or inf where torch's result is finite, at worst). Enable
x64 before the first call, jax.config.update("jax_enable_x64", True), or use
lowering="callback" (the default), which runs the function in torch at its own precision and
returns float32 arrays."""

_VALUE_SHAPED = """\
lowering="xla": {name} makes a tensor whose shape depends on its inputs' values ({op}{where}:
boolean-mask indexing `x[mask]`, nonzero, masked_select, unique, repeat_interleave by a
tensor). A lowered program fixes every shape when JAX traces it, so neither JAX ops nor a
per-op callback can carry that tensor. Rewrite it with fixed shapes (`x[x > 0].sum()` is
`torch.where(x > 0, x, 0).sum()`), or use lowering="callback" (the default), which runs the
whole function in torch: eagerly as it is, and under jit with its outputs declared
(to_jax(fn, result_shape_dtypes=...)) where their shapes do not follow from a fake run."""

_HIGHER_ORDER = """\
lowering="xla": {name} uses {op}, a torch higher-order op (control flow or a wrapped
subgraph), which has no lowering yet. Use lowering="callback" (the default) for it."""

_EFFECT = """\
lowering="xla": {name} calls {op}, an op with side effects (torch.export threads an effect
token through it{where}). A lowered program computes values only. Use lowering="callback"
(the default), which runs the function as torch code."""

_NOT_STRIDED = """\
lowering="xla": {name} makes a {layout} tensor ({op}). JAX arrays are dense, so neither a
lowering nor a per-op callback can carry it between ops. Use lowering="callback" (the
default), which runs the whole function in torch."""

# Ops whose output's shape is the count of some input's values: torch.export may have fixed
# it from the example (a constant mask, a mask of one element), but JAX cannot trace them.
_VALUE_SHAPED_OPS = frozenset(
    "nonzero masked_select _unique2 unique_dim unique_consecutive bincount argwhere".split()
)


def _value_shaped(node: torch.fx.Node, context: GraphContext) -> bool:
    """Whether `node` makes a tensor whose shape counts values: one of _VALUE_SHAPED_OPS, a
    repeat_interleave by a tensor, or indexing by a boolean mask."""
    if has_value_dependent_size(node.meta.get("val")):
        return True
    if node.op != "call_function" or not is_op_overload(node.target):
        return False
    op, overload = node.target.__name__.split(".")[0], node.target.__name__.split(".")[-1]
    if op in _VALUE_SHAPED_OPS or (op == "repeat_interleave" and overload == "Tensor"):
        return True
    if op != "index":
        return False
    indices = node.args[1] if len(node.args) > 1 else ()
    metas = [i.meta.get("val") for i in indices if isinstance(i, torch.fx.Node)]
    return any(isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in metas)


def _not_strided(node: torch.fx.Node, context: GraphContext) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.layout != torch.strided


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "64-bit float arithmetic with x64 off",
        lambda node, context: not context.x64 and computes_wide_float(node),
        _WIDE_FLOAT,
    ),
    Refusal("a value-dependent shape", _value_shaped, _VALUE_SHAPED),
    Refusal(
        "an op with side effects",
        lambda node, context: wraps_effect(node) and _op_name(node.args[1]) not in ERROR_CHECKS,
        _EFFECT,
    ),
    Refusal(
        "a higher-order op or a submodule",
        lambda node, context: (
            (is_higher_order_op(node.target) and not wraps_effect(node)) or node.op == "get_attr"
        ),
        _HIGHER_ORDER,
    ),
    Refusal("a sparse or other non-strided tensor", _not_strided, _NOT_STRIDED),
)


# -- route rules --------------------------------------------------------------------------

DROPPED = "dropped"  # a torch error check (above): nothing runs
STOP_GRADIENT = "stop_gradient"  # jax.lax.stop_gradient of its input
OWN = "own"  # the policy's JAX function
OP_TABLE = "op table"  # the op table's lowering (which may fall back, FALLBACKS)
TORCH_CALLBACK = "callback"  # the torch kernel, through the callback primitive


@dataclasses.dataclass(frozen=True)
class Site:
    """What a route rule sees of one op node: its op's name, its policy, the op table's
    entry (torchax's Operator: func, is_jax_function, needs_env), whether the call has a
    JAX key for random ops, and whether the op runs behind an effect token."""

    op: str
    target: Any
    policy: OpPolicy | None
    entry: Any
    has_key: bool
    effect: bool = False


@dataclasses.dataclass(frozen=True)
class Rule:
    """`route` for the first node site `applies` to; `why`: a callback's reason, printed by
    lowering_report."""

    name: str
    route: str
    applies: Callable[[Site], bool]
    why: str = ""


LISTED = "listed in _xla/_routes.py: its lowering disagrees with torch (make conformance)"
NO_LOWERING = "the op table has no lowering for it"
TORCH_CODE = "the op table's entry for it runs torch code, not JAX ops"
RANDOM = (
    "a random op: without a JAX key it draws from torch's generator, as lowering='callback' "
    "does (module_to_jax's apply(..., rng=key) lowers it to jax.random)"
)


def _marks_stop_gradient(site: Site) -> bool:
    return site.op in ("aten.detach.default", "torchjax.stop_gradient.default")


RULES: tuple[Rule, ...] = (
    Rule("torch's error check", DROPPED, lambda s: s.effect and s.op in ERROR_CHECKS),
    Rule("stop-gradient marker", STOP_GRADIENT, _marks_stop_gradient),
    Rule(
        "listed as disagreeing",
        TORCH_CALLBACK,
        lambda s: s.policy is not None and s.policy.kind == CALLBACK,
        LISTED,
    ),
    Rule("own lowering", OWN, lambda s: s.policy is not None and s.policy.kind == OWN_LOWERING),
    Rule("no op-table entry", TORCH_CALLBACK, lambda s: s.entry is None, NO_LOWERING),
    Rule(
        "op-table entry runs torch",
        TORCH_CALLBACK,
        lambda s: not s.entry.is_jax_function,
        TORCH_CODE,
    ),
    Rule(
        "random op without a key",
        TORCH_CALLBACK,
        lambda s: s.entry.needs_env and not s.has_key,
        RANDOM,
    ),
    Rule("op table", OP_TABLE, lambda s: True),
)

# Why the op table's lowering falls back to a callback, learned only while tracing.
FALLBACKS: dict[str, str] = {
    "raised": "its lowering raised {error}",
    "outputs": "its lowering returns {got} outputs, torch's op {want}",
    "shape": "its lowering's output has shape {got}, torch's {want}",
}


def route(site: Site) -> Rule:
    """The first rule of RULES that applies to `site`."""
    return next(rule for rule in RULES if rule.applies(site))


def site(node: torch.fx.Node, table: Any, has_key: bool) -> Site:
    """The Site of op node `node` (an op behind an effect token: that op's), with the op
    table's entry from `table` (an OpTable)."""
    if wraps_effect(node):
        name = _op_name(node.args[1])
        return Site(name, node.args[1], POLICIES.get(name), None, has_key, effect=True)
    name = _op_name(node.target)
    return Site(name, node.target, POLICIES.get(name), table.lowering(node.target), has_key)
