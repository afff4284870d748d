"""to_jax of torch functions returning torch-only pytrees: structseqs (torch.return_types) and
Hugging Face-style ModelOutput dict-likes registered in torch.utils._pytree."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.utils._pytree as torch_pytree

import torchjax
from torchjax.errors import OutputMismatchError


class ModelOutput(collections.OrderedDict):
    """Like transformers.utils.ModelOutput: an OrderedDict of the fields that are not None,
    registered (by every subclass) as a torch pytree node flattening to (values, keys)."""

    def __init_subclass__(cls):
        torch_pytree.register_pytree_node(
            cls,
            lambda out: (list(out.values()), list(out.keys())),
            lambda values, keys: cls(**dict(zip(keys, values, strict=True))),
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        )

    def __init__(self, **fields):
        super().__init__((k, v) for k, v in fields.items() if v is not None)

    def __getattr__(self, name):
        return self.get(name)


class CausalLMOutput(ModelOutput):
    pass


A = jnp.array([[2.0, 0.5, 0.1], [0.3, 1.5, -0.2], [0.0, 0.4, 3.0]])


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_structseq_becomes_namedtuple(mode):
    f = torchjax.to_jax(torch.linalg.slogdet)
    out = (jax.jit(f) if mode == "jit" else f)(A)
    assert type(out).__name__ == "linalg_slogdet" and out._fields == ("sign", "logabsdet")
    sign, logabsdet = jnp.linalg.slogdet(A)
    np.testing.assert_allclose(out.sign, sign)
    np.testing.assert_allclose(out.logabsdet, logabsdet, rtol=1e-6)


def test_structseq_grad_matches_jax():
    f = torchjax.to_jax(torch.linalg.slogdet)
    got = jax.grad(lambda a: f(a).logabsdet)(A)
    want = jax.grad(lambda a: jnp.linalg.slogdet(a)[1])(A)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_structseq_under_vmap_and_nested_in_a_dict():
    f = torchjax.to_jax(lambda x: {"max": x.max(dim=0), "n": x.shape[0]})
    xs = jnp.arange(24.0).reshape(2, 4, 3) % 5
    out = jax.vmap(f)(xs)
    np.testing.assert_array_equal(out["max"].values, jnp.max(xs, axis=1))
    np.testing.assert_array_equal(out["max"].indices, jnp.argmax(xs, axis=1))
    assert out["max"].indices.dtype == jnp.int32  # x64 off


def model(params, x):  # {'w': [3, 2]}, [N, 3] -> CausalLMOutput(logits=[N, 2], hidden=[N, 3])
    hidden = torch.tanh(x)
    return CausalLMOutput(loss=None, logits=hidden @ params["w"], hidden=hidden)


@pytest.mark.parametrize("mode", ["eager", "jit", "vmap"])
def test_model_output_becomes_dict_of_non_none_fields(mode):
    f = torchjax.to_jax(model)
    params = {"w": jnp.arange(6.0).reshape(3, 2) / 6}
    x = jnp.linspace(-1, 1, 12).reshape(4, 3)
    if mode == "vmap":
        out = jax.vmap(f, in_axes=(None, 0))(params, x[:, None])
        out = jax.tree.map(lambda v: v[:, 0], out)
    else:
        out = (jax.jit(f) if mode == "jit" else f)(params, x)
    assert isinstance(out, dict) and list(out) == ["logits", "hidden"]  # loss was None
    assert out.logits is out["logits"]  # attribute access, as on a ModelOutput
    with pytest.raises(AttributeError, match="no field 'loss'; its fields are"):
        _ = out.loss
    np.testing.assert_allclose(out["hidden"], jnp.tanh(x), rtol=1e-6)
    np.testing.assert_allclose(out["logits"], jnp.tanh(x) @ params["w"], rtol=1e-6)


def test_model_output_grad_matches_jax():
    f = torchjax.to_jax(model)
    params = {"w": jnp.arange(6.0).reshape(3, 2) / 6}
    x = jnp.linspace(-1, 1, 12).reshape(4, 3)
    got = jax.grad(lambda p: jnp.sum(f(p, x)["logits"] ** 2))(params)
    want = jax.grad(lambda p: jnp.sum((jnp.tanh(x) @ p["w"]) ** 2))(params)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5)


def test_non_array_leaf_named_by_its_path():
    f = torchjax.to_jax(lambda x: CausalLMOutput(logits=x * 2, label="positive"))
    with pytest.raises(OutputMismatchError, match=r"returned a str at out\['label'\]"):
        f(jnp.ones(2))


def test_plain_outputs_are_passed_through_unchanged():
    from torchjax._to_jax._call._outputs import as_jax_tree

    t = torch.ones(2)
    pair = (t, t)
    assert as_jax_tree(t) is t and as_jax_tree(pair) is pair
    nested = {"a": [t, (t, 1.0)], "b": None}
    assert jax.tree_util.tree_structure(as_jax_tree(nested)) == jax.tree_util.tree_structure(nested)


def test_output_dict_is_a_jax_pytree_that_keeps_order_and_type():
    f = torchjax.to_jax(model)
    out = f({"w": jnp.ones((3, 2))}, jnp.ones((4, 3)))
    doubled = jax.tree.map(lambda v: v * 2, out)
    assert type(doubled) is type(out) and list(doubled) == ["logits", "hidden"]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(out)]
    assert paths == ["['logits']", "['hidden']"]


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def test_real_hugging_face_model_output_with_attribute_access_and_gradients():
    model = _tiny_gpt2()
    apply, variables = torchjax.module_to_jax(model)
    tokens = np.random.default_rng(0).integers(0, 100, size=(2, 8))
    out = jax.jit(lambda v, t: apply(v, t, use_cache=False))(variables, jnp.asarray(tokens))
    with torch.no_grad():
        want = model(torch.as_tensor(tokens), use_cache=False)  # a real ModelOutput
    assert list(out) == list(want.keys()) == ["logits"]
    np.testing.assert_allclose(out.logits, want.logits.numpy(), rtol=1e-5, atol=1e-5)

    # The gradient of a loss that reads out.logits, against torch autograd on the module.
    def loss(params):
        logits = apply({**variables, "params": params}, tokens, use_cache=False).logits
        return jnp.sum(jnp.tanh(logits))

    grads = jax.grad(loss)(variables["params"])
    model.zero_grad()
    torch.tanh(model(torch.as_tensor(tokens), use_cache=False).logits).sum().backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_real_hugging_face_cache_output_names_use_cache_false():
    apply, variables = torchjax.module_to_jax(_tiny_gpt2())
    with pytest.raises(OutputMismatchError, match=r"at out\['cache'\].*use_cache=False"):
        apply(variables, jnp.zeros((1, 4), jnp.int32))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_python_float_that_overflows_float32_is_an_error(mode, x64_off):
    # x64 off: the float64 tensor of 1e300 raises; the Python float became inf silently.
    f = torchjax.to_jax(lambda t: (t * 2, 1e300))
    f = jax.jit(f) if mode == "jit" else f
    kind = torchjax.errors.ConversionError if mode == "eager" else Exception
    with pytest.raises(kind, match=r"Python number 1e\+300 does not fit torch.float32"):
        jax.block_until_ready(f(jnp.ones(2)))
    fine = torchjax.to_jax(lambda t: (t * 2, float("inf"), 3.5))  # inf stays inf
    out = fine(jnp.ones(2))
    assert out[1] == float("inf") and out[2] == 3.5


def test_numpy_scalars_in_the_output_become_arrays_of_their_dtype():
    """As JAX makes of a numpy scalar a jitted function returns (x64 off: int64 -> int32)."""

    def torch_fn(a):
        return a * 2, np.float32(0.5), np.int64(3), np.bool_(True), np.float64(0.25)

    def jax_fn(a):
        return a * 2, np.float32(0.5), np.int64(3), np.bool_(True), np.float64(0.25)

    f, x = torchjax.to_jax(torch_fn), jnp.ones(2)
    want = jax.jit(jax_fn)(x)
    for got in (f(x), jax.jit(f)(x)):
        assert [g.dtype for g in got] == [w.dtype for w in want]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    grad = jax.grad(lambda a: f(a)[0].sum() * f(a)[1])(x)
    np.testing.assert_array_equal(grad, np.ones(2))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # torch's own
def test_a_nested_tensor_output_names_its_path_and_the_fix():
    f = torchjax.to_jax(lambda a: {"parts": torch.nested.nested_tensor([a, a[:1]])})
    with pytest.raises(
        torchjax.errors.ConversionError,
        match=r"(?s)out\['parts'\] is a nested tensor.*unbind\(\).*to_padded_tensor",
    ):
        f(jnp.ones(2))
