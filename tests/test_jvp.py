# Tests of forward-mode differentiation (jax.jvp, jax.linearize) of functions made by
# to_jax (issue #6).
#
# References are the same functions written in jax.numpy. Symbolic zeros are checked in
# the jaxpr: the JvpFunction equation must receive tangents only for the leaves that have
# them, and no JvpFunction equation must appear where no tangent can be nonzero. jax.jvp
# is one torch call; where JAX needs the primal and tangent halves apart (linearize,
# checkpoint, jacfwd's vmap over tangents) the jaxpr must show them split.
from __future__ import annotations

import concurrent.futures
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import tree_close
from torch._subclasses.fake_tensor import is_fake

import torchjax

pytestmark = pytest.mark.core  # the version matrix runs this module

F0 = jax.dtypes.float0


def _torch_calls(jaxpr: Any) -> list:
    """The fn param of every torch_call equation, sub-jaxprs included."""
    fns = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "torch_call":
            fns.append((dict(eqn.params["params"])["fn"], eqn))
        for sub in _jaxprs_in_params(eqn.params):
            fns.extend(_torch_calls(sub))
    return fns


def _jaxprs_in_params(params: dict) -> list:
    # jax.extend.core.jaxprs_in_params, which JAX 0.8.0 (the oldest supported) lacks.
    found = []
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, jax.extend.core.Jaxpr):
                found.append(v)
    return found


def _of_type(fns: list, name: str) -> list:
    return [(fn, eqn) for fn, eqn in fns if type(fn).__name__ == name]


X = jnp.array([0.3, -1.2, 2.0])
Y = jnp.array([1.5, 0.2, -0.4])


def test_jvp_matches_jax_numpy():
    f = torchjax.to_jax(lambda x, y: torch.sin(x) * torch.exp(y) + x @ y)
    fj = lambda x, y: jnp.sin(x) * jnp.exp(y) + x @ y
    tx, ty = jnp.array([1.0, 0.5, -1.0]), jnp.array([0.0, 2.0, 1.0])
    tree_close(jax.jvp(f, (X, Y), (tx, ty)), jax.jvp(fj, (X, Y), (tx, ty)))
    tree_close(
        jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(X, Y, tx, ty), jax.jvp(fj, (X, Y), (tx, ty))
    )


def test_jvp_with_respect_to_one_of_two_args_sends_one_tangent():
    f = torchjax.to_jax(lambda x, y: torch.sin(x) * y)
    g = lambda x, y: jax.jvp(lambda x: f(x, y), (x,), (jnp.ones(3),))
    tree_close(g(X, Y), (jnp.sin(X) * Y, jnp.cos(X) * Y))
    jvps = _of_type(_torch_calls(jax.make_jaxpr(g)(X, Y).jaxpr), "JvpFunction")
    assert len(jvps) == 1
    fn, eqn = jvps[0]
    assert fn.wrt == (0,)
    # operands: the two primals and one tangent, no materialised zeros for y
    assert len(eqn.invars) == 3


def test_jvp_of_second_arg_only():
    f = torchjax.to_jax(lambda x, y: torch.sin(x) * y)
    g = lambda x, y: jax.jvp(lambda y: f(x, y), (y,), (jnp.ones(3),))
    tree_close(g(X, Y)[1], jnp.sin(X))
    ((fn, eqn),) = _of_type(_torch_calls(jax.make_jaxpr(g)(X, Y).jaxpr), "JvpFunction")
    assert fn.wrt == (1,) and len(eqn.invars) == 3


def test_no_tangent_no_jvp_call():
    calls = []

    def fn(x, n):
        if not is_fake(x):
            calls.append(1)
        return x * n

    f = torchjax.to_jax(fn)
    n = jnp.array([1, 2, 3])
    # the only tangent is on an int input: the output tangent is a symbolic zero
    g = lambda n: jax.jvp(lambda n: f(n, n), (n,), (np.zeros(3, F0),))
    out, t = g(n)
    tree_close(out, n * n)
    assert t.dtype == F0
    assert not _of_type(_torch_calls(jax.make_jaxpr(g)(n).jaxpr), "JvpFunction")
    assert len(calls) == 1


def test_int_inputs_get_no_tangent():
    f = torchjax.to_jax(lambda x, n: x * n.to(x.dtype) + n.sum())
    n = jnp.array([1, 2, 3])
    out, t = jax.jvp(f, (X, n), (jnp.ones(3), np.zeros(3, F0)))
    tree_close(out, X * n + 6)
    tree_close(t, n.astype(jnp.float32))
    jaxpr = jax.make_jaxpr(lambda x, n: jax.jvp(f, (x, n), (jnp.ones(3), np.zeros(3, F0))))(X, n)
    ((fn, eqn),) = _of_type(_torch_calls(jaxpr.jaxpr), "JvpFunction")
    assert fn.wrt == (0,) and len(eqn.invars) == 3


