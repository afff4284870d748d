# PytreePrimitive: a JAX primitive whose rules see pytrees. It imports jax only.
from torchjax._primitive._core import PytreePrimitive

__all__ = ["PytreePrimitive"]
