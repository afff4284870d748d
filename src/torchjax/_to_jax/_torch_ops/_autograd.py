# torch.autograd and torch.func building blocks of the derivatives in _callables/.
#
# Fresh tape nodes for the leaves to differentiate, pullbacks by torch.autograd.grad (one
# cotangent, or a batch of them through one forward), forward mode from two reverse-mode
# passes (grad_method="autograd"), the batch axes of cotangents batched on their own, and
# whether anything outside a call will differentiate it again. The advice that failures
# of torch's machinery get lives here too.
from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

from torchjax._compat._torch import peek_interpreter_stack

_tree = jax.tree_util

AUTODIFF_HINT = (
    "torch.func could not differentiate {name}: {error}\n"
    "Code that torch.func cannot transform (an old-style torch.autograd.Function without "
    "setup_context, some extension kernels) can be differentiated with "
    "to_jax(fn, grad_method='autograd'), which uses torch.autograd.grad instead."
)

SAVED_TENSOR_HOOKS_HINT = (
    "torch.func could not differentiate {name}: {error}\n"
    "torch.func does not differentiate through saved-tensor hooks, which "
    "torch.utils.checkpoint (use_reentrant=False) and torch.autograd.graph.save_on_cpu "
    "install. to_jax(fn, grad_method='autograd') (or module_to_jax(module, "
    "grad_method='autograd')) differentiates them with torch.autograd.grad instead."
)

REENTRANT_CHECKPOINT_HINT = (
    "torch.autograd could not differentiate {name}: {error}\n"
    "torchjax computes every derivative with torch.func or torch.autograd.grad, which "
    "torch.utils.checkpoint(..., use_reentrant=True) does not support (and where none of "
    "its inputs requires grad, torch drops the gradients of the parameters it uses). "
    "Pass use_reentrant=False; for Hugging Face models, "
    "gradient_checkpointing_enable() without gradient_checkpointing_kwargs does."
)

AUTOGRAD_HINT = "torch.autograd could not differentiate {name}: {error}"

FORWARD_AD_HINT = (
    "torch has no forward-mode derivative for an operation in {name}: {error}\n"
    "Reverse mode (jax.grad, jax.vjp, jax.jacrev) works without one. For forward mode "
    "(jax.jvp, jax.jacfwd, jax.hessian), to_jax(fn, grad_method='autograd') computes it "
    "from two reverse-mode passes instead."
)


def inexact(dtype: Any) -> bool:
    return jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def conj(t: torch.Tensor) -> torch.Tensor:
    # conj_physical, not conj: a lazily conjugated tensor cannot be handed to JAX by DLPack.
    return torch.conj_physical(t) if t.is_complex() else t


