# The torch half of the private names: functorch's levels and vmap steps, fake tensors,
# version counters and storages (the in-place guard), torch.compile's originals, nn.Module's
# own dicts, torch's pytree registry, and the DLPack calls between torch and jaxlib.
#
# Each name is looked up by feature detection, not by version number (see _registry.py and
# _jax.py's banner).
from __future__ import annotations

import builtins
import contextlib
import functools
import importlib
import io
import logging
import operator
import sys
import threading
from typing import Any

import jax
import torch
import torch.autograd.forward_ad as _forward_ad
import torch.utils.dlpack

from torchjax._compat._jax import dlpack_import
from torchjax._compat._messages import matches_no_signature
from torchjax._compat._registry import (
    ABSENT,
    check_required,
    or_,
    private,
    register,
)

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
        if dlpack_import is ABSENT:
            self.forms = []
        self.form: tuple | None = None  # the one that worked

    def __call__(self, t: torch.Tensor, device: Any) -> jax.Array:
        form = self.form
        if form is not None:
            return dlpack_import(_to_capsule(t), device, *form)
        while self.forms:
            capsule = _to_capsule(t)
            try:
                out = dlpack_import(capsule, device, *self.forms[0])
            except TypeError as e:
                if not matches_no_signature(e):  # the capsule was not consumed: next form
                    raise
                self.forms.pop(0)
            else:
                self.form = self.forms[0]
                return out
        return jax.dlpack.from_dlpack(t, device=device)


_to_capsule = torch.utils.dlpack.to_dlpack
tensor_to_capsule = _to_capsule  # a tensor as a DLPack capsule (torch._C._to_dlpack)


# `cpu_array_from_tensor(t, device)`: a contiguous, 64-byte aligned CPU tensor as a JAX
# array on `device`, zero-copy.
cpu_array_from_tensor = _CpuImport()

# ---------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------

# A DLPack capsule as a tensor without torch.utils.dlpack's Python wrapper and type checks.
tensor_from_capsule = or_(
    private("torch._C._from_dlpack", fallback="torch.utils.dlpack.from_dlpack (slower)"),
    torch.utils.dlpack.from_dlpack,
)

# The autograd graph task running on this thread (-1: none): a tensor hook asks it to act
# in one backward only, not in a backward nested inside (an adjoint solver's own grads).
current_graph_task_id = or_(
    private(
        "torch._C._current_graph_task_id",
        fallback="a jitted VJP copies its gradients after the backward (more peak memory)",
    ),
    None,
)

# Grad mode, set without the context-manager object torch.set_grad_enabled builds.
set_grad_enabled = or_(
    private("torch._C._set_grad_enabled", fallback="torch.set_grad_enabled (slower)"),
    torch.set_grad_enabled,
)

# A tensor's version counter: it moves on every in-place write, which is how in-place
# modification of an input is detected. No public API exposes it.
private("torch.Tensor._version")
tensor_version = operator.attrgetter("_version")

# torch.func may return a lazy ZeroTensor, which has no storage for DLPack.
# Unbound methods, called as is_zerotensor(t): a third of operator.methodcaller's cost.
is_zerotensor = private("torch.Tensor._is_zerotensor")


# functorch's interpreter stack: which torch.func transforms are active, and whether a
# tensor is one of their wrappers (batched or grad-tracking).
is_functorch_wrapped = private("torch._C._functorch.is_functorch_wrapped_tensor")
_transforms_active = private(
    "torch._C._are_functorch_transforms_active",
    fallback="torch calls from to_torch always go through autograd.Function (slower)",
)
# None where missing: _derivative then assumes an enclosing transform (the safe answer).
peek_interpreter_stack = or_(
    private(
        "torch._C._functorch.peek_interpreter_stack",
        fallback="derivatives are built to be differentiable again (slower)",
    ),
    None,
)


# torch.func's transforms set aside for a while (their levels popped, then pushed back): a
# fake run finds a function's output types from avals, which no enclosing transform takes
# part in; under one (to_torch traced inside torch.func.grad) its tensors came out wrapped.
interpreter_stack_cleared = or_(
    private(
        "torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack",
        fallback="a fake run inside torch.func.grad or jvp fails (TensorWrapper)",
    ),
    contextlib.nullcontext,
)


