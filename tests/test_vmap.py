# Tests of jax.vmap over functions made by to_jax (issue #5).
#
# References are independent of torchjax: a Python loop over the batch calling the torch
# function directly on torch tensors, or the same function written in jax.numpy. Where the
# default vmap_method="torch" must batch through torch.func.vmap, the tests assert that it
# did: one real torch call whatever the nesting, inside which the inputs are functorch
# BatchedTensors, and one torch_call equation in the jaxpr.
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import tree_close
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import is_fake

import torchjax
from torchjax._to_jax._callables import _batched as _callables
from torchjax._to_jax._torch_ops import _vmap as _vmap
from torchjax.errors import ShapeInferenceError, VmapError

pytestmark = pytest.mark.core  # the version matrix runs this module

SEQUENTIAL = re.escape("vmap_method='sequential'")


def _real(x: Any) -> bool:
    """True on a real call, False on a fake-tensor (shape inference) run.

    Unwraps functorch wrappers: inside torch.func.vmap a fake tensor is a BatchedTensor
    around a FakeTensor, which `isinstance(x, FakeTensor)` alone would miss.
    """
    return not is_fake(x)


def _batched(x: torch.Tensor) -> bool:
    return torch._C._functorch.is_batchedtensor(x)


def _t(x: Any) -> torch.Tensor:
    return torch.as_tensor(np.array(x))


def _eqns(jaxpr: Any, name: str = "torch_call") -> list:
    return [e for e in jaxpr.eqns if e.primitive.name == name]


def _fn_param(eqn: Any) -> Any:
    return dict(eqn.params["params"])["fn"]


def _arange(*shape: int, scale: float = 0.1) -> jax.Array:
    return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * scale - 0.5


