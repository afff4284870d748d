# Second order through a wrapped torch MLP, and what tracing a Hessian costs.
#
# jax.jit(jax.hessian(loss)) of an MLP 64-64-1 loss with respect to its 64 inputs, against
# torch.func.hessian of the same torch function (jacfwd of jacrev in both). Both compute
# the same 64x64 matrix (checked before timing). The tracing time is that of
# jax.jit(jax.hessian(f)).lower(x) for a freshly wrapped function, which includes the
# one fake-tensor run that finds its output types. Before derived functions took their
# types from the function they derive from (commit 11ba40a, where each transform was
# fake-run), that tracing took 77 ms on this machine (median of 6).
from __future__ import annotations

import statistics
import time

import jax
import torch
from _timing import Table, format_tables, paired_row

import torchjax

D_IN, D_HIDDEN = 64, 64


def measure() -> list[Table]:
    """Check both sides agree, then time them: one table of medians and ratios."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(D_IN, D_HIDDEN, generator=g) / D_IN**0.5
    b1 = torch.zeros(D_HIDDEN)
    w2 = torch.randn(D_HIDDEN, 1, generator=g) / D_HIDDEN**0.5

    def loss(x):  # [64] -> []
        return (torch.tanh(x @ w1 + b1) @ w2).sum()

    x_t = torch.randn(D_IN, generator=g)
    x = torchjax.tree_to_jax(x_t)
    hessian = jax.jit(jax.hessian(torchjax.to_jax(loss)))
    torch_hessian = torch.func.hessian(loss)
    assert abs(jax.device_get(hessian(x)) - torch_hessian(x_t).numpy()).max() < 1e-5

    lower_ms = []
    for _ in range(7):
        fresh = torchjax.to_jax(loss)  # new caches: the fake run is part of tracing
        start = time.perf_counter()
        jax.jit(jax.hessian(fresh)).lower(x)
        lower_ms.append((time.perf_counter() - start) * 1e3)
    trace_note = (
        f"tracing jax.jit(jax.hessian(f)).lower(x): median {statistics.median(lower_ms[1:]):.1f} ms"
    )

    return [
        (
            f"Hessian of an MLP {D_IN}-{D_HIDDEN}-1 loss w.r.t. its inputs ({trace_note})",
            [
                paired_row(
                    "jax.jit(jax.hessian(loss))",
                    lambda: jax.block_until_ready(hessian(x)),
                    "torch.func.hessian",
                    lambda: torch_hessian(x_t),
                ),
            ],
        )
    ]


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()
