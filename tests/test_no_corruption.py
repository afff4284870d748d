"""No silent corruption: a JAX array never changes, by any route, in any configuration.

Every test checks the caller's arrays against an independent copy made before the call,
and the error (type, argument path, fix) where one is due.
"""

import collections
import gc
import os
import re
import subprocess
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import ON_GPU
from torch._subclasses.fake_tensor import is_fake

import torchjax
from torchjax.errors import ConversionError, InPlaceMutationError, OutputMismatchError

pytestmark = pytest.mark.core  # the version matrix runs this module

F32_4 = jax.ShapeDtypeStruct((4,), jnp.float32)
real_calls = collections.Counter()


def _real(t):
    return not is_fake(t)


def _on_storage(storage):
    """A float32 tensor on `storage` (to read or write a kept storage)."""
    return torch.tensor([], dtype=torch.float32).set_(storage)


def _call(f, mode, x):
    """f(x) eagerly, under jit, or with declared outputs (no fake run) eagerly and under jit."""
    if mode == "eager":
        return torchjax.to_jax(f)(x)
    if mode == "jit":
        return jax.block_until_ready(jax.jit(torchjax.to_jax(f))(x))
    declared = torchjax.to_jax(f, result_shape_dtypes=F32_4)
    if mode == "declared":
        return declared(x)
    return jax.block_until_ready(jax.jit(declared)(x))


# -- 1, 2: writes by any route, with or without a fake run --------------------------------
def _data(t):
    t.data.mul_(2)


def _storage_fill(t):
    t.untyped_storage().fill_(0)


def _storage_setitem(t):
    t.untyped_storage()[0] = 7


def _tensor_on_storage(t):
    torch.tensor([], dtype=t.dtype).set_(t.untyped_storage()).fill_(3)


def _detach(t):
    t.detach().add_(1)


def _view(t):
    t.view(2, 2)[1].mul_(3)


def _as_strided(t):
    t.as_strided((2,), (2,)).zero_()


def _out_kwarg(t):
    torch.add(t, 1, out=t)


def _init(t):
    torch.nn.init.zeros_(t)


def _numpy(t):
    t.numpy()[0] = 9  # numpy() is refused in fake runs: only the real run sees this


ROUTES = [
    _data,
    _storage_fill,
    _storage_setitem,
    _tensor_on_storage,
    _detach,
    _view,
    _as_strided,
    _out_kwarg,
    _init,
    *([] if ON_GPU else [_numpy]),  # .numpy() of a GPU tensor fails before any write
]


def _writer(route):
    def fn(t):
        real_calls[route.__name__] += _real(t)
        route(t)
        return t * 1

    fn.__qualname__ = f"write{route.__name__}"
    return fn


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.__name__)
@pytest.mark.parametrize("mode", ["eager", "jit", "declared", "declared_jit"])
def test_no_write_reaches_the_callers_array(route, mode):
    x = jnp.arange(4.0)
    before = np.array(x)
    real_calls.clear()
    expected = r"(?s)modifies its input args\[0\] in place.*clone"
    if route is _numpy and mode == "jit":
        expected = "(?s)numpy.*result_shape_dtypes"  # no fake run of .numpy(): declare outputs
    with pytest.raises(Exception, match=expected):
        _call(_writer(route), mode, x)
    np.testing.assert_array_equal(x, before)
    if mode == "jit" and route is not _numpy:
        assert real_calls[route.__name__] == 0  # caught by the fake run, before real data
    if mode == "eager":
        # No fake run when there is data: the real run's write is refused by the storage.
        assert real_calls[route.__name__] >= 1


@pytest.mark.parametrize("mode", ["eager", "declared"])
def test_in_place_error_type_and_message(mode):
    x = jnp.arange(4.0)
    with pytest.raises(InPlaceMutationError, match=r"(?s)args\[0\].*x = x\.clone\(\)"):
        _call(lambda t: (t.data.mul_(2), t * 1)[1], mode, x)
    np.testing.assert_array_equal(x, np.arange(4.0))


