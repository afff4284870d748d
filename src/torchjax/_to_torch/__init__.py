# The JAX -> torch bridge: to_torch and to_torch_module.
from torchjax._to_torch._to_torch import to_torch
from torchjax._to_torch._to_torch_module import to_torch_module

__all__ = ["to_torch", "to_torch_module"]
