"""module_to_jax(module, copy="move"): one set of weights, and a module that can no longer
change them; placeholders that raise instead of computing with memory they do not have.

References are the module before the move (a deep copy taken first) run in plain torch."""

from __future__ import annotations

import copy
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax
from torchjax.errors import ArgumentError, CopyWarning, VariablesError

pytestmark = pytest.mark.core  # the version matrix runs this module


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )


class Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight, as language models do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed = torch.nn.Embedding(10, 6)
        self.out = torch.nn.Linear(6, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.embed(ids)))


X = np.linspace(-2, 2, 20, dtype=np.float32).reshape(5, 4)


def _moved(module):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CopyWarning)  # nothing else holds these tensors
        return torchjax.module_to_jax(module, copy="move")


def test_move_shares_memory_and_computes_as_the_module_did():
    module = net().eval()
    reference = copy.deepcopy(module)
    addresses = {n: t.data_ptr() for n, t in module.named_parameters()}
    apply, variables = _moved(module)
    for name, address in addresses.items():
        assert variables["params"][name].unsafe_buffer_pointer() == address, name
    np.testing.assert_allclose(
        apply(variables, X), reference(torch.as_tensor(X)).detach().cpu().numpy(), rtol=1e-6
    )
    loss = lambda p, x: jnp.sum(apply({"params": p, "buffers": variables["buffers"]}, x) ** 2)
    grads = jax.jit(jax.grad(loss))(variables["params"], X)
    torch_loss = torch.sum(reference(torch.as_tensor(X)) ** 2)
    names, params = zip(*reference.named_parameters(), strict=True)
    for name, g in zip(names, torch.autograd.grad(torch_loss, params), strict=True):
        np.testing.assert_allclose(grads[name], g.cpu().numpy(), rtol=1e-5, atol=1e-6)
    per_row = jax.vmap(lambda x: apply(variables, x[None])[0])(X)
    np.testing.assert_allclose(
        per_row, reference(torch.as_tensor(X)).detach().cpu().numpy(), rtol=1e-5
    )


def test_the_module_keeps_only_types_and_raises_when_torch_computes_with_it():
    module = net()
    shapes = {n: (t.shape, t.dtype, type(t)) for n, t in module.state_dict(keep_vars=True).items()}
    _moved(module)
    after = module.state_dict(keep_vars=True)
    assert {n: (t.shape, t.dtype, type(t).__mro__[1]) for n, t in after.items()}.keys() == (
        shapes.keys()
    )
    for name, t in after.items():
        assert t.is_meta and (t.shape, t.dtype) == shapes[name][:2], name
    assert all(isinstance(p, torch.nn.Parameter) for p in module.parameters())
    assert sum(p.numel() for p in module.parameters()) == 4 * 8 + 8 + 8 + 8 + 8 * 3 + 3
    with pytest.raises(VariablesError, match=r"variables\['params'\]\['0.weight'\]"):
        module(torch.ones(2, 4))
    with pytest.raises(VariablesError, match="moved into JAX variables"):
        module[0].weight.sum()
    with pytest.raises(VariablesError, match="load_state_dict"):
        module.to(torch.float64)
    assert "DatalessTensor" in repr(module[0].weight)


def test_tied_weights_move_once_and_stay_tied():
    module = Tied()
    reference = copy.deepcopy(module)
    apply, variables = _moved(module)
    assert list(variables["params"]) == ["embed.weight"]
    assert module.out.weight is module.embed.weight
    ids = np.array([[1, 2, 3], [4, 5, 9]])
    np.testing.assert_allclose(
        apply(variables, ids), reference(torch.as_tensor(ids)).detach().cpu().numpy(), rtol=1e-6
    )


def test_weights_go_back_with_load_state_dict_assign():
    module = net().eval()
    reference = copy.deepcopy(module)
    _, variables = _moved(module)
    state = torchjax.tree_to_torch({**variables["params"], **variables["buffers"]})
    module.load_state_dict(state, assign=True)
    x = torch.as_tensor(X)
    torch.testing.assert_close(module(x), reference(x))


