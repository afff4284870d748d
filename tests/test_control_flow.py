# Tests of functions made by to_jax inside JAX control flow (issue #6): lax.scan (an RNN
# cell and an Euler integrator step scanned over time), lax.cond, lax.while_loop (forward
# only: JAX cannot reverse-differentiate it) and jax.checkpoint, under jit and grad.
# References are the same programs with the torch function written in jax.numpy.
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import tree_close
from torch._subclasses.fake_tensor import is_fake

import torchjax


def _jit_or_not(jit: bool):
    return jax.jit if jit else (lambda f: f)


JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])

# -- scan: an RNN cell -------------------------------------------------------------------


def _cell_torch(h, x, p):
    return torch.tanh(h @ p["W"] + x @ p["U"] + p["b"])


def _cell_jax(h, x, p):
    return jnp.tanh(h @ p["W"] + x @ p["U"] + p["b"])


def _rnn_loss(cell):
    def loss(p, h0, xs):
        def step(h, x):
            h = cell(h, x, p)
            return h, h

        h, hs = jax.lax.scan(step, h0, xs)
        return (hs**2).sum() + h.sum()

    return loss


def _rnn_data():
    k = jax.random.split(jax.random.key(0), 4)
    p = {
        "W": 0.5 * jax.random.normal(k[0], (3, 3)),
        "U": 0.5 * jax.random.normal(k[1], (2, 3)),
        "b": 0.1 * jax.random.normal(k[2], (3,)),
    }
    return p, jnp.zeros(3), jax.random.normal(k[3], (5, 2))


@JIT
def test_scan_rnn_cell(jit):
    p, h0, xs = _rnn_data()
    wrap = _jit_or_not(jit)
    loss_t, loss_j = _rnn_loss(torchjax.to_jax(_cell_torch)), _rnn_loss(_cell_jax)
    tree_close(wrap(loss_t)(p, h0, xs), loss_j(p, h0, xs))
    g = wrap(jax.grad(loss_t, argnums=(0, 1, 2)))(p, h0, xs)
    tree_close(g, jax.jit(jax.grad(loss_j, argnums=(0, 1, 2)))(p, h0, xs))
    # forward mode through the scan (one torch.func.jvp per step), and linearize
    tangents = jax.tree.map(jnp.ones_like, (p, h0, xs))
    jvp = lambda loss: lambda *a: jax.jvp(loss, a, tangents)
    tree_close(wrap(jvp(loss_t))(p, h0, xs), jvp(loss_j)(p, h0, xs))
    tree_close(jax.linearize(loss_t, p, h0, xs)[1](*tangents), jvp(loss_j)(p, h0, xs)[1])


def test_scan_rnn_cell_is_one_call_per_step():
    calls = []

    def cell(h, x, p):
        if not is_fake(h):
            calls.append(1)
        return _cell_torch(h, x, p)

    p, h0, xs = _rnn_data()
    jax.jit(_rnn_loss(torchjax.to_jax(cell)))(p, h0, xs).block_until_ready()
    assert len(calls) == xs.shape[0]


def test_vmap_of_scan():
    p, h0, xs = _rnn_data()
    batch = jnp.stack([xs, -xs, 2 * xs])
    f = lambda cell: jax.vmap(_rnn_loss(cell), in_axes=(None, None, 0))
    tree_close(jax.jit(f(torchjax.to_jax(_cell_torch)))(p, h0, batch), f(_cell_jax)(p, h0, batch))


# -- scan: an Euler integrator -----------------------------------------------------------


def _euler(field, dt: float = 0.1, steps: int = 6):
    def solve(y0, theta):
        def step(y, _):
            return y + dt * field(y, theta), None

        y, _ = jax.lax.scan(step, y0, None, length=steps)
        return y

    return solve


def _pendulum_torch(y, theta):
    return torch.stack([y[1], -theta[0] * torch.sin(y[0]) - theta[1] * y[1]])


def _pendulum_jax(y, theta):
    return jnp.stack([y[1], -theta[0] * jnp.sin(y[0]) - theta[1] * y[1]])


