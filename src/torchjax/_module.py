# module_to_jax: a torch.nn.Module as a pure JAX function of a variables pytree.
#
# The module object only supplies the code (its forward) and the structure; its parameters
# and buffers travel as JAX arrays in `variables` and are substituted with
# torch.func.functional_call on every call. functional_call writes buffer updates (BatchNorm
# running stats) into the tensors it is given, so apply hands it fresh clones: the caller's
# arrays and the module's own tensors are never touched, and mutable=True returns the
# updated clones as new_buffers.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from torchjax._convert import tree_to_jax
from torchjax._errors import VariablesError
from torchjax._to_jax import to_jax

__all__ = ["VariablesError", "module_to_jax"]  # VariablesError: importable here as before


def _signature(named: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in named.items()}


def _check_group(module_name: str, group: str, given: Any, expected: dict[str, tuple]) -> None:
    if not isinstance(given, dict):
        raise VariablesError(
            f"variables[{group!r}] must be a dict of arrays, got {type(given).__name__}."
        )
    missing = [k for k in expected if k not in given]
    extra = [k for k in given if k not in expected]
    if missing or extra:
        raise VariablesError(
            f"variables[{group!r}] does not match {module_name}: missing {missing}, "
            f"unexpected {extra}. Use the variables returned by module_to_jax(module) (and "
            f"keep their keys when updating them)."
        )
    for k, shape in expected.items():
        got = tuple(np.shape(given[k]))
        if got != shape:
            raise VariablesError(
                f"variables[{group!r}][{k!r}] has shape {list(got)}, but {module_name} "
                f"expects {list(shape)}."
            )


def module_to_jax(module: torch.nn.Module) -> tuple[Callable, dict]:
    """Turn a ``torch.nn.Module`` into a pure JAX function and its variables pytree.

    Args:
      module: the module. Its forward is the code; its mode (``train()``/``eval()``) at
        call time is respected (a change of mode retraces under jit). It is never mutated.

    Returns:
      ``(apply, variables)``. ``variables = {"params": {name: array}, "buffers": {name:
      array}}`` with names as in ``named_parameters()``/``named_buffers()`` (tied weights
      appear once), converted zero-copy. ``apply(variables, *args, mutable=False, rng=None,
      **kwargs)`` returns the module's output; with ``mutable=True`` it returns
      ``(output, new_buffers)`` (e.g. BatchNorm running statistics after a training-mode
      step). ``rng``, a JAX PRNG key, seeds torch's generator for the call (dropout): the
      same key gives the same masks. Without it, torch's global generator is used, as in
      plain PyTorch. apply works under jit, vmap and grad (w.r.t. params and inputs).

    Example:
      >>> import jax, jax.numpy as jnp, torch, torchjax
      >>> apply, variables = torchjax.module_to_jax(torch.nn.Linear(3, 2))
      >>> loss = lambda v, x: jnp.sum(apply(v, x) ** 2)  # [B, 3] -> []
      >>> grads = jax.grad(loss)(variables, jnp.ones((4, 3)))
      >>> grads["params"]["weight"].shape
      (2, 3)
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module_to_jax expects a torch.nn.Module, got {type(module).__name__}.")
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    variables = {"params": tree_to_jax(params), "buffers": tree_to_jax(buffers)}
    expected = {"params": _signature(params), "buffers": _signature(buffers)}
    module_name = type(module).__name__

    def forward(params, buffers, args, kwargs, mutable, training, seed=None):
        del training  # static: only there so that a change of mode retraces
        # functional_call writes buffer updates into what it gets: give it copies.
        buffers = {k: v.clone() for k, v in buffers.items()}
        state = {**params, **buffers}
        if seed is None:  # torch's global generator, advancing as in plain PyTorch
            out = torch.func.functional_call(module, state, args, kwargs)
        else:  # a generator state derived from the JAX key, leaving the global one alone
            with torch.random.fork_rng(devices=[]):
                if not isinstance(seed, FakeTensor):
                    torch.manual_seed(int(seed.item()))
                out = torch.func.functional_call(module, state, args, kwargs)
        return (out, buffers) if mutable else out

    forward.__name__ = forward.__qualname__ = f"{module_name}.forward"
    forward_without_rng = to_jax(forward, vmap_randomness="different")
    # A seed read with .item() cannot be batched by torch.func.vmap: loop over examples.
    forward_with_rng = to_jax(forward, vmap_method="sequential")

    def apply(variables: dict, *args: Any, mutable: bool = False, rng: Any = None, **kwargs: Any):
        if not isinstance(variables, dict) or set(variables) != {"params", "buffers"}:
            raise VariablesError(
                "variables must be the dict {'params': ..., 'buffers': ...} returned by "
                "module_to_jax."
            )
        for group in ("params", "buffers"):
            _check_group(module_name, group, variables[group], expected[group])
        training = tuple(m.training for m in module.modules())
        v_params, v_buffers = variables["params"], variables["buffers"]
        if rng is None:
            return forward_without_rng(v_params, v_buffers, args, kwargs, mutable, training)
        seed = jax.random.randint(rng, (), 0, np.iinfo(np.int32).max, dtype=np.int32)
        return forward_with_rng(v_params, v_buffers, args, kwargs, mutable, training, seed)

    apply.__doc__ = f"{module_name} as a pure function: apply(variables, *args, **kwargs)."
    return apply, variables
