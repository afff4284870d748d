# Shape inference that real models survive (issue #15): only the user's own function is
# ever fake-run (once per signature), derived functions take their types from it, eager
# calls run for real where fakes cannot go, and the user's exceptions stay theirs.
from __future__ import annotations

import copy
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import tree_close
from torch._subclasses.fake_tensor import is_fake

import torchjax
from torchjax.errors import ConversionError, InPlaceMutationError, ShapeInferenceError


def _t(x):
    return torch.tensor(np.asarray(x))


class FakeRuns:
    """Wraps a torch function; counts the calls that received fake tensors."""

    def __init__(self, f):
        self.f, self.fake, self.real = f, 0, 0

    def __call__(self, *args):
        if any(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
            self.fake += 1
        else:
            self.real += 1
        return self.f(*args)


def test_derived_functions_are_never_fake_run():
    f = FakeRuns(lambda x: (torch.tanh(x) * x).sum())
    g = torchjax.to_jax(f)
    x = jnp.linspace(-1.0, 1.0, 4)
    jax.jit(jax.hessian(g)).lower(x)
    jax.jit(jax.vmap(jax.grad(g))).lower(jnp.stack([x, x]))
    jax.jit(jax.jacrev(jax.jacfwd(g))).lower(x)
    # One fake run per signature of the user's own function: [4] and, under vmap's
    # BatchedFunction, still [4] (its types are derived from the unbatched ones).
    assert f.fake == 1
    assert f.real == 0


def test_index_fill_gradient():
    # The fake run of the VJP met aten._unique (DynamicOutputShapeException).
    x, i, v = jnp.ones((4, 2)), jnp.array([0, 2]), jnp.array(3.0)
    fill = torchjax.to_jax(lambda x, i, v: x.index_fill(0, i.long(), v))
    assert float(jax.grad(lambda v: fill(x, i, v).sum())(v)) == 4.0
    assert float(jax.jit(jax.grad(lambda v: fill(x, i, v).sum()))(v)) == 4.0
    put = torchjax.to_jax(lambda x, v: x.index_put((torch.tensor([0, 2]),), v))
    tree_close(jax.grad(lambda v: put(x, v).sum())(jnp.ones(2)), [2.0, 2.0])


def test_layer_norm_gradient_with_respect_to_some_inputs():
    # torch's fake-tensor bug (FakeTensorDeviceMismatchError) in torch.func.jvp.
    def f(x, w):
        return F.layer_norm(x, (4,), weight=w).tanh().sum()

    x, w = jnp.linspace(-1, 1, 8).reshape(2, 4), jnp.linspace(0.5, 1.5, 4)
    expected = torch.func.grad(f)(_t(x), _t(w))
    tree_close(jax.grad(torchjax.to_jax(f))(x, w), expected)
    tree_close(jax.jit(jax.grad(torchjax.to_jax(f)))(x, w), expected)


def test_autograd_grad_method_with_fused_attention():
    def f(q):
        return F.scaled_dot_product_attention(q, q, q).sum()

    q = jnp.linspace(-1, 1, 48).reshape(2, 2, 3, 4)
    g = torchjax.to_jax(f, grad_method="autograd")
    tree_close(jax.grad(g)(q), torch.func.grad(f)(_t(q)))
    tree_close(jax.jit(jax.grad(g))(q), torch.func.grad(f)(_t(q)))


def test_torch_compile_function_in_every_transform():
    compiled = torch.compile(lambda x: torch.sin(x).sum())
    f = torchjax.to_jax(compiled)
    x = jnp.ones((3, 3))
    tree_close(f(x), 9 * np.sin(1.0))
    tree_close(jax.jit(f)(x), 9 * np.sin(1.0))
    tree_close(jax.vmap(f)(jnp.ones((2, 3, 3))), [9 * np.sin(1.0)] * 2)
    tree_close(jax.grad(f)(x), np.cos(np.ones((3, 3))))
    tree_close(jax.jit(jax.grad(f))(x), np.cos(np.ones((3, 3))))


def test_torch_compile_module():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    f = torchjax.to_jax(torch.compile(lin))
    x = jnp.ones((4, 3))
    expected = lin(torch.ones(4, 3)).detach()
    tree_close(f(x), expected)
    tree_close(jax.jit(f)(x), expected)
    tree_close(jax.vmap(f)(x[:, None]), expected[:, None])


def test_eager_call_runs_for_real_where_fakes_cannot():
    def logp(x):  # validate_args reads values, which a fake run may not
        return torch.distributions.Normal(torch.zeros(3), torch.ones(3)).log_prob(x).sum()

    x = jnp.array([0.1, -0.4, 2.0])
    tree_close(torchjax.to_jax(logp)(x), logp(_t(x)))

    f = FakeRuns(lambda x: x[x > 0] * 2)  # the output's shape depends on the values
    g = torchjax.to_jax(f)
    tree_close(g(x), [0.2, 4.0])
    tree_close(g(-x), [0.8])
    assert (f.fake, f.real) == (0, 2)  # eager calls have data: never a fake run
    with pytest.raises(ShapeInferenceError, match="(?s)DynamicOutputShape.*result_shape_dtypes"):
        jax.jit(g)(x)


def test_real_run_fallback_never_writes_into_the_caller_arrays():
    def sneaky(x):
        y = x[x > 0]  # data-dependent shape: no fake run can find it
        x.add_(1)
        return y

    x = jnp.array([1.0, -2.0, 3.0])
    with pytest.raises(InPlaceMutationError, match=r"args\[0\]"):
        torchjax.to_jax(sneaky)(x)
    np.testing.assert_array_equal(x, [1.0, -2.0, 3.0])


def test_inference_mode():
    f = torchjax.to_jax(lambda x: x * 2)
    with torch.inference_mode():
        out = f(jnp.ones(3))
        grad = jax.grad(lambda x: f(x).sum())(jnp.ones(3))
    tree_close(out, 2 * np.ones(3))
    tree_close(grad, 2 * np.ones(3))


def _raise_value_error(x):
    raise ValueError("bad input: negative scale")


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: f,
        jax.vmap,
        jax.grad,
        lambda f: lambda x: jax.jvp(f, (x,), (x,)),
        jax.hessian,
    ],
    ids=["eager", "vmap", "grad", "jvp", "hessian"],
)
def test_user_exception_stays_theirs_in_every_transform(transform):
    f = torchjax.to_jax(_raise_value_error)
    x = jnp.ones(3) if transform is not jax.vmap else jnp.ones((2, 3))
    with pytest.raises(ValueError, match="bad input: negative scale") as info:
        transform(f)(x)
    assert any("_raise_value_error" in note for note in info.value.__notes__)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: torchjax.to_jax(lambda x, y: x + y)(jnp.ones(3)), TypeError, "missing 1"),
        (
            lambda: torchjax.to_jax(lambda x, y: x @ y)(jnp.ones(3), jnp.ones(4)),
            RuntimeError,
            "inconsistent tensor size",  # torch's own message
        ),
        (lambda: torchjax.to_jax(torch.sin)([jnp.ones(3)]), TypeError, "must be Tensor"),
    ],
    ids=["arity", "shapes", "list"],
)
def test_deterministic_user_errors_are_not_blamed_on_shape_inference(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert not isinstance(info.value, ShapeInferenceError)


def test_user_exception_under_vmap_is_not_a_vmap_error():
    def check(x):
        if x.shape[-1] > 2:  # validation on shapes: the same under vmap
            raise ValueError("at most 2 features")
        return x

    f = torchjax.to_jax(check, result_shape_dtypes=lambda x: x)
    with pytest.raises(ValueError, match="at most 2 features"):
        jax.vmap(f)(jnp.ones((2, 3)))


def test_wrapped_function_calling_another_eagerly_inside_its_torch_code():
    inner = torchjax.to_jax(lambda x: x + 1)
    c = jnp.ones(2)

    def outer(x):
        return x * torchjax.tree_to_torch(inner(c)).sum()

    result = {}
    t = threading.Thread(target=lambda: result.setdefault("v", torchjax.to_jax(outer)(jnp.ones(3))))
    t.start()
    t.join(60)
    assert not t.is_alive(), "reentrant fake run deadlocked"
    tree_close(result["v"], 4 * np.ones(3))


def test_fake_tensor_handed_to_tree_to_jax_is_a_conversion_error():
    def leaks(x):
        torchjax.tree_to_jax({"a": x})
        return x * 1

    with pytest.raises(ConversionError, match=r"tree\['a'\] is a fake tensor"):
        jax.jit(torchjax.to_jax(leaks))(jnp.ones(3))
    with pytest.raises(ConversionError, match="meta tensor"):
        torchjax.tree_to_jax(torch.empty(2, device="meta"))


def _hf_grads_match(model, ids, **kwargs):
    apply, variables = torchjax.module_to_jax(model)

    def loss(params, ids):
        out = apply({"params": params, "buffers": variables["buffers"]}, ids, **kwargs)
        return jnp.mean(out[0] ** 2)

    grads = jax.jit(jax.grad(loss))(variables["params"], ids)
    model.zero_grad()
    out = model(_t(ids), **kwargs)
    out[0].pow(2).mean().backward()
    checked = 0
    for name, p in model.named_parameters():
        if p.grad is not None and name in grads:
            tree_close(grads[name], p.grad, atol=1e-6)
            checked += 1
    assert checked > 10


def test_gpt2_tiny_config_gradients_match_torch():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    _hf_grads_match(model, jnp.array([[1, 5, 7, 9]]), return_dict=False, use_cache=False)


def test_bert_tiny_config_gradients_match_torch():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=100,
    )
    model = transformers.BertModel(cfg).eval()
    _hf_grads_match(model, jnp.array([[1, 5, 7, 9]]), return_dict=False)


