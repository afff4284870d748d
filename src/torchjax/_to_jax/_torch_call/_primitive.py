# torch_call_p: the one primitive behind every wrapped torch function, and its rules.
#
# `torch_call_p.bind(*args, fn=fn, options=options)` means "fn(*args), computed by torch":
# `fn` is the user's function or one derived from it by a transformation (_callables/).
# Because every derived function is again a torch callable bound to this primitive, the
# rules compose: vmap of grad, hessian, jit of vmap of vmap.
#
# This file defines the primitive and imports no rule: each rule registers itself on the
# line after its definition, in a module of its own (the package's __init__ imports them):
#   abstract eval      _torch_call/_abstract_eval.py   output types: declared, fake-run, derived
#   impl (eager)       _torch_call/_impl.py            DLPack both ways; a real run gives the types
#   lowering (jit)     _torch_call/_lowering.py        buffer_callback on XLA's buffers
#   batching (vmap)    _torch_call/_batching.py        torch.func.vmap, and the policies
#   jvp                _torch_call/_jvp.py             one torch.func.jvp
#   transpose          _torch_call/_transpose.py       torch.func.vjp / torch.autograd.grad
#   partial eval       _torch_call/_partial_eval.py    the JVP split: linearize, grad, checkpoint
#   dead code (jit)    _torch_call/_dce.py             forwards of which only residuals are read
# TorchCallPrimitive adds to PytreePrimitive what only torch calls need: params that live on
# the user's function (they die with it), eager calls of the user's function that run for
# real without a fake run, and the partial-evaluation and linearization rules that JAX
# keeps in tables of its own.
from __future__ import annotations

import os
from typing import Any

import jax
import torch

from torchjax._compat._jax import (
    example_value,
    hide_frames_under,
    jax_config,
    register_dce,
    register_linearization,
)
from torchjax._compat._jax import partial_eval as pe
from torchjax._compat._messages import read_a_value
from torchjax._errors import ShapeInferenceError
from torchjax._primitive._core import PytreePrimitive
from torchjax._primitive._params import ARRAY

SYMBOLIC_DIMENSIONS = """\
{name} was called with {where}: a symbolic dimension (jax.export.symbolic_shape), as
jax.export and jax.eval_shape take them. torch runs on tensors of known sizes, and the
host callback that runs it needs them too, so torchjax cannot stage a torch call whose
shapes are symbolic, with or without result_shape_dtypes. Use concrete shapes:
jax.eval_shape(f, jax.ShapeDtypeStruct((8, 3), jnp.float32)). (jax.export cannot
serialize a torch call at any shape: it runs as a host callback, in this process.)
To export with symbolic dimensions, wrap the function with lowering="xla": it becomes JAX
ops, which jax.export serializes at symbolic shapes (docs/lowering.md)."""


def _refuse_symbolic_dimensions(fn: Any, in_tree: Any, statics: tuple, avals: tuple) -> None:
    """Raise ShapeInferenceError naming the arguments whose shapes hold a symbolic size."""
    it = iter(avals)
    leaves = [next(it) if s is ARRAY else s for s in statics]
    args = jax.tree_util.tree_unflatten(in_tree, leaves)
    where = [
        f"{fn.root.arg_path(path)} of shape ({', '.join(map(str, leaf.shape))})"
        for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]
        if any(type(d) is not int for d in getattr(leaf, "shape", ()))
    ]
    raise ShapeInferenceError(SYMBOLIC_DIMENSIONS.format(name=fn.root.name, where=", ".join(where)))


