"""The shortcuts a repeated call takes: the same checks, errors and results as a first call.

An eager to_jax call whose signature was seen last (JAX CPU arrays as positional arguments,
one tensor out) skips the bind (HotCall); a to_torch call of tensors alone skips the
flattening and the cache's hashing. Each test makes a first call, then checks that the next
one took the shortcut (the bind or the flattening is counted) and still behaves as a first
call would: against jax.numpy or torch on the same values, and against the caller's arrays
copied before the call.
"""

import concurrent.futures
import os
import subprocess
import sys
import traceback
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import torchjax
from torchjax._to_jax._torch_call._primitive import torch_call_p
from torchjax._to_torch import _to_torch
from torchjax.errors import CopyWarning, InPlaceMutationError, OutputMismatchError

pytestmark = pytest.mark.core
PACKAGE = os.path.dirname(torchjax.__file__)


@pytest.fixture
def binds(monkeypatch):
    """The number of to_jax calls that went through the bind (the full way)."""
    count = [0]
    full = torch_call_p._bind

    def counted(*args):
        count[0] += 1
        return full(*args)

    monkeypatch.setattr(torch_call_p, "_bind", counted)
    return count


def test_a_repeated_eager_call_skips_the_bind_and_a_new_signature_does_not(binds):
    f = torchjax.to_jax(lambda a, b: torch.sin(a) * b)
    x, y = jnp.arange(4.0), jnp.full(4, 3.0)
    for _ in range(3):
        np.testing.assert_allclose(f(x, y), jnp.sin(x) * y, rtol=1e-6)
    assert binds[0] == 1
    np.testing.assert_allclose(f(x[:3], y[:3]), jnp.sin(x[:3]) * y[:3], rtol=1e-6)
    np.testing.assert_allclose(f(x.astype(jnp.int32), y), jnp.sin(x) * y, rtol=1e-6)
    assert binds[0] == 3
    f(x, y)
    assert binds[0] == 4  # the shortcut is the last signature's only


def _data(t):
    t.data.mul_(2)


def _storage(t):
    t.untyped_storage().fill_(0)


def _setitem(t):
    t[0] = 7.0


def _out(t):
    torch.add(t, 1, out=t)


def _view_op(t):
    t.unsqueeze_(0)


@pytest.mark.parametrize(
    "route", [_data, _storage, _setitem, _out, _view_op], ids=lambda r: r.__name__
)
def test_a_write_on_a_repeated_call_is_refused(binds, route):
    def f(t):
        if t.sum() > 0:  # only the second call's values write
            route(t)
        return t * 1

    wrapped = torchjax.to_jax(f)
    wrapped(jnp.zeros(4))
    x = jnp.arange(4.0)
    with pytest.raises(InPlaceMutationError, match=r"args\[0\]"):
        wrapped(x)
    np.testing.assert_array_equal(x, np.arange(4.0))
    assert binds[0] == 1


