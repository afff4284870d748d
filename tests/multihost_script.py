"""Two JAX processes on this machine, 2 CPU devices each, one global mesh of 4 devices.

Run without arguments, it starts both worker processes (``python multihost_script.py
worker <process_id> <port>``) and exits 0 only if both exit 0 within the time limit. Each
worker joins the same coordinator (``jax.distributed.initialize``), exchanges data with
gloo (XLA's CPU collectives), and checks that a data-parallel ``jax.grad`` through a
wrapped torch function inside ``jax.shard_map`` equals the same program written in pure
JAX. XLA_FLAGS and the collectives setting must come before JAX starts, hence processes.
"""

import os
import socket
import subprocess
import sys
import time

NUM_PROCESSES = 2
LOCAL_DEVICES = 2
TIMEOUT_S = 240


def launch() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", str(i), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(NUM_PROCESSES)
    ]
    deadline = time.monotonic() + TIMEOUT_S  # one limit for both, however they finish
    codes = []
    for i, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            print(f"process {i} timed out after {TIMEOUT_S} s")
        print(f"--- process {i} (exit {proc.returncode}) ---\n{out}")
        codes.append(proc.returncode)
    return 0 if codes == [0] * NUM_PROCESSES else 1


def worker(process_id: int, port: int) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import torchjax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
        initialization_timeout=120,
    )
    assert jax.process_count() == NUM_PROCESSES
    assert len(jax.local_devices()) == LOCAL_DEVICES
    assert len(jax.devices()) == NUM_PROCESSES * LOCAL_DEVICES, jax.devices()
    mesh = jax.make_mesh((NUM_PROCESSES * LOCAL_DEVICES,), ("data",))

    # Every process makes the same global batch and keeps only its own rows.
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(3, 8)) / 2, jnp.float32),
        "b1": jnp.asarray(rng.normal(size=(8,)) / 4, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 1)) / 4, jnp.float32),
    }
    x_all = rng.normal(size=(32, 3)).astype(np.float32)
    y_all = np.sin(x_all).sum(axis=1, keepdims=True).astype(np.float32)
    rows = len(x_all) // NUM_PROCESSES
    local = slice(process_id * rows, (process_id + 1) * rows)
    sharding = NamedSharding(mesh, P("data"))
    x = jax.make_array_from_process_local_data(sharding, x_all[local], x_all.shape)
    y = jax.make_array_from_process_local_data(sharding, y_all[local], y_all.shape)
    assert not x.is_fully_addressable  # half of it lives in the other process

    def torch_mlp(p, x):
        return torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

    def jax_mlp(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

    wrapped = torchjax.to_jax(torch_mlp)

    def data_parallel_grad(mlp):
        def local_loss(p, x, y):
            return jax.lax.psum(((mlp(p, x) - y) ** 2).sum(), "data") / len(x_all)

        loss = jax.shard_map(
            local_loss, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P()
        )
        return jax.jit(jax.value_and_grad(loss))

    value_t, grad_t = data_parallel_grad(wrapped)(params, x, y)
    value_j, grad_j = data_parallel_grad(jax_mlp)(params, x, y)
    # The results are replicated: every process holds the whole value on its devices.
    local_value = lambda a: np.asarray(a.addressable_data(0))
    np.testing.assert_allclose(local_value(value_t), local_value(value_j), rtol=1e-5)
    for name in params:
        np.testing.assert_allclose(
            local_value(grad_t[name]), local_value(grad_j[name]), rtol=1e-4, atol=1e-6
        )
    assert np.abs(local_value(grad_t["w1"])).sum() > 0
    print(f"process {process_id}: multi-host data-parallel grad matches pure JAX: ok")
    jax.distributed.shutdown()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit(launch())
