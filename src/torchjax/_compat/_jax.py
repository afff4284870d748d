# The JAX and jaxlib half of the private names: JAX's primitive machinery and rule tables,
# its partial evaluation, jax.export's table of pytree node names, the x64 flag, arrays'
# devices and jaxlib's DLPack entry points.
# Imports jax only (PytreePrimitive stands on this half alone).
#
# Each name is looked up by feature detection, not by version number (see _registry.py):
# where a public API does the same job, a missing private name falls back to it and costs
# speed, not function; where none does, the name is required, and importing torchjax
# raises an ImportError that names it. Other modules import the namespaces below (`core`,
# `ad`, `batching`, `mlir`, `partial_eval`) in place of JAX's modules: each holds exactly
# the names torchjax uses, resolved once.
from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import os
import types
from typing import Any

import jax
import jax.extend.core
import numpy as np

from torchjax._compat._registry import (
    ABSENT,
    check_required,
    or_,
    private,
    register,
    resolve,
)

# ---------------------------------------------------------------------------------------
# JAX: primitives and their rules (PytreePrimitive, torch_call_p, the JVP splits)
# ---------------------------------------------------------------------------------------

# Whether a bind would only evaluate (no trace active): PytreePrimitive's eager fast path.
_trace_ctx = private(
    "jax._src.core.trace_ctx", fallback="every eager call goes through Primitive.bind (slower)"
)
_EvalTrace = private(
    "jax._src.core.EvalTrace", fallback="every eager call goes through Primitive.bind (slower)"
)


if _trace_ctx is not ABSENT and _EvalTrace is not ABSENT:

    def at_top_level() -> bool:
        """Whether no JAX transformation or trace is active (binding would just evaluate)."""
        return type(_trace_ctx.trace) is _EvalTrace

else:

    def at_top_level() -> bool:
        """Unknown without JAX's trace context: say no, and let JAX dispatch every call."""
        return False


# For a shortcut that asks at_top_level in its own frame, ``type(trace_context.trace) is
# eval_trace_type``; both None where either is missing (at_top_level is then always False).
trace_context, eval_trace_type = (
    (_trace_ctx, _EvalTrace)
    if _trace_ctx is not ABSENT and _EvalTrace is not ABSENT
    else (None, None)
)


# Inside shard_map, operands that vary over different manual mesh axes must be cast to vary
# over all of them before a bind (JAX's own primitives do it). JAX 0.8 called it
# standard_insert_pvary.
_auto_insert_reshard = private(
    "jax._src.core.auto_insert_reshard",
    "jax._src.core.standard_insert_pvary",
    fallback="under shard_map, calls whose operands vary over different manual axes fail",
)


def _no_reshard(*operands: Any) -> Any:
    return operands


# How an aval records the manual mesh axes it varies over: `mat` (with `.varying`) in JAX
# 0.10, `vma` (a frozenset) in JAX 0.8.
private(
    "jax._src.core.ShapedArray.mat",
    "jax._src.core.ShapedArray.vma",
    fallback="outputs inside shard_map are typed as not varying over manual axes",
)
_HAS_MAT = resolve("jax._src.core.ShapedArray.mat") is not ABSENT
_HAS_VMA = not _HAS_MAT and resolve("jax._src.core.ShapedArray.vma") is not ABSENT


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


_set_current_trace = private("jax.extend.core.set_current_trace", "jax._src.core.set_current_trace")
_apply_primitive = private(
    "jax._src.dispatch.apply_primitive",
    fallback="a PytreePrimitive with a lowering but no impl runs eagerly via jax.jit (slower)",
)


# JAX 0.8 passes some constants to rules as a TypedNdArray, a numpy array that is not an
# np.ndarray (by JAX 0.10 it is one). Each counts as array data wherever it may show.
_typed_ndarray = private(
    "jax._src.literals.TypedNdArray",
    fallback="none needed: JAX versions without it pass np.ndarray constants",
)
HOST_ARRAY_TYPES: tuple[type, ...] = (np.ndarray,)
if _typed_ndarray is not ABSENT and not issubclass(_typed_ndarray, np.ndarray):
    HOST_ARRAY_TYPES += (_typed_ndarray,)
# What a pytree leaf that is array data can be (a tuple: isinstance's fastest form).
ARRAY_TYPES: tuple[type, ...] = (jax.Array, *HOST_ARRAY_TYPES, jax.core.Tracer)


