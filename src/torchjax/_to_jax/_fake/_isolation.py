# Fake runs leave no trace: what the user's function touches while its types are found.
#
# A fake run executes the user's torch code on FakeTensors, which have shapes but no data.
# Code with state keeps what it computes: a tensor attribute built lazily in forward, a
# buffer registered on first use, a functools.lru_cache of tables, a library's prediction
# cache, a list a hook appends its input to. Kept from a fake run, such a tensor reaches
# later real calls (and plain torch) as garbage. So around every fake run (_fake/_run.py):
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
import gc
import types
import weakref
from typing import Any

import torch
from torch.nn.modules.lazy import LazyModuleMixin

from torchjax._compat._torch import fake_mode_active, is_fake
from torchjax._errors import ShapeInferenceError
from torchjax._to_jax._fake._snapshots import (
    TORCH_ENTRIES,
    DictSnapshot,
    ListSnapshot,
    ModuleSnapshot,
)
from torchjax._to_jax._fake._user_objects import (
    class_attribute,
    instance_dict,
    is_instance,
    is_lru_cache,
    items,
    partial_parts,
)
from torchjax._to_jax._fake._user_objects import (
    size as container_size,
)

# -- what a function can reach -------------------------------------------------------------
_MAX_DEPTH = 4  # function -> closure -> object -> attribute -> module
_MAX_OBJECTS = 5000
_MAX_ITEMS = 10000  # a container larger than this is data, not state: neither read nor kept
_LEAVES = (type, types.ModuleType, torch.Tensor, str, bytes, int, float, complex, bool)


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
            if obj is None or is_instance(obj, _LEAVES) or id(obj) in self._seen:
                continue
            self._seen.add(id(obj))
            todo.extend((child, depth + 1) for child in self._visit(obj, depth))

    def _visit(self, obj: Any, depth: int) -> list:
        """Record obj; return what it refers to that a call may read, if not too deep.
        Nothing of the user's runs here (_fake/_user_objects.py)."""
        if is_instance(obj, torch.nn.Module):
            found = []
            for m in obj.modules():
                if isinstance(m, torch.jit.ScriptModule):
                    # TorchScript keeps its state in tables of its own, which its compiled
                    # code alone changes (buffers, in place): no Python state to put back.
                    continue
                if id(m) not in self._seen or m is obj:
                    self._seen.add(id(m))
                    self.modules.append(m)
                    self.snapshots.append(ModuleSnapshot(m))
                    # The code a module runs names globals too (a cached helper, say), and
                    # its own attributes may be objects with state of their own.
                    forward = class_attribute(type(m), "forward")
                    if isinstance(forward, types.FunctionType):
                        found.append(forward)
                    found += [
                        v
                        for k, v in m.__dict__.items()
                        if k not in TORCH_ENTRIES and not is_instance(v, torch.nn.Module)
                    ]
            return found
        if is_lru_cache(obj):
            self.caches.append(obj)
            return [(instance_dict(obj) or {}).get("__wrapped__")]
        last = depth >= _MAX_DEPTH
        if is_instance(obj, types.FunctionType):
            g, names = obj.__globals__, _code_names(obj.__code__)
            names = [n for n in names if n in g]
            self.snapshots.append(DictSnapshot(g, names))
            if last:
                return []
            found = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            found += [g[n] for n in names]
            return found + list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        if is_instance(obj, types.MethodType):
            return [obj.__self__, obj.__func__]
        if is_instance(obj, list):
            if container_size(obj) > _MAX_ITEMS:
                return []
            self.snapshots.append(ListSnapshot(obj))
            return [] if last else items(obj)
        if is_instance(obj, dict):
            if container_size(obj) > _MAX_ITEMS:
                return []
            self.snapshots.append(DictSnapshot(obj))
            return [] if last else items(obj)
        if is_instance(obj, tuple | set | frozenset):
            return [] if last or container_size(obj) > _MAX_ITEMS else items(obj)
        parts = partial_parts(obj)
        if parts is not None:
            return parts
        attrs = instance_dict(obj)
        if attrs is None:
            return []
        self.snapshots.append(DictSnapshot(attrs))
        found = [] if last else list(attrs.values())
        call = class_attribute(type(obj), "__call__")
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


LAZY = """\
{name} calls a {module} whose parameters are not initialized yet (a lazy module: its
first call makes them, shaped after its input). Finding the output types of {name} (under
jax.jit or another transform) runs it on tensors without data first, which would make
that module's parameters without data too, for good. Initialize it before: call {name}
once eagerly (outside jax.jit and other transforms), or call the module once in torch on
an example input. Or declare the output types, so that no such run happens and the
first real call initializes the module:

    to_jax(fn, result_shape_dtypes=jax.ShapeDtypeStruct(shape, dtype))"""


def _refuse_in_fake_runs(name: str) -> Any:
    """A forward pre-hook, ahead of a lazy module's own: refuses to initialize it in a fake
    run (a call of the module from another thread, for real, passes)."""

    def hook(module: torch.nn.Module, args: tuple) -> None:
        if fake_mode_active() and module.has_uninitialized_params():
            raise ShapeInferenceError(LAZY.format(name=name, module=type(module).__name__))

    return hook