class Recorder:
    """A torch function that logs each real call: the input shapes and whether batched."""

    def __init__(self, body):
        self.body = body
        self.calls: list[tuple] = []

    def __call__(self, *args, **kwargs):
        tensors = [x for x in jax.tree.leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if tensors and _real(tensors[0]):
            self.calls.append(
                tuple((tuple(t.shape), _batched(t)) for t in tensors),
            )
        return self.body(*args, **kwargs)


# -- the original scenario ---------------------------------------------------------------


def test_nested_vmap_of_dict_function_is_one_torch_vmap_call():
    rec = Recorder(lambda d: torch.sin(d["a"]) * d["b"] + d["a"].sum())
    f = torchjax.to_jax(rec)
    a = _arange(3, 4, 5)  # [outer 3, inner 4, 5]
    b = _arange(5, 4)  # [5, inner 4], unbatched in the outer vmap
    g = jax.vmap(jax.vmap(f, in_axes=({"a": 0, "b": 1},)), in_axes=({"a": 0, "b": None},))

    out = g({"a": a, "b": b})

    at, bt = _t(a), _t(b)
    expected = torch.stack(
        [
            torch.stack([torch.sin(at[i, j]) * bt[:, j] + at[i, j].sum() for j in range(4)])
            for i in range(3)
        ]
    )
    tree_close(out, expected.cpu().numpy())
    # One real call, on per-example views of BatchedTensors: torch.func.vmap did the work.
    assert len(rec.calls) == 1
    assert rec.calls[0] == (((5,), True), ((5,), True))
    jaxpr = jax.make_jaxpr(g)({"a": a, "b": b}).jaxpr
    (eqn,) = _eqns(jaxpr)
    fn = _fn_param(eqn)
    assert type(fn).__name__ == "BatchedFunction"
    assert type(fn.inner).__name__ == "BatchedFunction"
    assert (fn.in_dims, fn.inner.in_dims) == ((0, None), (0, 1))


@pytest.mark.parametrize("fast", [True, False])
def test_nested_vmap_counts_torch_func_vmap_calls(monkeypatch, fast):
    seen = []
    real_vmap_call = _vmap.vmap_call

    def spy(fn, tensors, in_dims, randomness):
        seen.append(in_dims)
        return real_vmap_call(fn, tensors, in_dims, randomness)

    monkeypatch.setattr(_callables, "vmap_call", spy)
    monkeypatch.setattr(_vmap, "FAST_VMAP", fast)  # False: torch.func.vmap itself
    f = torchjax.to_jax(lambda d: d["a"] * d["b"])
    a, b = _arange(2, 3, 4), _arange(4, 3)
    g = jax.jit(jax.vmap(jax.vmap(f, in_axes=({"a": 0, "b": 1},)), in_axes=({"a": 0, "b": None},)))
    jax.block_until_ready(g({"a": a, "b": b}))
    seen.clear()
    jax.block_until_ready(g({"a": a, "b": b}))  # shapes cached: only the real call remains
    # The outer vmap maps only 'a': the unbatched 'b' is captured, not passed with None.
    assert seen == [(0,), (0, 1)]


# -- in_axes, out_axes, arguments --------------------------------------------------------


@pytest.mark.parametrize(
    ("in_axes", "xs", "ys"),
    [
        ((0, 0), (4, 3), (4, 3)),
        ((1, 0), (3, 4), (4, 3)),
        ((0, None), (4, 3), (3,)),
        ((None, 1), (3,), (3, 4)),
        ((-1, -2), (3, 4), (4, 3)),
        ((-1, None), (3, 4), (3,)),
    ],
)
def test_in_axes(in_axes, xs, ys):
    rec = Recorder(lambda x, y: x * torch.cos(y) + 1.0)
    f = torchjax.to_jax(rec)
    x, y = _arange(*xs), _arange(*ys, scale=0.2)
    out = jax.vmap(f, in_axes=in_axes)(x, y)
    ref = jax.vmap(lambda x, y: x * jnp.cos(y) + 1.0, in_axes=in_axes)(x, y)
    tree_close(out, ref)
    assert len(rec.calls) == 1
    batched = [ax is not None for ax in in_axes]
    assert [b for _, b in rec.calls[0]] == batched


def test_in_axes_differ_per_dict_entry_and_per_leaf():
    f = torchjax.to_jax(lambda d, s: {"u": d["a"] @ d["b"] + s, "v": d["c"].sum()})
    a = _arange(2, 3, 4)  # batch at 2
    b = _arange(4, 3, 2)  # batch at 0
    c = _arange(5)  # unbatched
    s = _arange(2, 4)  # batch at 1 (negative: -1)
    in_axes = ({"a": 2, "b": 0, "c": None}, -1)
    out = jax.vmap(f, in_axes=in_axes)({"a": a, "b": b, "c": c}, s)
    ref = jax.vmap(lambda d, s: {"u": d["a"] @ d["b"] + s, "v": d["c"].sum()}, in_axes=in_axes)(
        {"a": a, "b": b, "c": c}, s
    )
    tree_close(out, ref)
    assert out["u"].shape == (4, 2, 2) and out["v"].shape == (4,)


@pytest.mark.parametrize("out_axes", [0, 1, -1, 2])
def test_out_axes(out_axes):
    f = torchjax.to_jax(lambda x: torch.outer(x, x))
    x = _arange(4, 3)
    out = jax.vmap(f, out_axes=out_axes)(x)
    tree_close(out, jax.vmap(lambda x: jnp.outer(x, x), out_axes=out_axes)(x))


def test_out_axes_per_output_leaf():
    f = torchjax.to_jax(lambda x: {"m": x[:, None] * x, "s": (x.sum(), x.max())})
    x = _arange(4, 3)
    out_axes = {"m": 2, "s": (0, 0)}
    out = jax.vmap(f, out_axes=out_axes)(x)
    ref = jax.vmap(lambda x: {"m": x[:, None] * x, "s": (x.sum(), x.max())}, out_axes=out_axes)(x)
    tree_close(out, ref)
    assert out["m"].shape == (3, 3, 4)


def test_keyword_arguments_batched_and_static():
    rec = Recorder(lambda x, *, y, power, mode: (x + y) ** power if mode == "pow" else x - y)
    f = torchjax.to_jax(rec)
    x, y = _arange(4, 3), _arange(4, 3, scale=0.3)
    # jax.vmap maps keyword arguments at axis 0; static ones go through a closure.
    out = jax.vmap(lambda x, y: f(x, y=y, power=3, mode="pow"))(x, y)
    tree_close(out, (x + y) ** 3)
    out_kw = jax.vmap(lambda x, **kw: f(x, power=2, mode="pow", **kw))(x, y=y)
    tree_close(out_kw, (x + y) ** 2)
    out_minus = jax.vmap(lambda x, y: f(x, y=y, power=3, mode="minus"), in_axes=(0, None))(x, y[0])
    tree_close(out_minus, x - y[0])
    both = (((3,), True), ((3,), True))
    assert rec.calls == [both, both, (((3,), True), ((3,), False))]


def test_static_leaves_pass_through_unchanged():
    seen = []

    def fn(x, cfg):
        seen.append(cfg)
        scale, name, nothing = cfg
        assert name == "w" and nothing is None
        return x * scale

    f = torchjax.to_jax(fn)
    x = _arange(3, 2)
    out = jax.vmap(lambda x: f(x, (2.5, "w", None)))(x)
    tree_close(out, x * 2.5)
    assert seen and all(c == (2.5, "w", None) for c in seen)


def test_unbatched_arguments_are_not_batched_in_torch():
    rec = Recorder(lambda x, w, b: x @ w + b)
    f = torchjax.to_jax(rec)
    x, w, b = _arange(5, 3), _arange(3, 2), _arange(2)
    out = jax.vmap(f, in_axes=(0, None, None))(x, w, b)
    tree_close(out, x @ w + b)
    assert rec.calls == [(((3,), True), ((3, 2), False), ((2,), False))]


def test_axis_size_with_nothing_batched():
    rec = Recorder(lambda x: torch.exp(x))
    f = torchjax.to_jax(rec)
    x = _arange(3)
    out = jax.vmap(f, in_axes=None, axis_size=4)(x)
    assert out.shape == (4, 3)
    tree_close(out, np.broadcast_to(np.exp(np.asarray(x)), (4, 3)))
    assert len(rec.calls) == 1 and rec.calls[0] == (((3,), False),)


def test_python_number_outputs_are_batched():
    f = torchjax.to_jax(lambda x: (x.sum(), 2.0))
    s, two = jax.vmap(f)(_arange(4, 3))
    assert two.shape == (4,)
    tree_close(two, np.full(4, 2.0))
    tree_close(s, np.asarray(_arange(4, 3)).sum(1))


@settings(max_examples=8, deadline=None)
@given(
    axes=st.lists(st.one_of(st.none(), st.integers(-2, 1)), min_size=3, max_size=3).filter(
        lambda a: any(x is not None for x in a)
    ),
    n=st.integers(1, 3),
)
def test_in_axes_hypothesis(axes, n):
    def torch_fn(d):
        return {"p": d["a"] * d["b"], "q": torch.tanh(d["c"]).sum(0)}

    def jax_fn(d):
        return {"p": d["a"] * d["b"], "q": jnp.tanh(d["c"]).sum(0)}

    base = (2, 3)
    d = {}
    for key, ax in zip("abc", axes, strict=True):
        shape = list(base)
        if ax is not None:
            shape.insert(ax % 3, n)
        d[key] = _arange(*shape, scale=0.05)
    in_axes = ({k: a for k, a in zip("abc", axes, strict=True)},)
    f = torchjax.to_jax(torch_fn)
    tree_close(jax.vmap(f, in_axes=in_axes)(d), jax.vmap(jax_fn, in_axes=in_axes)(d))


# -- vmap_method -------------------------------------------------------------------------


def _data_dependent(x):
    # Python control flow on values: neither fake tensors nor torch.func.vmap can run this.
    return x * 2 if x.sum() > 0 else -x


def test_sequential_runs_data_dependent_code_one_call_per_example():
    rec = Recorder(_data_dependent)
    f = torchjax.to_jax(rec, result_shape_dtypes=lambda x: x, vmap_method="sequential")
    x = jnp.array([[1.0, 2.0], [-3.0, 1.0], [0.5, -0.1]])
    out = jax.vmap(f)(x)
    tree_close(out, np.stack([_data_dependent(_t(r)).cpu().numpy() for r in x]))
    assert rec.calls == [(((2,), False),)] * 3
    rec.calls.clear()
    tree_close(jax.jit(jax.vmap(f))(x), out)
    assert len(rec.calls) == 3


def test_sequential_item_and_unbatched_args():
    rec = Recorder(lambda x, w: x * w.sum().item())
    f = torchjax.to_jax(rec, result_shape_dtypes=lambda x, w: x, vmap_method="sequential")
    x, w = _arange(4, 3), _arange(4, 2)
    out = jax.vmap(f, in_axes=(0, 0))(x, w)
    tree_close(out, x * w.sum(1, keepdims=True))
    assert len(rec.calls) == 4
    rec.calls.clear()
    out = jax.vmap(f, in_axes=(0, None))(x, w[0])
    tree_close(out, x * w[0].sum())
    assert rec.calls == [(((3,), False), ((2,), False))] * 4


def test_sequential_nested_makes_one_call_per_pair():
    rec = Recorder(lambda x, y: x * y.sum().item())
    f = torchjax.to_jax(rec, result_shape_dtypes=lambda x, y: x, vmap_method="sequential")
    x, y = _arange(2, 3), _arange(4, 5)
    out = jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, None))(x, y)
    tree_close(out, x[:, None, :] * y.sum(1)[None, :, None])
    assert len(rec.calls) == 8


