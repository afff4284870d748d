"""Compare torchjax with other ways to call torch from JAX, and regenerate docs/benchmarks.md.

Runs every benchmark's measurement (conversion, to_jax overhead, vmap, grad/jvp, module_to_jax,
to_torch) and an array-size sweep of f(x) = x * 2 + 1 through each bridge, all in one process,
and prints the tables. With --write it also writes docs/benchmarks.md and
docs/benchmark_sweep.png, keeping the doc's hand-written blocks (HAND_WRITTEN).

Usage:
  python benchmarks/compare.py                   # measure and print
  python benchmarks/compare.py --write           # ... and regenerate the doc and the plot
  python benchmarks/compare.py --quick --sizes 16,256 --sections sweep   # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the bench modules import `_timing` as a top-level module
    sys.path.insert(0, str(HERE))

import _timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import torchjax  # noqa: E402

ROOT = HERE.parent
DOC = "benchmarks.md"
PLOT = "benchmark_sweep.png"
SIZES = [16, 256, 4096, 65536, 2**20, 2**24]

# The other benchmarks, in the doc's order: (bench module, section heading).
SUITES = {
    "convert": "Conversion: `tree_to_jax` / `tree_to_torch`",
    "to_jax": "`to_jax` overhead",
    "vmap": "`jax.vmap` of a wrapped function",
    "grad": "`jax.grad` and `jax.jvp` through a wrapped function",
    "hessian": "`jax.hessian` through a wrapped function",
    "train": "A training step, against torch's own",
    "gpt2": "A GPT-2 training step, against torch's fastest: time and memory",
    "resnet": "A BatchNorm ResNet training step, against torch's own",
    "module": "`module_to_jax` overhead",
    "concurrent": "Concurrent `module_to_jax` calls: `shard_map` over 4 devices",
    "to_torch": "`to_torch` overhead",
    "compile_cache": "A new process's first jitted call: JAX's persistent compilation cache",
}
SECTIONS = [*SUITES, "sweep"]

# Optional bridges: pip distribution name -> what it needs; see requirements-compare.txt.
OPTIONAL = {
    "torch-jax-interop": "imports chex without declaring it",
    "wrap-torch2jax": (
        "builds a C++ extension with torch.utils.cpp_extension on first use (g++ and ninja; "
        "cached under ~/.cache/torch2jax)"
    ),
}

# jax.pure_callback hands the callback read-only numpy arrays; torch warns once that it cannot
# guarantee they stay unwritten. The function here writes nothing.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def f(x):  # [N] -> [N], the function every method in the sweep computes
    return x * 2 + 1


# --------------------------------------------------------------------------------------------
# The sweep: one method = a way to get f's result for a float32 vector of n elements.


@dataclass(frozen=True)
class Method:
    """`make(fn, n)` returns `g`, where `g(x)` computes the torch function `fn` on n elements.

    `g` takes the torch tensor where `torch_input` (native torch), else the JAX array.
    `library` names the optional distribution the method needs (None: always measured).
    """

    name: str
    make: Callable[[Callable, int], Callable[[Any], Any]]
    torch_input: bool = False
    library: str | None = None


def _native(fn, n):
    del n
    return fn


def _to_jax_eager(fn, n):
    del n
    return torchjax.to_jax(fn)


def _to_jax_jit(fn, n):
    del n
    return jax.jit(torchjax.to_jax(fn))


def _pure_callback_jit(fn, n):
    def callback(a):  # numpy in, numpy out; torch computes
        # JAX 0.10 hands the callback jax.Arrays on CPU; np.asarray views them as numpy.
        return fn(torch.from_numpy(np.asarray(a))).numpy()

    out = jax.ShapeDtypeStruct((n,), jnp.float32)
    return jax.jit(lambda x: jax.pure_callback(callback, out, x, vmap_method="sequential"))


def _interop_eager(fn, n):
    del n
    from torch_jax_interop import torch_to_jax

    return torch_to_jax(fn)


def _interop_jit(fn, n):
    return jax.jit(_interop_eager(fn, n))


def _torch2jax_eager(fn, n):
    from wrap_torch2jax import torch2jax

    return torch2jax(fn, torch.empty(n, dtype=torch.float32))


def _torch2jax_jit(fn, n):
    return jax.jit(_torch2jax_eager(fn, n))


METHODS = [
    Method("native torch", _native, torch_input=True),
    Method("to_jax eager", _to_jax_eager),
    Method("jax.jit(to_jax)", _to_jax_jit),
    Method("jax.jit(pure_callback)", _pure_callback_jit),
    Method("torch_jax_interop eager", _interop_eager, library="torch-jax-interop"),
    Method("jax.jit(torch_jax_interop)", _interop_jit, library="torch-jax-interop"),
    Method("wrap_torch2jax", _torch2jax_eager, library="wrap-torch2jax"),
    Method("jax.jit(wrap_torch2jax)", _torch2jax_jit, library="wrap-torch2jax"),
]
BASELINE = "native torch"


@dataclass
class Sweep:
    sizes: list[int]
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)  # method -> n -> s
    notes: list[str] = field(default_factory=list)  # skipped methods and why


def _short(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}"


def _check_runs_torch(method: Method, n: int, x, t) -> str | None:
    """Build the method on a probe of f; None if torch saw only tensors and the result is right.

    Otherwise, why the method is not measured. The probe matters: a bridge that hands JAX
    tracers to the function would still compute x * 2 + 1 (JAX traces the arithmetic), and
    the timing would then be of XLA, not torch.
    """
    seen: set[type] = set()

    def probe(v):
        seen.add(type(v))
        return f(v)

    out = method.make(probe, n)(t if method.torch_input else x)
    not_torch = sorted(tp.__name__ for tp in seen if not issubclass(tp, torch.Tensor))
    if not_torch:
        return (
            f"the function received {', '.join(not_torch)}, not torch.Tensor: torch never runs "
            "(JAX traced the arithmetic), and a torch-only op would fail"
        )
    got = out.numpy() if isinstance(out, torch.Tensor) else np.asarray(out)
    if not np.allclose(got, f(np.arange(n, dtype=np.float32))):
        return "wrong result"
    return None


def _available(library: str) -> str | None:
    """None if `library` is installed, else a note saying it is not."""
    try:
        importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return f"not installed (`pip install -r requirements-compare.txt`; it {OPTIONAL[library]})"
    return None


def measure_sweep(sizes: list[int], *, optional: bool = True) -> Sweep:
    """Median per-call time of every method at every size; a failing method is skipped."""
    sweep = Sweep(sizes)
    skipped: dict[str, str] = {}
    for m in METHODS:
        if m.library is None:
            continue
        if not optional:
            skipped[m.name] = "optional libraries not requested (--no-optional)"
        elif (why := _available(m.library)) is not None:
            skipped[m.name] = why
    for n in sizes:
        t = torch.arange(n, dtype=torch.float32)
        x = jnp.arange(n, dtype=jnp.float32).block_until_ready()
        for m in METHODS:
            if m.name in skipped:
                continue
            try:
                why = _check_runs_torch(m, n, x, t)
                if why is None:
                    g = m.make(f, n)
                    arg = t if m.torch_input else x
                    if m.torch_input:
                        s = _timing.median_seconds(lambda g=g, arg=arg: g(arg))
                    else:
                        s = _timing.median_seconds(
                            lambda g=g, arg=arg: jax.block_until_ready(g(arg))
                        )
                    sweep.seconds.setdefault(m.name, {})[n] = s
            except Exception as e:  # an optional bridge that breaks on this JAX or torch
                if m.library is None:
                    raise
                why = f"failed at {n:,} elements with jax {jax.__version__}: {_short(e)}"
            if why is not None:
                if m.library is None:  # torchjax or a baseline: a bug, not a note
                    raise RuntimeError(f"{m.name} at {n:,} elements: {why}")
                skipped[m.name] = why
                sweep.seconds.pop(m.name, None)  # no partial lines in the table or plot
    for name, why in skipped.items():
        sweep.notes.append(f"{name}: not measured; {why}.")
    return sweep


def format_sweep(sweep: Sweep) -> str:
    """Markdown table: one row per size, one column per measured method, µs and ratio."""
    names = [m.name for m in METHODS if m.name in sweep.seconds]
    lines = [
        "### f(x) = x * 2 + 1 on float32, median µs per call (ratio to native torch)",
        "",
        "| elements | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for n in sweep.sizes:
        base = sweep.seconds.get(BASELINE, {}).get(n)
        cells = []
        for name in names:
            s = sweep.seconds[name].get(n)
            if s is None:
                cells.append("—")
            elif base is None or name == BASELINE:
                cells.append(f"{s * 1e6:,.1f}")
            else:
                cells.append(f"{s * 1e6:,.1f} ({s / base:.2f}x)")
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    if sweep.notes:
        lines.append("")
        lines.extend(f"- {note}" for note in sweep.notes)
    return "\n".join(lines)


def _size_label(n: int) -> str:
    return f"$2^{{{n.bit_length() - 1}}}$" if n > 0 and n & (n - 1) == 0 else f"{n:,}"


def plot_sweep(sweep: Sweep, path: Path) -> None:
    """Log-log per-call time against size, one line per measured method, as a PNG."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")  # no display; writes files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for m in METHODS:
        if m.name not in sweep.seconds:
            continue
        points = sorted(sweep.seconds[m.name].items())
        style = "-" if m.library is None else "--"
        ax.plot(
            [n for n, _ in points],
            [s * 1e6 for _, s in points],
            style,
            marker="o",
            markersize=4,
            label=m.name,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sweep.sizes, [_size_label(n) for n in sweep.sizes])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("elements (float32)")
    ax.set_ylabel("median time per call (µs)")
    ax.set_title("f(x) = x * 2 + 1: torch called from JAX, by method")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# The report.