@pytest.mark.parametrize(
    "fn, advice",
    [
        (lambda t: t.mul_(2), r"`y = x\.mul\(\.\.\.\)` for `x\.mul_\(\.\.\.\)`"),
        (lambda t: torch.sin(t, out=t), r"(?s)`y = torch\.sin\(\.\.\.\)`, instead of .*out="),
        # No out-of-place Tensor.zero / Tensor.fill: the general advice, which is true.
        (lambda t: t[0].zero_(), r"(?s)x = x\.clone\(\)`, then write into x"),
        (lambda t: t.fill_(1.0), r"(?s)x = x\.clone\(\)`, then write into x"),
    ],
)
def test_in_place_advice_names_the_op_the_fake_run_saw(fn, advice):
    x = jnp.arange(4.0)
    with pytest.raises(InPlaceMutationError, match=advice) as info:
        jax.jit(torchjax.to_jax(fn))(x)
    # Advice that names a method names one torch has.
    for method in re.findall(r"`y = x\.(\w+)\(", str(info.value)):
        assert hasattr(torch.Tensor, method), method
    for function in re.findall(r"`y = torch\.(\w+)\(", str(info.value)):
        assert hasattr(torch, function), function
    np.testing.assert_array_equal(x, np.arange(4.0))


def _branchy(t):
    if t.sum() > 0:  # a write that only real data takes: no fake run can see it
        t.data.add_(1)
    return t * 1


@pytest.mark.parametrize("mode", ["eager", "declared", "declared_jit"])
def test_value_dependent_write_is_refused(mode):
    x = jnp.arange(4.0)
    kind = InPlaceMutationError if mode != "declared_jit" else Exception
    with pytest.raises(kind, match=r"(?s)args\[0\].*refused it.*caller's array is unchanged"):
        _call(_branchy, mode, x)
    np.testing.assert_array_equal(x, np.arange(4.0))


def test_module_forward_writing_a_parameter_through_data():
    class Clamp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.tensor([-2.0, -1.0, 1.0, 2.0]))

        def forward(self, x):
            self.weight.data.clamp_(-1, 1)
            return x * self.weight

    module = Clamp()
    apply, variables = torchjax.module_to_jax(module)
    weight = np.array(variables["params"]["weight"])
    for run in (apply, jax.jit(apply)):
        with pytest.raises(InPlaceMutationError, match=r"variables\['params'\]\['weight'\]"):
            run(variables, jnp.ones(4))
    np.testing.assert_array_equal(variables["params"]["weight"], weight)
    np.testing.assert_array_equal(module.weight.detach().numpy(), weight)


@pytest.mark.parametrize("mode", ["eager", "jit", "declared", "declared_jit"])
@pytest.mark.cpu_only  # .numpy() reads host memory
def test_readers_that_ask_for_write_access_still_work(mode):
    # .numpy() and data_ptr() ask for a writable pointer without writing: such a function
    # runs on copies (after one refused attempt), with the right values, every time.
    def f(t):
        if _real(t):
            t.data_ptr()
            return torch.from_numpy(np.sin(t.numpy()))
        return torch.sin(t)

    x = jnp.arange(4.0)
    for _ in range(3):
        np.testing.assert_allclose(_call(f, mode, x), np.sin(np.arange(4.0)), rtol=1e-6)
    np.testing.assert_array_equal(x, np.arange(4.0))


# -- in-place view ops (metadata only) ------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "declared"])
def test_in_place_view_op_is_rejected_and_says_it_changes_no_data(mode):
    with pytest.raises(
        InPlaceMutationError, match=r"(?s)args\[0\] in place.*only the tensor's shape.*x\.t\(\)"
    ):
        _call(lambda t: t.unsqueeze_(0)[0], mode, jnp.ones(4))


def test_in_place_error_under_grad_names_the_users_argument():
    loss = torchjax.to_jax(lambda t: t.add_(1).sum())
    with pytest.raises(InPlaceMutationError, match=r"input args\[0\] in place"):
        jax.grad(loss)(jnp.arange(4.0))
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    declared = torchjax.to_jax(_branchy_sum, result_shape_dtypes=scalar)
    for transform in (jax.grad, _jvp):
        x = jnp.arange(4.0)
        with pytest.raises(InPlaceMutationError, match=r"input args\[0\] in place") as info:
            transform(declared)(x)
        assert "args[0][0]" not in str(info.value)
        np.testing.assert_array_equal(x, np.arange(4.0))


def _branchy_sum(t):
    return _branchy(t).sum()


def _jvp(f):
    return lambda x: jax.jvp(f, (x,), (x,))


