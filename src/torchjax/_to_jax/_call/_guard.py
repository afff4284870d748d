# The in-place guard: torch never writes into memory that JAX owns, by any route.
#
# Input tensors alias the caller's JAX buffers (DLPack, or XLA's buffers under jit). A write
# can reach them through an in-place op, a view, an out= argument, `.data` (which has a
# version counter of its own) or the storage itself (which bumps none), so version counters
# cannot promise anything. The guard works on what all those routes share, the storage:
#
# * fake runs (the shapes of the user's function): a dispatch mode refuses any op that
#   certainly writes into a tensor on an input's storage (an in-place op's self, an out=
#   argument), naming the op and the argument, before any real data is touched; an op
#   that only may write (its schema marks an argument it writes in some modes) is left to
#   the real run;
# * real runs: every input's storage is marked throw-on-mutable-data-ptr (torch's own mark
#   for FakeTensor storages), so every kernel that would write raises before it does,
#   whatever the route. A few readers ask for a writable pointer too (.numpy(), data_ptr(),
#   some compiled and extension kernels): on the first such refusal the call runs again on
#   copies, which are compared with the inputs afterwards (a change is an
#   InPlaceMutationError), and that signature runs on copies from then on;
# * outputs: an eager output is handed to JAX without a copy only when nothing but the
#   output itself reaches its memory (no closed-over tensor, parameter, cache or view of
#   one), so that torch cannot change a JAX array later;
# * under jit, an input the function kept a reference to (a hook, a cache) is given a copy
#   of its memory before XLA reuses the buffer, as eagerly the reference keeps its array.
from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from torchjax._compat._torch import (
    TorchDispatchMode,
    is_view,
    op_schema,
    set_throw_on_mutable_data_ptr,
    storage_cdata,
    storage_id,
    storage_key,
    storage_use_count,
    swap_storage_data,
    tensor_base,
    tensor_use_count,
    tensor_version,
)
from torchjax._errors import InPlaceMutationError, TorchJaxError

INPLACE_MESSAGE = """\
{name} modifies its input {path} in place ({how}). JAX arrays are immutable and torchjax
hands torch the caller's buffer without a copy, so this would silently change the caller's
array. {fix}
"""

# The fix, as specific as what was seen: the op (a fake run's), or only that a write came.
_FIX_IN_PLACE = """Use the out-of-place op, `y = x.{op}(...)` for `x.{op}_(...)`, or clone the
input before the write: `x = x.clone()`."""
_FIX_OUT = """Let {op} allocate its result, `y = torch.{op}(...)`, instead of writing
into the input with out=..., or clone the input first: `x = x.clone()`."""
_FIX_ANY = """Clone the input before writing into it (`x = x.clone()`, then write into x),
or use out-of-place ops (`y = x.mul(2)` for `x.mul_(2)`, `y = x.index_put(...)` for
`x[i] = v`, no out=)."""

_FIX_PARAMETER = """A module's parameters are inputs of each call, the caller's arrays, which
a call must not change (mutable=True returns new buffers, never parameters). Make the
forward's update of its own weights out of place, or make it in JAX between calls: for
nn.Embedding(max_norm=...), which renormalizes the rows it looks up in place, build the
Embedding without max_norm and limit the rows' norms in JAX after each optimizer step."""

METADATA_MESSAGE = """\
{name} changes its input {path} in place ({how}). That op changes only the tensor's shape or
strides, not its data, but to_jax rejects in-place ops on its inputs all the same. Use the
out-of-place form, e.g. `x = x.t()` for `x.t_()`, `x = x.unsqueeze(0)` for `x.unsqueeze_(0)`.
"""

_KEPT_MESSAGE = (
    "A function wrapped by to_jax kept a reference to one of its inputs (in a cache, a hook "
    "or an attribute) after a call under jax.jit, whose input buffers XLA reuses once the "
    "call returns. Keep a copy instead: `self.cache = x.clone()`."
)


_storage_use_count = storage_use_count
_sid = storage_id  # a tensor's storage, without making a Python object of it
_getrefcount, _getweakrefcount = sys.getrefcount, weakref.getweakrefcount