def _banner(module: ModuleType) -> str:
    """The leading `#` comment block of a bench file, as prose."""
    lines = []
    for line in Path(module.__file__).read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.removeprefix("#").removeprefix(" "))
    return "\n".join(lines).strip()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_lines() -> list[str]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = [
        f"torch {torch.__version__}",
        f"jax {jax.__version__}",
        f"jaxlib {_version('jaxlib')}",
        f"numpy {np.__version__}",
        f"Python {platform.python_version()}",
    ]
    versions += [f"{d} {v}" for d in OPTIONAL if (v := _version(d)) is not None]
    return [
        f"- Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- CPU: {_cpu_model()}; {os.cpu_count()} CPUs, {usable} usable by this process; "
        f"torch uses {torch.get_num_threads()} threads",
        f"- OS: {platform.platform()}",
        f"- JAX devices: {', '.join(str(d) for d in jax.devices())}",
        f"- Versions: {', '.join(versions)}",
        f"- Timing: a case and its baseline are called alternately, one call each, for "
        f"{2 * _timing.REPEAT * _timing.MIN_RUN_SECONDS:g} s (at least {_timing.MIN_PAIRS} "
        f"calls each); each number is the median of its calls. Unpaired numbers (the size "
        f"sweep, conversion, to_torch) are the median of {_timing.REPEAT} runs, each long "
        f"enough to last {_timing.MIN_RUN_SECONDS:g} s. One warm-up call comes first "
        "(compilation is not timed).",
    ]