def test_unallocated_fake_data_is_a_shape_inference_error_under_jit():
    # tensor_split with tensor indices reads them: a fake run meets "data is not allocated".
    f = torchjax.to_jax(lambda x, i: torch.tensor_split(x, i.long()))
    x, i = jnp.arange(5.0), jnp.array([1, 3])
    assert [o.shape for o in f(x, i)] == [(1,), (2,), (2,)]  # eagerly: a real run
    with pytest.raises(ShapeInferenceError, match="not allocated"):
        jax.jit(f)(x, i)


def _lazy_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.Tanh())


def test_lazy_module_is_refused_before_a_fake_run_and_left_lazy():
    # A fake run would initialize the lazy parameters without data, and the module's class
    # and parameters change in place: the user's module would be broken for plain torch too.
    net = _lazy_net()
    f = torchjax.to_jax(lambda x: net(x))
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    for transform in (jax.jit, lambda g: jax.grad(lambda x: g(x).sum())):
        with pytest.raises(
            ShapeInferenceError, match="calls a LazyLinear whose parameters are not"
        ):
            transform(f)(x)
        assert type(net[0]) is torch.nn.LazyLinear and net[0].has_uninitialized_params()
    want = net(torch.from_numpy(np.asarray(x)))  # the module still works in torch
    np.testing.assert_allclose(jax.jit(f)(x), want.detach().numpy(), rtol=1e-6)