def inplace_error(
    name: str, path: str, how: str, metadata: bool = False, func: Any = None, parameter=False
) -> InPlaceMutationError:
    """The error for a write into input `path`; `func` is the op that writes, where known;
    `parameter`: the input is a module's parameter (module_to_jax's CallHooks say so)."""
    if metadata:
        return InPlaceMutationError(METADATA_MESSAGE.format(name=name, path=path, how=how))
    fix = _FIX_ANY  # (an op whose out-of-place form torch lacks, e.g. zero_, gets this)
    if func is not None:
        schema = op_schema(func)
        op = schema.name.split("::")[-1]
        out = any(a.kwarg_only and a.alias_info and a.alias_info.is_write for a in schema.arguments)
        if op.endswith("_") and hasattr(torch.Tensor, op[:-1]) and not op.startswith("_"):
            fix = _FIX_IN_PLACE.format(op=op[:-1])
        elif out and hasattr(torch, op):
            fix = _FIX_OUT.format(op=op)
    if parameter:
        fix = _FIX_PARAMETER
    return InPlaceMutationError(INPLACE_MESSAGE.format(name=name, path=path, how=how, fix=fix))


def check_versions(tensors: list, versions: list, paths: list, name: str, how: str) -> None:
    """Raise InPlaceMutationError naming the first input whose version counter moved.

    Behind a storage that refuses writes, a counter that moved means an in-place view op
    (t_, unsqueeze_, as_strided_, set_): data writes raise before they happen.
    """
    for t, v, path in zip(tensors, versions, paths, strict=True):
        if tensor_version(t) != v:
            raise inplace_error(name, path, f"an in-place view op, {how}", metadata=True)


# -- fake runs ------------------------------------------------------------------------------
_writes: dict[Any, tuple] = {}  # op -> ((position, name), ...) of the arguments it writes


def _written_args(func: Any) -> tuple:
    """The arguments an op writes: an in-place op's `self`, its out= arguments, and the
    others it marks written (`Tensor(a!)`) where it has a `training` flag and it is set
    (batch norm's running statistics, rrelu's noise: written in training mode alone).

    Returns ((position, name, flag), ...): `flag` is None, or the (position, name) of the
    training flag the write depends on. Another op's `Tensor(a!)` arguments a fake run
    cannot tell written; the real run's storages refuse the write if it happens (below).
    """
    found = _writes.get(func)
    if found is None:
        schema = op_schema(func)
        in_place = schema.name.endswith("_")
        flags = [(i, a.name) for i, a in enumerate(schema.arguments) if a.name in _MODE_FLAGS]
        flag = flags[0] if flags and str(schema.arguments[flags[0][0]].type) == "bool" else None
        found = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            if a.is_out or (in_place and i == 0):
                found.append((i, a.name, None))
            elif flag is not None:
                found.append((i, a.name, flag))
        found = _writes[func] = tuple(found)
    return found


_MODE_FLAGS = ("training", "train")


