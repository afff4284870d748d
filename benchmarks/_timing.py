"""Shared timing helpers: medians over repeated runs, and a markdown table with ratios."""

from __future__ import annotations

import itertools
import statistics
import timeit
from collections.abc import Callable

REPEAT = 7  # runs per measurement; the median of these is reported
MIN_RUN_SECONDS = 0.2  # each run makes enough calls to last at least this long

Row = tuple[str, float, str, float]  # (case, seconds, baseline name, baseline seconds)
Table = tuple[str, list[Row]]  # (title, rows)


def configure(*, repeat: int, min_run_seconds: float) -> None:
    """Set the repeat count and run length of every later `median_seconds` (for smoke runs)."""
    global REPEAT, MIN_RUN_SECONDS
    REPEAT, MIN_RUN_SECONDS = repeat, min_run_seconds


def _calls_per_run(timer: timeit.Timer) -> int:
    # timeit.Timer.autorange with MIN_RUN_SECONDS in place of its fixed 0.2 s.
    for i in itertools.count():
        for j in (1, 2, 5):
            number = j * 10**i
            if timer.timeit(number) >= MIN_RUN_SECONDS:
                return number
    raise AssertionError("unreachable")


def median_seconds(fn: Callable[[], object], repeat: int | None = None) -> float:
    """Median per-call time of `fn` over `repeat` runs of an auto-ranged number of calls."""
    fn()  # warm up: compile, fill caches
    timer = timeit.Timer(fn)
    number = _calls_per_run(timer)
    runs = timer.repeat(repeat=repeat or REPEAT, number=number)
    return statistics.median(t / number for t in runs)


def paired_seconds(fn: Callable[[], object], base: Callable[[], object]) -> tuple[float, float]:
    """Medians of `fn` and `base`, timed in alternating runs.

    On a shared machine the speed drifts over seconds; alternating the runs exposes both
    functions to the same drift, so their ratio is steadier than from separate medians.
    """
    fn(), base()  # warm up: compile, fill caches
    timers = timeit.Timer(fn), timeit.Timer(base)
    numbers = [_calls_per_run(t) for t in timers]
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(REPEAT):
        for timer, number, out in zip(timers, numbers, runs, strict=True):
            out.append(timer.timeit(number) / number)
    return statistics.median(runs[0]), statistics.median(runs[1])


def paired_row(name: str, fn: Callable[[], object], base_name: str, base: Callable) -> Row:
    """A table row whose case and baseline were timed in alternating runs."""
    t, t_base = paired_seconds(fn, base)
    return (name, t, base_name, t_base)


def format_table(title: str, rows: list[Row]) -> str:
    """A markdown table of medians and ratios under a `### title` heading."""
    lines = [
        f"### {title}",
        "",
        "| case | median µs | baseline | baseline µs | ratio |",
        "|---|---:|---|---:|---:|",
    ]
    for name, t, base_name, base in rows:
        lines.append(
            f"| {name} | {t * 1e6:,.1f} | {base_name} | {base * 1e6:,.1f} | {t / base:.2f}x |"
        )
    return "\n".join(lines)


def format_tables(tables: list[Table]) -> str:
    """What `print_table` prints for each table in turn, as one string."""
    return "".join(f"\n{format_table(title, rows)}\n" for title, rows in tables)


def print_table(title: str, rows: list[Row]) -> None:
    """rows: (case, seconds, baseline name, baseline seconds); prints medians and ratios."""
    print(f"\n{format_table(title, rows)}")
