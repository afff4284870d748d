# jax.vmap of a torch call: rebind the primitive with torch.func.vmap(fn).
#
# One batched torch call serves the whole batch, and nested jax.vmap nests torch.func.vmap
# (BatchedFunction of a BatchedFunction): still one torch call however deep. The other
# vmap_method policies mirror jax.pure_callback's: "sequential" maps the unbatched call over
# the batch with lax.map; "expand_dims" and "broadcast_all" trust fn to handle a leading
# batch axis itself (LeadingAxisFunction only restates result_shape_dtypes, which describe
# one example, for the batch). A function torch.func.vmap cannot batch fails loudly when
# it runs and names vmap_method="sequential" as the fix. Derivatives taken with
# grad_method="autograd" cannot run under torch.func.vmap (autograd.grad needs
# requires_grad_), so their batches are a loop inside the one torch call.
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchjax._compat import FAST_VMAP
from torchjax._compat import vmap_add_batch_dim as _add_batch_dim
from torchjax._compat import vmap_decrement_nesting as _vmap_decrement_nesting
from torchjax._compat import vmap_increment_nesting as _vmap_increment_nesting
from torchjax._compat import vmap_lazy_load_decompositions as lazy_load_decompositions
from torchjax._compat import vmap_remove_batch_dim as _remove_batch_dim
from torchjax._convert import torch_dtype
from torchjax._errors import VmapError
from torchjax._primitive._params import _is_operand
from torchjax._to_jax._call_plan import autograd_inside, runs_autograd_itself
from torchjax._to_jax._torch_call import VMAP_RANDOMNESS, DerivedFunction, Options, torch_call_p

_tree = jax.tree_util

VMAP_HINT = (
    "torch.func.vmap could not batch {name}: {error}\n"
    "For functions torch.func.vmap cannot handle (.item(), data-dependent Python control "
    "flow, in-place ops on unbatched inputs), use to_jax(fn, vmap_method='sequential') "
    "(one call per example), or 'expand_dims' if fn already handles a leading batch axis."
)

# torch.func.vmap's own message names its `randomness` flag; the user sets it in to_jax.
RANDOMNESS_HINT = (
    "torch.func.vmap could not batch {name}: {error}\n"
    "{name} draws random numbers, and vmap_randomness='error' (the default) forbids that "
    "under jax.vmap. Choose how draws vary across the batch: "
    "to_jax(fn, vmap_randomness='different') (independent per example) or "
    "to_jax(fn, vmap_randomness='same') (one draw shared by all examples)."
)


def vmap_call(fn: Any, tensors: list, in_dims: tuple, randomness: str) -> Any:
    """``torch.func.vmap(fn, in_dims, randomness=randomness)(*tensors)``, for an fn that
    returns a tensor or a tuple of tensors, every output batched at axis 0.

    It takes the steps torch.func.vmap takes (load its decompositions, open a vmap level,
    add the batch dims, call, remove them) without its Python wrapper, whose per-call work
    (pytrees of arguments, in_dims and outputs; checks of sizes and dims that jax.vmap has
    already made) costs tens of microseconds a call. Where those steps are not found
    (another torch version), it is torch.func.vmap itself.
    """
    if not FAST_VMAP:
        return torch.func.vmap(fn, in_dims=in_dims, randomness=randomness)(*tensors)
    if randomness not in VMAP_RANDOMNESS:
        raise ValueError(f"randomness must be one of {VMAP_RANDOMNESS}, got {randomness!r}")
    lazy_load_decompositions()
    size = next((t.shape[d] for t, d in zip(tensors, in_dims, strict=True) if d is not None), None)
    if size is None:  # torch.func.vmap explains that nothing is batched
        return torch.func.vmap(fn, in_dims=in_dims, randomness=randomness)(*tensors)
    level = _vmap_increment_nesting(size, randomness)
    try:
        out = fn(
            *[
                t if d is None else _add_batch_dim(t, d, level)
                for t, d in zip(tensors, in_dims, strict=True)
            ]
        )
        if isinstance(out, torch.Tensor):
            return _remove_batch_dim(out, level, size, 0)
        for o in out:
            if not isinstance(o, torch.Tensor):
                raise ValueError(f"vmap: outputs must be tensors, got {type(o).__name__}.")
        return tuple(_remove_batch_dim(o, level, size, 0) for o in out)
    finally:
        _vmap_decrement_nesting()


