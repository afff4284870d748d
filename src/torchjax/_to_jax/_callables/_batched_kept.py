# Per-example gradients from one forward: jax.vmap of the reverse-mode split.
#
# jax.vmap(jax.value_and_grad(f)) batches both halves of the split (_torch_call/_partial_eval.py):
# the forward (a KeptForward) and its VJP. Batched as any call, the forward runs under
# torch.func.vmap, which cannot keep a graph, and the VJP recomputes it: two forwards where
# torch.func.vmap(torch.func.grad_and_value(f)) runs one. Instead the batched forward is
# recorded by torch.autograd around torch.func.vmap, with every differentiated input a leaf
# that carries the batch axis in front: a batched input moved there, an unbatched one
# (the parameters, in_axes=None) expanded to the batch size with stride 0, no copy. The
# gradient of a [B, ...] leaf is then one gradient per example, so the batched VJP pulls
# each example's cotangent back through the one kept graph: one forward, one backward, and
# torch.func's matmul count (the forward's matmuls become batched ones of the same FLOPs).
# Where the graph cannot serve (nested transforms, a VJP called twice, an evicted graph)
# the VJP recomputes under torch.func.vmap as before, replaying the forward's draws.
# Inside torch.func.vmap the batched tensors of a graph recorded around it say they do not
# require grad, where torch.func.vmap(torch.func.grad(f)) says they do: a function that
# asks (`if h.requires_grad: h.register_hook(...)`, nn.MultiheadAttention's fast path)
# would take another branch, and give another gradient. And an autograd.Function applied
# in it is differentiated through its vmap rule (the graph records what the rule ran), where
# torch.func runs its backward. Every kept forward watches for both (a
# TorchFunctionMode, which also turns nn.MultiheadAttention's fast path off, as
# torch.func's levels would); a call that asks or applies one runs again without a graph,
# its VJP recomputing under torch.func's levels, and so do the function's later calls.
# A kept graph is differentiated op by op as the batching rules ran it, and some rules
# write one example's value to one target from several places (select_scatter's rule
# scatters a stride-0 expansion of its source with an index that repeats): torch's
# derivative of such a write (scatter, index_put, index_copy, put) assumes each target is
# written once and sums the source's gradient once per repeat, where torch.func
# differentiates the op itself. A graph with a write whose targets repeat is not used:
# the call runs again as torch.func would (see `_repeated_write`).
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import torch
from torch.overrides import TorchFunctionMode

from torchjax._compat._torch import custom_function_call
from torchjax._to_jax._callables._autodiff import VjpFunction
from torchjax._to_jax._callables._base import DerivedFunction, TypesOf, unbatched_residual
from torchjax._to_jax._callables._batched import BatchedFunction
from torchjax._to_jax._callables._kept import KeptForward
from torchjax._to_jax._context import GRAPHS, OUTPUT_BUFFERS
from torchjax._to_jax._torch_ops._autograd import outermost
from torchjax._to_jax._torch_ops._residual import (
    KeptGraph,
    held_count,
    recording,
    replaying,
    rng_state,
    take_held,
)
from torchjax._to_jax._torch_ops._vmap import as_tensor

_tree = jax.tree_util