def functorch_transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) is running."""
    return True if _transforms_active is ABSENT else _transforms_active()


# What autograd.Function.apply does outside torch.func transforms, without its per-call
# inspect.signature bind (about as slow as the rest of a small to_torch call): drop dead
# functorch wrappers, then the C++ entry point. None where either is missing.
_unwrap_dead = private(
    "torch._functorch.utils.unwrap_dead_wrappers",
    fallback="to_torch's autograd.Function binds its arguments with inspect.signature (slower)",
)
_base_apply = private(
    "torch._C._FunctionBase.apply",
    fallback="to_torch's autograd.Function binds its arguments with inspect.signature (slower)",
)


def _plain_function_apply(cls: type, args: tuple) -> Any:
    """``cls.apply(*args)`` for an autograd.Function whose forward has no default arguments,
    while no torch.func transform is active (the caller checks)."""
    # super() past Function: _FunctionBase.apply, the C++ entry point Function.apply calls.
    return super(torch.autograd.Function, cls).apply(*_unwrap_dead(args))


plain_function_apply = None if ABSENT in (_unwrap_dead, _base_apply) else _plain_function_apply

# What autograd.Function.apply calls inside torch.func transforms; a TorchFunctionMode sees
# it as the function called (_callables/_batched_kept.py watches for it). None where missing.
custom_function_call = or_(
    private(
        "torch._functorch.autograd_function.custom_function_call",
        fallback="jax.vmap of a gradient runs the forward twice (once more in its VJP)",
    ),
    None,
)


private(
    "torch.autograd.forward_ad._current_level",
    fallback="torch calls from to_torch always go through autograd.Function (slower)",
)


def forward_ad_active() -> bool:
    """Whether a torch.autograd.forward_ad dual level is open (a module global, read each
    time; where it is missing, assume one is)."""
    return getattr(_forward_ad, "_current_level", 0) >= 0


# For a shortcut that asks both without a Python frame: the C function behind
# functorch_transforms_active, and forward_ad_active's read of the open dual level (-1:
# none) as a C call; None where missing (the shortcut then takes the full way).
transforms_active_c = None if _transforms_active is ABSENT else _transforms_active
forward_ad_level = (
    functools.partial(getattr, _forward_ad, "_current_level")
    if hasattr(_forward_ad, "_current_level")
    else None
)


# make_fx's proxy mode (torch.func.linearize, torch.fx tracing in real mode): its tensors are
# plain ones, and a call that ran JAX on them would be recorded as a constant.
_get_dispatch_mode = private("torch._C._get_dispatch_mode")
_PROXY_KEY = private("torch._C._TorchDispatchModeKey.PROXY")


# make_fx's proxy mode, or None, as one C call (a shortcut asks ``proxy_mode() is not
# None``); where torch lacks the query, a stand-in that answers as if it were set.
proxy_mode = (
    (lambda: True)
    if _get_dispatch_mode is ABSENT or _PROXY_KEY is ABSENT
    else functools.partial(_get_dispatch_mode, _PROXY_KEY)
)


def proxy_mode_active() -> bool:
    """Whether make_fx is tracing (its proxy dispatch mode is set); where torch lacks the
    query, assume so (the call then goes through the custom op, which is always right)."""
    return proxy_mode() is not None


_FAKE_KEY = private("torch._C._TorchDispatchModeKey.FAKE")


def fake_mode_active() -> bool:
    """Whether a FakeTensorMode is set on this thread (torch computes without data)."""
    return _get_dispatch_mode(_FAKE_KEY) is not None


# Whether torch.jit.trace is recording (its tracing state, None when not): the C call
# behind torch.jit.is_tracing, without its Python frame.
jit_tracing = or_(
    private("torch._C._get_tracing_state", fallback="torch.jit.is_tracing (slower)"),
    torch.jit.is_tracing,
)

# Leaves functorch's interpreter stack for a moment (setting generator state inside a
# torch.func transform must not be intercepted by it).
DisableFuncTorch = private("torch._C._DisableFuncTorch")

# The steps torch.func.vmap is made of, called without its Python wrapper (_batching.py).
# (Each written out in full: tests/test_compat.py reads the names from this source.)
_NO_FAST_VMAP = "torch.func.vmap itself (tens of µs more per batched call)"
vmap_add_batch_dim = private("torch._functorch.predispatch._add_batch_dim", fallback=_NO_FAST_VMAP)
vmap_remove_batch_dim = private(
    "torch._functorch.predispatch._remove_batch_dim", fallback=_NO_FAST_VMAP
)
vmap_increment_nesting = private(
    "torch._functorch.predispatch._vmap_increment_nesting", fallback=_NO_FAST_VMAP
)
vmap_decrement_nesting = private(
    "torch._functorch.predispatch._vmap_decrement_nesting", fallback=_NO_FAST_VMAP
)
vmap_lazy_load_decompositions = private(
    "torch._functorch.predispatch.lazy_load_decompositions", fallback=_NO_FAST_VMAP
)
FAST_VMAP = ABSENT not in (
    vmap_add_batch_dim,
    vmap_remove_batch_dim,
    vmap_increment_nesting,
    vmap_decrement_nesting,
    vmap_lazy_load_decompositions,
)

# torch's legacy vmap (torch._vmap_internals), which torch.autograd.grad(is_grads_batched=
# True), autograd.functional.jacobian/hessian(vectorize=True) and gradcheck's batched checks
# run a backward under: its batched tensors have no storage for DLPack, so to_torch takes the
# batch dimension off, calls the jax.vmap'ed function and puts it back (_spec.py).
_NO_LEGACY_VMAP = "to_torch under torch's legacy vmap (vectorize=True, is_grads_batched) fails"
is_legacy_batched = private("torch._C._functorch.is_legacy_batchedtensor", fallback=_NO_LEGACY_VMAP)
legacy_add_batch_dim = private("torch._add_batch_dim", fallback=_NO_LEGACY_VMAP)
legacy_remove_batch_dim = private("torch._remove_batch_dim", fallback=_NO_LEGACY_VMAP)
_legacy_enter = private("torch._C._vmapmode_increment_nesting", fallback=_NO_LEGACY_VMAP)
_legacy_leave = private("torch._C._vmapmode_decrement_nesting", fallback=_NO_LEGACY_VMAP)
LEGACY_VMAP = ABSENT not in (
    is_legacy_batched,
    legacy_add_batch_dim,
    legacy_remove_batch_dim,
    _legacy_enter,
    _legacy_leave,
)


def legacy_vmap_level() -> int:
    """How many legacy vmaps are running (0: none); the innermost one's level. Torch has no
    getter: entering one more returns the level it would have."""
    level = _legacy_enter()
    _legacy_leave()
    return level - 1


# torch.autocast's state on this thread, which a call takes where it is traced (eagerly:
# called) and runs its torch code in (_callables.UserFunction, _torch_call/_lowering.py).
_any_autocast = private("torch._C._is_any_autocast_enabled", fallback="autocast read per device")
AUTOCAST_DEVICES = ("cpu", "cuda")


def _any_autocast_by_device() -> bool:
    return any(torch.is_autocast_enabled(d) for d in AUTOCAST_DEVICES)


any_autocast = _any_autocast_by_device if _any_autocast is ABSENT else _any_autocast


def autocast_state() -> tuple:
    """``((device_type, dtype), ...)`` for each device type autocast is on for here, with
    its cache flag last; () where it is off for all (one C call: the common case)."""
    if not any_autocast():
        return ()
    on = tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES)
    on = tuple((d, dtype) for d, dtype in on if torch.is_autocast_enabled(d))
    return (*on, torch.is_autocast_cache_enabled()) if on else ()


@contextlib.contextmanager
def autocast_as(state: tuple) -> Any:
    """Run with autocast exactly as `state` says (autocast_state's form): on for its
    devices, off for every other one on which it is on here."""
    with contextlib.ExitStack() as stack:
        wanted = dict(state[:-1]) if state else {}
        for d in AUTOCAST_DEVICES:
            if d not in wanted and torch.is_autocast_enabled(d):
                stack.enter_context(torch.autocast(d, enabled=False))
        for d, dtype in wanted.items():
            stack.enter_context(torch.autocast(d, dtype=dtype, cache_enabled=state[-1]))
        yield


# Whether a tensor is batched at the innermost vmap level, from inside the vmapped function:
# which outputs of a batched call stay unbatched (jax.vmap's out_axes=None,
# _callables/_batched.py).
# A wrapper's level says which transform made it; one from an outer level is not batched
# here. Without these names every output counts as batched (broadcast, as before).
_NO_UNBATCHED = "every output of a batched call batched (out_axes=None refused)"
_current_level = private("torch._C._functorch.maybe_current_level", fallback=_NO_UNBATCHED)
_level_of = private("torch._C._functorch.maybe_get_level", fallback=_NO_UNBATCHED)
FINDS_UNBATCHED = ABSENT not in (_current_level, _level_of)


def batched_here(t: Any) -> bool:
    """Whether `t` (a function's output, inside torch.func.vmap) is batched at this level."""
    if not FINDS_UNBATCHED:
        return True
    if not isinstance(t, torch.Tensor):
        return False  # a Python number
    level = _current_level()
    return level is not None and _level_of(t) == level


# torch operators (torch.ops.aten.sin, a torch.library.custom_op), named in messages by
# their own names ("aten.sin.default", "mylib::op") rather than their Python classes'.
_NO_OP_NAME = "messages name a torch operator by its class"
_OP_OVERLOAD = private("torch._ops.OpOverload", fallback=_NO_OP_NAME)
_OPERATOR_TYPES = tuple(
    t
    for t in (
        _OP_OVERLOAD,
        private("torch._ops.OpOverloadPacket", fallback=_NO_OP_NAME),
        private("torch._library.custom_ops.CustomOpDef", fallback=_NO_OP_NAME),
    )
    if t is not ABSENT
)


def operator_name(fn: Any) -> str | None:
    """A torch operator's own name, or None for anything else."""
    if not isinstance(fn, _OPERATOR_TYPES):
        return None
    return str(getattr(fn, "_qualname", None) or fn)  # a custom op's "namespace::name"


# lowering="xla" (_to_jax/_xla/): a graph node's target is an ATen or custom op (an
# OpOverload), a higher-order op (control flow, which it cannot lower) or a Python function;
# torch's global decomposition tables, which torchax's import writes into and the loader
# puts back.
_NO_LOWERING = 'lowering="xla" cannot tell ops from other graph nodes (it refuses to run)'
_HIGHER_ORDER = private("torch._ops.HigherOrderOperator", fallback=_NO_LOWERING)
DECOMPOSITION_TABLES = or_(
    private(
        "torch._decomp.global_decomposition_table",
        fallback="torchax's import leaves its decompositions in torch's global table",
    ),
    {},
)


@contextlib.contextmanager
def device_registration_refused() -> Any:
    """Within: renaming torch's privateuse1 backend and registering a device module do
    nothing. torchax's import does both (to "jax"), which torch allows once per process and
    which break torch.compile afterwards ("PyTorch is not linked with support for jax
    devices"); lowering uses none of what they enable."""
    saved = torch.utils.rename_privateuse1_backend, torch._register_device_module
    torch.utils.rename_privateuse1_backend = lambda *args, **kwargs: None
    torch._register_device_module = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.utils.rename_privateuse1_backend, torch._register_device_module = saved


def is_op_overload(target: Any) -> bool:
    """Whether a graph node's target is one overload of a torch operator."""
    return _OP_OVERLOAD is not ABSENT and isinstance(target, _OP_OVERLOAD)


def is_custom_op_autograd(cls: type) -> bool:
    """Whether an autograd.Function class is torch.library's wrapper of a custom op (its
    forward runs the op itself: the op's one graph node)."""
    return (getattr(cls, "__module__", "") or "").startswith("torch._library.")


def is_higher_order_op(target: Any) -> bool:
    """Whether a graph node's target is a higher-order op (torch.cond, a wrapped subgraph)."""
    return _HIGHER_ORDER is not ABSENT and isinstance(target, _HIGHER_ORDER)


# Whether a torch.profiler (or autograd profiler) records now: torchjax's ranges are entered
# only then (_log.py). Without it, no range is ever recorded.
profiler_enabled = or_(
    private("torch.autograd._profiler_enabled", fallback="torch.profiler shows no torchjax ranges"),
    lambda: False,
)


# Fake tensors: output shapes without data (_fake/_run.py, _module_to_jax.py, _convert.py).
FakeTensorMode = private("torch._subclasses.fake_tensor.FakeTensorMode")
is_fake = private("torch._subclasses.fake_tensor.is_fake")
unset_fake_temporarily = private("torch._subclasses.fake_tensor.unset_fake_temporarily")
detect_fake_mode = private("torch._guards.detect_fake_mode")
_disable_current_modes = private(
    "torch.utils._python_dispatch._disable_current_modes",
    fallback="a module first imported inside a fake run builds its tensors as fakes (refused)",
)


# torch's loggers that speak while torch.export captures (a data-dependent guard's "Unable
# to find user code"), above the torchjax error that says the same.
_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export")


@contextlib.contextmanager
def export_silenced() -> Any:
    """Within (a torch.export capture): torch's export loggers are silent, and what torch
    prints to stderr (a failed capture's partial FX graph) goes to the StringIO yielded."""
    loggers = [logging.getLogger(n) for n in _EXPORT_LOGGERS]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.CRITICAL)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield printed
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)


