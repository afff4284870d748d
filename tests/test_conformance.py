# OpInfo conformance (issue 14): a representative subset of torch's own operator database
# through to_jax, under every transform, against torch itself (tests/opinfo_harness.py).
# One test per (op, transform): it passes when the pair passes or does not apply (skip),
# and fails on a mismatch or a torchjax error. Most run in the float64 profile (x64 on);
# FLOAT32_OPS also run in the float32 profile (x64 off). The full sweep over all of op_db,
# in both profiles, is tools/conformance.py, whose results are in docs/conformance.md.
from __future__ import annotations

import dataclasses
import importlib.util
import json
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

# In the float32 profile (x64 off): float32 samples, integer indices reaching JAX as int32,
# integer results (argmax's int64) expected back as int32.
FLOAT32_OPS = ["sin", "matmul", "gather", "sum", "argmax", "linalg.det"]


@pytest.fixture(scope="module", autouse=True)
def x64():
    # float64 comparisons; jax.enable_x64 restores the previous setting for other modules.
    with harness.x64():
        yield


def test_subset_names_exist():
    missing = [name for name in OPS if name not in harness.ops_by_name()]
    assert not missing, f"not in torch's op_db: {missing}"


def _assert_conforms(r):
    assert r.status in (harness.PASS, harness.SKIP), (
        f"{r.op} under {r.transform} ({r.profile}): {r.status}: {r.message}"
        + ("" if r.max_abs_err is None else f" (max abs error {r.max_abs_err:.3g})")
    )


@pytest.mark.parametrize("transform", harness.TRANSFORMS)
@pytest.mark.parametrize("name", OPS)
def test_conformance(name, transform):
    r = harness.run(name, transform)
    assert r.profile == "float64"
    _assert_conforms(r)


@pytest.mark.parametrize("transform", harness.TRANSFORMS)
@pytest.mark.parametrize("name", FLOAT32_OPS)
def test_conformance_float32(name, transform):
    r = harness.run(name, transform, profile="float32")
    assert r.profile == "float32"
    _assert_conforms(r)
    assert jnp.asarray(1.0).dtype == jnp.float64  # the run restored the module's x64


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


def test_harness_compares_float32_canonical_dtypes():
    # With x64 off, a 64-bit torch output comes back narrowed, as JAX canonicalizes it; no
    # other dtype difference passes, and the values are compared after the cast.
    e = [torch.tensor([1, 2]), torch.tensor([0.5], dtype=torch.float64), torch.tensor([True])]
    a = [np.array([1, 2], np.int32), np.array([0.5], np.float32), np.array([True])]
    with harness.profile("float32") as p:
        assert p is harness.current_profile() and p.name == "float32"
        assert jnp.asarray(1.0).dtype == jnp.float32
        assert harness._compare(a, e, 1e-5, 1e-5).status == harness.PASS
        for wrong in (
            [np.array([1, 2], np.int64), *a[1:]],  # not what JAX gives with x64 off
            [np.array([1, 2], np.int16), *a[1:]],
            [np.array([1.0, 2.0], np.float32), *a[1:]],  # int64 as float32
            [a[0], np.array([0.5], np.float16), a[2]],
            [a[0], np.array([0.5 + 1e-4], np.float32), a[2]],  # beyond tolerance
            [np.array([1, 3], np.int32), *a[1:]],
            [*a[:2], np.array([1], np.int32)],  # bool as int32
        ):
            result = harness._compare(wrong, e, 1e-5, 1e-5)
            assert result.status == harness.MISMATCH, (wrong, result)
    assert harness.current_profile().name == "float64"  # the module's fixture again
    assert jnp.asarray(1.0).dtype == jnp.float64
    assert harness._compare(a, e, 1e-5, 1e-5).status == harness.MISMATCH  # x64 on: exact


def test_harness_float32_profile_samples_float32():
    # float32 samples for torch's oracle; integer inputs stay int64 for torch and reach
    # JAX as int32 (what a user with x64 off has).
    with harness.profile("float32"):
        cases, _ = harness._cases("gather", harness.current_profile())
        tensors = cases[0].tensors
        assert [t.dtype for t in tensors] == [torch.float32, torch.int64]
        assert [harness._to_jax_array(t).dtype for t in tensors] == [jnp.float32, jnp.int32]
    cases, _ = harness._cases("gather", harness.PROFILES["float64"])
    assert cases[0].tensors[0].dtype == torch.float64