def test_expand_dims_gives_unbatched_args_a_size_one_axis():
    rec = Recorder(lambda x, w: torch.einsum("...i,...ij->...j", x, w))
    f = torchjax.to_jax(rec, vmap_method="expand_dims")
    x, w = _arange(4, 3), _arange(3, 2)
    out = jax.vmap(f, in_axes=(0, None))(x, w)
    tree_close(out, x @ w)
    assert rec.calls == [(((4, 3), False), ((1, 3, 2), False))]
    rec.calls.clear()
    # nested: each level adds its own leading axis
    ws = jnp.stack([w, 2 * w])
    out = jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(None, 0))(x, ws)
    tree_close(out, jnp.einsum("bi,wij->wbj", x, ws))
    assert len(rec.calls) == 1


def test_broadcast_all_broadcasts_unbatched_args():
    # The unbatched call (shape inference) must work too, as with jax.pure_callback.
    rec = Recorder(lambda x, w: torch.einsum("...i,...ij->...j", x, w))
    f = torchjax.to_jax(rec, vmap_method="broadcast_all")
    x, w = _arange(4, 3), _arange(3, 2)
    out = jax.vmap(f, in_axes=(0, None))(x, w)
    tree_close(out, x @ w)
    assert rec.calls == [(((4, 3), False), ((4, 3, 2), False))]
    rec.calls.clear()
    out = jax.vmap(f, in_axes=(1, None), out_axes=1)(x.T, w)
    tree_close(out, (x @ w).T)


