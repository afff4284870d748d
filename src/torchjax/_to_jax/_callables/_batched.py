# jax.vmap's callables: BatchedFunction (torch.func.vmap of its inner callable, or a loop
# over examples) and LeadingAxisFunction (vmap_method "expand_dims"/"broadcast_all": the
# inner callable handles the batch axis itself). One batched torch call serves a whole
# jax.vmap batch, however deep the nesting.
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import torch

from torchjax._compat._messages import (
    is_vmap_failure,
    lacks_batching_rule,
    needs_setup_context,
    refuses_randomness,
    runs_autograd_itself,
)
from torchjax._compat._torch import FINDS_UNBATCHED, batched_here
from torchjax._errors import (
    TorchJaxError,
    VmapError,
)
from torchjax._primitive._params import store
from torchjax._to_jax._call._plan import autograd_inside
from torchjax._to_jax._callables._base import DerivedFunction, TypesOf, _aval
from torchjax._to_jax._callables._user import UserFunction
from torchjax._to_jax._fake._run import (
    fake_eval,
    fake_target,
)
from torchjax._to_jax._torch_ops._vmap import (
    MODULE_RANDOMNESS_HINT,
    RANDOMNESS_HINT,
    VMAP_HINT,
    as_tensor,
    beneath_autograd,
    is_abstract,
    vmap_call,
)

_tree = jax.tree_util

_tree = jax.tree_util


EMPTY_BATCH_NOTE = """\
(jax.vmap over an empty batch: torchjax ran {name} on one example of zeros, batched, to
compute the call's outputs and derivatives, and that run failed.)"""

UNBATCHED_CHANGED = """\
{name}, batched by torch.func.vmap, batched its output {j} (in flattening order) that the
run that found which outputs depend on the batched inputs (on fake tensors, when the call
was traced) left unbatched, so JAX was told it is unbatched. Which outputs depend on the
batched inputs changes with the values (control flow on values, or random draws with
vmap_randomness='different'). Batch this function one example at a time instead:
to_jax(fn, vmap_method='sequential')."""


