# A training step through module_to_jax against the same step in torch, and its memory.
#
# MLP 512-512-10, batch 256, mean squared error, SGD. torchjax: jax.jit of value_and_grad of
# a loss computed in JAX from the module's output, then the SGD update in JAX, the params
# donated (the JAX idiom for an in-place update). torch: the module's forward, the loss,
# backward and torch.optim.SGD.step. Both update the same weights from the same data
# (checked). Eager jax.value_and_grad of a wrapped torch loss is timed against torch's
# forward + backward. The forward keeps torch's graph for the VJP, so each step runs one
# forward and one backward, as torch does. Two more rows put the eager ratio in context:
# JAX's eager autodiff alone (value_and_grad of a custom_vjp that computes nothing, with the
# same arguments: one opaque call through JAX's public API, no torch), and the same loss
# written in jax.numpy, run eagerly.
#
# Peak memory: each side runs 30 steps in a fresh process after two warm-up steps (torch's
# gradients then set to None, as zero_grad leaves them), with batch 2048 so that a step's
# peak lasts long enough to be seen; a thread samples the bytes in use in malloc's heap
# (glibc's mallinfo2: torch and XLA's CPU buffers both come from it) every 0.2 ms, and the
# peak above the resting value is a step's own memory. RSS would not do: the allocator keeps
# freed pages, so RSS growth says little about what a step needs.
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import torch
from _timing import Table, format_tables, paired_row

import torchjax

BATCH, D_IN, D_HIDDEN, D_OUT, LR = 256, 512, 512, 10, 0.01
MEMORY_BATCH = 2048  # the peak-memory runs: a step long enough for its peak to be seen


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, D_HIDDEN), torch.nn.ReLU(), torch.nn.Linear(D_HIDDEN, D_OUT)
    )
    x_t, y_t = torch.randn(BATCH, D_IN), torch.randn(BATCH, D_OUT)
    return model, x_t, y_t


def _jax_step(model):
    apply, variables = torchjax.module_to_jax(model)
    buffers = variables["buffers"]

    def loss(params, x, y):
        return jnp.mean((apply({"params": params, "buffers": buffers}, x) - y) ** 2)

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree.map(lambda p, g: p - LR * g, params, grads)

    return jax.jit(step, donate_argnums=0), variables["params"]


def _torch_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(x, y):
        opt.zero_grad()
        value = torch.nn.functional.mse_loss(model(x), y)
        value.backward()
        opt.step()
        return value

    return step


def _jax_loss(params, x, y):  # the same MLP and loss in jax.numpy
    h = jax.nn.relu(x @ params["0.weight"].T + params["0.bias"])
    return jnp.mean((h @ params["2.weight"].T + params["2.bias"] - y) ** 2)


def _jax_autodiff_alone(params, x, y):
    """jax.value_and_grad of an op that computes nothing (a custom_vjp returning arrays made
    beforehand), with the wrapped loss's arguments: what JAX's eager autodiff costs by
    itself for one opaque call made through its public API."""
    value = jnp.zeros(())
    grads = {k: jnp.zeros_like(v) for k, v in params.items()}

    @jax.custom_vjp
    def nothing(params, x, y):
        return value

    def forward(params, x, y):
        return value, (params, x, y)  # residuals, as a bridge keeps its inputs

    def backward(residuals, cotangent):
        return grads, None, None

    nothing.defvjp(forward, backward)
    return jax.value_and_grad(nothing)


def measure() -> list[Table]:
    """Check both sides agree, then time them: one table of medians and ratios."""
    model, x_t, y_t = _setup()
    x, y = torchjax.tree_to_jax((x_t, y_t))
    jax_step, params = _jax_step(model)
    value, new_params = jax_step(params, x, y)
    torch_step = _torch_step(model)
    assert abs(float(value) - float(torch_step(x_t, y_t).detach())) < 1e-5
    for name, p in model.named_parameters():
        assert float(jnp.abs(new_params[name] - torchjax.tree_to_jax(p.detach())).max()) < 1e-5
    state = [new_params]  # donated: each step's params are the last one's output

    def run_jax_step():
        value, state[0] = jax_step(state[0], x, y)
        return jax.block_until_ready(value)

    params = {k: torchjax.tree_to_jax(v.detach()).copy() for k, v in model.named_parameters()}

    def wrapped_loss(params, x, y):  # torch: the whole loss
        out = torch.func.functional_call(model, params, (x,))
        return torch.nn.functional.mse_loss(out, y)

    eager = jax.value_and_grad(torchjax.to_jax(wrapped_loss))
    torch_params = {k: v.detach().requires_grad_() for k, v in model.named_parameters()}

    def torch_fwd_bwd():
        value = wrapped_loss(torch_params, x_t, y_t)
        return value, torch.autograd.grad(value, list(torch_params.values()))

    autodiff_alone = _jax_autodiff_alone(params, x, y)
    in_jax = jax.value_and_grad(_jax_loss)
    eager_cases = [  # each against torch's forward + backward
        (
            "eager jax.value_and_grad(to_jax(loss))",
            lambda: jax.block_until_ready(eager(params, x, y)),
        ),
        (
            "JAX's eager autodiff alone: value_and_grad of a custom_vjp that computes "
            "nothing, same arguments",
            lambda: jax.block_until_ready(autodiff_alone(params, x, y)),
        ),
        (
            "eager jax.value_and_grad of the same loss in jax.numpy",
            lambda: jax.block_until_ready(in_jax(params, x, y)),
        ),
    ]
    memory = _peak_memory()
    return [
        (
            f"MLP {D_IN}-{D_HIDDEN}-{D_OUT}, batch {BATCH}, MSE, SGD (a step's peak memory "
            f"in use, batch {MEMORY_BATCH}: torchjax {memory['jax']:.1f} MiB, torch "
            f"{memory['torch']:.1f} MiB, {memory['jax'] / memory['torch']:.2f}x)",
            [
                paired_row(
                    "jax.jit(value_and_grad + SGD) via module_to_jax",
                    run_jax_step,
                    "torch forward, loss, backward, SGD step",
                    lambda: torch_step(x_t, y_t),
                ),
                *[
                    paired_row(name, fn, "torch forward + backward", torch_fwd_bwd)
                    for name, fn in eager_cases
                ],
            ],
        )
    ]


_MEMORY_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import jax, bench_train as b
b.BATCH = b.MEMORY_BATCH
model, x_t, y_t = b._setup()
if {side!r} == "jax":
    import torchjax
    step, params = b._jax_step(model)
    x, y = torchjax.tree_to_jax((x_t, y_t))
    state = [params]
    def run():
        value, state[0] = step(state[0], x, y)
        jax.block_until_ready(value)
else:
    step = b._torch_step(model)
    run = lambda: step(x_t, y_t)
from _timing import PeakInUse, malloc_in_use
run(); run()  # compile and warm up: what follows is a step's own memory
model.zero_grad(set_to_none=True)  # torch's resting state between steps
base = malloc_in_use()
with PeakInUse() as p:
    for _ in range(30):
        run()
print((p.peak - base) / 2**20)
"""


def _peak_memory() -> dict[str, float]:
    here = str(Path(__file__).resolve().parent)
    out = {}
    for side in ("jax", "torch"):
        script = _MEMORY_SCRIPT.format(here=here, side=side)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        out[side] = float(proc.stdout.strip().splitlines()[-1])
    return out


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()
