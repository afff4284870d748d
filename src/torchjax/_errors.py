# Error types. Every message says what went wrong, where (an argument path such as
# `args[0]['a']`), and how to fix it; long messages are built by the module that knows the
# context, these classes only let callers catch torchjax's failures precisely.
from __future__ import annotations


class TorchJaxError(Exception):
    """Base class of every error torchjax raises on purpose."""


class ConversionError(TorchJaxError, TypeError):
    """A value could not be converted between torch and JAX (dtype, device, tracer)."""


class StaticArgumentError(TorchJaxError, TypeError):
    """A non-array leaf of a primitive's arguments cannot serve as a static value."""


class RuleError(TorchJaxError, NotImplementedError):
    """A PytreePrimitive lacks a rule that a transformation needs."""


class OutputMismatchError(TorchJaxError, ValueError):
    """A rule or a torch function returned outputs that differ from the declared ones."""


class ShapeInferenceError(TorchJaxError, RuntimeError):
    """Output shapes could not be found by running the function on fake tensors."""


class InPlaceMutationError(TorchJaxError, RuntimeError):
    """A torch function modified one of its inputs in place."""


class TorchCallError(TorchJaxError, RuntimeError):
    """The wrapped torch function raised; the message carries the original type and text."""


class VmapError(TorchJaxError, RuntimeError):
    """torch.func.vmap could not batch the function."""


class AutodiffError(TorchJaxError, RuntimeError):
    """torch.func could not differentiate the function."""


class JaxOutputError(TorchJaxError, TypeError):
    """A JAX function called through to_torch returned a value torch cannot hold."""
