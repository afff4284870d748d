# Per-call cost of module_to_jax against to_jax of the same computation, measured in one run.
#
# The baseline is to_jax of the module's forward written as a function of its parameters
# (`functional_forward(params, x)`: the same torch ops, the same arrays in and out), so a
# ratio above 1 is what module_to_jax adds: the variables plumbing, and torch's own cost of
# calling nn.Modules (hooks checks, attribute lookups), which the "native torch" row shows
# without JAX. `to_jax(functional_call)` is what wrapping the module by hand costs, and
# `to_jax(module)` with the parameters closed over runs the same module call as apply: the
# ratio against it is module_to_jax's own cost, the variables plumbing. The "least module
# bridge" (parameters set into the module by hand, nothing checked) is the floor for any
# bridge that calls the module: its ratio to functional_forward is torch's cost alone.
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from _timing import Table, format_tables, paired_row

import torchjax

SMALL = (8, 16, 32, 4)  # batch, in, hidden, out: per-call overhead dominates
LARGE = (256, 512, 512, 10)  # bench_grad.py's MLP: compute dominates


def functional_forward(params, x):  # {'0.weight': [H, D], ...}, [B, D] -> [B, O]
    h = torch.tanh(torch.nn.functional.linear(x, params["0.weight"], params["0.bias"]))
    return torch.nn.functional.linear(h, params["2.weight"], params["2.bias"])


def _least_module_bridge(net: torch.nn.Module, names: list[str]):
    """The least a bridge that runs the module itself can do: the parameters as flat
    arguments, put into the module's parameter dicts by hand (no checks, no variables
    tree), the module called, its own tensors put back. Its ratio to functional_forward is
    the floor for module_to_jax: torch's nn.Module call cost and nothing of ours."""
    slots = []
    for name in names:
        owner, _, key = name.rpartition(".")
        slots.append((net.get_submodule(owner)._parameters, key))

    def least(*tensors):
        old = [d[k] for d, k in slots]
        for (d, k), t in zip(slots, tensors, strict=False):
            d[k] = t
        try:
            return net(tensors[-1])
        finally:
            for (d, k), t in zip(slots, old, strict=True):
                d[k] = t

    return least


def measure() -> list[Table]:
    """Check both sides agree, then time them: a table of medians and ratios per size."""
    return [_measure(*SMALL, full=True), _measure(*LARGE, full=False)]


def _measure(batch: int, d_in: int, d_hidden: int, d_out: int, full: bool) -> Table:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(d_in, d_hidden), torch.nn.Tanh(), torch.nn.Linear(d_hidden, d_out)
    )
    apply, variables = torchjax.module_to_jax(net)
    params = variables["params"]
    x = jnp.linspace(-1, 1, batch * d_in, dtype=jnp.float32).reshape(batch, d_in)
    f = torchjax.to_jax(functional_forward)
    by_hand = torchjax.to_jax(lambda p, x: torch.func.functional_call(net, p, (x,)))

    # The same torch code, the module's own call, with its parameters as constants: what
    # module_to_jax adds to a module call is the variables plumbing alone.
    closed = torchjax.to_jax(lambda x: net(x))
    names = list(params)
    least = torchjax.to_jax(_least_module_bridge(net, names))
    apply_jit, f_jit, by_hand_jit = jax.jit(apply), jax.jit(f), jax.jit(by_hand)
    closed_jit, least_jit = jax.jit(closed), jax.jit(least)
    flat_params = [params[k] for k in names]
    grad_apply = jax.jit(jax.grad(lambda v, x: jnp.sum(apply(v, x) ** 2)))
    grad_f = jax.jit(jax.grad(lambda p, x: jnp.sum(f(p, x) ** 2)))
    want = f(params, x)
    assert float(jnp.abs(apply_jit(variables, x) - want).max()) < 1e-5
    assert float(jnp.abs(closed_jit(x) - want).max()) < 1e-5
    assert float(jnp.abs(least_jit(*flat_params, x) - want).max()) < 1e-5
    got, ref = grad_apply(variables, x)["params"], grad_f(params, x)
    err = max(float(jnp.abs(got[k] - ref[k]).max() / (jnp.abs(ref[k]).max() + 1)) for k in ref)
    assert err < 1e-5, err

    params_t = {k: v.detach() for k, v in net.named_parameters()}
    x_t = torch.tensor(jax.device_get(x))

    def native_module():
        with torch.no_grad():
            return net(x_t)

    def native_functional():
        with torch.no_grad():
            return functional_forward(params_t, x_t)

    def run_apply_jit():
        return apply_jit(variables, x).block_until_ready()

    base_name = "to_jax(functional_forward)"
    rows = [
        paired_row(
            "jax.jit(apply)",
            run_apply_jit,
            f"jax.jit({base_name})",
            lambda: f_jit(params, x).block_until_ready(),
        ),
        paired_row(
            "jax.jit(jax.grad(loss of apply))",
            lambda: jax.block_until_ready(grad_apply(variables, x)),
            f"jax.jit(jax.grad(loss of {base_name}))",
            lambda: jax.block_until_ready(grad_f(params, x)),
        ),
    ]
    if full:
        rows += [
            paired_row(
                "apply eager",
                lambda: apply(variables, x).block_until_ready(),
                f"{base_name} eager",
                lambda: f(params, x).block_until_ready(),
            ),
            paired_row(
                "jax.jit(apply)",
                run_apply_jit,
                "jax.jit(to_jax(functional_call))",
                lambda: by_hand_jit(params, x).block_until_ready(),
            ),
            paired_row(
                "jax.jit(apply)",
                run_apply_jit,
                "jax.jit(to_jax(module)) (its parameters closed over)",
                lambda: closed_jit(x).block_until_ready(),
            ),
            paired_row(
                "apply eager",
                lambda: apply(variables, x).block_until_ready(),
                "to_jax(module) eager (its parameters closed over)",
                lambda: closed(x).block_until_ready(),
            ),
            paired_row(
                "jax.jit(to_jax(least module bridge))",
                lambda: least_jit(*flat_params, x).block_until_ready(),
                f"jax.jit({base_name})",
                lambda: f_jit(params, x).block_until_ready(),
            ),
            paired_row(
                "native torch: module(x)",
                native_module,
                "native torch: functional_forward(params, x)",
                native_functional,
            ),
        ]
    return (f"nn.Sequential MLP {d_in}-{d_hidden}-{d_out}, batch {batch}", rows)


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()