@contextlib.contextmanager
def imports_outside_fakes() -> Any:
    """Within (a fake run, a capture): an import runs outside torch's dispatch modes, so a
    module first imported there (an `import` inside forward) builds its module-level
    tensors real, as anywhere else, not as fakes the run would leave behind."""
    if _disable_current_modes is ABSENT:
        yield
        return
    real_import, real_import_module = builtins.__import__, importlib.import_module

    inside = threading.local()  # (leaving the modes imports too: no second pass)

    def outside(importer: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "active", False):
                return importer(*args, **kwargs)
            inside.active = True
            try:
                with _disable_current_modes():
                    return importer(*args, **kwargs)
            finally:
                inside.active = False

        return run

    ours = builtins.__import__ = outside(real_import)
    ours_module = importlib.import_module = outside(real_import_module)
    try:
        yield
    finally:  # (unless something else replaced them meanwhile)
        if builtins.__import__ is ours:
            builtins.__import__ = real_import
        if importlib.import_module is ours_module:
            importlib.import_module = real_import_module


# The fake machinery's logger: it logs the traceback of every meta kernel that raises,
# which during torchjax's fake runs is an exception torchjax re-raises anyway.
register("torch._subclasses.fake_tensor.log", "meta-kernel failures in fake runs are logged")


