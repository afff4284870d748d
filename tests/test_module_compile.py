"""module_to_jax(torch.compile(model)): real calls run the compiled code; shapes come from a
fake run of the original module; the variables carry the original module's names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax

# Calls that ran inside a dynamo-compiled frame. A global: apply runs copies of the module,
# whose own attributes are reset after every call.
COMPILED_CALLS = [0]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = torch.nn.Linear(4, 8)
        self.lin2 = torch.nn.Linear(8, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x):
        if torch.compiler.is_compiling():
            COMPILED_CALLS[0] += 1
        return torch.tanh(self.lin2(torch.tanh(self.lin1(x)))) * self.scale


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    net = Net()
    reference = Net()
    reference.load_state_dict(net.state_dict())
    apply, variables = torchjax.module_to_jax(torch.compile(net))
    return net, reference, apply, variables


X = jnp.linspace(-1, 1, 20, dtype=jnp.float32).reshape(5, 4)


def reference_out(reference, params, x):
    state = {**{k: torch.tensor(np.array(v)) for k, v in params.items()}, "scale": reference.scale}
    return torch.func.functional_call(reference, state, (torch.tensor(np.array(x)),))


def test_names_are_the_original_modules(compiled):
    net, _, _, variables = compiled
    assert set(variables["params"]) == {"lin1.weight", "lin1.bias", "lin2.weight", "lin2.bias"}
    assert set(variables["buffers"]) == {"scale"}
    assert not any(k.startswith("_orig_mod") for g in variables.values() for k in g)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_forward_runs_compiled_code(compiled, mode):
    net, reference, apply, variables = compiled
    before = COMPILED_CALLS[0]
    f = jax.jit(apply) if mode == "jit" else apply
    # New parameter values each call: the compiled module must use the ones it is given.
    params = jax.tree.map(lambda v: v * 0.5, variables["params"])
    out = f({"params": params, "buffers": variables["buffers"]}, X)
    want = reference_out(reference, params, X).detach().numpy()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert COMPILED_CALLS[0] > before, "the real call did not go through torch.compile"


def test_vmap(compiled):
    _, reference, apply, variables = compiled
    out = jax.vmap(lambda x: apply(variables, x))(X[:, None, :])  # [5, 1, 4] -> [5, 1, 3]
    want = reference_out(reference, variables["params"], X).detach().numpy()
    np.testing.assert_allclose(out[:, 0], want, rtol=1e-5, atol=1e-6)


def test_grad_wrt_params_and_inputs(compiled):
    _, reference, apply, variables = compiled
    buffers = variables["buffers"]
    loss = lambda p, x: jnp.sum(jnp.sin(apply({"params": p, "buffers": buffers}, x)))
    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], X)
    params_t = {
        k: torch.tensor(np.array(v), requires_grad=True) for k, v in variables["params"].items()
    }
    x_t = torch.tensor(np.array(X), requires_grad=True)
    state = {**params_t, "scale": reference.scale}
    torch.sin(torch.func.functional_call(reference, state, (x_t,))).sum().backward()
    for k, p in params_t.items():
        np.testing.assert_allclose(g_params[k], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(g_x, x_t.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_module_untouched(compiled):
    net, reference, apply, variables = compiled
    apply(variables, X)
    for (k, a), (_, b) in zip(
        net.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k


def test_apply_of_a_compiled_module_pickles():
    # torch.compile's wrapper of a module that is no container raises on len(): the
    # pickling must not ask it for its truth value.
    import pickle

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    apply, variables = torchjax.module_to_jax(torch.compile(module, backend="eager"))
    again = pickle.loads(pickle.dumps(apply))
    x = jnp.arange(6.0).reshape(2, 3)
    with torch.no_grad():
        expected = module(torch.from_numpy(np.asarray(x))).numpy()
    np.testing.assert_allclose(again(variables, x), expected, rtol=1e-6)
