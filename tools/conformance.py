# The full OpInfo conformance sweep: every op of torch's op_db, every transform of
# tests/opinfo_harness.py, torch as the oracle, in each dtype profile of the harness
# (float64 with JAX's x64 on, float32 with it off). Writes docs/conformance.md: versions,
# and per profile the counts per transform and every mismatch and error. `make conformance`
# runs it. The exit status is 1 when any pair is a mismatch or an error, else 0.
#
# Then the same ops through to_jax(..., lowering="xla") under harness.XLA_TRANSFORMS, within
# harness.XLA_TOLERANCES: per op, whether torch.export captured it and which of its ATen ops
# were lowered or ran as callbacks. A lowered ATen op that disagrees with torch belongs in
# the route table as a CALLBACK policy (src/torchjax/_to_jax/_xla/_routes.py): any xla
# mismatch fails the
# sweep, and its culprits (the ops whose callback makes it pass) are what to list. A listed
# op that agrees with torch when lowered wherever it occurs is stale: that fails the full
# sweep too (not --ci nor --ops, which see only some of the ops that may need it).
#
#   python tools/conformance.py                    # the whole sweep, both profiles
#   python tools/conformance.py --ops sin,linalg.det --profile float32 --out /tmp/c.md
#   python tools/conformance.py --lowering xla --ops sin    # lowering="xla" only
#   python tools/conformance.py --ci               # CI's partition (below), no report file
#
# --ci: every op under every transform in ONE profile (ops alternate between the profiles
# by their index in sorted order), and vmap_grad in both; about 56% of the full sweep, and
# every (op, transform) pair still runs in at least one dtype. lowering="xla": every op under
# every XLA transform in one profile, the other one (each op runs in both dtype regimes,
# one per lowering).
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import opinfo_harness as harness  # noqa: E402
import torch  # noqa: E402

STATUSES = (harness.PASS, harness.MISMATCH, harness.ERROR, harness.SKIP)
XLA_STATUSES = (harness.PASS, harness.MISMATCH, harness.ERROR, harness.UNCAPTURABLE, harness.SKIP)
FAILURES = (harness.MISMATCH, harness.ERROR)
PROFILES = tuple(harness.PROFILES)  # ("float64", "float32"): the report's order
CI_EVERY_PROFILE = ("vmap_grad",)  # transforms --ci runs in every profile, not only one
# (op, transform, profile) triples per worker process, whole ops at a time. A worker spends
# 5-6 s importing torch, jax and op_db (2-core VM), and 0.5-1.3 s per op and profile on
# its pairs: 20 ops in one profile (the old batch, 160 triples) spent 26% of its time
# starting up on cheap ops, some 9% on the sweep's average. 320 is 20 ops in both profiles,
# 35 in --ci's partition: about half that share. Not more: a worker's memory grows by some
# 35 MB per op (both profiles) even with each op's samples forgotten (JAX's caches;
# jax.clear_caches() stops that but made the pairs 2.6x slower), to 2.9 GB of address
# space after 320 triples, and each worker is limited to --memory-limit-gb.
BATCH_TRIPLES = 320
TIMED_OUT = 3  # a worker's exit code after a pair ran over its time limit


class Timing:
    """Where the workers' wall time went. (Not a dataclass: tests load this script with
    importlib, outside sys.modules, where dataclasses cannot resolve its annotations.)"""

    def __init__(self, processes: int = 0, startup: float = 0.0, total: float = 0.0) -> None:
        self.processes = processes
        self.startup = startup  # process start to imports done (torch, jax, op_db, harness)
        self.total = total  # process start to exit

    def __iadd__(self, other: Timing) -> Timing:
        self.processes += other.processes
        self.startup += other.startup
        self.total += other.total
        return self


def _profile_counts(results: list, profiles: list, statuses: tuple) -> list[str]:
    """A table of how many results of each profile have each status."""
    lines = ["| profile | " + " | ".join(statuses) + " |", "|---|" + "---|" * len(statuses)]
    for p in profiles:
        counts = collections.Counter(r.status for r in results if r.profile == p)
        lines.append(f"| {p} | " + " | ".join(str(counts[s]) for s in statuses) + " |")
    return lines


