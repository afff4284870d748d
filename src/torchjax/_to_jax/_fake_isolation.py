# Fake runs leave no trace: what the user's function touches while its types are found.
#
# A fake run executes the user's torch code on FakeTensors, which have shapes but no data.
# Code with state keeps what it computes: a tensor attribute built lazily in forward, a
# buffer registered on first use, a functools.lru_cache of tables, a library's prediction
# cache, a list a hook appends its input to. Kept from a fake run, such a tensor reaches
# later real calls (and plain torch) as garbage. So around every fake run (_fake_run.py):
#   * what the function can reach (itself, its closure, the globals its code names, a bound
#     method's object, a partial's arguments, and the objects, lists and dicts those hold;
#     for modules, every submodule, its attributes and the globals of its forward code) is
#     recorded and put back afterwards: a module's whole Python state (ModuleSnapshot),
#     elsewhere the entries that came to hold a fake tensor (another thread may be filling
#     the same list or dict for real);
#   * every fake tensor the run makes is tracked by a weak reference; any still alive once
#     the run is over is kept by someone: an lru_cache among its holders is cleared (it is
#     a cache), and anything else is an error that names the holder, before any real call
#     could read it.
# module_to_jax needs none of the first step: its fake runs use a copy of the module that
# is thrown away afterwards (_copies.py).
from __future__ import annotations

import collections
import copy
import gc
import operator
import types
import weakref
from typing import Any

import torch

from torchjax._compat._torch import is_fake, module_buffers, module_children, module_parameters
from torchjax._errors import ShapeInferenceError

# Entries every nn.Module has in its __dict__ (hook tables, flags): torch's bookkeeping,
# which a forward does not change. Other dicts, lists and sets are the module's own state
# (caches filled in place) and are put back too.
_TORCH_ENTRIES = frozenset(torch.nn.Module().__dict__)
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
            if k not in _TORCH_ENTRIES and type(v) in _CONTAINERS
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
            table.clear()
            table.update(saved)
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


class ModulesSnapshot:
    """ModuleSnapshots of a module and all its submodules, checked all at once: after every
    module_to_jax call, where nothing changed, a few comparisons in C for the whole tree."""

    def __init__(self, module: torch.nn.Module):
        self.each = [ModuleSnapshot(m) for m in module.modules()]
        self._dicts = [s.module.__dict__ for s in self.each] + [s._child_table for s in self.each]
        self._saved = [s.entries for s in self.each] + [s._saved_children for s in self.each]
        self._tables = [t for s in self.each for t in (s._param_table, s._buffer_table)]
        self._sizes = [n for s in self.each for n in s.sizes]
        self._with_containers = [s for s in self.each if s.containers]

    def restore_changed(self) -> None:
        """Put back the state of every module that changed (see ModuleSnapshot.changed)."""
        try:
            same = self._dicts == self._saved and list(map(len, self._tables)) == self._sizes
        except Exception:
            same = False
        if same and not any(s.changed() for s in self._with_containers):
            return
        for s in self.each:
            if s.changed():
                s.restore()


def _differs(v: Any, saved: Any) -> bool:
    if len(v) != len(saved):
        return True
    if isinstance(v, dict):
        return not all(map(_is, v.values(), saved.values())) or v.keys() != saved.keys()
    if isinstance(v, list):
        return not all(map(_is, v, saved))
    return v != saved


class _DictSnapshot:
    """The entries of a dict (all of them, or the globals a function names). Only entries
    that came to hold a fake tensor are put back: another thread may change the same dict
    for real meanwhile (append results, fill a cache), and that must stay."""

    __slots__ = ("d", "saved", "every")

    def __init__(self, d: dict, keys: Any = None):
        self.d, self.every = d, keys is None
        self.saved = dict(d) if keys is None else {k: d.get(k, _MISSING) for k in keys}

    def changed(self) -> bool:
        d = self.d
        if self.every and len(d) != len(self.saved):
            return True
        return any(d.get(k, _MISSING) is not v for k, v in self.saved.items())

    def restore(self) -> None:
        d, saved = self.d, self.saved
        keys = list(d) if self.every else list(saved)
        for k in keys:
            now, before = d.get(k, _MISSING), saved.get(k, _MISSING)
            if now is not before and has_fake(now):
                if before is _MISSING:
                    del d[k]
                else:
                    d[k] = before


