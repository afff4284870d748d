# torch_call_p: the one primitive behind every wrapped torch function.
#
# `torch_call_p.bind(*args, fn=fn, options=options)` means "fn(*args), computed by torch".
# `fn` is a hashable torch callable: the user's function (UserFunction) or one derived from
# it by a transformation (torch.func.vmap / jvp / vjp of another such callable; see
# _batching.py and _autodiff.py). Because every derived function is again a torch callable
# bound to this primitive, the rules compose: vmap of grad, hessian, jit of vmap of vmap.
#
# This file holds the rules every such call shares: abstract eval, the eager impl (DLPack
# both ways, and a real run where a fake run cannot find the types), and the jit lowering.
# Only the user's own function is ever run on fake tensors to find its output types (once
# per signature, or never with result_shape_dtypes); a derived function's types follow
# from its inner function's (declared_shapes), so no transform is ever fake-run.
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import torch

from torchjax._compat import is_zerotensor, set_grad_enabled, tensor_version
from torchjax._convert import array_to_tensor, canonical_torch_dtype, tensor_to_jax, torch_dtype
from torchjax._errors import (
    ConversionError,
    OutputMismatchError,
    ShapeInferenceError,
    TorchJaxError,
)
from torchjax._lowering import callback_call
from torchjax._primitive import PytreePrimitive
from torchjax._pytree_types import _ARRAY, _is_operand
from torchjax._shapes import (
    check_versions,
    fake_eval,
    fake_runs,
    fake_target,
    function_name,
    is_fake_limit,
    output_struct,
    real_mode,
)
from torchjax._torch_outputs import as_jax_tree

_tree = jax.tree_util

VMAP_METHODS = ("torch", "sequential", "expand_dims", "broadcast_all")
VMAP_RANDOMNESS = ("error", "different", "same")
GRAD_METHODS = ("torch.func", "autograd")


@dataclasses.dataclass(frozen=True)
class Options:
    """Policies chosen in to_jax; they travel with every call derived from the function."""

    vmap_method: str = "torch"
    vmap_randomness: str = "error"
    grad_method: str = "torch.func"


@dataclasses.dataclass(frozen=True, eq=False)
class UserFunction:
    """The user's torch function, called as ``fn(*args, **kwargs)``.

    Bound as ``torch_call_p.bind(args, kwargs, fn=UserFunction(...))``. Compared by
    identity: to_jax makes one per wrapped function, so repeated calls hit jit caches.
    """

    fn: Callable
    result_shape_dtypes: Any = None

    # Torch runs it with grad mode off: JAX does the differentiating, and a graph recorded
    # for closed-over parameters that require grad would only cost time and memory.
    grad_mode = False

    @property
    def name(self) -> str:
        return function_name(self.fn)

    @property
    def root(self) -> UserFunction:
        return self

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        return as_jax_tree(self.fn(*args, **kwargs))

    def arg_path(self, path: tuple) -> str:
        # bind's args are (args, kwargs): report paths as the user wrote the call.
        head = "args" if path[0].idx == 0 else "kwargs"
        return head + _tree.keystr(tuple(path[1:]))

    def declared_shapes(self, options: Options, args: tuple, kwargs: dict) -> Any:
        del options
        spec = self.result_shape_dtypes
        if callable(spec):
            to_struct = lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.core.ShapedArray) else x
            )
            spec = spec(*_tree.tree_map(to_struct, args), **_tree.tree_map(to_struct, kwargs))
        return spec

    def fake_types(self, args: tuple) -> Any:
        """Output types from one run on fake tensors (of the original, if compiled)."""
        target = fake_target(self.fn)
        try:
            call = lambda a, k: as_jax_tree(target(*a, **k))
            return fake_eval(call, args, self.name, self.arg_path)
        except TorchJaxError:
            raise
        except Exception as e:
            if not is_fake_limit(e):
                raise _theirs(e, self.name) from None
            raise ShapeInferenceError(
                f"Could not infer the output shapes of {self.name} by running it on fake "
                f"tensors (no real data): {type(e).__name__}: {e}\n"
                f"Fake tensors have no values, so a function whose output shapes depend on "
                f"its input values, or that reads values (.item(), .tolist(), Python control "
                f"flow on tensor values, argument validation such as torch.distributions' "
                f"validate_args), cannot be traced this way. Eager calls run such a function "
                f"for real; under jax.jit declare its outputs:\n"
                f"    to_jax(fn, result_shape_dtypes=jax.ShapeDtypeStruct(shape, dtype))\n"
                f"or a callable mapping the input ShapeDtypeStructs to the outputs."
            ) from e

    def call_failure(self, error: Exception) -> Exception:
        """The user's own exception stays theirs: same type and message, with a note."""
        return _theirs(error, self.name)


