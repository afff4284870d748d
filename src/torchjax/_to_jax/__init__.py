# The torch -> JAX bridge: to_jax, and the torch_call primitive every wrapped call binds.
from torchjax._to_jax._to_jax import to_jax

__all__ = ["to_jax"]
