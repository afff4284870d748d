# module_to_jax: an nn.Module as a pure JAX function of its variables (built on to_jax).
from torchjax._module_to_jax._module_to_jax import module_to_jax

__all__ = ["module_to_jax"]