def quiet_fake_tensor_log(quiet: Any) -> None:
    """Drop the fake machinery's log records where `quiet()` says so (installed once)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    if not any(getattr(f, "torchjax", False) for f in log.filters):
        record_filter = logging.Filter()
        record_filter.filter = lambda record: not quiet()
        record_filter.torchjax = True
        log.addFilter(record_filter)


# torch's pytree registry: containers torch knows and JAX does not (_call/_outputs.py).
torch_pytree = private("torch.utils._pytree")
private("torch.utils._pytree.SUPPORTED_NODES")
private("torch.utils._pytree.MappingKey")
private("torch.utils._pytree.GetAttrKey")
is_structseq_class = private("torch.utils._pytree.is_structseq_class")

# torch.compile: the original module or function inside a compiled one. Looking these up
# would import torch._dynamo (seconds); the test does.
_UNWRAP = "compiled modules and functions are fake-run as compiled (which may fail)"
register("torch._dynamo.eval_frame.OptimizedModule", _UNWRAP)
register("torch._dynamo.eval_frame.OptimizedModule()._orig_mod", _UNWRAP)
register("torch.compile(function)._torchdynamo_orig_callable", _UNWRAP)


def compiled_original(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module inside a ``torch.compile``'d one (an OptimizedModule), or None."""
    # Only a program that imported torch._dynamo can hold an OptimizedModule: looking it up
    # in sys.modules avoids importing dynamo (seconds) for every other module.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is not None and isinstance(module, optimized):
        return module._orig_mod
    return None


