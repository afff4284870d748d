"""The exceptions torchjax raises on purpose, importable for ``except`` clauses.

Every exception class derives from :class:`TorchJaxError`, so ``except TorchJaxError`` catches any
of them; each also derives from the builtin exception that describes its kind
(``TypeError``, ``ValueError``, ``RuntimeError``, ``NotImplementedError``), so code written
against those keeps working. Messages say what went wrong, where (an argument path such
as ``args[0]['w']``) and how to fix it.

Examples:
  >>> import jax.numpy as jnp, torch, torchjax
  >>> from torchjax.errors import InPlaceMutationError, TorchJaxError
  >>> bump = torchjax.to_jax(lambda x: x.add_(1))  # modifies its input
  >>> try:
  ...     bump(jnp.zeros(3))
  ... except InPlaceMutationError as e:
  ...     print(isinstance(e, TorchJaxError), "in place" in str(e))
  True True
"""

from torchjax._errors import (
    ArgumentError,
    AutodiffError,
    ConversionError,
    CopyWarning,
    InPlaceMutationError,
    JaxOutputError,
    LoweringError,
    OutputMismatchError,
    RuleError,
    ShapeInferenceError,
    ShardingWarning,
    StateWarning,
    StaticArgumentError,
    TorchJaxError,
    VariablesError,
    VmapError,
)

__all__ = [
    "TorchJaxError",
    "ArgumentError",
    "AutodiffError",
    "ConversionError",
    "InPlaceMutationError",
    "JaxOutputError",
    "LoweringError",
    "OutputMismatchError",
    "RuleError",
    "ShapeInferenceError",
    "CopyWarning",
    "ShardingWarning",
    "StateWarning",
    "StaticArgumentError",
    "VariablesError",
    "VmapError",
]