def _cell(text: str) -> str:
    # (< and >: a message's `<locals>` would read as an HTML tag in the rendered page)
    cell = text.replace("|", "\\|").replace("\n", " ")
    return cell.replace("<", "&lt;").replace(">", "&gt;")


def _plan(
    names: list[str],
    transforms: list[str],
    profiles: list[str],
    ci: bool,
    lowerings: tuple[str, ...] = ("callback",),
) -> list[tuple[str, str, str, str]]:
    """The (lowering, profile, op, transform) quadruples to run, those of one op together.

    ci: each op in one profile under every transform (the profiles alternate over the ops'
    sorted order), and under CI_EVERY_PROFILE in the other profiles too; under
    lowering="xla", each op in the profile after its callback one, under every transform
    of harness.XLA_TRANSFORMS."""
    plan = []
    for i, name in enumerate(sorted(names) if ci else names):
        home = profiles[i % len(profiles)]
        for lowering in lowerings:
            if lowering == "xla":
                home = profiles[(i + 1) % len(profiles)]
                ts = [t for t in transforms if t in harness.XLA_TRANSFORMS]
                plan += [("xla", p, name, t) for p in profiles if not ci or p == home for t in ts]
                continue
            for p in profiles:
                plan += [
                    (lowering, p, name, t)
                    for t in transforms
                    if not ci or p == home or t in CI_EVERY_PROFILE
                ]
    return plan


def _counts_table(
    results: list[harness.Result], transforms: list[str], statuses: tuple[str, ...] = STATUSES
) -> list[str]:
    counts = collections.Counter((r.transform, r.status) for r in results)
    lines = ["| transform | " + " | ".join(statuses) + " |", "|---|" + "---|" * len(statuses)]
    for t in transforms:
        lines.append(f"| {t} | " + " | ".join(str(counts[t, s]) for s in statuses) + " |")
    total = " | ".join(str(sum(counts[t, s] for t in transforms)) for s in statuses)
    lines.append(f"| **all** | {total} |")
    return lines


