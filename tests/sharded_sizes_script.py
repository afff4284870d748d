"""Wrapped torch calls on sharded inputs at realistic sizes, 4 host CPU devices, both lowerings
(run by test_multidevice.py in a subprocess with a timeout: a hang or an abort in XLA's
collectives fails that test, not the process running the suite).

Each check counts the torch calls that ran on real tensors (a fake run, which finds the
output types, is not one): a jitted call on sharded inputs runs torch once, on the whole
value; inside shard_map once per device, on its shard. Values are compared with numpy.
"""

import importlib.util
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402

import torchjax  # noqa: E402

assert len(jax.devices()) == 4, jax.devices()
rows_mesh = jax.make_mesh((4,), ("x",))
grid_mesh = jax.make_mesh((2, 2), ("a", "b"))
# (shape, mesh, spec): rows, columns, both.
LAYOUTS = [
    ((1024, 1024), rows_mesh, P("x", None)),
    ((1024, 1024), rows_mesh, P(None, "x")),
    ((4096, 256), rows_mesh, P("x", None)),
    ((4096, 256), rows_mesh, P(None, "x")),
    ((1024, 1024), grid_mesh, P("a", "b")),
]
calls: list[tuple[int, ...]] = []


def counted(fn):
    def run(*tensors):
        if not isinstance(tensors[0], FakeTensor):
            calls.append(tuple(tensors[0].shape))
        return fn(*tensors)

    return run


def weighted_sum(a, b):
    return a * 2 + b


def once(f, *args):
    """f(*args) with the torch calls it made."""
    calls.clear()
    out = jax.block_until_ready(f(*args))
    made = list(calls)
    calls.clear()
    return out, made


def check_layout(shape, mesh, spec):
    where = f"{shape} on {spec}"
    sharding = NamedSharding(mesh, spec)
    x_np = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x = jax.device_put(x_np, sharding)
    expected_sum = float(np.sum((3 * x_np.astype(np.float64)) * x_np))
    declared = torchjax.to_jax(
        counted(weighted_sum), result_shape_dtypes=jax.ShapeDtypeStruct(shape, jnp.float32)
    )
    inferred = torchjax.to_jax(counted(weighted_sum))
    for name, f in (("declared", declared), ("inferred", inferred)):
        # The result meets a sharded operand, then a reduction over the sharded value.
        total, made = once(jax.jit(lambda a, f=f: jnp.sum(f(a, a) * a)), x)
        np.testing.assert_allclose(float(total), expected_sum, rtol=1e-4, err_msg=where)
        assert made == [shape], (where, name, made)  # once, on the whole value
        out, made = once(jax.jit(f), x, x)
        np.testing.assert_allclose(np.asarray(out), 3 * x_np, rtol=1e-6, err_msg=where)
        assert made == [shape], (where, name, made)
        grad, made = once(jax.jit(jax.grad(lambda a, f=f: jnp.sum(f(a, a) ** 2))), x)
        np.testing.assert_allclose(np.asarray(grad), 18 * x_np, rtol=1e-5, err_msg=where)
        assert made == [shape], (where, name, made)
    # Inside shard_map: each device runs torch on its own shard.
    local = jax.jit(
        jax.shard_map(
            lambda a: jax.lax.psum(jnp.sum(inferred(a, a)), mesh.axis_names),
            mesh=mesh,
            in_specs=spec,
            out_specs=P(),
        )
    )
    total, made = once(local, x)
    np.testing.assert_allclose(float(total), 3 * float(np.sum(x_np, dtype=np.float64)), rtol=1e-4)
    shard_shape = sharding.shard_shape(shape)
    assert made == [shard_shape] * 4, (where, made)
    if importlib.util.find_spec("torchax") is None:  # (the version matrix installs no extra)
        print(f"{where}: once per call (declared, inferred, grad), per shard in shard_map")
        return
    # lowering="xla": ordinary JAX ops, which partition: no callback, no gather.
    lowered = torchjax.to_jax(weighted_sum, lowering="xla")
    step = jax.jit(lambda a: lowered(a, a))
    hlo = step.lower(x).compile().as_text()
    assert "custom-call" not in hlo and "all-gather" not in hlo, where
    out = step(x)
    np.testing.assert_allclose(np.asarray(out), 3 * x_np, rtol=1e-6, err_msg=where)
    assert out.sharding.is_equivalent_to(sharding, len(shape)), (where, out.sharding)
    print(f"{where}: once per call (declared, inferred, grad), per shard in shard_map; xla: ok")


def check_slow_call_and_draws():
    """A call whose torch work takes a while (an SVD of 1024x1024), and calls that draw."""
    shape = (1024, 1024)
    x_np = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    x = jax.device_put(x_np, NamedSharding(rows_mesh, P("x", None)))
    svdvals = torchjax.to_jax(counted(torch.linalg.svdvals))
    values, made = once(jax.jit(lambda a: jnp.sum(svdvals(a)) + jnp.sum(a)), x)
    expected = np.linalg.svd(x_np.astype(np.float64), compute_uv=False).sum() + x_np.sum()
    np.testing.assert_allclose(float(values), expected, rtol=1e-4)
    assert made == [shape], made
    declared = jax.ShapeDtypeStruct(shape, jnp.float32)
    drop = torchjax.to_jax(
        counted(lambda a: torch.nn.functional.dropout(a, 0.5)), result_shape_dtypes=declared
    )
    ones = jax.device_put(jnp.ones(shape), NamedSharding(rows_mesh, P("x", None)))
    (first, second), made = once(jax.jit(lambda a: (drop(a), drop(a))), ones)
    assert made == [shape, shape], made  # two calls, once each
    assert set(np.unique(np.asarray(first))) <= {0.0, 2.0}
    assert (np.asarray(first) != np.asarray(second)).any()  # two draws, not one merged
    print("a slow call (SVD) and calls that draw, 1024x1024 sharded: once each: ok")


if __name__ == "__main__":
    for layout in LAYOUTS:
        check_layout(*layout)
    check_slow_call_and_draws()
