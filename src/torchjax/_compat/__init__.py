# The one home of every private JAX, jaxlib and torch name torchjax uses.
#
# torchjax stands on internals of both frameworks: JAX's primitive machinery and its
# partial-evaluation rules, jaxlib's DLPack entry points, torch's functorch levels, fake
# tensors and version counters. Releases change them without notice, so each is looked up
# here, and nowhere else, by feature detection rather than by version number:
#   * where a public API does the same job, a missing private name falls back to it and
#     costs speed, not function (jax.dlpack for jaxlib's DLPack calls, torch.func.vmap for
#     the steps it is made of, torch.set_grad_enabled for torch._C's setter, ...);
#   * where none does, the name is required: without it importing torchjax raises an
#     ImportError that names it, instead of a transform failing later somewhere deep.
# PRIVATE_NAMES records every name, its alternatives across versions, and what its absence
# costs; tests/test_compat.py checks each against the installed versions, so an upgrade
# that removes one fails there by name. The supported versions are in docs/install.md.
#
# Other modules import the namespaces below (`from torchjax._compat import core`) in place
# of JAX's modules: each holds exactly the names torchjax uses, resolved once.
from __future__ import annotations

import functools
import importlib
import inspect
import operator
import sys
import types
import warnings
from typing import Any

import jax
import jax.extend.core
import numpy as np
import torch
import torch.autograd.forward_ad as _forward_ad
import torch.utils.dlpack

# name (alternatives joined by " | ", first found wins) -> what its absence costs
PRIVATE_NAMES: dict[str, str] = {}
# The names of PRIVATE_NAMES that the installed versions lack.
MISSING: list[str] = []

REQUIRED = "required"
_ABSENT = object()


def resolve(path: str) -> Any:
    """The object a dotted path names, or _ABSENT.

    The longest importable prefix is the module, the rest attributes; ``()`` after a part
    calls it with no arguments (instance attributes: ``torch.nn.Module()._parameters``).
    An attribute whose access warns of its deprecation counts as absent: it is on its way
    out, and under ``-W error`` it would fail anyway.
    """
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if "()" in module:
            continue
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for part in parts[i:]:
                    obj = getattr(obj, part.removesuffix("()"))
                    if part.endswith("()"):
                        obj = obj()
            except AttributeError:
                return _ABSENT
        if any(issubclass(w.category, DeprecationWarning) for w in caught):
            return _ABSENT
        return obj
    return _ABSENT


def _register(name: str, fallback: str = REQUIRED) -> None:
    """Record a private name that is not looked up here (importing it would cost seconds,
    or it is an attribute of instances made elsewhere); tests/test_compat.py checks it."""
    PRIVATE_NAMES[name] = fallback


def _private(*paths: str, fallback: str = REQUIRED) -> Any:
    """Look up the first of `paths` that exists; record the name and what it costs to lack.

    Returns the object, or _ABSENT when none exists (callers then use their fallback).
    """
    name = " | ".join(paths)
    PRIVATE_NAMES[name] = fallback
    for path in paths:
        obj = resolve(path)
        if obj is not _ABSENT:
            return obj
    MISSING.append(name)
    return _ABSENT


def _or(obj: Any, default: Any) -> Any:
    return default if obj is _ABSENT else obj


# ---------------------------------------------------------------------------------------
# JAX: primitives and their rules (PytreePrimitive, torch_call_p, the JVP splits)
# ---------------------------------------------------------------------------------------

# Whether a bind would only evaluate (no trace active): PytreePrimitive's eager fast path.
_trace_ctx = _private(
    "jax._src.core.trace_ctx", fallback="every eager call goes through Primitive.bind (slower)"
)
_EvalTrace = _private(
    "jax._src.core.EvalTrace", fallback="every eager call goes through Primitive.bind (slower)"
)


if _trace_ctx is not _ABSENT and _EvalTrace is not _ABSENT:

    def at_top_level() -> bool:
        """Whether no JAX transformation or trace is active (binding would just evaluate)."""
        return type(_trace_ctx.trace) is _EvalTrace

else:

    def at_top_level() -> bool:
        """Unknown without JAX's trace context: say no, and let JAX dispatch every call."""
        return False


