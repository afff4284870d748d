# The torch -> JAX bridge: to_jax, and the torch_call primitive every wrapped call binds
# (_torch_call/, whose package registers the primitive's rules).
from torchjax._to_jax._to_jax import to_jax

__all__ = ["to_jax"]
