"""Third-party torch libraries through torchjax, on both front ends, against themselves.

Each library is pinned in requirements-thirdparty.txt (installed without dependencies, so
that the pinned CPU torch stays). References are the library called directly in torch:
its outputs, and its gradients by torch autograd on the same library object. Every test
runs on ``lowering="callback"`` and ``lowering="xla"``. Where torch.export cannot capture
the library by design (it reads a tensor's value to decide what runs next, or makes a
tensor whose shape depends on values), the xla case asserts the LoweringError that names
the library's line and the fix; where the report says jax.export can serialize the lowered
function, the xla case also serializes it, deserializes it and compares the result with
torch's.
"""

from __future__ import annotations

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax
from torchjax.errors import LoweringError

LOWERINGS = ("callback", "xla")


def _refused(where: str):
    """lowering="xla" refuses a library call by design: a LoweringError that names `where`
    (a regex: the library's file or line) and the fix."""
    return pytest.raises(LoweringError, match=rf'(?s){where}.*lowering="callback"')


def _np(a) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _assert_close(got, want, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    if isinstance(want, dict):  # by key: `got` may be another mapping (a ModelOutput's)
        assert sorted(got.keys()) == sorted(want), (list(got.keys()), list(want))
        for k in want:
            _assert_close(got[k], want[k], rtol=rtol, atol=atol)
        return
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), (got, want)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(_np(g), _np(w), rtol=rtol, atol=atol)


def _assert_nontrivial(grads, floor: float = 1e-3) -> None:
    """A gradient that is there to get wrong: a zero-gradient bug cannot pass."""
    assert max(np.abs(_np(g)).max() for g in jax.tree.leaves(grads)) > floor


def _assert_export_round_trip(fn, args, want, report, rtol=1e-5, atol=1e-6) -> None:
    """Where lowering_report says jax.export can serialize `fn`, its serialized and then
    deserialized program gives torch's outputs `want`; where not, the report says why."""
    if not report.exportable:
        assert report.export_error and report.callbacks, str(report)
        return
    exported = jax.export.export(jax.jit(fn))(*args)
    restored = jax.export.deserialize(exported.serialize())
    _assert_close(restored.call(*args), want, rtol=rtol, atol=atol)


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


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_torchdiffeq_odeint_adjoint_gradients(mode, lowering):
    torch.manual_seed(0)
    ode = _Ode()
    if lowering == "xla":
        apply, variables = torchjax.module_to_jax(ode, lowering="xla")
    else:
        # torchdiffeq checks its time grid's values, which a fake run cannot: declare the
        # output.
        apply, variables = torchjax.module_to_jax(
            ode, result_shape_dtypes=jax.ShapeDtypeStruct((), jnp.float32)
        )
    params = jax.tree.map(lambda a: a * 1.3, variables["params"])  # not the module's own
    y0 = jnp.array([0.1, -0.3, 0.5])
    loss = lambda p, y: apply({"params": p, "buffers": {}}, y)
    grad = jax.grad(loss, argnums=(0, 1))
    if lowering == "xla":
        # The same check (`assert diff.all() or (~diff).all()`) stops torch.export: the
        # adjoint solver's control flow depends on values.
        with _refused(r"_Ode\.forward.*torchdiffeq/_impl/misc\.py"):
            (jax.jit(grad) if mode == "jit" else grad)(params, y0)
        return
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
@pytest.mark.parametrize("lowering", LOWERINGS)
def test_pyg_gcnconv_cached_twice_eagerly(lowering):
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)
    conv = GCNConv(4, 3, cached=True)
    reference = copy.deepcopy(conv)
    edge_index = torch.tensor([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]])
    x = torch.randn(4, 4)
    want = [reference(x, edge_index).detach().numpy() for _ in range(2)]
    apply, variables = torchjax.module_to_jax(conv, lowering=lowering)
    xj, ej = jnp.asarray(x.numpy()), jnp.asarray(edge_index.numpy())
    if lowering == "xla":
        # gcn_norm's self-loops index the edges with a boolean mask: a shape that depends
        # on values, which no lowered program can have.
        with _refused(r"depends on its inputs' values.*torch_geometric/nn/conv/gcn_conv\.py"):
            apply(variables, xj, ej)
        assert conv._cached_edge_index is None  # the capture left no fake graph in it
        np.testing.assert_allclose(conv(x, edge_index).detach().numpy(), want[0], rtol=1e-6)
        return
    for w in want:
        np.testing.assert_allclose(apply(variables, xj, ej), w, rtol=1e-6, atol=1e-7)
    assert conv._cached_edge_index is None  # the user's module never ran
    np.testing.assert_allclose(conv(x, edge_index).detach().numpy(), want[0], rtol=1e-6)


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
def test_pyg_gcnconv_with_an_int32_edge_index_with_x64_off(x64_off, transform, lowering):
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)
    conv = GCNConv(4, 3)
    edge_index = torch.tensor([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]])
    x = torch.randn(4, 4)
    xj, ej = jnp.asarray(x.numpy()), jnp.asarray(edge_index.numpy(), jnp.int32)
    assert ej.dtype == jnp.int32
    if lowering == "xla":  # the self-loops' boolean mask again (as in the test above)
        apply, variables = torchjax.module_to_jax(conv, lowering="xla")
        call = {
            "jit": lambda: jax.jit(apply)(variables, xj, ej),
            "grad": lambda: jax.grad(lambda x: (apply(variables, x, ej) ** 2).sum())(xj),
            "vmap": lambda: jax.vmap(apply, in_axes=(None, 0, None))(variables, xj[None], ej),
        }[transform]
        with _refused(r"depends on its inputs' values.*torch_geometric/nn/conv/gcn_conv\.py"):
            call()
        return
    # GCNConv's self-loops take a boolean mask (data-dependent shapes): declared types.
    declared = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    apply, variables = torchjax.module_to_jax(conv, result_shape_dtypes=declared)
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


