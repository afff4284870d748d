"""Modules holding a tensor computed from their parameters as a plain attribute:
torch.nn.utils.prune's `weight` (weight_orig * weight_mask) and the old
torch.nn.utils.weight_norm's (from weight_g and weight_v). Such a tensor is no graph leaf,
so copy.deepcopy refuses it; module_to_jax's private copies hold a placeholder for it,
which the module's hook recomputes from each call's variables. Every number is checked
against torch running the same module (torch.func.functional_call with the same tensors)."""

from __future__ import annotations

import concurrent.futures
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.utils.prune as prune

import torchjax
from torchjax.errors import VariablesError


def _pruned():
    torch.manual_seed(0)
    return prune.l1_unstructured(torch.nn.Linear(4, 3), "weight", amount=0.5)


def _pruned_twice():
    torch.manual_seed(1)
    lin = prune.l1_unstructured(torch.nn.Linear(4, 3), "weight", amount=0.3)
    return prune.random_unstructured(lin, "weight", amount=0.3)  # a PruningContainer


def _old_weight_norm():
    torch.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still widely used
        return torch.nn.utils.weight_norm(torch.nn.Linear(4, 3))


def _pruned_net():
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    prune.global_unstructured(
        [(net[0], "weight"), (net[2], "weight")], prune.L1Unstructured, amount=0.4
    )
    return net


MODULES = pytest.mark.parametrize(
    "make",
    [_pruned, _pruned_twice, _old_weight_norm, _pruned_net],
    ids=["prune", "prune_twice", "old_weight_norm", "global_prune"],
)
X = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)


def _torch_call(module, variables, x):
    """The module in torch with `variables`' tensors, as a reference."""
    tensors = {
        k: torch.tensor(np.asarray(v)).requires_grad_(g == "params")
        for g in ("params", "buffers")
        for k, v in variables[g].items()
    }
    return torch.func.functional_call(module, tensors, (torch.from_numpy(x),)), tensors


def _loss(apply, buffers):
    return lambda params, x: (apply({"params": params, "buffers": buffers}, x) ** 2).sum()


