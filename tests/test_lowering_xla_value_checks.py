"""lowering="xla" on torch functions that check their arguments' values (torch.cov,
torch.corrcoef, gaussian_nll_loss): torch.export cannot capture the check, so they are
captured without it (_xla/_value_checks.py). Values and gradients equal torch's and
torch.func's; every op lowers, and the function exports."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchjax

if importlib.util.find_spec("torchax") is None:
    pytest.skip("lowering='xla' needs torchax (the [xla] extra)", allow_module_level=True)

rng = np.random.default_rng(0)
X = rng.standard_normal((3, 5)).astype(np.float32)
FWEIGHTS = np.array([1, 2, 0, 3, 1], np.int32)  # int32: JAX's integers with x64 off
AWEIGHTS = rng.random(5).astype(np.float32)

CASES = {
    "cov": (lambda x: torch.cov(x), (X,)),
    "cov_of_a_vector": (lambda x: torch.cov(x[0]), (X,)),
    "cov_method_without_correction": (lambda x: x.cov(correction=0), (X,)),
    "cov_fweights": (lambda x, f: torch.cov(x, fweights=f), (X, FWEIGHTS)),
    "cov_aweights": (lambda x, a: torch.cov(x, aweights=a), (X, AWEIGHTS)),
    "cov_both_weights": (
        lambda x, f, a: torch.cov(x, correction=2, fweights=f, aweights=a),
        (X, FWEIGHTS, AWEIGHTS),
    ),
    "corrcoef": (lambda x: torch.corrcoef(x), (X,)),
    "corrcoef_method": (lambda x: x.corrcoef(), (X,)),
    "gaussian_nll_loss": (lambda x: F.gaussian_nll_loss(x, x * 0.5, x.abs() + 1), (X,)),
    "gaussian_nll_loss_shared_variance": (
        lambda x: F.gaussian_nll_loss(x, x * 0.5, x[:, 0].abs() + 1, full=True, reduction="sum"),
        (X,),
    ),
    "GaussianNLLLoss_module": (lambda x: torch.nn.GaussianNLLLoss()(x, x * 0.5, x.abs()), (X,)),
}


def _torch_args(args):
    # (torch wants int64 weights: the callback path widens int32 the same way)
    return [torch.tensor(a).long() if a.dtype == np.int32 else torch.tensor(a) for a in args]


@pytest.mark.parametrize("case", sorted(CASES))
def test_values_and_gradients_equal_torch(case):
    fn, args = CASES[case]
    f = torchjax.to_jax(fn, lowering="xla")
    np.testing.assert_allclose(
        jax.jit(f)(*args), fn(*_torch_args(args)).numpy(), rtol=1e-5, atol=1e-6
    )
    floating = tuple(i for i, a in enumerate(args) if a.dtype == np.float32)
    got = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=floating)(*args)
    ref = torch.func.grad(lambda *a: torch.sin(fn(*a)).sum(), argnums=floating)(*_torch_args(args))
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_op_lowers_and_the_function_exports(case):
    fn, args = CASES[case]
    report = torchjax.lowering_report(fn, *args)
    assert report.fully_lowered and report.exportable, report


def test_a_value_the_check_refuses_gives_nan_or_inf_instead_of_raising():
    # torch raises for weights that sum to zero; lowered, nothing raises inside jit.
    zero = np.zeros(5, np.float32)
    with pytest.raises(RuntimeError, match="weights sum to zero"):
        torch.cov(torch.tensor(X), aweights=torch.tensor(zero))
    got = torchjax.to_jax(lambda x, a: torch.cov(x, aweights=a), lowering="xla")(X, zero)
    assert not np.isfinite(np.asarray(got)).any()


def test_the_checks_are_skipped_only_while_capturing():
    # The callback path runs torch's own function, check included.
    f = torchjax.to_jax(lambda x, v: F.gaussian_nll_loss(x, x, v))
    with pytest.raises(ValueError, match="negative"):
        f(X, -np.ones_like(X))
    assert torch.overrides._get_current_function_mode() is None
