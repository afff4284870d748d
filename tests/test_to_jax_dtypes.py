"""to_jax over every dtype of the table, eager and jit, and random pytrees (hypothesis)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchjax
from torchjax._convert import _TORCH_TO_NUMPY

DTYPES = list(_TORCH_TO_NUMPY)
# torch implements only a few kernels for the newer unsigned types and the 8-bit floats;
# those get a copy test.
FLOAT8 = {d for d in DTYPES if "float8" in str(d)}
FEW_KERNELS = {torch.uint16, torch.uint32, torch.uint64, *FLOAT8}


def sample(dtype, shape):
    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) % 5
    if dtype == torch.bool:
        return base % 2 == 1
    return base


def identity_plus(x):
    """x + x for arithmetic dtypes, logical not for bool, a copy for sparse-kernel dtypes."""
    if x.dtype == torch.bool:
        return ~x
    if x.dtype in FEW_KERNELS:
        return x.clone()
    return x + x


def expected(values, dtype):
    if dtype == torch.bool:
        return ~values
    if dtype in FEW_KERNELS:
        return values
    return values + values


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(dtype, mode, x64):
    with jax.enable_x64(x64):
        values = sample(dtype, (2, 3))
        x = torchjax.tree_to_jax(torch.from_numpy(np.asarray(values)).to(dtype))
        f = torchjax.to_jax(identity_plus)
        if mode == "jit":
            f = jax.jit(f)
        out = f(x)
        assert out.dtype == x.dtype  # 64-bit types follow x64: narrowed when it is off
        want = expected(values, dtype)
        if dtype in FLOAT8:  # values the format cannot hold were rounded on the way in
            want = np.asarray(x.astype(jnp.float32))
        low_precision = dtype == torch.bfloat16 or dtype in FLOAT8
        got = np.asarray(out.astype(jnp.float32) if low_precision else out)
        np.testing.assert_array_equal(got.astype(np.complex128), want.astype(np.complex128))


def test_float64_output_is_narrowed_when_x64_is_off():
    with jax.enable_x64(False):
        f = torchjax.to_jax(lambda x: x.to(torch.float64) / 3)
        for g in (f, jax.jit(f)):
            out = g(jnp.ones(3, jnp.float32))
            assert out.dtype == jnp.float32
            np.testing.assert_allclose(out, np.full(3, 1 / 3), rtol=1e-7)


def test_int64_output_out_of_int32_range_raises_when_x64_is_off():
    with jax.enable_x64(False):
        f = torchjax.to_jax(lambda x: x.to(torch.int64) * (2**40))
        with pytest.raises(Exception, match="do not fit torch.int32.*jax_enable_x64"):
            jax.block_until_ready(f(jnp.ones(3, jnp.int32)))
        with pytest.raises(Exception, match="do not fit torch.int32"):
            jax.block_until_ready(jax.jit(f)(jnp.ones(3, jnp.int32)))


@pytest.mark.parametrize("x64", [False, True])
def test_numpy_inputs_take_the_dtype_jax_gives_them(x64):
    """A float64/int64 numpy array with x64 off is float32/int32 to JAX (jnp.asarray, jit):
    torch computes with it so eagerly too, under vmap and jvp as well, as jax.numpy does;
    except that an int32 input reaches torch as int64 (torch's indices are), its int64
    result narrowed back."""
    seen = []
    f = torchjax.to_jax(lambda a: (seen.append(a.dtype), (a + 1e-9) - a)[1])
    g = torchjax.to_jax(lambda i: (i * 3) // 4)
    with jax.enable_x64(x64):
        a, i = np.array([1.0, 2.0]), np.array([2**30, 7], dtype=np.int64)
        want_f = (jnp.asarray(a) + 1e-9) - jnp.asarray(a)  # 0 in float32, 1e-9 in float64
        # In int64, then narrowed (it fits): jax.numpy's int32 would wrap around.
        want_g = ((i.astype(np.int32).astype(np.int64) * 3) // 4).astype(jnp.asarray(i).dtype)
        for call in (lambda h: h, jax.jit):
            np.testing.assert_array_equal(call(f)(a), want_f)
            np.testing.assert_array_equal(call(g)(i), want_g)
        assert set(seen) == {torch.float64 if x64 else torch.float32}
        rows = np.ones((2, 2))
        want_rows = jax.vmap(lambda r: (r + 1e-9) - r)(rows)
        np.testing.assert_array_equal(jax.vmap(f)(rows), want_rows)
        np.testing.assert_array_equal(jax.jvp(f, (a,), (np.ones(2),))[0], want_f)
        assert set(seen) == {torch.float64 if x64 else torch.float32}


ARITH = [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def pytrees(draw, depth=2):
    """A pytree of (shape, dtype) leaves and static ints/strings, built recursively."""
    leaf = st.tuples(shapes, st.sampled_from(ARITH)).map(lambda sd: ("array", *sd))
    static = st.one_of(st.integers(-3, 3), st.sampled_from(["a", "b"])).map(lambda v: ("static", v))
    if depth == 0:
        return draw(st.one_of(leaf, static))
    child = pytrees(depth=depth - 1)
    return draw(
        st.one_of(
            leaf,
            static,
            st.lists(child, max_size=3),
            st.dictionaries(st.sampled_from(["p", "q", "r"]), child, max_size=3),
            st.lists(child, max_size=2).map(tuple),
        )
    )


def materialize(spec, counter):
    if isinstance(spec, tuple) and spec and spec[0] == "array":
        _, shape, dtype = spec
        counter[0] += 1
        n = int(np.prod(shape))
        return (torch.arange(n, dtype=torch.float32).reshape(shape) % 7 + counter[0]).to(dtype)
    if isinstance(spec, tuple) and spec and spec[0] == "static":
        return spec[1]
    if isinstance(spec, dict):
        return {k: materialize(v, counter) for k, v in spec.items()}
    if isinstance(spec, tuple):
        return tuple(materialize(v, counter) for v in spec)
    return [materialize(v, counter) for v in spec]


def torch_fn(tree, k):
    """Doubles every tensor and adds the static ints; static leaves become None."""
    statics = [v for v in jax.tree_util.tree_leaves(tree) if isinstance(v, int)]
    shift = sum(statics) + k
    return jax.tree_util.tree_map(
        lambda v: v * 2 + shift if isinstance(v, torch.Tensor) else None, tree
    )


def to_numpy(v):
    if isinstance(v, torch.Tensor):
        return v.to(torch.float64).numpy()
    return np.asarray(v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v, np.float64)


@settings(max_examples=40, deadline=None)
@given(spec=pytrees(), k=st.integers(-2, 2), use_jit=st.booleans())
def test_random_pytrees_match_torch(spec, k, use_jit):
    tree = materialize(spec, [0])
    want = torch_fn(tree, k)
    f = torchjax.to_jax(lambda t: torch_fn(t, k))
    leaves, treedef = jax.tree_util.tree_flatten(torchjax.tree_to_jax(tree))
    if use_jit:
        # jit would turn static Python leaves into traced arrays: close over them instead.
        is_arr = [isinstance(v, jax.Array) for v in leaves]

        def rebuild(arrays):
            it = iter(arrays)
            return treedef.unflatten(
                [next(it) if a else v for v, a in zip(leaves, is_arr, strict=True)]
            )

        got = jax.jit(lambda arrays: f(rebuild(arrays)))(
            [v for v in leaves if isinstance(v, jax.Array)]
        )
    else:
        got = f(treedef.unflatten(leaves))
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(to_numpy(g), to_numpy(w), rtol=1e-2)


def test_a_new_trace_after_set_default_dtype_finds_the_new_types():
    """torch.ones(3) follows torch's default dtype: a trace after torch.set_default_dtype
    finds its output types again (they were kept from the first trace, and the call
    failed). Reference: the function called in torch under the same default."""
    fn = lambda x: torch.ones(3) * x.sum()
    f = torchjax.to_jax(fn)
    with jax.enable_x64(True):
        x = jnp.ones(2, jnp.float64)
        assert jax.jit(f)(x).dtype == jnp.float32
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            want = fn(torch.ones(2, dtype=torch.float64)).numpy()
            assert want.dtype == np.float64
            for got in (jax.jit(lambda x: f(x))(x), jax.grad(lambda x: f(x).sum())(x)):
                assert got.dtype == jnp.float64
            np.testing.assert_array_equal(jax.jit(lambda x: f(x))(x), want)
        finally:
            torch.set_default_dtype(previous)
        assert jax.jit(lambda x: f(x) + 0)(x).dtype == jnp.float32
