"""module_to_jax's options (copy, vmap_method, grad_method, result_shape_dtypes), Mapping
variables, and when apply copies buffers."""

from __future__ import annotations

import collections.abc
import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax
from torchjax.errors import InPlaceMutationError, OutputMismatchError, VariablesError


def to_t(x):
    return torch.from_numpy(np.array(x))


def small_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def snapshot(variables):
    return jax.tree.map(np.array, variables)


# -- copy -------------------------------------------------------------------------------------


def _train_in_torch(net, steps=3):
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.linspace(-2, 3, 20).reshape(5, 4)).sin().sum().backward()
        opt.step()


def test_copy_true_variables_unchanged_when_module_trains_in_torch():
    net = torch.nn.Sequential(small_net(), torch.nn.BatchNorm1d(3))
    net.train()
    apply, variables = torchjax.module_to_jax(net)  # copy=True is the default
    before = snapshot(variables)
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    out_before = np.array(apply(variables, x))
    _train_in_torch(net)  # optimizer steps write params; training forwards write buffers
    assert not np.allclose(net[0][0].weight.detach().numpy(), before["params"]["0.0.weight"])
    jax.tree.map(np.testing.assert_array_equal, snapshot(variables), before)
    # apply computes with the arrays it is given, not with the module's new weights.
    np.testing.assert_allclose(apply(variables, x), out_before, rtol=1e-6)


def test_copy_false_shares_memory_so_torch_training_shows_through():
    # The documented hazard of copy=False: the JAX arrays are the module's tensors.
    net = small_net()
    apply, variables = torchjax.module_to_jax(net, copy=False)
    _train_in_torch(net)
    np.testing.assert_array_equal(variables["params"]["0.weight"], net[0].weight.detach().numpy())


# -- policies passed through to to_jax ---------------------------------------------------------


def test_vmap_method_sequential_runs_one_call_per_example():
    calls = []

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):  # [4] -> [3]
            calls.append(tuple(x.shape))
            # .item() on a value: torch.func.vmap cannot batch this, "sequential" can.
            return self.lin(x) * (1.0 + 0.0 * x.sum().item())

    torch.manual_seed(0)
    net = Counting()
    apply, variables = torchjax.module_to_jax(
        net, vmap_method="sequential", result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32)
    )
    xs = jnp.linspace(-1, 1, 20).reshape(5, 4)
    out = jax.vmap(lambda x: apply(variables, x))(xs)
    assert calls == [(4,)] * 5  # five real calls, each on one example
    with torch.no_grad():
        np.testing.assert_allclose(out, net.lin(to_t(xs)).numpy(), rtol=1e-6)
    # The default ("torch") cannot batch the .item() call.
    apply_torch, _ = torchjax.module_to_jax(
        net, result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32)
    )
    with pytest.raises(torchjax.errors.VmapError, match="sequential"):
        jax.vmap(lambda x: apply_torch(variables, x))(xs)


def test_invalid_option_rejected_at_creation():
    with pytest.raises(ValueError, match="vmap_method='loop'"):
        torchjax.module_to_jax(small_net(), vmap_method="loop")


class _DoubleGrad(torch.autograd.Function):  # old style: torch.func cannot transform it
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _OldStyleNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return _DoubleGrad.apply(self.lin(x))


def test_grad_method_autograd_differentiates_old_style_functions():
    torch.manual_seed(0)
    net = _OldStyleNet()
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    apply, variables = torchjax.module_to_jax(net, grad_method="autograd")
    loss = lambda p: jnp.sum(apply({"params": p, "buffers": {}}, x) ** 2)
    grads = jax.jit(jax.grad(loss))(variables["params"])
    (net(to_t(x)) ** 2).sum().backward()
    np.testing.assert_allclose(grads["lin.weight"], net.lin.weight.grad.numpy(), rtol=1e-5)
    apply_default, _ = torchjax.module_to_jax(net)
    # A first-order gradient runs on plain autograd; forward mode needs torch.func.
    f = lambda p: jnp.sum(apply_default({"params": p, "buffers": {}}, x))
    with pytest.raises(torchjax.errors.AutodiffError, match="grad_method='autograd'"):
        jax.jvp(f, (variables["params"],), (variables["params"],))


def test_result_shape_dtypes_skips_the_fake_run_and_is_checked():
    fake_runs = []

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            if torch._subclasses.fake_tensor.is_fake(x):
                fake_runs.append(x.shape)
            return {"y": self.lin(x)}

    torch.manual_seed(0)
    net = Net()
    declare = lambda x: {"y": jax.ShapeDtypeStruct((x.shape[0], 3), x.dtype)}
    apply, variables = torchjax.module_to_jax(net, result_shape_dtypes=declare)
    x = jnp.ones((2, 4))
    out = jax.jit(apply)(variables, x)
    with torch.no_grad():
        np.testing.assert_allclose(out["y"], net.lin(to_t(x)).numpy(), rtol=1e-6)
    assert fake_runs == []
    wrong = {"y": jax.ShapeDtypeStruct((2, 5), jnp.float32)}
    apply_wrong, _ = torchjax.module_to_jax(net, result_shape_dtypes=wrong)
    with pytest.raises(OutputMismatchError, match=r"float32\[2, 5\] was declared"):
        apply_wrong(variables, x)
    # The variables are still checked when no fake run happens.
    with pytest.raises(VariablesError, match="missing"):
        apply({"params": {}, "buffers": {}}, x)


# -- Mapping variables --------------------------------------------------------------------------