def test_a_reader_on_a_repeated_call_runs_on_copies(binds):
    def f(t):
        if t.sum() > 0:
            return torch.from_numpy(t.numpy() * 2)  # asks for a writable pointer
        return t * 2

    wrapped = torchjax.to_jax(f)
    wrapped(jnp.zeros(4))
    x = jnp.arange(4.0)
    with pytest.warns(CopyWarning):
        np.testing.assert_array_equal(wrapped(x), np.arange(4.0) * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(wrapped(x), np.arange(4.0) * 2)  # on copies, quietly
    np.testing.assert_array_equal(x, np.arange(4.0))
    # The second call took the shortcut; after its run on copies the plan is no longer
    # plain, so the third took the full way (which runs on copies, as it did before).
    assert binds[0] == 2


def test_outputs_torch_keeps_are_copied_on_a_repeated_call(binds):
    weight = torch.arange(4.0)
    cache = []

    def cached(t):
        y = t * 2
        cache.append(y)
        return y

    buffer = np.arange(4.0, dtype=np.float32)
    datas, storages = [], []

    def kept_data(t):
        y = t * 2
        datas.append(y.data)
        return y

    def kept_storage(t):
        y = t * 2
        storages.append(y.untyped_storage())
        return y

    cases = [
        (lambda t: t, None),  # the input itself: JAX's array, which the caller holds
        (lambda t: weight, lambda: weight.add_(100)),
        (lambda t: weight.detach()[:4], lambda: weight.add_(100)),
        (cached, lambda: [c.add_(100) for c in cache]),
        # memory torch did not allocate, which its owner may write
        (lambda t: torch.from_numpy(buffer), lambda: np.add(buffer, 100, out=buffer)),
        # a fresh tensor whose storage something else holds
        (kept_data, lambda: [d.add_(100) for d in datas]),
        (kept_storage, lambda: [s.fill_(100) for s in storages]),
    ]
    for fn, change in cases:
        wrapped = torchjax.to_jax(fn)
        wrapped(jnp.zeros(4))
        x = jnp.arange(4.0)
        out = wrapped(x)
        expected = np.array(out)
        if change is not None:
            change()
        np.testing.assert_array_equal(out, expected)
    assert binds[0] == len(cases)


def test_a_fresh_output_stays_zero_copy_on_a_repeated_call(binds):
    seen = []

    def f(t):
        y = t * 2
        seen.append(y.const_data_ptr())
        return y

    wrapped = torchjax.to_jax(f)
    wrapped(jnp.ones(1024))
    assert wrapped(jnp.ones(1024)).unsafe_buffer_pointer() == seen[-1]
    assert binds[0] == 1


def test_an_output_of_another_type_stays_zero_copy_on_a_repeated_call(binds):
    seen = []

    def f(t):
        y = t[: int(t[0])] * 2  # a fresh tensor whose shape follows the values
        seen.append(y.const_data_ptr())
        return y

    wrapped = torchjax.to_jax(f)
    x = jnp.full(1024, 1024.0)
    wrapped(x)
    second = x.at[0].set(512.0)
    out = wrapped(second)  # another shape than the shortcut's: its other way
    np.testing.assert_array_equal(out, second[:512] * 2)
    assert out.shape == (512,) and out.unsafe_buffer_pointer() == seen[-1]
    assert binds[0] == 1


def test_an_output_that_changes_with_the_values(binds):
    def f(t):  # an untyped function: shape, dtype and structure follow the values
        n = int(t[0])
        if n == 1:
            return t.long()
        if n == 2:
            return (t[:2], t.sum())
        return t[:n]

    wrapped = torchjax.to_jax(f)
    x = jnp.array([3.0, 1.0, 2.0, 4.0])
    np.testing.assert_array_equal(wrapped(x), x[:3])
    for first, expected in [(4.0, x.at[0].set(4.0)), (1.0, x.at[0].set(1.0).astype(jnp.int32))]:
        got = wrapped(x.at[0].set(first))
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)
    pair = wrapped(x.at[0].set(2.0))
    np.testing.assert_array_equal(pair[0], [2.0, 1.0])
    assert float(pair[1]) == 9.0
    np.testing.assert_array_equal(wrapped(x), x[:3])
    assert binds[0] == 1


def test_a_declared_output_is_checked_on_a_repeated_call(binds):
    def f(t):
        return t if t.sum() == 0 else t[:2]  # the second call's output breaks the declaration

    wrapped = torchjax.to_jax(f, result_shape_dtypes=jax.ShapeDtypeStruct((4,), jnp.float32))
    np.testing.assert_array_equal(wrapped(jnp.zeros(4)), np.zeros(4))
    with pytest.raises(OutputMismatchError, match=r"float32\[2\] at out.*float32\[4\]"):
        wrapped(jnp.arange(4.0))
    assert binds[0] == 1


