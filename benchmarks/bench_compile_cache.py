# JAX's persistent compilation cache with torch calls inside: a fresh process's first
# jitted call, with and without the cache.
#
# Each measurement is a new Python process that builds a module_to_jax training step
# (value_and_grad of an MLP 64-256-256-10's loss, batch 32; torch's forward and backward
# inside), jits it and calls it once. The first call's time is tracing (with the one fake
# run), lowering and XLA's compilation or a cache lookup, plus the run. Per round, in turn:
# "no cache" (the persistent cache off); "cache, empty" (on, in a new empty folder: the first
# process of a deployment, which compiles and writes the executable); "cache, filled" (on, in
# that folder: every later process). Each process checks its loss and gradients against
# plain torch autograd on the same weights, so an executable restored with a stale callback
# would fail here, not pass silently, and counts JAX's logged cache hits. JAX decides what it
# caches: jax 0.10 skips executables with host callbacks, jax 0.11 and later store them.
#
# Usage: `python benchmarks/bench_compile_cache.py --rounds 3 --json` (both optional)

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _timing

CHILD = r"""
import json, os, sys, time
start = time.perf_counter()
import logging
import jax, jax.numpy as jnp, numpy as np, torch, torchjax
hits = []
class _Hits(logging.Handler):  # jax logs each persistent-cache hit at DEBUG
    def emit(self, record):
        if "Persistent compilation cache hit" in record.getMessage():
            hits.append(record.getMessage())
_logger = logging.getLogger("jax._src.compiler")
_logger.setLevel(logging.DEBUG)
_logger.addHandler(_Hits())
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
    torch.nn.Linear(256, 10),
)
apply, variables = torchjax.module_to_jax(model)
x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
y = np.random.default_rng(1).standard_normal((32, 10)).astype(np.float32)

def loss(params, x, y):
    out = apply({"params": params, "buffers": variables["buffers"]}, x)
    return jnp.mean((out - y) ** 2)

step = jax.jit(jax.value_and_grad(loss))
imported = time.perf_counter()
value, grads = step(variables["params"], x, y)
jax.block_until_ready(grads)
first = time.perf_counter()
value, grads = step(variables["params"], x, y)
jax.block_until_ready(grads)
second = time.perf_counter()

xt, yt = torch.from_numpy(x), torch.from_numpy(y)
ref = torch.mean((model(xt) - yt) ** 2)
ref_grads = torch.autograd.grad(ref, list(model.parameters()))
names = [n for n, _ in model.named_parameters()]
ok = bool(np.allclose(float(value), ref.item(), rtol=1e-5, atol=1e-6)) and all(
    np.allclose(np.asarray(grads[n]), g.numpy(), rtol=1e-4, atol=1e-6)
    for n, g in zip(names, ref_grads, strict=True)
)
print(json.dumps({
    "import_and_setup_s": imported - start, "first_call_s": first - imported,
    "second_call_s": second - first, "correct": ok, "jax": jax.__version__,
    "cache_hits": len(hits),
}))
"""


def child(cache_dir: str | None) -> dict:
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600
    )
    if out.returncode:
        raise RuntimeError(f"the measured process failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if cache_dir is not None:
        result["cache_files"] = sum(len(files) for _, _, files in os.walk(cache_dir))
    return result


def measure(rounds: int | None = None) -> dict:
    if rounds is None:  # compare.py --quick sets _timing.REPEAT to 2: one round then
        rounds = 1 if _timing.REPEAT <= 2 else 3
    cases: dict[str, list[dict]] = {"no cache": [], "cache, empty": [], "cache, filled": []}
    for _ in range(rounds):  # interleaved, so that machine drift hits every case alike
        cases["no cache"].append(child(None))
        with tempfile.TemporaryDirectory(prefix="jax-cache-") as cache:
            cases["cache, empty"].append(child(cache))
            cases["cache, filled"].append(child(cache))
    summary = {}
    for name, runs in cases.items():
        if not all(r["correct"] for r in runs):
            raise AssertionError(f"{name}: a process computed wrong values: {runs}")
        summary[name] = {
            "first_call_s": statistics.median(r["first_call_s"] for r in runs),
            "import_and_setup_s": statistics.median(r["import_and_setup_s"] for r in runs),
            "cache_files": runs[-1].get("cache_files"),
            "cache_hits": runs[-1]["cache_hits"],
        }
    summary["jax"] = cases["no cache"][0]["jax"]
    summary["rounds"] = rounds
    return summary


def format_results(summary: dict) -> str:
    base = summary["no cache"]["first_call_s"]
    rows = [
        f"jax {summary['jax']}, median of {summary['rounds']} fresh processes per row",
        "",
        "| process | first jitted call (trace + compile + run) | vs no cache | cache files "
        "| cache hits |",
        "|---|---|---|---|---|",
    ]
    for name in ("no cache", "cache, empty", "cache, filled"):
        s = summary[name]
        files = "-" if s["cache_files"] is None else str(s["cache_files"])
        rows.append(
            f"| {name} | {s['first_call_s'] * 1e3:.0f} ms | {s['first_call_s'] / base:.2f}x "
            f"| {files} | {s['cache_hits']} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="JAX's persistent compilation cache")
    parser.add_argument("--rounds", type=int, default=None, help="fresh processes per row")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv if argv is not None else _own_argv())
    start = time.perf_counter()
    summary = measure(args.rounds)
    print(json.dumps(summary, indent=2) if args.json else format_results(summary))
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


def _own_argv() -> list[str]:
    """The command line when run as a script; none when benchmarks/run.py calls main()."""
    return sys.argv[1:] if __name__ == "__main__" else []


if __name__ == "__main__":
    sys.exit(main())
