# The ops whose torch decomposition JAX differentiates otherwise than torch does (the OpInfo
# sweep, make conformance, found each): the decompositions keep them whole. Those whose JAX
# form is a few lines get a lowering of our own, used before the op table's.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from torchjax._convert import canonical_jax_dtype


def _safe_softmax(x: Any, dim: int, dtype: Any = None) -> Any:
    """softmax that gives 0, not NaN, on a row of -inf (SDPA's masked rows). Decomposed,
    the row's NaN is masked by a `where`, whose derivative JAX takes through the NaN: torch's
    derivative there is 0, as here (the row is a constant 0)."""
    if dtype is not None:
        x = x.astype(canonical_jax_dtype(dtype))
    masked = jnp.all(x == -jnp.inf, axis=dim, keepdims=True)
    out = jax.nn.softmax(jnp.where(masked, 0, x), axis=dim)
    return jnp.where(masked, 0, out)


def _log_ndtr(x: Any) -> Any:
    """log of the normal CDF with JAX's asymptotic series: its derivative matches torch's at
    extreme inputs, where that of torch's decomposition loses float32 precision."""
    return jax.scipy.special.log_ndtr(x)


OWN_LOWERINGS: dict[str, Callable[..., Any]] = {
    "aten._safe_softmax.default": _safe_softmax,
    "aten.special_log_ndtr.default": _log_ndtr,
}


# Kept whole for the op table's lowering of the whole op, or, where it has none, for the
# torch kernel as a callback.
KEPT_WHOLE: frozenset[str] = frozenset(
    {
        *OWN_LOWERINGS,
        # max_unpool's decomposition scatters with repeated indices: JAX's derivative gives
        # the gradient to one of the repeated positions, torch's (a gather) to each.
        "aten.max_unpool2d.default",
        "aten.max_unpool3d.default",
        # entr's decomposition is a `where`: its derivative at x < 0 is 0, torch's NaN.
        "aten.special_entr.default",
    }
)
