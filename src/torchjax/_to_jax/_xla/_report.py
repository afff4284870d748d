# What lowering="xla" made of a function at one signature: per torch op, lowered to JAX ops
# or run as a torch callback and why, and whether jax.export can serialize the result.
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import torch

from torchjax._convert import canonical_jax_dtype, is_array
from torchjax._to_jax._xla._function import Lowered
from torchjax._to_jax._xla._program import SymbolicCallback


@dataclasses.dataclass(frozen=True)
class OpRoute:
    """One torch op of the graph: how many nodes call it, and how they run."""

    op: str  # e.g. "aten.addmm.default", "mylib.myop.default"
    count: int
    lowered: bool  # True: JAX ops; False: the torch kernel, as a host callback
    why: str = ""  # for a callback: why it is not lowered


@dataclasses.dataclass(frozen=True)
class LoweringReport:
    """``lowering_report``'s answer; ``print`` it for a table.

    Attributes:
      function: the function's name.
      ops: one OpRoute per (op, route), lowered ops first.
      exportable: whether ``jax.export`` serialized the lowered function at the example
        signature (False wherever an op runs as a callback).
      export_error: why not, where it is not.
      narrowed: the ops that compute int64 values in int32 because JAX's x64 mode is off:
        they wrap past 2**31 where torch would not (docs/lowering.md).
      autograd_functions: the torch.autograd.Function classes the function applies: their
        backward is not lowered, so derivatives of the lowered function raise a
        LoweringError (docs/lowering.md).
    """

    function: str
    ops: tuple[OpRoute, ...]
    exportable: bool
    export_error: str | None = None
    narrowed: tuple[str, ...] = ()
    autograd_functions: tuple[str, ...] = ()

    @property
    def callbacks(self) -> tuple[OpRoute, ...]:
        """The ops that run as torch callbacks."""
        return tuple(r for r in self.ops if not r.lowered)

    @property
    def fully_lowered(self) -> bool:
        """Whether every op became JAX ops (no host callback in the program)."""
        return not self.callbacks

    def __str__(self) -> str:
        lowered = [r for r in self.ops if r.lowered]
        lines = [
            f'lowering="xla" of {self.function}: {sum(r.count for r in lowered)} ops lowered '
            f"to JAX, {sum(r.count for r in self.callbacks)} run as torch callbacks; "
            + ("jax.export can serialize it." if self.exportable else "not exportable.")
        ]
        for r in self.callbacks:
            lines.append(f"  callback  {r.op} x{r.count}: {r.why}")
        for r in lowered:
            lines.append(f"  lowered   {r.op} x{r.count}")
        if self.export_error:
            lines.append(f"  jax.export: {self.export_error}")
        if self.narrowed:
            lines.append(
                f"  int64 arithmetic computed in int32 (x64 off; it wraps past 2**31): "
                f"{', '.join(self.narrowed)}. jax.config.update('jax_enable_x64', True) "
                f"computes it in int64."
            )
        if self.autograd_functions:
            lines.append(
                f"  torch.autograd.Function {', '.join(self.autograd_functions)}: its backward "
                f"is not lowered, so derivatives raise; lowering='callback' runs it."
            )
        return "\n".join(lines)


def _as_struct(leaf: Any) -> Any:
    """An example leaf as JAX sees it: a torch tensor by its shape and dtype."""
    if isinstance(leaf, torch.Tensor):
        return jax.ShapeDtypeStruct(tuple(leaf.shape), canonical_jax_dtype(leaf.dtype))
    if is_array(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return leaf


def report(
    name: str, call: Callable, lowered_of: Callable[[], list[Lowered]], args: tuple, kwargs: dict
) -> LoweringReport:
    """The LoweringReport of `call(*args, **kwargs)`, a function of JAX values that runs
    fresh Lowered functions (`lowered_of()` lists them once it has run), traced at the
    example signature (arrays, torch tensors or ShapeDtypeStructs, symbolic shapes too;
    other leaves are static)."""
    leaves, tree = jax.tree_util.tree_flatten(jax.tree_util.tree_map(_as_struct, (args, kwargs)))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.ShapeDtypeStruct)]

    def on_arrays(*arrays: Any) -> Any:
        filled = list(leaves)
        for i, a in zip(slots, arrays, strict=True):
            filled[i] = a
        a, k = jax.tree_util.tree_unflatten(tree, filled)
        return call(*a, **k)

    structs = [leaves[i] for i in slots]
    symbolic = None
    try:
        jax.eval_shape(on_arrays, *structs)
    except SymbolicCallback as error:  # (an op that cannot lower at symbolic shapes)
        symbolic = str(error).splitlines()[0]
    counts: collections.Counter = collections.Counter()
    narrowed: set[str] = set()
    functions: set[str] = set()
    for each in lowered_of():
        for program, _, _ in each.programs.values():
            narrowed.update(program.narrowed)
            functions.update(program.captured.autograd_functions)
            for route in program.routes.values():
                counts[(route.op, route.lowered, route.why)] += 1
    ops = tuple(
        OpRoute(op, n, is_lowered, why)
        for (op, is_lowered, why), n in sorted(
            counts.items(), key=lambda kv: (not kv[0][1], kv[0][0])
        )
    )
    if symbolic is not None:
        exportable, error = False, symbolic
    else:
        try:
            jax.export.export(jax.jit(on_arrays))(*structs).serialize()
            exportable, error = True, None
        except Exception as e:  # what jax.export says, first line: a host callback, say
            first = str(e).strip().splitlines()[0][:200]
            exportable, error = False, f"{type(e).__name__}: {first}"
    return LoweringReport(
        name, ops, exportable, error, tuple(sorted(narrowed)), tuple(sorted(functions))
    )
