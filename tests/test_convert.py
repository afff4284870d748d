# Tests of value conversion: tree_to_jax / tree_to_torch on whole pytrees.
#
# References are independent of torchjax: expected values are built with numpy, the expected
# dtypes and the supported-dtype list are written out here rather than read from _convert, and
# zero-copy is proved by comparing data pointers (and, once, by a write showing through).
from __future__ import annotations

import collections
import gc
import math
import re
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchjax
from torchjax.errors import ConversionError

# The version matrix runs this module; it is about the CPU (numpy and host-memory aliasing).
pytestmark = [pytest.mark.core, pytest.mark.cpu_only]

BF16 = np.dtype(jnp.bfloat16)

# torch dtype, its numpy dtype, and the torch dtype it becomes with JAX's x64 mode off.
DTYPES: list[tuple[torch.dtype, np.dtype, torch.dtype]] = [
    (torch.bool, np.dtype(np.bool_), torch.bool),
    (torch.uint8, np.dtype(np.uint8), torch.uint8),
    (torch.uint16, np.dtype(np.uint16), torch.uint16),
    (torch.uint32, np.dtype(np.uint32), torch.uint32),
    (torch.uint64, np.dtype(np.uint64), torch.uint32),
    (torch.int8, np.dtype(np.int8), torch.int8),
    (torch.int16, np.dtype(np.int16), torch.int16),
    (torch.int32, np.dtype(np.int32), torch.int32),
    (torch.int64, np.dtype(np.int64), torch.int32),
    (torch.float16, np.dtype(np.float16), torch.float16),
    (torch.bfloat16, BF16, torch.bfloat16),
    (torch.float32, np.dtype(np.float32), torch.float32),
    (torch.float64, np.dtype(np.float64), torch.float32),
    (torch.complex64, np.dtype(np.complex64), torch.complex64),
    (torch.complex128, np.dtype(np.complex128), torch.complex64),
]
NP_OF = {t: n for t, n, _ in DTYPES}
NARROW = {t: c for t, _, c in DTYPES}
WIDE = [torch.int64, torch.uint64, torch.float64, torch.complex128]
SHAPES = [(), (3, 0), (5,), (2, 3, 4), (1024, 1024)]

SUPPORTED = re.escape(
    "supported: bool, uint8, uint16, uint32, uint64, int8, int16, int32, int64, float16, "
    "bfloat16, float32, float64, complex64, complex128, float8_e4m3fn, float8_e5m2, "
    "float8_e4m3fnuz, float8_e5m2fnuz, float8_e8m0fnu. Not supported: int1, int2, int4"
)
FLOAT8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]


def _id(x: Any) -> str:
    return str(x).removeprefix("torch.")


# --------------------------------------------------------------------------- references


def reference(dtype: torch.dtype, shape: tuple[int, ...], fit: torch.dtype) -> np.ndarray:
    """Exactly representable test values of numpy type NP_OF[dtype], fitting torch type `fit`.

    Integers include the extremes of `fit`; floats include inf and nan; every float value
    is exact in bfloat16, so narrowing only changes the type, never the value.
    """
    n = math.prod(shape)
    base = np.arange(n, dtype=np.int64)
    np_dtype = NP_OF[dtype]
    if dtype == torch.bool:
        vals: np.ndarray = base % 3 == 0
    elif not dtype.is_floating_point and not dtype.is_complex:
        info = np.iinfo(NP_OF[fit])
        vals = (base * 7919 % 251 - (125 if info.min < 0 else 0)).astype(np_dtype)
        if n >= 2:
            vals[0], vals[1] = info.min, info.max
    else:
        vals = ((base * 37) % 61 - 30) * 0.5
        if n >= 3:
            vals[1], vals[2] = np.inf, np.nan
        if dtype.is_complex:
            vals = vals + 1j * ((base % 17) - 8) * 0.25
    return np.asarray(vals).astype(np_dtype).reshape(shape)


