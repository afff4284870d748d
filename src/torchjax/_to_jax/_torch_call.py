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
from collections.abc import Callable
from typing import Any

import jax
import torch

from torchjax._compat import array_committed, is_fake, sharding_device
from torchjax._convert import SUPPORTED_DTYPES, _ArrayImpl, array_to_tensor, torch_dtype
from torchjax._errors import (
    ConversionError,
    OutputMismatchError,
    ShapeInferenceError,
    TorchJaxError,
)
from torchjax._primitive._core import PytreePrimitive
from torchjax._primitive._params import _ARRAY, _is_operand
from torchjax._to_jax._call_plan import (
    CallPlan,
    fake_output_error,
    number_tensor,
    plain,
    to_jax_outputs,
)
from torchjax._to_jax._fake_run import (
    fake_eval,
    fake_runs,
    fake_target,
    function_name,
    is_fake_limit,
    output_struct,
    real_mode,
)
from torchjax._to_jax._outputs import as_jax_tree
from torchjax._to_jax._rule_lowering import callback_call

_SingleDevice = jax.sharding.SingleDeviceSharding
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
    # The primitive's params bound with this function or one derived from it, kept here
    # rather than in a global cache so that they die with the function (to_jax empties it
    # when its wrapper dies: the params refer back to this object).
    bound_params: dict = dataclasses.field(default_factory=dict, repr=False)

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
        return _tree.tree_map_with_path(self._declared_leaf, spec)

    def _declared_leaf(self, path: tuple, leaf: Any) -> jax.ShapeDtypeStruct:
        """A result_shape_dtypes leaf, checked, with JAX's dtype for it (a float64 declared
        while x64 is off is float32, eagerly as under jit)."""
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        try:
            if dtype is None:
                raise TypeError
            shape = tuple(int(d) for d in shape)
            dtype = jax.dtypes.canonicalize_dtype(dtype)
            torch_dtype(dtype)
        except (TypeError, ValueError):
            raise OutputMismatchError(
                f"result_shape_dtypes of {self.name} has a {type(leaf).__name__} at "
                f"out{_tree.keystr(path)}; every leaf must be a jax.ShapeDtypeStruct(shape, "
                f"dtype) of a dtype torch has, e.g. jax.ShapeDtypeStruct((3,), jnp.float32)."
            ) from None
        return jax.ShapeDtypeStruct(shape, dtype)

    def fake_types(self, args: tuple) -> Any:
        """Output types from one run on fake tensors (of the original, if compiled)."""
        target = fake_target(self.fn)
        try:
            call = lambda a, k: as_jax_tree(target(*a, **k))
            return fake_eval(call, args, self.name, self.arg_path, state_of=self.fn)
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


@torch_call_p._def_params_home
def _params_home(params: dict) -> dict:
    """A call's params (and their signature caches) live on the user's function: a
    dropped wrapper leaves nothing in a global cache."""
    return params["fn"].root.bound_params


_DTYPES_OK: set = set()  # input dtypes known to convert


def _check_input_dtype(where: str, dtype: Any) -> None:
    try:
        torch_dtype(dtype)
    except ConversionError:
        is_key = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
        hint = "Pass jax.random.key_data(key) instead. " if is_key else ""
        raise ConversionError(
            f"{where} has dtype {dtype}, which torch has no equivalent of. "
            f"{hint}Cast it to one of: {SUPPORTED_DTYPES}."
        ) from None
    _DTYPES_OK.add(dtype)


@torch_call_p.def_abstract_eval
def _abstract_eval(*args: Any, fn: Any, options: Options) -> Any:
    """Output types of ``fn(*args)``: declared by the user, found on fake tensors (the
    user's function), or derived from the inner function's (every derived function)."""
    for path, leaf in _tree.tree_flatten_with_path(args)[0]:
        if isinstance(leaf, jax.core.ShapedArray) and leaf.dtype not in _DTYPES_OK:
            _check_input_dtype(fn.arg_path(path), leaf.dtype)
    if isinstance(fn, DerivedFunction):
        return fn.declared_shapes(options, *args)
    _check_no_tensor(fn, args)
    if fn.result_shape_dtypes is not None:
        return fn.declared_shapes(options, *args)
    return fn.fake_types(args)


