# torch_call's eager rule: DLPack the JAX inputs to torch, call fn, DLPack the outputs back.
#
# A typed call (its output types known: declared, or derived from the inner function's)
# runs through the signature's call plan, which checks every output. The user's own
# function needs no types before an eager call: it has data, so it runs for real at once
# and its outputs give the types (no fake run, nothing a fake run could leave behind); its
# next calls try a typed plan made from those and fall back where their outputs differ.
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

import jax
import torch

from torchjax._compat._jax import (
    SingleDeviceSharding,
    array_committed,
    dlpack_export,
    sharding_device,
    single_device_shard,
    trace_context,
)
from torchjax._compat._torch import (
    any_autocast,
    autocast_as,
    is_fake,
    tensor_from_capsule,
)
from torchjax._convert import (
    ArrayImpl,
    array_to_tensor,
    torch_dtype,
)
from torchjax._errors import ConversionError
from torchjax._primitive._params import ARRAY, eager_type, store
from torchjax._to_jax import _hot as hot_paths
from torchjax._to_jax._call._output_checks import (
    fake_output_error,
    materialized,
    number_tensor,
)
from torchjax._to_jax._call._outputs import as_jax_tree, to_jax_outputs
from torchjax._to_jax._call._plan import CallPlan, plan_for
from torchjax._to_jax._callables._base import layout
from torchjax._to_jax._callables._user import UserFunction, types_key
from torchjax._to_jax._context import DTYPES_OK, fake_runs
from torchjax._to_jax._fake._run import output_struct, real_mode
from torchjax._to_jax._hot import MISS
from torchjax._to_jax._torch_call._abstract_eval import (
    check_input_dtype,
    check_no_tensor,
)
from torchjax._to_jax._torch_call._primitive import torch_call_p

_SingleDevice = SingleDeviceSharding
_tree = jax.tree_util
_from_capsule, _export, _shard = tensor_from_capsule, dlpack_export, single_device_shard
_inference_mode = torch.is_inference_mode_enabled
_is_grad_enabled = torch.is_grad_enabled
_getrefcount, _getweakrefcount = sys.getrefcount, weakref.getweakrefcount
_Tensor, _strided = torch.Tensor, torch.strided


class Untyped:
    """An eager signature without output types found beforehand: each call runs for real,
    keeping per-signature work (its plans) in ``memo``."""

    __slots__ = ("memo",)

    def __init__(self) -> None:
        self.memo: dict = {}


def bind_eager(
    prim: Any, operands: list, in_tree: Any, statics: tuple, bound: Any, x64: Any
) -> Any:
    """An eager call of torch_call_p (TorchCallPrimitive._bind_eager): the user's function
    without declared types runs for real at once; any other call finds its signature by
    abstract eval and runs its typed plan."""
    key = (in_tree, statics, x64.value, *[eager_type(x) for x in operands])
    signature = bound.eager_signatures.get(key)
    if signature is None:
        fn = dict(bound.items)["fn"]
        if type(fn) is UserFunction and fn.result_shape_dtypes is None:
            signature = Untyped()
        else:
            avals = tuple(jax.typeof(x) for x in operands)
            signature = prim._signature(bound, in_tree, statics, avals)
        store(bound.eager_signatures, key, signature)
    if type(signature) is Untyped:
        out = real_run(operands, in_tree, statics, bound.items, signature.memo)
    else:
        out_flat = impl(
            operands, in_tree=in_tree, statics=statics, signature=signature, params=bound.items
        )
        out = _tree.tree_unflatten(signature.out_tree, out_flat)
    if bound.hot is None or bound.hot.signature is not signature:
        bound.hot = HotCall.of(operands, in_tree, statics, x64, signature, bound)
    return out


torch_call_p.def_eager(bind_eager)


def types_from_a_real_run(
    values: list, in_tree: Any, statics: tuple, bound: Any, avals: tuple
) -> bool:
    """Run the user's function (without declared types) on the concrete `values` of a
    traced bind of operands of types `avals`, so that its output types are kept
    (UserFunction.real_types) for the trace's abstract eval; False for any other function
    (its fake run's error stands)."""
    fn = dict(bound.items)["fn"]
    if type(fn) is not UserFunction or fn.result_shape_dtypes is not None:
        return False
    memo: dict = {}
    real_run(values, in_tree, statics, bound.items, memo)
    found = fn.real_types.get(memo.get("types_key"))
    if found is not None:  # under the trace's types too (weak types, an example's slice)
        store(fn.real_types, types_key(_tree.tree_unflatten(in_tree, _fill(statics, avals))), found)
    return True


torch_call_p.def_types_from_values(types_from_a_real_run)


