# Every step torchjax inlines for speed, in one file, each function naming the reference
# it mirrors. A wrapped call's common case, eager or jitted, runs on every call, and a
# frame, a list or a loop there costs a few percent of a small call (measured: see each
# docstring); so these functions write out again steps whose reference lives elsewhere:
#
#   mirror               reference (the full way, which handles every case)
#   guarded_call         CallPlan._invoke                     _call/_plan.py
#   guarded_call_one     guarded_call
#   eager_call           bind_eager -> impl -> CallPlan.run   _torch_call/_impl.py
#   jit_host             _run_into(..., plan.run)             _torch_call/_lowering.py
#   jit_hot_host         _run_into(..., plan.run)             _torch_call/_lowering.py
#   jit_hot_host_one     jit_hot_host
#
# Each covers the common case only and hands anything else to its reference. A change to
# a reference is made to its mirrors too: tests/test_hot_paths.py runs every mirror against
# its reference (ENABLED off) over every route: a write, .data, a pointer reader, a fresh
# output, an output that is an input, a kept input.
from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torchjax._compat._jax import (
    SingleDeviceSharding,
    array_committed,
    dlpack_export,
    dlpack_import,
    eval_trace_type,
    single_device_shard,
    trace_context,
    uncommitted,
)
from torchjax._compat._torch import (
    _DL_CPU,
    any_autocast,
    cpu_array_from_tensor,
    is_view,
    storage_cdata,
    storage_id,
    storage_use_count,
    tensor_from_capsule,
    tensor_to_capsule,
    tensor_use_count,
    tensor_version,
)
from torchjax._convert import (
    ArrayImpl,
    check_has_data,
    jax_cpu_device,
    keeps_dtype,
    several_devices,
    tensor_to_jax,
)
from torchjax._to_jax._call._callback_errors import as_reported
from torchjax._to_jax._call._guard import copy_kept_inputs, owns_memory_alone, refuse_writes
from torchjax._to_jax._call._outputs import write_checked, write_output
from torchjax._to_jax._context import fake_runs

# Off: every call takes its reference (tests/test_hot_paths.py compares the two). Read when
# a plan is made and a call is lowered, never per call.
ENABLED = True

_SingleDevice = SingleDeviceSharding
_from_capsule, _export, _shard = tensor_from_capsule, dlpack_export, single_device_shard
_inference_mode = torch.is_inference_mode_enabled
_getrefcount, _getweakrefcount = sys.getrefcount, weakref.getweakrefcount
_refs = sys.getrefcount  # references: `tensors`, the loop variable, getrefcount's argument
_uses, _storage_id = storage_use_count, storage_id
_version = tensor_version
_Tensor, _strided = torch.Tensor, torch.strided


# -- the guarded call of a hot plan -------------------------------------------------------
def guarded_call(plan: Any, tensors: list[torch.Tensor]) -> Any:
    """The guarded call of a hot plan (CallPlan.hot: the user's function called
    directly, in the caller's grad mode), its steps inlined: this runs on every call.
    Returns fn's output unchecked.

    Mirrors CallPlan._invoke (_call/_plan.py): the same guard, the same refusals and
    retries on copies, minus what a hot plan rules out (grad mode, a tree to fill)."""
    for t in tensors:
        refuse_writes(t)
    refused = False
    try:
        out = plan.direct(*tensors)
    except Exception as e:
        refused = plan.refused(e, tensors)
    if refused:
        return plan.invoke_on_copies(tensors, compare=True)
    for t in tensors:
        if _version(t):
            plan.raise_mutated(tensors)
    return out


def guarded_call_one(plan: Any, t: torch.Tensor) -> Any:
    """guarded_call for one tensor: the eager shortcut's common fn(x) (jit_hot_host_one
    writes these steps out inline too).

    Mirrors guarded_call, written out again rather than shared: a list, loops or a
    star-call cost 2-3% of a call on 16 floats (measured, both ways)."""
    refuse_writes(t)
    refused = False
    try:
        out = plan.direct(t)
    except Exception as e:
        refused = plan.refused(e, [t])
    if refused:
        return plan.invoke_on_copies([t], compare=True)
    if _version(t):
        plan.raise_mutated([t])
    return out


