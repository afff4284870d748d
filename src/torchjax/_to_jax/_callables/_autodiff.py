# Autodiff's callables: JvpFunction (one torch.func.jvp; the JVP rule binds it, the splits
# take its linear half) and VjpFunction (torch.func.vjp, or torch.autograd.grad where
# nothing differentiates the call again; through a kept graph where the forward kept one).
# _Derivative holds what both share: the inputs differentiated (`wrt`), the outputs
# (`out_mask`), and the advice for a derivative torch refuses.
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import torch

from torchjax._compat._messages import (
    is_autodiff_failure,
    is_reentrant_checkpoint,
    lacks_forward_derivative,
    not_differentiable_input,
    refuses_saved_tensor_hooks,
)
from torchjax._convert import torch_dtype
from torchjax._errors import (
    AutodiffError,
)
from torchjax._primitive._params import leaf_paths
from torchjax._to_jax._call._plan import autograd_inside
from torchjax._to_jax._callables._base import (
    DerivedFunction,
    TypesOf,
    ZerosLike,
    _tensors_of,
    device_of,
    unbatched_residual,
)
from torchjax._to_jax._context import FORWARD_AD, GRAPHS, OUTPUT_BUFFERS
from torchjax._to_jax._torch_ops._autograd import (
    AUTODIFF_HINT,
    AUTOGRAD_HINT,
    FORWARD_AD_HINT,
    REENTRANT_CHECKPOINT_HINT,
    SAVED_TENSOR_HOOKS_HINT,
    autograd_pullback,
    autograd_pullbacks,
    batch_sizes,
    conj,
    jvp_by_double_vjp,
    outermost,
    stack_batch,
)
from torchjax._to_jax._torch_ops._residual import (
    replaying,
)
from torchjax._to_jax._torch_ops._vmap import (
    as_tensor,
    vmap_call,
)

_tree = jax.tree_util

_tree = jax.tree_util


class _Derivative(DerivedFunction):
    """Shared plumbing of JvpFunction and VjpFunction: select leaves, name errors."""

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str

    @property
    def method(self) -> str:
        """The grad_method in force: torch.autograd's where the function runs it itself."""
        return "autograd" if autograd_inside() else self.grad_method

    def arg_path(self, path: tuple) -> str:
        # Their args are (primals, tangents or cotangents); the primals are inner's args.
        if path and getattr(path[0], "idx", None) == 0 and len(path) > 1:
            return self.inner.arg_path(path[1:])
        return "args" + _tree.keystr(path)

    def _restricted(self, primals: tuple) -> tuple[Any, list]:
        """(g, x): g(*x) is inner's masked outputs as a function of the `wrt` leaves.

        g returns ``(masked, rest)``, both tensors: the masked outputs, and the others,
        which torch.func passes through as aux, untouched by the transform.
        """
        # This runs on every call: its loops stay in C where they can (map, `in`).
        leaves, tree = _tree.tree_flatten(primals)
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), None)
        if ZerosLike in map(type, leaves):
            leaves = [
                torch.zeros(x.shape, dtype=torch_dtype(x.dtype), device=device)
                if isinstance(x, ZerosLike)
                else x
                for x in leaves
            ]

        def g(*diff: torch.Tensor) -> tuple:
            new = list(leaves)
            for i, t in zip(self.wrt, diff, strict=True):
                new[i] = t
            outs = _tree.tree_leaves(self.inner(*_tree.tree_unflatten(tree, new)))
            # A Python number output is a constant: as a tensor, its derivative is zero.
            outs = [o if isinstance(o, torch.Tensor) else as_tensor(o, device) for o in outs]
            if all(self.out_mask):
                return tuple(outs), []
            masked = tuple(o for o, m in zip(outs, self.out_mask, strict=True) if m)
            return masked, [o for o, m in zip(outs, self.out_mask, strict=True) if not m]

        return g, [leaves[i] for i in self.wrt]

    grad_mode = True  # see CallPlan: torch.func runs derivatives with grad mode on
    # The module copy the forward runs in stays as it is until the pullback is done.
    holds_state = True

    def call_failure(self, error: Exception, in_tree: Any = None) -> Exception:
        text = f"{type(error).__name__}: {error}"
        if not is_autodiff_failure(error):
            return self.inner.call_failure(error, in_tree)  # the function's own exception
        if not_differentiable_input(error):
            return AutodiffError(self._not_differentiable(text, in_tree))
        if is_reentrant_checkpoint(error):
            hint = REENTRANT_CHECKPOINT_HINT
        elif self.method == "autograd":
            hint = AUTOGRAD_HINT
        elif lacks_forward_derivative(error):
            hint = FORWARD_AD_HINT
        elif refuses_saved_tensor_hooks(error):
            hint = SAVED_TENSOR_HOOKS_HINT
        else:
            hint = AUTODIFF_HINT
        return AutodiffError(hint.format(name=self.root.name, error=text))

    def _not_differentiable(self, text: str, in_tree: Any) -> str:
        """torch refuses to differentiate one of the inputs: name those differentiated."""
        names = []
        if in_tree is not None:
            paths = leaf_paths(in_tree)  # the primals' leaves come first
            names = [self.arg_path(paths[i]) for i in self.wrt if i < len(paths)]
        buffers = [n for n in names if self.root.hooks.is_buffer(n)]
        if buffers:
            return NOT_DIFFERENTIABLE_BUFFER.format(
                name=self.root.name, error=text, buffers=", ".join(buffers)
            )
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        return NOT_DIFFERENTIABLE.format(name=self.root.name, error=text, inputs=shown or "?")