class HotCall:
    """The last eager signature of a function called with JAX CPU arrays as its positional
    arguments, or nested in them (a dict of parameters, module_to_jax's variables), and
    nothing else, whose call plan is hot (see CallPlan.hot): its next call with arrays
    of the same types (avals) in the same structure goes straight to the plan, past the
    hashing and lookups of a bind (and, for arrays alone, the flattening), with the plan's
    checks and the output's conversion inlined into one frame (`call`, _hot.eager_call,
    which to_jax's wrapper tries first). Any other call returns MISS and takes the full way.
    """

    __slots__ = ("signature", "call")

    @staticmethod
    def of(operands: list, in_tree: Any, statics: tuple, x64: Any, signature: Any, bound: Any):
        """The HotCall of this eager call, or None where it has another form."""
        n = len(operands)
        if _export is None or len(statics) != n:
            return None  # static leaves
        parts = layout(dict(bound.items)["fn"], in_tree)
        if "kwargs" not in parts or parts["kwargs"].tree != _NO_KWARGS:
            return None  # keyword arguments, or not the user's function
        if trace_context is None:
            return None  # whether a trace is active is unknown: JAX dispatches every call
        for x in operands:
            if type(x) is not ArrayImpl or x.platform() != "cpu":
                return None
            if type(x.sharding) is not _SingleDevice:
                return None
        memo = signature.memo
        plan = memo.get("typed") if type(signature) is Untyped else memo.get("plan")
        if plan is None or not plan.hot:
            return None
        hot = HotCall()
        hot.signature = signature
        rest = functools.partial(_rest, plan, signature, in_tree, statics)
        call = hot_paths.eager_call(
            tuple(x.aval for x in operands), x64, plan, _committed_device, rest
        )
        hot.call = call if in_tree == _positional(n) else _flattening(call, parts["args"].tree)
        return hot


def _flattening(call: Any, args_tree: Any) -> Any:
    """A HotCall's call for nested arguments (a dict of parameters, module_to_jax's
    variables): their leaves, where the structure is the signature's, go to `call`."""
    flatten = _tree.tree_flatten

    def flat_call(args: tuple) -> Any:
        leaves, tree = flatten(args)
        if tree != args_tree:
            return MISS
        return call(leaves)

    return flat_call


def _rest(plan: CallPlan, signature: Any, in_tree: Any, statics: tuple, box: list, device: Any):
    """A HotCall's call after fn returned ``box[0]``, where the inlined steps do not cover
    it; `box` holds the only reference to the output, and is emptied."""
    if type(box[0]) is not torch.Tensor:
        box[0] = as_jax_tree(box[0])
    if type(signature) is not Untyped:
        outs = to_jax_outputs(plan.check_outputs(box.pop(), True), plan.out_paths, device)
        return _tree.tree_unflatten(signature.out_tree, outs)
    results = plan.check_outputs(box.pop(), strict=False)  # plan: the memo's typed one
    if type(results) is list:
        return _tree.tree_unflatten(plan.out_tree, to_jax_outputs(results, plan.out_paths, device))
    memo = signature.memo
    return _untyped_outputs(memo["plan"], results[1], device, memo, in_tree, statics)


_NO_KWARGS = _tree.tree_structure({})


@functools.lru_cache(maxsize=64)
def _positional(n: int) -> Any:
    """The argument structure of ``fn(x_1, ..., x_n)``: (args, kwargs) as bind sees it."""
    return _tree.tree_structure((tuple(range(n)), {}))


def _eagerplan_for(
    in_tree: Any, statics: tuple, signature: Any, params: tuple, operands: Any
) -> CallPlan:
    """The call plan of an eager signature, built on its first call and kept in its memo."""
    plan = signature.memo.get("plan")
    if plan is None:
        fn = dict(params)["fn"]
        structs, out_tree = _tree.tree_flatten(signature.out_types)
        dtypes = [x.dtype for x in operands]
        plan = plan_for(fn, in_tree, statics, tuple(structs), out_tree, dtypes)
        signature.memo["plan"] = plan
    return plan


def impl(operands: tuple, *, in_tree: Any, statics: tuple, signature: Any, params: tuple) -> list:
    """Eager: DLPack the JAX inputs to torch, call fn, DLPack the outputs back.

    The plan checks every output's shape and dtype, so the flat outputs need no re-check.
    """
    if fake_runs.depth or torch.is_inference_mode_enabled() or any_autocast():
        return _impl_in_real_mode(operands, in_tree, statics, signature, params)
    plan = _eagerplan_for(in_tree, statics, signature, params, operands)
    device = _device_of(operands, plan)
    tensors = _tensors(operands, plan)
    if tensors and tensors[0].is_cuda:
        # On the inputs' GPU, as under jit: torch code that makes tensors on "cuda" puts
        # them beside its inputs, and the outputs' export reads the current device.
        with torch.cuda.device(tensors[0].device):
            return to_jax_outputs(plan(tensors), plan.out_paths, device)
    return to_jax_outputs(plan(tensors), plan.out_paths, device)


torch_call_p.def_flat_impl(impl)


def _tensors(operands: Any, plan: CallPlan) -> list[torch.Tensor]:
    try:
        return [array_to_tensor(x) for x in operands]
    except ConversionError:
        for k, x in enumerate(operands):  # raise again, naming the argument
            if getattr(x, "dtype", None) is not None and x.dtype not in DTYPES_OK:
                check_input_dtype(plan.input_path(k), x.dtype)
            array_to_tensor(x, plan.input_path(k))
        raise


