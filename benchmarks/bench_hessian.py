# Second order through a wrapped torch MLP, and what tracing a Hessian costs.
#
# jax.jit(jax.hessian(loss)) of an MLP 64-64-1 loss with respect to its 64 inputs, against
# torch.func.hessian of the same torch function (jacfwd of jacrev in both). Both compute
# the same 64x64 matrix (checked before timing). The tracing time is that of
# jax.jit(jax.hessian(f)).lower(x) for a freshly wrapped function, which includes the
# one fake-tensor run that finds its output types. Before derived functions took their
# types from the function they derive from (commit 11ba40a, where each transform was
# fake-run), that tracing took 77 ms on this machine (median of 6).
#
# A Hessian-vector product with respect to the parameters of an MLP 256-256-10 on 64
# examples, jax.jit(jax.jvp(jax.grad(loss))) against torch.func.jvp(torch.func.grad(loss)):
# forward over reverse in both, the same matrix-product count (tests/test_forward_over_
# reverse.py counts them). Before the DCE rule (_torch_call/_dce.py) the jitted HVP also ran the
# reverse pass's forward and its JVP, for nothing but its random-number state.
from __future__ import annotations

import statistics
import time

import jax
import torch
from _timing import Table, format_tables, paired_row

import torchjax

D_IN, D_HIDDEN = 64, 64
HVP_SIZES, HVP_BATCH = (256, 256, 10), 64


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
        ),
        _hvp_table(),
    ]


def _hvp_table() -> Table:
    torch.manual_seed(0)
    d_in, d_hidden, d_out = HVP_SIZES
    net = torch.nn.Sequential(
        torch.nn.Linear(d_in, d_hidden), torch.nn.Tanh(), torch.nn.Linear(d_hidden, d_out)
    )
    params_t = {k: v.detach() for k, v in net.named_parameters()}
    v_t = {k: torch.randn_like(v) for k, v in params_t.items()}
    x_t = torch.randn(HVP_BATCH, d_in)

    def loss(params, x):  # the parameters, [64, 256] -> []
        return torch.func.functional_call(net, params, (x,)).pow(2).mean()

    f = torchjax.to_jax(loss)
    params, v, x = (torchjax.tree_to_jax(t) for t in (params_t, v_t, x_t))
    hvp = jax.jit(lambda p, v, x: jax.jvp(lambda p: jax.grad(f)(p, x), (p,), (v,))[1])

    def torch_hvp():
        return torch.func.jvp(lambda p: torch.func.grad(loss)(p, x_t), (params_t,), (v_t,))[1]

    got, want = hvp(params, v, x), torch_hvp()
    assert max(abs(jax.device_get(got[k]) - want[k].numpy()).max() for k in want) < 1e-4
    return (
        f"Hessian-vector product w.r.t. an MLP {d_in}-{d_hidden}-{d_out}'s parameters, "
        f"{HVP_BATCH} examples",
        [
            paired_row(
                "jax.jit(jax.jvp(jax.grad(loss)))",
                lambda: jax.block_until_ready(hvp(params, v, x)),
                "torch.func.jvp(torch.func.grad(loss))",
                torch_hvp,
            )
        ],
    )


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()
