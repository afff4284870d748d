"""docs/recipes.md's whole recipes, run from the page itself and checked here.

keep_freed_memory runs as the recipe says, in fresh processes. Its claim is about glibc, not
torchjax: with its three malloc settings made at run time (before JAX starts), memory a thread
frees is reused without new page faults. Each check runs in a new process because the settings
are process-wide and the arena one counts only for threads that have not allocated yet; a
process without the call is the control.

The other recipes (saving and loading variables, train and eval modes, where the time goes,
CPU threads) run their section's ```python blocks in order, in one namespace, as a reader
would paste them; the tests then check what the blocks made against references of their own
(numpy, torch called directly, the files read back), beyond the checks the page shows.
"""

import json
import logging
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest
import torch

import torchjax

RECIPES = pathlib.Path(__file__).resolve().parent.parent / "docs" / "recipes.md"

glibc_only = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the recipe is for glibc's malloc"
)


def _section(heading: str) -> str:
    """The text of docs/recipes.md under `## heading`, up to the next `## ` heading."""
    text = RECIPES.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _blocks(heading: str, language: str = "python") -> list[str]:
    blocks = re.findall(rf"^```{language}\n(.*?)^```", _section(heading), re.S | re.M)
    assert blocks, f"docs/recipes.md's {heading!r} has no {language} block"
    return blocks


def _run_section(heading: str) -> dict:
    """Run the section's python blocks in order in one namespace (as test_docs.py does)."""
    namespace: dict = {"__name__": "recipe"}
    for i, code in enumerate(_blocks(heading)):
        exec(compile(code, f"recipes.md[{heading}][block {i}]", "exec"), namespace)
    return namespace


def _recipe_function() -> str:
    """The recipe's code block, without its `if __name__ == "__main__":` example."""
    for block in re.findall(r"^```python\n(.*?)^```", RECIPES.read_text(), re.S | re.M):
        if "def keep_freed_memory" in block:
            return block.split('\nif __name__ == "__main__":')[0]
    raise AssertionError("docs/recipes.md has no keep_freed_memory block")


# A new thread allocates 64 MiB with torch, fills it (the first touch faults its pages in),
# frees it, and does the same five times more: each fill's page faults say whether the
# memory came back fresh from the kernel. torch on one thread, so the fill's faults are this
# thread's. (With the recipe, a later fill may still find new memory: another thread's
# small allocation can land in the freed block, and the heap then grows by one block more
# and stays; seen once per process at most.) Then a jitted to_jax gradient, whose numbers
# must not depend on the setting.
_PROBE = r"""
import json, resource, threading
applied = keep_freed_memory() if {call} else None
import jax, jax.numpy as jnp, torch, torchjax
torch.set_num_threads(1)
faults = []

def fill_twice():
    for _ in range(6):
        t = torch.empty(16 * 2**20)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        t.fill_(1.0)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
        del t

thread = threading.Thread(target=fill_twice)
thread.start()
thread.join()
f = torchjax.to_jax(lambda w, x: torch.tanh(x @ w).pow(2).sum())
w, x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), jnp.linspace(0.0, 2.0, 20).reshape(5, 4)
grad = jax.jit(jax.grad(f))(w, x)
print(json.dumps({{"applied": applied, "faults": faults, "grad": grad.tolist()}}))
"""


def _run(call: bool) -> dict:
    code = _recipe_function() + _PROBE.format(call=call)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@glibc_only
def test_keep_freed_memory_reuses_a_threads_freed_memory_without_page_faults():
    kept, control = _run(call=True), _run(call=False)
    assert kept["applied"] is True
    first, *later = control["faults"]
    assert first > 0 and min(later) * 2 >= first, control  # without: fresh pages every time
    first, *later = kept["faults"]
    assert first > 0 and later[-1] * 10 <= first, kept  # with: the same pages, already there
    assert sum(later) * 2 <= 5 * first, kept  # and the heap grew by two blocks at most
    # The setting changes where memory comes from, never a number.
    w = np.linspace(-1.0, 1.0, 12).reshape(4, 3)
    x = np.linspace(0.0, 2.0, 20).reshape(5, 4)
    t = np.tanh(x @ w)  # d/dw sum(tanh(x @ w) ** 2), by hand
    expected = x.T @ (2 * t * (1 - t**2))
    for result in (kept, control):
        np.testing.assert_allclose(result["grad"], expected, rtol=1e-5, atol=1e-5)


