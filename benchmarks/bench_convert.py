# Cost of tree_to_jax / tree_to_torch on one float32 array, against np.copy of the same size.
#
# Zero-copy conversion costs a fixed overhead per leaf, independent of size; a copy costs
# time proportional to size. So the ratio to np.copy is what to read: near or above 1 for
# tiny arrays (both are overhead), far below 1 for large ones (no bytes move).
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import torch
from _timing import median_seconds

import torchjax

SIZES = [16, 2**24]

ConvertRow = tuple[str, int, float, float]  # (call, elements, seconds, np.copy seconds)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def measure() -> list[ConvertRow]:
    """Median per-call times of both conversions and of np.copy, for each size in SIZES."""
    rows = []
    for n in SIZES:
        host = np.arange(n, dtype=np.float32)
        tensor = torch.from_numpy(host).clone()
        array = jnp.asarray(host)
        array.block_until_ready()
        baseline = median_seconds(functools.partial(np.copy, host))
        # Check once that the path measured is the zero-copy one.
        if torchjax.tree_to_jax(tensor).unsafe_buffer_pointer() != tensor.data_ptr():
            raise RuntimeError("tree_to_jax copied; this benchmark measures the zero-copy path")
        if torchjax.tree_to_torch(array).data_ptr() != array.unsafe_buffer_pointer():
            raise RuntimeError("tree_to_torch copied; this benchmark measures the zero-copy path")
        for name, fn in [
            ("tree_to_jax(tensor)", functools.partial(torchjax.tree_to_jax, tensor)),
            ("tree_to_torch(array)", functools.partial(torchjax.tree_to_torch, array)),
        ]:
            t = median_seconds(fn)
            rows.append((name, n, t, baseline))
    return rows


def format_results(rows: list[ConvertRow]) -> str:
    """A markdown table of median per-call times and their ratio to np.copy."""
    lines = [
        "| call | elements (float32) | median µs | np.copy median µs | ratio to np.copy |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, n, t, baseline in rows:
        lines.append(f"| `{name}` | {n:,} | {_fmt(t)} | {_fmt(baseline)} | {t / baseline:.3g} |")
    return "\n".join(lines)


def main() -> None:
    """Print a markdown table of median per-call times and their ratio to np.copy."""
    print(format_results(measure()))


if __name__ == "__main__":
    main()
