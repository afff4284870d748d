"""Errors that name the fix (issue #25): each provoked as a user meets it, its message
checked for what went wrong, where (the argument path) and how to fix it; where the advice
is code, the advice is run and must work.
"""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import tree_close
from torch.utils.checkpoint import checkpoint

import torchjax
from torchjax.errors import (
    ArgumentError,
    AutodiffError,
    OutputMismatchError,
    ShapeInferenceError,
    TorchJaxError,
)

pytestmark = pytest.mark.core


def _batch_norm_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).eval()


@pytest.mark.parametrize("grad_method", ["torch.func", "autograd"])
def test_differentiated_batch_norm_buffers_are_named_with_the_fix(grad_method):
    model = _batch_norm_model()
    apply, variables = torchjax.module_to_jax(model, grad_method=grad_method)
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    # Every float leaf differentiated, as equinox's filter_grad would (the int counter aside).
    loss = lambda v: apply(v, x).sum()
    with pytest.raises(AutodiffError) as info:
        jax.grad(loss, allow_int=True)(variables)
    text = str(info.value)
    assert "variables['buffers']['1.running_mean']" in text  # where
    assert "not differentiable with respect to argument 'running_mean'" in text  # what
    assert "stop_gradient" in text and "variables['params'] only" in text  # the fix
    assert "grad_method" not in text  # the other grad_method fails the same way: not advised
    # The fix it shows works, and agrees with torch.
    params = variables["params"]
    grads = jax.grad(lambda p: apply({"params": p, "buffers": variables["buffers"]}, x).sum())(
        params
    )
    xt = torch.linspace(-1.0, 1.0, 12).reshape(4, 3)
    model(xt).sum().backward()
    tree_close(grads["0.weight"], model[0].weight.grad)


def test_traced_python_bool_is_named_with_static_argnames():
    f = torchjax.to_jax(lambda x, negate: -x if negate else x)
    with pytest.raises(ShapeInferenceError) as info:
        jax.jit(f)(jnp.ones(2), True)
    text = str(info.value)
    assert "args[1]: a boolean the function may branch on arrived as an array" in text
    assert "static_argnames" in text and "functools.partial" in text
    # The advice works:
    tree_close(jax.jit(f, static_argnums=1)(jnp.ones(2), True), -jnp.ones(2))
    tree_close(jax.jit(functools.partial(f, negate=True))(jnp.ones(2)), -jnp.ones(2))


def test_traced_python_int_used_as_a_size_is_named_with_static_argnums():
    f = torchjax.to_jax(lambda x, n: x.repeat(n))
    x = jnp.array([1.0, 2.0])
    with pytest.raises(ShapeInferenceError) as info:
        jax.jit(f)(x, 3)
    text = str(info.value)
    assert "args[1]: a Python int the function may use as a size" in text
    assert "static_argnums" in text
    # An int array is not a Python number: no such advice for it.
    with pytest.raises(ShapeInferenceError) as info:
        jax.jit(f)(x, jnp.array(3, dtype=jnp.int32))
    assert "Python int" not in str(info.value)
    # The advice works:
    want = torch.tensor([1.0, 2.0]).repeat(3).numpy()
    tree_close(jax.jit(f, static_argnums=1)(x, 3), want)
    tree_close(jax.jit(functools.partial(f, n=3))(x), want)


def test_traced_bool_keyword_of_a_transformers_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    apply, variables = torchjax.module_to_jax(transformers.GPT2LMHeadModel(cfg).eval())
    ids = jnp.array([[1, 2, 3, 4]])
    with pytest.raises(ShapeInferenceError) as info:
        jax.jit(apply)(variables, ids, use_cache=False, return_dict=False)
    text = str(info.value)
    assert "kwargs['use_cache']" in text and "kwargs['return_dict']" in text
    assert 'static_argnames=("use_cache", "return_dict")' in text
    jitted = jax.jit(apply, static_argnames=("use_cache", "return_dict"))
    out = jitted(variables, ids, use_cache=False, return_dict=False)
    assert out[0].shape == (1, 4, 32)


