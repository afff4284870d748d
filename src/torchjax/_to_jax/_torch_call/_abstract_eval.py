# torch_call's abstract evaluation rule: the output types of a call, without running it.
#
# Declared by the user (result_shape_dtypes), found by one run on fake tensors (the user's
# function, once per signature: see _fake/_run.py), or derived from the inner function's
# types (every derived callable: its out_types). Inputs are checked here too: a dtype torch
# has no equivalent of, a torch tensor where a JAX array belongs.
from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import torch

from torchjax._convert import SUPPORTED_DTYPES, torch_dtype
from torchjax._errors import ConversionError, ShardingWarning, warn
from torchjax._log import debug_on, describe, logger, signature
from torchjax._to_jax._callables._base import DerivedFunction
from torchjax._to_jax._context import DTYPES_OK
from torchjax._to_jax._options import Options
from torchjax._to_jax._torch_call._primitive import torch_call_p

_tree = jax.tree_util


def check_input_dtype(where: str, dtype: Any) -> None:
    try:
        torch_dtype(dtype)
    except ConversionError:
        is_key = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
        hint = "Pass jax.random.key_data(key) instead. " if is_key else ""
        raise ConversionError(
            f"{where} has dtype {dtype}, which torch has no equivalent of. "
            f"{hint}Cast it to one of: {SUPPORTED_DTYPES}."
        ) from None
    DTYPES_OK.add(dtype)


def abstract_eval(*args: Any, fn: Any, options: Options) -> Any:
    """Output types of ``fn(*args)``: declared by the user, found on fake tensors (the
    user's function), or derived from the inner function's (every derived function)."""
    if debug_on(logging.DEBUG):  # JAX caches this rule per signature: once per trace
        logger.debug("tracing %s at %s", describe(fn), signature(args))
    for path, leaf in _tree.tree_flatten_with_path(args)[0]:
        if isinstance(leaf, jax.core.ShapedArray) and leaf.dtype not in DTYPES_OK:
            check_input_dtype(fn.arg_path(path), leaf.dtype)
    if isinstance(fn, DerivedFunction):
        return fn.out_types(functools.partial(_types_of, options), *args)
    check_no_tensor(fn, args)
    warn_if_sharded(fn, args)
    if fn.result_shape_dtypes is not None:
        return fn.out_types(None, *args)
    return fn.fake_types(args)


torch_call_p.def_abstract_eval(abstract_eval)


def _types_of(options: Options, fn: Any, *args: Any) -> Any:
    # The cached abstract eval of an inner function: derived callables' types_of.
    return torch_call_p.abstract_eval(*args, fn=fn, options=options)


SHARDED = """\
{name} is called under jax.jit on {path}, sharded over the mesh axes {axes}. A torch call
sees whole arrays, so XLA gathers the array onto the device the call runs on, and torch
computes on all of it. To run torch on each device's own shard, call the function inside
jax.shard_map:

    jax.shard_map(f, mesh=mesh, in_specs=P({spec}), out_specs=P({spec}))"""


def warn_if_sharded(fn: Any, args: tuple) -> None:
    """Say so (once per signature: abstract eval is cached) where an input is sharded over
    several devices outside shard_map. Only explicitly sharded types tell (meshes of
    Explicit axes, jax.make_mesh's default); under Auto axes the trace does not know."""
    for path, leaf in _tree.tree_flatten_with_path(args)[0]:
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        axes = [a for a in spec or () if a is not None]
        if axes:
            shown = ", ".join(repr(a) for a in spec)
            text = SHARDED.format(name=fn.name, path=fn.arg_path(path), axes=axes, spec=shown)
            warn(text, ShardingWarning)
            return


def check_no_tensor(fn: Any, args: tuple) -> None:
    for path, leaf in _tree.tree_flatten_with_path(args)[0]:
        if isinstance(leaf, torch.Tensor):
            raise ConversionError(
                f"{fn.arg_path(path)} is a torch.Tensor; functions made by to_jax take JAX "
                f"arrays where the torch function takes tensors. Convert it with "
                f"torchjax.tree_to_jax, or close over it in the torch function."
            )
