# Huge pages for XLA's large output buffers on the CPU.
#
# Under jit XLA allocates a call's buffers for each execution, and a large one comes fresh
# from the kernel: glibc maps an allocation over its mmap threshold (at most 32 MiB) on its
# own and unmaps it when it is freed. The callback's write into an output buffer is then the
# memory's first touch, one page fault per 4 KiB page. On the VM these numbers come from,
# writing GPT-2's 473 MiB of gradients into fresh memory took 200-250 ms, into touched
# memory 35 ms. Where the kernel gives transparent huge pages to memory that asks for them
# (/sys/kernel/mm/transparent_hugepage/enabled reads "[madvise]", a common default), the
# callback asks for them (madvise(MADV_HUGEPAGE)) on each output buffer of 4 MiB or more,
# before it writes: one fault per 2 MiB, and the same write took 55-60 ms. numpy asks the
# same for its own arrays of 4 MiB or more. The advice changes how the memory is backed,
# never what it holds, and it covers only whole 2 MiB pages inside the buffer (memory the
# write touches anyway). With "[always]" the kernel does this unasked, with "[never]" it
# cannot; elsewhere (not Linux, no libc) nothing is asked. TORCHJAX_HUGE_PAGES=0 turns the
# advice off.
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchjax._compat._torch import _DL_CPU, tensor_from_capsule

THRESHOLD = 4 * 2**20  # bytes: a smaller buffer is a few faults (numpy's threshold too)
_HUGE_PAGE = 2 * 2**20  # x86-64's and arm64's (4 KiB base pages) transparent huge page
_MADV_HUGEPAGE = 14  # linux/mman.h
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _kernel_gives_on_request() -> bool:
    try:
        with open(_THP_MODE) as f:
            return "[madvise]" in f.read()
    except OSError:
        return False


def _libc_madvise() -> Any:
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = None
if (
    sys.platform.startswith("linux")
    and os.environ.get("TORCHJAX_HUGE_PAGES", "1") != "0"
    and _kernel_gives_on_request()
):
    _madvise = _libc_madvise()

# Read when a callback is lowered (benchmarks and tests flip it to compare).
ENABLED = _madvise is not None


def large_outputs(out_structs: Sequence[Any]) -> tuple[int, ...]:
    """The positions of the outputs whose buffers get the advice: none where it is off."""
    if not ENABLED or _madvise is None:
        return ()
    sizes = [
        int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize for s in out_structs
    ]
    return tuple(i for i, n in enumerate(sizes) if n >= THRESHOLD)


def advise(outs: Sequence[Any], which: tuple[int, ...]) -> None:
    """Ask for huge pages on XLA's output buffers `outs[i]`, i in `which`, if on the CPU (a
    device buffer's address is not host memory). A refusal (EINVAL on an old kernel) only
    leaves the memory as it was, so it is not an error."""
    for i in which:
        buf = outs[i]
        if buf.__dlpack_device__()[0] != _DL_CPU:
            return  # a callback is lowered for one platform: all or none are on the CPU
        try:
            dst = tensor_from_capsule(buf.__dlpack__())
        except (RuntimeError, TypeError, BufferError):
            continue  # a dtype DLPack cannot hand over is written another way: no advice
        start = dst.data_ptr()
        end = (start + dst.nbytes) & -_HUGE_PAGE  # whole huge pages inside the buffer only
        start = (start + _HUGE_PAGE - 1) & -_HUGE_PAGE
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)
