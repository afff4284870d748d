# Error types. Every message says what went wrong, where (an argument path such as
# `args[0]['a']`), and how to fix it; long messages are built by the module that knows the
# context, these classes only let callers catch torchjax's failures precisely. The public
# names live in torchjax.errors; each class also derives from the builtin exception of its
# kind, so `except TypeError` and the like keep working.
from __future__ import annotations

import sys
import warnings


class TorchJaxError(Exception):
    """Base class of every error torchjax raises on purpose."""


class ConversionError(TorchJaxError, TypeError):
    """A value could not be converted between torch and JAX.

    Raised by ``tree_to_jax``/``tree_to_torch`` and the functions made by ``to_jax`` and
    ``to_torch``: a dtype the other side lacks, a 64-bit value that does not fit while
    JAX's x64 mode is off, a torch tensor passed where a JAX array is expected.
    """


class ArgumentError(TorchJaxError, TypeError, ValueError):
    """An argument of one of torchjax's own functions is of the wrong kind or value: to_jax
    of something that is not callable, an option outside its choices (``vmap_method``,
    ``vmap_randomness``, ``grad_method``), module_to_jax of a ScriptModule, a parameter
    name to_torch_module cannot use. The message names the argument and what it accepts."""


class StaticArgumentError(TorchJaxError, TypeError):
    """A non-array leaf of the arguments cannot serve as a static value.

    Non-array leaves are compile-time values: they must be hashable and must not be arrays
    of the other framework (``to_jax``, ``to_torch``, ``PytreePrimitive.bind``).
    """


class RuleError(TorchJaxError, NotImplementedError):
    """A ``PytreePrimitive`` lacks a rule (jvp, transpose, batching, ...) that a
    transformation needs."""


class OutputMismatchError(TorchJaxError, ValueError):
    """A function returned outputs that differ from the declared ones.

    A torch function whose real outputs differ in structure, shape or dtype from its
    ``result_shape_dtypes`` (or from its fake-tensor run), or that returned a leaf that is
    neither a tensor nor a number; a ``PytreePrimitive`` rule returning the wrong pytree.
    """


class ShapeInferenceError(TorchJaxError, RuntimeError):
    """Output shapes could not be found by running the torch function on fake tensors
    (data-dependent shapes, ``.item()``); declare ``result_shape_dtypes`` instead."""


class InPlaceMutationError(TorchJaxError, RuntimeError):
    """A torch function modified one of its inputs in place, which would change the
    caller's immutable JAX array; clone the input inside the function first."""


class VmapError(TorchJaxError, RuntimeError):
    """``jax.vmap`` of a wrapped torch function failed: ``torch.func.vmap`` could not batch
    it (try ``vmap_method="sequential"``), or an ``"expand_dims"``/``"broadcast_all"``
    function returned an output without the batch axis."""


class AutodiffError(TorchJaxError, RuntimeError):
    """``torch.func`` (or ``torch.autograd``) could not differentiate the wrapped torch
    function (try ``grad_method="autograd"``)."""


class JaxOutputError(TorchJaxError, TypeError):
    """A JAX function called through ``to_torch`` returned a value torch cannot hold
    (a non-array leaf, or a dtype torch lacks)."""


class VariablesError(TorchJaxError, ValueError):
    """``variables`` passed to a ``module_to_jax`` function does not match the module's
    parameters and buffers (missing, unexpected or misshaped entries), or torch computed
    with a module tensor that has no data: one of a module after
    ``module_to_jax(module, copy="move")``, or one the module kept outside its parameter
    and buffer slots."""


class LoweringError(TorchJaxError, RuntimeError):
    """``lowering="xla"`` cannot turn the function into JAX ops: torch.export cannot
    capture it (Python control flow on tensor values, an unsupported construct), the op
    table is not installed, or a symbolic shape has no torch.export equivalent. The
    message names the frame and the fix; ``lowering="callback"`` runs any torch code."""


class StateWarning(UserWarning):
    """A torch module changed state that torchjax does not keep: a buffer written or
    reassigned by a ``module_to_jax`` call with ``mutable=False`` (the new value is dropped;
    ``mutable=True`` returns it)."""


class ShardingWarning(UserWarning):
    """An input sharded over several devices reaches a torch call under jax.jit outside
    jax.shard_map: XLA gathers it, and torch computes on the whole array."""


class CopyWarning(UserWarning):
    """A wrapped function asked an input for a writable pointer without writing (.numpy(),
    data_ptr(), some compiled kernels): its calls of that signature run on copies of their
    inputs from then on (read addresses with const_data_ptr() to stay zero-copy)."""


# Frames a warning is not attributed to: torchjax's own, and those of the libraries between
# the user's call and torchjax's (JAX's tracing and dispatch, torch's module call).
_LIBRARIES = frozenset({"torchjax", "jax", "jaxlib", "torch", "contextlib", "functools"})


def warn(text: str, category: type[Warning]) -> None:
    """warnings.warn, attributed to the user's line that led here (the first frame outside
    torchjax and the libraries it runs under), so that the message points at the user's
    call and the warning filters' once-per-location rule counts the user's locations."""
    frame, level = sys._getframe(1), 2  # 2: warn's caller
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES:
        frame, level = frame.f_back, level + 1
    warnings.warn(text, category, stacklevel=level)
