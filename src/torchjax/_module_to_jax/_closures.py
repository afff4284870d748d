# Closures in a module's copy that still point at the module it was copied from.
#
# copy.deepcopy copies a module's attributes, hook dicts and tensors, but a Python function
# is atomic to it: the copy's `self.head = lambda h: h @ self.l.weight.T`, or a forward
# hook `lambda m, i, o: o @ w` closing over a Parameter, is the very function of the
# original, and its closure cells still hold the original module and tensors. A call that
# runs such a function would compute with the user's module (its weights, not the call's
# variables: a silent wrong value and a missing gradient). So after the deepcopy every
# function the copy holds gets a twin whose cells hold the copies of what deepcopy copied
# (the memo says which), and the twin takes the function's place in the copy. Cells that
# hold anything else are shared with the original, so a closure's own state (a `nonlocal`
# counter) stays one. Functions reached through globals are out of reach: docs/module.md.
from __future__ import annotations

import types
from typing import Any

import torch

_DEPTH = 4  # containers within containers within an attribute (hook dicts: 1)


def rebind_closures(copied: torch.nn.Module, memo: dict[int, Any]) -> None:
    """Give every function that `copied` (a deepcopy made with `memo`) and its submodules
    hold, in attributes, hook dicts and lists, dicts or tuples in them, closure cells that
    hold the copies of the originals deepcopy replaced."""
    twins: dict[int, Any] = {}
    # What deepcopy made (memo's values): only those containers may change in place; one
    # an object's own __deepcopy__ shared with the original stays as it is.
    made = {id(v) for v in memo.values()}
    for sub in copied.modules():
        attributes = vars(sub)
        for key, value in list(attributes.items()):
            new = _rebound(value, memo, twins, made, _DEPTH)
            if new is not value:
                attributes[key] = new


def _rebound(value: Any, memo: dict, twins: dict, made: set, depth: int) -> Any:
    """`value` with its functions' closures rebound; the same object where none changes.
    Containers the deepcopy made are changed in place (they belong to the copy alone)."""
    if isinstance(value, types.FunctionType):
        return _twin(value, memo, twins)
    if depth == 0 or isinstance(value, (torch.Tensor, torch.nn.Module, str, bytes)):
        return value  # a module's own attributes are walked through copied.modules()
    if isinstance(value, dict | list) and id(value) not in made:
        return value
    if isinstance(value, dict):
        for key, item in list(value.items()):
            new = _rebound(item, memo, twins, made, depth - 1)
            if new is not item:
                value[key] = new
    elif isinstance(value, list):
        for i, item in enumerate(value):
            new = _rebound(item, memo, twins, made, depth - 1)
            if new is not item:
                value[i] = new
    elif type(value) is tuple:
        items = [_rebound(item, memo, twins, made, depth - 1) for item in value]
        if any(new is not old for new, old in zip(items, value, strict=True)):
            return tuple(items)
    return value


def _twin(fn: types.FunctionType, memo: dict, twins: dict) -> Any:
    """`fn` itself if none of its cells holds what deepcopy copied, else a twin of it."""
    if id(fn) in twins:
        return twins[id(fn)]
    twins[id(fn)] = fn  # a function reaching itself through a cell (recursion) stops here
    cells = fn.__closure__ or ()
    new_cells = []
    for cell in cells:
        try:
            content = cell.cell_contents
        except ValueError:  # a cell not yet filled
            new_cells.append(cell)
            continue
        if isinstance(content, types.FunctionType):
            new = _twin(content, memo, twins)
        else:
            new = memo.get(id(content), content)
        new_cells.append(cell if new is content else types.CellType(new))
    # Default values are bound once too (`lambda h, w=self.l.weight: ...`).
    defaults = tuple(memo.get(id(d), d) for d in fn.__defaults__ or ())
    kwdefaults = {k: memo.get(id(d), d) for k, d in (fn.__kwdefaults__ or {}).items()}
    if (
        all(new is old for new, old in zip(new_cells, cells, strict=True))
        and all(new is old for new, old in zip(defaults, fn.__defaults__ or (), strict=True))
        and all(kwdefaults[k] is d for k, d in (fn.__kwdefaults__ or {}).items())
    ):
        return fn
    twin = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__ and defaults, tuple(new_cells)
    )
    twin.__kwdefaults__ = fn.__kwdefaults__ and kwdefaults
    twin.__qualname__, twin.__module__, twin.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    twin.__dict__.update(fn.__dict__)
    twins[id(fn)] = twin
    return twin
