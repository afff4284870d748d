# Reverse and forward mode through a wrapped torch MLP, against torch doing the same.
#
# jax.jit(jax.grad(loss)) vs torch forward + backward (torch.autograd.grad) on the same data;
# jax.jvp vs torch.func.jvp. Both sides compute the same numbers (checked before timing).
# The floor for any Python callback, a hand-written buffer_callback that runs torch's
# forward + backward on XLA's buffers and copies the gradients out, is timed too.
from __future__ import annotations

import jax
import torch
from _timing import Table, format_tables, paired_row
from jax.experimental.buffer_callback import buffer_callback

import torchjax

BATCH, D_IN, D_HIDDEN, D_OUT = 256, 512, 512, 10
KEYS = ("b1", "b2", "w1", "w2")  # the params' order as JAX flattens the dict


def _dl(buf):
    return torch.utils.dlpack.from_dlpack(buf.__dlpack__())


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

    def floor_callback(ctx, outs, b1, b2, w1, w2, x, y):
        p = {k: _dl(v).requires_grad_() for k, v in zip(KEYS, (b1, b2, w1, w2), strict=True)}
        with torch.enable_grad():
            grads = torch.autograd.grad(torch_loss(p, _dl(x), _dl(y)), list(p.values()))
        for out, g in zip(outs, grads, strict=True):
            _dl(out).copy_(g)

    structs = [jax.ShapeDtypeStruct(params[k].shape, params[k].dtype) for k in KEYS]
    floor = jax.jit(
        lambda p, x, y: buffer_callback(floor_callback, structs)(*[p[k] for k in KEYS], x, y)
    )
    for k, grad in zip(KEYS, floor(params, x, y), strict=True):
        assert abs(jax.device_get(got[k]) - jax.device_get(grad)).max() < 1e-5, k

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
                    "hand-written buffer_callback of forward + backward",
                    lambda: jax.block_until_ready(floor(params, x, y)),
                    "torch forward + backward",
                    torch_grad,
                ),
                paired_row(
                    "jax.jit(jax.grad(loss))",
                    lambda: jax.block_until_ready(grad_fn(params, x, y)),
                    "hand-written buffer_callback of forward + backward",
                    lambda: jax.block_until_ready(floor(params, x, y)),
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