def test_script_module_is_refused_with_the_wrapping_that_works():
    linear = torch.nn.Linear(2, 3)
    scripted = torch.jit.script(linear)
    with pytest.raises(
        ArgumentError, match=r"module_to_jax\(Linear\): it is a TorchScript module"
    ) as e:
        torchjax.module_to_jax(scripted)
    assert "torchjax.to_jax(lambda x: scripted(x))" in str(e.value)
    f = torchjax.to_jax(lambda x: scripted(x))
    x = jnp.ones((4, 2))
    tree_close(jax.jit(f)(x), linear(torch.ones(4, 2)))
    tree_close(jax.jit(jax.grad(lambda x: f(x).sum()))(x), linear.weight.sum(0).expand(4, 2))


def test_lazy_module_is_refused_saying_to_call_it_first():
    net = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.Tanh())
    with pytest.raises(
        ArgumentError, match=r"(?s)its parameter '0.weight' is not initialized.*module\(example"
    ):
        torchjax.module_to_jax(net)
    x = torch.ones(4, 2)
    net(x)  # what the message says: then it converts, and computes what torch does
    apply, variables = torchjax.module_to_jax(net)
    tree_close(apply(variables, jnp.ones((4, 2))), net(x))


def test_a_forward_writing_its_own_parameter_gets_the_parameter_advice():
    torch.manual_seed(0)
    with_max_norm = torch.nn.Embedding(6, 3, max_norm=1.0)
    weight = with_max_norm.weight.detach().clone()
    ids = torch.tensor([1, 4, 4])
    apply, variables = torchjax.module_to_jax(with_max_norm)
    with pytest.raises(torchjax.errors.InPlaceMutationError) as info:
        apply(variables, jnp.asarray(ids.numpy()))
    text = str(info.value)
    assert "variables['params']['weight']" in text  # where
    assert "parameters are inputs of each call" in text and "without max_norm" in text
    assert "x = x.clone()" not in text  # an input's advice, which a parameter cannot take
    np.testing.assert_array_equal(variables["params"]["weight"], weight.numpy())  # unchanged
    # The advice: the Embedding without max_norm, the rows' norms limited in JAX.
    apply, variables = torchjax.module_to_jax(torch.nn.Embedding(6, 3))
    norms = jnp.linalg.norm(weight.numpy(), axis=1, keepdims=True)
    limited = jnp.where(norms > 1.0, weight.numpy() / (norms + 1e-7), weight.numpy())
    got = apply({"params": {"weight": limited}, "buffers": {}}, jnp.asarray(ids.numpy()))
    tree_close(got, with_max_norm(ids), rtol=1e-6)


def _padded_encoder(nested: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()

    class Padded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def forward(self, x, mask):
            return self.encoder(x, src_key_padding_mask=mask)

    return Padded()


def test_the_nested_tensor_fast_path_names_its_fix():
    x = torch.linspace(-1.0, 1.0, 80).reshape(2, 5, 8)
    mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    apply, variables = torchjax.module_to_jax(_padded_encoder(nested=True))
    with pytest.raises(ShapeInferenceError) as info:
        jax.jit(apply)(variables, jnp.asarray(x.numpy()), jnp.asarray(mask.numpy()))
    text = str(info.value)
    assert "stopped in TransformerEncoder.forward" in text  # where
    assert "enable_nested_tensor=False" in text  # the fix
    assert "module_to_jax(module, result_shape_dtypes=" in text  # the other, as spelt here
    model = _padded_encoder(nested=False)  # what it advises
    apply, variables = torchjax.module_to_jax(model)
    got = jax.jit(apply)(variables, jnp.asarray(x.numpy()), jnp.asarray(mask.numpy()))
    with torch.no_grad():
        tree_close(got, model(x, mask), rtol=1e-5, atol=1e-6)


def test_a_value_read_in_a_submodule_names_the_submodule():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3, momentum=None))
    apply, variables = torchjax.module_to_jax(model)  # momentum=None reads a counter's value
    with pytest.raises(ShapeInferenceError, match=r"stopped in BatchNorm1d\.forward \(batchnorm"):
        jax.jit(apply)(variables, jnp.ones((4, 3)))


