# Where torch's autograd does not differentiate what a captured graph computes, and JAX,
# differentiating the lowered ops, would: a .detach(), a torch.no_grad() block, an output
# that torch's derivative formula leaves out (batch norm's saved statistics), and the
# forward of a torch.autograd.Function, whose own backward torch.export drops (the graph
# holds only the forward's ops; _autograd_functions.py finds them while capturing, and
# derivatives of such a program are refused).
#
# One pass decides every stop-gradient, and nothing after it does. Graph form:
# mark_stop_gradients sees the graph torch.export captured, before functionalization and
# decomposition, as that is the only form where torch's grad mode is still there
# (decomposition inlines a no_grad block's ops), where an in-place write is still a write,
# and where each op is the one torch's autograd differentiates (an output its derivative
# leaves out, once decomposed, is computed by ops JAX would differentiate). A value torch
# does not differentiate gets a marker that survives decomposition, which Program lowers to
# jax.lax.stop_gradient (_routes.py's first rule). The marker must say what torch's
# autograd says of the *value at that point*: a later in-place write with a differentiated
# operand (`out = torch.zeros_like(x); out[1:] = 2 * x[:-1]`, the scatter idiom
# `x.new_zeros(...).index_add_(...)`) makes the written tensor differentiated again.
# aten.detach, a view, cannot say that: functionalization replays the view on the written
# result, and JAX's gradient becomes 0. So a fresh value (not an alias of another) is marked by
# torchjax::stop_gradient, a functional copy that functionalization leaves where it is;
# only an alias keeps aten.detach, which is what torch gives it (torch refuses an in-place
# write in grad mode into a view made under no_grad).
from __future__ import annotations

import operator
from typing import Any

import torch

from torchjax._compat._torch import (
    is_op_overload,
    op_schema,
    torch_pytree,
)
from torchjax._errors import LoweringError
from torchjax._to_jax._context import LOWERING_LOCK

_DETACH = torch.ops.aten.detach.default
# (the higher-order op torch.export makes of a torch.no_grad() block; absent in old torch)
_SET_GRAD_ENABLED = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
_stop_gradient: Any = None


def stop_gradient_op() -> Any:
    """torchjax::stop_gradient, defined on first use (importing torchjax defines no torch
    op): a copy of its input that is no view of it, so functionalization keeps it before
    the in-place writes that follow; Program lowers it to jax.lax.stop_gradient."""
    global _stop_gradient
    if _stop_gradient is None:
        with LOWERING_LOCK:
            if _stop_gradient is None:
                _stop_gradient = _define_stop_gradient()
    return _stop_gradient


