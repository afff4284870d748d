# The ATen -> JAX op table lowering="xla" uses: torchax's, imported on first use only.
#
# torchax's import changes global state. Each change is undone right after the import (the
# MHA fast path, an environment variable, JAX's PJRT client options, torch's global
# decomposition tables) or refused while it runs (renaming torch's privateuse1 backend to
# "jax" and registering a device module for it, which torch allows once per process and which
# break torch.compile afterwards): the process is left as it was.
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import torch

from torchjax._compat._torch import (
    DECOMPOSITION_TABLES,
    device_registration_refused,
    is_op_overload,
)
from torchjax._errors import LoweringError
from torchjax._to_jax._context import LOWERING_LOCK

_MISSING = """\
lowering="xla" needs torchax, the ATen -> JAX op table it lowers each torch op with, and it is
not installed ({error}). Install the pinned extra:

    pip install 'torchjax[xla]'

or use the default lowering="callback", which runs the function as torch code."""

_PJRT_OPTION = "jax_pjrt_client_create_options"
_TELEMETRY = "ENABLE_RUNTIME_UPTIME_TELEMETRY"


@dataclasses.dataclass(frozen=True)
class OpTable:
    """torchax's lowerings and the decompositions run before them.

    ``ops`` maps an ATen overload (or its packet) to torchax's Operator (``func``,
    ``is_jax_function``, ``needs_env``); ``decompositions`` is torchax's table, run after
    torch.export's core ATen decompositions.
    """

    ops: dict
    decompositions: dict

    def lowering(self, target: Any) -> Any:
        """torchax's Operator for `target`, or None."""
        op = self.ops.get(target)
        if op is None and is_op_overload(target):
            op = self.ops.get(target.overloadpacket)
        return op


_table: OpTable | None = None


def op_table() -> OpTable:
    """The op table, imported once (thread-safe); LoweringError where torchax is missing."""
    global _table
    if _table is None:
        with LOWERING_LOCK:
            if _table is None:
                _table = _contained(_import_torchax)
    return _table


def _import_torchax() -> OpTable:
    try:
        import torchax  # noqa: F401
        import torchax.decompositions
        import torchax.ops.jaten  # noqa: F401  (registers the ATen lowerings)
        import torchax.ops.jtorch  # noqa: F401
        from torchax.ops import ops_registry
    except ImportError as error:
        raise LoweringError(_MISSING.format(error=error)) from None
    return OpTable(ops_registry.all_aten_ops, torchax.decompositions.DECOMPOSITIONS)


def _contained(load: Callable[[], OpTable]) -> OpTable:
    """`load()`, with the global settings torchax's import changes put back afterwards."""
    fastpath = torch.backends.mha.get_fastpath_enabled()
    telemetry = os.environ.get(_TELEMETRY)
    pjrt = getattr(jax.config, _PJRT_OPTION, None)
    # torchax registers its extra decompositions into torch's global tables, which
    # torch.compile reads; its own copy of them is all lowering needs.
    tables = DECOMPOSITION_TABLES
    saved = {kind: dict(table) for kind, table in tables.items()}
    try:
        with device_registration_refused():
            return load()
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        if telemetry is None:
            os.environ.pop(_TELEMETRY, None)
        else:
            os.environ[_TELEMETRY] = telemetry
        if pjrt is not None and getattr(jax.config, _PJRT_OPTION, None) != pjrt:
            jax.config.update(_PJRT_OPTION, pjrt)
        for kind, table in tables.items():
            table.clear()
            table.update(saved.get(kind, {}))
