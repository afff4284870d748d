"""The corners of JAX's API a careful user reaches (issue #25): Python and numpy scalars as
primals, tangents and cotangents; pickling across processes; jit inside
torch.inference_mode; outputs left unbatched by jax.vmap; JAX inside torch inside JAX; an
op whose schema may write but whose call does not; float8. Each against the same
computation in jax.numpy (or torch), eagerly and under jit.
"""

from __future__ import annotations

import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import tree_close
from torch._subclasses.fake_tensor import FakeTensor

import torchjax
from torchjax.errors import InPlaceMutationError, VmapError

pytestmark = pytest.mark.core

JIT = [False, True]


def _maybe_jit(fn, jit):
    return jax.jit(fn) if jit else fn


# -- 1. Python and numpy scalars ----------------------------------------------------------

triple = torchjax.to_jax(lambda s: s * 3)
sine = torchjax.to_jax(torch.sin)
SCALARS = [2.0, np.float32(2.0), np.float64(2.0), jnp.float32(2.0)]
FUNCTIONS = [(triple, lambda s: s * 3), (sine, jnp.sin)]


@pytest.mark.parametrize("jit", JIT)
@pytest.mark.parametrize("s", SCALARS, ids=type)
@pytest.mark.parametrize("f, ref", FUNCTIONS, ids=["times3", "sin"])
def test_scalar_primals_differentiate_like_jax_numpy(f, ref, s, jit):
    for transform in (
        jax.grad,
        jax.value_and_grad,
        jax.jacfwd,
        jax.jacrev,
        jax.hessian,
        lambda g: lambda x: jax.jvp(g, (x,), (1.0,)),
        lambda g: lambda x: jax.vjp(g, x)[1](1.0),
        lambda g: lambda x: jax.linearize(g, x)[1](np.float32(1.0)),
    ):
        got = _maybe_jit(transform(f), jit)(s)
        want = transform(ref)(s)
        tree_close(got, want)


@pytest.mark.parametrize("jit", JIT)
def test_scalar_tangents_and_cotangents(jit):
    x = jnp.array([0.5, 1.0])
    _, vjp_fn = jax.vjp(sine, 0.7)
    for ct in (1.0, np.float32(1.0), np.float64(2.0)):
        tree_close(vjp_fn(ct), (jnp.cos(0.7) * ct,))
    tangent = _maybe_jit(lambda x: jax.jvp(sine, (x,), (2.0,)), jit)(0.7)
    tree_close(tangent, (jnp.sin(0.7), jnp.cos(0.7) * 2.0))
    transpose = jax.linear_transpose(triple, 1.0)
    tree_close(transpose(1.0), (3.0,))
    tree_close(transpose(np.float32(2.0)), (6.0,))
    # A scalar beside an array: only the array's gradient changes shape.
    scaled = torchjax.to_jax(lambda s, v: torch.sin(v) * s)
    g = _maybe_jit(jax.grad(lambda s, v: scaled(s, v).sum(), argnums=(0, 1)), jit)(2.0, x)
    tree_close(g, jax.grad(lambda s, v: (jnp.sin(v) * s).sum(), argnums=(0, 1))(2.0, x))


def test_scalar_not_differentiated_stays_a_python_number():
    # A Python number that no transform touches still reaches torch as a number.
    seen = []

    def f(x, k):
        seen.append(type(k))
        return x * k

    g = torchjax.to_jax(f)
    tree_close(jax.grad(lambda x: g(x, 3).sum())(jnp.ones(2)), jnp.full(2, 3.0))
    assert int in seen


# -- 2. pickling ---------------------------------------------------------------------------