@dataclasses.dataclass(frozen=True)
class _BatchedLeaf:
    """How a batched graph's leaf is made from the forward's input k (the recipe a VJP
    refills it with): moved (batch axis `dim` to the front) or, for an unbatched input,
    expanded to `size` with stride 0."""

    k: int
    dim: int | None
    size: int

    def rebuild(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        t = inputs[self.k].detach()
        return t.expand(self.size, *t.shape) if self.dim is None else t.movedim(self.dim, 0)


_T = torch.Tensor
# What asks a tensor about autograd: its answer inside torch.func.vmap differs between a
# graph recorded around the vmap and torch.func.grad's levels within it.
_AUTOGRAD_QUESTIONS = frozenset(
    {
        _T.requires_grad.__get__,
        _T.grad_fn.__get__,
        _T.is_leaf.__get__,
        _T.register_hook,
        _T.retain_grad,
        _T.requires_grad_,
        _T.register_post_accumulate_grad_hook,
    }
)


class _AutogradQuestions(TorchFunctionMode):
    """Notes whether the code it runs asks a tensor about autograd (see the banner)."""

    asked = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is custom_function_call or func in _AUTOGRAD_QUESTIONS:
            self.asked = True
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class BatchedKeptForward(DerivedFunction):
    """``forward`` (a KeptForward) batched by torch.func.vmap over the tensor leaves
    with batch axes `in_dims`, recorded by torch.autograd with batched leaves (see the
    banner). Returns ``(*outputs batched at 0, handle, rng_state)``, the two residuals
    unbatched; handle 0 where no graph was kept (inside another transform)."""

    inner: KeptForward
    in_dims: tuple
    randomness: str

    def _batched(self, in_dims: tuple | None = None) -> BatchedFunction:
        return BatchedFunction(self.inner.inner, in_dims or self.in_dims, self.randomness)

    def arg_path(self, path: tuple) -> str:
        return self.inner.arg_path(path)

    holds_state = True  # as the forward it batches
    n_residuals = 2  # as the forward it batches: the handle and the RNG state

    def _call(self, *primals: Any) -> tuple:
        leaves, tree = _tree.tree_flatten(primals)
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[i] for i in positions]
        device = tensors[0].device
        state = rng_state(device).to(device)
        dims = dict(zip(positions, self.in_dims, strict=True))
        wrt = self.inner.wrt
        facts = self.inner.root.facts
        # (Without custom_function_call to watch for, no function is known not to ask.)
        asks = True if custom_function_call is None else facts.get("asks_autograd")
        if asks or not outermost(primals) or any(leaves[i].is_complex() for i in wrt):
            outs = _tree.tree_leaves(self._batched()(*primals))
            return (*[as_tensor(o, device) for o in outs], _handle(0, device), state)
        size = next(t.shape[d] for t, d in zip(tensors, self.in_dims, strict=True) if d is not None)
        index = {i: k for k, i in enumerate(positions)}
        recipes = [_BatchedLeaf(index[i], dims[i], size) for i in wrt]
        graph = KeptGraph()
        mark = held_count()
        new = list(leaves)
        for i, recipe in zip(wrt, recipes, strict=True):
            new[i] = _leaf_on(recipe.rebuild(tensors))
        in_dims = tuple(0 if i in wrt else d for i, d in dims.items())
        watch = _AutogradQuestions()
        try:
            with torch.enable_grad(), recording(graph, tensors):
                graph.leaves = [new[i] for i in wrt]
                with watch:
                    out = self._batched(in_dims)(*_tree.tree_unflatten(tree, new))
                # Inside the recording (saved indices may be views of its inputs), outside
                # the watch (the walk asks about autograd itself).
                repeats = _repeated_write(_tree.tree_leaves(out))
        except Exception:  # noqa: BLE001 - the call without a graph raises fn's own error
            # What torch.func.vmap batches only beneath an autograd level of its own (a
            # composite op such as column_stack decomposed), which refuses saved-tensor
            # hooks: batched as before, with no graph; the VJP recomputes.
            del graph, new
            return self._without_graph(primals, mark, state, device)
        if watch.asked:  # its answers were wrong here: again, with torch.func's levels
            facts["asks_autograd"] = True
            del out, graph, new
            return self._without_graph(primals, mark, state, device)
        if repeats:  # its derivative, as kept, would count a repeated target again
            del out, graph, new
            return self._without_graph(primals, mark, state, device)
        outs = [as_tensor(o, device) for o in _tree.tree_leaves(out)]
        del out, new
        mask = self.inner.out_mask
        if not any(o.requires_grad for o, m in zip(outs, mask, strict=True) if m):
            return (*[o.detach() for o in outs], _handle(0, device), state)
        graph.keep_held(take_held(mark), tensors)
        graph.let_go_of_inputs(tensors, outs, recipes)
        graph.outputs = [o if m else None for o, m in zip(outs, mask, strict=True)]
        graph.input_shapes = tuple(zip((t.shape for t in tensors), self.in_dims, strict=True))
        return (*[o.detach() for o in outs], _handle(GRAPHS.put(graph), device), state)

    def _without_graph(self, primals: tuple, mark: int, state: Any, device: Any) -> tuple:
        """The call batched as BatchedFunction would, keeping no graph (the VJP will
        recompute), after an attempt to keep its graph: what that attempt held is let go of."""
        for h in take_held(mark):
            h.release()
        with replaying(state, device):  # the draws the VJP will replay too
            outs = _tree.tree_leaves(self._batched()(*primals))
        return (*[as_tensor(o, device) for o in outs], _handle(0, device), state)

    def out_types(self, types_of: TypesOf, *primals: Any) -> tuple:
        out = self._batched().out_types(types_of, *primals)
        return (*_tree.tree_leaves(out), *KeptForward.residual_types())

    def call_failure(self, error: Exception, in_tree: Any = None) -> Exception:
        return self._batched().call_failure(error, in_tree)