@pytest.mark.parametrize("first", ["eager", "result_shape_dtypes"])
def test_lazy_module_under_jit_after_either_fix_the_error_names(first):
    net = _lazy_net()
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    if first == "eager":
        f = torchjax.to_jax(lambda x: net(x))
        f(x)  # initializes the module, for real
    else:
        f = torchjax.to_jax(
            lambda x: net(x), result_shape_dtypes=jax.ShapeDtypeStruct((2, 3), x.dtype)
        )
    got = jax.jit(f)(x)
    assert type(net[0]) is torch.nn.Linear and not is_fake(net[0].weight)
    want = net(torch.from_numpy(np.asarray(x)))
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-6)
    grads = jax.grad(lambda x: jax.jit(f)(x).sum())(x)
    t = torch.from_numpy(np.asarray(x)).requires_grad_()
    (want_grad,) = torch.autograd.grad(net(t).sum(), t)
    np.testing.assert_allclose(grads, want_grad.numpy(), rtol=1e-5)


def test_a_lazy_module_the_function_does_not_call_stays_lazy_and_is_no_obstacle():
    heads = {"used": torch.nn.Linear(4, 3), "unused": torch.nn.LazyLinear(5)}
    f = jax.jit(torchjax.to_jax(lambda x: heads["used"](x)))
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    want = heads["used"](torch.from_numpy(np.asarray(x))).detach().numpy()
    np.testing.assert_allclose(f(x), want, rtol=1e-6)
    assert type(heads["unused"]) is torch.nn.LazyLinear
    assert heads["unused"].has_uninitialized_params()


# -- eager transforms of code that reads values (issue 45): real data is at hand -----------
def _log_prob(mu, x):  # torch.distributions validates its arguments by reading values
    normal = torch.distributions.Normal(mu, torch.ones_like(mu), validate_args=True)
    return normal.log_prob(x).sum()