def on_tape(x: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh autograd nodes for the leaves to differentiate (grad_method="autograd").

    A leaf already on an outer tape (a higher derivative in progress, e.g. jax.hessian)
    must stay connected to it, or the outer derivative is silently zero: it gets a view,
    a new node on the same tape. Other leaves are detached and start a tape of their own.
    """
    return [xi.view_as(xi) if xi.requires_grad else xi.detach().requires_grad_() for xi in x]


def batch_sizes(shapes: list, levels: tuple) -> tuple:
    """The sizes of the batch axes `levels` (innermost first) put on `shapes`, outermost
    first; each level's axes index the shapes as they are without the outer levels."""
    shapes, sizes = [list(s) for s in shapes], []
    for dims in reversed(levels):
        size = next(s[d] for s, d in zip(shapes, dims, strict=True) if d is not None)
        sizes.append(size)
        shapes = [s if d is None else s[:d] + s[d + 1 :] for s, d in zip(shapes, dims, strict=True)]
    return tuple(sizes)


def stack_batch(tensors: tuple, levels: tuple) -> tuple[tuple, tuple]:
    """The tensors with the batch axes of `levels` moved to the front (outermost first;
    unbatched ones broadcast) and merged into one: ``(flat, sizes)``, each flat tensor
    ``[prod(sizes), ...]``."""
    tensors, placed, sizes = list(tensors), 0, []
    for dims in reversed(levels):
        pairs = zip(tensors, dims, strict=True)
        size = next(t.shape[placed + d] for t, d in pairs if d is not None)
        sizes.append(size)
        tensors = [
            t.movedim(placed + d, placed)
            if d is not None
            else t.unsqueeze(placed).expand(*t.shape[:placed], size, *t.shape[placed:])
            for t, d in zip(tensors, dims, strict=True)
        ]
        placed += 1
    n = int(np.prod(sizes))
    return tuple(t.reshape(n, *t.shape[placed:]) for t in tensors), tuple(sizes)


def autograd_pullbacks(g: Any, x: list, flat_cts: tuple) -> tuple:
    """The cotangents of x for each row of the stacked cotangents, from one forward."""
    with torch.enable_grad():
        x = on_tape(x)
        out, _ = g(*x)
        live = [i for i, o in enumerate(out) if o.requires_grad]
        n = flat_cts[0].shape[0] if flat_cts else 0
        rows = []
        for k in range(n):
            if not live:
                rows.append([torch.zeros_like(xi) for xi in x])
                continue
            rows.append(
                torch.autograd.grad(
                    [out[i] for i in live],
                    x,
                    [flat_cts[i][k] for i in live],
                    retain_graph=True,
                    create_graph=True,
                    allow_unused=True,
                    materialize_grads=True,
                )
            )
    return tuple(torch.stack([r[j] for r in rows]) for j in range(len(x)))


def outermost(args: Any) -> bool:
    """Whether nothing outside this call will differentiate it: no torch.func transform is
    active, and no tensor among its arguments is on an autograd tape."""
    peek = peek_interpreter_stack
    if peek is None or peek() is not None:
        return False
    return not any(map(_requires_grad, _tree.tree_leaves(args)))


def _requires_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def autograd_pullback(g: Any, x: list, cotangents: tuple, *, create_graph: bool) -> tuple:
    """The cotangents of x by torch.autograd.grad; with create_graph, differentiable again."""
    with torch.enable_grad():
        x = on_tape(x)
        out, _ = g(*x)
        # Outputs off the tape do not depend on x and contribute nothing.
        pairs = [(o, c) for o, c in zip(out, cotangents, strict=True) if o.requires_grad]
        if not pairs:
            return tuple(torch.zeros_like(xi) for xi in x)
        return tuple(
            torch.autograd.grad(
                [o for o, _ in pairs],
                x,
                [c for _, c in pairs],
                create_graph=create_graph,
                allow_unused=True,
                materialize_grads=True,
            )
        )


def jvp_by_double_vjp(g: Any, x: list, tangents: tuple) -> tuple:
    """Forward mode from reverse mode: J t = d/du [u^T J]^T t, u a dummy cotangent."""
    with torch.enable_grad():
        x = on_tape(x)
        out, rest = g(*x)
        result = [torch.zeros_like(o) for o in out]
        # An output off the tape does not depend on x: its tangent is zero, and
        # autograd.grad refuses it, so only outputs on the tape take part.
        live = [i for i, o in enumerate(out) if o.requires_grad]
        pairs, u = [], []
        if live:
            u = [torch.zeros_like(out[i], requires_grad=True) for i in live]
            vjp = torch.autograd.grad(
                [out[i] for i in live],
                x,
                u,
                create_graph=True,
                allow_unused=True,
                materialize_grads=True,
            )
            pairs = [(v, t) for v, t in zip(vjp, tangents, strict=True) if v.requires_grad]
        if pairs:
            jt = torch.autograd.grad(
                [v for v, _ in pairs],
                u,
                [t for _, t in pairs],
                create_graph=True,
                allow_unused=True,
                materialize_grads=True,
            )
            for i, t in zip(live, jt, strict=True):
                result[i] = t
    return out, tuple(result), rest
