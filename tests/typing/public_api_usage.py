"""How user code sees torchjax's types: `make typecheck` runs mypy on this file, on
torchjax/__init__.py and on examples/ (pyproject.toml's [tool.mypy]).

Every `assert_type` states a type a caller relies on; every `# type: ignore[...]` marks a
call that must be rejected, and mypy's warn_unused_ignores fails the check if it is not
(an annotation widened to Any would pass every call). Not collected by pytest: it is
checked, not run.
"""

from collections.abc import Callable
from typing import Any, assert_type

import jax
import jax.numpy as jnp
import torch

import torchjax
from torchjax.errors import TorchJaxError

# to_jax: as a call and as a decorator factory, with its options as literals.
sin = torchjax.to_jax(torch.sin)
assert_type(sin, Callable[..., Any])
decorator = torchjax.to_jax(vmap_method="sequential")
assert_type(decorator, Callable[[Callable[..., Any]], Callable[..., Any]])


@torchjax.to_jax(grad_method="autograd", vmap_randomness="different")
def layer(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


y: jax.Array = layer(jnp.ones((3, 2)), jnp.ones(3))
torchjax.to_jax(torch.sin, vmap_method="loop")  # type: ignore[call-overload]
torchjax.to_jax(torch.sin, grad_method="jax")  # type: ignore[call-overload]

# module_to_jax: (apply, variables).
apply, variables = torchjax.module_to_jax(torch.nn.Linear(3, 2), copy=False)
assert_type(apply, Callable[..., Any])
assert_type(variables, dict[Any, Any])
torchjax.module_to_jax(torch.nn.Linear(3, 2), grad_method="jax")  # type: ignore[arg-type]
torchjax.module_to_jax(torch.nn.Linear(3, 2), copy="move")
torchjax.module_to_jax(torch.nn.Linear(3, 2), copy="share")  # type: ignore[arg-type]

# to_torch and to_torch_module: torch callables and an nn.Module.
double = torchjax.to_torch(lambda x: 2 * x)
assert_type(double, Callable[..., Any])
assert_type(torchjax.to_torch(has_aux=True), Callable[[Callable[..., Any]], Callable[..., Any]])
module = torchjax.to_torch_module(lambda p, x: p["w"] * x, {"w": jnp.ones(2)})
as_module: torch.nn.Module = module
out: torch.Tensor = module(torch.ones(2))
kernel: torch.Tensor = module.w  # a JaxModule's attributes are its parameters
torchjax.to_torch(lambda x: x, has_aux="yes")  # type: ignore[call-overload]

# Conversion and the primitive.
tree = torchjax.tree_to_jax({"a": torch.ones(2)})
back = torchjax.tree_to_torch(tree)
prim = torchjax.PytreePrimitive("example")
assert_type(prim, torchjax.PytreePrimitive)
torchjax.PytreePrimitive(3)  # type: ignore[arg-type]

# The exceptions: one base class, each also a builtin exception.
assert issubclass(torchjax.errors.InPlaceMutationError, TorchJaxError)
version: str = torchjax.__version__
