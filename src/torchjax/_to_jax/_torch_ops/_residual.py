# Residuals of a torch call split for reverse mode: torch's autograd graph and RNG state.
#
# jax.grad splits a call into its primal half (run now) and a linear half (transposed
# later into a VJP). torch's saved tensors cannot become XLA arrays, so without help the
# VJP runs the forward again. Instead the primal half runs with autograd recording and
# keeps the graph host-side, in GRAPHS, under a handle that travels to the VJP as a JAX
# residual (an int32 scalar); the VJP pulls back through the kept graph and frees it: one
# forward and one backward, as in torch. The random-number state from before the forward
# travels as a residual too (uint8), so that a VJP that must recompute instead (the graph
# was evicted, the VJP is called twice, batched, or differentiated again) replays the same
# draws: value and gradient always see the same dropout masks.
#
# Under jit XLA owns the input buffers and may reuse them once the forward's callback has
# returned, so the graph must not keep them: a saved tensor that is (a view of) an input is
# recorded as "input k, this view", and is rebuilt from the VJP's own inputs (the same
# values, which JAX passes to the VJP) when the backward needs it.
#
# A backward may read more than saved tensors: torch.utils.checkpoint recomputes the forward
# and an adjoint ODE solver re-evaluates its vector field, both reading the module they run
# in. So what a forward leaves in use (module_to_jax's private module copy, holding that
# call's tensors) is *held* until nothing can backpropagate through it any more: the end of
# the outermost derived torch call (a VJP pulls back inside it), or, for a kept graph, its
# backward. See `hold` and `HeldState`.
# Over 400 lines: the kept graph, its refilled leaves and views, and the state held for a
# backward are one mechanism (what a forward keeps is exactly what its VJP refills).
from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from torchjax._compat._torch import (
    DisableFuncTorch,
    current_graph_task_id,
    is_view,
    storage_id,
    tensor_use_count,
    tensor_version,
)
from torchjax._to_jax._call._cuda import forward_stream, ordered_with
from torchjax._to_jax._context import holding as _holding

_getrefcount = sys.getrefcount


def _input_of(leaf: torch.Tensor, inputs: list[torch.Tensor]) -> int | None:
    """The index of the input that `leaf` is a detached alias of, if any."""
    if is_view(leaf) or not leaf.numel():
        return None
    storage = storage_id(leaf)
    for k, t in enumerate(inputs):
        if (
            storage == storage_id(t)
            and leaf.shape == t.shape
            and leaf.stride() == t.stride()
            and leaf.storage_offset() == t.storage_offset()
            and leaf.dtype == t.dtype
        ):
            return k
    return None


