# Outputs of torch functions as JAX pytrees.
#
# Torch code returns containers that torch's own pytree registry knows
# but JAX's does not: the structseqs of torch.return_types (`torch.linalg.slogdet(x)`,
# `x.max(dim=0)`) and registered dict-likes such as Hugging Face's ModelOutput. JAX would
# take each for one opaque leaf. `as_jax_tree` rebuilds them as containers JAX knows, the
# same way on fake and real runs, so the output structure found by the fake run is the one
# real calls produce: a structseq becomes a namedtuple with its field names, a dict-like
# becomes an OutputDict of its non-None entries (a dict that also reads `out.logits`, as
# ModelOutput does), any other torch node a tuple of its children.
# A numpy scalar becomes a 0-d tensor of its dtype. Leaves that are neither tensors nor
# numbers are left alone: the output checks name them.
#
# Each container made here is registered for jax.export serialization, so an exported
# function's output structure serializes: OutputDict as "torchjax.OutputDict" (next to its
# pytree registration, at import), each structseq's namedtuple as
# "torchjax.return_types.<name>" when it is first made. A process that deserializes needs
# the same names registered: `import torchjax` does OutputDict's; a return_types name, or
# any name where torchjax cannot be imported, is registered there by hand (docs/lowering.md;
# torchjax then returns the class registered). A user's own namedtuple stays the user's
# class (isinstance, its methods), so its name is the user's to register.
from __future__ import annotations

import collections
import functools
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import torch

from torchjax._compat._jax import export_type_named, uncommitted
from torchjax._compat._torch import is_structseq_class, tensor_from_capsule, torch_pytree
from torchjax._convert import check_has_data, narrow_checked, several_devices, tensor_to_jax
from torchjax._log import logger
from torchjax._to_jax._call._guard import owns_memory_alone

_tree = jax.tree_util


