# Value conversion between torch tensors and JAX arrays, and the one dtype/device table.
#
# Everything that moves data between the two frameworks goes through this file, so the
# zero-copy rules, the x64 policy and the dtype table live in exactly one place:
#
# * zero-copy through DLPack wherever XLA accepts the layout; otherwise exactly one copy
#   (non-contiguous or under-aligned torch views, which XLA cannot alias);
# * with JAX's x64 mode off, 64-bit values are narrowed to JAX's canonical 32-bit types
#   (one copy), and values that do not fit raise instead of wrapping or becoming inf (the
#   rest of the x64 policy, int32 inputs and 64-bit arithmetic, is _x64.py's);
# * tensors that require grad are detached: autograd history does not cross the bridge.
from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np
import torch

from torchjax._compat._jax import (
    ARRAY_TYPES,
    HOST_ARRAY_TYPES,
    ArrayImpl,
    SingleDeviceSharding,
    dlpack_export,
    single_device_shard,
    uncommitted,
)
from torchjax._compat._jax import jax_config as _jax_config
from torchjax._compat._messages import is_write_refusal
from torchjax._compat._torch import cpu_array_from_tensor, is_fake
from torchjax._compat._torch import tensor_from_capsule as _tensor_from_capsule
from torchjax._errors import ConversionError