def test_scripted_submodule_is_accepted_where_a_scripted_top_is_refused():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.jit.script(torch.nn.Linear(2, 2))
            self.norm = torch.nn.LayerNorm(2)

        def forward(self, x):
            return self.norm(self.inner(x))

    model = Outer()
    # As torch.func.functional_call: a TorchScript submodule gets the call's tensors
    # (issue 57; tests/test_torchscript_reached.py), the top-level refusal names this wrapping.
    apply, variables = torchjax.module_to_jax(model)
    tree_close(jax.jit(apply)(variables, jnp.ones((4, 2))), model(torch.ones(4, 2)))
    f = torchjax.to_jax(lambda x: model(x))
    tree_close(jax.jit(f)(jnp.ones((4, 2))), model(torch.ones(4, 2)))


_Pair = collections.namedtuple("_Pair", "a b")


def test_namedtuple_class_made_per_call_is_explained():
    def fresh_class(x):
        Pair = collections.namedtuple("Pair", "a b")  # a new class on every call
        return Pair(x, x * 2)

    f = torchjax.to_jax(fresh_class)
    # Under jit the real call's class differs from the fake run's: the error says why.
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"(?s)print alike.*\(Pair, two class objects of one name\).*Define it once",
    ):
        jax.jit(f)(jnp.ones(2)).a.block_until_ready()
    defined_once = torchjax.to_jax(lambda x: _Pair(x, x * 2))  # the fix
    tree_close(jax.jit(defined_once)(jnp.ones(2)), _Pair(jnp.ones(2), 2 * jnp.ones(2)))


def test_declared_structure_mismatch_prints_both_trees():
    declared = [jax.ShapeDtypeStruct((2,), jnp.float32)] * 2  # a list; the function: a tuple
    f = torchjax.to_jax(lambda x: (x, x), result_shape_dtypes=declared)
    with pytest.raises(
        OutputMismatchError,
        match=r"structure PyTreeDef\(\(\*, \*\)\), but PyTreeDef\(\[\*, \*\]\) was declared",
    ):
        f(jnp.ones(2))


@pytest.mark.parametrize(
    "arg, where",
    [
        (2.0, r"args\[0\]"),
        ([1.0, 2.0], r"args\[0\]\[0\], args\[0\]\[1\]"),
        ({"a": 1.0}, r"args\[0\]\['a'\]"),
    ],
    ids=["float", "list", "dict"],
)
def test_python_values_where_a_tensor_is_expected_get_a_note(arg, where):
    f = torchjax.to_jax(lambda x: torch.sin(x))
    with pytest.raises(TypeError, match="must be Tensor") as info:  # torch's own error
        f(arg)
    assert not isinstance(info.value, TorchJaxError)  # it stays the user's
    notes = "\n".join(info.value.__notes__)
    assert re.search(where + " reached the function as Python numbers", notes), notes
    assert "jnp.asarray(values)" in notes
    values = arg["a"] if isinstance(arg, dict) else arg
    tree_close(f(jnp.asarray(values)), np.sin(np.asarray(values, np.float32)))  # the fix


INT64_OPS = {
    "take": (lambda x, i: torch.take(x, i), lambda x, i: jnp.take(x, i)),
    "nll_loss": (
        lambda x, i: torch.nn.functional.nll_loss(x.reshape(2, 3), i),
        lambda x, i: -jnp.mean(x.reshape(2, 3)[jnp.arange(2), i]),
    ),
}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("op", sorted(INT64_OPS))
def test_int32_indices_with_x64_off_reach_torch_as_int64(op, jit, x64_off):
    fn, ref = INT64_OPS[op]
    f = torchjax.to_jax(fn)
    x, i = jnp.linspace(0.0, 1.0, 6), jnp.array([0, 1])
    assert i.dtype == jnp.int32
    tree_close((jax.jit(f) if jit else f)(x, i), ref(x, i))
    grad = jax.grad(lambda x: f(x, i).sum())
    tree_close((jax.jit(grad) if jit else grad)(x), jax.grad(lambda x: ref(x, i).sum())(x))


