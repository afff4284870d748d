# Autodiff of a torch call: JVP through torch.func.jvp, transpose through torch.func.vjp.
#
# The JVP rule binds torch_call_p once, for JvpFunction(fn, with_primals=True): one
# torch.func.jvp gives the outputs and their tangents. Where JAX needs the two halves apart
# (linearize, grad, checkpoint, scan, jacfwd), _rule_partial_eval.py splits that call into
# fn(primals) and JvpFunction(fn)(primals, tangents), which is linear in the tangents; the
# transpose rule turns the latter into VjpFunction(fn)(primals, cotangents). All of these
# are torch callables bound to the same primitive, so they are batched, differentiated and
# transposed again by the same rules: grad of grad, hessian, vmap of grad and jit of all of
# them need no special case.
#
# Leaves are addressed by their index among the flat leaves of the positional args
# (`wrt`), and outputs by a mask over the flat output leaves (`out_mask`: the inexact
# outputs that carry tangents or cotangents), so derived functions stay hashable tuples.
# torch's complex cotangents are the conjugates of JAX's; VjpFunction converts both ways.
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import torch

from torchjax._compat import is_functorch_wrapped
from torchjax._errors import AutodiffError
from torchjax._primitive._params import Linear, _is_operand
from torchjax._to_jax._batching import vmap_call
from torchjax._to_jax._derivative import (
    ZerosLike,
    _autograd_pullback,
    _autograd_pullbacks,
    _batch_sizes,
    _conj,
    _Derivative,
    _inexact,
    _on_tape,
    _outermost,
    _stack_batch,
)
from torchjax._to_jax._fake_run import default_torch_device
from torchjax._to_jax._residual import (
    GRAPHS,
    KeptGraph,
    enter_derived_call,
    exit_derived_call,
    held_count,
    recording,
    replaying,
    rng_state,
    rng_state_size,
    take_held,
)
from torchjax._to_jax._torch_call import Options, torch_call_p

_tree = jax.tree_util


@dataclasses.dataclass(frozen=True)
class JvpFunction(_Derivative):
    """``(primals, tangents) -> tangents of inner's masked outputs``; linear in tangents.

    With ``with_primals`` it returns inner's outputs too, flat and first: ``(*outputs,
    *tangents)``, from the one torch.func.jvp that computes both. The JVP rule binds that
    form; where JAX needs the halves apart (linearize, grad, checkpoint, jacfwd), the
    rules in _rule_partial_eval.py split it back into the primal call and the linear form.

    ``taped``: the linear form that follows a TapedFunction, called as ``(primals,
    residuals, tangents)`` with that call's residuals; it replays the forward's random
    draws, and its transpose pulls back through the kept graph.
    """

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str
    with_primals: bool = False
    taped: bool = False

    @property
    def linear(self) -> JvpFunction:
        return dataclasses.replace(self, with_primals=False)

    def __call__(self, primals: tuple, *rest: tuple) -> tuple:
        enter_derived_call()  # a module copy the forward runs in stays as it is until the end
        try:
            if not self.taped:
                return self._jvp(primals, rest[0])
            (_, state), tangents = rest
            with replaying(_plain(state, 1), _device_of(primals)):
                return self._jvp(primals, tangents)
        finally:
            exit_derived_call()

    def _jvp(self, primals: tuple, tangents: tuple) -> tuple:
        g, x = self._restricted(primals)
        if self.method == "torch.func":
            outs, t_outs, rest = torch.func.jvp(g, tuple(x), tuple(tangents), has_aux=True)
        else:
            outs, t_outs, rest = self._jvp_by_double_vjp(g, x, tangents)
        if not self.with_primals:
            return tuple(t_outs)
        done, others = iter(outs), iter(rest)
        merged = [next(done) if m else next(others) for m in self.out_mask]
        return (*merged, *t_outs)

    def _jvp_by_double_vjp(self, g: Any, x: list, tangents: tuple) -> tuple:
        """Forward mode from reverse mode: J t = d/du [u^T J]^T t, u a dummy cotangent."""
        with torch.enable_grad():
            x = _on_tape(x)
            out, rest = g(*x)
            result = [torch.zeros_like(o) for o in out]
            # An output off the tape does not depend on x: its tangent is zero, and
            # autograd.grad refuses it, so only outputs on the tape take part.
            live = [i for i, o in enumerate(out) if o.requires_grad]
            pairs, u = [], []
            if live:
                u = [torch.zeros_like(out[i], requires_grad=True) for i in live]
                vjp = torch.autograd.grad(
                    [out[i] for i in live],
                    x,
                    u,
                    create_graph=True,
                    allow_unused=True,
                    materialize_grads=True,
                )
                pairs = [(v, t) for v, t in zip(vjp, tangents, strict=True) if v.requires_grad]
            if pairs:
                jt = torch.autograd.grad(
                    [v for v, _ in pairs],
                    u,
                    [t for _, t in pairs],
                    create_graph=True,
                    allow_unused=True,
                    materialize_grads=True,
                )
                for i, t in zip(live, jt, strict=True):
                    result[i] = t
        return out, tuple(result), rest

    def declared_shapes(self, options: Options, primals: tuple, *rest: tuple) -> tuple:
        del rest
        out = torch_call_p.abstract_eval(*primals, fn=self.inner, options=options)
        every = _tree.tree_leaves(out)
        masked = tuple(s for s, m in zip(every, self.out_mask, strict=True) if m)
        return (*every, *masked) if self.with_primals else masked