def _run_shipped(payload: bytes) -> dict:
    """In a fresh process: unpickle a wrapped function and use it under every transform."""
    f = cloudpickle.loads(payload)
    x = jnp.linspace(0.1, 1.0, 4)
    return {
        "eager": np.asarray(f(x)),
        "jit": np.asarray(jax.jit(f)(x)),
        "grad": np.asarray(jax.grad(lambda v: f(v).sum())(x)),
        "vmap": np.asarray(jax.vmap(f)(jnp.stack([x, 2 * x]))),
        "jvp": np.asarray(jax.jvp(f, (x,), (jnp.ones(4),))[1]),
    }


def _apply_in_worker(args: tuple) -> np.ndarray:
    apply, variables, x = args
    return np.asarray(
        jax.jit(jax.grad(lambda v: apply(v, x).sum()))(variables)["params"]["0.weight"]
    )


def _spawn_pool() -> ProcessPoolExecutor:
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))


@pytest.mark.slow
def test_cloudpickled_function_runs_every_transform_in_another_process():
    f = torchjax.to_jax(lambda t: torch.sin(t) * 2)
    x = jnp.linspace(0.1, 1.0, 4)
    with _spawn_pool() as pool:
        got = pool.submit(_run_shipped, cloudpickle.dumps(f)).result(timeout=240)
    ref = lambda v: jnp.sin(v) * 2
    tree_close(got["eager"], ref(x))
    tree_close(got["jit"], ref(x))
    tree_close(got["grad"], 2 * jnp.cos(x))
    tree_close(got["vmap"], ref(jnp.stack([x, 2 * x])))
    tree_close(got["jvp"], 2 * jnp.cos(x))


def test_cloudpickle_round_trip_in_process_keeps_the_rules():
    f = cloudpickle.loads(cloudpickle.dumps(torchjax.to_jax(lambda t: torch.sin(t) * 2)))
    x = jnp.linspace(0.1, 1.0, 4)
    tree_close(jax.jit(jax.grad(lambda v: f(v).sum()))(x), 2 * jnp.cos(x))
    tree_close(jax.vmap(f)(jnp.stack([x, x])), jnp.sin(jnp.stack([x, x])) * 2)


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Tanh())


def test_module_apply_pickles_with_plain_pickle():
    m = _module()
    apply, variables = torchjax.module_to_jax(m)
    again = pickle.loads(pickle.dumps(apply))
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    tree_close(again(variables, x), m(torch.linspace(-1.0, 1.0, 6).reshape(2, 3)))
    grads = jax.jit(jax.grad(lambda v: again(v, x).sum()))(variables)
    tree_close(grads, jax.grad(lambda v: apply(v, x).sum())(variables))
    assert "Sequential" in repr(again)


@pytest.mark.slow
def test_module_apply_goes_to_a_multiprocessing_pool():
    apply, variables = torchjax.module_to_jax(_module())
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    with _spawn_pool() as pool:
        got = pool.submit(_apply_in_worker, (apply, variables, x)).result(timeout=240)
    want = jax.grad(lambda v: apply(v, x).sum())(variables)["params"]["0.weight"]
    tree_close(got, want)


# -- 3. jit inside torch.inference_mode ----------------------------------------------------


@pytest.mark.parametrize("jit", JIT)
def test_call_inside_inference_mode(jit):
    f = torchjax.to_jax(lambda t: torch.tanh(t) + 1)
    x = jnp.linspace(-1.0, 1.0, 5)
    with torch.inference_mode():
        out = _maybe_jit(f, jit)(x)
        grad = _maybe_jit(jax.grad(lambda v: f(v).sum()), jit)(x)
    tree_close(out, jnp.tanh(x) + 1)
    tree_close(grad, 1 - jnp.tanh(x) ** 2)


# -- 4. outputs jax.vmap leaves unbatched --------------------------------------------------


def _pair(x, y):
    return x * 2 + y.sum(), torch.sin(y)


def _pair_jnp(x, y):
    return x * 2 + y.sum(), jnp.sin(y)