# Inside shard_map, operands that vary over different manual mesh axes must be cast to vary
# over all of them before a bind (JAX's own primitives do it). JAX 0.8 called it
# standard_insert_pvary.
_auto_insert_reshard = _private(
    "jax._src.core.auto_insert_reshard",
    "jax._src.core.standard_insert_pvary",
    fallback="under shard_map, calls whose operands vary over different manual axes fail",
)


def _no_reshard(*operands: Any) -> Any:
    return operands


# How an aval records the manual mesh axes it varies over: `mat` (with `.varying`) in JAX
# 0.10, `vma` (a frozenset) in JAX 0.8.
_private(
    "jax._src.core.ShapedArray.mat",
    "jax._src.core.ShapedArray.vma",
    fallback="outputs inside shard_map are typed as not varying over manual axes",
)
_HAS_MAT = resolve("jax._src.core.ShapedArray.mat") is not _ABSENT
_HAS_VMA = not _HAS_MAT and resolve("jax._src.core.ShapedArray.vma") is not _ABSENT


def varying_manual_axes(aval: Any) -> frozenset:
    """The manual mesh axes (inside shard_map) whose devices hold different values."""
    if _HAS_MAT:
        mat = getattr(aval, "mat", None)
        return mat.varying if mat is not None else frozenset()
    if _HAS_VMA:
        return getattr(aval, "vma", frozenset())
    return frozenset()


def manual_axes_of(aval: Any) -> dict:
    """ShapedArray keyword arguments that make a new aval vary over the axes `aval` does."""
    if _HAS_MAT:
        return {"manual_axis_type": aval.mat}
    if _HAS_VMA:
        return {"vma": aval.vma}
    return {}


_set_current_trace = _private(
    "jax.extend.core.set_current_trace", "jax._src.core.set_current_trace"
)
_apply_primitive = _private(
    "jax._src.dispatch.apply_primitive",
    fallback="a PytreePrimitive with a lowering but no impl runs eagerly via jax.jit (slower)",
)


# JAX 0.8 passes some constants to rules as a TypedNdArray, a numpy array that is not an
# np.ndarray (by JAX 0.10 it is one). Each counts as array data wherever it may show.
_typed_ndarray = _private(
    "jax._src.literals.TypedNdArray",
    fallback="none needed: JAX versions without it pass np.ndarray constants",
)
HOST_ARRAY_TYPES: tuple[type, ...] = (np.ndarray,)
if _typed_ndarray is not _ABSENT and not issubclass(_typed_ndarray, np.ndarray):
    HOST_ARRAY_TYPES += (_typed_ndarray,)
# What a pytree leaf that is array data can be (a tuple: isinstance's fastest form).
ARRAY_TYPES: tuple[type, ...] = (jax.Array, *HOST_ARRAY_TYPES, jax.core.Tracer)


def _jit_apply_primitive(prim: Any, *operands: Any, **params: Any) -> Any:
    return jax.jit(lambda *xs: prim.bind(*xs, **params))(*operands)


# Stand-ins for jax._src.core and jax._src.dispatch: only what torchjax uses.
core = types.SimpleNamespace(
    Primitive=jax.extend.core.Primitive,
    Var=jax.extend.core.Var,
    Tracer=jax.core.Tracer,
    ShapedArray=jax.core.ShapedArray,
    typeof=jax.typeof,
    auto_insert_reshard=_or(_auto_insert_reshard, _no_reshard),
    set_current_trace=_set_current_trace,
)
dispatch = types.SimpleNamespace(apply_primitive=_or(_apply_primitive, _jit_apply_primitive))

# Rule tables and autodiff types. jax.interpreters re-exports them; JAX has been removing
# names from there, so the jax._src original is the alternative.
ad = types.SimpleNamespace(
    primitive_jvps=_private(
        "jax.interpreters.ad.primitive_jvps", "jax._src.interpreters.ad.primitive_jvps"
    ),
    primitive_transposes=_private(
        "jax.interpreters.ad.primitive_transposes",
        "jax._src.interpreters.ad.primitive_transposes",
    ),
    Zero=_private("jax.interpreters.ad.Zero", "jax._src.interpreters.ad.Zero"),
    is_undefined_primal=_private(
        "jax.interpreters.ad.is_undefined_primal",
        "jax._src.interpreters.ad.is_undefined_primal",
    ),
)

