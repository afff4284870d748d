# Tests of vmap composed with differentiation for functions made by to_jax (issues #5, #6):
# vmap(grad), grad(vmap), vmap(jvp), vmap(hessian), jacobians of batched functions, each
# also under jit, compared with the same function written in jax.numpy. Where the batched
# derivative should be one torch.func.vmap call, the tests count real torch calls.
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import tree_close
from torch._subclasses.fake_tensor import is_fake

import torchjax


def _cubic(x):
    # (x * x * x) under vmap(vmap(jvp(grad))) trips torch's fake tensors (see test below).
    return (x * x * x).sum() + (torch.exp(x) * x).sum()


def _cubic_jax(x):
    return (x * x * x).sum() + (jnp.exp(x) * x).sum()


XS = jnp.array([[0.3, -1.2, 0.8], [1.0, 0.1, -0.5], [-0.7, 0.4, 0.2], [0.0, 2.0, -1.0]])

TRANSFORMS = {
    "vmap(grad)": lambda f: jax.vmap(jax.grad(f)),
    "grad(vmap)": lambda f: jax.grad(lambda xs: (jax.vmap(f)(xs) ** 2).sum()),
    "vmap(hessian)": lambda f: jax.vmap(jax.hessian(f)),
    "hessian(vmap)": lambda f: jax.hessian(lambda xs: jax.vmap(f)(xs).sum()),
    "vmap(jvp)": lambda f: jax.vmap(lambda x: jax.jvp(f, (x,), (jnp.cos(x),))[1]),
    "jvp(vmap)": lambda f: lambda xs: jax.jvp(jax.vmap(f), (xs,), (jnp.ones_like(xs),))[1],
    "vmap(vmap(grad))": lambda f: jax.vmap(jax.vmap(jax.grad(f)), in_axes=1, out_axes=1),
    "vmap(grad(grad))": lambda f: jax.vmap(jax.grad(lambda x: jax.grad(f)(x).sum())),
    "jacrev(vmap)": lambda f: jax.jacrev(jax.vmap(f)),
    "jacfwd(vmap)": lambda f: jax.jacfwd(jax.vmap(f)),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_composition(name, jit):
    t = TRANSFORMS[name]
    xs = XS.reshape(2, 2, 3) if name == "vmap(vmap(grad))" else XS
    g = t(torchjax.to_jax(_cubic))
    g = jax.jit(g) if jit else g
    tree_close(g(xs), jax.jit(t(_cubic_jax))(xs))


def test_vmap_of_hessian_survives_the_fake_tensor_bug():
    # Regression. torch's fake tensors raise FakeTensorDeviceMismatchError ("meta and
    # cpu") on vmap(vmap(jvp(grad(f)))) for f = (x * x * x).sum(), which real tensors run
    # fine; jax.vmap(jax.hessian(f)) builds exactly that, and shape inference failed.
    def torch_side(x, t):
        f = lambda x: (x * x * x).sum()
        inner = lambda x, t: torch.func.jvp(torch.func.grad(f), (x,), (t,))[1]
        return torch.func.vmap(torch.func.vmap(inner, in_dims=(None, 0)), in_dims=(0, None))(x, t)

    # The premise: if torch fixes this, the workaround is dead code and this says so.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError, match="meta"):
        torch_side(torch.empty(2, 3), torch.empty(3, 3))

    f = torchjax.to_jax(lambda x: (x * x * x).sum())
    tree_close(jax.vmap(jax.hessian(f))(XS), jax.vmap(lambda x: jnp.diag(6 * x))(XS))


def test_per_example_gradients_are_one_torch_call():
    calls = []

    def loss(params, x, y):
        if not is_fake(x):
            calls.append(tuple(x.shape))
        pred = torch.tanh(x @ params["w"] + params["b"])
        return ((pred - y) ** 2).sum()

    def loss_jax(params, x, y):
        return ((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2).sum()

    params = {"w": jnp.array([[0.2, -0.5], [0.7, 0.1], [-0.3, 0.4]]), "b": jnp.array([0.1, -0.2])}
    ys = jnp.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [-1.0, 1.0]])
    g = jax.jit(jax.vmap(jax.grad(torchjax.to_jax(loss)), in_axes=(None, 0, 0)))
    out = g(params, XS, ys)
    tree_close(out, jax.vmap(jax.grad(loss_jax), in_axes=(None, 0, 0))(params, XS, ys))
    assert out["w"].shape == (4, 3, 2)
    # jit drops the unused primal call: one batched VJP call, on per-example shapes
    assert calls == [(3,)]