def test_integer_and_bool_outputs_have_zero_tangents():
    f = torchjax.to_jax(lambda x: (x * 2, x.argmax(), x > 0, {"n": x.shape[0], "s": x.sum()}))
    out, t = jax.jvp(f, (X,), (jnp.ones(3),))
    tree_close(out[0], X * 2)
    tree_close(t[0], np.full(3, 2.0))
    assert t[1].dtype == F0 and t[2].dtype == F0 and t[3]["n"].dtype == F0
    tree_close(t[3]["s"], 3.0)
    ((fn, eqn),) = _of_type(
        _torch_calls(jax.make_jaxpr(lambda x: jax.jvp(f, (x,), (x,)))(X).jaxpr), "JvpFunction"
    )
    assert fn.out_mask == (True, False, False, False, True)
    assert len(eqn.outvars) == 5 + 2  # every output, then the two float outputs' tangents


def test_pytree_inputs_and_outputs():
    f = torchjax.to_jax(lambda d: {"u": d["a"] * d["b"], "v": (torch.tanh(d["a"]).sum(),)})
    fj = lambda d: {"u": d["a"] * d["b"], "v": (jnp.tanh(d["a"]).sum(),)}
    d = {"a": X, "b": Y}
    t = {"a": jnp.ones(3), "b": jnp.array([1.0, 0.0, 2.0])}
    tree_close(jax.jvp(f, (d,), (t,)), jax.jvp(fj, (d,), (t,)))


def _counting(fn):
    calls = []

    def counted(*args):
        if not any(is_fake(a) for a in args):
            calls.append(1)
        return fn(*args)

    return counted, calls


@pytest.mark.parametrize("jit", [False, True])
def test_jvp_is_one_torch_call(jit):
    counted, calls = _counting(lambda x, y: torch.sin(x) * y)
    f = torchjax.to_jax(counted)
    g = lambda x, y, t: jax.jvp(f, (x, y), (t, t))
    g = jax.jit(g) if jit else g
    out, t = g(X, Y, jnp.ones(3))
    tree_close(out, jnp.sin(X) * Y)
    tree_close(t, jnp.cos(X) * Y + jnp.sin(X))
    calls.clear()
    jax.block_until_ready(g(X, Y, jnp.ones(3)))
    assert len(calls) == 1
    ((fn, eqn),) = _torch_calls(jax.make_jaxpr(g)(X, Y, jnp.ones(3)).jaxpr)
    assert type(fn).__name__ == "JvpFunction" and fn.with_primals
    assert len(eqn.outvars) == 2  # the output and its tangent


def test_linearize_splits_the_call_into_primal_and_linear_halves():
    f = torchjax.to_jax(lambda x: torch.sin(x))
    jaxpr = jax.make_jaxpr(lambda x, t: jax.linearize(f, x)[1](t))(X, X)
    kinds = sorted(
        (type(fn).__name__, getattr(fn, "with_primals", None))
        for fn, _ in _torch_calls(jaxpr.jaxpr)
    )
    # The primal half is a KeptForward: it keeps the graph and RNG state for a later
    # transpose.
    assert kinds == [("JvpFunction", False), ("KeptForward", None)]


def test_jacfwd_computes_the_primal_once_unbatched():
    counted, calls = _counting(lambda x: torch.sin(x) * x.sum())
    f = torchjax.to_jax(counted)
    fj = lambda x: jnp.sin(x) * x.sum()
    tree_close(jax.jacfwd(f)(X), jax.jacfwd(fj)(X))
    calls.clear()
    jax.jacfwd(f)(X)
    assert len(calls) == 2  # the primal, and the tangents batched in one torch.vmap call
    fns = [fn for fn, _ in _torch_calls(jax.make_jaxpr(jax.jacfwd(f))(X).jaxpr)]
    assert sorted(type(fn).__name__ for fn in fns) == ["BatchedFunction", "UserFunction"]
    (batched,) = [fn for fn in fns if type(fn).__name__ == "BatchedFunction"]
    assert type(batched.inner).__name__ == "JvpFunction" and not batched.inner.with_primals


