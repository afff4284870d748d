"""to_jax eager and under jit: values, pytrees, static leaves, zero-copy, caching."""

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import torchjax
from torchjax._to_jax._torch_call import _lowering as _rule_lowering
from torchjax._to_jax._torch_call._primitive import torch_call_p

pytestmark = pytest.mark.core  # the version matrix runs this module

real_calls = collections.Counter()


def count_real(name, x):
    if not isinstance(x, FakeTensor):
        real_calls[name] += 1


@pytest.fixture(autouse=True)
def _reset():
    real_calls.clear()


def torch_mlp(params, x, *, activation="tanh"):
    """A two-layer perceptron on torch tensors."""
    count_real("mlp", x)
    act = torch.tanh if activation == "tanh" else torch.relu
    h = act(x @ params["w1"] + params["b1"])
    return {"out": h @ params["w2"], "hidden_norm": h.norm()}


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32),
        "b1": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 2)), jnp.float32),
    }


def reference(params, x, activation="tanh"):
    out = torch_mlp(
        torchjax.tree_to_torch(params), torch.as_tensor(np.array(x)), activation=activation
    )
    return {k: v.cpu().numpy() for k, v in out.items()}


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_pytree_in_out_kwargs_static(mode, activation):
    f = torchjax.to_jax(torch_mlp)
    if mode == "jit":
        f = jax.jit(f, static_argnames="activation")
    params = make_params()
    x = jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4)
    got = f(params, x, activation=activation)
    assert real_calls["mlp"] == 1
    ref = reference(params, x, activation)
    assert set(got) == {"out", "hidden_norm"}
    np.testing.assert_allclose(got["out"], ref["out"], rtol=1e-6)
    np.testing.assert_allclose(got["hidden_norm"], ref["hidden_norm"], rtol=1e-6)


def test_decorator_forms_keep_name_and_doc():
    @torchjax.to_jax
    def plain(x):
        """Doc of plain."""
        return x * 2

    @torchjax.to_jax(result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32))
    def declared(x):
        """Doc of declared."""
        return x * 3

    assert plain.__name__ == "plain" and plain.__doc__ == "Doc of plain."
    assert declared.__name__ == "declared" and declared.__doc__ == "Doc of declared."
    np.testing.assert_allclose(plain(jnp.ones(3)), 2 * np.ones(3))
    np.testing.assert_allclose(declared(jnp.ones(3)), 3 * np.ones(3))
    np.testing.assert_allclose(torchjax.to_jax(torch.sin)(jnp.ones(3)), np.sin(np.ones(3)))


def test_static_leaves_passed_through_and_retrace_on_change():
    seen = []

    def f(x, cfg):
        seen.append(cfg)
        return x * cfg["scale"] + len(cfg["name"])

    g = torchjax.to_jax(f)
    x = jnp.ones(2)
    np.testing.assert_allclose(g(x, {"scale": 2.0, "name": "ab"}), np.full(2, 4.0))
    np.testing.assert_allclose(g(x, {"scale": 3.0, "name": "ab"}), np.full(2, 5.0))
    assert {"scale": 2.0, "name": "ab"} in seen and {"scale": 3.0, "name": "ab"} in seen


def test_eager_is_zero_copy_both_ways():
    seen = {}

    def f(x):
        # const_data_ptr: data_ptr() asks for write access, which inputs refuse.
        if not isinstance(x, FakeTensor):
            seen["in"] = x.const_data_ptr()
        y = x * 2
        if not isinstance(x, FakeTensor):
            seen["out"] = y.data_ptr()
        return y

    x = jnp.arange(1024, dtype=jnp.float32)
    y = torchjax.to_jax(f)(x)
    assert seen["in"] == x.unsafe_buffer_pointer()
    assert seen["out"] == y.unsafe_buffer_pointer()


def test_jit_inputs_are_zero_copy():
    seen = {}

    def f(x):
        if not isinstance(x, FakeTensor):
            seen["in"] = x.const_data_ptr()
        return x + 1

    x = jnp.arange(1 << 16, dtype=jnp.float32)
    jax.jit(torchjax.to_jax(f))(x).block_until_ready()
    assert seen["in"] == x.unsafe_buffer_pointer()


def test_output_aliasing_an_input_is_copied_in_eager():
    x = jnp.arange(4.0)
    y = torchjax.to_jax(lambda x: x)(x)
    np.testing.assert_allclose(y, x)
    assert y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()