def eager_call(avals: tuple, x64: Any, plan: Any, committed_device: Callable, rest: Callable):
    """The eager call of a hot plan's signature (HotCall.call): ``call(args)`` is the
    call's output, or MISS where `args` or the context are not those of this signature (a
    trace is active, a fake run, inference mode, x64 changed).

    Mirrors _torch_call/_impl.py's bind_eager (through impl, CallPlan.run and
    to_jax_outputs): after guarded_call, the steps of owns_memory_alone and tensor_to_jax
    are inlined with what the signature fixes (one frame: this runs on every call); an
    output they do not cover goes to ``rest(box, device)``, the reference's own steps.
    `committed_device(args, plan)` is the reference's too. (It holds no reference to its
    HotCall: no cycle, so a dropped wrapper is freed at once.)"""
    n, x64_value = len(avals), x64.value
    dtype, shape, where = plan.hot_dtype, plan.hot_shape, plan.out_paths[0]
    cpu = jax_cpu_device()
    form = cpu_array_from_tensor.form  # jaxlib's DLPack import signature, once found
    # The output's dtype, fixed by the plan, is one XLA aliases as it is (tensor_to_jax),
    # and jaxlib's import is set up; only a complex tensor can have its conjugate bit set.
    aliasable = keeps_dtype(dtype) and form is not None
    complex_out = dtype.is_complex
    # With several CPU devices an output of uncommitted inputs is not committed either, as
    # JAX's own results (see to_jax_outputs).
    spread = several_devices("cpu")

    def call(args: tuple) -> Any:
        if len(args) != n or x64.value != x64_value or not plan.hot:  # (not once it runs on copies)
            return MISS
        # at_top_level(), inlined: no JAX trace or transformation is active
        if type(trace_context.trace) is not eval_trace_type:
            return MISS
        if fake_runs.depth or _inference_mode():
            return MISS
        committed, tensors, i = False, [], 0
        for x in args:  # (indexed: zip and unpacking cost more than the checks)
            if type(x) is not ArrayImpl or x.aval != avals[i] or x.platform() != "cpu":
                return MISS
            i += 1
            if type(x.sharding) is not _SingleDevice:  # a sharded array: the full way says so
                return MISS
            committed = committed or array_committed(x)
            tensors.append(_from_capsule(_export(_shard(x), stream=None)))
        device = committed_device(args, plan) if committed else cpu
        box = [guarded_call(plan, tensors)]  # the output's one reference: see finish
        tensors = None
        return finish(box, device, committed)

    def call_one(args: Any) -> Any:
        """`call` for one array argument: no list, no loop, and the guard for one tensor
        (guarded_call_one), which `call` takes 0.5 µs more for (3% of an eager call on 16
        floats, measured)."""
        if len(args) != 1 or x64.value != x64_value or not plan.hot:
            return MISS
        if type(trace_context.trace) is not eval_trace_type:
            return MISS
        if fake_runs.depth or _inference_mode():
            return MISS
        x = args[0]
        if type(x) is not ArrayImpl or x.aval != aval or x.platform() != "cpu":
            return MISS
        if type(x.sharding) is not _SingleDevice:
            return MISS
        committed = array_committed(x)
        device = committed_device(args, plan) if committed else cpu
        box = [guarded_call_one(plan, _from_capsule(_export(_shard(x), stream=None)))]
        return finish(box, device, committed)

    def finish(box: list, device: Any, committed: bool) -> Any:
        """The call's output from fn's output ``box[0]`` (its only reference, which this
        takes): owns_memory_alone(out, 1) and tensor_to_jax's common case, inlined."""
        out = box.pop()
        # References to `out`: this frame's and getrefcount's argument; to its storage:
        # `storage`, getrefcount's argument and torch's own (see owns_memory_alone).
        if (
            aliasable
            and type(out) is _Tensor
            and out.dtype is dtype
            and out.shape == shape
            and _getrefcount(out) == 2
            and not _getweakrefcount(out)
            and tensor_use_count(out) == 1
            and not out.requires_grad
            and out.is_cpu
            and out.layout is _strided
            and not is_view(out)
        ):
            storage = out.untyped_storage()
            if (
                storage.resizable()
                and _getrefcount(storage) == 3
                and not _getweakrefcount(storage)
                and storage_use_count(storage_cdata(storage)) == 2
                and out.is_contiguous()
                and not out.const_data_ptr() % 64
                and not (complex_out and out.is_conj())
                and not out.is_neg()
            ):
                storage = None
                result = dlpack_import(tensor_to_capsule(out), device, *form)
                return uncommitted(result) if spread and not committed else result
            storage = None
        box = [out]
        del out  # the output's references are now in `box` alone (see owns_memory_alone)
        if (
            type(box[0]) is _Tensor
            and box[0].dtype is dtype
            and box[0].shape == shape
            and box[0].layout is _strided  # (a sparse tensor has no storage: the full way says)
        ):
            if owns_memory_alone(box[0], 1):
                result = tensor_to_jax(box.pop(), where, device)
                return uncommitted(result) if spread and not committed else result
        return rest(box, device if committed else None)

    if n == 1:
        aval = avals[0]
        return call_one
    return call


