"""How JAX sees a torch call: the torch_call primitive, and its rules, one module each.

Each rule module registers its rule on torch_call_p as it is imported; importing this
package registers them all."""

from torchjax._to_jax._torch_call import (  # noqa: F401  (each registers its rules)
    _abstract_eval,
    _batching,
    _dce,
    _impl,
    _jvp,
    _lowering,
    _partial_eval,
    _transpose,
)
from torchjax._to_jax._torch_call._primitive import torch_call_p

__all__ = ["torch_call_p"]
