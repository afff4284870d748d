"""TorchScript modules below the top (issue 57): a module holding a torch.jit.script'ed
submodule, reaching one through a plain attribute, or a function closing over a module
with a scripted part, through module_to_jax and to_jax, eagerly, under jit and jax.grad.

TorchScript keeps a scripted module's parameters and buffers in tables of its own, which
set existing entries and have no clear(): module_to_jax sets each call's tensors there (as
torch.func.functional_call does), and the per-call snapshots never call what such a table
lacks (every call failed with "'OrderedDictWrapper' object has no attribute 'clear'",
reported as raised by the user's forward). References are torch autograd on the same
module. And an exception raised inside torchjax's own machinery says it is torchjax's,
never the user's function's.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import tree_close

import torchjax
from torchjax._to_jax._fake import _snapshots
from torchjax.errors import ArgumentError

pytestmark = pytest.mark.core

TRANSFORMS = ["eager", "jit", "grad"]
_X = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)


class Inner(torch.nn.Module):
    """Scripted below: a parameter, a buffer, a submodule of its own."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.shift


class HoldsScripted(torch.nn.Module):
    """A TorchScript submodule, registered as a child (e3nn's compiled tensor products)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.jit.script(Inner())
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inner(x * self.scale) ** 2).sum()


class ReachesScripted(torch.nn.Module):
    """A TorchScript module in a plain attribute (not a submodule: its tensors are
    constants of the call, not variables)."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "helper", torch.jit.script(Inner()))
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.helper(x * self.scale) ** 2).sum()


def _torch_reference(model: torch.nn.Module, x: np.ndarray) -> tuple:
    """The value and, by torch autograd, the gradients w.r.t. the parameters and x."""
    x_t = torch.tensor(x, requires_grad=True)
    value = model(x_t)
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(value, [p for _, p in model.named_parameters()] + [x_t])
    return value.detach(), dict(zip(names, grads[:-1], strict=True)), grads[-1]


