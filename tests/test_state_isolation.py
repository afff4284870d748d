"""A wrapped call is a pure function of its inputs, even when the torch code has state.

module_to_jax calls run in private copies of the module (threads, backwards that read the
module again, Python attributes a forward sets); fake runs leave nothing behind (lazily
built attributes, lru_caches, lists a function appends to); torch code that runs autograd
itself is differentiated. References are independent: the same math in jax.numpy, or torch
computing the same thing directly.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import functools
import importlib
import importlib.util
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import tree_close
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils.checkpoint import checkpoint

import torchjax
from torchjax.errors import (
    ConversionError,
    ShapeInferenceError,
    StateWarning,
    VariablesError,
    VmapError,
)

pytestmark = pytest.mark.core  # the version matrix runs this module


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _mlp_jnp(params, x):  # the same MLP in jax.numpy: [B, 16] -> [B, 4]
    h = jnp.tanh(x @ params["0.weight"].T + params["0.bias"])
    return h @ params["2.weight"].T + params["2.bias"]


def _state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _unchanged(module, before):
    after = module.state_dict()
    assert set(after) == set(before)
    for k, v in before.items():
        assert after[k].device.type != "meta", k
        assert torch.equal(after[k], v), k


X = jnp.asarray(np.random.RandomState(0).randn(8, 16), jnp.float32)


# -- module calls from many threads --------------------------------------------------------
def test_threads_each_with_their_own_variables_get_exact_values_and_gradients():
    net = _mlp()
    before = _state(net)
    apply, variables = torchjax.module_to_jax(net)
    jit_apply = jax.jit(apply)
    loss = lambda p, x: jnp.sum(apply({"params": p, "buffers": {}}, x) ** 2)
    grad = jax.jit(jax.grad(loss))
    ref_grad = jax.grad(lambda p, x: jnp.sum(_mlp_jnp(p, x) ** 2))

    def work(i: int) -> float:
        params = jax.tree.map(lambda a: a * (1.0 + 0.1 * i), variables["params"])
        want = np.asarray(_mlp_jnp(params, X))
        want_grad = ref_grad(params, X)
        worst = 0.0
        for k in range(12):
            out = (apply if k % 2 else jit_apply)({"params": params, "buffers": {}}, X)
            worst = max(worst, float(np.abs(np.asarray(out) - want).max()))
            if k % 4 == 0:
                g = grad(params, X)
                for name in params:
                    err = np.abs(np.asarray(g[name]) - np.asarray(want_grad[name])).max()
                    worst = max(worst, float(err) / 10)
        return worst

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        errors = list(pool.map(work, range(8)))
    assert max(errors) < 1e-5, errors
    _unchanged(net, before)


def test_seeded_calls_from_threads_match_the_same_call_alone():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)).train()
    apply, variables = torchjax.module_to_jax(net)
    keys = [jax.random.key(i) for i in range(8)]
    alone = [np.asarray(apply(variables, X, rng=k)) for k in keys]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda k: np.asarray(apply(variables, X, rng=k)), keys * 3))
    for i, out in enumerate(together):
        np.testing.assert_array_equal(out, alone[i % 8])


# -- a backward that reads the module again ------------------------------------------------
class _Checkpointed(torch.nn.Module):
    """What Hugging Face's gradient_checkpointing_enable() does: the backward recomputes."""

    def __init__(self):
        super().__init__()
        self.inner = _mlp()

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_checkpointed_backward_sees_the_calls_weights(mode):
    net = _Checkpointed()
    before = _state(net)
    apply, variables = torchjax.module_to_jax(net)
    # Other weights than the module's own: after an optimizer step, say.
    params = jax.tree.map(lambda a: a * 1.7 + 0.01, variables["params"])
    loss = lambda p: jnp.sum(jnp.sin(apply({"params": p, "buffers": {}}, X)))
    grad = jax.jit(jax.grad(loss)) if mode == "jit" else jax.grad(loss)
    got = grad(params)
    torch_net = _Checkpointed()
    torch_net.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in params.items()})
    torch.sin(torch_net(torch.tensor(np.asarray(X)))).sum().backward()
    for name, p in torch_net.named_parameters():
        np.testing.assert_allclose(got[name], p.grad.cpu().numpy(), rtol=1e-5, atol=1e-6)
    _unchanged(net, before)


