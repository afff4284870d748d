"""Multi-device checks, run in a subprocess with 4 host CPU devices (see test_multidevice.py).

XLA_FLAGS must be set before JAX initialises, so this runs as its own process; it prints
one line per check and exits non-zero on the first failure.
"""

import os
import warnings

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402

import torchjax  # noqa: E402

assert len(jax.devices()) == 4, jax.devices()
mesh = jax.make_mesh((4,), ("data",))
shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
seen_shapes = []


def sin2(x):
    if not isinstance(x, FakeTensor):
        seen_shapes.append(tuple(x.shape))
    return torch.sin(x) * 2


def check_local_shards_and_grad():
    f = torchjax.to_jax(sin2)
    x = shard(jnp.arange(16.0))
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    seen_shapes.clear()
    np.testing.assert_allclose(g(x), 2 * np.sin(np.arange(16.0)), rtol=1e-6)
    assert seen_shapes == [(4,)] * 4, seen_shapes  # each device ran torch on its own shard
    total = jax.shard_map(
        lambda x: jax.lax.psum(f(x).sum(), "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
    )
    grad = jax.jit(jax.grad(total))(x)
    np.testing.assert_allclose(grad, 2 * np.cos(np.arange(16.0)), rtol=1e-6)
    per_row = jax.shard_map(jax.vmap(f), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    xs = shard(jnp.arange(32.0).reshape(8, 4))
    np.testing.assert_allclose(
        jax.jit(per_row)(xs), 2 * np.sin(np.arange(32.0).reshape(8, 4)), rtol=1e-6
    )
    print("shard_map: local shards, grad, vmap: ok")


def check_sharded_input_without_shard_map():
    f = torchjax.to_jax(sin2)
    x = shard(jnp.arange(16.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.testing.assert_allclose(jax.jit(f)(x), 2 * np.sin(np.arange(16.0)), rtol=1e-6)
    told = [w for w in caught if issubclass(w.category, torchjax.errors.ShardingWarning)]
    # Only a trace whose types carry the sharding (Explicit mesh axes) can tell.
    explicit = any(a is not None for a in (jax.typeof(x).sharding.spec or ()))
    if explicit:
        assert len(told) == 1, caught
        text = str(told[0].message)
        assert "args[0]" in text and "'data'" in text and "jax.shard_map(f" in text, text
    else:
        assert not told, told
    try:
        f(x)
    except torchjax.errors.ConversionError as e:
        assert "shard_map" in str(e), e
    else:
        raise AssertionError("eager call on a sharded array should raise")
    warned = "given" if explicit else "not traced (Auto axes)"
    print(f"sharded input under jit: gathered, ShardingWarning {warned}; eager: clear error: ok")


def mlp(params, x):
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"]


def check_data_parallel_training_matches_single_device():
    rng = np.random.default_rng(0)
    params0 = {
        "w1": jnp.asarray(rng.normal(size=(3, 16)) / 2, jnp.float32),
        "b1": jnp.zeros(16, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(16, 1)) / 4, jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(64, 3)), jnp.float32)
    y = jnp.sin(x).sum(axis=1, keepdims=True)
    f = torchjax.to_jax(mlp)
    loss = lambda p, x, y: jnp.mean((f(p, x) - y) ** 2)
    opt = optax.adam(1e-2)

    @jax.jit
    def single_step(p, s):
        lv, g = jax.value_and_grad(loss)(p, x, y)
        u, s = opt.update(g, s)
        return optax.apply_updates(p, u), s, lv

    def dp_grads(p, x, y):
        lv, g = jax.value_and_grad(loss)(p, x, y)
        return jax.lax.pmean(lv, "data"), jax.lax.pmean(g, "data")

    dp = jax.shard_map(dp_grads, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())

    @jax.jit
    def parallel_step(p, s, x, y):
        lv, g = dp(p, x, y)
        u, s = opt.update(g, s)
        return optax.apply_updates(p, u), s, lv

    p1, s1 = params0, opt.init(params0)
    p2, s2 = params0, opt.init(params0)
    xs, ys = shard(x), shard(y)
    for _ in range(20):
        p1, s1, l1 = single_step(p1, s1)
        p2, s2, l2 = parallel_step(p2, s2, xs, ys)
        np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for k in params0:
        np.testing.assert_allclose(p2[k], p1[k], rtol=1e-4, atol=1e-6)
    assert float(l1) < 0.5 * float(loss(params0, x, y))
    print("data-parallel training over 4 devices equals single-device: ok")


def _mlp_jnp(params, x):  # Sequential(Linear(64, 256), Tanh(), Linear(256, 8)) in jax.numpy
    h = jnp.tanh(x @ params["0.weight"].T + params["0.bias"])
    return h @ params["2.weight"].T + params["2.bias"]


def check_module_calls_isolated_across_devices():
    """One module_to_jax apply, two variable sets, on 4 devices at once: every device's
    calls see their own variables, in the forward and the backward."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    apply, v = torchjax.module_to_jax(net)
    v2 = jax.tree.map(lambda a: -0.5 * a + 0.01, v)

    def loss_jnp(p, p2, x):
        return jnp.sum(_mlp_jnp(p, x) ** 2) + jnp.sum(jnp.sin(_mlp_jnp(p2, x)))

    # The references, in jax.numpy on one device.
    x_one = jnp.asarray(np.random.RandomState(1).randn(32, 64), jnp.float32)
    want = (_mlp_jnp(v["params"], x_one), _mlp_jnp(v2["params"], x_one))
    want_grads = jax.grad(loss_jnp, argnums=(0, 1))(v["params"], v2["params"], x_one)

    both = jax.jit(
        jax.shard_map(
            lambda v, v2, x: (apply(v, x), apply(v2, x)),
            mesh=mesh,
            in_specs=(P(), P(), P("data")),
            out_specs=(P("data"), P("data")),
        )
    )

    def loss(p, p2, x):
        a, b = both({"params": p, "buffers": {}}, {"params": p2, "buffers": {}}, x)
        return jnp.sum(a**2) + jnp.sum(jnp.sin(b))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))
    v, v2 = jax.device_put((v, v2), NamedSharding(mesh, P()))  # on every device
    x = shard(x_one)
    for _ in range(20):
        out = both(v, v2, x)
        for o, w in zip(out, want, strict=True):
            np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5)
        got = grads(v["params"], v2["params"], x)
        for g, w in zip(got, want_grads, strict=True):
            for k in w:
                np.testing.assert_allclose(g[k], w[k], rtol=1e-4, atol=1e-4)
    for k, t in net.state_dict().items():
        assert torch.equal(t, before[k]), k  # the user's module is untouched
    print("module_to_jax in shard_map, two variable sets, values and grads: ok")


def check_declared_types_with_sharded_inputs():
    """Declared types stage the call as drawing random numbers (no fake run says it does
    not): XLA's partitioner refused that side-effecting call on sharded inputs (issue 45).
    Now it runs once per call on the whole value, its outputs usable by later operations."""
    x = shard(jnp.arange(16.0 * 4).reshape(16, 4))
    declared = jax.ShapeDtypeStruct(x.shape, x.dtype)
    calls = []

    def add(a, b):
        calls.append(tuple(a.shape))
        return a + b

    f = torchjax.to_jax(add, result_shape_dtypes=declared)
    out = jax.jit(f)(x, x)
    np.testing.assert_allclose(out, 2 * np.asarray(x))
    np.testing.assert_allclose(out[3, :2] + 1, 2 * np.asarray(x)[3, :2] + 1)  # usable
    calls.clear()
    jax.block_until_ready(jax.jit(f)(x, x))
    assert calls == [(16, 4)], calls  # once, on the whole value
    grad = jax.jit(jax.grad(lambda a: (f(a, a) ** 2).sum()))(x)
    np.testing.assert_allclose(grad, 8 * np.asarray(x), rtol=1e-6)
    # A function that does draw: two calls on the same input draw twice, once each.
    drop = torchjax.to_jax(
        lambda a: torch.nn.functional.dropout(a, 0.5), result_shape_dtypes=declared
    )
    ones = shard(jnp.ones((16, 4)))
    first, second = jax.jit(lambda a: (drop(a), drop(a)))(ones)
    assert set(np.unique(np.asarray(first))) <= {0.0, 2.0}
    assert (np.asarray(first) != np.asarray(second)).any()
    # The same with inferred types (the fake run saw the draw), and inside shard_map.
    inferred = torchjax.to_jax(lambda a: torch.nn.functional.dropout(a, 0.5))
    assert set(np.unique(np.asarray(jax.jit(inferred)(ones)))) <= {0.0, 2.0}
    local = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    per_shard = torchjax.to_jax(lambda a: a * 3, result_shape_dtypes=local)
    g = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_allclose(g(x), 3 * np.asarray(x))
    print("declared types with sharded inputs: once per call, grad, draws, shard_map: ok")


if __name__ == "__main__":
    check_local_shards_and_grad()
    check_sharded_input_without_shard_map()
    check_data_parallel_training_matches_single_device()
    check_module_calls_isolated_across_devices()
    check_declared_types_with_sharded_inputs()
