# A module's calls, each in a private copy of the module holding that call's tensors.
#
# A call of module_to_jax's apply is a pure function of its variables and inputs, on any
# thread and device, from its forward through its backward. Putting a call's arrays into
# the user's one nn.Module (as torch.func.functional_call does) cannot give that: two
# threads (or two devices of a shard_map) would swap each other's tensors out, a backward
# that reads the module again (torch.utils.checkpoint, adjoint ODE solvers) would see
# whatever the module holds by then, and state the forward leaves behind (a lazily built
# table, a cache, a Python counter) would change later calls. So the user's module is never
# run. At module_to_jax time it is copied once (`template`; parameters and buffers become
# placeholders without memory, which raise if computed with: _placeholders.py), and every
# call runs in a copy of that template taken from a pool: installed with the call's
# tensors, run, and given back reset to the template's Python state. A copy that a
# backward may still read is held, not given back, until that backward is done
# (_residual.hold). Fake runs get a fresh copy of their own, thrown away after, so that no
# FakeTensor can reach a later call. A TorchScript submodule's slots are TorchScript's own
# tables (set through them, as torch.func.functional_call does). Its deepcopy ignores the
# memo and cannot copy a placeholder: the template's hold plain meta tensors there, and each
# copy has its placeholders installed after it is made.
from __future__ import annotations

import collections
import copy
import operator
import threading
from collections.abc import Mapping
from typing import Any

import torch

from torchjax._compat._torch import (
    compiled_context,
    is_functorch_wrapped,
    module_buffers,
    module_parameters,
    parametrize_cache,
    storage_id,
)
from torchjax._errors import VariablesError
from torchjax._module_to_jax._aliases import AliasWatch, overlapping
from torchjax._module_to_jax._closures import rebind_closures
from torchjax._module_to_jax._placeholders import (
    BATCHED,
    IDLE,
    DatalessTensor,
    computed_attributes,
    placeholder,
)
from torchjax._module_to_jax._variables import ModuleVariables
from torchjax._to_jax._context import PARAMETRIZE_LOCK
from torchjax._to_jax._fake._run import real_mode
from torchjax._to_jax._fake._snapshots import ModulesSnapshot
from torchjax._to_jax._torch_ops._residual import (
    HeldState,
    KeptGraph,
    hold,
    input_view,
    rebuild_input_view,
)

_setitem = operator.setitem
_consume = collections.deque(maxlen=0).extend


def _slot_names(module: torch.nn.Module, named: Any) -> list[tuple[str, str, str]]:
    """(owner path, key, canonical name) for every place a tensor of `named` sits.

    `named` is named_parameters or named_buffers; a tied tensor's aliases (several places,
    one tensor) all map to the name under which it appears once in `variables`.
    """
    canonical = {id(t): name for name, t in named()}
    names = []
    for name, t in named(remove_duplicate=False):
        owner, _, key = name.rpartition(".")
        names.append((owner, key, canonical[id(t)]))
    return names


def _slot_tables(module: torch.nn.Module, param_names: list, buffer_names: list) -> list:
    """(table, key) for every slot of `module` named in `param_names` and `buffer_names`
    (see _slot_names), parameters first: the dict (or TorchScript's table) it sits in."""
    owners = dict(module.named_modules(remove_duplicate=False))
    return [
        (table(owners[owner]), key)
        for table, names in ((module_parameters, param_names), (module_buffers, buffer_names))
        for owner, key, _ in names
    ]