class KeptGraph:
    """One forward's autograd graph: the differentiated leaves, the outputs on it, the
    inputs its saved tensors refer to (the forward's during the forward, then filled in by
    the VJP before the backward), and the state the forward left held (`HeldState`)."""

    __slots__ = (
        "leaves",
        "outputs",
        "nbytes",
        "inputs",
        "refill",
        "held",
        "stream",
        "input_shapes",
        "__weakref__",
    )

    def __init__(self) -> None:
        self.leaves: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.nbytes = 0
        self.inputs: list[torch.Tensor] = []
        self.refill: list[int | None] = []  # per leaf: the input to refill it from
        self.held: list[HeldState] = []
        self.stream: Any = None  # the forward's CUDA stream (None off the GPU)
        self.input_shapes: tuple | None = None  # a batched forward's (shape, batch axis)s

    def keep_held(self, held: list[HeldState], inputs: list[torch.Tensor]) -> None:
        """Take over what the forward left held, until the backward (or this graph's end)."""
        for h in held:
            h.keep_for_graph(self, inputs)
        self.held = held

    def reinstall_held(self) -> None:
        """Put the held state back as the forward left it, for the backward to read."""
        for h in self.held:
            h.reinstall(self)

    def backward(
        self, inputs: list[torch.Tensor], out_mask: tuple, cotangents: tuple, into: Any = None
    ) -> tuple:
        """The cotangents of the leaves from this kept forward, by torch.autograd.grad; frees
        the graph. `inputs` are the VJP's own, the same values as the forward's: saved views
        of inputs and emptied leaves are refilled from them, and what the forward left held
        is put back for the backward to read.

        `into` (XLA's output buffers under jit, one per leaf, or None): each leaf's gradient
        is copied there the moment torch has it, and torch's own is freed then, instead of
        all of them living until the backward ends and being copied after (a second set of
        gradients at the step's peak). A leaf whose gradient went there returns its buffer.
        """
        self.inputs = inputs
        self.refill_leaves()
        outs = [o for o, m in zip(self.outputs, out_mask, strict=True) if m]
        pairs = [(o, c) for o, c in zip(outs, cotangents, strict=True) if o is not None]
        pairs = [(o, c) for o, c in pairs if o.requires_grad]  # others do not depend on leaves
        self.reinstall_held()
        # On the GPU a backward on another stream than the forward's (eager after jitted,
        # or the reverse) is ordered both ways with it, before the graph's tensors are freed.
        hooks: list = []
        with ordered_with(self.stream):
            try:
                if not pairs:
                    return tuple(torch.zeros_like(x) for x in self.leaves)
                roots = [o for o, _ in pairs]
                filled = _write_into(roots, self.leaves, into, hooks) if into else None
                grads = torch.autograd.grad(
                    [o for o, _ in pairs],
                    self.leaves,
                    [c for _, c in pairs],
                    allow_unused=True,
                    materialize_grads=True,
                )
                if filled is None:
                    return grads
                return tuple(d if f else g for g, d, f in zip(grads, into, filled, strict=True))
            finally:
                for h in hooks:  # a leaf something else holds must not write there again
                    h.remove()
                self.release_held()
                self.inputs = self.outputs = self.leaves = []

    def write_outputs(self, outs: list, into: list) -> None:
        """Under jit: each output on the graph copied into XLA's buffer for it (`into`,
        aligned with `outs`), which takes its place in `outs`, so that the lowering copies
        it no more. The backward needs only an output's grad_fn and shape, not its values:
        one that nothing else holds (no cache, no view of it, not returned twice) keeps a
        stride-0 zero in place of its memory, which is freed now instead of at the
        backward (GPT-2's 51 MB of logits would exist twice until then)."""
        for j in range(len(outs)):  # not enumerate: its reused tuple holds the output
            o, dst = outs[j], into[j]
            if not isinstance(o, torch.Tensor) or self.outputs[j] is not o or o.grad_fn is None:
                continue  # not on the graph
            if dst.shape != o.shape or dst.dtype is not o.dtype or o.layout != torch.strided:
                continue  # narrowed (x64 off) or converted: the lowering's checked write
            dst.copy_(o)
            outs[j] = dst
            # References: self.outputs, `o`, getrefcount's argument.
            if _getrefcount(o) == 3 and tensor_use_count(o) == 1 and not is_view(o):
                o.data = o.new_zeros(()).expand(o.shape)
            o = None

    def release_held(self) -> None:
        held, self.held = self.held, []
        for h in held:
            h.release()

    def __del__(self) -> None:
        # An evicted graph, or one whose VJP recomputed instead, still gives back its state.
        if self.held:
            self.release_held()

    def let_go_of_inputs(
        self, inputs: list[torch.Tensor], returned: list[Any], recipes: list | None = None
    ) -> None:
        """Empty the leaves, which share the memory of `inputs`, until the VJP refills them.

        Under jit an input is XLA's buffer for this call only: a leaf the graph keeps alive
        would make the call copy it (_guard.copy_kept_inputs), a copy of every parameter per
        training step. Only the graph needs the leaves (saved views of inputs are rebuilt
        from the VJP's inputs anyway), and the VJP gets the same inputs again. A leaf
        anything else holds (returned, cached by the function) is left as it is. `recipes`
        (a batched forward's, per leaf): how a leaf that is a view of an input is made again
        from the VJP's inputs (its `rebuild`).
        """
        self.refill = []
        for j in range(len(self.leaves)):  # not enumerate: its reused tuple holds the leaf
            leaf = self.leaves[j]
            uses, refs = tensor_use_count(leaf), _getrefcount(leaf)
            # References: the list, `leaf`, getrefcount's argument, and torch's own while
            # the graph's AccumulateGrad node (the one other user) holds it.
            alone = uses <= 2 and refs == 2 + uses and not any(r is leaf for r in returned)
            k = (_input_of(leaf, inputs) if recipes is None else recipes[j]) if alone else None
            if k is not None:
                leaf.data = leaf.new_empty(0)
            self.refill.append(k)

    def refill_leaves(self) -> None:
        """Give the emptied leaves the VJP's inputs, the values the forward saw."""
        for leaf, k in zip(self.leaves, self.refill, strict=True):
            if k is not None:
                leaf.data = self.inputs[k] if type(k) is int else k.rebuild(self.inputs)


# A gradient smaller than this is copied after the backward as before: freeing it early
# saves little, and the hook costs a few microseconds a call (register, fire, remove).
MIN_HOOKED_NUMEL = 1 << 16