# Direct linearization (JAX's LinearizeTrace: grad, vjp, linearize): a primitive's own rule
# replaces JAX's fallback, which traces the JVP rule into a jaxpr, partially evaluates and
# prunes it on every call. The rule's calling convention changed twice: JAX 0.8 passes the
# nonzero mask and the primals; later ones an is_vjp flag first; JAX 0.11 takes structured
# residuals back too (none here), passed to the linearized function before the tangents.
_SLOWER_LINEARIZE = "JAX's own linearization of the JVP rule (slower reverse mode)"
_linearizations = _private(
    "jax._src.interpreters.ad.primitive_linearizations", fallback=_SLOWER_LINEARIZE
)
_fallback_linearize = _private(
    "jax._src.interpreters.ad.fallback_linearize_rule", fallback=_SLOWER_LINEARIZE
)
_LinearizeTrace = _private("jax._src.interpreters.ad.LinearizeTrace", fallback=_SLOWER_LINEARIZE)


def _linearize_convention() -> str | None:
    if _ABSENT in (_linearizations, _fallback_linearize, _LinearizeTrace):
        return None
    try:
        names = list(inspect.signature(_fallback_linearize).parameters)
    except (TypeError, ValueError):
        return None
    if names[:3] == ["_prim", "_nonzeros", "primals"]:
        return "nonzeros"
    if names[:3] != ["_prim", "_is_vjp", "_nonzeros"]:
        return None
    structured = "structured_residuals" in getattr(_LinearizeTrace, "__annotations__", {})
    return "structured" if structured else "is_vjp"


LINEARIZE_CONVENTION = _linearize_convention()


def register_linearization(primitive: Any, rule: Any) -> bool:
    """Register `rule` as `primitive`'s direct linearization; False where JAX has none.

    ``rule(is_vjp, nonzeros, *primals, **params)`` returns ``(outputs, output_nonzeros,
    residuals, linearized)``, with ``linearized(residuals, *tangents)`` the output tangents,
    or None to leave this call to JAX's fallback. `is_vjp` says whether the linear half will
    be transposed (grad, vjp) or applied forward (linearize); None where JAX does not say.
    """
    convention = LINEARIZE_CONVENTION
    if convention is None:
        return False
    fallback = functools.partial(_fallback_linearize, primitive)

    def lin(*args: Any, **params: Any) -> Any:
        is_vjp, (nonzeros, *primals) = (
            (None, args) if convention == "nonzeros" else (args[0], args[1:])
        )
        found = rule(is_vjp, nonzeros, *primals, **params)
        if found is None:
            return fallback(*args, **params)
        if convention != "structured":
            return found
        out, nonzeros_out, residuals, linearized = found
        return out, nonzeros_out, residuals, None, lambda r, _, *t: linearized(r, *t)

    _linearizations[primitive] = lin
    return True


batching = types.SimpleNamespace(
    primitive_batchers=_private(
        "jax.interpreters.batching.primitive_batchers",
        "jax._src.interpreters.batching.primitive_batchers",
    ),
)
mlir = types.SimpleNamespace(
    register_lowering=_private(
        "jax.interpreters.mlir.register_lowering", "jax._src.interpreters.mlir.register_lowering"
    ),
    lower_fun=_private("jax.interpreters.mlir.lower_fun", "jax._src.interpreters.mlir.lower_fun"),
)
# The JVP splits (_rule_partial_eval.py): partial-evaluation rules, and remat policy results.
partial_eval = types.SimpleNamespace(
    custom_partial_eval_rules=_private(
        "jax.interpreters.partial_eval.custom_partial_eval_rules",
        "jax._src.interpreters.partial_eval.custom_partial_eval_rules",
    ),
    partial_eval_jaxpr_custom_rules=_private(
        "jax.interpreters.partial_eval.partial_eval_jaxpr_custom_rules",
        "jax._src.interpreters.partial_eval.partial_eval_jaxpr_custom_rules",
    ),
    ensure_enum=_private("jax._src.interpreters.partial_eval.ensure_enum"),
    RecomputeType=_private("jax._src.interpreters.partial_eval.RecomputeType"),
    # Only named in a type annotation.
    JaxprTrace=_or(resolve("jax._src.interpreters.partial_eval.JaxprTrace"), Any),
)

