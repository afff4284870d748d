"""torch.autocast: a call takes the state where it is made, or, under jax.jit, where it is
traced (_to_jax/_torch_ops/_autocast.py).
References: the same torch code called directly in the same
state (its dtypes and values), and torch autograd for gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import tree_close

import torchjax

pytestmark = pytest.mark.core

torch.manual_seed(0)
W = torch.randn(4, 3)
X_T = torch.linspace(-1.0, 1.0, 15).reshape(5, 3)
X = jnp.asarray(X_T.numpy())


def linear(x):  # a matmul: bfloat16 in CPU autocast
    return torch.nn.functional.linear(x, W)


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _close(got, want):
    assert got.dtype == jnp.dtype(str(want.dtype).removeprefix("torch."))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want.float().numpy())


def test_eager_and_jitted_calls_compute_as_torch_does_in_autocast():
    f = torchjax.to_jax(linear)
    _close(f(X), linear(X_T))  # outside: float32
    jax.jit(f)(X)  # a trace outside first: its types must not leak into autocast
    with bf16():
        want = linear(X_T)
        assert want.dtype == torch.bfloat16
        _close(f(X), want)
        _close(jax.jit(lambda x: f(x) * 1)(X), want)  # a fresh trace, in autocast
    _close(f(X), linear(X_T))


def test_a_jitted_function_runs_in_the_state_it_was_traced_in():
    f = torchjax.to_jax(linear)
    outside, inside = jax.jit(lambda x: f(x) + 0), jax.jit(lambda x: f(x) - 0)
    want_f32 = linear(X_T)
    with bf16():
        want_bf16 = linear(X_T)
        _close(inside(X), want_bf16)  # traced here
        _close(outside(X), want_bf16)  # traced here too (first call)
    _close(inside(X), want_bf16)  # compiled in autocast: still runs in it
    fresh = jax.jit(lambda x: f(x) * 1)
    _close(fresh(X), want_f32)  # traced outside
    with bf16():
        _close(fresh(X), want_f32)  # the compiled function, called in autocast: as traced


def test_gradients_in_autocast_match_torch_autograd():
    def loss(x, w):
        return torch.nn.functional.linear(x, w).float().pow(2).sum()

    f = torchjax.to_jax(loss)
    x_t, w_t = X_T.clone().requires_grad_(), W.clone().requires_grad_()
    with bf16():
        value_t = loss(x_t, w_t)
        gx_t, gw_t = torch.autograd.grad(value_t, (x_t, w_t))
        for g in (jax.value_and_grad(f, argnums=(0, 1)), jax.jit(jax.value_and_grad(f, (0, 1)))):
            value, (gx, gw) = g(X, jnp.asarray(W.numpy()))
            tree_close(value, value_t.detach(), rtol=1e-6)
            tree_close((gx, gw), (gx_t, gw_t), rtol=1e-6)


def test_module_to_jax_in_autocast():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    apply, variables = torchjax.module_to_jax(model)
    with bf16(), torch.no_grad():
        want = model(X_T)
        _close(apply(variables, X), want)
        _close(jax.jit(apply)(variables, X), want)
    with torch.no_grad():
        _close(apply(variables, X), model(X_T))


def test_a_compiled_function_in_autocast():
    """Its fake run runs the original in the same state (torch.compile's frames cannot run
    under a fake mode of ours), its real runs the compiled code in it."""
    compiled = torch.compile(linear, backend="eager")
    f = torchjax.to_jax(compiled)
    with bf16():
        want = linear(X_T)
        _close(f(X), want)
        _close(jax.jit(f)(X), want)
