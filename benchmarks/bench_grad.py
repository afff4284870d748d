# Reverse and forward mode through a wrapped torch MLP, against torch doing the same.
#
# jax.jit(jax.grad(loss)) vs torch forward + backward (torch.autograd.grad) on the same data;
# jax.jvp vs torch.func.jvp. Both sides compute the same numbers (checked before timing).
from __future__ import annotations

import jax
import torch
from _timing import Table, format_tables, paired_row

import torchjax

BATCH, D_IN, D_HIDDEN, D_OUT = 256, 512, 512, 10


def mlp(params, x):  # {'w1': [512, 512], ...}, [B, 512] -> [B, 10]
    h = torch.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def torch_loss(params, x, y):
    return torch.nn.functional.cross_entropy(mlp(params, x), y.long())  # int32 while x64 is off


def measure() -> list[Table]:
    """Check both sides agree, then time them: one table of medians and ratios."""
    g = torch.Generator().manual_seed(0)
    params_t = {
        "w1": torch.randn(D_IN, D_HIDDEN, generator=g) / D_IN**0.5,
        "b1": torch.zeros(D_HIDDEN),
        "w2": torch.randn(D_HIDDEN, D_OUT, generator=g) / D_HIDDEN**0.5,
        "b2": torch.zeros(D_OUT),
    }
    x_t = torch.randn(BATCH, D_IN, generator=g)
    y_t = torch.randint(0, D_OUT, (BATCH,), generator=g)
    params, x, y = torchjax.tree_to_jax((params_t, x_t, y_t))

    loss = torchjax.to_jax(torch_loss)
    grad_fn = jax.jit(jax.grad(loss))
    leaves = [p.requires_grad_() for p in params_t.values()]

    def torch_grad():
        return torch.autograd.grad(torch_loss(params_t, x_t, y_t), leaves)

    got = grad_fn(params, x, y)
    for (k, _p), want in zip(params_t.items(), torch_grad(), strict=True):
        assert abs(jax.device_get(got[k]) - want.numpy()).max() < 1e-5, k

    f = torchjax.to_jax(mlp)
    tangent_t = torch.randn(BATCH, D_IN, generator=g)
    tangent = torchjax.tree_to_jax(tangent_t)
    params_nograd = {k: v.detach() for k, v in params_t.items()}
    jvp_fn = jax.jit(lambda x, t: jax.jvp(lambda x: f(params, x), (x,), (t,)))
    torch_jvp = lambda: torch.func.jvp(lambda x: mlp(params_nograd, x), (x_t,), (tangent_t,))
    assert abs(jax.device_get(jvp_fn(x, tangent)[1]) - torch_jvp()[1].numpy()).max() < 1e-4

    return [
        (
            f"MLP {D_IN}-{D_HIDDEN}-{D_OUT}, batch {BATCH}",
            [
                paired_row(
                    "jax.jit(jax.grad(loss))",
                    lambda: jax.block_until_ready(grad_fn(params, x, y)),
                    "torch forward + backward",
                    torch_grad,
                ),
                paired_row(
                    "jax.jit(jax.jvp(f))",
                    lambda: jax.block_until_ready(jvp_fn(x, tangent)),
                    "torch.func.jvp",
                    torch_jvp,
                ),
            ],
        )
    ]


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()