def _report(
    results: list[harness.Result],
    args: argparse.Namespace,
    transforms: list[str],
    seconds: float,
    cpu_seconds: float,
    timing: Timing,
) -> str:
    xla = [r for r in results if r.lowering == "xla"]
    results = [r for r in results if r.lowering == "callback"]
    ops = sorted({r.op for r in results})
    profiles = [p for p in PROFILES if any(r.profile == p for r in results)]
    mode = (
        "CI partition (each op under every transform in one profile, alternating over the "
        f"sorted ops, and {', '.join(CI_EVERY_PROFILE)} in both)"
        if args.ci
        else "every op under every transform in every profile"
    )
    lines = [
        "# OpInfo conformance",
        "",
        "Every operator of torch's own OpInfo database (`op_db`) called through",
        "`torchjax.to_jax` under each transform, compared with torch itself: the op called",
        "directly, `torch.func` and `torch.autograd.grad`, in two dtype profiles. Generated",
        "by `make conformance` (`tools/conformance.py`); the harness is",
        "`tests/opinfo_harness.py`, and `tests/test_conformance.py` runs a representative",
        'subset in the test suite. The last section, [lowering="xla"](#loweringxla), runs',
        'them through `to_jax(..., lowering="xla")`.',
        "",
        f"* date: {datetime.date.today().isoformat()}",
        f"* torch {torch.__version__}, jax {jax.__version__}, Python {platform.python_version()}",
        f"* {len(ops)} ops, {len(results)} (op, transform, profile) triples: {mode}; "
        f"{args.samples} samples per pair where they apply, time limit {args.time_limit:g} s "
        f"per side, {args.jobs} worker processes; the sweep took {seconds / 60:.1f} min "
        f"({cpu_seconds / 60:.1f} min of CPU time); worker processes: {timing.processes}, "
        f"their start-ups (importing torch, jax and op_db) {timing.startup / 60:.1f} min of "
        f"their {timing.total / 60:.1f} min",
        "",
        "Profiles:",
        "",
    ]
    lines += [f"* **{p}**: {harness.PROFILES[p].description}." for p in profiles]
    lines += [
        "",
        "Classes: **pass**; **mismatch** (both ran, results differ beyond the profile's",
        "rtol/atol or the OpInfo's own tolerance for the samples' dtype, or shapes, output",
        "counts or dtypes differ, other than JAX's own narrowing of 64-bit dtypes with x64",
        "off); **error** (torch ran, torchjax raised); **skip** (torch itself fails, or the",
        "pair does not apply: random or uninitialized outputs, in-place ops, non-tensor or",
        "complex outputs for derivatives, integer-only ops for derivatives, inputs too large",
        "for second-order transforms).",
        "",
    ]
    lines += _profile_counts(results, profiles, STATUSES)

    for p in profiles:
        mine = [r for r in results if r.profile == p]
        lines += ["", f"## Profile {p}", "", harness.PROFILES[p].description + ".", ""]
        lines += _counts_table(mine, transforms)
        for status, title in ((harness.MISMATCH, "Mismatches"), (harness.ERROR, "Errors")):
            found = [r for r in mine if r.status == status]
            lines += ["", f"### {title}, {p} ({len(found)})", ""]
            if not found:
                lines.append("None.")
                continue
            if status == harness.MISMATCH:
                lines += ["| op | transform | max abs error | message |", "|---|---|---|---|"]
            else:
                lines += ["| op | transform | message |", "|---|---|---|"]
            for r in found:
                if status == harness.MISMATCH:
                    err = "" if r.max_abs_err is None else f"{r.max_abs_err:.3g}"
                    lines.append(f"| `{r.op}` | {r.transform} | {err} | {_cell(r.message)} |")
                else:
                    lines.append(f"| `{r.op}` | {r.transform} | {_cell(r.message)} |")

        reasons = collections.Counter(_skip_reason(r.message) for r in mine if r.status == "skip")
        lines += ["", f"### Skip reasons, {p} (most common)", ""]
        lines += ["| pairs | reason |", "|---|---|"]
        lines += [f"| {n} | {_cell(why)} |" for why, n in reasons.most_common(25)]
    if xla:
        lines += ["", *_xla_report(xla, args)]
    return "\n".join(lines) + "\n"


def _route_kind(callback: str) -> tuple[str, str]:
    """("aten.op.overload", why) of a result's "op: why" callback entry, the why without
    the numbers and names that vary from sample to sample."""
    op, _, why = callback.partition(": ")
    return op, why.split(":")[0] if why.startswith("its lowering raised") else why


def _op_class(rs: list[harness.Result]) -> str:
    """An op's route under lowering="xla", over its transforms in one profile."""
    if any(r.callbacks for r in rs):
        return "fell back"
    if any(r.lowered for r in rs):
        return "fully lowered"
    if any(r.status == harness.UNCAPTURABLE for r in rs):
        return harness.UNCAPTURABLE
    return "no applicable sample"


OP_CLASSES = ("fully lowered", "fell back", harness.UNCAPTURABLE, "no applicable sample")


def _listed_status(xla: list[harness.Result]) -> dict[str, tuple[list[str], bool]]:
    """Per listed callback: (where lowering it disagrees with torch, "profile op
    transform: max error", and whether any graph of the sweep holds it)."""
    status = {}
    for op in sorted(harness.listed_callback_ops()):
        needed = [
            f"{r.profile} `{r.op}` {r.transform}: "
            + ("?" if r.needed[op] is None else f"{r.needed[op]:.3g}")
            for r in xla
            if op in r.needed
        ]
        seen = any(c.startswith(op + ": ") for r in xla for c in r.callbacks)
        status[op] = (needed, seen)
    return status


def _stale(xla: list[harness.Result]) -> list[str]:
    """Listed callbacks that some graph holds and that agree with torch, lowered, in
    every such graph."""
    return [op for op, (needed, seen) in _listed_status(xla).items() if seen and not needed]


