"""What many test modules share: one closeness check, and the torch functions they reuse.

`tree_close` compares two pytrees leaf by leaf (JAX arrays, numpy arrays, torch tensors,
numbers) with one tolerance policy, by the dtype of the actual leaf: what float32 and
float64 arithmetic done in two different orders (JAX's and torch's) can differ by. A test
that needs more slack passes `rtol`/`atol` and says why.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Whether the tests run with their data on the GPU (conftest.py: TORCHJAX_TEST_DEVICE).
ON_GPU = os.environ.get("TORCHJAX_TEST_DEVICE", "cpu") == "cuda"

# dtype -> (rtol, atol); integers and booleans compare exactly.
TOLERANCES = {
    np.dtype(np.float16): (1e-3, 1e-3),
    np.dtype(jnp.bfloat16): (1e-2, 1e-2),
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.complex64): (1e-5, 1e-6),
    np.dtype(np.float64): (1e-7, 1e-9),
    np.dtype(np.complex128): (1e-7, 1e-9),
}


def as_numpy(x: Any) -> np.ndarray:
    """A leaf as a numpy array: a torch tensor is detached first."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def tree_close(actual: Any, expected: Any, rtol: float | None = None, atol: float | None = None):
    """Assert that two pytrees have the same structure and close leaves (see TOLERANCES).

    Torch tensors count as leaves on either side; `expected` may also be a single leaf to
    compare with every leaf of `actual`.
    """
    is_leaf = lambda x: isinstance(x, torch.Tensor)  # noqa: E731
    leaves = jax.tree.leaves(actual, is_leaf=is_leaf)
    tree = jax.tree.structure(actual, is_leaf=is_leaf)
    if jax.tree.structure(expected, is_leaf=is_leaf).num_leaves == 1 and len(leaves) > 1:
        wanted = [expected] * len(leaves)
    else:
        wanted = tree.flatten_up_to(expected)
    for a, e in zip(leaves, wanted, strict=True):
        a, e = as_numpy(a), as_numpy(e)
        r, t = TOLERANCES.get(a.dtype, (0.0, 0.0))
        np.testing.assert_allclose(
            a, e, rtol=r if rtol is None else rtol, atol=t if atol is None else atol
        )


class Cube(torch.autograd.Function):
    """x**3, old style (forward takes ctx, no setup_context): torch.func cannot transform
    it, torch.autograd can."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 3 * x**2


class Square(torch.autograd.Function):
    """x * x, new style, with a backward but no jvp: torch.func.vjp works, torch.func.jvp
    does not."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


# The matrix products torch.func's counts are compared by (tests/test_per_example.py,
# tests/test_forward_over_reverse.py).
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "mv", "addmv", "dot"}


class MatmulCount(TorchDispatchMode):
    """Counts the matrix products torch runs while active (in callbacks too: on the CPU,
    XLA runs them on the calling thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMULS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())