def _theirs(error: Exception, name: str) -> Exception:
    note = f"(raised by {name}, called through torchjax)"
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)
    return error


class DerivedFunction:
    """Base of the torch callables a transformation derives from another one, `inner`.

    They report errors under the user's function (`root`) and name arguments as it does,
    unless their own arguments are laid out differently (then they override arg_path).
    Their output types follow from inner's (`declared_shapes`): they are never fake-run.
    A failure of the call is the transform's (call_failure turns it into VmapError or
    AutodiffError with advice) only where the machinery raised it; otherwise it is passed
    to inner, and reaches the user as their own exception.
    """

    inner: Any

    @property
    def root(self) -> UserFunction:
        return self.inner.root

    @property
    def grad_mode(self) -> bool:
        return self.inner.grad_mode

    def arg_path(self, path: tuple) -> str:
        return self.inner.arg_path(path)

    def declared_shapes(self, options: Options, *args: Any) -> Any:
        raise NotImplementedError

    def call_failure(self, error: Exception) -> Exception:
        return self.inner.call_failure(error)


torch_call_p = PytreePrimitive("torch_call")


@torch_call_p.def_abstract_eval
def _abstract_eval(*args: Any, fn: Any, options: Options) -> Any:
    """Output types of ``fn(*args)``: declared by the user, found on fake tensors (the
    user's function), or derived from the inner function's (every derived function)."""
    if isinstance(fn, DerivedFunction):
        return fn.declared_shapes(options, *args)
    for path, leaf in _tree.tree_flatten_with_path(args)[0]:
        if isinstance(leaf, torch.Tensor):
            raise ConversionError(
                f"{fn.arg_path(path)} is a torch.Tensor; functions made by to_jax take JAX "
                f"arrays where the torch function takes tensors. Convert it with "
                f"torchjax.tree_to_jax, or close over it in the torch function."
            )
    if fn.result_shape_dtypes is not None:
        return fn.declared_shapes(options, *args)
    return fn.fake_types(args)


@functools.lru_cache(maxsize=1024)
def _leaf_paths(tree: Any) -> list[tuple]:
    """The key path of every leaf of a treedef, in flattening order (for messages)."""
    dummy = _tree.tree_unflatten(tree, range(tree.num_leaves))
    return [p for p, _ in _tree.tree_flatten_with_path(dummy)[0]]