def torch_from_reference(ref: np.ndarray) -> torch.Tensor:
    """A torch tensor with the reference's values, in memory torch allocated (64-byte aligned)."""
    if ref.dtype == BF16:
        return torch.from_numpy(ref.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(ref).clone()


def values(x: Any) -> np.ndarray:
    """A numpy array of `x`'s values in a type where equality is exact and nan == nan."""
    if isinstance(x, torch.Tensor):
        x = x.to(torch.float64) if x.dtype == torch.bfloat16 else x
        x = x.resolve_conj().resolve_neg().numpy()
    x = np.asarray(x)
    if x.dtype == BF16:
        return x.astype(np.float64)
    return x


def assert_same_values(actual: Any, expected: Any) -> None:
    np.testing.assert_array_equal(values(actual), values(expected), strict=False)
    assert values(actual).shape == np.shape(expected)


def ptr(a: jax.Array) -> int:
    return a.unsafe_buffer_pointer()


# --------------------------------------------------------------------------- pytrees


Point = collections.namedtuple("Point", ["x", "y"])


@jax.tree_util.register_pytree_node_class
class Box:
    """A custom pytree node with one child and one static field."""

    def __init__(self, child: Any, tag: str):
        self.child = child
        self.tag = tag

    def tree_flatten(self):
        return (self.child,), self.tag

    @classmethod
    def tree_unflatten(cls, tag, children):
        return cls(children[0], tag)


class Pair:
    """A node registered with the plain function register_pytree_node."""

    def __init__(self, a: Any, b: Any):
        self.a, self.b = a, b


jax.tree_util.register_pytree_node(Pair, lambda p: ((p.a, p.b), None), lambda _, c: Pair(*c))


STATIC_LEAVES = {"int": 3, "float": 2.5, "str": "s", "bool": True, "obj": object(), "fn": len}


def _tree(leaf: Any, other: Any) -> dict:
    return {
        "plain": leaf(0),
        "list": [leaf(1), STATIC_LEAVES["int"], None],
        "tuple": (leaf(2), (other(3), STATIC_LEAVES["str"])),
        "point": Point(x=leaf(4), y=STATIC_LEAVES["float"]),
        "box": Box({"deep": [leaf(5), STATIC_LEAVES["obj"]]}, tag="t"),
        "pair": Pair(leaf(6), STATIC_LEAVES["fn"]),
        "none": None,
        "numpy": np.full((2,), 7.0, np.float32),
        "static": dict(STATIC_LEAVES),
    }


def _check_structure(out: Any, inp: Any, array_type: type) -> None:
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(inp)
    assert type(out["point"]) is Point and type(out["box"]) is Box and type(out["pair"]) is Pair
    assert out["box"].tag == "t"
    assert out["none"] is None and out["list"][2] is None
    for o, i in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(inp), strict=True):
        if isinstance(i, torch.Tensor | jax.Array | np.ndarray):
            assert isinstance(o, array_type)
            assert_same_values(o, i)
        else:
            assert o is i


def test_tree_to_jax_structure_and_leaves():
    tree = _tree(lambda k: torch.full((2, 2), float(k)), lambda k: jnp.full((3,), k))
    out = torchjax.tree_to_jax(tree)
    _check_structure(out, tree, jax.Array)
    assert out["tuple"][1][0] is tree["tuple"][1][0]  # JAX arrays pass through as they are
    assert out["static"]["obj"] is STATIC_LEAVES["obj"]
    assert_same_values(out["box"].child["deep"][0], np.full((2, 2), 5.0, np.float32))


def test_tree_to_torch_structure_and_leaves():
    tree = _tree(lambda k: jnp.full((2, 2), float(k)), lambda k: torch.full((3,), k))
    out = torchjax.tree_to_torch(tree)
    _check_structure(out, tree, torch.Tensor)
    assert out["tuple"][1][0] is tree["tuple"][1][0]  # torch tensors pass through as they are
    assert_same_values(out["pair"].a, np.full((2, 2), 6.0, np.float32))