def _check_no_tensor(fn: Any, args: tuple) -> None:
    for path, leaf in _tree.tree_flatten_with_path(args)[0]:
        if isinstance(leaf, torch.Tensor):
            raise ConversionError(
                f"{fn.arg_path(path)} is a torch.Tensor; functions made by to_jax take JAX "
                f"arrays where the torch function takes tensors. Convert it with "
                f"torchjax.tree_to_jax, or close over it in the torch function."
            )


def _plan(fn: Any, in_tree: Any, template: tuple, structs: tuple, out_tree: Any) -> CallPlan:
    flat_fn = fn.fn if type(fn) is UserFunction else None
    return CallPlan(fn, in_tree, template, structs, out_tree, flat_fn)


def _plan_parts(args: tuple, out_types: Any) -> tuple:
    leaves, in_tree = _tree.tree_flatten(args)
    operands = [x for x in leaves if _is_operand(x)]
    template = tuple(_ARRAY if _is_operand(x) else x for x in leaves)
    structs, out_tree = _tree.tree_flatten(out_types)
    return operands, in_tree, template, tuple(structs), out_tree


def _eager_plan(in_tree: Any, statics: tuple, signature: Any, params: tuple) -> CallPlan:
    """The call plan of an eager signature, built on its first call and kept in its memo."""
    plan = signature.memo.get("plan")
    if plan is None:
        fn = dict(params)["fn"]
        structs, out_tree = _tree.tree_flatten(signature.out_types)
        plan = signature.memo["plan"] = _plan(fn, in_tree, statics, tuple(structs), out_tree)
    return plan


@torch_call_p._def_flat_impl
def _impl(operands: tuple, *, in_tree: Any, statics: tuple, signature: Any, params: tuple) -> list:
    """Eager: DLPack the JAX inputs to torch, call fn, DLPack the outputs back.

    The plan checks every output's shape and dtype, so the flat outputs need no re-check.
    """
    if fake_runs.depth or torch.is_inference_mode_enabled():
        return _impl_in_plain_mode(operands, in_tree, statics, signature, params)
    plan = _eager_plan(in_tree, statics, signature, params)
    device = None
    for x in operands:
        if type(x) is _ArrayImpl and array_committed(x):
            device = _committed_device(operands, plan)
            break
    return to_jax_outputs(plan(_tensors(operands, plan)), plan.out_paths, device)


def _tensors(operands: Any, plan: CallPlan) -> list[torch.Tensor]:
    try:
        return [array_to_tensor(x) for x in operands]
    except ConversionError:
        for k, x in enumerate(operands):  # raise again, naming the argument
            if getattr(x, "dtype", None) is not None and x.dtype not in _DTYPES_OK:
                _check_input_dtype(plan.input_path(k), x.dtype)
            array_to_tensor(x, plan.input_path(k))
        raise


def _committed_device(operands: Any, plan: CallPlan) -> Any:
    """The device eager outputs go to: that of the inputs committed to one (as JAX puts
    its own results), or None (JAX's default CPU device) where none is."""
    device = None
    for k, x in enumerate(operands):
        if type(x) is _ArrayImpl and array_committed(x):
            d = sharding_device(x.sharding) if type(x.sharding) is _SingleDevice else None
            if device is None:
                device = d
            elif d is not device:
                raise ConversionError(
                    f"{plan.input_path(k)} is committed to {d}, but an earlier argument to "
                    f"{plan.name} is committed to {device}. Put the arguments on one device "
                    f"(jax.device_put)."
                )
    return device


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


@torch_call_p._def_untyped_first
def _untyped_first(params: tuple) -> bool:
    """The user's own function needs no fake run when called eagerly: there is data, and
    its real run gives the types (nothing a fake run could leave behind, no fake-tensor
    limits). Derived functions take their types from it, so they never fake-run anyway."""
    fn = dict(params)["fn"]
    return type(fn) is UserFunction and fn.result_shape_dtypes is None