class _CallPlan:
    """What one call signature fixes: where the tensors go, what must come out.

    Built once per (function, argument structure, static leaves, output types): once per
    jit lowering, and cached for eager calls, so a call only fills in tensors, runs fn and
    checks the outputs. Shared by the eager impl and the jit callback.
    """

    def __init__(self, fn: Any, in_tree: Any, template: tuple, structs: tuple, out_tree: Any):
        self.fn, self.name = fn, fn.root.name
        # Derived functions run with grad mode on, as torch.func would run them: torch picks
        # other kernels without it (a no-grad backward whose forward-mode derivative is
        # wrong for det, solve, ..., or missing for silu, mish, group_norm).
        self.grad_mode = fn.grad_mode
        self.in_tree, self.out_tree = in_tree, out_tree
        self.template = list(template)
        self.positions = [i for i, x in enumerate(template) if x is _ARRAY]
        self.structs = structs
        self.out_dtypes = [torch_dtype(s.dtype) for s in structs]
        self.out_shapes = [tuple(s.shape) for s in structs]
        paths = _leaf_paths(out_tree) if out_tree is not None else ()  # None: not yet known
        self.out_paths = ["out" + _tree.keystr(p) for p in paths]
        # Fast paths for the common call, fn(x, y) -> tensor: no template to fill, no
        # argument tree to rebuild, no output tree to flatten.
        self.has_statics = len(self.positions) != len(template)
        positional = _tree.tree_structure((tuple(range(in_tree.num_leaves)), {}))
        flat_user_call = type(fn) is UserFunction and in_tree == positional
        self.direct = fn.fn if flat_user_call and not self.has_statics else None
        self.one_tensor_out = (
            out_tree is not None and out_tree.num_nodes == 1 and out_tree.num_leaves == 1
        )

    def invoke(self, tensors: list[torch.Tensor]) -> Any:
        """fn on `tensors`, as it returns; raises as __call__ does, before any output check."""
        versions = [tensor_version(t) for t in tensors]
        grad_was_enabled = torch.is_grad_enabled()
        set_grad_enabled(self.grad_mode)
        try:
            if self.direct is not None:
                out = as_jax_tree(self.direct(*tensors))
            else:
                out = self.fn(*_tree.tree_unflatten(self.in_tree, self._fill(tensors)))
        except TorchJaxError:
            raise
        except Exception as e:
            err = self.fn.call_failure(e)
            if err is e:
                raise
            raise err from e
        finally:
            set_grad_enabled(grad_was_enabled)
        if versions != [tensor_version(t) for t in tensors]:
            self._raise_mutated(tensors, versions)
        return out

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run fn on `tensors`; return its flat outputs as tensors of the declared shapes.

        Re-raises fn's own exception (a transform's failure as VmapError or AutodiffError),
        raises InPlaceMutationError if fn modified an input after all (the fake run catches
        that first; version counters are the backstop), and OutputMismatchError if an output
        differs from the declared or inferred one. Outputs may still be 64-bit where JAX's
        x64 mode is off: the conversion that follows narrows them.
        """
        out = self.invoke(tensors)
        if self.one_tensor_out and isinstance(out, torch.Tensor) and not self.grad_mode:
            if out.dtype is self.out_dtypes[0] and out.shape == self.out_shapes[0]:
                return [out]  # the common case, checked
            results = [out]
        else:
            results, got_tree = _tree.tree_flatten(out)
            if got_tree != self.out_tree:
                raise OutputMismatchError(
                    f"{self.name} returned an output of structure {got_tree}, but "
                    f"{self.out_tree} was declared (result_shape_dtypes) or inferred "
                    f"(fake-tensor run)."
                )
        if self.grad_mode:
            results = [_plain(v) for v in results]
        for k, value in enumerate(results):
            if not isinstance(value, torch.Tensor) or value.dtype is not self.out_dtypes[k]:
                results[k] = self._coerce(k, value)
            elif value.shape != self.out_shapes[k]:
                self._raise_mismatch(k, value)
        return results

    def _fill(self, tensors: list[torch.Tensor]) -> list:
        """The argument leaves: the static leaves with the tensors in their slots."""
        if not self.has_statics:
            return tensors
        leaves = self.template.copy()
        for i, t in zip(self.positions, tensors, strict=True):
            leaves[i] = t
        return leaves

    def _coerce(self, k: int, value: Any) -> torch.Tensor:
        want = self.out_dtypes[k]
        if not isinstance(value, torch.Tensor):
            if isinstance(value, bool | int | float | complex):
                return torch.tensor(value, dtype=want)
            raise OutputMismatchError(
                f"{self.name} returned a {type(value).__name__} at {self.out_paths[k]}; a "
                f"function wrapped by to_jax must return tensors, Python numbers, or pytrees "
                f"of them."
            )
        if value.shape != self.out_shapes[k] or canonical_torch_dtype(value.dtype) != want:
            self._raise_mismatch(k, value)
        return value

    def _raise_mismatch(self, k: int, value: torch.Tensor) -> None:
        s = self.structs[k]
        raise OutputMismatchError(
            f"{self.name} returned {str(value.dtype).removeprefix('torch.')}"
            f"{list(value.shape)} at {self.out_paths[k]}, but {s.dtype}{list(s.shape)} was "
            f"declared (result_shape_dtypes) or inferred (fake-tensor run). Make "
            f"result_shape_dtypes match what the function returns, or make the function's "
            f"output independent of the input values."
        )

    def _raise_mutated(self, tensors: list, versions: list) -> None:
        paths = _leaf_paths(self.in_tree)
        names = [self.fn.root.arg_path(paths[i]) for i in self.positions]
        check_versions(tensors, versions, names, self.name, "seen after the real call")


def _plain(value: Any) -> Any:
    """A derived call's output as plain data: torch.func may return a lazy ZeroTensor (a
    tangent or gradient known to be zero, which has no storage for DLPack), and autograd
    outputs that are still on a tape."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.requires_grad:
        value = value.detach()
    if is_zerotensor(value):
        value = torch.zeros(value.shape, dtype=value.dtype, device=value.device)
    return value


def _plan_parts(args: tuple, out_types: Any) -> tuple:
    leaves, in_tree = _tree.tree_flatten(args)
    operands = [x for x in leaves if _is_operand(x)]
    template = tuple(_ARRAY if _is_operand(x) else x for x in leaves)
    structs, out_tree = _tree.tree_flatten(out_types)
    return operands, in_tree, template, tuple(structs), out_tree


