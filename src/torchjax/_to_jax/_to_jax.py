# to_jax: the public wrapper that turns a torch function into a JAX function.
#
# All the work happens in torch_call_p's rules; this file validates the options, keeps
# one UserFunction per wrapped function (so jit caches hit on every call), and binds.
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, overload

import jax

from torchjax._compat._jax import traceback_boundary
from torchjax._compat._torch import any_autocast, autocast_state
from torchjax._convert import is_array
from torchjax._errors import ArgumentError, StaticArgumentError
from torchjax._log import profiled, profiling
from torchjax._primitive._params import call_path, check_hashable
from torchjax._to_jax._callables._user import UserFunction
from torchjax._to_jax._fake._run import function_name
from torchjax._to_jax._hooks import NO_HOOKS, CallHooks
from torchjax._to_jax._hot import MISS
from torchjax._to_jax._options import (
    GradMethod,
    Lowering,
    Options,
    VmapMethod,
    VmapRandomness,
    check_lowering,
)
from torchjax._to_jax._torch_call import torch_call_p
from torchjax._to_jax._xla._function import Lowered, lowered_function


def _raise_unhashable(user: UserFunction, args: tuple, kwargs: dict) -> None:
    takes = f"to_jax passes non-array leaves to {user.name} as static values"
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        if not is_array(leaf):
            check_hashable(leaf, user.arg_path(path), takes)


@overload
def to_jax(
    fn: Callable,
    *,
    result_shape_dtypes: Any = None,
    vmap_method: VmapMethod = "torch.func",
    vmap_randomness: VmapRandomness = "error",
    grad_method: GradMethod = "torch.func",
    lowering: Lowering = "callback",
) -> Callable: ...


@overload
def to_jax(
    fn: None = None,
    *,
    result_shape_dtypes: Any = None,
    vmap_method: VmapMethod = "torch.func",
    vmap_randomness: VmapRandomness = "error",
    grad_method: GradMethod = "torch.func",
    lowering: Lowering = "callback",
) -> Callable[[Callable], Callable]: ...


def to_jax(
    fn: Callable | None = None,
    *,
    result_shape_dtypes: Any = None,
    vmap_method: VmapMethod = "torch.func",
    vmap_randomness: VmapRandomness = "error",
    grad_method: GradMethod = "torch.func",
    lowering: Lowering = "callback",
) -> Callable:
    """Turn a function on torch tensors into a JAX function.

    The result takes the same arguments as `fn` (positional and keyword, arbitrary
    pytrees) with JAX arrays where `fn` takes tensors; every other leaf is passed to `fn`
    unchanged as a static (hashable) value. It returns `fn`'s output pytree with JAX arrays
    where `fn` returned tensors (Python numbers become 0-d arrays). It works eagerly and
    under ``jax.jit``, ``jax.vmap``, ``jax.grad``, ``jax.jvp`` and their compositions.

    Args:
      fn: the torch function. Omit it to use ``@to_jax(...)`` as a decorator factory.
      result_shape_dtypes: the outputs' types, a pytree of ``jax.ShapeDtypeStruct``, or a
        callable taking the inputs as ShapeDtypeStructs (same signature as `fn`) and
        returning one. Without it, types are found by running `fn` on torch fake
        tensors (no real data), once per input signature. With ``lowering="xla"`` the
        capture finds them, and a declaration is checked against it.
      vmap_method: how ``jax.vmap`` batches the call. ``"torch.func"`` (default; also
        spelled ``"torch"``): one call of ``torch.func.vmap(fn)``. ``"sequential"``: one
        call per example (for code that torch.vmap cannot batch). ``"expand_dims"``:
        `fn` handles a leading batch axis itself; unbatched inputs get a size-1 axis.
        ``"broadcast_all"``: likewise, with every input broadcast to the full batch.
      vmap_randomness: ``torch.func.vmap``'s ``randomness``: ``"error"`` (default),
        ``"different"`` or ``"same"``.
      grad_method: ``"torch.func"`` (default) differentiates with ``torch.func.jvp`` and
        ``torch.func.vjp`` (plain ``torch.autograd.grad`` for a VJP that nothing outside
        differentiates again); ``"autograd"`` uses ``torch.autograd.grad`` for code torch.func
        cannot transform (old-style ``torch.autograd.Function``, some extensions).
      lowering: ``"callback"`` (default): `fn` runs as torch code, one host callback per
        call; any torch code works. ``"xla"``: `fn` is captured with ``torch.export`` once
        per input signature and each ATen op becomes JAX ops (needs the ``torchjax[xla]``
        extra), so XLA fuses it, ``jax.export`` serializes it (symbolic dimensions too) and
        sharded inputs partition; an op with no JAX lowering (a custom op, a random op) runs
        its torch kernel as a callback. `fn` must run the same ops whatever its inputs'
        values; see ``torchjax.lowering_report`` and docs/lowering.md.

    Returns:
      A JAX function with `fn`'s name and docstring.

    Examples:
      >>> import jax, jax.numpy as jnp, torch, torchjax
      >>> @torchjax.to_jax
      ... def f(x):  # [N] -> []
      ...     return torch.sin(x).sum()
      >>> x = jnp.arange(3.0)
      >>> bool(jnp.allclose(jax.jit(jax.grad(f))(x), jnp.cos(x)))
      True
    """
    if fn is None:
        return functools.partial(
            to_jax,
            result_shape_dtypes=result_shape_dtypes,
            vmap_method=vmap_method,
            vmap_randomness=vmap_randomness,
            grad_method=grad_method,
            lowering=lowering,
        )
    if not callable(fn):
        raise ArgumentError(
            f"to_jax expects a callable (a torch function, or any Python callable), got "
            f"{type(fn).__name__}. Pass the function itself: to_jax(fn), or use @to_jax."
        )
    options = Options.checked(vmap_method, vmap_randomness, grad_method)
    if check_lowering(lowering) == "xla":
        callback = functools.partial(op_callback, options=options)
        lowered = Lowered(fn, function_name(fn), callback, call_path)
        return lowered_function(fn, lowered, result_shape_dtypes)
    return wrap(fn, result_shape_dtypes, options)


