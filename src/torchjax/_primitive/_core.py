# PytreePrimitive: a JAX primitive whose rules see the caller's pytrees, not flat lists.
#
# JAX primitives take flat lists of arrays, and JAX finds tracers only among those flat
# arguments: a dict of tracers is not a tracer. So a rule written for `f({'a': x, 'b': y})`
# cannot be registered directly. Here `bind` flattens every positional argument, sends the
# array leaves to the underlying `jax.core.Primitive` as operands, and carries the tree
# structure and every non-array leaf as static params. Each registered rule is wrapped in
# a flat adapter (_adapters.py) that rebuilds the pytrees before calling the rule and
# flattens what it returns. The output structure and avals are found once per signature by
# the abstract eval rule and travel as params too, so the adapters can unflatten outputs
# and check them.
#
# This module imports jax only: it knows nothing of torch.
from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from torchjax._compat._jax import (
    HOST_ARRAY_TYPES,
    ad,
    at_top_level,
    batching,
    core,
    mlir,
    partitioned,
    varying_manual_axes,
)
from torchjax._compat._jax import jax_config as config
from torchjax._errors import OutputMismatchError, RuleError
from torchjax._primitive import _adapters
from torchjax._primitive._params import (
    ARRAY,
    OPERAND_TYPES,
    BoundParams,
    Linear,
    Signature,
    StaticLeaves,
    arg_path,
    check_hashable,
    eager_type,
    is_operand,
    out_aval,
    path_str,
    rebuild,
    store,
)

_tree = jax.tree_util
canonicalize_dtype = jax.dtypes.canonicalize_dtype

# Output types depend on JAX's x64 mode (a float64 result is float32 while it is off), so
# it is part of every signature cache key; read on every call, as the state object.
_x64 = config.enable_x64


# How the lowering in progress is partitioned across devices (a context variable: lowerings
# nest, and run on any thread). A lowering rule traces JAX code and never sees the lowering
# context; what it stages may depend on this (lowering_partitioning).
_PARTITIONED: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "torchjax_lowering_partitioned", default=None
)


def lowering_partitioning() -> str | None:
    """Inside a lowering rule: "auto" under jit of sharded inputs (XLA's partitioner),
    "manual" in shard_map, None on one device (see _compat/_jax.py's `partitioned`)."""
    return _PARTITIONED.get()


def _knowing_the_partitioning(lowering: Callable) -> Callable:
    lower = mlir.lower_fun(lowering, multiple_results=True)

    def rule(ctx: Any, *args: Any, **params: Any) -> Any:
        token = _PARTITIONED.set(partitioned(ctx.module_context.axis_context))
        try:
            return lower(ctx, *args, **params)
        finally:
            _PARTITIONED.reset(token)

    return rule


