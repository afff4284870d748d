# One forward per training step (issue #17): reverse mode keeps torch's autograd graph
# from the forward for the VJP, and value and gradient see the same random draws, with or
# without a kept graph. References: the same computation in torch, and the identity
# d/dx sum(dropout(x)) = mask / (1 - p) = dropout(ones) (the mask itself).
from __future__ import annotations

import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import tree_close
from torch._subclasses.fake_tensor import is_fake

import torchjax
from torchjax._to_jax._context import GRAPHS

pytestmark = pytest.mark.core  # the version matrix runs this module


class Counted(torch.autograd.Function):
    """The identity, counting the forwards and backwards torch runs through it."""

    forwards = backwards = 0

    @staticmethod
    def forward(x):
        Counted.forwards += 1
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        Counted.backwards += 1
        return g


def _reset():
    Counted.forwards = Counted.backwards = 0


def _mlp_loss(params, x):  # torch: {'w1': [4, 8], 'w2': [8, 1]}, [B, 4] -> []
    h = torch.tanh(Counted.apply(x @ params["w1"]))
    return (h @ params["w2"]).pow(2).mean()


def _mlp_loss_jax(params, x):
    return ((jnp.tanh(x @ params["w1"]) @ params["w2"]) ** 2).mean()


PARAMS = {
    "w1": jnp.linspace(-1.0, 1.0, 32).reshape(4, 8),
    "w2": jnp.linspace(0.5, -0.5, 8).reshape(8, 1),
}
X = jnp.linspace(-2.0, 2.0, 12).reshape(3, 4)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_value_and_grad_is_one_forward_and_one_backward(jit):
    loss = torchjax.to_jax(_mlp_loss)
    step = jax.value_and_grad(loss)
    if jit:
        step = jax.jit(step)
    step(PARAMS, X)  # trace (one fake run) and warm up
    _reset()
    value, grads = step(PARAMS, X)
    assert (Counted.forwards, Counted.backwards) == (1, 1)
    ref_value, ref_grads = jax.value_and_grad(_mlp_loss_jax)(PARAMS, X)
    tree_close(value, ref_value)
    tree_close(grads["w1"], ref_grads["w1"])
    tree_close(grads["w2"], ref_grads["w2"])


class CountedLayer(torch.nn.Module):
    def forward(self, x):
        return Counted.apply(x)


