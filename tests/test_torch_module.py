"""to_torch_module: a JAX function and its params pytree as a torch.nn.Module. References are
pure JAX (jax.grad, the function itself) computed independently of torch."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax
from torchjax.errors import ConversionError


def mlp(params, x):  # {"dense": {...}, "out": {...}, "scale": [[]]}, [N, 3] -> [N, 2]
    h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return (h @ params["out"][0] + params["out"][1]) * params["scale"][0]


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "dense": {"kernel": jax.random.normal(k1, (3, 4)) / 2, "bias": jnp.zeros(4)},
        "out": [jax.random.normal(k2, (4, 2)) / 2, jnp.full(2, 0.1)],
        "scale": [jnp.asarray(1.5)],
    }


NAMES = {"dense.kernel", "dense.bias", "out.0", "out.1", "scale.0"}
X = jnp.linspace(-1, 1, 15).reshape(5, 3)
Y = jnp.linspace(0, 1, 10).reshape(5, 2)


def jax_loss(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)


def t(x):
    return torch.tensor(np.array(x))


def as_tree(module):
    return jax.tree.map(lambda v: jnp.asarray(v.detach().numpy()), module.param_tree())


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def test_names_follow_tree_paths_and_forward_matches():
    params = init_params()
    model = torchjax.to_torch_module(mlp, params)
    assert {n for n, _ in model.named_parameters()} == NAMES
    assert set(model.state_dict()) == NAMES
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    close(model(t(X)).detach(), mlp(params, X))


def test_sgd_steps_match_pure_jax_gradient_steps_and_leave_params_alone():
    params = init_params()
    before = jax.tree.map(np.array, params)
    model = torchjax.to_torch_module(mlp, params)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = params
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = torch.mean((model(t(X)) - t(Y)) ** 2)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        grads = jax.grad(jax_loss)(reference, X, Y)
        reference = jax.tree.map(lambda p, g: p - 0.1 * g, reference, grads)
        jax.tree.map(close, as_tree(model), reference)
    assert losses[-1] < losses[0]
    jax.tree.map(np.testing.assert_array_equal, params, before)  # JAX arrays never written


def test_parameters_own_their_memory():
    params = init_params()
    model = torchjax.to_torch_module(mlp, params)
    pointers = {p.unsafe_buffer_pointer() for p in jax.tree.leaves(params)}
    assert not pointers & {p.data_ptr() for p in model.parameters()}


def test_adam_reduces_the_loss():
    model = torchjax.to_torch_module(mlp, init_params())
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.mean((model(t(X)) - t(Y)) ** 2)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.2 * losses[0]


def test_state_dict_round_trip():
    model = torchjax.to_torch_module(mlp, init_params())
    other_params = jax.tree.map(lambda p: p * 0 + 0.25, init_params())
    other = torchjax.to_torch_module(mlp, other_params)
    assert not torch.allclose(model(t(X)), other(t(X)))
    other.load_state_dict(model.state_dict())
    close(other(t(X)).detach(), model(t(X)).detach())
    for (k, a), (k2, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b)
    twin = copy.deepcopy(model)  # a deep copy is independent of the original
    with torch.no_grad():
        twin.get_parameter("out.1").add_(1.0)
    close(twin(t(X)).detach(), model(t(X)).detach() + 1.5)  # scale 1.5 times the shift


def test_functional_call_substitutes_parameters_and_differentiates():
    model = torchjax.to_torch_module(mlp, init_params())
    new = jax.tree.map(lambda p: p * 1.5, init_params())
    flat = {
        "dense.kernel": new["dense"]["kernel"],
        "dense.bias": new["dense"]["bias"],
        "out.0": new["out"][0],
        "out.1": new["out"][1],
        "scale.0": new["scale"][0],
    }
    flat_t = {k: t(v) for k, v in flat.items()}
    out = torch.func.functional_call(model, flat_t, (t(X),))
    close(out, mlp(new, X))
    loss = lambda p: torch.mean((torch.func.functional_call(model, p, (t(X),)) - t(Y)) ** 2)
    grads = torch.func.grad(loss)(flat_t)
    want = jax.grad(jax_loss)(new, X, Y)
    close(grads["dense.kernel"], want["dense"]["kernel"])
    close(grads["out.0"], want["out"][0])
    close(grads["scale.0"], want["scale"][0])


def test_torch_compile_forward_and_backward():
    params = init_params()
    model = torchjax.to_torch_module(mlp, params)
    compiled = torch.compile(model)
    out = compiled(t(X))
    close(out.detach(), mlp(params, X))
    torch.mean((out - t(Y)) ** 2).backward()
    want = jax.grad(jax_loss)(params, X, Y)
    close(model.get_submodule("dense").get_parameter("kernel").grad, want["dense"]["kernel"])
    explained = torch._dynamo.explain(model)(t(X))
    assert explained.graph_break_count == 0  # to_torch's call stays in the graph


def test_integer_leaves_become_buffers():
    params = {"w": jnp.ones(3), "offset": jnp.asarray(2, jnp.int32)}
    model = torchjax.to_torch_module(lambda p, x: x * p["w"] + p["offset"], params)
    assert [n for n, _ in model.named_parameters()] == ["w"]
    assert [n for n, _ in model.named_buffers()] == ["offset"]
    assert set(model.state_dict()) == {"w", "offset"}
    close(model(torch.ones(3)).detach(), np.full(3, 3.0))


def test_has_aux():
    def f(params, x):
        y = x @ params["w"]
        return jnp.sum(y**2), {"y": y}

    model = torchjax.to_torch_module(f, {"w": jnp.ones((3, 2))}, has_aux=True)
    value, aux = model(torch.ones(4, 3))
    assert value.requires_grad and not aux["y"].requires_grad
    value.backward()
    close(model.w.grad, jax.grad(lambda w: f({"w": w}, jnp.ones((4, 3)))[0])(jnp.ones((3, 2))))


def test_train_eval_and_to_keep_working():
    model = torchjax.to_torch_module(mlp, {"params": init_params()["dense"]} | init_params())
    model.eval()
    model.train()
    model.double()
    assert model.get_parameter("dense.kernel").dtype == torch.float64


@pytest.mark.parametrize(
    "params, match",
    [
        ({"a.b": jnp.ones(2)}, r"key 'a.b'.*contains \"\.\""),
        ({"x": {"": jnp.ones(2)}}, r"params\['x'\] has the key ''.*empty"),
        ({"training": jnp.ones(2)}, r"key 'training'.*already has an attribute"),
        ({"blocks": {"forward": jnp.ones(2)}}, r"key 'forward'.*_Node already has"),
    ],
)
def test_bad_names_rejected(params, match):
    with pytest.raises(ValueError, match=f"(?s){match}"):
        torchjax.to_torch_module(lambda p, x: x, params)


def test_non_array_leaf_rejected():
    with pytest.raises(ConversionError, match=r"params\['lr'\] is a float"):
        torchjax.to_torch_module(lambda p, x: x, {"w": jnp.ones(2), "lr": 0.1})