# -- PyG message passing: messages gathered per edge, summed per node by scatter -----------
# Each layer aggregates with scatter_add_/index_add_ into a buffer of zeros (GAT's softmax
# also with scatter_reduce_ "amax"), without self-loops, so that no boolean mask is taken.
def _pyg_layer(name: str) -> torch.nn.Module:
    from torch_geometric import nn

    torch.manual_seed(0)
    return {
        "SAGEConv": lambda: nn.SAGEConv(4, 3),
        "GATConv": lambda: nn.GATConv(4, 3, heads=2, add_self_loops=False),
        "GCNConv": lambda: nn.GCNConv(4, 3, add_self_loops=False),
        "GINConv": lambda: nn.GINConv(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())),
    }[name]()


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("layer", ["SAGEConv", "GATConv", "GCNConv", "GINConv"])
def test_pyg_message_passing_forward_and_gradients(x64_off, layer, lowering):
    conv = _pyg_layer(layer)
    reference = copy.deepcopy(conv)
    edge_index = torch.tensor([[0, 1, 1, 2, 2, 3, 3, 0], [1, 0, 2, 1, 3, 2, 1, 3]])
    x = torch.randn(4, 4)
    x_t = x.clone().requires_grad_()
    want = reference(x_t, edge_index)
    # Every output counts, differently.
    weights = torch.linspace(-1.0, 1.0, want.numel()).reshape(want.shape)
    want_grads = torch.autograd.grad((want * weights).sum(), [x_t, *reference.parameters()])
    names = [n for n, _ in reference.named_parameters()]

    apply, variables = torchjax.module_to_jax(conv, lowering=lowering)
    xj, ej = jnp.asarray(x.numpy()), jnp.asarray(edge_index.numpy(), jnp.int32)
    wj = jnp.asarray(weights.numpy())

    def loss(params, x):
        return (apply({"params": params, "buffers": variables["buffers"]}, x, ej) * wj).sum()

    _assert_close(jax.jit(apply)(variables, xj, ej), want)
    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], xj)
    _assert_close(g_x, want_grads[0])
    _assert_close([g_params[n] for n in names], want_grads[1:])
    _assert_nontrivial(want_grads[0])
    _assert_nontrivial(g_x)
    if lowering == "xla":
        report = torchjax.lowering_report(apply, variables, xj, ej)
        _assert_export_round_trip(
            lambda v, x: apply(v, x, ej), (variables, xj), want.detach(), report
        )


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


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_gpytorch_eval_mode_prediction_with_debug_off(x64, lowering):
    import gpytorch

    model = _gp_model()
    test_x = torch.linspace(-0.2, 1.2, 7, dtype=torch.float64)
    if lowering == "xla":
        # The kernel asks torch.equal(x1, x2) (is this the training data?), a value read.
        apply, variables = torchjax.module_to_jax(model, lowering="xla")
        with gpytorch.settings.debug(False), _refused(r"gpytorch/kernels/kernel\.py.*torch\.equal"):
            apply(variables, jnp.asarray(test_x.numpy()))
        mean, _ = model(test_x)  # the module still predicts in plain torch
        assert not isinstance(mean, torch._subclasses.fake_tensor.FakeTensor)
        return
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
        # The predictions' gradient in the hyperparameters, against torch autograd.
        reference = copy.deepcopy(model)
        mean, var = reference(test_x)
        names = [n for n, _ in reference.named_parameters()]
        want = torch.autograd.grad(mean.sum() + var.sum(), list(reference.parameters()))
        got = jax.grad(
            lambda p: sum(t.sum() for t in apply({**variables, "params": p}, test_x.numpy()))
        )(variables["params"])
        _assert_close([got[n] for n in names], want, rtol=1e-8, atol=1e-10)
        _assert_nontrivial(want)


