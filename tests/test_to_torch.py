# Tests of to_torch: JAX functions called from PyTorch. References are independent: the
# JAX function called directly (jax.grad / jax.jvp / jax.vmap on it), the same maths
# written in torch, and finite differences (torch.autograd.gradcheck / gradgradcheck).
from __future__ import annotations

import doctest
import math
import warnings

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import Square
from hypothesis import given, settings

import torchjax
from torchjax import to_torch
from torchjax._to_torch import _spec
from torchjax.errors import ConversionError, JaxOutputError, StaticArgumentError

pytestmark = pytest.mark.core  # the version matrix runs this module


def x64():
    """Context manager enabling JAX's x64 mode for one block (no global change)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # older JAX

    return enable_x64()


def np_(t):
    return np.asarray(t.detach().cpu())


def close(a, b, **kw):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, **kw)


def jax_energy(params, x):  # {"w": [D, K], "b": [K]}, [N, D] -> ([N], scalar)
    h = jnp.tanh(x @ params["w"] + params["b"])
    return {"per_row": jnp.sum(h**2, axis=-1), "total": jnp.sum(jnp.sin(h))}


@pytest.fixture
def spy_runs(monkeypatch):
    """Names of the specs run on real data, in order (to assert which rule fired)."""
    names = []
    original = _spec.Spec.run

    def run(self, tensors):
        names.append(self.name)
        return original(self, tensors)

    monkeypatch.setattr(_spec.Spec, "run", run)
    return names


# ---------------------------------------------------------------- forward values


leaf_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
trees = st.recursive(
    leaf_shapes,
    lambda sub: (
        st.lists(sub, min_size=1, max_size=2)
        | st.dictionaries(st.sampled_from("abc"), sub, min_size=1, max_size=2)
    ),
    max_leaves=4,
)


@settings(max_examples=12, deadline=None)
@given(shapes=trees, dtype=st.sampled_from([torch.float32, torch.int32, torch.float16]))
def test_forward_matches_jax_on_pytrees(shapes, dtype):
    tree = jax.tree_util.tree_map(
        lambda s: (torch.arange(int(np.prod(s)), dtype=torch.float32) - 1).reshape(s).to(dtype),
        shapes,
        is_leaf=lambda s: isinstance(s, tuple),
    )

    def f(t, scale):
        return jax.tree_util.tree_map(lambda a: (a * scale + 1, jnp.sum(a)), t)

    got = to_torch(f)(tree, 3)
    want = f(torchjax.tree_to_jax(tree), 3)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert isinstance(g, torch.Tensor) and np_(g).dtype == w.dtype
        np.testing.assert_array_equal(np_(g), np.asarray(w))


def test_kwargs_statics_and_compile_cache():
    traces = []

    def f(x, *, k, mode):
        traces.append((x.shape, k, mode))
        return x * k if mode == "mul" else x + k

    g = to_torch(f)
    x = torch.arange(3.0)
    close(g(x, k=2, mode="mul"), [0, 2, 4])
    close(g(x, k=2, mode="mul"), [0, 2, 4])
    assert len(traces) == 1  # same signature: traced and compiled once
    close(g(x, k=2, mode="add"), [2, 3, 4])
    g(x, k=2.0, mode="add")
    g(x, k=True, mode="add")  # equal to 1 but a different type: a separate signature
    assert [t[1] for t in traces] == [2, 2, 2.0, True]
    assert [type(t[1]) for t in traces] == [int, int, float, bool]
    g(torch.arange(4.0), k=2, mode="mul")
    assert len(traces) == 5


def test_outputs_never_alias_inputs_or_each_other():
    x = torch.arange(4.0)
    y, z = to_torch(lambda a: (a, a))(x)
    close(y, [0, 1, 2, 3])
    y += 1
    z *= 0
    close(x, [0, 1, 2, 3])
    close(y, [1, 2, 3, 4])


def test_empty_output_and_none_leaves():
    assert to_torch(lambda x: ())(torch.ones(2)) == ()
    out = to_torch(lambda d: {"a": d["a"] + 1, "none": None})({"a": torch.ones(2), "b": None})
    assert out["none"] is None
    close(out["a"], [2, 2])


def test_noncontiguous_inputs():
    base = torch.arange(12.0).reshape(3, 4)
    a, b = base.t(), base[:, 0].expand(4, 3)  # transposed; stride-0 broadcast
    assert not a.is_contiguous() and not b.is_contiguous()
    close(to_torch(lambda a, b: a * 2 + b)(a, b), (a * 2 + b).cpu().numpy())


def test_float64_with_x64_off_narrows_and_grads_keep_dtype():
    assert not jax.config.jax_enable_x64
    x = torch.linspace(-1, 1, 5, dtype=torch.float64, requires_grad=True)
    y = to_torch(jnp.sin)(x)
    assert y.dtype == torch.float32  # JAX's dtype with x64 off
    y.sum().backward()
    assert x.grad.dtype == torch.float64
    close(x.grad, torch.cos(x.detach()).cpu().numpy())


# ---------------------------------------------------------------- reverse mode


def test_backward_matches_torch_autograd():
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 2, requires_grad=True), "b": torch.randn(2, requires_grad=True)}
    x = torch.randn(5, 3)
    out = to_torch(jax_energy)(params, x)
    (out["per_row"].sum() + 2 * out["total"]).backward()

    ref = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    h = torch.tanh(x @ ref["w"] + ref["b"])
    ((h**2).sum() + 2 * torch.sin(h).sum()).backward()
    for k in params:
        close(params[k].grad, ref[k].grad.cpu().numpy())


def test_gradcheck_and_gradgradcheck_float64():
    torch.manual_seed(0)

    def f(x, params):
        out = jax_energy(params, x)
        return out["per_row"], out["total"]

    g = to_torch(f)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    fn = lambda x, w, b: g(x, {"w": w, "b": b})
    with x64():
        assert torch.autograd.gradcheck(fn, (x, w, b), check_forward_ad=True)
        assert torch.autograd.gradgradcheck(fn, (x, w, b))


def test_gradcheck_complex():
    z = torch.randn(3, dtype=torch.complex128, requires_grad=True)
    with x64():
        real_out = to_torch(lambda z: jnp.abs(z * jnp.sin(z)) ** 2)
        holo = to_torch(lambda z: z * jnp.exp(z))
        assert torch.autograd.gradcheck(real_out, (z,), check_forward_ad=True)
        assert torch.autograd.gradgradcheck(real_out, (z,))
        assert torch.autograd.gradcheck(holo, (z,), check_forward_ad=True)


def test_int_inputs_and_outputs_are_not_differentiable():
    def f(x, idx):
        return x[idx] * 2.0, jnp.argmax(x), idx.sum()

    x = torch.tensor([3.0, 1.0, 4.0], requires_grad=True)
    idx = torch.tensor([2, 0])
    y, am, s = to_torch(f)(x, idx)
    assert y.requires_grad and not am.requires_grad and not s.requires_grad
    assert am.item() == 2 and s.item() == 2
    y.sum().backward()
    close(x.grad, [2, 0, 2])
    assert idx.grad is None


def test_backward_only_for_inputs_that_need_it(monkeypatch):
    wrts = []
    for derived in ("vjp", "keeping"):  # (keeping: the pullback plain autograd keeps)
        original = getattr(_spec.Spec, derived)
        spy = lambda s, wrt, original=original: wrts.append(wrt) or original(s, wrt)
        monkeypatch.setattr(_spec.Spec, derived, spy)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    to_torch(lambda a, b: a * b)(a, b).sum().backward()
    assert wrts == [(0,)]
    close(a.grad, b.cpu().numpy())


def test_plain_backward_runs_the_forward_once_and_can_run_twice():
    """Under plain autograd the forward keeps JAX's pullback and the backward runs it: the
    JAX function executes once per forward + backward (a double backward recomputes)."""
    runs = []

    def f(x, w):
        jax.debug.callback(lambda: runs.append(1))
        return jnp.sin(x) @ w

    g = to_torch(f)
    x = torch.linspace(-1, 1, 6).reshape(2, 3).requires_grad_()
    w = torch.linspace(0, 1, 12).reshape(3, 4).requires_grad_()
    out = g(x, w)
    ct = torch.linspace(1, 2, 8).reshape(2, 4)
    first = torch.autograd.grad(out, (x, w), ct, retain_graph=True)
    second = torch.autograd.grad(out, (x, w), ct)  # the kept pullback, again
    assert len(runs) == 1
    xj, wj = jnp.asarray(x.detach().numpy()), jnp.asarray(w.detach().numpy())
    want = jax.vjp(lambda x, w: jnp.sin(x) @ w, xj, wj)[1](jnp.asarray(ct.numpy()))
    for got in (first, second):
        for a, b in zip(got, want, strict=True):
            close(a, b)


def test_torch_func_grad_vjp_jacrev_hessian_match_jax():
    def f(x):
        return jnp.sum(jnp.sin(x) * x**2)

    g = to_torch(f)
    x = torch.linspace(-1, 1, 4)
    xj = jnp.asarray(x.cpu().numpy())
    close(torch.func.grad(g)(x), jax.grad(f)(xj))
    close(torch.func.hessian(g)(x), jax.hessian(f)(xj))
    close(torch.func.jacrev(torch.func.jacrev(g))(x), jax.hessian(f)(xj))
    out, pull = torch.func.vjp(to_torch(jnp.sin), x)
    close(pull(torch.ones(4))[0], jnp.cos(xj))


# ---------------------------------------------------------------- forward mode


def test_torch_func_jvp_and_jacfwd_match_jax():
    def f(x, y):
        return jnp.sin(x) * y, jnp.sum(x * y)

    g = to_torch(f)
    x, y = torch.linspace(-1, 1, 3), torch.linspace(2, 3, 3)
    tx, ty = torch.ones(3), torch.arange(3.0)
    primal, tangent = torch.func.jvp(g, (x, y), (tx, ty))
    args = tuple(jnp.asarray(t.cpu().numpy()) for t in (x, y, tx, ty))
    jp, jt = jax.jvp(f, args[:2], args[2:])
    for a, b in zip((*primal, *tangent), (*jp, *jt), strict=True):
        close(a, b)
    close(
        torch.func.jacfwd(lambda x: g(x, y)[0])(x), jax.jacfwd(lambda x: f(x, args[1])[0])(args[0])
    )
    close(
        torch.func.jacfwd(torch.func.jacrev(lambda x: g(x, y)[1]))(x),
        jax.hessian(lambda x: f(x, args[1])[1])(args[0]),
    )


def test_forward_ad_with_int_outputs():
    import torch.autograd.forward_ad as fwAD

    x = torch.tensor([1.0, 5.0, 2.0])
    with fwAD.dual_level():
        outs = to_torch(lambda x: (x**2, jnp.argmax(x)))(fwAD.make_dual(x, torch.ones(3)))
        tangents = [fwAD.unpack_dual(o).tangent for o in outs]
    close(tangents[0], 2 * x.cpu().numpy())
    assert tangents[1] is None


# ---------------------------------------------------------------- vmap


def test_vmap_is_one_batched_jax_call(spy_runs):
    def f(x, w):
        return jnp.tanh(x @ w), jnp.argmax(x)

    g = to_torch(f)
    xs, w = torch.randn(6, 3), torch.randn(3, 2)
    ys, idx = torch.func.vmap(g, in_dims=(0, None))(xs, w)
    assert spy_runs == ["vmap(to_torch(test_vmap_is_one_batched_jax_call.<locals>.f))"]
    wy, widx = jax.vmap(f, in_axes=(0, None))(
        jnp.asarray(xs.cpu().numpy()), jnp.asarray(w.cpu().numpy())
    )
    close(ys, wy)
    np.testing.assert_array_equal(np_(idx), np.asarray(widx))


def test_vmap_in_dims_nesting_and_grad_compositions():
    def f(x, y):
        return jnp.sum(jnp.sin(x) * y)

    g = to_torch(f)
    xs, ys = torch.randn(3, 4, 5), torch.randn(5, 4)
    xj, yj = jnp.asarray(xs.cpu().numpy()), jnp.asarray(ys.cpu().numpy())
    inner = torch.func.vmap(g, in_dims=(0, 1))  # over 4
    close(
        torch.func.vmap(inner, in_dims=(0, None))(xs, ys),
        jax.vmap(jax.vmap(f, (0, 1)), (0, None))(xj, yj),
    )
    vg = torch.func.vmap(torch.func.grad(g), in_dims=(0, None))(xs[0], ys.t())
    close(vg, jax.vmap(jax.grad(f), (0, None))(xj[0], yj.T))
    gv = torch.func.grad(lambda x: torch.func.vmap(g, in_dims=(0, None))(x, ys.t()).sum())(xs[0])
    close(gv, jax.grad(lambda x: jax.vmap(f, (0, None))(x, yj.T).sum())(xj[0]))
    jac = torch.func.vmap(torch.func.jacfwd(g))(
        xs[0], ys.t().expand(4, 4, 5).reshape(4, 4, 5)[:, 0]
    )
    close(jac, jax.vmap(jax.jacfwd(f))(xj[0], jnp.broadcast_to(yj.T, (4, 4, 5))[:, 0]))


def test_vmap_with_unbatched_inputs_only():
    g = to_torch(lambda x: x * 2)
    out = torch.func.vmap(lambda b, x: g(x) + b, in_dims=(0, None))(
        torch.arange(3.0), torch.ones(2)
    )
    close(out, [[2, 2], [3, 3], [4, 4]])


# ---------------------------------------------------------------- errors


# ------------------------------------------- torch's legacy vmap (vectorized backward)
# autograd.grad(is_grads_batched=True), autograd.functional.jacobian/hessian(vectorize=True)
# and gradcheck's batched checks run the backward under torch._vmap_internals' vmap, whose
# tensors have no storage. Reference: the same maths written in torch, through the same API.


def _energy_pair():
    return (
        lambda x, y: jnp.sin(x) * x * jnp.sum(y**2),
        lambda x, y: torch.sin(x) * x * (y**2).sum(),
    )


def test_vectorized_jacobian_and_hessian_match_torch():
    jf, tf = _energy_pair()
    g = to_torch(jf)
    x = torch.linspace(-1, 1, 3, dtype=torch.float64)
    y = torch.tensor([0.5, -2.0], dtype=torch.float64)
    jac = torch.autograd.functional.jacobian
    hess = torch.autograd.functional.hessian
    with x64():
        for got, want in zip(jac(g, (x, y), vectorize=True), jac(tf, (x, y)), strict=True):
            torch.testing.assert_close(got, want)
        for strategy in ("reverse-mode", "forward-mode"):
            got = hess(lambda x: g(x, y).sum(), x, vectorize=True, outer_jacobian_strategy=strategy)
            torch.testing.assert_close(got, hess(lambda x: tf(x, y).sum(), x))


def test_vectorized_derivatives_with_create_graph_stay_on_the_graph():
    """jacobian/hessian(vectorize=True, create_graph=True), is_grads_batched with
    create_graph: the results are differentiable, as torch's are."""
    jf, tf = _energy_pair()
    g = to_torch(jf)
    y = torch.tensor([0.5, -2.0], dtype=torch.float64)
    hess = torch.autograd.functional.hessian
    jac = torch.autograd.functional.jacobian
    with x64():
        for fn in (g, tf):
            x = torch.linspace(-1, 1, 3, dtype=torch.float64, requires_grad=True)
            h = hess(lambda x, fn=fn: fn(x, y).sum(), x, vectorize=True, create_graph=True)
            j = jac(lambda x, fn=fn: fn(x, y), x, vectorize=True, create_graph=True)
            (gx,) = torch.autograd.grad((h**2).sum() + (j**3).sum() + x.sum(), x)
            out = fn(x, y)
            (batched,) = torch.autograd.grad(
                out, x, torch.eye(3, dtype=torch.float64), is_grads_batched=True, create_graph=True
            )
            (gb,) = torch.autograd.grad((batched**2).sum(), x)
            if fn is g:
                got = (gx, gb)
            else:
                want = (gx, gb)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)