# -- Python state a forward changes --------------------------------------------------------
class _Stateful(torch.nn.Module):
    """Builds a table lazily, counts its calls, and keeps a running buffer."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))
        self.calls = 0
        self.table = None

    def forward(self, x):
        if self.table is None or self.table.shape[0] != x.shape[-1]:
            self.table = torch.cos(torch.arange(x.shape[-1], dtype=x.dtype))
        self.calls += 1
        self.total = self.total + x.sum(0)  # a buffer reassigned
        return self.lin(x) * self.table + self.calls


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_attributes_a_call_sets_are_not_seen_by_later_calls(mode):
    torch.manual_seed(0)
    net = _Stateful()
    pristine = copy.deepcopy(net)
    apply, variables = torchjax.module_to_jax(net)
    f = jax.jit(apply) if mode == "jit" else apply
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    with pytest.warns(StateWarning, match="(?s)reassigned a buffer: 'total'.*mutable=True"):
        first = f(variables, x)
    for _ in range(3):  # each call is the first call of a fresh module
        out = f(variables, x)
        want = copy.deepcopy(pristine)(torch.tensor(np.asarray(x))).detach().cpu().numpy()
        np.testing.assert_allclose(out, want, rtol=1e-6)
    np.testing.assert_array_equal(first, out)
    assert net.calls == 0 and net.table is None  # the user's module never ran
    _unchanged(net, _state(pristine))


class _NestedState(torch.nn.Module):
    """State below the module's own entries, each changed in place by forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.ema = torch.zeros(4)  # a plain tensor attribute, not a buffer
        self.count = torch.zeros(())  # `self.count += 1` is in place on a tensor
        self.cfg = types.SimpleNamespace(calls=0, seen=[])  # an object the module holds
        self.cache = {"hist": []}  # a list inside a dict
        self.recent = collections.deque(maxlen=3)
        self.grow = torch.zeros(1)  # resized in place (eagerly: a fake run cannot resize it)
        self.resizes = False

    def forward(self, x):
        self.cfg.calls += 1
        self.cfg.seen.append(1.0)
        self.cache["hist"].append(2.0)
        self.recent.append(3.0)
        self.ema.mul_(0.5).add_(x.mean(0))
        self.count += 1
        if self.resizes:
            self.grow.resize_(self.grow.numel() + 1).fill_(1.0)
        extra = self.cfg.calls + len(self.cfg.seen) + len(self.cache["hist"]) + len(self.recent)
        return self.lin(x) * self.count + self.ema + extra + self.grow.sum()


@pytest.mark.parametrize("mode", ["eager", "jit", "grad"])
def test_state_below_the_modules_entries_is_not_seen_by_later_calls(mode):
    # A forward that changes an object it holds, a nested list or a plain tensor in place:
    # every call is the first call of the module as it was (torch's first call, on a copy).
    torch.manual_seed(0)
    net = _NestedState()
    net.resizes = mode == "eager"
    pristine = copy.deepcopy(net)
    apply, variables = torchjax.module_to_jax(net)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    loss = lambda p: apply({"params": p, "buffers": variables["buffers"]}, x).sum()
    for _ in range(3):
        first = copy.deepcopy(pristine)
        x_t = torch.tensor(np.asarray(x))
        if mode == "grad":
            got = jax.grad(loss)(variables["params"])["lin.bias"]
            want = torch.autograd.grad(first(x_t).sum(), first.lin.bias)[0]
        else:
            got = (jax.jit(apply) if mode == "jit" else apply)(variables, x)
            want = first(x_t)
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-6)
    assert net.cfg.calls == 0 and not net.cache["hist"] and not net.ema.any()  # never ran