class ModuleCopy(HeldState):
    """One private copy of the module: what a call runs in.

    Installed with a call's tensors (`install`), run, then either given back to its pool
    (`release`: placeholders in, Python state reset) or held for a backward that may read
    it again (see _residual.HeldState), which then finds it as the forward left it.
    """

    def __init__(self, pool: CopyPool, module: torch.nn.Module):
        self.pool, self.module = pool, module
        self.runner = pool.wrap(module)  # a torch.compile'd module runs compiled
        self.slots = _slot_tables(module, pool.param_names, pool.buffer_names)
        self.placeholders = pool.placeholders
        for (d, key), empty in zip(self.slots, self.placeholders, strict=True):
            if d[key] is not empty:  # a TorchScript submodule's copy of the template's
                d[key] = empty
        self._dicts = [d for d, _ in self.slots]
        self._keys = [key for _, key in self.slots]
        self.snapshot = ModulesSnapshot(module, self.placeholders)
        self.training: tuple | None = None
        self._record: list | None = None

    def install(self, values: list, training: tuple) -> None:
        if training != self.training:
            for snapshot, mode in zip(self.snapshot.each, training, strict=True):
                snapshot.set_training(mode)
            self.training = training
        if len(values) != len(self._keys):
            raise ValueError(f"{len(values)} tensors for {len(self._keys)} slots")
        _consume(map(_setitem, self._dicts, self._keys, values))  # a loop in C: per call

    def slot_values(self) -> list:
        return [d[key] for d, key in self.slots]

    def _uninstall(self) -> None:
        _consume(map(_setitem, self._dicts, self._keys, self.placeholders))

    def release(self) -> None:
        self._uninstall()
        self._record = None
        self.snapshot.restore_changed()
        self.pool.give_back(self)

    # -- held by a kept graph between the forward and its backward ---------------------
    def keep_for_graph(self, graph: KeptGraph, inputs: list[torch.Tensor]) -> None:
        where = {storage_id(t): k for k, t in enumerate(inputs) if t.numel()}
        record = []
        for j, t in enumerate(self.slot_values()):
            leaf = next((i for i, lf in enumerate(graph.leaves) if lf is t), None)
            if is_functorch_wrapped(t):
                # A forward batched under torch.func.vmap (per-example gradients from one
                # graph): its backward runs unbatched, so a backward that reads the module
                # again is refused, saying why, rather than computed on the wrong shapes.
                why = BATCHED.format(module=type(self.module).__name__)
                record.append(("own", placeholder(self.placeholders[j], why)))
            elif leaf is not None:
                record.append(("leaf", leaf))
            elif isinstance(t, torch.Tensor) and t.numel() and storage_id(t) in where:
                record.append(("input", input_view(where[storage_id(t)], t)))
            else:
                record.append(("own", t))
        self._record = record
        self._uninstall()  # XLA's buffers are this call's only; the leaves are emptied

    def reinstall(self, graph: KeptGraph) -> None:
        for (d, key), (kind, value) in zip(self.slots, self._record, strict=True):
            if kind == "leaf":
                d[key] = graph.leaves[value]
            elif kind == "input":
                d[key] = rebuild_input_view(value, graph.inputs)
            else:
                d[key] = value


class CopyPool:
    """Copies of one template module, made on demand and reused; thread-safe."""

    def __init__(
        self, template: torch.nn.Module, compiled: Any, param_names, buffer_names, placeholders
    ):
        self.template, self.compiled = template, compiled
        self.param_names, self.buffer_names = param_names, buffer_names
        self.placeholders = placeholders  # what every copy's slots hold between calls
        self._free: list[ModuleCopy] = []
        self._lock = threading.Lock()

    def wrap(self, module: torch.nn.Module) -> Any:
        """What runs a copy: the copy, or for a compiled module the copy compiled alike."""
        context = None if self.compiled is None else compiled_context(self.compiled)
        return module if context is None else type(self.compiled)(module, context)

    def _new(self) -> torch.nn.Module:
        with self._lock:  # deepcopy reads the template, which nothing else may touch then
            return _copy_of(self.template)

    def acquire(self) -> ModuleCopy:
        try:
            return self._free.pop()
        except IndexError:
            return ModuleCopy(self, self._new())

    def give_back(self, c: ModuleCopy) -> None:
        self._free.append(c)

    def fresh(self) -> torch.nn.Module:
        """A copy for a fake run, used once: whatever the fake run leaves in it goes with it.
        Made for real (its tensors are the template's), though a fake run asks for it."""
        with real_mode():
            return self._new()


