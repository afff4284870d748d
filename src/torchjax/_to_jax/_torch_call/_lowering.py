# torch_call's lowering rule: under jax.jit, a host callback that runs torch on XLA's
# buffers.
#
# buffer_callback (jax's, through _compat) hands the callback XLA's own input and output buffers.
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

from torchjax._compat._jax import buffer_callback, can_place_callbacks
from torchjax._compat._torch import (
    any_autocast,
    autocast_as,
    tensor_from_capsule,
)
from torchjax._convert import (
    array_to_tensor,
    torch_dtype,
)
from torchjax._log import describe, profiled, profiling
from torchjax._primitive._core import lowering_partitioning
from torchjax._to_jax import _hot as hot_paths
from torchjax._to_jax._call._callback_errors import as_reported
from torchjax._to_jax._call._cuda import on_xla_stream
from torchjax._to_jax._call._guard import copy_kept_inputs
from torchjax._to_jax._call._huge_pages import advise, large_outputs
from torchjax._to_jax._call._outputs import buffer_tensor, write_all, write_output
from torchjax._to_jax._call._plan import CallPlan, plan_for, plan_parts
from torchjax._to_jax._callables._autodiff import VjpFunction
from torchjax._to_jax._callables._batched_kept import BatchedKeptVjp
from torchjax._to_jax._callables._kept import KeptForward
from torchjax._to_jax._context import OUTPUT_BUFFERS
from torchjax._to_jax._torch_call._placed import placed_call
from torchjax._to_jax._torch_call._primitive import torch_call_p

# Tests flip this to exercise the documented pure_callback fallback.
USE_BUFFER_CALLBACK = buffer_callback is not None

# `run(tensors)` computes the flat outputs (tensors or Python numbers) from the flat inputs.
Run = Callable[[list[torch.Tensor]], Sequence[Any]]


_DL_CPU = 1  # DLPack's kDLCPU
_inference_mode = torch.is_inference_mode_enabled
_Tensor = torch.Tensor
_refs = sys.getrefcount  # references: `tensors`, the loop variable, getrefcount's argument


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
    name: str = "torchjax",
) -> list[Any]:
    """Stage a host call of `run` into the current JAX trace; returns the flat outputs.

    With `share_outputs` (a VJP through a kept graph), XLA's output buffers are offered to
    the call (OUTPUT_BUFFERS): a gradient it writes there itself, returned as that buffer,
    is not copied again, and torch's own is freed as soon as it was written. A hot `plan`
    (see CallPlan.hot) whose `run` this is has its call inlined (_hot.py).
    A call that `draws` random numbers from torch's generator is staged as having a side
    effect: XLA would otherwise merge two such calls on the same inputs into one (two
    dropout masks would be one), or drop one whose outputs go unused."""
    partitioning = lowering_partitioning()
    if partitioning == "auto" or (partitioning == "manual" and draws):
        # Partitioned, a call needs a sharding of its own, which buffer_callback cannot
        # carry: without one XLA's partitioner runs it on every device (each on the gathered
        # value: one torch call per device), and refuses one that draws. Placed once on
        # device 0 (per device in shard_map), it runs on host copies of its operands.
        # Its outputs come out pinned to that one device, a sharding later JAX operations
        # on them cannot convert (jax 0.10): the barrier leaves the partitioner free to
        # place them. Inside shard_map a call that does not draw runs per device anyway,
        # on its own shard: buffer_callback, below, with no copies.
        host = _numpy_host(run, out_structs, out_paths, name)
        if can_place_callbacks:
            outs = placed_call(host, out_structs, operands, draws)
        else:
            outs = io_callback(host, list(out_structs), *operands, ordered=False)
        return list(jax.lax.optimization_barrier(list(outs)))
    if not USE_BUFFER_CALLBACK:
        return _pure_callback_call(run, operands, out_structs, out_paths, draws, name)
    on_cpu = None  # fixed by the first call: a buffer_callback is lowered for one platform

    def slow(host: Callable, ctx: Any, outs: list, ins: tuple) -> None:
        """The full way, for any call: `host` is the callback that called it, entered
        again in the state the call must run in."""
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
        if not on_cpu:
            with _xla_stream(ctx, (ins or outs)[0]):
                _run_into(run, ins, outs, out_paths, buffer_tensor, share_outputs)
        elif share_outputs:
            _run_sharing_outputs(
                run, [tensor_from_capsule(b.__dlpack__()) for b in ins], outs, out_paths
            )
        else:
            _run_into(run, ins, outs, out_paths, buffer_tensor)

    if share_outputs or not hot_paths.ENABLED:

        def host(ctx: Any, outs: list, *ins: Any) -> None:
            try:
                slow(host, ctx, outs, ins)
            except Exception as e:
                raise as_reported(e) from None  # (_call/_callback_errors.py)

    else:
        # One output of a fixed dtype: its copy without the loop, measured 0.5 µs (4%) faster.
        one_out = torch_dtype(out_structs[0].dtype) if len(out_structs) == 1 else None
        host = hot_paths.jit_host(run, list(out_paths), one_out, slow)

    if plan is not None and plan.hot and not share_outputs:
        host = hot_paths.jit_hot_host(plan, host)
    large = large_outputs(out_structs)  # on the CPU, huge pages for them (_call/_huge_pages.py)
    callback = _advising(host, large) if large else host  # (_host's recursion: not twice)
    callback = _ranged(callback, name)
    return buffer_callback(callback, list(out_structs), has_side_effect=draws)(*operands)


