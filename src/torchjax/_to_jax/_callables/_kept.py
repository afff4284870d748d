# The forward that keeps its graph for reverse mode: KeptForward.
#
# jax.grad splits a call into a forward and a linear half (_torch_call/_partial_eval.py).
# The forward runs with autograd on, keeps its graph in a store under a handle, and returns
# the handle and torch's generator state after its outputs: the residuals its VJP pulls
# back through (or recomputes from, replaying the draws, where the graph is gone).
# ForwardResiduals is what the DCE rule leaves of a forward whose outputs nobody reads:
# the residuals alone. See _torch_ops/_residual.py for the kept graphs themselves.
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import torch

from torchjax._compat._messages import (
    refuses_saved_tensor_hooks,
)
from torchjax._to_jax._callables._autodiff import _Derivative
from torchjax._to_jax._callables._base import DerivedFunction, TypesOf, device_of
from torchjax._to_jax._context import GRAPHS, OUTPUT_BUFFERS, WARMED
from torchjax._to_jax._fake._run import (
    default_torch_device,
)
from torchjax._to_jax._torch_ops._autograd import (
    on_tape,
    outermost,
)
from torchjax._to_jax._torch_ops._residual import (
    KeptGraph,
    held_count,
    recording,
    replaying,
    rng_state,
    rng_state_size,
    take_held,
)

_tree = jax.tree_util

_tree = jax.tree_util


@dataclasses.dataclass(frozen=True)
class KeptForward(_Derivative):
    """``(*primals) -> (*inner's flat outputs, handle, rng_state)``: the primal half of a
    call that reverse mode splits (_torch_call/_partial_eval.py), run with autograd recording on the
    `wrt` leaves. The graph is kept under `handle` (0: none kept, e.g. under a torch.func
    transform) for the VJP to pull back through; `rng_state` is torch's generator state
    from before the forward, for a VJP that must recompute. See _torch_ops/_residual.py.
    """

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str
    keep_graph: bool = True  # False: the linear half is applied forward, and recomputes

    n_residuals = 2  # the handle and the RNG state, after the outputs (CallPlan.empty_batch)

    def arg_path(self, path: tuple) -> str:
        return self.inner.arg_path(path)  # its args are inner's own

    def _call(self, *primals: Any) -> tuple:
        into = OUTPUT_BUFFERS.take()  # XLA's buffers for the outputs, under jit
        tensors = [x for x in _tree.tree_leaves(primals) if isinstance(x, torch.Tensor)]
        device = tensors[0].device if tensors else default_torch_device()
        state = rng_state(device).to(device)
        g, x = self._restricted(primals)
        graph = None
        # A derivative (grad of grad) is differentiated again by torch.func, which does
        # not take saved-tensor hooks: only the user's own function keeps its graph.
        if self.keep_graph and outermost(primals) and not self.inner.grad_mode:
            try:
                masked, rest, graph = self._keep_graph(g, x, tensors)
            except RuntimeError as e:
                if not refuses_saved_tensor_hooks(e):
                    raise
                # fn uses torch.func itself: run it again as it is, with the same draws.
                with replaying(state, device):
                    masked, rest = g(*x)
        else:
            masked, rest = g(*x)
        done, others = iter(masked), iter(rest)
        outs = [next(done) if m else next(others) for m in self.out_mask]
        del masked, rest, done, others  # (the outputs' references: see write_outputs)
        handle = 0
        if graph is not None:
            if into is not None:
                graph.write_outputs(outs, into)
            handle = GRAPHS.put(graph)
        return (*outs, torch.tensor(handle, dtype=torch.int32, device=device), state)

    def _keep_graph(self, g: Any, x: list, tensors: list) -> tuple:
        graph = KeptGraph()
        mark = held_count()
        with torch.enable_grad(), recording(graph, tensors):
            graph.leaves = on_tape(x)
            masked, rest = g(*graph.leaves)
        if not any(o.requires_grad for o in masked):
            return masked, rest, None
        # What the forward left held (a module copy with this call's tensors) is the
        # graph's now: its backward may read it again (checkpointing, adjoint solvers).
        graph.keep_held(take_held(mark), tensors)
        graph.let_go_of_inputs(tensors, [*masked, *rest])
        found = iter(masked)
        graph.outputs = [next(found) if m else None for m in self.out_mask]
        return masked, rest, graph

    def out_types(self, types_of: TypesOf, *primals: Any) -> tuple:
        out = types_of(self.inner, *primals)
        return (*_tree.tree_leaves(out), *self.residual_types())

    @staticmethod
    def residual_types() -> tuple:
        """The types of the graph handle and the RNG state."""
        size = rng_state_size(default_torch_device())
        return jax.ShapeDtypeStruct((), np.int32), jax.ShapeDtypeStruct((size,), np.uint8)


@dataclasses.dataclass(frozen=True)
class ForwardResiduals(DerivedFunction):
    """``(*args) -> (handle 0, rng_state)``: the residuals `inner` (a KeptForward that
    would keep no graph, or the forward inside a JVP's) returns after its outputs, without
    running it: the generator state it reads before its forward.

    Except the first time for a given user function: then the forward does run, plainly,
    as the call it stands for would have. Torch code that fills a cache or builds state on
    its first call would otherwise first run inside the VJP's torch.func transform, and
    keep a tensor of that transform's level, which fails every later call (it does in
    torch.func alone, too). Its random draws are then the ones the VJP replays.
    """

    inner: Any

    n_residuals = 2  # its outputs are the residuals alone

    def _call(self, *args: Any) -> tuple:
        root = self.inner.root
        if root not in WARMED:
            *_, handle, state = dataclasses.replace(self.inner, keep_graph=False)(*args)
            WARMED.add(root)
            return handle, state
        device = device_of(args)
        device = device if device is not None else default_torch_device()  # as the forward
        return torch.tensor(0, dtype=torch.int32, device=device), rng_state(device).to(device)

    def out_types(self, types_of: TypesOf, *args: Any) -> tuple:
        del types_of, args
        return KeptForward.residual_types()