class _ListSnapshot:
    """A list's items; as for dicts, only items holding a fake tensor that the list did not
    hold before are taken out."""

    __slots__ = ("items", "saved")

    def __init__(self, items: list):
        self.items, self.saved = items, list(items)

    def changed(self) -> bool:
        return len(self.items) != len(self.saved) or not all(map(_is, self.items, self.saved))

    def restore(self) -> None:
        before = {id(x) for x in self.saved}
        self.items[:] = [x for x in self.items if id(x) in before or not has_fake(x)]


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

# -- what a function can reach -------------------------------------------------------------
_MAX_DEPTH = 4  # function -> closure -> object -> attribute -> module
_MAX_OBJECTS = 5000
_MAX_ITEMS = 10000  # a container larger than this is data, not state: neither read nor kept
_LEAVES = (type, types.ModuleType, torch.Tensor, str, bytes, int, float, complex, bool)


def _is_lru_cache(obj: Any) -> bool:
    return callable(obj) and hasattr(obj, "cache_clear") and hasattr(obj, "cache_info")


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


class Reachable:
    """What a call of `fn` can reach and change: the modules (with all their submodules),
    other objects' attributes, lists and dicts, the globals its code names, lru_caches."""

    def __init__(self, fn: Any):
        self.modules: list[torch.nn.Module] = []
        self.caches: list[Any] = []
        self.snapshots: list[Any] = []
        self._seen: set[int] = set()
        todo = collections.deque([(fn, 0)])
        while todo and len(self._seen) < _MAX_OBJECTS:
            obj, depth = todo.popleft()
            if obj is None or isinstance(obj, _LEAVES) or id(obj) in self._seen:
                continue
            self._seen.add(id(obj))
            todo.extend((child, depth + 1) for child in self._visit(obj, depth))

    def _visit(self, obj: Any, depth: int) -> list:
        """Record obj; return what it refers to that a call may read, if not too deep."""
        if isinstance(obj, torch.nn.Module):
            found = []
            for m in obj.modules():
                if id(m) not in self._seen or m is obj:
                    self._seen.add(id(m))
                    self.modules.append(m)
                    self.snapshots.append(ModuleSnapshot(m))
                    # The code a module runs names globals too (a cached helper, say), and
                    # its own attributes may be objects with state of their own.
                    forward = getattr(type(m), "forward", None)
                    if isinstance(forward, types.FunctionType):
                        found.append(forward)
                    found += [
                        v
                        for k, v in m.__dict__.items()
                        if k not in _TORCH_ENTRIES and not isinstance(v, torch.nn.Module)
                    ]
            return found
        if _is_lru_cache(obj):
            self.caches.append(obj)
            return [getattr(obj, "__wrapped__", None)]
        last = depth >= _MAX_DEPTH
        if isinstance(obj, types.FunctionType):
            g, names = obj.__globals__, _code_names(obj.__code__)
            names = [n for n in names if n in g]
            self.snapshots.append(_DictSnapshot(g, names))
            if last:
                return []
            found = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            found += [g[n] for n in names]
            return found + list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        if isinstance(obj, types.MethodType):
            return [obj.__self__, obj.__func__]
        if isinstance(obj, list):
            if len(obj) > _MAX_ITEMS:
                return []
            self.snapshots.append(_ListSnapshot(obj))
            return [] if last else list(obj)
        if isinstance(obj, dict):
            if len(obj) > _MAX_ITEMS:
                return []
            self.snapshots.append(_DictSnapshot(obj))
            return [] if last else list(obj.values())
        if isinstance(obj, tuple | set | frozenset):
            return [] if last or len(obj) > _MAX_ITEMS else list(obj)
        if hasattr(obj, "func") and hasattr(obj, "args") and hasattr(obj, "keywords"):  # partial
            return [obj.func, *obj.args, *obj.keywords.values()]
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            return []
        self.snapshots.append(_DictSnapshot(attrs))
        found = [] if last else list(attrs.values())
        call = getattr(type(obj), "__call__", None)  # noqa: B004 - the method, not callable()
        if isinstance(call, types.FunctionType):
            found.append(call)
        return found


# -- what survives a fake run --------------------------------------------------------------
LEFT_BEHIND = """\
The fake run that found the output types of {name} (under jax.jit or another transform; it
runs the function on tensors without data) left a fake tensor in {holder}, which outlives
the call. A later real call, in JAX or in plain torch, would read it as garbage. torchjax
puts back the state of modules it can reach from the function and clears lru_caches; this
holder it could not reach. That object now holds a tensor without data: rebuild it (or
clear that cache). So that no fake run happens at all, declare the output types:

    to_jax(fn, result_shape_dtypes=jax.ShapeDtypeStruct(shape, dtype))

or call the function eagerly (eager calls have data and run for real)."""