def test_outputs_that_need_converting_on_a_repeated_call(binds):
    w = torch.ones(4, requires_grad=True)

    def grad_inside(t):
        with torch.enable_grad():
            return t * w  # requires grad: detached on the way out

    wrapped = torchjax.to_jax(grad_inside)
    conj = torchjax.to_jax(lambda t: t.conj())
    negated = torchjax.to_jax(lambda t: torch._neg_view(t))
    strided = torchjax.to_jax(lambda t: (t * 1).view(2, 2).t())
    z = jnp.array([1 + 2j, 3 - 1j])
    x = jnp.arange(4.0)
    for _ in range(2):
        np.testing.assert_array_equal(wrapped(x), x)
        np.testing.assert_array_equal(conj(z), jnp.conj(z))
        np.testing.assert_array_equal(negated(x), -x)
        np.testing.assert_array_equal(strided(x), x.reshape(2, 2).T)
    assert binds[0] == 4


def test_a_repeated_call_under_transforms_and_modes():
    f = torchjax.to_jax(lambda t: torch.sin(t) * 2)
    x = jnp.linspace(0.0, 1.0, 4)
    f(x)
    np.testing.assert_allclose(jax.jit(f)(x), jnp.sin(x) * 2, rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(f)(x[None]), jnp.sin(x)[None] * 2, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda v: f(v).sum())(x), 2 * jnp.cos(x), rtol=1e-6)
    with torch.inference_mode():
        np.testing.assert_allclose(f(x), jnp.sin(x) * 2, rtol=1e-6)
    with torch.no_grad():
        np.testing.assert_allclose(f(x), jnp.sin(x) * 2, rtol=1e-6)
    double = torchjax.to_jax(lambda t: t.double())
    z = jnp.zeros(2, jnp.float32)
    assert double(z).dtype == jnp.float32
    with jax.enable_x64(True):
        assert double(z).dtype == jnp.float64
        assert double(z).dtype == jnp.float64
    assert double(z).dtype == jnp.float32


def test_the_users_exception_on_a_repeated_call_is_theirs(binds):
    def f(t):
        if t.sum() > 0:
            raise ValueError("the user's own message")
        return t + 1

    wrapped = torchjax.to_jax(f)
    wrapped(jnp.zeros(3))
    with pytest.raises(ValueError, match="the user's own message"):
        wrapped(jnp.ones(3))
    assert binds[0] == 1


def test_the_traceback_of_a_repeated_call_shows_the_users_frames_only():
    def users_function(t):
        if t.sum() > 0:
            raise ValueError("the user's own message")
        return t + 1

    wrapped = torchjax.to_jax(users_function)
    names = []
    for x in (jnp.ones(3), jnp.zeros(3), jnp.ones(3)):  # the full way, then the shortcut
        try:
            wrapped(x)
        except ValueError as e:
            frames = traceback.extract_tb(e.__traceback__)
            names.append([f.name for f in frames if f.filename.startswith(PACKAGE)])
            assert frames[-1].name == "users_function"
    assert names == [[], []]


def test_repeated_calls_from_threads():
    f = torchjax.to_jax(lambda a, b: a * b + 1)
    f(jnp.ones(8), jnp.ones(8))

    def work(k):
        xs = [jnp.full(8, float(k * 100 + i)) for i in range(50)]
        return all(bool((f(x, x) == x * x + 1).all()) for x in xs)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(8)))


def test_python_numbers_take_the_full_way(binds):
    f = torchjax.to_jax(lambda t, s: t * s)
    for s in (2.0, 2.0, 3):
        np.testing.assert_array_equal(f(jnp.arange(3.0), s), np.arange(3.0) * s)
    assert binds[0] == 3