def _summed(f, *rest):
    return lambda x: f(x, *rest).sum()


# -- 3: static leaves that compare equal ----------------------------------------------------
def test_static_leaves_of_different_types_are_different_signatures():
    full = torchjax.to_jax(lambda a, s: torch.full((2,), s))
    z = jnp.zeros(1)
    assert full(z, 1).dtype == jnp.int32
    assert full(z, 1.0).dtype == jnp.float32
    assert full(z, True).dtype == jnp.bool_
    assert full(z, 1).dtype == jnp.int32  # and back
    assert np.signbit(np.asarray(full(z, -0.0))).all()
    assert not np.signbit(np.asarray(full(z, 0.0))).any()
    # Complex numbers by the sign of each part: 0j == complex(-0.0, 0.0), hashes alike.
    for c in [0j, complex(-0.0, 0.0), complex(0.0, -0.0), 0j]:
        out = np.asarray(full(z, c))
        assert (np.signbit(out.real) == (np.copysign(1, c.real) < 0)).all(), c
        assert (np.signbit(out.imag) == (np.copysign(1, c.imag) < 0)).all(), c
    # Under jit: closures of each, one jaxpr with both, and jit's own static arguments.
    assert jax.jit(lambda z: full(z, 1))(z).dtype == jnp.int32
    assert jax.jit(lambda z: full(z, 1.0))(z).dtype == jnp.float32
    both = jax.jit(lambda z: (full(z, True), full(z, 1), full(z, 1.0)))(z)
    assert [b.dtype for b in both] == [jnp.bool_, jnp.int32, jnp.float32]
    static = jax.jit(full, static_argnums=1)
    assert [static(z, s).dtype for s in (1, 1.0, True)] == [jnp.int32, jnp.float32, jnp.bool_]


# -- 4: outputs that torch could still change -----------------------------------------------
def _shared_outputs():
    """(name, fn, change): fn returns memory torch keeps; change() writes into it later."""
    w = torch.arange(32.0)
    linear = torch.nn.Linear(16, 4)
    cache, storages = [], []

    def cached(x):
        y = x * 2
        if _real(y):
            cache.append(y)
        return y

    def storage_kept(x):
        y = x * 2
        if _real(y):
            storages.append(y.untyped_storage())
        return y

    def add(t):
        return lambda: t.data.add_(100)

    return [
        ("closed-over tensor", lambda x: w, add(w)),
        ("view of one", lambda x: w[16:], add(w)),  # 64-byte aligned: XLA could alias it
        ("its .data", lambda x: w.data, add(w)),
        ("a parameter", lambda x: linear.weight, add(linear.weight)),
        ("a view of a parameter", lambda x: linear.weight.detach()[0], add(linear.weight)),
        ("an output kept in a cache", cached, lambda: [c.add_(100) for c in cache]),
        ("its storage kept", storage_kept, lambda: [_on_storage(s).add_(100) for s in storages]),
    ]


@pytest.mark.parametrize("case", range(7))
def test_outputs_torch_keeps_are_copied(case):
    name, fn, change = _shared_outputs()[case]
    x = jnp.arange(4.0)
    eager = torchjax.to_jax(fn)(x)
    jitted = jax.jit(torchjax.to_jax(fn))(x)
    expected = np.array(eager)
    change()
    np.testing.assert_array_equal(eager, expected, err_msg=name)
    np.testing.assert_array_equal(jitted, expected, err_msg=name)


def test_fresh_outputs_stay_zero_copy():
    seen = {}

    def f(x):
        y = x * 2
        seen["y"] = y.const_data_ptr()
        return y

    def view(x):
        y = x * 2
        seen["view"] = y.const_data_ptr()
        return y.view(32, 32).t()[0]  # a view of a fresh result that nothing else holds

    out = torchjax.to_jax(f)(jnp.ones(1024))
    assert out.unsafe_buffer_pointer() == seen["y"]
    out = torchjax.to_jax(lambda x: (x * 2).view(32, 32))(jnp.ones(1024))
    np.testing.assert_array_equal(out, 2 * np.ones((32, 32)))
    ptr = {}

    def reshaped(x):
        y = x * 2
        ptr["y"] = y.const_data_ptr()
        return y.view(32, 32)

    assert torchjax.to_jax(reshaped)(jnp.ones(1024)).unsafe_buffer_pointer() == ptr["y"]
    np.testing.assert_array_equal(torchjax.to_jax(view)(jnp.ones(1024)), 2 * np.ones(32))


