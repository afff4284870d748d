"""torchjax: call real PyTorch code from JAX as a first-class JAX function, and back."""

from torchjax import errors
from torchjax._convert import tree_to_jax, tree_to_torch
from torchjax._lowering_report import lowering_report
from torchjax._module_to_jax._module_to_jax import module_to_jax
from torchjax._primitive._core import PytreePrimitive
from torchjax._to_jax._to_jax import to_jax
from torchjax._to_torch._to_torch import to_torch
from torchjax._to_torch._to_torch_module import to_torch_module
from torchjax._version import __version__ as __version__

__all__ = [
    "PytreePrimitive",
    "errors",
    "lowering_report",
    "module_to_jax",
    "to_jax",
    "to_torch",
    "to_torch_module",
    "tree_to_jax",
    "tree_to_torch",
]