def _numpy_forward_eval(variables, x):
    """Linear -> BatchNorm1d (eval: running statistics) -> [ReLU or Dropout] -> Linear."""
    p = {k: np.asarray(v, np.float64) for k, v in variables["params"].items()}
    b = {k: np.asarray(v, np.float64) for k, v in variables["buffers"].items()}
    h = np.asarray(x, np.float64) @ p["0.weight"].T + p["0.bias"]
    h = (h - b["1.running_mean"]) / np.sqrt(b["1.running_var"] + 1e-5) * p["1.weight"]
    return h + p["1.bias"]


def test_save_and_load_recipe():
    ns = _run_section("Save and load trained variables")
    variables, state, restored = ns["variables"], ns["state"], ns["restored"]
    # What was saved was trained: three steps of running statistics and moved parameters.
    assert int(variables["buffers"]["1.num_batches_tracked"]) == 3
    assert np.abs(np.asarray(variables["buffers"]["1.running_mean"])).max() > 0
    # orbax: every leaf back, bit for bit, with its dtype, and optax's named tuples.
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    assert [type(s) for s in restored["opt_state"]] == [type(s) for s in state["opt_state"]]
    # safetensors: the same, from the flattened file.
    loaded = ns["loaded"]
    assert jax.tree.structure(loaded) == jax.tree.structure(variables)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(variables), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    # The torch module holds the variables, and its forward (eval mode) equals numpy's.
    trained, x = ns["trained"], ns["x"]
    held = trained.state_dict()
    assert set(held) == set(variables["params"]) | set(variables["buffers"])
    for name, tensor in held.items():
        group = "params" if name in variables["params"] else "buffers"
        np.testing.assert_array_equal(tensor.numpy(), np.asarray(variables[group][name]))
    assert held["1.num_batches_tracked"].dtype == torch.int64  # cast back from int32
    with torch.no_grad():
        out = trained(torch.tensor(np.asarray(x))).numpy()
    h = np.maximum(_numpy_forward_eval(variables, x), 0.0)
    p = variables["params"]
    expected = h @ np.asarray(p["3.weight"], np.float64).T + np.asarray(p["3.bias"])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    # In train mode too, torch's forward and apply's agree (the batch's statistics, and the
    # same new running statistics), and the module passed in was left in train mode.
    model, apply = ns["model"], ns["apply"]
    assert model.training
    trained.train()
    with torch.no_grad():
        torch_out = trained(torch.tensor(np.asarray(x))).numpy()
    out, buffers = apply(variables, x, mutable=True)
    np.testing.assert_allclose(out, torch_out, rtol=1e-6, atol=1e-6)
    for name, value in buffers.items():
        np.testing.assert_allclose(value, trained.state_dict()[name].numpy(), rtol=1e-6)
    # The torch-format file is a plain state_dict: the names and values of the module's.
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as tmp:
        save_file(ns["state_dict"], f"{tmp}/model.safetensors")
        reread = load_file(f"{tmp}/model.safetensors")
    assert set(reread) == set(model.state_dict())
    for name, tensor in reread.items():
        np.testing.assert_array_equal(tensor.numpy(), ns["state_dict"][name].numpy())


def _eval_reference(variables, x):
    """The train/eval recipe's model in eval mode, in numpy (dropout is the identity)."""
    p = variables["params"]
    h = _numpy_forward_eval(variables, x)
    return h @ np.asarray(p["3.weight"], np.float64).T + np.asarray(p["3.bias"], np.float64)