# -- botorch: acquisition functions (which turn gpytorch's debug checks off) ----------------
@pytest.mark.parametrize("lowering", LOWERINGS)
def test_botorch_expected_improvement(x64, lowering):
    from botorch.acquisition import ExpectedImprovement
    from botorch.models import SingleTaskGP

    torch.manual_seed(0)
    train_x = torch.rand(10, 2, dtype=torch.float64)
    train_y = train_x.sin().sum(-1, keepdim=True)
    model = SingleTaskGP(train_x, train_y).eval()
    ei = ExpectedImprovement(model, best_f=train_y.max())
    x = torch.rand(5, 1, 2, dtype=torch.float64)
    want = ei(x).detach().numpy()
    if lowering == "xla":  # gpytorch's torch.equal again (as in the test above)
        f = torchjax.to_jax(lambda x: ei(x), lowering="xla")
        with _refused(r"gpytorch/kernels/kernel\.py.*torch\.equal"):
            jax.grad(lambda x: f(x).sum())(jnp.asarray(x.numpy()))
        np.testing.assert_allclose(ei(x).detach().numpy(), want, rtol=1e-10)  # still works
        return
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
    _assert_nontrivial(want_grad, floor=1e-4)  # compared to 1e-12 above
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


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_hf_dynamic_rope_over_calls_of_12_8_12_tokens(lowering):
    # The forward re-registers its inv_freq buffer and sets max_seq_len_cached.
    model = _llama(
        max_position_embeddings=8,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        initializer_range=0.5,  # weights large enough for positions to matter in the logits
    )
    model.eval()
    stateful = copy.deepcopy(model)  # torch, called in sequence, keeps its state
    apply, variables = torchjax.module_to_jax(model, lowering=lowering)
    rng = np.random.RandomState(0)
    seqs = [rng.randint(0, 64, (1, n)) for n in (12, 8, 12)]
    if lowering == "xla":
        # Dynamic RoPE grows its frequencies in a Python branch on the positions' values.
        with _refused(r"transformers/modeling_rope_utils\.py.*seq_len > max_seq_len_cached"):
            apply(variables, jnp.asarray(seqs[0]), use_cache=False, mutable=True)
        return
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


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_hf_gradient_checkpointing_trains_like_torch(x64, lowering):
    import optax

    model = _llama(max_position_embeddings=32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    reference = copy.deepcopy(model)
    apply, variables = torchjax.module_to_jax(model, lowering=lowering)
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
    # Adam divides each gradient by its own size: where that is about eps (1e-8), XLA's
    # rounding of the lowered ops (gradients equal to 1e-7) moves a step of 1e-2 by 1e-5.
    atol = 1e-6 if lowering == "callback" else 5e-5
    for name, p in reference.named_parameters():
        np.testing.assert_allclose(params[name], p.detach().numpy(), rtol=1e-4, atol=atol)
    # Adam's steps are about the learning rate whatever the gradient's size, but only where
    # the gradient is not zero: the parameters moved, as torch's did.
    moved = [np.abs(params[n] - variables["params"][n]).max() for n in params]
    assert min(moved) > 1e-3, moved


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


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("transform", ["eager", "jit", "grad", "vmap", "jacfwd"])
def test_e3nn_modules_through_module_to_jax_equal_e3nn(transform, lowering):
    pytest.importorskip("e3nn")
    model = _e3nn_model()
    reference = copy.deepcopy(model)
    apply, variables = torchjax.module_to_jax(model, lowering=lowering)
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
    if lowering == "xla" and transform == "eager":
        report = torchjax.lowering_report(apply, variables, xs)
        _assert_export_round_trip(jax_fn, (params, xs), want, report)


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


# Validation reads the arguments' values: torch.export stops there.
_PYRO_VALIDATION = r"_pyro_log_prob.*pyro/distributions/distribution\.py"


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_pyro_log_prob_with_validation_under_eager_grad_then_jit(x64_off, lowering):
    pyro = pytest.importorskip("pyro")
    loc, scale, x = jnp.float32(0.3), jnp.float32(1.5), jnp.linspace(-1.0, 1.0, 5)
    value, grads = _pyro_reference(loc, scale, x)
    if lowering == "xla":
        with pyro.validation_enabled(True):
            f = torchjax.to_jax(_pyro_log_prob, lowering="xla")
            with _refused(_PYRO_VALIDATION):
                jax.grad(f, argnums=(0, 1))(loc, scale, x)
            with _refused(_PYRO_VALIDATION):
                jax.jit(f)(loc, scale, x)
        return
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


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_pyro_log_prob_without_validation_under_jit_grad_and_vmap(x64_off, lowering):
    pyro = pytest.importorskip("pyro")
    loc, x = jnp.float32(0.3), jnp.linspace(-1.0, 1.0, 5)
    scales = jnp.array([1.5, 2.0, 0.5], dtype=jnp.float32)
    with pyro.validation_enabled(False):
        f = torchjax.to_jax(_pyro_log_prob, lowering=lowering)
        value, grads = _pyro_reference(loc, scales[0], x)
        np.testing.assert_allclose(jax.jit(f)(loc, scales[0], x), value, rtol=1e-6)
        got = jax.jit(jax.grad(f, argnums=(0, 1)))(loc, scales[0], x)
        np.testing.assert_allclose(got, grads, rtol=1e-5)
        _assert_nontrivial(grads)
        per_example = jax.vmap(jax.grad(f, argnums=1), in_axes=(None, 0, None))(loc, scales, x)
        np.testing.assert_allclose(
            per_example, [_pyro_reference(loc, s, x)[1][1] for s in scales], rtol=1e-5
        )
        if lowering == "xla":
            report = torchjax.lowering_report(f, loc, scales[0], x)
            _assert_export_round_trip(f, (loc, scales[0], x), np.float32(value), report)


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("method", ["torch.func", "sequential"])
def test_pyro_log_prob_with_validation_under_eager_vmap(x64_off, method, lowering):
    pyro = pytest.importorskip("pyro")
    loc, x = jnp.float32(0.3), jnp.linspace(-1.0, 1.0, 5)
    scales = jnp.array([1.5, 2.0, 0.5], dtype=jnp.float32)
    with pyro.validation_enabled(True):
        f = torchjax.to_jax(_pyro_log_prob, vmap_method=method, lowering=lowering)
        if lowering == "xla":
            with _refused(_PYRO_VALIDATION):
                jax.vmap(f, in_axes=(None, 0, None))(loc, scales, x)
            return
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


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("transform", ["eager", "grad", "hessian"])
def test_torchquad_simpson_under_eager_grad_and_hessian(x64_off, transform, lowering):
    pytest.importorskip("torchquad")
    f = torchjax.to_jax(_simpson, lowering=lowering)
    exact = lambda a: (jnp.exp(a) - 1.0) / a  # the integral of exp(a t) over [0, 1]
    wrap = {"eager": lambda g: g, "grad": jax.grad, "hessian": jax.hessian}[transform]
    a = jnp.float32(0.7)
    if lowering == "xla":  # the domain check is a Python branch on its values
        with _refused(r"_simpson.*torchquad/integration/utils\.py"):
            wrap(f)(a)
        return
    np.testing.assert_allclose(wrap(f)(a), wrap(exact)(a), rtol=2e-5)
    if transform == "grad":  # and torch autograd's, through torchquad itself
        a_t = torch.tensor(0.7, requires_grad=True)
        (want,) = torch.autograd.grad(_simpson(a_t), a_t)
        np.testing.assert_allclose(wrap(f)(a), want.item(), rtol=1e-5)
        _assert_nontrivial(want)


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


@pytest.mark.parametrize("reads_a_value", [False, True], ids=["capture succeeds", "capture fails"])
def test_pyro_param_store_keeps_no_fake_tensor_after_a_capture(reads_a_value):
    # lowering="xla": torch.export runs the function on its fake tensors, and pyro.param
    # stores the parameter it makes there. As after the callback path's fake run (above),
    # the capture names the holder it cannot put back, and leaves no fake tensor in use.
    pyro = pytest.importorskip("pyro")
    fn = _pyro_scaled if reads_a_value else (lambda x: x * pyro.param("w", lambda: torch.ones(3)))
    pyro.clear_param_store()
    try:
        f = jax.jit(torchjax.to_jax(fn, lowering="xla"))
        holder = "'_param_to_name' of a ParamStoreDict object, as the key of 'w'"
        with pytest.raises(LoweringError, match=holder) as info:
            f(jnp.ones(3))
        assert ("GuardOnDataDependentSymNode" in str(info.value)) is reads_a_value
        for name, value in pyro.get_param_store().items():
            assert not isinstance(value, torch._subclasses.fake_tensor.FakeTensor), name
        out = fn(torch.ones(3))
        assert not isinstance(out, torch._subclasses.fake_tensor.FakeTensor)
        want = 2.0 if reads_a_value else 1.0
        torch.testing.assert_close(out.detach(), torch.full((3,), want))
        if not reads_a_value:  # filled before the first lowered call: the function's state
            np.testing.assert_allclose(f(jnp.ones(3)), np.full(3, want))
    finally:
        pyro.clear_param_store()


# -- roma: rotations; boolean-mask selections, argmax and gather, float64 inside -----------
def _roma_chain(rotvec, quat):  # [B, 3], [B, 4] -> ([B, 3], [B, 3, 3])
    import roma

    rotmat = roma.rotvec_to_rotmat(rotvec)  # a small-angle branch by torch.where on a mask
    q = roma.rotmat_to_unitquat(rotmat)  # the largest of four candidates: argmax, gather
    q = roma.quat_product(q, roma.quat_normalize(quat))
    return roma.unitquat_to_rotvec(q), roma.unitquat_to_rotmat(q)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_roma_rotation_conversions_forward_gradients_and_export(x64_off, lowering):
    pytest.importorskip("roma")
    torch.manual_seed(0)
    rotvec = torch.randn(4, 3)
    rotvec[0] = 1e-8  # below roma's small-angle threshold: the other side of the mask
    quat = torch.randn(4, 4)
    rotvec_t, quat_t = rotvec.clone().requires_grad_(), quat.clone().requires_grad_()
    want = _roma_chain(rotvec_t, quat_t)
    weights = [torch.linspace(-1.0, 1.0, w.numel()).reshape(w.shape) for w in want]
    loss_t = sum((w * c).sum() for w, c in zip(want, weights, strict=True))
    want_grads = torch.autograd.grad(loss_t, (rotvec_t, quat_t))

    f = torchjax.to_jax(_roma_chain, lowering=lowering)
    args = (jnp.asarray(rotvec.numpy()), jnp.asarray(quat.numpy()))
    cs = [jnp.asarray(c.numpy()) for c in weights]

    def loss(rotvec, quat):
        return sum((o * c).sum() for o, c in zip(f(rotvec, quat), cs, strict=True))

    _assert_close(jax.jit(f)(*args), [w.detach() for w in want], rtol=1e-5, atol=1e-6)
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
    _assert_close(got, want_grads, rtol=1e-4, atol=1e-5)
    _assert_nontrivial(want_grads)
    if lowering == "xla":
        report = torchjax.lowering_report(_roma_chain, *args)
        _assert_export_round_trip(f, args, [w.detach() for w in want], report)


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("x64_mode", [False, True], ids=["x64 off", "x64 on"])
def test_roma_special_procrustes_computes_in_float64(lowering, x64_mode):
    # special_procrustes(M) of float32 matrices computes Horn's eigenvector in float64 and
    # returns float32, with an autograd.Function of its own for the derivative.
    roma = pytest.importorskip("roma")
    torch.manual_seed(0)
    m = torch.randn(3, 3, 3)
    m_t = m.clone().requires_grad_()
    want = roma.special_procrustes(m_t)
    assert want.dtype == torch.float32
    weights = torch.linspace(-1.0, 1.0, want.numel()).reshape(want.shape)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), m_t)
    _assert_nontrivial(want_grad)
    with jax.enable_x64(x64_mode):
        f = torchjax.to_jax(roma.special_procrustes, lowering=lowering)
        mj, wj = jnp.asarray(m.numpy()), jnp.asarray(weights.numpy())
        grad = jax.grad(lambda m: (f(m) * wj).sum())
        if lowering == "callback":
            got = jax.jit(f)(mj)
            assert got.dtype == jnp.float32
            _assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
            _assert_close(jax.jit(grad)(mj), want_grad, rtol=1e-4, atol=1e-5)
            return
        # lowering="xla": with x64 on, torch's numbers; with x64 off, torch's numbers or a
        # LoweringError that names float64 (never float32 arithmetic passed off as float64).
        try:
            got = jax.jit(f)(mj)
        except LoweringError as e:  # the refusal, only with x64 off, and saying float64
            assert not x64_mode and ("float64" in str(e) or "x64" in str(e)), str(e)
        else:
            assert got.dtype == jnp.float32
            _assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        # Its derivative is the autograd.Function's backward, which torch.export drops: a
        # LoweringError that names it (or, with x64 off, the float64 refusal).
        with pytest.raises(LoweringError) as info:
            grad(mj)
        text = str(info.value)
        named = re.search(r'(?s)_HornEigenvector\w*.*lowering="callback"', text)
        assert named or (not x64_mode and ("float64" in text or "x64" in text)), text