def test_training_step_with_a_loss_computed_in_jax_is_one_forward():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), CountedLayer(), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )
    apply, variables = torchjax.module_to_jax(model)

    def loss(params, x):
        pred = apply({"params": params, "buffers": variables["buffers"]}, x)
        return jnp.mean((pred - 1.0) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    step(variables["params"], X)
    _reset()
    value, grads = step(variables["params"], X)
    assert (Counted.forwards, Counted.backwards) == (1, 1)
    x_t = torch.tensor(np.asarray(X))
    expected = (model(x_t) - 1.0).pow(2).mean()
    expected.backward()
    tree_close(value, expected.item())
    for name, p in model.named_parameters():
        tree_close(grads[name], p.grad)


def _dropout_sum(x):
    return F.dropout(x, 0.5, training=True).sum()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_value_and_gradient_see_the_same_dropout_mask(jit):
    step = jax.value_and_grad(torchjax.to_jax(_dropout_sum))
    if jit:
        step = jax.jit(step)
    for _ in range(3):
        value, grad = step(jnp.ones(1000))
        # d/dx sum(dropout(x)) = mask / (1 - p), and at x = 1 the value is its sum.
        tree_close(value, grad.sum(), rtol=1e-6)
        assert set(np.unique(np.asarray(grad))) <= {0.0, 2.0}


def test_same_mask_when_the_vjp_recomputes():
    # A VJP called twice (the graph is freed by the first) and a linearized function
    # applied forward both recompute the forward, replaying its random draws.
    f = torchjax.to_jax(_dropout_sum)
    x = jnp.ones(1000)
    value, pullback = jax.vjp(f, x)
    (g1,) = pullback(jnp.ones(()))
    (g2,) = pullback(jnp.ones(()))
    tree_close(g1, g2)
    tree_close(value, g1.sum(), rtol=1e-6)
    kept = len(GRAPHS)
    value, f_lin = jax.linearize(f, x)
    tree_close(value, f_lin(x), rtol=1e-6)  # the JVP in direction x at x = 1: the same sum
    from torchjax._compat._jax import LINEARIZE_CONVENTION

    if LINEARIZE_CONVENTION != "nonzeros":  # JAX 0.8 does not say the linear half goes forward
        assert len(GRAPHS) == kept  # applied forward, it recomputes: no graph is kept for it


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_same_mask_through_module_to_jax_without_rng(jit):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.3)
    layer.train()
    apply, variables = torchjax.module_to_jax(layer)
    x = jnp.linspace(-1.0, 1.0, 5 * 2 * 8).reshape(5, 2, 8)

    def loss(params):
        return jnp.sum(apply({"params": params, "buffers": variables["buffers"]}, x) ** 2)

    step = jax.jit(jax.value_and_grad(loss)) if jit else jax.value_and_grad(loss)
    step(variables["params"])  # trace and compile: no draws
    state = torch.get_rng_state()
    value, grads = step(variables["params"])
    # The same draws in torch: restore the generator, run forward and backward there.
    torch.set_rng_state(state)
    layer.zero_grad()
    expected = layer(torch.tensor(np.asarray(x))).pow(2).sum()
    expected.backward()
    tree_close(value, expected.item(), rtol=1e-4)
    for name, p in layer.named_parameters():
        tree_close(grads[name], p.grad, rtol=1e-3, atol=1e-5)


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_graphs_whose_backward_never_runs_do_not_accumulate():
    w = torch.linspace(-1, 1, 64 * 64).reshape(64, 64)
    f = torchjax.to_jax(lambda x: torch.tanh(x @ w).sum())
    x = jnp.ones((16, 64))
    for _ in range(500):  # warm up: the store fills to its bound
        jax.vjp(f, x)
    gc.collect()
    before = _rss_bytes()
    for _ in range(10_000):
        jax.vjp(f, x)  # the forward keeps a graph; the VJP never runs
    gc.collect()
    growth = _rss_bytes() - before
    assert len(GRAPHS) <= GRAPHS.max_count
    assert growth < 64 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB"


def test_evicted_graph_falls_back_to_recomputing_with_the_same_draws(monkeypatch):
    monkeypatch.setattr(GRAPHS, "max_count", 1)
    f = torchjax.to_jax(_dropout_sum)
    x = jnp.ones(1000)
    value, pullback = jax.vjp(f, x)
    jax.vjp(f, x)  # a second forward evicts the first graph
    (grad,) = pullback(jnp.ones(()))
    tree_close(value, grad.sum(), rtol=1e-6)


def test_jit_graph_does_not_keep_xla_input_buffers():
    # Under jit XLA may reuse the forward's input buffers before the backward runs: the
    # graph's saved inputs are rebuilt from the VJP's own inputs. Run steps whose inputs
    # are fresh buffers each time and compare every gradient with plain JAX.
    loss = torchjax.to_jax(lambda w, x: (torch.sin(x @ w) * x.sum()).sum())
    loss_jax = lambda w, x: (jnp.sin(x @ w) * x.sum()).sum()
    step = jax.jit(lambda w, x: jax.grad(loss)(w * 1.0, x + 0.0))
    for k in range(20):
        w = jnp.full((4, 3), 0.1 * k)
        x = jnp.linspace(0.1, 1.0, 8).reshape(2, 4) * k
        tree_close(step(w, x), jax.grad(loss_jax)(w, x), rtol=1e-4, atol=1e-5)