@pytest.mark.parametrize("convert", [torchjax.tree_to_jax, torchjax.tree_to_torch])
@pytest.mark.parametrize("tree", [None, 5, "x", 2.5, [], {}, (), [None, ()]], ids=repr)
def test_trees_without_arrays_pass_through(convert, tree):
    out = convert(tree)
    assert out == tree and type(out) is type(tree)
    if isinstance(tree, int | str | float):
        assert out is tree


def test_bare_leaves():
    a = torchjax.tree_to_jax(torch.tensor([1.0, 2.0]))
    assert isinstance(a, jax.Array)
    assert_same_values(a, np.array([1.0, 2.0], np.float32))
    t = torchjax.tree_to_torch(jnp.array([3, 4], jnp.int32))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32
    assert t.tolist() == [3, 4]


# --------------------------------------------------------------------------- zero-copy


def test_torch_to_jax_is_zero_copy():
    t = torch.arange(1000, dtype=torch.float32)
    out = torchjax.tree_to_jax({"t": t})["t"]
    assert ptr(out) == t.data_ptr()
    t[0] = 42.0  # only to show the aliasing; user code must never do this
    assert float(np.asarray(out)[0]) == 42.0


def test_jax_to_torch_is_zero_copy():
    a = jnp.arange(1000, dtype=jnp.float32)
    out = torchjax.tree_to_torch([a])[0]
    assert out.data_ptr() == ptr(a)
    assert out.tolist() == list(range(1000))


def test_round_trip_returns_to_the_same_memory():
    t = torch.randn(16, 8)
    back = torchjax.tree_to_torch(torchjax.tree_to_jax(t))
    assert back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)


def test_aligned_slice_is_zero_copy():
    base = torch.arange(64, dtype=torch.float32)
    t = base[16:]  # 64 bytes past a fresh allocation: aligned as XLA requires
    out = torchjax.tree_to_jax(t)
    assert ptr(out) == t.data_ptr()
    assert_same_values(out, np.arange(16, 64, dtype=np.float32))


def test_torch_to_jax_keeps_memory_alive():
    t = torch.arange(4096, dtype=torch.float32)
    p = t.data_ptr()
    out = torchjax.tree_to_jax(t)
    del t
    gc.collect()
    junk = [torch.full((4096,), -1.0) for _ in range(32)]
    assert ptr(out) == p
    assert_same_values(out, np.arange(4096, dtype=np.float32))
    del junk


def test_jax_to_torch_keeps_memory_alive():
    a = jnp.arange(4096, dtype=jnp.float32)
    out = torchjax.tree_to_torch(a)
    del a
    gc.collect()
    junk = [jnp.full((4096,), -1.0) for _ in range(32)]
    assert_same_values(out, np.arange(4096, dtype=np.float32))
    del junk


# --------------------------------------------------------------------------- dtype x shape grid


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [d for d, _, _ in DTYPES], ids=_id)
def test_grid_torch_to_jax(x64_off, dtype, shape):
    narrow = NARROW[dtype]
    ref = reference(dtype, shape, fit=narrow)
    t = torch_from_reference(ref)
    out = torchjax.tree_to_jax(t)
    assert out.dtype == NP_OF[narrow]
    assert out.shape == shape
    assert_same_values(out, ref)
    if narrow == dtype and t.numel():
        assert ptr(out) == t.data_ptr()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [d for d, _, _ in DTYPES if d not in WIDE], ids=_id)
def test_grid_jax_to_torch(x64_off, dtype, shape):
    ref = reference(dtype, shape, fit=dtype)
    a = jax.device_put(ref)
    assert a.dtype == ref.dtype
    out = torchjax.tree_to_torch(a)
    assert out.dtype == dtype
    assert tuple(out.shape) == shape
    assert_same_values(out, ref)
    if out.numel():
        assert out.data_ptr() == ptr(a)