def test_batched_grads_and_batched_gradcheck():
    jf, tf = _energy_pair()
    g = to_torch(jf)
    x = torch.linspace(-1, 1, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0.5, -2.0], dtype=torch.float64, requires_grad=True)
    cotangents = torch.randn(4, 3, dtype=torch.float64)
    with x64():
        got = torch.autograd.grad(g(x, y), (x, y), cotangents, is_grads_batched=True)
        want = torch.autograd.grad(tf(x, y), (x, y), cotangents, is_grads_batched=True)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
        assert torch.autograd.gradcheck(g, (x, y), check_batched_grad=True)
        assert torch.autograd.gradgradcheck(g, (x, y), check_batched_grad=True)


def test_no_grad_calls_in_a_vectorized_backward_take_the_batched_way():
    """A user's Function whose backward calls to_torch functions on the cotangent: from the
    second call on the shortcut (_hot_call.py) sees the legacy-batched tensors."""
    twice = to_torch(lambda g: 2 * g)
    pair = to_torch(lambda g, h: (2 * g, h))

    class SquareThroughJax(Square):
        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            with torch.no_grad():
                doubled, same = pair(g, g)
                return twice(g) * x + 0 * doubled * same

    x = torch.linspace(-1, 1, 3)
    for _ in range(3):  # the first call builds the shortcut, the later ones take it
        got = torch.autograd.functional.jacobian(SquareThroughJax.apply, x, vectorize=True)
        torch.testing.assert_close(got, torch.diag(2 * x))


