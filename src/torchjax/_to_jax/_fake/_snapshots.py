# Python state, recorded and put back: a module's own, a dict's entries, a list's items.
#
# module_to_jax resets each private module copy to its template's state after every call
# (ModulesSnapshot, checked in C for the whole module tree), and a fake run puts back what
# it touched in the user's objects (_fake/_isolation.py): a module's whole state, elsewhere
# only the entries that came to hold a fake tensor. A TorchScript submodule (e3nn's
# compiled tensor products, a torch.jit.script'ed layer) keeps its state in TorchScript's
# own tables, whose entries can be set but never added or removed: its snapshot is of its
# Python side alone (ScriptedSnapshot), and no snapshot calls a method that a table of
# TorchScript's lacks.
from __future__ import annotations

import collections
import copy
import enum
import operator
import types
from itertools import chain
from typing import Any

import torch

from torchjax._compat._torch import (
    ScriptMethod,
    is_fake,
    module_buffers,
    module_children,
    module_parameters,
)
from torchjax._compat._torch import tensor_version as _version
from torchjax._to_jax._fake._user_objects import instance_dict, items

# Entries every nn.Module has in its __dict__ (hook tables, flags): torch's bookkeeping,
# which a forward does not change. Other dicts, lists and sets are the module's own state
# (caches filled in place) and are put back too.
TORCH_ENTRIES = frozenset(torch.nn.Module().__dict__)
_CONTAINERS = (dict, list, set, collections.OrderedDict, collections.defaultdict)
_is = operator.is_


class ModuleSnapshot:
    """A module's own Python state: its __dict__ entries, the contents of its containers
    (caches filled in place) and of its submodule table, and how many parameters and
    buffers it has (their values are slots, which callers set themselves). Not its
    submodules' state (take one of each) nor the insides of other objects it refers to.

    `changed` runs after every module_to_jax call, for every submodule: it is a handful of
    identity checks in C where nothing changed.
    """

    __slots__ = (
        "module",
        "entries",
        "tables",
        "sizes",
        "containers",
        "_param_table",
        "_buffer_table",
        "_child_table",
        "_saved_children",
    )

    def __init__(self, module: torch.nn.Module):
        d = module.__dict__
        self.module = module
        self.entries = dict(d)
        tables = (module_parameters(module), module_buffers(module), module_children(module))
        self.tables = [(t, dict(t)) for t in tables]
        self._param_table, self._buffer_table, self._child_table = tables
        self._saved_children = self.tables[2][1]
        self.sizes = (len(tables[0]), len(tables[1]))
        self.containers = [
            (v, copy.copy(v))
            for k, v in d.items()
            if k not in TORCH_ENTRIES and type(v) in _CONTAINERS
        ]

    def changed(self) -> bool:
        """Whether the module's state differs from the snapshot (cheap when it does not).

        The dicts compare in C, where an entry that is the same object is equal without
        asking it; an entry that is not asks its __eq__, and anything but a plain "equal"
        (a tensor's elementwise answer, a fake tensor's refusal) counts as a change.
        """
        try:
            if self.module.__dict__ != self.entries or self._child_table != self._saved_children:
                return True
        except Exception:
            return True
        if (len(self._param_table), len(self._buffer_table)) != self.sizes:
            return True
        return bool(self.containers) and any(_differs(v, saved) for v, saved in self.containers)

    def restore(self) -> None:
        d = self.module.__dict__
        d.clear()
        d.update(self.entries)
        for table, saved in self.tables:
            _put_back(table, saved)
        for v, saved in self.containers:
            v.clear()
            if isinstance(v, list):
                v.extend(saved)
            else:
                v.update(saved)

    def set_training(self, mode: bool) -> None:
        """Set the module's mode, as part of the state it is restored to."""
        self.module.training = mode
        self.entries["training"] = mode


def _put_back(table: Any, saved: dict) -> None:
    """Give a module's table of parameters, buffers or submodules the entries `saved`. A
    dict is refilled; any other mapping (TorchScript's, which sets existing entries and
    refuses to add or remove one) has its entries set, through the one method it has."""
    if isinstance(table, dict):
        table.clear()
        table.update(saved)
    else:
        for k, v in saved.items():
            table[k] = v


class ScriptedSnapshot:
    """A TorchScript module's snapshot: its Python __dict__. Its parameters, buffers,
    submodules and attributes live in TorchScript's own tables, whose entries are fixed
    once it is scripted (new ones are refused): a parameter's or buffer's value is a slot,
    which callers set themselves (as for ModuleSnapshot), and any other attribute is
    TorchScript's alone, which its compiled code may change and no snapshot puts back
    (docs/limitations.md). Its Python side caches each compiled method it is asked for (a
    ScriptMethod added to __dict__): kept, as a cache, not counted as a change.
    """

    __slots__ = ("module", "entries")

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.entries = dict(module.__dict__)

    def changed(self) -> bool:
        d = self.module.__dict__
        try:
            if d == self.entries:
                return False
        except Exception:
            return True
        for k, v in list(d.items()):
            if k not in self.entries and type(v) is ScriptMethod:
                self.entries[k] = v  # a method looked up for the first time: TorchScript's cache
        try:
            return d != self.entries
        except Exception:
            return True

    def restore(self) -> None:
        d = self.module.__dict__
        d.clear()
        d.update(self.entries)

    def set_training(self, mode: bool) -> None:
        """Set the module's mode (TorchScript keeps it in its own table, not __dict__)."""
        self.module.training = mode