# ---------------------------------------------------------------------------------------
# JAX and jaxlib: the x64 flag, DLPack, arrays' devices (_convert.py, _torch_call.py)
# ---------------------------------------------------------------------------------------

# Whether an array was placed on its device explicitly, and a single-device sharding's
# device: read without building the sharding's device set.
_private("jax._src.lib._jax.ArrayImpl._committed")
array_committed = operator.attrgetter("_committed")
_private("jax.sharding.SingleDeviceSharding._device")
sharding_device = operator.attrgetter("_device")


class _PublicX64:
    """jax.config's public view of the x64 flag (thread-local contexts included)."""

    @property
    def value(self) -> bool:
        return bool(jax.config.jax_enable_x64)


# The flag's state object: read on every conversion, it is cheaper than jax.config.
jax_config = types.SimpleNamespace(
    enable_x64=_or(
        _private("jax._src.config.enable_x64", fallback="jax.config.jax_enable_x64 (slower)"),
        _PublicX64(),
    )
)

_DLPACK_SLOW = "jax.dlpack and jax.Array.__dlpack__ (about 10 µs more per conversion)"
_dlpack_import = _private(
    "jax._src.lib._jax.dlpack_managed_tensor_to_buffer", fallback="jax.dlpack.from_dlpack"
)
# jaxlib's DLPack export of a single-device array, and the type it applies to; None (and a
# type nothing has) where missing, so callers take jax.Array.__dlpack__.
dlpack_export = _or(
    _private("jax._src.lib._jax.buffer_to_dlpack_managed_tensor", fallback=_DLPACK_SLOW), None
)


class _NoArray:
    """A type no array has: `type(a) is ArrayImpl` is then always False."""


ArrayImpl = _or(_private("jax._src.lib._jax.ArrayImpl", fallback=_DLPACK_SLOW), _NoArray)

_DL_CPU = 1  # DLPack's kDLCPU (dlpack.h)


class _CpuImport:
    """jaxlib's DLPack import of CPU tensors, in whichever signature this jaxlib has.

    ``(capsule, device, stream)`` in jaxlib 0.8.0, ``copy`` added by 0.8.2, and
    ``dl_device_type`` by 0.10. Which form works is found on the first call (not at import:
    that would start JAX's backends) and kept; with none, jax.dlpack.from_dlpack does it.
    """

    def __init__(self) -> None:
        # The trailing arguments of each form, newest first.
        self.forms = [(None, None, _DL_CPU), (None, None), (None,)]
        if _dlpack_import is _ABSENT:
            self.forms = []

    def __call__(self, t: torch.Tensor, device: Any) -> jax.Array:
        while self.forms:
            capsule = torch.utils.dlpack.to_dlpack(t)
            try:
                return _dlpack_import(capsule, device, *self.forms[0])
            except TypeError as e:
                # nanobind's message for a call that matches no signature (the capsule was
                # not consumed): try the next form.
                if "incompatible function arguments" not in str(e):
                    raise
                self.forms.pop(0)
        return jax.dlpack.from_dlpack(t, device=device)


# `cpu_array_from_tensor(t, device)`: a contiguous, 64-byte aligned CPU tensor as a JAX
# array on `device`, zero-copy.
cpu_array_from_tensor = _CpuImport()

# ---------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------

# A DLPack capsule as a tensor without torch.utils.dlpack's Python wrapper and type checks.
tensor_from_capsule = _or(
    _private("torch._C._from_dlpack", fallback="torch.utils.dlpack.from_dlpack (slower)"),
    torch.utils.dlpack.from_dlpack,
)

# Grad mode, set without the context-manager object torch.set_grad_enabled builds.
set_grad_enabled = _or(
    _private("torch._C._set_grad_enabled", fallback="torch.set_grad_enabled (slower)"),
    torch.set_grad_enabled,
)