def _xla_report(xla: list[harness.Result], args: argparse.Namespace) -> list[str]:
    profiles = [p for p in PROFILES if any(r.profile == p for r in xla)]
    transforms = [t for t in harness.XLA_TRANSFORMS if any(r.transform == t for r in xla)]
    ops = sorted({r.op for r in xla})
    mode = (
        "each op in one profile (the one its callback pairs do not run in), under every transform"
        if args.ci
        else "every op under every transform in every profile"
    )
    lines = [
        '## lowering="xla"',
        "",
        'The same ops through `to_jax(..., lowering="xla")`: each sample `torch.export`ed, each',
        "ATen node of its graph lowered to JAX ops through the op table (torchax) or, where it",
        "has no lowering, its lowering raised, or the route table lists it as a callback",
        "(`src/torchjax/_to_jax/_xla/_routes.py`), run as a torch callback. Transforms:",
        f"{', '.join(harness.XLA_TRANSFORMS)}; {len(ops)} ops, {len(xla)} (op, transform, "
        f"profile) triples: {mode}.",
        "",
        "The lowered ops are JAX's implementations, not torch's kernels, so the tolerances are",
        "looser than the callback path's: (rtol, atol) by the samples' dtype, in every profile",
        "(`XLA_TOLERANCES` in the harness), loosened further by an OpInfo's own",
        "`toleranceOverride` for the dtype; integer and bool outputs compare exactly, and",
        "dtypes must match as on the callback path.",
        "",
        "| samples' dtype | rtol | atol |",
        "|---|---|---|",
    ]
    for dtype, (rtol, atol) in harness.XLA_TOLERANCES.items():
        lines.append(f"| {str(dtype).removeprefix('torch.')} | {rtol:g} | {atol:g} |")
    lines += [
        "",
        "Classes as above, and **uncapturable**: `torch.export` cannot capture the op (a",
        "`LoweringError`: control flow on values), or an op of its graph has an output shape",
        "that depends on the values (`nonzero`, `unique`; a `ShapeInferenceError`), so",
        'lowering="xla" does not apply; not a failure. A mismatch or an error fails the sweep:',
        "a mismatch's culprits (the lowered ATen ops that, run as callbacks, make it pass) go",
        "into the route table as `CALLBACK` policies.",
        "",
    ]
    lines += _profile_counts(xla, profiles, XLA_STATUSES)
    lines += [
        "",
        "Per op and profile, over its transforms: **fully lowered** (every ATen node became",
        "JAX ops), **fell back** (some ran as torch callbacks), uncapturable, or no applicable",
        "sample (every pair a skip).",
        "",
        "| profile | " + " | ".join(OP_CLASSES) + " |",
        "|---|" + "---|" * len(OP_CLASSES),
    ]
    by_op: dict[tuple[str, str], list[harness.Result]] = collections.defaultdict(list)
    for r in xla:
        by_op[r.profile, r.op].append(r)
    for p in profiles:
        classes = collections.Counter(_op_class(rs) for (q, _), rs in by_op.items() if q == p)
        lines.append(f"| {p} | " + " | ".join(str(classes[c]) for c in OP_CLASSES) + " |")

    for p in profiles:
        mine = [r for r in xla if r.profile == p]
        lines += ["", f'### lowering="xla", profile {p}', ""]
        lines += _counts_table(mine, transforms, XLA_STATUSES)
        for status, title in ((harness.MISMATCH, "Mismatches"), (harness.ERROR, "Errors")):
            found = [r for r in mine if r.status == status]
            lines += ["", f'#### {title}, {p}, lowering="xla" ({len(found)})', ""]
            if not found:
                lines.append("None.")
                continue
            lines += ["| op | transform | max abs error | culprits | message |", "|---|" * 5]
            for r in found:
                err = "" if r.max_abs_err is None else f"{r.max_abs_err:.3g}"
                culprits = ", ".join(f"`{c}`" for c in r.culprits)
                lines.append(
                    f"| `{r.op}` | {r.transform} | {err} | {culprits} | {_cell(r.message)} |"
                )

    fallbacks: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for r in xla:
        for c in r.callbacks:
            fallbacks[_route_kind(c)].add(r.op)
    lines += [
        "",
        f"### ATen ops run as callbacks ({len(fallbacks)})",
        "",
        "| ATen op | why | OpInfo ops |",
        "|---|---|---|",
    ]
    for (aten, why), names in sorted(fallbacks.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        shown = ", ".join(f"`{n}`" for n in sorted(names)[:6])
        more = f" and {len(names) - 6} more" if len(names) > 6 else ""
        lines.append(f"| `{aten}` | {_cell(why)} | {shown}{more} |")

    uncapturable: dict[str, list[str]] = collections.defaultdict(list)
    for (p, name), rs in by_op.items():
        if _op_class(rs) == harness.UNCAPTURABLE:
            r = next(r for r in rs if r.status == harness.UNCAPTURABLE)
            uncapturable[name].append(p)
            uncapturable[name].append(r.message)
    lines += ["", f"### Uncapturable ops ({len(uncapturable)})", ""]
    lines += ["| op | profiles | why (first sample) |", "|---|---|---|"]
    for name, found in sorted(uncapturable.items()):
        why = _cell(found[1][:160])
        lines.append(f"| `{name}` | {', '.join(found[::2])} | {why} |")

    status = _listed_status(xla)
    lines += [
        "",
        f"### Listed callbacks ({len(status)})",
        "",
        "`CALLBACK` policies of `src/torchjax/_to_jax/_xla/_routes.py`: lowered, these",
        "disagree with torch beyond the tolerances above, so they run as torch callbacks.",
        "The sweep lowers each one alone where a passing sample's graph holds it; where it",
        "then agrees with torch everywhere, it is stale.",
        "",
        "| ATen op | where lowering it disagrees: max abs error | state |",
        "|---|---|---|",
    ]
    for op, (needed, seen) in status.items():
        state = "needed" if needed else ("stale" if seen else "in no graph of this sweep")
        lines.append(f"| `{op}` | {'; '.join(needed[:4]) or '—'} | {state} |")
    return lines


def _skip_reason(message: str) -> str:
    # Group skips by their kind, not their numbers: "input of 625 elements is too large".
    words = message.split()
    if "too large" in message:
        return "input or result too large for a second-order transform"
    return " ".join(words[:12])


def _cache_export_op_sets() -> None:
    """Keep torch.export's set of CompositeImplicitAutograd ops for the worker's lifetime.

    torch recomputes it (walking every operator namespace) in each run_decompositions,
    twice per capture: some 30% of a lowering="xla" pair's time on small ops. The set only
    changes when operators are registered, which no pair does once the op table is
    imported; the sweep's numbers do not depend on this."""
    import torch._export.utils as export_utils
    import torch.export.decomp_utils as decomp_utils
    import torch.export.exported_program as exported_program

    cached = functools.cache(export_utils._collect_all_valid_cia_ops)
    exported_program._collect_all_valid_cia_ops = cached
    decomp_utils._collect_all_valid_cia_ops = cached


XLA_HEADING = '\n## lowering="xla"\n'


def _kept_section(out: Path, text: str, lowerings: tuple[str, ...]) -> str:
    """The report to write: a sweep of one lowering rewrites its part of an existing report
    and keeps the other's (`--lowering xla` leaves the callback sections as they were)."""
    if len(lowerings) == 2 or not out.exists():
        return text
    old = out.read_text()
    if lowerings == ("xla",):
        if "\n## Profile " not in old:
            return text
        xla = text.partition(XLA_HEADING)
        return old.partition(XLA_HEADING)[0] + xla[1] + xla[2]
    return text.rstrip("\n") + "\n" + "".join(old.partition(XLA_HEADING)[1:])


def _worker(args: argparse.Namespace) -> None:
    """Run the (lowering, profile, op, transform) quadruples given as JSON on stdin; print
    one JSON line per event: imports done, a quadruple begun, a result."""
    print(json.dumps({"ready": time.time()}), flush=True)  # the imports are done
    limit = int(args.memory_limit_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    triples = json.load(sys.stdin)
    if any(lowering == "xla" for lowering, *_ in triples):
        _cache_export_op_sets()
    previous = None
    for lowering, p, name, t in triples:
        if previous is not None and name != previous:
            harness.forget(previous)  # the triples of one op come together
        previous = name
        print(json.dumps({"begin": [lowering, p, name, t]}), flush=True)
        r = harness.run(
            name,
            t,
            n_samples=args.samples,
            time_limit=args.time_limit,
            profile=p,
            lowering=lowering,
        )
        print(json.dumps(dataclasses.asdict(r)), flush=True)
        if "_Timeout" in r.message:
            sys.exit(TIMED_OUT)  # the interrupted state may linger: a fresh process goes on


def _run_batch(
    triples: list[tuple[str, str, str, str]], args: argparse.Namespace
) -> tuple[list[harness.Result], Timing]:
    """The triples' results, from as many worker processes as crashes and timeouts need."""
    command = [sys.executable, __file__, "--worker", f"--samples={args.samples}"]
    command += [f"--time-limit={args.time_limit}", f"--memory-limit-gb={args.memory_limit_gb}"]
    results: list[harness.Result] = []
    timing = Timing()
    while triples:
        started = time.time()
        proc = subprocess.run(
            command, input=json.dumps(triples), capture_output=True, text=True, check=False
        )
        timing += Timing(1, 0.0, time.time() - started)
        begun = None
        for line in proc.stdout.splitlines():
            event = json.loads(line)
            if "ready" in event:
                timing.startup += event["ready"] - started
            elif "begin" in event:
                begun = tuple(event["begin"])
            else:
                results.append(harness.Result(**event))
                begun = None
        done = {(r.lowering, r.profile, r.op, r.transform) for r in results}
        if begun is not None:  # the process died inside this triple
            why = (
                f"signal {-proc.returncode}"
                if proc.returncode < 0
                else f"exit code {proc.returncode}"
            )
            tail = proc.stderr.strip().splitlines()[-1:] or [""]
            message = f"the process died ({why}): {tail[0][:200]}"
            lowering, p, name, t = begun
            results.append(
                harness.Result(name, t, harness.ERROR, message, profile=p, lowering=lowering)
            )
            done.add(begun)
        elif proc.returncode not in (0, TIMED_OUT):
            raise RuntimeError(f"conformance worker failed: {proc.stderr[-2000:]}")
        triples = [x for x in triples if tuple(x) not in done]
    return results, timing


def _summary(results: list[harness.Result], transforms: list[str]) -> str:
    """Counts per profile and transform, and every failing triple, for the terminal."""
    lines = []
    for lowering in harness.LOWERINGS:
        statuses = XLA_STATUSES if lowering == "xla" else STATUSES
        ts = [t for t in transforms if lowering != "xla" or t in harness.XLA_TRANSFORMS]
        for p in PROFILES:
            mine = [r for r in results if r.profile == p and r.lowering == lowering]
            if mine:
                table = _counts_table(mine, ts, statuses)
                lines += [f"{p}, lowering={lowering}:", *("  " + line for line in table)]
    failed = [r for r in results if r.status in FAILURES]
    lines.append(f"{len(failed)} mismatches and errors" + (":" if failed else ""))
    lines += [f"  {_describe(r)}" for r in failed]
    return "\n".join(lines)


def _describe(r: harness.Result) -> str:
    where = f"{r.profile} {r.op} {r.transform}" + (" (xla)" if r.lowering == "xla" else "")
    culprits = f" [culprits: {', '.join(r.culprits)}]" if r.culprits else ""
    return f"{where}: {r.status}: {r.message}{culprits}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description="OpInfo conformance sweep; exit status 1 on any mismatch or error."
    )
    parser.add_argument("--ops", help="comma-separated op names (default: all of op_db)")
    parser.add_argument("--transforms", default=",".join(harness.TRANSFORMS))
    parser.add_argument(
        "--profile",
        choices=[*PROFILES, "both"],
        default="both",
        help="dtype profile: float64 (x64 on), float32 (x64 off), or both (default)",
    )
    parser.add_argument(
        "--ci",
        action="store_true",
        help="CI partition: each op under every transform in one profile, alternating "
        f"over the sorted ops, and {', '.join(CI_EVERY_PROFILE)} in both; writes no report "
        "unless --out is given",
    )
    parser.add_argument(
        "--lowering",
        choices=[*harness.LOWERINGS, "both"],
        default="both",
        help='to_jax\'s lowering: callback, xla (lowering="xla", its transforms and '
        "tolerances), or both (default)",
    )
    parser.add_argument("--samples", type=int, default=1, help="samples that must run per pair")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per side")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at once")
    parser.add_argument(
        "--batch-triples", type=int, default=BATCH_TRIPLES, help="about this many per worker"
    )
    parser.add_argument("--memory-limit-gb", type=float, default=6.0, help="per worker")
    parser.add_argument("--out", help="the report (default: docs/conformance.md; none in --ci)")
    parser.add_argument("--json", help="also write every result here, one JSON object a line")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0

    names = args.ops.split(",") if args.ops else [harness.op_name(op) for op in harness.all_ops()]
    unknown = [n for n in names if n not in harness.ops_by_name()]
    if unknown:
        parser.error(f"not in op_db: {unknown}")
    transforms = args.transforms.split(",")
    lowerings = tuple(harness.LOWERINGS) if args.lowering == "both" else (args.lowering,)
    unknown = [t for t in transforms if t not in harness.TRANSFORMS]
    if unknown:
        parser.error(f"unknown transforms {unknown}; expected some of {harness.TRANSFORMS}")
    profiles = list(PROFILES) if args.profile == "both" else [args.profile]
    if args.ci and len(profiles) < 2:
        parser.error("--ci partitions the ops between both profiles: leave out --profile")
    out = args.out or (None if args.ci else str(ROOT / "docs" / "conformance.md"))

    triples = _plan(names, transforms, profiles, args.ci, lowerings)
    batches: list[list[tuple[str, str, str, str]]] = [[]]
    for _, group in itertools.groupby(triples, key=lambda x: x[2]):  # whole ops per batch
        if len(batches[-1]) >= args.batch_triples:
            batches.append([])
        batches[-1] += group
    start = time.perf_counter()
    results: list[harness.Result] = []
    timing = Timing()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_run_batch, batch, args) for batch in batches]
        for i, future in enumerate(concurrent.futures.as_completed(futures)):
            batch_results, batch_timing = future.result()
            results += batch_results
            timing += batch_timing
            for r in batch_results:
                if r.status in FAILURES:
                    print(f"  {_describe(r)[:200]}", file=sys.stderr)
            print(
                f"[{i + 1}/{len(batches)} batches] {time.perf_counter() - start:.0f} s",
                file=sys.stderr,
            )
    rank = lambda x: (harness.LOWERINGS.index(x[0]), PROFILES.index(x[1]))  # noqa: E731
    order = {x: k for k, x in enumerate(sorted(triples, key=rank))}
    results.sort(key=lambda r: order[r.lowering, r.profile, r.op, r.transform])
    seconds = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = children.ru_utime + children.ru_stime
    if out:
        text = _report(results, args, transforms, seconds, cpu_seconds, timing)
        Path(out).write_text(_kept_section(Path(out), text, lowerings))
    if args.json:
        Path(args.json).write_text(
            "".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in results)
        )
    print(_summary(results, transforms))
    xla = [r for r in results if r.lowering == "xla"]
    stale = _stale(xla)
    # Only the full sweep sees every graph that may need an entry.
    stale_fails = bool(stale) and not args.ci and not args.ops and len(profiles) == 2
    if stale:
        print(
            f"stale listed callbacks (lowered, they agree with torch wherever a graph of "
            f"this sweep holds them){'' if stale_fails else ', not failing a partial sweep'}: "
            + ", ".join(stale)
        )
    counts = collections.Counter(r.status for r in results)
    print(
        f"{'wrote ' + out + ' ' if out else ''}in {seconds:.0f} s ({cpu_seconds:.0f} s CPU; "
        f"worker processes: {timing.processes}, their start-ups {timing.startup:.0f} s of "
        f"their {timing.total:.0f} s): {dict(counts)}"
    )
    return 1 if stale_fails or any(r.status in FAILURES for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