class _RunningMax(torch.nn.Module):
    """An observer: writes its buffer only when a call sees a new maximum."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mx", torch.zeros(()))

    def forward(self, x, scale=1.0):
        m = x.max() * scale
        if m > self.mx:
            self.mx.copy_(m)
        return x / self.mx.clamp_min(1.0)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_buffer_written_only_by_later_calls_is_returned_with_mutable(mode):
    # The first call in a mode writes no buffer, so later calls would get the caller's
    # arrays; a later call that does write (a new maximum) runs again on copies.
    torch.manual_seed(0)
    ref = _RunningMax()
    # (Under jit its outputs are declared: the branch on a value has no fake run.)
    declared = lambda x, scale=1.0: jax.ShapeDtypeStruct(x.shape, x.dtype)
    apply, variables = torchjax.module_to_jax(_RunningMax(), result_shape_dtypes=declared)
    f = jax.jit(apply, static_argnames=("mutable", "scale")) if mode == "jit" else apply
    for x, scale in [(-jnp.ones(3), 1.0), (5 * jnp.ones(3), 1.0), (jnp.ones(3), 9.0)]:
        before = np.asarray(variables["buffers"]["mx"]).copy()
        out, new_buffers = f(variables, x, mutable=True, scale=scale)
        want = ref(torch.tensor(np.asarray(x)), scale=scale)
        np.testing.assert_array_equal(out, want.numpy())
        np.testing.assert_array_equal(new_buffers["mx"], ref.mx.numpy())
        np.testing.assert_array_equal(variables["buffers"]["mx"], before)  # not written
        variables = {"params": variables["params"], "buffers": new_buffers}
    assert float(variables["buffers"]["mx"]) == 9.0


def test_mutable_returns_the_reassigned_buffer():
    torch.manual_seed(0)
    net = _Stateful()
    reference = copy.deepcopy(net)
    apply, variables = torchjax.module_to_jax(net)
    x = jnp.ones((2, 4))
    buffers = variables["buffers"]
    for _ in range(3):
        out, buffers = apply({"params": variables["params"], "buffers": buffers}, x, mutable=True)
        fresh = copy.deepcopy(reference)  # its Python counter starts from 0, as apply's does
        want = fresh(torch.tensor(np.asarray(x))).detach().cpu().numpy()
        np.testing.assert_allclose(out, want, rtol=1e-6)
        reference.total = fresh.total  # the buffer carries over, as the variables do
    np.testing.assert_allclose(buffers["total"], 3 * np.asarray(x).sum(0))


def test_ten_batch_norm_layers_in_train_mode_give_one_warning_naming_every_buffer():
    layers = []
    for _ in range(10):
        layers += [torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)]
    model = torch.nn.Sequential(*layers).train()
    apply, variables = torchjax.module_to_jax(model)
    x = jnp.linspace(-1.0, 2.0, 12).reshape(3, 4)
    for call in (apply, jax.jit(apply)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(variables, x)
        if call is apply:
            (warning,) = [w for w in caught if w.category is StateWarning]
            text = str(warning.message)
            names = [name for name, _ in model.named_buffers()]
            assert len(names) == 30 and all(repr(name) in text for name in names)
            assert "mutable=True" in text and "module.eval()" in text
        else:  # each buffer is said once per apply
            assert not [w for w in caught if w.category is StateWarning]


def test_a_first_call_under_jit_gives_one_warning_naming_every_written_buffer():
    # The fake run sees only the counter's write (batch norm's CPU kernel moves no version
    # counter of the running statistics): the real run, which sees them all, warns.
    bn = torch.nn.BatchNorm1d(4).train()
    apply, variables = torchjax.module_to_jax(bn)
    x = jnp.linspace(-1.0, 2.0, 12).reshape(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.block_until_ready(jax.jit(apply)(variables, x))
    (warning,) = [w for w in caught if w.category is StateWarning]
    assert "3 buffers: 'running_mean', 'running_var', 'num_batches_tracked'" in str(warning.message)


def test_in_place_buffer_write_without_mutable_warns_once():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4).train()
    apply, variables = torchjax.module_to_jax(bn)
    x = jnp.linspace(-1.0, 2.0, 12).reshape(3, 4)
    with pytest.warns(StateWarning, match="(?s)wrote in place into 3 buffers: 'running_mean'"):
        apply(variables, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StateWarning)
        apply(variables, x)  # once per buffer, not once per call
    np.testing.assert_array_equal(variables["buffers"]["running_mean"], np.zeros(4))


# -- fake runs leave nothing behind --------------------------------------------------------
@functools.lru_cache
def _cos_table(n: int) -> torch.Tensor:
    return torch.cos(torch.arange(n, dtype=torch.float32))


@pytest.mark.parametrize("mode", ["eager", "jit", "grad"])
def test_lru_cache_filled_by_the_function_holds_real_tensors(mode):
    _cos_table.cache_clear()
    f = torchjax.to_jax(lambda x: x * _cos_table(x.shape[0]))
    x = jnp.linspace(0.5, 2.0, 5)
    if mode == "grad":
        out = jax.grad(lambda x: f(x).sum())(x)
    else:
        out = (jax.jit(f) if mode == "jit" else f)(x)
    want = np.cos(np.arange(5.0)) * (1.0 if mode == "grad" else np.asarray(x))
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert type(_cos_table(5)) is torch.Tensor  # in plain torch, afterwards, too
    np.testing.assert_allclose(_cos_table(5).cpu().numpy(), np.cos(np.arange(5.0)), rtol=1e-6)


class _LazyRotary(torch.nn.Module):
    """A positional table built on first use, as rotary embeddings do."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        if not hasattr(self, "cos_cached") or self.cos_cached.shape[0] < x.shape[0]:
            self.cos_cached = torch.cos(torch.arange(x.shape[0], dtype=x.dtype))
        if "pos" not in self._buffers:
            self.register_buffer("pos", torch.arange(x.shape[0], dtype=x.dtype))
        return x * self.cos_cached[: x.shape[0]] * self.scale + self.pos


