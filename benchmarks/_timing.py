"""Shared timing helpers: medians over repeated runs, and a markdown table with ratios."""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable

REPEAT = 7


def median_seconds(fn: Callable[[], object], repeat: int = REPEAT) -> float:
    """Median per-call time of `fn` over `repeat` runs of an auto-ranged number of calls."""
    fn()  # warm up: compile, fill caches
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()  # enough calls for about 0.2 s per run
    return statistics.median(t / number for t in timer.repeat(repeat=repeat, number=number))


def print_table(title: str, rows: list[tuple[str, float, str, float]]) -> None:
    """rows: (case, seconds, baseline name, baseline seconds); prints medians and ratios."""
    print(f"\n### {title}\n")
    print("| case | median µs | baseline | baseline µs | ratio |")
    print("|---|---:|---|---:|---:|")
    for name, t, base_name, base in rows:
        print(f"| {name} | {t * 1e6:,.1f} | {base_name} | {base * 1e6:,.1f} | {t / base:.2f}x |")
