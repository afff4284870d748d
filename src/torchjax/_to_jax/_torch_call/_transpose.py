# torch_call's transpose rule: cotangents of a call's linear inputs, by a VjpFunction.
#
# A JvpFunction (linear in its tangents) transposes to the VjpFunction of its inner
# function. Any other call linear in some leaves (the user's own linear function under
# jax.linear_transpose, a VjpFunction transposed again) is transposed generically: the VJP
# of fn with respect to those leaves, at zero (any point will do for a linear function).
# torch's complex cotangents are the conjugates of JAX's; VjpFunction converts both ways.
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from torchjax._errors import AutodiffError
from torchjax._primitive._params import Linear
from torchjax._to_jax._callables._autodiff import JvpFunction, VjpFunction
from torchjax._to_jax._callables._base import ZerosLike
from torchjax._to_jax._options import Options
from torchjax._to_jax._torch_call._primitive import torch_call_p

_tree = jax.tree_util


def transpose(cts: Any, *args: Any, fn: Any, options: Options) -> tuple:
    """Cotangents of the linear inputs, through VjpFunction.

    A JvpFunction (linear in its tangents) transposes to VjpFunction of its inner function
    directly. Any other call linear in some leaves (the user's own linear function, a
    VjpFunction) is transposed generically: the vjp of fn with respect to those leaves,
    taken at zero (any point will do for a linear function).
    """
    if isinstance(fn, JvpFunction) and fn.with_primals:
        # Partial evaluation splits this form before transposition (see _partial_eval.py);
        # should it reach here whole, its outputs must carry no cotangent.
        n_out = len(fn.out_mask)
        if any(c is not None for c in cts[:n_out]):
            raise AutodiffError(
                f"Cannot transpose the JVP of {fn.root.name} with respect to its outputs: "
                f"they are not linear in the tangents. Please report this with the program."
            )
        cts, fn = cts[n_out:], fn.linear
    if isinstance(fn, JvpFunction):
        primals, *residuals, tangents = args  # residuals: after a KeptForward: (handle, rng)
        if all(isinstance(t, Linear) for t in tangents) and not _has_linear((primals, residuals)):
            nothing = (None,) * len(args)
            keep = [i for i, c in enumerate(cts) if c is not None]
            if not keep:
                return nothing
            float_outputs = [j for j, m in enumerate(fn.out_mask) if m]
            chosen = {float_outputs[i] for i in keep}
            out_mask = tuple(j in chosen for j in range(len(fn.out_mask)))
            vjp_fn = VjpFunction(
                fn.inner, fn.wrt, out_mask, fn.grad_method, with_residuals=fn.with_residuals
            )
            grads = torch_call_p.bind(
                primals, *residuals, tuple(cts[i] for i in keep), fn=vjp_fn, options=options
            )
            return (*nothing[:-1], tuple(grads))
    return _transpose_generic(cts, args, fn, options)


torch_call_p.def_transpose(transpose)


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
