# Output shapes without real data: run the torch function on FakeTensors.
#
# FakeTensorMode propagates shapes and dtypes through real torch kernels' meta functions,
# so the function runs exactly as written but touches no memory. The same run catches
# writes into inputs, by any route (_guard.WriteGuard), before any real JAX buffer is
# handed to torch. Results are cached by PytreePrimitive,
# once per (function, structure, static leaves, shapes, dtypes).
from __future__ import annotations

import inspect
import traceback
from typing import Any

import jax
import numpy as np
import torch

from torchjax._compat._torch import (
    FakeTensorMode,
    compiled_function_original,
    imports_outside_fakes,
    interpreter_stack_cleared,
    operator_name,
    quiet_fake_tensor_log,
    tensor_version,
    unset_fake_temporarily,
)
from torchjax._convert import canonical_jax_dtype, check_has_data, torch_dtype
from torchjax._errors import ConversionError, OutputMismatchError
from torchjax._log import signature, timed
from torchjax._to_jax._call._guard import WriteGuard, check_versions
from torchjax._to_jax._context import FAKE_RUN_LOCK, failed_fake_run, fake_runs
from torchjax._to_jax._fake._isolation import FakeRunState
from torchjax._to_jax._hooks import NO_HOOKS, CallHooks
from torchjax._to_jax._torch_ops._autocast import InAutocast

_tree = jax.tree_util


def function_name(fn: Any) -> str:
    """A readable name for messages: the qualified name, or the type's for callable objects;
    a torch operator by its own name (torch.ops.aten.sin, a torch.library custom op)."""
    op = operator_name(fn)
    if op is not None:
        return op
    if inspect.isbuiltin(fn) and getattr(fn, "__module__", None) == "torch":
        return f"torch.{fn.__name__}"  # not its C class's qualified name
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    return type(fn).__qualname__ + " instance"


def default_torch_device() -> torch.device:
    """The torch device matching JAX's default device (where real calls will run): the one
    `jax.default_device` or the `jax_default_device` option names, else JAX's first.

    An abstract value carries no device, so a fake run on a GPU other than the default one
    needs that option (or declared types) where the function mixes its inputs with tensors
    of its own on that GPU."""
    chosen = jax.config.jax_default_device
    if isinstance(chosen, str):
        chosen = jax.devices(chosen)[0]
    device = chosen if chosen is not None else jax.devices()[0]
    if device.platform not in ("gpu", "cuda", "rocm"):
        return torch.device("cpu")
    index = getattr(device, "local_hardware_id", None)
    return torch.device("cuda", index) if isinstance(index, int) else torch.device("cuda")


def _path_of(path: tuple) -> str:
    return "args" + _tree.keystr(path)


def output_struct(path: tuple, leaf: Any, name: str) -> jax.ShapeDtypeStruct:
    """The JAX type of one output leaf of a torch function (tensor or Python number)."""
    if isinstance(leaf, torch.Tensor):
        if leaf.is_nested:  # (it has no shape to read)
            check_has_data(leaf, f"out{_tree.keystr(path)}")
        return jax.ShapeDtypeStruct(tuple(leaf.shape), canonical_jax_dtype(leaf.dtype))
    if isinstance(leaf, bool | int | float | complex):
        dtype = jax.dtypes.canonicalize_dtype(np.result_type(type(leaf)))
        if isinstance(leaf, int) and not isinstance(leaf, bool):
            info = np.iinfo(dtype)
            if not info.min <= leaf <= info.max:
                raise ConversionError(
                    f"{name} returned the Python int {leaf} at out{_tree.keystr(path)}, which "
                    f"does not fit {dtype}, its type as a JAX array"
                    f"{'' if jax.config.jax_enable_x64 else ' while x64 is off'}. Return a "
                    f"tensor of a dtype that holds it, or a smaller number."
                )
        return jax.ShapeDtypeStruct((), dtype)
    fix = "Return the value as a tensor, or drop it from the output."
    if _is_hf_cache(leaf):
        fix = (
            "It is the model's key/value cache: call the model with use_cache=False (or "
            "drop the field from the output)."
        )
    raise OutputMismatchError(
        f"{name} returned a {type(leaf).__name__} at out{_tree.keystr(path)}; a function "
        f"wrapped by to_jax must return tensors, Python numbers, or pytrees of them. {fix}"
    )


def _is_hf_cache(leaf: Any) -> bool:
    """Whether `leaf` is a Hugging Face cache object (transformers' Cache classes)."""
    return any(
        c.__name__.endswith("Cache") and c.__module__.startswith("transformers.")
        for c in type(leaf).__mro__
    )


def real_mode() -> Any:
    """A context in which torch runs for real even inside an enclosing fake run."""
    return unset_fake_temporarily()


def fake_target(fn: Any) -> Any:
    """What to fake-run for `fn`: the original of a torch.compile'd function or module.

    torch.compile's own frames cannot run under a FakeTensorMode of ours (it crashes or
    mixes devices), but the code it compiled computes the same types.
    """
    if type(fn) is InAutocast:  # the original, in the same autocast state
        return InAutocast(fake_target(fn.fn), fn.state)
    orig = compiled_function_original(fn)
    return fn if orig is None else orig