@pytest.mark.parametrize("mode", ["eager", "jit", "grad"])
def test_lazily_built_attributes_of_a_closed_over_module(mode):
    rotary = _LazyRotary()
    f = torchjax.to_jax(lambda x: rotary(x))
    x = jnp.linspace(0.5, 2.0, 6)
    if mode == "grad":
        out = jax.jit(jax.grad(lambda x: f(x).sum()))(x)
        want = 2 * np.cos(np.arange(6.0))
    else:
        out = (jax.jit(f) if mode == "jit" else f)(x)
        want = np.asarray(x) * np.cos(np.arange(6.0)) * 2 + np.arange(6.0)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    # The real calls built them (for real); the fake run's were put back.
    for t in (rotary.cos_cached, rotary.pos):
        assert type(t) is torch.Tensor
    plain = rotary(torch.ones(6)).detach().cpu().numpy()  # the module still works in plain torch
    np.testing.assert_allclose(plain, 2 * np.cos(np.arange(6.0)) + np.arange(6.0), rtol=1e-6)


def test_list_a_function_appends_its_input_to_keeps_only_real_tensors():
    kept = []

    def keep(x):
        kept.append(x)
        return x * 2

    f = jax.jit(torchjax.to_jax(keep))
    f(jnp.ones(3))
    f(jnp.full(3, 2.0))
    assert [type(t) for t in kept] == [torch.Tensor, torch.Tensor]
    np.testing.assert_array_equal(kept[-1].cpu().numpy(), [2.0, 2.0, 2.0])


class _Registry(dict):
    """A dict whose get and [] mean something else (as transformers' _CanRecordRegistry,
    which a tiny GPT-2's forward reads, keys on a model's class)."""

    def __setitem__(self, obj, value):
        super().__setitem__(type(obj).__name__, value)

    def get(self, obj):
        return super().get(type(obj).__name__) or {}


class _Log(list):
    """A list whose iteration and length mean something else."""

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0


