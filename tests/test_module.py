"""module_to_jax: torch modules as pure JAX functions of a variables pytree."""

import copy
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import torchjax
from torchjax.errors import VariablesError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def to_t(x):
    return torch.from_numpy(np.array(x))


def small_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("copy", [True, False])
def test_variables_names_and_copy_or_zero_copy(copy):
    net = small_net()
    net.register_buffer("scale", torch.ones(3))
    apply, variables = torchjax.module_to_jax(net, copy=copy)
    assert set(variables["params"]) == {n for n, _ in net.named_parameters()}
    assert set(variables["buffers"]) == {"scale"}
    named = {**dict(net.named_parameters()), **dict(net.named_buffers())}
    for group in ("params", "buffers"):
        for name, array in variables[group].items():
            np.testing.assert_array_equal(array, named[name].detach().numpy())
            shared = array.unsafe_buffer_pointer() == named[name].data_ptr()
            assert shared is not copy, name


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_apply_matches_module(mode):
    net = small_net()
    apply, variables = torchjax.module_to_jax(net)
    if mode == "jit":
        apply = jax.jit(apply)
    x = jnp.linspace(-1, 1, 20).reshape(5, 4)
    np.testing.assert_allclose(apply(variables, x), net(to_t(x)).detach().numpy(), rtol=1e-6)