def _write_into(
    roots: list[torch.Tensor], leaves: list[torch.Tensor], into: list, hooks: list
) -> list[bool] | None:
    """Hook each leaf whose buffer in `into` fits it and has MIN_HOOKED_NUMEL elements or
    more: its gradient is written there as soon as torch computes it, and a stride-0 zero
    goes on in its place (freed with the graph). Returns, per leaf, a flag that is set once
    its buffer holds the gradient (None: no hooks, the gradients are copied after).

    A tensor hook fires in every backward that reaches the leaf, and a backward may run
    others inside it through the same leaves (an adjoint ODE solver's vector-field VJPs):
    the hooks act only in the backward whose roots are `roots`, told by its graph task."""
    if current_graph_task_id is None or any(r.grad_fn is None for r in roots):
        return None
    fits = [
        dst is not None
        and dst.numel() >= MIN_HOOKED_NUMEL
        and dst.shape == leaf.shape
        and dst.dtype is leaf.dtype
        for leaf, dst in zip(leaves, into, strict=True)
    ]
    if not any(fits):
        return None
    task: list[int] = []

    def mark(_grad_outputs: Any) -> None:
        if not task:  # the roots run first in their own backward, before any nested one
            task.append(current_graph_task_id())

    for r in roots:
        hooks.append(r.grad_fn.register_prehook(mark))
    filled = [False] * len(leaves)
    for j, (leaf, dst) in enumerate(zip(leaves, into, strict=True)):
        if not fits[j]:
            continue

        def write(g: torch.Tensor, j: int = j, dst: torch.Tensor = dst) -> torch.Tensor:
            if not task or current_graph_task_id() != task[0]:
                return g  # a backward nested inside: not ours
            if filled[j]:  # a second pass (never seen: torch sums first): add, as it would
                dst.add_(g)
            else:
                dst.copy_(g)
                filled[j] = True
            return g.new_zeros(()).expand(g.shape)

        hooks.append(leaf.register_hook(write))
    return filled


class HeldState:
    """What a forward leaves in use that its backward may read again (interface).

    module_to_jax's private module copies implement it: during its call the copy holds the
    call's tensors, and a checkpointed or adjoint backward reads them from it.
    """

    def keep_for_graph(self, graph: KeptGraph, inputs: list[torch.Tensor]) -> None:
        """Stop referring to `inputs` (XLA's buffers for this call only); remember how to
        find them again in `graph` (its leaves, and its inputs as the VJP refills them)."""
        raise NotImplementedError

    def reinstall(self, graph: KeptGraph) -> None:
        """Hold again what the forward held, from graph's refilled leaves and inputs."""
        raise NotImplementedError

    def release(self) -> None:
        """Done: nothing will read it again."""
        raise NotImplementedError


def hold(state: HeldState) -> bool:
    """Keep `state` until the outermost derived torch call on this thread ends (a backward
    inside it may read it). False outside any: nothing can read it again, release it now."""
    if not _holding.depth:
        return False
    _holding.held.append(state)
    return True


def enter_derived_call() -> None:
    """A derived torch call (JVP, VJP, kept forward, batched call) starts on this thread."""
    _holding.depth += 1


def exit_derived_call() -> None:
    """It ends; at the outermost one, everything held is released."""
    _holding.depth -= 1
    if not _holding.depth and _holding.held:
        for state in take_held():
            state.release()


def held_count() -> int:
    """How much this thread holds now: a mark for take_held."""
    return len(_holding.held)


def take_held(since: int = 0) -> list[HeldState]:
    """What this thread came to hold after the mark `since`, handed to the caller (a kept
    graph takes over what its forward held)."""
    held = _holding.held[since:]
    del _holding.held[since:]
    return held


class _Leaf:
    """A saved tensor that is differentiated leaf i itself (an autograd.Function saving its
    input, as adjoint ODE solvers do, later differentiates with respect to that very tensor)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class _Saved:
    """A tensor torch saved for the backward, with its version then. Saved-tensor hooks
    take over torch's own check that nothing changed it in place since (exp's output
    doubled in place after exp saved it): torch's error, as torch would raise it."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor):
        self.t, self.version = t, tensor_version(t)

    def checked(self) -> torch.Tensor:
        t = self.t
        if tensor_version(t) != self.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: [{t.type()} {list(t.shape)}] is at version "
                f"{tensor_version(t)}; expected version {self.version} instead. (torch's "
                f"own check, as torch.autograd raises it: a tensor torch saved for the "
                f"backward was changed in place afterwards, in the forward.) Make the change "
                f"out of place, e.g. `y = y * 2` for `y.mul_(2)`."
            )
        return t


