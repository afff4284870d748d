# jax.vmap of a torch call: rebind the primitive with torch.func.vmap(fn).
#
# One batched torch call serves the whole batch, and nested jax.vmap nests torch.func.vmap
# (BatchedFunction of a BatchedFunction): still one torch call however deep. The other
# vmap_method policies mirror jax.pure_callback's: "sequential" maps the unbatched call over
# the batch with lax.map; "expand_dims" and "broadcast_all" trust fn to handle a leading
# batch axis itself. A function torch.func.vmap cannot batch fails loudly while tracing
# (the fake run of the batched function) and names vmap_method="sequential" as the fix.
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchjax._errors import VmapError
from torchjax._primitive import _is_operand
from torchjax._torch_call import Options, torch_call_p

_tree = jax.tree_util

VMAP_HINT = (
    "torch.func.vmap could not batch {name}: {error}\n"
    "For functions torch.func.vmap cannot handle (.item(), data-dependent Python control "
    "flow, in-place ops on unbatched inputs), use to_jax(fn, vmap_method='sequential') "
    "(one call per example), or 'expand_dims' if fn already handles a leading batch axis."
)


@dataclasses.dataclass(frozen=True)
class BatchedFunction:
    """``torch.func.vmap(inner)`` over the tensor leaves of inner's positional args.

    Attributes:
      inner: the torch callable being batched.
      in_dims: one int (batched axis) or None per tensor leaf, in flattening order.
      randomness: torch.func.vmap's randomness policy.
    """

    inner: Any
    in_dims: tuple
    randomness: str

    @property
    def root(self) -> Any:
        return self.inner.root

    def arg_path(self, path: tuple) -> str:
        return self.inner.arg_path(path)

    def __call__(self, *args: Any) -> Any:
        leaves, tree = _tree.tree_flatten(args)
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        out_tree = []

        def flat(*tensors: torch.Tensor) -> tuple:
            new = list(leaves)
            for i, t in zip(positions, tensors, strict=True):
                new[i] = t
            out_leaves, treedef = _tree.tree_flatten(self.inner(*_tree.tree_unflatten(tree, new)))
            out_tree.append(treedef)
            return tuple(x if isinstance(x, torch.Tensor) else torch.tensor(x) for x in out_leaves)

        batched = torch.func.vmap(flat, in_dims=self.in_dims, randomness=self.randomness)
        out = batched(*(leaves[i] for i in positions))
        return _tree.tree_unflatten(out_tree[-1], out)

    def declared_shapes(self, options: Options, *args: Any) -> Any:
        leaves, tree = _tree.tree_flatten(args)
        dims = iter(self.in_dims)
        size, unbatched = None, []
        for x in leaves:
            d = next(dims) if _is_abstract(x) else None
            if d is not None:
                size = x.shape[d]
                x = jax.ShapeDtypeStruct(x.shape[:d] + x.shape[d + 1 :], x.dtype)
            unbatched.append(x)
        inner = torch_call_p.abstract_eval(
            *_tree.tree_unflatten(tree, unbatched), fn=self.inner, options=options
        )
        return _tree.tree_map(lambda s: jax.ShapeDtypeStruct((size, *s.shape), s.dtype), inner)

    def fake_failure(self, error: Exception) -> Exception:
        return VmapError(
            VMAP_HINT.format(name=self.root.name, error=f"{type(error).__name__}: {error}")
        )

    def call_failure(self, error: Exception) -> Exception:
        return self.fake_failure(error)


def _is_abstract(x: Any) -> bool:
    return _is_operand(x) or isinstance(x, jax.core.ShapedArray | jax.ShapeDtypeStruct)


@torch_call_p.def_batching
def _batch(args: tuple, axes: tuple, *, fn: Any, options: Options) -> tuple[Any, int]:
    """Batch ``fn(*args)`` according to ``options.vmap_method``; outputs batched at axis 0."""
    leaves, tree = _tree.tree_flatten(args)
    flat_axes = tree.flatten_up_to(axes)
    size = next(x.shape[a] for x, a in zip(leaves, flat_axes, strict=True) if a is not None)
    method = options.vmap_method
    if method == "torch":
        in_dims = tuple(a for x, a in zip(leaves, flat_axes, strict=True) if _is_operand(x))
        batched = BatchedFunction(fn, in_dims, options.vmap_randomness)
        return torch_call_p.bind(*args, fn=batched, options=options), 0

    moved = [
        jnp.moveaxis(x, a, 0) if a is not None else x
        for x, a in zip(leaves, flat_axes, strict=True)
    ]
    if method == "sequential":
        mapped = [i for i, a in enumerate(flat_axes) if a is not None]

        def one(slices: list) -> Any:
            new = list(moved)
            for i, s in zip(mapped, slices, strict=True):
                new[i] = s
            return torch_call_p.bind(*_tree.tree_unflatten(tree, new), fn=fn, options=options)

        return jax.lax.map(one, [moved[i] for i in mapped]), 0

    def lift(x: Any, a: Any) -> Any:
        if a is not None or not _is_operand(x):
            return x
        if method == "expand_dims":
            return jnp.expand_dims(x, 0)
        return jnp.broadcast_to(x, (size, *jnp.shape(x)))

    new = [lift(x, a) for x, a in zip(moved, flat_axes, strict=True)]
    return torch_call_p.bind(*_tree.tree_unflatten(tree, new), fn=fn, options=options), 0