@JIT
def test_scan_euler_integrator(jit):
    y0, theta = jnp.array([1.0, 0.0]), jnp.array([9.81, 0.3])
    solve_t, solve_j = _euler(torchjax.to_jax(_pendulum_torch)), _euler(_pendulum_jax)
    wrap = _jit_or_not(jit)
    tree_close(wrap(solve_t)(y0, theta), solve_j(y0, theta))
    tree_close(
        wrap(jax.jacrev(solve_t, argnums=(0, 1)))(y0, theta),
        jax.jit(jax.jacrev(solve_j, argnums=(0, 1)))(y0, theta),
    )
    tree_close(
        wrap(jax.jacfwd(solve_t, argnums=1))(y0, theta), jax.jacfwd(solve_j, argnums=1)(y0, theta)
    )


# -- cond --------------------------------------------------------------------------------


def _branches(sin, cos):
    def f(x):
        return jax.lax.cond(x.sum() > 0, lambda x: sin(x) * 2, lambda x: cos(x) ** 2, x).sum()

    return f


@JIT
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["true", "false"])
def test_cond(sign, jit):
    x = sign * jnp.array([0.3, 0.5, -0.1])
    f = _branches(torchjax.to_jax(torch.sin), torchjax.to_jax(torch.cos))
    fj = _branches(jnp.sin, jnp.cos)
    wrap = _jit_or_not(jit)
    tree_close(wrap(f)(x), fj(x))
    expected = jax.grad(fj)(x)
    assert not np.allclose(expected, 0)
    tree_close(wrap(jax.grad(f))(x), expected)


def test_vmap_of_cond_takes_both_branches():
    f = _branches(torchjax.to_jax(torch.sin), torchjax.to_jax(torch.cos))
    fj = _branches(jnp.sin, jnp.cos)
    xs = jnp.array([[0.3, 0.5], [-0.3, -0.5]])
    tree_close(jax.jit(jax.vmap(jax.grad(f)))(xs), jax.vmap(jax.grad(fj))(xs))


# -- while_loop (forward) ----------------------------------------------------------------


def _iterate(step):
    def f(x):
        def body(c):
            i, x = c
            return i + 1, step(x)

        return jax.lax.while_loop(lambda c: (c[0] < 4) & (c[1].sum() < 10.0), body, (0, x))

    return f


@JIT
def test_while_loop(jit):
    step_t = torchjax.to_jax(lambda x: x * 1.5 + torch.sin(x))
    step_j = lambda x: x * 1.5 + jnp.sin(x)
    x = jnp.array([0.3, -0.2, 0.5])
    wrap = _jit_or_not(jit)
    tree_close(wrap(_iterate(step_t))(x), _iterate(step_j)(x))
    t = jnp.array([1.0, 0.0, -1.0])
    tree_close(
        wrap(lambda x, t: jax.jvp(_iterate(step_t), (x,), (t,)))(x, t)[1][1],
        jax.jvp(_iterate(step_j), (x,), (t,))[1][1],
    )
    xs = jnp.stack([x, 4 * x, -x])  # different trip counts per example
    tree_close(wrap(jax.vmap(_iterate(step_t)))(xs), jax.vmap(_iterate(step_j))(xs))


# -- checkpoint --------------------------------------------------------------------------


@JIT
def test_checkpoint(jit):
    sin_t = torchjax.to_jax(torch.sin)
    ck = lambda s: jax.checkpoint(lambda x: (s(s(x)) * x).sum())
    x = jnp.array([0.3, -0.8, 1.2])
    wrap = _jit_or_not(jit)
    tree_close(wrap(jax.grad(ck(sin_t)))(x), jax.grad(ck(jnp.sin))(x))
    tree_close(wrap(jax.hessian(ck(sin_t)))(x), jax.jit(jax.hessian(ck(jnp.sin)))(x))


def _counted_sin() -> tuple[Any, list]:
    """to_jax(torch.sin), and the list that gets one entry per real (not fake) call."""
    calls = []

    def fn(x):
        if not is_fake(x):
            calls.append(1)
        return torch.sin(x)

    return torchjax.to_jax(fn), calls


