# The torch.autograd.Function watcher of a capture: torch.export keeps no trace of an
# autograd.Function (the graph holds its forward's ops, and drops its backward), nor of a
# torch.autograd.grad or .backward() call inside the function; this finds both while
# torch.export runs, so that the program's derivatives are refused by name.
from __future__ import annotations

import inspect
import sys
import threading
import types
from typing import Any

import torch

from torchjax._compat._torch import is_custom_op_autograd

# Function.apply's code, in AutogradFunctions.codes: the class it applies is its `cls`.
_APPLY: Any = object()
# torch.autograd.grad's and torch.autograd.backward's (Tensor.backward's) code: a derivative
# taken inside the function, which torch.export does not capture as ops JAX could run.
_AUTOGRAD: Any = object()


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
        self.derivatives: list[str] = []  # where torch.autograd.grad/backward was called
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

    def __exit__(self, *_exc: Any) -> None:
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
        if cls is _AUTOGRAD:
            where = f"torch.autograd.{code.co_name}{_caller(frame)}"
            if where not in self.derivatives:
                self.derivatives.append(where)
            return
        if cls is _APPLY:  # Function.apply(cls, ...): the class applied
            cls = frame.f_locals.get("cls")
            if not isinstance(cls, type) or is_custom_op_autograd(cls):
                return
        if cls is not None and cls not in self.found:
            self.found.append(cls)


def _caller(frame: types.FrameType) -> str:
    """ ", called at file:line" of the nearest frame outside torch that led to `frame`."""
    caller = frame.f_back
    while caller is not None and any(
        part in caller.f_code.co_filename for part in ("/torch/", "/torchjax/")
    ):
        caller = caller.f_back
    if caller is None:
        return ""
    return f", called at {caller.f_code.co_filename}:{caller.f_lineno}"


def _forward_codes() -> dict[types.CodeType, Any]:
    """The code of Function.apply (to _APPLY), and the forward's code (unwrapped: torch.amp's
    custom_fwd wraps it) of each torch.autograd.Function subclass that overrides apply, to
    the subclass (the others are found through apply, each once)."""
    codes: dict[types.CodeType, Any] = {}
    function_apply = inspect.getattr_static(torch.autograd.Function, "apply", None)
    apply = getattr(function_apply, "__func__", function_apply)  # a classmethod's function
    if isinstance(getattr(apply, "__code__", None), types.CodeType):
        codes[apply.__code__] = _APPLY
    for derivative in (torch.autograd.grad, torch.autograd.backward):
        code = getattr(inspect.unwrap(derivative), "__code__", None)
        if isinstance(code, types.CodeType):
            codes[code] = _AUTOGRAD
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