@dataclasses.dataclass(frozen=True)
class BatchedFunction(DerivedFunction):
    """``torch.func.vmap(inner)`` over the tensor leaves of inner's positional args.

    Attributes:
      inner: the torch callable being batched.
      in_dims: one int (batched axis) or None per tensor leaf, in flattening order.
      randomness: torch.func.vmap's randomness policy.
      loop: call inner once per example instead (a derivative by torch.autograd.grad).
    """

    inner: Any
    in_dims: tuple
    randomness: str
    loop: bool = False

    def __call__(self, *args: Any) -> Any:
        leaves, tree = _tree.tree_flatten(args)
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if self.loop or autograd_inside():  # autograd cannot run under torch.func.vmap
            return self._loop(leaves, tree, positions)
        try:
            return self._vmap(leaves, tree, positions)
        except Exception as e:
            if runs_autograd_itself(e):
                raise  # the call runs again with a loop (CallPlan.invoke)
            text = f"{type(e).__name__}: {e}"
            if "batching rule not implemented" in text.lower():
                # Composite ops (column_stack) decompose into batchable ones only beneath
                # an autograd level, as under torch.func.vmap(torch.func.grad(f)).
                try:
                    return self._vmap(leaves, tree, positions, decompose=True)
                except Exception:
                    raise e from None
            if any(m in text.lower() for m in _VMAP_FAILURES):
                raise  # torch.func.vmap's own message: call_failure adds the advice
            # Ambiguous (an in-place op into an unbatched tensor fails with a shape
            # error): the function's own failure if one example alone fails too.
            self._one_example(leaves, tree, positions)
            raise VmapError(self._hint(text)) from e

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
        stacked = [torch.stack([r[j] for r in rows]) for j in range(out_tree.num_leaves)]
        return _tree.tree_unflatten(out_tree, stacked)

    def _vmap(self, leaves: list, tree: Any, positions: list, decompose: bool = False) -> Any:
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

        dims = tuple(d for _, d in mapped)
        call = _beneath_autograd(flat) if decompose else flat
        out = vmap_call(call, [leaves[i] for i, _ in mapped], dims, self.randomness)
        return _tree.tree_unflatten(out_tree[-1], [out] if out_tree[-1].num_leaves == 1 else out)

    def declared_shapes(self, options: Options, *args: Any) -> Any:
        leaves, tree = _tree.tree_flatten(args)
        dims = iter(self.in_dims)
        size, unbatched = None, []
        for x in leaves:
            d = next(dims) if _is_abstract(x) else None
            if d is not None:
                size = x.shape[d]
                x = jax.ShapeDtypeStruct(x.shape[:d] + x.shape[d + 1 :], x.dtype)
            unbatched.append(x)
        inner = torch_call_p.abstract_eval(
            *_tree.tree_unflatten(tree, unbatched), fn=self.inner, options=options
        )
        return _tree.tree_map(lambda s: jax.ShapeDtypeStruct((size, *s.shape), s.dtype), inner)

    def call_failure(self, error: Exception) -> Exception:
        text = f"{type(error).__name__}: {error}"
        if not any(m in text.lower() for m in _VMAP_FAILURES):
            return self.inner.call_failure(error)  # not vmap's: the function's own, say
        if self.inner.grad_mode and "setup_context" in text:
            return self.inner.call_failure(error)  # torch.func cannot differentiate it
        return VmapError(self._hint(text))

    def _hint(self, text: str) -> str:
        hint = VMAP_HINT
        if self.randomness == "error" and "randomness" in text:
            hint = RANDOMNESS_HINT
        return hint.format(name=self.root.name, error=text)


def _beneath_autograd(flat: Any) -> Any:
    """flat, run under a torch.func autograd level over its floating inputs (outputs only)."""

    def call(*tensors: torch.Tensor) -> Any:
        floats = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]

        kinds: list = []

        def of_floats(*fs: torch.Tensor) -> Any:
            new = list(tensors)
            for i, t in zip(floats, fs, strict=True):
                new[i] = t
            out = flat(*new)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            kinds.append([o.is_floating_point() or o.is_complex() for o in outs])
            # vjp takes floating outputs only; the others (an int handle, say) ride as aux.
            return tuple(o for o in outs if o.is_floating_point() or o.is_complex()), [
                o for o in outs if not (o.is_floating_point() or o.is_complex())
            ]

        inexact, _, others = torch.func.vjp(of_floats, *[tensors[i] for i in floats], has_aux=True)
        inexact, others = iter(inexact), iter(others)
        outs = [next(inexact) if k else next(others) for k in kinds[-1]]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return call


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

    def __call__(self, *args: Any) -> Any:
        return self.inner(*args)

    def declared_shapes(self, options: Options, *args: Any) -> Any:
        if self.root.result_shape_dtypes is None:
            # Found types describe what fn does with these very inputs, batch axis and all.
            return torch_call_p.abstract_eval(*args, fn=self.inner, options=options)
        leaves, tree = _tree.tree_flatten(args)
        unbatched = [
            jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if _is_abstract(x) else x for x in leaves
        ]
        inner = torch_call_p.abstract_eval(
            *_tree.tree_unflatten(tree, unbatched), fn=self.inner, options=options
        )
        return _tree.tree_map(lambda s: jax.ShapeDtypeStruct((self.size, *s.shape), s.dtype), inner)