# -- jax.vmap ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BatchedFunction(DerivedFunction):
    """``torch.func.vmap(inner)`` over the tensor leaves of inner's positional args.

    Attributes:
      inner: the torch callable being batched.
      in_dims: one int (batched axis) or None per tensor leaf, in flattening order.
      randomness: torch.func.vmap's randomness policy.
      per_example: call inner once per example instead (a derivative by torch.autograd.grad).
      out_dims: 0 or None per output leaf, None where the output does not depend on the
        batched inputs and stays unbatched (jax.vmap's out_axes=None); None for all
        batched.
    """

    inner: Any
    in_dims: tuple
    randomness: str
    per_example: bool = False
    out_dims: tuple | None = None

    maps_a_batch = True  # over an empty batch, nothing to compute (CallPlan.empty_batch)

    def with_out_dims(self, args: tuple) -> BatchedFunction:
        """This call, with the outputs that depend on no batched input left unbatched.

        Asked of the user's function only, where some tensor input is unbatched (with every
        input batched only a constant output could be), by one fake run per signature of it
        under torch.func.vmap. Where that run fails, every output is batched, as it always
        can be.
        """
        root = self.inner
        if root is not root.root or self.per_example or not FINDS_UNBATCHED:
            return self
        if None not in self.in_dims:
            return self
        leaves, tree = _tree.tree_flatten(args)
        abstract = [_aval(x) if is_abstract(x) else x for x in leaves]
        signature = tuple(x if is_abstract(x) else (type(x), x) for x in abstract)
        key = (self.in_dims, self.randomness, tree, signature)
        out_dims = root.batched_outputs.get(key, False)
        if out_dims is False:
            out_dims = self._probe(_tree.tree_unflatten(tree, abstract))
            store(root.batched_outputs, key, out_dims)
        return self if out_dims is None else dataclasses.replace(self, out_dims=out_dims)

    def _probe(self, args: tuple) -> tuple | None:
        """with_out_dims's fake run: the out_dims it found, or None (all batched)."""
        root = self.inner
        seen: list = []
        probe = dataclasses.replace(self, inner=UserFunction(fake_target(root.fn)))

        def run(*a: Any) -> Any:
            leaves, tree = _tree.tree_flatten(a)
            positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            return probe._vmap(leaves, tree, positions, seen=seen)

        try:
            fake_eval(run, args, root.name, root.arg_path, root.fn, hooks=root.hooks)
        except Exception:  # noqa: BLE001 - batched outputs are always right, if wasteful
            return None
        if not seen or all(seen[-1]):
            return None
        return tuple(0 if b else None for b in seen[-1])

    def _call(self, *args: Any) -> Any:
        leaves, tree = _tree.tree_flatten(args)
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        mapped = [(i, d) for i, d in zip(positions, self.in_dims, strict=True) if d is not None]
        if mapped and leaves[mapped[0][0]].shape[mapped[0][1]] == 0:
            return self._empty_batch(leaves, tree, mapped)
        if self.per_example or autograd_inside():  # autograd cannot run under torch.func.vmap
            return self._loop(leaves, tree, positions)
        try:
            return self._vmap(leaves, tree, positions)
        except Exception as e:
            if isinstance(e, TorchJaxError) or runs_autograd_itself(e):
                raise  # ours; or: the call runs again with a loop (CallPlan.invoke)
            if lacks_batching_rule(e):
                # Composite ops (column_stack) decompose into batchable ones only beneath
                # an autograd level, as under torch.func.vmap(torch.func.grad(f)).
                try:
                    return self._vmap(leaves, tree, positions, decompose=True)
                except Exception:
                    raise e from None
            if is_vmap_failure(e):
                raise  # torch.func.vmap's own message: call_failure adds the advice
            # Ambiguous (an in-place op into an unbatched tensor fails with a shape
            # error): the function's own failure if one example alone fails too.
            self._one_example(leaves, tree, positions)
            raise VmapError(self._hint(e)) from e

    def _empty_batch(self, leaves: list, tree: Any, mapped: list) -> Any:
        """An empty batch, which torch.func.vmap cannot run many ops over (no example to
        select): one example of zeros appended, and the batched outputs cut back to none,
        detached. Exact, derivatives too: nothing flows back from the cut-off example (a
        gradient of an unbatched input sums over no example, as JAX's does), and an
        output that stays unbatched depends on no batched input."""
        padded = list(leaves)
        for i, d in mapped:
            x = leaves[i]
            padded[i] = torch.cat([x, x.new_zeros((*x.shape[:d], 1, *x.shape[d + 1 :]))], d)
        try:
            out = self(*_tree.tree_unflatten(tree, padded))
        except Exception as e:
            e.add_note(EMPTY_BATCH_NOTE.format(name=self.root.name))
            raise
        outs, out_tree = _tree.tree_flatten(out)
        dims = self.out_dims or (0,) * len(outs)
        # Detached: no derivative flows back from the cut-off example at all (a zero
        # cotangent times its derivative at the zeros, inf for w / x, would be NaN).
        cut = [o if d is None else o.detach()[:0] for o, d in zip(outs, dims, strict=True)]
        return _tree.tree_unflatten(out_tree, cut)

    def _one_example(self, leaves: list, tree: Any, positions: list) -> None:
        new = list(leaves)
        for i, d in zip(positions, self.in_dims, strict=True):
            if d is not None:
                if not leaves[i].shape[d]:
                    return
                new[i] = leaves[i].select(d, 0)
        self.inner(*_tree.tree_unflatten(tree, new))

    def _loop(self, leaves: list, tree: Any, positions: list) -> Any:
        """inner once per example, outputs stacked: for what torch.func.vmap cannot run."""
        mapped = [(i, d) for i, d in zip(positions, self.in_dims, strict=True) if d is not None]
        size = leaves[mapped[0][0]].shape[mapped[0][1]]
        device = leaves[mapped[0][0]].device
        rows, out_tree = [], None
        for k in range(size):
            new = list(leaves)
            for i, d in mapped:
                new[i] = leaves[i].select(d, k)
            out_leaves, out_tree = _tree.tree_flatten(self.inner(*_tree.tree_unflatten(tree, new)))
            rows.append([as_tensor(o, device) for o in out_leaves])
        dims = self.out_dims or (0,) * out_tree.num_leaves
        stacked = [
            torch.stack([r[j] for r in rows]) if d is not None else self._same(rows, j)
            for j, d in enumerate(dims)
        ]
        return _tree.tree_unflatten(out_tree, stacked)

    def _same(self, rows: list, j: int) -> torch.Tensor:
        """Output j, which out_dims keeps unbatched: equal in every example, checked."""
        if not all(torch.equal(r[j], rows[0][j]) for r in rows[1:]):
            raise VmapError(UNBATCHED_CHANGED.format(name=self.root.name, j=j))
        return rows[0][j]

    def _vmap(
        self, leaves: list, tree: Any, positions: list, decompose: bool = False, seen: Any = None
    ) -> Any:
        """One torch.func.vmap call; `seen` (a list) collects which outputs were batched."""
        out_tree = []
        device = leaves[positions[0]].device if positions else None
        # Only the batched tensors go through vmap's arguments; the others are captured,
        # which torch.func.vmap treats exactly like in_dims=None, and saves its per-argument
        # Python work on every call.
        mapped = [(i, d) for i, d in zip(positions, self.in_dims, strict=True) if d is not None]

        def flat(*tensors: torch.Tensor) -> Any:
            new = list(leaves)
            for (i, _), t in zip(mapped, tensors, strict=True):
                new[i] = t
            out_leaves, treedef = _tree.tree_flatten(self.inner(*_tree.tree_unflatten(tree, new)))
            out_tree.append(treedef)
            out = [x if isinstance(x, torch.Tensor) else as_tensor(x, device) for x in out_leaves]
            # One output goes back bare: vmap's per-output Python work is per call.
            return out[0] if len(out) == 1 else tuple(out)

        call = beneath_autograd(flat) if decompose else flat
        unbatched: dict = {}
        if seen is not None or self.out_dims is not None:
            call = self._watching(call, seen, unbatched)
        dims = tuple(d for _, d in mapped)
        out = vmap_call(call, [leaves[i] for i, _ in mapped], dims, self.randomness)
        outs = [out] if out_tree[-1].num_leaves == 1 else list(out)
        for j, o in unbatched.items():
            outs[j] = o  # not batched at this level: as it left the function (vmap expanded it)
        return _tree.tree_unflatten(out_tree[-1], outs)

    def _watching(self, call: Any, seen: Any, unbatched: dict) -> Any:
        """`call`, noting which outputs are batched at this vmap level (into `seen`), or
        keeping those out_dims leaves unbatched (into `unbatched`), checked to be so."""

        def watched(*tensors: torch.Tensor) -> Any:
            out = call(*tensors)
            outs = [out] if isinstance(out, torch.Tensor) else out
            if seen is not None:
                seen.append([batched_here(o) for o in outs])
                return out
            for j, d in enumerate(self.out_dims):
                if d is None:
                    if batched_here(outs[j]):
                        raise VmapError(UNBATCHED_CHANGED.format(name=self.root.name, j=j))
                    unbatched[j] = outs[j]
            return out

        return watched

    def out_types(self, types_of: TypesOf, *args: Any) -> Any:
        leaves, tree = _tree.tree_flatten(args)
        dims = iter(self.in_dims)
        size, unbatched = None, []
        for x in leaves:
            d = next(dims) if is_abstract(x) else None
            if d is not None:
                size = x.shape[d]
                x = jax.ShapeDtypeStruct(x.shape[:d] + x.shape[d + 1 :], x.dtype)
            unbatched.append(x)
        inner = types_of(self.inner, *_tree.tree_unflatten(tree, unbatched))
        structs, out_tree = _tree.tree_flatten(inner)
        dims = self.out_dims or (0,) * len(structs)
        return _tree.tree_unflatten(
            out_tree,
            [
                s if d is None else jax.ShapeDtypeStruct((size, *s.shape), s.dtype)
                for s, d in zip(structs, dims, strict=True)
            ],
        )

    def call_failure(self, error: Exception, in_tree: Any = None) -> Exception:
        if not is_vmap_failure(error):
            return self.inner.call_failure(error, in_tree)  # not vmap's: the function's own
        if self.inner.grad_mode and needs_setup_context(error):
            return self.inner.call_failure(error, in_tree)  # torch.func cannot differentiate it
        return VmapError(self._hint(error))

    def _hint(self, error: Exception) -> str:
        module = self.root.hooks.for_module
        hint = VMAP_HINT.replace("to_jax(fn, ", self.root.hooks.api)
        if self.randomness == "error" and refuses_randomness(error):
            hint = MODULE_RANDOMNESS_HINT if module else RANDOMNESS_HINT
        return hint.format(name=self.root.name, error=f"{type(error).__name__}: {error}")


@dataclasses.dataclass(frozen=True)
class LeadingAxisFunction(DerivedFunction):
    """``inner`` called on inputs that all carry a leading batch axis of ``size`` (or 1).

    vmap_method "expand_dims" and "broadcast_all": inner handles the batch axis itself, so
    the call is inner's own. Only its declared output types differ: result_shape_dtypes
    describes one example, so they are inner's on the inputs without their leading axis,
    with ``size`` in front.
    """

    inner: Any
    size: int

    def _call(self, *args: Any) -> Any:
        return self.inner(*args)

    def out_types(self, types_of: TypesOf, *args: Any) -> Any:
        if self.root.result_shape_dtypes is None:
            # Found types describe what fn does with these very inputs, batch axis and all.
            return types_of(self.inner, *args)
        leaves, tree = _tree.tree_flatten(args)
        unbatched = [
            jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if is_abstract(x) else x for x in leaves
        ]
        inner = types_of(self.inner, *_tree.tree_unflatten(tree, unbatched))
        return _tree.tree_map(lambda s: jax.ShapeDtypeStruct((self.size, *s.shape), s.dtype), inner)
