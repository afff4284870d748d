"""Forward over reverse under jit (_torch_call/_dce.py): a Hessian-vector product
(jax.jvp(jax.grad(f))) and jax.hessian run the forward as often as torch.func does, counted
by the matrix products torch runs, with torch.func's numbers and random draws. Without the
rule, the reverse pass's forward would still run for its random-number state: one more
forward (and its JVP) than torch.func."""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import MatmulCount, tree_close

import torchjax
from torchjax._to_jax._context import GRAPHS

pytestmark = pytest.mark.core  # the version matrix runs this module

D, H = 6, 5


def _model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(D, H),
        torch.nn.LayerNorm(H),
        torch.nn.Tanh(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(H, H),
        torch.nn.Linear(H, 1),
    )


MODEL = _model()
PARAMS_T = {k: v.detach().clone() for k, v in MODEL.named_parameters()}
PARAMS = {k: jnp.asarray(v.numpy()) for k, v in PARAMS_T.items()}
V_T = {k: torch.linspace(-0.3, 0.4, v.numel()).reshape(v.shape) for k, v in PARAMS_T.items()}
V = {k: jnp.asarray(v.numpy()) for k, v in V_T.items()}
X_T = torch.linspace(-1.0, 1.0, 4 * D).reshape(4, D)
X = jnp.asarray(X_T.numpy())


def loss(params, x):  # torch: the model's parameters, [4, D] -> []
    return torch.func.functional_call(MODEL, params, (x,)).pow(2).sum()


def _counted(thunk):
    thunk()  # traced and compiled: only the call is counted below
    with MatmulCount() as mode:
        out = jax.block_until_ready(thunk())
    return out, mode.total


def _torch_counted(thunk):
    thunk()
    with MatmulCount() as mode:
        out = thunk()
    return out, mode.total


# The counts see the callbacks' torch work because on the CPU XLA runs a callback on the
# calling thread, where the dispatch mode is active: on a GPU it may not.
@pytest.mark.cpu_only
def test_jitted_hvp_has_torch_funcs_matmul_count():
    f = torchjax.to_jax(loss)
    hvp = jax.jit(lambda p, v: jax.jvp(lambda p: jax.grad(f)(p, X), (p,), (v,)))
    (grads, hv), count = _counted(lambda: hvp(PARAMS, V))
    (want_grads, want_hv), want_count = _torch_counted(
        lambda: torch.func.jvp(lambda p: torch.func.grad(loss)(p, X_T), (PARAMS_T,), (V_T,))
    )
    assert count == want_count  # the recorded forward's JVP, kept, would add 9
    tree_close(grads, want_grads)
    tree_close(hv, want_hv, rtol=1e-4, atol=1e-5)  # float32, two orders of summation


@pytest.mark.cpu_only  # counts callbacks' work (see above)
def test_jitted_hessian_has_torch_funcs_matmul_count():
    p0 = {k: v for k, v in PARAMS_T.items() if k != "5.weight"}

    def loss_x(x):  # torch: [D] -> []
        return torch.func.functional_call(MODEL, p0 | {"5.weight": PARAMS_T["5.weight"]}, (x,))[
            0
        ].pow(2)

    x_t = torch.linspace(-0.5, 0.7, D)
    hessian_fn = jax.jit(jax.hessian(torchjax.to_jax(loss_x)))  # one wrapper: one fake run
    hessian, count = _counted(lambda: hessian_fn(x_t.numpy()))
    want, want_count = _torch_counted(lambda: torch.func.hessian(loss_x)(x_t))
    assert count == want_count  # the recorded forward, kept for its RNG state, would add 3
    tree_close(hessian, want, rtol=1e-4, atol=1e-6)