def test_a_tensor_held_elsewhere_is_copied_with_a_warning_and_stays_apart():
    module = net().eval()
    optimizer = torch.optim.SGD(module[0].parameters(), lr=1.0)  # holds 0.weight, 0.bias
    with pytest.warns(CopyWarning, match=r"params\['0.weight'\], params\['0.bias'\] are also"):
        apply, variables = torchjax.module_to_jax(module, copy="move")
    before = jax.tree.map(np.array, variables)
    kept = optimizer.param_groups[0]["params"][0]
    assert not kept.is_meta  # the optimizer's tensor still has its data ...
    assert variables["params"]["0.weight"].unsafe_buffer_pointer() != kept.data_ptr()
    kept.grad = torch.ones_like(kept)
    optimizer.step()  # ... and writing it leaves the variables alone
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, variables), before)
    moved = variables["params"]["3.weight"]  # not held: moved
    assert isinstance(moved, jax.Array) and module[3].weight.is_meta


def test_training_mode_buffer_writes_never_reach_the_moved_memory():
    module = net().train()
    apply, variables = _moved(module)
    before = jax.tree.map(np.array, variables)
    out, new_buffers = apply(variables, X, mutable=True)
    reference = net().train()
    expected = reference(torch.as_tensor(X))
    np.testing.assert_allclose(out, expected.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        new_buffers["1.running_mean"], reference[1].running_mean.cpu().numpy(), rtol=1e-6
    )
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, variables), before)


def test_apply_of_a_moved_module_pickles():
    module = net().eval()
    reference = copy.deepcopy(module)
    apply, variables = _moved(module)
    again = pickle.loads(pickle.dumps(apply))
    np.testing.assert_allclose(
        again(variables, X), reference(torch.as_tensor(X)).detach().cpu().numpy(), rtol=1e-6
    )


@pytest.mark.parametrize("bad", ["yes", 1, None, "copy"])
def test_copy_accepts_only_its_choices(bad):
    with pytest.raises(ArgumentError, match="copy=.* is not one of its choices"):
        torchjax.module_to_jax(net(), copy=bad)


class KeepsAReference(torch.nn.Module):
    """Reads its weight through a list made in __init__, not through the attribute."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.kept = [self.lin.weight]

    def forward(self, x):
        return x @ self.kept[0]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_reference_kept_outside_the_slots_raises_instead_of_reading_no_data(jit):
    # The call's copy holds placeholders there: a meta tensor would let F.linear and matmul
    # return uninitialized memory on CPU (torch 2.13), a silent wrong result.
    apply, variables = torchjax.module_to_jax(KeepsAReference())
    call = jax.jit(apply) if jit else apply
    with pytest.raises(VariablesError, match="outside a call's slots"):
        jax.block_until_ready(call(variables, jnp.ones((2, 3))))


def test_a_move_that_cannot_convert_leaves_the_module_whole():
    module = net().eval()
    module.register_buffer("odd", torch.zeros(2, dtype=torch.complex32))  # no JAX dtype
    before = {n: t.clone() for n, t in module.state_dict().items()}
    with pytest.raises(torchjax.errors.ConversionError, match="complex32"):
        torchjax.module_to_jax(module, copy="move")
    for name, t in module.state_dict().items():
        same = t.view(torch.uint8) if name == "odd" else t  # torch cannot compare complex32
        was = before[name].view(torch.uint8) if name == "odd" else before[name]
        assert not t.is_meta and torch.equal(same, was), name


@pytest.mark.parametrize("copy_mode", [True, False, "move"])
def test_a_variable_that_does_not_convert_is_named_as_in_variables(copy_mode, x64_off):
    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = torch.nn.Linear(2, 2)
            self.sub.register_buffer("big", torch.tensor([2**40]))
            self.w = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))

        def forward(self, x):
            return x * 2

    module = Wide()
    with pytest.raises(
        torchjax.errors.ConversionError, match=r"variables\['buffers'\]\['sub.big'\]"
    ):
        torchjax.module_to_jax(module, copy=copy_mode)
    with torch.no_grad():
        module.sub.big.fill_(1)
        module.w.fill_(1e300)
    with pytest.raises(torchjax.errors.ConversionError, match=r"variables\['params'\]\['w'\]"):
        torchjax.module_to_jax(module, copy=copy_mode)
    assert module.w.item() == 1e300  # a failed move loses nothing