# -- 5: references kept past a call under jit ------------------------------------------------
@pytest.mark.parametrize("how", ["tensor", "view", "data", "storage", "tensor_on_storage"])
def test_input_kept_under_jit_keeps_its_values(how):
    kept = []

    def f(t):
        if _real(t):
            if how == "tensor":
                kept.append(t)
            elif how == "view":
                kept.append(t[1:])
            elif how == "data":
                kept.append(t.data)
            elif how == "storage":
                kept.append(t.untyped_storage())
            else:
                kept.append(_on_storage(t.untyped_storage()))
        return t * 2

    # The callback's input is an XLA temporary (x + 1), freed and reused after each call.
    g = jax.jit(lambda x: torchjax.to_jax(f)(x + 1) + 1)
    outs = [g(jnp.full(256, float(i))) for i in range(3)]
    jax.block_until_ready(outs)
    churn = [jax.jit(lambda x: x * 3 + 7)(jnp.full(256, 5.0)) for _ in range(10)]
    jax.block_until_ready(churn)
    if how == "storage":
        kept = [_on_storage(k) for k in kept]
    assert [float(k[0]) for k in kept] == [1.0, 2.0, 3.0]
    assert all(bool(torch.all(k == k[0])) for k in kept)
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out, 2 * (i + 1) + 1)


def test_input_kept_eagerly_still_refuses_writes():
    kept = []
    f = torchjax.to_jax(lambda t: (kept.append(t) if _real(t) else None, t * 2)[1])
    x = jnp.arange(4.0)
    f(x)
    with pytest.raises(RuntimeError, match="Cannot access data pointer"):
        kept[0].add_(1)
    np.testing.assert_array_equal(x, np.arange(4.0))


# -- 6: x64 --------------------------------------------------------------------------------
def test_x64_mode_is_part_of_every_signature():
    z = jnp.zeros(2, jnp.float32)
    f = torchjax.to_jax(lambda t: t.double())
    assert f(z).dtype == jnp.float32
    with jax.enable_x64(True):
        assert f(z).dtype == jnp.float64
        assert jax.jit(f)(z).dtype == jnp.float64
    g = torchjax.to_jax(lambda t: t.double())
    with jax.enable_x64(True):
        assert g(z).dtype == jnp.float64
    assert g(z).dtype == jnp.float32
    assert jax.jit(g)(z).dtype == jnp.float32


def test_declared_float64_is_the_same_dtype_eagerly_and_under_jit():
    spec = jax.ShapeDtypeStruct((2,), jnp.float64)
    f = torchjax.to_jax(lambda t: t.double() * 2, result_shape_dtypes=spec)
    z = jnp.ones(2, jnp.float32)
    assert f(z).dtype == jax.jit(f)(z).dtype == jnp.float32
    with jax.enable_x64(True):
        assert f(z).dtype == jax.jit(f)(z).dtype == jnp.float64
        np.testing.assert_array_equal(f(z), [2.0, 2.0])


# -- 8: nothing keeps a dropped wrapper or module alive -------------------------------------
def test_dropped_wrappers_and_modules_are_freed():
    refs = []
    for mode in ("eager", "jit", "grad", "declared"):
        w = torch.ones(4)
        refs.append(weakref.ref(w))
        spec = F32_4 if mode == "declared" else None
        f = torchjax.to_jax(lambda t, w=w: t * w, result_shape_dtypes=spec)
        x = jnp.arange(4.0)
        jax.block_until_ready({"jit": jax.jit(f), "grad": jax.grad(_summed(f))}.get(mode, f)(x))
        del w, f
    module = torch.nn.Linear(4, 2)
    refs.append(weakref.ref(module))
    apply, variables = torchjax.module_to_jax(module)
    jax.block_until_ready(jax.grad(_summed(apply, jnp.ones((3, 4))))(variables))
    # (blocking: a computation in flight holds its callback, and with it the function)
    jax.block_until_ready(jax.jit(apply)(variables, jnp.ones((3, 4))))
    del module, apply, variables
    # module_to_jax's forward refers to its own wrappers: one cycle, which the collector
    # frees (torch tensors in a cycle can take it two passes).
    gc.collect()
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