def test_a_python_number_where_an_array_was_declared_is_an_error(binds):
    # A number is a 0-d array: under jit, copied into a buffer of four, it was broadcast.
    declared = jax.ShapeDtypeStruct((4,), jnp.float32)
    x = jnp.arange(4.0)
    message = r"returned the Python number 3.5 \(a 0-d array\) at out, but float32\[4\]"
    eager = torchjax.to_jax(lambda t: 3.5, result_shape_dtypes=declared)
    for _ in range(3):
        with pytest.raises(OutputMismatchError, match=message):
            eager(x)
    number = [False]
    jitted = jax.jit(torchjax.to_jax(lambda t: 3.5 if number[0] else t * 2))
    np.testing.assert_array_equal(jitted(x), np.arange(4.0) * 2)
    number[0] = True
    for _ in range(2):
        # XLA reports the callback's exception as its own (a JaxRuntimeError, or a
        # ValueError where the call runs on the dispatching thread).
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match=message):
            jitted(x).block_until_ready()
    # A number where a 0-d array is expected is fine, eagerly and under jit.
    scalar = torchjax.to_jax(
        lambda t: 3.5, result_shape_dtypes=jax.ShapeDtypeStruct((), jnp.float32)
    )
    assert float(scalar(x)) == 3.5 and float(jax.jit(scalar)(x)) == 3.5


def test_a_sparse_output_on_a_repeated_call_is_named(binds):
    sparse = [False]
    f = torchjax.to_jax(lambda t: (t * 2).to_sparse() if sparse[0] else t * 2)
    np.testing.assert_array_equal(f(jnp.arange(4.0)), np.arange(4.0) * 2)
    sparse[0] = True
    for _ in range(2):
        with pytest.raises(torchjax.errors.ConversionError, match=r"out is a torch.sparse_coo"):
            f(jnp.arange(4.0))


def test_an_output_held_by_a_weak_reference_is_copied(binds):
    # torch keeps a tensor's Python object alive while JAX holds its memory, so a weak
    # reference to an output would still reach it, and a write through it would change
    # the JAX array returned before.
    cache = weakref.WeakValueDictionary()
    kept = []

    def accumulate(t):
        buf = cache.get("sum")
        if buf is None:
            buf = torch.zeros(4)
            cache["sum"] = buf
            kept.append(buf)  # a strong reference too, from the second call on
        buf.add_(t)
        return buf

    f = torchjax.to_jax(accumulate)
    outs = [f(jnp.ones(4)) for _ in range(4)]
    for k, out in enumerate(outs):
        np.testing.assert_array_equal(out, np.full(4, k + 1.0))
    del kept[:]
    storages = weakref.WeakValueDictionary()

    def weak_storage(t):
        y = t * 2
        storages["y"] = y.untyped_storage()
        return y

    g = torchjax.to_jax(weak_storage)
    outs = [g(jnp.full(4, float(k))) for k in range(3)]
    for k, out in enumerate(outs):
        np.testing.assert_array_equal(out, np.full(4, 2.0 * k))
    for storage in list(storages.values()):  # what a weak reference still reaches
        storage.fill_(7)
    for k, out in enumerate(outs):
        np.testing.assert_array_equal(out, np.full(4, 2.0 * k))
    assert binds[0] == 2


DELETE_KEPT = """
import jax.numpy as jnp, numpy as np, torch, torchjax
cache = []
f = torchjax.to_jax(lambda t: (cache.append(t), t * 2)[1])
xs = [jnp.arange(4.0) + k for k in range(3)]  # the first call, then the shortcut
for x in xs:
    f(x)
nested = torchjax.to_jax(lambda p: (cache.append(p["a"]), p["a"] + 1)[1])
ys = [jnp.arange(4.0) + 10 + k for k in range(3)]
for y in ys:
    nested({"a": y})
z = jnp.arange(4.0) + 20
t = torchjax.tree_to_torch(z)
for x in xs + ys + [z]:
    x.delete()
expected = [np.arange(4.0) + k for k in (0, 1, 2, 10, 11, 12)]
for kept, want in zip(cache, expected, strict=True):
    assert kept.tolist() == want.tolist()
assert t.tolist() == [20.0, 21.0, 22.0, 23.0]
print("ok")
"""


