# torch_call's lowering rule: under jax.jit, a host callback that runs torch on XLA's
# buffers.
#
# jax.experimental.buffer_callback hands the callback XLA's own input and output buffers.
# Inputs are wrapped zero-copy with DLPack; torch computes the outputs and each is copied
# once into XLA's output buffer (torch allocates its results itself, so that copy is the
# one unavoidable one). On GPU torch runs on XLA's stream (ctx.stream), so the work is
# ordered after XLA's producers and before its consumers with no device-wide synchronize,
# and an event each way orders it with torch's own current stream (_call/_cuda.py).
# Where buffer_callback is missing (JAX < 0.6.1) jax.pure_callback is the fallback: it
# copies inputs and outputs through host numpy arrays.
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch
from jax.experimental import io_callback

from torchjax._compat._torch import (
    any_autocast,
    autocast_as,
    tensor_from_capsule,
    tensor_use_count,
    tensor_version,
)
from torchjax._compat._torch import storage_id as _storage_id
from torchjax._compat._torch import storage_use_count as _uses
from torchjax._convert import (
    array_to_tensor,
    check_has_data,
    narrow_checked,
    torch_dtype,
)
from torchjax._primitive._core import lowering_is_partitioned
from torchjax._to_jax._call._cuda import on_xla_stream
from torchjax._to_jax._call._guard import copy_kept_inputs, refuse_writes
from torchjax._to_jax._call._huge_pages import advise, large_outputs
from torchjax._to_jax._call._outputs import as_jax_tree
from torchjax._to_jax._call._plan import CallPlan, plan_for, plan_parts
from torchjax._to_jax._callables._autodiff import VjpFunction
from torchjax._to_jax._callables._batched_kept import BatchedKeptVjp
from torchjax._to_jax._callables._kept import KeptForward
from torchjax._to_jax._context import OUTPUT_BUFFERS
from torchjax._to_jax._torch_call._callback_errors import as_reported
from torchjax._to_jax._torch_call._primitive import torch_call_p

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # pragma: no cover - exercised by forcing the flag in tests
    buffer_callback = None

# Tests flip this to exercise the documented pure_callback fallback.
USE_BUFFER_CALLBACK = buffer_callback is not None

# `run(tensors)` computes the flat outputs (tensors or Python numbers) from the flat inputs.
Run = Callable[[list[torch.Tensor]], Sequence[Any]]


_DL_CPU = 1  # DLPack's kDLCPU
_inference_mode = torch.is_inference_mode_enabled
_Tensor = torch.Tensor
_refs = sys.getrefcount  # references: `tensors`, the loop variable, getrefcount's argument


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


def _xla_stream(ctx: Any, buf: Any) -> contextlib.AbstractContextManager:
    """Make XLA's stream torch's current stream: torch's kernels then run in XLA's order,
    after the producers of the inputs and before the consumers of the outputs, and in
    order with the work queued on torch's own current stream (see _call/_cuda.py)."""
    return on_xla_stream(ctx.stream, buf.__dlpack_device__()[1])