def test_grad_of_nested_dict_vmap():
    f = torchjax.to_jax(lambda d: (torch.sin(d["a"]) * d["b"]).sum())
    fj = lambda d: (jnp.sin(d["a"]) * d["b"]).sum()
    a, b = XS, XS[:, :2].T  # a batched at 0, b at 1
    loss = lambda f: (
        lambda a, b: jax.vmap(f, in_axes=({"a": 0, "b": 1},))({"a": a[:, :2], "b": b}).sum()
    )
    tree_close(jax.grad(loss(f), argnums=(0, 1))(a, b), jax.grad(loss(fj), argnums=(0, 1))(a, b))


def test_sequential_vmap_of_grad_of_data_dependent_code():
    def torch_f(x):
        return (x**2).sum() * 2 if x.sum() > 0 else torch.sin(x).sum()

    def jax_f(x):
        return jnp.where(x.sum() > 0, (x**2).sum() * 2, jnp.sin(x).sum())

    f = torchjax.to_jax(
        torch_f,
        result_shape_dtypes=jax.ShapeDtypeStruct((), jnp.float32),
        vmap_method="sequential",
    )
    tree_close(jax.jit(jax.vmap(jax.grad(f)))(XS), jax.vmap(jax.grad(jax_f))(XS))
    tree_close(jax.jit(jax.vmap(jax.hessian(f)))(XS), jax.vmap(jax.hessian(jax_f))(XS))
    grad_of_vmap = jax.jit(jax.grad(lambda xs: jax.vmap(f)(xs).sum()))
    tree_close(grad_of_vmap(XS), jax.vmap(jax.grad(jax_f))(XS))


# -- derivatives under vmap_method "expand_dims" / "broadcast_all" -----------------------


def _einsum_loss(x, w):  # [..., I], [I, J] or [..., I, J] -> [...]
    return torch.tanh(torch.einsum("...i,...ij->...j", x, w)).sum(-1)


def _einsum_loss_jax(x, w):
    return jnp.tanh(jnp.einsum("...i,...ij->...j", x, w)).sum(-1)


W = jnp.array([[0.2, -0.5], [0.7, 0.1], [-0.3, 0.4]])

LEADING = {
    "vmap(grad)": lambda f: jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(0, None)),
    "grad(vmap)": lambda f: jax.grad(
        lambda x, w: jax.vmap(f, in_axes=(0, None))(x, w).sum(), argnums=(0, 1)
    ),
    "vmap(hessian)": lambda f: jax.vmap(jax.hessian(f, argnums=1), in_axes=(0, None)),
    "vmap(jvp)": lambda f: jax.vmap(lambda x, w: jax.jvp(f, (x, w), (x, w))[1], in_axes=(0, None)),
}


@pytest.mark.parametrize(
    ("method", "declared"),
    [("expand_dims", False), ("expand_dims", True), ("broadcast_all", False)],
    ids=["expand_dims-fake", "expand_dims-declared", "broadcast_all-fake"],
)
@pytest.mark.parametrize("name", list(LEADING))
def test_leading_axis_methods_compose_with_autodiff(name, method, declared):
    # Regression: with expand_dims, the VJP of a batched call got a size-1 cotangent for a
    # batched output, and a VJP with respect to a size-1 input would sum over the batch.
    rsd = (lambda x, w: jax.ShapeDtypeStruct(x.shape[:-1], x.dtype)) if declared else None
    f = torchjax.to_jax(_einsum_loss, vmap_method=method, result_shape_dtypes=rsd)
    t = LEADING[name]
    tree_close(jax.jit(t(f))(XS, W), t(_einsum_loss_jax)(XS, W))