@dataclasses.dataclass(frozen=True)
class VjpFunction(_Derivative):
    """``(primals, cotangents) -> cotangents of the wrt leaves``; linear in cotangents.

    ``ct_batch`` holds one entry per jax.vmap over the cotangents alone (jax.jacrev,
    hessian, the JVP of a VJP with respect to its cotangents), innermost first: the
    cotangent leaves' batch axes at that level (None where not batched). The forward then
    runs once, and only the pullback is batched, as torch.func.jacrev does: the function
    is not re-run under vmap, so random draws, data-dependent code and kernels without a
    batching rule work. Outputs carry the batch axes in front, outermost first.
    """

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str
    ct_batch: tuple = ()
    taped: bool = False  # called as (primals, residuals, cotangents): see JvpFunction
    # Called with two sets of cotangents, (..., cotangents, more): the pullbacks of both from
    # one forward, (*of cotangents, *of more). The JVP of a VJP in its cotangents.
    pair: bool = False

    def __call__(self, primals: tuple, *rest: tuple) -> tuple:
        # A module copy the forward runs in stays as it is until the pullback is done.
        enter_derived_call()
        try:
            return self._call(primals, *rest)
        finally:
            exit_derived_call()

    def _call(self, primals: tuple, *rest: tuple) -> tuple:
        if self.pair:
            *head, cts, more = rest
            stacked = tuple(torch.stack([c, m]) for c, m in zip(cts, more, strict=True))
            both = dataclasses.replace(self, pair=False, ct_batch=(*self.ct_batch, (0,) * len(cts)))
            out = both._call(primals, *head, stacked)
            return (*[o[0] for o in out], *[o[1] for o in out])
        cotangents = rest[-1]
        # torch pulls back with the conjugate of JAX's cotangent convention for complex
        # numbers: JAX's vjp(ct) is conj(torch's vjp(conj(ct))). Real leaves are unaffected.
        if any(map(torch.is_complex, cotangents)):
            cotangents = tuple(map(_conj, cotangents))
        if self.taped:
            grads = self._after_taped(primals, rest[0], cotangents)
        elif self.ct_batch:
            grads = self._batched_pullback(primals, cotangents)
        else:
            grads = self._pullback(primals, cotangents)
        return tuple(map(_conj, grads)) if any(map(torch.is_complex, grads)) else tuple(grads)

    def _after_taped(self, primals: tuple, residuals: tuple, cotangents: tuple) -> tuple:
        """Through the graph the forward kept, if it is still there and nothing outside
        differentiates this call; otherwise recompute, replaying the forward's draws."""
        handle, state = (_plain(r, ndim) for r, ndim in zip(residuals, (0, 1), strict=True))
        graph = GRAPHS.take(int(handle)) if handle is not None and int(handle) else None
        if graph is not None and not self.ct_batch and _outermost((primals, cotangents)):
            return _through(graph, primals, self.out_mask, cotangents)
        with replaying(state, _device_of(primals)):
            if self.ct_batch:
                return self._batched_pullback(primals, cotangents)
            return self._pullback(primals, cotangents)

    def _pullback(self, primals: tuple, cotangents: tuple) -> tuple:
        g, x = self._restricted(primals)
        if self.method == "autograd":
            return _autograd_pullback(g, x, cotangents, create_graph=True)
        if _outermost((primals, cotangents)):
            # Nothing outside this call to differentiate it further: torch.func.vjp would
            # compute the same with plain autograd, plus its transform's per-op overhead.
            return _autograd_pullback(g, x, cotangents, create_graph=False)
        _, pullback, _ = torch.func.vjp(g, *x, has_aux=True)
        return tuple(pullback(tuple(cotangents)))

    def _batched_pullback(self, primals: tuple, cotangents: tuple) -> tuple:
        """One forward, then the pullback of every cotangent in the batch."""
        flat, lead = _stack_batch(cotangents, self.ct_batch)
        g, x = self._restricted(primals)
        if flat[0].shape[0] == 0:  # an empty batch: nothing to pull back
            return tuple(xi.new_zeros(*lead, *xi.shape) for xi in x)
        if self.method == "autograd":
            grads = _autograd_pullbacks(g, x, flat)
        else:
            _, pullback, _ = torch.func.vjp(g, *x, has_aux=True)
            grads = vmap_call(lambda *c: tuple(pullback(c)), list(flat), (0,) * len(flat), "error")
        return tuple(gr.reshape(*lead, *gr.shape[1:]) for gr in grads)

    def declared_shapes(self, options: Options, primals: tuple, *rest: tuple) -> tuple:
        del options
        cotangents = rest[-2] if self.pair else rest[-1]
        leaves = _tree.tree_leaves(primals)
        lead = _batch_sizes([c.shape for c in cotangents], self.ct_batch)
        out = tuple(
            jax.ShapeDtypeStruct((*lead, *leaves[i].shape), leaves[i].dtype) for i in self.wrt
        )
        return (*out, *out) if self.pair else out