def callback_call(
    run: Run,
    operands: Sequence[Any],
    out_structs: Sequence[jax.ShapeDtypeStruct],
    out_paths: Sequence[str],
    share_outputs: bool = False,
    plan: CallPlan | None = None,
    draws: bool = False,
) -> list[Any]:
    """Stage a host call of `run` into the current JAX trace; returns the flat outputs.

    With `share_outputs` (a VJP through a kept graph), XLA's output buffers are offered to
    the call (OUTPUT_BUFFERS): a gradient it writes there itself, returned as that buffer,
    is not copied again, and torch's own is freed as soon as it was written. A plain
    `plan` (see CallPlan.plain) whose `run` this is has its call inlined (_plain_host).
    A call that `draws` random numbers from torch's generator is staged as having a side
    effect: XLA would otherwise merge two such calls on the same inputs into one (two
    dropout masks would be one), or drop one whose outputs go unused."""
    if draws and lowering_is_partitioned():
        # Partitioned, a side-effecting call needs a sharding (XLA's partitioner refuses
        # one without), which jax's io_callback gives (once, on one device; per device in
        # shard_map) and buffer_callback does not: the host-copying callback, for this case.
        # Its outputs come out pinned to that one device, a sharding later JAX operations
        # on them cannot convert (jax 0.10): the barrier leaves the partitioner free to
        # place them.
        outs = _pure_callback_call(run, operands, out_structs, out_paths, draws)
        return list(jax.lax.optimization_barrier(list(outs)))
    if not USE_BUFFER_CALLBACK:
        return _pure_callback_call(run, operands, out_structs, out_paths, draws)
    on_cpu = None  # fixed by the first call: a buffer_callback is lowered for one platform
    # One output of a fixed dtype: its copy without the loop, measured 0.5 µs (4%) faster.
    one_out = torch_dtype(out_structs[0].dtype) if len(out_structs) == 1 else None

    def host(ctx: Any, outs: list, *ins: Any) -> None:
        try:
            if on_cpu and not share_outputs and not _inference_mode() and not any_autocast():
                # The CPU path, inlined: this runs on every call of a jitted function.
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
            else:
                _host(ctx, outs, ins)
        except Exception as e:
            raise as_reported(e) from None  # (_torch_call/_callback_errors.py)

    def _host(ctx: Any, outs: list, ins: tuple) -> None:
        nonlocal on_cpu
        if _inference_mode():
            # A jitted call made inside torch.inference_mode() runs its callback there too:
            # its tensors would have no version counters, which the in-place check reads.
            with torch.inference_mode(False):
                return host(ctx, outs, *ins)
        if any_autocast():
            # Likewise in torch.autocast: the function runs in the state it was traced in
            # (_torch_ops/_autocast.py), not in the one where the compiled function runs.
            with autocast_as(()):
                return host(ctx, outs, *ins)
        if on_cpu is None:
            on_cpu = (ins or outs)[0].__dlpack_device__()[0] == _DL_CPU
            if on_cpu and not share_outputs:
                return host(ctx, outs, *ins)
        if not on_cpu:
            with _xla_stream(ctx, (ins or outs)[0]):
                _run_into(run, ins, outs, out_paths, _buffer_tensor, share_outputs)
        else:
            _run_sharing_outputs(
                run, [tensor_from_capsule(b.__dlpack__()) for b in ins], outs, out_paths
            )

    if plan is not None and plan.plain and not share_outputs:
        host = _plain_host(plan, host)
    large = large_outputs(out_structs)  # on the CPU, huge pages for them (_call/_huge_pages.py)
    callback = _advising(host, large) if large else host  # (_host's recursion: not twice)
    return buffer_callback(callback, list(out_structs), has_side_effect=draws)(*operands)


def _advising(host: Callable, large: tuple[int, ...]) -> Callable:
    def advising_host(ctx: Any, outs: list, *ins: Any) -> None:
        advise(outs, large)
        return host(ctx, outs, *ins)

    return advising_host


