# to_torch's shortcut for a repeated call: the last signature called with tensors alone,
# positionally. A call of the same types skips the flattening and the cache's hashing (the
# key it would build is the one the spec was found by), and where no autograd, torch.func
# transform or torch.compile is involved, runs the jitted function with Spec.run's
# conversions inlined: one frame on every call, the work of the fastest hand-written bridge
# plus the checks that keep it exact.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchjax._compat._jax import (
    SingleDeviceSharding,
    dlpack_export,
    dlpack_import,
    jax_config,
)
from torchjax._compat._torch import (
    cpu_array_from_tensor,
    forward_ad_level,
    jit_tracing,
    proxy_mode,
    tensor_from_capsule,
    tensor_to_capsule,
    transforms_active_c,
)
from torchjax._convert import ArrayImpl, array_to_tensor, jax_cpu_device, keeps_dtype
from torchjax._to_torch._spec import Spec

_x64 = jax_config.enable_x64
_SingleDevice = SingleDeviceSharding
_grad_enabled = torch.is_grad_enabled
_Tensor, _Parameter, _strided = torch.Tensor, torch.nn.Parameter, torch.strided

MISS = object()  # a call the shortcut does not cover: it takes the full way


def hot_call(spec: Spec, tensors: list, run: Callable[[Spec, Any, tuple], Any], out_tree: Any):
    """The shortcut for calls with tensors like `tensors` (shapes, dtypes), in the current
    x64 mode: ``call(args)`` is the call's output, or MISS where `args` differ. `run(spec,
    out_tree, tensors)` is the full call of a spec (through autograd where needed)."""
    shapes, dtypes = tuple(t.shape for t in tensors), tuple(t.dtype for t in tensors)
    n, x64_value = len(shapes), _x64.value
    single = out_tree.num_leaves == 1 and out_tree.num_nodes == 1
    form = cpu_array_from_tensor.form  # jaxlib's DLPack import signature, once found
    # Inlined only where every input keeps its dtype as an array and there are outputs.
    inline = form is not None and spec.out_avals and all(map(keeps_dtype, dtypes))
    inline = inline and transforms_active_c is not None and forward_ad_level is not None
    transforms_active, dual_level = transforms_active_c, forward_ad_level
    complex_in = any(d.is_complex for d in dtypes)  # only these can have the conjugate bit
    jitted, cpu, out_where = spec.jitted, jax_cpu_device(), spec.out_where
    # Whether the outputs are single-device CPU arrays, which DLPack exports as they are: a
    # property of the compiled function (jit places its outputs by its inputs', here
    # committed to `cpu`), so the first inlined call checks it for all later ones.
    # (Not without inputs: jax.default_device may then move a retraced call's outputs.)
    plain_outs = [False]

    def outputs(outs: Any) -> list:
        """The jitted function's outputs as tensors, the first call's check included."""
        if plain_outs[0]:
            return [tensor_from_capsule(dlpack_export(o, stream=None)) for o in outs]
        results, plain = [], True
        for o in outs:
            if type(o) is ArrayImpl and type(o.sharding) is _SingleDevice and o.platform() == "cpu":
                results.append(tensor_from_capsule(dlpack_export(o, stream=None)))
            else:
                plain = False
                results.append(array_to_tensor(o, out_where))
        plain_outs[0] = plain and n > 0
        return results

    def call(args: tuple) -> Any:
        if len(args) != n or _x64.value != x64_value:
            return MISS
        plain, i = inline, 0
        for a in args:  # (indexed: zip and unpacking cost more than the checks)
            if not isinstance(a, _Tensor) or a.dtype is not dtypes[i] or a.shape != shapes[i]:
                return MISS
            if type(a) is not _Tensor and type(a) is not _Parameter:
                plain = False  # a fake or functional tensor: torch.compile is tracing
            i += 1
        # plain, no torch.func transform (functorch_transforms_active), no forward-mode
        # dual level (forward_ad_active), no input that autograd follows: Spec.run.
        if (
            not plain
            or transforms_active()
            or dual_level() >= 0
            or proxy_mode() is not None  # make_fx tracing: the call must be recorded
            or jit_tracing()  # torch.jit.trace: refused by the full way
        ):
            return run(spec, out_tree, args)
        if _grad_enabled():
            for a in args:
                if a.requires_grad:
                    return run(spec, out_tree, args)
        # Spec.run, its conversions inlined (tensor_to_jax's, array_to_tensor's common case)
        arrays = []
        try:
            for a in args:
                if not (
                    a.is_cpu
                    and a.layout is _strided
                    and a.is_contiguous()
                    and not a.const_data_ptr() % 64
                    and not (complex_in and a.is_conj())
                    and not a.is_neg()
                ):
                    return run(spec, out_tree, args)  # a copy or another device: full way
                arrays.append(dlpack_import(tensor_to_capsule(a), cpu, *form))
        except RuntimeError:  # memory that refuses a writable pointer (copied, and
            return run(spec, out_tree, args)  # tensor_to_jax says when), or none at all
        results = outputs(jitted(*arrays))
        # XLA may forward an input as an output, or give two outputs one buffer; torch must
        # not see two tensors that secretly share memory (as in Spec.run).
        results = spec.unshared(args, results)
        if single:
            return results[0]
        return out_tree.unflatten(results)

    def call_one(args: tuple) -> Any:
        """`call` for one tensor in and one out, the common signature: the same steps
        without the loops."""
        if len(args) != 1 or _x64.value != x64_value:
            return MISS
        a = args[0]
        if not isinstance(a, _Tensor) or a.dtype is not dtype or a.shape != shape:
            return MISS
        try:
            if (
                (type(a) is not _Tensor and type(a) is not _Parameter)  # torch.compile
                or transforms_active()
                or dual_level() >= 0
                or proxy_mode() is not None  # make_fx tracing: the call must be recorded
                or jit_tracing()  # torch.jit.trace: refused by the full way
                or (a.requires_grad and _grad_enabled())
                or not a.is_cpu
                or a.layout is not _strided
                or not a.is_contiguous()
                or a.const_data_ptr() % 64
                or (complex_in and a.is_conj())
                or a.is_neg()
            ):
                return run(spec, out_tree, args)
            x = dlpack_import(tensor_to_capsule(a), cpu, *form)
        except RuntimeError:  # memory that refuses a writable pointer (copied, and
            # tensor_to_jax says when), or no storage at all (torch's legacy vmap)
            return run(spec, out_tree, args)
        (o,) = jitted(x)
        if plain_outs[0]:
            r = tensor_from_capsule(dlpack_export(o, stream=None))
        else:
            (r,) = outputs((o,))
        # XLA forwards an input returned as it is: torch must not see two tensors that
        # secretly share memory (as in Spec.run). (An empty one copied costs nothing.)
        if r.const_data_ptr() == a.const_data_ptr():
            return r.clone()
        return r

    if inline and n == 1 and single:
        shape, dtype = shapes[0], dtypes[0]
        return call_one
    return call