def test_nested_legacy_vmap_is_refused_with_the_way_out():
    from torch._vmap_internals import _vmap

    g = to_torch(lambda x: x * 2)
    with pytest.raises(torchjax.errors.ArgumentError, match="(?s)nested levels.*torch.func"):
        _vmap(_vmap(g))(torch.ones(2, 3))


def test_error_static_array_leaf():
    with pytest.raises(StaticArgumentError, match=r"(?s)args\[0\]\['a'\] is a jax.*tree_to_torch"):
        to_torch(lambda d: d["a"])({"a": jnp.ones(2)})
    with pytest.raises(StaticArgumentError, match=r"(?s)kwargs\['y'\]\[1\] is a numpy.*from_numpy"):
        to_torch(lambda x, y: x)(torch.ones(1), y=[1, np.ones(2)])


def test_error_unhashable_static():
    with pytest.raises(StaticArgumentError, match=r"args\[1\] is a set, which is not hashable"):
        to_torch(lambda x, s: x)(torch.ones(1), {1, 2})


def test_error_unsupported_dtype_and_overflow():
    # complex32 has no JAX equivalent (float8 ones do: see test_convert)
    with pytest.raises(ConversionError, match=r"args\[0\]\[1\]: torch dtype torch.complex32"):
        to_torch(lambda xs: xs)([torch.ones(1), torch.ones(1).to(torch.complex32)])
    with pytest.raises(ConversionError, match=r"args\[0\]: torch.int64 values .* do not fit"):
        to_torch(lambda x: x)(torch.tensor([2**40]))