class FakeRunState:
    """Around one fake run of `fn`: puts back reachable modules' state afterwards, and
    checks that no fake tensor made during the run (`track` them) is still alive.

    A lazy module `fn` reaches, not initialized yet, raises ShapeInferenceError (LAZY) if
    the run calls it: initializing changes the module's class and its parameters in place,
    which no snapshot puts back."""

    def __init__(self, fn: Any, name: str, isolated: bool = False):
        self.name = name
        found = Reachable(None if isolated else fn)
        self.lazy_guards = [
            m.register_forward_pre_hook(_refuse_in_fake_runs(name), prepend=True)
            for m in found.modules
            if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()
        ]
        self.snapshots, self.caches = found.snapshots, found.caches
        self.sizes = [_cache_size(c) for c in self.caches]
        self.made: list[weakref.ref] = []
        # ids of the objects that hold the run's fake tensors by right (lowering="xla"'s
        # captured program: its nodes' types): a tensor only they hold is no leftover,
        # and they are neither taken back from nor named
        self.held: set[int] = set()

    def track(self, t: torch.Tensor) -> None:
        if is_fake(t):  # real tensors made meanwhile (a copy made for real) are not traces
            self.made.append(weakref.ref(t))

    def restore(self) -> None:
        for handle in self.lazy_guards:
            handle.remove()
        for s in self.snapshots:
            if s.changed():
                s.restore()

    def clear_grown_caches(self) -> None:
        """Clear each reachable lru_cache the run added entries to: what it cached may be a
        fake tensor (torch.export's, which `track` never sees), and a cache may go empty."""
        for cache, size in zip(self.caches, self.sizes, strict=True):
            if _cache_size(cache) != size:
                cache.cache_clear()

    def check_left_behind(
        self,
        after: BaseException | None = None,
        message: str = LEFT_BEHIND,
        error: type[Exception] = ShapeInferenceError,
    ) -> None:
        """Take back fake tensors that outlive the run where that is safe; raise `error`
        with `message` (formatted with the name and the holder) for any other. Call after
        the run's own references to its tensors are gone; `after`: the exception a failed
        run raised (the error then names it, and is raised from it)."""
        if self._first_alive() is None:
            return
        gc.collect()  # what only a reference cycle kept goes now
        if self._first_alive() is None:
            return
        if after is not None and not _reach_state([r() for r in self.made if r() is not None]):
            return  # only the failure holds them (see _reach_state): they go with it
        self.clear_grown_caches()
        _take_back(self.made, self.held)
        t = self._first_alive() if after is None else self._first_held()
        if t is not None:
            holder = _describe(t, self.held)
            del t
            text = message.format(name=self.name, holder=holder)
            if after is None:
                raise error(text)
            failed = f"{type(after).__name__}: {after}".split("\n")[0]
            raise error(f"{text}\n(The fake run had failed: {failed})") from after

    def _first_held(self) -> torch.Tensor | None:
        """_first_alive for a failed run: the first tensor that state holds, not only the
        failure (its traceback's frames, the exception and what it carries)."""
        alive = [t for t in (r() for r in self.made) if t is not None]
        if not alive or not _reach_state(alive):
            return None
        return next((t for t in alive if _reach_state([t])), None)

    def _first_alive(self) -> torch.Tensor | None:
        alive = [t for t in (r() for r in self.made) if t is not None]
        if not alive or not self.held:
            return alive[0] if alive else None
        # One scan of the heap for all of them (most are held by self.held's objects only),
        # then, of each holder outside those, which of them it holds: a scan per tensor
        # cost seconds a capture, as a capture leaves hundreds in its program's records.
        ids = {id(t) for t in alive}
        elsewhere: set[int] = set()
        for r in _holders_outside(alive, self.held):
            elsewhere.update(i for i in map(id, gc.get_referents(r)) if i in ids)
        return next((t for t in alive if id(t) in elsewhere), None)


# What a failed run's exception keeps alive until it is dropped: no state of the user's.
_FAILURE_PARTS = (types.FrameType, types.TracebackType, BaseException)


def _reach_state(tensors: list, levels: int = 8, budget: int = 20_000) -> bool:
    """Whether a path of references from any of `tensors` leads to a module or a class
    (where state lives: globals, class attributes, and what they hold) other than through
    a failure's frames, tracebacks and exceptions, which die with it. One scan of the heap
    per level for all of them together; a search past `budget` objects counts as not
    reaching (the run's own failure is then what the user sees)."""
    frontier, seen = list(tensors), {id(t) for t in tensors}
    mine = {id(frontier), id(tensors)}
    for _ in range(levels):
        nxt: list = []
        mine.add(id(nxt))
        for r in gc.get_referrers(*frontier):
            if id(r) in seen or id(r) in mine or isinstance(r, _FAILURE_PARTS):
                continue
            if isinstance(r, types.ModuleType | type):
                return True
            seen.add(id(r))
            nxt.append(r)
        if not nxt or len(seen) > budget:
            return False
        mine.discard(id(frontier))
        frontier = nxt
        mine.add(id(frontier))
    return False


