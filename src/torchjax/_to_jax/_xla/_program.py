# One signature's lowered program: the exported graph walked node by node on JAX values.
# A node the op table lowers becomes JAX ops; any other runs its real torch kernel through
# the callback primitive (to_jax of the ATen op itself), so jit, grad, vmap and jvp work
# through it as through any wrapped torch function. Each node's route, and why, is
# recorded for lowering_report.
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch.export.graph_signature import InputKind, OutputKind

from torchjax._compat._torch import (
    has_value_dependent_size,
    is_higher_order_op,
    is_op_overload,
    op_schema,
    torch_pytree,
)
from torchjax._convert import canonical_jax_dtype, tensor_to_jax
from torchjax._errors import LoweringError
from torchjax._log import logger
from torchjax._to_jax._xla._callback_ops import CALLBACK_OPS
from torchjax._to_jax._xla._export import Captured
from torchjax._to_jax._xla._gradients import (
    differentiable_outputs,
    stop_gradient_op,
    user_line,
)
from torchjax._to_jax._xla._op_table import OpTable
from torchjax._to_jax._xla._own_ops import OWN_LOWERINGS

_HIGHER_ORDER = """\
lowering="xla": {name} uses {op}, a torch higher-order op (control flow or a wrapped
subgraph), which has no lowering yet. Use lowering="callback" (the default) for it."""

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

_SYMBOLIC = """\
lowering="xla": {op} in {name} runs as a torch callback ({why}), and a torch callback
needs concrete sizes: it cannot take the symbolic shapes {shapes} (jax.export.symbolic_shape).
Export at concrete shapes, or make the op lower: torchjax.lowering_report(fn, *example_args)
at concrete shapes lists each op that runs as a callback and why."""


class SymbolicCallback(LoweringError):
    """A graph node that would run as a torch callback at symbolic shapes (jax.export's):
    the routes up to it are known, and lowering_report reports them."""


_NOT_STRIDED = """\
lowering="xla": {name} makes a {layout} tensor ({op}). JAX arrays are dense, so neither a
lowering nor a per-op callback can carry it between ops. Use lowering="callback" (the
default), which runs the whole function in torch."""

NO_LOWERING = "the op table has no lowering for it"
TORCH_CODE = "the op table's entry for it runs torch code, not JAX ops"
RANDOM = (
    "a random op: without a JAX key it draws from torch's generator, as lowering='callback' "
    "does (module_to_jax's apply(..., rng=key) lowers it to jax.random)"
)
LISTED = "listed in _xla/_callback_ops.py: its lowering disagrees with torch (make conformance)"


@dataclasses.dataclass
class Route:
    """How one graph node runs: as JAX ops (`lowered`), or as a torch callback and `why`."""

    node: str
    op: str
    lowered: bool
    why: str = ""


class _Keys:
    """The key source torchax's random lowerings draw from (their `env`): one key per draw,
    folded from the call's key, so the same key gives the same draws."""

    def __init__(self, key: Any):
        self.key, self.count = key, 0

    def get_and_rotate_prng_key(self, generator: Any = None) -> Any:
        del generator  # a torch.Generator's seed is not an input: the call's key decides
        self.count += 1
        return jax.random.fold_in(self.key, self.count)


def op_name(target: Any) -> str:
    """`aten.add.Tensor` for torch.ops.aten.add.Tensor; a custom op by its namespace."""
    if is_op_overload(target):
        return str(target)
    return getattr(target, "__name__", repr(target))