def snapshot_of(module: torch.nn.Module) -> ModuleSnapshot | ScriptedSnapshot:
    """The snapshot of one module's own state: ScriptedSnapshot for a TorchScript module."""
    if isinstance(module, torch.jit.ScriptModule):
        return ScriptedSnapshot(module)
    return ModuleSnapshot(module)


class ModulesSnapshot:
    """Snapshots of a module and all its submodules, checked all at once: after every
    module_to_jax call, where nothing changed, a few comparisons in C for the whole tree;
    and the state below them (NestedState). A TorchScript submodule's is a ScriptedSnapshot:
    its tables are TorchScript's, which compare by identity and cost a call into TorchScript
    to count, so only its __dict__ takes part in the comparisons."""

    def __init__(self, module: torch.nn.Module, slots: Any = ()):
        self.each = [snapshot_of(m) for m in module.modules()]
        plain = [s for s in self.each if type(s) is ModuleSnapshot]
        self.nested = NestedState(plain, {id(t) for t in slots})
        self._dicts = [s.module.__dict__ for s in self.each] + [s._child_table for s in plain]
        self._saved = [s.entries for s in self.each] + [s._saved_children for s in plain]
        self._tables = [t for s in plain for t in (s._param_table, s._buffer_table)]
        self._sizes = [n for s in plain for n in s.sizes]
        self._with_containers = [s for s in plain if s.containers]

    def restore_changed(self) -> None:
        """Put back the state of every module that changed (see ModuleSnapshot.changed)."""
        try:
            same = self._dicts == self._saved and list(map(len, self._tables)) == self._sizes
        except Exception:
            same = False
        if not same or any(s.changed() for s in self._with_containers):
            for s in self.each:
                if s.changed():
                    s.restore()
        if self.nested.changed():
            self.nested.restore()


# What the walk below does not enter: values without state of their own, and objects whose
# state is not the module's (classes, Python modules, functions: globals every caller sees).
_ATOMIC = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)
_NOT_STATE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    enum.Enum,
    torch.nn.Module,  # (each has a ModuleSnapshot of its own)
)
MAX_NESTED = 100_000  # entries a NestedState records at most (a dataset list would be more)


class NestedState:
    """The state below the modules' own entries, which ModuleSnapshot restores: the objects
    their entries refer to (a config, a namespace, a list in a dict, at any depth) and the
    tensors that are not parameters or buffers (`self.ema`, a cached table), which a
    forward may change in place (`self.calls += 1` on a tensor is in place).

    Taken of a private module copy, whose objects are its own (a deep copy): a change is
    the forward's, and restoring it touches nobody else's. Nothing of the user's runs
    (_fake/_user_objects.py): containers and objects' __dict__s are read through the built-in
    types and compared by the identity of what they hold, in C; tensors by version counter,
    each restored from a copy of its data taken with the snapshot.
    """

    def __init__(self, snapshots: list, skip: set):
        self.dicts: list = []  # dicts and objects' __dict__s, with copies of them
        self.lists: list = []
        self.others: list = []  # sets, deques
        self.tensors: list = []
        seen, budget = set(skip), [MAX_NESTED]
        for snap in snapshots:
            for k, v in snap.entries.items():
                if k not in TORCH_ENTRIES:
                    if type(v) in _CONTAINERS:  # its entries are ModuleSnapshot's; not below
                        seen.add(id(v))
                        for x in items(v):
                            self._walk(x, seen, budget)
                    else:
                        self._walk(v, seen, budget)
        self.saved_dicts = [dict.copy(d) for d in self.dicts]
        self.saved_lists = [list.copy(x) for x in self.lists]
        self.saved_others = [items(x) for x in self.others]
        self.identities = self._identities()
        self.data = [t.detach().clone() for t in self.tensors]
        self.versions = [_version(t) for t in self.tensors]
        self.empty = not (self.dicts or self.lists or self.others or self.tensors)

    def _walk(self, v: Any, seen: set, budget: list) -> None:
        stack = [v]
        while stack and budget[0] > 0:
            v = stack.pop()
            t = type(v)
            if issubclass(t, _ATOMIC) or id(v) in seen or issubclass(t, _NOT_STATE):
                continue
            seen.add(id(v))
            if issubclass(t, torch.Tensor):
                if not is_fake(v) and v.device.type != "meta" and v.layout == torch.strided:
                    self.tensors.append(v)
                    budget[0] -= 1
                continue
            contents = items(v)
            if issubclass(t, dict):
                self.dicts.append(v)
            elif issubclass(t, list):
                self.lists.append(v)
            elif issubclass(t, set | collections.deque):
                self.others.append(v)
            elif contents is None:  # an object: its attributes, where Python stores them
                d = instance_dict(v)
                if d is None:
                    continue  # no state the walk can read (a C object, __slots__ alone)
                self.dicts.append(d)
                contents = list(d.values())
            budget[0] -= len(contents) + 1
            stack.extend(contents)

    def _identities(self) -> tuple:
        """What the containers hold, as the ids of their keys and values (and their
        sizes, so that an entry moved from one to another shows)."""
        return (
            list(map(dict.__len__, self.dicts)),
            list(map(id, chain.from_iterable(map(dict.keys, self.dicts)))),
            list(map(id, chain.from_iterable(map(dict.values, self.dicts)))),
            list(map(list.__len__, self.lists)),
            list(map(id, chain.from_iterable(map(list.copy, self.lists)))),
            [sorted(map(id, items(x))) for x in self.others],
        )

    def changed(self) -> bool:
        # The saved copies keep every object they held alive: an id seen again is the same
        # object, not a new one at a freed address.
        if self.empty:
            return False
        return (
            self._identities() != self.identities
            or list(map(_version, self.tensors)) != self.versions
        )

    def restore(self) -> None:
        for d, saved in zip(self.dicts, self.saved_dicts, strict=True):
            dict.clear(d)
            dict.update(d, saved)
        for x, saved in zip(self.lists, self.saved_lists, strict=True):
            list.__setitem__(x, slice(None), saved)
        for x, saved in zip(self.others, self.saved_others, strict=True):
            if isinstance(x, set):
                set.clear(x)
                set.update(x, saved)
            else:
                collections.deque.clear(x)
                collections.deque.extend(x, saved)
        with torch.no_grad():
            for k, (t, data) in enumerate(zip(self.tensors, self.data, strict=True)):
                if _version(t) != self.versions[k]:
                    if t.shape == data.shape and t.stride() == data.stride():
                        t.copy_(data)
                    else:  # resized or restrided in place (resize_, t_)
                        t.set_(data.clone())
                    self.versions[k] = _version(t)