def _device_of(operands: Any, plan: CallPlan) -> Any:
    """The device the inputs are committed to, or None where none is."""
    for x in operands:
        if type(x) is ArrayImpl and array_committed(x):
            return _committed_device(operands, plan)
    return None


def _committed_device(operands: Any, plan: CallPlan) -> Any:
    """The device eager outputs go to: that of the inputs committed to one (as JAX puts
    its own results), or None (JAX's default CPU device) where none is."""
    device = None
    for k, x in enumerate(operands):
        if type(x) is ArrayImpl and array_committed(x):
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


def _impl_in_real_mode(operands, in_tree, statics, signature, params) -> list:
    """The eager impl outside torch's inference mode (whose tensors have no version counter
    for the in-place check; the outputs are ordinary arrays either way) and outside an
    enclosing fake run (a wrapped function calling another one while its types are found:
    the inner call has real data and runs for real), and with autocast off (a function
    called in autocast runs its own state: _torch_ops/_autocast.py)."""
    with real_mode(), torch.inference_mode(False), autocast_as(()):
        depth, fake_runs.depth = fake_runs.depth, 0
        try:
            return impl(
                operands, in_tree=in_tree, statics=statics, signature=signature, params=params
            )
        finally:
            fake_runs.depth = depth


def real_run(operands: list, in_tree: Any, statics: tuple, params: tuple, memo: dict) -> Any:
    """An eager call of the user's function without output types: run it for real and
    take the types from the outputs.

    The call runs behind the same in-place guard as any other (its inputs refuse writes),
    with plans kept in the signature's `memo`: the first call's outputs give a typed plan
    that later calls try first (the checks of a typed call, no output tree to walk),
    falling back to the untyped path where outputs differ (their shapes may depend on the
    values). A failure of the run is fn's own.
    """
    if fake_runs.depth or torch.is_inference_mode_enabled() or any_autocast():
        with real_mode(), torch.inference_mode(False), autocast_as(()):
            depth, fake_runs.depth = fake_runs.depth, 0
            try:
                return real_run(operands, in_tree, statics, params, memo)
            finally:
                fake_runs.depth = depth
    typed = memo.get("typed")
    plan = typed or memo.get("plan")
    if plan is None:
        # What abstract eval (and the fake run) would have checked, once per signature.
        fn = dict(params)["fn"]
        args = _tree.tree_unflatten(in_tree, _fill(statics, operands))
        check_no_tensor(fn, args)
        check = fn.hooks.check_signature if type(fn) is UserFunction else None
        if check is not None:
            check(*args[0], **args[1])
        dtypes = [x.dtype for x in operands]
        plan = memo["plan"] = plan_for(fn, in_tree, statics, (), None, dtypes)
        # The signature as abstract eval will see it: this call's types serve it.
        avals = [jax.typeof(x) for x in operands]
        memo["dtypes"] = dtypes
        memo["types_key"] = types_key(_tree.tree_unflatten(in_tree, _fill(statics, avals)))
    device = _device_of(operands, plan)
    tensors = _tensors(operands, plan)
    if tensors and tensors[0].is_cuda:  # on the inputs' GPU, as in impl
        with torch.cuda.device(tensors[0].device):
            return _run_untyped(plan, typed, tensors, device, memo, in_tree, statics)
    return _run_untyped(plan, typed, tensors, device, memo, in_tree, statics)


def _run_untyped(plan, typed, tensors, device, memo, in_tree, statics) -> Any:
    """real_run's call on the converted inputs."""
    if typed is not None:
        results = typed.run(tensors, strict=False)
        if type(results) is list:
            outs = to_jax_outputs(results, typed.out_paths, device)
            if typed.one_tensor_out:
                return outs[0]
            return _tree.tree_unflatten(typed.out_tree, outs)
        box = results[1]
        # Its outputs' types depend on the values: no real run speaks for a trace.
        memo["types_vary"] = True
        if type(plan.fn) is UserFunction:
            plan.fn.real_types.pop(memo.get("types_key"), None)
    else:
        box = [plan.invoke(tensors)]
    return _untyped_outputs(plan, box, device, memo, in_tree, statics)


def _untyped_outputs(plan, box, device, memo, in_tree, statics) -> Any:
    """The outputs of an untyped call whose raw output is in `box`, taken as they are."""
    results, out_tree, paths = _typed_outputs(plan, box)
    outs = to_jax_outputs(results, paths, device)
    if "typed" not in memo:
        structs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
        memo["typed"] = plan_for(
            plan.fn, in_tree, statics, tuple(structs), out_tree, memo["dtypes"]
        )
        if type(plan.fn) is UserFunction and "types_key" in memo and "types_vary" not in memo:
            store(plan.fn.real_types, memo["types_key"], _tree.tree_unflatten(out_tree, structs))
    return _tree.tree_unflatten(out_tree, outs)


def _fill(statics: tuple, operands: tuple) -> list:
    it = iter(operands)
    return [next(it) if s is ARRAY else s for s in statics]


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
        results.append(materialized(leaf))
        paths.append(where)
        del leaf
    return results, out_tree, paths
