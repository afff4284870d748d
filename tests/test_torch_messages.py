"""Every phrase of torch's (and jaxlib's) error messages that torchjax matches, provoked from
torch itself: a release that rewords one fails here, by phrase (the matrix runs this on the
oldest and newest versions). The phrases live in src/torchjax/_compat/_messages.py.
"""

from __future__ import annotations

import copy

import jax
import pytest
import torch
from helpers import Cube, Square
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from torchjax._compat import _jax, _messages, _torch

pytestmark = pytest.mark.core


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        return e
    raise AssertionError("expected torch to raise")


def _fake(fn):
    def run():
        with FakeTensorMode(allow_non_fake_inputs=True):
            fn(torch.ones(4))

    return run


def _grad(f, x):
    x = x.clone().requires_grad_()
    torch.autograd.grad(f(x).sum(), x)


@torch.library.custom_op("torchjax_messages::no_fake_kernel", mutates_args=())
def _no_fake_kernel(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _nested_fast_path(x):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 1).eval()
    mask = torch.tensor([[False, False, True, True]])
    with torch.no_grad():
        encoder(x.reshape(1, 1, 4).expand(1, 4, 4), src_key_padding_mask=mask)


_REAL = torch.ones(3)  # a real tensor a fake run deep-copies

FAKE_LIMITS = {
    "data is not allocated": _fake(lambda x: torch.tensor_split(x, torch.tensor([1, 2]))),
    "not supported for tensor subclasses": _fake(lambda x: x.numpy()),
    "not available for 'meta' device type": _fake(lambda x: x.untyped_storage().tolist()),
    "no fake impl registered": _fake(lambda x: _no_fake_kernel(x)),
    "nestedtensorimpl doesn't support sizes": _fake(lambda x: _nested_fast_path(x)),
    'attempted to set the storage of a tensor on device "meta"': _fake(
        lambda x: copy.deepcopy(_REAL)
    ),
}

AUTODIFF = {
    "forward ad": lambda: torch.func.jvp(
        lambda w: torch.nn.functional.embedding_bag(
            torch.tensor([0, 1]), w.reshape(3, 1), torch.tensor([0]), mode="max"
        )[0],
        (torch.ones(3),),
        (torch.ones(3),),
    ),
    "forward mode": lambda: torch.func.jvp(Square.apply, (torch.ones(3),), (torch.ones(3),)),
    "jvp function": lambda: torch.func.jvp(Square.apply, (torch.ones(3),), (torch.ones(3),)),
    # igamma has no derivative in its first argument (torch 2.13 to 2.15); cdist's double
    # backward, used before, gained one in torch 2.15
    "derivative for": lambda: _grad(lambda x: torch.igamma(x, torch.ones(3)), torch.rand(3) + 1),
    "functorch": lambda: torch.func.vjp(Cube.apply, torch.ones(3)),
    "setup_context": lambda: torch.func.vjp(Cube.apply, torch.ones(3)),
    "does not require grad and does not have a grad_fn": lambda: torch.autograd.grad(
        torch.ones(2).sum(), [torch.ones(2, requires_grad=True)]
    ),
    "not differentiable": lambda: torch.func.vjp(
        lambda a: torch.linalg.qr(a, mode="complete")[0], torch.randn(4, 3)
    )[1](torch.ones(4, 4)),
    "appears to not have been used in the graph": lambda: torch.autograd.grad(
        (torch.ones(2, requires_grad=True) * 2).sum(), [torch.ones(2, requires_grad=True)]
    ),
    "support saved tensor hooks": lambda: torch.func.grad(
        lambda x: checkpoint(torch.sin, x, use_reentrant=False).sum()
    )(torch.ones(3)),
    "checkpoint is incompatible with .grad()": lambda: _grad(
        lambda x: checkpoint(torch.sin, x, use_reentrant=True), torch.ones(3)
    ),
}

VMAP = {
    "vmap": lambda: torch.func.vmap(lambda t: t.sum().item())(torch.ones(3, 2)),
    "batching rule": lambda: torch.func.vmap(lambda t: torch.column_stack([t, t]))(
        torch.ones(3, 2)
    ),
}


def test_every_phrase_has_its_case_here():
    assert set(FAKE_LIMITS) == set(_messages.FAKE_LIMIT_PHRASES)
    assert set(AUTODIFF) == set(_messages.AUTODIFF_PHRASES)
    assert set(VMAP) == set(_messages.VMAP_PHRASES)


@pytest.mark.parametrize("phrase", sorted(FAKE_LIMITS))
def test_fake_limit_phrase(phrase):
    error = _raised(FAKE_LIMITS[phrase])
    assert phrase in f"{type(error).__name__} {error}".lower(), error
    assert _messages.is_fake_limit(error)


def test_fake_limit_types():
    for fn in (lambda x: x.sum().item(), lambda x: torch.nonzero(x)):
        error = _raised(_fake(fn))
        assert isinstance(error, _messages.FAKE_LIMIT_ERRORS), type(error)
    assert not _messages.is_fake_limit(ValueError("the function's own"))


