# Tests of reverse-mode (and, through check_grads, forward-mode) differentiation of
# functions made by to_jax (issue #6).
#
# References are independent of torchjax: jax.test_util.check_grads compares against
# finite differences in float64 (x64 is switched on only inside a test, by a context
# manager), and exact values come from the same function written in jax.numpy. grad_method
# "autograd" is tested on an old-style torch.autograd.Function that torch.func refuses.
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import Cube, Square, tree_close
from jax.test_util import check_grads

import torchjax
from torchjax.errors import AutodiffError

pytestmark = pytest.mark.core  # the version matrix runs this module

BOTH = ("fwd", "rev")


def _normal(seed: int, *shape: int, dtype: Any = jnp.float64) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, dtype=dtype)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2), torch.nn.Softplus()
    ).double()


# (torch function, argument shapes); each is checked to order 2 in both modes.
CASES = {
    "elementwise": (lambda x: torch.sin(x) * torch.exp(x) + x**3 / (1 + x**2), [(3, 4)]),
    "binary": (lambda x, y: torch.tanh(x) * y - torch.sigmoid(y), [(3, 4), (3, 4)]),
    "matmul": (lambda a, b: a @ b, [(3, 4), (4, 2)]),
    "reductions": (
        lambda x: (x.sum(0), (x**2).mean(), x.prod(1), x.amax(1), x.norm()),
        [(3, 4)],
    ),
    "softmax": (lambda x: torch.softmax(x, dim=-1), [(3, 4)]),
    "logsumexp": (lambda x: torch.logsumexp(x, dim=1), [(3, 4)]),
    "conv2d": (lambda img, w: F.conv2d(img, w, padding=1), [(1, 1, 3, 3), (2, 1, 2, 2)]),
    "pytree": (
        lambda d: {"s": (d["a"] * d["b"]).sum(), "t": (torch.cos(d["a"]), d["b"] ** 2)},
        [{"a": (3,), "b": (3,)}],
    ),
}


def _args(shapes: list) -> tuple:
    leaves, tree = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    return tuple(jax.tree.unflatten(tree, [_normal(i, *s) for i, s in enumerate(leaves)]))


@pytest.mark.parametrize("name", list(CASES))
def test_check_grads_order_2(name, x64):
    fn, shapes = CASES[name]
    check_grads(torchjax.to_jax(fn), _args(shapes), order=2, modes=BOTH)


def test_check_grads_small_nn_closed_over(x64):
    net = _mlp()
    check_grads(torchjax.to_jax(lambda x: net(x)), (_normal(0, 3, 4),), order=2, modes=BOTH)


def _well_posed(seed: int) -> tuple[jax.Array, jax.Array]:
    return _normal(seed, 3, 3) + 3 * jnp.eye(3), _normal(seed + 1, 3, 2)


def test_check_grads_linalg_solve(x64):
    solve = torchjax.to_jax(torch.linalg.solve)
    a, b = _well_posed(0)
    check_grads(solve, (a, b), order=1, modes=BOTH)
    check_grads(solve, (a, b), order=2, modes=("rev",))


def test_grad_matches_jax_numpy():
    f = torchjax.to_jax(lambda x, y: (torch.sin(x) @ y).pow(2).sum())
    fj = lambda x, y: ((jnp.sin(x) @ y) ** 2).sum()
    x, y = _normal(0, 3, 4, dtype=jnp.float32), _normal(1, 4, 2, dtype=jnp.float32)
    tree_close(jax.grad(f, argnums=(0, 1))(x, y), jax.grad(fj, argnums=(0, 1))(x, y), rtol=1e-4)
    tree_close(
        jax.jit(jax.grad(f, argnums=(0, 1)))(x, y), jax.grad(fj, argnums=(0, 1))(x, y), rtol=1e-4
    )


def test_grad_goes_through_one_vjp_call():
    f = torchjax.to_jax(lambda x, y: (x * y).sum())
    x = jnp.arange(3.0)
    jaxpr = jax.make_jaxpr(jax.grad(f))(x, x + 1)
    fns = [dict(e.params["params"])["fn"] for e in jaxpr.eqns if e.primitive.name == "torch_call"]
    vjps = [fn for fn in fns if type(fn).__name__ == "VjpFunction"]
    assert len(vjps) == 1 and vjps[0].wrt == (0,)


# -- a pullback differentiated with respect to its cotangent ----------------------------
# The pullback of jax.vjp is linear in its cotangent; differentiated in reverse with
# respect to the cotangent alone (the point fixed), its JVP pair must split into the
# pullback of the cotangent (known) and that of its tangent (staged, to be transposed).