class _Miss:
    """eager_call's answer for a call it does not cover: it takes the full way."""

    def __reduce__(self) -> str:
        # By reference: a wrapper pickled by value (cloudpickle) compares with this one.
        return "MISS"


MISS = _Miss()


# -- jitted calls: host callbacks -----------------------------------------------------------
def jit_host(run: Callable, out_paths: list, one_out: Any, slow: Callable) -> Callable:
    """The host callback of a jitted call on the CPU that offers XLA's buffers to nothing
    (not a VJP through a kept graph): `run` (a plan's run) on XLA's input buffers, its
    outputs copied into XLA's output buffers; `one_out`, the dtype of a single output.

    Mirrors _torch_call/_lowering.py's _run_into: the copies of write_output and the check
    of copy_kept_inputs inlined (one frame: this runs on every call of a jitted function).
    The first call, a GPU, inference mode and autocast go to ``slow(host, ctx, outs, ins)``,
    the reference, which may enter `host` again."""
    on_cpu = False  # known after the first call (a callback is lowered for one platform)

    def host(ctx: Any, outs: list, *ins: Any) -> None:
        nonlocal on_cpu
        try:
            if not on_cpu or _inference_mode() or any_autocast():
                on_cpu = on_cpu or (ins or outs)[0].__dlpack_device__()[0] == _DL_CPU
                return slow(host, ctx, outs, ins)
            tensors = [tensor_from_capsule(b.__dlpack__()) for b in ins]
            results = run(tensors)
            if one_out is not None and results[0].dtype is one_out:
                try:
                    tensor_from_capsule(outs[0].__dlpack__()).copy_(results[0])
                except Exception:
                    check_has_data(results[0], out_paths[0])  # meta or sparse: say which
                    raise
            else:
                for buf, value, where in zip(outs, results, out_paths, strict=True):
                    dst = tensor_from_capsule(buf.__dlpack__())
                    if value.dtype is not dst.dtype:
                        write_output(dst, value, where)
                    else:
                        try:
                            dst.copy_(value)
                        except Exception:
                            check_has_data(value, where)  # meta or sparse: say which
                            raise
            results = value = dst = None  # (not del: with no outputs, never bound)
            # An input the function kept a reference to (a cache, a hook) gets memory of
            # its own before XLA reuses the buffer; the common case (none kept) inlined.
            for t in tensors:
                if _refs(t) != 3 or tensor_use_count(t) != 1 or _uses(_storage_id(t)) != 1:
                    del t  # copy_kept_inputs counts the references to each input
                    copy_kept_inputs(tensors)
                    break
        except Exception as e:
            raise as_reported(e) from None  # (_call/_callback_errors.py)

    return host