def _conformance_script():
    script = pathlib.Path(__file__).resolve().parent.parent / "tools" / "conformance.py"
    spec = importlib.util.spec_from_file_location("conformance_script", script)
    conformance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conformance)
    return conformance


def test_sweep_script(tmp_path, monkeypatch):
    # tools/conformance.py end to end on two ops, with its worker process as in the sweep.
    conformance = _conformance_script()
    out, log = tmp_path / "conformance.md", tmp_path / "results.jsonl"
    argv = ["conformance.py", "--ops=exp,bernoulli", "--transforms=eager,vjp", "--jobs=1"]
    monkeypatch.setattr(sys, "argv", [*argv, f"--out={out}", f"--json={log}"])
    assert conformance.main() == 0  # no mismatch, no error: exit status 0
    text = out.read_text()
    for p in ("float64", "float32"):  # both profiles by default, a section each
        section = text.split(f"## Profile {p}")[1].split("## Profile")[0]
        assert "| eager | 1 | 0 | 0 | 1 |" in section and "| vjp | 1 | 0 | 0 | 1 |" in section
        assert f"Mismatches, {p} (0)" in section and f"Errors, {p} (0)" in section, text
    results = [json.loads(line) for line in log.read_text().splitlines()]
    for lowering in ("callback", "xla"):  # both by default; xla runs eager and vjp of these
        assert sorted((r["profile"], r["op"]) for r in results if r["lowering"] == lowering) == (
            sorted(
                (p, op) for p in ("float64", "float32") for op in ("exp", "bernoulli") for _ in "ab"
            )
        )
    xla = text.split('## lowering="xla"')[1]
    assert "| float64 | 2 | 0 | 0 | 0 | 2 |" in xla and "| float64 | 1 | 0 | 0 | 1 |" in xla, xla
    assert {
        tuple(r["lowered"]) for r in results if r["lowering"] == "xla" and r["op"] == "exp"
    } == {("aten.exp.default",)}


def test_ci_partition_covers_every_pair():
    # --ci: every (op, transform) in at least one profile, the profiles alternating over the
    # sorted ops, and vmap_grad in both.
    plan = _conformance_script()._plan(
        ["sum", "abs", "sin"], list(harness.TRANSFORMS), ["float64", "float32"], ci=True
    )
    assert len(plan) == len(set(plan)) == 3 * len(harness.TRANSFORMS) + 3
    assert {lowering for lowering, *_ in plan} == {"callback"}
    assert {(op, t) for _, _, op, t in plan} == {
        (op, t) for op in ("sum", "abs", "sin") for t in harness.TRANSFORMS
    }
    assert {op for _, p, op, t in plan if p == "float64" and t == "eager"} == {"abs", "sum"}
    assert {op for _, p, op, t in plan if p == "float32" and t == "eager"} == {"sin"}
    assert {(p, op) for _, p, op, t in plan if t == "vmap_grad"} == {
        (p, op) for p in ("float64", "float32") for op in ("sum", "abs", "sin")
    }


def test_ci_partition_lowering_xla():
    # lowering="xla" in --ci: every op under every XLA transform, in the profile its
    # callback pairs do not run in (each op meets both dtype regimes, one per lowering).
    ops, profiles = ["sum", "abs", "sin"], ["float64", "float32"]
    plan = _conformance_script()._plan(
        ops, list(harness.TRANSFORMS), profiles, ci=True, lowerings=("callback", "xla")
    )
    xla = [(p, op, t) for lowering, p, op, t in plan if lowering == "xla"]
    assert len(xla) == len(set(xla)) == 3 * len(harness.XLA_TRANSFORMS)
    assert {t for _, _, t in xla} == set(harness.XLA_TRANSFORMS)
    home = {op: p for _, p, op, t in plan if t == "eager" and _ == "callback"}
    assert all(p != home[op] for p, op, _ in xla)
    full = _conformance_script()._plan(ops, ["eager", "hessian"], profiles, False, ("xla",))
    assert sorted(full) == sorted(("xla", p, op, "eager") for p in profiles for op in ops)


# ---------------------------------------------------------------- lowering="xla"
xla_needed = pytest.mark.skipif(
    importlib.util.find_spec("torchax") is None, reason='lowering="xla" needs torchax'
)


@xla_needed
@pytest.mark.parametrize("transform", harness.XLA_TRANSFORMS)
def test_xla_lowers_and_conforms(transform):
    r = harness.run("atan2", transform, lowering="xla")
    assert (r.status, r.lowering, r.profile) == (harness.PASS, "xla", "float64"), r
    assert r.lowered == ("aten.atan2.default",) and not r.callbacks, r


