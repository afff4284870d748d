# OpInfo conformance (issue 14): a representative subset of torch's own operator database
# through to_jax, under every transform, against torch itself (tests/opinfo_harness.py).
# One test per (op, transform): it passes when the pair passes or does not apply (skip),
# and fails on a mismatch or a torchjax error. The full sweep over all of op_db is
# tools/conformance.py, whose results are in docs/conformance.md.
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import opinfo_harness as harness
import pytest
import torch

import torchjax

pytestmark = pytest.mark.slow  # leave out with -m 'not slow'

OPS = [
    # pointwise
    "sin",
    "exp",
    "sigmoid",
    "tanh",
    "pow",
    "div.no_rounding_mode",
    "where",
    "clamp",
    "atan2",
    # reductions
    "sum",
    "mean",
    "prod",
    "amax",
    "logsumexp",
    "var",
    "norm",
    "cumsum",
    "max.reduction_with_dim",
    # linear algebra
    "matmul",
    "linalg.det",
    "linalg.slogdet",
    "logdet",
    "linalg.solve",
    "linalg.inv",
    "linalg.cholesky",
    "linalg.eigh",
    "linalg.norm",
    # nn.functional
    "nn.functional.silu",
    "nn.functional.gelu",
    "softmax",
    "log_softmax",
    "nn.functional.layer_norm",
    "nn.functional.group_norm",
    "nn.functional.mish",
    "logit",
    "nn.functional.conv1d",
    "nn.functional.linear",
    "nn.functional.mse_loss",
    # indexing
    "index_select",
    "gather",
    "index_fill",
    "index_put",
    "take_along_dim",
    "masked_fill",
    # shape
    "cat",
    "stack",
    "reshape",
    "transpose",
    "column_stack",
    "flip",
]


@pytest.fixture(scope="module", autouse=True)
def x64():
    # float64 comparisons; jax.enable_x64 restores the previous setting for other modules.
    with harness.x64():
        yield


def test_subset_names_exist():
    missing = [name for name in OPS if name not in harness.ops_by_name()]
    assert not missing, f"not in torch's op_db: {missing}"


@pytest.mark.parametrize("transform", harness.TRANSFORMS)
@pytest.mark.parametrize("name", OPS)
def test_conformance(name, transform):
    r = harness.run(name, transform)
    assert r.status in (harness.PASS, harness.SKIP), (
        f"{name} under {transform}: {r.status}: {r.message}"
        + ("" if r.max_abs_err is None else f" (max abs error {r.max_abs_err:.3g})")
    )


# ---------------------------------------------------------------- the harness can fail
# Each check above could only ever pass if the harness never reported a mismatch or an
# error; these show that it does, with to_jax replaced by a broken one.


def _broken_to_jax(change):
    real = torchjax.to_jax

    def to_jax(fn, **kwargs):
        f = real(fn, **kwargs)
        return lambda *args: jax.tree.map(change, f(*args))

    return to_jax


@pytest.mark.parametrize("transform", harness.TRANSFORMS)
def test_harness_reports_wrong_values(monkeypatch, transform):
    monkeypatch.setattr(torchjax, "to_jax", _broken_to_jax(lambda y: y * 1.001 + y**2 * 1e-3))
    r = harness.run("sin", transform)
    assert r.status == harness.MISMATCH, r
    assert r.max_abs_err is not None and r.max_abs_err > 1e-4


def test_harness_reports_wrong_shapes(monkeypatch):
    monkeypatch.setattr(torchjax, "to_jax", _broken_to_jax(lambda y: y[..., None]))
    r = harness.run("sin", "eager")
    assert r.status == harness.MISMATCH and "shape" in r.message, r


def test_harness_reports_torchjax_errors(monkeypatch):
    def to_jax(fn, **kwargs):
        def f(*args):
            raise torchjax.errors.VmapError("broken on purpose")

        return f

    monkeypatch.setattr(torchjax, "to_jax", to_jax)
    r = harness.run("exp", "jit")
    assert r == dataclasses.replace(
        r, status=harness.ERROR, message="VmapError: broken on purpose"
    ), r


def test_harness_skips_what_does_not_apply():
    assert harness.run("bernoulli", "eager").status == harness.SKIP  # random
    assert "in-place" in harness.run("zero_", "eager").message
    assert harness.run("bitwise_and", "vjp").message == "no floating tensor input"
    assert harness.run("nonzero", "eager").status == harness.PASS  # declared shapes
    # Writes its running statistics: declared by its schema, never by a version counter.
    assert harness.run("_batch_norm_with_update", "eager").message == "mutates its input"


def test_harness_compares_exactly():
    a = [np.array([1.0, np.nan, np.inf]), np.array([1, 2])]
    e = [torch.tensor([1.0, np.nan, np.inf], dtype=torch.float64), torch.tensor([1, 2])]
    assert harness._compare(a, e, 1e-6, 1e-6).status == harness.PASS
    for wrong in (
        [np.array([1.0, 0.0, np.inf]), np.array([1, 2])],  # nan vs number
        [np.array([1.0, np.nan, -np.inf]), np.array([1, 2])],  # inf of the other sign
        [np.array([1.0 + 2e-6, np.nan, np.inf]), np.array([1, 2])],  # beyond tolerance
        [np.array([1.0, np.nan, np.inf]), np.array([1, 3])],  # integers exactly
        [np.array([1.0, np.nan, np.inf]), np.array([1.0, 2.0])],  # dtype
        [np.array([1.0, np.nan, np.inf])],  # output count
    ):
        assert harness._compare(wrong, e, 1e-6, 1e-6).status == harness.MISMATCH, wrong
    assert jnp.asarray(1.0).dtype == jnp.float64  # the module's x64 fixture is on


def test_sweep_script(tmp_path, monkeypatch):
    # tools/conformance.py end to end on two ops, with its worker process as in the sweep.
    script = pathlib.Path(__file__).resolve().parent.parent / "tools" / "conformance.py"
    spec = importlib.util.spec_from_file_location("conformance_script", script)
    conformance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conformance)
    out, log = tmp_path / "conformance.md", tmp_path / "results.jsonl"
    argv = ["conformance.py", "--ops=exp,bernoulli", "--transforms=eager,vjp", "--jobs=1"]
    monkeypatch.setattr(sys, "argv", [*argv, f"--out={out}", f"--json={log}"])
    conformance.main()
    text = out.read_text()
    assert "| eager | 1 | 0 | 0 | 1 |" in text and "| vjp | 1 | 0 | 0 | 1 |" in text, text
    assert "## Mismatches (0)" in text and "## Errors (0)" in text
    assert len(log.read_text().splitlines()) == 4
