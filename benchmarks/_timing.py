"""Shared timing helpers: medians over repeated runs, and a markdown table with ratios; and
the peak of memory in use while something runs."""

from __future__ import annotations

import ctypes
import itertools
import statistics
import threading
import time
import timeit
from collections.abc import Callable

REPEAT = 7  # runs per measurement; the median of these is reported
MIN_RUN_SECONDS = 0.2  # each run makes enough calls to last at least this long
MIN_PAIRS = 5  # paired_seconds times at least this many calls of each function

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
    """Medians of `fn` and `base`, called alternately, one call each, over and over.

    On a shared machine the speed drifts within fractions of a second (other tenants,
    cache contents). Alternating single calls exposes both functions to the same
    conditions at every moment, so their ratio is steadier than from separate runs. Runs
    for REPEAT * MIN_RUN_SECONDS per function (at least MIN_PAIRS pairs); per-call timer
    overhead is well under a microsecond.
    """
    fn(), base()  # warm up: compile, fill caches
    clock = time.perf_counter
    times: tuple[list[float], list[float]] = ([], [])
    deadline = clock() + 2 * REPEAT * MIN_RUN_SECONDS
    while clock() < deadline or len(times[0]) < MIN_PAIRS:
        t0 = clock()
        fn()
        t1 = clock()
        base()
        t2 = clock()
        times[0].append(t1 - t0)
        times[1].append(t2 - t1)
    return statistics.median(times[0]), statistics.median(times[1])


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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
        "keepcost".split()
    ]


_libc = None


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not taken back (glibc's mallinfo2: heap chunks in use
    plus mmapped chunks). torch's and XLA's CPU buffers both come from malloc; RSS would not
    do, since the allocator keeps freed pages."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6")
        _libc.mallinfo2.restype = _MallInfo2
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakInUse:
    """`with PeakInUse() as p: ...`: p.peak is the most malloc_in_use() seen, sampled every
    0.2 ms on a thread of its own while the block runs."""

    def __enter__(self) -> PeakInUse:
        self.peak, self._done = malloc_in_use(), False
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done:
            self.peak = max(self.peak, malloc_in_use())
            time.sleep(0.0002)

    def __exit__(self, *exc: object) -> None:
        self._done = True
        self._thread.join()