class Program:
    """The lowered graph of one signature.

    ``run(constants, arrays, key)`` takes the graph's lifted constants (JAX arrays, passed
    as arguments rather than baked into the XLA program), the signature's arrays and a PRNG
    key or None, and returns (user outputs, mutated inputs: {input index: new value}).
    """

    def __init__(
        self,
        name: str,
        program: torch.export.ExportedProgram,
        captured: Captured,
        table: OpTable,
        callback: Callable[[Any], Callable],
    ):
        self.name, self.graph, self.captured = name, program.graph, captured
        self.table, self.callback = table, callback
        signature = program.graph_signature
        state = {**program.state_dict, **program.constants}
        self.inputs: list[tuple[str, Any]] = []  # per placeholder: ("user", i) | ("constant", j)
        constants: list[torch.Tensor] = []
        n_user = 0
        for spec in signature.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                self.inputs.append(("user", n_user))
                n_user += 1
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                self.inputs.append(("constant", len(constants)))
                constants.append(state[spec.target])
            else:
                raise LoweringError(
                    f'lowering="xla": {name} takes a {spec.kind.name.lower()} input '
                    f"({spec.arg.name}), which has no JAX form. Use lowering='callback'."
                )
        # Private copies: the program is a function of its inputs, whatever the closure's
        # tensors hold later (the callback path reads them at each call instead).
        self.constants = [tensor_to_jax(t.detach().clone(), "a constant") for t in constants]
        user_names = [s.arg.name for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
        self.mutated: list[int | None] = []  # per mutation output: the user input it writes
        self.n_mutations = 0
        for spec in signature.output_specs:
            if spec.kind == OutputKind.USER_INPUT_MUTATION:
                self.mutated.append(user_names.index(spec.target))
            elif spec.kind == OutputKind.BUFFER_MUTATION:
                self.mutated.append(None)  # a buffer of a module the function closes over
            else:
                continue
            self.n_mutations += 1
        self.routes: dict[str, Route] = {}
        # With x64 off JAX holds int64 values as int32: arithmetic the graph does in int64
        # wraps past 2**31 where torch's would not (the callback path raises a
        # ConversionError for an output out of int32's range instead). Named in the report.
        self.narrowed = sorted(
            {op_name(n.target) for n in self.graph.nodes if _narrows(n)}
            if not jax.config.jax_enable_x64
            else set()
        )
        if not jax.config.jax_enable_x64:
            _refuse_wide_floats(name, self.graph)
        for node in self.graph.nodes:
            if has_value_dependent_size(node.meta.get("val")) or _value_shaped(node):
                where = user_line(node)
                raise LoweringError(
                    _VALUE_SHAPED.format(name=name, op=op_name(node.target), where=where)
                )
            if is_higher_order_op(node.target):
                raise LoweringError(_HIGHER_ORDER.format(name=name, op=op_name(node.target)))
            if node.op == "get_attr":
                op = f"a submodule ({node.target})"
                raise LoweringError(_HIGHER_ORDER.format(name=name, op=op))
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.layout != torch.strided:
                raise LoweringError(
                    _NOT_STRIDED.format(name=name, op=op_name(node.target), layout=val.layout)
                )

    @property
    def mutated_inputs(self) -> list[int]:
        return [i for i in self.mutated if i is not None]

    def run(self, constants: list, arrays: list, key: Any) -> tuple[list, dict]:
        keys = _Keys(key) if key is not None else None
        env: dict[Any, Any] = {}
        placeholders = iter(self.inputs)
        outs: list = []
        for node in self.graph.nodes:
            if node.op == "placeholder":
                kind, i = next(placeholders)
                env[node] = arrays[i] if kind == "user" else constants[i]
            elif node.op == "call_function":
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = self._call(node, args, kwargs, keys)
            elif node.op == "output":
                outs = list(torch.fx.node.map_arg(node.args[0], env.__getitem__))
        metas = [
            n.meta.get("val") if isinstance(n, torch.fx.Node) else None
            for n in self.graph.output_node().args[0]
        ]
        outs = [_as_declared(v, m) for v, m in zip(outs, metas, strict=True)]
        mutations = {i: outs[k] for k, i in enumerate(self.mutated) if i is not None}
        return outs[self.n_mutations :], mutations

    def _call(self, node: torch.fx.Node, args: tuple, kwargs: dict, keys: _Keys | None) -> Any:
        target = node.target
        if not is_op_overload(target):
            return target(*args, **kwargs)  # operator.getitem, arithmetic on sizes
        name = op_name(target)
        if target is torch.ops.aten.detach.default or target is stop_gradient_op():
            self.routes[node.name] = Route(node.name, name, True)
            return jax.lax.stop_gradient(args[0])
        own = OWN_LOWERINGS.get(name)
        if own is not None and name not in CALLBACK_OPS:
            self.routes[node.name] = Route(node.name, name, True)
            return own(*args, **kwargs)
        op = self.table.lowering(target)
        if name in CALLBACK_OPS:
            why = LISTED
        elif op is None:
            why = NO_LOWERING
        elif not op.is_jax_function:
            why = TORCH_CODE
        elif op.needs_env and keys is None:
            why = RANDOM
        else:
            extra = {"env": keys} if op.needs_env else {}
            try:
                out = op.func(*args, **kwargs, **extra)
            except Exception as error:  # a lowering that cannot take these arguments
                why = f"its lowering raised {type(error).__name__}: {str(error)[:160]}"
            else:
                why = _unlike_torch(node, out)
                if not why:
                    self.routes[node.name] = Route(node.name, name, True)
                    return _as_torch_differentiates(node, out)
        if node.name not in self.routes:
            logger.debug("%s: %s runs as a torch callback: %s", self.name, name, why)
        self.routes[node.name] = Route(node.name, name, False, why)
        # (torch.fx's immutable containers are leaves to JAX: plain ones are its pytrees)
        args, kwargs = _plain((args, kwargs))
        shapes = [
            tuple(a.shape)
            for a in jax.tree_util.tree_leaves((args, kwargs))
            if hasattr(a, "shape") and not all(isinstance(d, int) for d in a.shape)
        ]
        if shapes:
            shown = ", ".join(str(s).replace("'", "") for s in shapes[:3])
            raise SymbolicCallback(_SYMBOLIC.format(name=self.name, op=name, why=why, shapes=shown))
        return self.callback(target)(*args, **kwargs)


def _plain(value: Any) -> Any:
    """`value` with torch.fx's immutable_list and immutable_dict made lists and dicts."""
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# Ops whose output's shape is the count of some input's values: torch.export may have fixed
# it from the example (a constant mask, a mask of one element), but JAX cannot trace them.
_VALUE_SHAPED_OPS = frozenset(
    "nonzero masked_select _unique2 unique_dim unique_consecutive bincount argwhere".split()
)


def _value_shaped(node: torch.fx.Node) -> bool:
    """Whether `node` makes a tensor whose shape counts values: one of _VALUE_SHAPED_OPS, a
    repeat_interleave by a tensor, or indexing by a boolean mask."""
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


_WIDE_FLOATS = (torch.float64, torch.complex128)
# Ops that move a 64-bit float without computing with it: a conversion, a copy.
_NOT_ARITHMETIC = frozenset(
    {"_to_copy", "clone", "copy", "convert_element_type", "_assert_tensor_metadata", "detach"}
)


def _refuse_wide_floats(name: str, graph: torch.fx.Graph) -> None:
    """With x64 off, a LoweringError where the graph computes with float64 or complex128
    values (JAX would hold them in 32 bits); a conversion, a copy or a view of one is no
    computation, so `x.double()` returned, or cast back, lowers."""
    found: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or not is_op_overload(node.target):
            continue
        inputs = [
            a.meta.get("val")
            for a in torch_pytree.tree_leaves((node.args, node.kwargs))
            if isinstance(a, torch.fx.Node)
        ]
        wide = [t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.dtype in _WIDE_FLOATS]
        if not wide or node.target.__name__.split(".")[0] in _NOT_ARITHMETIC:
            continue
        if any(r.alias_info is not None for r in op_schema(node.target).returns):
            continue  # a view
        found.setdefault(str(wide[0]).removeprefix("torch."), []).append(node)
    for dtype, nodes in found.items():
        ops = ", ".join(dict.fromkeys(op_name(n.target) for n in nodes[:6]))
        where = next((user_line(n) for n in nodes if user_line(n)), "")
        raise LoweringError(_WIDE_FLOAT.format(name=name, dtype=dtype, ops=ops, where=where))


# Ops whose int64 result can leave the range of their inputs (so int32 arithmetic can wrap
# where int64 would not); moving, selecting and comparing values cannot.
_ARITHMETIC = frozenset(
    "add sub rsub mul div floor_divide remainder fmod pow neg abs square sum prod cumsum "
    "cumprod mm bmm addmm dot mv matmul linear bitwise_left_shift __lshift__ mean".split()
)


def _narrows(node: torch.fx.Node) -> bool:
    """Whether `node` is int64 arithmetic (JAX computes it in int32 with x64 off)."""
    meta = node.meta.get("val") if node.op == "call_function" else None
    if not isinstance(meta, torch.Tensor) or meta.dtype != torch.int64:
        return False
    return is_op_overload(node.target) and str(node.target).split(".")[1] in _ARITHMETIC


def _unlike_torch(node: torch.fx.Node, out: Any) -> str:
    """Why a lowering's result cannot stand for the node's (its outputs' count or static
    shapes differ from those torch recorded), or "" where it can."""
    meta = node.meta.get("val")
    if isinstance(meta, tuple | list):
        if not isinstance(out, tuple | list) or len(out) != len(meta):
            n = len(out) if isinstance(out, tuple | list) else 1
            return f"its lowering returns {n} outputs, torch's op {len(meta)}"
        pairs = list(zip(out, meta, strict=True))
    else:
        pairs = [(out, meta)]
    for value, val in pairs:
        if not isinstance(val, torch.Tensor) or not hasattr(value, "shape"):
            continue
        shape = tuple(val.shape)
        if all(isinstance(d, int) for d in shape) and tuple(value.shape) != shape:
            return f"its lowering's output has shape {tuple(value.shape)}, torch's {shape}"
    return ""


def _as_torch_differentiates(node: torch.fx.Node, out: Any) -> Any:
    """A lowered multi-output op's results, with a stop_gradient on each output torch's
    autograd does not differentiate (native_layer_norm's mean and rstd, batch norm's saved
    statistics): JAX would differentiate the JAX ops that compute them, torch gives zero."""
    if not isinstance(out, tuple | list):
        return out
    mask = differentiable_outputs(node)
    if mask is None or all(mask) or len(mask) != len(out):
        return out
    kept = [o if d else jax.lax.stop_gradient(o) for o, d in zip(out, mask, strict=True)]
    return type(out)(kept)


def _as_declared(value: Any, meta: Any) -> Any:
    """An output with the dtype the torch graph gives it, under JAX's x64 policy: a
    lowering may compute in another (int32 for int64 with x64 off, float32 for a Python
    float), and the callback path returns the graph's."""
    if isinstance(meta, torch.Tensor):
        dtype = canonical_jax_dtype(meta.dtype)
        value = jnp.asarray(value)
        return value if value.dtype == dtype else value.astype(dtype)
    if isinstance(value, int | float | bool):
        return jnp.asarray(value)
    return value
