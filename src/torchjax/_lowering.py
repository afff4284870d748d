# Lowering a torch call under jax.jit: a host callback that runs torch on XLA's buffers.
#
# jax.experimental.buffer_callback hands the callback XLA's own input and output buffers.
# Inputs are wrapped zero-copy with DLPack; torch computes the outputs and each is copied
# once into XLA's output buffer (torch allocates its results itself, so that copy is the
# one unavoidable one). On GPU torch runs on XLA's stream (ctx.stream), so the work is
# ordered after XLA's producers and before its consumers with no device-wide synchronize.
# Where buffer_callback is missing (JAX < 0.6.1) jax.pure_callback is the fallback: it
# copies inputs and outputs through host numpy arrays.
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch

from torchjax._convert import narrow_checked, torch_dtype
from torchjax._errors import OutputMismatchError

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # pragma: no cover - exercised by forcing the flag in tests
    buffer_callback = None

# Tests flip this to exercise the documented pure_callback fallback.
USE_BUFFER_CALLBACK = buffer_callback is not None

# `run(tensors)` computes the flat outputs (tensors or Python numbers) from the flat inputs.
Run = Callable[[list[torch.Tensor]], Sequence[Any]]


def _buffer_to_tensor(buf: Any) -> torch.Tensor:
    if buf.__dlpack_device__()[0] == 1:  # kDLCPU: the capsule path skips stream handling
        return torch.utils.dlpack.from_dlpack(buf.__dlpack__())
    return torch.from_dlpack(buf)


def write_output(dst: torch.Tensor, value: Any, where: str, name: str) -> None:
    """Copy one torch result into XLA's output tensor, checking shape and dtype exactly."""
    if not isinstance(value, torch.Tensor):
        dst.fill_(value)
        return
    if tuple(value.shape) != tuple(dst.shape):
        raise OutputMismatchError(
            f"{name} returned shape {list(value.shape)} at {where}, but {list(dst.shape)} was "
            f"declared or inferred. Fix result_shape_dtypes, or the function."
        )
    if value.dtype != dst.dtype:  # only x64 narrowing gets here (callers check the type)
        value = narrow_checked(value, dst.dtype, where)
    dst.copy_(value)


def _gpu_stream(ctx: Any, tensors: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    if tensors and tensors[0].is_cuda:
        return torch.cuda.stream(torch.cuda.ExternalStream(ctx.stream, device=tensors[0].device))
    return contextlib.nullcontext()


def callback_call(
    run: Run,
    operands: Sequence[Any],
    out_structs: Sequence[jax.ShapeDtypeStruct],
    out_paths: Sequence[str],
    name: str,
) -> list[Any]:
    """Stage a host call of `run` into the current JAX trace; returns the flat outputs."""
    if not USE_BUFFER_CALLBACK:
        return _pure_callback_call(run, operands, out_structs, out_paths, name)

    def host(ctx: Any, outs: list, *ins: Any) -> None:
        tensors = [_buffer_to_tensor(b) for b in ins]
        with _gpu_stream(ctx, tensors):
            results = run(tensors)
            for buf, value, where in zip(outs, results, out_paths, strict=True):
                write_output(_buffer_to_tensor(buf), value, where, name)

    return buffer_callback(host, list(out_structs))(*operands)


def _numpy_to_tensor(a: np.ndarray) -> torch.Tensor:
    a = np.array(a, copy=True)  # pure_callback's arrays may be read-only views
    if a.dtype == jax.numpy.bfloat16:  # numpy has no bfloat16; reinterpret the bits
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _pure_callback_call(run, operands, out_structs, out_paths, name):
    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        tensors = [_numpy_to_tensor(a) for a in arrays]
        results = []
        for s, value, where in zip(out_structs, run(tensors), out_paths, strict=True):
            dst = torch.empty(s.shape, dtype=torch_dtype(s.dtype))
            write_output(dst, value, where, name)
            if dst.dtype == torch.bfloat16:  # numpy has no bfloat16; reinterpret the bits
                results.append(dst.view(torch.int16).numpy().view(s.dtype))
            else:
                results.append(dst.numpy())
        return results

    return jax.pure_callback(host, list(out_structs), *operands, vmap_method="sequential")