def test_fake_run_puts_back_dict_and_list_subclasses_as_stored():
    # The shape-finding fake run puts back what it touched through dict's and list's own
    # methods, not the subclass's (whose get took one argument: jit raised TypeError).
    registry, log = _Registry(), _Log()
    registry[torch.nn.Linear(1, 1)] = {"scale": 3.0}

    def f(x):
        y = x * registry.get(torch.nn.Linear(1, 1))["scale"]
        dict.__setitem__(registry, "last", y)  # caches filled in place, as stored
        list.append(log, y)
        return y

    f_jit = jax.jit(torchjax.to_jax(f))
    for k in (1.0, 2.0):
        np.testing.assert_array_equal(f_jit(jnp.full(3, k)), np.full(3, 3 * k))
    assert type(dict.get(registry, "last")) is torch.Tensor
    assert [type(t) for t in list.copy(log)] == [torch.Tensor, torch.Tensor]
    assert dict.get(registry, "Linear") == {"scale": 3.0}


def test_jitted_tiny_gpt2_through_a_closure():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=100,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    logits = torchjax.to_jax(lambda ids: model(ids).logits)
    ids = np.random.default_rng(0).integers(0, 100, (2, 8)).astype(np.int32)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(jax.jit(logits)(jnp.asarray(ids)), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits(jnp.asarray(ids)), expected, rtol=1e-5, atol=1e-5)


class _Box:
    __slots__ = ("value",)  # no __dict__: torchjax cannot put back what it holds