@pytest.mark.parametrize("jit", [False, True])
def test_int32_pivots_stay_int32_for_the_ops_that_want_them(jit, x64_off):
    # lu_solve refuses the int64 copy: the call runs again on the int32 pivots themselves.
    a = np.array([[4.0, 1.0], [2.0, 3.0]], np.float32)
    lu, pivots = torch.linalg.lu_factor(torch.tensor(a))
    f = torchjax.to_jax(lambda lu, p, b: torch.linalg.lu_solve(lu, p, b))
    b = jnp.array([[1.0], [2.0]])
    p = jnp.asarray(pivots.numpy())
    assert p.dtype == jnp.int32
    got = (jax.jit(f) if jit else f)(jnp.asarray(lu.numpy()), p, b)
    tree_close(got, np.linalg.solve(a, np.asarray(b)), rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("op", sorted(INT64_OPS))
def test_int32_indices_without_widening_get_the_x64_note(op, jit, x64_off, monkeypatch):
    monkeypatch.setattr(torchjax._x64, "WIDEN_INT32", False)  # TORCHJAX_WIDEN_INT32=0
    fn, ref = INT64_OPS[op]
    f = torchjax.to_jax(fn)
    x, i = jnp.linspace(0.0, 1.0, 6), jnp.array([0, 1])
    # Under jit, from the fake run (take checks dtypes there) or from XLA's host callback
    # (nll_loss): JaxRuntimeError, a RuntimeError too.
    with pytest.raises(RuntimeError) as info:
        out = (jax.jit(f) if jit else f)(x, i)
        out.block_until_ready()
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert "x64 mode is off" in text and "index.long()" in text and "jax_enable_x64" in text
    assert "TORCHJAX_WIDEN_INT32" in text
    # The fix it names works:
    fixed = torchjax.to_jax(lambda x, i: fn(x, i.long()))
    tree_close((jax.jit(fixed) if jit else fixed)(x, i), ref(x, i))


@torch.library.custom_op("torchjax_advice::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_custom_op_without_fake_kernel_names_register_fake():
    f = torchjax.to_jax(_doubled)
    with pytest.raises(ShapeInferenceError) as info:
        jax.jit(f)(jnp.ones(3))
    text = str(info.value)
    assert "torchjax_advice::doubled is a custom operator without a fake kernel" in text
    assert '@torch.library.register_fake("torchjax_advice::doubled")' in text
    assert "result_shape_dtypes" in text
    tree_close(f(jnp.ones(3)), 2 * jnp.ones(3))  # eagerly it runs for real
    declared = torchjax.to_jax(
        _doubled, result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32)
    )
    tree_close(jax.jit(declared)(jnp.ones(3)), 2 * jnp.ones(3))  # the second fix works


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torchjax.to_jax(3), r"to_jax expects a callable .* got int"),
        (
            lambda: torchjax.to_jax(torch.sin, grad_method="magic"),
            r"grad_method='magic' is not one of",
        ),
        (lambda: torchjax.to_jax(torch.sin, vmap_randomness="maybe"), r"vmap_randomness='maybe'"),
        (lambda: torchjax.module_to_jax(lambda x: x), r"module_to_jax expects a torch.nn.Module"),
        (lambda: torchjax.to_torch(jnp.ones(2)), r"got a jax.Array"),
        (
            lambda: torchjax.to_torch_module(lambda p, x: x, {"a.b": jnp.ones(2)}),
            r"params has the key 'a.b'",
        ),
    ],
    ids=["not-callable", "grad_method", "vmap_randomness", "not-a-module", "to_torch-array", "key"],
)
def test_bad_arguments_raise_argument_error(make, match):
    with pytest.raises(ArgumentError, match=match) as info:
        make()
    assert isinstance(info.value, TorchJaxError)
    assert isinstance(info.value, TypeError | ValueError)  # the builtin kinds still catch


# -- torch.utils.checkpoint ----------------------------------------------------------------
def _sin_squared_checkpointed(x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda y: torch.sin(y) ** 2, x, use_reentrant=False).sum()