@MODULES
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_outputs_and_gradients_match_torch_with_the_calls_variables(make, jit):
    module = make()
    apply, variables = torchjax.module_to_jax(module)
    assert not any(k.endswith("weight") and "_" not in k for k in variables["params"])
    # Other parameters than the module's: the hook must compute from these.
    params = jax.tree.map(lambda a: a * 1.5 - 0.25, variables["params"])
    call = {"params": params, "buffers": variables["buffers"]}
    loss = _loss(apply, variables["buffers"])
    grad = jax.grad(loss)
    if jit:
        apply, grad = jax.jit(apply), jax.jit(grad)
    ref, tensors = _torch_call(module, call, X)
    np.testing.assert_allclose(apply(call, jnp.asarray(X)), ref.detach().numpy(), rtol=1e-5)
    ref_grads = torch.autograd.grad((ref**2).sum(), [tensors[k] for k in params])
    got = grad(params, jnp.asarray(X))
    for k, want in zip(params, ref_grads, strict=True):
        np.testing.assert_allclose(got[k], want.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


@MODULES
def test_per_example_outputs_under_vmap(make):
    module = make()
    apply, variables = torchjax.module_to_jax(module)
    got = jax.vmap(lambda x: apply(variables, x))(jnp.asarray(X))
    ref, _ = _torch_call(module, variables, X)
    np.testing.assert_allclose(got, ref.detach().numpy(), rtol=1e-5)


@pytest.mark.parametrize("make", [_pruned, _pruned_net], ids=["prune", "global_prune"])
def test_hessian_vector_product_matches_torch_func(make):
    # (the old weight_norm's _weight_norm_interface has no forward-mode derivative in torch)
    module = make()
    apply, variables = torchjax.module_to_jax(module)
    buffers = variables["buffers"]
    loss = _loss(apply, buffers)
    params = variables["params"]
    tangent = jax.tree.map(lambda a: jnp.cos(a), params)
    got = jax.jvp(lambda p: jax.grad(loss)(p, jnp.asarray(X)), (params,), (tangent,))[1]

    t_buffers = {k: torch.tensor(np.asarray(v)) for k, v in buffers.items()}

    def t_loss(p):
        out = torch.func.functional_call(module, {**p, **t_buffers}, (torch.from_numpy(X),))
        return (out**2).sum()

    t_params = {k: torch.tensor(np.asarray(v)) for k, v in params.items()}
    t_tangent = {k: torch.tensor(np.asarray(v)) for k, v in tangent.items()}
    _, want = torch.func.jvp(torch.func.grad(t_loss), (t_params,), (t_tangent,))
    for k in params:
        np.testing.assert_allclose(got[k], want[k].numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("copy", [True, False, "move"])
def test_every_copy_mode_and_the_users_module_unchanged(copy):
    module = _pruned()
    ref = module(torch.from_numpy(X)).detach().numpy()  # torch's call sets module.weight
    weight, orig = module.weight, module.weight_orig
    before = weight.detach().clone()
    apply, variables = torchjax.module_to_jax(module, copy=copy)
    np.testing.assert_allclose(jax.jit(apply)(variables, jnp.asarray(X)), ref, rtol=1e-6)
    np.testing.assert_allclose(apply(variables, jnp.asarray(X)), ref, rtol=1e-6)
    if copy != "move":
        assert module.weight is weight and module.weight_orig is orig
        assert torch.equal(module.weight.detach(), before)


def test_threads_with_their_own_parameters_each_get_their_own_numbers():
    module = _pruned_net()
    apply, variables = torchjax.module_to_jax(module)
    f = jax.jit(apply)
    sets = [
        {**variables, "params": jax.tree.map(lambda a, s=s: a * s, variables["params"])}
        for s in (0.5, 1.0, 2.0, -1.0)
    ]
    want = [_torch_call(module, v, X)[0].detach().numpy() for v in sets]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got = list(pool.map(lambda v: np.asarray(f(v, jnp.asarray(X))), sets))
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-5)


class _ReadsChildWeight(torch.nn.Module):
    """Reads a pruned child's `weight` without calling the child: no hook recomputes it."""

    def __init__(self):
        super().__init__()
        self.child = prune.l1_unstructured(torch.nn.Linear(4, 4), "weight", amount=0.5)

    def forward(self, x):
        return x @ self.child.weight


def test_a_computed_attribute_read_without_its_hook_is_refused_naming_it():
    apply, variables = torchjax.module_to_jax(_ReadsChildWeight())
    with pytest.raises(VariablesError, match=r"attribute child\.weight, a tensor computed"):
        apply(variables, jnp.ones((2, 4)))
    with pytest.raises(VariablesError, match="prune.remove"):
        jax.jit(apply)(variables, jnp.ones((2, 4)))


def test_old_weight_norm_forward_over_reverse_with_grad_method_autograd():
    # What docs/module.md advises where torch has no forward-mode derivative: the HVP from
    # two reverse passes, against torch.autograd.functional.hvp.
    module = _old_weight_norm()
    apply, variables = torchjax.module_to_jax(module, grad_method="autograd")
    loss = _loss(apply, variables["buffers"])
    params = variables["params"]
    tangent = jax.tree.map(jnp.cos, params)
    got = jax.jvp(lambda p: jax.grad(loss)(p, jnp.asarray(X)), (params,), (tangent,))[1]
    names = list(params)

    def t_loss(*tensors):
        out = torch.func.functional_call(
            module, dict(zip(names, tensors, strict=True)), (torch.from_numpy(X),)
        )
        return (out**2).sum()

    _, want = torch.autograd.functional.hvp(
        t_loss,
        tuple(torch.tensor(np.asarray(params[k])) for k in names),
        tuple(torch.tensor(np.asarray(tangent[k])) for k in names),
    )
    for k, w in zip(names, want, strict=True):
        np.testing.assert_allclose(got[k], w.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("make", [_pruned, _old_weight_norm], ids=["prune", "old_weight_norm"])
def test_move_moves_the_parameters_a_computed_attribute_was_made_from(make):
    module = make()
    x = torch.from_numpy(X)
    want = module(x).detach().numpy()
    addresses = {k: p.data_ptr() for k, p in module.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchjax.errors.CopyWarning)  # nothing left to alias
        apply, variables = torchjax.module_to_jax(module, copy="move")
    for k, ptr in addresses.items():
        assert variables["params"][k].unsafe_buffer_pointer() == ptr, k  # moved, not copied
    np.testing.assert_allclose(apply(variables, jnp.asarray(X)), want, rtol=1e-6)
    with pytest.raises(VariablesError, match=r'the tensor weight computed from parameters.*"move"'):
        module.weight + 1
    # The way back the error gives: load the weights, and the hook computes weight again.
    module.load_state_dict(
        torchjax.tree_to_torch({**variables["params"], **variables["buffers"]}), assign=True
    )
    np.testing.assert_allclose(module(x).detach().numpy(), want, rtol=1e-6)