def test_error_bad_output():
    with pytest.raises(JaxOutputError, match=r"output\['name'\] is a str"):
        to_torch(lambda x: {"y": x, "name": "hi"})(torch.ones(1))


def test_error_not_callable():
    with pytest.raises(TypeError, match=r"expected a JAX function \(a callable\), got a jax.Array"):
        to_torch(jnp.ones(2))


def test_error_inside_jax_function_names_the_call():
    with pytest.raises(TypeError) as info:
        to_torch(lambda x, y: x @ y)(torch.ones(2, 3), torch.ones(2, 3))
    assert any("to_torch" in n and "args[1]: float32[2, 3]" in n for n in info.value.__notes__)


# ---------------------------------------------------------------- torch.compile


def test_torch_compile_no_graph_break():
    import torch._dynamo

    g = to_torch(lambda d, n: (jnp.sin(d["x"]) * n + d["l"][0], jnp.argmax(d["x"])))

    def model(x):
        y, i = g({"x": x * 2, "l": [x]}, 3)
        return y.sum() + i

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for n in (3, 4):  # the second size is a recompile with symbolic sizes made concrete
        x = torch.randn(n, requires_grad=True)
        out = compiled(x)
        out.backward()
        x_ref = x.detach().clone().requires_grad_()
        model(x_ref).backward()
        close(out.detach(), model(x).detach())
        close(x.grad, x_ref.grad.cpu().numpy())