class _InputView:
    """A saved tensor that is a view of input k: rebuilt from the VJP's input k."""

    __slots__ = ("k", "size", "stride", "offset", "dtype")

    def __init__(self, k: int, t: torch.Tensor):
        self.k, self.size, self.stride = k, t.size(), t.stride()
        self.offset, self.dtype = t.storage_offset(), t.dtype


def input_view(k: int, t: torch.Tensor) -> _InputView:
    """How to rebuild `t`, a view of input k, from another set of inputs (the VJP's)."""
    return _InputView(k, t)


def rebuild_input_view(view: _InputView, inputs: list[torch.Tensor]) -> torch.Tensor:
    return inputs[view.k].as_strided(view.size, view.stride, view.offset)


@contextlib.contextmanager
def recording(graph: KeptGraph, inputs: list[torch.Tensor]) -> Iterator[None]:
    """Record a forward into `graph`: saved views of `inputs` by reference, their sizes
    not counted; everything else torch saves counted in graph.nbytes."""
    # Storage ids, not data pointers: asking a protected input for its data pointer is a
    # request to write (see _call/_guard.py), and would make the call run on copies.
    where = {storage_id(t): k for k, t in enumerate(inputs) if t.numel()}
    dtypes = [t.dtype for t in inputs]
    # Autograd run inside the forward (forces from an energy, gradient penalties) unpacks
    # saved tensors there: they refer to the forward's own inputs until it ends.
    graph.inputs = inputs
    graph.stream = forward_stream(inputs)
    # The hooks live as long as the autograd graph, which the KeptGraph holds: a strong
    # reference back would be a cycle through C++ that Python's collector cannot see.
    kept = weakref.ref(graph)

    def pack(t: torch.Tensor) -> Any:
        if not t.numel():
            return t
        if t.layout != torch.strided or t.is_nested:
            return t.detach()  # sparse or nested: no storage that an input could share
        owner = kept()
        if owner is not None and t.requires_grad:
            for i, leaf in enumerate(owner.leaves):
                if t is leaf:
                    return _Leaf(i)
        k = where.get(storage_id(t))
        if k is not None:
            if t.dtype == dtypes[k] and not t.is_conj() and not t.is_neg():
                return _InputView(k, t)
            t = t.clone()  # a view as_strided cannot rebuild: keep a copy, not XLA's buffer
        if owner is not None:
            owner.nbytes += t.numel() * t.element_size()
        # Detached: a saved output (tanh saves its own) kept with its grad_fn would close
        # a reference cycle inside torch's graph that nothing ever frees. The detached
        # tensor shares the version counter: a later in-place change is caught at unpack.
        return _Saved(t.detach())

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _InputView):
            # The VJP holds the graph while it pulls back.
            return rebuild_input_view(saved, kept().inputs)
        if isinstance(saved, _Leaf):
            return kept().leaves[saved.i]
        if isinstance(saved, _Saved):
            return saved.checked()
        return saved

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        graph.inputs = []  # XLA's buffers: the VJP brings its own


def rng_devices(device: torch.device | None) -> list[int]:
    """The CUDA devices whose generator state travels with the CPU one's."""
    if device is not None and device.type == "cuda":
        return [device.index if device.index is not None else torch.cuda.current_device()]
    return []


def rng_state(device: torch.device | None) -> torch.Tensor:
    """torch's generator state (CPU, and the call's CUDA device) as one uint8 tensor."""
    parts = [torch.get_rng_state()]
    parts += [torch.cuda.get_rng_state(d) for d in rng_devices(device)]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def rng_state_size(device: torch.device | None) -> int:
    return rng_state(device).numel()


@contextlib.contextmanager
def replaying(state: torch.Tensor | None, device: torch.device | None) -> Iterator[None]:
    """Run with torch's generators set to `state`; restore them afterwards, so that a
    recomputation draws what the forward drew and leaves the global generators as they
    were (in total, one forward's draws, as in torch)."""
    if state is None or not bool(state.any()):  # zeros: no state was kept (a batched call)
        yield
        return
    devices = rng_devices(device)
    with torch.random.fork_rng(devices=devices):
        # Inside a torch.func transform, setting generator state must not be intercepted.
        with DisableFuncTorch():
            cpu = torch.get_rng_state().numel()
            torch.set_rng_state(state[:cpu].cpu())
            offset = cpu
            for d in devices:
                n = torch.cuda.get_rng_state(d).numel()
                torch.cuda.set_rng_state(state[offset : offset + n].cpu(), d)
                offset += n
        yield