# -- 9: devices and errors at the edges -----------------------------------------------------
_DEVICE_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, torch, torchjax
cpu1 = jax.devices()[1]
x = jax.device_put(jnp.arange(4.0), cpu1)
f = torchjax.to_jax(lambda t: (t * 2, {"n": t.sum()}))
out, aux = f(x)
assert out.devices() == {cpu1} and aux["n"].devices() == {cpu1}, (out.devices(), aux)
assert (out == jnp.arange(4.0) * 2).all()
assert jax.jit(f)(x)[0].devices() == {cpu1}
assert torchjax.to_jax(lambda t: t * 2)(jnp.arange(2.0)).devices() == {jax.devices()[0]}
g = torchjax.to_jax(lambda t: t * 2)  # the second call takes the eager shortcut (HotCall)
assert [g(x).devices() for _ in range(2)] == [{cpu1}, {cpu1}]
# Uncommitted inputs give uncommitted outputs, as JAX's own ops do: a later op may then
# move them to another device's arrays. Committed inputs, on the first device too, commit.
cpu0 = jax.devices()[0]
y1 = jax.device_put(jnp.ones(4), cpu1)
for h in (torchjax.to_jax(lambda t: t * 2), f):  # the shortcut, and the full way
    for _ in range(3):
        out = h(jnp.arange(4.0))
        first = out if isinstance(out, jax.Array) else out[0]
        assert not first.committed and (jnp.arange(4.0) * 2).committed is False
        assert (first + y1).devices() == {cpu1} and ((first + y1) == jnp.arange(4.0) * 2 + 1).all()
        on0 = h(jax.device_put(jnp.arange(4.0), cpu0))
        on0 = on0 if isinstance(on0, jax.Array) else on0[0]
        assert on0.committed and on0.devices() == {cpu0}
add = torchjax.to_jax(lambda a, b: a + b)
add(x, x)  # a first call, on one device: the next, on two, takes the shortcut
for h in (torchjax.to_jax(lambda a, b: a + b), add):
    try:
        h(x, jax.device_put(jnp.ones(4), jax.devices()[0]))
    except torchjax.errors.ConversionError as e:
        assert "args[1] is committed to" in str(e), e
    else:
        raise AssertionError("no error for inputs on two devices")
from jax.sharding import NamedSharding, PartitionSpec
mesh = jax.make_mesh((2,), ("d",))
sharded = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, PartitionSpec("d")))
g(jnp.arange(4.0))  # the shortcut's signature: the same shape and dtype, on one device
try:
    g(sharded)
except torchjax.errors.ConversionError as e:
    assert "args[0] is sharded over 2 devices" in str(e), e
else:
    raise AssertionError("no error for a sharded input on a repeated call")
replicated = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, PartitionSpec()))
for convert in (g, torchjax.tree_to_torch):
    try:
        convert(replicated)
    except torchjax.errors.ConversionError as e:
        assert "is replicated on 2 devices" in str(e) and "addressable_shards[0]" in str(e), e
    else:
        raise AssertionError("no error for a replicated input")
one_copy = replicated.addressable_shards[0].data  # what the message says to convert
assert (g(one_copy) == jnp.arange(4.0) * 2).all()
assert torch.equal(torchjax.tree_to_torch(one_copy), torch.arange(4.0))
# Converted tensors are not committed, as jnp.asarray leaves an array: a jit over a mesh
# (data parallelism with module_to_jax's variables) places them; committed, it refused.
assert not torchjax.tree_to_jax(torch.ones(2)).committed
torch.manual_seed(0)
lin = torch.nn.Linear(3, 1)
apply, variables = torchjax.module_to_jax(lin)
assert not any(a.committed for a in jax.tree.leaves(variables))
rows = NamedSharding(mesh, PartitionSpec("d"))
data = jax.device_put(jnp.linspace(-1, 1, 24).reshape(8, 3), rows)
def dp_loss(p, x):
    return jax.lax.psum(jnp.sum(apply({"params": p, "buffers": {}}, x) ** 2), "d")
