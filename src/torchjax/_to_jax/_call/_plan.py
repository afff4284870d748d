# The call plan: what one call signature fixes, and how one real call of fn goes.
#
# A plan is built once per signature (function, argument structure, static leaves, output
# types): once per jit lowering, and kept in the signature's memo for eager calls. A call
# then only fills in tensors, runs fn behind the in-place guard (_call/_guard.py), and checks
# the outputs against the declared or inferred types (_call/_output_checks.py). The eager
# impl and the jit callback share it, so both see the same checks and the same errors; a
# failed call's notes are _call/_failures.py's.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import torch

from torchjax import _x64
from torchjax._compat._messages import is_write_refusal, runs_autograd_itself
from torchjax._compat._torch import set_grad_enabled, tensor_version
from torchjax._convert import torch_dtype
from torchjax._errors import CopyWarning, TorchJaxError, warn
from torchjax._log import logger
from torchjax._primitive._params import ARRAY, is_operand, leaf_paths
from torchjax._to_jax import _hot as hot_paths
from torchjax._to_jax._call._failures import ON_COPIES, explain, innermost_line
from torchjax._to_jax._call._guard import check_versions, inplace_error, refuse_writes, same_bytes
from torchjax._to_jax._call._output_checks import OutputChecks
from torchjax._to_jax._call._outputs import as_jax_tree
from torchjax._to_jax._context import WARNED_COPIES
from torchjax._to_jax._context import autograd_inside as _autograd

_tree = jax.tree_util
_version = tensor_version
_is_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor

_WROTE = (
    "a write into its memory, directly or through a view, .data, a storage or an out= "
    "argument; torch refused it, and the caller's array is unchanged"
)
_ON_COPY = "an in-place op, seen on the copy this function runs on"


def autograd_inside() -> bool:
    """Whether derived calls must use torch.autograd (see CallPlan.invoke)."""
    return _autograd.depth > 0