@torch_call_p._def_eager_fallback
def _real_run(error: Exception | None, operands: tuple, *, in_tree, statics, params, memo) -> Any:
    """An eager call without output types found beforehand: run it for real and take the
    types from the outputs.

    `error` is why the types could not be found (None where they were not looked for, see
    _untyped_first, and on later calls). The call runs behind the same in-place guard as
    any other (its inputs refuse writes), with plans kept in the signature's `memo`: the
    first call's outputs give a typed plan that later calls try first (the checks of a
    typed call, no output tree to walk), falling back to the untyped path where outputs
    differ (their shapes may depend on the values). A failure of the real run is fn's own.
    """
    if isinstance(error, TorchJaxError) and not isinstance(error, ShapeInferenceError):
        raise error
    if fake_runs.depth or torch.is_inference_mode_enabled():
        with real_mode(), torch.inference_mode(False):
            return _real_run(
                error, operands, in_tree=in_tree, statics=statics, params=params, memo=memo
            )
    typed = memo.get("typed")
    plan = typed or memo.get("plan")
    if plan is None:
        # What abstract eval (and the fake run) would have checked, once per signature.
        fn = dict(params)["fn"]
        args = _tree.tree_unflatten(in_tree, _fill(statics, operands))
        _check_no_tensor(fn, args)
        check = getattr(fn.fn, "check_signature", None) if type(fn) is UserFunction else None
        if check is not None:
            check(*args[0], **args[1])
        plan = memo["plan"] = _plan(fn, in_tree, statics, (), None)
    device = None
    for x in operands:
        if type(x) is _ArrayImpl and array_committed(x):
            device = _committed_device(operands, plan)
            break
    tensors = _tensors(operands, plan)
    if typed is not None:
        results = typed.run(tensors, strict=False)
        if type(results) is list:
            return _tree.tree_unflatten(
                typed.out_tree, to_jax_outputs(results, typed.out_paths, device)
            )
        box = results[1]
    else:
        box = [plan.invoke(tensors)]
    results, out_tree, paths = _typed_outputs(plan, box)
    outs = to_jax_outputs(results, paths, device)
    if "typed" not in memo:
        structs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
        memo["typed"] = _plan(plan.fn, in_tree, statics, tuple(structs), out_tree)
    return _tree.tree_unflatten(out_tree, outs)


def _fill(statics: tuple, operands: tuple) -> list:
    it = iter(operands)
    return [next(it) if s is _ARRAY else s for s in statics]


def _typed_outputs(plan: CallPlan, box: list) -> tuple[list, Any, list]:
    """fn's flat outputs as tensors, with their structure and paths; raises for what is
    not an array. `box` holds fn's raw output, and is emptied."""
    flat, out_tree = _tree.tree_flatten_with_path(box.pop())
    results, paths = [], []
    while flat:  # popped, so that each output's references are all in `results`
        path, leaf = flat.pop(0)
        where = "out" + _tree.keystr(path)
        struct = output_struct(path, leaf, plan.name)
        if not isinstance(leaf, torch.Tensor):
            leaf = number_tensor(leaf, torch_dtype(struct.dtype), where)
        elif is_fake(leaf):
            raise fake_output_error(plan.name, where)
        results.append(plain(leaf))
        paths.append(where)
        del leaf
    return results, out_tree, paths


@torch_call_p.def_lowering(signature=True)
def _lowering(*args: Any, fn: Any, options: Options, signature: Any) -> Any:
    """Under jit: a buffer_callback that runs fn on XLA's buffers (see _rule_lowering.py)."""
    del options
    operands, *parts = _plan_parts(args, signature.out_types)
    plan = _plan(fn, *parts)
    outs = callback_call(plan, operands, plan.structs, plan.out_paths)
    return _tree.tree_unflatten(plan.out_tree, outs)