def _differs(v: Any, saved: Any) -> bool:
    if len(v) != len(saved):
        return True
    if isinstance(v, dict):
        return not all(map(_is, v.values(), saved.values())) or v.keys() != saved.keys()
    if isinstance(v, list):
        return not all(map(_is, v, saved))
    return v != saved


# A fake run's snapshots read and write dicts and lists through the built-in types' own
# methods: a subclass may give get, [] or iteration another meaning (transformers'
# _CanRecordRegistry.get takes a model, not a key), and what is saved and put back is the
# entries as stored.
_dict_copy, _dict_get, _dict_keys = dict.copy, dict.get, dict.keys
_dict_set, _dict_del, _dict_len = dict.__setitem__, dict.__delitem__, dict.__len__
_list_copy, _list_len, _list_set = list.copy, list.__len__, list.__setitem__


class DictSnapshot:
    """The entries of a dict (all of them, or the globals a function names). Only entries
    that came to hold a fake tensor are put back: another thread may change the same dict
    for real meanwhile (append results, fill a cache), and that must stay."""

    __slots__ = ("d", "saved", "every")

    def __init__(self, d: dict, keys: Any = None):
        self.d, self.every = d, keys is None
        self.saved = _dict_copy(d) if keys is None else {k: _dict_get(d, k, _MISSING) for k in keys}

    def changed(self) -> bool:
        d = self.d
        if self.every and _dict_len(d) != len(self.saved):
            return True
        return any(_dict_get(d, k, _MISSING) is not v for k, v in self.saved.items())

    def restore(self) -> None:
        d, saved = self.d, self.saved
        keys = list(_dict_keys(d)) if self.every else list(saved)
        for k in keys:
            now, before = _dict_get(d, k, _MISSING), saved.get(k, _MISSING)
            if now is not before and has_fake(now):
                if before is _MISSING:
                    _dict_del(d, k)
                else:
                    _dict_set(d, k, before)


class ListSnapshot:
    """A list's items; as for dicts, only items holding a fake tensor that the list did not
    hold before are taken out."""

    __slots__ = ("items", "saved")

    def __init__(self, items: list):
        self.items, self.saved = items, _list_copy(items)

    def changed(self) -> bool:
        items = self.items
        if _list_len(items) != len(self.saved):
            return True
        return not all(map(_is, _list_copy(items), self.saved))

    def restore(self) -> None:
        before = {id(x) for x in self.saved}
        kept = [x for x in _list_copy(self.items) if id(x) in before or not has_fake(x)]
        _list_set(self.items, slice(None), kept)


def has_fake(value: Any) -> bool:
    """Whether `value` is a fake tensor or a container holding one (one level down)."""
    if isinstance(value, torch.Tensor):
        return is_fake(value)
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list | tuple | set | frozenset):
        return False
    return any(isinstance(x, torch.Tensor) and is_fake(x) for x in value)


_MISSING = object()