class PytreePrimitive:
    """A JAX primitive whose rules receive and return arbitrary pytrees.

    Args:
      name: the primitive's name, shown in jaxprs and in error messages.

    ``bind(*args, **params)`` takes pytrees. Array leaves (``jax.Array``, numpy arrays,
    tracers) are the primitive's operands; every other leaf (numbers, strings, None,
    callables, ...) is static and must be hashable. ``params`` are static keyword params.
    Every rule receives the positional args exactly as they were passed to ``bind``.

    Rules (register each with the decorator of the same name):

      * ``def_abstract_eval(rule)``: ``rule(*args, **params)`` returns a pytree of
        ``jax.ShapeDtypeStruct``; array leaves arrive as ``jax.core.ShapedArray``
        (they have ``.shape`` and ``.dtype``). Called once per distinct signature
        (structure, static leaves by type and value, shapes, dtypes, params, x64 mode) and
        cached with the params: keep it pure.
      * ``def_impl(rule)``: ``rule(*args, **params)`` computes the output pytree eagerly.
      * ``def_lowering(rule)``: a JAX-traceable ``rule(*args, **params)`` used under
        ``jax.jit``. Without one, the impl is traced as JAX code.
      * ``def_batching(rule)``: ``rule(args, batch_axes, **params) -> (out, out_axes)``.
        ``batch_axes`` mirrors ``args`` with an int per batched array leaf and None for
        unbatched and static leaves; ``out_axes`` is an int, None, or a pytree like out.
      * ``def_jvp(rule)``: ``rule(primals, tangents, **params) -> (out, out_tangents)``.
        A symbolic-zero tangent arrives as None (static leaves too); the rule may return
        None for a zero output tangent, per leaf or for the whole output.
      * ``def_transpose(rule)``: ``rule(cotangents, *args, **params)`` returns a tuple like
        args with a cotangent for each ``PytreePrimitive.Linear`` leaf (None for a zero
        one, per leaf or per whole argument). Zero cotangents arrive as None.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from torchjax import PytreePrimitive
      >>> weighted_sum_p = PytreePrimitive("weighted_sum")
      >>> @weighted_sum_p.def_abstract_eval
      ... def _(d, *, scale):
      ...     return jax.ShapeDtypeStruct(d["x"].shape, d["x"].dtype)
      >>> @weighted_sum_p.def_impl
      ... def _(d, *, scale):
      ...     return scale * d["x"] + d["y"]
      >>> @weighted_sum_p.def_batching
      ... def _(args, axes, *, scale):
      ...     (d,), (ax,) = args, axes
      ...     x = jnp.moveaxis(d["x"], ax["x"], 0) if ax["x"] is not None else d["x"]
      ...     y = jnp.moveaxis(d["y"], ax["y"], 0) if ax["y"] is not None else d["y"]
      ...     x, y = jnp.broadcast_arrays(x, y)  # [B, N] each
      ...     return weighted_sum_p.bind({"x": x, "y": y}, scale=scale), 0
      >>> xs = jnp.ones((3, 2))
      >>> f = lambda d: weighted_sum_p.bind(d, scale=2.0)
      >>> jax.vmap(f, in_axes=({"x": 0, "y": None},))({"x": xs, "y": jnp.ones(2)}).shape
      (3, 2)
    """

    Linear = Linear

    def __init__(self, name: str):
        self.name = name
        self._abstract_eval_rule: Callable | None = None
        self._impl_rule: Callable | None = None
        self._lowering_rule: Callable | None = None
        self._impl_signature = self._lowering_signature = False
        self._batching_rule: Callable | None = None
        self._jvp_rule: Callable | None = None
        self._transpose_rule: Callable | None = None
        self._params: dict[tuple, BoundParams] = {}

        prim = core.Primitive(name)
        prim.multiple_results = True
        prim.def_abstract_eval(functools.partial(_adapters.flat_abstract_eval, self))
        prim.def_impl(functools.partial(_adapters.flat_impl, self))
        lowering = functools.partial(_adapters.flat_lowering, self)
        mlir.register_lowering(prim, _knowing_the_partitioning(lowering))
        batching.primitive_batchers[prim] = functools.partial(_adapters.flat_batching, self)
        ad.primitive_jvps[prim] = functools.partial(_adapters.flat_jvp, self)
        ad.primitive_transposes[prim] = functools.partial(_adapters.flat_transpose, self)
        self.primitive = prim

    def __repr__(self) -> str:
        return f"PytreePrimitive({self.name!r})"

    # -- rule registration -------------------------------------------------------------
    def def_abstract_eval(self, rule: Callable) -> Callable:
        self._abstract_eval_rule = rule
        self._params.clear()  # and with it the signatures found by the old rule
        return rule

    def def_impl(self, rule: Callable | None = None, *, signature: bool = False) -> Any:
        """Register the eager impl. With ``signature=True`` (usable as
        ``@p.def_impl(signature=True)``) the rule also receives ``signature=``, a
        `Signature` whose ``out_types`` are what abstract_eval declared and whose ``memo``
        dict keeps per-signature work (e.g. a call plan) between calls."""
        if rule is None:
            return functools.partial(self.def_impl, signature=signature)
        self._impl_rule, self._impl_signature = rule, signature
        return rule

    def def_lowering(self, rule: Callable | None = None, *, signature: bool = False) -> Any:
        """Register the jit lowering, a JAX-traceable rule; ``signature`` as in def_impl."""
        if rule is None:
            return functools.partial(self.def_lowering, signature=signature)
        self._lowering_rule, self._lowering_signature = rule, signature
        return rule

    def def_batching(self, rule: Callable) -> Callable:
        self._batching_rule = rule
        return rule

    def def_jvp(self, rule: Callable) -> Callable:
        self._jvp_rule = rule
        return rule

    def def_transpose(self, rule: Callable) -> Callable:
        self._transpose_rule = rule
        return rule

    def _missing(self, rule: str, needed_by: str) -> RuleError:
        return RuleError(
            f"PytreePrimitive '{self.name}' has no {rule} rule, which {needed_by} needs. "
            f"Register one with @{self.name}_p.def_{rule}."
        )

    # -- bind --------------------------------------------------------------------------
    def bind(self, *args: Any, **params: Any) -> Any:
        """Apply the primitive to pytree arguments; returns the output pytree."""
        return self._bind(args, self._bound_params(params))

    def _bound_params(self, params: dict) -> BoundParams:
        """bind's keyword params, sorted and checked once; callers that bind the same
        params on every call (to_jax's wrapper) keep the result and call _bind."""
        items = tuple(sorted(params.items()))
        home = self._params_home(params)
        try:
            bound = home.get(items)
        except TypeError:
            for name, value in items:
                check_hashable(value, f"{self.name}.bind keyword param {name!r}")
            raise
        if bound is None:
            bound = BoundParams(items)
            store(home, items, bound)
        return bound

    def context_key(self) -> Any:
        """Global state besides x64 that output types depend on, part of every traced
        signature's cache key (hashable; None here: a subclass names its own)."""
        return None

    def _signature(self, bound: BoundParams, in_tree, statics, avals) -> Signature:
        """The output signature of a call, found by abstract_eval once and kept in `bound`."""
        key = (in_tree, statics, avals, _x64.value, self.context_key())
        found = bound.signatures.get(key)
        if found is None:
            found = self._out_signature(in_tree, statics, avals, bound.items)
            store(bound.signatures, key, found)
        return found

    def _traced_signature(self, in_tree, statics, avals, user_params) -> Signature:
        """The signature param of a traced call with keyword params `user_params`."""
        bound = self._bound_params(dict(user_params))
        return self._signature(bound, in_tree, statics, avals).traced

    def _bind(self, args: tuple, bound: BoundParams) -> Any:
        leaves, in_tree = _tree.tree_flatten(args)
        operands = []
        statics = []
        for leaf in leaves:
            if isinstance(leaf, OPERAND_TYPES):
                if type(leaf) in HOST_ARRAY_TYPES and leaf.dtype != canonicalize_dtype(leaf.dtype):
                    # A numpy array of a dtype JAX narrows (float64 with x64 off) becomes
                    # the array JAX makes of it, eagerly as under jit, which converts it so.
                    leaf = jnp.asarray(leaf)
                operands.append(leaf)
                statics.append(ARRAY)
            else:
                statics.append(leaf)
        # Type-strict (1, 1.0 and True differ) where there are static leaves at all.
        statics_t = StaticLeaves(statics) if len(operands) != len(leaves) else tuple(statics)
        try:
            hash(statics_t)
        except TypeError:
            self._raise_unhashable(args)
        traced = any(isinstance(x, core.Tracer) for x in operands)
        if not traced and self._has_impl() and at_top_level():
            return self._bind_eager(operands, in_tree, statics_t, bound)
        if traced:
            # Inside shard_map, operands that vary over different manual mesh axes are cast
            # to vary over all of them (as JAX's own primitives do), so outputs vary over
            # their union and transposition yields cotangents of the right type.
            operands = list(core.auto_insert_reshard(*operands))
        avals = tuple(core.typeof(x) for x in operands)
        signature = self._traced_bind_signature(bound, in_tree, statics_t, avals, operands)
        out_flat = self.primitive.bind(
            *operands,
            in_tree=in_tree,
            statics=statics_t,
            signature=signature,
            params=bound.items,
        )
        return _tree.tree_unflatten(signature.out_tree, out_flat)

    def abstract_eval(self, *args: Any, **params: Any) -> Any:
        """The output types of ``bind(*args, **params)``: a pytree of ShapeDtypeStruct.

        Uses the same per-signature cache as bind; array leaves may be arrays, tracers,
        ``ShapedArray`` or ``ShapeDtypeStruct``.
        """
        leaves, in_tree = _tree.tree_flatten(args)
        avals, statics = [], []
        for leaf in leaves:
            if is_operand(leaf) or isinstance(leaf, core.ShapedArray):
                avals.append(core.typeof(leaf) if is_operand(leaf) else leaf)
                statics.append(ARRAY)
            elif isinstance(leaf, jax.ShapeDtypeStruct):
                # A type (a derived function's, say): the same signature as an array of it.
                avals.append(core.ShapedArray(leaf.shape, leaf.dtype))
                statics.append(ARRAY)
            else:
                statics.append(leaf)
        has_statics = len(avals) != len(statics)
        statics_t = StaticLeaves(statics) if has_statics else tuple(statics)
        found = self._signature(self._bound_params(params), in_tree, statics_t, tuple(avals))
        return found.out_types

    def _raise_unhashable(self, args: tuple) -> None:
        for path, leaf in _tree.tree_flatten_with_path(args)[0]:
            if not is_operand(leaf):
                check_hashable(leaf, f"{self.name}: static leaf {arg_path(path)}")

    def _out_signature(self, in_tree, statics, avals, user_params):
        if self._abstract_eval_rule is None:
            raise self._missing("abstract_eval", "every bind")
        args = rebuild(in_tree, statics, avals)
        out = self._abstract_eval_rule(*args, **dict(user_params))
        leaves, out_tree = _tree.tree_flatten(out)
        # bind made the operands' varying manual axes agree: any one of them speaks for all.
        manual = next((a for a in avals if varying_manual_axes(a)), None)
        for path, leaf in _tree.tree_flatten_with_path(out)[0]:
            if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                raise OutputMismatchError(
                    f"{self.name}: abstract_eval returned {type(leaf).__name__} at "
                    f"{path_str('out', path)}; every leaf must be a jax.ShapeDtypeStruct."
                )
        return Signature(out_tree, tuple(out_aval(leaf, manual) for leaf in leaves))

    # -- subclassing ---------------------------------------------------------------------
    # A subclass (torch_call_p's TorchCallPrimitive) may override the methods below, and
    # use _bind(args, bound) with _bound_params(params) kept from an earlier call (bind
    # without sorting and checking the params again), _signature and _traced_signature.
    def _traced_bind_signature(self, bound, in_tree, statics, avals, operands) -> Signature:
        """The signature param of a traced bind of these operands (tracers among them): a
        subclass may use what the trace knows of their values."""
        del operands
        return self._signature(bound, in_tree, statics, avals).traced

    def _params_home(self, params: dict) -> dict:
        """The dict that keeps the `BoundParams` (and with them the signature caches) of
        bind's keyword `params`: the primitive's own, unless a subclass keeps them with one
        of the params (so that they die with it)."""
        return self._params

    def _has_impl(self) -> bool:
        """Whether eager calls have an impl to run (else they dispatch through JAX)."""
        return self._impl_rule is not None

    def _bind_eager(self, operands: list, in_tree, statics: tuple, bound: BoundParams) -> Any:
        """An eager call (no trace active, no tracer among the operands): what core.bind
        would do here, minus its trace dispatch, with the signature found from plain shapes
        and dtypes (cheaper than avals to hash). Returns the output pytree."""
        key = (in_tree, statics, _x64.value, *[eager_type(x) for x in operands])
        signature = bound.eager_signatures.get(key)
        if signature is None:
            avals = tuple(core.typeof(x) for x in operands)
            signature = self._signature(bound, in_tree, statics, avals)
            store(bound.eager_signatures, key, signature)
        out_flat = self._flat_impl(
            operands, in_tree=in_tree, statics=statics, signature=signature, params=bound.items
        )
        return _tree.tree_unflatten(signature.out_tree, out_flat)

    def _flat_impl(self, operands, *, in_tree, statics, signature, params) -> list:
        """The eager impl on flat operands: the output leaves, checked against `signature`.
        By default the pytrees are rebuilt for the impl rule (or, without one, the call is
        compiled from the lowering); a subclass may compute on the flat operands."""
        return _adapters.impl_on_pytrees(self, operands, in_tree, statics, signature, params)
