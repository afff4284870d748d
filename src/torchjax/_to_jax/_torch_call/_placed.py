# A host call that exists only inside torch_call's lowering on partitioned programs: a
# primitive whose MLIR is jax's python callback with the sharding jax gives its own
# callbacks (once, on device 0, under jit's partitioner; per device in shard_map), called
# with numpy views of its operands (_compat/_jax.py's emit_placed_callback says why not
# io_callback). XLA moves the operands to that device and the results back out.
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from torchjax._compat._jax import core, emit_placed_callback, mlir

placed_call_p = core.Primitive("torchjax_placed_call")
placed_call_p.multiple_results = True


def _abstract_eval(*avals: Any, host: Callable, out_avals: tuple, draws: bool) -> tuple:
    del avals, host, draws
    return out_avals


def _lowering(ctx: Any, *operands: Any, host: Callable, out_avals: tuple, draws: bool) -> list:
    del out_avals
    return emit_placed_callback(ctx, host, operands, has_side_effect=draws)


placed_call_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(placed_call_p, _lowering)


def placed_call(
    host: Callable,
    out_structs: Sequence[jax.ShapeDtypeStruct],
    operands: Sequence[Any],
    draws: bool,
) -> list:
    """Stage `host(*numpy operands) -> [numpy outputs]` in the lowering being traced. A call
    that `draws` is a side effect: XLA neither merges two of them nor drops an unused one."""
    out_avals = tuple(core.ShapedArray(s.shape, s.dtype) for s in out_structs)
    return list(placed_call_p.bind(*operands, host=host, out_avals=out_avals, draws=draws))
