# torchjax's own JAX lowerings of a few ATen ops, used before the op table's (_routes.py
# lists them, with why): each gives torch's derivatives or takes symbolic sizes where the op
# table's lowering, or JAX differentiating torch's decomposition, would not.
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from torchjax._convert import canonical_jax_dtype


def safe_softmax(x: Any, dim: int, dtype: Any = None) -> Any:
    """softmax that gives 0, not NaN, on a row of -inf (SDPA's masked rows). Decomposed,
    the row's NaN is masked by a `where`, whose derivative JAX takes through the NaN: torch's
    derivative there is 0, as here (the row is a constant 0)."""
    if dtype is not None:
        x = x.astype(canonical_jax_dtype(dtype))
    masked = jnp.all(x == -jnp.inf, axis=dim, keepdims=True)
    out = jax.nn.softmax(jnp.where(masked, 0, x), axis=dim)
    return jnp.where(masked, 0, out)


def log_ndtr(x: Any) -> Any:
    """log of the normal CDF with JAX's asymptotic series: its derivative matches torch's at
    extreme inputs, where that of torch's decomposition loses float32 precision."""
    return jax.scipy.special.log_ndtr(x)


def linalg_vector_norm(
    x: Any, ord: float = 2, dim: Any = None, keepdim: bool = False, dtype: Any = None
) -> Any:
    """torch.linalg.vector_norm with torch's derivatives. JAX differentiates the norm's
    formula, which at a zero (of the norm, or of an entry) gives NaN or inf, or 1 for |x|'s
    derivative at 0; torch's rules (norm_jvp in FunctionsManual.cpp) give the subgradient 0
    there. Those rules, written in differentiable JAX ops, are the jvp: its transpose gives
    the vjp, and its own derivatives the second order."""
    if dtype is not None:  # torch casts the input first; the result is its real counterpart
        x = x.astype(canonical_jax_dtype(dtype))
    # dim=None and dim=[] both reduce every axis; a 0-d tensor's dim 0 or -1 reduces none.
    dim = [dim] if isinstance(dim, int) else dim
    axes = tuple(sorted({d % x.ndim for d in dim})) if dim and x.ndim else None
    return _vector_norm(x, float(ord), axes, bool(keepdim))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _vector_norm(x: Any, ord: float, axes: tuple[int, ...] | None, keepdim: bool) -> Any:
    a = jnp.abs(x)
    total = functools.partial(jnp.sum, axis=axes, keepdims=keepdim)
    if ord == 0:  # the count of nonzero entries
        return total((x != 0).astype(a.dtype))
    if ord == math.inf:
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ord == -math.inf:
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ord == 1:
        return total(a)
    if ord == 2:
        return jnp.sqrt(total(a * a))
    return total(a**ord) ** (1 / ord)


@_vector_norm.defjvp
def _vector_norm_jvp(ord: float, axes: Any, keepdim: bool, primals: Any, tangents: Any) -> Any:
    """torch's norm_jvp, case by case. The tangent is `total(coef * dot(t))` scaled: the
    coefficients depend on x alone, so the rule is linear in t (JAX transposes it), and
    each division is by a value made safe where torch masks the result to 0 (a `where` on
    the result alone would pass NaN to the derivatives of this rule)."""
    (x,), (t,) = primals, tangents
    norm = _vector_norm(x, ord, axes, keepdim)  # differentiated by this rule again
    if ord == 0:
        return norm, jnp.zeros_like(norm)
    total = functools.partial(jnp.sum, axis=axes, keepdims=keepdim)
    complex_ = jnp.iscomplexobj(x)

    def dot(u: Any) -> Any:  # Re(u conj(t)): the derivative of |x| along t is dot(sgn x)
        return jnp.real(u * jnp.conj(t)) if complex_ else u * t

    a = jnp.abs(x)
    zero = a == 0
    safe_a = jnp.where(zero, 1, a)
    # sgn: x / |x|, 0 at 0. (jnp.sign of a complex x has no derivative: torch's sgn has.)
    sgn = jnp.where(zero, 0, x / safe_a) if complex_ else jnp.sign(x)
    empty = norm == 0
    safe_norm = jnp.where(empty, 1, norm)
    if ord == 1:
        return norm, total(dot(sgn))
    if ord == 2:
        return norm, total(dot(x)) * jnp.where(empty, 0, 1 / safe_norm)
    if math.isinf(ord):  # split evenly among the entries at the max (min), NaNs included
        expanded = norm if keepdim else jnp.expand_dims(norm, axes or tuple(range(x.ndim)))
        at = ((a == expanded) | (jnp.isnan(x) & jnp.isnan(expanded))).astype(norm.dtype)
        return norm, total(dot(sgn) * at / jnp.sum(at, axis=axes, keepdims=True))
    if ord < 1:  # p < 1, negative p too: a zero entry contributes 0, not inf
        coef = jnp.where(zero, 0, safe_a ** (ord - 1))
        return norm, total(coef * dot(sgn)) * norm ** (1 - ord)
    if ord < 2:
        tangent = total(a ** (ord - 1) * dot(sgn))
    else:
        tangent = total(a ** (ord - 2) * dot(x))
    return norm, tangent * jnp.where(empty, 0, 1 / safe_norm ** (ord - 1))