def test_torch_method_vmap_cannot_batch_names_sequential():
    def fill(x):
        out = torch.zeros(3)
        out.add_(x)  # in place into an unbatched tensor: torch.func.vmap cannot do this
        return out

    f = torchjax.to_jax(fill)
    x = _arange(4, 3)
    tree_close(f(x[0]), x[0])  # fine unbatched
    with pytest.raises(VmapError, match=SEQUENTIAL):
        jax.vmap(f)(x)
    # The batched function is never fake-run (its types follow from fill's): under jit
    # the error comes from the call, wrapped by XLA's callback.
    with pytest.raises(Exception, match=SEQUENTIAL):
        jax.jit(jax.vmap(f))(x)
    g = torchjax.to_jax(fill, vmap_method="sequential")
    tree_close(jax.vmap(g)(x), x)


def test_item_without_declared_shapes_asks_for_result_shape_dtypes_under_jit():
    f = torchjax.to_jax(lambda x: x * x.sum().item())
    with pytest.raises(ShapeInferenceError, match="result_shape_dtypes"):
        jax.jit(jax.vmap(f))(_arange(4, 3))


def test_item_under_eager_vmap_gives_torch_funcs_error_or_works_sequentially():
    # Eagerly the values are at hand: one example's real run gives the types, so what
    # remains is torch.func.vmap's own refusal, with the advice; sequentially it works.
    fn = lambda x: x * x.sum().item()
    x = _arange(4, 3)
    with pytest.raises(VmapError, match=SEQUENTIAL) as info:
        jax.vmap(torchjax.to_jax(fn))(x)
    assert ".item()" in str(info.value)
    got = jax.vmap(torchjax.to_jax(fn, vmap_method="sequential"))(x)
    want = torch.stack([fn(row) for row in torch.from_numpy(np.asarray(x))])
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


