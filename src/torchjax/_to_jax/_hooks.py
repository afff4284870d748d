# How a caller that wraps its own function for to_jax (module_to_jax's forward) talks to
# the call machinery: one frozen object on the user's function (UserFunction.hooks), read
# by the rules, the plan and the fake run, instead of attributes on the function and tests
# of its argument names. A to_jax function has none (NO_HOOKS).
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class CallHooks:
    """What a wrapped function tells the call machinery about itself.

    Attributes:
      for_module: it is module_to_jax's forward: advice names ``module_to_jax(module, ...)``
        where it would name ``to_jax(fn, ...)``, and a module's options.
      describe_path: ``(key path into bind's (args, kwargs)) -> str``: how messages name an
        argument (``variables['params']['w']``); None: ``args[0]['w']``.
      parameter_paths, buffer_paths: the prefix of the described paths of the function's
        parameters and of its buffers (in-place advice, what may be differentiated).
      flat_form: ``(in_tree, template) -> callable on the flat tensors, or None``: a call
        that skips rebuilding the argument tree (CallPlan).
      check_signature: ``(*args, **kwargs) -> None``, called on the arguments of each eager
        signature's first call, which runs for real at once (no fake run checks them).
      isolates_state: fake runs of it touch a throwaway copy of its state, not the user's
        (fake_eval need not snapshot what it reaches).
      seeded: its random draws are a function of its inputs (no hidden generator state).
    """

    for_module: bool = False
    describe_path: Callable[[tuple], str] | None = None
    parameter_paths: str | None = None
    buffer_paths: str | None = None
    flat_form: Callable[[Any, list], Callable | None] | None = None
    check_signature: Callable[..., None] | None = None
    isolates_state: bool = False
    seeded: bool = False

    @property
    def api(self) -> str:
        """How advice spells the call that wraps the function, up to its options."""
        return "module_to_jax(module, " if self.for_module else "to_jax(fn, "

    def is_parameter(self, path: str) -> bool:
        return self.parameter_paths is not None and path.startswith(self.parameter_paths)

    def is_buffer(self, path: str) -> bool:
        return self.buffer_paths is not None and path.startswith(self.buffer_paths)


NO_HOOKS = CallHooks()
