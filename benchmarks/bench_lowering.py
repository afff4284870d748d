# lowering="xla" against lowering="callback" (issue 48), both against torch eager, on CPU.
#
# For each case, in one process: torch eager's forward (under torch.no_grad) and its
# forward + backward (the sum of the outputs, .backward(), the gradients w.r.t. the
# parameters, or the input for a plain function); the same through to_jax/module_to_jax
# with lowering="callback" (torch runs as a host callback) and lowering="xla" (torch.export
# per signature, each ATen op lowered to JAX ops): jax.jit of the forward, and
# jax.jit(jax.grad) of the sum of its outputs. The three of a row are called in turn, one
# call each, over and over (as _timing.paired_seconds does for two), so the ratios to torch
# eager are taken under the same conditions. Each path's output is checked against torch's
# (max abs diff, printed beside the times: a wrong result cannot hide behind a fast number).
# Compile time: the first call of a fresh wrapper under jax.jit (tracing, the fake run or
# torch.export and lowering, XLA's compilation), forward and grad each on a wrapper of its
# own, after a warm-up that pays every first-use cost in the process. Cases: an elementwise
# chain (to_jax, grad w.r.t. x), MLPs, nn.TransformerEncoderLayer (eval), and a GPT-2 built
# from a config (random weights, no download; logits only, use_cache=False): 2 layers with
# --quick, 124M otherwise, with transformers' default (SDPA) attention and with its "eager"
# attention. A path that fails is reported with its error verbatim, and for lowering="xla"
# with torchjax.lowering_report's routes (or its error). torch keeps its default threads
# (printed); XLA's CPU client uses every core.
#
# Usage: `python benchmarks/bench_lowering.py [--quick] [--only NAME ...] [--torch-threads N]`
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import _timing
import jax
import jax.numpy as jnp
import numpy as np
import torch

import torchjax

