"""What a user can watch: the "torchjax" logger (TORCHJAX_LOG) and the profiler ranges every
torch call is recorded under, in torch.profiler's and jax.profiler's traces."""

from __future__ import annotations

import glob
import importlib.util
import logging
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax

pytestmark = pytest.mark.core


def test_debug_log_reports_fake_runs_traces_and_copies(caplog):
    def energy(x):  # [3] -> []
        return torch.sin(x).sum()

    f = torchjax.to_jax(energy)
    bn = torch.nn.BatchNorm1d(3).train()  # forward writes its running statistics
    apply, variables = torchjax.module_to_jax(bn)
    with caplog.at_level(logging.DEBUG, logger="torchjax"):
        jax.jit(jax.grad(f))(jnp.ones(3))
        apply(variables, jnp.ones((4, 3)), mutable=True)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "torchjax")
    assert "fake run of test_debug_log_reports_fake_runs_traces_and_copies.<locals>.energy" in text
    assert "at ((float32[3],), {}) took" in text
    assert "tracing vjp(" in text and "energy" in text
    assert "copies of 3 buffers" in text


def test_silent_by_default(caplog):
    f = torchjax.to_jax(lambda x: x * 2)
    with caplog.at_level(logging.WARNING):
        jax.jit(f)(jnp.ones(2))
    assert not [r for r in caplog.records if r.name == "torchjax"]


def test_environment_switch_turns_it_on():
    code = (
        "import jax, jax.numpy as jnp, torch, torchjax\n"
        "jax.jit(torchjax.to_jax(lambda x: x * 2))(jnp.ones(2))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "TORCHJAX_LOG": "debug"},
    )
    assert done.returncode == 0, done.stderr
    # (INFO in place of DEBUG where the fake run took over 2 s: a loaded machine)
    assert re.search(
        r"torchjax (DEBUG|INFO): fake run of <lambda> at \(\(float32\[2\],\), \{\}\) took",
        done.stderr,
    ), done.stderr


def _ranges(events) -> list[str]:
    return [e.name for e in events if e.name.startswith("torchjax ")]


def test_torch_profiler_shows_eager_and_jitted_calls_as_named_ranges():
    def energy(x):  # [3] -> []
        return torch.sin(x).sum()

    f = torchjax.to_jax(energy)
    grad = jax.jit(jax.grad(f))
    x = jnp.ones(3)
    grad(x)  # compiled before the trace
    with torch.profiler.profile() as prof:
        f(x)
        grad(x).block_until_ready()
    names = _ranges(prof.events())
    eager = (
        "torchjax test_torch_profiler_shows_eager_and_jitted_calls_as_named_ranges.<locals>.energy"
    )
    assert eager in names, names
    assert any(n.startswith("torchjax vjp(") for n in names), names  # the jitted backward
    with torch.profiler.profile() as prof:
        pass
    assert not _ranges(prof.events())
    # No profiler: no range is entered (record_function would be seen by a later trace).
    np.testing.assert_allclose(f(x), 3 * np.sin(1.0), rtol=1e-6)


def test_jax_profiler_trace_holds_the_ranges(tmp_path):
    def cosines(x):  # [3] -> []
        return torch.cos(x).sum()

    f = torchjax.to_jax(cosines)
    jitted = jax.jit(f)
    x = jnp.ones(3)
    jitted(x)
    with jax.profiler.trace(str(tmp_path)):
        jitted(x).block_until_ready()  # the jitted call's host callback alone
    files = glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)
    assert files
    data = b"".join(open(p, "rb").read() for p in files)
    assert ("torchjax " + cosines.__qualname__).encode() in data


@pytest.mark.skipif(
    importlib.util.find_spec("torchax") is None, reason="lowering='xla' needs torchax ([xla])"
)
def test_lowered_calls_are_named_ranges_and_their_errors_start_at_the_call():
    """lowering="xla"'s wrapper does what to_jax's does: a named range in a profiler that
    records, and an error's traceback that starts at the user's call, not in torchjax."""

    def energy(x):  # [3] -> []
        return torch.sin(x).sum()

    f = torchjax.to_jax(energy, lowering="xla")
    x = jnp.ones(3)
    f(x)  # captured before the trace
    with torch.profiler.profile() as prof:
        f(x)
    assert "torchjax " + energy.__qualname__ in _ranges(prof.events())
    with pytest.raises(torchjax.errors.StaticArgumentError) as info:
        f(x, {1})
    frames = [str(entry.path) for entry in info.traceback]
    assert not any("/torchjax/" in p for p in frames), frames  # (JAX filters them)
