# torch_call's JVP rule: outputs and tangents from one torch call.
#
# The rule binds JvpFunction(fn, with_primals=True): one torch.func.jvp gives the outputs and
# their tangents, which is all jax.jvp needs. Where JAX needs the halves apart (linearize,
# grad, checkpoint, jacfwd), _partial_eval.py and _batching.py split that call.
# Symbolic-zero tangents and integer inputs are left out of `wrt`; integer outputs get zero
# (float0) tangents. Leaves are addressed by their index among the flat leaves of the
# positional args (`wrt`), outputs by a mask over the flat output leaves (`out_mask`).
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from torchjax._primitive._params import is_operand
from torchjax._to_jax._callables._autodiff import JvpFunction, VjpFunction
from torchjax._to_jax._options import Options
from torchjax._to_jax._torch_call._primitive import torch_call_p
from torchjax._to_jax._torch_ops._autograd import inexact

_tree = jax.tree_util


def differentiated(leaves: list, tangents: list) -> tuple:
    """The positions of the float array leaves whose tangent is not None (a symbolic zero)."""
    return tuple(
        i
        for i, (x, t) in enumerate(zip(leaves, tangents, strict=True))
        if t is not None and is_operand(x) and inexact(x.dtype)
    )


def jvp(primals: tuple, tangents: tuple, *, fn: Any, options: Options) -> tuple[Any, Any]:
    """Outputs and tangents from one call, JvpFunction(fn, with_primals=True), given the
    nonzero float tangents; fn alone where no output tangent can be nonzero."""
    if isinstance(fn, VjpFunction) and not _tree.tree_leaves(tangents[:-1]):
        return _jvp_of_pullback(primals, tangents[-1], fn, options)
    leaves, tree = _tree.tree_flatten(primals)
    t_leaves = tree.flatten_up_to(tangents)
    wrt = differentiated(leaves, t_leaves)
    out_types = torch_call_p.abstract_eval(*primals, fn=fn, options=options)
    out_leaves, out_tree = _tree.tree_flatten(out_types)
    out_mask = tuple(inexact(o.dtype) for o in out_leaves)
    if not wrt or not any(out_mask):
        return torch_call_p.bind(*primals, fn=fn, options=options), None
    jvp_fn = JvpFunction(fn, wrt, out_mask, options.grad_method, with_primals=True)
    flat = torch_call_p.bind(primals, tuple(t_leaves[i] for i in wrt), fn=jvp_fn, options=options)
    out, t_out = flat[: len(out_mask)], iter(flat[len(out_mask) :])
    return _tree.tree_unflatten(out_tree, out), _tree.tree_unflatten(
        out_tree, [next(t_out) if m else None for m in out_mask]
    )


torch_call_p.def_jvp(jvp)


def _jvp_of_pullback(primals: tuple, ct_dots: tuple, fn: VjpFunction, options: Options) -> tuple:
    """A VJP differentiated with respect to its cotangents alone, in which it is linear:
    its tangent is the same VJP of the cotangents' tangents. Both come from one call that
    runs the forward once and pulls back both (VjpFunction with_tangents); batched over the
    tangents alone (jax.jacfwd), it splits again (_torch_call/_partial_eval.py)."""
    *points, cts = primals
    if all(t is None for t in ct_dots):
        return torch_call_p.bind(*primals, fn=fn, options=options), None
    dots = [jax.numpy.zeros_like(c) if t is None else t for c, t in zip(cts, ct_dots, strict=True)]
    both = dataclasses.replace(fn, with_tangents=True)
    out = torch_call_p.bind(*points, cts, tuple(dots), fn=both, options=options)
    return tuple(out[: len(out) // 2]), tuple(out[len(out) // 2 :])