def _argument(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[i] if i < len(args) else None


_SEEDED = torch.Tag.nondeterministic_seeded  # ops that draw from a generator


class WriteGuard(TorchDispatchMode):
    """Refuses every op that writes into the storage of one of `inputs` (fake tensors), as
    its schema and training flag say (_written_args); a write no schema tells the real run
    refuses if it happens.

    Sees all routes to the storage: in-place ops and out= arguments on the input, its
    views, `.data` and tensors made on its storage. An in-place view op (t_, unsqueeze_)
    is refused with a message that says it changes no data.
    """

    def __init__(
        self, inputs: list, paths: list, name: str, made: Any = None, is_parameter: Any = None
    ):
        super().__init__()
        self.is_parameter = is_parameter  # (path) -> whether it is a module's parameter
        pairs = zip(inputs, paths, strict=True)
        self.storages = {storage_key(t.untyped_storage()): p for t, p in pairs}
        self.name = name
        self.made = made  # called with every tensor an op returns (fake_eval tracks them)
        self.draws = False  # whether an op drew random numbers (see partial_eval_custom)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg_name, flag in _written_args(func):
            if flag is not None and not _argument(args, kwargs, *flag):
                continue  # not in training mode: nothing is written
            value = _argument(args, kwargs, i, arg_name)
            for t in value if isinstance(value, list | tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    path = self.storages.get(storage_key(t.untyped_storage()))
                    if path is not None:
                        metadata = torch.Tag.inplace_view in func.tags
                        how = f"{func}, seen while inferring output shapes"
                        parameter = self.is_parameter is not None and self.is_parameter(path)
                        raise inplace_error(self.name, path, how, metadata, func, parameter)
        if _SEEDED in func.tags:
            self.draws = True
        out = func(*args, **kwargs)
        if self.made is not None:
            for t in out if isinstance(out, list | tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    self.made(t)
        return out


# -- real runs ------------------------------------------------------------------------------
# refuse_writes(t): every write into t's storage (by any tensor on it) raises before it happens.
refuse_writes = set_throw_on_mutable_data_ptr


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape, dtype and layout hold the same bits."""
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def owns_memory_alone(t: torch.Tensor, refs: int) -> bool:
    """Whether nothing but `t` reaches t's memory, so that it may become a JAX array as is.

    `refs` is the number of Python references the caller itself holds to `t` (a list
    entry, a local variable). Anything else that holds the tensor (a closure, a module, a
    cache), another tensor on its storage (a view, `.data`, a base kept by a view), or
    memory torch did not allocate (from_numpy, DLPack: not resizable) means it is shared.
    So does a weak reference (a WeakValueDictionary cache): torch keeps a tensor's Python
    object alive while its memory is in use, by JAX too, so the weak reference would reach it.
    """
    if _getrefcount(t) != refs + 2 or tensor_use_count(t) != 1:  # + `t` and getrefcount's argument
        return False
    if _getweakrefcount(t):
        return False
    storage = t.untyped_storage()
    # The storage's Python object counts as a user of it, and torch keeps it with the
    # storage once made: references `storage`, getrefcount's argument and torch's own.
    # One more is a storage object kept by someone else.
    if not storage.resizable() or _getrefcount(storage) != 3 or _getweakrefcount(storage):
        return False
    if not is_view(t):
        return _storage_use_count(storage_cdata(storage)) == 2
    # A view keeps its base alive: private if the base is reachable only through it. The
    # base's Python object is then kept by torch for the view (one reference), besides
    # `base` and getrefcount's argument; any other holder (a closure, a list) adds one.
    if _storage_use_count(storage_cdata(storage)) != 3:
        return False
    base = tensor_base(t)
    return tensor_use_count(base) == 2 and _getrefcount(base) == 3 and not _getweakrefcount(base)


def copy_kept_inputs(tensors: list) -> None:
    """Give an input the function kept a reference to a copy of its memory.

    Under jit the inputs are XLA's buffers, valid only during the call; a tensor, view or
    storage of one that outlives the call would read memory XLA has reused. Such an input's
    storage gets a private copy of the data in place of XLA's, so the kept reference reads
    the call's input, as it does eagerly (where the tensor keeps its JAX array alive).
    """
    for t in tensors:
        # References: the list, the loop variable, getrefcount's argument; t on its storage.
        if _getrefcount(t) == 3 and tensor_use_count(t) == 1:
            if _storage_use_count(_sid(t)) == 1:
                continue
            # Once a Python object of a storage was made (a weak reference, say), torch keeps
            # it with the storage: a second user, harmless while nothing else holds it
            # (references: `storage`, getrefcount's argument, torch's own).
            storage = t.untyped_storage()
            if _storage_use_count(storage_cdata(storage)) == 2 and _getrefcount(storage) == 3:
                continue
        else:
            storage = t.untyped_storage()
        # The clone then holds XLA's buffer, and lets go of it.
        if not swap_storage_data(storage, storage.clone()):  # pragma: no cover - older torch
            raise TorchJaxError(_KEPT_MESSAGE)