def test_a_jitted_forward_frees_its_outputs_once_xla_has_them():
    """The kept graph needs an output's grad_fn, not its values: once the output is in
    XLA's buffer, torch's memory for it is freed (GPT-2's logits would otherwise exist twice
    until the backward). One the function keeps (a cache) is left as it is."""
    from torch.multiprocessing.reductions import StorageWeakRef

    storages, cache = [], []

    def fn(x, w, keep):
        y = torch.tanh(x) @ w  # mm saves its inputs, not its output
        storages.append(StorageWeakRef(y.untyped_storage()))
        if keep:
            cache.append(y)
        return y

    f = torchjax.to_jax(fn)
    x, w = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), jnp.linspace(0.0, 1.0, 20).reshape(4, 5)
    ref_out, ref_pull = jax.vjp(lambda x, w: jnp.tanh(x) @ w, x, w)
    ct = jnp.linspace(1.0, 2.0, 15).reshape(3, 5)
    for keep in (False, True):
        storages.clear()
        kept = len(GRAPHS)
        forward = jax.jit(lambda x, w, keep=keep: jax.vjp(lambda x, w: f(x, w, keep), x, w))
        out, pull = forward(x, w)
        assert len(GRAPHS) == kept + 1  # the graph waits for its backward
        assert storages[-1].expired() is not keep
        tree_close(out, ref_out, rtol=1e-6)
        tree_close(jax.jit(lambda pull, ct: pull(ct))(pull, ct), ref_pull(ct), rtol=1e-6)
        if keep:
            tree_close(cache.pop(), ref_out, rtol=1e-6)  # the cache's values are intact


def test_scan_of_wrapped_steps_keeps_one_graph_per_step():
    calls = []

    def cell(h, x):
        if not is_fake(h):
            calls.append(1)
        return torch.tanh(h + x)

    f = torchjax.to_jax(cell)
    f_jax = lambda h, x: jnp.tanh(h + x)

    def loss(h0, xs, cell):
        h, _ = jax.lax.scan(lambda h, x: (cell(h, x), None), h0, xs)
        return h.sum()

    h0, xs = jnp.zeros(3), jnp.linspace(-1, 1, 12).reshape(4, 3)
    grad = jax.jit(jax.grad(lambda h: loss(h, xs, f)))
    tree_close(grad(h0), jax.grad(lambda h: loss(h, xs, f_jax))(h0))
    calls.clear()
    grad(h0)
    assert len(calls) == 4  # one forward per step; the backward reuses each step's graph