def render_doc(sections: dict[str, str], modules: dict[str, ModuleType], quick: bool) -> str:
    out = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python benchmarks/compare.py --write`; edit that script, not this"
        " file, but for its hand-written blocks, which --write keeps. -->",
        "",
        "Every table comes from one run of one process: each median and its baseline were "
        "measured moments apart on the same machine, so the ratios are what to read; the "
        "absolute numbers are this machine's.",
        "",
    ]
    if quick:
        out += ["**Quick run (--quick): few, short repeats; the numbers are noisy.**", ""]
    out += [
        "## Machine",
        "",
        *machine_lines(),
        "",
        "## How to reproduce",
        "",
        "```bash",
        "make bench                              # benchmarks/run.py: every bench_*.py, printed",
        "python benchmarks/compare.py            # these tables and the sweep, printed",
        "python benchmarks/compare.py --write    # ... and regenerate this file and the plot",
        "pip install -r requirements-compare.txt # optional: the other bridges in the sweep",
        "```",
        "",
    ]
    for name, heading in SUITES.items():
        if name not in sections:
            continue
        out += [f"## {heading}", "", _banner(modules[name]), "", sections[name].strip(), ""]
    if "sweep" in sections:
        out += [
            "## Size sweep: torch called from JAX, by method",
            "",
            "f(x) = x * 2 + 1 on a float32 vector, from 16 to 2**24 elements. *native torch* "
            "calls f on a torch tensor: the floor. *to_jax eager* and *jax.jit(to_jax)* are "
            "torchjax. *jax.jit(pure_callback)* is the plain-JAX way: `jax.pure_callback` whose "
            "callback calls torch on the numpy input (copies in and out through host memory). "
            "The other bridges are measured where installed (`requirements-compare.txt`): "
            "*torch_jax_interop* is `torch_jax_interop.torch_to_jax(f)`; *wrap_torch2jax* is "
            "what `wrap_torch2jax.torch2jax(f, example)` returns, already jitted inside. Each "
            "method is first checked to run torch on torch tensors and give the right numbers; "
            "one that fails the check is listed below the table instead of measured.",
            "",
            f"![per-call time against size, log-log]({PLOT})",
            "",
            sections["sweep"].strip(),
            "",
        ]
    return "\n".join(out + gpu_section())


# A measurement no bench module makes (a comparison across source trees, a one-off run of
# another script) and its explanation sit in the doc between these two lines; --write
# carries each such block into the regenerated doc (carry_hand_written).
HAND_WRITTEN = "<!-- hand-written: compare.py --write keeps this block -->"
HAND_WRITTEN_END = "<!-- end of hand-written block -->"