@dataclasses.dataclass(frozen=True)
class BatchedKeptVjp(DerivedFunction):
    """``inner`` (a VjpFunction with residuals) batched over `in_dims` (its tensor leaves':
    primals, the two residuals, unbatched, and cotangents): through the graph a
    BatchedKeptForward kept, one cotangent per example; else as BatchedFunction would,
    recomputing under torch.func.vmap with the forward's draws replayed. The gradients
    carry the batch axis in front."""

    inner: VjpFunction
    in_dims: tuple
    randomness: str

    def _batched(self) -> BatchedFunction:
        return BatchedFunction(self.inner, self.in_dims, self.randomness)

    def arg_path(self, path: tuple) -> str:
        return self.inner.arg_path(path)

    holds_state = True  # as the VJP it batches

    def _call(self, primals: tuple, residuals: tuple, cotangents: tuple) -> tuple:
        into = OUTPUT_BUFFERS.take()  # XLA's buffers for the gradients, under jit
        graph = self._graph(primals, residuals, cotangents)
        if graph is None:
            return self._batched()(primals, residuals, cotangents)
        ct_dims = self.in_dims[len(self.in_dims) - len(cotangents) :]
        leaves = _tree.tree_leaves((primals, residuals, cotangents))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        size = next(t.shape[d] for t, d in zip(tensors, self.in_dims, strict=True) if d is not None)
        cts = tuple(
            c.expand(size, *c.shape) if d is None else c.movedim(d, 0)
            for c, d in zip(cotangents, ct_dims, strict=True)
        )
        inputs = [x for x in _tree.tree_leaves(primals) if isinstance(x, torch.Tensor)]
        if into is not None and len(into) != len(graph.leaves):
            into = None
        return graph.backward(inputs, self.inner.out_mask, cts, into)

    def _graph(self, primals: tuple, residuals: tuple, cotangents: tuple) -> KeptGraph | None:
        """The batched graph to pull back through, taken from the store; None: recompute."""
        handle = unbatched_residual(residuals[0], 0)
        if handle is None or not int(handle) or not outermost((primals, cotangents)):
            return None
        graph = GRAPHS.take(int(handle))
        if graph is None or getattr(graph, "input_shapes", None) is None:
            return None
        inputs = [x for x in _tree.tree_leaves(primals) if isinstance(x, torch.Tensor)]
        layout = tuple(zip((t.shape for t in inputs), self.in_dims, strict=False))
        if layout != graph.input_shapes:
            return None  # not the forward's shapes and batch axes: its saved views would not fit
        if any(map(torch.is_complex, cotangents)):
            return None
        return graph

    def out_types(self, types_of: TypesOf, *args: Any) -> Any:
        return self._batched().out_types(types_of, *args)

    def call_failure(self, error: Exception, in_tree: Any = None) -> Exception:
        return self._batched().call_failure(error, in_tree)


def _repeats_along(index: torch.Tensor, dim: int) -> bool:
    """Whether two entries of `index` on one line along `dim` are equal (one target
    written twice by a scatter along `dim`)."""
    if index.dim() == 0 or index.shape[dim] < 2:
        return False
    if index.stride(dim) == 0:  # an expansion: every entry on a line is the same
        return True
    ordered = index.sort(dim).values
    return bool(
        (
            ordered.narrow(dim, 1, index.shape[dim] - 1)
            == ordered.narrow(dim, 0, index.shape[dim] - 1)
        ).any()
    )


def _repeats(index: torch.Tensor) -> bool:
    return _repeats_along(index.reshape(-1), 0)


def _index_put_repeats(node: Any) -> bool:
    """Whether an index_put (not accumulating) writes one position twice."""
    if node._saved_accumulate:
        return False
    indices = [i for i in node._saved_indices if i is not None]
    if not indices:
        return False
    if any(i.dtype == torch.bool for i in indices):
        # A mask names each position once; mixed with integer indices, take no chances.
        return len(indices) > 1
    rows = torch.broadcast_tensors(*indices)
    keys = torch.stack([r.reshape(-1) for r in rows], dim=1)
    return keys.shape[0] > 1 and torch.unique(keys, dim=0).shape[0] < keys.shape[0]


# The writes whose derivative assumes each target is written once, by autograd node type:
# what tells, from the node's saved arguments, that some target is written again.
_WRITE_REPEATS = {
    "ScatterBackward0": lambda n: _repeats_along(n._saved_index, n._saved_dim),
    "IndexCopyBackward0": lambda n: _repeats(n._saved_index),
    "PutBackward0": lambda n: not n._saved_accumulate and _repeats(n._saved_index),
    "IndexPutBackward0": _index_put_repeats,
}


def _repeated_write(outputs: list[Any]) -> bool:
    """Whether the graph behind `outputs` holds a write that repeats a target (see the
    banner): one walk over its nodes, each visited once."""
    seen = set()
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        check = _WRITE_REPEATS.get(type(node).__name__)
        if check is not None and check(node):
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _leaf_on(view: torch.Tensor) -> torch.Tensor:
    """An autograd leaf holding `view`'s memory that is not itself a view: a view keeps its
    base, an alias of XLA's input buffer, alive after the leaf is emptied (and the call
    would then copy that buffer, _guard.copy_kept_inputs)."""
    leaf = torch.empty(0, dtype=view.dtype, device=view.device).requires_grad_()
    leaf.data = view
    return leaf


def _handle(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int32, device=device)
