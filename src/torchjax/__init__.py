"""torchjax: call real PyTorch code from JAX as a first-class JAX function, and back."""

from torchjax._convert import tree_to_jax, tree_to_torch
from torchjax._primitive import PytreePrimitive
from torchjax._to_jax import to_jax

__all__ = ["PytreePrimitive", "to_jax", "tree_to_jax", "tree_to_torch"]