_MU, _X = np.array([0.5, -0.2, 1.5], np.float32), np.array([1.0, 2.0, -0.5], np.float32)


def _torch_grads():
    mu, x = torch.tensor(_MU, requires_grad=True), torch.tensor(_X, requires_grad=True)
    value = _log_prob(mu, x)
    return value.detach().numpy(), [g.numpy() for g in torch.autograd.grad(value, (mu, x))]


@pytest.mark.parametrize("transform", ["grad", "value_and_grad", "vjp", "jvp"])
def test_eager_transforms_of_value_reading_code_need_no_declared_types(transform):
    f = torchjax.to_jax(_log_prob)  # no eager call first, no result_shape_dtypes
    value, (g_mu, g_x) = _torch_grads()
    if transform == "grad":
        got = jax.grad(f, argnums=(0, 1))(_MU, _X)
        np.testing.assert_allclose(got[0], g_mu, rtol=1e-6)
        np.testing.assert_allclose(got[1], g_x, rtol=1e-6)
    elif transform == "value_and_grad":
        v, got = jax.value_and_grad(f)(_MU, _X)
        np.testing.assert_allclose(v, value, rtol=1e-6)
        np.testing.assert_allclose(got, g_mu, rtol=1e-6)
    elif transform == "vjp":
        v, pullback = jax.vjp(f, _MU, _X)
        got = pullback(jnp.float32(2.0))
        np.testing.assert_allclose(v, value, rtol=1e-6)
        np.testing.assert_allclose(got[0], 2 * g_mu, rtol=1e-6)
    else:
        t = np.array([1.0, -1.0, 0.5], np.float32)
        v, tangent = jax.jvp(lambda m: f(m, _X), (_MU,), (t,))
        np.testing.assert_allclose(v, value, rtol=1e-6)
        np.testing.assert_allclose(tangent, g_mu @ t, rtol=1e-6)


def test_jit_after_an_eager_transform_takes_the_types_of_the_real_run():
    f = torchjax.to_jax(_log_prob)
    with pytest.raises(ShapeInferenceError, match="result_shape_dtypes"):
        jax.jit(f)(_MU, _X)  # nothing has run for real yet: the fake run cannot read values
    jax.grad(f)(_MU, _X)
    _, (g_mu, _) = _torch_grads()
    np.testing.assert_allclose(jax.jit(jax.grad(f))(_MU, _X), g_mu, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(_MU, _X), _torch_grads()[0], rtol=1e-6)


# -- int32 inputs with x64 off reach torch as int64 (cross_entropy targets, labels=) -------
def test_bert_with_int32_labels_trains_like_torch_with_x64_off():
    import optax

    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=100,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForSequenceClassification(cfg).train()
    reference = copy.deepcopy(model)
    apply, variables = torchjax.module_to_jax(model)
    ids = jnp.array([[1, 5, 7, 9], [3, 2, 8, 0]], jnp.int32)
    labels = jnp.array([2, 0], jnp.int32)
    assert ids.dtype == labels.dtype == jnp.int32  # x64 off: JAX's integers
    opt = optax.sgd(0.1)

    @jax.jit
    def step(params, state):
        def loss(p):
            out = apply({"params": p, "buffers": variables["buffers"]}, ids, labels=labels)
            return out["loss"]

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    params, state = variables["params"], opt.init(variables["params"])
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        params, state, value = step(params, state)
        torch_opt.zero_grad()
        want = reference(_t(ids).long(), labels=_t(labels).long()).loss
        want.backward()
        torch_opt.step()
        tree_close(value, want.detach(), rtol=1e-5, atol=1e-6)
    for name, p in reference.named_parameters():
        tree_close(params[name], p.detach(), rtol=1e-4, atol=1e-5)


_CACHED = {"basis": torch.linspace(0.0, 1.0, 4)}


def _copies_a_cached_tensor(x):
    # As torch-harmonics does with its cached quadrature weights.
    basis = copy.deepcopy(_CACHED["basis"])
    return x * basis