def test_item_with_declared_shapes_fails_at_run_time_and_names_sequential():
    f = torchjax.to_jax(lambda x: x * x.sum().item(), result_shape_dtypes=lambda x: x)
    x = _arange(4, 3)
    with pytest.raises(VmapError, match=SEQUENTIAL) as info:
        jax.vmap(f)(x)
    assert ".item()" in str(info.value)
    # Under jit the error is raised in XLA's callback, which wraps it; the hint survives.
    with pytest.raises(Exception, match=SEQUENTIAL):
        jax.block_until_ready(jax.jit(jax.vmap(f))(x))


# -- vmap_randomness ---------------------------------------------------------------------


def _noisy(x):
    return x + torch.randn(x.shape)


def test_randomness_error_is_the_default():
    f = torchjax.to_jax(_noisy)
    with pytest.raises(VmapError, match=re.escape("vmap_randomness='different'")):
        jax.vmap(f)(jnp.zeros((3, 4)))


def test_randomness_error_without_fake_run():
    f = torchjax.to_jax(_noisy, result_shape_dtypes=lambda x: x)
    with pytest.raises(VmapError, match=re.escape("vmap_randomness='same'")):
        jax.vmap(f)(jnp.zeros((3, 4)))


def test_randomness_different_gives_different_rows():
    f = torchjax.to_jax(_noisy, vmap_randomness="different")
    torch.manual_seed(0)
    out = np.asarray(jax.vmap(f)(jnp.zeros((3, 64))))
    assert out.shape == (3, 64)
    assert not np.allclose(out[0], out[1]) and not np.allclose(out[1], out[2])
    assert 0.5 < out.std() < 1.5


def test_randomness_same_gives_equal_rows():
    f = torchjax.to_jax(_noisy, vmap_randomness="same")
    torch.manual_seed(0)
    out = np.asarray(jax.vmap(f)(jnp.zeros((3, 64))))
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(out[0], out[2])
    assert out[0].std() > 0.5
    # "same" shares the draw, not the input: a batched offset still shows.
    shifted = np.asarray(jax.vmap(f)(jnp.arange(3.0)[:, None] * jnp.ones((3, 64))))
    np.testing.assert_allclose(shifted[1] - shifted[0], 1.0, atol=1e-5)


# -- compositions with jit ---------------------------------------------------------------


def _cell(x, w):
    return torch.tanh(x @ w)


def _cell_jax(x, w):
    return jnp.tanh(x @ w)


def test_jit_of_vmap_and_vmap_of_jit():
    rec = Recorder(_cell)
    f = torchjax.to_jax(rec)
    x, w = _arange(4, 3), _arange(3, 2)
    ref = jax.vmap(_cell_jax, in_axes=(0, None))(x, w)
    tree_close(jax.jit(jax.vmap(f, in_axes=(0, None)))(x, w), ref)
    tree_close(jax.vmap(jax.jit(f), in_axes=(0, None))(x, w), ref)
    assert len(rec.calls) == 2 and all(c[0] == ((3,), True) for c in rec.calls)


