"""Per-example gradients from one forward (_callables/_batched_kept.py): jax.vmap of jax.grad or
jax.value_and_grad runs the batched forward once, keeping one graph for every example, and
pulls each example's cotangent back through it: torch.func's matmul count, counted here
by a dispatch mode, and torch.func's numbers (torch.func.vmap(torch.func.grad_and_value))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import MatmulCount, tree_close

import torchjax

pytestmark = pytest.mark.core  # the version matrix runs this module

D, H, B = 6, 5, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(D, H), torch.nn.Tanh(), torch.nn.Linear(H, H), torch.nn.Linear(H, 1)
    )


MODEL = _model()
PARAMS_T = {k: v.detach() for k, v in MODEL.named_parameters()}
PARAMS = {k: jnp.asarray(v.cpu().numpy()) for k, v in PARAMS_T.items()}
XS = jnp.linspace(-1.0, 1.0, B * D).reshape(B, D)


def loss(params, x):  # torch: params, [D] -> []
    return torch.func.functional_call(MODEL, params, (x,)).squeeze(-1).pow(2)


def _count(thunk):
    thunk()  # traced and compiled: only the calls themselves are counted below
    with MatmulCount() as mode:
        out = jax.block_until_ready(thunk())
    return out, mode.total


def _torch_reference():
    xs = torch.tensor(np.asarray(XS))
    per_example = torch.func.vmap(torch.func.grad_and_value(loss), in_dims=(None, 0))
    per_example(PARAMS_T, xs)
    with MatmulCount() as mode:
        grads, values = per_example(PARAMS_T, xs)
    return grads, values, mode.total


# The counts see the callbacks' torch work because on the CPU XLA runs a callback on the
# calling thread, where the dispatch mode is active: on a GPU it may not.
@pytest.mark.cpu_only
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_value_and_grad_per_example_is_one_forward_with_torch_funcs_matmul_count(jit):
    step = jax.vmap(jax.value_and_grad(torchjax.to_jax(loss)), in_axes=(None, 0))
    step = jax.jit(step) if jit else step
    (values, grads), count = _count(lambda: step(PARAMS, XS))
    want_grads, want_values, want_count = _torch_reference()
    assert count == want_count  # one forward and one backward: 2 forwards would add 3
    tree_close(values, want_values)
    tree_close(grads, want_grads)


@pytest.mark.cpu_only  # counts callbacks' work (see above)
def test_module_per_example_grads_of_a_loss_computed_in_jax():
    apply, variables = torchjax.module_to_jax(_model())

    def jax_loss(params, x):
        return (apply({"params": params, "buffers": {}}, x)[0] ** 2).sum()

    step = jax.jit(jax.vmap(jax.value_and_grad(jax_loss), in_axes=(None, 0)))
    (values, grads), count = _count(lambda: step(variables["params"], XS))
    want_grads, want_values, want_count = _torch_reference()
    assert count == want_count
    tree_close(values, want_values)
    tree_close(grads, want_grads)


def test_batched_input_differentiated_too_with_its_batch_axis_not_first():
    f = torchjax.to_jax(lambda w, x: torch.tanh(x @ w).pow(2).sum())
    w = jnp.linspace(-0.5, 0.5, D * 3).reshape(D, 3)
    xs_t = XS.T  # [D, B]: the batch on axis 1
    got = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(None, 1)))(w, xs_t)
    want = jax.vmap(
        jax.grad(lambda w, x: (jnp.tanh(x @ w) ** 2).sum(), argnums=(0, 1)), in_axes=(None, 1)
    )(w, xs_t)
    tree_close(got, want)


def test_nested_vmap_of_grad():
    f = torchjax.to_jax(lambda w, x: torch.tanh(x @ w).sum())
    w = jnp.linspace(-0.5, 0.5, D * 3).reshape(D, 3)
    xs = XS.reshape(2, 2, D)
    inner = jax.vmap(jax.grad(f), in_axes=(None, 0))
    got = jax.vmap(inner, in_axes=(None, 0))(w, xs)
    ref = jax.grad(lambda w, x: jnp.tanh(x @ w).sum())
    want = jax.vmap(jax.vmap(ref, in_axes=(None, 0)), in_axes=(None, 0))(w, xs)
    tree_close(got, want)


def test_a_vjp_called_twice_recomputes_the_second_time():
    f = torchjax.to_jax(lambda w, x: torch.sin(x @ w).sum())
    w = jnp.linspace(-0.5, 0.5, D * 3).reshape(D, 3)

    def both(w, x):
        _, pullback = jax.vjp(lambda w: f(w, x), w)
        return pullback(1.0)[0], pullback(2.0)[0]  # the graph serves the first only

    first, second = jax.vmap(both, in_axes=(None, 0))(w, XS)
    want = jax.vmap(jax.grad(lambda w, x: jnp.sin(x @ w).sum()), in_axes=(None, 0))(w, XS)
    tree_close(first, want)
    tree_close(second, 2 * want)


def test_checkpointed_module_under_vmap_still_says_what_to_do():
    # torch.utils.checkpoint re-runs the module in the backward, unbatched: refused with
    # torch.func's own reason and the advice, as before one-forward batching.
    import torch.utils.checkpoint as cp

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(D, 1)

        def forward(self, x):
            return cp.checkpoint(lambda x: torch.tanh(self.lin(x)), x, use_reentrant=False)

    apply, variables = torchjax.module_to_jax(Checkpointed())

    def jax_loss(params, x):
        return apply({"params": params, "buffers": {}}, x).sum()

    with pytest.raises(Exception, match="vmap_method='sequential'"):
        jax.vmap(jax.grad(jax_loss), in_axes=(None, 0))(variables["params"], XS)


def test_a_jitted_per_example_step_copies_no_input(monkeypatch):
    # The batched leaves (parameters expanded with stride 0) are emptied after the forward
    # and rebuilt from the VJP's inputs, so the call never gives XLA's input buffers a
    # private copy (_guard.copy_kept_inputs), nor runs on copies.
    from torchjax._to_jax._call import _guard
    from torchjax._to_jax._call import _plan as _call_plan

    copied = []
    swap = _guard.swap_storage_data  # copy_kept_inputs' copy of a kept input's memory
    on_copies = _call_plan.CallPlan.invoke_on_copies
    monkeypatch.setattr(_guard, "swap_storage_data", lambda *a: copied.append("copy") or swap(*a))
    monkeypatch.setattr(
        _call_plan.CallPlan,
        "invoke_on_copies",
        lambda self, *a, **k: copied.append("on copies") or on_copies(self, *a, **k),
    )
    step = jax.jit(jax.vmap(jax.value_and_grad(torchjax.to_jax(loss)), in_axes=(None, 0)))
    for _ in range(3):
        values, grads = step(PARAMS, XS)
    assert copied == []
    want_grads, want_values, _ = _torch_reference()
    tree_close(values, want_values)
    tree_close(grads, want_grads)


# -- functions whose gradient the one-forward plan would change -------------------------
# Inside torch.func.vmap, tensors of a graph recorded around the vmap say they do not
# require grad, and an autograd.Function runs its vmap rule there, differentiated as such;
# under torch.func.vmap(torch.func.grad(f)) they require grad and the Function's backward
# runs. A function that asks, or applies a Function, is batched as torch.func batches it.


def _hooked(x, w):  # torch: a gradient hook registered only where autograd is recording
    h = x * w
    if h.requires_grad:
        h.register_hook(lambda g: g * 3)
    return torch.tanh(h).sum()


class _FiveBack(torch.autograd.Function):
    """x * 2 whose backward says 5: a custom gradient, with a hand-written vmap rule."""

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 5

    @staticmethod
    def vmap(info, in_dims, x):
        return x * 2, in_dims[0]


def _custom(x, w):
    return (_FiveBack.apply(x) * w).sum()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fn", [_hooked, _custom], ids=["hook", "function_vmap_rule"])
def test_per_example_gradient_of_code_that_asks_autograd_matches_torch_func(fn, jit, x64):
    xs = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    w = jnp.array([0.3, -0.2, 0.1])
    step = jax.vmap(jax.grad(torchjax.to_jax(fn), argnums=(0, 1)), in_axes=(0, None))
    step = jax.jit(step) if jit else step
    expected = torch.func.vmap(torch.func.grad(fn, argnums=(0, 1)), in_dims=(0, None))(
        torch.tensor(np.asarray(xs)), torch.tensor(np.asarray(w))
    )
    for _ in range(2):  # the first call finds out, the second knows
        tree_close(step(xs, w), tuple(t.numpy() for t in expected))


def test_per_example_gradient_of_an_eval_attention_fast_path_matches_torch_func():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    params = {k: v.detach() for k, v in mha.named_parameters()}

    def loss(p, x):  # each example a batch of 2 sequences: MHA's fast path applies
        return torch.func.functional_call(mha, p, (x, x, x), {"need_weights": False})[0].sum()

    xs = np.random.default_rng(0).normal(size=(2, 2, 4, 8)).astype(np.float32)
    expected = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, torch.tensor(xs))
    step = jax.vmap(jax.grad(torchjax.to_jax(loss)), in_axes=(None, 0))
    p = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    for _ in range(2):
        tree_close(
            step(p, jnp.asarray(xs)),
            {k: v.numpy() for k, v in expected.items()},
            rtol=1e-4,
            atol=1e-5,
        )


# Writes whose torch derivative assumes each target is written once. select_scatter's
# batching rule scatters an expanded source with a repeating index, so a graph recorded
# around torch.func.vmap counted each example's gradient once per repeat (issue 45: 5x);
# the others repeat a target in the user's own index. Each against torch.func.
_REPEATED_WRITES = {
    "select_scatter": (lambda x, s: torch.select_scatter(x, s, 0, 2), (5,)),
    "select_scatter_dim1": (lambda x, s: torch.select_scatter(x, s, 1, 2), (4,)),
    "scatter_repeated": (lambda x, s: x.scatter(1, torch.tensor([[0, 0]] * 4), s), (4, 2)),
    "index_copy_repeated": (lambda x, s: x.index_copy(0, torch.tensor([1, 1]), s), (2, 5)),
    "index_put_repeated": (lambda x, s: x.index_put((torch.tensor([3, 3]),), s), (2, 5)),
    "put_repeated": (lambda x, s: x.put(torch.tensor([7, 7]), s), (2,)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 0)], ids=str)
@pytest.mark.parametrize("name", list(_REPEATED_WRITES))
def test_per_example_gradient_of_a_write_that_repeats_a_target_matches_torch_func(
    name, in_axes, jit
):
    fn, src_shape = _REPEATED_WRITES[name]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4, 5) if in_axes[0] == 0 else (4, 5)).astype(np.float32)
    s = rng.normal(size=(3, *src_shape) if in_axes[1] == 0 else src_shape).astype(np.float32)

    def loss(x, s):
        return (fn(x, s) ** 2 * torch.arange(20.0).reshape(4, 5)).sum()

    step = jax.vmap(jax.grad(torchjax.to_jax(loss), argnums=(0, 1)), in_axes=in_axes)
    step = jax.jit(step) if jit else step
    expected = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=in_axes)(
        torch.tensor(x), torch.tensor(s)
    )
    for _ in range(2):
        tree_close(step(x, s), tuple(t.numpy() for t in expected))


def test_a_write_that_repeats_no_target_keeps_the_one_forward_plan():
    calls = []

    def loss(x, s):  # slice_scatter's rule scatters too, with an index that repeats nothing
        calls.append(None)
        return (torch.slice_scatter(x, s, 0, 1, 3) ** 2).sum()

    x, s = np.ones((3, 4, 5), np.float32), np.full((3, 2, 5), 2.0, np.float32)
    step = jax.vmap(jax.grad(torchjax.to_jax(loss), argnums=(0, 1)))
    got = step(x, s)
    expected = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(
        torch.tensor(x), torch.tensor(s)
    )
    tree_close(got, tuple(t.numpy() for t in expected))
    calls.clear()
    jax.block_until_ready(step(x, s))
    assert len(calls) == 1  # the batched forward; the pullback reused its graph
