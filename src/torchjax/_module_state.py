# A module's parameters and buffers swapped for the arrays of a call, and swapped back.
#
# torch.func.functional_call does this too, but spends as long on bookkeeping (name
# resolution, tie detection, setattr checks) as a small model spends computing. Here the
# bookkeeping happens once: every name, including each alias of a tied tensor, is resolved
# to the `_parameters`/`_buffers` dict that holds it, so a call only assigns dict entries.
# The module's own tensors are put back afterwards, whatever happened.
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torchjax._compat import module_buffers, module_parameters
from torchjax._errors import VariablesError

GROUPS = ("params", "buffers")


def _slots(module: torch.nn.Module, named: Any, slot_dict: Any) -> list[tuple[dict, str, str]]:
    """(owning dict, key, canonical name) for every place a tensor of `named` sits.

    `named` is named_parameters or named_buffers; a tied tensor's aliases (several places,
    one tensor) all map to the name under which it appears once in `variables`.
    """
    canonical = {id(t): name for name, t in named()}
    slots = []
    for name, t in named(remove_duplicate=False):
        owner, _, key = name.rpartition(".")
        slots.append((slot_dict(module.get_submodule(owner)), key, canonical[id(t)]))
    return slots


class ModuleState:
    """The named tensors of `module` and where they live; swaps them in and out.

    Args:
      module: the module whose forward runs (for a compiled module, its ``_orig_mod``).
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.params = dict(module.named_parameters())
        self.buffers = dict(module.named_buffers())
        self.param_slots = _slots(module, module.named_parameters, module_parameters)
        self.buffer_slots = _slots(module, module.named_buffers, module_buffers)
        self.slots = self.param_slots + self.buffer_slots
        # One slot per buffer name, to read the buffers back after a call.
        first: dict[str, tuple[dict, str]] = {}
        for d, key, name in self.buffer_slots:
            first.setdefault(name, (d, key))
        self.buffer_reads = [(name, d, key) for name, (d, key) in first.items()]
        self.shapes = {
            "params": {k: tuple(v.shape) for k, v in self.params.items()},
            "buffers": {k: tuple(v.shape) for k, v in self.buffers.items()},
        }
        self.submodules = list(module.modules())

    def training(self) -> tuple[bool, ...]:
        """The mode of every submodule (train()/eval() may be set per submodule)."""
        return tuple([m.training for m in self.submodules])

    def slot_values(self, params: Mapping, buffers: Mapping) -> list:
        """The tensor for every slot (in `slots` order) from the variables' two groups."""
        return [params[name] for _, _, name in self.param_slots] + [
            buffers[name] for _, _, name in self.buffer_slots
        ]

    def call(self, module: Any, args: tuple, kwargs: dict, values: list, read_buffers: bool) -> Any:
        """``module(*args, **kwargs)`` with `values` (one per slot, see slot_values) in place
        of the state's tensors.

        `module` is the state's module or a compiled form of it. Returns its result, and
        with `read_buffers` also the buffers as the call left them (updated in place, or
        reassigned by forward).
        """
        slots = self.slots
        old = [d[key] for d, key, _ in slots]
        try:
            for (d, key, _), t in zip(slots, values, strict=True):
                d[key] = t
            out = module(*args, **kwargs)
            if read_buffers:
                out = (out, {name: d[key] for name, d, key in self.buffer_reads})
            return out
        finally:
            for (d, key, _), t in zip(slots, old, strict=True):
                d[key] = t

    def check(self, module_name: str, params: Any, buffers: Any) -> None:
        """Raise VariablesError unless `params`/`buffers` have exactly the module's names
        and shapes. Their leaves need only ``.shape`` (tensors, fakes, ShapeDtypeStructs)."""
        for group, given in zip(GROUPS, (params, buffers), strict=True):
            _check_group(module_name, group, given, self.shapes[group])


def _check_group(module_name: str, group: str, given: Any, expected: dict[str, tuple]) -> None:
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
        if got != shape:
            raise VariablesError(
                f"variables[{group!r}][{k!r}] has shape {list(got)}, but {module_name} "
                f"expects {list(shape)}."
            )