# A tensor's version counter: it moves on every in-place write, which is how in-place
# modification of an input is detected. No public API exposes it.
_private("torch.Tensor._version")
tensor_version = operator.attrgetter("_version")

# torch.func may return a lazy ZeroTensor, which has no storage for DLPack.
_private("torch.Tensor._is_zerotensor")
is_zerotensor = operator.methodcaller("_is_zerotensor")


# functorch's interpreter stack: which torch.func transforms are active, and whether a
# tensor is one of their wrappers (batched or grad-tracking).
is_functorch_wrapped = _private("torch._C._functorch.is_functorch_wrapped_tensor")
_transforms_active = _private(
    "torch._C._are_functorch_transforms_active",
    fallback="torch calls from to_torch always go through autograd.Function (slower)",
)
# None where missing: _derivative then assumes an enclosing transform (the safe answer).
peek_interpreter_stack = _or(
    _private(
        "torch._C._functorch.peek_interpreter_stack",
        fallback="derivatives are built to be differentiable again (slower)",
    ),
    None,
)


def functorch_transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) is running."""
    return True if _transforms_active is _ABSENT else _transforms_active()


_private(
    "torch.autograd.forward_ad._current_level",
    fallback="torch calls from to_torch always go through autograd.Function (slower)",
)


def forward_ad_active() -> bool:
    """Whether a torch.autograd.forward_ad dual level is open (a module global, read each
    time; where it is missing, assume one is)."""
    return getattr(_forward_ad, "_current_level", 0) >= 0


# Leaves functorch's interpreter stack for a moment (setting generator state inside a
# torch.func transform must not be intercepted by it).
DisableFuncTorch = _private("torch._C._DisableFuncTorch")

# The steps torch.func.vmap is made of, called without its Python wrapper (_batching.py).
_VMAP_STEPS = {
    name: _private(
        f"torch._functorch.predispatch.{name}",
        fallback="torch.func.vmap itself (tens of µs more per batched call)",
    )
    for name in (
        "_add_batch_dim",
        "_remove_batch_dim",
        "_vmap_increment_nesting",
        "_vmap_decrement_nesting",
        "lazy_load_decompositions",
    )
}
FAST_VMAP = all(f is not _ABSENT for f in _VMAP_STEPS.values())
vmap_add_batch_dim = _VMAP_STEPS["_add_batch_dim"]
vmap_remove_batch_dim = _VMAP_STEPS["_remove_batch_dim"]
vmap_increment_nesting = _VMAP_STEPS["_vmap_increment_nesting"]
vmap_decrement_nesting = _VMAP_STEPS["_vmap_decrement_nesting"]
vmap_lazy_load_decompositions = _VMAP_STEPS["lazy_load_decompositions"]

# Fake tensors: output shapes without data (_fake_run.py, _module_to_jax.py, _convert.py).
fake_tensor = _private("torch._subclasses.fake_tensor")
FakeTensorMode = _private("torch._subclasses.fake_tensor.FakeTensorMode")
is_fake = _private("torch._subclasses.fake_tensor.is_fake")
unset_fake_temporarily = _private("torch._subclasses.fake_tensor.unset_fake_temporarily")
detect_fake_mode = _private("torch._guards.detect_fake_mode")
# The fake machinery's own exceptions (a real run may succeed where these stop a fake
# one); whichever this torch defines. Not registered: each is optional by design, and
# error messages are matched as well.
FAKE_LIMIT_ERRORS = tuple(
    getattr(fake_tensor, name)
    for name in (
        "DataDependentOutputException",
        "DynamicOutputShapeException",
        "UnsupportedOperatorException",
        "UnsupportedFakeTensorException",
        "FakeTensorDeviceMismatchError",
        "MetadataMismatchError",
    )
    if fake_tensor is not _ABSENT and hasattr(fake_tensor, name)
)

# torch's pytree registry: containers torch knows and JAX does not (_outputs.py).
torch_pytree = _private("torch.utils._pytree")
for _name in ("SUPPORTED_NODES", "MappingKey", "GetAttrKey"):
    _private(f"torch.utils._pytree.{_name}")
is_structseq_class = _private("torch.utils._pytree.is_structseq_class")

# torch.compile: the original module or function inside a compiled one. Looking these up
# would import torch._dynamo (seconds); the test does.
_UNWRAP = "compiled modules and functions are fake-run as compiled (which may fail)"
_register("torch._dynamo.eval_frame.OptimizedModule", _UNWRAP)
_register("torch._dynamo.eval_frame.OptimizedModule()._orig_mod", _UNWRAP)
_register("torch.compile(function)._torchdynamo_orig_callable", _UNWRAP)


def compiled_original(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module inside a ``torch.compile``'d one (an OptimizedModule), or None."""
    # Only a program that imported torch._dynamo can hold an OptimizedModule: looking it up
    # in sys.modules avoids importing dynamo (seconds) for every other module.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is not None and isinstance(module, optimized):
        return module._orig_mod
    return None