@jax.tree_util.register_pytree_with_keys_class
class FrozenMapping(collections.abc.Mapping):
    """A read-only mapping registered as a pytree: not a dict, as flax's State is not."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def tree_flatten_with_keys(self):
        keys = sorted(self._data)
        return [(jax.tree_util.DictKey(k), self._data[k]) for k in keys], keys

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(zip(keys, values, strict=True))


def _as_frozen(variables):
    return FrozenMapping({g: FrozenMapping(variables[g]) for g in ("params", "buffers")})


@pytest.mark.parametrize("mode", ["eager", "jit", "grad", "vmap"])
def test_mapping_subclass_as_variables(mode):
    net = small_net()
    apply, variables = torchjax.module_to_jax(net)
    frozen = _as_frozen(variables)
    assert not isinstance(frozen, dict) and not isinstance(frozen["params"], dict)
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    if mode == "grad":
        grads = jax.jit(jax.grad(lambda v: jnp.sum(apply(v, x) ** 2)))(frozen)
        assert isinstance(grads, FrozenMapping)
        (net(to_t(x)) ** 2).sum().backward()
        np.testing.assert_allclose(grads["params"]["2.bias"], net[2].bias.grad.numpy(), rtol=1e-5)
        return
    if mode == "vmap":
        out = jax.vmap(lambda x: apply(frozen, x))(x)
    else:
        out = (jax.jit(apply) if mode == "jit" else apply)(frozen, x)
    np.testing.assert_allclose(out, net(to_t(x)).detach().numpy(), rtol=1e-6)


def test_mapping_subclass_with_wrong_keys_names_them():
    apply, variables = torchjax.module_to_jax(small_net())
    params = {k: v for k, v in variables["params"].items() if k != "2.bias"}
    bad = FrozenMapping({"params": FrozenMapping(params), "buffers": FrozenMapping({})})
    with pytest.raises(VariablesError, match=r"missing \['2.bias'\]"):
        apply(bad, jnp.ones((2, 4)))
    with pytest.raises(VariablesError, match=r"must be a mapping.*got list"):
        apply({"params": list(params.values()), "buffers": {}}, jnp.ones((2, 4)))


def test_flax_nnx_state_as_variables():
    nnx = pytest.importorskip("flax.nnx")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).eval()
    apply, variables = torchjax.module_to_jax(net)
    state = nnx.State(variables)
    assert not isinstance(state, dict)
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    out = jax.jit(apply)(state, x)
    np.testing.assert_allclose(out, net(to_t(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
    loss = lambda p: jnp.sum(apply(nnx.State({"params": p, "buffers": state["buffers"]}), x) ** 2)
    grads = jax.grad(loss)(state["params"])  # buffers hold an integer: no gradient there
    assert isinstance(grads, nnx.State)
    (net(to_t(x)) ** 2).sum().backward()
    np.testing.assert_allclose(grads["0.weight"], net[0].weight.grad.numpy(), rtol=1e-5)


# -- buffers: copied only when forward writes them ----------------------------------------------


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def test_buffers_not_copied_in_eval_mode(monkeypatch):
    net = _bn_net().eval()
    apply, variables = torchjax.module_to_jax(net)
    clones = []
    real_clone = torch.Tensor.clone

    def counting_clone(t, *a, **k):
        if not torch._subclasses.fake_tensor.is_fake(t):
            clones.append(tuple(t.shape))
        return real_clone(t, *a, **k)

    x = jnp.ones((2, 3))
    apply(variables, x)  # the fake run happens here, once
    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    apply(variables, x)
    assert clones == []  # eval-mode BatchNorm writes nothing: no copies
    net.train()
    apply(variables, x)
    assert len(clones) == 3  # running_mean, running_var, num_batches_tracked


def test_mode_switched_after_jit_trace_never_writes_callers_buffers():
    net = _bn_net().eval()
    apply, variables = torchjax.module_to_jax(net)
    f = jax.jit(lambda v, x: apply(v, x))
    x = jnp.linspace(-2, 3, 12).reshape(4, 3)
    f(variables, x)  # traced in eval mode, where forward writes no buffer
    before = snapshot(variables)
    net.train()  # the jit cache hit below runs the module in training mode
    reference = copy.deepcopy(net)
    out = f(variables, x)
    jax.tree.map(np.testing.assert_array_equal, snapshot(variables), before)
    np.testing.assert_allclose(out, reference(to_t(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_forward_writing_a_parameter_is_rejected():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            with torch.no_grad():
                self.w.mul_(2)
            return x * self.w

    apply, variables = torchjax.module_to_jax(Bad())
    with pytest.raises(InPlaceMutationError, match=r"variables\['params'\]\['w'\]"):
        apply(variables, jnp.ones(3))
    np.testing.assert_array_equal(variables["params"]["w"], np.ones(3))


def test_module_tensors_restored_after_forward_raises():
    class Failing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            if not torch._subclasses.fake_tensor.is_fake(x):
                raise ValueError("boom")
            return self.lin(x)

    net = Failing()
    own = {**dict(net.named_parameters()), **dict(net.named_buffers())}
    apply, variables = torchjax.module_to_jax(net)
    with pytest.raises(ValueError, match="boom"):  # the module's own exception
        apply(variables, jnp.ones(2))
    after = {**dict(net.named_parameters()), **dict(net.named_buffers())}
    assert all(after[k] is own[k] for k in own)


def test_parametrized_module_uses_given_original():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", _Symmetric())
    apply, variables = torchjax.module_to_jax(lin)
    assert "parametrizations.weight.original" in variables["params"]
    w = jnp.arange(9.0).reshape(3, 3)
    params = {**variables["params"], "parametrizations.weight.original": w}
    out = apply({"params": params, "buffers": {}}, jnp.ones(3))
    sym = jnp.triu(w) + jnp.triu(w, 1).T
    np.testing.assert_allclose(out, sym @ jnp.ones(3) + variables["params"]["bias"], rtol=1e-6)


class _Symmetric(torch.nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)