LOWERINGS = ("callback", "xla")
CHAIN_STEPS, CHAIN_SIZE = 8, 1024
GPT2_QUICK = {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_positions": 128, "vocab_size": 1000}
GPT2_FULL: dict = {}  # GPT2Config's defaults: 12 layers, 768 wide, 50257 tokens, 124M
GPT2_SHAPE_QUICK, GPT2_SHAPE_FULL = (2, 64), (1, 128)  # (batch, tokens)


def chain(x):  # [N] -> [N]
    for _ in range(CHAIN_STEPS):
        x = torch.tanh(x) * 1.1 + torch.sin(x)
    return x


class LogitsOnly(torch.nn.Module):
    """A transformers causal LM whose forward(input_ids) returns the logits alone."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):  # [B, T] int -> [B, T, vocab]
        return self.model(input_ids, use_cache=False, return_dict=False)[0]


class Case(NamedTuple):
    """A computation three ways. `torch_forward()` -> tensor (torch eager, no grad);
    `torch_grads()` -> {name: tensor} (forward, sum, backward); `build(lowering)` ->
    (forward, grads): zero-argument callables running a fresh jitted wrapper each (their
    first call compiles), returning an array and {name: array}. `report()` runs
    torchjax.lowering_report on the computation."""

    name: str
    torch_forward: Callable[[], torch.Tensor]
    torch_grads: Callable[[], dict]
    build: Callable[[str], tuple[Callable[[], Any], Callable[[], dict]]]
    report: Callable[[], Any]


def _function_case(name: str, fn: Callable, x_t: torch.Tensor) -> Case:
    x_j = jnp.asarray(x_t.numpy())

    def torch_forward():
        with torch.no_grad():
            return fn(x_t)

    def torch_grads():
        x = x_t.detach().clone().requires_grad_()
        fn(x).sum().backward()
        return {"x": x.grad}

    def build(lowering):
        forward = jax.jit(torchjax.to_jax(fn, lowering=lowering))
        wrapped = torchjax.to_jax(fn, lowering=lowering)  # its own: its own capture
        grad = jax.jit(jax.grad(lambda x: jnp.sum(wrapped(x))))
        return (lambda: forward(x_j)), (lambda: {"x": grad(x_j)})

    return Case(name, torch_forward, torch_grads, build, lambda: torchjax.lowering_report(fn, x_j))


def _module_case(name: str, module: torch.nn.Module, x_t: torch.Tensor) -> Case:
    x_j = jnp.asarray(x_t.numpy())

    def torch_forward():
        with torch.no_grad():
            return module(x_t)

    def torch_grads():
        module(x_t).sum().backward()
        grads = {n: p.grad for n, p in module.named_parameters()}
        module.zero_grad(set_to_none=True)
        return grads

    def build(lowering):
        apply, variables = torchjax.module_to_jax(module, lowering=lowering)
        forward = jax.jit(apply)
        apply_g, variables_g = torchjax.module_to_jax(module, lowering=lowering)

        def loss(params, buffers, x):
            return jnp.sum(apply_g({"params": params, "buffers": buffers}, x))

        grad = jax.jit(jax.grad(loss))
        params, buffers = variables_g["params"], variables_g["buffers"]
        return (lambda: forward(variables, x_j)), (lambda: grad(params, buffers, x_j))

    return Case(
        name, torch_forward, torch_grads, build, lambda: torchjax.lowering_report(module, x_j)
    )


def _mlp(*sizes: int, act: type[torch.nn.Module]) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers += [torch.nn.Linear(a, b)] + ([act()] if i < len(sizes) - 2 else [])
    return torch.nn.Sequential(*layers).eval()


def _gpt2(quick: bool, attention: str | None = None) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    options = {} if attention is None else {"attn_implementation": attention}
    config = GPT2Config(**(GPT2_QUICK if quick else GPT2_FULL), **options)
    batch, seq = GPT2_SHAPE_QUICK if quick else GPT2_SHAPE_FULL
    model = LogitsOnly(GPT2LMHeadModel(config)).eval()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq)))
    size = "2 layers, 128 wide, vocab 1000" if quick else "124M"
    attn = config._attn_implementation
    return _module_case(f"GPT-2 {size}, {attn} attention, {batch} x {seq} tokens", model, ids)


def cases(quick: bool) -> list[tuple[str, Callable[[], Case]]]:
    """(short name, a function building the case): built one at a time, in order."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    def seeded(make):
        def build():
            torch.manual_seed(0)
            return make()

        return build

    return [
        (
            "chain",
            seeded(
                lambda: _function_case(
                    f"chain: {CHAIN_STEPS}x tanh(x)*1.1 + sin(x), {CHAIN_SIZE:,} float32",
                    chain,
                    torch.linspace(-2, 2, CHAIN_SIZE),
                )
            ),
        ),
        (
            "mlp_small",
            seeded(
                lambda: _module_case(
                    "MLP 64-256-8 (tanh), batch 32",
                    _mlp(64, 256, 8, act=torch.nn.Tanh),
                    randn(32, 64),
                )
            ),
        ),
        (
            "mlp_512",
            seeded(
                lambda: _module_case(
                    "MLP 512x3 (ReLU), batch 256",
                    _mlp(512, 512, 512, 512, act=torch.nn.ReLU),
                    randn(256, 512),
                )
            ),
        ),
        (
            "transformer",
            seeded(
                lambda: _module_case(
                    "TransformerEncoderLayer(256, 4), eval, 4 x 128 x 256",
                    torch.nn.TransformerEncoderLayer(256, 4, batch_first=True, dropout=0.0).eval(),
                    randn(4, 128, 256),
                )
            ),
        ),
        # transformers' default attention (torch's scaled_dot_product_attention) ...
        ("gpt2", seeded(lambda: _gpt2(quick))),
        # ... and its "eager" attention (matmuls and a softmax): the same model, other ops
        ("gpt2_eager", seeded(lambda: _gpt2(quick, "eager"))),
    ]


# --------------------------------------------------------------------------------------------
# Measuring


def _block(out: Any) -> Any:
    return jax.block_until_ready(out)


def interleaved_seconds(fns: list[Callable[[], object]]) -> list[float]:
    """Median seconds per call of each of `fns`, called in turn, one call each, over and
    over: _timing.paired_seconds for any number of functions (the same run length per
    function, the same minimum number of calls)."""
    for fn in fns:
        fn()  # warm up
    clock = time.perf_counter
    times: list[list[float]] = [[] for _ in fns]
    deadline = clock() + len(fns) * _timing.REPEAT * _timing.MIN_RUN_SECONDS
    while clock() < deadline or len(times[0]) < _timing.MIN_PAIRS:
        for fn, ts in zip(fns, times, strict=True):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
    return [statistics.median(ts) for ts in times]


def _max_abs_diff(got: Any, want: torch.Tensor) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want.detach().double().numpy())))


