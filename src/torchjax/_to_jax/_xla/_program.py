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
    is_op_overload,
)
from torchjax._convert import tensor_to_jax
from torchjax._errors import LoweringError
from torchjax._log import logger
from torchjax._to_jax._xla._export import Captured
from torchjax._to_jax._xla._gradients import user_line
from torchjax._to_jax._xla._op_table import OpTable
from torchjax._to_jax._xla._routes import (
    DROPPED,
    FALLBACKS,
    OP_TABLE,
    OWN,
    REFUSALS,
    STOP_GRADIENT,
    GraphContext,
    route,
    site,
    wraps_effect,
)
from torchjax._x64 import computes_wide_float, may_wrap, output_dtype, x64_enabled

_SYMBOLIC = """\
lowering="xla": {op} in {name} runs as a torch callback ({why}), and a torch callback
needs concrete sizes: it cannot take the symbolic shapes {shapes} (jax.export.symbolic_shape).
Export at concrete shapes, or make the op lower: torchjax.lowering_report(fn, *example_args)
at concrete shapes lists each op that runs as a callback and why."""


_USER, _TOKEN = "user output", "effect token"  # Program.outputs' kinds besides mutations


class SymbolicCallback(LoweringError):
    """A graph node that would run as a torch callback at symbolic shapes (jax.export's):
    the routes up to it are known, and lowering_report reports them."""


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
        # per placeholder: ("user", i) | ("constant", j) | ("token", None)
        self.inputs: list[tuple[str, Any]] = []
        constants: list[torch.Tensor] = []
        n_user = 0
        for spec in signature.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                self.inputs.append(("user", n_user))
                n_user += 1
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                self.inputs.append(("constant", len(constants)))
                constants.append(state[spec.target])
            elif spec.kind == InputKind.TOKEN:  # torch's effect token: see _routes.py
                self.inputs.append(("token", None))
            else:
                raise LoweringError(
                    f'lowering="xla": {name} takes a {spec.kind.name.lower()} input '
                    f"({spec.arg.name}), which has no JAX form. Use lowering='callback'."
                )
        # Private copies: the program is a function of its inputs, whatever the closure's
        # tensors hold later (the callback path reads them at each call instead).
        self.constants = [tensor_to_jax(t.detach().clone(), "a constant") for t in constants]
        user_names = [s.arg.name for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
        # Per graph output: the user input it writes (a mutation), None for a buffer of a
        # module the function closes over, USER for a user output, TOKEN for an effect token.
        self.outputs: list[Any] = []
        for spec in signature.output_specs:
            if spec.kind == OutputKind.USER_INPUT_MUTATION:
                self.outputs.append(user_names.index(spec.target))
            elif spec.kind == OutputKind.BUFFER_MUTATION:
                self.outputs.append(None)
            elif spec.kind == OutputKind.TOKEN:
                self.outputs.append(_TOKEN)
            else:
                self.outputs.append(_USER)
        self.routes: dict[str, Route] = {}
        # With x64 off JAX holds int64 values as int32: arithmetic the graph does in int64
        # wraps past 2**31 where torch's would not (the callback path raises a
        # ConversionError for an output out of int32's range instead). Named in the report
        # where its values may leave int32's range.
        x64 = x64_enabled()
        self.narrowed = sorted({op_name(n.target) for n in may_wrap(self.graph)} if not x64 else [])
        _refuse(name, self.graph, GraphContext(x64=x64))

    @property
    def mutated_inputs(self) -> list[int]:
        return [i for i in self.outputs if isinstance(i, int)]

    def run(self, constants: list, arrays: list, key: Any) -> tuple[list, dict]:
        keys = _Keys(key) if key is not None else None
        env: dict[Any, Any] = {}
        placeholders = iter(self.inputs)
        outs: list = []
        for node in self.graph.nodes:
            if node.op == "placeholder":
                kind, i = next(placeholders)
                env[node] = arrays[i] if kind == "user" else constants[i] if i is not None else None
            elif node.op == "call_function":
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = self._call(node, args, kwargs, keys)
            elif node.op == "output":
                outs = list(torch.fx.node.map_arg(node.args[0], env.__getitem__))
        metas = [
            n.meta.get("val") if isinstance(n, torch.fx.Node) else None
            for n in self.graph.output_node().args[0]
        ]
        user, mutations = [], {}
        for kind, value, meta in zip(self.outputs, outs, metas, strict=True):
            if kind is _USER:
                user.append(_as_declared(value, meta))
            elif isinstance(kind, int):
                mutations[kind] = _as_declared(value, meta)
        return user, mutations

    def _call(self, node: torch.fx.Node, args: tuple, kwargs: dict, keys: _Keys | None) -> Any:
        target = node.target
        if not is_op_overload(target) and not wraps_effect(node):
            return target(*args, **kwargs)  # operator.getitem, arithmetic on sizes
        where = site(node, self.table, keys is not None)
        rule = route(where)
        why = rule.why
        if rule.route == DROPPED:  # (the token, and the check's result: None)
            return self._lowered(node, (args[0], None), where.op)
        if rule.route == STOP_GRADIENT:
            return self._lowered(node, jax.lax.stop_gradient(args[0]))
        if rule.route == OWN:
            return self._lowered(node, where.policy.function(*args, **kwargs))
        if rule.route == OP_TABLE:
            op = where.entry
            extra = {"env": keys} if op.needs_env else {}
            try:
                out = op.func(*args, **kwargs, **extra)
            except Exception as error:  # a lowering that cannot take these arguments
                message = f"{type(error).__name__}: {str(error)[:160]}"
                why = FALLBACKS["raised"].format(error=message)
            else:
                why = _unlike_torch(node, out)
                if not why:
                    return self._lowered(node, out)
        if node.name not in self.routes:
            logger.debug("%s: %s runs as a torch callback: %s", self.name, where.op, why)
        self.routes[node.name] = Route(node.name, where.op, False, why)
        # (torch.fx's immutable containers are leaves to JAX: plain ones are its pytrees)
        args, kwargs = _plain((args, kwargs))
        shapes = [
            tuple(a.shape)
            for a in jax.tree_util.tree_leaves((args, kwargs))
            if hasattr(a, "shape") and not all(isinstance(d, int) for d in a.shape)
        ]
        if shapes:
            shown = ", ".join(str(s).replace("'", "") for s in shapes[:3])
            raise SymbolicCallback(
                _SYMBOLIC.format(name=self.name, op=where.op, why=why, shapes=shown)
            )
        return self.callback(target)(*args, **kwargs)

    def _lowered(self, node: torch.fx.Node, out: Any, op: str = "") -> Any:
        self.routes[node.name] = Route(node.name, op or op_name(node.target), True)
        return out


def _plain(value: Any) -> Any:
    """`value` with torch.fx's immutable_list and immutable_dict made lists and dicts."""
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _refuse(name: str, graph: torch.fx.Graph, context: GraphContext) -> None:
    """A LoweringError for the first of _routes.REFUSALS that flags a node of `graph`."""
    for refusal in REFUSALS:
        flagged = [n for n in graph.nodes if refusal.applies(n, context)]
        if not flagged:
            continue
        first = flagged[0]
        dtype = computes_wide_float(first)
        if dtype:  # (the ops computing in that dtype)
            flagged = [n for n in flagged if computes_wide_float(n) == dtype]
        ops = ", ".join(dict.fromkeys(_describe(n) for n in flagged[:6]))
        where = next((user_line(n) for n in flagged if user_line(n)), "")
        val = first.meta.get("val")
        raise LoweringError(
            refusal.message.format(
                name=name,
                op=_describe(first),
                ops=ops,
                where=where,
                dtype=dtype,
                layout=getattr(val, "layout", ""),
            )
        )


def _describe(node: torch.fx.Node) -> str:
    if node.op == "get_attr":
        return f"a submodule ({node.target})"
    return op_name(node.target)


def _unlike_torch(node: torch.fx.Node, out: Any) -> str:
    """Why a lowering's result cannot stand for the node's (its outputs' count or static
    shapes differ from those torch recorded), or "" where it can."""
    meta = node.meta.get("val")
    if isinstance(meta, tuple | list):
        if not isinstance(out, tuple | list) or len(out) != len(meta):
            n = len(out) if isinstance(out, tuple | list) else 1
            return FALLBACKS["outputs"].format(got=n, want=len(meta))
        pairs = list(zip(out, meta, strict=True))
    else:
        pairs = [(out, meta)]
    for value, val in pairs:
        if not isinstance(val, torch.Tensor) or not hasattr(value, "shape"):
            continue
        shape = tuple(val.shape)
        if all(isinstance(d, int) for d in shape) and tuple(value.shape) != shape:
            return FALLBACKS["shape"].format(got=tuple(value.shape), want=shape)
    return ""


def _as_declared(value: Any, meta: Any) -> Any:
    """An output with the dtype the torch graph gives it, under JAX's x64 policy: a
    lowering may compute in another (int32 for int64 with x64 off, float32 for a Python
    float), and the callback path returns the graph's."""
    if isinstance(meta, torch.Tensor):
        dtype = output_dtype(meta.dtype)
        value = jnp.asarray(value)
        return value if value.dtype == dtype else value.astype(dtype)
    if isinstance(value, int | float | bool):
        return jnp.asarray(value)
    return value