def _pullback_loss(f, x, w):
    def loss(c):
        gx, gw = jax.vjp(f, x, w)[1](c)
        return jnp.sum(gx**2) + jnp.sum(jnp.cos(gw))

    return loss


PULLBACK_TRANSFORMS = {
    "grad": jax.grad,
    "jit(grad)": lambda h: jax.jit(jax.grad(h)),
    "grad(checkpoint)": lambda h: jax.grad(jax.checkpoint(h)),
    "grad(checkpoint), all saved": lambda h: jax.grad(
        jax.checkpoint(h, policy=jax.checkpoint_policies.everything_saveable)
    ),
    "hessian": jax.hessian,
    "vmap(grad)": lambda h: lambda c: jax.vmap(jax.grad(h))(jnp.stack([c, 2 * c])),
    "linearize": lambda h: lambda c: jax.linearize(h, c)[1](jnp.array([1.0, 0.5])),
}


@pytest.mark.parametrize("transform", list(PULLBACK_TRANSFORMS))
def test_reverse_mode_through_a_pullback_in_its_cotangent(transform, x64):
    f = torchjax.to_jax(lambda x, w: (torch.sin(x) * x) @ w)
    fj = lambda x, w: (jnp.sin(x) * x) @ w
    x, w, c = _normal(0, 3), _normal(1, 3, 2), jnp.array([1.0, -2.0])
    t = PULLBACK_TRANSFORMS[transform]
    tree_close(t(_pullback_loss(f, x, w))(c), t(_pullback_loss(fj, x, w))(c))


