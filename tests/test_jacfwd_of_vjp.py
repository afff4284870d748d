"""Known issue, kept as a strict xfail so that the fix is noticed: jax.jacfwd of a function
that applies a wrapped torch function's vjp to its argument (the cotangent).

jacfwd is vmap(jvp, out_axes=(None, -1)): the primal output must come back unbatched, as it
does in pure JAX, but the batched rule marks it batched. diffrax's BacksolveAdjoint does
exactly this with the vector field (examples/neural_ode_adjoints.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax

Y = jnp.array([0.1, -0.4, 0.7], dtype=jnp.float32)


def _jacfwd_of_vjp(f):
    return jax.jacfwd(lambda c: jax.vjp(f, Y)[1](c)[0])(Y)


@pytest.mark.xfail(strict=True, reason="jvp of the vjp primitive marks its primal batched")
def test_jacfwd_of_vjp_in_the_cotangent():
    f = torchjax.to_jax(lambda y: torch.tanh(y) * 2)
    expected = _jacfwd_of_vjp(lambda y: jnp.tanh(y) * 2)  # diag(2 (1 - tanh^2 y))
    np.testing.assert_allclose(_jacfwd_of_vjp(f), expected, rtol=1e-6)
