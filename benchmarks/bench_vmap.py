# jax.vmap of a wrapped per-example torch function: one torch.func.vmap call for the batch.
#
# Baseline: torch.func.vmap of the same function on torch tensors, in the same process.
# "sequential" (one torch call per example, what callback bridges without a batching rule
# do) shows what the batching rule saves. The floor for any Python callback is a
# hand-written buffer_callback that calls torch.func.vmap on XLA's buffers and copies the
# result out: it is timed against native too, and to_jax against it.
#
# Per-example gradients: jax.jit(jax.vmap(jax.value_and_grad(loss))) and of jax.grad, the
# parameters unbatched, against torch.func.vmap(torch.func.grad_and_value(loss)) and of
# torch.func.grad. torchjax runs one batched forward that keeps its graph (the parameters
# expanded to the batch with stride 0) and pulls every example back through it; the
# gradients, one per example (256 x 68k floats), are then written into XLA's buffers. Their
# floor for any callback is a hand-written buffer_callback of torch.func.vmap(grad) that
# copies the gradients into XLA's output buffers: against native, it is what that copy
# costs; torchjax is timed against it too.
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from _timing import Table, format_tables, paired_row
from jax.experimental.buffer_callback import buffer_callback

import torchjax

BATCH, D_IN, D_HIDDEN, D_OUT = 256, 256, 256, 10


def _dl(buf):
    return torch.utils.dlpack.from_dlpack(buf.__dlpack__())


def per_example_mlp(params, x):  # {'w1': [256, 256], ...}, [256] -> [10]
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def measure() -> list[Table]:
    """Check the three agree, then time them: one table of medians and ratios."""
    g = torch.Generator().manual_seed(0)
    params_t = {
        "w1": torch.randn(D_IN, D_HIDDEN, generator=g) / D_IN**0.5,
        "b1": torch.zeros(D_HIDDEN),
        "w2": torch.randn(D_HIDDEN, D_OUT, generator=g) / D_HIDDEN**0.5,
        "b2": torch.zeros(D_OUT),
    }
    xs_t = torch.randn(BATCH, D_IN, generator=g)
    params, xs = torchjax.tree_to_jax(params_t), torchjax.tree_to_jax(xs_t)

    native = torch.func.vmap(per_example_mlp, in_dims=(None, 0))
    batched = jax.jit(jax.vmap(torchjax.to_jax(per_example_mlp), in_axes=(None, 0)))
    sequential = jax.jit(
        jax.vmap(torchjax.to_jax(per_example_mlp, vmap_method="sequential"), in_axes=(None, 0))
    )
    want = native(params_t, xs_t).numpy()
    for f in (batched, sequential):  # same numbers before timing them
        assert abs(jax.device_get(f(params, xs)) - want).max() < 1e-4

    def floor_callback(ctx, out, b1, b2, w1, w2, x):
        p = {"b1": _dl(b1), "b2": _dl(b2), "w1": _dl(w1), "w2": _dl(w2)}
        with torch.no_grad():
            _dl(out).copy_(native(p, _dl(x)))

    out_struct = jax.ShapeDtypeStruct((BATCH, D_OUT), jnp.float32)
    floor = jax.jit(
        lambda p, x: buffer_callback(floor_callback, out_struct)(
            p["b1"], p["b2"], p["w1"], p["w2"], x
        )
    )
    assert abs(jax.device_get(floor(params, xs)) - want).max() < 1e-4

    grad_tables = _per_example_grads(params_t, xs_t, params, xs)
    base_name, base = "native torch.func.vmap", lambda: native(params_t, xs_t)
    floor_name = "hand-written buffer_callback of torch.func.vmap"
    mlp = f"MLP {D_IN}-{D_HIDDEN}-{D_OUT}"
    return [
        (
            f"jit(vmap(to_jax(per_example_mlp))) over {BATCH} examples, {mlp}",
            [
                paired_row(
                    "vmap_method='torch'",
                    lambda: batched(params, xs).block_until_ready(),
                    base_name,
                    base,
                ),
                paired_row(
                    floor_name, lambda: floor(params, xs).block_until_ready(), base_name, base
                ),
                paired_row(
                    "vmap_method='torch'",
                    lambda: batched(params, xs).block_until_ready(),
                    floor_name,
                    lambda: floor(params, xs).block_until_ready(),
                ),
                paired_row(
                    "vmap_method='sequential'",
                    lambda: sequential(params, xs).block_until_ready(),
                    base_name,
                    base,
                ),
            ],
        ),
        *grad_tables,
    ]