def test_train_eval_recipe():
    first, second = _blocks("Train mode and eval mode")
    ns: dict = {"__name__": "recipe"}
    # In train mode, predict (no mutable=True) drops the running statistics, and says so.
    with pytest.warns(torchjax.errors.StateWarning, match="running_mean"):
        exec(compile(first, "recipes.md[train/eval][block 0]", "exec"), ns)
    model, apply, predict, x = ns["model"], ns["apply"], ns["predict"], ns["x"]
    variables = ns["variables"]
    assert model.training  # the block leaves it in train mode
    assert int(variables["buffers"]["1.num_batches_tracked"]) == 1
    np.testing.assert_allclose(
        ns["in_eval_mode"], _eval_reference(variables, x), rtol=1e-5, atol=1e-5
    )
    assert not np.allclose(ns["in_train_mode"], ns["in_eval_mode"])
    # The mode is read when torch runs, per submodule: with dropout alone in eval mode, the
    # jitted predict uses the batch's statistics and drops nothing.
    try:
        model[2].eval()
        p = {k: np.asarray(v, np.float64) for k, v in variables["params"].items()}
        h = np.asarray(x, np.float64) @ p["0.weight"].T + p["0.bias"]
        h = (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5) * p["1.weight"] + p["1.bias"]
        expected = h @ p["3.weight"].T + p["3.bias"]
        np.testing.assert_allclose(predict(variables, x), expected, rtol=1e-5, atol=1e-5)
        model.eval()
        np.testing.assert_array_equal(predict(variables, x), apply(variables, x))
    finally:
        model.train()
    key = jax.random.key(3)  # train mode again: dropout draws, from the key when given
    a, b = apply(variables, x, rng=key), apply(variables, x, rng=key)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, apply(variables, x, rng=jax.random.key(4)))
    # Both modes in one program: one more training step's buffers, then eval mode on them.
    exec(compile(second, "recipes.md[train/eval][block 1]", "exec"), ns)
    variables = ns["variables"]
    assert model.training
    assert int(variables["buffers"]["1.num_batches_tracked"]) == 2
    np.testing.assert_allclose(ns["evaluated"], _eval_reference(variables, x), rtol=1e-5, atol=1e-5)


def test_where_the_time_goes_recipe():
    logger = logging.getLogger("torchjax")
    level, handlers = logger.level, list(logger.handlers)
    ns = _run_section("Where the time goes")
    lines = ns["log"].getvalue().splitlines()
    fake_runs = [line for line in lines if "fake run of Sequential.forward at" in line]
    assert len(fake_runs) == 2, lines  # one per shape; the repeated call made none
    assert "(float32[16,4],)" in fake_runs[0] and "(float32[8,4],)" in fake_runs[1]
    assert all(re.search(r" took \d+\.\d{3} s$", line) for line in fake_runs)
    assert any(line.startswith("torchjax DEBUG: tracing vjp(Sequential.forward)") for line in lines)
    # The helper leaves the logger as it found it, as does jax.log_compiles.
    assert logger.level == level and logger.handlers == handlers
    assert not jax.config.jax_log_compiles and not jax.config.jax_explain_cache_misses
    # torch.profiler: ten of each jitted torch call; the jax trace: both ranges inside the step.
    counts = {key: event.count for key, event in ns["torch_calls"].items()}
    assert set(counts.values()) == {10}, counts
    milliseconds = ns["milliseconds"]
    assert "torchjax vjp(Sequential.forward)" in milliseconds
    assert "torchjax forward kept for vjp(Sequential.forward)" in milliseconds
    assert 0 < ns["in_torch"] < ns["step"]


@pytest.mark.slow
def test_where_the_time_goes_environment_switch(tmp_path):
    # The page's command, TORCHJAX_LOG=debug python train.py, on the page's first program
    # (whose own helper logs to a StringIO; the environment's handler writes stderr).
    (command,) = _blocks("Where the time goes", "bash")
    assignment, python, script = shlex.split(command.strip())
    name, value = assignment.split("=")
    assert (name, python, script) == ("TORCHJAX_LOG", "python", "train.py")
    (tmp_path / script).write_text(_blocks("Where the time goes")[0])
    done = subprocess.run(
        [sys.executable, script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, name: value},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchjax DEBUG: fake run of Sequential.forward at" in done.stderr
    assert "torchjax DEBUG: tracing vjp(Sequential.forward)" in done.stderr


@pytest.mark.cpu_only
def test_cpu_threads_recipe(capsys):
    threads = torch.get_num_threads()
    ns = _run_section("CPU threads: torch's beside XLA's")
    assert torch.get_num_threads() == threads  # the helper put it back
    printed = capsys.readouterr().out
    assert re.search(r"torch threads 1: \d+\.\d\d ms per step", printed), printed
    # The loop trained, and the thread count changes time, never a number.
    step, loss_fn, carry = ns["step"], ns["loss_fn"], ns["carry"]
    initial = ns["variables"]["params"]
    assert float(loss_fn(carry[0])) < float(loss_fn(initial))
    results = []
    for n in (1, max(threads, 2)):
        _, after = ns["milliseconds_per_step"](step, carry, n, n_steps=2)
        results.append(after[0])
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert torch.get_num_threads() == threads