def _grads_diff(got: dict, want: dict) -> float:
    if set(got) != set(want):
        raise AssertionError(
            f"gradient names differ: only in JAX {sorted(set(got) - set(want))}, "
            f"only in torch {sorted(set(want) - set(got))}"
        )
    return max(_max_abs_diff(got[k], want[k]) for k in want)


def _first_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = _block(fn())
    return time.perf_counter() - t0, out


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def measure_case(case: Case) -> dict:
    """Compile times, numerical checks and interleaved medians of one case."""
    want_fwd = case.torch_forward()
    want_grads = case.torch_grads()
    result: dict = {
        "name": case.name,
        "ref_fwd": float(want_fwd.abs().max()),
        "ref_grad": max(float(g.abs().max()) for g in want_grads.values()),
        "paths": {},
    }
    runners: dict[str, tuple[Callable, Callable]] = {}
    for lowering in LOWERINGS:
        path: dict = result["paths"].setdefault(lowering, {})
        try:
            forward, grads = case.build(lowering)
            path["compile_fwd"], out = _first_call(forward)
            path["diff_fwd"] = _max_abs_diff(out, want_fwd)
            path["compile_grad"], got = _first_call(grads)
            path["diff_grad"] = _grads_diff(got, want_grads)
            runners[lowering] = (lambda f=forward: _block(f())), (lambda g=grads: _block(g()))
        except Exception as e:  # reported verbatim, not raised: the other paths still run
            path["error"] = _error(e)
            if lowering == "xla":
                try:
                    path["report"] = str(case.report())
                except Exception as e2:
                    path["report"] = f"lowering_report failed too: {_error(e2)}"
    names = list(runners)
    fwd = interleaved_seconds([case.torch_forward] + [runners[n][0] for n in names])
    grad = interleaved_seconds([case.torch_grads] + [runners[n][1] for n in names])
    result["torch_fwd"], result["torch_grad"] = fwd[0], grad[0]
    for n, tf, tg in zip(names, fwd[1:], grad[1:], strict=True):
        result["paths"][n]["fwd"], result["paths"][n]["grad"] = tf, tg
    return result


def warm_up() -> None:
    """One tiny function through both lowerings, so that the first case's compile times do
    not include what any first use in a process pays (JAX's runtime, torchax's import and
    op table, torch.export's own first-use setup)."""
    x = jnp.ones(4, jnp.float32)
    for lowering in LOWERINGS:
        f = torchjax.to_jax(lambda t: torch.sin(t) + 1, lowering=lowering)
        _block(jax.jit(f)(x))
        _block(jax.jit(jax.grad(lambda x, f=f: jnp.sum(f(x))))(x))


def measure(quick: bool | None = None, only: list[str] | None = None) -> dict:
    if quick is None:  # compare.py --quick / run.py after configure(repeat=2): the small model
        quick = _timing.REPEAT <= 2
    warm_up()
    results = []
    for short, make in cases(quick):
        if only and short not in only:
            continue
        started = time.perf_counter()
        r = measure_case(make())
        r["wall"] = time.perf_counter() - started
        results.append(r)
        print(f"  ({short}: {r['wall']:.1f} s)", file=sys.stderr, flush=True)
    return {"quick": quick, "results": results}


# --------------------------------------------------------------------------------------------
# Reporting


def _us(t: float) -> str:
    return f"{t * 1e6:,.1f}"


def _cell(path: dict, key: str, base: float) -> str:
    if "error" in path:
        return "failed"
    return f"{_us(path[key])} ({path[key] / base:.2f}x)"


