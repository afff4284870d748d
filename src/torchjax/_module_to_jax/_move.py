# module_to_jax(module, copy="move"): the module's tensors become `variables` without a copy,
# and the module is left holding placeholders without data.
#
# copy=True keeps two full sets of weights alive (the module's and the JAX copy), which for
# a large model is the difference between fitting in memory and not; copy=False shares the
# memory but lets any later torch write (an optimizer step, load_state_dict) change
# "immutable" JAX arrays. Moving shares the memory and closes that door: once the module no
# longer holds the tensors, torch has nothing to write through. A tensor something else
# still holds (an optimizer built on module.parameters(), a view, a reference kept in a
# list) could still be written through that holder, so it is copied instead, with a
# CopyWarning naming it: a move never leaves an alias behind.
#
# What the module holds afterwards must fail loudly when torch computes with it: each slot
# holds a DatalessTensor (_placeholders.py) that names the variable it went to and how to
# get the weights back.
from __future__ import annotations

from typing import Any

import torch

from torchjax._compat._torch import module_buffers, module_parameters
from torchjax._convert import tensors_to_jax
from torchjax._errors import CopyWarning, warn
from torchjax._module_to_jax._placeholders import MOVED, computed_tensor_attributes, placeholder
from torchjax._to_jax._call._guard import owns_memory_alone

_HELD = """\
module_to_jax({module}, copy="move"): {names} {verb} also reachable outside the module (a
Python reference such as an optimizer's parameter list, another tensor on the same memory
such as a view, or memory torch did not allocate, as from torch.from_numpy), so {pronoun}
{verb} copied into variables instead of moved: torch could still write through that
reference and change the JAX arrays. To move every tensor, call module_to_jax
before making an optimizer or keeping references to the parameters (build the optimizer on
the JAX side, e.g. optax, or on torchjax.tree_to_torch(variables) afterwards)."""


def move_out(module: torch.nn.Module, groups: dict[str, dict[str, torch.Tensor]]) -> dict:
    """`groups` ({"params": {name: tensor}, "buffers": ...}, the module's named tensors,
    each once) as JAX arrays sharing their memory; every slot of `module` and its submodules
    then holds a placeholder of the same type, shape and dtype (tied slots one), and so does
    each entry of `groups`. Raises before touching the module if a tensor cannot become a
    JAX array, so a failed move loses nothing."""
    kind = type(module).__name__
    for group, tensors in groups.items():  # a dry run: mostly zero-copy, dropped at once
        tensors_to_jax({name: t.detach() for name, t in tensors.items()}, f"variables[{group!r}]")
    placeholders: dict[int, torch.Tensor] = {}
    for group, tensors in groups.items():
        for name, t in tensors.items():
            where = f"variables[{group!r}][{name!r}]"
            placeholders[id(t)] = placeholder(t, MOVED.format(name=where, module=kind))
    for _, m in module.named_modules():
        for slots in (module_parameters(m), module_buffers(m)):
            for key, t in slots.items():
                if t is not None:
                    slots[key] = placeholders[id(t)]
    # A tensor computed from parameters held as an attribute (prune's and the old
    # weight_norm's `weight`): its graph holds the parameters, an alias a move must not
    # leave; the module's hook computes it again once the weights are back.
    for m, key, where, value in computed_tensor_attributes(module):
        name = f"the tensor {where} computed from parameters"
        vars(m)[key] = placeholder(value, MOVED.format(name=name, module=kind))
    value = None  # the loop's last reference: the graph goes now
    variables: dict[str, dict[str, Any]] = {}
    copied: list[str] = []
    for group, tensors in groups.items():
        moved, left = {}, {}
        for name in list(tensors):
            t = tensors.pop(name)  # the group's reference goes: `t` is ours alone now
            left[name] = placeholders[id(t)]
            if not owns_memory_alone(t, refs=1):  # 1: `t`
                copied.append(f"{group}[{name!r}]")
                t = t.detach().clone(memory_format=torch.contiguous_format)
            moved[name] = t.detach()
            del t
        variables[group] = tensors_to_jax(moved, f"variables[{group!r}]")
        moved.clear()  # the JAX arrays keep the memory alive through DLPack
        tensors.update(left)
    if copied:
        plural = len(copied) > 1
        warn(
            _HELD.format(
                module=kind,
                names=", ".join(copied),
                verb="are" if plural else "is",
                pronoun="they" if plural else "it",
            ),
            CopyWarning,
        )
    return variables