def test_three_levels_with_jit_between_is_one_call():
    rec = Recorder(_cell)
    f = torchjax.to_jax(rec)
    x, w = _arange(2, 3, 4, 3), _arange(3, 3, 2)  # w batched only at the middle level
    vm = lambda g, ax: jax.vmap(g, in_axes=ax)
    nested = vm(jax.jit(vm(jax.jit(vm(f, (0, None))), (0, 0))), (0, None))
    ref = vm(vm(vm(_cell_jax, (0, None)), (0, 0)), (0, None))(x, w)
    tree_close(jax.jit(nested)(x, w), ref)
    tree_close(nested(x, w), ref)
    assert len(rec.calls) == 2
    assert all(c == (((3,), True), ((3, 2), True)) for c in rec.calls)


def test_vmap_of_grad_and_grad_of_vmap():
    f = torchjax.to_jax(lambda x, w: _cell(x, w).pow(2).sum())
    fj = lambda x, w: (_cell_jax(x, w) ** 2).sum()
    x, w = _arange(4, 3), _arange(3, 2)
    tree_close(
        jax.vmap(jax.grad(f, argnums=1), in_axes=(0, None))(x, w),
        jax.vmap(jax.grad(fj, argnums=1), in_axes=(0, None))(x, w),
    )
    loss = lambda f: lambda w: jax.vmap(f, in_axes=(0, None))(x, w).sum()
    tree_close(jax.grad(loss(f))(w), jax.grad(loss(fj))(w))
    tree_close(jax.jit(jax.grad(loss(f)))(w), jax.grad(loss(fj))(w))


# -- expand_dims / broadcast_all with declared output types ------------------------------


def _einsum_tanh(x, w):  # [..., I], [..., I, J] -> [..., J]
    return torch.tanh(torch.einsum("...i,...ij->...j", x, w))


@pytest.mark.parametrize("method", ["expand_dims", "broadcast_all"])
def test_leading_axis_methods_with_declared_per_example_shapes(method):
    # Regression: result_shape_dtypes describe one example; the batched call was checked
    # against them unchanged and failed with OutputMismatchError.
    f = torchjax.to_jax(
        _einsum_tanh,
        result_shape_dtypes=jax.ShapeDtypeStruct((2,), jnp.float32),
        vmap_method=method,
    )
    x, w = _arange(4, 3), _arange(3, 2)
    ref = jnp.tanh(x @ w)
    tree_close(jax.vmap(f, in_axes=(0, None))(x, w), ref)
    tree_close(jax.jit(jax.vmap(f, in_axes=(0, None)))(x, w), ref)
    ws = jnp.stack([w, -w])
    nested = jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(None, 0))
    tree_close(nested(x, ws), jnp.tanh(jnp.einsum("bi,wij->wbj", x, ws)))


@pytest.mark.parametrize("method", ["expand_dims", "broadcast_all"])
def test_leading_axis_methods_reject_outputs_without_the_batch_axis(method):
    f = torchjax.to_jax(lambda x: x.sum(), vmap_method=method)
    with pytest.raises(VmapError, match=re.escape("leading batch axis of size 4")):
        jax.vmap(f)(_arange(4, 3))


def test_python_number_outputs_keep_their_dtype_under_vmap():
    # Regression: under x64 a Python float output is float64 unbatched but came out of the
    # batched call as float32 (torch.tensor's default dtype).
    f = torchjax.to_jax(lambda x: (x.sum(), 2.0, 3))
    with jax.enable_x64(True):
        x = jnp.ones((2, 3))
        unbatched = [o.dtype for o in f(x[0])]
        assert unbatched == [jnp.float64, jnp.float64, jnp.int64]
        assert [o.dtype for o in jax.vmap(f)(x)] == unbatched
        grads = jax.vmap(jax.grad(lambda x: f(x)[0] + f(x)[1]))(x)
        assert grads.dtype == jnp.float64
        tree_close(grads, np.ones((2, 3)))