def test_a_deep_copy_of_a_real_tensor_in_a_fake_run_asks_for_declared_types():
    f = torchjax.to_jax(_copies_a_cached_tensor)
    x = jnp.arange(4.0)
    with pytest.raises(ShapeInferenceError, match="result_shape_dtypes") as info:
        jax.jit(f)(x)
    assert 'device "meta"' in str(info.value)  # torch's refusal, quoted
    declared = torchjax.to_jax(_copies_a_cached_tensor, result_shape_dtypes=lambda x: x)
    want = _copies_a_cached_tensor(torch.arange(4.0)).numpy()
    np.testing.assert_allclose(jax.jit(declared)(x), want)
    np.testing.assert_allclose(f(x), want)  # eagerly: a real run


@pytest.mark.parametrize("declared", [False, True], ids=["inferred", "declared"])
def test_symbolic_dimensions_get_torchjaxs_own_error_naming_the_fix(declared):
    from jax import export

    fn = lambda x: torch.tanh(x) * 2
    f = torchjax.to_jax(fn, result_shape_dtypes=(lambda x: x) if declared else None)
    (b,) = export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, 3), jnp.float32)
    for attempt in (lambda: jax.eval_shape(f, spec), lambda: export.export(jax.jit(f))(spec)):
        with pytest.raises(ShapeInferenceError) as info:
            attempt()
        text = str(info.value)
        assert "args[0] of shape (b, 3): a symbolic dimension" in text
        assert "Use concrete shapes" in text
    # What it advises: a concrete shape.
    got = jax.eval_shape(f, jax.ShapeDtypeStruct((8, 3), jnp.float32))
    assert (got.shape, got.dtype) == ((8, 3), jnp.float32)


# -- a plain eager call's types serve a later jit of its signature (issue 57) --------------
def _default_log_prob(mu, x):  # validate_args by default: reads mu's and x's values
    return torch.distributions.Normal(mu, torch.ones_like(mu)).log_prob(x).sum()


@pytest.fixture
def default_validation():
    """torch.distributions' default, validation on, as in a fresh process: torch.compile
    (an earlier test's) turns it off for the whole process."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    yield
    torch.distributions.Distribution.set_default_validate_args(before)


@pytest.mark.usefixtures("default_validation")
def test_jit_after_a_plain_eager_call_takes_the_types_of_its_real_run():
    f = torchjax.to_jax(_default_log_prob)
    eager = f(jnp.zeros(5), jnp.linspace(-1, 1, 5))  # a plain eager call: a real run
    tree_close(eager, _default_log_prob(torch.zeros(5), torch.linspace(-1, 1, 5)))
    # Another value of the same signature under jit: the eager call's types serve, though
    # jnp.full's array carries a weak type that jnp.zeros' lacks (torch sees float32 both).
    mu, x = jnp.full(5, 0.3), jnp.linspace(-2, 2, 5)
    assert jax.typeof(mu).weak_type and not jax.typeof(jnp.zeros(5)).weak_type
    want = torch.distributions.Normal(_t(mu), torch.ones(5)).log_prob(_t(x)).sum()
    tree_close(jax.jit(f)(mu, x), want)
    tree_close(jax.jit(f)(jnp.zeros(5) + 0.3, x), want)  # without the weak type too
    # and derived functions under jit, whose types follow from the function's
    mu_t = _t(mu).requires_grad_()
    (want_grad,) = torch.autograd.grad(
        torch.distributions.Normal(mu_t, torch.ones(5)).log_prob(_t(x)).sum(), mu_t
    )
    tree_close(jax.jit(jax.grad(f))(mu, x), want_grad)


@pytest.mark.usefixtures("default_validation")
def test_jit_of_another_shape_than_the_eager_call_still_asks_for_declared_types():
    f = torchjax.to_jax(_default_log_prob)
    f(jnp.zeros(5), jnp.linspace(-1, 1, 5))
    with pytest.raises(ShapeInferenceError) as info:
        jax.jit(f)(jnp.full(4, 0.3), jnp.linspace(-2, 2, 4))  # a shape no real run had
    text = str(info.value)
    assert "It read a value at torch/distributions/distribution.py" in text
    assert "call the function once eagerly" in text and "result_shape_dtypes" in text
    f(jnp.zeros(4), jnp.linspace(-1, 1, 4))  # the fix it names: an eager call of that shape
    want = torch.distributions.Normal(torch.full((4,), 0.3), torch.ones(4)).log_prob(
        torch.linspace(-2, 2, 4)
    )
    tree_close(jax.jit(f)(jnp.full(4, 0.3), jnp.linspace(-2, 2, 4)), want.sum())