def jit_hot_host(plan: Any, host: Callable) -> Callable:
    """The host callback of a jitted call of a hot plan (CallPlan.hot) on the CPU.

    Mirrors _torch_call/_lowering.py's _run_into with plan.run: guarded_call, then, inlined
    with what the plan fixes, plan.run's output check, write_output's copy into XLA's buffer
    and copy_kept_inputs' check (one frame: this runs on every call). The first call, a
    GPU, inference mode and a plan that runs on copies since go to `host`."""
    dtype, shape, where = plan.hot_dtype, plan.hot_shape, plan.out_paths[0]
    on_cpu = False  # known after the first call (a callback is lowered for one platform)
    if len(plan.template) == 1 and plan.positions == [0]:  # fn(x): its own callback
        return jit_hot_host_one(plan, host)

    def hot_host(ctx: Any, outs: list, *ins: Any) -> None:
        nonlocal on_cpu
        if not on_cpu or not plan.hot or _inference_mode() or any_autocast():
            on_cpu = on_cpu or (ins or outs)[0].__dlpack_device__()[0] == _DL_CPU
            return host(ctx, outs, *ins)
        try:
            # XLA's output buffer wrapped first, before the inputs and fn, as the fastest
            # hand-written callback does: measured 0.3 µs (2% of a call on 16 floats) faster
            # than wrapping it after fn (why is the allocator's or jaxlib's, not ours).
            dst = tensor_from_capsule(outs[0].__dlpack__())
            tensors = [tensor_from_capsule(b.__dlpack__()) for b in ins]
            out = guarded_call(plan, tensors)
            if type(out) is _Tensor and out.dtype is dtype and out.shape == shape:
                try:
                    dst.copy_(out)
                except Exception:
                    check_has_data(out, where)  # meta or sparse: say which
                    raise
            else:
                write_checked(plan, out, outs)
            out = dst = None
            # An input the function kept a reference to (a cache, a hook) gets memory of
            # its own before XLA reuses the buffer; the common case (none kept) inlined.
            for t in tensors:
                if _refs(t) != 3 or tensor_use_count(t) != 1 or _uses(_storage_id(t)) != 1:
                    del t  # copy_kept_inputs counts the references to each input
                    copy_kept_inputs(tensors)
                    break
        except Exception as e:
            raise as_reported(e) from None  # (_call/_callback_errors.py)

    return hot_host


def jit_hot_host_one(plan: Any, host: Callable) -> Callable:
    """jit_hot_host for fn(x), one tensor in and out.

    Mirrors jit_hot_host, with guarded_call_one's steps inlined too: no list, no loop, no
    frame between XLA's call and fn's (measured 4% of a call on 16 floats against the
    general callback, and 0.8% against calling guarded_call_one)."""
    dtype, shape, where = plan.hot_dtype, plan.hot_shape, plan.out_paths[0]
    fn = plan.direct
    on_cpu = False

    def hot_host(ctx: Any, outs: list, *ins: Any) -> None:
        nonlocal on_cpu
        if not on_cpu or not plan.hot or _inference_mode() or any_autocast():
            on_cpu = on_cpu or (ins or outs)[0].__dlpack_device__()[0] == _DL_CPU
            return host(ctx, outs, *ins)
        try:
            dst = tensor_from_capsule(outs[0].__dlpack__())  # first: see jit_hot_host
            t = tensor_from_capsule(ins[0].__dlpack__())
            refuse_writes(t)  # as guarded_call_one: fn cannot write into XLA's buffer
            refused = False
            try:
                out = fn(t)
            except Exception as e:
                refused = plan.refused(e, [t])
            if refused:
                out = plan.invoke_on_copies([t], compare=True)
            elif tensor_version(t):
                plan.raise_mutated([t])
            if type(out) is _Tensor and out.dtype is dtype and out.shape == shape:
                try:
                    dst.copy_(out)
                except Exception:
                    check_has_data(out, where)  # meta or sparse: say which
                    raise
            else:
                write_checked(plan, out, outs)
            out = dst = None
            # References: `t`, getrefcount's argument (see the loop in jit_hot_host).
            if _refs(t) != 2 or tensor_use_count(t) != 1 or _uses(_storage_id(t)) != 1:
                tensors = [t]
                del t  # copy_kept_inputs counts the references to each input
                copy_kept_inputs(tensors)
        except Exception as e:
            raise as_reported(e) from None  # (_call/_callback_errors.py)

    return hot_host