register(
    "torch._dynamo.eval_frame.OptimizedModule().dynamo_ctx",
    "module_to_jax of a compiled module: calls run the module uncompiled",
)


def compiled_context(compiled: torch.nn.Module) -> Any:
    """The compile context of a torch.compile'd module: with the module's class, it compiles
    another module the same way (`type(compiled)(other, context)`)."""
    return getattr(compiled, "dynamo_ctx", None)


# The attributes by which torch.compile's function and module wrappers name their originals.
COMPILED_ORIGINAL_ATTRS = ("_torchdynamo_orig_callable", "_orig_mod")


def compiled_function_original(fn: Any) -> Any:
    """What torch.compile compiled: the original function or module, or None."""
    function_attr, module_attr = COMPILED_ORIGINAL_ATTRS
    orig = getattr(fn, function_attr, None)
    if orig is not None:
        return orig
    mod = getattr(fn, module_attr, None)
    return mod if isinstance(mod, torch.nn.Module) else None


# torch.nn.utils.parametrize.cached()'s cache: keyed by the id of the module a
# parametrization was registered on, which every copy of that module shares (the key lives
# in a closure of the class's property). Read each time: cached() replaces the dict.
import torch.nn.utils.parametrize as _parametrize  # noqa: E402

private("torch.nn.utils.parametrize._cache")
private("torch.nn.utils.parametrize._cache_enabled")