NOT_DIFFERENTIABLE_BUFFER = """\
torch cannot differentiate {name} with respect to some of its module's buffers: {error}
The buffers being differentiated: {buffers}. Buffers such as BatchNorm's running
statistics are the module's state, not parameters: differentiate variables['params'] only,
    jax.grad(lambda p: loss({{"params": p, "buffers": variables["buffers"]}}))(params)
or mark the buffers constant with jax.lax.stop_gradient (with equinox's filter_grad, keep
them out of the differentiated part of the model: eqx.partition)."""

NOT_DIFFERENTIABLE = """\
torch cannot differentiate {name} with respect to one of the inputs being differentiated:
{error}
The differentiated inputs: {inputs}. Keep the one torch names out of what JAX
differentiates (as a non-differentiated argument), or wrap it in jax.lax.stop_gradient."""


# -- autodiff ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class JvpFunction(_Derivative):
    """``(primals, tangents) -> tangents of inner's masked outputs``; linear in tangents.

    With ``with_primals`` it returns inner's outputs too, flat and first: ``(*outputs,
    *tangents)``, from the one torch.func.jvp that computes both. The JVP rule binds that
    form; where JAX needs the halves apart (linearize, grad, checkpoint, jacfwd), the
    rules in _torch_call/_partial_eval.py split it back into the primal call and the linear form.

    ``with_residuals``: the linear form that follows a KeptForward, called as ``(primals,
    residuals, tangents)`` with that call's residuals; it replays the forward's random
    draws, and its transpose pulls back through the kept graph.
    """

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str
    with_primals: bool = False
    with_residuals: bool = False

    @property
    def linear(self) -> JvpFunction:
        return dataclasses.replace(self, with_primals=False)

    @property
    def parts(self) -> tuple[str, ...]:  # type: ignore[override]
        if self.with_residuals:
            return ("primals", "residuals", "tangents")
        return ("primals", "tangents")

    def _call(self, primals: tuple, *rest: tuple) -> tuple:
        if not self.with_residuals:
            return self._jvp(primals, rest[0])
        (_, state), tangents = rest
        with replaying(unbatched_residual(state, 1), device_of(primals)):
            return self._jvp(primals, tangents)

    def _jvp(self, primals: tuple, tangents: tuple) -> tuple:
        g, x = self._restricted(primals)
        if self.method == "torch.func":
            with FORWARD_AD:
                outs, t_outs, rest = torch.func.jvp(g, tuple(x), tuple(tangents), has_aux=True)
        else:
            outs, t_outs, rest = jvp_by_double_vjp(g, x, tangents)
        if not self.with_primals:
            return tuple(t_outs)
        done, others = iter(outs), iter(rest)
        merged = [next(done) if m else next(others) for m in self.out_mask]
        return (*merged, *t_outs)

    def out_types(self, types_of: TypesOf, primals: tuple, *rest: tuple) -> tuple:
        del rest
        out = types_of(self.inner, *primals)
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
    with_residuals: bool = False  # called as (primals, residuals, cotangents): see JvpFunction
    # Called with two sets of cotangents, (..., cotangents, more): the pullbacks of both from
    # one forward, (*of cotangents, *of more). The JVP of a VJP in its cotangents.
    with_tangents: bool = False

    @property
    def parts(self) -> tuple[str, ...]:  # type: ignore[override]
        more = ("ct_tangents",) if self.with_tangents else ()
        if self.with_residuals:
            return ("primals", "residuals", "cotangents", *more)
        return ("primals", "cotangents", *more)

    def _call(self, primals: tuple, *rest: tuple) -> tuple:
        into = OUTPUT_BUFFERS.take()  # XLA's buffers for the gradients, at the top call only
        if self.with_tangents:
            *head, cts, more = rest
            stacked = tuple(torch.stack([c, m]) for c, m in zip(cts, more, strict=True))
            both = dataclasses.replace(
                self, with_tangents=False, ct_batch=(*self.ct_batch, (0,) * len(cts))
            )
            out = both._call(primals, *head, stacked)
            return (*[o[0] for o in out], *[o[1] for o in out])
        cotangents = rest[-1]
        # torch pulls back with the conjugate of JAX's cotangent convention for complex
        # numbers: JAX's vjp(ct) is conj(torch's vjp(conj(ct))). Real leaves are unaffected.
        if any(map(torch.is_complex, cotangents)):
            cotangents = tuple(map(conj, cotangents))
            into = None  # conjugated after: not what the buffers should hold
        if self.with_residuals:
            grads = self._through_kept_graph(primals, rest[0], cotangents, into)
        elif self.ct_batch:
            grads = self._batched_pullback(primals, cotangents)
        else:
            grads = self._pullback(primals, cotangents)
        # A sparse gradient (nn.Embedding(sparse=True)'s) holds the same numbers as the
        # dense array JAX takes.
        grads = [g if g.layout is torch.strided else g.to_dense() for g in grads]
        return tuple(map(conj, grads)) if any(map(torch.is_complex, grads)) else tuple(grads)

    def _through_kept_graph(
        self, primals: tuple, residuals: tuple, cotangents: tuple, into: Any = None
    ) -> tuple:
        """Through the graph the forward kept, if it is still there and nothing outside
        differentiates this call (writing the gradients into `into`, XLA's buffers, where
        given); otherwise recompute, replaying the forward's draws."""
        handle, state = (
            unbatched_residual(r, ndim) for r, ndim in zip(residuals, (0, 1), strict=True)
        )
        graph = GRAPHS.take(int(handle)) if handle is not None and int(handle) else None
        if graph is not None and not self.ct_batch and outermost((primals, cotangents)):
            if into is not None and len(into) != len(self.wrt):
                into = None
            return graph.backward(_tensors_of(primals), self.out_mask, cotangents, into)
        with replaying(state, device_of(primals)):
            if self.ct_batch:
                return self._batched_pullback(primals, cotangents)
            return self._pullback(primals, cotangents)

    def _pullback(self, primals: tuple, cotangents: tuple) -> tuple:
        g, x = self._restricted(primals)
        if self.method == "autograd":
            return autograd_pullback(g, x, cotangents, create_graph=True)
        if outermost((primals, cotangents)):
            # Nothing outside this call to differentiate it further: torch.func.vjp would
            # compute the same with plain autograd, plus its transform's per-op overhead.
            return autograd_pullback(g, x, cotangents, create_graph=False)
        _, pullback, _ = torch.func.vjp(g, *x, has_aux=True)
        return tuple(pullback(tuple(cotangents)))

    def _batched_pullback(self, primals: tuple, cotangents: tuple) -> tuple:
        """One forward, then the pullback of every cotangent in the batch."""
        flat, lead = stack_batch(cotangents, self.ct_batch)
        g, x = self._restricted(primals)
        if flat[0].shape[0] == 0:  # an empty batch: nothing to pull back
            return tuple(xi.new_zeros(*lead, *xi.shape) for xi in x)
        if self.method == "autograd":
            grads = autograd_pullbacks(g, x, flat)
        else:
            _, pullback, _ = torch.func.vjp(g, *x, has_aux=True)
            grads = vmap_call(lambda *c: tuple(pullback(c)), list(flat), (0,) * len(flat), "error")
        return tuple(gr.reshape(*lead, *gr.shape[1:]) for gr in grads)

    def out_types(self, types_of: TypesOf, primals: tuple, *rest: tuple) -> tuple:
        del types_of
        cotangents = rest[-2] if self.with_tangents else rest[-1]
        leaves = _tree.tree_leaves(primals)
        lead = batch_sizes([c.shape for c in cotangents], self.ct_batch)
        out = tuple(
            jax.ShapeDtypeStruct((*lead, *leaves[i].shape), leaves[i].dtype) for i in self.wrt
        )
        return (*out, *out) if self.with_tangents else out
