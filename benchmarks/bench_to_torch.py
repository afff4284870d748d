# Per-call cost of to_torch against calling the jitted JAX function directly, in one run.
#
# The baseline is `jax.jit(f)(x).block_until_ready()` on a JAX array: what the same work
# costs without torch. to_torch adds argument flattening, a signature-cache lookup, DLPack
# in and out, and (when an input requires grad) the autograd.Function. The conversion-only
# row is those DLPack steps alone, so the rest is what to_torch itself adds. For 2**24
# elements the question is extra copies, not overhead.
#
# Two floors, timed paired with to_torch on 16 elements: the fastest hand-written bridge
# for any f (torch._C._to_dlpack, jaxlib's DLPack import, the jitted f, jaxlib's export,
# torch._C._from_dlpack; nothing checked), and for a forward and torch.autograd.grad, a
# hand-written old-style autograd.Function whose forward runs a jitted jax.vjp and keeps
# its pullback, and whose backward runs that jitted pullback.
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from _timing import Row, Table, format_tables, median_seconds, paired_row

from torchjax._compat._jax import dlpack_export, dlpack_import
from torchjax._compat._torch import cpu_array_from_tensor
from torchjax._convert import array_to_tensor, tensor_to_jax
from torchjax._to_torch._to_torch import to_torch

_from_capsule = torch._C._from_dlpack


def fastest_bridge(f):
    """The floor for a forward: private DLPack calls around jax.jit(f), nothing checked."""
    f_jit = jax.jit(f)
    device = jax.devices("cpu")[0]
    cpu_array_from_tensor(torch.zeros(1), device)  # settles this jaxlib's import signature
    form = cpu_array_from_tensor.forms[0]

    def call(t):
        x = dlpack_import(torch._C._to_dlpack(t), device, *form)
        return _from_capsule(dlpack_export(f_jit(x), stream=None))

    return call


def hand_function(f):
    """The floor for forward + backward: an old-style autograd.Function around jax.vjp."""
    device = jax.devices("cpu")[0]
    cpu_array_from_tensor(torch.zeros(1), device)  # settles this jaxlib's import signature
    form = cpu_array_from_tensor.forms[0]
    to_jax = lambda t: dlpack_import(torch._C._to_dlpack(t), device, *form)
    to_torch_ = lambda a: _from_capsule(dlpack_export(a, stream=None))
    forward = jax.jit(lambda x: jax.vjp(f, x))
    backward = jax.jit(lambda pullback, ct: pullback(ct)[0])

    class Hand(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            y, pullback = forward(to_jax(t.detach()))
            ctx.pullback = pullback
            return to_torch_(y)

        @staticmethod
        def backward(ctx, ct):
            return to_torch_(backward(ctx.pullback, to_jax(ct.contiguous())))

    return Hand.apply


def floor_rows(f, n: int) -> list[Row]:
    t = torch.arange(n, dtype=torch.float32)
    t_grad = t.clone().requires_grad_()
    wrapped, bridge, hand = to_torch(f), fastest_bridge(f), hand_function(f)
    ref = torch.autograd.grad(hand(t_grad).sum(), t_grad)[0]
    got = torch.autograd.grad(wrapped(t_grad).sum(), t_grad)[0]
    assert torch.equal(bridge(t), wrapped(t)) and torch.equal(ref, got)
    return [
        paired_row(
            "to_torch(f)", lambda: wrapped(t), "fastest hand-written bridge", lambda: bridge(t)
        ),
        paired_row(
            "to_torch(f) forward + autograd.grad",
            lambda: torch.autograd.grad(wrapped(t_grad).sum(), t_grad),
            "hand-written autograd.Function around jax.vjp",
            lambda: torch.autograd.grad(hand(t_grad).sum(), t_grad),
        ),
    ]


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
    add_one = lambda x: x + 1
    return [
        ("f(x) = x + 1 on 16 float32", rows_for(add_one, 16) + floor_rows(add_one, 16)),
        ("f(x) = x * 2 on 2**24 float32", rows_for(lambda x: x * 2, 2**24)),
    ]


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()