def test_jit_cache_hits_and_one_primitive_for_all_functions():
    shape_runs = collections.Counter()

    def f(x):
        if isinstance(x, FakeTensor):
            shape_runs["f"] += 1
        return x.sin()

    g = torchjax.to_jax(f)
    jitted = jax.jit(lambda x: g(x) * 2)
    for _ in range(3):
        jitted(jnp.ones(3))
    jax.jit(lambda x: g(x) * 2)(jnp.ones(3))  # a new jit of the same function
    assert jitted._cache_size() == 1
    assert shape_runs["f"] == 1  # fake run cached per (fn, signature)
    jitted(jnp.ones(4))
    assert shape_runs["f"] == 2
    jaxpr = jax.make_jaxpr(lambda x: g(x) + torchjax.to_jax(torch.cos)(x))(jnp.ones(3))
    assert {e.primitive for e in jaxpr.eqns} >= {torch_call_p.primitive}
    assert sum(e.primitive is torch_call_p.primitive for e in jaxpr.eqns) == 2


def test_python_numbers_become_0d_arrays():
    f = torchjax.to_jax(lambda x: (x.sum(), 3, 2.5, True))
    for g in (f, jax.jit(f)):
        s, i, fl, b = g(jnp.ones(3))
        assert s.shape == i.shape == fl.shape == b.shape == ()
        assert (int(i), float(fl), bool(b)) == (3, 2.5, True)
        assert i.dtype == jnp.int32 and fl.dtype == jnp.float32 and b.dtype == jnp.bool_


def test_result_shape_dtypes_skips_fake_run():
    def data_dependent(x):
        n = int((x > 0).sum().item())
        return x[:n] * 2

    f = torchjax.to_jax(data_dependent, result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32))
    x = jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(f(x), [2.0, 4.0, 6.0])
    np.testing.assert_allclose(jax.jit(f)(x), [2.0, 4.0, 6.0])
    g = torchjax.to_jax(
        data_dependent, result_shape_dtypes=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    )
    np.testing.assert_allclose(jax.jit(g)(x), [2.0, 4.0, 6.0])


def test_pure_callback_fallback(monkeypatch):
    monkeypatch.setattr(_rule_lowering, "USE_BUFFER_CALLBACK", False)
    f = torchjax.to_jax(lambda x, y: {"s": x + y.to(x.dtype), "b": (x > 1).to(torch.bfloat16)})
    x = jnp.arange(4.0)
    y = jnp.arange(4, dtype=jnp.int32)
    out = jax.jit(f)(x, y)
    np.testing.assert_allclose(out["s"], 2 * np.arange(4.0))
    assert out["b"].dtype == jnp.bfloat16
    np.testing.assert_allclose(out["b"].astype(jnp.float32), [0, 0, 1, 1])


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_threads_get_their_own_results(mode):
    f = torchjax.to_jax(lambda x, k: torch.sin(x) * k)
    if mode == "jit":
        f = jax.jit(f, static_argnums=1)
    errors, results = [], {}

    def work(tid):
        try:
            for i in range(20):
                x = jnp.full((64,), float(tid * 100 + i))
                got = f(x, tid + 1)
                want = np.sin(np.full(64, float(tid * 100 + i), np.float32)) * (tid + 1)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            results[tid] = True
        except Exception as e:  # collected: assertion errors in threads do not fail tests
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_jit_runs_on_xla_stream_without_copies():
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    if not devices:
        pytest.skip("JAX has no GPU backend")
    seen = {}

    def f(x):
        if not isinstance(x, FakeTensor):
            seen["ptr"] = x.const_data_ptr()  # data_ptr() asks for write access: refused
            seen["stream"] = torch.cuda.current_stream().cuda_stream
        return torch.sin(x) * 2

    x = jax.device_put(jnp.arange(1 << 20, dtype=jnp.float32), devices[0])
    got = jax.jit(torchjax.to_jax(f))(x)
    np.testing.assert_allclose(
        np.asarray(got), 2 * np.sin(np.arange(1 << 20, dtype=np.float32)), rtol=1e-5, atol=1e-5
    )
    assert seen["ptr"] == x.unsafe_buffer_pointer()
    assert seen["stream"] != torch.cuda.default_stream().cuda_stream  # XLA's, not torch's
    eager = torchjax.to_jax(f)(x)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(got), rtol=1e-6)
