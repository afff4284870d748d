"""torchjax on one device against torch on the same device: per call, vmap, grad and a
training step, in one table (what `make gpu-check` prints on a GPU machine).

Each row times the torchjax side and torch's own side alternately (_timing.paired_seconds),
each call waited for (block_until_ready / torch.cuda.synchronize), so a ratio compares whole
calls, launch overhead included. Every case first checks that both sides compute the same
numbers. `--device cpu` runs the same cases on the CPU (the smoke test does, to keep this
script working where no GPU is).

Usage:
  python benchmarks/gpu_bench.py --device cuda [--quick] [--out table.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _timing import Row, configure, format_table, paired_row

import torchjax

D, HIDDEN, BATCH, LR = 256, 512, 128, 0.01


def _sync(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _close(a, b, what: str) -> None:
    a = np.asarray(a)
    b = b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5, err_msg=what)


def _mlp(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(D, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    ).to(device)


def cases(device: torch.device, jax_device) -> list[Row]:
    sync = _sync(device)
    put = lambda a: jax.device_put(a, jax_device)  # noqa: E731
    rows = []

    # Per call: the smallest function, so the row is the bridge's own cost.
    x16_t = torch.arange(16.0, device=device)
    x16 = put(jnp.arange(16.0))
    plus_one = jax.jit(torchjax.to_jax(lambda x: x + 1))
    _close(plus_one(x16), x16_t + 1, "per call")

    def torch_plus_one():
        x16_t + 1
        sync()

    rows.append(
        paired_row(
            "jit(to_jax(x + 1)), 16 floats",
            lambda: plus_one(x16).block_until_ready(),
            "torch x + 1",
            torch_plus_one,
        )
    )

    # vmap and grad of a functional MLP.
    model = _mlp(device)
    params_t = {k: v.detach() for k, v in model.named_parameters()}
    params = {k: put(jnp.asarray(v.cpu().numpy())) for k, v in params_t.items()}
    xs_t = torch.randn(BATCH, D, device=device)
    xs = put(jnp.asarray(xs_t.cpu().numpy()))

    def one(params, x):  # [D] -> []
        return torch.func.functional_call(model, params, (x,)).squeeze(-1)

    def loss(params, xs):  # [N, D] -> []
        return (torch.func.functional_call(model, params, (xs,)) ** 2).mean()

    per_example = jax.jit(jax.vmap(torchjax.to_jax(one), in_axes=(None, 0)))
    torch_vmap = torch.func.vmap(one, in_dims=(None, 0))
    _close(per_example(params, xs), torch_vmap(params_t, xs_t), "vmap")

    def torch_per_example():
        torch_vmap(params_t, xs_t)
        sync()

    rows.append(
        paired_row(
            f"jit(vmap(to_jax(mlp))), {BATCH} examples",
            lambda: per_example(params, xs).block_until_ready(),
            "torch.func.vmap",
            torch_per_example,
        )
    )

    grad = jax.jit(jax.grad(torchjax.to_jax(loss)))
    torch_grad = torch.func.grad(loss)
    got, want = grad(params, xs), torch_grad(params_t, xs_t)
    for k in params:
        _close(got[k], want[k], f"grad {k}")

    def torch_grad_call():
        torch_grad(params_t, xs_t)
        sync()

    rows.append(
        paired_row(
            "jit(grad(to_jax(loss)))",
            lambda: jax.block_until_ready(grad(params, xs)),
            "torch.func.grad",
            torch_grad_call,
        )
    )

    # A training step: module_to_jax + SGD in JAX against the module + torch.optim.SGD.
    ys_t = torch.randn(BATCH, 1, device=device)
    ys = put(jnp.asarray(ys_t.cpu().numpy()))
    apply, variables = torchjax.module_to_jax(_mlp(device))

    def jax_loss(params, x, y):
        return jnp.mean((apply({"params": params, "buffers": variables["buffers"]}, x) - y) ** 2)

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(jax_loss)(params, x, y)
        return value, jax.tree.map(lambda p, g: p - LR * g, params, grads)

    trained = _mlp(device)
    opt = torch.optim.SGD(trained.parameters(), lr=LR)

    def torch_step():
        opt.zero_grad()
        value = torch.nn.functional.mse_loss(trained(xs_t), ys_t)
        value.backward()
        opt.step()
        sync()
        return value

    state = {"params": jax.device_put(variables["params"], jax_device)}
    _close(step(state["params"], xs, ys)[0], torch_step(), "training step loss")

    def jax_step():
        value, state["params"] = step(state["params"], xs, ys)
        value.block_until_ready()

    rows.append(paired_row("training step (module_to_jax + SGD)", jax_step, "torch", torch_step))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke run)")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.quick:
        configure(repeat=2, min_run_seconds=0.01)
    if args.device == "cuda":
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not torch.cuda.is_available() or not gpus:
            print(f"no CUDA device (torch: {torch.cuda.is_available()}, JAX: {jax.devices()})")
            return 1
        device, jax_device = torch.device("cuda", 0), gpus[0]
        where = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, jax {jax.__version__}"
    else:
        device, jax_device = torch.device("cpu"), jax.devices("cpu")[0]
        where = f"CPU, torch {torch.__version__}, jax {jax.__version__}"
    table = format_table(f"torchjax against torch on {where}", cases(device, jax_device))
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
