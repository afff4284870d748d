# A module's parameters and buffers that are views of one another (a buffer registered as
# a slice of another, `register_buffer("part", self.full[:3])`).
#
# apply gives every parameter and buffer an array of its own (variables holds one per
# name), so inside a call two such tensors no longer share memory: a write into one would
# not show through the other, as it does in torch, and the call would compute with stale
# values. Reading them is exact (each holds the module's values), so only a write is
# refused: at the call (or trace) that makes it, naming both tensors and the fix.
from __future__ import annotations

import itertools
from typing import Any

import torch

from torchjax._compat._torch import storage_id, tensor_version
from torchjax._errors import VariablesError


def overlapping(named: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """The pairs of names of distinct tensors in `named` whose memory overlaps."""
    by_storage: dict[Any, list] = {}
    for name, t in named.items():
        if t.numel() and t.layout is torch.strided and t.device.type != "meta":
            by_storage.setdefault((t.device, storage_id(t)), []).append((name, t))
    return [
        (a, b)
        for group in by_storage.values()
        for (a, ta), (b, tb) in itertools.combinations(group, 2)
        if ta is not tb and _overlap(ta, tb)
    ]


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    start = t.storage_offset() * size
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * size


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < b1 and b0 < a1


class AliasWatch:
    """Refuses a call that writes in place into a tensor another one of the module views.

    Args:
      pairs: names from `overlapping`.
      slot_of: a name's slot (its first place in the module, ModuleState.slot_names).
      n_params: slots before this index hold parameters, the rest buffers.
      module_name: the module's class name, for the message.
    """

    def __init__(self, pairs: list, slot_of: dict[str, int], n_params: int, module_name: str):
        self.partner: dict[int, tuple[str, str]] = {}  # slot -> (its name, a view's name)
        for a, b in pairs:
            self.partner.setdefault(slot_of[a], (a, b))
            self.partner.setdefault(slot_of[b], (b, a))
        self.slots = sorted(self.partner)
        self.kind = {
            name: "parameter" if slot_of[name] < n_params else "buffer" for p in pairs for name in p
        }
        self.module_name = module_name

    def before(self, values: list) -> list:
        """What the check compares with: each watched slot's tensor and its version."""
        return [(values[j], tensor_version(values[j])) for j in self.slots]

    def check(self, slot_tensors: list, before: list) -> None:
        """Raise VariablesError if a watched tensor, still in its slot, was written."""
        for j, (t, version) in zip(self.slots, before, strict=True):
            if slot_tensors[j] is t and tensor_version(t) != version:
                a, b = self.partner[j]
                raise VariablesError(
                    f"{self.module_name}'s forward wrote in place into {self.kind[a]} {a!r}, "
                    f"which in the module shares memory with {self.kind[b]} {b!r} (one is a "
                    f"view of the other). apply gives every parameter and buffer an array of "
                    f"its own, so {b!r} would not see the write, as it does in torch. "
                    f"Register only one of them and make the other from it in forward (a "
                    f"property returning a slice of it, say), or register {b!r} as a copy "
                    f"(.clone()) if it is not meant to follow {a!r}."
                )