# -- zuko: normalizing flows; autoregressive masks, spline bins found by searchsorted ------
def _zuko_log_prob(flow: torch.nn.Module) -> torch.nn.Module:
    class LogProb(torch.nn.Module):  # log p(x | c): [B, 3], [B, 2] -> [B]
        def __init__(self):
            super().__init__()
            self.flow = flow

        def forward(self, x, c):
            return self.flow(c).log_prob(x)

    return LogProb()


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_zuko_neural_spline_flow_log_prob_and_gradients(x64_off, lowering):
    zuko = pytest.importorskip("zuko")
    torch.manual_seed(0)
    flow = zuko.flows.NSF(3, 2, transforms=2, bins=4, hidden_features=(8, 8))
    model = _zuko_log_prob(flow)
    reference = copy.deepcopy(model)
    x, c = torch.randn(4, 3), torch.randn(4, 2)
    x_t = x.clone().requires_grad_()
    want = reference(x_t, c)
    names = [n for n, _ in reference.named_parameters()]
    want_grads = torch.autograd.grad(want.sum(), [x_t, *reference.parameters()])

    apply, variables = torchjax.module_to_jax(model, lowering=lowering)
    xj, cj = jnp.asarray(x.numpy()), jnp.asarray(c.numpy())

    def loss(params, x):  # the masks are boolean buffers: the parameters only
        return apply({"params": params, "buffers": variables["buffers"]}, x, cj).sum()

    _assert_close(jax.jit(apply)(variables, xj, cj), want, rtol=1e-5, atol=1e-5)
    g_params, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], xj)
    _assert_close([g_x, *(g_params[n] for n in names)], want_grads, rtol=1e-4, atol=1e-5)
    _assert_nontrivial(g_x)
    if lowering == "xla":
        report = torchjax.lowering_report(apply, variables, xj, cj)
        _assert_export_round_trip(
            lambda v, x: apply(v, x, cj), (variables, xj), want, report, atol=1e-5
        )


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_zuko_realnvp_coupling_indexes_by_a_boolean_mask(x64_off, lowering):
    # RealNVP's coupling splits x by a boolean mask buffer, x[..., mask]: a shape that
    # depends on the mask's values, which lowering="xla" cannot carry.
    zuko = pytest.importorskip("zuko")
    torch.manual_seed(0)
    model = _zuko_log_prob(zuko.flows.RealNVP(3, 2, transforms=2, hidden_features=(8,)))
    reference = copy.deepcopy(model)
    x, c = torch.randn(4, 3), torch.randn(4, 2)
    x_t = x.clone().requires_grad_()
    want = reference(x_t, c)
    (want_grad,) = torch.autograd.grad(want.sum(), x_t)
    apply, variables = torchjax.module_to_jax(model, lowering=lowering)
    xj, cj = jnp.asarray(x.numpy()), jnp.asarray(c.numpy())
    if lowering == "xla":
        with _refused(r"depends on its inputs' values.*zuko/flows/coupling\.py"):
            apply(variables, xj, cj)
        return
    _assert_close(apply(variables, xj, cj), want, rtol=1e-5, atol=1e-5)
    # A shape that depends on values is not taken from one real run for the next (as for
    # GCNConv's self-loops above): the output types, declared, serve jax.grad.
    declared = jax.ShapeDtypeStruct((4,), jnp.float32)
    apply, variables = torchjax.module_to_jax(model, result_shape_dtypes=declared)
    got = jax.grad(lambda x: apply(variables, x, cj).sum())(xj)
    _assert_close(got, want_grad, rtol=1e-4, atol=1e-5)
    _assert_nontrivial(want_grad)