def carry_hand_written(old: str, new: str) -> str:
    """`new` with every hand-written block of `old` put back, in `old`'s order, at the end
    of the section (`## ` heading) it followed in `old`, or before the GPU section where
    `new` has no such heading. A block left open (no end line) is an error: its end is
    unknown, and guessing it could drop or duplicate text."""
    blocks: list[tuple[str | None, list[str]]] = []
    heading: str | None = None  # the last `## ` heading seen
    anchor: str | None = None  # the one before the open block
    block: list[str] | None = None
    for line in old.splitlines():
        if block is not None:
            block.append(line)
            if line.strip() == HAND_WRITTEN_END:
                blocks.append((anchor, block))
                block = None
        elif line.strip() == HAND_WRITTEN:
            block, anchor = [line], heading
        if line.startswith("## "):
            heading = line
    if block is not None:
        raise ValueError(f"a hand-written block has no {HAND_WRITTEN_END!r} line: {block[:2]}")
    lines = new.splitlines()
    for anchor, block in blocks:
        end = _section_end(lines, anchor)
        lines[end:end] = [*block, ""]
    return "\n".join(lines) + "\n"


def _section_end(lines: list[str], heading: str | None) -> int:
    """The index just past the section under `heading` (before the next `## ` heading); for
    a heading `lines` lacks, the GPU section's start, or the end."""
    starts = [i for i, line in enumerate(lines) if line.startswith("## ")]
    if heading in lines:
        after = [i for i in starts if i > lines.index(heading)]
        return after[0] if after else len(lines)
    gpu = [i for i in starts if lines[i] == "## On a GPU"]
    return gpu[0] if gpu else len(lines)


# A GPU run's table (`make gpu-check` writes build/gpu-check.md), committed here once measured.
GPU_RESULTS = HERE / "gpu_results.md"


def gpu_section() -> list[str]:
    """The GPU section: the table of the last `make gpu-check`, or that there is none yet."""
    out = ["## On a GPU", ""]
    if GPU_RESULTS.exists():
        return out + [GPU_RESULTS.read_text().strip(), ""]
    return out + [
        "**Still to be measured**: no GPU machine has been available to the project yet. On "
        "one, `make gpu-check` installs requirements-gpu.txt into its own venv, runs the GPU "
        "tests and the core suite on CUDA, and prints a table of torchjax against torch on "
        "the same GPU (per call, vmap, grad, a training step; benchmarks/gpu_bench.py). It "
        "writes the table to build/gpu-check.md: copy that to benchmarks/gpu_results.md and "
        "regenerate this file.",
        "",
    ]


def _parse_size(text: str) -> int:
    text = text.strip()
    if "**" in text:
        base, exp = text.split("**")
        return int(base) ** int(exp)
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help=f"write {DOC} and {PLOT} (default: only print)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 2 short repeats per number"
    )
    parser.add_argument(
        "--sizes",
        type=lambda s: [_parse_size(p) for p in s.split(",")],
        default=SIZES,
        help="comma-separated sweep sizes, e.g. 16,256,2**20 (default: %(default)s)",
    )
    parser.add_argument(
        "--sections",
        type=lambda s: s.split(","),
        default=SECTIONS,
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--no-optional",
        dest="optional",
        action="store_false",
        help="do not measure the optional bridges even where installed",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=ROOT / "docs",
        help="where --write puts the doc and the plot (default: docs/)",
    )
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    if args.write and args.sections != SECTIONS:
        parser.error("--write regenerates the whole doc; leave out --sections")
    if args.quick:
        _timing.configure(repeat=2, min_run_seconds=0.01)

    print("## Machine\n\n" + "\n".join(machine_lines()) + "\n", flush=True)
    sections: dict[str, str] = {}
    modules: dict[str, ModuleType] = {}
    for name in SUITES:
        if name not in args.sections:
            continue
        modules[name] = importlib.import_module(f"bench_{name}")
        start = time.perf_counter()
        sections[name] = modules[name].format_results(modules[name].measure())
        print(f"## {SUITES[name]}\n\n{sections[name].strip()}\n", flush=True)
        print(f"(bench_{name}: {time.perf_counter() - start:.1f} s)\n", flush=True)
    sweep = None
    if "sweep" in args.sections:
        start = time.perf_counter()
        sweep = measure_sweep(args.sizes, optional=args.optional)
        sections["sweep"] = format_sweep(sweep)
        print(f"## Size sweep\n\n{sections['sweep']}\n", flush=True)
        print(f"(sweep: {time.perf_counter() - start:.1f} s)\n", flush=True)

    if args.write:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        if sweep is not None:
            plot_sweep(sweep, args.out_dir / PLOT)
        doc = args.out_dir / DOC
        # the hand-written blocks of the doc it replaces (docs/'s where it writes elsewhere)
        previous = doc if doc.exists() else ROOT / "docs" / DOC
        old = previous.read_text() if previous.exists() else ""
        doc.write_text(carry_hand_written(old, render_doc(sections, modules, args.quick)))
        print(f"wrote {doc}" + (f" and {args.out_dir / PLOT}" if sweep is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
