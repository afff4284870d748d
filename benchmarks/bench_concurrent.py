# Concurrent module_to_jax calls: one apply, two variable sets, on 4 CPU devices at once.
#
# Inside jax.shard_map XLA runs each device's torch call on a thread of its own, at the same
# time: module_to_jax gives each call a private copy of the module (docs/how_it_works.md,
# section 10). The baseline does the same work with to_jax of the module's forward written
# as a function of its parameters, which has no module to keep apart. MLP 64-256-8, 32 rows
# per device, forward and jax.grad. 4 host devices need XLA_FLAGS before JAX starts, so the
# measurement runs in a subprocess, which prints the table as JSON.
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _timing
from _timing import Table, format_tables

DEVICES = 4


def measure() -> list[Table]:
    """Run the measurement in a subprocess with 4 host devices; return its table."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    config = json.dumps({"repeat": _timing.REPEAT, "min_run_seconds": _timing.MIN_RUN_SECONDS})
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", config],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bench_concurrent's subprocess failed:\n{proc.stderr[-3000:]}")
    title, rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return [(title, [tuple(r) for r in rows])]


def _child(config: dict) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import torchjax

    _timing.configure(**config)
    assert len(jax.devices()) == DEVICES, jax.devices()
    mesh = jax.make_mesh((DEVICES,), ("data",))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    apply, v = torchjax.module_to_jax(net)
    v2 = jax.tree.map(lambda a: -0.5 * a, v)

    def functional(p, x):  # the same MLP as a function of its parameters, in torch
        h = torch.tanh(torch.nn.functional.linear(x, p["0.weight"], p["0.bias"]))
        return torch.nn.functional.linear(h, p["2.weight"], p["2.bias"])

    f = torchjax.to_jax(functional)
    spec = dict(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P("data"), P("data")))
    modules = jax.shard_map(lambda v, v2, x: (apply(v, x), apply(v2, x)), **spec)
    functions = jax.shard_map(lambda v, v2, x: (f(v["params"], x), f(v2["params"], x)), **spec)

    def loss(run):
        return lambda p, p2, x: sum(
            jnp.sum(o**2)
            for o in run({"params": p, "buffers": {}}, {"params": p2, "buffers": {}}, x)
        )

    x = jax.device_put(
        jnp.asarray(np.random.RandomState(0).randn(32 * DEVICES, 64), jnp.float32),
        NamedSharding(mesh, P("data")),
    )
    v, v2 = jax.device_put((v, v2), NamedSharding(mesh, P()))
    fwd_m, fwd_f = jax.jit(modules), jax.jit(functions)
    grad_m = jax.jit(jax.grad(loss(modules), argnums=(0, 1)))
    grad_f = jax.jit(jax.grad(loss(functions), argnums=(0, 1)))
    for a, b in zip(fwd_m(v, v2, x), fwd_f(v, v2, x), strict=True):
        assert float(jnp.abs(a - b).max()) < 1e-5
    grads = grad_m(v["params"], v2["params"], x), grad_f(v["params"], v2["params"], x)
    for a, b in zip(*grads, strict=True):
        for k in a:
            assert float(jnp.abs(a[k] - b[k]).max()) < 1e-4
    rows = [
        _timing.paired_row(
            "jax.jit(shard_map(two applys))",
            lambda: jax.block_until_ready(fwd_m(v, v2, x)),
            "jax.jit(shard_map(two to_jax(functional)))",
            lambda: jax.block_until_ready(fwd_f(v, v2, x)),
        ),
        _timing.paired_row(
            "jax.jit(jax.grad(... two applys))",
            lambda: jax.block_until_ready(grad_m(v["params"], v2["params"], x)),
            "jax.jit(jax.grad(... two to_jax(functional)))",
            lambda: jax.block_until_ready(grad_f(v["params"], v2["params"], x)),
        ),
    ]
    title = f"MLP 64-256-8 on {DEVICES} CPU devices in shard_map, 32 rows each, two variable sets"
    print(json.dumps([title, rows]))


format_results = format_tables


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(json.loads(sys.argv[2]))
    else:
        main()