class CallPlan(OutputChecks):
    """What one call signature fixes: where the tensors go, what must come out.

    Args:
      fn: the torch callable (UserFunction or a DerivedFunction).
      in_tree, template: the argument structure and its leaves, `ARRAY` where a tensor goes.
      structs, out_tree: the declared or inferred outputs (out_tree None: not yet known).
      flat_fn: the user's own function, to call directly when the call is ``fn(x, y)``
        (or through its ``flat_form``, where it has one).
    """

    def __init__(
        self, fn, in_tree, template, structs, out_tree, flat_fn: Callable | None, widen=False
    ):
        self.fn, self.name = fn, fn.root.name
        # Derived functions run with grad mode on, as torch.func would run them: torch picks
        # other kernels without it (a no-grad backward whose forward-mode derivative is
        # wrong for det, solve, ..., or missing for silu, mish, group_norm).
        self.grad_mode = fn.grad_mode
        self.in_tree, self.out_tree = in_tree, out_tree
        self.template = list(template)
        self.positions = [i for i, x in enumerate(template) if x is ARRAY]
        self.structs = structs
        self.out_dtypes = [torch_dtype(s.dtype) for s in structs]
        self.out_shapes = [tuple(s.shape) for s in structs]
        paths = leaf_paths(out_tree) if out_tree is not None else ()
        self.out_paths = ["out" + _tree.keystr(p) for p in paths]
        # Fast paths for the common call, fn(x, y) -> tensor: no template to fill, no
        # argument tree to rebuild, no output tree to flatten.
        self.has_statics = len(self.positions) != len(template)
        positional = _tree.tree_structure((tuple(range(in_tree.num_leaves)), {}))
        self.direct = flat_fn if in_tree == positional and not self.has_statics else None
        # A function may offer its own flat form for other structures (module_to_jax's
        # forward: the variables straight into the module, no tree rebuilt per call).
        flat_form = fn.root.hooks.flat_form if flat_fn is not None else None
        if self.direct is None and flat_form is not None:
            self.direct = flat_form(in_tree, self.template)
        if self.direct is None and flat_fn is not None and not self.has_statics:
            self.direct = _unflattening(flat_fn, in_tree)  # nested arrays: a dict of params
        if widen and self.direct is not None:
            self.direct = _widening(self.direct, fn.facts)  # (others widen in UserFunction)
        self.one_tensor_out = (
            out_tree is not None and out_tree.num_nodes == 1 and out_tree.num_leaves == 1
        )
        # A hot plan's calls take the inlined steps of _hot.py: the user's function called
        # directly, in the caller's grad mode (derived functions need theirs on), one output
        # of known type. (Unset once it runs on copies.)
        self.hot = (
            hot_paths.ENABLED
            and self.direct is not None
            and self.one_tensor_out
            and not self.grad_mode
        )
        if self.hot:
            self.hot_dtype, self.hot_shape = self.out_dtypes[0], self.out_shapes[0]
        # Set once fn asked a protected input for a writable pointer without writing (a
        # reader such as .numpy() or a compiled kernel): then it runs on copies.
        self.on_copies = False
        self.refused_at = ""  # where it asked (for the warning)
        # Set once a derived call failed because the function runs torch.autograd itself,
        # which torch.func cannot transform: then it is differentiated by torch.autograd.
        self.autograd_inside = False
        # A vmapped call over an empty batch (every output empty) computes nothing: its
        # outputs are made, not computed (torch.func.vmap fails on many ops with no
        # example to run; under jit XLA gives empty outputs as well).
        # (Residuals come last: no graph, no RNG state then.)
        main = structs[: len(structs) - fn.n_residuals]
        self.empty_batch = fn.maps_a_batch and bool(main) and all(0 in s.shape for s in main)

    def invoke(self, tensors: list[torch.Tensor]) -> Any:
        """fn on `tensors`, as it returns; raises as __call__ does, before any output check.

        `tensors` are fresh (version 0), made for this call. Their storages refuse writes
        during it (see _call/_guard.py): a refusal runs fn again on copies, and a copy that
        changed is an InPlaceMutationError; a version counter that moved all the same is an
        in-place view op (t_), rejected too. A derived call that torch.func refuses because
        the function runs torch.autograd itself runs again, and from then on, with
        torch.autograd's derivatives and a loop over the batch (autograd_inside).
        """
        if self.empty_batch:  # (zeros: empty outputs, and residuals that say "none")
            device = tensors[0].device if tensors else None
            made = [torch.zeros(s, dtype=d, device=device) for s, d in self._out_types()]
            return _tree.tree_unflatten(self.out_tree, made)
        if self.autograd_inside:
            _autograd.depth += 1
            try:
                return self._invoke(tensors)
            finally:
                _autograd.depth -= 1
        try:
            return self._invoke(tensors)
        except _RetryWithAutograd:
            self.autograd_inside = True
            return self.invoke(tensors)

    def _invoke(self, tensors: list[torch.Tensor]) -> Any:
        if self.on_copies:
            return self.invoke_on_copies(tensors, compare=False)
        for t in tensors:
            refuse_writes(t)
        refused = False
        try:
            out = self._run(tensors)
        except Exception as e:
            refused = self.refused(e, tensors)
        if refused:
            return self.invoke_on_copies(tensors, compare=True)
        if any(map(_version, tensors)):
            self.raise_mutated(tensors)
        return out

    def _out_types(self) -> list[tuple]:
        return list(zip(self.out_shapes, self.out_dtypes, strict=True))

    def refused(self, error: Exception, tensors: list[torch.Tensor]) -> bool:
        """True where fn's `error` is the guard refusing a write (fn then runs on copies,
        outside the caller's except: no chained traceback); raises anything else."""
        if isinstance(error, TorchJaxError):
            raise error
        if not is_write_refusal(error):
            self._raise_failure(error, tensors)
        self.refused_at = innermost_line(error)
        return True

    def _run(self, tensors: list[torch.Tensor]) -> Any:
        """fn on `tensors`, in the plan's grad mode."""
        grad_was_enabled = _is_grad_enabled()
        if self.grad_mode:
            set_grad_enabled(True)
        try:
            if self.direct is not None:
                return as_jax_tree(self.direct(*tensors))
            return self.fn(*_tree.tree_unflatten(self.in_tree, self._fill(tensors)))
        finally:
            if self.grad_mode:
                set_grad_enabled(grad_was_enabled)

    def _raise_failure(self, error: Exception, tensors: list | None = None) -> None:
        if not autograd_inside() and self._autograd_inside(error):
            raise _RetryWithAutograd from None
        err = self.fn.call_failure(error, self.in_tree)
        if err is error:
            explain(self, error, tensors or [])
            raise error
        raise err from error

    def _autograd_inside(self, error: Exception) -> bool:
        """Whether a derived call failed because fn runs torch.autograd itself."""
        return self.fn is not self.fn.root and runs_autograd_itself(error)

    def invoke_on_copies(self, tensors: list[torch.Tensor], compare: bool) -> Any:
        """fn on copies of `tensors`; with `compare`, each copy must still equal its input."""
        copies = [t.clone() for t in tensors]
        try:
            out = self._run(copies)
        except TorchJaxError:
            raise
        except Exception as e:
            self._raise_failure(e, copies)
        for k, (t, c) in enumerate(zip(tensors, copies, strict=True)):
            if compare and (tensor_version(c) or not same_bytes(t, c)):
                raise self._inplace_error(k, _WROTE)
            if tensor_version(c):
                raise self._inplace_error(k, _ON_COPY)
        if not self.on_copies:
            why = "it writes into them" if compare else "it keeps or reads their storage"
            logger.debug("%s runs on copies of its inputs from now on: %s", self.name, why)
        if compare and not self.on_copies and self.fn.root not in WARNED_COPIES:
            WARNED_COPIES.add(self.fn.root)
            at = f", at {self.refused_at}" if self.refused_at else ""
            warn(ON_COPIES.format(name=self.name, at=at), CopyWarning)
        self.on_copies = True
        self.hot = False
        return out

    def _inplace_error(self, k: int, how: str) -> Exception:
        path = self.input_path(k)
        return inplace_error(self.name, path, how, parameter=self.fn.root.hooks.is_parameter(path))

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run fn on `tensors`; return its flat outputs as tensors of the declared shapes.

        Re-raises fn's own exception (a transform's failure as VmapError or AutodiffError),
        raises InPlaceMutationError if fn tried to write into an input, and
        OutputMismatchError if an output differs from the declared or inferred one.
        Outputs may still be 64-bit where JAX's x64 mode is off: the conversion that
        follows narrows them.
        """
        return self.run(tensors)

    def run(self, tensors: list[torch.Tensor], strict: bool = True) -> Any:
        """__call__; with ``strict=False`` outputs that differ from this plan's types are no
        error (an eager call whose types were a guess from an earlier call): then
        ``(None, [out])``, fn's raw output in a list the caller may empty."""
        if self.hot:
            out = hot_paths.guarded_call(self, tensors)
            if type(out) is _Tensor:
                if out.dtype is self.hot_dtype and out.shape == self.hot_shape:
                    return [out]  # checked
            else:
                out = as_jax_tree(out)
        else:
            out = self.invoke(tensors)
        return self.check_outputs(out, strict)

    def _fill(self, tensors: list[torch.Tensor]) -> list:
        """The argument leaves: the static leaves with the tensors in their slots."""
        if not self.has_statics:
            return tensors
        leaves = self.template.copy()
        for i, t in zip(self.positions, tensors, strict=True):
            leaves[i] = t
        return leaves

    def input_path(self, k: int) -> str:
        return self.fn.arg_path(leaf_paths(self.in_tree)[self.positions[k]])

    def raise_mutated(self, tensors: list) -> None:
        names = [self.input_path(k) for k in range(len(tensors))]
        check_versions(tensors, [0] * len(tensors), names, self.name, "seen after the real call")