@pytest.mark.parametrize("phrase", sorted(AUTODIFF))
def test_autodiff_phrase(phrase):
    error = _raised(AUTODIFF[phrase])
    assert phrase in f"{type(error).__name__}: {error}".lower(), error
    assert _messages.is_autodiff_failure(error)


def test_forward_derivative_and_setup_context():
    assert _messages.lacks_forward_derivative(_raised(AUTODIFF["forward ad"]))
    assert _messages.lacks_forward_derivative(_raised(AUTODIFF["jvp function"]))
    assert _messages.needs_setup_context(_raised(AUTODIFF["setup_context"]))
    assert not _messages.is_autodiff_failure(ValueError("the function's own"))


def test_checkpoint_refusals():
    assert _messages.refuses_saved_tensor_hooks(_raised(AUTODIFF["support saved tensor hooks"]))
    reentrant = _raised(AUTODIFF["checkpoint is incompatible with .grad()"])
    assert _messages.is_reentrant_checkpoint(reentrant)
    assert not _messages.is_reentrant_checkpoint(_raised(AUTODIFF["functorch"]))


@pytest.mark.parametrize("phrase", sorted(VMAP))
def test_vmap_phrase(phrase):
    error = _raised(VMAP[phrase])
    assert phrase in f"{type(error).__name__}: {error}".lower(), error
    assert _messages.is_vmap_failure(error)


def test_missing_batching_rule_and_randomness():
    assert _messages.lacks_batching_rule(_raised(VMAP["batching rule"]))
    random = _raised(lambda: torch.func.vmap(lambda t: t + torch.rand(2))(torch.ones(3, 2)))
    assert _messages.refuses_randomness(random) and _messages.is_vmap_failure(random)


def test_runs_autograd_itself():
    def forces(x):
        x = x.detach().requires_grad_(True)
        return torch.autograd.grad((x**2).sum(), x)[0]

    assert _messages.runs_autograd_itself(_raised(lambda: torch.func.vmap(forces)(torch.ones(3))))


def test_saved_tensor_hooks():
    def run():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            torch.func.grad(lambda x: (x**2).sum())(torch.ones(3))

    assert _messages.refuses_saved_tensor_hooks(_raised(run))


def test_write_refusal():
    t = torch.zeros(3)
    _torch.set_throw_on_mutable_data_ptr(t)
    error = _raised(lambda: t.add_(1))
    assert _messages.WRITE_REFUSED in str(error) and _messages.is_write_refusal(error)
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = error
    assert _messages.is_write_refusal(wrapped)


def test_jaxlib_signature_mismatch():
    # jaxlib's DLPack import, called with more arguments than any jaxlib takes (0.12.1 takes
    # six): nanobind's message.
    capsule = torch.utils.dlpack.to_dlpack(torch.ones(2))
    device = jax.devices("cpu")[0]
    error = _raised(lambda: _jax.dlpack_import(capsule, device, *[None] * 10))
    assert _messages.matches_no_signature(error), error
    assert not _messages.matches_no_signature(ValueError(_messages.NO_MATCHING_SIGNATURE))


def test_custom_op_without_fake_kernel_is_named():
    error = _raised(FAKE_LIMITS["no fake impl registered"])
    assert _messages.custom_op_without_fake_kernel(error) == "torchjax_messages::no_fake_kernel"
    assert _messages.custom_op_without_fake_kernel(ValueError("the function's own")) is None


WANTS_INT64 = {
    "expected a long tensor for index": lambda i: torch.take(torch.ones(3), i),
    "target dtype to be long": lambda i: torch.nn.functional.nll_loss(torch.ones(2, 3), i),
    "should be type int64": lambda i: torch.nn.functional.max_unpool1d(
        torch.ones(1, 1, 2), i.reshape(1, 1, 2), 2
    ),
    "only applicable to index tensor of type longtensor": lambda i: torch.nn.functional.one_hot(
        i, 3
    ),
}


def test_every_int64_phrase_has_its_case_here():
    assert set(WANTS_INT64) == set(_messages.WANTS_INT64_PHRASES)


@pytest.mark.parametrize("phrase", sorted(WANTS_INT64))
def test_wants_int64_phrase(phrase):
    error = _raised(lambda: WANTS_INT64[phrase](torch.tensor([0, 1], dtype=torch.int32)))
    assert phrase in str(error).lower(), error
    assert _messages.wants_int64(error)
    WANTS_INT64[phrase](torch.tensor([0, 1]))  # int64 indices are accepted


def _lu(pivots):
    lu, _ = torch.linalg.lu_factor(torch.eye(2) + 1)
    return lu, pivots


WANTS_INT32 = {
    "should be a tensor of scalar type torch.int32": lambda p: torch.linalg.lu_solve(
        *_lu(p), torch.ones(2, 1)
    ),
    "tensor of torch.int32 dtype": lambda p: torch.lu_unpack(*_lu(p)),
}


def test_every_int32_phrase_has_its_case_here():
    assert set(WANTS_INT32) == set(_messages.WANTS_INT32_PHRASES)