@xla_needed
def test_xla_uncapturable_is_its_own_class():
    # nonzero's output shape depends on the values: lowering="xla" does not apply.
    r = harness.run("nonzero", "eager", lowering="xla")
    assert r.status == harness.UNCAPTURABLE and "nonzero" in r.message, r
    with pytest.raises(ValueError, match="unknown transform 'hessian'"):
        harness.run("sin", "hessian", lowering="xla")


@pytest.fixture
def fresh_sin():
    # The harness keeps each sample's lowered functions (one torch.export each): lowered
    # under another op table or list, they must not serve these tests.
    harness.forget("sin")
    yield
    harness.forget("sin")


def _wrong_sin_lowering(monkeypatch):
    # aten.sin lowered 0.1% off: what a wrong entry of the op table looks like.
    from torchjax._to_jax._xla import _op_table

    real = _op_table.OpTable.lowering

    def lowering(self, target):
        op = real(self, target)
        if str(target) != "aten.sin.default":
            return op
        return dataclasses.replace(op, func=lambda x: jnp.sin(x) * 1.001)

    monkeypatch.setattr(_op_table.OpTable, "lowering", lowering)


def _list_callback_ops(monkeypatch, ops):
    from torchjax._to_jax._xla import _routes

    listed = {op: _routes.OpPolicy(op, _routes.CALLBACK, "listed by the test") for op in ops}
    monkeypatch.setattr(_routes, "POLICIES", {**_routes.POLICIES, **listed})


@xla_needed
def test_xla_mismatch_names_its_culprit(monkeypatch, fresh_sin):
    _wrong_sin_lowering(monkeypatch)
    r = harness.run("sin", "vjp", lowering="xla")
    assert r.status == harness.MISMATCH and r.max_abs_err > 1e-4, r
    assert r.culprits == ("aten.sin.default",), r


@xla_needed
def test_xla_listed_op_runs_as_callback_and_is_checked(monkeypatch, fresh_sin):
    # Listed, the wrong lowering is not used (pass), and the sweep sees that it is needed.
    _wrong_sin_lowering(monkeypatch)
    _list_callback_ops(monkeypatch, {"aten.sin.default"})
    r = harness.run("sin", "eager", lowering="xla")
    assert r.status == harness.PASS and r.lowered == (), r
    assert r.callbacks == ("aten.sin.default: " + _program_listed(),), r
    assert list(r.needed) == ["aten.sin.default"] and r.needed["aten.sin.default"] > 1e-4
    assert r.unneeded == ()


@xla_needed
def test_xla_stale_entry_is_reported(monkeypatch, fresh_sin):
    # Listed, but its lowering is right: stale, and the full sweep fails on it.
    _list_callback_ops(monkeypatch, {"aten.sin.default"})
    r = harness.run("sin", "jvp", lowering="xla")
    assert r.status == harness.PASS and r.unneeded == ("aten.sin.default",) and not r.needed
    conformance = _conformance_script()
    assert conformance._stale([r]) == ["aten.sin.default"]
    assert conformance._stale([dataclasses.replace(r, callbacks=())]) == []  # in no graph


def _program_listed():
    from torchjax._to_jax._xla._routes import LISTED

    return LISTED


@pytest.mark.parametrize("name, transform", sorted(harness.WRONG_REFERENCES))
def test_the_wrong_torch_references_are_still_wrong(name, transform):
    # The sweep skips these pairs as torch's own answer is wrong: torch.func.jvp against
    # central differences (float64) and against torch's reverse mode, on the op's samples.
    assert transform == "jvp"
    (op,) = [o for o in harness.op_db if harness.op_name(o) == name]
    wrong = 0
    for sample in op.sample_inputs("cpu", torch.float64):

        def f(x, sample=sample):
            return op.op(x, *sample.args, **sample.kwargs)

        x = sample.input.detach()
        t = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(0))
        _, tangent = torch.func.jvp(f, (x,), (t,))
        eps = 1e-6
        central = (f(x + eps * t) - f(x - eps * t)) / (2 * eps)
        xr = x.clone().requires_grad_()
        out = f(xr)
        (g,) = torch.autograd.grad(out, xr, torch.ones_like(out))
        assert torch.allclose((g * t).sum(), central.sum(), atol=1e-6)  # reverse mode is right
        wrong += not torch.allclose(tangent, central, atol=1e-4)
    assert wrong, f"torch's {transform} of {name} is right now: drop it from WRONG_REFERENCES"
