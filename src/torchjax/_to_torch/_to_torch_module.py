# to_torch_module: a JAX function of a params pytree as a torch.nn.Module.
#
# The params become nn.Parameters (their own copies: torch.optim writes them in place, and
# must never write into a JAX array), registered in nested submodules named by the tree's
# keys, so that state_dict() reads "dense.kernel" for params["dense"]["kernel"]. forward
# reads the tensors back out of the module's own dicts on every call, which is what lets
# torch.func.functional_call and load_state_dict substitute them, and calls the function
# through to_torch, which gives autograd, torch.func and torch.compile.
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import torch

from torchjax._compat._torch import module_buffers, module_children, module_parameters
from torchjax._convert import tree_to_torch
from torchjax._errors import ArgumentError, ConversionError
from torchjax._to_torch._to_torch import to_torch

_tree = jax.tree_util

_BAD_NAME = """\
to_torch_module: params{path} has the key {key!r}, which cannot name a torch parameter or
submodule ({why}).
state_dict() joins the keys of a path with ".", so a key must be a non-empty string without
"." (numbers become strings) that is not an attribute of torch.nn.Module ("training",
"forward", ...). Rename the key, e.g.
    params = {{"dense_1": ...}}   # instead of {{"dense.1": ...}}"""

_BAD_LEAF = """\
to_torch_module: params{path} is a {kind}; every leaf of params must be an array (jax.Array
or numpy array) to become a torch parameter. Pass numbers as arrays (jnp.asarray(0.5)), and
close over non-array settings in fn instead of putting them in params."""


def _key_name(key: Any) -> str:
    """One path element as a name part: dict key, sequence index, attribute, or index."""
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey (FlattenedIndexKey)
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _names(path: tuple) -> list[str]:
    parts = [_key_name(k) for k in path] or ["params"]  # a bare array as params
    for i, part in enumerate(parts):
        why = "it is empty" if not part else 'it contains "."' if "." in part else None
        if why:
            raise ArgumentError(_BAD_NAME.format(path=_tree.keystr(path[:i]), key=part, why=why))
    return parts


def _check_free(owner: torch.nn.Module, name: str, path: tuple) -> None:
    # Module.__setattr__ would refuse later writes to such an attribute (module.eval() sets
    # `training`), and attribute access would find the attribute, not the parameter.
    if hasattr(owner, name):
        why = f"{type(owner).__name__} already has an attribute of that name"
        raise ArgumentError(_BAD_NAME.format(path=_tree.keystr(path), key=name, why=why))