class OutputDict(dict):
    """A dict-like torch output (Hugging Face's ModelOutput) as a JAX pytree: a dict of its
    non-None fields in their order, read as ``out["logits"]`` or ``out.logits``."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"this output has no field {name!r}; its fields are {list(self)}"
            ) from None

    def __repr__(self) -> str:
        return f"OutputDict({dict.__repr__(self)})"


_tree.register_pytree_with_keys(
    OutputDict,
    lambda d: ([(_tree.DictKey(k), v) for k, v in d.items()], tuple(d)),
    lambda keys, values: OutputDict(zip(keys, values, strict=True)),
    lambda d: (list(d.values()), tuple(d)),
)

_NOT_A_STRING_KEY = (
    "jax.export cannot serialize an OutputDict with the key {key!r} (a {type}): it writes "
    "string keys only, as for a dict. Give the dict-like your torch function returns string "
    "keys, or return a tuple of its values from the function you export."
)


def _keys_as_bytes(keys: tuple) -> bytes:
    for key in keys:
        if type(key) is not str:
            raise TypeError(_NOT_A_STRING_KEY.format(key=key, type=type(key).__name__))
    return json.dumps(keys).encode()


def _keys_from_bytes(data: bytes) -> tuple:
    return tuple(json.loads(data))  # the pytree's aux data: the keys, as a tuple


def _for_export(cls: type, name: str, register: Any) -> type:
    """`cls`, registered by `register` (one of jax.export's) to serialize as `name`.

    Where `name` is taken, jax.export refuses a second type for it: the type registered
    under it is returned in place of `cls` if it is a tuple with the same fields (the user's
    line from docs/lowering.md, or the same class made by another thread at the same
    moment), and `cls` unregistered otherwise (serializing it then fails, naming it).
    """
    try:
        return register(cls, serialized_name=name)
    except ValueError:
        taken = export_type_named(name)
        fields = getattr(cls, "_fields", None)
        if fields is not None and isinstance(taken, type) and issubclass(taken, tuple):
            if getattr(taken, "_fields", None) == fields:
                return taken
        logger.debug("jax.export's name %r is taken by %r: %r will not serialize", name, taken, cls)
        return cls


_for_export(
    OutputDict,
    "torchjax.OutputDict",
    functools.partial(
        jax.export.register_pytree_node_serialization,
        serialize_auxdata=_keys_as_bytes,
        deserialize_auxdata=_keys_from_bytes,
    ),
)


def as_jax_tree(out: Any) -> Any:
    """`out` with every container that only torch's pytree registry knows made a JAX one.

    Args:
      out: what a torch function returned.

    Returns:
      `out` itself when JAX already knows every container in it (the common case, checked
      first without rebuilding anything); otherwise a rebuilt tree of tuples, lists, dicts
      and namedtuples with the same leaves.
    """
    t = type(out)
    if t is torch.Tensor:
        return out
    if (t is tuple or t is list) and all(type(o) is torch.Tensor for o in out):
        return out
    return _convert(out)


def _convert(x: Any) -> Any:
    t = type(x)
    if t is torch.Tensor or x is None or t in (bool, int, float, complex, str):
        return x
    if isinstance(x, np.bool_ | np.number):
        # A numpy scalar (np.float32(0.5), an element of a numpy array): a 0-d array of its
        # dtype, as JAX makes of one returned from a jitted function.
        return torch.from_numpy(np.array(x))
    if t is tuple or t is list:
        return t(_convert(v) for v in x)
    if t is dict:
        return {k: _convert(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple: JAX knows it
        return t(*(_convert(v) for v in x))
    node = torch_pytree.SUPPORTED_NODES.get(t)
    if node is None or not _is_jax_leaf(x):
        return x  # JAX knows it, or nobody does (the output checks will name it)
    if is_structseq_class(t):
        return _namedtuple(t)(*(_convert(v) for v in x))
    if node.flatten_with_keys_fn is not None:
        entries, _ = node.flatten_with_keys_fn(x)
        keys = [k for k, _ in entries]
        if keys and all(
            isinstance(k, torch_pytree.MappingKey | torch_pytree.GetAttrKey) for k in keys
        ):
            return OutputDict((_key_name(k), _convert(v)) for k, v in entries if v is not None)
        return tuple(_convert(v) for _, v in entries)
    children, context = node.flatten_fn(x)
    if isinstance(context, list | tuple) and len(context) == len(children):
        # flatten_fn's context lists the keys of a dict-like (ModelOutput's does).
        if all(isinstance(k, str) for k in context):
            pairs = zip(context, children, strict=True)
            return OutputDict((k, _convert(v)) for k, v in pairs if v is not None)
    return tuple(_convert(v) for v in children)


def _key_name(key: Any) -> Any:
    return key.key if isinstance(key, torch_pytree.MappingKey) else key.name


def _is_jax_leaf(x: Any) -> bool:
    # One level only: x itself is a JAX node or not, whatever its children are.
    return _tree.treedef_is_leaf(_tree.tree_structure(x, is_leaf=lambda y: y is not x))


@functools.cache
def _namedtuple(structseq: type) -> type:
    """One namedtuple class per structseq type, so equal outputs give equal treedefs,
    registered for jax.export as torchjax.return_types.<name> (a structseq of another
    module: torchjax.<module>.<name>)."""
    n = structseq.n_sequence_fields
    cls = collections.namedtuple(structseq.__name__, structseq.__match_args__[:n])
    module = structseq.__module__.removeprefix("torch.")
    name = f"torchjax.{module}.{structseq.__qualname__}"
    return _for_export(cls, name, jax.export.register_namedtuple_serialization)


def write_output(dst: torch.Tensor, value: torch.Tensor, where: str) -> None:
    """Copy one checked torch result into XLA's output buffer (the one copy on this path).

    `run` has checked shape and dtype; a dtype that still differs is a 64-bit result
    narrowed because JAX's x64 mode is off, and it must fit. A tensor without data (meta,
    sparse) is named by its path.
    """
    if value.dtype is not dst.dtype:
        value = narrow_checked(value, dst.dtype, where)
    try:
        dst.copy_(value)
    except Exception:
        check_has_data(value, where)  # a meta or sparse output: say which
        raise


def write_checked(plan: Any, out: Any, outs: list) -> None:
    """A hot plan's output other than the one tensor the plan fixes: plan.run's checks
    (coercions, or the error that says what differs), then the copies into XLA's buffers."""
    results = plan.check_outputs(out if type(out) is torch.Tensor else as_jax_tree(out), True)
    del out  # (the output's references: see owns_memory_alone)
    write_all(results, outs, plan.out_paths, buffer_tensor)


def buffer_tensor(buf: Any) -> torch.Tensor:
    """One of XLA's buffers as a tensor, zero-copy. No stream goes to its __dlpack__: the
    buffer is ready on XLA's stream, which the callback's torch work runs on."""
    return tensor_from_capsule(buf.__dlpack__())


def write_all(results: Sequence, outs: Sequence, out_paths: Sequence[str], wrap) -> None:
    for buf, value, where in zip(outs, results, out_paths, strict=True):
        write_output(wrap(buf), value, where)


def to_jax_outputs(results: list, paths: list, device: Any = None) -> list:
    """The flat outputs of an eager call as JAX arrays on `device` (None: JAX's CPU).

    An output is handed over without a copy only where nothing but the output reaches its
    memory: one that shares it with an input, a closed-over tensor, a parameter, a cache or
    a view of any of them is copied first, or torch could change the JAX array later.
    With `device` None (no input committed to a device) and several devices, the outputs
    are not committed either, as JAX's own results on such inputs.
    """
    outs = []
    for k in range(len(results)):
        value = results[k]
        try:
            if not owns_memory_alone(value, 2):  # our references: the list's and `value`
                value = value.clone(memory_format=torch.contiguous_format)
        except RuntimeError:
            check_has_data(value, paths[k])  # a sparse or meta tensor: say so
            raise
        out = tensor_to_jax(value, paths[k], device)
        if device is None and several_devices(out.platform()):
            out = uncommitted(out)  # as JAX places an op's result on uncommitted inputs
        outs.append(out)
    return outs