def test_checkpoint_recomputes_in_torch():
    f, calls = _counted_sin()
    x = jnp.array([0.3, -0.8, 1.2])
    plain = jax.grad(lambda x: (f(f(x)) * x).sum())
    remat = jax.grad(jax.checkpoint(lambda x: (f(f(x)) * x).sum()))
    tree_close(remat(x), plain(x))
    calls.clear()
    plain(x)
    assert len(calls) == 2  # two forward calls; the VJPs pull back through their graphs
    calls.clear()
    remat(x)
    assert len(calls) == 4  # and the two forward calls again, in the backward pass
    # the torch calls are inside the rematerialised region
    (eqn,) = [e for e in jax.make_jaxpr(remat)(x).eqns if e.primitive.name.startswith("remat")]
    inner = [e.primitive.name for e in eqn.params["jaxpr"].eqns]
    assert inner.count("torch_call") == 4


def test_checkpoint_policy_that_saves_runs_no_torch_call_twice():
    f, calls = _counted_sin()
    x = jnp.array([0.3, -0.8, 1.2])
    loss = lambda x: (f(f(x)) * x).sum()
    saving = jax.grad(jax.checkpoint(loss, policy=jax.checkpoint_policies.everything_saveable))
    tree_close(saving(x), jax.grad(lambda x: (jnp.sin(jnp.sin(x)) * x).sum())(x))
    calls.clear()
    saving(x)
    assert len(calls) == 4  # two forward calls, two VJP calls: the outputs were saved


@pytest.mark.parametrize(
    "policy", [None, jax.checkpoint_policies.everything_saveable], ids=["recompute", "save"]
)
def test_scan_inside_checkpoint(policy):
    # jax.checkpoint partially evaluates the scan body with its custom rules: the one-call
    # JVP inside must split there too, for the gradient and for forward-over-reverse.
    def loss(sin):
        def run(x):
            def step(c, _):
                return sin(c) * 1.1, c.sum()

            c, ys = jax.lax.scan(step, x, None, length=4)
            return c.sum() + ys.sum()

        return jax.checkpoint(run, policy=policy)

    x = jnp.array([0.3, -0.2, 0.5])
    sin_t = torchjax.to_jax(torch.sin)
    tree_close(jax.jit(jax.grad(loss(sin_t)))(x), jax.grad(loss(jnp.sin))(x))
    tree_close(jax.jit(jax.hessian(loss(sin_t)))(x), jax.hessian(loss(jnp.sin))(x))


def _dropout_calls():
    """A to_jax function and a module_to_jax apply that draw from torch's global generator."""
    f = torchjax.to_jax(lambda x: torch.nn.functional.dropout(x, 0.5))
    apply, variables = torchjax.module_to_jax(torch.nn.Dropout(0.5))
    return {"to_jax": f, "module_to_jax": lambda x: apply(variables, x)}


@pytest.mark.parametrize("which", ["to_jax", "module_to_jax"])
@pytest.mark.parametrize(
    "policy", [None, jax.checkpoint_policies.everything_saveable], ids=["recompute", "save"]
)
@JIT
def test_checkpoint_of_random_draws_differentiates_the_forwards_draws(which, policy, jit):
    # Recomputed, the forward would draw again: the gradient would belong to other draws
    # than the outputs. d sum(dropout(x)) / dx is 2 exactly where the output is not 0.
    drop = _dropout_calls()[which]
    x = jnp.ones(64)

    def loss(x):
        y = jax.checkpoint(drop, policy=policy)(x)
        return y.sum(), y

    (_, y), g = _jit_or_not(jit)(jax.value_and_grad(loss, has_aux=True))(x)
    np.testing.assert_array_equal(np.asarray(g), np.where(np.asarray(y) != 0, 2.0, 0.0))
    assert 0 < int((np.asarray(y) != 0).sum()) < 64  # dropout did drop some
    # An output the backward of a JAX op reads (d/dw of (dropout(x) * w).sum() is dropout(x)),
    # where the torch call itself is not differentiated.
    (_, y), gw = _jit_or_not(jit)(
        jax.value_and_grad(
            lambda w: (lambda y: ((y * w).sum(), y))(jax.checkpoint(drop, policy=policy)(x)),
            has_aux=True,
        )
    )(jnp.ones(64))
    np.testing.assert_array_equal(gw, y)
