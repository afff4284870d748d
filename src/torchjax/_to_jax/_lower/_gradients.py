# Where torch's autograd does not differentiate what a captured graph computes, and JAX,
# differentiating the lowered ops, would: a .detach(), a torch.no_grad() block, an output
# that torch's derivative formula leaves out (batch norm's saved statistics), and the
# forward of a torch.autograd.Function, whose own backward torch.export drops (the graph
# holds only the forward's ops). The first three become aten.detach nodes before the graph
# is decomposed, and Program lowers aten.detach to jax.lax.stop_gradient; an
# autograd.Function is found while capturing, and derivatives of its program refused.
from __future__ import annotations

import inspect
import operator
import sys
import threading
import types
from typing import Any

import torch

from torchjax._compat._torch import is_custom_op_autograd, is_op_overload, torch_pytree

_DETACH = torch.ops.aten.detach.default
# (the higher-order op torch.export makes of a torch.no_grad() block; absent in old torch)
_SET_GRAD_ENABLED = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
# Function.apply's code, in AutogradFunctions.codes: the class it applies is its `cls`.
_APPLY: Any = object()


class AutogradFunctions:
    """Records the torch.autograd.Function classes whose forward runs on this thread while
    active (torch.export keeps no trace of them: the graph holds the forward's ops), but
    torch.library's wrappers of custom ops; torch's own too (reentrant checkpointing's
    forward runs under no_grad, its backward recomputes). It watches Function.apply, whose
    `cls` is the class applied (a class defined inside the function, a new one on every
    call, is found there), and, for a subclass defined when it starts that overrides apply,
    its forward's code.

    Python 3.12+ watches only those code objects, through sys.monitoring (another tool's
    events are untouched); 3.11 sets a profile function for the capture's duration, handing
    each event on to a Python profile function already set, and re-enabling cProfile's.
    """

    def __init__(self) -> None:
        self.found: list[type] = []
        self.thread = threading.get_ident()
        self.codes = _forward_codes()
        self.tool: int | None = None
        self.previous: Any = None

    def __enter__(self) -> AutogradFunctions:
        if not self.codes:
            return self
        monitoring = getattr(sys, "monitoring", None)
        free = [i for i in range(6) if monitoring and monitoring.get_tool(i) is None]
        if free:
            self.tool = free[-1]
            monitoring.use_tool_id(self.tool, "torchjax")
            monitoring.register_callback(self.tool, monitoring.events.PY_START, self._start)
            for code in self.codes:
                monitoring.set_local_events(self.tool, code, monitoring.events.PY_START)
        else:
            self.previous = sys.getprofile()
            sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.codes:
            return
        if self.tool is not None:
            monitoring = sys.monitoring
            for code in self.codes:
                monitoring.set_local_events(self.tool, code, 0)
            monitoring.register_callback(self.tool, monitoring.events.PY_START, None)
            monitoring.free_tool_id(self.tool)
        elif self.previous is None or callable(self.previous):
            sys.setprofile(self.previous)
        else:  # cProfile's profiler (not callable): its enable() installs it again
            sys.setprofile(None)
            self.previous.enable()

    def _start(self, code: types.CodeType, offset: int) -> None:
        if threading.get_ident() == self.thread:
            self._record(code, sys._getframe(1))  # (the frame whose code starts)

    def _event(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call":
            self._record(frame.f_code, frame)
        if callable(self.previous):
            self.previous(frame, event, arg)

    def _record(self, code: types.CodeType, frame: types.FrameType) -> None:
        cls = self.codes.get(code)
        if cls is _APPLY:  # Function.apply(cls, ...): the class applied
            cls = frame.f_locals.get("cls")
            if not isinstance(cls, type) or is_custom_op_autograd(cls):
                return
        if cls is not None and cls not in self.found:
            self.found.append(cls)


def _forward_codes() -> dict[types.CodeType, Any]:
    """The code of Function.apply (to _APPLY), and the forward's code (unwrapped: torch.amp's
    custom_fwd wraps it) of each torch.autograd.Function subclass that overrides apply, to
    the subclass (the others are found through apply, each once)."""
    codes: dict[types.CodeType, Any] = {}
    function_apply = inspect.getattr_static(torch.autograd.Function, "apply", None)
    apply = getattr(function_apply, "__func__", function_apply)  # a classmethod's function
    if isinstance(getattr(apply, "__code__", None), types.CodeType):
        codes[apply.__code__] = _APPLY
    stack = list(torch.autograd.Function.__subclasses__())
    seen: set[type] = set()
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        stack.extend(cls.__subclasses__())
        if is_custom_op_autograd(cls):  # the op is one node (a callback, with its backward)
            continue
        if codes and inspect.getattr_static(cls, "apply", None) is function_apply:
            continue  # (codes holds apply's)
        forward = cls.__dict__.get("forward")
        forward = getattr(forward, "__func__", forward)  # a staticmethod's function
        try:
            code = inspect.unwrap(forward).__code__ if callable(forward) else None
        except (AttributeError, ValueError):
            code = None
        if isinstance(code, types.CodeType):
            codes[code] = cls
    return codes


def mark_stop_gradients(graph_module: torch.fx.GraphModule) -> None:
    """Put an aten.detach after every value of the captured (not yet decomposed) graph that
    torch does not differentiate: the outputs of a torch.no_grad() block, and the floating
    outputs a torch op's derivative leaves out. Decomposition keeps aten.detach whole."""
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _SET_GRAD_ENABLED and _SET_GRAD_ENABLED is not None:
            enabled, submodule = node.args[0], node.args[1]
            if enabled:
                mark_stop_gradients(getattr(graph_module, submodule.target))
                continue
            stopped = None  # every output of a no_grad block
        elif is_op_overload(node.target) and node.target is not _DETACH:
            mask = differentiable_outputs(node)
            if mask is None or all(mask):
                continue
            stopped = [i for i, d in enumerate(mask) if not d]
        else:
            continue
        _detach_outputs(graph, node, stopped)
    graph_module.recompile()


def _detach_outputs(graph: torch.fx.Graph, node: torch.fx.Node, stopped: list | None) -> None:
    """Route the uses of `node`'s outputs numbered in `stopped` (all where None) through
    a new aten.detach node each."""
    if isinstance(node.meta.get("val"), torch.Tensor):
        _detach_uses(graph, node)
        return
    for user in list(node.users):
        if user.target is operator.getitem and (stopped is None or user.args[1] in stopped):
            _detach_uses(graph, user)


def _detach_uses(graph: torch.fx.Graph, value: torch.fx.Node) -> None:
    meta = value.meta.get("val")
    if not isinstance(meta, torch.Tensor) or not (meta.is_floating_point() or meta.is_complex()):
        return
    with graph.inserting_after(value):
        detached = graph.call_function(_DETACH, (value,))
    detached.meta.update(value.meta)
    value.replace_all_uses_with(detached, delete_user_cb=lambda user: user is not detached)


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
