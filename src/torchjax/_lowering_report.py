# torchjax.lowering_report: what lowering="xla" makes of a torch function or module.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchjax._module_to_jax._module_to_jax import ModuleFunction, module_to_jax
from torchjax._to_jax._to_jax import to_jax
from torchjax._to_jax._xla._function import Lowered
from torchjax._to_jax._xla._report import LoweringReport, report

__all__ = ["lowering_report"]


def lowering_report(fn: Callable, *example_args: Any, **kwargs: Any) -> LoweringReport:
    """Which of a torch function's ops ``lowering="xla"`` turns into JAX ops, which run as
    torch callbacks and why, and whether ``jax.export`` can serialize the result.

    Args:
      fn: a torch function, an ``nn.Module``, a function made by ``to_jax(...,
        lowering="xla")``, or an ``apply`` made by ``module_to_jax(..., lowering="xla")``
        (whose first example argument is then its ``variables``).
      *example_args: the inputs, as JAX arrays, torch tensors or ``jax.ShapeDtypeStruct``
        (symbolic shapes too); other leaves are static values, as in a call.
      **kwargs: keyword inputs, likewise (for an ``apply``: ``rng=`` and ``mutable=``
        too).

    Returns:
      A ``LoweringReport``: ``print`` it for a table, or read ``ops`` (one ``OpRoute(op,
      count, lowered, why)`` per op and route), ``callbacks``, ``fully_lowered``,
      ``exportable`` and ``export_error``.

    Raises:
      LoweringError: torch.export cannot capture `fn` (the message names the frame and the
        fix), or torchax, the op table, is not installed.

    Examples:
      >>> import jax.numpy as jnp, torch, torchjax
      >>> r = torchjax.lowering_report(lambda x: torch.tanh(x) * 2, jnp.ones(3))  # [3] -> [3]
      >>> r.fully_lowered, r.exportable
      (True, True)
    """
    if isinstance(fn, ModuleFunction | torch.nn.Module):
        if isinstance(fn, ModuleFunction):  # a fresh apply like it, on the same variables
            impl = fn._impl
            options = {**impl.options, "lowering": "xla"}
            apply, _ = module_to_jax(impl.state.module, copy=False, **options)
            call = apply
        else:
            apply, variables = module_to_jax(fn, lowering="xla")
            call = lambda *a, **k: apply(variables, *a, **k)  # noqa: E731
        impl = apply._impl

        def lowered_of() -> list[Lowered]:
            return list(impl.lowered.by_mode.values()) if impl.lowered is not None else []

        return report(impl.name, call, lowered_of, example_args, kwargs)
    source = getattr(fn, "lowered", None)
    if not isinstance(source, Lowered):
        source = to_jax(fn, lowering="xla").lowered  # (checks that fn is callable)
    lowered = Lowered(source.fn, source.name, source.callback, source.describe)  # fresh
    call = lambda *a, **k: lowered((a, k))[0]  # noqa: E731
    return report(lowered.name, call, lambda: [lowered], example_args, kwargs)