def _define_stop_gradient() -> Any:
    @torch.library.custom_op("torchjax::stop_gradient", mutates_args=())
    def stop_gradient(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @stop_gradient.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    # (torch never differentiates it: the graph is only replayed to decompose it)
    stop_gradient.register_autograd(lambda ctx, grad: torch.zeros_like(grad))
    return torch.ops.torchjax.stop_gradient.default


_WRITE_INTO_DETACHED = """\
lowering="xla": {name} writes in place into the result of .detach(){where} and reads the
tensor it detached from after that write. The two share memory, so torch gives the write to
both, and differentiates it through the detached one only: a captured graph of values, which
is what lowering="xla" turns into JAX ops, cannot hold that. Write into a .clone() of it
instead, or use lowering="callback" (the default), which runs the function as torch code."""


def mark_stop_gradients(graph_module: torch.fx.GraphModule, name: str = "the function") -> None:
    """Mark every value of the captured (not functionalized, not decomposed) graph that
    torch does not differentiate: the outputs of a torch.no_grad() block, the floating
    outputs a torch op's derivative leaves out, and a .detach() the function writes into
    afterwards (whose aten.detach becomes the functional marker)."""
    graph = graph_module.graph
    _rebuild_users(graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _SET_GRAD_ENABLED and _SET_GRAD_ENABLED is not None:
            enabled, submodule = node.args[0], node.args[1]
            block = getattr(graph_module, submodule.target)
            if enabled:
                mark_stop_gradients(block, name)
                continue
            written = _stop_block_writes(graph, node, block)
            _mark_outputs(graph, node, None, _block_aliases(block, written))
        elif node.target is _DETACH:
            _detached_then_written(graph, node, name)
        elif is_op_overload(node.target):
            mask = differentiable_outputs(node)
            if mask is None or all(mask):
                continue
            stopped = [i for i, d in enumerate(mask) if not d]
            returns = op_schema(node.target).returns
            aliases = [r.alias_info is not None for r in returns]
            _mark_outputs(graph, node, stopped, aliases)
    graph.lint()
    graph_module.recompile()


def _rebuild_users(graph: torch.fx.Graph) -> None:
    """Make each node's `users` the nodes that read it. torch.export's passes that wrap a
    no_grad block leave some out (a slice of a buffer that the block then writes), and the
    passes here follow `users` to every read and write of a value."""
    for node in graph.nodes:
        node.users.clear()
    for node in graph.nodes:
        for read in node.all_input_nodes:
            read.users[node] = None


def _stop_block_writes(
    graph: torch.fx.Graph, node: torch.fx.Node, block: torch.fx.GraphModule
) -> set[torch.fx.Node]:
    """What a no_grad block (`node`, its graph `block`) writes in place into a tensor from
    outside changes that tensor's value and not its derivative: torch's autograd never
    sees the write (`with torch.no_grad(): out.mul_(3)` leaves out's gradient as it was).
    So each such tensor x becomes, after the block, x_before + stop_gradient(x - x_before):
    the block's value, and the derivative x had before it."""
    placeholders = [n for n in block.graph.nodes if n.op == "placeholder"]
    inputs = node.args[2:]
    written: set[torch.fx.Node] = set()
    for placeholder, x in zip(placeholders, inputs, strict=False):
        meta = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not isinstance(meta, torch.Tensor) or not meta.is_floating_point():
            continue
        if not any(_writes(u, m) for m in _aliases_of(placeholder) for u in m.users):
            continue
        written.add(placeholder)
        with graph.inserting_before(node):
            before = _call(graph, torch.ops.aten.clone.default, (x,), meta)
        with graph.inserting_after(node):
            delta = _call(graph, torch.ops.aten.sub.Tensor, (x, before), meta)
        with graph.inserting_after(delta):
            stopped = _call(graph, stop_gradient_op(), (delta,), meta)
        with graph.inserting_after(stopped):
            value = _call(graph, torch.ops.aten.add.Tensor, (before, stopped), meta)
        with graph.inserting_after(value):
            _call(graph, torch.ops.aten.copy_.default, (x, value), meta)
    return written


def _call(graph: torch.fx.Graph, target: Any, args: tuple, meta: torch.Tensor) -> torch.fx.Node:
    made = graph.call_function(target, args)
    made.meta["val"] = meta
    return made


def _block_aliases(block: torch.fx.GraphModule, written: set[torch.fx.Node]) -> list:
    """Per output of a no_grad block's graph, its marker: True (aten.detach) where it may
    alias a value from outside, False (the functional marker) where it is fresh, None (no
    marker) where it is a block input the block writes, or a view of one: torch's autograd
    sees that tensor as before the block (_stop_block_writes gave it that derivative)."""
    outputs = block.graph.output_node().args[0]
    outputs = outputs if isinstance(outputs, tuple | list) else (outputs,)
    return [None if _base(out) in written else _may_alias(out) for out in outputs]


def _base(value: Any) -> Any:
    """The node `value` is a view of (or an in-place write's result into), followed back
    through every op whose result aliases an argument; `value` where none."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function":
        if value.target is operator.getitem:
            value = value.args[0]
            continue
        if not is_op_overload(value.target):
            return value
        schema = op_schema(value.target)
        if not any(r.alias_info is not None for r in schema.returns):
            return value
        source = next(
            (a for a, arg in zip(value.args, schema.arguments, strict=False) if arg.alias_info),
            None,
        )
        if not isinstance(source, torch.fx.Node):
            return value
        value = source
    return value


def _may_alias(value: Any) -> bool:
    if not isinstance(value, torch.fx.Node):
        return False
    if value.op == "placeholder":
        return True
    if value.target is operator.getitem:
        return _may_alias(value.args[0])
    if not is_op_overload(value.target):
        return True  # (unknown: keep the view semantics)
    return any(r.alias_info is not None for r in op_schema(value.target).returns)


def _mark_outputs(
    graph: torch.fx.Graph, node: torch.fx.Node, stopped: list | None, aliases: list
) -> None:
    """Route the uses of `node`'s outputs numbered in `stopped` (all where None) through a
    marker each: torchjax::stop_gradient for a fresh value, aten.detach for an alias."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        if not aliases or aliases[0] is not None:
            _mark_uses(graph, node, aliases[0] if aliases else True)
        return
    for user in list(node.users):
        if user.target is operator.getitem and (stopped is None or user.args[1] in stopped):
            i = user.args[1]
            alias = aliases[i] if i < len(aliases) else True
            if alias is not None:
                _mark_uses(graph, user, alias)


def _mark_uses(graph: torch.fx.Graph, value: torch.fx.Node, alias: bool) -> None:
    meta = value.meta.get("val")
    if not isinstance(meta, torch.Tensor) or not (meta.is_floating_point() or meta.is_complex()):
        return
    with graph.inserting_after(value):
        marker = graph.call_function(_DETACH if alias else stop_gradient_op(), (value,))
    marker.meta.update(value.meta)
    value.replace_all_uses_with(marker, delete_user_cb=lambda user: user is not marker)


def _detached_then_written(graph: torch.fx.Graph, detach: torch.fx.Node, name: str) -> None:
    """A user's `y = h.detach()` that the function writes into afterwards (`y.add_(x)`):
    torch differentiates what the write adds through y, where a view's replay after
    functionalization would stop it. Where h's side is not touched after the detach (h is
    not written, nor read after y's first write), y becomes the functional marker; where
    it is, refused."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    detached = _aliases_of(detach)
    writes = [order[u] for m in detached for u in m.users if _writes(u, m)]
    source = detach.args[0]
    if not writes or not isinstance(source, torch.fx.Node) or source.op == "placeholder":
        return  # (an input written through y: torch.export records it, Lowered refuses it)
    first = min(writes)
    for member in _aliases_of(source) - detached:
        for user in member.users:
            if user is detach or user in detached:
                continue
            after = order.get(user, len(order))
            if after > first or (after > order[detach] and _writes(user, member)):
                raise LoweringError(_WRITE_INTO_DETACHED.format(name=name, where=user_line(detach)))
    with graph.inserting_after(detach):
        marker = graph.call_function(stop_gradient_op(), detach.args)
    marker.meta.update(detach.meta)
    detach.replace_all_uses_with(marker)
    graph.erase_node(detach)


def _aliases_of(value: torch.fx.Node) -> set[torch.fx.Node]:
    """`value` and every node of the graph that shares its memory through it: its views,
    the results of in-place writes into it, their views, ..."""
    found, stack = {value}, [value]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in found:
                continue
            if user.target is operator.getitem or _aliased_argument(user, node) is not None:
                found.add(user)
                stack.append(user)
    return found


def _aliased_argument(user: torch.fx.Node, value: torch.fx.Node) -> Any:
    """The schema argument through which op `user` aliases `value` (a view's input, an
    in-place op's self), or None."""
    if not is_op_overload(user.target):
        return None
    schema = op_schema(user.target)
    for arg, given in zip(schema.arguments, user.args, strict=False):
        if given is value and arg.alias_info is not None:
            return arg
    for arg in schema.arguments:
        if user.kwargs.get(arg.name) is value and arg.alias_info is not None:
            return arg
    return None


def _writes(user: torch.fx.Node, value: torch.fx.Node) -> bool:
    arg = _aliased_argument(user, value)
    return arg is not None and arg.alias_info.is_write


def user_line(node: torch.fx.Node) -> str:
    """ ", at <the user's line>" from torch.export's stack trace of `node`, or ""."""
    trace = node.meta.get("stack_trace") or ""
    frames = [
        line.strip()
        for line in trace.splitlines()
        if line.strip().startswith("File ")
        and not any(part in line for part in ("/torch/", "/torchjax/", "/jax/"))
    ]
    return f", at {frames[-1][5:]}" if frames else ""


def differentiable_outputs(node: torch.fx.Node) -> list[bool] | None:
    """Which outputs of `node` torch differentiates, from one run of the op on meta tensors
    shaped like its inputs, every floating one requiring grad; None where that cannot run
    (symbolic sizes, an op without a meta kernel), or where no input requires grad: then
    every output is differentiated."""
    found = node.meta.get("torchjax_differentiable", False)
    if found is not False:
        return found

    def meta(n: Any) -> Any:
        val = n.meta.get("val") if isinstance(n, torch.fx.Node) else n
        if isinstance(val, torch.Tensor):
            t = torch.empty(tuple(val.shape), dtype=val.dtype, device="meta")
            return t.requires_grad_(val.dtype.is_floating_point or val.dtype.is_complex)
        return val

    try:
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), meta)
        leaves = torch_pytree.tree_leaves((args, kwargs))
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
            found = None
        else:
            with torch.enable_grad():
                outs = node.target(*args, **kwargs)
            outs = outs if isinstance(outs, tuple | list) else (outs,)
            found = [not _stopped(o) for o in outs]
    except Exception:
        found = None
    node.meta["torchjax_differentiable"] = found
    return found


def _stopped(out: Any) -> bool:
    """Whether torch leaves a floating output of an op on grad-requiring inputs out of the
    autograd graph."""
    if not isinstance(out, torch.Tensor):
        return False
    return (out.is_floating_point() or out.is_complex()) and not out.requires_grad