def per_example_loss(params, x):  # {'w1': [256, 256], ...}, [256] -> []
    return per_example_mlp(params, x).pow(2).sum()


def _per_example_grads(params_t, xs_t, params, xs) -> list[Table]:
    wrapped = torchjax.to_jax(per_example_loss)
    value_and_grad = jax.jit(jax.vmap(jax.value_and_grad(wrapped), in_axes=(None, 0)))
    grad = jax.jit(jax.vmap(jax.grad(wrapped), in_axes=(None, 0)))
    native_vg = torch.func.vmap(torch.func.grad_and_value(per_example_loss), in_dims=(None, 0))
    native_g = torch.func.vmap(torch.func.grad(per_example_loss), in_dims=(None, 0))
    want_grads, want_values = native_vg(params_t, xs_t)
    values, grads = value_and_grad(params, xs)
    assert abs(jax.device_get(values) - want_values.numpy()).max() < 1e-3
    for k, g in grad(params, xs).items():  # same numbers before timing them
        assert abs(jax.device_get(g) - want_grads[k].numpy()).max() < 1e-4
        assert abs(jax.device_get(grads[k]) - want_grads[k].numpy()).max() < 1e-4
    floor = _per_example_grads_floor(native_g, params_t)
    for k, g in floor(params, xs).items():
        assert abs(jax.device_get(g) - want_grads[k].numpy()).max() < 1e-4
    floor_name = "hand-written buffer_callback of torch.func.vmap(grad)"
    return [
        (
            f"per-example gradients of {BATCH} examples, MLP {D_IN}-{D_HIDDEN}-{D_OUT}",
            [
                paired_row(
                    "jit(vmap(value_and_grad(to_jax(loss))))",
                    lambda: jax.block_until_ready(value_and_grad(params, xs)),
                    "torch.func.vmap(grad_and_value)",
                    lambda: native_vg(params_t, xs_t),
                ),
                paired_row(
                    "jit(vmap(grad(to_jax(loss))))",
                    lambda: jax.block_until_ready(grad(params, xs)),
                    "torch.func.vmap(grad)",
                    lambda: native_g(params_t, xs_t),
                ),
                paired_row(
                    floor_name,
                    lambda: jax.block_until_ready(floor(params, xs)),
                    "torch.func.vmap(grad)",
                    lambda: native_g(params_t, xs_t),
                ),
                paired_row(
                    "jit(vmap(grad(to_jax(loss))))",
                    lambda: jax.block_until_ready(grad(params, xs)),
                    floor_name,
                    lambda: jax.block_until_ready(floor(params, xs)),
                ),
            ],
        )
    ]


def _per_example_grads_floor(native_g, params_t):
    """The floor for any callback: torch.func.vmap(grad) on XLA's buffers, the gradients
    (one per example) copied into XLA's output buffers."""
    names = sorted(params_t)  # the flattening order of a dict's leaves
    structs = tuple(jax.ShapeDtypeStruct((BATCH, *params_t[k].shape), jnp.float32) for k in names)

    def callback(ctx, outs, *bufs):
        *p, x = (_dl(b) for b in bufs)
        grads = native_g(dict(zip(names, p, strict=True)), x)
        for k, out in zip(names, outs, strict=True):
            _dl(out).copy_(grads[k])

    call = buffer_callback(callback, structs)
    return jax.jit(
        lambda params, xs: dict(zip(names, call(*[params[k] for k in names], xs), strict=True))
    )


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()
