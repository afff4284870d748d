# Per-call cost of to_torch against calling the jitted JAX function directly, in one run.
#
# The baseline is `jax.jit(f)(x).block_until_ready()` on a JAX array: what the same work
# costs without torch. to_torch adds argument flattening, a signature-cache lookup, DLPack
# in and out, and (when an input requires grad) the autograd.Function. The conversion-only
# row is those DLPack steps alone, so the rest is what to_torch itself adds. For 2**24
# elements the question is extra copies, not overhead.
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from _timing import Row, Table, format_tables, median_seconds

from torchjax._convert import array_to_tensor, tensor_to_jax
from torchjax._to_torch._to_torch import to_torch


def rows_for(f, n: int) -> list[Row]:
    x = jnp.arange(n, dtype=jnp.float32)
    t = torch.arange(n, dtype=torch.float32)
    t_grad = t.clone().requires_grad_()
    f_jit = jax.jit(f)
    wrapped = to_torch(f)
    base_name = "jax.jit(f) on jax.Array"
    base = median_seconds(lambda: f_jit(x).block_until_ready())
    return [
        ("to_torch(f)", median_seconds(lambda: wrapped(t)), base_name, base),
        (
            "to_torch(f), input requires grad",
            median_seconds(lambda: wrapped(t_grad)),
            base_name,
            base,
        ),
        (
            "conversion only: tensor_to_jax → jit → array_to_tensor",
            median_seconds(lambda: array_to_tensor(f_jit(tensor_to_jax(t)))),
            base_name,
            base,
        ),
    ]


def measure() -> list[Table]:
    """Two tables of medians and ratios: overhead on 16 elements, copies on 2**24."""
    return [
        ("f(x) = x + 1 on 16 float32", rows_for(lambda x: x + 1, 16)),
        ("f(x) = x * 2 on 2**24 float32", rows_for(lambda x: x * 2, 2**24)),
    ]


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()