def test_deleting_an_array_torch_kept_is_safe():
    # jaxlib aborts the process when an array it exported itself is deleted while the
    # export is held; torchjax exports a new array object on the same buffer, as
    # jax.Array.__dlpack__ does. In a subprocess: a regression aborts it, not the suite.
    done = subprocess.run(
        [sys.executable, "-c", DELETE_KEPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_nested_arguments_skip_the_bind_while_their_structure_stays(binds):
    f = torchjax.to_jax(lambda p, x: torch.tanh(x @ p["w"] + p["b"]) * p["s"][0])
    p = {"w": jnp.arange(6.0).reshape(3, 2) / 6, "b": jnp.ones(2), "s": [jnp.full(2, 2.0)]}
    x = jnp.arange(12.0).reshape(4, 3) / 12

    def expected(p, x):
        return np.asarray(jnp.tanh(x @ p["w"] + p["b"]) * p["s"][0])

    for k in range(3):
        q = {**p, "b": p["b"] * k}  # new values, the same structure: the shortcut
        np.testing.assert_allclose(f(q, x), expected(q, x), rtol=1e-6)
    assert binds[0] == 1
    # Another structure, or a Python number among the leaves: the full way, still right.
    np.testing.assert_allclose(f({**p, "extra": jnp.ones(1)}, x), expected(p, x), rtol=1e-6)
    np.testing.assert_allclose(f({**p, "s": (p["s"][0],)}, x), expected(p, x), rtol=1e-6)
    np.testing.assert_allclose(f({**p, "s": [2.0]}, x), expected(p, x), rtol=1e-6)
    assert binds[0] == 4


def test_module_to_jax_apply_skips_the_bind_and_checks_as_a_first_call(binds):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5))
    apply, variables = torchjax.module_to_jax(module)
    x = jnp.arange(12.0).reshape(4, 3)
    saved = jax.tree_util.tree_map(np.array, variables)
    for _ in range(3):
        with torch.no_grad():
            expected = module(torch.from_numpy(np.array(x))).numpy()
        np.testing.assert_allclose(apply(variables, x), expected, rtol=1e-5, atol=1e-6)
    assert binds[0] == 1
    # New parameter values through the shortcut: the module's own with those values.
    scaled = jax.tree_util.tree_map(lambda v: v * 2, variables)
    with torch.no_grad():
        for t in module.parameters():
            t.mul_(2)
        expected = module(torch.from_numpy(np.array(x))).numpy()
    np.testing.assert_allclose(apply(scaled, x), expected, rtol=1e-5, atol=1e-6)
    assert binds[0] == 1
    jax.tree_util.tree_map(np.testing.assert_array_equal, variables, saved)  # unchanged
    # A write into a parameter on a repeated call is refused as on a first call.
    writes = torch.nn.Linear(3, 5)
    writes.register_forward_pre_hook(lambda m, a: m.weight.data.mul_(0) if a[0].sum() else None)
    apply_w, variables_w = torchjax.module_to_jax(writes)
    apply_w(variables_w, jnp.zeros((4, 3)))
    before = jax.tree_util.tree_map(np.array, variables_w)
    with pytest.raises(InPlaceMutationError, match=r"weight"):
        apply_w(variables_w, x)
    jax.tree_util.tree_map(np.testing.assert_array_equal, variables_w, before)


# -- to_torch ---------------------------------------------------------------------------------
@pytest.fixture
def flattens(monkeypatch):
    """The number of to_torch calls that flattened their arguments (the full way)."""
    count = [0]

    class Counting:
        def __getattr__(self, name):
            return getattr(jax.tree_util, name)

        def tree_flatten(self, tree, *args, **kwargs):
            if isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[1], dict):
                count[0] += 1  # a call's (args, kwargs)
            return jax.tree_util.tree_flatten(tree, *args, **kwargs)

    monkeypatch.setattr(_to_torch, "_tree", Counting())
    return count


