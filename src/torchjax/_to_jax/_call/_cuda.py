# GPU: how torch's work is ordered with XLA's, and what a GPU out-of-memory error says.
#
# torch and XLA each queue work on their own CUDA streams and each has its own caching
# allocator. Three rules keep their work in order (docs/how_it_works.md, "Streams"):
#
# * Under jit the callback runs torch on XLA's stream (ctx.stream), so torch's kernels run
#   after XLA's producers of the inputs and before XLA's consumers of the outputs. Work the
#   user queued on torch's current stream before the call (a closed-over tensor just
#   written) is waited for first, and torch's current stream waits for the call's work
#   after it: one event each way, none where the two streams are the same.
# * A kept autograd graph (forward now, backward later) holds tensors torch allocated on
#   the forward's stream. A backward on another stream waits for the forward's stream, and
#   the forward's stream then waits for the backward: its allocator hands the freed blocks
#   only to later work on the forward's stream, which so runs after the backward's reads
#   (what Tensor.record_stream does, for a graph's tensors that cannot be listed).
# * Eager DLPack hand-overs pass the consumer's stream (torch.from_dlpack and
#   jax.dlpack.from_dlpack both do); torch's export reads the current device, so
#   _convert.py enters the tensor's device around it.
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def on_xla_stream(stream_ptr: int, device_index: int) -> Iterator[None]:
    """Run the body with XLA's stream as torch's current stream on `device_index`, ordered
    after the work already queued on torch's own current stream there, and with torch's
    current stream ordered after the body's work."""
    device = torch.device("cuda", device_index)
    xla = torch.cuda.ExternalStream(stream_ptr, device=device)
    user = torch.cuda.current_stream(device)
    apart = user.cuda_stream != xla.cuda_stream
    if apart:
        xla.wait_stream(user)
    try:
        with torch.cuda.stream(xla):  # also makes `device` torch's current device
            yield
    finally:
        if apart:
            user.wait_stream(xla)


def forward_stream(inputs: list[torch.Tensor]) -> Any:
    """The CUDA stream a forward on `inputs` runs on (torch's current stream of their
    device), or None for a forward off the GPU."""
    for t in inputs:
        if t.is_cuda:
            return torch.cuda.current_stream(t.device)
    return None


@contextlib.contextmanager
def ordered_with(stream: Any) -> Iterator[None]:
    """Order the body, run on torch's current stream, after `stream` (a kept graph's
    forward stream, or None), and later work on `stream` after the body."""
    if stream is None:
        yield
        return
    here = torch.cuda.current_stream(stream.device)
    apart = here.cuda_stream != stream.cuda_stream
    if apart:
        here.wait_stream(stream)
    try:
        yield
    finally:
        if apart:
            stream.wait_stream(here)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def gpu_oom_note(jax_devices: list, environ: Any = os.environ) -> str | None:
    """A note for torch's CUDA out-of-memory error raised inside a wrapped call, or None
    where JAX holds no GPU (then torch's own message says all there is)."""
    gpus = [d for d in jax_devices if d.platform in ("gpu", "cuda", "rocm")]
    if not gpus:
        return None
    held = []
    for d in gpus:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - stats are a nicety; the advice stands without
            stats = {}
        if "bytes_limit" in stats:
            held.append(
                f"{d}: {_gib(stats.get('bytes_in_use', 0))} in use of a "
                f"{_gib(stats['bytes_limit'])} pool"
            )
    lines = [
        "torch ran out of GPU memory inside a torchjax call: torch and JAX share the GPU, "
        "each with its own allocator" + (f" (JAX: {'; '.join(held)})" if held else "") + "."
    ]
    if environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() not in ("false", "0"):
        fraction = environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ".75")
        lines.append(
            f"JAX reserved {fraction} of the GPU's memory when it started (its "
            f"preallocation), so torch gets only the rest. Set XLA_PYTHON_CLIENT_PREALLOCATE="
            f"false (JAX then allocates what it needs), or a smaller "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION, in the environment before JAX starts."
        )
    else:
        lines.append(
            "JAX's preallocation is already off: the program needs more than the GPU holds; "
            "use smaller batches, or free JAX arrays you no longer need."
        )
    if "expandable_segments:true" not in environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower():
        lines.append(
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets torch's allocator grow its "
            "segments in place instead of reserving new ones, which cuts the memory it holds "
            "but cannot use (fragmentation)."
        )
    return " ".join(lines)
