# The variables contract of module_to_jax, both lowerings: a module's parameters and
# buffers by name and shape, the modes of its submodules, the check of the variables a call
# is given, and the warnings for buffers a call drops. The callback path's copies of the
# module (_copies.py) build on it; lowering="xla" needs nothing else (_xla_module.py).
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torchjax._errors import StateWarning, VariablesError, warn

GROUPS = ("params", "buffers")


class ModuleVariables:
    """The named tensors of `module` and what a call's variables must match.

    Args:
      module: the module whose forward runs (for a compiled module, its ``_orig_mod``).
      compiled: the ``torch.compile``'d module, or None.
    """

    def __init__(self, module: torch.nn.Module, compiled: Any = None):
        self.module, self.compiled = module, compiled
        self.params = dict(module.named_parameters())
        self.buffers = dict(module.named_buffers())
        self.shapes = {
            "params": {k: tuple(v.shape) for k, v in self.params.items()},
            "buffers": {k: tuple(v.shape) for k, v in self.buffers.items()},
        }
        self.submodules = list(module.modules())
        self.warned: set[str] = set()
        # Buffer name -> the other shapes mutable=True calls returned for it (see check).
        self.grown: dict[str, set[tuple]] = {}

    def training(self) -> tuple[bool, ...]:
        """The mode of every submodule (train()/eval() may be set per submodule)."""
        return tuple([m.training for m in self.submodules])

    def warn_dropped(self, names: list[str], how: str, new: bool = False) -> None:
        """One StateWarning for the buffers `names` a call dropped (each named once per
        apply): a model with ten BatchNorm layers in train mode gets one warning, not 30."""
        names = [n for n in names if n not in self.warned]
        if not names:
            return
        self.warned.update(names)
        listed = ", ".join(repr(n) for n in names)
        module = type(self.module).__name__
        if new:
            warn(
                f"{module}'s forward {how} {_buffers(names, lacking=True)}: {listed}. "
                f"mutable=True returns the buffers the module had when module_to_jax was "
                f"called, so these are "
                f"dropped and the next call starts without them. To carry one from call to "
                f"call, register it in __init__ (before module_to_jax), with its initial "
                f"value.",
                StateWarning,
            )
            return
        first = names[0]
        warn(
            f"{module}'s forward {how} {_buffers(names)}: {listed}. With mutable=False "
            f"apply is a pure function of its variables, so the new values are dropped and "
            f"the next call sees variables['buffers'][{first!r}] and the others again. To "
            f"keep them, call apply(variables, ..., mutable=True), which returns (output, "
            f"new_buffers), and pass the new buffers to the next call; for inference, where "
            f"they should not change (BatchNorm's running statistics), call module.eval() "
            f"before apply.",
            StateWarning,
        )

    def check(self, module_name: str, params: Any, buffers: Any) -> None:
        """Raise VariablesError unless `params`/`buffers` have exactly the module's names
        and shapes. Their leaves need only ``.shape`` (tensors, fakes, ShapeDtypeStructs)."""
        for group, given in zip(GROUPS, (params, buffers), strict=True):
            grown = self.grown if group == "buffers" else {}
            _check_group(module_name, group, given, self.shapes[group], grown)


def _buffers(names: list, lacking: bool = False) -> str:
    """ "a buffer" or "3 buffers" (that variables lacks)."""
    counted = "a buffer" if len(names) == 1 else f"{len(names)} buffers"
    return counted + (" that variables lacks" if lacking else "")


def _check_group(
    module_name: str, group: str, given: Any, expected: dict[str, tuple], grown: dict
) -> None:
    if not isinstance(given, Mapping):
        raise VariablesError(
            f"variables[{group!r}] must be a mapping of names to arrays (a dict, or a "
            f"registered pytree Mapping), got {type(given).__name__}. Use the variables "
            f"returned by module_to_jax(module)."
        )
    missing = [k for k in expected if k not in given]
    extra = [k for k in given if k not in expected]
    if missing or extra:
        raise VariablesError(
            f"variables[{group!r}] does not match {module_name}: missing {missing}, "
            f"unexpected {extra}. Use the variables returned by module_to_jax(module) (and "
            f"keep their keys when updating them)."
        )
    for k, shape in expected.items():
        got = tuple(np.shape(given[k]))
        if got != shape and got not in grown.get(k, ()):
            also = ""
            if grown.get(k):
                shapes = ", ".join(str(list(g)) for g in sorted(grown[k]))
                also = f" (or a shape a mutable=True call returned for it: {shapes})"
            raise VariablesError(
                f"variables[{group!r}][{k!r}] has shape {list(got)}, but {module_name} "
                f"expects {list(shape)}{also}. Pass the arrays module_to_jax returned, or "
                f"those a mutable=True call returned for them."
            )