def _plain_host(plan: CallPlan, host: Callable) -> Callable:
    """The host callback for a plain plan (see CallPlan.plain): on CPU, CallPlan.call_plain
    and then, inlined with what the plan fixes, plan.run's output check, the copy into
    XLA's buffer and the kept-input check (one frame: this runs on every call). The first
    call, a GPU, inference mode and a plan that runs on copies since go to `host`."""
    dtype, shape, where = plan.plain_dtype, plan.plain_shape, plan.out_paths[0]
    on_cpu = False  # known after the first call (a callback is lowered for one platform)
    if len(plan.template) == 1 and plan.positions == [0]:  # fn(x): its own callback
        return _plain_host_one(plan, host)

    def plain_host(ctx: Any, outs: list, *ins: Any) -> None:
        nonlocal on_cpu
        if not on_cpu or not plan.plain or _inference_mode() or any_autocast():
            on_cpu = on_cpu or (ins or outs)[0].__dlpack_device__()[0] == _DL_CPU
            return host(ctx, outs, *ins)
        try:
            # XLA's output buffer wrapped first, before the inputs and fn, as the fastest
            # hand-written callback does: measured 0.3 µs (2% of a call on 16 floats) faster
            # than wrapping it after fn (why is the allocator's or jaxlib's, not ours).
            dst = tensor_from_capsule(outs[0].__dlpack__())
            tensors = [tensor_from_capsule(b.__dlpack__()) for b in ins]
            out = plan.call_plain(tensors)
            if type(out) is _Tensor and out.dtype is dtype and out.shape == shape:
                try:
                    dst.copy_(out)
                except Exception:
                    check_has_data(out, where)  # meta or sparse: say which
                    raise
            else:
                _write_checked(plan, out, outs)
            out = dst = None
            # An input the function kept a reference to (a cache, a hook) gets memory of
            # its own before XLA reuses the buffer; the common case (none kept) inlined.
            for t in tensors:
                if _refs(t) != 3 or tensor_use_count(t) != 1 or _uses(_storage_id(t)) != 1:
                    del t  # copy_kept_inputs counts the references to each input
                    copy_kept_inputs(tensors)
                    break
        except Exception as e:
            raise as_reported(e) from None  # (_torch_call/_callback_errors.py)

    return plain_host


def _plain_host_one(plan: CallPlan, host: Callable) -> Callable:
    """_plain_host for fn(x), one tensor in and out, with CallPlan.call_plain_one's steps
    inlined too: no list, no loop, no frame between XLA's call and fn's (measured 4% of a
    call on 16 floats against the general callback, and 0.8% against calling
    call_plain_one)."""
    dtype, shape, where = plan.plain_dtype, plan.plain_shape, plan.out_paths[0]
    fn = plan.direct
    on_cpu = False

    def plain_host(ctx: Any, outs: list, *ins: Any) -> None:
        nonlocal on_cpu
        if not on_cpu or not plan.plain or _inference_mode() or any_autocast():
            on_cpu = on_cpu or (ins or outs)[0].__dlpack_device__()[0] == _DL_CPU
            return host(ctx, outs, *ins)
        try:
            dst = tensor_from_capsule(outs[0].__dlpack__())  # first: see _plain_host
            t = tensor_from_capsule(ins[0].__dlpack__())
            refuse_writes(t)  # as call_plain_one: fn cannot write into XLA's buffer
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
                _write_checked(plan, out, outs)
            out = dst = None
            # References: `t`, getrefcount's argument (see the loop in _plain_host).
            if _refs(t) != 2 or tensor_use_count(t) != 1 or _uses(_storage_id(t)) != 1:
                tensors = [t]
                del t  # copy_kept_inputs counts the references to each input
                copy_kept_inputs(tensors)
        except Exception as e:
            raise as_reported(e) from None  # (_torch_call/_callback_errors.py)

    return plain_host


def _write_checked(plan: CallPlan, out: Any, outs: list) -> None:
    """A plain call's output other than the one tensor the plan fixes: plan.run's checks
    (coercions, or the error that says what differs), then the copies into XLA's buffers."""
    results = plan.check_outputs(out if type(out) is _Tensor else as_jax_tree(out), True)
    del out  # (the output's references: see owns_memory_alone)
    _write_all(results, outs, plan.out_paths, _buffer_tensor)


def _buffer_tensor(buf: Any) -> torch.Tensor:
    """One of XLA's buffers as a tensor, zero-copy. No stream goes to its __dlpack__: the
    buffer is ready on XLA's stream, which the callback's torch work runs on."""
    return tensor_from_capsule(buf.__dlpack__())