def test_a_repeated_to_torch_call_skips_the_flattening(flattens):
    f = torchjax.to_torch(lambda a, b: jnp.sin(a) * b)
    a, b = torch.linspace(0, 1, 5), torch.full((5,), 3.0)
    for _ in range(3):
        torch.testing.assert_close(f(a, b), torch.sin(a) * b)
    assert flattens[0] == 1
    torch.testing.assert_close(f(a.double(), b), (torch.sin(a) * b))  # float64 -> float32
    torch.testing.assert_close(f(a[:3], b[:3]), torch.sin(a[:3]) * b[:3])
    torch.testing.assert_close(f(a, b=b), torch.sin(a) * b)
    assert flattens[0] == 4


def test_a_repeated_to_torch_call_differentiates(flattens):
    f = torchjax.to_torch(lambda a: jnp.sin(a).sum())
    a = torch.linspace(0, 1, 5)
    f(a)
    p = torch.nn.Parameter(a.clone())
    f(p).backward()
    torch.testing.assert_close(p.grad, torch.cos(a))
    torch.testing.assert_close(torch.func.grad(f)(a), torch.cos(a))
    torch.testing.assert_close(torch.func.vmap(f)(a[None]), torch.sin(a).sum()[None])
    with torch.no_grad():
        assert not f(p).requires_grad
    with fwAD.dual_level():  # forward mode without torch.func: the dual level alone says so
        tangent = fwAD.unpack_dual(f(fwAD.make_dual(a, torch.ones(5)))).tangent
    torch.testing.assert_close(tangent, torch.cos(a).sum())
    assert flattens[0] == 1


def test_a_repeated_to_torch_call_of_another_structure_is_another_signature(flattens):
    # As many tensors as arguments, but nested, or beside a number: not the shortcut's.
    def f(p, q):
        return p[0] * 100 + q if isinstance(p, list) else p * 2 + q

    wrapped = torchjax.to_torch(f)
    a, b = torch.ones(3), torch.full((3,), 5.0)
    torch.testing.assert_close(wrapped([a], b), torch.full((3,), 105.0))
    for _ in range(3):
        torch.testing.assert_close(wrapped(a, b), torch.full((3,), 7.0))
    torch.testing.assert_close(wrapped([a], b), torch.full((3,), 105.0))

    def g(p, s):
        return p["x"] * s - p["y"] if isinstance(p, dict) else p - s

    wrapped = torchjax.to_torch(g)
    x, y = torch.ones(2), torch.full((2,), 3.0)
    torch.testing.assert_close(wrapped({"x": x, "y": y}, 2.0), torch.full((2,), -1.0))
    for _ in range(3):
        torch.testing.assert_close(wrapped(x, y), torch.full((2,), -2.0))


def test_x64_is_part_of_a_repeated_to_torch_call(flattens):
    f = torchjax.to_torch(lambda a: a * 2)
    a = torch.arange(3, dtype=torch.float64)
    assert f(a).dtype == torch.float32
    with jax.enable_x64(True):
        assert f(a).dtype == torch.float64
        assert f(a).dtype == torch.float64
    assert f(a).dtype == torch.float32
    assert flattens[0] == 3


def _unaligned(a):
    """`a`'s values in memory one element past a 64-byte boundary."""
    return torch.cat([torch.zeros(1, dtype=a.dtype), a.reshape(-1)])[1:].view(a.shape)