def test_torch_compile_dict_output_falls_back_correctly():
    g = to_torch(lambda x: {"y": x + 1})
    x = torch.ones(2)
    close(torch.compile(lambda x: g(x)["y"] * 2, backend="eager")(x), [4, 4])


def test_torch_compile_of_a_lambda_defined_without_source():
    # As in a REPL or `python -c`: FX named the wrapper of a lambda from its source, and
    # without one the compile failed ("Unable to represent lambda").
    x = torch.linspace(0, 1, 5)
    for module in ({"__name__": "__main__"}, {}):  # a REPL's; exec'd code's, none
        namespace = {"to_torch": to_torch, "jnp": jnp, **module}
        exec(compile("g = to_torch(lambda x: jnp.sin(x) * 2)", "<stdin>", "exec"), namespace)
        g = namespace["g"]
        compiled = torch.compile(lambda x, g=g: g(x) + 1, backend="eager")
        close(compiled(x), torch.sin(x) * 2 + 1)


def test_make_fx_real_mode_and_func_linearize_record_the_call():
    # make_fx's real mode (and torch.func.linearize, built on it) traces plain tensors: a
    # call that ran JAX on them was recorded as a constant, the trace-time output.
    from torch.fx.experimental.proxy_tensor import make_fx

    g = to_torch(lambda x: jnp.sin(x) * 3)
    x1, x2 = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([-1.0, 0.0, 4.0])
    g(x1), g(x1)  # the shortcut is set up: it must not run inside the trace either
    traced = make_fx(g)(x1)
    close(traced(x2), torch.sin(x2) * 3)
    t = torch.tensor([1.0, -1.0, 3.0])
    primal, tangent_fn = torch.func.linearize(g, x1)
    close(primal, torch.sin(x1) * 3)
    close(tangent_fn(t), torch.cos(x1) * 3 * t)


