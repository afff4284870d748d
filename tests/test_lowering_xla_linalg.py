"""lowering="xla" on torch's linear algebra, whose ops torch.export captures behind an effect
token (the error check `_linalg_check_errors`): each lowers or falls back per op, and its
values and gradients equal torch's and torch.func's."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax
from torchjax.errors import LoweringError

if importlib.util.find_spec("torchax") is None:
    pytest.skip("lowering='xla' needs torchax (the [xla] extra)", allow_module_level=True)

rng = np.random.default_rng(0)
A = (rng.standard_normal((2, 3, 3)) + 3 * np.eye(3)).astype(np.float32)


def _t(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a))


def _spd(a):  # a symmetric positive definite matrix from any square one
    return a @ a.mT + torch.eye(a.shape[-1])


# (function, its arguments, whether torch differentiates it, whether every op lowers)
CASES = {
    "inv": (lambda a: torch.linalg.inv(a), (A,), True, True),
    "inv_ex": (lambda a: torch.linalg.inv_ex(a).inverse, (A,), True, True),
    "solve": (
        lambda a, b: torch.linalg.solve(a, b),
        (A, rng.standard_normal((2, 3, 4))),
        True,
        True,
    ),
    "solve_left_false": (
        lambda a, b: torch.linalg.solve(a, b, left=False),
        (A, rng.standard_normal((2, 4, 3))),
        True,
        True,
    ),
    "solve_batched_vector": (
        lambda a, b: torch.linalg.solve(a, b),
        (A, rng.standard_normal((2, 3))),
        True,
        True,
    ),
    "solve_broadcast": (
        lambda a, b: torch.linalg.solve(a, b),
        (A, rng.standard_normal((3, 2))),
        True,
        True,
    ),
    "solve_vector": (
        lambda a, b: torch.linalg.solve(a[0], b),
        (A, rng.standard_normal(3)),
        True,
        True,
    ),
    "solve_ex_lu": (
        lambda a, b: torch.linalg.solve_ex(a, b).result * torch.linalg.lu_factor(a).LU.sum(),
        (A, rng.standard_normal((2, 3, 1))),
        True,
        True,
    ),
    "tensorinv": (lambda a: torch.linalg.tensorinv(a[0], ind=1), (A,), True, True),
    "tensorsolve": (
        lambda a, b: torch.linalg.tensorsolve(a[0], b),
        (A, rng.standard_normal(3)),
        True,
        True,
    ),
    "lu_factor": (lambda a: torch.linalg.lu_factor(a).LU, (A,), True, True),
    # cholesky_ex is listed as a callback (_xla/_routes.py): its info output's derivative
    "cholesky": (lambda a: torch.linalg.cholesky(_spd(a)), (A,), True, False),
    # torch has no derivative of ldl_factor
    "ldl_factor": (lambda a: torch.linalg.ldl_factor(_spd(a)).LD, (A,), False, False),
}


def _args(case):
    return tuple(np.asarray(a, np.float32) for a in CASES[case][1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_linear_algebra_equals_torch_under_jit(case):
    fn = CASES[case][0]
    args = _args(case)
    got = jax.jit(torchjax.to_jax(fn, lowering="xla"))(*args)
    np.testing.assert_allclose(got, fn(*map(_t, args)).numpy(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c][2]))
def test_linear_algebra_gradients_equal_torch_func(case):
    fn = CASES[case][0]
    args = _args(case)
    f = torchjax.to_jax(fn, lowering="xla")
    argnums = tuple(range(len(args)))
    got = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=argnums)(*args)
    ref = torch.func.grad(lambda *a: (fn(*a) ** 2).sum(), argnums=argnums)(*map(_t, args))
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r.numpy(), rtol=1e-4, atol=1e-4 * np.abs(r.numpy()).max())


@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c][3]))
def test_the_error_check_lowers_and_the_function_exports(case):
    fn = CASES[case][0]
    args = _args(case)
    report = torchjax.lowering_report(fn, *args)
    assert report.fully_lowered and report.exportable, report


def test_an_op_that_falls_back_is_named_with_its_reason():
    report = torchjax.lowering_report(CASES["cholesky"][0], *_args("cholesky"))
    assert [r.op for r in report.callbacks] == ["aten.linalg_cholesky_ex.default"], report
    assert "_xla/_routes.py" in report.callbacks[0].why


INFOS = {
    "inv_ex": lambda a: torch.linalg.inv_ex(a).info,
    "lu_factor_ex": lambda a: torch.linalg.lu_factor_ex(a).info,
    "solve_ex": lambda a: torch.linalg.solve_ex(a, torch.ones(a.shape[:-1])).info,
}
MATRICES = {
    "zero": np.zeros((2, 2), np.float32),
    "rank_one": np.array([[1, 2], [2, 4]], np.float32),
    "second_pivot_zero": np.array([[2, 0, 0], [0, 0, 0], [0, 0, 3]], np.float32),
    "regular": A[0],
    "batch_of_both": np.stack([np.eye(3, dtype=np.float32), np.zeros((3, 3), np.float32)]),
}


@pytest.mark.parametrize("matrix", sorted(MATRICES))
@pytest.mark.parametrize("op", sorted(INFOS))
def test_info_outputs_keep_torchs_values(op, matrix):
    # torch's `_ex` ops report a singular matrix in `info` (the first zero pivot, 1-based)
    # instead of raising: code that tests it must see torch's value.
    fn, a = INFOS[op], MATRICES[matrix]
    got = jax.jit(torchjax.to_jax(fn, lowering="xla"))(a)
    np.testing.assert_array_equal(got, fn(_t(a)).numpy())


def test_a_singular_matrix_gives_infinities_where_torch_raises():
    # JAX raises nothing inside a compiled program: the check is dropped, and the values
    # are the factorization's, as jnp.linalg.inv gives them.
    singular = MATRICES["zero"]
    with pytest.raises(RuntimeError, match="singular"):
        torch.linalg.inv(_t(singular))
    got = torchjax.to_jax(lambda a: torch.linalg.inv(a), lowering="xla")(singular)
    assert not np.isfinite(np.asarray(got)).all()


def test_an_op_with_side_effects_is_refused_by_name():
    @torch.library.custom_op("torchjax_test::effectful", mutates_args=())
    def effectful(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @effectful.register_fake
    def _(x):
        return torch.empty_like(x)

    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    _register_effectful_op(torch.ops.torchjax_test.effectful.default, _EffectType.ORDERED)
    f = torchjax.to_jax(lambda x: effectful(x) * 2, lowering="xla")
    with pytest.raises(LoweringError, match='(?s)side effects.*lowering="callback"'):
        f(np.ones(3, np.float32))