def _diff(path: dict, key: str) -> str:
    return "—" if "error" in path else f"{path[key]:.1e}"


def machine_lines() -> list[str]:
    return [
        f"- torch threads: {torch.get_num_threads()} (torch.get_num_threads()); "
        f"CPUs usable by this process: {len(os.sched_getaffinity(0))} of {os.cpu_count()}; "
        f"JAX devices: {', '.join(str(d) for d in jax.devices())} (XLA's CPU client uses "
        "a thread per core by default)",
        "- Load average (1, 5, 15 min) at the end: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + " (the machine is shared: other processes' CPU time slows torch's threads most)",
        f"- Versions: torch {torch.__version__}, jax {jax.__version__}, "
        f"torchjax {getattr(torchjax, '__version__', '?')}, Python {sys.version.split()[0]}",
        f"- Timing: the three of a row called in turn, one call each, for "
        f"{3 * _timing.REPEAT * _timing.MIN_RUN_SECONDS:g} s (at least {_timing.MIN_PAIRS} "
        "calls each); medians, ratios to torch eager in brackets. One warm-up call each first.",
    ]


def format_results(result: dict) -> str:
    rows = result["results"]
    out = [
        "### Forward and gradient: median µs per call (ratio to torch eager), max abs diff "
        "from torch",
        "",
        "| case | pass | torch eager | jit(callback) | jit(xla) | xla / callback | "
        "max abs diff callback | max abs diff xla | max abs torch |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cb, xla = r["paths"]["callback"], r["paths"]["xla"]
        for label, key, base, ref in (
            ("forward", "fwd", r["torch_fwd"], r["ref_fwd"]),
            ("grad", "grad", r["torch_grad"], r["ref_grad"]),
        ):
            both = "error" not in cb and "error" not in xla
            out.append(
                f"| {r['name']} | {label} | {_us(base)} | {_cell(cb, key, base)} | "
                f"{_cell(xla, key, base)} | "
                f"{f'{xla[key] / cb[key]:.2f}x' if both else '—'} | "
                f"{_diff(cb, 'diff_' + key)} | {_diff(xla, 'diff_' + key)} | {ref:.1e} |"
            )
    out += [
        "",
        "### Compile time: first call of a fresh wrapper under jax.jit, seconds",
        "",
        "| case | fwd callback | fwd xla | grad callback | grad xla |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = []
        for key in ("compile_fwd", "compile_grad"):
            for lowering in LOWERINGS:
                p = r["paths"][lowering]
                cells.append("failed" if key not in p else f"{p[key]:.2f}")
        out.append(f"| {r['name']} | {' | '.join(cells)} |")
    for r in rows:
        for lowering, p in r["paths"].items():
            if "error" in p:
                out += ["", f"**{r['name']}, lowering={lowering!r} failed:**", "", "```"]
                out += [p["error"], "```"]
                if "report" in p:
                    out += ["", "torchjax.lowering_report:", "", "```", p["report"], "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="lowering='xla' against the callback path")
    parser.add_argument("--quick", action="store_true", help="few, short repeats; small GPT-2")
    parser.add_argument(
        "--only", nargs="*", help="case names: chain mlp_small mlp_512 transformer gpt2 gpt2_eager"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch.set_num_threads(N) first (default: torch's own default, printed)",
    )
    args = parser.parse_args(argv if argv is not None else _own_argv())
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.quick:
        _timing.configure(repeat=2, min_run_seconds=0.01)
    warnings.filterwarnings("ignore", message=".*token_id.*")
    result = measure(quick=args.quick or None, only=args.only)
    size = "quick: 2 short repeats, 2-layer GPT-2" if result["quick"] else "full"
    print(f"### lowering='xla' against the callback path ({size})\n")
    print("\n".join(machine_lines()) + "\n")
    print(format_results(result), end="")


def _own_argv() -> list[str]:
    """The command line when run as a script; none when benchmarks/run.py calls main()."""
    return sys.argv[1:] if __name__ == "__main__" else []


if __name__ == "__main__":
    main()