def test_threads_each_pull_back_through_their_own_graph():
    import threading

    loss = torchjax.to_jax(lambda w, x: torch.tanh(x @ w).pow(2).sum())
    loss_jax = lambda w, x: (jnp.tanh(x @ w) ** 2).sum()
    step = jax.jit(jax.value_and_grad(loss))
    results, errors = {}, []

    def work(k):
        try:
            w, x = jnp.full((4, 2), 0.1 * k), jnp.linspace(-1.0, 1.0, 12).reshape(3, 4) * k
            for _ in range(20):
                results[k] = (step(w, x), jax.value_and_grad(loss_jax)(w, x))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for (value, grad), (ref_value, ref_grad) in results.values():
        tree_close(value, ref_value, rtol=1e-5)
        tree_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_kept_graph_with_sparse_intermediates(jit):
    # torch saves sparse tensors for the backward of to_sparse/to_dense: they have no
    # storage to compare with the inputs', and must be kept as they are.
    def fn(x):
        return (x.to_sparse().to_dense() * x).sum()

    f = torchjax.to_jax(fn)
    x = jnp.array([[1.0, 0.0, -2.0], [0.0, 3.0, 0.5]])
    vg = jax.value_and_grad(f)
    val, grad = (jax.jit(vg) if jit else vg)(x)
    xt = torch.tensor(np.asarray(x), requires_grad=True)
    want = fn(xt)
    want.backward()
    np.testing.assert_allclose(val, want.item(), rtol=1e-6)
    np.testing.assert_allclose(grad, xt.grad.cpu().numpy(), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_step_copies_no_input(jit, monkeypatch):
    # The kept graph must not make the call copy its inputs: neither by running it on
    # copies (a protected input asked for a writable pointer) nor by giving XLA's buffers
    # a private copy because the graph keeps the parameters alive (copy_kept_inputs).
    from torchjax._to_jax._call import _guard
    from torchjax._to_jax._call import _plan as _call_plan

    copied = []
    on_copies = _call_plan.CallPlan.invoke_on_copies
    swap = _guard.swap_storage_data  # copy_kept_inputs' copy of a kept input's memory
    monkeypatch.setattr(
        _call_plan.CallPlan,
        "invoke_on_copies",
        lambda self, *a, **k: copied.append("on copies") or on_copies(self, *a, **k),
    )
    monkeypatch.setattr(_guard, "swap_storage_data", lambda *a: copied.append("copy") or swap(*a))
    step = jax.value_and_grad(torchjax.to_jax(_mlp_loss))
    step = jax.jit(step) if jit else step
    for _ in range(3):
        value, grads = step(PARAMS, X)
    assert copied == []
    ref_value, ref_grads = jax.value_and_grad(_mlp_loss_jax)(PARAMS, X)
    tree_close(value, ref_value)
    tree_close(grads["w1"], ref_grads["w1"])


def test_a_function_that_keeps_its_input_still_reads_the_call_values(monkeypatch):
    # The leaf it keeps is not emptied (the graph is not its only holder), and under jit
    # its memory is its own after the call: later reads see this call's values (the copy
    # test_a_step_copies_no_input watches for is made here).
    from torchjax._to_jax._call import _guard

    copies = []
    swap = _guard.swap_storage_data
    monkeypatch.setattr(_guard, "swap_storage_data", lambda *a: copies.append(1) or swap(*a))
    kept = []

    def loss(w, x):
        kept.append(w)
        return (torch.tanh(x @ w) ** 2).sum()

    f = jax.jit(jax.value_and_grad(torchjax.to_jax(loss)))
    w = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)
    f(w, X)
    jax.block_until_ready(f(w * 2, X))
    np.testing.assert_allclose(kept[-1].detach().cpu().numpy(), np.asarray(w * 2), rtol=1e-6)
    assert copies  # the kept input got memory of its own


# ------------------------------------------- gradients written into XLA's output buffers


def _copies_after_the_backward(monkeypatch) -> list:
    """The shapes of the outputs the jitted callbacks copy into XLA's buffers after their
    calls (the forward's loss, graph handle and RNG state among them)."""
    from torchjax._to_jax._torch_call import _lowering as _rule_lowering

    copied = []
    write = _rule_lowering.write_output
    monkeypatch.setattr(
        _rule_lowering,
        "write_output",
        lambda d, v, w: copied.append(tuple(d.shape)) or write(d, v, w),
    )
    return copied


def _wide_loss(params, x):  # torch: {'w': [256, 256], 'b': [256]}, [4, 256] -> []
    return torch.tanh(x @ params["w"] + params["b"]).pow(2).mean()


WIDE = {"w": jnp.linspace(-0.05, 0.05, 256 * 256).reshape(256, 256), "b": jnp.ones(256)}
X_WIDE = jnp.linspace(-1.0, 1.0, 4 * 256).reshape(4, 256)