@pytest.mark.parametrize("shape", [(), (3, 0), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("dtype", WIDE, ids=_id)
def test_grid_64_bit_with_x64(x64, dtype, shape):
    ref = reference(dtype, shape, fit=dtype)
    t = torch_from_reference(ref)
    out = torchjax.tree_to_jax(t)
    assert out.dtype == NP_OF[dtype]
    assert_same_values(out, ref)
    back = torchjax.tree_to_torch(out)
    assert back.dtype == dtype
    assert_same_values(back, ref)
    if t.numel():
        assert ptr(out) == t.data_ptr() == back.data_ptr()


# --------------------------------------------------------------------------- numpy leaves


@pytest.mark.parametrize("dtype", [d for d, _, _ in DTYPES], ids=_id)
def test_numpy_leaves(x64_off, dtype):
    ref = reference(dtype, (2, 3), fit=NARROW[dtype])
    out = torchjax.tree_to_jax({"n": ref})["n"]
    assert isinstance(out, jax.Array) and out.dtype == NP_OF[NARROW[dtype]]
    assert_same_values(out, ref)
    t = torchjax.tree_to_torch({"n": ref})["n"]
    assert isinstance(t, torch.Tensor) and t.dtype == dtype
    assert_same_values(t, ref)
    assert t.data_ptr() == ref.ctypes.data  # torch aliases writeable numpy memory


def test_numpy_to_jax_is_zero_copy_when_aligned():
    x = torch.arange(100, dtype=torch.float32).numpy()  # torch's allocator aligns to 64
    assert x.ctypes.data % 64 == 0
    out = torchjax.tree_to_jax(x)
    assert ptr(out) == x.ctypes.data


NUMPY_LAYOUTS = {
    "reversed": lambda x: x[::-1],
    "reversed_2d": lambda x: x.reshape(4, 6)[:, ::-2],
    "read_only": lambda x: np.broadcast_to(x[:6], (3, 6)),
    "strided": lambda x: x[::3],
    "transposed": lambda x: x.reshape(4, 6).T,
}


@pytest.mark.parametrize("layout", NUMPY_LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=_id)
def test_numpy_layouts(dtype, layout):
    ref = reference(dtype, (24,), fit=dtype)
    view = NUMPY_LAYOUTS[layout](ref)
    expected = values(view).copy()
    assert_same_values(torchjax.tree_to_jax(view), expected)
    assert_same_values(torchjax.tree_to_torch(view), expected)
    assert_same_values(ref, reference(dtype, (24,), fit=dtype))  # input untouched


def test_read_only_numpy_is_copied_not_aliased():
    x = np.broadcast_to(np.arange(4, dtype=np.float32), (2, 4))
    assert not x.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it aliases read-only memory
        t = torchjax.tree_to_torch(x)
        a = torchjax.tree_to_jax(x)
    t += 1  # the tensor owns writeable memory of its own
    assert_same_values(x, np.broadcast_to(np.arange(4, dtype=np.float32), (2, 4)))
    assert_same_values(a, np.broadcast_to(np.arange(4, dtype=np.float32), (2, 4)))


def test_numpy_field_with_odd_strides():
    rec = np.zeros(5, dtype=[("x", "<f4"), ("y", "i1")])
    rec["x"] = np.arange(5)
    field = rec["x"]  # strides of 5 bytes: not a multiple of the item size
    assert field.strides == (5,)
    assert_same_values(torchjax.tree_to_jax(field), np.arange(5, dtype=np.float32))
    assert_same_values(torchjax.tree_to_torch(field), np.arange(5, dtype=np.float32))


# --------------------------------------------------------------------------- layouts of torch views


VIEWS = {
    "transposed": lambda x: x.T,
    "strided": lambda x: x[::2],
    "column": lambda x: x[:, 1],
    "rows_from_1": lambda x: x[1:],
    "flat_from_1": lambda x: x.reshape(-1)[1:],
    "flat_from_3_step_5": lambda x: x.reshape(-1)[3::5],
    "broadcast": lambda x: (
        x[:1].expand(4, 8) if isinstance(x, torch.Tensor) else np.broadcast_to(x[:1], (4, 8))
    ),
    "size_1_dim": lambda x: x.reshape(-1)[:6].reshape(6, 1).T,  # odd stride on a size-1 dim
}
VIEW_DTYPES = [torch.bool, torch.int8, torch.float16, torch.bfloat16, torch.float32]
VIEW_DTYPES += [torch.float64, torch.complex64, torch.uint64]


@pytest.mark.parametrize("view", VIEWS, ids=str)
@pytest.mark.parametrize("dtype", VIEW_DTYPES, ids=_id)
def test_torch_views(x64_off, dtype, view):
    ref = reference(dtype, (6, 8), fit=NARROW[dtype])
    t = torch_from_reference(ref)
    v = VIEWS[view](t)
    expected = VIEWS[view](ref)
    out = torchjax.tree_to_jax(v)
    assert out.dtype == NP_OF[NARROW[dtype]]
    assert_same_values(out, expected)
    assert_same_values(t, ref)  # the user's tensor is never modified


def test_conjugate_and_negative_views():
    z = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64)
    assert z.conj().is_conj()
    assert_same_values(torchjax.tree_to_jax(z.conj()), np.array([1 - 2j, -3 + 4j], np.complex64))
    n = torch.tensor([1.0, -2.0])._neg_view()
    assert n.is_neg()
    assert_same_values(torchjax.tree_to_jax(n), np.array([-1.0, 2.0], np.float32))


def test_channels_last():
    ref = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    t = torch.from_numpy(ref.copy()).to(memory_format=torch.channels_last)
    assert not t.is_contiguous()
    assert_same_values(torchjax.tree_to_jax(t), ref)


# --------------------------------------------------------------------------- autograd


def test_requires_grad_is_detached():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    y = w * 2
    out = torchjax.tree_to_jax({"w": w, "y": y})
    assert_same_values(out["w"], np.array([1.0, 2.0, 3.0], np.float32))
    assert_same_values(out["y"], np.array([2.0, 4.0, 6.0], np.float32))
    assert ptr(out["w"]) == w.data_ptr()  # detaching does not copy
    assert w.requires_grad and y.grad_fn is not None  # the inputs are left as they were


def test_requires_grad_graph_is_not_kept_alive():
    x = torch.randn(3, requires_grad=True)
    saved = torch.randn(3)
    alive = weakref.ref(saved)
    y = x * saved  # y's graph holds `saved` for the backward pass
    out = torchjax.tree_to_jax(y)
    del y, saved
    gc.collect()
    assert alive() is None  # the JAX array holds detached data, not y and its graph
    assert out.shape == (3,)


# --------------------------------------------------------------------------- x64 policy


@pytest.mark.parametrize(
    "dtype, vals, narrow",
    [
        (torch.int64, [-(2**31), 2**31 - 1, 0, -5], torch.int32),
        (torch.uint64, [0, 2**32 - 1, 7], torch.uint32),
        (torch.float64, [3.0e38, -1.5, float("inf"), 1e-300], torch.float32),
        (torch.complex128, [1.5 - 2.5j, 3.0e38j], torch.complex64),
    ],
    ids=lambda x: _id(x) if isinstance(x, torch.dtype) else "",
)
def test_x64_off_narrows_with_correct_values(x64_off, dtype, vals, narrow):
    t = torch.from_numpy(np.array(vals, dtype=NP_OF[dtype]))
    out = torchjax.tree_to_jax(t)
    assert out.dtype == NP_OF[narrow]
    expected = np.array(vals, dtype=NP_OF[narrow])  # numpy's own rounding as the reference
    assert_same_values(out, expected)
    assert ptr(out) != t.data_ptr()


@pytest.mark.parametrize(
    "dtype, vals, match",
    [
        (torch.int64, [1, 2**40], r"int64 values in \[1, 1099511627776\] do not fit torch\.int32"),
        (torch.int64, [-(2**31) - 1], r"int64 values in \[-2147483649, -2147483649\] do not fit"),
        (torch.uint64, [2**32], r"uint64 values in \[4294967296, 4294967296\] do not fit"),
        (torch.uint64, [1, 2**64 - 1], r"uint64 values in \[\d+, \d+\] do not fit torch\.uint32"),
        (torch.float64, [1.0, 1e300], r"float64 values overflow torch\.float32"),
        (torch.complex128, [1e300j], r"complex128 values overflow torch\.complex64"),
    ],
    ids=lambda x: _id(x) if isinstance(x, torch.dtype) else "",
)
def test_x64_off_out_of_range_raises(x64_off, dtype, vals, match):
    t = torch.from_numpy(np.array(vals, dtype=NP_OF[dtype]))
    with pytest.raises(ConversionError, match=match + r".*x64 is off.*jax_enable_x64"):
        torchjax.tree_to_jax({"a": [0, t]})
    with pytest.raises(ConversionError, match=r"^tree\['a'\]\[1\]: "):
        torchjax.tree_to_jax({"a": [0, t]})


def test_x64_off_numpy_out_of_range_raises(x64_off):
    with pytest.raises(ConversionError, match=r"tree\['x'\]: torch\.float64 values overflow"):
        torchjax.tree_to_jax({"x": np.array([1e300])})


def test_x64_on_keeps_extreme_values(x64):
    cases = {
        torch.int64: [2**40, -(2**63), 2**63 - 1],
        torch.uint64: [2**64 - 1, 2**40],
        torch.float64: [1e300, -1e-300],
        torch.complex128: [1e300 - 1e-300j],
    }
    for dtype, vals in cases.items():
        t = torch.from_numpy(np.array(vals, dtype=NP_OF[dtype])).clone()
        out = torchjax.tree_to_jax(t)
        assert out.dtype == NP_OF[dtype]
        assert ptr(out) == t.data_ptr()
        assert values(out).tolist() == vals


def test_x64_context_does_not_leak():
    before = jax.config.jax_enable_x64
    with jax.enable_x64(not before):
        assert torchjax.tree_to_jax(torch.zeros(1, dtype=torch.int64)).dtype == (
            np.int32 if before else np.int64
        )
    assert jax.config.jax_enable_x64 == before


# --------------------------------------------------------------------------- errors


def test_tracer_raises_in_jit():
    def f(tree):
        torchjax.tree_to_torch(tree)
        return tree["x"]

    where = r"tree\['x'\] is a traced JAX value \(float32\[3\]\)"
    with pytest.raises(ConversionError, match=where):
        jax.jit(f)({"x": jnp.ones(3)})
    with pytest.raises(ConversionError, match=r"torchjax\.to_jax"):
        jax.jit(f)({"x": jnp.ones(3)})


def test_tracer_raises_in_vmap_and_grad():
    def f(x):
        torchjax.tree_to_torch([x])
        return x

    with pytest.raises(ConversionError, match=r"^tree\[0\] is a traced JAX value"):
        jax.vmap(f)(jnp.ones((2, 3)))
    with pytest.raises(ConversionError, match="traced JAX value"):
        jax.grad(lambda x: torchjax.tree_to_torch(x).sum())(1.0)


@pytest.mark.parametrize("name", FLOAT8)
def test_float8_round_trips_zero_copy(name):
    # Values every format holds exactly (float8_e8m0fnu: powers of two only).
    values = np.array([0.5, 1.0, 2.0, 4.0], np.float32)
    t = torch.tensor(values).to(getattr(torch, name))
    a = torchjax.tree_to_jax(t)
    assert a.dtype == getattr(jnp, name)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), values)
    back = torchjax.tree_to_torch(a)
    assert back.dtype == getattr(torch, name) and back.data_ptr() == t.data_ptr()
    # Through to_jax, eagerly and under jit: torch upcasts, computes, casts back.
    f = torchjax.to_jax(lambda x: (x.float() * 2).to(x.dtype))
    for run in (f, jax.jit(f)):
        out = run(a)
        assert out.dtype == getattr(jnp, name)
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), values * 2)