def _eager_plan(in_tree: Any, statics: tuple, signature: Any, params: tuple) -> _CallPlan:
    """The call plan of an eager signature, built on its first call and kept in its memo."""
    plan = signature.memo.get("plan")
    if plan is None:
        fn = dict(params)["fn"]
        structs, out_tree = _tree.tree_flatten(signature.out_types)
        plan = signature.memo["plan"] = _CallPlan(fn, in_tree, statics, tuple(structs), out_tree)
    return plan


@torch_call_p._def_flat_impl
def _impl(operands: tuple, *, in_tree: Any, statics: tuple, signature: Any, params: tuple) -> list:
    """Eager: DLPack the JAX inputs to torch, call fn, DLPack the outputs back.

    The plan checks every output's shape and dtype, so the flat outputs need no re-check.
    """
    if fake_runs.depth or torch.is_inference_mode_enabled():
        return _impl_in_plain_mode(operands, in_tree, statics, signature, params)
    plan = _eager_plan(in_tree, statics, signature, params)
    tensors = [array_to_tensor(x) for x in operands]
    return _to_jax_outputs(plan(tensors), tensors, plan.out_paths)


def _to_jax_outputs(results: list, tensors: list, paths: list) -> list:
    # Each input tensor wraps a whole JAX buffer, so its data_ptr is its storage's start.
    inputs = {t.data_ptr() for t in tensors if t.numel()}
    outs = []
    for value, where in zip(results, paths, strict=True):
        if value.numel() and value.untyped_storage().data_ptr() in inputs:
            value = value.clone()  # an output aliasing an input would share its JAX buffer
        outs.append(tensor_to_jax(value, where))
    return outs


def _impl_in_plain_mode(operands, in_tree, statics, signature, params) -> list:
    """The eager impl outside torch's inference mode (whose tensors have no version counter
    for the in-place check; the outputs are ordinary arrays either way) and outside an
    enclosing fake run (a wrapped function calling another one while its types are found:
    the inner call has real data and runs for real)."""
    with real_mode(), torch.inference_mode(False):
        depth, fake_runs.depth = fake_runs.depth, 0
        try:
            return _impl(
                operands, in_tree=in_tree, statics=statics, signature=signature, params=params
            )
        finally:
            fake_runs.depth = depth


@torch_call_p._def_eager_fallback
def _real_run(error: Exception | None, operands: tuple, *, in_tree, statics, params) -> Any:
    """An eager call whose output types could not be found without data: run it for real
    and take the types from the outputs.

    `error` is why the types could not be found, on the first such call of a signature;
    None on later ones. That first call runs on copies of the inputs, so a function that
    writes into its inputs raises InPlaceMutationError with the caller's arrays untouched;
    later calls of the signature run zero-copy, with the version counters as the backstop,
    as every call after a fake run does. A failure of the real run is fn's own.
    """
    if isinstance(error, TorchJaxError) and not isinstance(error, ShapeInferenceError):
        raise error
    if fake_runs.depth or torch.is_inference_mode_enabled():
        with real_mode(), torch.inference_mode(False):
            return _real_run(error, operands, in_tree=in_tree, statics=statics, params=params)
    fn = dict(params)["fn"]
    tensors = [array_to_tensor(x) for x in operands]
    if error is not None:
        tensors = [t.clone() for t in tensors]
    plan = _CallPlan(fn, in_tree, statics, (), None)
    out = plan.invoke(tensors)
    flat, out_tree = _tree.tree_flatten_with_path(out)
    results = []
    for path, leaf in flat:
        struct = output_struct(path, leaf, plan.name)  # raises for what is not an array
        if not isinstance(leaf, torch.Tensor):
            leaf = torch.tensor(leaf, dtype=torch_dtype(struct.dtype))
        results.append(_plain(leaf))
    arrays = _to_jax_outputs(results, tensors, ["out" + _tree.keystr(p) for p, _ in flat])
    return _tree.tree_unflatten(out_tree, arrays)


@torch_call_p.def_lowering(signature=True)
def _lowering(*args: Any, fn: Any, options: Options, signature: Any) -> Any:
    """Under jit: a buffer_callback that runs fn on XLA's buffers (see _lowering.py)."""
    del options
    operands, *parts = _plan_parts(args, signature.out_types)
    plan = _CallPlan(fn, *parts)
    outs = callback_call(plan, operands, plan.structs, plan.out_paths)
    return _tree.tree_unflatten(plan.out_tree, outs)
