# Per-call cost of to_jax against the floor for any Python callback, measured in one run.
#
# The floor is a hand-written buffer_callback that calls torch and copies into XLA's output
# buffer: every Python-callback bridge pays at least that. jax.pure_callback and native torch
# are shown for reference. For 2**24 elements the question is extra copies, not overhead.
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from _timing import Table, format_tables, paired_row
from jax.experimental.buffer_callback import buffer_callback

import torchjax


def _dl(buf):
    return torch.utils.dlpack.from_dlpack(buf.__dlpack__())


def hand_callback(op, n):
    """The floor: a buffer_callback that runs `op` in torch and copies into `out`."""

    def cb(ctx, out, x):
        _dl(out).copy_(op(_dl(x)))

    return jax.jit(buffer_callback(cb, jax.ShapeDtypeStruct((n,), jnp.float32)))


def measure() -> list[Table]:
    """Two tables of medians and ratios: overhead on 16 elements, copies on 2**24."""
    add_one = lambda x: x + 1
    n = 16
    x = jnp.arange(n, dtype=jnp.float32)
    t = torch.arange(n, dtype=torch.float32)
    f = torchjax.to_jax(add_one)
    f_jit = jax.jit(f)
    hand = hand_callback(add_one, n)
    pure = jax.jit(
        lambda x: jax.pure_callback(
            lambda a: a + 1, jax.ShapeDtypeStruct((n,), jnp.float32), x, vmap_method="sequential"
        )
    )
    floor_name, floor = "hand-written buffer_callback", lambda: hand(x).block_until_ready()
    small = (
        "f(x) = x + 1 on 16 float32",
        [
            paired_row("to_jax under jit", lambda: f_jit(x).block_until_ready(), floor_name, floor),
            paired_row("to_jax eager", lambda: f(x).block_until_ready(), floor_name, floor),
            paired_row(
                "jax.pure_callback under jit",
                lambda: pure(x).block_until_ready(),
                floor_name,
                floor,
            ),
            paired_row("native torch", lambda: add_one(t), floor_name, floor),
        ],
    )

    times_two = lambda x: x * 2
    n = 2**24
    x = jnp.arange(n, dtype=jnp.float32)
    t = torch.arange(n, dtype=torch.float32)
    f = torchjax.to_jax(times_two)
    f_jit = jax.jit(f)
    hand = hand_callback(times_two, n)
    large = (
        "f(x) = x * 2 on 2**24 float32",
        [
            paired_row(
                "to_jax under jit",
                lambda: f_jit(x).block_until_ready(),
                "hand-written compute-then-copy",
                lambda: hand(x).block_until_ready(),
            ),
            paired_row(
                "to_jax eager",
                lambda: f(x).block_until_ready(),
                "native torch",
                lambda: times_two(t),
            ),
        ],
    )
    return [small, large]


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()