@dataclasses.dataclass(frozen=True)
class TapedFunction(_Derivative):
    """``(*primals) -> (*inner's flat outputs, handle, rng_state)``: the primal half of a
    call that reverse mode splits (_rule_partial_eval.py), run with autograd recording on the
    `wrt` leaves. The graph is kept under `handle` (0: none kept, e.g. under a torch.func
    transform) for the VJP to pull back through; `rng_state` is torch's generator state
    from before the forward, for a VJP that must recompute. See _residual.py.
    """

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str
    keep: bool = True  # False: the linear half is applied forward, and recomputes

    def arg_path(self, path: tuple) -> str:
        return self.inner.arg_path(path)  # its args are inner's own

    def __call__(self, *primals: Any) -> tuple:
        enter_derived_call()
        try:
            return self._call(primals)
        finally:
            exit_derived_call()

    def _call(self, primals: tuple) -> tuple:
        tensors = [x for x in _tree.tree_leaves(primals) if isinstance(x, torch.Tensor)]
        device = tensors[0].device if tensors else default_torch_device()
        state = rng_state(device).to(device)
        g, x = self._restricted(primals)
        handle = 0
        # A derivative (grad of grad) is differentiated again by torch.func, which does
        # not take saved-tensor hooks: only the user's own function keeps its graph.
        if self.keep and _outermost(primals) and not self.inner.grad_mode:
            try:
                masked, rest, handle = self._keep_graph(g, x, tensors)
            except RuntimeError as e:
                if "saved tensor hooks" not in str(e):
                    raise
                # fn uses torch.func itself: run it again as it is, with the same draws.
                with replaying(state, device):
                    masked, rest = g(*x)
        else:
            masked, rest = g(*x)
        done, others = iter(masked), iter(rest)
        outs = [next(done) if m else next(others) for m in self.out_mask]
        return (*outs, torch.tensor(handle, dtype=torch.int32, device=device), state)

    def _keep_graph(self, g: Any, x: list, tensors: list) -> tuple:
        graph = KeptGraph()
        mark = held_count()
        with torch.enable_grad(), recording(graph, tensors):
            graph.leaves = _on_tape(x)
            masked, rest = g(*graph.leaves)
        if not any(o.requires_grad for o in masked):
            return masked, rest, 0
        # What the forward left held (a module copy with this call's tensors) is the
        # graph's now: its backward may read it again (checkpointing, adjoint solvers).
        graph.keep_held(take_held(mark), tensors)
        graph.let_go_of_inputs(tensors, [*masked, *rest])
        found = iter(masked)
        graph.outputs = [next(found) if m else None for m in self.out_mask]
        return masked, rest, GRAPHS.put(graph)

    def declared_shapes(self, options: Options, *primals: Any) -> tuple:
        out = torch_call_p.abstract_eval(*primals, fn=self.inner, options=options)
        return (*_tree.tree_leaves(out), *self.residual_types())

    @staticmethod
    def residual_types() -> tuple:
        """The types of the graph handle and the RNG state."""
        size = rng_state_size(default_torch_device())
        return jax.ShapeDtypeStruct((), np.int32), jax.ShapeDtypeStruct((size,), np.uint8)