class FakeRunState:
    """Around one fake run of `fn`: puts back reachable modules' state afterwards, and
    checks that no fake tensor made during the run (`track` them) is still alive."""

    def __init__(self, fn: Any, name: str, isolated: bool = False):
        self.name = name
        found = Reachable(None if isolated else fn)
        self.snapshots, self.caches = found.snapshots, found.caches
        self.sizes = [_cache_size(c) for c in self.caches]
        self.made: list[weakref.ref] = []

    def track(self, t: torch.Tensor) -> None:
        if is_fake(t):  # real tensors made meanwhile (a copy made for real) are not traces
            self.made.append(weakref.ref(t))

    def restore(self) -> None:
        for s in self.snapshots:
            if s.changed():
                s.restore()

    def check_left_behind(self) -> None:
        """Take back fake tensors that outlive the run where that is safe; raise for any
        other. Call after the run's own references to its tensors are gone."""
        if self._first_alive() is None:
            return
        gc.collect()  # what only a reference cycle kept goes now
        if self._first_alive() is None:
            return
        for cache, size in zip(self.caches, self.sizes, strict=True):
            if _cache_size(cache) != size:
                cache.cache_clear()
        for ref in self.made:
            _take_back(ref)
        t = self._first_alive()
        if t is not None:
            holder = _describe(t)
            del t
            raise ShapeInferenceError(LEFT_BEHIND.format(name=self.name, holder=holder))

    def _first_alive(self) -> torch.Tensor | None:
        for r in self.made:
            t = r()
            if t is not None:
                return t
        return None


def _take_back(ref: weakref.ref) -> None:
    """Drop the holds on a fake tensor that can go without harm: an lru_cache's (cleared:
    it is a cache), and a plain dict's entry (a cache keyed by the run's objects, such as
    torch.nn.utils.parametrize.cached's), which the run itself made or overwrote with
    data-less garbage. An object's attribute or a list item stays: an error names it."""
    t = ref()
    if t is None:
        return
    for holder in _holders(t):
        if _is_lru_cache(holder):
            holder.cache_clear()
    for r in gc.get_referrers(t):
        if type(r) in (dict, collections.OrderedDict) and not _is_namespace(r):
            for k in _keys_of(r, t):
                del r[k]


def _keys_of(d: dict, value: Any) -> list:
    # Not a comprehension inside the callers: one would keep `value` in a closure cell,
    # which gc.get_referrers would then report as a holder.
    return [k for k, v in d.items() if v is value]


def _is_namespace(d: dict) -> bool:
    """Whether `d` is an object's attributes or a module's globals (not a plain dict)."""
    return any(getattr(o, "__dict__", None) is d for o in gc.get_referrers(d))


def _cache_size(cache: Any) -> int | None:
    try:
        return cache.cache_info().currsize
    except Exception:
        return None


def _holders(t: Any, depth: int = 3) -> list:
    """The objects that keep `t` alive, up to `depth` references away (containers between)."""
    found, frontier, seen = [], [t], {id(t)}
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            for r in gc.get_referrers(obj):
                if id(r) in seen or isinstance(r, types.FrameType) or r is frontier:
                    continue
                seen.add(id(r))
                found.append(r)
                if isinstance(r, dict | list | tuple | set):
                    nxt.append(r)
        frontier = nxt
    return found


def _describe(t: Any) -> str:
    """Words for what holds `t`: an object's attribute, a global, a container, an object."""
    for r in gc.get_referrers(t):
        if isinstance(r, types.FrameType):
            continue
        if isinstance(r, dict):
            key = (_keys_of(r, t) or ["?"])[0]
            for owner in gc.get_referrers(r):
                if isinstance(owner, types.ModuleType) and owner.__dict__ is r:
                    return f"the global {key!r} of module {owner.__name__}"
                if getattr(owner, "__dict__", None) is r:
                    return f"the attribute {key!r} of a {type(owner).__qualname__} object"
            return f"a dict, under the key {key!r}"
        if isinstance(r, list | tuple | set):
            return f"a {type(r).__name__}"
        return f"a {type(r).__qualname__} object"
    return "an object torchjax cannot name"
