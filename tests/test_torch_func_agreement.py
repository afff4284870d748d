# Derivatives agree with torch.func (issue #14): every composition of JAX transforms of a
# wrapped function gives torch.func's numbers, and works wherever torch.func works. The
# references are torch.func itself, applied to the same torch function, in float64.
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import Square, tree_close
from torch._subclasses.fake_tensor import is_fake

import torchjax
from torchjax.errors import AutodiffError

pytestmark = [pytest.mark.core, pytest.mark.usefixtures("x64")]  # all in float64


def _t(x):
    return torch.tensor(np.asarray(x))


RNG = np.random.default_rng(0)
# Unshifted random matrices: det's second derivative depends on every entry.
MATRIX = RNG.normal(size=(3, 3))
VECTOR = RNG.normal(size=3)

SECOND_ORDER_LINALG = {
    "det": torch.linalg.det,
    "slogdet": lambda x: torch.linalg.slogdet(x)[1],
    "logdet": lambda x: torch.logdet(x @ x.mT + torch.eye(3, dtype=x.dtype)),
    "solve": lambda x: torch.linalg.solve(x, torch.tensor(VECTOR)).pow(2).sum(),
    "solve_ex": lambda x: torch.linalg.solve_ex(x, torch.tensor(VECTOR))[0].pow(2).sum(),
    "tensorsolve": lambda x: torch.linalg.tensorsolve(x, torch.tensor(VECTOR)).sum(),
}


@pytest.mark.parametrize("name", list(SECOND_ORDER_LINALG))
def test_hessian_of_linalg_matches_torch_func(name):
    # Regression: derived calls ran with grad mode off, and torch's no-grad backward of
    # these ops has a wrong forward-mode derivative (hessian off by up to 17).
    f = SECOND_ORDER_LINALG[name]
    expected = torch.func.hessian(f)(_t(MATRIX))
    g = torchjax.to_jax(f)
    tree_close(jax.hessian(g)(MATRIX), expected)
    tree_close(jax.jit(jax.hessian(g))(MATRIX), expected)
    tree_close(
        jax.jacrev(jax.jacfwd(g))(MATRIX), torch.func.jacrev(torch.func.jacfwd(f))(_t(MATRIX))
    )


def test_hvp_and_vmap_of_hessian_of_det():
    f, g = torch.linalg.det, torchjax.to_jax(torch.linalg.det)
    v = RNG.normal(size=(3, 3))
    hvp = jax.jvp(jax.grad(g), (MATRIX,), (v,))[1]
    tree_close(hvp, torch.func.jvp(torch.func.grad(f), (_t(MATRIX),), (_t(v),))[1])
    xs = np.stack([MATRIX, 2 * MATRIX + 1])
    tree_close(jax.vmap(jax.hessian(g))(xs), torch.func.vmap(torch.func.hessian(f))(_t(xs)))


@pytest.mark.parametrize(
    "name, f",
    [
        ("silu", lambda x: F.silu(x).pow(2).sum()),
        ("mish", lambda x: F.mish(x).pow(2).sum()),
        ("logit", lambda x: torch.logit(x).pow(2).sum()),
        ("group_norm", lambda x: F.group_norm(x, 2).pow(3).sum()),
    ],
)
def test_hessian_where_torch_has_no_grad_mode_forward_ad(name, f):
    # Under no_grad torch picks silu_backward & co., which have no forward-mode formula.
    x = 0.5 + 0.1 * RNG.normal(size=(1, 4, 3))
    tree_close(jax.hessian(torchjax.to_jax(f))(x), torch.func.hessian(f)(_t(x)))


def _cube_sum(x):
    return (x**3).sum()


def test_autograd_grad_method_composes_with_vmap():
    f = torchjax.to_jax(_cube_sum, grad_method="autograd")
    x = jnp.array([0.5, -1.0, 2.0])
    tree_close(jax.jacfwd(f)(x), 3 * x**2)
    tree_close(jax.hessian(f)(x), jnp.diag(6 * x))
    tree_close(jax.jit(jax.hessian(f))(x), jnp.diag(6 * x))
    xs = jnp.stack([x, 2 * x])
    tree_close(jax.vmap(jax.grad(f))(xs), 3 * xs**2)
    cube = torchjax.to_jax(lambda x: x**3, grad_method="autograd")
    tree_close(jax.jacobian(cube)(x), jnp.diag(3 * x**2))
    tree_close(jax.jacfwd(cube)(x), jnp.diag(3 * x**2))


def test_zero_tangents_and_gradients_from_torch_func_are_materialized():
    # torch.func returns lazy ZeroTensors (no storage) for derivatives known to be zero.
    f = torchjax.to_jax(lambda x: tuple(torch.linalg.slogdet(x)))
    (sign, logabs), (t_sign, t_logabs) = jax.jvp(f, (2 * jnp.eye(3),), (jnp.ones((3, 3)),))
    tree_close(t_sign, 0.0)
    tree_close(t_logabs, 1.5)
    tree_close(jax.grad(lambda x: torchjax.to_jax(torch.sgn)(x).sum())(jnp.array([1.0, -2.0])), 0.0)
    l1 = lambda x: F.l1_loss(x, torch.zeros(3, dtype=x.dtype))
    x = jnp.array([1.0, -2.0, 3.0])
    expected = torch.func.jacrev(torch.func.jacrev(l1))(_t(x))
    assert expected._is_zerotensor()  # what torch.func hands back: zero, without storage
    tree_close(jax.jacrev(jax.jacrev(torchjax.to_jax(l1)))(x), np.zeros((3, 3)))


