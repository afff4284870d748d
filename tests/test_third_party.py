"""Third-party torch libraries whose code has state, through torchjax, against themselves.

Each library is pinned in requirements-thirdparty.txt (installed without dependencies, so
that the pinned CPU torch stays). References are the library called directly in torch.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax


# -- torchdiffeq: the adjoint backward re-evaluates the vector field -----------------------
class _Field(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, t, y):
        return torch.tanh(self.lin(y)) * torch.cos(t)


class _Ode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.field = _Field()

    def forward(self, y0):
        from torchdiffeq import odeint_adjoint

        t = torch.linspace(0.0, 1.0, 5, dtype=y0.dtype)
        ys = odeint_adjoint(self.field, y0, t, method="rk4", options={"step_size": 0.1})
        return (ys[-1] ** 2).sum()


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_torchdiffeq_odeint_adjoint_gradients(mode):
    torch.manual_seed(0)
    ode = _Ode()
    # torchdiffeq checks its time grid's values, which a fake run cannot: declare the output.
    apply, variables = torchjax.module_to_jax(
        ode, result_shape_dtypes=jax.ShapeDtypeStruct((), jnp.float32)
    )
    params = jax.tree.map(lambda a: a * 1.3, variables["params"])  # not the module's own
    y0 = jnp.array([0.1, -0.3, 0.5])
    loss = lambda p, y: apply({"params": p, "buffers": {}}, y)
    grad = jax.grad(loss, argnums=(0, 1))
    g_params, g_y0 = (jax.jit(grad) if mode == "jit" else grad)(params, y0)
    torch_ode = _Ode()
    torch_ode.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in params.items()})
    y0_t = torch.tensor(np.asarray(y0), requires_grad=True)
    out = torch_ode(y0_t)
    names = [n for n, _ in torch_ode.named_parameters()]
    want = torch.autograd.grad(out, [*torch_ode.parameters(), y0_t])
    for name, w in zip(names, want, strict=False):
        np.testing.assert_allclose(g_params[name], w.numpy(), rtol=1e-5, atol=1e-7)
        assert np.abs(w.numpy()).max() > 1e-4  # a gradient that is there to get wrong
    np.testing.assert_allclose(g_y0, want[-1].numpy(), rtol=1e-5, atol=1e-7)


# -- PyTorch Geometric: GCNConv(cached=True) keeps the normalized graph --------------------
def test_pyg_gcnconv_cached_twice_eagerly():
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)
    conv = GCNConv(4, 3, cached=True)
    reference = copy.deepcopy(conv)
    edge_index = torch.tensor([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]])
    x = torch.randn(4, 4)
    want = [reference(x, edge_index).detach().numpy() for _ in range(2)]
    apply, variables = torchjax.module_to_jax(conv)
    xj, ej = jnp.asarray(x.numpy()), jnp.asarray(edge_index.numpy())
    for w in want:
        np.testing.assert_allclose(apply(variables, xj, ej), w, rtol=1e-6, atol=1e-7)
    assert conv._cached_edge_index is None  # the user's module never ran
    np.testing.assert_allclose(conv(x, edge_index).detach().numpy(), want[0], rtol=1e-6)


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
def test_pyg_gcnconv_with_an_int32_edge_index_with_x64_off(transform):
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)
    conv = GCNConv(4, 3)
    edge_index = torch.tensor([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]])
    x = torch.randn(4, 4)
    # GCNConv's self-loops take a boolean mask (data-dependent shapes): declared types.
    declared = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    apply, variables = torchjax.module_to_jax(conv, result_shape_dtypes=declared)
    xj, ej = jnp.asarray(x.numpy()), jnp.asarray(edge_index.numpy(), jnp.int32)
    assert ej.dtype == jnp.int32
    if transform == "jit":
        got, want = jax.jit(apply)(variables, xj, ej), conv(x, edge_index)
    elif transform == "grad":
        got = jax.grad(lambda x: (apply(variables, x, ej) ** 2).sum())(xj)
        x_t = x.clone().requires_grad_()
        (want,) = torch.autograd.grad((conv(x_t, edge_index) ** 2).sum(), x_t)
    else:
        xs = jnp.stack([xj, 2 * xj])
        got = jax.vmap(apply, in_axes=(None, 0, None))(variables, xs, ej)
        want = torch.stack([conv(x, edge_index), conv(2 * x, edge_index)])
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-6)


# -- gpytorch: eval-mode predictions cache the training solve ------------------------------
def _gp_model():
    import gpytorch

    class GP(gpytorch.models.ExactGP):
        def __init__(self, x, y, likelihood):
            super().__init__(x, y, likelihood)
            self.mean = gpytorch.means.ConstantMean()
            self.cov = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean(x), self.cov(x))

    class Predict(torch.nn.Module):  # the posterior's mean and variance at x
        def __init__(self, gp):
            super().__init__()
            self.gp = gp

        def forward(self, x):
            posterior = self.gp.likelihood(self.gp(x))
            return posterior.mean, posterior.variance

    train_x = torch.linspace(0, 1, 12, dtype=torch.float64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    gp = GP(train_x, torch.sin(6 * train_x), likelihood).double()
    return Predict(gp).eval()


def test_gpytorch_eval_mode_prediction_with_debug_off(x64):
    import gpytorch

    model = _gp_model()
    test_x = torch.linspace(-0.2, 1.2, 7, dtype=torch.float64)
    with gpytorch.settings.debug(False):
        apply, variables = torchjax.module_to_jax(model)
        for shift in (0.0, 0.3, -0.2):  # the module's hyperparameters, then others
            v = jax.tree.map(lambda a, s=shift: a + s, variables)
            reference = copy.deepcopy(model)
            reference.load_state_dict(
                {k: torch.tensor(np.asarray(a)) for g in v.values() for k, a in g.items()}
            )
            want = [t.detach().numpy() for t in reference(test_x)]
            got = apply(v, jnp.asarray(test_x.numpy()))
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
        # The module itself still predicts in plain torch (no fake or foreign cache in it).
        mean, _ = model(test_x)
        np.testing.assert_allclose(mean.detach().numpy(), apply(variables, test_x.numpy())[0])


# -- botorch: acquisition functions (which turn gpytorch's debug checks off) ----------------
def test_botorch_expected_improvement(x64):
    from botorch.acquisition import ExpectedImprovement
    from botorch.models import SingleTaskGP

    torch.manual_seed(0)
    train_x = torch.rand(10, 2, dtype=torch.float64)
    train_y = train_x.sin().sum(-1, keepdim=True)
    model = SingleTaskGP(train_x, train_y).eval()
    ei = ExpectedImprovement(model, best_f=train_y.max())
    x = torch.rand(5, 1, 2, dtype=torch.float64)
    want = ei(x).detach().numpy()
    f = torchjax.to_jax(lambda x: ei(x))
    np.testing.assert_allclose(f(jnp.asarray(x.numpy())), want, rtol=1e-10)
    np.testing.assert_allclose(ei(x).detach().numpy(), want, rtol=1e-10)  # still works
    # Its gradient, for a JAX optimizer of the acquisition (the fake run cannot read
    # gpytorch's data-dependent checks: declare the output).
    declared = torchjax.to_jax(
        lambda x: ei(x), result_shape_dtypes=jax.ShapeDtypeStruct((5,), jnp.float64)
    )
    g = jax.jit(jax.grad(lambda x: declared(x).sum()))(jnp.asarray(x.numpy()))
    x_t = x.clone().requires_grad_()
    (want_grad,) = torch.autograd.grad(ei(x_t).sum(), x_t)
    np.testing.assert_allclose(g, want_grad.numpy(), rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(ei(x).detach().numpy(), want, rtol=1e-10)


# -- Hugging Face: dynamic RoPE and gradient checkpointing ----------------------------------
def _llama(**config):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.0,
        **config,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_hf_dynamic_rope_over_calls_of_12_8_12_tokens():
    # The forward re-registers its inv_freq buffer and sets max_seq_len_cached.
    model = _llama(
        max_position_embeddings=8,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        initializer_range=0.5,  # weights large enough for positions to matter in the logits
    )
    model.eval()
    stateful = copy.deepcopy(model)  # torch, called in sequence, keeps its state
    apply, variables = torchjax.module_to_jax(model)
    rng = np.random.RandomState(0)
    seqs = [rng.randint(0, 64, (1, n)) for n in (12, 8, 12)]
    buffers = variables["buffers"]
    carried = []
    for ids in seqs:
        want = stateful(torch.tensor(ids), use_cache=False).logits.detach().numpy()
        out, buffers = apply(
            {"params": variables["params"], "buffers": buffers},
            jnp.asarray(ids),
            use_cache=False,
            mutable=True,
        )
        np.testing.assert_allclose(out["logits"], want, rtol=1e-5, atol=1e-5)
        carried.append(want)
    # Without mutable=True each call is a fresh module's (the dropped buffer is said once):
    # the 8-token call after a 12-token one differs from torch's stateful one, which keeps
    # the grown frequencies.
    with pytest.warns(torchjax.errors.StateWarning, match="reassigned a buffer: 'model"):
        apply(variables, jnp.asarray(seqs[0]), use_cache=False)
    for ids in seqs:
        fresh = copy.deepcopy(model)(torch.tensor(ids), use_cache=False).logits.detach().numpy()
        out = apply(variables, jnp.asarray(ids), use_cache=False)
        np.testing.assert_allclose(out["logits"], fresh, rtol=1e-5, atol=1e-5)
    fresh_8 = copy.deepcopy(model)(torch.tensor(seqs[1]), use_cache=False).logits.detach()
    assert np.abs(fresh_8.numpy() - carried[1]).max() > 1e-2  # the two semantics differ here


def test_hf_gradient_checkpointing_trains_like_torch(x64):
    import optax

    model = _llama(max_position_embeddings=32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    reference = copy.deepcopy(model)
    apply, variables = torchjax.module_to_jax(model)
    ids = np.random.RandomState(0).randint(0, 64, (2, 10))

    def loss(params):
        v = {"params": params, "buffers": variables["buffers"]}
        return apply(v, ids, labels=ids, use_cache=False)["loss"]

    opt = optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    params, state = variables["params"], opt.init(variables["params"])
    torch_opt = torch.optim.AdamW(
        reference.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
    )
    for _ in range(3):
        params, state, value = step(params, state)
        torch_opt.zero_grad()
        torch_loss = reference(torch.tensor(ids), labels=torch.tensor(ids), use_cache=False).loss
        torch_loss.backward()
        torch_opt.step()
        np.testing.assert_allclose(value, torch_loss.item(), rtol=1e-5)
    for name, p in reference.named_parameters():
        np.testing.assert_allclose(params[name], p.detach().numpy(), rtol=1e-4, atol=1e-6)


# -- e3nn: every module holds o3.Irreps, a tuple subclass whose __len__ raises --------------
# The per-call snapshots and fake runs walk a module's objects without calling their code
# (issue 45: they called list() on tuples, so every e3nn module failed).
def _e3nn_model() -> torch.nn.Module:
    from e3nn import o3

    torch.manual_seed(0)
    irreps_in, irreps_out = o3.Irreps("2x0e + 1x1o"), o3.Irreps("1x0e + 2x1o")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.irreps_in = irreps_in
            self.lin = o3.Linear(irreps_in, irreps_in)
            self.tp = o3.FullyConnectedTensorProduct(irreps_in, irreps_in, irreps_out)

        def forward(self, x):  # [5] -> [7]
            h = self.lin(x)
            return self.tp(h, x)

    return Model()


@pytest.mark.parametrize("transform", ["eager", "jit", "grad", "vmap", "jacfwd"])
def test_e3nn_modules_through_module_to_jax_equal_e3nn(transform):
    pytest.importorskip("e3nn")
    model = _e3nn_model()
    reference = copy.deepcopy(model)
    apply, variables = torchjax.module_to_jax(model)
    xs = np.random.default_rng(0).normal(size=(4, 5)).astype(np.float32)
    x_t = torch.tensor(xs)
    params_t = {k: v.detach() for k, v in reference.named_parameters()}

    def torch_fn(p, x):
        return torch.func.functional_call(reference, p, (x,))

    def jax_fn(p, x):
        return apply({"params": p, "buffers": variables["buffers"]}, x)

    params = variables["params"]
    if transform == "eager":
        got, want = jax_fn(params, xs), torch_fn(params_t, x_t)
    elif transform == "jit":
        got, want = jax.jit(jax_fn)(params, xs), torch_fn(params_t, x_t)
    elif transform == "grad":
        got = jax.grad(lambda p, x: jax_fn(p, x).sum() ** 2)(params, xs)
        want = torch.func.grad(lambda p, x: torch_fn(p, x).sum() ** 2)(params_t, x_t)
    elif transform == "vmap":
        got = jax.vmap(jax_fn, in_axes=(None, 0))(params, xs[:, None])
        want = torch.func.vmap(torch_fn, in_dims=(None, 0))(params_t, x_t[:, None])
    else:
        got = jax.jacfwd(jax_fn, argnums=1)(params, xs)
        want = torch.func.jacfwd(torch_fn, argnums=1)(params_t, x_t)
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g), w.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert any(np.abs(w.detach().numpy()).max() > 1e-3 for w in want_leaves)
    # The module itself is untouched: its parameters are still the reference's.
    for k, v in model.named_parameters():
        np.testing.assert_array_equal(v.detach().numpy(), params_t[k].numpy())


# -- pyro and torchquad: library code that validates its inputs by reading values --------
def _pyro_log_prob(loc, scale, x):
    import pyro.distributions as dist

    return dist.Normal(loc, scale).log_prob(x).sum()


def _pyro_reference(loc, scale, x):
    """The log-density and its gradient in (loc, scale), by pyro and torch autograd."""
    loc, scale = (torch.tensor(float(v), requires_grad=True) for v in (loc, scale))
    value = _pyro_log_prob(loc, scale, torch.from_numpy(np.asarray(x)))
    grads = torch.autograd.grad(value, (loc, scale))
    return value.item(), [g.item() for g in grads]


def test_pyro_log_prob_with_validation_under_eager_grad_then_jit(x64_off):
    pyro = pytest.importorskip("pyro")
    loc, scale, x = jnp.float32(0.3), jnp.float32(1.5), jnp.linspace(-1.0, 1.0, 5)
    value, grads = _pyro_reference(loc, scale, x)
    with pyro.validation_enabled(True):
        f = torchjax.to_jax(_pyro_log_prob)
        with pytest.raises(torchjax.errors.ShapeInferenceError) as info:
            jax.jit(f)(loc, scale, x)  # no real run yet: both routes, and where it read
        text = str(info.value)
        assert (
            "torch/distributions/distribution.py" in text
            and "call the function once eagerly" in text
        )
        assert "result_shape_dtypes" in text
        got = jax.grad(f, argnums=(0, 1))(loc, scale, x)  # eager: a real run gives the types
        np.testing.assert_allclose(got, grads, rtol=1e-5)
        np.testing.assert_allclose(jax.jit(f)(loc, scale, x), value, rtol=1e-6)
        np.testing.assert_allclose(
            jax.jit(jax.grad(f, argnums=(0, 1)))(loc, scale, x), grads, rtol=1e-5
        )
        # A value the validation refuses is the library's own error, eagerly and under jit.
        with pytest.raises(ValueError, match="scale"):
            f(loc, jnp.float32(-1.0), x)


@pytest.mark.parametrize("method", ["torch.func", "sequential"])
def test_pyro_log_prob_with_validation_under_eager_vmap(x64_off, method):
    pyro = pytest.importorskip("pyro")
    loc, x = jnp.float32(0.3), jnp.linspace(-1.0, 1.0, 5)
    scales = jnp.array([1.5, 2.0, 0.5], dtype=jnp.float32)
    with pyro.validation_enabled(True):
        f = torchjax.to_jax(_pyro_log_prob, vmap_method=method)
        got = jax.vmap(f, in_axes=(None, 0, None))(loc, scales, x)
        want = [_pyro_reference(loc, s, x)[0] for s in scales]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        per_example = jax.vmap(jax.grad(f, argnums=1), in_axes=(None, 0, None))(loc, scales, x)
        np.testing.assert_allclose(
            per_example, [_pyro_reference(loc, s, x)[1][1] for s in scales], rtol=1e-5
        )


def _simpson(a):
    from torchquad import Simpson

    integrand = lambda t: torch.exp(a * t[:, 0])
    domain = [[0.0, 1.0]]  # torchquad checks it by reading its values
    return Simpson().integrate(integrand, dim=1, N=101, integration_domain=domain, backend="torch")


@pytest.mark.parametrize("transform", ["eager", "grad", "hessian"])
def test_torchquad_simpson_under_eager_grad_and_hessian(x64_off, transform):
    pytest.importorskip("torchquad")
    f = torchjax.to_jax(_simpson)
    exact = lambda a: (jnp.exp(a) - 1.0) / a  # the integral of exp(a t) over [0, 1]
    wrap = {"eager": lambda g: g, "grad": jax.grad, "hessian": jax.hessian}[transform]
    a = jnp.float32(0.7)
    np.testing.assert_allclose(wrap(f)(a), wrap(exact)(a), rtol=2e-5)


def _pyro_scaled(x):
    import pyro

    w = pyro.param("w", lambda: torch.full((3,), 2.0))
    if bool(x.sum() > 0):  # a value read: a fake run stops here, after pyro.param
        return x * w
    return x


@pytest.mark.parametrize("reads_a_value", [False, True], ids=["run succeeds", "run fails"])
def test_pyro_param_store_keeps_no_fake_tensor_after_a_fake_run(reads_a_value):
    pyro = pytest.importorskip("pyro")
    fn = _pyro_scaled if reads_a_value else (lambda x: x * pyro.param("w", lambda: torch.ones(3)))
    pyro.clear_param_store()
    try:
        with pytest.raises(torchjax.errors.ShapeInferenceError) as info:
            jax.jit(torchjax.to_jax(fn))(jnp.ones(3))
        text = str(info.value)
        # The holder and the key, and for a failed run what it failed with.
        assert "'_param_to_name' of a ParamStoreDict object, as the key of 'w'" in text
        assert ("DataDependentOutputException" in text) is reads_a_value
        # Plain pyro afterwards computes with real tensors: the run's parameter is gone
        # from the store (the run made it), and pyro makes it anew.
        out = fn(torch.ones(3))
        assert not isinstance(out, torch._subclasses.fake_tensor.FakeTensor)
        want = 2.0 if reads_a_value else 1.0
        torch.testing.assert_close(out.detach(), torch.full((3,), want))
    finally:
        pyro.clear_param_store()