def test_linearize():
    f = torchjax.to_jax(lambda x, y: (torch.sin(x) * y, (x**2).sum()))
    fj = lambda x, y: (jnp.sin(x) * y, (x**2).sum())
    out, lin = jax.linearize(f, X, Y)
    out_j, lin_j = jax.linearize(fj, X, Y)
    tree_close(out, out_j)
    for tx, ty in [(jnp.ones(3), jnp.zeros(3)), (X, Y), (jnp.zeros(3), jnp.ones(3))]:
        tree_close(lin(tx, ty), lin_j(tx, ty))
    tree_close(jax.jit(lin)(X, Y), lin_j(X, Y))
    # the linear function is linear: twice the tangent, twice the output tangent
    tree_close(lin(2 * X, 2 * Y), jax.tree.map(lambda a: 2 * a, lin(X, Y)))


def test_linearize_evaluates_primal_once():
    counted, calls = _counting(torch.sin)
    f = torchjax.to_jax(counted)
    out, lin = jax.linearize(f, X)
    n = len(calls)
    for t in (jnp.ones(3), X):
        tree_close(lin(t), jnp.cos(X) * t)
    # each application of the linear map is one real (JVP) call: the primal is not redone
    assert len(calls) == n + 2


def test_vjp_directly():
    f = torchjax.to_jax(lambda x, y: (torch.sin(x) * y, (x**2).sum()))
    fj = lambda x, y: (jnp.sin(x) * y, (x**2).sum())
    out, pb = jax.vjp(f, X, Y)
    out_j, pb_j = jax.vjp(fj, X, Y)
    tree_close(out, out_j)
    ct = (jnp.array([1.0, -1.0, 2.0]), jnp.float32(3.0))
    tree_close(pb(ct), pb_j(ct))
    tree_close(jax.jit(pb)(ct), pb_j(ct))
    # a zero cotangent for one output: only the other contributes
    ct0 = (jnp.zeros(3), jnp.float32(1.0))
    tree_close(pb(ct0), (2 * X, jnp.zeros(3)))


@pytest.mark.parametrize("grad_method", ["torch.func", "autograd"])
def test_python_number_outputs_have_zero_tangents(grad_method):
    # Regression: torch.func.jvp/vjp take tensor outputs only, and a Python number output
    # (which to_jax turns into a 0-d array) made every derivative fail.
    f = torchjax.to_jax(lambda x: (torch.sin(x).sum(), 2.0), grad_method=grad_method)
    out, t = jax.jvp(f, (X,), (jnp.ones(3),))
    tree_close(out, (jnp.sin(X).sum(), 2.0))
    tree_close(t, (jnp.cos(X).sum(), 0.0))
    tree_close(jax.grad(lambda x: f(x)[0] + f(x)[1])(X), jnp.cos(X))
    g = torchjax.to_jax(
        lambda x: 3.0,
        result_shape_dtypes=jax.ShapeDtypeStruct((), jnp.float32),
        grad_method=grad_method,
    )
    tree_close(jax.grad(g)(X), jnp.zeros(3))


def test_jvp_with_declared_result_shapes_runs_nothing_on_fake_tensors():
    fake_runs = []

    def fn(x):
        fake_runs.append(is_fake(x))
        return {"y": torch.sin(x), "n": x.argmax()}

    declared = {
        "y": jax.ShapeDtypeStruct((3,), jnp.float32),
        "n": jax.ShapeDtypeStruct((), jnp.int32),
    }
    f = torchjax.to_jax(fn, result_shape_dtypes=declared)
    out, t = jax.jvp(f, (X,), (jnp.ones(3),))
    tree_close(out, {"y": jnp.sin(X), "n": jnp.argmax(X)})
    tree_close(t["y"], jnp.cos(X))
    assert t["n"].dtype == F0
    tree_close(jax.jacfwd(lambda x: f(x)["y"])(X), jnp.diag(jnp.cos(X)))
    tree_close(jax.jit(jax.grad(lambda x: f(x)["y"].sum()))(X), jnp.cos(X))
    assert fake_runs and not any(fake_runs)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jvps_from_many_threads_at_once(jit):
    # torch's forward-mode levels are process-wide: unserialized, concurrent torch.func.jvp
    # calls close each other's level, and tangents come out zero (silently) or fail.
    w = torch.linspace(0.1, 1.0, 64 * 64).reshape(64, 64) / 64
    w_j = jnp.asarray(w.numpy())
    f = torchjax.to_jax(lambda x: torch.tanh(x @ w).sum())
    jvp = lambda x, v: jax.jvp(f, (x,), (v,))[1]
    jvp = jax.jit(jvp) if jit else jvp
    xs = [jnp.full((8, 64), 0.01 * i) for i in range(32)]
    v = jnp.ones((8, 64))

    def many(x):
        return [jvp(x, v) for _ in range(20)]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(many, xs))
    for x, got in zip(xs, results, strict=True):
        want = jax.jvp(lambda x: jnp.tanh(x @ w_j).sum(), (x,), (v,))[1]
        for t in got:
            tree_close(t, want, rtol=1e-4)
