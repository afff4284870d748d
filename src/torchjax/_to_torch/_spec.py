# The JAX side of to_torch: a JAX function as torch calls it.
#
# A `Spec` holds one *flat* JAX function (arrays in, tuple of arrays out) for one call
# signature, its jitted form, and the specs derived from it: the vjp (torch's backward),
# the jvp (forward mode) and jax.vmap'ed versions (torch.func.vmap), each again a flat JAX
# function in a spec. `run_spec` runs a spec on tensors, through DLPack, or through one
# opaque custom op while torch.compile traces.
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchjax._compat._jax import jax_config, x64_as
from torchjax._compat._torch import (
    LEGACY_VMAP,
    is_legacy_batched,
    legacy_add_batch_dim,
    legacy_remove_batch_dim,
    legacy_vmap_level,
    proxy_mode_active,
)
from torchjax._convert import array_to_tensor, tensor_to_jax, torch_dtype
from torchjax._errors import ArgumentError, ConversionError, JaxOutputError

_tree = jax.tree_util


def _is_diff(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


class Spec:
    """A flat JAX function at one input signature, with its jitted form and derivatives.

    `fn` takes one array per entry of `in_avals` and returns a tuple of arrays. Derived
    specs (vjp, jvp, vmap) are built on first use and cached here, so each is traced and
    compiled once. The last `n_aux` outputs are auxiliary (to_torch's has_aux): never
    differentiable, whatever their dtype. `n_aux` may be a callable, asked after `fn` was
    traced (the count is known only then).
    """

    def __init__(
        self,
        name: str,
        fn: Callable,
        in_avals: list,
        paths: list[str],
        n_aux: int | Callable[[], int] = 0,
    ):
        self.name, self.fn = name, fn
        self.x64 = _x64.value  # the mode it is traced in, which its derived specs keep
        self.in_avals, self.in_paths = tuple(in_avals), tuple(paths)
        self.out_where = f"{name} output"
        self.jitted = jax.jit(fn)
        try:
            # Shapes without running: torch needs them to mark outputs and for fake kernels.
            self.out_avals = tuple(jax.eval_shape(self.jitted, *self.in_avals))
        except Exception as e:
            pairs = zip(paths, in_avals, strict=True)
            sig = ", ".join(f"{p}: {a.dtype}{list(a.shape)}" for p, a in pairs)
            e.add_note(f"(while tracing {name} for torchjax.to_torch with {sig})")
            raise
        try:
            self.out_dtypes = tuple(torch_dtype(a.dtype) for a in self.out_avals)
        except ConversionError as e:
            raise JaxOutputError(f"{name}: an output has no torch dtype: {e}") from None
        self.n_aux = n_aux() if callable(n_aux) else n_aux
        n_main = len(self.out_avals) - self.n_aux
        self.diff_in = tuple(_is_diff(a.dtype) for a in self.in_avals)
        self.diff_out = tuple(
            _is_diff(a.dtype) and i < n_main for i, a in enumerate(self.out_avals)
        )
        self.out_specs = tuple(zip(self.out_avals, self.out_dtypes, strict=True))
        self._derived: dict[Any, Spec] = {}
        self.op_id: int | None = None

    def __repr__(self) -> str:
        return f"<torchjax spec {self.name}>"

    def run(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Call the jitted function on real tensors; zero-copy in and out."""
        return self.outputs_of(tensors, self.jitted(*self.arrays_of(tensors)))

    def arrays_of(self, tensors: tuple) -> list:
        """The inputs as JAX arrays (zero-copy where they can be), named by their paths."""
        return [tensor_to_jax(t, p) for t, p in zip(tensors, self.in_paths, strict=True)]

    def outputs_of(self, tensors: tuple, outs: Any) -> tuple[torch.Tensor, ...]:
        """A call's output arrays as tensors, none sharing memory with `tensors`."""
        return tuple(self.unshared(tensors, [array_to_tensor(o, self.out_where) for o in outs]))

    @staticmethod
    def unshared(tensors: tuple, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """`results`, each that shares memory with an input or an earlier result copied.

        Outputs are fresh XLA buffers unless XLA forwarded an input or deduplicated two
        outputs; torch must not see two tensors that secretly share memory."""
        seen = {t.const_data_ptr() for t in tensors}
        for k, t in enumerate(results):
            if t.numel():
                ptr = t.const_data_ptr()
                if ptr in seen:
                    t = results[k] = t.clone()
                    ptr = t.const_data_ptr()
                seen.add(ptr)
        return results

    def _derive(self, key: Any, build: Callable[[], Spec]) -> Spec:
        spec = self._derived.get(key)
        if spec is None:
            spec = self._derived[key] = build()
        return spec

    def _restricted(self, wrt: tuple[int, ...], with_all: bool = False) -> Callable:
        """`f(primals, *x)`: the differentiable outputs as functions of the inputs `wrt`;
        `with_all`: with every output beside them, as jax.vjp's has_aux takes them."""
        fn, diff_out = self.fn, self.diff_out

        def f(primals: tuple, *x: Any) -> tuple:
            full = list(primals)
            for i, xi in zip(wrt, x, strict=True):
                full[i] = xi
            outs = tuple(fn(*full))
            diff = tuple(o for o, d in zip(outs, diff_out, strict=True) if d)
            return (diff, outs) if with_all else diff

        return f

    def vjp(self, wrt: tuple[int, ...]) -> Spec:
        """Spec of `(*primals, *cotangents of diff outputs) -> grads of inputs wrt`.

        Torch's complex convention is the conjugate of JAX's (torch's backward returns the
        conjugate Wirtinger gradient), hence the conjugations around `jax.vjp`.
        """

        def build() -> Spec:
            n, f = len(self.in_avals), self._restricted(wrt)

            def vjp_fn(*arrays: Any) -> tuple:
                primals = arrays[:n]
                _, pull = jax.vjp(functools.partial(f, primals), *(primals[i] for i in wrt))
                grads = pull(tuple(jnp.conj(c) for c in arrays[n:]))
                return tuple(jnp.conj(g) for g in grads)

            cts = [a for a, d in zip(self.out_avals, self.diff_out, strict=True) if d]
            paths = [*self.in_paths, *(f"cotangent[{i}]" for i in range(len(cts)))]
            return Spec(f"vjp({self.name})", vjp_fn, [*self.in_avals, *cts], paths)

        return self._derive(("vjp", wrt), build)

    def keeping(self, wrt: tuple[int, ...]) -> tuple[Callable, Callable]:
        """``(forward, pullback)``, both jitted, for plain autograd (_kept_vjp.py):
        ``forward(*arrays) -> (outputs, residuals)``, the outputs with jax.vjp's pullback
        of the differentiable ones with respect to the inputs `wrt` (a pytree of arrays),
        and ``pullback(residuals, *cotangents) -> grads``, in torch's complex convention
        (the conjugations of `vjp`)."""

        def build() -> tuple[Callable, Callable]:
            f = self._restricted(wrt, with_all=True)

            def forward(*arrays: Any) -> tuple:
                g = functools.partial(f, arrays)
                _, pull, outs = jax.vjp(g, *(arrays[i] for i in wrt), has_aux=True)
                return outs, pull

            def pullback(pull: Any, *cts: Any) -> tuple:
                return tuple(jnp.conj(g) for g in pull(tuple(jnp.conj(c) for c in cts)))

            return jax.jit(forward), jax.jit(pullback)

        return self._derive(("keeping", wrt), build)

    def jvp(self, wrt: tuple[int, ...]) -> Spec:
        """Spec of `(*primals, *tangents of inputs wrt) -> tangents of diff outputs`."""

        def build() -> Spec:
            n, f = len(self.in_avals), self._restricted(wrt)

            def jvp_fn(*arrays: Any) -> tuple:
                primals = arrays[:n]
                diff_primals = tuple(primals[i] for i in wrt)
                _, t_out = jax.jvp(functools.partial(f, primals), diff_primals, arrays[n:])
                return tuple(t_out)

            tangents = [self.in_avals[i] for i in wrt]
            paths = [*self.in_paths, *(f"tangent[{i}]" for i in wrt)]
            return Spec(f"jvp({self.name})", jvp_fn, [*self.in_avals, *tangents], paths)

        return self._derive(("jvp", wrt), build)

    def batched(
        self, in_dims: tuple[int | None, ...], size: int, keep_unbatched: bool = False
    ) -> Spec:
        """Spec of the function `jax.vmap`ed over `in_dims`, every output batched at 0; with
        `keep_unbatched`, an output that depends on no batched input is left unbatched, as
        torch.func.vmap leaves it (so `out_dims=None` can take it). The derived spec's
        `out_axes` says which (0 or None per output)."""

        def build() -> Spec:
            batched = self._batched_outputs(in_dims) if keep_unbatched else None
            out_axes = tuple(0 if b else None for b in batched) if batched else 0
            fn = jax.vmap(self.fn, in_axes=in_dims, out_axes=out_axes, axis_size=size)
            avals = []
            for a, d in zip(self.in_avals, in_dims, strict=True):
                if d is not None:
                    a = jax.ShapeDtypeStruct((*a.shape[:d], size, *a.shape[d:]), a.dtype)
                avals.append(a)
            spec = Spec(f"vmap({self.name})", fn, avals, list(self.in_paths), self.n_aux)
            spec.out_axes = out_axes if batched else (0,) * len(spec.out_avals)
            return spec

        return self._derive(("vmap", in_dims, size, keep_unbatched), build)

    def _batched_outputs(self, in_dims: tuple[int | None, ...]) -> tuple[bool, ...]:
        """Which outputs depend on an input batched in `in_dims`, from the jaxpr: jax.vmap
        leaves the others unbatched. Conservative where the jaxpr is coarse: each equation's
        outputs (a scan's, a cond's) depend on all its inputs."""
        jaxpr = jax.make_jaxpr(self.fn)(*self.in_avals).jaxpr
        batched = {id(v) for v, d in zip(jaxpr.invars, in_dims, strict=True) if d is not None}
        for eqn in jaxpr.eqns:
            if any(id(v) in batched for v in eqn.invars):
                batched.update(id(v) for v in eqn.outvars)
        return tuple(id(v) in batched for v in jaxpr.outvars)


# torch.compile: tracing runs the function on fake tensors, which have no data for JAX.
# There `forward` calls one opaque custom op instead, whose fake kernel answers with the
# spec's output shapes; the int argument finds the spec again when the graph runs.
_OP_SPECS: list[Spec] = []
_op: Any = None
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not fake, functional or a subclass


def _jax_call_op() -> Any:
    """The `torchjax::jax_call` custom op, registered on first use (not at import)."""
    global _op
    if _op is None:
        # The schema spelled out: torch 2.4 cannot read it from string annotations.
        schema = "(Tensor[] tensors, int spec_id) -> Tensor[]"

        @torch.library.custom_op("torchjax::jax_call", mutates_args=(), schema=schema)
        def jax_call(tensors: list[torch.Tensor], spec_id: int) -> list[torch.Tensor]:
            return list(_OP_SPECS[spec_id].run(tuple(tensors)))

        @jax_call.register_fake
        def _(tensors: list[torch.Tensor], spec_id: int) -> list[torch.Tensor]:
            dev = tensors[0].device if tensors else None
            return [
                torch.empty(a.shape, dtype=d, device=dev) for a, d in _OP_SPECS[spec_id].out_specs
            ]

        _op = jax_call
    return _op


def run_spec(spec: Spec, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    for t in tensors:
        if type(t) not in PLAIN_TENSORS:
            break
        if LEGACY_VMAP and is_legacy_batched(t):
            return run_legacy_batched(spec, tensors)
    else:
        if not proxy_mode_active():
            return spec.run(tensors)
    # Fake or functional tensors (torch.compile is tracing), or make_fx's proxy mode
    # (torch.func.linearize): the custom op, which the trace records as a call.
    if spec.op_id is None:
        spec.op_id = len(_OP_SPECS)
        _OP_SPECS.append(spec)
    return tuple(_jax_call_op()(list(tensors), spec.op_id))


_NESTED_LEGACY = """\
{name} was called under {level} nested levels of torch's legacy vmap (the one
behind autograd.grad(is_grads_batched=True), autograd.functional.jacobian/hessian(
vectorize=True) and gradcheck's batched checks), which torchjax follows one level deep only.
Use torch.func (jacrev, jacfwd, hessian, vmap), which nests to any depth, or vectorize=False."""


def has_legacy_batched(tensors: tuple) -> bool:
    return LEGACY_VMAP and any(is_legacy_batched(t) for t in tensors)


def run_legacy_batched(
    spec: Spec, tensors: tuple, run: Callable[[Spec, tuple], tuple] | None = None
) -> tuple[torch.Tensor, ...]:
    """`spec` on tensors some of which torch's legacy vmap batched: one call of the
    jax.vmap'ed spec on the batched tensors' physical values, its outputs batched again.
    `run(spec, tensors)` makes the call (default run_spec; _JaxFunction's apply where
    autograd must record it: autograd works on the physical tensors under legacy vmap)."""
    run = run or run_spec
    level = legacy_vmap_level()
    if level != 1:
        raise ArgumentError(_NESTED_LEGACY.format(name=spec.name, level=level))
    physical, dims = [], []
    for t in tensors:
        batched = is_legacy_batched(t)
        # (The size argument is for tensors not batched at `level`; these all are.)
        physical.append(legacy_remove_batch_dim(t, level, 1, 0) if batched else t)
        dims.append(0 if batched else None)
    size = next(p.shape[0] for p, d in zip(physical, dims, strict=True) if d is not None)
    outs = run(spec.batched(tuple(dims), size), tuple(physical))
    return tuple(legacy_add_batch_dim(o, 0, level) for o in outs)


_x64 = jax_config.enable_x64


def in_x64_of(spec: Spec) -> Any:
    """A context in JAX's x64 mode of `spec`'s trace: a backward (or JVP) run after the
    forward's `with jax.enable_x64(...)` block converts and traces as the forward did."""
    return contextlib.nullcontext() if _x64.value == spec.x64 else x64_as(spec.x64)


def save_inputs(ctx: Any, tensors: tuple) -> None:
    """ctx.save_for_backward(*tensors), except that inference tensors (made in
    torch.inference_mode), which torch refuses to save, are kept on ctx as they are: they
    take no gradient, and have no version counter for saving to check."""
    for t in tensors:
        if t.is_inference():
            ctx.inference_inputs = {i: t for i, t in enumerate(tensors) if t.is_inference()}
            ctx.save_for_backward(*(None if t.is_inference() else t for t in tensors))
            return
    ctx.save_for_backward(*tensors)


def saved_inputs(ctx: Any) -> tuple:
    """The tensors save_inputs saved, in order."""
    saved = ctx.saved_tensors
    kept = getattr(ctx, "inference_inputs", None)
    return saved if kept is None else tuple(kept.get(i, t) for i, t in enumerate(saved))