# ---------------------------------------------------------------- round trip, docs, gpu


@pytest.mark.skipif(not hasattr(torchjax, "to_jax"), reason="torchjax.to_jax not written yet")
def test_round_trip_to_jax_of_to_torch():
    def f(x):
        return jnp.sin(x) * jnp.sum(x**2)

    h = torchjax.to_jax(to_torch(f))
    x = jnp.linspace(-1.0, 1.0, 4)
    close(h(x), f(x))
    close(jax.grad(lambda x: h(x).sum())(x), jax.grad(lambda x: f(x).sum())(x))
    close(jax.jit(h)(x), f(x))


def test_docstring_example_runs():
    text = to_torch.__doc__
    test = doctest.DocTestParser().get_doctest(text, {}, "to_torch", None, 0)
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.failures == 0 and runner.tries > 3


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not any(d.platform == "gpu" for d in jax.devices()),
    reason="needs CUDA in both torch and JAX",
)
def test_cuda_round_trip_and_grad():
    x = torch.randn(8, device="cuda", requires_grad=True)
    y = to_torch(jnp.sin)(x)
    assert y.device == x.device
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))


# -- to_torch and to_jax inside each other -----------------------------------------------------


def _inner_math(t):
    return torch.sin(torch.tanh(t).pow(3).sum())


@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap", "plain"])
def test_a_first_call_under_a_torch_func_transform_of_a_jax_function_calling_to_jax(transform):
    # The first call traces the JAX function, whose to_jax call finds its output types by a
    # fake run: under torch.func.grad or jvp its tensors came out wrapped (TensorWrapper).
    inner = torchjax.to_jax(lambda t: torch.tanh(t).pow(3).sum())
    wrapped = to_torch(lambda x: jnp.sin(inner(x)))
    apply = {
        "grad": torch.func.grad,
        "jvp": lambda f: lambda x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1],
        "vmap": torch.func.vmap,
        "plain": lambda f: f,
    }[transform]
    x = torch.linspace(-1.0, 1.0, 12, dtype=torch.float32).reshape(4, 3)
    x = x if transform == "vmap" else x[0]
    saved = x.clone()
    for k in range(3):
        torch.testing.assert_close(apply(wrapped)(x * (k + 1)), apply(_inner_math)(x * (k + 1)))
    torch.testing.assert_close(x, saved)