# Differentiated with respect to the point as well, under jax.checkpoint: the recomputed
# forward's residuals (its RNG state) were read from a call that still took the point's
# tangent as an operand, so the checkpoint's transpose took everything computed from them
# (the pullback's value) for linear, and failed in JAX (an AssertionError in mul's transpose).
POLICIES = {
    "default": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_checkpointed_pullback_differentiated_in_its_point(policy, jit, x64):
    f = torchjax.to_jax(lambda x, w: (torch.sin(x) * x) @ w)
    fj = lambda x, w: (jnp.sin(x) * x) @ w

    def loss(fn):
        def at(x, w, c):
            gx, gw = jax.vjp(fn, x, w)[1](c)
            return jnp.sum(gx**2) + jnp.sum(jnp.cos(gw))

        grad = jax.grad(jax.checkpoint(at, policy=POLICIES[policy]), argnums=(0, 1, 2))
        return jax.jit(grad) if jit else grad

    x, w, c = _normal(0, 3), _normal(1, 3, 2), jnp.array([1.0, -2.0])
    tree_close(loss(f)(x, w, c), loss(fj)(x, w, c))


def test_check_grads_of_a_pullback_in_its_cotangent(x64):
    f = torchjax.to_jax(lambda x, w: (torch.sin(x) * x) @ w)
    loss = _pullback_loss(f, _normal(0, 3), _normal(1, 3, 2))
    check_grads(loss, (jnp.array([1.0, -2.0]),), order=2, modes=BOTH)


# -- non-differentiable inputs, several outputs ------------------------------------------


def test_integer_inputs_get_float0_cotangents():
    f = torchjax.to_jax(lambda x, n: (x * n.to(x.dtype)).sum() + n.sum())
    x, n = jnp.array([0.5, 1.5, -2.0]), jnp.array([1, 2, 3])
    gx, gn = jax.grad(f, argnums=(0, 1), allow_int=True)(x, n)
    tree_close(gx, np.array([1.0, 2.0, 3.0]))
    assert gn.dtype == jax.dtypes.float0 and gn.shape == (3,)
    with pytest.raises(TypeError, match="allow_int"):
        jax.grad(f, argnums=1)(x, n)


def test_mixed_pytree_input_with_int_and_static_leaves():
    f = torchjax.to_jax(lambda d, k: (d["w"] * d["idx"].to(d["w"].dtype) ** k).sum())
    d = {"w": jnp.array([1.0, 2.0]), "idx": jnp.array([3, 4])}
    g = jax.grad(lambda w: f({"w": w, "idx": d["idx"]}, 2))(d["w"])
    tree_close(g, np.array([9.0, 16.0]))


def test_vjp_with_several_pytree_outputs():
    f = torchjax.to_jax(
        lambda x, y: {"p": x * y, "q": (torch.sin(x).sum(), y.argmax()), "r": x > 0}
    )
    fj = lambda x, y: {"p": x * y, "q": (jnp.sin(x).sum(), y.argmax()), "r": x > 0}
    x, y = jnp.array([0.1, -0.7, 2.0]), jnp.array([1.0, 3.0, -2.0])
    out, pullback = jax.vjp(f, x, y)
    out_j, pullback_j = jax.vjp(fj, x, y)
    tree_close(out, out_j)
    ct = {
        "p": jnp.array([1.0, -1.0, 0.5]),
        "q": (jnp.float32(2.0), np.zeros((), jax.dtypes.float0)),
        "r": np.zeros((3,), jax.dtypes.float0),
    }
    tree_close(pullback(ct), pullback_j(ct))


def test_grad_of_one_output_among_many():
    f = torchjax.to_jax(lambda x: (torch.exp(x), torch.cos(x), x.sum()))
    x = jnp.array([0.3, -0.2])
    tree_close(jax.grad(lambda x: f(x)[1].sum())(x), -jnp.sin(x))
    tree_close(
        jax.jit(jax.grad(lambda x: f(x)[2] + f(x)[0][0]))(x), jnp.array([1 + jnp.exp(0.3), 1])
    )


def test_output_not_depending_on_the_input_has_zero_grad():
    f = torchjax.to_jax(lambda x, y: (y * 2).sum() + 0 * x.sum())
    g = torchjax.to_jax(lambda x, y: (y * 2).sum())
    x = jnp.arange(3.0)
    tree_close(jax.grad(f)(x, x), np.zeros(3))
    tree_close(jax.grad(g)(x, x), np.zeros(3))


# -- grad_method="autograd" --------------------------------------------------------------


def _cube_sum(x):
    return Cube.apply(x).sum()


def test_old_style_function_is_what_torch_func_refuses():
    # The premise of the autograd tests: without it they would prove nothing.
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(_cube_sum)(torch.ones(2))


def test_default_grad_method_names_autograd():
    f = torchjax.to_jax(_cube_sum)
    x = jnp.array([0.5, -1.0, 2.0])
    tree_close(f(x), (x**3).sum())
    # A first-order VJP that nothing differentiates again runs on plain autograd, which
    # takes old-style Functions; what needs torch.func fails and names the way out.
    tree_close(jax.grad(f)(x), 3 * x**2)
    tree_close(jax.jit(jax.grad(f))(x), 3 * x**2)
    hint = re.escape("grad_method='autograd'")
    with pytest.raises(AutodiffError, match=hint):
        jax.jvp(f, (x,), (x,))
    with pytest.raises(AutodiffError, match=hint):
        jax.hessian(f)(x)
    with pytest.raises(Exception, match=hint):  # under jit, wrapped by XLA's callback
        jax.jit(jax.hessian(f))(x)


def test_autograd_grad_method_differentiates_old_style_function():
    f = torchjax.to_jax(_cube_sum, grad_method="autograd")
    x = jnp.array([0.5, -1.0, 2.0])
    tree_close(jax.grad(f)(x), 3 * x**2)
    tree_close(jax.jit(jax.grad(f))(x), 3 * x**2)
    _, t = jax.jvp(f, (x,), (jnp.array([1.0, 0.0, -1.0]),))
    tree_close(t, 3 * 0.25 - 3 * 4.0)
    _, t = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(x, jnp.ones(3))
    tree_close(t, (3 * x**2).sum())


def test_autograd_second_order_old_style_function():
    # Second order needs Cube.backward to be differentiable, which it is (plain torch ops).
    f = torchjax.to_jax(_cube_sum, grad_method="autograd", vmap_method="sequential")
    x = jnp.array([0.5, -1.0, 2.0])
    tree_close(jax.grad(lambda x: jax.grad(f)(x).sum())(x), 6 * x)
    tree_close(jax.jit(jax.hessian(f))(x), jnp.diag(6 * x))


def test_autograd_check_grads_order_2(x64):
    f = torchjax.to_jax(
        lambda x, y: (torch.sin(x) * y.exp(), (x * y).sum()), grad_method="autograd"
    )
    check_grads(f, (_normal(0, 4), _normal(1, 4)), order=2, modes=BOTH)


def test_autograd_higher_derivatives_are_not_cut():
    # Regression: the autograd path detached its inputs, cutting the outer tape, so every
    # second derivative came out as zeros.
    f = torchjax.to_jax(lambda x: (x**3).sum(), grad_method="autograd")
    x = jnp.array([0.5, -1.0, 2.0])
    tree_close(jax.grad(lambda x: jax.grad(f)(x).sum())(x), 6 * x)
    tree_close(jax.jvp(jax.grad(f), (x,), (jnp.ones(3),))[1], 6 * x)
    tree_close(jax.grad(lambda x: jax.jvp(f, (x,), (jnp.ones(3),))[1])(x), 6 * x)


def test_autograd_output_independent_of_input():
    # Regression: torch.autograd.grad refused outputs that do not depend on the inputs.
    f = torchjax.to_jax(lambda x, y: (y * 2, (x**2).sum()), grad_method="autograd")
    x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    tree_close(jax.grad(lambda x: f(x, y)[0].sum())(x), np.zeros(2))
    tree_close(jax.jvp(lambda x: f(x, y), (x,), (jnp.ones(2),))[1], (np.zeros(2), 6.0))
    tree_close(jax.grad(lambda x: f(x, y)[1] + f(x, y)[0].sum())(x), 2 * x)


# -- complex numbers ---------------------------------------------------------------------


def _not_holomorphic(z):
    return z * z.conj() * z + 1j * torch.sin(z.real) * z.imag


@pytest.mark.parametrize("grad_method", ["torch.func", "autograd"])
def test_check_grads_complex(grad_method, x64):
    z = jnp.array([1 + 2j, 0.5 - 1j, -0.3 + 0.2j])
    x = jnp.array([0.3, -0.7, 1.1])
    f = torchjax.to_jax(_not_holomorphic, grad_method=grad_method)
    check_grads(f, (z,), order=2, modes=BOTH)
    mixed = torchjax.to_jax(lambda z, x: (z * x, (z.abs() * x).sum()), grad_method=grad_method)
    check_grads(mixed, (z, x), order=2, modes=BOTH)


def test_complex_vjp_uses_jax_convention():
    # Regression: torch's pullback is the conjugate of JAX's, and was returned as is.
    z = jnp.array([1 + 2j, 0.5 - 1j], dtype=jnp.complex64)
    ct = jnp.array([0.3 - 1j, 2 + 0.5j], dtype=jnp.complex64)
    f = torchjax.to_jax(lambda z: z * z)
    tree_close(jax.vjp(f, z)[1](ct), jax.vjp(lambda z: z * z, z)[1](ct))
    g = torchjax.to_jax(lambda z: (z.abs() ** 2 + z.real * z.imag).sum())
    gj = lambda z: (jnp.abs(z) ** 2 + z.real * z.imag).sum()
    tree_close(jax.grad(g)(z), jax.grad(gj)(z))
    tree_close(jax.jit(jax.grad(g))(z), jax.grad(gj)(z))


# -- reverse mode where torch has no forward mode ----------------------------------------


def _square_sum(x):
    return torch.sin(Square.apply(x)).sum()


def test_grad_without_forward_mode_in_torch():
    # Regression: jax.grad traces the JVP call before transposing it into a VJP, and the
    # fake-tensor run of torch.func.jvp failed, although only the VJP ever runs.
    with pytest.raises(NotImplementedError, match="jvp"):
        torch.func.jvp(_square_sum, (torch.ones(2),), (torch.ones(2),))
    f = torchjax.to_jax(_square_sum)
    x = jnp.array([0.5, -1.0, 1.5])
    expected = 2 * x * jnp.cos(x**2)
    tree_close(jax.grad(f)(x), expected)
    tree_close(jax.jit(jax.grad(f))(x), expected)
    tree_close(jax.vmap(jax.grad(f))(jnp.stack([x, -x])), jnp.stack([expected, -expected]))
    # forward mode itself cannot work with torch.func, and says what can
    with pytest.raises(AutodiffError, match=re.escape("grad_method='autograd'")):
        jax.jvp(f, (x,), (jnp.ones(3),))
    g = torchjax.to_jax(_square_sum, grad_method="autograd")
    tree_close(jax.jvp(g, (x,), (jnp.ones(3),))[1], expected.sum())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_sparse_gradient_arrives_dense(jit):
    # nn.Embedding(sparse=True): torch's gradient of the weight is a sparse COO tensor.
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    apply, variables = torchjax.module_to_jax(emb)
    ids = jnp.asarray([[0, 1, 2], [3, 1, 1]])
    loss = lambda p: jnp.sum(apply({"params": p, "buffers": {}}, ids) ** 2)
    grad = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    w = emb.weight.detach().clone().requires_grad_()
    (F.embedding(torch.tensor(np.asarray(ids)), w) ** 2).sum().backward()
    tree_close(grad(variables["params"])["weight"], w.grad.numpy())