# -- kornia: image ops; writes into strided slices, hue by boolean masks ------------------
def _kornia_demosaic_to_hls(raw):  # [B, 1, H, W] -> [B, 3, H, W]
    import kornia

    rgb = kornia.color.raw_to_rgb(raw, kornia.color.CFA.BG)  # g[:, :, ::2, 1::2] = ...
    return kornia.color.rgb_to_hls(rgb)  # masked_fill and torch.where on channel masks


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_kornia_demosaic_and_hls_forward_gradients_and_export(x64_off, lowering):
    pytest.importorskip("kornia")
    torch.manual_seed(0)
    raw = torch.rand(2, 1, 6, 8)
    raw_t = raw.clone().requires_grad_()
    want = _kornia_demosaic_to_hls(raw_t)
    weights = torch.linspace(-1.0, 1.0, want.numel()).reshape(want.shape)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), raw_t)
    f = torchjax.to_jax(_kornia_demosaic_to_hls, lowering=lowering)
    rj, wj = jnp.asarray(raw.numpy()), jnp.asarray(weights.numpy())
    _assert_close(jax.jit(f)(rj), want.detach(), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(lambda r: (f(r) * wj).sum()))(rj)
    _assert_close(got, want_grad, rtol=1e-4, atol=1e-4)
    _assert_nontrivial(want_grad)
    if lowering == "xla":
        report = torchjax.lowering_report(_kornia_demosaic_to_hls, rj)
        _assert_export_round_trip(f, (rj,), want.detach(), report, atol=1e-5)