@pytest.mark.parametrize("jit", JIT)
def test_vmap_keeps_outputs_of_unbatched_inputs_unbatched(jit):
    f = torchjax.to_jax(_pair)
    x, y = jnp.arange(6.0).reshape(3, 2), jnp.arange(2.0)
    spec = dict(in_axes=(0, None), out_axes=(0, None))
    got = _maybe_jit(jax.vmap(f, **spec), jit)(x, y)
    want = jax.vmap(_pair_jnp, **spec)(x, y)
    assert got[1].shape == (2,)
    tree_close(got, want)
    # out_axes=0 still broadcasts it, as jax.numpy does
    tree_close(
        _maybe_jit(jax.vmap(f, in_axes=(0, None)), jit)(x, y),
        jax.vmap(_pair_jnp, in_axes=(0, None))(x, y),
    )
    # differentiated through
    loss = lambda y: jax.vmap(f, **spec)(x, y)[1].sum()
    tree_close(_maybe_jit(jax.grad(loss), jit)(y), jnp.cos(y))


@pytest.mark.parametrize("jit", JIT)
def test_nested_vmap_with_unbatched_outputs(jit):
    f = torchjax.to_jax(_pair)
    inner = dict(in_axes=(0, None), out_axes=(0, None))
    outer = dict(in_axes=(0, 0), out_axes=(0, 0))
    x, y = jnp.linspace(0.0, 1.0, 24).reshape(4, 3, 2), jnp.linspace(0.0, 1.0, 8).reshape(4, 2)
    got = _maybe_jit(jax.vmap(jax.vmap(f, **inner), **outer), jit)(x, y)
    want = jax.vmap(jax.vmap(_pair_jnp, **inner), **outer)(x, y)
    assert got[1].shape == (4, 2)
    tree_close(got, want)
    # unbatched inside, batched outside: the outer level still sees it batched
    outer_none = dict(in_axes=(None, 0), out_axes=(0, 0))
    got = _maybe_jit(jax.vmap(jax.vmap(f, **inner), **outer_none), jit)(x[0], y)
    tree_close(got, jax.vmap(jax.vmap(_pair_jnp, **inner), **outer_none)(x[0], y))


def test_module_output_of_params_alone_stays_unbatched():
    class WithNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x), self.lin.weight.norm()

    m = WithNorm()
    apply, variables = torchjax.module_to_jax(m)
    x = jnp.ones((5, 3))
    out, norm = jax.jit(jax.vmap(apply, in_axes=(None, 0), out_axes=(0, None)))(variables, x)
    tree_close(norm, m.lin.weight.norm())
    tree_close(out, m(torch.ones(5, 3))[0])


def test_vmap_output_that_changes_batchedness_is_an_error_not_a_wrong_number():
    def flips(x, y):
        # On fake tensors (where torchjax finds which outputs are batched) it uses y alone;
        # on real data x too: a function whose dependence changes with the data.
        if isinstance(y, FakeTensor):
            return y * 2
        return y * 2 + x.sum()

    f = torchjax.to_jax(flips)
    batched = jax.vmap(f, in_axes=(0, None), out_axes=None)
    message = (
        r"(?s)flips, batched by torch.func.vmap, batched its output 0.*vmap_method='sequential'"
    )
    with pytest.raises(VmapError, match=message):
        batched(jnp.ones((3, 2)), jnp.ones(2))
    # under jit it fails inside XLA's host callback, which reports it as its own error
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        jax.jit(batched)(jnp.ones((3, 2)), jnp.ones(2))


# -- 5. JAX inside torch inside JAX --------------------------------------------------------

inner_sin = torchjax.to_jax(torch.sin)


def _uses_jax(t):
    return torchjax.tree_to_torch(jnp.cos(torchjax.tree_to_jax(t))) + t


def test_torch_function_that_calls_jax_on_its_input():
    x = jnp.linspace(0.0, 1.0, 3)
    tree_close(torchjax.to_jax(_uses_jax)(x), jnp.cos(x) + x)  # eager: runs for real at once


