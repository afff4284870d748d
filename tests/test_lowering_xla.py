"""lowering="xla": torch functions and modules as JAX ops (torch.export + torchax's op table),
compared with torch and torch.func computing the same thing, under every transform."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.test_util import check_grads

import torchjax
from torchjax.errors import (
    ArgumentError,
    InPlaceMutationError,
    LoweringError,
    StateWarning,
    StaticArgumentError,
)

# Not imported here: collecting this file must not import the op table (its import is what
# the last tests check).
if importlib.util.find_spec("torchax") is None:
    pytest.skip("lowering='xla' needs torchax (the [xla] extra)", allow_module_level=True)

rng = np.random.default_rng(0)


def _no_callback(fn, *args) -> None:
    """Assert the jaxpr of fn(*args) runs no torch code: only JAX ops."""
    text = str(jax.make_jaxpr(fn)(*args))
    assert "torch_call" not in text and "callback" not in text, text


def _t(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a))


def poly(x, w):  # [N, 3], [3, 2] -> [N]
    return (torch.tanh(x @ w) * torch.sin(x).sum(-1, keepdim=True)).sum(-1) + x.pow(2).mean()


X = rng.standard_normal((4, 3)).astype(np.float32)
W = rng.standard_normal((3, 2)).astype(np.float32)


# -- a function --------------------------------------------------------------------------
def test_function_equals_torch_eager_and_jit():
    f = torchjax.to_jax(poly, lowering="xla")
    ref = poly(_t(X), _t(W)).numpy()
    np.testing.assert_allclose(f(X, W), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(X, W), ref, rtol=1e-5, atol=1e-6)
    _no_callback(f, X, W)


def test_function_grad_equals_torch_func():
    f = torchjax.to_jax(poly, lowering="xla")
    loss = lambda x, w: f(x, w).sum()  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(X, W)
    ref = torch.func.grad(lambda x, w: poly(x, w).sum(), argnums=(0, 1))(_t(X), _t(W))
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r.numpy(), rtol=1e-5, atol=1e-6)
    _no_callback(jax.grad(loss), X, W)


def test_function_vmap_jvp_hessian_equal_torch_func():
    f = torchjax.to_jax(poly, lowering="xla")
    xs = rng.standard_normal((5, 4, 3)).astype(np.float32)
    np.testing.assert_allclose(
        jax.vmap(f, in_axes=(0, None))(xs, W),
        torch.func.vmap(poly, in_dims=(0, None))(_t(xs), _t(W)).numpy(),
        rtol=1e-5,
        atol=1e-6,
    )
    t = rng.standard_normal((4, 3)).astype(np.float32)
    _, tangent = jax.jvp(lambda x: f(x, W), (X,), (t,))
    _, ref = torch.func.jvp(lambda x: poly(x, _t(W)), (_t(X),), (_t(t),))
    np.testing.assert_allclose(tangent, ref.numpy(), rtol=1e-5, atol=1e-5)
    scalar = lambda x: f(x, W).sum()  # noqa: E731
    hess = jax.jit(jax.hessian(scalar))(X)
    ref = torch.func.hessian(lambda x: poly(x, _t(W)).sum())(_t(X))
    np.testing.assert_allclose(hess, ref.numpy(), rtol=1e-4, atol=1e-5)
    _no_callback(jax.hessian(scalar), X)
    _no_callback(jax.vmap(f, in_axes=(0, None)), xs, W)


def test_function_check_grads_float64(x64):
    f = torchjax.to_jax(poly, lowering="xla")
    x, w = X.astype(np.float64), W.astype(np.float64)
    check_grads(lambda x, w: f(x, w), (x, w), order=2, modes=("fwd", "rev"))


def test_pytrees_static_leaves_and_python_numbers():
    def fn(d, scale, *, power):  # {'a': [3], 'b': [3]} -> ({'s': [3]}, 2)
        return {"s": (d["a"] * scale + d["b"]) ** power}, 2

    f = torchjax.to_jax(fn, lowering="xla")
    a, b = np.arange(3.0, dtype=np.float32), np.ones(3, np.float32)
    out, two = jax.jit(f, static_argnums=1, static_argnames="power")({"a": a, "b": b}, 1.5, power=2)
    np.testing.assert_allclose(out["s"], (a * 1.5 + b) ** 2)
    assert int(two) == 2 and isinstance(two, jax.Array)


def test_int32_indices_with_x64_off(x64_off):
    def fn(table, idx):  # [10, 4], int32[6] -> [6, 4]
        return torch.nn.functional.embedding(idx, table) * 2 + table[idx].sum()

    table = rng.standard_normal((10, 4)).astype(np.float32)
    idx = np.array([1, 3, 3, 0, 9, 2], np.int32)
    f = torchjax.to_jax(fn, lowering="xla")
    ref = fn(_t(table), _t(idx).long()).numpy()
    np.testing.assert_allclose(jax.jit(f)(table, idx), ref, rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda t: f(t, idx).sum())(table)
    tt = _t(table).requires_grad_()
    fn(tt, _t(idx).long()).sum().backward()
    np.testing.assert_allclose(g, tt.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_integer_outputs_follow_the_x64_policy(x64_off):
    f = torchjax.to_jax(lambda x: (x.argmax(-1), x.sum()), lowering="xla")
    idx, s = f(X)
    assert idx.dtype == jnp.int32  # torch's int64, as JAX holds it with x64 off
    np.testing.assert_array_equal(idx, _t(X).argmax(-1).numpy())


# -- ops without a lowering: torch kernels as callbacks ----------------------------------
@torch.library.custom_op("torchjax_test::cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    return x**3


@cube.register_fake
def _(x):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


cube.register_autograd(lambda ctx, g: g * 3 * ctx.saved_tensors[0] ** 2, setup_context=_setup)


def with_custom_op(x):  # [N] -> []
    return torch.sin(cube(x)).sum() + x.mean()


def test_custom_op_runs_as_a_callback_under_jit_and_grad():
    f = torchjax.to_jax(with_custom_op, lowering="xla")
    x = np.linspace(-1, 1, 5).astype(np.float32)
    tx = _t(x).requires_grad_()
    ref = with_custom_op(tx)
    ref.backward()
    np.testing.assert_allclose(jax.jit(f)(x), ref.item(), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), tx.grad.numpy(), rtol=1e-5)
    assert "torch_call" in str(jax.make_jaxpr(f)(x))  # the custom op, and only it
    report = torchjax.lowering_report(with_custom_op, x)
    assert [r.op for r in report.callbacks] == ["torchjax_test.cube.default"]
    assert "no lowering" in report.callbacks[0].why
    assert {r.op for r in report.ops if r.lowered} >= {"aten.sin.default", "aten.mean.default"}
    assert not report.exportable and "host_callback" in report.export_error
    assert "torchjax_test.cube.default" in str(report)


def test_report_of_a_fully_lowered_module_with_symbolic_batch():
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    (b,) = jax.export.symbolic_shape("b")
    report = torchjax.lowering_report(mlp, jax.ShapeDtypeStruct((b, 3), jnp.float32))
    assert report.fully_lowered and report.exportable, str(report)
    assert {r.op for r in report.ops} >= {"aten.relu.default"}


def test_random_ops_in_to_jax_draw_from_torchs_generator():
    def noisy(x):
        return x + torch.rand_like(x)

    f = torchjax.to_jax(noisy, lowering="xla")
    x = np.zeros(4, np.float32)
    torch.manual_seed(3)
    got = f(x)
    torch.manual_seed(3)
    np.testing.assert_allclose(got, torch.rand(4).numpy())  # the same draws as torch
    report = torchjax.lowering_report(noisy, x)
    assert any("random op" in r.why for r in report.callbacks), str(report)


# -- a module -----------------------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(4, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.ln = torch.nn.LayerNorm(16)
        self.drop = torch.nn.Dropout(0.5)
        self.l2 = torch.nn.Linear(16, 3)

    def forward(self, x):  # [B, 4] -> [B, 3]
        return self.l2(self.drop(self.ln(torch.relu(self.bn(self.l1(x))))))


def _block(train: bool) -> Block:
    torch.manual_seed(0)
    m = Block()
    m.bn.running_mean.uniform_()
    return m.train(train)


XB = rng.standard_normal((8, 4)).astype(np.float32)


def test_module_eval_equals_torch_under_every_transform():
    m = _block(False)
    apply, v = torchjax.module_to_jax(m, lowering="xla")
    np.testing.assert_allclose(jax.jit(apply)(v, XB), m(_t(XB)).detach().numpy(), atol=1e-5)
    names = dict(m.named_parameters())
    params = {k: _t(np.asarray(a)) for k, a in v["params"].items()}
    buffers = {k: _t(np.asarray(a)) for k, a in v["buffers"].items()}

    def torch_loss(p, x):
        return torch.func.functional_call(m, {**p, **buffers}, (x,)).pow(2).sum()

    jax_loss = lambda p, x: (apply({"params": p, "buffers": v["buffers"]}, x) ** 2).sum()  # noqa: E731
    got = jax.jit(jax.grad(jax_loss))(v["params"], XB)
    ref = torch.func.grad(torch_loss)(params, _t(XB))
    assert set(got) == set(names)
    for k in names:
        np.testing.assert_allclose(got[k], ref[k].numpy(), rtol=1e-4, atol=1e-5)
    xs = rng.standard_normal((3, 8, 4)).astype(np.float32)
    np.testing.assert_allclose(
        jax.vmap(apply, in_axes=(None, 0))(v, xs),
        torch.func.vmap(lambda x: m(x))(_t(xs)).detach().numpy(),
        atol=1e-5,
    )
    x_loss = lambda x: (apply(v, x) ** 2).sum()  # noqa: E731
    hess = jax.hessian(x_loss)(XB[:2])
    ref = torch.func.hessian(lambda x: m(x).pow(2).sum())(_t(XB[:2]))
    np.testing.assert_allclose(hess, ref.detach().numpy(), rtol=1e-4, atol=1e-4)
    _, tangent = jax.jvp(lambda x: apply(v, x), (XB,), (XB,))
    _, ref = torch.func.jvp(lambda x: m(x), (_t(XB),), (_t(XB),))
    np.testing.assert_allclose(tangent, ref.detach().numpy(), atol=1e-5)
    _no_callback(jax.grad(jax_loss), v["params"], XB)


def test_module_train_mode_buffers_and_dropout_key():
    m = _block(True)
    apply, v = torchjax.module_to_jax(m, lowering="xla")
    key = jax.random.key(0)
    out, new = apply(v, XB, mutable=True, rng=key)
    ref = _block(True)
    ref.drop.p = 0.0  # the masks differ (JAX's generator); the statistics do not
    ref(_t(XB))
    for name, t in ref.named_buffers():
        np.testing.assert_allclose(new[name], t.numpy(), rtol=1e-5, atol=1e-6)
    same, _ = apply(v, XB, mutable=True, rng=key)
    other, _ = apply(v, XB, mutable=True, rng=jax.random.key(1))
    np.testing.assert_array_equal(out, same)
    assert not np.allclose(out, other)
    assert np.asarray(v["buffers"]["bn.num_batches_tracked"]) == 0  # the caller's, unchanged
    with pytest.warns(StateWarning, match="bn.running_mean"):
        apply(v, XB, rng=key)  # mutable=False: the writes are dropped, and said so
    _no_callback(lambda v, x: apply(v, x, mutable=True, rng=key), v, XB)


def test_three_optax_steps_equal_three_torch_optim_steps():
    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    x, y = XB, rng.standard_normal((8, 1)).astype(np.float32)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(_t(x)), _t(y)).backward()
        opt.step()
    apply, v = torchjax.module_to_jax(make(), lowering="xla")
    tx = optax.adam(0.05)
    params, state = v["params"], tx.init(v["params"])

    @jax.jit
    def step(params, state):
        loss = lambda p: jnp.mean((apply({"params": p, "buffers": {}}, x) - y) ** 2)  # noqa: E731
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(3):
        params, state = step(params, state)
    for name, t in model.named_parameters():
        np.testing.assert_allclose(params[name], t.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_tiny_transformers_model_lowers_and_matches_torch():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=50, use_cache=False
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    # A batch of 2: torch's decomposition of SDPA gives its output other strides than the
    # capture saw, and a view of it in GPT-2's attention fails replaying the graph unless
    # the capture turns views into reshapes.
    ids = np.array([[1, 5, 7, 9, 2, 3], [4, 4, 8, 0, 1, 6]], np.int32)
    apply, v = torchjax.module_to_jax(Logits(), lowering="xla")
    ref = model(input_ids=_t(ids).long()).logits
    np.testing.assert_allclose(jax.jit(apply)(v, ids), ref.detach().numpy(), rtol=1e-4, atol=1e-4)
    report = torchjax.lowering_report(apply, v, ids)
    assert report.ops and all(r.lowered for r in report.ops), str(report)
    model.zero_grad()
    ref.square().mean().backward()
    got = jax.jit(jax.grad(lambda v: jnp.mean(apply(v, ids) ** 2)))(v)["params"]
    for name, t in model.named_parameters():
        np.testing.assert_allclose(got[f"model.{name}"], t.grad.numpy(), rtol=1e-3, atol=1e-5)


# -- semantics shared with the callback path ----------------------------------------------
def test_in_place_write_into_an_input_is_refused():
    f = torchjax.to_jax(lambda x: x.mul_(2), lowering="xla")
    x = np.ones(3, np.float32)
    with pytest.raises(InPlaceMutationError, match=r"args\[0\]"):
        f(x)
    np.testing.assert_array_equal(x, 1)


def test_python_branch_on_a_value_names_the_frame_and_the_fix():
    def branchy(x):
        if x.sum() > 0:  # a value decides what runs
            return x * 2
        return x

    f = torchjax.to_jax(branchy, lowering="xla")
    with pytest.raises(LoweringError, match='lowering="callback"') as info:
        f(np.ones(3, np.float32))
    assert "test_lowering_xla.py" in str(info.value) and "if x.sum() > 0" in str(info.value)


def test_the_users_own_exception_stays_theirs():
    def checks(x):
        if x.shape[0] != 4:
            raise ValueError("expected 4 rows")
        return x

    with pytest.raises(ValueError, match="expected 4 rows") as info:
        torchjax.to_jax(checks, lowering="xla")(np.ones(3, np.float32))
    assert not isinstance(info.value, LoweringError)


def test_options_are_checked():
    with pytest.raises(ArgumentError, match="lowering='fast' is not one of"):
        torchjax.to_jax(torch.sin, lowering="fast")
    with pytest.raises(ArgumentError, match="lowering="):
        torchjax.module_to_jax(torch.nn.Linear(2, 2), lowering="XLA")
    f = torchjax.to_jax(lambda x, s: x * len(s), lowering="xla")
    with pytest.raises(StaticArgumentError, match=r"args\[1\] is a set"):
        f(np.ones(2, np.float32), {1, 2})


def test_a_later_change_to_a_closed_over_tensor_is_not_seen():
    # The program holds a private copy of what the function closes over (a function of its
    # inputs), and the caller's tensor is never written.
    w = torch.ones(3)
    f = torchjax.to_jax(lambda x: x * w, lowering="xla")
    np.testing.assert_array_equal(f(np.ones(3, np.float32)), 1)
    w.mul_(5)
    np.testing.assert_array_equal(f(np.ones(3, np.float32)), 1)


# -- serving: jax.export with symbolic shapes, run where torch cannot be imported ----------
_SERVE = """
import sys
sys.modules["torch"] = None  # `import torch` fails in this process
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("torch imported")
import numpy as np
from jax import export
exported = export.deserialize(open(sys.argv[1], "rb").read())
x = np.load(sys.argv[2])
np.save(sys.argv[3], np.asarray(exported.call(x)))
"""


@pytest.mark.slow
def test_exported_mlp_serves_another_batch_size_without_torch(tmp_path):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    apply, v = torchjax.module_to_jax(mlp, lowering="xla")
    (b,) = jax.export.symbolic_shape("b")
    exported = jax.export.export(jax.jit(lambda x: apply(v, x)))(
        jax.ShapeDtypeStruct((b, 3), jnp.float32)
    )
    (tmp_path / "mlp.bin").write_bytes(exported.serialize())
    x = rng.standard_normal((11, 3)).astype(np.float32)  # b=11: a size never traced
    np.save(tmp_path / "x.npy", x)
    env = {k: val for k, val in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_SERVE),
            *(str(tmp_path / n) for n in ("mlp.bin", "x.npy", "y.npy")),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(
        np.load(tmp_path / "y.npy"), mlp(_t(x)).detach().numpy(), rtol=1e-5, atol=1e-6
    )


def test_a_symbolic_expression_is_refused_with_the_fix():
    f = torchjax.to_jax(lambda x: x * 2, lowering="xla")
    (b,) = jax.export.symbolic_shape("b")
    with pytest.raises(LoweringError, match="2\\*b"):
        jax.eval_shape(f, jax.ShapeDtypeStruct((2 * b,), jnp.float32))


# -- import stays free of side effects -----------------------------------------------------
_IMPORT = """
import os, torch, torch._decomp, jax
def settings():
    tables = torch._decomp.global_decomposition_table
    return (torch.backends.mha.get_fastpath_enabled(),
            os.environ.get("ENABLE_RUNTIME_UPTIME_TELEMETRY"),
            {k: len(v) for k, v in tables.items()},
            torch._C._get_privateuse1_backend_name(), hasattr(torch, "jax"),
            jax.config.jax_pjrt_client_create_options)