specs = dict(in_specs=(PartitionSpec(), PartitionSpec("d")), out_specs=PartitionSpec())
dp = jax.shard_map(dp_loss, mesh=mesh, **specs)
grads = jax.jit(jax.grad(dp))(variables["params"], data)
want = lambda p: jnp.sum((jnp.linspace(-1, 1, 24).reshape(8, 3) @ p["weight"].T + p["bias"]) ** 2)
ref = jax.grad(want)({k: jnp.asarray(v.detach().numpy()) for k, v in lin.named_parameters()})
for k in ref:
    assert np.allclose(grads[k], ref[k], rtol=1e-5), (k, grads[k], ref[k])
print("devices ok")
"""


def test_eager_outputs_go_where_the_inputs_are():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run(
        [sys.executable, "-c", _DEVICE_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert "devices ok" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda t: (t, torch.empty(3, device="meta")), r"out\[1\] is a meta tensor"),
        (lambda t: {"s": t.to_sparse()}, r"out\['s'\] is a torch.sparse_coo tensor.*to_dense"),
        (lambda t: (t, 2**40), r"Python int 1099511627776 at out\[1\].*does not fit int32"),
    ],
    ids=["meta", "sparse", "int_overflow"],
)
def test_outputs_without_a_jax_value_name_their_path(fn, match, mode):
    f = torchjax.to_jax(fn)
    if mode == "jit":
        f = jax.jit(f)
    kind = ConversionError if mode == "eager" else Exception
    with pytest.raises(kind, match=match):
        jax.block_until_ready(f(jnp.ones(3)))


@pytest.mark.parametrize(
    "make, hint",
    [
        (lambda: jax.random.key(0), "jax.random.key_data"),
        (lambda: jnp.ones(2, jnp.float8_e4m3b11fnuz), "Cast it"),
        (lambda: jnp.ones(2, jnp.int4), "Cast it"),
    ],
    ids=["prng_key", "float8", "int4"],
)
@pytest.mark.parametrize("declared", [False, True])
def test_inputs_torch_cannot_hold_name_their_path(make, hint, declared):
    spec = jax.ShapeDtypeStruct((), jnp.float32) if declared else None
    f = torchjax.to_jax(lambda x, *, k: x.sum(), result_shape_dtypes=spec)
    for run in (f, jax.jit(f)):
        with pytest.raises(ConversionError, match=rf"(?s)kwargs\['k'\] has dtype .*{hint}"):
            run(jnp.ones(2), k=make())


@pytest.mark.parametrize("leaf", [(4,), "float32", jnp.float32, torch.ones(4)])
def test_result_shape_dtypes_leaf_that_is_not_a_struct(leaf):
    f = torchjax.to_jax(lambda t: (t, t), result_shape_dtypes=(F32_4, leaf))
    with pytest.raises(OutputMismatchError, match=r"result_shape_dtypes .* at out\[1\].*Struct"):
        f(jnp.ones(4))


def test_namedtuple_class_made_on_every_call():
    def f(t):
        Pair = collections.namedtuple("Pair", "a b")
        return Pair(t, t * 2)

    # Under jit the fake run's class, then the real run's (XLA wraps the callback's error).
    with pytest.raises(Exception, match="OutputMismatchError.*class differs between calls"):
        jax.jit(torchjax.to_jax(f))(jnp.ones(2))
    # Eagerly each call's own output is returned: there is nothing to compare it with.
    out = torchjax.to_jax(f)(jnp.ones(2))
    np.testing.assert_array_equal(out.b, [2.0, 2.0])


@pytest.mark.parametrize("jit", [False, True])
def test_batch_norm_running_statistics_write_is_refused(jit):
    # batch_norm's CPU kernel writes running_mean/var through raw pointers: torch's schema
    # does not mark them mutable and their version counters do not move. The guard refuses
    # the write all the same, and the caller's arrays keep their values.
    def fn(x, mean, var):
        return torch.nn.functional.batch_norm(x, mean, var, training=True)

    f = torchjax.to_jax(fn)
    x, mean, var = jnp.arange(12.0).reshape(4, 3), jnp.zeros(3), jnp.ones(3)
    if jit:
        with pytest.raises(
            Exception, match=r"InPlaceMutationError: .*fn modifies its input args\[1\]"
        ):
            jax.jit(f)(x, mean, var)
    else:
        with pytest.raises(InPlaceMutationError, match=r"args\[1\]"):
            f(x, mean, var)
    np.testing.assert_array_equal(mean, np.zeros(3))
    np.testing.assert_array_equal(var, np.ones(3))