LEADING_AXIS_MESSAGE = (
    "{name} was batched with vmap_method={method!r}, so it must return every output with "
    "a leading batch axis of size {size}, but it returned {got} at {where}. With {method!r} "
    "the function receives the whole batch and must map over its leading axis itself; use "
    "vmap_method='torch' or 'sequential' for a function written for one example."
)


# Phrases of torch.func.vmap's own messages (a missing batching rule, .item() or
# data-dependent control flow under vmap, randomness), as opposed to the function's errors.
_VMAP_FAILURES = ("vmap", "batching rule", "batchedtensor", "batched tensor")


def as_tensor(value: Any, device: torch.device | None = None) -> Any:
    """A Python number output as a tensor of the dtype to_jax gives it; others unchanged.

    torch.func transforms take tensors only, and torch.tensor(2.0) would be float32 where
    to_jax declares a Python float float64 under x64: use the declared dtype.
    """
    if isinstance(value, bool | int | float | complex):
        dtype = torch_dtype(jax.dtypes.canonicalize_dtype(np.asarray(value).dtype))
        return torch.tensor(value, dtype=dtype, device=device)
    return value


def _calls_user_directly(fn: Any) -> bool:
    """Whether fn is the user's function, perhaps under LeadingAxisFunction layers."""
    while isinstance(fn, LeadingAxisFunction):
        fn = fn.inner
    return fn is fn.root


def _is_abstract(x: Any) -> bool:
    return _is_operand(x) or isinstance(x, jax.core.ShapedArray | jax.ShapeDtypeStruct)


def batch(args: tuple, axes: tuple, *, fn: Any, options: Options) -> tuple[Any, int]:
    """Batch ``fn(*args)`` according to ``options.vmap_method``; outputs batched at axis 0.

    torch_call_p's batching rule; _rule_partial_eval.py registers it, after taking out one case
    of the JVP call (tangents batched, primals not).
    """
    leaves, tree = _tree.tree_flatten(args)
    flat_axes = tree.flatten_up_to(axes)
    size = next(x.shape[a] for x, a in zip(leaves, flat_axes, strict=True) if a is not None)
    method = options.vmap_method
    if method == "torch":
        in_dims = tuple(a for x, a in zip(leaves, flat_axes, strict=True) if _is_operand(x))
        # A derivative by torch.autograd.grad (grad_mode: one is in fn) cannot be vmapped.
        loop = options.grad_method == "autograd" and fn.grad_mode
        batched = BatchedFunction(fn, in_dims, options.vmap_randomness, loop)
        return torch_call_p.bind(*args, fn=batched, options=options), 0

    moved = [
        jnp.moveaxis(x, a, 0) if a is not None else x
        for x, a in zip(leaves, flat_axes, strict=True)
    ]
    if method == "sequential":
        mapped = [i for i, a in enumerate(flat_axes) if a is not None]

        def one(slices: list) -> Any:
            new = list(moved)
            for i, s in zip(mapped, slices, strict=True):
                new[i] = s
            return torch_call_p.bind(*_tree.tree_unflatten(tree, new), fn=fn, options=options)

        return jax.lax.map(one, [moved[i] for i in mapped]), 0

    if method == "expand_dims" and not _calls_user_directly(fn):
        # A derivative of fn (JvpFunction, VjpFunction) is not itself batch-polymorphic: a
        # size-1 cotangent does not match the batched output it pulls back, and a VJP with
        # respect to a size-1 input sums over the batch instead of giving one row per
        # example. With every input broadcast, each example stays separate.
        method = "broadcast_all"

    def lift(x: Any, a: Any) -> Any:
        if a is not None or not _is_operand(x):
            return x
        if method == "expand_dims":
            return jnp.expand_dims(x, 0)
        return jnp.broadcast_to(x, (size, *jnp.shape(x)))

    new = [lift(x, a) for x, a in zip(moved, flat_axes, strict=True)]
    lead = LeadingAxisFunction(fn, size)
    out = torch_call_p.bind(*_tree.tree_unflatten(tree, new), fn=lead, options=options)
    for path, o in _tree.tree_flatten_with_path(out)[0]:
        if not o.shape or o.shape[0] != size:
            raise VmapError(
                LEADING_AXIS_MESSAGE.format(
                    name=fn.root.name,
                    method=options.vmap_method,
                    size=size,
                    got=f"{o.dtype}{list(o.shape)}",
                    where="out" + _tree.keystr(path),
                )
            )
    return out, 0