class _Loss(torch.nn.Module):
    """MODEL's loss on X, computed by the module."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _model()

    def forward(self, x):
        return self.model(x).pow(2).sum()


@pytest.mark.cpu_only  # counts callbacks' work (see above)
def test_jitted_hvp_through_module_to_jax():
    # With the loss computed by torch. A loss computed in JAX from the module's outputs
    # needs their tangents (its second derivative meets them) from a call of their own:
    # one forward more (docs/limitations.md).
    apply, variables = torchjax.module_to_jax(_Loss())

    def total(params):
        return apply({"params": params, "buffers": variables["buffers"]}, X)

    hvp = jax.jit(lambda p, v: jax.jvp(jax.grad(total), (p,), (v,))[1])
    hv, count = _counted(lambda: hvp(variables["params"], {f"model.{k}": v for k, v in V.items()}))
    want, want_count = _torch_counted(
        lambda: torch.func.jvp(lambda p: torch.func.grad(loss)(p, X_T), (PARAMS_T,), (V_T,))[1]
    )
    assert count == want_count
    tree_close(hv, {f"model.{k}": v for k, v in want.items()})


def _dropout_cube(x):  # torch: [N] -> []; its Hessian is diagonal, from the mask
    return F.dropout(x, 0.5, training=True).pow(3).sum()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_hvp_with_dropout_sees_the_draws_torch_func_makes(jit):
    f = torchjax.to_jax(_dropout_cube)
    hvp = lambda x, v: jax.jvp(jax.grad(f), (x,), (v,))
    hvp = jax.jit(hvp) if jit else hvp
    x, v = jnp.linspace(0.5, 1.5, 200), jnp.linspace(-1.0, 1.0, 200)
    hvp(x, v)  # traced and compiled: now only the call draws
    for _ in range(3):
        state = torch.get_rng_state()
        grad, hv = hvp(x, v)
        torch.set_rng_state(state)
        x_t, v_t = torch.tensor(np.asarray(x)), torch.tensor(np.asarray(v))
        want_grad, want_hv = torch.func.jvp(torch.func.grad(_dropout_cube), (x_t,), (v_t,))
        tree_close(grad, want_grad)
        tree_close(hv, want_hv)
        kept = np.asarray(grad) != 0  # the mask: grad = 3 * 8 * x**2 there, zero elsewhere
        assert 50 < kept.sum() < 150
        tree_close(np.asarray(hv)[kept], (6 * 8 * x * v)[kept])


def test_jitted_hessian_keeps_no_graph_behind():
    f = torchjax.to_jax(lambda x: torch.tanh(x).pow(3).sum())
    hessian = jax.jit(jax.hessian(f))
    x = jnp.linspace(-1.0, 1.0, 5)
    hessian(x)
    before = len(GRAPHS)
    for _ in range(5):
        got = hessian(x)
    assert len(GRAPHS) == before
    tree_close(got, jax.hessian(lambda x: (jnp.tanh(x) ** 3).sum())(x))


def test_a_jitted_forward_whose_pullback_is_unused_keeps_no_graph():
    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    f = torchjax.to_jax(lambda x, w: torch.sin(x @ w).sum())
    value_only = jax.jit(lambda x: jax.vjp(lambda x: f(x, w), x)[0])
    both = jax.jit(lambda x: jax.value_and_grad(lambda x: f(x, w))(x))
    x = jnp.linspace(0.0, 1.0, 8).reshape(2, 4)
    value_only(x)
    both(x)
    before = len(GRAPHS)
    tree_close(value_only(x), jnp.sin(x @ w).sum())
    assert len(GRAPHS) == before
    value, grad = both(x)  # the pullback used: its graph is kept, then freed by the backward
    tree_close(grad, jax.grad(lambda x: jnp.sin(x @ w).sum())(x))
    assert len(GRAPHS) == before


def test_jitted_hvp_with_grad_method_autograd():
    f = torchjax.to_jax(loss, grad_method="autograd")
    hvp = jax.jit(lambda p, v: jax.jvp(lambda p: jax.grad(f)(p, X), (p,), (v,))[1])
    want = torch.func.jvp(lambda p: torch.func.grad(loss)(p, X_T), (PARAMS_T,), (V_T,))[1]
    tree_close(hvp(PARAMS, V), want, rtol=1e-4, atol=1e-5)


@pytest.mark.cpu_only  # counts callbacks' work (see above)
def test_jitted_batch_of_hvps():
    f = torchjax.to_jax(loss)
    vs = jax.tree.map(lambda v: jnp.stack([v, -2 * v, 0.5 * v]), V)
    hvp = lambda p, v: jax.jvp(lambda p: jax.grad(f)(p, X), (p,), (v,))[1]
    hvs, count = _counted(lambda: jax.jit(jax.vmap(hvp, in_axes=(None, 0)))(PARAMS, vs))
    vs_t = {k: torch.tensor(np.asarray(vs[k])) for k in PARAMS_T}  # torch's key order
    torch_hvp = lambda v: torch.func.jvp(
        lambda p: torch.func.grad(loss)(p, X_T), (PARAMS_T,), (v,)
    )[1]
    want, want_count = _torch_counted(lambda: torch.func.vmap(torch_hvp)(vs_t))
    assert count == want_count
    tree_close(hvs, want, rtol=1e-4, atol=1e-5)


def _cached_tanh():
    """A torch function that fills a cache on its first call, and its jax.numpy twin."""
    cache = {}
    w = torch.linspace(-1.0, 1.0, 12).reshape(4, 3)

    def cached(x):  # [2, 4] -> []
        if "w" not in cache:
            cache["w"] = w * 1.0
        return torch.tanh(x @ cache["w"]).pow(2).sum()

    w_j = jnp.asarray(w.numpy())
    return torchjax.to_jax(cached), lambda x: (jnp.tanh(x @ w_j) ** 2).sum(), cache


@pytest.mark.parametrize("which", ["hvp", "hessian"])
def test_a_cache_filled_on_the_first_jitted_call_holds_a_plain_tensor(which):
    # The first call's forward still runs, plainly: were the cache filled inside the VJP's
    # torch.func transform, it would keep a tensor of that transform, and every later call
    # would fail (torch.func.jvp(torch.func.grad(cached)) fails so on its second call).
    f, f_jax, cache = _cached_tanh()
    if which == "hvp":
        make = lambda f: jax.jit(lambda x, v: jax.jvp(jax.grad(f), (x,), (v,))[1])
        args = lambda i: (jnp.full((2, 4), 0.1 * i), jnp.ones((2, 4)))
    else:
        make = lambda f: jax.jit(jax.hessian(f))
        args = lambda i: (jnp.full((2, 4), 0.1 * i),)
    got, want = make(f), make(f_jax)
    for i in range(3):
        tree_close(got(*args(i)), want(*args(i)))
    assert type(cache["w"]) is torch.Tensor and not torch._C._functorch.is_functorch_wrapped_tensor(
        cache["w"]
    )


def test_a_cache_filled_on_the_first_call_under_jitted_hvps_from_threads():
    f, f_jax, _ = _cached_tanh()
    hvp = lambda f: jax.jit(lambda x, v: jax.jvp(jax.grad(f), (x,), (v,))[1])
    got, want = hvp(f), hvp(f_jax)
    xs = [jnp.full((2, 4), 0.1 * i) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda x: got(x, jnp.ones((2, 4))), xs))
    for x, out in zip(xs, outs, strict=True):
        tree_close(out, want(x, jnp.ones((2, 4))))