def parametrize_cache() -> dict | None:
    """parametrize.cached()'s cache while one is open, else None."""
    return _parametrize._cache if _parametrize._cache_enabled else None


# nn.Module's own dicts of parameters, buffers and submodules: assigning entries there is
# what setattr does, minus its checks.
private("torch.nn.Module()._parameters")
private("torch.nn.Module()._buffers")
private("torch.nn.Module()._modules")
module_parameters = operator.attrgetter("_parameters")
module_buffers = operator.attrgetter("_buffers")
module_children = operator.attrgetter("_modules")
# What a TorchScript module caches in its Python __dict__ the first time a method of its
# compiled code is looked up (RecursiveScriptModule.__getattr__): a cache, not state.
ScriptMethod = private("torch._C.ScriptMethod")

# The in-place guard (_call/_guard.py, _call/_plan.py, _torch_call/_lowering.py): dispatch
# modes, and who
# shares a tensor's storage.
TorchDispatchMode = private("torch.utils._python_dispatch.TorchDispatchMode")
# Every later write into the storage raises before it happens (torch's mark for fake ones).
set_throw_on_mutable_data_ptr = private("torch._C._set_throw_on_mutable_data_ptr")
storage_use_count = private("torch._C._storage_Use_Count")  # users of a storage id
storage_id = private("torch._C._storage_id")  # a tensor's storage, as an id (no object)
private("torch.UntypedStorage._cdata")
storage_cdata = operator.attrgetter("_cdata")  # an UntypedStorage's id
tensor_use_count = private("torch.Tensor._use_count")  # references to the TensorImpl
is_view = private("torch.Tensor._is_view")
private("torch.Tensor._base")
tensor_base = operator.attrgetter("_base")
private("torch.ops.aten.add.Tensor._schema")
op_schema = operator.attrgetter("_schema")
_KEEP_FAILS = "a jitted function that keeps a reference to its input fails (TorchJaxError)"
_swap_data_ptr = private("torch.UntypedStorage._swap_data_ptr_", fallback=_KEEP_FAILS)


def swap_storage_data(storage: Any, other: Any) -> bool:
    """Make `storage` and `other` trade their memory (False where torch cannot)."""
    if _swap_data_ptr is ABSENT:
        return False
    storage._swap_data_ptr_(other)
    return True  # an OpOverload's schema (arguments, aliasing)


check_required(f"torch {torch.__version__}")


def generator_states(tensors: list[torch.Tensor]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """(generator, state) of torch's default generators that a call on `tensors` may draw
    from: the CPU one, and each CUDA device's among the tensors."""
    states = [(torch.default_generator, torch.default_generator.get_state())]
    for index in {t.device.index for t in tensors if t.device.type == "cuda"}:
        generator = torch.cuda.default_generators[index or 0]
        states.append((generator, generator.get_state()))
    return states


def restore_generators(states: list | None) -> None:
    """Put back the states generator_states took (none where None)."""
    for generator, state in states or ():
        generator.set_state(state)


# The in-place guard's fake runs (_call/_guard.py's WriteGuard) key storages by a weak
# reference that compares equal for one storage: torch's own, from its multiprocessing
# support. Required: nothing public compares storages without holding them.
storage_key = private("torch.multiprocessing.reductions.StorageWeakRef")  # storage -> key

_free_unbacked_symbols = private(
    "torch.fx.experimental.symbolic_shapes.free_unbacked_symbols",
    fallback="lowering='xla' names a value-dependent shape only when a lowering fails on it",
)


def has_value_dependent_size(value: Any) -> bool:
    """Whether a captured tensor's sizes depend on its inputs' values (torch.export's
    unbacked symbols: `x[mask]`, nonzero, unique)."""
    if _free_unbacked_symbols is ABSENT or not isinstance(value, torch.Tensor):
        return False
    try:
        return bool(_free_unbacked_symbols(value.shape))
    except Exception:
        return False