def test_to_torch_inside_to_jax_runs_without_copies_of_the_call():
    # torch's DLPack export asks for a writable pointer, which the enclosing to_jax call's
    # guard refuses: the to_torch conversion copies that input itself, and the function
    # is not run again on copies (no CopyWarning, whose advice would not fit).
    double_sin = to_torch(lambda x: jnp.sin(x) * 2)
    f = torchjax.to_jax(lambda t: (double_sin(t) ** 2).sum())
    x = jnp.linspace(0.0, 3.0, 4)
    expected = float(jnp.sum((jnp.sin(x) * 2) ** 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            assert float(f(x)) == pytest.approx(expected, rel=1e-6)
            assert float(jax.jit(f)(x)) == pytest.approx(expected, rel=1e-6)
            np.testing.assert_allclose(jax.grad(f)(x), 4 * jnp.sin(2 * x), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(x, np.linspace(0.0, 3.0, 4, dtype=np.float32))


# -- torch.jit.trace ---------------------------------------------------------------------
# The tracer cannot see into a JAX call: it would record the outputs as constants, and the
# traced function would return them for every input. The call is refused instead.


@pytest.mark.parametrize("warm", [False, True], ids=["first_call", "after_a_call"])
def test_torch_jit_trace_of_a_to_torch_call_is_refused(warm):
    f = to_torch(lambda x, w: jnp.tanh(x @ w))
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    if warm:  # the repeated-call shortcut is set up: it must refuse too
        torch.testing.assert_close(f(x, w), torch.tanh(x @ w))
        torch.testing.assert_close(f(x, w), torch.tanh(x @ w))
    with pytest.raises(torchjax.errors.ArgumentError, match=r"torch\.jit\.trace.*torch\.export"):
        torch.jit.trace(lambda x, w: f(x, w) * 1, (x, w))
    g = to_torch(jnp.sin)  # one tensor in and out: the one-input shortcut
    if warm:
        torch.testing.assert_close(g(x), torch.sin(x))
        torch.testing.assert_close(g(x), torch.sin(x))
    with pytest.raises(torchjax.errors.ArgumentError, match=r"torch\.jit\.trace"):
        torch.jit.trace(lambda x: g(x) + 1, (x,))
    torch.testing.assert_close(f(x, w), torch.tanh(x @ w))  # untraced calls still run
    torch.testing.assert_close(g(x), torch.sin(x))


# -- inference tensors as inputs ----------------------------------------------------------
# A tensor made in torch.inference_mode (a constant) takes no gradient, and torch refuses to
# save it for a backward; torch itself differentiates sin(x) + b with such a b.


@pytest.mark.parametrize("how", ["backward", "create_graph", "torch.func.grad", "forward_ad"])
def test_an_inference_tensor_beside_a_differentiated_input(how):
    f = to_torch(lambda x, b: jnp.sin(x) * b)
    with torch.inference_mode():
        b = torch.arange(1.0, 5.0)
    x = torch.linspace(0.0, 1.0, 4, requires_grad=True)
    if how == "backward":
        f(x, b).sum().backward()
        torch.testing.assert_close(x.grad, torch.cos(x.detach()) * b)
    elif how == "create_graph":
        (g,) = torch.autograd.grad(f(x, b).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        torch.testing.assert_close(gg, -torch.sin(x.detach()) * b)
    elif how == "torch.func.grad":
        g = torch.func.grad(lambda x: f(x, b).sum())(x.detach())
        torch.testing.assert_close(g, torch.cos(x.detach()) * b)
    else:
        import torch.autograd.forward_ad as fwAD

        with fwAD.dual_level():
            out = f(fwAD.make_dual(x.detach(), torch.ones(4)), b)
            torch.testing.assert_close(fwAD.unpack_dual(out).tangent, torch.cos(x.detach()) * b)


def test_a_non_array_aux_leaf_is_named_as_an_output_would_be():
    f = to_torch(lambda x: (x.sum(), {"tag": "a string"}), has_aux=True)
    with pytest.raises(JaxOutputError, match=r"output\[1\]\['tag'\] is a str"):
        f(torch.ones(3))


def test_a_nested_tensor_argument_is_named_with_the_fix():
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(ConversionError, match=r"args\[1\] is a nested tensor.*unbind"):
        to_torch(lambda x, y: x)(torch.ones(2), nested)


# -- a backward after the forward's jax.enable_x64 block -----------------------------------
# The backward runs (converts, traces its VJP) in the x64 mode of the forward.


@pytest.mark.parametrize("forward_x64", [True, False], ids=["forward_x64_on", "forward_x64_off"])
@pytest.mark.parametrize("create_graph", [False, True], ids=["backward", "create_graph"])
def test_a_backward_outside_the_forwards_x64_mode(forward_x64, create_graph):
    f = to_torch(lambda x: jnp.sum(x**3))
    x = torch.tensor([1.5, 2.0], dtype=torch.float64, requires_grad=True)
    with jax.enable_x64(forward_x64):
        y = f(x)
    with jax.enable_x64(not forward_x64):
        (g,) = torch.autograd.grad(y, x, create_graph=create_graph)
        if create_graph:
            (gg,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(g.detach(), 3 * x.detach() ** 2, rtol=1e-6, atol=1e-6)
    if create_graph:
        torch.testing.assert_close(gg, 6 * x.detach(), rtol=1e-6, atol=1e-6)


def test_zero_and_negative_zero_are_different_statics():
    f = to_torch(lambda x, s: x / s)
    x = torch.ones(2)
    assert torch.equal(f(x, 0.0), torch.full((2,), float("inf")))
    assert torch.equal(f(x, -0.0), torch.full((2,), float("-inf")))


def test_complex_statics_differ_by_the_sign_of_a_zero_part():
    # 0j == complex(-0.0, 0.0) (and their hashes agree), but 1 / their real parts differ.
    by_real = to_torch(lambda x, c: x / jnp.real(c))
    by_imag = to_torch(lambda x, c: x / jnp.imag(c))
    x = torch.ones(1)
    for c in [0j, complex(-0.0, 0.0), complex(0.0, -0.0), complex(-0.0, -0.0), 0j]:
        assert np_(by_real(x, c))[0] == math.copysign(math.inf, c.real), c
        assert np_(by_imag(x, c))[0] == math.copysign(math.inf, c.imag), c


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_python_number_statics_that_dynamo_makes_symbolic(backend):
    # Dynamo passes a float (and an int after its value changed) as SymFloat/SymInt.
    g = to_torch(lambda x, n, flag: x**n if flag else x * n)
    compiled = torch.compile(lambda x, n, flag: g(x, n, flag) + 1, backend=backend)
    x = torch.tensor([2.0, 3.0], requires_grad=True)
    for n, flag in [(2, True), (3, True), (0.5, False), (1.5, True), (2.5, True)]:
        y = compiled(x, n, flag)
        (dy,) = torch.autograd.grad(y.sum(), x)
        expected = (x**n if flag else x * n) + 1
        (dexpected,) = torch.autograd.grad(expected.sum(), x)
        torch.testing.assert_close(y, expected)
        torch.testing.assert_close(dy, dexpected)


def test_vmap_leaves_outputs_that_depend_on_no_batched_input_unbatched():
    def jf(x, w):
        return x * w, jnp.sum(w**2), 3.0 * jnp.ones(2)

    def tf(x, w):  # the same math in torch: the oracle
        return x * w, (w**2).sum(), 3.0 * torch.ones(2)

    g = to_torch(jf)
    x, w = torch.randn(4, 3), torch.randn(3)
    vmap = torch.func.vmap
    for out_dims in [(0, None, None), 0, (1, None, 0)]:
        got = vmap(g, (0, None), out_dims)(x, w)
        expected = vmap(tf, (0, None), out_dims)(x, w)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b)

    def loss(f):
        def of_w(w):
            y, s, c = vmap(f, (0, None), (0, None, None))(x, w)
            return y.sum() + 2 * s + c.sum()

        return of_w

    torch.testing.assert_close(torch.func.grad(loss(g))(w), torch.func.grad(loss(tf))(w))
    ones = (torch.ones(3),)
    torch.testing.assert_close(
        torch.func.jvp(loss(g), (w,), ones), torch.func.jvp(loss(tf), (w,), ones)
    )
    w1, w2 = w.clone().requires_grad_(), w.clone().requires_grad_()
    loss(g)(w1).backward()
    loss(tf)(w2).backward()
    torch.testing.assert_close(w1.grad, w2.grad)
    ws = torch.randn(5, 3)  # nested, the other way round
    for a, b in zip(
        vmap(vmap(g, (0, None)), (None, 0))(x, ws),
        vmap(vmap(tf, (0, None)), (None, 0))(x, ws),
        strict=True,
    ):
        torch.testing.assert_close(a, b)