@pytest.mark.parametrize("phrase", sorted(WANTS_INT32))
def test_wants_int32_phrase(phrase):
    error = _raised(lambda: WANTS_INT32[phrase](torch.tensor([1, 2])))  # int64 pivots
    assert phrase in str(error).lower(), error
    assert _messages.wants_int32(error)
    WANTS_INT32[phrase](torch.tensor([1, 2], dtype=torch.int32))  # int32 is accepted


_F = torch.nn.functional
_LONG = torch.ones(2, 3, dtype=torch.long)
# Each phrase provoked, with the dtypes the message must be read to name, in its order.
DTYPE_MISMATCH = {
    "have the same dtype": (lambda: _F.linear(_LONG, torch.ones(2, 3)), ["int64", "float32"]),
    "expected scalar type": (
        lambda: torch.bmm(torch.ones(1, 2, 2), torch.ones(1, 2, 2, dtype=torch.double)),
        ["float32", "float64"],
    ),
    "should be the same": (
        lambda: torch.nn.Conv1d(1, 1, 2)(torch.ones(1, 1, 3, dtype=torch.double)),
        ["float64", "float32"],
    ),
    "expected both vectors to have same dtype": (
        lambda: torch.dot(torch.ones(2), torch.ones(2, dtype=torch.double)),
        ["float32", "float64"],
    ),
    "not implemented for": (lambda: _F.softmax(_LONG, 0), ["int64"]),
    "can't be cast to the desired output type": (lambda: _LONG.add_(0.5), ["float32", "int64"]),
    "to have one of the following scalar types": (
        lambda: _F.embedding(torch.ones(2), torch.ones(3, 2)),
        ["int64", "int32", "float32"],
    ),
    "does not match weight dtype": (
        lambda: torch.nn.LSTM(2, 2)(torch.ones(1, 1, 2, dtype=torch.double)),
        ["float64", "float32"],
    ),
}


def test_every_dtype_mismatch_phrase_has_its_case_here():
    assert set(DTYPE_MISMATCH) == set(_messages.DTYPE_MISMATCH_PHRASES)


@pytest.mark.parametrize("phrase", sorted(DTYPE_MISMATCH))
def test_dtype_mismatch_phrase_and_its_dtypes(phrase):
    provoke, dtypes = DTYPE_MISMATCH[phrase]
    error = _raised(provoke)
    assert phrase in str(error).lower(), error
    assert _messages.mismatched_dtypes(error) == dtypes, error
    assert _messages.mismatched_dtypes(ValueError("the function's own: Long and Float")) == []


def test_expects_tensor_and_not_differentiable_input():
    error = _raised(lambda: torch.sin(2.0))
    assert _messages.EXPECTS_TENSOR in str(error) and _messages.expects_tensor(error)
    stats = torch.zeros(2, requires_grad=True)
    error = _raised(
        lambda: torch.func.vjp(
            lambda m: torch.nn.functional.batch_norm(torch.ones(3, 2), m, torch.ones(2)), stats
        )
    )
    assert _messages.not_differentiable_input(error), error
    assert not _messages.not_differentiable_input(ValueError("the function's own"))


def _backward(f, *inputs):
    def run():
        leaves = [x.clone().requires_grad_() for x in inputs]
        f(*leaves).sum().backward()

    return run


def _in_place_into_leaf():
    torch.ones(2, requires_grad=True).add_(1)


GRAD_REFUSALS = {
    "is not differentiable with respect to argument": lambda: torch.nn.functional.nll_loss(
        torch.zeros(1, 3), torch.tensor([1]), weight=torch.ones(3, requires_grad=True)
    ),
    "a leaf Variable that requires grad is being used in an in-place operation": (
        _in_place_into_leaf
    ),
    "does not support automatic differentiation": lambda: torch.nn.functional.silu(
        torch.ones(2, dtype=torch.complex64, requires_grad=True)
    ),
    "is not implemented": _backward(torch.igamma, torch.ones(3) + 1, torch.ones(3) + 1),
}

VIEW_REFUSALS = {
    "view size is not compatible": lambda: torch.ones(2, 3).t().view(6),
    "Cannot view a tensor with shape": _fake(lambda x: x.reshape(2, 2).t().view(4)),
}


def test_every_capture_refusal_phrase_has_its_case_here():
    assert set(GRAD_REFUSALS) == set(_messages.GRAD_REFUSAL_PHRASES)
    assert set(VIEW_REFUSALS) == set(_messages.VIEW_REFUSAL_PHRASES)


@pytest.mark.parametrize("phrase", sorted(GRAD_REFUSALS))
def test_grad_refusal_phrase(phrase):
    error = _raised(GRAD_REFUSALS[phrase])
    assert phrase in str(error) and _messages.refuses_grad(error)


@pytest.mark.parametrize("phrase", sorted(VIEW_REFUSALS))
def test_view_refusal_phrase(phrase):
    error = _raised(VIEW_REFUSALS[phrase])
    assert phrase in str(error) and _messages.refuses_view(error)
    assert not _messages.refuses_grad(error)