def _jit_apply_primitive(prim: Any, *operands: Any, **params: Any) -> Any:
    return jax.jit(lambda *xs: prim.bind(*xs, **params))(*operands)


# Stand-ins for jax._src.core and jax._src.dispatch: only what torchjax uses.
core = types.SimpleNamespace(
    Primitive=jax.extend.core.Primitive,
    Var=jax.extend.core.Var,
    Literal=jax.extend.core.Literal,
    Tracer=jax.core.Tracer,
    ShapedArray=jax.core.ShapedArray,
    typeof=jax.typeof,
    auto_insert_reshard=or_(_auto_insert_reshard, _no_reshard),
    set_current_trace=_set_current_trace,
)
dispatch = types.SimpleNamespace(apply_primitive=or_(_apply_primitive, _jit_apply_primitive))

# Rule tables and autodiff types. jax.interpreters re-exports them; JAX has been removing
# names from there, so the jax._src original is the alternative.
ad = types.SimpleNamespace(
    primitive_jvps=private(
        "jax.interpreters.ad.primitive_jvps", "jax._src.interpreters.ad.primitive_jvps"
    ),
    primitive_transposes=private(
        "jax.interpreters.ad.primitive_transposes",
        "jax._src.interpreters.ad.primitive_transposes",
    ),
    Zero=private("jax.interpreters.ad.Zero", "jax._src.interpreters.ad.Zero"),
    is_undefined_primal=private(
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
_linearizations = private(
    "jax._src.interpreters.ad.primitive_linearizations", fallback=_SLOWER_LINEARIZE
)
_fallback_linearize = private(
    "jax._src.interpreters.ad.fallback_linearize_rule", fallback=_SLOWER_LINEARIZE
)
_LinearizeTrace = private("jax._src.interpreters.ad.LinearizeTrace", fallback=_SLOWER_LINEARIZE)


def _linearize_convention() -> str | None:
    if ABSENT in (_linearizations, _fallback_linearize, _LinearizeTrace):
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
    primitive_batchers=private(
        "jax.interpreters.batching.primitive_batchers",
        "jax._src.interpreters.batching.primitive_batchers",
    ),
)
mlir = types.SimpleNamespace(
    register_lowering=private(
        "jax.interpreters.mlir.register_lowering", "jax._src.interpreters.mlir.register_lowering"
    ),
    lower_fun=private("jax.interpreters.mlir.lower_fun", "jax._src.interpreters.mlir.lower_fun"),
)

# A tracer's value where the trace has one (an eager jax.grad's or jax.jvp's primals):
# torch calls then find their types from a real run instead of a fake one.
_to_concrete_value = private(
    "jax._src.core.to_concrete_value",
    fallback="eager transforms of value-reading code need result_shape_dtypes",
)


def concrete_value(x: Any) -> Any:
    """x's concrete value (an array) where a trace knows it, else None."""
    if _to_concrete_value is ABSENT:
        return None
    try:
        return _to_concrete_value(x)
    except Exception:  # a trace that cannot say
        return None


# The folder of jax's own frames, which its traceback filter hides (and so does the text of
# a torch error under jit: _call/_callback_errors.py).
JAX_SOURCE_DIR = os.path.join(os.path.dirname(jax.__file__), "_src") + os.sep


# An eager jax.vmap's tracer: its batch of concrete values and the axis it maps over.
_BatchTracer = private(
    "jax._src.interpreters.batching.BatchTracer",
    fallback="eager jax.vmap of value-reading code needs result_shape_dtypes",
)


def example_value(x: Any) -> Any:
    """One example of x's value, where the traces around x know it: x's concrete value
    (an eager jax.grad's or jax.jvp's tracer), or through an eager jax.vmap's tracer, the
    first example of its batch (a numpy array); else None. Nested transforms are followed
    inwards (jax.vmap(jax.grad(f)) eagerly)."""
    value = concrete_value(x)
    if value is not None:
        return value
    if not isinstance(x, jax.core.Tracer):
        return None
    primal = getattr(x, "primal", None)  # a JVP's or a linearization's tracer
    if primal is not None:
        return example_value(primal)
    if _BatchTracer is ABSENT or not isinstance(x, _BatchTracer):
        return None
    batch = example_value(x.val)
    axis = x.batch_dim
    if batch is None or not (axis is None or type(axis) is int or _not_mapped(axis)):
        return None  # a ragged axis
    if type(axis) is not int:
        return batch  # not mapped: every example's
    return np.asarray(np.take(np.asarray(batch), 0, axis=axis))


def _not_mapped(axis: Any) -> bool:
    return type(axis).__name__ == "NotMapped"


# Whether a lowering is partitioned across devices: jit with sharded inputs (XLA's SPMD
# partitioner, automatic axes) or shard_map (manual axes). A side-effecting custom call
# there needs a sharding of its own, which jax's callbacks give and buffer_callback does
# not (_torch_call/_lowering.py).
_ShardingContext = private(
    "jax._src.sharding_impls.ShardingContext", fallback="no partitioned lowering is recognized"
)
_SPMDAxisContext = private(
    "jax._src.sharding_impls.SPMDAxisContext", fallback="no partitioned lowering is recognized"
)


def partitioned(axis_context: Any) -> str | None:
    """How a lowering rule's ``ctx.module_context.axis_context`` partitions the computation
    across devices: "manual" (shard_map: each device runs its own program on its shard),
    "auto" (jit of sharded inputs: XLA's partitioner splits one program over more than one
    device), or None (one device)."""
    if _SPMDAxisContext is not ABSENT and isinstance(axis_context, _SPMDAxisContext):
        return "manual"
    if _ShardingContext is not ABSENT and isinstance(axis_context, _ShardingContext):
        return "auto" if axis_context.num_devices > 1 else None
    return None


# A host callback that carries its own sharding (once on device 0 under the partitioner,
# per device in shard_map), handed numpy views of its operands. jax's io_callback and
# pure_callback give the same sharding but first device_put their operands onto CPU device
# 0; on a multi-device CPU that transfer (from about 1 MiB) waits behind the program
# running on device 0, the other devices wait in the next collective, and XLA aborts the
# process after 40 s. Without these names, io_callback (and that risk) is the fallback.
_PLACED_FALLBACK = "jax.experimental.io_callback: large sharded operands can hang XLA's CPU"
_emit_python_callback = private("jax._src.callback.emit_python_callback", fallback=_PLACED_FALLBACK)
_callback_op_sharding = private(
    "jax._src.callback._callback_op_sharding", fallback=_PLACED_FALLBACK
)
can_place_callbacks = _emit_python_callback is not ABSENT and _callback_op_sharding is not ABSENT


def emit_placed_callback(ctx: Any, host: Any, operands: Any, has_side_effect: bool) -> list:
    """Inside a lowering rule: the results of a host callback `host` (numpy arrays in, a
    sequence of numpy arrays out) on `operands`, placed as jax places its callbacks."""
    sharding = _callback_op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
    results, _, _ = _emit_python_callback(
        ctx,
        host,
        None,
        list(operands),
        list(ctx.avals_in),
        list(ctx.avals_out),
        has_side_effect=has_side_effect,
        sharding=sharding,
    )
    return list(results)


# The JVP splits (_torch_call/_partial_eval.py): partial-evaluation rules, and remat policy results.
partial_eval = types.SimpleNamespace(
    custom_partial_eval_rules=private(
        "jax.interpreters.partial_eval.custom_partial_eval_rules",
        "jax._src.interpreters.partial_eval.custom_partial_eval_rules",
    ),
    partial_eval_jaxpr_custom_rules=private(
        "jax.interpreters.partial_eval.partial_eval_jaxpr_custom_rules",
        "jax._src.interpreters.partial_eval.partial_eval_jaxpr_custom_rules",
    ),
    ensure_enum=private("jax._src.interpreters.partial_eval.ensure_enum"),
    RecomputeType=private("jax._src.interpreters.partial_eval.RecomputeType"),
    # Only named in a type annotation.
    JaxprTrace=or_(resolve("jax._src.interpreters.partial_eval.JaxprTrace"), Any),
)

# Dead-code elimination rules (_torch_call/_dce.py). JAX 0.12 passes which inputs are live (for
# effects) between the used outputs and the equation; earlier versions do not.
_NO_DCE = "under jit, forward-over-reverse runs a forward more than torch.func does"
_dce_rules = private(
    "jax.interpreters.partial_eval.dce_rules",
    "jax._src.interpreters.partial_eval.dce_rules",
    fallback=_NO_DCE,
)
_default_dce_rule = private(
    "jax._src.interpreters.partial_eval._default_dce_rule", fallback=_NO_DCE
)


def _dce_convention() -> str | None:
    if ABSENT in (_dce_rules, _default_dce_rule):
        return None
    try:
        names = list(inspect.signature(_default_dce_rule).parameters)
    except (TypeError, ValueError):
        return None
    if len(names) == 2:
        return "used_outs"
    return "live_ins" if len(names) == 3 else None


DCE_CONVENTION = _dce_convention()


def register_dce(primitive: Any, rule: Any) -> bool:
    """Register ``rule(used_outputs, eqn) -> (used_inputs, eqn or None)`` as `primitive`'s
    dead-code elimination; False where JAX's table or calling convention is unknown."""
    if DCE_CONVENTION == "used_outs":
        _dce_rules[primitive] = rule
    elif DCE_CONVENTION == "live_ins":
        _dce_rules[primitive] = lambda used_outs, _live_ins, eqn: rule(used_outs, eqn)
    return DCE_CONVENTION is not None


# What the partial-evaluation rules read off JAX's objects: a JaxprTrace's known values and
# constants, an equation's fields, an aval's tangent type. Methods, not looked up here.
register("jax._src.interpreters.partial_eval.JaxprTrace.default_process_primitive")
register("jax._src.interpreters.partial_eval.JaxprTrace.new_const")
register("jax._src.interpreters.partial_eval.JaxprTracer.pval")
register("jax._src.interpreters.partial_eval.PartialVal.is_known")
register("jax._src.interpreters.partial_eval.PartialVal.get_known")
register("jax._src.core.JaxprEqn.replace")
register("jax._src.core.ShapedArray.to_tangent_aval")


def is_known(tracer: Any) -> bool:
    """Whether a JaxprTrace tracer's value is known (computed now, not staged)."""
    return tracer.pval.is_known()


def known_value(tracer: Any) -> Any:
    return tracer.pval.get_known()


def process_by_default(trace: Any, primitive: Any, tracers: Any, params: dict) -> Any:
    """What a JaxprTrace does with a primitive that has no rule of its own."""
    return trace.default_process_primitive(primitive, tracers, params)


def trace_constant(trace: Any, value: Any) -> Any:
    """`value` as a known constant of a JaxprTrace."""
    return trace.new_const(value)


def new_var(aval: Any) -> Any:
    """A fresh jaxpr variable of type `aval`, for an equation a rule adds."""
    return core.Var(aval)


def replace_equation(eqn: Any, **changes: Any) -> Any:
    """A jaxpr equation with some of its fields (invars, outvars, params) replaced."""
    return eqn.replace(**changes)


def tangent_aval(aval: Any) -> Any:
    """The type of a tangent of a value of type `aval` (float0 for integers)."""
    return aval.to_tangent_aval()


# Tracebacks: an error in a wrapped call shows the user's frames, not torchjax's (JAX's own
# traceback filtering, which hides JAX's frames below its API boundaries).
_NO_FILTERING = "tracebacks of errors in wrapped calls show torchjax's frames too"
_register_exclusion = private("jax._src.traceback_util.register_exclusion", fallback=_NO_FILTERING)
_api_boundary = private("jax._src.traceback_util.api_boundary", fallback=_NO_FILTERING)


def hide_frames_under(path: str) -> None:
    """Leave the frames of files under `path` out of the tracebacks JAX filters."""
    if _register_exclusion is not ABSENT:
        _register_exclusion(path)


def traceback_boundary(fn: Any) -> Any:
    """`fn`, made a boundary below which JAX filters an exception's traceback."""
    return fn if _api_boundary is ABSENT else _api_boundary(fn)


# ---------------------------------------------------------------------------------------
# JAX: jax.export's names for pytree nodes (_to_jax/_call/_outputs.py)
# ---------------------------------------------------------------------------------------

# Serialized name -> (type, ...), what jax.export.deserialize looks names up in. jax.export
# refuses a second type for a name, and says only that; where a name torchjax wants for one
# of its namedtuples is taken (by the user, to deserialize an artifact before torchjax made
# the class, or by another thread making the same class at the same moment), the type found
# here is used in its place.
_export_names = private(
    "jax._src.export._export.deserialization_registry",
    fallback="an output namedtuple whose jax.export name was taken first does not serialize",
)


def export_type_named(serialized_name: str) -> type | None:
    """The type registered for jax.export serialization as `serialized_name`, or None."""
    entry = None if _export_names is ABSENT else _export_names.get(serialized_name)
    if isinstance(entry, tuple) and entry and isinstance(entry[0], type):
        return entry[0]
    return None


# ---------------------------------------------------------------------------------------
# JAX and jaxlib: the x64 flag, DLPack, arrays' devices (_convert.py, _torch_call/_primitive.py)
# ---------------------------------------------------------------------------------------

# Whether an array was placed on its device explicitly.
private("jax._src.lib._jax.ArrayImpl._committed")
array_committed = operator.attrgetter("_committed")

# The sharding of an array on one device: its class, for `type(a.sharding) is ...` on every
# conversion (jax 0.12.1 deprecates the public name jax.sharding.SingleDeviceSharding in
# favour of jax.sharding.is_single_device_sharding, a call), and its device, read without
# building the sharding's device set.
SingleDeviceSharding = private(
    "jax._src.sharding_impls.SingleDeviceSharding", "jax.sharding.SingleDeviceSharding"
)
private("jax._src.sharding_impls.SingleDeviceSharding._device")
sharding_device = operator.attrgetter("_device")


class _PublicX64:
    """jax.config's public view of the x64 flag (thread-local contexts included)."""

    @property
    def value(self) -> bool:
        return bool(jax.config.jax_enable_x64)


# The flag's state object: read on every conversion, it is cheaper than jax.config.
jax_config = types.SimpleNamespace(
    enable_x64=or_(
        private("jax._src.config.enable_x64", fallback="jax.config.jax_enable_x64 (slower)"),
        _PublicX64(),
    )
)


def x64_as(value: bool) -> Any:
    """A context in which JAX's x64 flag is `value` (for this thread), as jax.enable_x64."""
    state = jax_config.enable_x64
    return state(value) if callable(state) else contextlib.nullcontext()


_DLPACK_SLOW = "jax.dlpack and jax.Array.__dlpack__ (about 10 µs more per conversion)"
dlpack_import = private(
    "jax._src.lib._jax.dlpack_managed_tensor_to_buffer", fallback="jax.dlpack.from_dlpack"
)
# jaxlib's DLPack export of a single-device array, and the type it applies to; None (and a
# type nothing has) where missing, so callers take jax.Array.__dlpack__.
dlpack_export = or_(
    private("jax._src.lib._jax.buffer_to_dlpack_managed_tensor", fallback=_DLPACK_SLOW), None
)

# The array a DLPack export should hold: a new array object on the same buffer. Exporting
# the caller's array itself puts a hold on it that makes its x.delete() abort the process
# (jaxlib's "Non-zero type 1 hold on destruction") while torch still has the tensor;
# jax.Array.__dlpack__ exports addressable_data(0), which is this, 0.4 µs slower.
single_device_shard = or_(
    private(
        "jax._src.lib._jax.ArrayImpl._fully_replicated_shard",
        fallback="jax.Array.addressable_data (0.4 µs more per conversion)",
    ),
    lambda a: a.addressable_data(0),
)

# An array's class as JAX's Python code builds it: with it, an eager output gets JAX's own
# placement of an op's result on uncommitted inputs (uncommitted, so a later op may move
# it to another device). jaxlib's DLPack import commits what it makes.
_ArrayImplBuilt = private(
    "jax._src.array.ArrayImpl",
    fallback="with several devices, eager outputs of uncommitted inputs stay committed",
)


def uncommitted(a: Any) -> Any:
    """A single-device array `a` not committed to its device, on the same buffer."""
    if _ArrayImplBuilt is ABSENT:
        return a
    return _ArrayImplBuilt(a.aval, a.sharding, [a], committed=False, _skip_checks=True)


class _NoArray:
    """A type no array has: `type(a) is ArrayImpl` is then always False."""


ArrayImpl = or_(private("jax._src.lib._jax.ArrayImpl", fallback=_DLPACK_SLOW), _NoArray)


check_required(f"jax {jax.__version__}")


# A host callback on XLA's own buffers (jax >= 0.6.1); without it, jax.pure_callback
# copies every input and output through numpy (_torch_call/_lowering.py).
buffer_callback = or_(
    private(
        "jax.experimental.buffer_callback.buffer_callback",
        fallback="jax.pure_callback: a numpy copy of every input and output under jit",
    ),
    None,
)


# Whether a jax.profiler trace records now (jaxlib's TraceMe): torchjax's ranges are entered
# only then (_log.py).
_trace_me = private(
    "jax._src.lib._profiler.TraceMe", fallback="jax.profiler shows no torchjax ranges"
)
jax_profiler_active = or_(getattr(_trace_me, "is_enabled", ABSENT), lambda: False)
