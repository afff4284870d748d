# What torchjax does, for a user to watch: the "torchjax" logger and profiler ranges.
#
# The logger is silent by default (Python's default shows WARNING and above, and torchjax logs
# below that). TORCHJAX_LOG=debug (or info) in the environment turns it on from outside, with
# a handler on stderr: set before `import torchjax`. DEBUG reports fake runs, traces,
# torch.export captures (signature and time), copies made and why, kept graphs evicted, and
# fallbacks (a sequential vmap, an op run as a callback); INFO reports a fake run or capture
# that took over SLOW_SECONDS.
#
# Profiler ranges: each torch call is a named range in a torch.profiler trace and in a
# jax.profiler trace (Perfetto, TensorBoard), entered only while one of them records: two
# flag reads per call otherwise (docs/benchmarks.md measures it).
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import jax
import torch

from torchjax._compat._jax import jax_profiler_active
from torchjax._compat._torch import profiler_enabled

logger = logging.getLogger("torchjax")

ENV = "TORCHJAX_LOG"
SLOW_SECONDS = 2.0


def _from_environment() -> None:
    """TORCHJAX_LOG=debug|info|warning: that level, with a handler on stderr (once)."""
    level = os.environ.get(ENV, "").strip().upper()
    if not level:
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        logger.warning("%s=%r is not one of debug, info, warning, error: ignored", ENV, level)
        return
    logger.setLevel(level)
    if not any(getattr(h, "_torchjax", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        handler._torchjax = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


_from_environment()

debug_on = logger.isEnabledFor  # (cached by logging: a dict lookup per call)


def signature(tree: Any) -> str:
    """`f32[4,3], {'a': i32[]}`-style types of a pytree of arrays, avals or tensors."""

    def one(x: Any) -> Any:
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is None or dtype is None:
            return x
        name = str(dtype).removeprefix("torch.")
        return f"{name}{list(shape)}".replace(" ", "")

    typed = jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, torch.Tensor))
    return str(typed).replace("'", "")


_KINDS = {
    "JvpFunction": "jvp",
    "VjpFunction": "vjp",
    "BatchedFunction": "vmap",
    "LeadingAxisFunction": "vmap",
    "KeptForward": "forward kept for vjp",
    "ForwardResiduals": "forward with residuals",
    "BatchedKeptForward": "vmap forward kept for vjp",
    "BatchedKeptVjp": "vmap vjp",
}


def describe(fn: Any) -> str:
    """A torch callable as `vjp(vmap(f))`: the transforms around the user's function."""
    kinds = []
    while hasattr(fn, "inner"):
        kinds.append(_KINDS.get(type(fn).__name__, type(fn).__name__))
        fn = fn.inner
    name = getattr(fn, "name", None) or type(fn).__name__
    for kind in reversed(kinds):
        name = f"{kind}({name})"
    return name


@contextlib.contextmanager
def timed(what: str, *args: Any) -> Iterator[None]:
    """Log `what % args` with the time it took: DEBUG, or INFO past SLOW_SECONDS."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        level = logging.INFO if seconds > SLOW_SECONDS else logging.DEBUG
        if logger.isEnabledFor(level):
            slow = " (slow: see docs/recipes.md, 'Where the time goes')" if level > 10 else ""
            logger.log(level, what + " took %.3f s%s", *args, seconds, slow)


def profiling() -> bool:
    """Whether a torch or jax profiler records now (cheap: two flag reads)."""
    return profiler_enabled() or jax_profiler_active()


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """`name` as a range in whichever of torch's and jax's profilers records."""
    with contextlib.ExitStack() as stack:
        if profiler_enabled():
            stack.enter_context(torch.profiler.record_function(name))
        if jax_profiler_active():
            stack.enter_context(jax.profiler.TraceAnnotation(name))
        yield
