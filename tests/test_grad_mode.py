"""Torch's grad mode inside a wrapped function (issue #46): the function runs in the mode
plain torch would give it, on unless the caller turned it off, so force code that calls
torch.autograd.grad without an enable_grad of its own works eagerly and under every
transform. References: the same math in jax.numpy, and plain torch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax

pytestmark = pytest.mark.core


def forces(w, x):
    """Minus the gradient of an energy, as molecular-dynamics code writes it: no
    torch.enable_grad() of its own, and a graph kept for a later derivative."""
    x = x.detach().requires_grad_(True)
    energy = (w**3 * torch.sin(x) ** 2).sum()
    (dedx,) = torch.autograd.grad(energy, x, create_graph=True)
    return -dedx


def forces_jnp(w, x):
    return -(w**3) * jnp.sin(2 * x)  # d/dx of sin(x)**2 is sin(2x); x detached


def forces_of_positions(w, x):
    """The same with the positions kept on JAX's tape: the derivative reaches x too."""
    x = x if x.requires_grad else x.requires_grad_(True)
    energy = (w**3 * torch.sin(x) ** 2).sum()
    (dedx,) = torch.autograd.grad(energy, x, create_graph=True)
    return -dedx


W, X = 1.7, np.linspace(0.0, 1.0, 6)


def _total(fn):
    return lambda w, x: fn(w, x).sum()


def test_autograd_grad_inside_works_eagerly_and_under_jit_as_in_plain_torch():
    f = torchjax.to_jax(forces)
    expected = forces(torch.tensor(W), torch.tensor(X)).detach().numpy()  # plain torch
    np.testing.assert_allclose(f(jnp.asarray(W), jnp.asarray(X)), expected, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(jnp.asarray(W), jnp.asarray(X)), expected, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_derivatives_through_code_that_runs_autograd_itself(jit):
    f = torchjax.to_jax(forces)
    w, x = jnp.asarray(W), jnp.asarray(X)
    maybe_jit = jax.jit if jit else (lambda g: g)
    got = maybe_jit(jax.grad(_total(f)))(w, x)
    np.testing.assert_allclose(got, jax.grad(_total(forces_jnp))(w, x), rtol=1e-6)
    xs = jnp.stack([x, 2 * x, -x])
    got = maybe_jit(jax.vmap(jax.grad(_total(f)), in_axes=(None, 0)))(w, xs)
    want = jax.vmap(jax.grad(_total(forces_jnp)), in_axes=(None, 0))(w, xs)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got = maybe_jit(jax.hessian(_total(f)))(w, x)
    np.testing.assert_allclose(got, jax.hessian(_total(forces_jnp))(w, x), rtol=1e-6)


def test_the_derivative_reaches_inputs_the_function_differentiates_by():
    f = torchjax.to_jax(forces_of_positions)
    w, x = jnp.asarray(W), jnp.asarray(X)
    for transform in (jax.grad, jax.jacfwd, jax.jacrev):
        got = transform(_total(f), argnums=1)(w, x)
        np.testing.assert_allclose(got, -2 * W**3 * np.cos(2 * X), rtol=1e-5, atol=1e-5)


def test_the_callers_no_grad_is_kept_and_outputs_leave_their_graph():
    param = torch.nn.Parameter(torch.tensor(2.0))  # closed over, requires grad
    seen = []

    def fn(x):
        seen.append(torch.is_grad_enabled())
        return param * x

    f = torchjax.to_jax(fn)
    x = jnp.arange(3.0)
    np.testing.assert_allclose(f(x), [0.0, 2.0, 4.0])  # an output on a graph: detached
    np.testing.assert_allclose(jax.jit(f)(x), [0.0, 2.0, 4.0])
    with torch.no_grad():
        np.testing.assert_allclose(f(x + 1), [2.0, 4.0, 6.0])
    assert seen[0] is True and seen[-1] is False
    assert param.grad is None  # nothing was differentiated on the user's graph