# torch dtype -> numpy/JAX dtype. The one table: every other module asks these helpers.
_TORCH_TO_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(jax.numpy.bfloat16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
# The 8-bit floats both sides have, where both have them (DLPack carries them between jaxlib
# 0.8+ and torch 2.13+). What only one side has, or DLPack cannot carry, is listed in
# UNSUPPORTED below.
for _name in (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
):
    _t, _j = getattr(torch, _name, None), getattr(jax.numpy, _name, None)
    if _t is not None and _j is not None:
        _TORCH_TO_NUMPY[_t] = np.dtype(_j)
del _name, _t, _j
_NUMPY_TO_TORCH: dict[np.dtype, torch.dtype] = {v: k for k, v in _TORCH_TO_NUMPY.items()}

# Neither side can hand these to the other: JAX's sub-byte integers and 4/6-bit floats have
# no DLPack type in XLA (torch's int1..int7 and uint1..uint7 are placeholders without
# kernels), torch's float4_e2m1fn_x2 packs two values a byte where JAX's float4_e2m1fn does
# not, complex32 has no DLPack width, and the remaining 8-bit floats exist on one side only.
UNSUPPORTED = (
    "int1, int2, int4, uint1, uint2, uint4, float4_e2m1fn, float6_e2m3fn, float6_e3m2fn, "
    "float8_e3m4, float8_e4m3, float8_e4m3b11fnuz (JAX only); float4_e2m1fn_x2, complex32, "
    "the quantized qint/quint types (torch only)"
)

# What a 64-bit type becomes when JAX's x64 mode is off (JAX's own canonicalization).
_NARROW_64: dict[torch.dtype, torch.dtype] = {
    torch.int64: torch.int32,
    torch.uint64: torch.uint32,
    torch.float64: torch.float32,
    torch.complex128: torch.complex64,
}

SUPPORTED_DTYPES = ", ".join(str(d).removeprefix("torch.") for d in _TORCH_TO_NUMPY)
_SUPPORTED = f"supported: {SUPPORTED_DTYPES}. Not supported: {UNSUPPORTED}"

_x64 = _jax_config.enable_x64  # read on every conversion: the state object, not jax.config


def jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The JAX (numpy) dtype for a torch dtype; raises ConversionError if there is none."""
    try:
        return _TORCH_TO_NUMPY[dtype]
    except KeyError:
        raise ConversionError(f"torch dtype {dtype} has no JAX equivalent; {_SUPPORTED}.") from None


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype for a JAX/numpy dtype (anything np.dtype accepts)."""
    try:
        return _NUMPY_TO_TORCH[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ConversionError(f"dtype {dtype} has no torch equivalent; {_SUPPORTED}.") from None


# The dtypes a tensor keeps as a JAX array whatever the x64 mode (tensor_to_jax's fast path).
_KEPT_DTYPES = frozenset(_TORCH_TO_NUMPY).difference(_NARROW_64)
_strided = torch.strided


def keeps_dtype(dtype: torch.dtype) -> bool:
    """Whether a tensor of `dtype` becomes a JAX array of the same dtype (x64 policy)."""
    return dtype in _KEPT_DTYPES or (_x64.value and dtype in _TORCH_TO_NUMPY)


def canonical_torch_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a value of `dtype` has once it is a JAX array (x64 policy applied)."""
    if not _x64.value:
        return _NARROW_64.get(dtype, dtype)
    return dtype


def canonical_jax_dtype(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype a torch value of `dtype` becomes (x64 policy applied)."""
    return jax_dtype(canonical_torch_dtype(dtype))


def narrow_checked(t: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """`t` cast to the narrower `dtype`, raising if any value would change beyond rounding.

    Integers must fit the narrower range; finite floats must stay finite. Rounding a
    float64 to float32 is JAX's own x64-off behaviour and is allowed.
    """
    out = t.to(dtype)
    if t.numel() == 0:
        return out
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        # torch implements few kernels for uint64; its bits read as int64 order the same
        # way for everything below 2**63, and values at or above it show up as negative.
        signed = t.view(torch.int64) if t.dtype == torch.uint64 else t
        lo, hi = signed.min().item(), signed.max().item()
        if t.dtype == torch.uint64 and lo < 0:
            lo, hi = 0, 2**64 - 1
        if lo < info.min or hi > info.max:
            raise ConversionError(
                f"{where}: {t.dtype} values in [{lo}, {hi}] do not fit {dtype}, the type JAX "
                f"uses while x64 is off. Enable it with jax.config.update('jax_enable_x64', "
                f"True), or cast the values yourself."
            )
    elif not torch.equal(torch.isfinite(out), torch.isfinite(t)):
        raise ConversionError(
            f"{where}: {t.dtype} values overflow {dtype}, the type JAX uses while x64 is off. "
            f"Enable it with jax.config.update('jax_enable_x64', True), or rescale them."
        )
    return out


class _CpuDevice(threading.local):
    device: Any = None


_cpu = _CpuDevice()


def jax_cpu_device() -> Any:
    """JAX's first CPU device, where CPU tensors become arrays by default."""
    if _cpu.device is None:
        _cpu.device = jax.devices("cpu")[0]
    return _cpu.device


_DEVICE_COUNTS: dict[str, int] = {}


def several_devices(platform: str) -> bool:
    """Whether this process has more than one JAX device of `platform` ("cpu", "gpu")."""
    count = _DEVICE_COUNTS.get(platform)
    if count is None:
        try:
            count = len(jax.local_devices(backend=platform))
        except RuntimeError:  # a platform name that is no backend's: JAX's own placement
            count = 1
        _DEVICE_COUNTS[platform] = count
    return count > 1


def check_has_data(t: Any, where: str) -> None:
    """Raise ConversionError naming `where` for a tensor with no dense data to hand over."""
    if isinstance(t, torch.Tensor) and t.is_nested:
        raise ConversionError(
            f"{where} is a nested tensor (torch.nested), whose components differ in shape: no "
            f"JAX array holds it. Pass (or return) its components, t.unbind(), or a padded "
            f"tensor, t.to_padded_tensor(0.0)."
        )
    if isinstance(t, torch.Tensor) and (t.is_meta or is_fake(t) or t.layout != torch.strided):
        kind = "meta" if t.is_meta else "fake" if is_fake(t) else str(t.layout)
        fix = "call .to_dense() first" if t.layout != torch.strided else "use tensors with data"
        raise ConversionError(
            f"{where} is a {kind} tensor, which has no data that DLPack could carry to JAX; {fix}."
        )


def tensor_to_jax(t: torch.Tensor, where: str = "value", device: Any = None) -> jax.Array:
    """A torch tensor as a JAX array, sharing memory where the layout allows.

    Args:
      t: the tensor; it is detached (autograd history does not cross to JAX).
      where: a path such as ``args[0]['a']`` used in error messages.
      device: the JAX CPU device for a CPU tensor (default: the first).

    Returns:
      A ``jax.Array`` on the matching device. It aliases ``t``'s memory when ``t`` is
      contiguous and 64-byte aligned and keeps its dtype; otherwise it is one copy.
    """
    if t.requires_grad:
        t = t.detach()
    if (
        t.is_cpu
        and (t.dtype in _KEPT_DTYPES or (_x64.value and t.dtype in _TORCH_TO_NUMPY))
        and t.layout is _strided
        and t.is_contiguous()
        and not t.const_data_ptr() % 64
        and not t.is_conj()
        and not t.is_neg()
    ):
        # The common case, checked in one go: a dense CPU tensor XLA can alias as it is.
        if device is None or device.platform != "cpu":
            device = jax_cpu_device()
        return _cpu_import(t, device, where)
    if t.layout != torch.strided:
        check_has_data(t, where)
    jax_dtype(t.dtype)  # raise early, with the table, for unsupported dtypes
    narrow = canonical_torch_dtype(t.dtype)
    if narrow is not t.dtype:
        t = narrow_checked(t, narrow, where)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_cpu:
        if not t.is_contiguous() or t.const_data_ptr() % 64:
            # XLA aliases only dense, 64-byte aligned memory; anything else is copied once.
            t = t.clone(memory_format=torch.contiguous_format)
        if device is None or device.platform != "cpu":
            device = jax_cpu_device()
        return _cpu_import(t, device, where)
    if t.is_meta:
        check_has_data(t, where)
    if not t.is_contiguous():
        t = t.contiguous()
    # Off the CPU, jax.dlpack negotiates the stream hand-over (JAX's stream waits for torch's
    # current one); its overhead is small there. torch's export reads the current CUDA
    # device for both the check and the stream, so it runs on the tensor's own device.
    if t.is_cuda:
        with torch.cuda.device(t.device):
            return jax.dlpack.from_dlpack(t)
    return jax.dlpack.from_dlpack(t)


def _cpu_import(t: torch.Tensor, device: Any, where: str) -> jax.Array:
    """A dense, aligned CPU tensor as a JAX array on `device`, zero-copy where torch's
    DLPack export may run: it asks for a writable pointer, which the storage of an input of
    an enclosing to_jax call (a JAX array's memory) refuses; that one is copied."""
    try:
        return cpu_array_from_tensor(t, device)
    except RuntimeError as e:
        if is_write_refusal(e):
            return cpu_array_from_tensor(t.clone(), device)
        check_has_data(t, where)  # a tensor without data: say which
        raise


def _numpy_to_tensor(a: np.ndarray) -> torch.Tensor:
    """A numpy array as a torch tensor, aliasing its memory where torch can.

    Raises ConversionError (with the table) for dtypes outside it, including non-native byte
    order. torch.from_numpy cannot alias read-only memory, negative strides or strides that
    are not a multiple of the item size, so those are copied once; it also does not know
    ml_dtypes' bfloat16, so bfloat16 goes through a 16-bit view of the same bits.
    """
    dtype = torch_dtype(a.dtype)
    if not a.flags.writeable or any(s < 0 or s % a.itemsize for s in a.strides):
        a = a.copy()  # C-contiguous
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


_ArrayImpl = ArrayImpl
_SingleDeviceSharding = SingleDeviceSharding
# jaxlib's DLPack export of a single-device array; jax.Array.__dlpack__ adds ~10 µs of checks.
_EXPORT, _shard = dlpack_export, single_device_shard  # (the shard: see single_device_shard)


def array_to_tensor(a: Any, where: str = "value") -> torch.Tensor:
    """A JAX (or numpy) array as a torch tensor, sharing memory (zero-copy).

    The tensor aliases the array's buffer: writing to it would change an immutable JAX
    array, so callers must treat it as read-only (to_jax enforces this for torch code).
    """
    if type(a) is _ArrayImpl and _EXPORT is not None and type(a.sharding) is _SingleDeviceSharding:
        if a.platform() == "cpu" and a.dtype in _NUMPY_TO_TORCH:  # the common case, first
            return _tensor_from_capsule(_EXPORT(_shard(a), stream=None))
    if isinstance(a, HOST_ARRAY_TYPES):
        return _numpy_to_tensor(np.asarray(a))
    if isinstance(a, jax.core.Tracer):
        raise ConversionError(
            f"{where} is a traced JAX value ({a.aval}); it has no data to convert. Call torch "
            f"code on traced values with torchjax.to_jax(fn) instead of converting them."
        )
    if not isinstance(a, jax.Array):
        raise ConversionError(f"{where}: expected a JAX array, got {type(a).__name__}.")
    if type(a) is _ArrayImpl and _EXPORT is not None and a.platform() == "cpu":
        sharding = a.sharding
        if type(sharding) is _SingleDeviceSharding or len(sharding.device_set) == 1:
            if a.dtype not in _NUMPY_TO_TORCH:
                torch_dtype(a.dtype)  # raises, naming the supported dtypes
            return _tensor_from_capsule(_EXPORT(_shard(a), stream=None))
    torch_dtype(a.dtype)
    if not a.is_fully_addressable or len(a.sharding.device_set) != 1:
        n = len(a.sharding.device_set)
        if a.is_fully_addressable and a.is_fully_replicated:  # n equal copies, not shards
            raise ConversionError(
                f"{where} is replicated on {n} devices (a full copy on each); a torch tensor "
                f"lives on one. Convert one copy, {where}.addressable_shards[0].data, or "
                f"jax.device_put it to one device."
            )
        raise ConversionError(
            f"{where} is sharded over {n} devices; convert single-device arrays, or call the "
            f"torch code inside jax.shard_map on the local shards."
        )
    if a.platform() == "cpu":
        return torch.utils.dlpack.from_dlpack(a.__dlpack__())
    return torch.from_dlpack(a)  # negotiates the stream with torch's current stream


def is_array(x: Any) -> bool:
    """Whether a pytree leaf is array data (as opposed to a static value)."""
    return isinstance(x, ARRAY_TYPES)


def _leaf_path(path: tuple, root: str = "tree") -> str:
    return root + jax.tree_util.keystr(path)


def tree_to_jax(tree: Any) -> Any:
    """Convert every torch tensor and numpy array leaf of a pytree to a JAX array.

    JAX arrays and non-array leaves pass through unchanged; the structure is preserved.
    Conversion is zero-copy through DLPack where the layout allows it; non-contiguous or
    under-aligned tensors, read-only numpy arrays, and 64-bit values narrowed because JAX's
    x64 mode is off are copied once. Tensors that require grad are detached.

    Warning:
      A zero-copy result shares memory with the tensor: writing to the tensor afterwards
      (an optimizer step, ``param.data.copy_(...)``, ``add_``) **changes the JAX array**,
      which JAX assumes immutable, silently and including arrays already passed to
      jitted code. Convert clones (``tree_to_jax({k: v.clone() for k, v in d.items()})``)
      when the tensors will change.

    Args:
      tree: any pytree (dicts, lists, tuples, namedtuples, registered custom nodes).

    Returns:
      The same structure with JAX arrays in place of tensors and numpy arrays.

    Examples:
      >>> import torch, torchjax
      >>> out = torchjax.tree_to_jax({"w": torch.ones(2, 3), "n": 4})
      >>> out["w"].shape, out["n"]  # [2, 3] jax.Array; 4 passes through
      ((2, 3), 4)
    """

    return tensors_to_jax(tree, "tree")


def tensors_to_jax(tree: Any, root: str) -> Any:
    """tree_to_jax, naming a leaf in errors from `root` (``variables['params']``, say)."""

    def convert(path: tuple, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.is_meta or is_fake(x):
                kind = "meta" if x.is_meta else "fake"
                raise ConversionError(
                    f"{_leaf_path(path, root)} is a {kind} tensor: it has a shape and dtype "
                    f"but no data. torchjax runs a wrapped function on fake "
                    f"tensors once to find its output types; code that leaves torch inside it "
                    f"cannot run then. Convert real tensors only, or declare the outputs with "
                    f"to_jax(fn, result_shape_dtypes=...) so that no fake run happens."
                )
            return _placed_as_jax_would(tensor_to_jax(x, _leaf_path(path, root)))
        if isinstance(x, np.ndarray):
            return _placed_as_jax_would(tensor_to_jax(_numpy_to_tensor(x), _leaf_path(path, root)))
        return x

    return jax.tree_util.tree_map_with_path(convert, tree)


def _placed_as_jax_would(a: jax.Array) -> jax.Array:
    """`a`, not committed to its device where that is its platform's first, as jnp.asarray
    leaves an array: with several devices a jit over a mesh (data parallelism, shard_map)
    may then place it, where a committed one is refused as on another device."""
    platform = a.platform()
    if several_devices(platform):
        devices = a.devices()
        if len(devices) == 1 and devices == {jax.local_devices(backend=platform)[0]}:
            return uncommitted(a)
    return a


def tree_to_torch(tree: Any) -> Any:
    """Convert every JAX array and numpy array leaf of a pytree to a torch tensor.

    Torch tensors and non-array leaves pass through unchanged. The tensors share memory
    with the arrays (DLPack).

    Warning:
      The tensors alias the JAX arrays' buffers, zero-copy. Writing to them (in-place ops,
      ``.data``, an optimizer step, ``out=``) **silently changes the JAX arrays**, which JAX
      assumes immutable and may share between values. Nothing stops such a write here (only
      calls made by ``to_jax`` refuse them): treat these tensors as read-only, or ``clone()``
      them first.

    Args:
      tree: any pytree.

    Returns:
      The same structure with torch tensors in place of arrays.

    Examples:
      >>> import jax.numpy as jnp, torchjax
      >>> t = torchjax.tree_to_torch([jnp.zeros(3), None])
      >>> t[0].shape, t[1]  # torch.Size([3]); None passes through
      (torch.Size([3]), None)
    """

    def convert(path: tuple, x: Any) -> Any:
        if isinstance(x, ARRAY_TYPES):
            return array_to_tensor(x, _leaf_path(path))
        return x

    return jax.tree_util.tree_map_with_path(convert, tree)