def _copy_of(module: torch.nn.Module, placeholders: dict | None = None) -> torch.nn.Module:
    """A deep copy of `module` sharing the tensors in `placeholders` (id -> tensor)."""
    memo = dict(placeholders or {})
    for _, t in module.named_parameters(remove_duplicate=False):
        memo.setdefault(id(t), t)
    for _, t in module.named_buffers(remove_duplicate=False):
        memo.setdefault(id(t), t)
    for sub in module.modules():  # a template's placeholders of computed attributes
        for value in vars(sub).values():
            if isinstance(value, DatalessTensor):
                memo.setdefault(id(value), value)
    copied = copy.deepcopy(module, memo)
    rebind_closures(copied, memo)  # lambdas and hooks that close over the module or its tensors
    return copied


_COPY_FAILED = (
    "module_to_jax({name}): the module cannot be copied ({error}). torchjax runs every call "
    "in a private copy of the module, so that calls from several threads or devices, and a "
    "backward that reads the module again, each see their own tensors and the module itself "
    "never changes. Make the module deep-copyable (copy.deepcopy), or wrap a function of "
    "its parameters with torchjax.to_jax."
)


class ModuleState(ModuleVariables):
    """The named tensors of `module`, where they sit, and the copies calls run in (the
    callback path's).

    Args:
      module: the module whose forward runs (for a compiled module, its ``_orig_mod``).
      compiled: the ``torch.compile``'d module, or None: real calls then run compiled copies.
    """

    def __init__(self, module: torch.nn.Module, compiled: Any = None):
        super().__init__(module, compiled)
        param_names = _slot_names(module, module.named_parameters)
        buffer_names = _slot_names(module, module.named_buffers)
        self.slot_names = [name for _, _, name in param_names + buffer_names]
        self.n_params = len(param_names)
        # One slot per buffer name, to read the buffers back after a call.
        first: dict[str, int] = {}
        for j, (_, _, name) in enumerate(buffer_names, self.n_params):
            first.setdefault(name, j)
        self.buffer_reads = list(first.items())
        # Parameters and buffers that are views of one another: a write into one is
        # refused (_aliases.py). None for the usual module, which has none.
        pairs = overlapping({**self.params, **self.buffers})
        slot_of: dict[str, int] = {}
        for j, name in enumerate(self.slot_names):
            slot_of.setdefault(name, j)
        name = type(module).__name__
        self.aliases = AliasWatch(pairs, slot_of, self.n_params, name) if pairs else None
        idle = IDLE.format(module=type(module).__name__)
        placeholders = {
            id(t): placeholder(t, idle) for t in (*module.parameters(), *module.buffers())
        }
        placeholders.update(computed_attributes(module))
        try:
            template = _copy_of(module, placeholders)
        except Exception as e:
            raise VariablesError(
                _COPY_FAILED.format(name=type(module).__name__, error=f"{type(e).__name__}: {e}")
            ) from e
        # A TorchScript submodule's deepcopy copied the user's tensors (it ignores the
        # memo), and would fail on a placeholder: its slots in the template hold meta
        # tensors instead, and each copy's get the placeholders (ModuleCopy).
        theirs = _slot_tables(module, param_names, buffer_names)
        empties = []
        for (d, key), (user_d, user_key) in zip(
            _slot_tables(template, param_names, buffer_names), theirs, strict=True
        ):
            empty = placeholders[id(user_d[user_key])]
            empties.append(empty)
            if d[key] is not empty:
                d[key] = torch.empty(empty.shape, dtype=empty.dtype, device="meta")
        self.pool = CopyPool(template, compiled, param_names, buffer_names, empties)
        # The parametrize.cached() keys of the module's parametrized tensors (see call).
        self.parametrized = [
            (id(m), name)
            for m in self.submodules
            if isinstance(getattr(m, "parametrizations", None), torch.nn.ModuleDict)
            for name in m.parametrizations
        ]

    def slot_values(self, params: Mapping, buffers: Mapping) -> list:
        """The tensor for every slot (parameters first) from the variables' two groups."""
        n = self.n_params
        names = self.slot_names
        return [params[name] for name in names[:n]] + [buffers[name] for name in names[n:]]

    def call(self, args: tuple, kwargs: dict, values: list, read_buffers: bool) -> Any:
        """The module's ``forward(*args, **kwargs)`` with `values` (one per slot, see
        slot_values) as its tensors, in a copy with the modes the user's module has now.

        Returns its result, and with `read_buffers` also the buffers as the call left them
        (updated in place, or reassigned by forward). Without it, a buffer the forward
        reassigned is dropped, with a warning the first time.
        """
        if self.parametrized and parametrize_cache() is not None:
            with PARAMETRIZE_LOCK:  # one call at a time may own the shared keys
                return self._call_with_own_cache(args, kwargs, values, read_buffers)
        return self._call(args, kwargs, values, read_buffers)

    def _call(self, args: tuple, kwargs: dict, values: list, read_buffers: bool) -> Any:
        c = self.pool.acquire()
        c.install(values, self.training())  # the user's module's modes, as they are now
        try:
            before = self.aliases.before(values) if self.aliases else None
            out = c.runner(*args, **kwargs)
            if before is not None:
                self.aliases.check(c.slot_values(), before)
            if read_buffers:
                out = (out, self._buffers_after(c))
            elif self.buffer_reads:
                self._check_reassigned(c, values)
        except BaseException:
            c.release()
            raise
        if not hold(c):
            c.release()
        return out

    def _call_with_own_cache(self, args, kwargs, values, read_buffers) -> Any:
        """call inside parametrize.cached(), whose cache key a copy shares with the user's
        module: the call must neither read the module's cached tensors (its own parameters)
        nor leave its own (this call's variables) for the module or the next call."""
        cache = parametrize_cache()
        theirs = {k: cache.pop(k) for k in self.parametrized if k in cache}
        try:
            return self._call(args, kwargs, values, read_buffers)
        finally:
            cache = parametrize_cache() or {}
            for k in self.parametrized:
                cache.pop(k, None)
            cache.update(theirs)

    def _check_reassigned(self, c: ModuleCopy, values: list) -> None:
        reassigned = [
            name for name, j in self.buffer_reads if c.slots[j][0][c.slots[j][1]] is not values[j]
        ]
        if reassigned:
            self.warn_dropped(reassigned, "reassigned")

    def fake_call(self, args: tuple, kwargs: dict, values: list, read_buffers: bool) -> Any:
        """forward on fake tensors, in a copy of its own that is thrown away afterwards."""
        module = self.pool.fresh()
        c = ModuleCopy(_OneUse(self.pool), module)
        c.install(values, self.training())
        before = self.aliases.before(values) if self.aliases else None
        out = module(*args, **kwargs)
        if before is not None:
            self.aliases.check(c.slot_values(), before)
        if read_buffers:
            out = (out, self._buffers_after(c))
        return out

    def _buffers_after(self, c: ModuleCopy) -> dict:
        """The buffers as a call left them in copy `c`, for mutable=True. A buffer forward
        registered again with another shape (a mask or rotary cache grown on demand) is
        accepted at that shape in the calls that are given it back (`check`)."""
        buffers = {name: c.slots[j][0][c.slots[j][1]] for name, j in self.buffer_reads}
        new = [name for name, _ in c.module.named_buffers() if name not in self.buffers]
        if new:  # registered by forward: variables has no place for them
            self.warn_dropped(new, "registered", new=True)
        for name, t in buffers.items():
            shape = tuple(t.shape)
            if shape != self.shapes["buffers"][name]:
                self.grown.setdefault(name, set()).add(shape)
        return buffers


class _OneUse:
    """The pool of a fake run's copy: it is never given back, and runs uncompiled."""

    def __init__(self, pool: CopyPool):
        self.param_names, self.buffer_names = pool.param_names, pool.buffer_names
        self.placeholders = pool.placeholders

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def give_back(self, c: ModuleCopy) -> None:
        pass
