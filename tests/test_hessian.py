# Tests of second-order differentiation of functions made by to_jax (issue #6): hessian,
# jacfwd(jacrev), jacrev(jacfwd), grad(grad), jvp(grad), each also under jit, compared with
# the same function written in jax.numpy.
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import tree_close

import torchjax

pytestmark = pytest.mark.core  # the version matrix runs this module


def _torch_f(x):
    return (torch.sin(x) * x * x).sum() + torch.logsumexp(x, 0) + (x[:-1] * x[1:]).sum()


def _jax_f(x):
    return (jnp.sin(x) * x * x).sum() + jax.nn.logsumexp(x, 0) + (x[:-1] * x[1:]).sum()


X = jnp.array([0.3, -1.2, 0.8, 2.0])

TRANSFORMS = {
    "hessian": jax.hessian,
    "jacfwd(jacrev)": lambda f: jax.jacfwd(jax.jacrev(f)),
    "jacrev(jacfwd)": lambda f: jax.jacrev(jax.jacfwd(f)),
    "jacrev(jacrev)": lambda f: jax.jacrev(jax.jacrev(f)),
    "grad(grad)": lambda f: jax.grad(lambda x: (jax.grad(f)(x) * jnp.arange(1.0, 5.0)).sum()),
    "jvp(grad)": lambda f: lambda x: jax.jvp(jax.grad(f), (x,), (jnp.arange(1.0, 5.0),))[1],
    "grad(jvp)": lambda f: jax.grad(lambda x: jax.jvp(f, (x,), (jnp.arange(1.0, 5.0),))[1]),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_second_order(name, jit):
    t = TRANSFORMS[name]
    g = t(torchjax.to_jax(_torch_f))
    g = jax.jit(g) if jit else g
    tree_close(g(X), jax.jit(t(_jax_f))(X))


def test_hessian_is_the_analytic_one():
    # An independent check of the reference itself, on a function with a known Hessian.
    f = torchjax.to_jax(lambda x: (x**3).sum() + x[0] * x[1])
    expected = jnp.diag(6 * X).at[0, 1].set(1.0).at[1, 0].set(1.0)
    tree_close(jax.hessian(f)(X), expected)


def test_hessian_of_several_pytree_arguments():
    def torch_f(p, x):
        return (torch.tanh(x @ p["w"] + p["b"]) ** 2).sum()

    def jax_f(p, x):
        return (jnp.tanh(x @ p["w"] + p["b"]) ** 2).sum()

    p = {"w": jnp.array([[0.2, -0.5], [0.7, 0.1], [-0.3, 0.4]]), "b": jnp.array([0.1, -0.2])}
    x = jnp.array([[1.0, -1.0, 0.5], [0.3, 0.2, -0.7]])
    f = torchjax.to_jax(torch_f)
    h = jax.jit(jax.hessian(f, argnums=(0, 1)))(p, x)
    tree_close(h, jax.jit(jax.hessian(jax_f, argnums=(0, 1)))(p, x))
    assert h[0]["w"][1].shape == (3, 2, 2, 3)  # d2f / dw dx


def test_third_order():
    f = torchjax.to_jax(lambda x: torch.sin(x).sum())
    d3 = jax.grad(lambda x: jax.grad(lambda x: jax.grad(f)(x).sum())(x).sum())
    tree_close(jax.jit(d3)(X), -jnp.cos(X))


def test_hessian_vector_product_of_a_small_nn():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    w1, b1 = (jnp.asarray(t.detach().cpu().numpy()) for t in (net[0].weight, net[0].bias))
    w2, b2 = (jnp.asarray(t.detach().cpu().numpy()) for t in (net[2].weight, net[2].bias))
    f = torchjax.to_jax(lambda x: net(x).sum())
    fj = lambda x: (jnp.tanh(x @ w1.T + b1) @ w2.T + b2).sum()
    x = jnp.array([[0.5, -0.2, 0.1], [1.0, 0.3, -0.8]])
    v = jnp.ones_like(x)
    hvp = lambda f: jax.jvp(jax.grad(f), (x,), (v,))[1]
    tree_close(hvp(f), hvp(fj))
    tree_close(jax.jit(jax.hessian(f))(x), jax.jit(jax.hessian(fj))(x))


@pytest.mark.parametrize("transform", ["hessian", "jacrev_jacrev"])
def test_eval_mode_batch_norm_with_running_statistics_as_inputs(transform, x64):
    # Eval mode writes nothing: its schema marks the running statistics mutable, and the
    # fake run's guard reads the training flag (issue 45 reported a refusal here).
    rng = np.random.default_rng(0)
    x, w, b = rng.normal(size=(3, 2, 4)), rng.normal(size=2), rng.normal(size=2)
    mean, var = rng.normal(size=2), rng.uniform(0.5, 1.5, size=2)
    saved_mean = mean.copy()

    def bn(x, w, b, mean, var):
        return torch.ops.aten._native_batch_norm_legit(x, w, b, mean, var, False, 0.5, 1e-5)[0]

    f = torchjax.to_jax(bn)
    s_j = lambda x: (f(x, w, b, mean, var) ** 2).sum()
    rest = [torch.tensor(a) for a in (w, b, mean, var)]
    s_t = lambda x: (bn(x, *rest) ** 2).sum()
    if transform == "hessian":
        got, want = jax.hessian(s_j)(x), torch.func.hessian(s_t)(torch.tensor(x))
    else:
        got = jax.jacrev(jax.jacrev(s_j))(x)
        want = torch.func.jacrev(torch.func.jacrev(s_t))(torch.tensor(x))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-7, atol=1e-9)
    np.testing.assert_array_equal(mean, saved_mean)  # the caller's statistics unchanged
