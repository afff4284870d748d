# torch.autocast around the user's function.
#
# Autocast is thread-local torch state that changes what a function computes and returns
# (a linear layer's output is bfloat16 in it). A call takes the state where it is made, or,
# under jax.jit, where it is traced: to_jax's wrapper binds, in autocast, a variant of the
# user's function (UserFunction.variant) whose callable is `InAutocast`, which sets that
# state around every run of the function (fake runs, eager calls, callbacks, derivatives).
# Every torch call otherwise runs with autocast off (the lowering's callbacks and the eager
# impl leave an ambient autocast on entry), so a function traced outside autocast computes
# as traced, whatever the state where its compiled form runs.
from __future__ import annotations

from typing import Any

from torchjax._compat._torch import COMPILED_ORIGINAL_ATTRS, autocast_as

# Attributes of the user's function that torchjax reads and that must not bypass the state:
# a compiled function's original is fake-run bare.
_HIDDEN = frozenset(COMPILED_ORIGINAL_ATTRS)


class InAutocast:
    """`fn` run in autocast state `state` (autocast_state's form), called as fn is; other
    attributes read through to fn."""

    def __init__(self, fn: Any, state: tuple):
        self.fn, self.state = fn, state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with autocast_as(self.state):
            return self.fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in _HIDDEN or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __reduce__(self) -> Any:
        return (InAutocast, (self.fn, self.state))