@pytest.mark.parametrize("dtype", [torch.float4_e2m1fn_x2, torch.complex32], ids=_id)
def test_unsupported_torch_dtype(dtype):
    leaf = torch.zeros(3, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else None
    if leaf is None:
        leaf = torch.zeros(3, dtype=dtype)
    name = re.escape(str(dtype))
    with pytest.raises(ConversionError, match=f"{name} has no JAX equivalent; {SUPPORTED}"):
        torchjax.tree_to_jax({"a": leaf})


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: jnp.zeros(3, jnp.int4), "int4"),
        (lambda: jnp.zeros(3, jnp.float8_e4m3b11fnuz), "float8_e4m3b11fnuz"),
        (lambda: jax.random.key(0), "key<fry>"),
        (lambda: np.array(["a"]), "<U1"),
        (lambda: np.array([1, "a"], dtype=object), "object"),
        (lambda: np.arange(3, dtype=">i4"), ">i4"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_unsupported_array_dtype(make, name):
    match = f"dtype {re.escape(name)} has no torch equivalent; {SUPPORTED}"
    with pytest.raises(ConversionError, match=match):
        torchjax.tree_to_torch([make()])
    if isinstance(make(), np.ndarray):  # numpy leaves go through the same table both ways
        with pytest.raises(ConversionError, match=match):
            torchjax.tree_to_jax([make()])


def test_sparse_tensor_raises():
    with pytest.raises(ConversionError, match=r"tree\['s'\] is a torch\.sparse_coo .*to_dense"):
        torchjax.tree_to_jax({"s": torch.eye(3).to_sparse()})


def test_conversion_error_is_a_type_error():
    # Callers that catch TypeError (as for any bad argument) also catch conversion failures.
    with pytest.raises(TypeError):
        torchjax.tree_to_jax(torch.zeros(1, dtype=torch.complex32))


# --------------------------------------------------------------------------- hypothesis


HYP_DTYPES = [d for d, _, _ in DTYPES]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(HYP_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype.is_floating_point or dtype.is_complex:
        # float32-exact values, so that narrowing float64 changes the type only
        wide = torch.complex64 if dtype.is_complex else torch.float32
        t = (torch.randn(shape, generator=g, dtype=wide) * 100).to(dtype)
    else:
        info = np.iinfo(NP_OF[NARROW[dtype]])
        ints = np.random.default_rng(g.initial_seed()).integers(info.min, info.max, shape)
        t = torch.from_numpy(ints.astype(NP_OF[dtype])).clone()  # clone: torch's alignment
    if t.ndim >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    return t


STATICS = st.none() | st.integers() | st.text(max_size=4) | st.booleans() | st.floats()
LEAVES = st.one_of(tensors(), tensors(), tensors(), STATICS)  # mostly tensors
TREES = st.recursive(
    LEAVES,
    lambda kids: (
        st.lists(kids, max_size=3)
        | st.dictionaries(st.text(max_size=3), kids, max_size=3)
        | st.tuples(kids, kids)
        | st.builds(Point, kids, kids)
    ),
    max_leaves=12,
)


@pytest.mark.parametrize("x64", [False, True], ids=["x64_off", "x64"])
@settings(max_examples=50, deadline=None)
@given(tree=TREES)
def test_round_trip_random_trees(x64, tree):
    with jax.enable_x64(x64):
        mid = torchjax.tree_to_jax(tree)
        out = torchjax.tree_to_torch(mid)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    mids = jax.tree_util.tree_leaves(mid)
    outs = jax.tree_util.tree_leaves(out)
    for leaf, m, o in zip(jax.tree_util.tree_leaves(tree), mids, outs, strict=True):
        if not isinstance(leaf, torch.Tensor):
            assert m is leaf and o is leaf
            continue
        want = leaf.dtype if x64 else NARROW[leaf.dtype]
        assert isinstance(m, jax.Array) and isinstance(o, torch.Tensor)
        assert o.dtype == want and o.shape == leaf.shape
        assert_same_values(o, values(leaf))
        if want == leaf.dtype and leaf.is_contiguous() and leaf.numel():
            assert o.data_ptr() == leaf.data_ptr()
