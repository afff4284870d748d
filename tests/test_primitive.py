"""PytreePrimitive: rules see the caller's pytrees under every transformation."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from torchjax import PytreePrimitive
from torchjax.errors import OutputMismatchError, RuleError, StaticArgumentError

pytestmark = pytest.mark.core  # the version matrix runs this module

fired = collections.Counter()

# weighted_sum({'a': x, 'b': y}, scale=s) = s * a + b, with hand-written rules.
weighted_sum_p = PytreePrimitive("weighted_sum")


@weighted_sum_p.def_abstract_eval
def _ws_abstract(d, *, scale):
    fired["abstract_eval"] += 1
    shape = jnp.broadcast_shapes(d["a"].shape, d["b"].shape)
    return jax.ShapeDtypeStruct(shape, d["a"].dtype)


@weighted_sum_p.def_impl
def _ws_impl(d, *, scale):
    fired["impl"] += 1
    return scale * d["a"] + d["b"]


@weighted_sum_p.def_batching
def _ws_batch(args, axes, *, scale):
    fired["batching"] += 1
    (d,), (ax,) = args, axes
    assert set(ax) == {"a", "b"}  # the rule sees the dict, not a flat list
    a = jnp.moveaxis(d["a"], ax["a"], 0) if ax["a"] is not None else d["a"][None]
    b = jnp.moveaxis(d["b"], ax["b"], 0) if ax["b"] is not None else d["b"][None]
    return weighted_sum_p.bind({"a": a, "b": b}, scale=scale), 0


@weighted_sum_p.def_jvp
def _ws_jvp(primals, tangents, *, scale):
    fired["jvp"] += 1
    (d,), (t,) = primals, tangents
    fired["jvp_none_tangents"] += sum(v is None for v in t.values())
    out = weighted_sum_p.bind(d, scale=scale)
    if t["a"] is None and t["b"] is None:
        return out, None
    ta = jnp.zeros_like(d["a"]) if t["a"] is None else t["a"]
    tb = jnp.zeros_like(d["b"]) if t["b"] is None else t["b"]
    return out, weighted_sum_p.bind({"a": ta, "b": tb}, scale=scale)


@weighted_sum_p.def_transpose
def _ws_transpose(ct, d, *, scale):
    fired["transpose"] += 1
    if ct is None:
        return (None,)

    def reduce_to(x):
        summed = ct.sum(axis=tuple(range(ct.ndim - len(x.shape))))
        return summed.reshape(x.shape)

    is_lin = lambda x: isinstance(x, PytreePrimitive.Linear)
    return (
        {
            "a": reduce_to(d["a"]) * scale if is_lin(d["a"]) else None,
            "b": reduce_to(d["b"]) if is_lin(d["b"]) else None,
        },
    )


def ws(d, scale=2.0):
    return weighted_sum_p.bind(d, scale=scale)


def ws_ref(d, scale=2.0):
    return scale * d["a"] + d["b"]


@pytest.fixture(autouse=True)
def _reset():
    fired.clear()


def test_original_scenario_nested_vmap_with_dict_axes():
    a = jnp.arange(4 * 5 * 3.0).reshape(4, 5, 3)
    b = jnp.arange(3 * 5.0).reshape(3, 5) * 10
    inner = jax.vmap(ws, in_axes=({"a": 0, "b": 1},))
    outer = jax.vmap(inner, in_axes=({"a": 0, "b": None},))
    got = outer({"a": a, "b": b})
    expected = np.stack(
        [np.stack([ws_ref({"a": a[i, j], "b": b[:, j]}) for j in range(5)]) for i in range(4)]
    )
    np.testing.assert_allclose(got, expected)
    assert fired["batching"] == 2
    jitted = jax.jit(outer)({"a": a, "b": b})
    np.testing.assert_allclose(jitted, expected)


@pytest.mark.parametrize("axis", [0, 1, -1, -2])
def test_vmap_int_and_negative_axes(axis):
    a = jnp.arange(12.0).reshape(3, 4)
    got = jax.vmap(lambda x: ws({"a": x, "b": 1.0 * x}), in_axes=axis)(a)
    moved = np.moveaxis(np.asarray(a), axis, 0)
    np.testing.assert_allclose(got, 3 * moved)
    assert fired["batching"] == 1


def test_vmap_out_axes_and_keyword_params():
    a = jnp.arange(6.0).reshape(2, 3)
    got = jax.vmap(lambda x: ws({"a": x, "b": x}, scale=5.0), out_axes=1)(a)
    np.testing.assert_allclose(got, (6 * a).T)


def test_jvp_with_symbolic_zero_tangent():
    a, b = jnp.arange(3.0), jnp.ones(3)
    primal, tangent = jax.jvp(lambda x: ws({"a": x, "b": b}), (a,), (jnp.ones(3),))
    np.testing.assert_allclose(primal, 2 * a + b)
    np.testing.assert_allclose(tangent, 2 * jnp.ones(3))
    assert fired["jvp"] == 1
    assert fired["jvp_none_tangents"] == 1  # b's tangent arrived as None, not zeros


def test_grad_through_transpose_rule_passes_check_grads():
    a, b = jnp.arange(3.0), jnp.linspace(-1, 1, 3)
    f = lambda x, y: jnp.sum(ws({"a": x, "b": y}) ** 2)
    check_grads(f, (a, b), order=2, modes=("fwd", "rev"))
    ga, gb = jax.grad(f, argnums=(0, 1))(a, b)
    np.testing.assert_allclose(ga, 2 * 2 * (2 * a + b), rtol=1e-6)
    np.testing.assert_allclose(gb, 2 * (2 * a + b), rtol=1e-6)
    assert fired["transpose"] > 0


def test_jit_of_grad_vjp_linearize():
    a, b = jnp.arange(3.0), jnp.ones(3)
    f = lambda x: jnp.sum(jnp.sin(ws({"a": x, "b": b})))
    ref = lambda x: jnp.sum(jnp.sin(2 * x + b))
    np.testing.assert_allclose(jax.jit(jax.grad(f))(a), jax.grad(ref)(a), rtol=1e-6)
    out, pullback = jax.vjp(lambda x: ws({"a": x, "b": b}), a)
    np.testing.assert_allclose(pullback(jnp.ones(3))[0], 2 * jnp.ones(3))
    y, f_jvp = jax.linearize(lambda x: ws({"a": x, "b": b}), a)
    np.testing.assert_allclose(f_jvp(jnp.ones(3)), 2 * jnp.ones(3))
    hess = jax.jit(jax.hessian(f))(a)
    np.testing.assert_allclose(hess, jax.hessian(ref)(a), rtol=1e-5, atol=1e-6)


def test_vmap_of_grad_and_grad_of_vmap():
    xs = jnp.arange(6.0).reshape(2, 3)
    b = jnp.ones(3)
    f = lambda x: jnp.sum(ws({"a": x, "b": b}) ** 2)
    ref = lambda x: jnp.sum((2 * x + b) ** 2)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(xs), jax.vmap(jax.grad(ref))(xs))
    g = jax.grad(lambda xs: jnp.sum(jax.vmap(f)(xs)))(xs)
    np.testing.assert_allclose(g, jax.grad(lambda xs: jnp.sum(jax.vmap(ref)(xs)))(xs))


def test_static_leaves_reach_rules_and_jit_cache():
    p = PytreePrimitive("with_static")
    seen = []

    @p.def_abstract_eval
    def _(x, cfg, *, power):
        seen.append(cfg)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @p.def_impl
    def _(x, cfg, *, power):
        return x**power * cfg["k"] if cfg["mode"] == "mul" else x**power + cfg["k"]

    x = jnp.arange(3.0)
    f = jax.jit(lambda x, mode: p.bind(x, {"k": 3.0, "mode": mode}, power=2), static_argnums=1)
    np.testing.assert_allclose(f(x, "mul"), 3 * x**2)
    np.testing.assert_allclose(f(x, "add"), x**2 + 3)
    np.testing.assert_allclose(f(x, "mul"), 3 * x**2)
    assert seen == [{"k": 3.0, "mode": "mul"}, {"k": 3.0, "mode": "add"}]  # cached per signature


def test_linear_marker_exposes_shape_and_dtype():
    p = PytreePrimitive("scale_linear")
    seen = []
    p.def_abstract_eval(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
    p.def_impl(lambda x: 3 * x)
    p.def_jvp(lambda primals, tangents: (p.bind(*primals), p.bind(*tangents)))

    @p.def_transpose
    def _(ct, x):
        seen.append((type(x), x.shape, x.dtype))
        return (3 * ct,)

    g = jax.grad(lambda x: p.bind(x).sum())(jnp.ones((2, 2), jnp.float32))
    np.testing.assert_allclose(g, 3 * np.ones((2, 2)))
    assert seen == [(PytreePrimitive.Linear, (2, 2), np.dtype("float32"))]


def test_missing_rules_name_primitive_and_rule():
    p = PytreePrimitive("bare")
    with pytest.raises(RuleError, match="'bare' has no abstract_eval rule"):
        p.bind(jnp.ones(2))
    p.def_abstract_eval(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
    with pytest.raises(RuleError, match="'bare' has no impl rule"):
        p.bind(jnp.ones(2))
    p.def_impl(lambda x: x * 2)
    np.testing.assert_allclose(jax.jit(p.bind)(jnp.ones(2)), 2 * np.ones(2))  # impl as lowering
    with pytest.raises(RuleError, match="'bare' has no batching rule.*jax.vmap"):
        jax.vmap(p.bind)(jnp.ones((3, 2)))
    with pytest.raises(RuleError, match="'bare' has no jvp rule"):
        jax.jvp(p.bind, (jnp.ones(2),), (jnp.ones(2),))
    p.def_jvp(lambda primals, tangents: (p.bind(*primals), p.bind(*tangents)))
    with pytest.raises(RuleError, match="'bare' has no transpose rule"):
        jax.grad(lambda x: p.bind(x).sum())(jnp.ones(2))


def test_output_mismatch_names_leaf_path_expected_actual():
    p = PytreePrimitive("liar")
    p.def_abstract_eval(lambda d: {"y": jax.ShapeDtypeStruct((2,), jnp.float32)})
    p.def_impl(lambda d: {"y": jnp.zeros((3,), jnp.float32)})
    with pytest.raises(
        OutputMismatchError, match=r"liar.*float32\[3\] at out\['y'\].*declared float32\[2\]"
    ):
        p.bind({"a": jnp.ones(2)})
    p.def_impl(lambda d: {"z": jnp.zeros((2,), jnp.float32)})
    with pytest.raises(OutputMismatchError, match="structure"):
        p.bind({"a": jnp.ones(2)})


def test_unhashable_static_leaf_names_its_path():
    with pytest.raises(StaticArgumentError, match=r"args\[0\]\['cfg'\].*set.*hashable"):
        weighted_sum_p.bind({"a": jnp.ones(2), "b": jnp.ones(2), "cfg": {1, 2}}, scale=1.0)
    with pytest.raises(StaticArgumentError, match="keyword param 'scale'"):
        weighted_sum_p.bind({"a": jnp.ones(2), "b": jnp.ones(2)}, scale=[1.0])


def test_abstract_eval_sees_shaped_leaves_and_jaxpr_is_one_equation():
    jaxpr = jax.make_jaxpr(ws)({"a": jnp.ones(3), "b": jnp.ones(3)})
    assert [e.primitive.name for e in jaxpr.eqns] == ["weighted_sum"]
    assert weighted_sum_p.abstract_eval({"a": jnp.ones(3), "b": jnp.ones(3)}, scale=2.0).shape == (
        3,
    )