@pytest.mark.parametrize("fast", [True, False])
def test_vmap_without_torch_func_wrapper_matches_torch_func_vmap(monkeypatch, fast):
    # _vmap.vmap_call takes torch.func.vmap's steps without its Python wrapper; with
    # FAST_VMAP off it is torch.func.vmap itself. Both must give the jax.numpy results,
    # for tuple and integer outputs, nested vmaps, and vmap of grad.
    monkeypatch.setattr(_vmap, "FAST_VMAP", fast)
    f = torchjax.to_jax(lambda x, w: (torch.tanh(x @ w), x.argmax(), x.shape[0]))
    fj = lambda x, w: (jnp.tanh(x @ w), x.argmax(), x.shape[0])
    xs, w = _arange(2, 3, 4) / 10, _arange(4, 5) / 10
    inner = lambda f: jax.vmap(f, in_axes=(0, None))
    tree_close(
        jax.vmap(inner(f), in_axes=(0, None))(xs, w), jax.vmap(inner(fj), in_axes=(0, None))(xs, w)
    )
    loss = lambda f: lambda x, w: f(x, w)[0].sum()
    tree_close(
        jax.vmap(jax.grad(loss(f), argnums=1), in_axes=(0, None))(xs, w),
        jax.vmap(jax.grad(loss(fj), argnums=1), in_axes=(0, None))(xs, w),
    )


# -- an empty batch ----------------------------------------------------------------------
# torch.func.vmap fails on many ops with no example to run (x[0], select); jax.vmap gives
# empty outputs, and derivatives that sum over no example. Reference: the same in jax.numpy.


def _pair_torch(x, w):  # x: [3] batched, w: [3, 2] unbatched
    return {"batched": x[0] * w + x.sum(), "unbatched": torch.tanh(w)}


def _pair_jax(x, w):
    return {"batched": x[0] * w + x.sum(), "unbatched": jnp.tanh(w)}


@pytest.mark.parametrize("vmap_method", ["torch.func", "sequential"])
@pytest.mark.parametrize("jit", [False, True])
def test_an_empty_batch_gives_empty_outputs_and_derivatives(vmap_method, jit):
    f = torchjax.to_jax(_pair_torch, vmap_method=vmap_method)
    x, w = jnp.zeros((0, 3)), jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)
    wrap = jax.jit if jit else (lambda g: g)
    for fn in (f, _pair_jax):
        assert jax.vmap(fn, in_axes=(0, None))(x, w)["batched"].shape == (0, 3, 2)
    got = wrap(jax.vmap(f, in_axes=(0, None)))(x, w)
    tree_close(got, jax.vmap(_pair_jax, in_axes=(0, None))(x, w))

    def loss(fn):
        def total(x, w):
            out = jax.vmap(fn, in_axes=(0, None))(x, w)
            return out["batched"].sum() + (out["unbatched"] ** 2).sum()

        return total

    grads = wrap(jax.grad(loss(f), argnums=(0, 1)))(x, w)
    tree_close(grads, jax.grad(loss(_pair_jax), argnums=(0, 1))(x, w))
    tangent = wrap(lambda x, w: jax.jvp(loss(f), (x, w), (x, jnp.ones_like(w)))[1])(x, w)
    tree_close(tangent, jax.jvp(loss(_pair_jax), (x, w), (x, jnp.ones_like(w)))[1])


@pytest.mark.parametrize("jit", [False, True])
def test_derivatives_over_an_empty_batch_take_nothing_from_the_padded_example(jit):
    """w / x at the padded example's zeros has an infinite derivative: a zero cotangent
    times it would be NaN. And cholesky fails on zeros: with every output empty, its
    derivatives run nothing (eagerly too, where grad first runs the forward for a graph)."""
    wrap = jax.jit if jit else (lambda g: g)
    divide = torchjax.to_jax(lambda w, x: w / x)
    w, empty = jnp.ones(3), jnp.zeros((0, 3))

    def total(fn):
        return lambda w: jax.vmap(fn, in_axes=(None, 0))(w, empty).sum()

    tree_close(wrap(jax.grad(total(divide)))(w), jax.grad(total(lambda w, x: w / x))(w))
    cholesky = torchjax.to_jax(torch.linalg.cholesky)
    matrices = jnp.zeros((0, 3, 3))
    grad = wrap(jax.grad(lambda m: jax.vmap(cholesky)(m).sum()))(matrices)
    assert grad.shape == (0, 3, 3)
    tangent = jax.jvp(jax.vmap(cholesky), (matrices,), (matrices,))[1]
    assert tangent.shape == (0, 3, 3)