class _RetryWithAutograd(Exception):
    """A derived call to run again with torch.autograd (see CallPlan.invoke)."""


def _unflattening(fn: Callable, in_tree: Any) -> Callable:
    """``fn`` called on the tensors of a call whose leaves are all tensors, their structure
    `in_tree` (bind's (args, kwargs)) rebuilt around them: UserFunction's call, flat."""
    unflatten = in_tree.unflatten

    def call(*tensors: torch.Tensor) -> Any:
        args, kwargs = unflatten(tensors)
        return fn(*args, **kwargs)

    return call


def plan_for(
    fn: Any, in_tree: Any, template: tuple, structs: tuple, out_tree: Any, in_dtypes: Any = ()
) -> CallPlan:
    """The plan of one signature of `fn` (its output types `structs`/`out_tree`, or
    ``(), None`` where not yet known); the user's own function is called directly, its
    int32 inputs widened where x64 is off (`in_dtypes`: the operands' dtypes)."""
    flat_fn = fn.fn if fn is fn.root else None
    widen = flat_fn is not None and _x64.widens(in_dtypes)
    return CallPlan(fn, in_tree, template, structs, out_tree, flat_fn, widen)


def _widening(fn: Callable, facts: dict) -> Callable:
    def call(*tensors: torch.Tensor) -> Any:
        return _x64.call_widening(fn, facts, *tensors)

    return call


def plan_parts(args: tuple, out_types: Any) -> tuple:
    """(operands, in_tree, template, structs, out_tree) of a call of `args` with these
    output types: plan_for's arguments after the operands."""
    leaves, in_tree = _tree.tree_flatten(args)
    operands = [x for x in leaves if is_operand(x)]
    template = tuple(ARRAY if is_operand(x) else x for x in leaves)
    structs, out_tree = _tree.tree_flatten(out_types)
    return operands, in_tree, template, tuple(structs), out_tree