def _state(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(model: torch.nn.Module, before: dict) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("transform", [*TRANSFORMS, "vmap"])
@pytest.mark.parametrize("cls", [HoldsScripted, ReachesScripted])
def test_module_to_jax_of_a_module_reaching_a_scripted_module(cls, transform):
    torch.manual_seed(0)
    model = cls()
    before = _state(model)
    reference = copy.deepcopy(model)
    value, param_grads, x_grad = _torch_reference(reference, _X)
    options = {}
    if cls is ReachesScripted and transform == "vmap":
        # Plain torch.func.vmap of TorchScript code whose own parameters require grad fails
        # from its second run on (TorchScript's optimized plan reads `.data`): one call per
        # example, as the VmapError advises.
        options["vmap_method"] = "sequential"
    apply, variables = torchjax.module_to_jax(model, **options)
    if cls is HoldsScripted:  # its parameters and buffer are variables, set per call
        assert set(variables["params"]) == {"scale", "inner.lin.weight", "inner.lin.bias"}
        assert set(variables["buffers"]) == {"inner.shift"}
    for _ in range(2):  # every call, not only the first (the crash came on each)
        if transform == "eager":
            tree_close(apply(variables, _X), value)
        elif transform == "jit":
            tree_close(jax.jit(apply)(variables, _X), value)
        elif transform == "grad":
            grads = jax.grad(lambda p, x: apply({**variables, "params": p}, x), argnums=(0, 1))
            got_params, got_x = grads(variables["params"], _X)
            tree_close(got_params, param_grads)
            tree_close(got_x, x_grad)
        else:  # one example at a time, as torch computes each
            got = jax.vmap(apply, in_axes=(None, 0))(variables, _X[:, None])
            tree_close(got, torch.stack([reference(torch.tensor(x)[None]) for x in _X]))
    _same_state(model, before)  # the user's module (and its scripted part) unchanged


def test_variables_reach_the_scripted_submodule():
    """Other variables give other values: the call's arrays, not the module's tensors."""
    torch.manual_seed(0)
    model = HoldsScripted()
    apply, variables = torchjax.module_to_jax(model)
    doubled = jax.tree.map(lambda a: 2 * a, variables)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for t in [*reference.parameters(), *reference.buffers()]:
            t.mul_(2)
    want = reference(torch.tensor(_X))
    tree_close(apply(doubled, _X), want)
    tree_close(jax.jit(apply)(doubled, _X), want)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_to_jax_of_a_function_closing_over_a_module_with_a_scripted_part(transform):
    torch.manual_seed(0)
    model = HoldsScripted()
    before = _state(model)
    value, _, x_grad = _torch_reference(copy.deepcopy(model), _X)
    f = torchjax.to_jax(lambda x: model(x))
    for _ in range(2):
        if transform == "eager":
            tree_close(f(_X), value)
        elif transform == "jit":
            tree_close(jax.jit(f)(_X), value)
        else:
            tree_close(jax.grad(f)(_X), x_grad)
    _same_state(model, before)


class BatchNormed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.jit.script(
            torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_scripted_submodule_writing_its_buffers_gives_them_back_with_mutable():
    """BatchNorm's running statistics, written by TorchScript's compiled code in training
    mode, come back as torch's; the user's module keeps its own."""
    torch.manual_seed(0)
    model = BatchNormed()
    before = _state(model)
    reference = copy.deepcopy(model)
    want = reference(torch.tensor(_X))
    apply, variables = torchjax.module_to_jax(model)
    out, buffers = apply(variables, _X, mutable=True)
    tree_close(out, want)
    tree_close(buffers, {k: v for k, v in reference.named_buffers()})
    out, buffers = jax.jit(lambda v, x: apply(v, x, mutable=True))(variables, _X)
    tree_close(out, want)
    tree_close(buffers, {k: v for k, v in reference.named_buffers()})
    model.eval()  # the mode reaches TorchScript's table too
    reference = copy.deepcopy(model)
    _same_state(reference, before)
    tree_close(apply(variables, _X), reference(torch.tensor(_X)))
    _same_state(model, before)


def test_a_scripted_top_module_is_still_refused_as_torch_func_refuses_it():
    scripted = torch.jit.script(Inner())
    with pytest.raises(ArgumentError, match=r"module_to_jax\(Inner\): it is a TorchScript") as e:
        torchjax.module_to_jax(scripted)
    assert "self.net = scripted" in str(e.value)  # the plain-module wrapping that works
    with pytest.raises(RuntimeError, match="Jitted modules"):  # what torch.func does
        torch.func.functional_call(scripted, dict(scripted.named_parameters()), (_X,))


def test_e3nn_compiled_by_torchscript_through_module_to_jax_equals_e3nn():
    e3nn = pytest.importorskip("e3nn")
    from e3nn import o3

    defaults = e3nn.get_optimization_defaults()
    e3nn.set_optimization_defaults(jit_mode="script")  # mace-torch's e3nn compiles so
    try:
        torch.manual_seed(0)
        irreps = o3.Irreps("2x0e + 1x1o")
        model = torch.nn.Sequential(o3.Linear(irreps, irreps), o3.Linear(irreps, "1x0e"))
    finally:
        e3nn.set_optimization_defaults(**defaults)
    assert any(isinstance(m, torch.jit.ScriptModule) for m in model.modules())
    xs = np.random.default_rng(1).normal(size=(4, 5)).astype(np.float32)
    x_t = torch.tensor(xs, requires_grad=True)
    want = model(x_t).sum()
    want_grads = torch.autograd.grad(want, [*model.parameters(), x_t])
    apply, variables = torchjax.module_to_jax(model)
    tree_close(apply(variables, xs).sum(), want)
    tree_close(jax.jit(apply)(variables, xs).sum(), want)
    loss = lambda p, x: apply({**variables, "params": p}, x).sum()  # noqa: E731
    got_params, got_x = jax.grad(loss, argnums=(0, 1))(variables["params"], xs)
    names = [n for n, _ in model.named_parameters()]
    tree_close(got_params, dict(zip(names, want_grads[:-1], strict=True)))
    tree_close(got_x, want_grads[-1])


# -- an exception raised in torchjax's own machinery is torchjax's ------------------------
class Counts(torch.nn.Module):
    """Its forward changes its Python state, which the copy's snapshot then puts back."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.lin(x)


def test_an_exception_inside_torchjax_is_not_blamed_on_the_users_function(monkeypatch):
    torch.manual_seed(0)
    model = Counts()
    reference = copy.deepcopy(model)
    apply, variables = torchjax.module_to_jax(model)
    # The restore step after the call fails inside torchjax's own source (a None where a
    # function belongs: the TypeError's innermost frame is _snapshots.py's).
    monkeypatch.setattr(_snapshots, "_put_back", None)
    with pytest.raises(TypeError, match="'NoneType' object is not callable") as info:
        apply(variables, _X)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised inside torchjax, at torchjax/_to_jax/_fake/_snapshots.py:" in notes
    assert "in restore, while it called Counts.forward" in notes
    assert "please report it" in notes
    assert "raised by Counts.forward" not in notes
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(jax.jit(apply)(variables, _X))
    text = str(info.value)
    assert "raised inside torchjax, at torchjax/_to_jax/_fake/_snapshots.py:" in text
    assert "raised by" not in text
    monkeypatch.undo()
    tree_close(apply(variables, _X), reference(torch.tensor(_X)))  # later calls work
    # The user's own exception stays theirs.
    with pytest.raises(RuntimeError) as info:
        torchjax.to_jax(_mismatched)(jnp.ones(()))
    assert "(raised by _mismatched, called through torchjax)" in info.value.__notes__


def _mismatched(x):
    return torch.ones(2) @ torch.ones(3) + x  # torch raises, from the user's line