class TorchCallPrimitive(PytreePrimitive):
    """PytreePrimitive for torch calls (one instance: torch_call_p)."""

    def _params_home(self, params: dict) -> dict:
        # A call's params (and their signature caches) live on the user's function: a
        # dropped wrapper leaves nothing in a global cache.
        return params["fn"].root.bound_params

    def __init__(self, name: str):
        super().__init__(name)
        self._eager_rule: Any = None
        self._flat_impl_rule: Any = None
        self._real_types_rule: Any = None

    def def_eager(self, rule: Any) -> Any:
        """``rule(primitive, operands, in_tree, statics, bound, x64) -> outputs``: a call
        with no trace active and no tracer among the operands, its own fast path."""
        self._eager_rule = rule
        return rule

    def def_flat_impl(self, rule: Any) -> Any:
        """``rule(operands, *, in_tree, statics, signature, params) -> flat outputs``: the
        impl JAX dispatches to, on flat operands (no pytrees rebuilt)."""
        self._flat_impl_rule = rule
        return rule

    def def_types_from_values(self, rule: Any) -> Any:
        """``rule(values, in_tree, statics, bound, avals) -> bool``: where a trace knows its
        operands' values (eager transforms), find the types by a real run and keep them for
        the signature; False where it cannot."""
        self._real_types_rule = rule
        return rule

    def _has_impl(self) -> bool:
        return True

    def _bind_eager(self, operands: list, in_tree: Any, statics: tuple, bound: Any) -> Any:
        return self._eager_rule(self, operands, in_tree, statics, bound, jax_config.enable_x64)

    def _traced_bind_signature(self, bound, in_tree, statics, avals, operands) -> Any:
        if any(type(d) is not int for a in avals for d in getattr(a, "shape", ())):
            _refuse_symbolic_dimensions(dict(bound.items)["fn"], in_tree, statics, avals)
        try:
            return self._signature(bound, in_tree, statics, avals).traced
        except ShapeInferenceError as e:
            # An eager transform (jax.grad, jax.jvp) of the user's function that reads a
            # value: the trace knows the values, so a real run gives the types, as an eager
            # call's do (where the output shapes depend on the values, the error stands:
            # the types are kept for the signature).
            values = [example_value(x) for x in operands]
            if not read_a_value(e.__cause__) or any(v is None for v in values):
                raise
            if not self._real_types_rule(values, in_tree, statics, bound, avals):
                raise
            return self._signature(bound, in_tree, statics, avals).traced

    def _flat_impl(self, operands, *, in_tree, statics, signature, params) -> list:
        return self._flat_impl_rule(
            operands, in_tree=in_tree, statics=statics, signature=signature, params=params
        )

    def def_partial_eval(self, rule: Any) -> Any:
        """``rule(trace, *tracers, **params)``: JAX's JaxprTrace rule for the primitive."""
        pe.custom_partial_eval_rules[self.primitive] = rule
        return rule

    def def_partial_eval_custom(self, rule: Any) -> Any:
        """``rule(saveable, unks_in, inst_in, eqn)``: jax.checkpoint's rule for it."""
        pe.partial_eval_jaxpr_custom_rules[self.primitive] = rule
        return rule

    def __reduce__(self) -> Any:
        # By reference: JAX's rule tables know this instance's primitive, and only it. A
        # function pickled by value (cloudpickle: Ray, dask, spawned pools) finds it again.
        return (_the_primitive, ())

    def context_key(self) -> Any:
        # torch.ones(3) is of torch's default dtype: after torch.set_default_dtype a new
        # trace finds its types again (eager calls take their types from the call itself).
        return torch.get_default_dtype()

    def def_dce(self, rule: Any) -> Any:
        """``rule(used_outputs, eqn) -> (used_inputs, eqn or None)``: JAX's dead-code
        elimination of the primitive's equations (where JAX's table is there)."""
        register_dce(self.primitive, rule)
        return rule

    def def_linearization(self, rule: Any) -> Any:
        """``rule(is_vjp, nonzeros, *primals, **params)``: direct linearization, where JAX
        has it (see _compat._jax.register_linearization)."""
        register_linearization(self.primitive, rule)
        return rule


torch_call_p = TorchCallPrimitive("torch_call")


def _the_primitive() -> TorchCallPrimitive:
    return torch_call_p


# An error in a wrapped call shows the user's frames (their call, their torch code), not
# torchjax's, wherever JAX filters tracebacks: torchjax is one more layer of JAX to them.
hide_frames_under(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