def test_fake_tensor_left_where_torchjax_cannot_reach_is_an_error():
    box = _Box()
    hidden = [[[box]]]  # deeper than torchjax looks, and a holder it cannot restore

    def f(x):
        hidden[0][0][0].value = x * 2
        return x + 1

    with pytest.raises(
        ShapeInferenceError, match="(?s)left a fake tensor in a _Box object.*result_shape_dtypes"
    ):
        jax.jit(torchjax.to_jax(f))(jnp.ones(3))
    # With declared types no fake run happens, and the box holds the real call's tensor.
    declared = torchjax.to_jax(f, result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32))
    np.testing.assert_array_equal(jax.jit(declared)(jnp.ones(3)), [2.0, 2.0, 2.0])
    assert type(box.value) is torch.Tensor


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_real_call_that_returns_a_fake_tensor_is_an_error(mode):
    with FakeTensorMode():
        fake = torch.ones(3)
    assert isinstance(fake, FakeTensor)
    # A tensor without data that some state kept (here: the closure) reaches a real call.
    f = torchjax.to_jax(lambda x: fake, result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32))
    if mode == "jit":
        with pytest.raises(Exception, match=r"(?s)ConversionError.*FakeTensor at out"):
            jax.jit(f)(jnp.ones(3))
    else:
        with pytest.raises(ConversionError, match=r"(?s)FakeTensor at out.*result_shape_dtypes"):
            f(jnp.ones(3))
        with pytest.raises(ConversionError, match=r"(?s)FakeTensor at out"):
            torchjax.to_jax(lambda x: fake)(jnp.ones(3))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_parametrize_cached_around_a_call(mode):
    import torch.nn.utils.parametrize as parametrize

    class Symmetric(torch.nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(-1, -2)

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    parametrize.register_parametrization(lin, "weight", Symmetric())
    apply, variables = torchjax.module_to_jax(lin)
    f = jax.jit(apply) if mode == "jit" else apply
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    other = jax.tree.map(lambda a: a * 2, variables)
    x_t = torch.tensor(np.asarray(x))
    with torch.no_grad():
        doubled = copy.deepcopy(lin)
        for p in doubled.parameters():
            p.mul_(2)
        want, want_other = lin(x_t).cpu().numpy(), doubled(x_t).cpu().numpy()
    with parametrize.cached(), torch.no_grad():
        mine = lin(x_t).cpu().numpy()  # the module caches its own weight under its key
        out = np.asarray(f(variables, x))
        out_other = np.asarray(f(other, x))  # neither reads what the other cached
        mine_after = lin(x_t).cpu().numpy()
    np.testing.assert_allclose(out, want, rtol=1e-6)
    np.testing.assert_allclose(out_other, want_other, rtol=1e-6)
    np.testing.assert_array_equal(mine, want)
    np.testing.assert_array_equal(mine_after, want)


# -- torch code that runs autograd itself ---------------------------------------------------
def _forces(w, x):  # minus the gradient of an energy: what interatomic potentials return
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        (dedx,) = torch.autograd.grad((w * torch.sin(x) ** 2).sum(), x, create_graph=True)
    return -dedx


_W = jnp.array([0.5, 1.5, 2.0], dtype=jnp.float32)
_XF = jnp.array([0.3, -0.2, 1.1], dtype=jnp.float32)


def _torch_loss(w):
    return (_forces(w, torch.tensor(np.asarray(_XF))) ** 2).sum()


@pytest.mark.parametrize("transform", ["grad", "jit_grad", "vjp", "hessian", "vmap_grad"])
def test_autograd_inside_the_forward(transform):
    f = torchjax.to_jax(_forces)
    loss = lambda w: jnp.sum(f(w, _XF) ** 2)
    w_t = torch.tensor(np.asarray(_W), requires_grad=True)
    (want_grad,) = torch.autograd.grad(_torch_loss(w_t), w_t)
    if transform == "grad":
        got, want = jax.grad(loss)(_W), want_grad
    elif transform == "jit_grad":
        got, want = jax.jit(jax.grad(loss))(_W), want_grad
    elif transform == "vjp":
        out, pullback = jax.vjp(lambda w: f(w, _XF), _W)
        ct = jnp.array([1.0, -2.0, 0.5])
        (got,) = pullback(ct)
        w_t = torch.tensor(np.asarray(_W), requires_grad=True)
        forces = _forces(w_t, torch.tensor(np.asarray(_XF)))
        (want,) = torch.autograd.grad(forces, w_t, torch.tensor(np.asarray(ct)))
        np.testing.assert_allclose(out, forces.detach().cpu().numpy(), rtol=1e-6)
    elif transform == "hessian":
        got = jax.hessian(loss)(_W)
        want = torch.autograd.functional.hessian(_torch_loss, torch.tensor(np.asarray(_W)))
    else:
        ws = jnp.stack([_W, 2 * _W])
        got = jax.vmap(jax.grad(loss))(ws)
        rows = []
        for w in ws:
            w_t = torch.tensor(np.asarray(w), requires_grad=True)
            rows.append(torch.autograd.grad(_torch_loss(w_t), w_t)[0])
        want = torch.stack(rows)
    np.testing.assert_allclose(got, want.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
    # The same by hand: forces are -w sin(2x), the loss' gradient 2 w sin(2x)^2.
    if transform in ("grad", "jit_grad"):
        np.testing.assert_allclose(got, 2 * _W * jnp.sin(2 * _XF) ** 2, rtol=1e-5)


# -- vmap randomness ------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["global", "generator"])
def test_random_module_under_vmap_is_refused_by_default(which):
    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gen = torch.Generator().manual_seed(0)

        def forward(self, x):
            if which == "global":
                return x + torch.rand(x.shape)
            return x + torch.rand(x.shape, generator=self.gen)

    apply, variables = torchjax.module_to_jax(Noisy())
    xs = jnp.zeros((4, 3))
    with pytest.raises(VmapError, match="(?s)random.*vmap_randomness='different'"):
        jax.vmap(lambda x: apply(variables, x))(xs)
    f = torchjax.to_jax(lambda x: x + torch.rand(x.shape))
    with pytest.raises(VmapError, match="(?s)random.*vmap_randomness='different'"):
        jax.vmap(f)(xs)
    chosen, v = torchjax.module_to_jax(Noisy(), vmap_randomness="different")
    assert jax.vmap(lambda x: chosen(v, x))(xs).shape == (4, 3)


class _GrowingMask(torch.nn.Module):
    """A causal mask cached as a buffer and registered again, larger, when a longer input
    comes (as attention layers grow their mask or rotary caches on demand)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(4, 12)
        self.register_buffer("mask", torch.ones(2, 2, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x):  # x: [T, 4]
        T = x.shape[0]
        if T > self.mask.shape[0]:
            self.register_buffer(
                "mask", torch.ones(T, T, dtype=torch.bool).tril(), persistent=False
            )
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.T).masked_fill(~self.mask[:T, :T], float("-inf"))
        return scores.softmax(-1) @ v


@pytest.mark.parametrize("jit", [False, True])
def test_a_buffer_the_forward_grows_is_taken_back_at_its_new_shape(jit):
    module, reference = _GrowingMask(), _GrowingMask()
    apply, variables = torchjax.module_to_jax(module)
    call = jax.jit(apply, static_argnames="mutable") if jit else apply
    params, buffers = variables["params"], variables["buffers"]
    for length in (2, 3, 2, 5):
        x = torch.linspace(-1.0, 1.0, 4 * length).reshape(length, 4)
        out, buffers = call(
            {"params": params, "buffers": buffers}, jnp.asarray(x.numpy()), mutable=True
        )
        tree_close(out, reference(x).detach(), rtol=1e-6)
        assert buffers["mask"].shape == tuple(reference.mask.shape)
    wrong = {"params": params, "buffers": {"mask": jnp.ones((4, 4), bool)}}
    with pytest.raises(VariablesError, match=r"expects \[2, 2\] \(or a shape a mutable=True"):
        apply(wrong, jnp.ones((2, 4)))


# -- buffers a call cannot carry as torch does ------------------------------------------
class _ViewedBuffer(torch.nn.Module):
    """A buffer registered as a view of another: torch's forward sees a write into `full`
    through `part`; apply gives each its own array, so such a write is refused."""

    def __init__(self, write: bool):
        super().__init__()
        self.write = write
        self.register_buffer("full", torch.ones(4))
        self.register_buffer("part", self.full[:3])

    def forward(self, x):
        if self.write:
            self.full.mul_(3)
        return x * self.part


@pytest.mark.parametrize("mode", ["eager", "jit", "mutable"])
def test_a_write_into_a_buffer_another_one_views_is_refused(mode):
    x = jnp.ones(3)
    apply, variables = torchjax.module_to_jax(_ViewedBuffer(write=True))
    call = {
        "eager": lambda: apply(variables, x),
        "jit": lambda: jax.jit(apply)(variables, x),
        "mutable": lambda: apply(variables, x, mutable=True),
    }[mode]
    with pytest.raises(VariablesError, match="(?s)buffer 'full'.*shares memory with buffer 'part'"):
        call()
    np.testing.assert_array_equal(variables["buffers"]["full"], np.ones(4))


def test_buffers_that_view_each_other_are_read_as_torch_reads_them():
    module = _ViewedBuffer(write=False)
    apply, variables = torchjax.module_to_jax(module)
    x = jnp.array([1.0, 2.0, 3.0])
    want = module(torch.tensor(np.asarray(x))).numpy()
    np.testing.assert_array_equal(apply(variables, x), want)
    np.testing.assert_array_equal(jax.jit(apply)(variables, x), want)


class _RegistersOnFirstCall(torch.nn.Module):
    def forward(self, x):
        if "acc" not in self._buffers:
            self.register_buffer("acc", torch.zeros_like(x))
        self.acc.add_(x)
        return self.acc * 1


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_buffer_forward_registers_is_dropped_with_a_warning_under_mutable(mode):
    apply, variables = torchjax.module_to_jax(_RegistersOnFirstCall())
    call = jax.jit(apply, static_argnames="mutable") if mode == "jit" else apply
    with pytest.warns(
        StateWarning, match="(?s)registered a buffer that variables lacks: 'acc'.*__init__"
    ):
        out, new_buffers = call(variables, jnp.ones(3), mutable=True)
    np.testing.assert_array_equal(out, np.ones(3))
    assert new_buffers == {}  # what the warning says: it cannot be carried over


# -- the walk over user objects runs none of their code (issue 45: e3nn's o3.Irreps) -------
_RAN: list[str] = []
_COPY_PROTOCOL = {"__deepcopy__", "__setstate__", "__reduce_ex__", "__reduce__", "__getstate__"}


class _Opaque(tuple):
    """A tuple whose Python protocol raises (o3.Irreps' __len__ does)."""

    def __len__(self):
        _RAN.append("__len__")
        raise NotImplementedError

    def __iter__(self):
        _RAN.append("__iter__")
        raise NotImplementedError

    def __eq__(self, other):
        _RAN.append("__eq__")
        raise NotImplementedError

    __hash__ = None


class _Forwarding:
    """An object whose __getattr__ and a property have effects."""

    def __init__(self):
        self.table = {"k": _Opaque((1,))}

    def __getattr__(self, name):
        _RAN.append(f"__getattr__({name})")
        raise AttributeError(name)

    @property
    def loud(self):
        _RAN.append("property")
        return 1


class _OpaqueList(list):  # (copy.deepcopy iterates it: that is copy's protocol)
    def __len__(self):
        _RAN.append("list.__len__")
        raise NotImplementedError


class _HoldsOpaque(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.irreps = _Opaque((1, 2, 3))
        self.other = _Forwarding()
        self.items = _OpaqueList([_Opaque((4,))])
        self.nested = {"a": [_Opaque((5,)), _Forwarding()]}

    def forward(self, x):  # [3] -> [2]
        return self.lin(x) * sum(tuple.__iter__(self.irreps))


@pytest.mark.parametrize("transform", ["eager", "jit", "grad", "vmap"])
@pytest.mark.parametrize("entry", ["module_to_jax", "to_jax"])
def test_objects_whose_protocol_raises_are_walked_without_running_their_code(entry, transform):
    module = _HoldsOpaque()
    x = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)
    if entry == "module_to_jax":
        apply, variables = torchjax.module_to_jax(module)
        fn = lambda x: apply(variables, x)
    else:
        fn = torchjax.to_jax(lambda x: module(x))
    transformed = {
        "eager": fn,
        "jit": jax.jit(fn),
        "grad": jax.grad(lambda x: fn(x).sum()),
        "vmap": jax.vmap(fn),
    }[transform]
    _RAN.clear()
    got = transformed(x)
    # module_to_jax's private copies ask copy.deepcopy's protocol, as copy.deepcopy does.
    ran = [r for r in _RAN if r.removeprefix("__getattr__(").rstrip(")") not in _COPY_PROTOCOL]
    assert ran == []
    x_t = torch.tensor(x, requires_grad=transform == "grad")
    want = module(x_t)
    if transform == "grad":
        (want,) = torch.autograd.grad(want.sum(), x_t)
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-6, atol=1e-6)


_LAZY_MODULE = """\
import torch
TABLE = torch.arange(3.0) * 2
"""


@pytest.mark.parametrize("how", ["import_statement", "import_module"])
@pytest.mark.parametrize("lowering", ["callback", "xla"])
def test_a_module_first_imported_inside_the_function_builds_real_tensors(
    lowering, how, tmp_path, monkeypatch
):
    # An import inside forward (torchdiffeq's solvers, a plugin) runs the module's code in
    # the first fake run or capture: its module-level tensors are real, as after an import
    # anywhere else, and the module works afterwards in plain torch too.
    if lowering == "xla" and importlib.util.find_spec("torchax") is None:
        pytest.skip("lowering='xla' needs torchax")
    name = f"torchjax_lazy_{lowering}_{how}"
    (tmp_path / f"{name}.py").write_text(_LAZY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))

    def fn(x):
        if how == "import_module":
            module = importlib.import_module(name)
        else:
            module = __import__(name)
        return x + module.TABLE

    f = torchjax.to_jax(fn, lowering=lowering)
    x = np.ones(3, np.float32)
    np.testing.assert_allclose(jax.jit(f)(x), [1.0, 3.0, 5.0])
    module = sys.modules[name]
    assert type(module.TABLE) is torch.Tensor  # not a FakeTensor
    np.testing.assert_allclose(module.TABLE.numpy(), [0.0, 2.0, 4.0])
    monkeypatch.delitem(sys.modules, name)