@pytest.mark.parametrize(
    "variant",
    [
        lambda a: a.t(),  # the same shape, other strides
        _unaligned,
        lambda a: a.to(torch.complex64).conj(),  # the conjugate bit
        lambda a: torch._neg_view(a.to(torch.complex64)),  # the negative bit
    ],
    ids=["transposed", "unaligned", "conj", "neg"],
)
def test_a_repeated_to_torch_call_of_another_layout(flattens, variant):
    # The shortcut aliases a dense, aligned CPU tensor as it is; any other goes the full
    # way (a copy), with the values of the tensor as torch reads it.
    f = torchjax.to_torch(lambda a: a @ jnp.arange(3.0, dtype=a.dtype) + a.sum())
    base = torch.arange(9.0).reshape(3, 3)
    a = variant(base)
    first = torch.randn(3, 3).to(a.dtype)
    f(first)  # the signature's first call: contiguous
    expected = np.asarray(a.resolve_conj().resolve_neg().contiguous())
    expected = expected @ np.arange(3.0) + expected.sum()
    np.testing.assert_allclose(f(a).numpy(), expected, rtol=1e-6)
    np.testing.assert_array_equal(base.numpy(), np.arange(9.0).reshape(3, 3))
    assert flattens[0] == 1


def test_a_repeated_to_torch_call_returns_memory_of_its_own(flattens):
    # XLA may hand an input back as an output, or one buffer for two outputs: torch must
    # not see two tensors that secretly share memory.
    same = torchjax.to_torch(lambda a: a)
    twice = torchjax.to_torch(lambda a: (a * 2, a * 2))
    a = torch.arange(4.0)
    for _ in range(3):
        out = same(a)
        out.add_(100)
        np.testing.assert_array_equal(a.numpy(), np.arange(4.0))
        x, y = twice(a)
        x.add_(100)
        np.testing.assert_array_equal(y.numpy(), np.arange(4.0) * 2)
    assert flattens[0] == 2


def test_a_repeated_to_torch_call_of_a_parameter_under_no_grad(flattens):
    f = torchjax.to_torch(lambda a: jnp.cos(a))
    p = torch.nn.Parameter(torch.linspace(0, 1, 5))
    f(p.detach())
    with torch.no_grad():
        out = f(p)
    assert not out.requires_grad
    torch.testing.assert_close(out, torch.cos(p.detach()))
    out = f(p)
    assert out.requires_grad  # grad mode on: through autograd
    torch.testing.assert_close(torch.autograd.grad(out.sum(), p)[0], -torch.sin(p.detach()))
    assert flattens[0] == 1


def test_a_dropped_wrapper_frees_its_function_at_once():
    # Without waiting for the cycle collector: the shortcut holds no cycle (docs/how_it_works.md,
    # section 9: "a dropped wrapper, its closure ... are freed at once").
    import gc
    import weakref

    class Fn:
        def __call__(self, t):
            return t * 2

    fn = Fn()
    gone = weakref.ref(fn)
    wrapped = torchjax.to_jax(fn)
    unwrapped = torchjax.to_torch(lambda a: a * 2)
    for _ in range(2):  # the second call takes (and the first sets up) the shortcut
        wrapped(jnp.ones(3))
        unwrapped(torch.ones(3))
    jax_side = weakref.ref(unwrapped)
    gc.disable()
    try:
        del fn, wrapped, unwrapped
        assert gone() is None
        assert jax_side() is None
    finally:
        gc.enable()


# ------------------------------------- every mirror of _hot.py against its reference
# _hot.py writes out again, for speed, steps whose reference lives elsewhere. Each style
# below reaches one mirror on its second call; with _hot.ENABLED off the same calls take
# the references. The two must agree on every route: what the call returns or raises,
# what it warns, the caller's arrays, and what a kept input reads afterwards.


def _write(x, kept):
    x.add_(1)
    return x * 2


def _data_write(x, kept):
    x.data.mul_(2)
    return x * 2


def _pointer_reader(x, kept):
    return torch.from_numpy(x.numpy() * 2)  # asks for a writable pointer, writes nothing


def _fresh(x, kept):
    return torch.sin(x) * 2


def _the_input(x, kept):
    return x


def _kept_input(x, kept):
    kept.append(x)
    return x * 2


ROUTES = [_write, _data_write, _pointer_reader, _fresh, _the_input, _kept_input]

