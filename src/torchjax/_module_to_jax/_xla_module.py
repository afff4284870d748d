# module_to_jax(module, lowering="xla"): forward as a function of (params, buffers, args,
# kwargs), captured with torch.func.functional_call on a private copy of the module, lowered
# per signature and mode like to_jax's. torch.export functionalizes buffer writes (batch
# norm's running statistics): they come back as new buffers with mutable=True, and are
# dropped with a StateWarning otherwise, as on the callback path.
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from torchjax._module_to_jax._variables import ModuleVariables
from torchjax._to_jax._options import Options
from torchjax._to_jax._to_jax import op_callback
from torchjax._to_jax._xla._function import Lowered


def _shell(module: torch.nn.Module) -> torch.nn.Module:
    """A private copy of `module` whose parameters and buffers are meta tensors of the same
    shapes: functional_call puts each call's in their places, so copying the weights would
    only cost memory (and a module after copy="move" holds tensors without data)."""
    memo: dict[int, Any] = {}
    for group in (module.named_parameters, module.named_buffers):
        for _, t in group(remove_duplicate=False):
            empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
            if isinstance(t, torch.nn.Parameter):
                empty = torch.nn.Parameter(empty, requires_grad=t.requires_grad)
            memo[id(t)] = empty
    return copy.deepcopy(module, memo)


class ModuleLowering:
    """One Lowered per mode of the submodules (torch.export traces the mode it finds)."""

    def __init__(self, state: ModuleVariables, options: Options, describe: Callable[[tuple], str]):
        self.state, self.options, self.describe = state, options, describe
        self.name = type(state.module).__name__
        self.module = _shell(state.module)  # the copy torch.export traces
        self.by_mode: dict[tuple, Lowered] = {}

    def _lowered(self, mode: tuple) -> Lowered:
        lowered = self.by_mode.get(mode)
        if lowered is None:
            module, submodules = self.module, list(self.module.modules())

            def forward(params: dict, buffers: dict, args: tuple, kwargs: dict) -> Any:
                # Runs only inside torch.export, under Lowered's lock: one mode at a time.
                for m, training in zip(submodules, mode, strict=True):
                    m.training = training
                return torch.func.functional_call(module, {**params, **buffers}, args, kwargs)

            forward.__name__ = forward.__qualname__ = f"{self.name}.forward"
            lowered = self.by_mode[mode] = Lowered(
                forward,
                forward.__name__,
                lambda op: op_callback(op, self.options),
                self.describe,  # apply's paths: variables['params'][...], args[i]
                may_write=lambda path: path[1].idx == 1,  # buffers: returned or dropped
            )
        return lowered

    def __call__(self, params, buffers, args, kwargs, mutable: bool, rng: Any) -> Any:
        state = self.state
        state.check(self.name, params, buffers)
        lowered = self._lowered(state.training())
        out, written = lowered(((params, buffers, args, kwargs), {}), rng)
        names = [path[2].key for path in written]
        if not mutable:
            if names:
                state.warn_dropped(names, "wrote in place into")
            return out
        new = dict(buffers)
        for path, value in written.items():
            new[path[2].key] = value
        return out, new