def _holders_outside(tensors: list, held: set[int]) -> list:
    """What holds one of `tensors` outside `held` (the frames of running code, and that
    list itself, aside)."""
    return [
        r
        for r in gc.get_referrers(*tensors)
        if id(r) not in held and r is not tensors and not isinstance(r, types.FrameType)
    ]


def _take_back(refs: list[weakref.ref], held: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Drop the holds on fake tensors that can go without harm: an lru_cache's (cleared:
    it is a cache), and a plain dict's entry (a cache keyed by the run's objects, such as
    torch.nn.utils.parametrize.cached's), which the run itself made or overwrote with
    data-less garbage. An object's attribute or a list item stays: an error names it.
    All of them at once: a few scans of the heap in all, not a few per tensor."""
    tensors = [t for t in (r() for r in refs) if t is not None]
    if not tensors:
        return
    for holder in _holders(*tensors):
        if is_lru_cache(holder):
            holder.cache_clear()
    ids = {id(t) for t in tensors}
    dicts = [
        r
        for r in gc.get_referrers(*tensors)
        if id(r) not in held and type(r) in (dict, collections.OrderedDict)
    ]
    namespaces = _namespaces(dicts)
    for d in dicts:
        if id(d) not in namespaces:
            for k in _keys_holding(d, ids):
                del d[k]


def _keys_holding(d: dict, ids: set[int]) -> list:
    # (not a comprehension inside the caller, for _keys_of's reason)
    return [k for k, v in d.items() if id(v) in ids]


def _namespaces(dicts: list) -> set[int]:
    """The ids of those of `dicts` that are an object's attributes or a module's globals."""
    if not dicts:
        return set()
    ids = {id(d) for d in dicts}
    return {
        id(d)
        for o in gc.get_referrers(*dicts)
        if (d := instance_dict(o)) is not None and id(d) in ids
    }


def _keys_of(d: dict, value: Any) -> list:
    # Not a comprehension inside the callers: one would keep `value` in a closure cell,
    # which gc.get_referrers would then report as a holder.
    return [k for k, v in d.items() if v is value]


def _cache_size(cache: Any) -> int | None:
    try:
        return cache.cache_info().currsize
    except Exception:
        return None


def _holders(*objects: Any, depth: int = 3) -> list:
    """The objects that keep `objects` alive, up to `depth` references away (containers
    between): one scan of the heap per level."""
    found, frontier, seen = [], list(objects), {id(o) for o in objects}
    for _ in range(depth):
        if not frontier:
            break
        nxt: list = []
        mine = {id(found), id(frontier), id(nxt), id(objects)}  # (lists of this search)
        for r in gc.get_referrers(*frontier):
            if id(r) in seen or id(r) in mine or isinstance(r, types.FrameType):
                continue
            seen.add(id(r))
            found.append(r)
            if isinstance(r, dict | list | tuple | set):
                nxt.append(r)
        frontier = nxt
    return found


def _as_key(d: dict, t: Any) -> str:
    """Words for fake tensor `t` held as a key of `d`, with the value it maps to where that
    is short to say (pyro's param store maps each parameter to its name)."""
    value = next((v for k, v in d.items() if k is t), None)
    if isinstance(value, str | int):
        return f"as the key of {value!r}"
    return "as a key"


def _dict_named(d: dict) -> str:
    """A dict, named by the object or module attribute it is, where one is found."""
    for namespace in gc.get_referrers(d):
        if not isinstance(namespace, dict):
            continue
        name = next((k for k, v in namespace.items() if v is d), None)
        if name is None:
            continue
        for owner in gc.get_referrers(namespace):
            if isinstance(owner, types.ModuleType) and owner.__dict__ is namespace:
                return f"the dict {owner.__name__}.{name}"
            if instance_dict(owner) is namespace:
                return f"the dict {name!r} of a {type(owner).__qualname__} object"
    return "a dict"


def _describe(t: Any, held: set[int] = frozenset()) -> str:  # type: ignore[assignment]
    """Words for what holds `t` (but the objects in `held`): an object's attribute, a
    global, a container, an object."""
    for r in gc.get_referrers(t):
        if isinstance(r, types.FrameType) or id(r) in held:
            continue
        if isinstance(r, dict):
            keys = _keys_of(r, t)
            where = f"under the key {keys[0]!r}" if keys else _as_key(r, t)
            for owner in gc.get_referrers(r):
                if isinstance(owner, types.ModuleType) and owner.__dict__ is r:
                    return f"the global {keys[0] if keys else '?'!r} of module {owner.__name__}"
                if instance_dict(owner) is r:
                    if keys:
                        return f"the attribute {keys[0]!r} of a {type(owner).__qualname__} object"
                    return f"a {type(owner).__qualname__} object's attributes, as a key"
            return f"{_dict_named(r)}, {where}"
        if isinstance(r, list | tuple | set):
            return f"a {type(r).__name__}"
        return f"a {type(r).__qualname__} object"
    return "an object torchjax cannot name"
