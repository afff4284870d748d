# A GPT-2 training step through module_to_jax, against torch's own step: time and memory.
#
# GPT-2 built from a config (random weights, no download), dropout off, batch 2 of 128
# tokens; the loss is next-token cross entropy. torchjax: jax.jit of value_and_grad of the
# loss computed in JAX from apply's logits, then optax.adamw's update, the params donated.
# torch: forward, the same loss, backward, torch.optim.AdamW(fused=True) (torch's fastest
# step), zero_grad(set_to_none=True). Times are paired in one process; a second pair times
# both without the optimizer (forward, loss and gradients: what the bridge does), and the
# difference of the two pairs is each optimizer's update. Memory: each side in
# a fresh process, malloc's bytes in use (glibc's mallinfo2, which torch's and XLA's CPU
# buffers both come from) at rest after two warm-up steps, and the peak sampled every
# 0.2 ms over the next steps; torchjax with copy=True (the module keeps its weights beside
# the JAX copy) and with copy="move" (one set of weights). The torch process starts JAX's
# runtime too (about 50 MiB), so that the difference is what the steps hold. The time pairs
# are measured twice: as the process starts, and with glibc told to keep the memory a step
# frees for the next (KEEP_FREED, both sides in the same process; docs/recipes.md). By
# default XLA's buffers for a step, and torch's allocations in a callback XLA runs on one of
# its worker threads, are fresh memory from the kernel on every step, and its page faults
# are kernel time torch's own step, reusing its main thread's heap, mostly does not pay. The
# full model is GPT-2's 124M configuration; compare.py --quick uses a 2-layer, 128-wide one.
#
# Usage: `python benchmarks/bench_gpt2.py --small` (the 2-layer model; optional)
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import _timing
from _timing import format_table, paired_row

# glibc: one arena for all threads, no allocation mapped on its own, no memory given back.
KEEP_FREED = (
    "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"
)
FULL = {}  # GPT2Config's defaults: 12 layers, 768 wide, 50257 tokens, 124M parameters
SMALL = {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 1000, "n_positions": 256}
BATCH, SEQ = 2, 128

_SETUP = r"""
import sys, warnings
sys.path.insert(0, {here!r})
import numpy as np, torch
warnings.filterwarnings("ignore", message=".*token_id.*")
from transformers import GPT2Config, GPT2LMHeadModel, logging as hf_logging
hf_logging.set_verbosity_error()
torch.manual_seed(0)
config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **{config!r})
model = GPT2LMHeadModel(config).train()
ids = torch.from_numpy(np.random.default_rng(0).integers(0, config.vocab_size, ({batch}, {seq})))
"""

_JAX_STEP = r"""
import jax, jax.numpy as jnp, optax, torchjax
apply, variables = torchjax.module_to_jax(model, copy={copy!r})
if {copy!r} == "move":
    del model  # what a user who hands the model over does
buffers = variables["buffers"]
ids_j = jnp.asarray(ids.numpy())
opt = optax.adamw(1e-4)

def loss(params, ids):
    logits = apply({{"params": params, "buffers": buffers}}, ids, return_dict=False,
                   use_cache=False)[0]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

def step(params, opt_state, ids):
    value, grads = jax.value_and_grad(loss)(params, ids)
    updates, opt_state = opt.update(grads, opt_state, params)
    return value, optax.apply_updates(params, updates), opt_state

step = jax.jit(step, donate_argnums=(0, 1))
state = [variables["params"], opt.init(variables["params"])]
del variables

def run():
    value, state[0], state[1] = step(state[0], state[1], ids_j)
    jax.block_until_ready(value)
    return float(value)
"""

_TORCH_STEP = r"""
import jax
jax.devices()  # JAX's runtime is loaded beside torch in both processes: the difference is the step
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

def run():
    logits = model(ids, return_dict=False, use_cache=False)[0]
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    value = -logp.gather(-1, ids[:, 1:, None]).mean()
    value.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return value.item()
"""

_MEMORY = r"""
import gc, json
from _timing import PeakInUse, malloc_in_use
losses = [run(), run()]  # compile and warm up
gc.collect()
rest = malloc_in_use()
with PeakInUse() as p:
    for _ in range({steps}):
        losses.append(run())
print(json.dumps({{"rest_mib": rest / 2**20, "peak_mib": p.peak / 2**20, "losses": losses}}))
"""


def _script(side: str, config: dict, copy: bool | str = True, steps: int = 3) -> str:
    here = str(Path(__file__).resolve().parent)
    code = _SETUP.format(here=here, config=config, batch=BATCH, seq=SEQ)
    code += _JAX_STEP.format(copy=copy) if side == "jax" else _TORCH_STEP
    return code


def _memory(side: str, config: dict, copy: bool | str = True, steps: int = 3) -> dict:
    script = _script(side, config, copy) + _MEMORY.format(steps=steps)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the {side} memory process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The gradients alone, without the optimizer: what the bridge itself does in a step.
_JAX_GRADS = r"""
grads_only = jax.jit(jax.value_and_grad(loss))

def run_grads():
    value, grads = grads_only(state[0], ids_j)
    jax.block_until_ready(grads)
    return float(value)
"""

