"""Nothing is lost: in-place mutation, exceptions, wrong outputs, bad static leaves."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import torchjax
from torchjax.errors import (
    ConversionError,
    InPlaceMutationError,
    OutputMismatchError,
    ShapeInferenceError,
    StaticArgumentError,
)

real_calls = collections.Counter()


@pytest.fixture(autouse=True)
def _reset():
    real_calls.clear()


def _real(x):
    return not isinstance(x, FakeTensor)


def add_inplace(d):
    real_calls["add_inplace"] += _real(d["a"])
    d["a"].add_(1)
    return d["a"] * 2


def setitem(d):
    real_calls["setitem"] += _real(d["a"])
    d["a"][0] = 5.0
    return d["a"].sum()


def out_kwarg(d):
    real_calls["out_kwarg"] += _real(d["a"])
    torch.add(d["a"], 1.0, out=d["a"])
    return d["a"]


def view_mutation(d):
    real_calls["view_mutation"] += _real(d["a"])
    d["a"].view(-1)[1:].mul_(3)
    return d["a"] + 0


@pytest.mark.parametrize("fn", [add_inplace, setitem, out_kwarg, view_mutation])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_inplace_rejected_and_the_callers_array_unchanged(fn, mode):
    real_calls.clear()
    f = torchjax.to_jax(fn)
    if mode == "jit":
        f = jax.jit(f)
    a = jnp.arange(4.0)
    before = np.array(a)
    with pytest.raises(
        InPlaceMutationError, match=r"(?s)modifies its input args\[0\]\['a'\].*clone"
    ):
        f({"a": a})
    if mode == "jit":
        assert real_calls[fn.__name__] == 0  # the fake run refused it before any real data
    else:
        # Eager calls have data and run for real at once; the storage refuses the write.
        assert real_calls[fn.__name__] >= 1
    np.testing.assert_array_equal(a, before)


def test_inplace_on_keyword_argument_path():
    def f(x, *, scale):
        scale.mul_(2)
        return x * scale

    with pytest.raises(InPlaceMutationError, match=r"kwargs\['scale'\]"):
        torchjax.to_jax(f)(jnp.ones(2), scale=jnp.ones(2))


def sneaky(x):
    # Writes only on real data: the fake run cannot see it; the protected storage refuses it.
    if _real(x):
        x.mul_(0)
    return x.sum()


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_write_on_real_data_only_is_refused(mode):
    f = torchjax.to_jax(sneaky)
    if mode == "jit":
        f = jax.jit(f)
    x = jnp.ones(3)
    refused = r"(?s)modifies its input args\[0\].*refused it.*caller's array is unchanged"
    with pytest.raises(Exception, match=refused):
        jax.block_until_ready(f(x))
    np.testing.assert_array_equal(x, np.ones(3))


def failing(x):
    if _real(x):
        raise ValueError("the simulator diverged at step 7")
    return x * 2


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_exception_keeps_type_message_and_name_and_process_survives(mode):
    f = torchjax.to_jax(failing)
    g = torchjax.to_jax(lambda x: x + 1)
    if mode == "jit":
        f, g = jax.jit(f), jax.jit(g)
    for _ in range(2):
        # The user's exception stays theirs: its type eagerly (XLA wraps it under jit),
        # its message, and a note naming the function.
        kind = ValueError if mode == "eager" else Exception
        with pytest.raises(kind, match=r"(?s)ValueError: the simulator diverged|^the simulator"):
            jax.block_until_ready(f(jnp.ones(3)))
        if mode == "eager":
            with pytest.raises(ValueError) as info:
                f(jnp.ones(3))
            assert any("failing" in note for note in info.value.__notes__)
    np.testing.assert_allclose(g(jnp.ones(3)), 2 * np.ones(3))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_declared_shape_mismatch_names_path_expected_actual(mode):
    f = torchjax.to_jax(
        lambda x: {"y": x[:2]},
        result_shape_dtypes={"y": jax.ShapeDtypeStruct((3,), jnp.float32)},
    )
    if mode == "jit":
        f = jax.jit(f)
    with pytest.raises(Exception, match=r"float32\[2\] at out\['y'\], but float32\[3\]"):
        jax.block_until_ready(f(jnp.ones(3)))


def test_declared_dtype_mismatch():
    f = torchjax.to_jax(
        lambda x: x.to(torch.int32), result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32)
    )
    with pytest.raises(OutputMismatchError, match=r"int32\[3\] at out, but float32\[3\]"):
        f(jnp.ones(3))


def test_declared_structure_mismatch():
    f = torchjax.to_jax(
        lambda x: (x, x), result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32)
    )
    with pytest.raises(OutputMismatchError, match="structure"):
        f(jnp.ones(3))


def test_non_tensor_output_is_rejected():
    with pytest.raises(
        OutputMismatchError, match=r"returned a str at out\[1\].*tensors, Python numbers"
    ):
        torchjax.to_jax(lambda x: (x, "done"))(jnp.ones(2))


def test_unhashable_static_leaf_names_path():
    with pytest.raises(StaticArgumentError, match=r"args\[1\]\['opts'\].*set.*hashable"):
        torchjax.to_jax(lambda x, cfg: x)(jnp.ones(2), {"opts": {1, 2}})


def test_torch_tensor_argument_is_a_clear_error():
    with pytest.raises(ConversionError, match=r"args\[0\]\['w'\] is a torch.Tensor.*tree_to_jax"):
        torchjax.to_jax(lambda d: d["w"] * 2)({"w": torch.ones(2)})


def test_fake_run_failure_suggests_result_shape_dtypes():
    def nonzero(x):
        return torch.nonzero(x)

    x = jnp.array([0.0, 1.0, 2.0])
    with pytest.raises(ShapeInferenceError, match="(?s)nonzero.*fake tensors.*result_shape_dtypes"):
        jax.jit(torchjax.to_jax(nonzero))(x)
    # Eagerly there is data: the function runs for real, on each call, whatever the shape.
    f = torchjax.to_jax(nonzero)
    np.testing.assert_array_equal(f(x), torch.nonzero(torch.tensor(np.asarray(x))).numpy())
    np.testing.assert_array_equal(f(jnp.ones(3)), [[0], [1], [2]])

    def item(x):
        return x * x.max().item()

    with pytest.raises(ShapeInferenceError, match="result_shape_dtypes"):
        jax.jit(torchjax.to_jax(item))(jnp.ones(2))


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="vmap_method='loop' is not one of"):
        torchjax.to_jax(lambda x: x, vmap_method="loop")
    with pytest.raises(TypeError, match="expects a callable"):
        torchjax.to_jax(3)
