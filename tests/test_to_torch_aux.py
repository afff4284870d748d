"""to_torch(fn, has_aux=True): fn returns (output, aux); aux comes back as tensors that carry
no gradient, under autograd and torch.func. References: the JAX function's own transforms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax
from torchjax.errors import JaxOutputError

pytestmark = pytest.mark.usefixtures("x64")  # every test in float64


def jax_loss(w, x):  # [3], [N, 3] -> [], {"pred": [N], "best": []}
    pred = jnp.tanh(x @ w)
    return jnp.mean(pred**2), {"pred": pred, "best": jnp.argmax(pred)}


loss = torchjax.to_torch(jax_loss, has_aux=True)


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, generator=g, dtype=torch.float64), torch.randn(
        5, 3, generator=g, dtype=torch.float64
    )


def as_jax(*ts):
    return [jnp.asarray(t.detach().numpy()) for t in ts]


def close(a, b, **kw):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12, **kw)


def test_values_and_requires_grad():
    w, x = data()
    w.requires_grad_()
    value, aux = loss(w, x)
    want_value, want_aux = jax_loss(*as_jax(w, x))
    close(value.detach(), want_value)
    close(aux["pred"], want_aux["pred"])
    assert int(aux["best"]) == int(want_aux["best"])
    assert value.requires_grad
    assert not aux["pred"].requires_grad and not aux["best"].requires_grad
    assert aux["pred"].grad_fn is None


def test_backward_matches_jax_grad_and_ignores_aux():
    w, x = data()
    w.requires_grad_()
    value, aux = loss(w, x)
    # aux is detached: adding it to the loss changes nothing in the gradient.
    (value + aux["pred"].sum()).backward()
    want = jax.grad(lambda w, x: jax_loss(w, x)[0])(*as_jax(w, x))
    close(w.grad, want)


def test_torch_func_grad_has_aux_matches_jax_grad_has_aux():
    w, x = data()
    g, aux = torch.func.grad(loss, has_aux=True)(w, x)
    want_g, want_aux = jax.grad(jax_loss, has_aux=True)(*as_jax(w, x))
    close(g, want_g)
    close(aux["pred"], want_aux["pred"])


def test_torch_func_vjp_and_jvp_with_aux():
    w, x = data()
    (value, pull, aux) = torch.func.vjp(lambda w: loss(w, x), w, has_aux=True)
    (g,) = pull(torch.ones_like(value))
    jw, jx = as_jax(w, x)
    close(g, jax.grad(lambda w: jax_loss(w, jx)[0])(jw))
    close(aux["pred"], jax_loss(jw, jx)[1]["pred"])
    t = torch.linspace(-1, 1, 3, dtype=torch.float64)
    _, tangent, aux = torch.func.jvp(lambda w: loss(w, x), (w,), (t,), has_aux=True)
    _, want = jax.jvp(lambda w: jax_loss(w, jx)[0], (jw,), (jnp.asarray(t.numpy()),))
    close(tangent, want)
    close(aux["pred"], jax_loss(jw, jx)[1]["pred"])


def test_forward_ad_gives_no_tangent_to_aux():
    import torch.autograd.forward_ad as fwAD

    w, x = data()
    with fwAD.dual_level():
        value, aux = loss(fwAD.make_dual(w, torch.ones(3, dtype=torch.float64)), x)
        assert fwAD.unpack_dual(value).tangent is not None
        assert fwAD.unpack_dual(aux["pred"]).tangent is None


def test_vmap_batches_output_and_aux():
    w, x = data()
    ws = torch.stack([w, 2 * w, -w])
    value, aux = torch.func.vmap(loss, in_dims=(0, None))(ws, x)
    want_value, want_aux = jax.vmap(jax_loss, in_axes=(0, None))(*as_jax(ws, x))
    close(value, want_value)
    close(aux["pred"], want_aux["pred"])
    np.testing.assert_array_equal(aux["best"].numpy(), np.asarray(want_aux["best"]))


def test_vmap_of_grad_with_aux():
    w, x = data()
    ws = torch.stack([w, 2 * w])
    g, aux = torch.func.vmap(torch.func.grad(loss, has_aux=True), in_dims=(0, None))(ws, x)
    want_g, want_aux = jax.vmap(jax.grad(jax_loss, has_aux=True), in_axes=(0, None))(*as_jax(ws, x))
    close(g, want_g)
    close(aux["pred"], want_aux["pred"])


def test_hessian_with_aux_ignores_aux():
    w, x = data()
    h = torch.func.hessian(lambda w: loss(w, x)[0])(w)
    jw, jx = as_jax(w, x)
    close(h, jax.hessian(lambda w: jax_loss(w, jx)[0])(jw))


def test_decorator_form():
    @torchjax.to_torch(has_aux=True)
    def f(x):
        return jnp.sum(x**2), x * 3

    value, aux = f(torch.ones(2, requires_grad=True))
    assert float(value) == 2.0 and aux.tolist() == [3.0, 3.0] and not aux.requires_grad


@pytest.mark.parametrize(
    "bad, kind",
    [(lambda x: x, r"single array of shape \[2\]"), (lambda x: (x, x, x), "tuple of length 3")],
)
def test_not_a_pair_is_an_error(bad, kind):
    f = torchjax.to_torch(bad, has_aux=True)
    with pytest.raises(JaxOutputError, match=f"(?s)returned a {kind}.*pair \\(output, aux\\)"):
        f(torch.ones(2))


def test_torch_compile_with_aux():
    w, x = data()
    compiled = torch.compile(lambda w, x: loss(w, x))
    w.requires_grad_()
    value, aux = compiled(w, x)
    value.backward()
    want_value, want_aux = jax_loss(*as_jax(w, x))
    close(value.detach(), want_value)
    close(aux["pred"], want_aux["pred"])
    assert not aux["pred"].requires_grad
    close(w.grad, jax.grad(lambda w, x: jax_loss(w, x)[0])(*as_jax(w, x)))
