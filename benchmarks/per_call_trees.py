"""Per-call overhead of two source trees of torchjax, interleaved: jit, eager, vmap, grad and
to_torch calls of small functions, where the call's own machinery is most of the time.

Two versions of the package cannot share one process (their modules have the same names),
so each round runs one process per tree, alternating A B A B, and each process times every
case with a baseline of its own (the same computation in jax.numpy, jitted), so that the
ratio to it is what is compared: both trees' ratios come from the same kind of process.

    python benchmarks/per_call_trees.py OLD_SRC NEW_SRC [--rounds 3]

prints, per case, the median ratio to the baseline for each tree and new/old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, time, statistics
import jax, jax.numpy as jnp, numpy as np, torch, torchjax
torch.set_num_threads(1)

def timed(f, *args, n=2000):
    for _ in range(200):
        jax.block_until_ready(f(*args))
    runs = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t) / n)
    return statistics.median(runs)

x = jnp.arange(16.0, dtype=jnp.float32)
w = jnp.ones((16, 16), jnp.float32)
xs = jnp.ones((32, 16), jnp.float32)
add = torchjax.to_jax(lambda t: t + 1)
mlp = torchjax.to_jax(lambda w, t: torch.tanh(t @ w).sum())
baseline = timed(jax.jit(lambda t: t + 1), x)
cases = {
    "eager f(x)": (add, (x,)),
    "jit f(x)": (jax.jit(add), (x,)),
    "jit vmap": (jax.jit(jax.vmap(mlp, in_axes=(None, 0))), (w, xs)),
    "jit grad": (jax.jit(jax.grad(mlp)), (w, x)),
}
out = {k: timed(f, *a) / baseline for k, (f, a) in cases.items()}
tt = torchjax.to_torch(jax.jit(lambda t: t + 1))
tx = torch.arange(16.0)
for _ in range(200):
    tt(tx)
runs = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(2000):
        tt(tx)
    runs.append((time.perf_counter() - t) / 2000)
out["to_torch f(x)"] = statistics.median(runs) / baseline
print(json.dumps(out))
"""


def _run(src: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    old, new = [], []
    for _ in range(a.rounds):
        old.append(_run(a.old))
        new.append(_run(a.new))
    print("| case | old (x jitted jnp) | new (x jitted jnp) | new / old |")
    print("|---|---|---|---|")
    for case in old[0]:
        o = statistics.median(r[case] for r in old)
        n = statistics.median(r[case] for r in new)
        print(f"| {case} | {o:.2f} | {n:.2f} | {n / o:.3f} |")


if __name__ == "__main__":
    main()
