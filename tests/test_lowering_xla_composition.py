"""lowering="xla" where torch ops compose: in-place writes into buffers made from an input,
.detach() and no_grad blocks before such writes, 64-bit arithmetic with x64 off, shapes that
depend on values, derivatives taken inside. Each program is compared with torch itself
under jit, grad, vmap, jvp and hessian (torch.func, torch.autograd.functional, or a loop of
eager torch calls), or must be refused with a LoweringError that names the cause.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax
from torchjax.errors import LoweringError

# (find_spec, not importorskip: importing torchax outside torchjax's guard changes torch's
# global state, its device registration, which breaks torch.compile in later tests)
if importlib.util.find_spec("torchax") is None:
    pytest.skip("lowering='xla' needs torchax (the [xla] extra)", allow_module_level=True)

_INDEX = [[1, 0, 2], [0, 3, 1], [2, 2, 0], [3, 1, 3]]


def _index_add(x):
    out = x.new_zeros(3, x.shape[-1])
    out.index_add_(0, torch.tensor([0, 2, 2, 1]), x)
    return out


def _scatter_add(x):
    out = torch.zeros_like(x)
    out.scatter_add_(0, torch.tensor(_INDEX), x * 2)
    return out


def _scatter_reduce(x):
    out = torch.ones_like(x)
    out.scatter_reduce_(0, torch.tensor(_INDEX), x, "sum")
    return out


def _index_put(x):
    out = torch.empty_like(x).fill_(0.5)
    out[torch.tensor([3, 0])] = x[:2] * 3
    return out


def _masked_fill_after_copy(x):
    out = torch.zeros_like(x)
    out.copy_(x * x)
    out.masked_fill_(x > 0.5, 0.0)
    return out


def _slice_assignment(x):
    out = torch.full_like(x, 2.0)
    out[:, 1:] = x[:, :-1].sin()
    return out


def _shift(x):  # the issue's own example
    out = torch.zeros_like(x)
    out[1:] = 2.0 * x[:-1]
    return out


def _full_then_index_add(x):
    out = torch.full((3, x.shape[-1]), 0.25)
    out.index_add_(0, torch.tensor([1, 1, 0, 2]), x.tanh())
    return out


def _no_grad_write_into_buffer(x):  # torch stops what the no_grad block writes
    out = torch.zeros_like(x)
    with torch.no_grad():
        out[1:] = x[:-1]
    return out * x


def _no_grad_buffer_written_after(x):  # ... and differentiates what is written after it
    with torch.no_grad():
        b = torch.zeros_like(x)
        b[1:] = x[:-1]
    b[0] = x[0] * 3
    return b * x


def _no_grad_scaling_of_a_written_buffer(x):  # the fuzzer's: the value changes, not the
    out = torch.zeros_like(x)  # derivative (torch's autograd never sees a no_grad write)
    out[1:] = x[:-1] * 2
    with torch.no_grad():
        out.mul_(3.0)
    return out * x


def _detached_then_written(x):
    h = x * 2
    y = h.detach()
    y.add_(x.sin())
    return y * x


def _detach_stops(x):  # a plain .detach(): no gradient through it
    return x.detach() * x + x.sin()


PROGRAMS = [
    _index_add,
    _scatter_add,
    _scatter_reduce,
    _index_put,
    _masked_fill_after_copy,
    _slice_assignment,
    _shift,
    _full_then_index_add,
    _no_grad_write_into_buffer,
    _no_grad_buffer_written_after,
    _no_grad_scaling_of_a_written_buffer,
    _detached_then_written,
    _detach_stops,
]
_X = np.linspace(-1.0, 1.2, 12, dtype=np.float32).reshape(4, 3)


def _torch_loss(fn):
    return lambda t: (fn(t) ** 2).sum()


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__.strip("_"))
def test_value_and_gradient_under_jit_match_torch(fn):
    f = torchjax.to_jax(fn, lowering="xla")
    _close(jax.jit(f)(_X), fn(torch.tensor(_X)))
    want = torch.func.grad(_torch_loss(fn))(torch.tensor(_X))
    got = jax.jit(jax.grad(lambda a: jnp.sum(f(a) ** 2)))(_X)
    _close(got, want)
    assert np.abs(want.numpy()).max() > 0.1  # a gradient that is there to get wrong


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__.strip("_"))
def test_vmap_matches_a_loop_of_torch_calls(fn):
    f = torchjax.to_jax(fn, lowering="xla")
    xs = np.stack([_X, _X[::-1] * 0.5])
    want = torch.stack([fn(torch.tensor(x.copy())) for x in xs])
    _close(jax.vmap(f)(xs), want)
    grads = jax.vmap(jax.grad(lambda a: jnp.sum(f(a) ** 2)))(xs)
    for g, x in zip(grads, xs, strict=True):
        _close(g, torch.func.grad(_torch_loss(fn))(torch.tensor(x.copy())))


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__.strip("_"))
def test_jvp_matches_torch_autograd(fn):
    f = torchjax.to_jax(fn, lowering="xla")
    tangent = np.cos(np.arange(12, dtype=np.float32)).reshape(4, 3)
    out, tan = jax.jvp(f, (_X,), (tangent,))
    # (torch.autograd.functional.jvp: reverse mode twice, no forward-mode rule needed)
    want_out, want_tan = torch.autograd.functional.jvp(fn, torch.tensor(_X), torch.tensor(tangent))
    _close(out, want_out)
    _close(tan, want_tan)


@pytest.mark.parametrize(
    "fn", [_index_add, _shift, _no_grad_buffer_written_after, _detached_then_written]
)
def test_hessian_matches_torch_autograd(fn):
    f = torchjax.to_jax(fn, lowering="xla")
    small = _X[:, :2]
    got = jax.hessian(lambda a: jnp.sum(jnp.sin(f(a)) ** 2))(small)
    want = torch.autograd.functional.hessian(
        lambda t: (torch.sin(fn(t)) ** 2).sum(), torch.tensor(small)
    )
    _close(got, want, tol=1e-4)


def test_module_gcn_style_scatter_gradients_match_torch():
    class Conv(torch.nn.Module):  # the message passing of a graph-network layer
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x, edge_index):
            src, dst = edge_index
            messages = self.lin(x)[src]
            out = messages.new_zeros(x.shape[0], messages.shape[1])
            out.index_add_(0, dst, messages)
            return out.relu()

    torch.manual_seed(0)
    conv = Conv()
    edges = np.array([[0, 1, 1, 2, 3], [1, 0, 2, 3, 0]], dtype=np.int32)  # x64 off
    apply, variables = torchjax.module_to_jax(conv, lowering="xla")
    loss = lambda p, x: jnp.sum(apply({"params": p, "buffers": {}}, x, edges) ** 2)
    got = jax.jit(jax.grad(loss))(variables["params"], _X)
    out = conv(torch.tensor(_X), torch.tensor(edges, dtype=torch.int64))
    want = torch.autograd.grad((out**2).sum(), list(conv.parameters()))
    for (name, _), w in zip(conv.named_parameters(), want, strict=True):
        _close(got[name], w)
    assert np.abs(want[0].numpy()).max() > 0.1


def test_a_detached_value_written_while_its_source_is_read_again_is_refused():
    def fn(x):
        h = x * 2
        y = h.detach()
        y.add_(x.sin())  # torch writes h too, and differentiates the write through y only
        return y + h

    with pytest.raises(LoweringError, match=r"writes in place into the result of \.detach\(\)"):
        torchjax.to_jax(fn, lowering="xla")(_X)
    # (the callback path runs it as torch does)
    want = fn(torch.tensor(_X))
    _close(torchjax.to_jax(fn)(_X), want)


def test_float64_arithmetic_with_x64_off_is_refused_with_the_fix():
    def fn(x):
        return torch.logsumexp(x.double() * 100, 0).float()

    with pytest.raises(LoweringError, match=r"(?s)computes in float64 .*jax_enable_x64"):
        torchjax.to_jax(fn, lowering="xla")(_X)
    want = fn(torch.tensor(_X))  # finite, where float32 arithmetic would not lose it here
    _close(torchjax.to_jax(fn)(_X), want)


def test_a_float64_cast_that_computes_nothing_lowers():
    f = torchjax.to_jax(lambda x: (x * 3).double(), lowering="xla")
    _close(f(_X), _X * 3)
    assert torchjax.lowering_report(f, _X).fully_lowered


def test_float64_arithmetic_with_x64_on_lowers_in_float64():
    def fn(x):
        return torch.logsumexp(x.double() * 100, 0)

    with jax.enable_x64(True):
        f = torchjax.to_jax(fn, lowering="xla")
        x = _X.astype(np.float64)
        out = f(x)
        assert out.dtype == jnp.float64
        _close(out, fn(torch.tensor(x)), tol=1e-12)


@pytest.mark.parametrize(
    "fn",
    [lambda x: x[x > 0].sum(), lambda x: torch.nonzero(x), lambda x: torch.masked_select(x, x > 0)],
    ids=["mask_index", "nonzero", "masked_select"],
)
def test_a_value_dependent_shape_is_refused_naming_the_cause(fn):
    f = torchjax.to_jax(fn, lowering="xla")
    for call in (f, jax.jit(f)):
        with pytest.raises(LoweringError, match="shape depends on its inputs' values"):
            call(_X)


def test_a_derivative_taken_inside_is_refused_naming_the_call():
    def energy_and_forces(pos):
        pos = pos.detach().requires_grad_(True)
        energy = (torch.tanh(pos) ** 2).sum()
        (grad,) = torch.autograd.grad(energy, pos, create_graph=True)
        return energy, -grad

    f = torchjax.to_jax(energy_and_forces, lowering="xla")
    with pytest.raises(LoweringError, match=r"torch\.autograd\.grad, called at .*test_lowering"):
        f(_X)
    # the way out the message names: the derivative taken in JAX, around the lowered energy
    energy = torchjax.to_jax(lambda p: (torch.tanh(p) ** 2).sum(), lowering="xla")
    forces = -jax.grad(energy)(_X)
    _close(forces, energy_and_forces(torch.tensor(_X))[1].detach())


def test_int32_indices_reach_torch_as_int64_as_on_the_callback_path():
    seen = []

    def fn(x, idx):
        seen.append(idx.dtype)
        return x[idx].sum(0)

    f = torchjax.to_jax(fn, lowering="xla")
    idx = np.array([3, 1], dtype=np.int32)
    _close(f(_X, idx), _X[[3, 1]].sum(0))
    assert seen and set(seen) == {torch.int64}


@torch.library.custom_op("torchjax_composition::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:  # an op the op table cannot know
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_callback_at_symbolic_shapes_is_refused_naming_the_op_and_reported():
    f = torchjax.to_jax(lambda x: _twice(x)[:, :2] + 1, lowering="xla")
    spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 4"), jnp.float32)
    with pytest.raises(LoweringError, match=r"(?s)torchjax_composition.twice.* symbolic"):
        jax.export.export(jax.jit(f))(spec)
    report = torchjax.lowering_report(f, spec)
    assert not report.exportable
    assert [r.op for r in report.callbacks] == ["torchjax_composition.twice.default"]
    # at concrete shapes it runs, as a callback
    _close(f(np.ones((3, 4), np.float32)), np.full((3, 2), 3.0))


def test_slice_assignment_exports_at_a_symbolic_batch():
    f = torchjax.to_jax(_slice_assignment, lowering="xla")
    spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 3"), jnp.float32)
    exported = jax.export.export(jax.jit(f))(spec)
    served = jax.export.deserialize(exported.serialize())
    for n in (2, 5):
        x = np.linspace(-1, 1, 3 * n, dtype=np.float32).reshape(n, 3)
        _close(served.call(x), _slice_assignment(torch.tensor(x)))
    assert torchjax.lowering_report(f, spec).exportable


def test_a_capture_leaves_no_fake_tensor_in_user_state_and_tolerates_dead_proxies():
    import weakref

    class Box:
        pass

    box = Box()
    dead = [weakref.proxy(box)]  # a proxy whose referent is gone (torch.compile keeps such)
    del box
    names: dict = {}

    def fn(x):
        if not names:
            names[torch.ones(3)] = "w"  # a store keyed by a tensor the run makes
        return x * 2

    with pytest.raises(LoweringError, match="left one in a dict, as the key of 'w'"):
        torchjax.to_jax(fn, lowering="xla")(np.ones(3, np.float32))
    assert len(dead) == 1  # (the scan of the heap met the dead proxy without raising)
    names.clear()
    names[torch.ones(3)] = "w"  # filled before the capture: no leftover
    _close(torchjax.to_jax(fn, lowering="xla")(np.ones(3, np.float32)), np.full(3, 2.0))