def _run_into(
    run: Run, ins: Sequence, outs: Sequence, out_paths: Sequence[str], wrap, share: bool = False
) -> None:
    tensors = [wrap(b) for b in ins]
    if share:
        _run_sharing_outputs(run, tensors, outs, out_paths)
        return
    _write_all(run(tensors), outs, out_paths, wrap)
    copy_kept_inputs(tensors)


def _run_sharing_outputs(run: Run, tensors: list, outs: Sequence, out_paths: Sequence[str]) -> None:
    """`run` with XLA's output buffers offered to it (OUTPUT_BUFFERS); an output it returns
    as its buffer is already written there."""
    dsts = [tensor_from_capsule(b.__dlpack__()) for b in outs]
    OUTPUT_BUFFERS.buffers = dsts
    try:
        results = run(tensors)
    finally:
        OUTPUT_BUFFERS.buffers = None
    for dst, value, where in zip(dsts, results, out_paths, strict=True):
        if not _is_buffer(value, dst):
            write_output(dst, value, where)
    results = value = dst = dsts = None
    for t in tensors:  # as in the inlined CPU path: copy only where an input is kept
        if _refs(t) != 3 or tensor_use_count(t) != 1 or _uses(_storage_id(t)) != 1:
            del t
            copy_kept_inputs(tensors)
            break


def _is_buffer(value: Any, dst: torch.Tensor) -> bool:
    """Whether `value` is XLA's buffer `dst` itself (or a plain alias of it: the plan's
    checks may detach an output), so that it holds the output already."""
    return (
        type(value) is _Tensor
        and value.const_data_ptr() == dst.const_data_ptr()
        and value.dtype is dst.dtype
        and value.shape == dst.shape
        and value.stride() == dst.stride()
    )


def _write_all(results: Sequence, outs: Sequence, out_paths: Sequence[str], wrap) -> None:
    for buf, value, where in zip(outs, results, out_paths, strict=True):
        write_output(wrap(buf), value, where)


def _pure_callback_call(run, operands, out_structs, out_paths, draws=False):
    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        try:
            tensors = [array_to_tensor(a) for a in arrays]  # the one numpy conversion
            results = []
            for s, value, where in zip(out_structs, run(tensors), out_paths, strict=True):
                dst = torch.empty(s.shape, dtype=torch_dtype(s.dtype))
                write_output(dst, value, where)
                if dst.dtype == torch.bfloat16:  # numpy has no bfloat16; reinterpret bits
                    results.append(dst.view(torch.int16).numpy().view(s.dtype))
                else:
                    results.append(dst.numpy())
            return results
        except Exception as e:
            raise as_reported(e) from None  # (_torch_call/_callback_errors.py)

    if draws:  # not pure: two calls on the same inputs draw twice (see callback_call)
        return io_callback(host, list(out_structs), *operands, ordered=False)
    return jax.pure_callback(host, list(out_structs), *operands, vmap_method="sequential")


def lowering(*args: Any, fn: Any, options: Any, signature: Any) -> Any:
    """Under jit: a buffer_callback that runs fn on XLA's buffers, through the call plan of
    this signature (the same checks and errors as an eager call)."""
    del options
    operands, *parts = plan_parts(args, signature.out_types)
    plan = plan_for(fn, *parts, in_dtypes=[x.dtype for x in operands])
    share = (
        (type(fn) is VjpFunction and fn.with_residuals and not fn.ct_batch)
        or type(fn) is BatchedKeptVjp
        or (type(fn) is KeptForward and fn.keep_graph)  # writes its outputs there
    )
    # The user's function, whose fake run saw whether it draws; without one (declared
    # result_shape_dtypes, a seeded call) it may: merging two calls costs more than it saves.
    root = getattr(fn, "root", None)
    draws = root is not None and root.facts.get("draws", True)
    outs = callback_call(plan.run, operands, plan.structs, plan.out_paths, share, plan, draws)
    return jax.tree_util.tree_unflatten(plan.out_tree, outs)


torch_call_p.def_lowering(lowering, signature=True)
