"""Functions a module holds that close over the module or its tensors (a lambda attribute
capturing `self`, a hook capturing its parent, a default argument): module_to_jax's calls
run them against the call's variables, never the user's module. References: the same
torch module with the same weights, called directly; torch.autograd.grad for gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax
from torchjax.errors import VariablesError

pytestmark = pytest.mark.core


class TiedHead(torch.nn.Module):
    """A head tied to the embedding through a lambda attribute that captures self."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)
        self.head = lambda h: h @ self.l.weight.T

    def forward(self, x):
        return self.head(torch.tanh(self.l(x)))


class HookedParent(torch.nn.Module):
    """A forward hook on a child that closes over the parent module."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)
        self.proj = torch.nn.Linear(4, 3)
        self.l.register_forward_hook(lambda m, i, out: out @ self.proj.weight.T + self.proj.bias)

    def forward(self, x):
        return self.l(x).sin()


class NestedAndListed(torch.nn.Module):
    """Closures made by a helper, kept in a list, and a default argument."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)

        def make(scale):
            return lambda h: scale * (h @ self.l.weight)

        self.steps = [make(2.0), make(0.5)]
        self.bias_of = lambda h, m=self.l: h + m.bias

    def forward(self, x):
        for step in self.steps:
            x = step(x)
        return self.bias_of(x)


def _x():
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _scaled(build, factor):
    torch.manual_seed(0)
    module = build().double()
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(factor)
    return module


@pytest.mark.parametrize("build", [TiedHead, HookedParent, NestedAndListed])
@pytest.mark.parametrize("jit", [False, True])
def test_closures_read_the_calls_variables(build, jit):
    with jax.enable_x64(True):
        user = _scaled(build, 1.0)
        apply, variables = torchjax.module_to_jax(user)
        call = jax.jit(apply) if jit else apply
        x = _x()
        xj = jnp.asarray(x.numpy())
        doubled = {"params": jax.tree.map(lambda a: 2 * a, variables["params"]), "buffers": {}}
        reference = _scaled(build, 2.0)
        np.testing.assert_allclose(call(doubled, xj), reference(x).detach().numpy(), rtol=1e-12)

        loss = lambda p: jnp.sum(call({"params": p, "buffers": {}}, xj) ** 2)
        grads = jax.grad(loss)(doubled["params"])
        names = [name for name, _ in reference.named_parameters()]
        expected = torch.autograd.grad((reference(x) ** 2).sum(), list(reference.parameters()))
        for name, g in zip(names, expected, strict=True):
            np.testing.assert_allclose(grads[name], g.numpy(), rtol=1e-10, err_msg=name)


def test_the_users_module_is_neither_read_nor_changed():
    with jax.enable_x64(True):
        user = _scaled(TiedHead, 1.0)
        apply, variables = torchjax.module_to_jax(user)
        xj = jnp.asarray(_x().numpy())
        before = np.asarray(apply(variables, xj))
        with torch.no_grad():
            user.l.weight.zero_()  # copy=True: the variables are the weights from before
        np.testing.assert_array_equal(apply(variables, xj), before)
        assert user.head.__closure__[0].cell_contents is user  # the user's lambda is its own
        assert not user.l.weight.any()


def test_a_hook_holding_a_parameter_itself_is_refused():
    """A closure over the Parameter object (not the module) cannot be pointed at a call's
    tensor: the copy's placeholder raises, where the user's weight would be read silently."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    w = lin.weight
    lin.register_forward_hook(lambda m, i, out: out @ w)
    apply, variables = torchjax.module_to_jax(lin)
    x = jnp.ones((2, 4))
    with pytest.raises(VariablesError, match="outside a call's slots"):
        apply(variables, x)
    with pytest.raises(VariablesError, match="outside a call's slots"):
        jax.jit(apply)(variables, x)


def test_state_a_closure_keeps_outside_the_module_stays_shared():
    """Cells holding what deepcopy did not copy (a counter in __init__'s scope) stay the
    user's: the function's own state is one, as in torch."""
    calls = []

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(2, 2)
            self.note = lambda: calls.append(self.l.weight.shape)

        def forward(self, x):
            self.note()
            return self.l(x)

    module = Counting()
    apply, variables = torchjax.module_to_jax(module)
    x = jnp.ones((1, 2))
    expected = module(torch.ones(1, 2)).detach().numpy()
    calls.clear()
    np.testing.assert_allclose(apply(variables, x), expected, rtol=1e-6)
    assert calls == [torch.Size([2, 2])]