# style: (jitted, number of inputs, two outputs, the mirror it reaches)
STYLES = {
    "eager f(x)": (False, 1, False, "eager_call, guarded_call_one"),
    "eager f(x, y)": (False, 2, False, "eager_call, guarded_call"),
    "jit f(x)": (True, 1, False, "jit_hot_host_one"),
    "jit f(x, y)": (True, 2, False, "jit_hot_host, guarded_call"),
    "jit f(x, y) -> (a, b)": (True, 2, True, "jit_host"),
}


def _outcome(style: str, route, enabled: bool, monkeypatch) -> tuple[dict, int]:
    """What the second and third calls of `route` in `style` did, and how often the
    references ran during the second call."""
    from torchjax._to_jax import _hot
    from torchjax._to_jax._call._plan import CallPlan
    from torchjax._to_jax._torch_call import _lowering

    jitted, n_in, two_out, _ = STYLES[style]
    monkeypatch.setattr(_hot, "ENABLED", enabled)
    armed, kept = [False], []

    def fn(*ts):
        # The route on the second call only (and on its rerun on copies, where it asks).
        out = route(ts[0], kept) if armed[0] else ts[0] * 2
        return (out, out.sum() + 1) if two_out else out

    f = torchjax.to_jax(fn)
    f = jax.jit(f) if jitted else f
    args = [[jnp.arange(4.0) + k + 10 * i for i in range(n_in)] for k in range(3)]
    copies = [[np.array(a) for a in call] for call in args]
    jax.block_until_ready(f(*args[0]))
    references = [0]

    def counted(owner, name):
        real = getattr(owner, name)

        def spy(*a, **k):
            references[0] += 1
            return real(*a, **k)

        monkeypatch.setattr(owner, name, spy)

    counted(torch_call_p, "_bind")
    counted(_lowering, "_run_into")
    if not two_out:
        counted(CallPlan, "run")
    seen: dict = {}
    armed[0] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = jax.block_until_ready(f(*args[1]))
            seen["out"] = [np.asarray(o).tolist() for o in jax.tree_util.tree_leaves(out)]
        except Exception as e:  # noqa: BLE001 - the outcome compared
            # (Under jit, XLA's error may hold the message after a traceback: its frames
            # are the code that ran, not what it said.)
            said = [
                line
                for line in str(e).splitlines()
                if line and not line[0].isspace() and "Traceback (most recent" not in line
            ]
            seen["raised"] = (type(e).__name__, *said)
    armed[0] = False
    ran_references = references[0]
    seen["warned"] = sorted({w.category.__name__ for w in caught})
    jax.block_until_ready(f(*args[2]))  # XLA may reuse the second call's buffers now
    seen["kept"] = [t.detach().clone().cpu().numpy().tolist() for t in kept]  # (read-only)
    for call, saved in zip(args, copies, strict=True):
        for a, c in zip(call, saved, strict=True):
            np.testing.assert_array_equal(a, c)  # the caller's arrays, unchanged
    return seen, ran_references


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.__name__.strip("_"))
@pytest.mark.parametrize("style", list(STYLES))
def test_each_mirror_agrees_with_its_reference(style, route, monkeypatch):
    mirror, took_the_mirror = _outcome(style, route, True, monkeypatch)
    monkeypatch.undo()
    reference, took_the_reference = _outcome(style, route, False, monkeypatch)
    assert mirror == reference, STYLES[style][3]
    assert took_the_mirror == 0, f"the second call did not take {STYLES[style][3]}"
    assert took_the_reference > 0
    if route is _write or route is _data_write:  # (under jit, inside XLA's error)
        assert "InPlaceMutationError" in " ".join(reference["raised"])
    if route is _kept_input:
        assert reference["kept"] == [(np.arange(4.0) + 1).tolist()]
    if route is _pointer_reader:
        assert "CopyWarning" in reference["warned"]