def test_jitted_gradients_go_into_xlas_buffers_as_torch_computes_them(monkeypatch):
    # A large gradient (w: 65,536 elements) is written into its output buffer from a hook
    # the moment torch has it, so torch's own is freed then: the step never holds two sets
    # of gradients. A small one (b) is copied after the backward, as before: cheaper.
    copied = _copies_after_the_backward(monkeypatch)
    step = jax.jit(jax.value_and_grad(torchjax.to_jax(_wide_loss)))
    value, grads = step(WIDE, X_WIDE)
    assert (256,) in copied and (256, 256) not in copied  # b's; w's went in during it

    def reference(params, x):
        return (jnp.tanh(x @ params["w"] + params["b"]) ** 2).mean()

    ref_value, ref_grads = jax.value_and_grad(reference)(WIDE, X_WIDE)
    tree_close(value, ref_value)
    tree_close(grads, ref_grads)


def test_without_graph_task_ids_the_gradients_are_copied_after(monkeypatch):
    # The control for the test above: with the hooks off, both gradients are copied.
    from torchjax._to_jax._torch_ops import _residual as _residual

    monkeypatch.setattr(_residual, "current_graph_task_id", None)
    copied = _copies_after_the_backward(monkeypatch)
    grads = jax.jit(jax.grad(torchjax.to_jax(_wide_loss)))(WIDE, X_WIDE)
    assert (256,) in copied and (256, 256) in copied
    assert np.abs(np.asarray(grads["w"])).max() > 0


class _VjpInsideBackward(torch.autograd.Function):
    """tanh(x @ w) whose backward differentiates again through w itself, as an adjoint ODE
    solver's backward does with the module's parameters."""

    @staticmethod
    def forward(x, w):
        return torch.tanh(x @ w)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            y = torch.tanh(x.detach() @ w)  # w: the differentiated leaf
            # Twice the cotangent, halved after: what the nested backward returns matters.
            (gw,) = torch.autograd.grad(y, w, 2 * g)
        return None, gw / 2  # x is not differentiated here


def test_a_backward_nested_in_the_backward_keeps_its_own_gradients(monkeypatch):
    # The hook that writes a leaf's gradient acts in the outer backward only: the nested
    # torch.autograd.grad through the same leaf must see the real gradient, not a zero.
    from torchjax._to_jax._torch_ops import _residual as _residual

    monkeypatch.setattr(_residual, "MIN_HOOKED_NUMEL", 1)  # hook the small leaf too

    def loss(x, w):
        return _VjpInsideBackward.apply(x, w).pow(2).sum()

    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    w = jnp.linspace(0.5, -0.5, 8).reshape(4, 2)
    got = jax.jit(jax.grad(torchjax.to_jax(loss), argnums=1))(x, w)
    want = jax.grad(lambda w: (jnp.tanh(x @ w) ** 2).sum())(w)
    tree_close(got, want)


@pytest.mark.parametrize("jit", [False, True])
def test_an_output_changed_in_place_after_torch_saved_it_is_refused_as_torch_does(jit):
    """exp saves its output; doubling it in place afterwards makes its backward wrong, which
    torch's version check refuses. The kept graph's hooks make the same check (torch's own
    is off under saved-tensor hooks): no silently wrong gradient."""

    def doubled_exp(x):
        return torch.exp(x).mul_(2).add_(1)

    x_t = torch.tensor([0.1, 0.5, -0.3], requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        doubled_exp(x_t).sum().backward()  # torch itself
    f = torchjax.to_jax(doubled_exp)
    grad = jax.grad(lambda x: jnp.sin(f(x)).sum())
    with pytest.raises(Exception, match="modified by an inplace operation"):
        jax.block_until_ready((jax.jit(grad) if jit else grad)(jnp.array([0.1, 0.5, -0.3])))
    # Out of place, as the message says: the gradient jax.numpy gives.
    g = torchjax.to_jax(lambda x: torch.exp(x) * 2 + 1)
    got = (jax.jit if jit else (lambda h: h))(jax.grad(lambda x: jnp.sin(g(x)).sum()))
    want = jax.grad(lambda x: jnp.sin(jnp.exp(x) * 2 + 1).sum())
    x = jnp.array([0.1, 0.5, -0.3])
    tree_close(got(x), want(x), rtol=1e-5)