class _Node(torch.nn.Module):
    """A container for the parameters and submodules under one key of the params tree."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a params container of to_torch_module is not callable")


class JaxModule(torch.nn.Module):
    """A JAX function ``fn(params, *args, **kwargs)`` with its params as nn.Parameters.

    Made by :func:`to_torch_module`; see there. ``forward(*args, **kwargs)`` returns
    ``fn(params, *args, **kwargs)`` with the module's current parameters as ``params``.
    """

    def __init__(self, fn: Callable, params: Any, has_aux: bool = False):
        super().__init__()
        self._fn_name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        leaves, self._treedef = _tree.tree_flatten_with_path(params)
        treedef = self._treedef

        # forward passes the leaves as a flat list, so that it does no JAX pytree work of
        # its own, which torch.compile could not trace; to_torch's wrapper it can.
        def flat_fn(leaves: list, *args: Any, **kwargs: Any) -> Any:
            return fn(_tree.tree_unflatten(treedef, leaves), *args, **kwargs)

        flat_fn.__name__ = flat_fn.__qualname__ = self._fn_name
        self._call = to_torch(flat_fn, has_aux=has_aux)
        # (owner's dict, key) of each leaf, in flattening order: forward reads them there.
        self._slots: list[tuple[dict, str]] = []
        for path, leaf in leaves:
            if not isinstance(leaf, jax.Array | np.ndarray):
                kind = type(leaf).__qualname__
                raise ConversionError(_BAD_LEAF.format(path=_tree.keystr(path), kind=kind))
            *parents, name = _names(path)
            owner: torch.nn.Module = self
            for i, part in enumerate(parents):
                child = module_children(owner).get(part)
                if child is None:
                    _check_free(owner, part, path[:i])
                    child = module_children(owner)[part] = _Node()
                owner = child
            # A copy that torch owns: optimizers update it in place.
            tensor = tree_to_torch(leaf).detach().clone(memory_format=torch.contiguous_format)
            _check_free(owner, name, path[:-1])
            if tensor.is_floating_point() or tensor.is_complex():
                module_parameters(owner)[name] = torch.nn.Parameter(tensor)
                self._slots.append((module_parameters(owner), name))
            else:  # integers and booleans cannot require grad: a (saved) buffer
                module_buffers(owner)[name] = tensor
                self._slots.append((module_buffers(owner), name))

    def param_tree(self) -> Any:
        """The current parameters (tensors) as a pytree shaped like the params given."""
        return _tree.tree_unflatten(self._treedef, [d[k] for d, k in self._slots])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._call([d[k] for d, k in self._slots], *args, **kwargs)

    def extra_repr(self) -> str:
        return f"fn={self._fn_name}"

    if TYPE_CHECKING:
        # For type checkers only: the attributes are the params' names, made at run time, so
        # `module.dense.kernel` is a parameter or a group of them, not nn.Module's
        # `Tensor | Module` (which has no `.detach()`). nn.Module's own __getattr__ runs.
        def __getattr__(self, name: str) -> Any: ...


def to_torch_module(fn: Callable, params: Any, *, has_aux: bool = False) -> JaxModule:
    """Turn a JAX function and its params pytree into a ``torch.nn.Module``.

    Args:
      fn: a JAX function ``fn(params, *args, **kwargs)``, pure as for ``jax.jit``; it is
        called through :func:`to_torch`, so ``args`` are torch tensors (pytrees allowed).
      params: a pytree of arrays (``jax.Array`` or numpy). Floating and complex leaves
        become ``nn.Parameter``s, integer and boolean ones buffers. Each is a copy that torch
        owns, made once now: training the module never changes ``params``.
      has_aux: as in :func:`to_torch`: ``fn`` returns ``(output, aux)``.

    Returns:
      A module whose ``forward(*args, **kwargs)`` returns ``fn(params, *args, **kwargs)``
      with its current parameters. Names follow the tree paths, joined by ``"."``
      (``params["dense"]["kernel"]`` is ``"dense.kernel"``, list items are numbered), so
      ``state_dict``/``load_state_dict``, ``torch.optim``, ``torch.func.functional_call``
      and ``torch.compile`` work as for any module. ``module.param_tree()`` returns the
      current tensors as a pytree shaped like ``params``.

    Raises:
      ValueError: a key of ``params`` is empty, contains ``"."``, or is the name of a
        ``torch.nn.Module`` attribute (such as ``"training"`` or ``"forward"``).
      ConversionError: a leaf of ``params`` is not an array.

    Examples:
      >>> import jax, jax.numpy as jnp, torch, torchjax
      >>> def mlp(params, x):  # {"dense": {"kernel": [3, 2], "bias": [2]}}, [N, 3] -> [N, 2]
      ...     return jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
      >>> params = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}}
      >>> model = torchjax.to_torch_module(mlp, params)
      >>> sorted(model.state_dict())
      ['dense.bias', 'dense.kernel']
      >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
      >>> model(torch.ones(4, 3)).pow(2).sum().backward()
      >>> opt.step()
      >>> float(params["dense"]["kernel"][0, 0])  # the JAX params are untouched
      1.0
    """
    if not callable(fn):
        raise ArgumentError(
            f"to_torch_module: fn must be a JAX function (a callable), got {type(fn).__name__}."
        )
    return JaxModule(fn, params, has_aux)
