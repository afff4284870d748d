# to_torch under plain autograd: the forward keeps JAX's pullback, the backward runs it.
#
# Where no torch.func transform, forward-mode level or torch.compile trace is involved, a
# call whose inputs require grad goes through `KeptVjp` rather than _JaxFunction: its
# forward runs jax.vjp once, jitted, and keeps the pullback (its residuals, JAX arrays) on
# the autograd node; its backward runs that pullback: one forward in all, and no input
# converted again, as a hand-written autograd.Function around jax.vjp does. A backward
# that is itself differentiated (create_graph=True, double backward) takes _JaxFunction's
# vjp spec instead, which is differentiable (it recomputes the forward).
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchjax._compat._torch import proxy_mode_active
from torchjax._convert import array_to_tensor, tensor_to_jax
from torchjax._to_torch._spec import (
    PLAIN_TENSORS,
    Spec,
    has_legacy_batched,
    in_x64_of,
    save_inputs,
    saved_inputs,
)


def keeps_pullback(tensors: tuple | list) -> bool:
    """Whether a call of these tensors (under plain autograd) can run through KeptVjp:
    real tensors, none batched by torch's legacy vmap, no make_fx trace."""
    return (
        all(type(t) in PLAIN_TENSORS for t in tensors)
        and not has_legacy_batched(tensors)
        and not proxy_mode_active()
    )


class KeptVjp(torch.autograd.Function):
    """Old-style (ctx in forward, so the pullback can be kept there); `differentiable` is
    the backward for create_graph=True: ``differentiable(spec, wrt, saved, cts)``."""

    differentiable: Callable[..., tuple] | None = None  # set by _to_torch.py

    @staticmethod
    def forward(ctx: Any, spec: Spec, *tensors: torch.Tensor) -> tuple:  # type: ignore[override]
        needs = ctx.needs_input_grad[1:]
        wrt = tuple(i for i, d in enumerate(spec.diff_in) if d and needs[i])
        forward, ctx.pullback = spec.keeping(wrt)
        outs, ctx.residuals = forward(*spec.arrays_of(tensors))
        results = spec.outputs_of(tensors, outs)
        ctx.spec, ctx.wrt = spec, wrt
        save_inputs(ctx, tensors)  # for a differentiated backward (create_graph)
        nondiff = [o for o, d in zip(results, spec.diff_out, strict=True) if not d]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return results

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple:  # type: ignore[override]
        with in_x64_of(ctx.spec):
            return KeptVjp._backward(ctx, cotangents)

    @staticmethod
    def _backward(ctx: Any, cotangents: tuple) -> tuple:
        spec, wrt = ctx.spec, ctx.wrt
        grads: list[torch.Tensor | None] = [None] * len(spec.in_avals)
        if not wrt:
            return (None, *grads)
        cts = [c for c, d in zip(cotangents, spec.diff_out, strict=True) if d]
        if torch.is_grad_enabled() or not keeps_pullback(cts):
            # create_graph=True (a backward torch differentiates), or cotangents torch's
            # legacy vmap batched (is_grads_batched, vectorize=True): the vjp spec.
            outs = KeptVjp.differentiable(spec, wrt, saved_inputs(ctx), cts)
        else:
            paths = [f"cotangent[{k}]" for k in range(len(cts))]
            arrays = [tensor_to_jax(c, p) for c, p in zip(cts, paths, strict=True)]
            pulled = ctx.pullback(ctx.residuals, *arrays)
            outs = [array_to_tensor(g, f"gradient of {spec.name}") for g in pulled]
        for i, g in zip(wrt, outs, strict=True):
            grads[i] = g
        return (None, *grads)