@functools.cache
def op_callback(op: Any, options: Options) -> Callable:
    """The callback-path JAX function of one torch op (a node lowering="xla" cannot lower),
    one per op and options, so jit caches hit across signatures and functions."""
    return wrap(op, None, options)


def wrap(
    fn: Callable, result_shape_dtypes: Any, options: Options, hooks: CallHooks = NO_HOOKS
) -> Callable:
    """to_jax's function for `fn`, whose `hooks` tell the call machinery about it
    (module_to_jax's forward: CallHooks)."""
    user = UserFunction(fn, result_shape_dtypes, hooks)
    params = torch_call_p._bound_params({"fn": user, "options": options})

    def call(args: tuple, kwargs: dict) -> Any:
        bound = params
        if any_autocast():  # a call in torch.autocast: the variant that runs in it
            variant = user.variant(autocast_state())
            bound = torch_call_p._bound_params({"fn": variant, "options": options})
        else:
            hot = params.hot  # the last eager signature's shortcut (see HotCall)
            if hot is not None and not kwargs:
                out = hot.call(args)
                if out is not MISS:
                    return out
        try:
            return torch_call_p._bind((args, kwargs), bound)
        except StaticArgumentError:
            # bind names paths in its own (args, kwargs) pair; name them as the user wrote.
            _raise_unhashable(user, args, kwargs)
            raise

    range_name = f"torchjax {user.name}"

    @functools.wraps(fn)
    @traceback_boundary  # an error's traceback starts at the user's call
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if profiling():  # a named range in the torch or jax profiler that records
            with profiled(range_name):
                return call(args, kwargs)
        return call(args, kwargs)

    # The params (in user.bound_params) refer back to `user`; emptying that dict when the
    # wrapper dies frees the function, its closure and its signature caches at once,
    # without waiting for the cycle collector. Held weakly: where fn itself refers back to
    # the wrapper (a module's forward and its variants), that is one cycle, collected whole.
    weakref.finalize(wrapped, _forget, weakref.ref(user))
    return wrapped


def _forget(user_ref: weakref.ref) -> None:
    user = user_ref()
    if user is not None:
        user.bound_params.clear()
        for variant in user.variants.values():
            variant.bound_params.clear()
        user.variants.clear()