# -- Hugging Face T5: an encoder-decoder, relative position buckets, a padding mask -------
def _t5():
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=32,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config).eval()


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_hf_t5_encoder_decoder_loss_gradients_and_export(x64_off, lowering):
    pytest.importorskip("transformers")
    model = _t5()
    reference = copy.deepcopy(model)
    rng = np.random.RandomState(0)
    ids = rng.randint(3, 32, (2, 7)).astype(np.int32)
    labels = rng.randint(3, 32, (2, 5)).astype(np.int32)  # shifted right in place for the decoder
    mask = np.ones((2, 7), np.int32)
    mask[1, 5:] = 0  # the second sequence is padded
    out = reference(
        input_ids=torch.tensor(ids).long(),
        attention_mask=torch.tensor(mask).long(),
        labels=torch.tensor(labels).long(),
        use_cache=False,
    )
    want = {k: out[k].detach() for k in ("loss", "logits", "encoder_last_hidden_state")}
    names = [n for n, _ in reference.named_parameters()]
    want_grads = torch.autograd.grad(out.loss, list(reference.parameters()))

    apply, variables = torchjax.module_to_jax(model, lowering=lowering)

    def run(params, ids, mask, labels):  # T5's own output (a ModelOutput) as JAX sees it
        v = {"params": params, "buffers": variables["buffers"]}
        return apply(v, input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)

    args = (variables["params"], jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(labels))
    _assert_close(jax.jit(run)(*args), want, rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(lambda p, *a: run(p, *a)["loss"]))(*args)
    assert sorted(grads) == sorted(names)
    _assert_close([grads[n] for n in names], want_grads, rtol=1e-4, atol=1e-6)
    _assert_nontrivial(want_grads)
    if lowering == "xla":
        report = torchjax.lowering_report(
            apply,
            variables,
            input_ids=args[1],
            attention_mask=args[2],
            labels=args[3],
            use_cache=False,
        )
        _assert_export_round_trip(run, args, want, report, atol=1e-5)