def test_grads_wrt_params_and_inputs_match_torch_autograd():
    net = small_net()
    apply, variables = torchjax.module_to_jax(net)
    x = jnp.linspace(-1, 1, 20).reshape(5, 4)
    loss = lambda params, x: jnp.sum(apply({"params": params, "buffers": {}}, x) ** 2)
    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], x)
    xt = to_t(x).requires_grad_()
    (net(xt) ** 2).sum().backward()
    for name, p in net.named_parameters():
        np.testing.assert_allclose(g_params[name], p.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_x, xt.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_vmap_over_examples_and_per_example_grads():
    net = small_net()
    apply, variables = torchjax.module_to_jax(net)
    xs = jnp.linspace(-1, 1, 20).reshape(5, 4)
    per_example = jax.vmap(lambda x: apply(variables, x[None])[0])(xs)
    np.testing.assert_allclose(per_example, net(to_t(xs)).detach().numpy(), rtol=1e-6)
    grads = jax.vmap(
        jax.grad(lambda p, x: jnp.sum(apply({"params": p, "buffers": {}}, x[None]))),
        in_axes=(None, 0),
    )(variables["params"], xs)
    for i in range(5):
        net.zero_grad()
        net(to_t(xs[i : i + 1])).sum().backward()
        np.testing.assert_allclose(grads["2.weight"][i], net[2].weight.grad.numpy(), rtol=1e-5)


def test_batchnorm_buffers_update_functionally():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    net.train()
    reference = copy.deepcopy(net)
    apply, variables = torchjax.module_to_jax(net)
    before_module = {k: v.clone() for k, v in net.state_dict().items()}
    before_vars = jax.tree.map(np.array, variables)
    x = jnp.linspace(-2, 3, 18).reshape(6, 3)

    out, new_buffers = jax.jit(lambda v, x: apply(v, x, mutable=True))(variables, x)
    ref_out = reference(to_t(x))
    np.testing.assert_allclose(out, ref_out.detach().numpy(), rtol=1e-5, atol=1e-6)
    for name, buf in reference.named_buffers():
        np.testing.assert_allclose(new_buffers[name], buf.numpy(), rtol=1e-6)
    assert new_buffers["1.num_batches_tracked"] == 1
    assert new_buffers["1.num_batches_tracked"].dtype == jnp.int32  # x64 off
    for k, v in net.state_dict().items():  # the module is untouched
        assert torch.equal(v, before_module[k]), k
    jax.tree.map(np.testing.assert_array_equal, variables, before_vars)  # so are the arrays


def test_train_and_eval_mode_respected_under_jit():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    apply, variables = torchjax.module_to_jax(net)
    f = jax.jit(apply)
    x = jnp.linspace(-2, 3, 18).reshape(6, 3)
    net.train()
    train_out = f(variables, x)
    net.eval()
    eval_out = f(variables, x)
    np.testing.assert_allclose(eval_out, net(to_t(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
    net.train()
    np.testing.assert_allclose(
        train_out, copy.deepcopy(net)(to_t(x)).detach().numpy(), rtol=1e-5, atol=1e-5
    )
    assert not np.allclose(train_out, eval_out)


def test_dropout_rng_reproducible_and_global_rng_without_key():
    net = torch.nn.Dropout(0.5)
    net.train()
    apply, variables = torchjax.module_to_jax(net)
    x = jnp.ones((200,))
    a = apply(variables, x, rng=jax.random.key(0))
    b = jax.jit(lambda v, x, k: apply(v, x, rng=k))(variables, x, jax.random.key(0))
    c = apply(variables, x, rng=jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert set(np.unique(np.asarray(a))) <= {0.0, 2.0}
    # Without a key: torch's global generator, advancing like plain PyTorch.
    torch.manual_seed(123)
    d, e = apply(variables, x), apply(variables, x)
    assert not np.array_equal(d, e)
    torch.manual_seed(123)
    np.testing.assert_array_equal(apply(variables, x), d)
    keys = jax.random.split(jax.random.key(2), 3)
    rows = jax.vmap(lambda k: apply(variables, x, rng=k))(keys)
    assert not np.array_equal(rows[0], rows[1])


@pytest.mark.parametrize("callback", ["buffer_callback", "pure_callback"])
def test_two_unseeded_draws_in_one_jit_draw_twice(callback, monkeypatch):
    """Two calls on the same inputs inside one jax.jit draw two masks, as two torch calls
    and two eager calls do (XLA merged the two identical callbacks into one: an R-Drop
    consistency loss was 0 and its gradient too). The same sequence as torch's from a seed."""
    from torchjax._to_jax._torch_call import _lowering as _rule_lowering

    if callback == "pure_callback":
        monkeypatch.setattr(_rule_lowering, "USE_BUFFER_CALLBACK", False)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5)).train()
    apply, variables = torchjax.module_to_jax(net)
    x = jnp.ones((3, 4))
    pair = jax.jit(lambda v, x: (apply(v, x), apply(v, x)))
    pair(variables, x)  # compiled (its fake run draws nothing)
    torch.manual_seed(7)
    first, second = pair(variables, x)
    torch.manual_seed(7)
    expected = [net(torch.ones(3, 4)).detach().numpy() for _ in range(2)]
    assert not np.array_equal(expected[0], expected[1])
    np.testing.assert_allclose(first, expected[0], rtol=1e-6)
    np.testing.assert_allclose(second, expected[1], rtol=1e-6)
    # A gradient through the difference of the two draws is not zero either.
    v = lambda p: {"params": p, "buffers": {}}
    loss = lambda p, x: jnp.sum((apply(v(p), x) - apply(v(p), x)) ** 2)
    grads = jax.jit(jax.grad(loss))(variables["params"], x)
    assert float(jnp.abs(grads["0.weight"]).sum()) > 0
    f = torchjax.to_jax(lambda t: torch.nn.functional.dropout(t, 0.5))
    assert float(jnp.abs(jax.jit(lambda x: f(x) - f(x))(jnp.ones(64))).max()) > 0
    # Declared types: no fake run tells whether it draws; staged as drawing all the same.
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    g = torchjax.to_jax(lambda t: torch.nn.functional.dropout(t, 0.5), result_shape_dtypes=like)
    assert float(jnp.abs(jax.jit(lambda x: g(x) - g(x))(jnp.ones(64))).max()) > 0


class _RunningMax(torch.nn.Module):
    """Dropout, then a buffer written only for some inputs (an observer's running max)."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)
        self.d = torch.nn.Dropout(0.5)
        self.register_buffer("mx", torch.ones(()))

    def forward(self, x):
        h = self.d(self.l(x))
        m = h.abs().max()
        if m > self.mx:
            self.mx.copy_(m)
        return h / self.mx


@pytest.mark.parametrize("jit", [False, True])
def test_a_run_again_on_buffer_copies_keeps_the_first_runs_draws(jit):
    """A write into a buffer that the mode had not made before runs forward again on copies:
    with the generator as the first run found it, so the masks and the generator's sequence
    are torch's from the same seed (the run again drew a second mask)."""
    torch.manual_seed(0)
    model = _RunningMax().train()
    reference = copy.deepcopy(model)
    declared = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # the branch is on values
    apply, variables = torchjax.module_to_jax(model, result_shape_dtypes=declared)
    call = lambda v, x: apply(v, x, mutable=True)
    call = jax.jit(call) if jit else call
    small = np.full((3, 4), 0.01, np.float32)
    big = np.full((3, 4), 10.0, np.float32) * np.arange(1, 5, dtype=np.float32)
    torch.manual_seed(123)
    outs = [np.asarray(call(variables, jnp.asarray(x))[0]) for x in (small, big, small)]
    torch.manual_seed(123)
    for x, out in zip((small, big, small), outs, strict=True):
        reference.mx.fill_(1.0)  # apply got the same buffers each time (not threaded)
        np.testing.assert_allclose(out, reference(torch.from_numpy(x)).detach().numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    "bad, got",
    [
        (3, "got 3 (int)"),
        (jnp.ones(3), "float32[3] array"),
        (jnp.zeros((2, 2), jnp.uint32), "[2, 2]"),
    ],
)
def test_rng_that_is_not_one_key_is_named_as_rng(bad, got):
    apply, variables = torchjax.module_to_jax(torch.nn.Dropout(0.5))
    with pytest.raises(
        torchjax.errors.ArgumentError, match=r"rng must be one JAX PRNG key"
    ) as info:
        apply(variables, jnp.ones(4), rng=bad)
    assert got in str(info.value) and "jax.random.key" in str(info.value)
    with pytest.raises(torchjax.errors.ArgumentError, match=r"rng=\.\.\."):
        jax.jit(lambda v, k: apply(v, jnp.ones(4), rng=k))(variables, bad)


def test_tied_weights_appear_once_and_get_summed_grads():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = torch.nn.Linear(4, 4, bias=False)
            self.dec = torch.nn.Linear(4, 4, bias=False)
            self.dec.weight = self.enc.weight

        def forward(self, x):
            return self.dec(torch.tanh(self.enc(x)))

    torch.manual_seed(0)
    net = Tied()
    apply, variables = torchjax.module_to_jax(net)
    assert list(variables["params"]) == ["enc.weight"]
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    g = jax.grad(lambda p: jnp.sum(apply({"params": p, "buffers": {}}, x) ** 2))(
        variables["params"]
    )
    (net(to_t(x)) ** 2).sum().backward()
    np.testing.assert_allclose(g["enc.weight"], net.enc.weight.grad.numpy(), rtol=1e-5)


def test_variables_errors_name_key_expected_actual():
    apply, variables = torchjax.module_to_jax(small_net())
    x = jnp.ones((2, 4))
    params = dict(variables["params"])
    del params["0.bias"]
    with pytest.raises(VariablesError, match=r"missing \['0.bias'\]"):
        apply({"params": params, "buffers": {}}, x)
    params = {**variables["params"], "extra": jnp.ones(2)}
    with pytest.raises(VariablesError, match=r"unexpected \['extra'\]"):
        apply({"params": params, "buffers": {}}, x)
    params = {**variables["params"], "0.weight": jnp.ones((4, 8))}
    with pytest.raises(VariablesError, match=r"'0.weight'\] has shape \[4, 8\].*expects \[8, 4\]"):
        apply({"params": params, "buffers": {}}, x)
    with pytest.raises(VariablesError, match="returned by module_to_jax"):
        apply(variables["params"], x)


def test_transformer_encoder_layer_grads_match_torch_autograd():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=8, nhead=2, dim_feedforward=16, batch_first=True
    )
    layer.eval()
    apply, variables = torchjax.module_to_jax(layer)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 8)), jnp.float32)
    loss = lambda p: jnp.sum(jnp.sin(apply({"params": p, "buffers": variables["buffers"]}, x)))
    grads = jax.jit(jax.grad(loss))(variables["params"])
    torch.sin(layer(to_t(x))).sum().backward()
    names = [n for n, _ in layer.named_parameters()]
    assert set(grads) == set(names)
    for name, p in layer.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_optax_training_matches_torch_optim_adam():
    spec = importlib.util.spec_from_file_location("train_optax", ROOT / "examples/train_optax.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    jax_losses = example.train_with_optax(40)
    torch_losses = example.train_with_torch(40)
    np.testing.assert_allclose(jax_losses, torch_losses, rtol=2e-3, atol=1e-5)
    assert jax_losses[-1] < 0.2 * jax_losses[0]  # it actually trained


class _Structures(torch.nn.Module):
    """A buffer tied between two submodules and written in place, and a forward that takes
    a static int, keyword arrays, None and a dict: every way apply's call can be shaped."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("count", torch.zeros(()))
        self.sub = torch.nn.Module()
        self.sub.register_buffer("count", self.count)

    def forward(self, x, k=1, scale=None, *, extra=None):
        if isinstance(x, dict):
            x = x["a"] - x["b"]
        self.count.add_(1)
        y = self.lin(x) * k
        if scale is not None:
            y = y * scale
        if extra is not None:
            y = y + extra
        return y, self.sub.count * 1


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize(
    "call",
    [
        lambda x: ((x,), {}),
        lambda x: ((x, 2), {}),
        lambda x: ((x, 1, None), {"extra": x[:, :3]}),
        lambda x: ((x,), {"scale": jnp.float32(3.0)}),
        lambda x: (({"a": x, "b": 2 * x}, 3), {}),
    ],
    ids=["array", "static-int", "none-and-kwarg", "kwarg-only", "dict-arg"],
)
def test_apply_call_structures_match_module(mode, call):
    torch.manual_seed(0)
    net = _Structures()
    apply, variables = torchjax.module_to_jax(net)
    before = jax.tree.map(np.array, variables)
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    args, kwargs = call(x)
    leaves, tree = jax.tree.flatten((args, kwargs))

    def run(v, arrays):  # the arrays traced under jit, the int left static
        given = iter(arrays)
        filled = [next(given) if isinstance(a, jax.Array) else a for a in leaves]
        a, kw = jax.tree.unflatten(tree, filled)
        return apply(v, *a, mutable=True, **kw)

    run = jax.jit(run) if mode == "jit" else run
    arrays = [a for a in leaves if isinstance(a, jax.Array)]
    for step in range(2):  # the second call reuses the plan
        (out, count), new_buffers = run(variables, arrays)
        ref = copy.deepcopy(net)
        t_args = [to_t(a) if isinstance(a, jax.Array) else a for a in args]
        t_args = [{k: to_t(v) for k, v in a.items()} if isinstance(a, dict) else a for a in t_args]
        t_kwargs = {k: to_t(v) for k, v in kwargs.items()}
        ref_out, ref_count = ref(*t_args, **t_kwargs)
        np.testing.assert_allclose(out, ref_out.detach().numpy(), rtol=1e-6, atol=1e-7)
        assert float(count) == float(ref_count) == 1.0, step  # one write, tied buffer, a copy
        np.testing.assert_array_equal(new_buffers["count"], 1.0)
        jax.tree.map(np.testing.assert_array_equal, variables, before)  # caller's arrays
    assert float(net.count) == 0.0  # the module is untouched


def test_a_jitted_optax_loop_over_the_variables_compiles_once():
    # The variables behave like arrays jnp.asarray makes (uncommitted): step 2, called with
    # step 1's outputs, is the same signature, not a second compile (issue 46).
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    apply, variables = torchjax.module_to_jax(net)
    assert not any(a.committed for a in jax.tree.leaves(variables))
    opt = optax.adam(1e-2)
    x = jnp.linspace(-1.0, 1.0, 20).reshape(5, 4)

    @jax.jit
    def step(params, state):
        loss = lambda p: (apply({"params": p, "buffers": variables["buffers"]}, x) ** 2).mean()
        grads = jax.grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = variables["params"], opt.init(variables["params"])
    for _ in range(3):
        params, state = step(params, state)
    assert step._cache_size() == 1