def _counting(f):
    """f, counting its real calls (not the fake run that finds its output types)."""

    def counted(*args):
        if not any(map(is_fake, args)):
            counted.calls += 1
        return f(*args)

    counted.calls = 0
    return counted


def test_jacrev_runs_the_forward_once_and_batches_only_the_pullback():
    # Random draws: the forward cannot run under vmap with randomness="error", and
    # torch.func.jacrev does not need it to: neither does jax.jacrev.
    f = _counting(lambda x: torch.bernoulli(torch.sigmoid(x)) * x)
    jac = jax.jacrev(torchjax.to_jax(f))(jnp.zeros(3))
    assert jac.shape == (3, 3)
    assert np.all((np.asarray(jac) == 0) | (np.asarray(jac) == 1))
    tree_close(jac, np.diag(np.diag(jac)))  # d(mask * x)/dx = diag(mask)
    x = jnp.array([0.2, -0.3, 0.4])
    assert jax.jacrev(torchjax.to_jax(lambda x: torch.normal(x, 1.0)))(x).shape == (3, 3)
    rrelu = lambda x: F.rrelu(x, training=False)
    tree_close(jax.jacrev(torchjax.to_jax(rrelu))(x), torch.func.jacrev(rrelu)(_t(x)))
    # jax.jacrev of an 8-output function: the real torch calls, one forward each.
    f = _counting(lambda x: torch.sin(x) * x.sum())
    g = torchjax.to_jax(f)
    y = jnp.linspace(0.1, 0.8, 8)
    f.calls = 0
    jac = jax.jacrev(g)(y)
    tree_close(jac, torch.func.jacrev(lambda t: torch.sin(t) * t.sum())(_t(y)))
    assert f.calls == 2  # the primal output, and one forward inside the batched VJP


def test_jvp_of_a_vjp_with_respect_to_its_cotangents_is_one_call():
    # diffrax's BacksolveAdjoint differentiates VJPs of the vector field this way.
    f = _counting(lambda x: torch.tanh(x) * x)
    g = torchjax.to_jax(f)
    x = jnp.array([0.3, -0.7, 1.1])
    _, pullback = jax.vjp(g, x)
    ct, ct_dot = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, -1.0, 0.0])
    f.calls = 0
    (value,), (tangent,) = jax.jvp(pullback, (ct,), (ct_dot,))
    assert f.calls == 1
    _, torch_pullback = torch.func.vjp(lambda t: torch.tanh(t) * t, _t(x))
    tree_close(value, torch_pullback(_t(ct))[0])
    tree_close(tangent, torch_pullback(_t(ct_dot))[0])


def test_jacrev_of_jacrev_and_vmap_of_jacrev_match_torch_func():
    f = lambda x: (torch.sin(x) * x.prod()).sum()
    g = torchjax.to_jax(f)
    x = jnp.array([0.3, -0.7, 1.1])
    tree_close(jax.jacrev(jax.jacrev(g))(x), torch.func.jacrev(torch.func.jacrev(f))(_t(x)))
    xs = jnp.stack([x, -x, 2 * x])
    tree_close(jax.vmap(jax.jacrev(g))(xs), torch.func.vmap(torch.func.jacrev(f))(_t(xs)))
    tree_close(jax.jacrev(jax.vmap(g))(xs), torch.func.jacrev(torch.func.vmap(f))(_t(xs)))


def test_forward_mode_without_formula_names_the_way_out():
    f = torchjax.to_jax(lambda x: Square.apply(x).sum())
    x = jnp.array([1.0, 2.0])
    tree_close(jax.grad(f)(x), 2 * x)
    with pytest.raises(AutodiffError, match="(?s)forward-mode derivative.*grad_method='autograd'"):
        jax.jvp(f, (x,), (x,))


def test_vmap_of_grad_where_torch_func_vmap_alone_cannot_batch():
    # torch.func.vmap has no rule for column_stack; beneath an autograd level (as in
    # torch.func.vmap(torch.func.grad(f))) it decomposes into ops it can batch.
    f = lambda x: torch.column_stack([x, x * x]).sum()
    xs = jnp.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0]])
    expected = torch.func.vmap(torch.func.grad(f))(_t(xs))
    tree_close(jax.vmap(jax.grad(torchjax.to_jax(f)))(xs), expected)
    tree_close(jax.jit(jax.vmap(jax.grad(torchjax.to_jax(f))))(xs), expected)


def test_jacrev_of_empty_inputs():
    f = lambda x: torch.flip(x, (0,)) * 2
    x = jnp.zeros((5, 0))
    assert jax.jacrev(jax.jacrev(torchjax.to_jax(lambda x: f(x).sum())))(x).shape == (5, 0, 5, 0)
    assert jax.jacrev(torchjax.to_jax(f))(x).shape == (5, 0, 5, 0)


def test_jacfwd_of_a_vjp_in_its_cotangent():
    # jacfwd batches the tangents only: the pullback of the primal cotangent must come out
    # unbatched (diffrax's BacksolveAdjoint differentiates the vector field's VJP this way).
    y = jnp.array([0.1, -0.4, 0.7])
    jac = lambda f: jax.jacfwd(lambda c: jax.vjp(f, y)[1](c)[0])(y)
    expected = jac(lambda y: jnp.tanh(y) * 2)  # diag(2 (1 - tanh(y)^2))
    tree_close(jac(torchjax.to_jax(lambda y: torch.tanh(y) * 2)), expected)
    tree_close(jax.jit(lambda: jac(torchjax.to_jax(lambda y: torch.tanh(y) * 2)))(), expected)