def _through(graph: KeptGraph, primals: tuple, out_mask: tuple, cotangents: tuple) -> tuple:
    """The cotangents of graph's leaves from a kept forward; frees the graph."""
    # Saved views of the inputs are rebuilt from these: the same values as the forward's.
    graph.inputs = [x for x in _tree.tree_leaves(primals) if isinstance(x, torch.Tensor)]
    graph.refill_leaves()
    outs = [o for o, m in zip(graph.outputs, out_mask, strict=True) if m]
    pairs = [(o, c) for o, c in zip(outs, cotangents, strict=True) if o is not None]
    pairs = [(o, c) for o, c in pairs if o.requires_grad]  # others do not depend on leaves
    graph.reinstall_held()
    try:
        if not pairs:
            return tuple(torch.zeros_like(x) for x in graph.leaves)
        return torch.autograd.grad(
            [o for o, _ in pairs],
            graph.leaves,
            [c for _, c in pairs],
            allow_unused=True,
            materialize_grads=True,
        )
    finally:
        graph.release_held()
        graph.inputs = graph.outputs = graph.leaves = []


def _plain(t: Any, ndim: int) -> Any:
    """t if it is a plain tensor of `ndim` dims; None if a torch.func transform wraps it or
    it carries a batch axis (vmap_method="broadcast_all"): a batch of handles or RNG
    states has no single graph or generator state to use."""
    if isinstance(t, torch.Tensor) and t.dim() == ndim:
        if not is_functorch_wrapped(t):
            return t
    return None


def _device_of(primals: tuple) -> torch.device | None:
    return next((x.device for x in _tree.tree_leaves(primals) if isinstance(x, torch.Tensor)), None)


def differentiated(leaves: list, tangents: list) -> tuple:
    """The positions of the float array leaves whose tangent is not None (a symbolic zero)."""
    return tuple(
        i
        for i, (x, t) in enumerate(zip(leaves, tangents, strict=True))
        if t is not None and _is_operand(x) and _inexact(x.dtype)
    )


@torch_call_p.def_jvp
def _jvp(primals: tuple, tangents: tuple, *, fn: Any, options: Options) -> tuple[Any, Any]:
    """Outputs and tangents from one call, JvpFunction(fn, with_primals=True), given the
    nonzero float tangents; fn alone where no output tangent can be nonzero."""
    if isinstance(fn, VjpFunction) and not _tree.tree_leaves(tangents[:-1]):
        return _jvp_of_pullback(primals, tangents[-1], fn, options)
    leaves, tree = _tree.tree_flatten(primals)
    t_leaves = tree.flatten_up_to(tangents)
    wrt = differentiated(leaves, t_leaves)
    out_types = torch_call_p.abstract_eval(*primals, fn=fn, options=options)
    out_leaves, out_tree = _tree.tree_flatten(out_types)
    out_mask = tuple(_inexact(o.dtype) for o in out_leaves)
    if not wrt or not any(out_mask):
        return torch_call_p.bind(*primals, fn=fn, options=options), None
    jvp_fn = JvpFunction(fn, wrt, out_mask, options.grad_method, with_primals=True)
    flat = torch_call_p.bind(primals, tuple(t_leaves[i] for i in wrt), fn=jvp_fn, options=options)
    out, t_out = flat[: len(out_mask)], iter(flat[len(out_mask) :])
    return _tree.tree_unflatten(out_tree, out), _tree.tree_unflatten(
        out_tree, [next(t_out) if m else None for m in out_mask]
    )