def fake_eval(
    fn: Any,
    args: tuple,
    name: str,
    describe: Any = None,
    state_of: Any = None,
    facts: dict | None = None,
    hooks: CallHooks = NO_HOOKS,
) -> Any:
    """Run `fn(*args)` on fake tensors; return its output as a pytree of ShapeDtypeStruct.

    The run leaves no trace (_fake/_isolation.py): the Python state of the modules reachable
    from `state_of` is put back afterwards, and a fake tensor that something else kept is
    an error (an lru_cache that kept one is cleared).

    Args:
      fn: a torch callable taking the positional pytrees `args`.
      args: pytrees whose array leaves are avals (``.shape``/``.dtype``); other leaves
        are passed through as they are.
      name: the user-facing function name, for messages.
      describe: maps a leaf's key path to its name in messages (default ``args[i]...``).
      state_of: the user's callable, whose reachable state the run may touch (default
        `fn`); not searched where `hooks` say it isolates its own state (module_to_jax's
        forward).
      facts: a dict to record in what the run saw besides types: ``facts["draws"]``,
        whether an op drew random numbers.
      hooks: what the user's function tells the call machinery (CallHooks).

    Raises:
      InPlaceMutationError: `fn` writes into an input (or changes one in place).
      ShapeInferenceError: the run left a fake tensor where torchjax cannot take it back.
      Exception: whatever `fn` raised on fake tensors; callers add the context.
    """
    state_of = fn if state_of is None else state_of
    # torch logs every meta kernel that raises; this run re-raises what it meets.
    quiet_fake_tensor_log(lambda: fake_runs.depth > 0)
    with FAKE_RUN_LOCK, timed("fake run of %s at %s", name, signature(args)):
        touched = FakeRunState(state_of, name, hooks.isolates_state)
        try:
            types, draws = _fake_run(fn, args, name, describe or _path_of, touched, hooks)
            if facts is not None:
                facts["draws"] = facts.get("draws", False) or draws
        except BaseException as failure:
            touched.restore()
            # A failed run is cleaned up as a finished one: what it left in state torchjax
            # cannot reach (pyro's global param store) is refused. The failure's frames hold
            # the run's fake tensors too: their locals go (their lines stay, and the class of
            # each one's `self`, which messages name, is kept first: owner_classes).
            _keep_owner_classes(failure)
            traceback.clear_frames(failure.__traceback__)
            touched.check_left_behind(after=failure)
            raise
        touched.restore()
        touched.check_left_behind()
    return types


# The class of `self` in each frame of the last failed fake run's traceback (per thread),
# taken before those frames drop their locals (fake_eval).
_failed = failed_fake_run


def _keep_owner_classes(failure: BaseException) -> None:
    owners, tb = {}, failure.__traceback__
    while tb is not None:  # by frame: the traceback grows as the failure is raised on
        owners[id(tb.tb_frame)] = type(tb.tb_frame.f_locals.get("self"))
        tb = tb.tb_next
    _failed.error, _failed.owners = failure, owners


def owner_classes(error: BaseException) -> list:
    """The class of `self` (NoneType where none) in each frame of `error`'s traceback,
    in order: kept where a failed fake run cleared those frames, else read from them."""
    kept = _failed.owners if getattr(_failed, "error", None) is error else {}
    owners, tb = [], error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        found = kept.get(id(frame))
        owners.append(found if found is not None else type(frame.f_locals.get("self")))
        tb = tb.tb_next
    return owners


def _fake_run(
    fn: Any, args: tuple, name: str, describe: Any, touched: FakeRunState, hooks: CallHooks
) -> Any:
    """fake_eval's run itself, returning (types, whether it drew random numbers); every
    tensor it makes is tracked, and none outlives it here."""
    device = default_torch_device()
    no_inference = torch.inference_mode(False)  # inference tensors have no version counter
    # JAX code the torch code runs (a wrapped function called on a constant, say) runs
    # now, on its concrete values: staged into the trace that asked for the types, it
    # would hand torch a tracer.
    compile_time = jax.ensure_compile_time_eval()
    no_transforms = interpreter_stack_cleared()  # the types do not depend on torch.func's
    with (
        compile_time,
        no_transforms,
        _inside_fake_run(),
        no_inference,
        imports_outside_fakes(),
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        leaves, tree = _tree.tree_flatten_with_path(args)
        fakes, paths, values = [], [], []
        for path, leaf in leaves:
            if isinstance(leaf, jax.core.ShapedArray | jax.ShapeDtypeStruct):
                t = torch.empty(leaf.shape, dtype=torch_dtype(leaf.dtype), device=device)
                touched.track(t)
                fakes.append(t)
                paths.append(describe(path))
                values.append(t)
                del t
            else:
                values.append(leaf)
        versions = [tensor_version(t) for t in fakes]
        guard = WriteGuard(fakes, paths, name, made=touched.track, is_parameter=hooks.is_parameter)
        with guard:
            out = fn(*_tree.tree_unflatten(tree, values))

        del values
        check_versions(fakes, versions, paths, name, "seen while inferring output shapes")
    return _tree.tree_map_with_path(lambda p, x: output_struct(p, x, name), out), guard.draws


class _inside_fake_run:
    def __enter__(self) -> None:
        fake_runs.depth += 1

    def __exit__(self, *_exc: Any) -> None:
        fake_runs.depth -= 1
