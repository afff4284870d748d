"""lowering="xla" with sharded inputs on 4 host CPU devices (run by test_lowering_xla.py).

XLA_FLAGS must be set before JAX initialises, so this runs as its own process. A lowered
program is ordinary JAX: under plain jax.jit its ops partition like any JAX op's, where a
callback gathers its inputs onto one device.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import torchjax  # noqa: E402

assert len(jax.devices()) == 4, jax.devices()
# Auto axes: XLA chooses how intermediates are sharded (with Explicit axes JAX asks the
# program to say, for pure-JAX code as for this).
mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
ref = mlp(torch.tensor(x)).detach().numpy()
apply, v = torchjax.module_to_jax(mlp, lowering="xla")


def placed(tree, specs):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)


def check_data_parallel():
    xs = placed(x, P("x"))  # the batch split over the devices, the weights replicated
    out = jax.jit(apply)(v, xs)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert out.sharding.shard_shape(out.shape) == (4, 4), out.sharding  # stayed split
    text = jax.jit(apply).lower(v, xs).compile().as_text()
    assert "all-gather" not in text and "callback" not in text.lower()
    grads = jax.jit(jax.grad(lambda v: (apply(v, xs) ** 2).sum()))(v)
    tm = torch.func.functional_call
    p = {k: torch.tensor(np.asarray(a)) for k, a in v["params"].items()}
    ref_g = torch.func.grad(lambda p: tm(mlp, p, (torch.tensor(x),)).pow(2).sum())(p)
    for k in p:
        np.testing.assert_allclose(grads["params"][k], ref_g[k].numpy(), rtol=1e-4, atol=1e-5)
    print("data parallel: ok")


def check_tensor_parallel():
    # Megatron-style: the first layer split by output features, the second by input ones.
    specs = {
        "params": {
            "0.weight": P("x", None),
            "0.bias": P("x"),
            "2.weight": P(None, "x"),
            "2.bias": P(),
        },
        "buffers": {},
    }
    vs = placed(v, specs)
    hidden = torchjax.module_to_jax(mlp[0], lowering="xla")[0]
    first = {
        "params": {"weight": vs["params"]["0.weight"], "bias": vs["params"]["0.bias"]},
        "buffers": {},
    }
    h = jax.jit(hidden)(first, x)
    assert h.sharding.shard_shape(h.shape) == (16, 8), h.sharding  # split by feature
    out = jax.jit(apply)(vs, x)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    text = jax.jit(apply).lower(vs, x).compile().as_text()
    assert "callback" not in text.lower()
    print("tensor parallel: ok")


check_data_parallel()
check_tensor_parallel()