def _jvp_of_pullback(primals: tuple, ct_dots: tuple, fn: VjpFunction, options: Options) -> tuple:
    """A VJP differentiated with respect to its cotangents alone, in which it is linear:
    its tangent is the same VJP of the cotangents' tangents. Both come from one call that
    runs the forward once and pulls back both (VjpFunction.pair); batched over the
    tangents alone (jax.jacfwd), it splits again (_rule_partial_eval.py)."""
    *points, cts = primals
    if all(t is None for t in ct_dots):
        return torch_call_p.bind(*primals, fn=fn, options=options), None
    dots = [jax.numpy.zeros_like(c) if t is None else t for c, t in zip(cts, ct_dots, strict=True)]
    both = dataclasses.replace(fn, pair=True)
    out = torch_call_p.bind(*points, cts, tuple(dots), fn=both, options=options)
    return tuple(out[: len(out) // 2]), tuple(out[len(out) // 2 :])


@torch_call_p.def_transpose
def _transpose(cts: Any, *args: Any, fn: Any, options: Options) -> tuple:
    """Cotangents of the linear inputs, through VjpFunction.

    A JvpFunction (linear in its tangents) transposes to VjpFunction of its inner function
    directly. Any other call linear in some leaves (the user's own linear function, a
    VjpFunction) is transposed generically: the vjp of fn with respect to those leaves,
    taken at zero (any point will do for a linear function).
    """
    if isinstance(fn, JvpFunction) and fn.with_primals:
        # Partial evaluation splits this form before transposition (see _rule_partial_eval.py);
        # should it reach here whole, its outputs must carry no cotangent.
        n_out = len(fn.out_mask)
        if any(c is not None for c in cts[:n_out]):
            raise AutodiffError(
                f"Cannot transpose the JVP of {fn.root.name} with respect to its outputs: "
                f"they are not linear in the tangents. Please report this with the program."
            )
        cts, fn = cts[n_out:], fn.linear
    if isinstance(fn, JvpFunction):
        primals, *residuals, tangents = args  # residuals: a taped form's (handle, rng)
        if all(isinstance(t, Linear) for t in tangents) and not _has_linear((primals, residuals)):
            nothing = (None,) * len(args)
            keep = [i for i, c in enumerate(cts) if c is not None]
            if not keep:
                return nothing
            float_outputs = [j for j, m in enumerate(fn.out_mask) if m]
            chosen = {float_outputs[i] for i in keep}
            out_mask = tuple(j in chosen for j in range(len(fn.out_mask)))
            vjp_fn = VjpFunction(fn.inner, fn.wrt, out_mask, fn.grad_method, taped=fn.taped)
            grads = torch_call_p.bind(
                primals, *residuals, tuple(cts[i] for i in keep), fn=vjp_fn, options=options
            )
            return (*nothing[:-1], tuple(grads))
    return _transpose_generic(cts, args, fn, options)


def _has_linear(tree: Any) -> bool:
    return any(isinstance(x, Linear) for x in _tree.tree_leaves(tree))


def _transpose_generic(cts: Any, args: tuple, fn: Any, options: Options) -> tuple:
    leaves, tree = _tree.tree_flatten(args)
    wrt = tuple(i for i, x in enumerate(leaves) if isinstance(x, Linear))
    ct_leaves = _tree.tree_structure(
        torch_call_p.abstract_eval(
            *_tree.tree_unflatten(tree, [_aval_of(x) for x in leaves]), fn=fn, options=options
        )
    ).flatten_up_to(cts)
    out_mask = tuple(c is not None for c in ct_leaves)
    if not wrt or not any(out_mask):
        return tuple(None for _ in args)
    point = [ZerosLike(x.shape, np.dtype(x.dtype)) if isinstance(x, Linear) else x for x in leaves]
    vjp_fn = VjpFunction(fn, wrt, out_mask, options.grad_method)
    grads = iter(
        torch_call_p.bind(
            _tree.tree_unflatten(tree, point),
            tuple(c for c in ct_leaves if c is not None),
            fn=vjp_fn,
            options=options,
        )
    )
    full = [next(grads) if isinstance(x, Linear) else None for x in leaves]
    return tuple(_tree.tree_unflatten(tree, full))


def _aval_of(x: Any) -> Any:
    return x.aval if isinstance(x, Linear) else x
