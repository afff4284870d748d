# torch.func.vmap's steps, called without its Python wrapper, and what batched calls share.
#
# One batched torch call serves a whole jax.vmap batch (_callables/_batched.py).
# torch.func.vmap's Python wrapper does per-call work (pytrees of arguments, in_dims and
# outputs; checks of sizes and dims that jax.vmap has already made) that costs tens of
# microseconds a call, so vmap_call takes its steps itself where they are found.
from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

from torchjax._compat._torch import (
    FAST_VMAP,
    vmap_add_batch_dim,
    vmap_decrement_nesting,
    vmap_increment_nesting,
    vmap_lazy_load_decompositions,
    vmap_remove_batch_dim,
)
from torchjax._convert import torch_dtype
from torchjax._primitive._params import is_operand
from torchjax._to_jax._options import VMAP_RANDOMNESS

VMAP_HINT = (
    "torch.func.vmap could not batch {name}: {error}\n"
    "For functions torch.func.vmap cannot handle (.item(), data-dependent Python control "
    "flow, in-place ops on unbatched inputs), use to_jax(fn, vmap_method='sequential') "
    "(one call per example), or 'expand_dims' if fn already handles a leading batch axis."
)


# torch.func.vmap's own message names its `randomness` flag; the user sets it in to_jax.
RANDOMNESS_HINT = (
    "torch.func.vmap could not batch {name}: {error}\n"
    "{name} draws random numbers, and vmap_randomness='error' (the default) forbids that "
    "under jax.vmap. Choose how draws vary across the batch: "
    "to_jax(fn, vmap_randomness='different') (independent per example) or "
    "to_jax(fn, vmap_randomness='same') (one draw shared by all examples)."
)


# The same for module_to_jax's apply, whose options and call take other spellings.
MODULE_RANDOMNESS_HINT = (
    "torch.func.vmap could not batch {name}: {error}\n"
    "The module draws random numbers (dropout in train mode), and vmap_randomness='error' "
    "(the default) forbids that under jax.vmap. Choose one: pass a JAX key, "
    "apply(variables, ..., rng=key) (vmap over jax.random.split(key, n) for independent "
    "masks); or module_to_jax(module, vmap_randomness='different') (independent per "
    "example) or 'same' (one draw shared by all examples); or, where no draw is wanted "
    "(inference), module.eval() before calling apply."
)


LEADING_AXIS_MESSAGE = (
    "{name} was batched with vmap_method={method!r}, so it must return every output with "
    "a leading batch axis of size {size}, but it returned {got} at {where}. With {method!r} "
    "the function receives the whole batch and must map over its leading axis itself; use "
    "vmap_method='torch.func' or 'sequential' for a function written for one example."
)


def vmap_call(fn: Any, tensors: list, in_dims: tuple, randomness: str) -> Any:
    """``torch.func.vmap(fn, in_dims, randomness=randomness)(*tensors)``, for an fn that
    returns a tensor or a tuple of tensors, every output batched at axis 0.

    It takes the steps torch.func.vmap takes (load its decompositions, open a vmap level,
    add the batch dims, call, remove them) without its Python wrapper, whose per-call work
    (pytrees of arguments, in_dims and outputs; checks of sizes and dims that jax.vmap has
    already made) costs tens of microseconds a call. Where those steps are not found
    (another torch version), it is torch.func.vmap itself.
    """
    if not FAST_VMAP:
        return torch.func.vmap(fn, in_dims=in_dims, randomness=randomness)(*tensors)
    if randomness not in VMAP_RANDOMNESS:
        raise ValueError(f"randomness must be one of {VMAP_RANDOMNESS}, got {randomness!r}")
    vmap_lazy_load_decompositions()
    size = next((t.shape[d] for t, d in zip(tensors, in_dims, strict=True) if d is not None), None)
    if size is None:  # torch.func.vmap explains that nothing is batched
        return torch.func.vmap(fn, in_dims=in_dims, randomness=randomness)(*tensors)
    level = vmap_increment_nesting(size, randomness)
    try:
        out = fn(
            *[
                t if d is None else vmap_add_batch_dim(t, d, level)
                for t, d in zip(tensors, in_dims, strict=True)
            ]
        )
        if isinstance(out, torch.Tensor):
            return vmap_remove_batch_dim(out, level, size, 0)
        for o in out:
            if not isinstance(o, torch.Tensor):
                raise ValueError(f"vmap: outputs must be tensors, got {type(o).__name__}.")
        return tuple(vmap_remove_batch_dim(o, level, size, 0) for o in out)
    finally:
        vmap_decrement_nesting()


def beneath_autograd(flat: Any) -> Any:
    """flat, run under a torch.func autograd level over its floating inputs (outputs only)."""

    def call(*tensors: torch.Tensor) -> Any:
        floats = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]

        kinds: list = []

        def of_floats(*fs: torch.Tensor) -> Any:
            new = list(tensors)
            for i, t in zip(floats, fs, strict=True):
                new[i] = t
            out = flat(*new)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            kinds.append([o.is_floating_point() or o.is_complex() for o in outs])
            # vjp takes floating outputs only; the others (an int handle, say) ride as aux.
            return tuple(o for o in outs if o.is_floating_point() or o.is_complex()), [
                o for o in outs if not (o.is_floating_point() or o.is_complex())
            ]

        inexact, _, others = torch.func.vjp(of_floats, *[tensors[i] for i in floats], has_aux=True)
        inexact, others = iter(inexact), iter(others)
        outs = [next(inexact) if k else next(others) for k in kinds[-1]]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return call


def as_tensor(value: Any, device: torch.device | None = None) -> Any:
    """A Python number output as a tensor of the dtype to_jax gives it; others unchanged.

    torch.func transforms take tensors only, and torch.tensor(2.0) would be float32 where
    to_jax declares a Python float float64 under x64: use the declared dtype.
    """
    if isinstance(value, bool | int | float | complex):
        dtype = torch_dtype(jax.dtypes.canonicalize_dtype(np.asarray(value).dtype))
        return torch.tensor(value, dtype=dtype, device=device)
    return value


def is_abstract(x: Any) -> bool:
    return is_operand(x) or isinstance(x, jax.core.ShapedArray | jax.ShapeDtypeStruct)
