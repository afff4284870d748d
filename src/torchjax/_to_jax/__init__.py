# The torch -> JAX bridge: to_jax, and the torch_call primitive every wrapped call binds.
#
# _torch_call/_primitive.py comes first: it defines torch_call_p and registers its
# rules (_torch_call/_*.py), which bind it and use the callables of _callables/_callables.py.
from torchjax._to_jax._torch_call._primitive import torch_call_p  # noqa: F401  (first: see above)

# isort: split
from torchjax._to_jax._to_jax import to_jax

__all__ = ["to_jax"]
