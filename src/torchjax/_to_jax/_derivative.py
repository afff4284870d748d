# What JvpFunction and VjpFunction share: the base class that restricts a torch callable to
# the leaves being differentiated, its error classification, and the autograd helpers (fresh
# tape nodes, pullbacks by torch.autograd.grad, batches of cotangents). Split from
# _autodiff.py, which keeps the two derived functions and the JVP and transpose rules.
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import torch

from torchjax._compat import peek_interpreter_stack
from torchjax._convert import torch_dtype
from torchjax._errors import AutodiffError
from torchjax._to_jax._batching import as_tensor
from torchjax._to_jax._call_plan import autograd_inside
from torchjax._to_jax._torch_call import DerivedFunction

_tree = jax.tree_util

AUTODIFF_HINT = (
    "torch.func could not differentiate {name}: {error}\n"
    "Code that torch.func cannot transform (an old-style torch.autograd.Function without "
    "setup_context, some extension kernels) can be differentiated with "
    "to_jax(fn, grad_method='autograd'), which uses torch.autograd.grad instead."
)
AUTOGRAD_HINT = "torch.autograd could not differentiate {name}: {error}"
FORWARD_AD_HINT = (
    "torch has no forward-mode derivative for an operation in {name}: {error}\n"
    "Reverse mode (jax.grad, jax.vjp, jax.jacrev) works without one. For forward mode "
    "(jax.jvp, jax.jacfwd, jax.hessian), to_jax(fn, grad_method='autograd') computes it "
    "from two reverse-mode passes instead."
)

# Phrases of torch's own messages when its autodiff machinery, not the function, fails.
_AUTODIFF_FAILURES = (
    "forward ad",
    "forward mode",
    "jvp function",
    "derivative for",
    "functorch",
    "setup_context",
    "does not require grad and does not have a grad_fn",
    "not differentiable",
    "one of the differentiated tensors",
)


@dataclasses.dataclass(frozen=True)
class ZerosLike:
    """A static leaf standing for zeros of this shape and dtype (a linear input's point)."""

    shape: tuple
    dtype: np.dtype


def _inexact(dtype: Any) -> bool:
    return jax.numpy.issubdtype(dtype, jax.numpy.inexact)


class _Derivative(DerivedFunction):
    """Shared plumbing of JvpFunction and VjpFunction: select leaves, name errors."""

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str

    @property
    def method(self) -> str:
        """The grad_method in force: torch.autograd's where the function runs it itself."""
        return "autograd" if autograd_inside() else self.grad_method

    def arg_path(self, path: tuple) -> str:
        # Their args are (primals, tangents or cotangents); the primals are inner's args.
        if path and getattr(path[0], "idx", None) == 0 and len(path) > 1:
            return self.inner.arg_path(path[1:])
        return "args" + _tree.keystr(path)

    def _restricted(self, primals: tuple) -> tuple[Any, list]:
        """(g, x): g(*x) is inner's masked outputs as a function of the `wrt` leaves.

        g returns ``(masked, rest)``, both tensors: the masked outputs, and the others,
        which torch.func passes through as aux, untouched by the transform.
        """
        # This runs on every call: its loops stay in C where they can (map, `in`).
        leaves, tree = _tree.tree_flatten(primals)
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), None)
        if ZerosLike in map(type, leaves):
            leaves = [
                torch.zeros(x.shape, dtype=torch_dtype(x.dtype), device=device)
                if isinstance(x, ZerosLike)
                else x
                for x in leaves
            ]

        def g(*diff: torch.Tensor) -> tuple:
            new = list(leaves)
            for i, t in zip(self.wrt, diff, strict=True):
                new[i] = t
            outs = _tree.tree_leaves(self.inner(*_tree.tree_unflatten(tree, new)))
            # A Python number output is a constant: as a tensor, its derivative is zero.
            outs = [o if isinstance(o, torch.Tensor) else as_tensor(o, device) for o in outs]
            if all(self.out_mask):
                return tuple(outs), []
            masked = tuple(o for o, m in zip(outs, self.out_mask, strict=True) if m)
            return masked, [o for o, m in zip(outs, self.out_mask, strict=True) if not m]

        return g, [leaves[i] for i in self.wrt]

    grad_mode = True  # see _CallPlan: torch.func runs derivatives with grad mode on

    def call_failure(self, error: Exception) -> Exception:
        text = f"{type(error).__name__}: {error}"
        if not any(m in text.lower() for m in _AUTODIFF_FAILURES):
            return self.inner.call_failure(error)  # the function's own exception
        if self.method == "autograd":
            hint = AUTOGRAD_HINT
        elif isinstance(error, NotImplementedError) and "forward" in text.lower():
            hint = FORWARD_AD_HINT
        else:
            hint = AUTODIFF_HINT
        return AutodiffError(hint.format(name=self.root.name, error=text))


def _conj(t: torch.Tensor) -> torch.Tensor:
    # conj_physical, not conj: a lazily conjugated tensor cannot be handed to JAX by DLPack.
    return torch.conj_physical(t) if t.is_complex() else t


def _on_tape(x: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh autograd nodes for the leaves to differentiate (grad_method="autograd").

    A leaf already on an outer tape (a higher derivative in progress, e.g. jax.hessian)
    must stay connected to it, or the outer derivative is silently zero: it gets a view,
    a new node on the same tape. Other leaves are detached and start a tape of their own.
    """
    return [xi.view_as(xi) if xi.requires_grad else xi.detach().requires_grad_() for xi in x]


def _batch_sizes(shapes: list, levels: tuple) -> tuple:
    """The sizes of the batch axes `levels` (innermost first) put on `shapes`, outermost
    first; each level's axes index the shapes as they are without the outer levels."""
    shapes, sizes = [list(s) for s in shapes], []
    for dims in reversed(levels):
        size = next(s[d] for s, d in zip(shapes, dims, strict=True) if d is not None)
        sizes.append(size)
        shapes = [s if d is None else s[:d] + s[d + 1 :] for s, d in zip(shapes, dims, strict=True)]
    return tuple(sizes)


def _stack_batch(tensors: tuple, levels: tuple) -> tuple[tuple, tuple]:
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


def _autograd_pullbacks(g: Any, x: list, flat_cts: tuple) -> tuple:
    """The cotangents of x for each row of the stacked cotangents, from one forward."""
    with torch.enable_grad():
        x = _on_tape(x)
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


def _outermost(args: Any) -> bool:
    """Whether nothing outside this call will differentiate it: no torch.func transform is
    active, and no tensor among its arguments is on an autograd tape."""
    peek = peek_interpreter_stack
    if peek is None or peek() is not None:
        return False
    return not any(map(_requires_grad, _tree.tree_leaves(args)))


def _requires_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def _autograd_pullback(g: Any, x: list, cotangents: tuple, *, create_graph: bool) -> tuple:
    """The cotangents of x by torch.autograd.grad; with create_graph, differentiable again."""
    with torch.enable_grad():
        x = _on_tape(x)
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