_register(
    "torch._dynamo.eval_frame.OptimizedModule().dynamo_ctx",
    "module_to_jax of a compiled module: calls run the module uncompiled",
)


def compiled_context(compiled: torch.nn.Module) -> Any:
    """The compile context of a torch.compile'd module: with the module's class, it compiles
    another module the same way (`type(compiled)(other, context)`)."""
    return getattr(compiled, "dynamo_ctx", None)


def compiled_function_original(fn: Any) -> Any:
    """What torch.compile compiled: the original function or module, or None."""
    orig = getattr(fn, "_torchdynamo_orig_callable", None)
    if orig is not None:
        return orig
    mod = getattr(fn, "_orig_mod", None)
    return mod if isinstance(mod, torch.nn.Module) else None


# torch.nn.utils.parametrize.cached()'s cache: keyed by the id of the module a
# parametrization was registered on, which every copy of that module shares (the key lives
# in a closure of the class's property). Read each time: cached() replaces the dict.
import torch.nn.utils.parametrize as _parametrize  # noqa: E402

_private("torch.nn.utils.parametrize._cache")
_private("torch.nn.utils.parametrize._cache_enabled")


def parametrize_cache() -> dict | None:
    """parametrize.cached()'s cache while one is open, else None."""
    return _parametrize._cache if _parametrize._cache_enabled else None


# nn.Module's own dicts of parameters, buffers and submodules: assigning entries there is
# what setattr does, minus its checks.
_private("torch.nn.Module()._parameters")
_private("torch.nn.Module()._buffers")
_private("torch.nn.Module()._modules")
module_parameters = operator.attrgetter("_parameters")
module_buffers = operator.attrgetter("_buffers")
module_children = operator.attrgetter("_modules")

# The in-place guard (_guard.py, _call_plan.py, _rule_lowering.py): dispatch modes, and who
# shares a tensor's storage.
TorchDispatchMode = _private("torch.utils._python_dispatch.TorchDispatchMode")
# Every later write into the storage raises before it happens (torch's mark for fake ones).
set_throw_on_mutable_data_ptr = _private("torch._C._set_throw_on_mutable_data_ptr")
storage_use_count = _private("torch._C._storage_Use_Count")  # users of a storage id
storage_id = _private("torch._C._storage_id")  # a tensor's storage, as an id (no object)
_private("torch.UntypedStorage._cdata")
storage_cdata = operator.attrgetter("_cdata")  # an UntypedStorage's id
_private("torch.Tensor._use_count")
tensor_use_count = operator.methodcaller("_use_count")  # references to the TensorImpl
_private("torch.Tensor._is_view")
is_view = operator.methodcaller("_is_view")
_private("torch.Tensor._base")
tensor_base = operator.attrgetter("_base")
_private("torch.ops.aten.add.Tensor._schema")
op_schema = operator.attrgetter("_schema")  # an OpOverload's schema (arguments, aliasing)

# ---------------------------------------------------------------------------------------

_required_missing = [name for name in MISSING if PRIVATE_NAMES[name] == REQUIRED]
if _required_missing:
    raise ImportError(
        f"torchjax cannot run with jax {jax.__version__} and torch {torch.__version__}: it "
        f"needs {', '.join(_required_missing)}, which they lack. Install versions from the "
        f"table in docs/install.md (pip install torchjax picks them)."
    )

del _name