def test_hessian_through_checkpoint_names_grad_method_autograd():
    # torch.func refuses the saved-tensor hooks that non-reentrant checkpoint installs.
    x = jnp.array([0.3, 0.7, -1.2])
    with pytest.raises(AutodiffError, match="saved-tensor hooks") as info:
        jax.hessian(torchjax.to_jax(_sin_squared_checkpointed))(x)
    assert "grad_method='autograd'" in str(info.value)
    # The fix it names works, and agrees with torch.autograd's own Hessian:
    got = jax.hessian(torchjax.to_jax(_sin_squared_checkpointed, grad_method="autograd"))(x)
    want = torch.autograd.functional.hessian(_sin_squared_checkpointed, torch.tensor(np.asarray(x)))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    # ... as do per-example gradients (d/dx sin(x)^2 = sin(2x)):
    xs = jnp.stack([x, 2 * x])
    per_example = jax.vmap(
        jax.grad(torchjax.to_jax(_sin_squared_checkpointed, grad_method="autograd"))
    )
    np.testing.assert_allclose(jax.jit(per_example)(xs), jnp.sin(2 * xs), rtol=1e-5, atol=1e-6)


class _ReentrantCheckpointed(torch.nn.Module):
    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.lin, self.use_reentrant = torch.nn.Linear(3, 3), use_reentrant

    def forward(self, x):
        return checkpoint(self.lin, x, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("jit", [False, True])
def test_reentrant_checkpoint_is_refused_naming_use_reentrant_false(jit):
    torch.manual_seed(0)
    x = jnp.ones((2, 3))
    apply, variables = torchjax.module_to_jax(_ReentrantCheckpointed(use_reentrant=True))
    grad = jax.grad(lambda v, x: apply(v, x).sum(), argnums=(0, 1))
    # Eager: AutodiffError; under jit it reaches the caller inside XLA's JaxRuntimeError.
    with pytest.raises((AutodiffError, RuntimeError)) as info:
        jax.block_until_ready((jax.jit(grad) if jit else grad)(variables, x))
    text = str(info.value)
    assert "AutodiffError" in text or isinstance(info.value, AutodiffError)
    assert "Pass use_reentrant=False" in text
    # The fix it names works: the same weights, use_reentrant=False, torch's gradients.
    torch.manual_seed(0)
    fixed = _ReentrantCheckpointed(use_reentrant=False)
    apply, variables = torchjax.module_to_jax(fixed)
    grad = jax.grad(lambda v, x: apply(v, x).sum(), argnums=(0, 1))
    got_v, got_x = (jax.jit(grad) if jit else grad)(variables, x)
    xt = torch.ones(2, 3, requires_grad=True)
    fixed(xt).sum().backward()
    np.testing.assert_allclose(got_x, xt.grad.numpy(), rtol=1e-6)
    for name, p in fixed.named_parameters():
        np.testing.assert_allclose(got_v["params"][name], p.grad.numpy(), rtol=1e-6)


def test_reentrant_checkpoint_of_inputs_that_need_no_grad_keeps_torchs_warning():
    # torch itself drops the gradient of a weight used inside such a checkpoint (it warns,
    # and torch.autograd.grad of the output alone raises); docs/limitations.md says so.
    def f(w, x):
        return checkpoint(lambda x: (x @ w).sum(), x, use_reentrant=True)

    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        jax.grad(torchjax.to_jax(f))(jnp.eye(2), jnp.ones((1, 2)))


def test_vmap_of_a_module_with_dropout_names_module_to_jaxs_own_options():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5)).train()
    apply, variables = torchjax.module_to_jax(model)
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    with pytest.raises(torchjax.errors.VmapError) as info:
        jax.vmap(lambda row: apply(variables, row))(x)
    text = str(info.value)
    for advice in (
        "rng=key",
        "module_to_jax(module, vmap_randomness='different')",
        "module.eval()",
    ):
        assert advice in text
    assert "to_jax(fn, " not in text  # not the other entry point's spelling
    # Each advice works: a key per example, and eval mode (then equal to torch's own).
    keys = jax.random.split(jax.random.key(0), 4)
    masked = jax.vmap(lambda row, k: apply(variables, row, rng=k))(x, keys)
    assert masked.shape == (4, 3)
    model.eval()
    got = jax.vmap(lambda row: apply(variables, row))(x)
    with torch.no_grad():
        tree_close(got, model(torch.tensor(np.asarray(x))), rtol=1e-6)