def test_torch_function_that_calls_jax_on_its_input_under_jit():
    # Under jit only real data can go through JAX inside torch: declare the output types.
    x = jnp.linspace(0.0, 1.0, 3)
    f = torchjax.to_jax(_uses_jax, result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32))
    tree_close(jax.jit(f)(x), jnp.cos(x) + x)


@pytest.mark.parametrize("jit", JIT)
def test_wrapped_function_on_a_constant_inside_another(jit):
    c = jnp.array([0.5, 1.0])
    f = torchjax.to_jax(lambda t: t + torchjax.tree_to_torch(inner_sin(c)))
    x = jnp.array([1.0, 2.0])
    tree_close(_maybe_jit(f, jit)(x), x + jnp.sin(c))
    tree_close(_maybe_jit(jax.grad(lambda v: f(v).sum()), jit)(x), jnp.ones(2))


# -- 6. an op whose schema may write, called so that it does not ---------------------------


def _legit(training):
    def f(x, w, b, mean, var):
        return torch.ops.aten._native_batch_norm_legit(x, w, b, mean, var, training, 0.1, 1e-5)[0]

    return f


@pytest.mark.parametrize("jit", JIT)
def test_eval_mode_batch_norm_kernel_is_not_refused(jit):
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    w, b = jnp.array([1.0, 2.0, 0.5]), jnp.array([0.0, 0.1, -0.1])
    mean, var = jnp.array([0.1, -0.2, 0.0]), jnp.array([1.0, 0.5, 2.0])
    f = torchjax.to_jax(_legit(False))
    ref = lambda x, w: (x - mean) / jnp.sqrt(var + 1e-5) * w + b
    tree_close(_maybe_jit(f, jit)(x, w, b, mean, var), ref(x, w))
    g = _maybe_jit(jax.grad(lambda x, w: f(x, w, b, mean, var).sum(), argnums=(0, 1)), jit)(x, w)
    tree_close(g, jax.grad(lambda x, w: ref(x, w).sum(), argnums=(0, 1))(x, w))
    tree_close(
        jax.vmap(f, in_axes=(0, None, None, None, None))(x[:, None], w, b, mean, var),
        jax.vmap(ref, in_axes=(0, None))(x[:, None], w),
    )


@pytest.mark.parametrize("jit", JIT)
def test_training_mode_batch_norm_kernel_is_refused_and_nothing_changes(jit):
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    w, b, mean, var = jnp.ones(3), jnp.zeros(3), jnp.zeros(3), jnp.ones(3)
    before = np.asarray(mean).copy()
    f = torchjax.to_jax(_legit(True))
    with pytest.raises(InPlaceMutationError, match=r"args\[3\]"):
        _maybe_jit(f, jit)(x, w, b, mean, var)
    np.testing.assert_array_equal(np.asarray(mean), before)


# -- 7. float8 -----------------------------------------------------------------------------

FLOAT8 = [
    ("float8_e4m3fn", jnp.float8_e4m3fn),
    ("float8_e5m2", jnp.float8_e5m2),
    ("float8_e4m3fnuz", jnp.float8_e4m3fnuz),
    ("float8_e5m2fnuz", jnp.float8_e5m2fnuz),
]


@pytest.mark.parametrize("jit", JIT)
@pytest.mark.parametrize("torch_name, jax_dtype", FLOAT8, ids=[n for n, _ in FLOAT8])
def test_float8_in_and_out(torch_name, jax_dtype, jit):
    x = jnp.array([0.5, 1.0, -2.0, 3.0], dtype=jax_dtype)
    torch_dtype = getattr(torch, torch_name)
    up = torchjax.to_jax(lambda t: (t.to(torch.float32) * 2, t.to(torch.float32).to(torch_dtype)))
    wide, same = _maybe_jit(up, jit)(x)
    tree_close(wide, x.astype(jnp.float32) * 2)
    assert same.dtype == jax_dtype
    np.testing.assert_array_equal(
        np.asarray(same).astype(np.float32), np.asarray(x).astype(np.float32)
    )