def _ranged(host: Callable, name: str) -> Callable:
    """`host` as a named range in the torch or jax profiler that records, if one does. This
    is the outermost callback frame now: it raises the stand-in (_call/_callback_errors.py)."""

    def ranged_host(ctx: Any, outs: list, *ins: Any) -> None:
        try:
            if profiling():
                with profiled(name):
                    return host(ctx, outs, *ins)
            return host(ctx, outs, *ins)
        except Exception as e:
            raise as_reported(e) from None

    return ranged_host


def _advising(host: Callable, large: tuple[int, ...]) -> Callable:
    def advising_host(ctx: Any, outs: list, *ins: Any) -> None:
        advise(outs, large)
        return host(ctx, outs, *ins)

    return advising_host


def _run_into(
    run: Run, ins: Sequence, outs: Sequence, out_paths: Sequence[str], wrap, share: bool = False
) -> None:
    tensors = [wrap(b) for b in ins]
    if share:
        _run_sharing_outputs(run, tensors, outs, out_paths)
        return
    write_all(run(tensors), outs, out_paths, wrap)
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
    copy_kept_inputs(tensors)


def _is_buffer(value: Any, dst: torch.Tensor) -> bool:
    """Whether `value` is XLA's buffer `dst` itself (or an alias of it: the plan's
    checks may detach an output), so that it holds the output already."""
    return (
        type(value) is _Tensor
        and value.const_data_ptr() == dst.const_data_ptr()
        and value.dtype is dst.dtype
        and value.shape == dst.shape
        and value.stride() == dst.stride()
    )


def _numpy_host(run: Run, out_structs, out_paths, name: str) -> Callable:
    """`run` as a host callback on numpy arrays: numpy operands in (wrapped zero-copy), a
    list of numpy results out."""

    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        try:  # (the outermost callback frame raises the stand-in: see _ranged)
            if profiling():
                with profiled(name):
                    return on_host(arrays)
            return on_host(arrays)
        except Exception as e:
            raise as_reported(e) from None

    def on_host(arrays: tuple) -> list[np.ndarray]:
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
            raise as_reported(e) from None  # (_call/_callback_errors.py)

    return host


def _pure_callback_call(run, operands, out_structs, out_paths, draws=False, name="torchjax"):
    host = _numpy_host(run, out_structs, out_paths, name)
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
    name = f"torchjax {describe(fn)}"  # its range in a profiler's trace
    outs = callback_call(plan.run, operands, plan.structs, plan.out_paths, share, plan, draws, name)
    return jax.tree_util.tree_unflatten(plan.out_tree, outs)


torch_call_p.def_lowering(lowering, signature=True)