@jax.custom_jvp
def nextafter(x: Any, other: Any) -> Any:
    """nextafter with torch's derivative, which JAX has none of: 1 along x, 0 along other
    (the step to the next float is a constant almost everywhere)."""
    return jnp.nextafter(x, other)


@nextafter.defjvp
def _nextafter_jvp(primals: Any, tangents: Any) -> Any:
    out = nextafter(*primals)
    return out, jnp.broadcast_to(tangents[0], out.shape).astype(out.dtype)


_OPEN_END = 2**62  # torch writes an open slice end as 2**63 - 1


def slice_scatter(
    x: Any, src: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1
) -> Any:
    """slice_scatter at any size, symbolic ones (jax.export's) included. `x[:, 1:] = v`
    captures as a slice_scatter over the whole first axis, ending at 2**63 - 1: the op
    table's lowering hands that to JAX's indexing, which cannot compare it with a symbolic
    size (the op then fell back to a callback, which takes no symbolic size). Here an open
    end is the axis's size, and a negative bound counts from it, as in torch."""
    dim = dim % x.ndim
    size = x.shape[dim]
    start = 0 if start is None else start
    end = size if end is None or (isinstance(end, int) and end >= _OPEN_END) else end
    if isinstance(start, int) and start < 0:
        start += size
    if isinstance(end, int) and end < 0:
        end += size
    if isinstance(size, int) and isinstance(end, int):
        end = min(end, size)
    index = tuple(slice(start, end, step) if i == dim else slice(None) for i in range(x.ndim))
    return x.at[index].set(src.astype(x.dtype))


def _lu(A: Any) -> tuple[Any, Any, Any]:
    """A's LU factorization as torch gives it: (LU, 1-based int32 pivots, info), info the
    1-based index of the first zero on U's diagonal and 0 where there is none (LAPACK's
    getrf, which torch's `_ex` ops return: the op table's lowerings return 0 always)."""
    lu, pivots, _ = jax.lax.linalg.lu(A)
    zero = jnp.diagonal(lu, axis1=-2, axis2=-1) == 0
    first = jnp.argmax(zero, axis=-1) + 1
    info = jnp.where(jnp.any(zero, axis=-1), first, 0).astype(jnp.int32)
    return lu, (pivots + 1).astype(jnp.int32), info


def linalg_lu_factor_ex(A: Any, pivot: bool = True, check_errors: bool = False) -> Any:
    """torch's linalg_lu_factor_ex: (LU, pivots, info), info as torch's (_lu)."""
    del pivot, check_errors  # (pivot=False is CUDA's only; a lowered check never raises)
    return _lu(A)


def linalg_inv_ex(A: Any, check_errors: bool = False) -> Any:
    """torch's linalg_inv_ex: (inverse, info), info as torch's (_lu)."""
    del check_errors
    return jnp.linalg.inv(A), _lu(A)[2]


def linalg_solve_ex(A: Any, B: Any, left: bool = True, check_errors: bool = False) -> Any:
    """torch's _linalg_solve_ex (linalg.solve's op): (X, LU, pivots, info), with B a batch
    of vectors where it has one dimension less than A and A's leading sizes (torch's rule),
    and `left=False` solving X A = B. LU and pivots are A's LU factorization as torch gives
    it, with torch's info (_lu): a singular A gives inf or NaN, as an error check lowered
    does not raise (_routes.py's ERROR_CHECKS)."""
    del check_errors
    vector = B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])
    transposed = jnp.swapaxes(A, -1, -2)
    if vector:
        X = jnp.linalg.solve(A if left else transposed, B[..., None])[..., 0]
    elif left:
        X = jnp.linalg.solve(A, B)
    else:  # X A = B: A^T X^T = B^T
        X = jnp.swapaxes(jnp.linalg.solve(transposed, jnp.swapaxes(B, -1, -2)), -1, -2)
    return (X, *_lu(A))
