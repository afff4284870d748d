# torch functions that validate their arguments by reading values (torch.cov's "weights
# sum to zero", gaussian_nll_loss's "var has negative entries"): torch.export turns each
# read into a data-dependent guard and cannot capture them, though what they compute does
# not depend on the check. While capturing, each runs as the same computation without its
# check (_routes.py lists them as CAPTURED_AS policies; the capture enters `checks_skipped`).
# Lowered, a value the check would refuse gives inf or NaN instead of an exception, as a
# lowered linalg error check does.
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def cov(
    input: torch.Tensor,
    *,
    correction: int = 1,
    fweights: torch.Tensor | None = None,
    aweights: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch.cov: rows are variables, columns observations; fweights (integer counts) and
    aweights (importances) weight the observations, and the normalization is numpy's:
    sum(w) - correction * sum(w * aweights) / sum(w), or sum(w) - correction without
    aweights, clamped at 0 (torch warns there and divides by 0)."""
    x = input if input.ndim == 2 else input.reshape(1, -1)
    observations = x.shape[1]
    weights = fweights
    if aweights is not None:
        weights = aweights if weights is None else weights * aweights
    if weights is None:
        total = torch.scalar_tensor(observations, dtype=torch.long)
        mean = x.sum(1) / total
        norm = total - correction
    else:
        total = weights.sum()
        mean = (x * weights).sum(1) / total
        if correction != 0 and aweights is not None:
            norm = total - correction * (weights * aweights).sum() / total
        else:
            norm = total - correction
    norm = norm.clamp(min=0)
    centered = x - mean.unsqueeze(1)
    weighted = centered if weights is None else centered * weights
    return torch.true_divide(centered @ weighted.mT.conj(), norm).squeeze()


def corrcoef(input: torch.Tensor) -> torch.Tensor:
    """torch.corrcoef: cov scaled by the standard deviations, clipped to [-1, 1] (real and
    imaginary parts apart)."""
    c = cov(input)
    if c.ndim == 0:
        return c / c
    d = c.diagonal()
    stddev = torch.sqrt(d.real if d.is_complex() else d)
    c = c / stddev.unsqueeze(1) / stddev.unsqueeze(0)
    if c.is_complex():
        return torch.complex(c.real.clip(-1, 1), c.imag.clip(-1, 1))
    return c.clip(-1, 1)


def gaussian_nll_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    var: torch.Tensor | float,
    full: bool = False,
    eps: float = 1e-6,
    reduction: str = "mean",
) -> torch.Tensor:
    """torch.nn.functional.gaussian_nll_loss: 0.5 * (log(var) + (input - target)**2 / var),
    var clamped at eps for the value only (its derivative passes the clamp, as torch's), one
    dimension short of input's or broadcasting along one dimension (a shared variance)."""
    if isinstance(var, float):
        var = var * torch.ones_like(input)
    if var.shape != input.shape:
        if input.shape[:-1] == var.shape:
            var = var.unsqueeze(-1)
        elif (
            input.ndim != var.ndim
            or sum(v for i, v in zip(input.shape, var.shape, strict=True) if i != v) != 1
        ):
            raise ValueError("var is of incorrect size")  # (torch's message)
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    var = var.clone()
    with torch.no_grad():
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss


class ChecksSkipped(torch.overrides.TorchFunctionMode):
    """While capturing: each function of `replacements` ({torch function: its check-free
    form}) runs as its replacement."""

    def __init__(self, replacements: dict[Callable, Callable]):
        super().__init__()
        self.replacements = replacements

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        replacement = self.replacements.get(func)
        return (replacement or func)(*args, **(kwargs or {}))