before = settings()
import torchjax, numpy as np
assert "torchax" not in __import__("sys").modules  # import torchjax does not import it
torchjax.to_jax(torch.sin, lowering="xla")(np.ones(2, np.float32))
assert "torchax" in __import__("sys").modules
after = settings()
assert before == after, (before, after)
compiled = torch.compile(lambda x: x.cos() * 2)  # torch.compile still works
assert torch.allclose(compiled(torch.ones(2)), torch.ones(2).cos() * 2)
print("ok")
"""


@pytest.mark.slow
def test_the_op_tables_import_leaves_global_settings_as_they_were():
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@pytest.mark.slow
def test_sharded_inputs_partition_on_four_devices():
    script = os.path.join(os.path.dirname(__file__), "lowering_multidevice_script.py")
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data parallel: ok" in result.stdout and "tensor parallel: ok" in result.stdout


def test_capture_leaves_no_fake_tensor_in_a_cache_filled_on_first_use():
    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cache = None

        def forward(self, x):  # [3] -> [3]
            if self.cache is None:
                self.cache = torch.cos(x).clone()
            return x * self.cache

    c = Cached()
    f = torchjax.to_jax(lambda x: c(x), lowering="xla")
    x = np.linspace(0, 1, 3).astype(np.float32)
    np.testing.assert_allclose(jax.jit(f)(x), x * np.cos(x), rtol=1e-6)
    assert c.cache is None  # torch.export's fake tensors never reach the user's module


@functools.lru_cache
def _sin_table(n: int) -> torch.Tensor:
    return torch.sin(torch.arange(n, dtype=torch.float32))


class _SinScaled(torch.nn.Module):
    def forward(self, x):  # [n] -> [n]
        return x * _sin_table(x.shape[0])


@pytest.mark.parametrize("kind", ["to_jax", "module_to_jax"])
def test_capture_leaves_no_fake_tensor_in_an_lru_cache(kind):
    # torch.export fills the cache with its fake tensor; plain torch must get a real one
    # after (the callback path: tests/test_state_isolation.py).
    _sin_table.cache_clear()
    x = np.linspace(0.5, 2.0, 5).astype(np.float32)
    if kind == "to_jax":
        got = jax.jit(torchjax.to_jax(lambda x: x * _sin_table(x.shape[0]), lowering="xla"))(x)
    else:
        apply, v = torchjax.module_to_jax(_SinScaled(), lowering="xla")
        got = jax.jit(apply)(v, x)
    np.testing.assert_allclose(got, x * np.sin(np.arange(5.0)), rtol=1e-6)
    assert type(_sin_table(5)) is torch.Tensor
    np.testing.assert_allclose(_sin_table(5).numpy(), np.sin(np.arange(5.0)), rtol=1e-6)


def test_a_moved_module_and_a_pickled_apply():
    import pickle

    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))  # noqa: E731
    m, ref = make(), make()
    ref.load_state_dict(m.state_dict())
    apply, v = torchjax.module_to_jax(m, copy="move", lowering="xla")
    x = rng.standard_normal((5, 3)).astype(np.float32)
    out, new = apply(v, x, mutable=True)
    np.testing.assert_allclose(out, ref(_t(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["1.running_var"], ref[1].running_var.numpy(), rtol=1e-6)
    lin = torch.nn.Linear(3, 2)
    apply, v = torchjax.module_to_jax(lin, lowering="xla")
    again = pickle.loads(pickle.dumps(apply))
    np.testing.assert_allclose(again(v, x), lin(_t(x)).detach().numpy(), rtol=1e-6, atol=1e-6)
    _no_callback(again, v, x)


def test_attention_in_projection_stays_one_dot():
    # Decomposed, MultiheadAttention's in-projection (a linear on a transposed 3-D input)
    # became expand + bmm over a broadcast weight: 7x slower than torch (docs/benchmarks.md).
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    layer.eval()
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    apply, v = torchjax.module_to_jax(layer, lowering="xla")
    with torch.no_grad():
        ref = layer(_t(x)).numpy()
    np.testing.assert_allclose(jax.jit(apply)(v, x), ref, rtol=1e-4, atol=1e-5)
    ops = {r.op for r in torchjax.lowering_report(apply, v, x).ops}
    assert "aten.linear.default" in ops and "aten.expand.default" not in ops, ops


def test_int64_arithmetic_with_x64_off_is_named_and_exact_with_x64_on():
    def scaled_total(t):  # int32[3] -> int64[]
        return (t.to(torch.int64) * 4).sum()

    x = np.full(3, 2**30, np.int32)
    with jax.enable_x64(False):
        report = torchjax.lowering_report(scaled_total, x)
    assert {"aten.mul.Tensor", "aten.sum.dim_IntList"} <= set(report.narrowed), str(report)
    assert "wraps past 2**31" in str(report)
    with jax.enable_x64(True):
        got = torchjax.to_jax(scaled_total, lowering="xla")(x)
        assert not torchjax.lowering_report(scaled_total, x).narrowed
    assert got.dtype == jnp.int64 and int(got) == scaled_total(_t(x)).item() == 12 * 2**30


def test_int64_arithmetic_bounded_by_sizes_is_not_named():
    # Position ids as transformers make them: an arange plus an offset, a cumsum of a mask
    # of ones, minus one. Their values stay below the sequence length; only arithmetic on
    # an input's values (unbounded but by int32's range) may wrap.
    def positions(ids, offset):  # int32[2, 8], int -> int64[2, 8]
        mask = torch.ones_like(ids)
        from_mask = mask.long().cumsum(-1) - 1
        return torch.arange(ids.shape[1]) + offset + from_mask

    def scaled(ids, offset):
        return positions(ids, offset) + ids.long() * 3

    ids = np.arange(16, dtype=np.int32).reshape(2, 8)
    with jax.enable_x64(False):
        assert not torchjax.lowering_report(positions, ids, 5).narrowed
        np.testing.assert_array_equal(
            torchjax.to_jax(positions, lowering="xla")(ids, 5), positions(_t(ids), 5).numpy()
        )
        assert "aten.mul.Tensor" in torchjax.lowering_report(scaled, ids, 5).narrowed


def test_outputs_torch_does_not_differentiate_get_no_gradient():
    # native_layer_norm's mean and rstd are outputs torch's autograd does not differentiate;
    # JAX would differentiate the ops that compute them.
    def with_statistics(x, w, b):  # [2, 3], [3], [3] -> []
        out, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [3], w, b, 1e-5)
        return out.pow(2).sum() + mean.sum() * 3 + rstd.sum() * 2

    x = rng.standard_normal((2, 3)).astype(np.float32)
    w, b = np.full(3, 1.5, np.float32), np.zeros(3, np.float32)
    got = jax.grad(torchjax.to_jax(with_statistics, lowering="xla"), argnums=(0, 1))(x, w, b)
    ref = torch.func.grad(with_statistics, argnums=(0, 1))(_t(x), _t(w), _t(b))
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r.numpy(), rtol=1e-5, atol=1e-5)


# -- what torch does not differentiate ---------------------------------------------------
def _torch_grad(fn, *arrays) -> list[np.ndarray]:
    tensors = [_t(a).requires_grad_() for a in arrays]
    return [g.numpy() for g in torch.autograd.grad(fn(*tensors), tensors)]


def _no_grad_block(x):  # [3] -> []
    with torch.no_grad():
        y = x * 2
    return (x * y).sum()


def _batch_norm_statistics(x, w, b):  # [4, 3, 2], [3], [3] -> []
    out, mean, rstd = torch.ops.aten._native_batch_norm_legit(x, w, b, True, 0.1, 1e-5)
    return out.pow(2).sum() + mean.sum() * 3 + rstd.sum() * 2


@pytest.mark.parametrize(
    "fn, shapes",
    [
        (lambda x: (x * x.detach()).sum(), [(3,)]),
        (_no_grad_block, [(3,)]),
        # decomposed before lowering: the saved statistics are JAX ops of the input
        (_batch_norm_statistics, [(4, 3, 2), (3,), (3,)]),
    ],
    ids=["detach", "no_grad", "batch_norm_saved_statistics"],
)
def test_what_torch_does_not_differentiate_gets_no_gradient(fn, shapes):
    arrays = [rng.standard_normal(s).astype(np.float32) + 1.5 for s in shapes]
    argnums = tuple(range(len(arrays)))
    got = jax.grad(torchjax.to_jax(fn, lowering="xla"), argnums=argnums)(*arrays)
    for g, r in zip(got, _torch_grad(fn, *arrays), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    jit_got = jax.jit(jax.grad(torchjax.to_jax(fn, lowering="xla")))(*arrays)
    np.testing.assert_allclose(jit_got, _torch_grad(fn, *arrays)[0], rtol=1e-5, atol=1e-5)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _rounded(x):  # [3] -> []
    return (_StraightThrough.apply(x) * x).sum()


def test_an_autograd_function_lowers_its_values_and_refuses_its_derivatives():
    x = np.array([0.3, 1.7, 2.2], np.float32)
    f = torchjax.to_jax(_rounded, lowering="xla")
    ref = _rounded(_t(x)).item()
    np.testing.assert_allclose(f(x), ref, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(x), ref, rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(f)(x[None]), [ref], rtol=1e-6)
    for transform in (jax.grad, jax.jacfwd):
        with pytest.raises(LoweringError, match=r"(?s)_StraightThrough.*lowering=\"callback\""):
            transform(f)(x)
    report = torchjax.lowering_report(_rounded, x)
    assert report.autograd_functions == ("_StraightThrough",), report
    assert "_StraightThrough" in str(report)
    # lowering="callback" runs its backward: torch's gradient
    got = jax.grad(torchjax.to_jax(_rounded))(x)
    np.testing.assert_allclose(got, _torch_grad(_rounded, x)[0], rtol=1e-6)


def _rounded_by_a_class_of_its_own(x):  # [3] -> []: a new Function class on every call
    # a straight-through floor whose backward halves the gradient
    StraightThroughInside = type(
        "StraightThroughInside",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(lambda ctx, x: torch.floor(x)),
            "backward": staticmethod(lambda ctx, g: g / 2),
            "__qualname__": "_rounded_by_a_class_of_its_own.<locals>.StraightThroughInside",
        },
    )
    return (StraightThroughInside.apply(x) * x).sum()


def test_an_autograd_function_defined_during_the_call_refuses_its_derivatives():
    # A class made after the capture starts has no forward code to watch beforehand: it is
    # found through Function.apply. Differentiating its forward's ops would give d floor = 0.
    x = np.array([0.3, 1.7, 2.2], np.float32)
    f = torchjax.to_jax(_rounded_by_a_class_of_its_own, lowering="xla")
    ref = _rounded_by_a_class_of_its_own(_t(x)).item()
    np.testing.assert_allclose(jax.jit(f)(x), ref, rtol=1e-6)
    for transform in (jax.grad, jax.jacfwd):
        with pytest.raises(LoweringError, match="StraightThroughInside"):
            jax.jit(transform(f))(x)
    report = torchjax.lowering_report(_rounded_by_a_class_of_its_own, x)
    assert report.autograd_functions == (
        "_rounded_by_a_class_of_its_own.<locals>.StraightThroughInside",
    ), report
    got = jax.grad(torchjax.to_jax(_rounded_by_a_class_of_its_own))(x)
    np.testing.assert_allclose(got, _torch_grad(_rounded_by_a_class_of_its_own, x)[0], rtol=1e-6)


def test_an_autograd_function_is_found_under_cprofile():
    # 3.11 finds it through a profile function: cProfile's own must keep recording after.
    import cProfile
    import pstats

    x = np.array([0.3, 1.7], np.float32)
    f = torchjax.to_jax(_rounded, lowering="xla")
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        f(x)

        def after_the_capture():
            return 1

        after_the_capture()
    finally:
        profiler.disable()
    with pytest.raises(LoweringError, match="_StraightThrough"):
        jax.grad(f)(x)
    names = {key[2] for key in pstats.Stats(profiler).stats}
    assert "after_the_capture" in names
    assert sys.getprofile() is None


# -- outputs and ops lowering="xla" treats its own way -----------------------------------
def test_a_structseq_output_of_an_op_with_a_lowering_of_torchjaxs_own():
    # torch.linalg.solve_ex returns a structseq; the op table's lowering of _linalg_solve_ex
    # returns 2 of its 4 outputs, so torchjax has its own (_xla/_own_ops.py).
    a = rng.standard_normal((3, 3)) + 3 * np.eye(3)
    b = rng.standard_normal((3, 2))
    f = lambda a, b: torch.linalg.solve_ex(a, b)  # noqa: E731
    got = jax.jit(torchjax.to_jax(f, lowering="xla"))(a.astype(np.float32), b.astype(np.float32))
    ref = f(_t(a).float(), _t(b).float())
    assert got._fields == ("result", "info")
    np.testing.assert_allclose(got.result, ref.result.numpy(), rtol=1e-5, atol=1e-5)
    assert int(got.info) == int(ref.info) == 0
    report = torchjax.lowering_report(f, a.astype(np.float32), b.astype(np.float32))
    assert report.fully_lowered and report.exportable, report


def test_a_sparse_tensor_in_the_graph_is_refused_with_the_fix():
    f = torchjax.to_jax(lambda x: x.to_sparse().to_dense() * 2, lowering="xla")
    with pytest.raises(LoweringError, match='(?s)sparse_coo.*lowering="callback"'):
        f(np.eye(3, dtype=np.float32))


def test_embedding_bag_grad_equals_torch():
    # A capture's example tensors do not require grad, so torch picks
    # _embedding_bag_forward_only, which has no derivative.
    weight = rng.standard_normal((10, 3)).astype(np.float32)
    index = np.array([1, 2, 4, 5, 4, 3, 2, 9], np.int32)
    offsets = np.array([0, 4], np.int32)

    def bags(w, i, o):  # [10, 3], [8], [2] -> []
        return torch.nn.functional.embedding_bag(i, w, o, mode="mean").pow(2).sum()

    got = jax.grad(torchjax.to_jax(bags, lowering="xla"))(weight, index, offsets)
    w = _t(weight).requires_grad_()
    (ref,) = torch.autograd.grad(bags(w, _t(index).long(), _t(offsets).long()), w)
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-6)


def test_safe_softmax_of_a_masked_row_has_torchs_zero_gradient():
    x = rng.standard_normal((3, 4)).astype(np.float32)
    x[1] = -np.inf
    f = lambda x: torch.ops.aten._safe_softmax(x, -1).pow(2).sum()  # noqa: E731
    got = jax.grad(torchjax.to_jax(f, lowering="xla"))(x)
    np.testing.assert_allclose(got, _torch_grad(f, x)[0], rtol=1e-5, atol=1e-6)
    assert not np.isnan(got).any()
    report = torchjax.lowering_report(f, x)
    assert report.fully_lowered, report


def test_checkpointing_lowers_without_reentrant_and_refuses_derivatives_with_it():
    import torch.utils.checkpoint as checkpoint

    layer = torch.nn.Linear(4, 4)
    x = rng.standard_normal((3, 4)).astype(np.float32)

    def energy(x, reentrant):  # [3, 4] -> []
        return (
            checkpoint.checkpoint(lambda y: torch.tanh(layer(y)), x, use_reentrant=reentrant)
            .pow(2)
            .sum()
        )

    xt = _t(x).requires_grad_()
    energy(xt, False).backward()
    got = jax.grad(torchjax.to_jax(energy, lowering="xla"))(x, False)
    np.testing.assert_allclose(got, xt.grad.numpy(), rtol=1e-5, atol=1e-6)
    f = torchjax.to_jax(energy, lowering="xla")
    np.testing.assert_allclose(f(x, True), energy(_t(x), True).item(), rtol=1e-6)
    with pytest.raises(LoweringError, match="(?s)CheckpointFunction.*use_reentrant=False"):
        jax.grad(f)(x, True)


def test_an_op_torch_cannot_differentiate_still_lowers():
    # The capture runs with inputs requiring grad, and without where torch refuses that:
    # silu has no complex derivative in torch.
    x = (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64)
    got = torchjax.to_jax(torch.nn.functional.silu, lowering="xla")(x)
    np.testing.assert_allclose(got, torch.nn.functional.silu(_t(x)).numpy(), rtol=1e-5)


def test_vector_norm_lowers_with_torchs_derivatives_at_zero():
    # At a zero row (or entry) torch's derivative is the subgradient 0, where JAX
    # differentiating the norm's formula gives NaN, inf or 1, so the op ran as a callback,
    # which kept jax.export from code with norms (rotations, distances).
    x = rng.standard_normal((3, 4)).astype(np.float32)
    x[0] = 0
    x[1, :2] = 2.0
    t = rng.standard_normal((3, 4)).astype(np.float32)
    norms = [
        lambda x: x.norm(dim=1),
        lambda x: torch.linalg.vector_norm(x, ord=float("inf"), dim=1),
        lambda x: torch.linalg.vector_norm(x, ord=0.5, dim=1, keepdim=True),
        lambda x: torch.linalg.vector_norm(x, ord=3, dim=1, dtype=torch.float64),
    ]
    for norm in norms:
        f = torchjax.to_jax(norm, lowering="xla")
        got = jax.grad(lambda x, f=f: f(x).sum())(x)
        ref = _torch_grad(lambda x, norm=norm: norm(x).sum(), x)[0]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        _, tangent = jax.jvp(f, (x,), (t,))
        _, ref = torch.func.jvp(norm, (_t(x),), (_t(t),))
        np.testing.assert_allclose(tangent, ref.numpy(), rtol=1e-5, atol=1e-6)
        assert torchjax.lowering_report(norm, x).fully_lowered
    report = torchjax.lowering_report(lambda x: x.norm(), x)
    assert report.fully_lowered and report.exportable, str(report)
    f = torchjax.to_jax(lambda x: x.norm(), lowering="xla")
    assert jax.export.export(jax.jit(f))(x).serialize()


def test_declared_types_are_checked_against_the_capture():
    """result_shape_dtypes under lowering="xla": the capture finds the types, and a
    declaration that disagrees in shape, dtype or structure is an error naming the output."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    right = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    f = torchjax.to_jax(lambda a, b: a + b, lowering="xla", result_shape_dtypes=right)
    np.testing.assert_array_equal(jax.jit(f)(x, x), 2 * x)
    from_inputs = torchjax.to_jax(
        lambda a: {"s": a.sum(0)}, lowering="xla", result_shape_dtypes=lambda a: {"s": a}
    )
    with pytest.raises(torchjax.errors.OutputMismatchError, match=r"out\['s'\] is float32\[3\]"):
        from_inputs(x)
    wrong_dtype = jax.ShapeDtypeStruct((2, 3), jnp.int32)
    g = torchjax.to_jax(lambda a: a * 2, lowering="xla", result_shape_dtypes=wrong_dtype)
    with pytest.raises(torchjax.errors.OutputMismatchError, match="declares int32"):
        jax.jit(g)(x)
    pair = torchjax.to_jax(lambda a: (a, a), lowering="xla", result_shape_dtypes=right)
    with pytest.raises(torchjax.errors.OutputMismatchError, match="returns PyTreeDef"):
        pair(x)
    apply, variables = torchjax.module_to_jax(
        torch.nn.Linear(3, 4), lowering="xla", result_shape_dtypes=right
    )
    with pytest.raises(torchjax.errors.OutputMismatchError, match=r"float32\[2, 4\]"):
        apply(variables, x)


def test_a_failed_capture_prints_nothing_but_torchjaxs_error(capfd):
    # torch.export prints its partial FX graph (twice) and a symbolic_shapes warning when a
    # capture fails; they go to torchjax's logger at DEBUG, not to the user's stderr.
    def branches(x):
        if x.sum() > 0:
            return x * 2
        return x

    capfd.readouterr()
    with pytest.raises(LoweringError, match="cannot capture .*branches"):
        torchjax.to_jax(branches, lowering="xla")(np.ones(3, np.float32))
    out, err = capfd.readouterr()
    assert "def forward" not in out + err and "symbolic_shapes" not in err, err
    assert err.strip() == "", err