_TORCH_GRADS = r"""
def run_grads():
    logits = model(ids, return_dict=False, use_cache=False)[0]
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    value = -logp.gather(-1, ids[:, 1:, None]).mean()
    value.backward()
    model.zero_grad(set_to_none=True)
    return value.item()
"""


def _paired_steps(config: dict) -> list:
    """Both steps in this process, timed alternately (run in a child: see measure); then
    both without their optimizers (forward, loss and gradients only)."""
    namespace: dict = {}
    exec(_script("torch", config) + _TORCH_GRADS, namespace)
    torch_run = namespace["run"]
    namespace_jax: dict = {}
    exec(_script("jax", config, copy="move") + _JAX_GRADS, namespace_jax)
    jax_run = namespace_jax["run"]
    first = (torch_run(), jax_run())  # same weights and data: the same first loss
    if abs(first[0] - first[1]) > 1e-3 * abs(first[0]):
        raise AssertionError(f"the two steps start from different losses: {first}")
    step = paired_row(
        "jax.jit(value_and_grad + optax.adamw) via module_to_jax",
        jax_run,
        "torch forward, loss, backward, AdamW(fused=True) step",
        torch_run,
    )
    grads = paired_row(
        "jax.jit(value_and_grad) via module_to_jax, no optimizer",
        namespace_jax["run_grads"],
        "torch forward, loss, backward, no optimizer",
        namespace["run_grads"],
    )
    return [step, grads]


def _timed_in_child(config: dict, tunables: str | None = None) -> list:
    # A fresh process: two GPT-2s, their optimizer states and JAX's compiled step stay out
    # of the caller's (compare.py's later benchmarks ran several times slower beside them).
    here = str(Path(__file__).resolve().parent)
    code = (
        f"import json, sys; sys.path.insert(0, {here!r}); import _timing, bench_gpt2\n"
        f"_timing.configure(repeat={_timing.REPEAT}, min_run_seconds={_timing.MIN_RUN_SECONDS})\n"
        f"print(json.dumps(bench_gpt2._paired_steps({config!r})))"
    )
    env = dict(os.environ, GLIBC_TUNABLES=tunables) if tunables else None
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"the timing process failed:\n{proc.stderr[-3000:]}")
    return [tuple(row) for row in json.loads(proc.stdout.strip().splitlines()[-1])]


def measure(small: bool | None = None) -> dict:
    if small is None:  # compare.py --quick (2 repeats): the small model
        small = _timing.REPEAT <= 2
    config = SMALL if small else FULL
    time_rows = _timed_in_child(config)
    kept_rows = _timed_in_child(config, KEEP_FREED) if sys.platform.startswith("linux") else None
    memory = {
        "torch": _memory("torch", config),
        "torchjax, copy=True": _memory("jax", config, copy=True),
        'torchjax, copy="move"': _memory("jax", config, copy="move"),
    }
    return {"small": small, "time": time_rows, "kept": kept_rows, "memory": memory}


def format_results(result: dict) -> str:
    size = "2 layers, 128 wide" if result["small"] else "124M parameters"
    title = f"GPT-2 ({size}), batch {BATCH} x {SEQ} tokens, AdamW"
    step, grads = result["time"]
    out = format_table(title, [step, grads])
    # The optimizer's part of a step: the step less its gradients, on each side.
    jax_update, torch_update = step[1] - grads[1], step[3] - grads[3]
    out += (
        f"\n\nThe optimizer's update (a step's median less its gradients' median): "
        f"optax.adamw in XLA {jax_update * 1e3:,.1f} ms, torch's AdamW(fused=True) "
        f"{torch_update * 1e3:,.1f} ms, {(jax_update - torch_update) * 1e3:+,.1f} ms of the "
        f"{(step[1] - step[3]) * 1e3:+,.1f} ms between the steps.\n"
    )
    if result.get("kept"):
        out += "\n" + format_table(
            f"{title}, glibc keeping freed memory (GLIBC_TUNABLES={KEEP_FREED})",
            list(result["kept"]),
        )
        out += "\n"
    torch_mem = result["memory"]["torch"]
    rows = [
        f"\nMemory in use (MiB), {size}, each side a fresh process:",
        "",
        "| side | at rest | peak during a step | at rest vs torch | peak vs torch |",
        "|---|---:|---:|---:|---:|",
    ]
    for side, m in result["memory"].items():
        rows.append(
            f"| {side} | {m['rest_mib']:,.0f} | {m['peak_mib']:,.0f} | "
            f"{m['rest_mib'] / torch_mem['rest_mib']:.2f}x | "
            f"{m['peak_mib'] / torch_mem['peak_mib']:.2f}x |"
        )
    return out + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="GPT-2 training step against torch's")
    parser.add_argument("--small", action="store_true", help="the 2-layer configuration")
    args = parser.parse_args(argv if argv is not None else _own_argv())
    print(format_results(measure(small=args.small)), end="")


def _own_argv() -> list[str]:
    """The command line when run as a script; none when benchmarks/run.py calls main()."""
    return sys.argv[1:] if __name__ == "__main__" else []


if __name__ == "__main__":
    main()
