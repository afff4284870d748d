# The user's torch function, as torch_call binds it: UserFunction.
#
# Called as ``fn(*args, **kwargs)`` with bind's (args, kwargs); its output types are
# declared (result_shape_dtypes), found by one fake run per signature, or, where the fake
# run cannot read a value, taken from a real run of the same signature. Where a fake run
# fails, the ShapeInferenceError says what stopped it and the ways out (the hints below).
from __future__ import annotations

import dataclasses
import linecache
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from torchjax import _x64
from torchjax._compat._messages import (
    custom_op_without_fake_kernel,
    is_fake_limit,
    is_nested_fast_path,
    read_a_value,
    wants_int64,
)
from torchjax._convert import torch_dtype
from torchjax._errors import (
    OutputMismatchError,
    ShapeInferenceError,
    TorchJaxError,
)
from torchjax._primitive._params import call_path
from torchjax._to_jax._call._failures import INT32_NOTE
from torchjax._to_jax._call._outputs import as_jax_tree
from torchjax._to_jax._callables._base import TorchCallable, TypesOf, _theirs
from torchjax._to_jax._fake._run import (
    fake_eval,
    fake_target,
    function_name,
    owner_classes,
)
from torchjax._to_jax._hooks import NO_HOOKS, CallHooks
from torchjax._to_jax._torch_ops._autocast import InAutocast

_tree = jax.tree_util


# -- the user's function ------------------------------------------------------------------
def types_key(args: Any) -> tuple:
    """A call's signature as torch sees it, whether an eager call or a trace made it:
    structure, input shapes and dtypes, static leaves, x64, torch's default dtype (a new
    trace after set_default_dtype finds its types again). An input's weak type is JAX's
    alone (jnp.full(5, 0.3) has one, jnp.zeros(5) not): torch gets the same tensor, so a
    real run with one gives the types of a trace with the other."""
    leaves, tree = _tree.tree_flatten(args)
    leaves = [(x.shape, x.dtype) if isinstance(x, jax.core.ShapedArray) else x for x in leaves]
    return (tree, tuple(leaves), jax.config.jax_enable_x64, torch.get_default_dtype())


@dataclasses.dataclass(frozen=True, eq=False)
class UserFunction(TorchCallable):
    """The user's torch function, called as ``fn(*args, **kwargs)``.

    Bound as ``torch_call_p.bind(args, kwargs, fn=UserFunction(...))``. Compared by
    identity: to_jax makes one per wrapped function, so repeated calls hit jit caches.
    """

    fn: Callable
    result_shape_dtypes: Any = None
    # What a caller that wraps its own function (module_to_jax) tells the call machinery.
    hooks: CallHooks = NO_HOOKS
    # The primitive's params bound with this function or one derived from it, kept here
    # rather than in a global cache so that they die with the function (to_jax empties it
    # when its wrapper dies: the params refer back to this object).
    bound_params: dict = dataclasses.field(default_factory=dict, repr=False)
    # Calls batched over some of its inputs: which outputs stay unbatched, per (in_dims,
    # randomness, signature), found once each (BatchedFunction.with_out_dims).
    batched_outputs: dict = dataclasses.field(default_factory=dict, repr=False)
    # What its fake runs saw besides types: "draws", whether it draws random numbers from a
    # generator its inputs do not seed (then jax.checkpoint saves its outputs rather than
    # recompute them with other draws: _torch_call/_partial_eval.py).
    facts: dict = dataclasses.field(default_factory=dict, repr=False)
    # torch.autocast's state where the call was made or traced (_compat's autocast_state),
    # which torch runs fn in: a call traced in autocast runs in it, one traced outside runs
    # outside, whatever the state where the compiled function runs. to_jax's wrapper binds
    # one UserFunction per state it meets (`variant`).
    autocast: tuple = ()
    variants: dict = dataclasses.field(default_factory=dict, repr=False)
    # Output types its eager calls found by running for real, per signature (types_key):
    # where a fake run cannot find them (code that reads values), a later abstract eval of
    # the same signature (an eager transform, a jax.jit) takes these, and every real call
    # is still checked against them.
    real_types: dict = dataclasses.field(default_factory=dict, repr=False)

    # Whether a call must switch torch's grad mode on (derived functions: see CallPlan).
    # The user's own function runs in the caller's mode, as plain torch would run it: on,
    # unless the caller turned it off (then torch.autograd.grad inside works without an
    # enable_grad of its own); its outputs leave any graph they are on (CallPlan).
    grad_mode = False

    def __reduce__(self) -> Any:
        # Pickled (to another process) without this process's caches.
        return (_user_function, (self.fn, self.result_shape_dtypes, self.autocast, self.hooks))

    def variant(self, autocast: tuple) -> UserFunction:
        """This function as called in autocast state `autocast` (kept: jit caches hit)."""
        found = self.variants.get(autocast)
        if found is None:
            fn = InAutocast(self.fn, autocast)
            # A flat form would call the function outside the state it must run in.
            hooks = dataclasses.replace(self.hooks, flat_form=None)
            found = UserFunction(fn, self.result_shape_dtypes, hooks, autocast=autocast)
            self.variants[autocast] = found
        return found

    @property
    def name(self) -> str:
        fn = self.fn.fn if type(self.fn) is InAutocast else self.fn  # a variant: fn's own
        return function_name(fn)

    @property
    def root(self) -> UserFunction:
        return self

    parts = ("args", "kwargs")  # bind's: the call as the user wrote it

    def _call(self, args: tuple, kwargs: dict) -> Any:
        # (x64 off: int32 inputs reach torch as int64, its indices' dtype; see _x64.py)
        return as_jax_tree(_x64.call_widening(self.fn, self.facts, *args, **kwargs))

    def arg_path(self, path: tuple) -> str:
        # bind's args are (args, kwargs): report paths as the user wrote the call, or as the
        # function describes its own arguments (module_to_jax's forward: variables[...]).
        describe = self.hooks.describe_path
        if describe is not None:
            return describe(path)
        return call_path(path)

    def out_types(self, types_of: TypesOf, args: tuple, kwargs: dict) -> Any:
        del types_of
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
        """Output types from one run on fake tensors (of the original, if compiled); where
        that cannot run (code that reads values), from a real run of the same signature,
        if one was made (real_types)."""
        try:
            return self._fake_types(args)
        except ShapeInferenceError as e:
            found = self.real_types.get(types_key(args)) if read_a_value(e.__cause__) else None
            if found is None:
                raise
            return found

    def _fake_types(self, args: tuple) -> Any:
        target = fake_target(self.fn)
        try:
            call = lambda a, k: as_jax_tree(_x64.call_widening(target, self.facts, *a, **k))
            facts = {} if self.hooks.seeded else self.facts
            return fake_eval(
                call, args, self.name, self.arg_path, self.fn, facts=facts, hooks=self.hooks
            )
        except TorchJaxError:
            raise
        except Exception as e:
            if not is_fake_limit(e):
                if wants_int64(e) and not jax.config.jax_enable_x64 and not _x64.WIDEN_INT32:
                    if any(getattr(x, "dtype", None) == np.int32 for x in _tree.tree_leaves(args)):
                        e.add_note(INT32_NOTE)
                raise _theirs(e, self.name) from None
            raise ShapeInferenceError(self._why_not_fake(e, args)) from e

    def _why_not_fake(self, error: Exception, args: tuple) -> str:
        """ShapeInferenceError's message: what stopped the fake run, and the fixes."""
        text = (
            f"Could not infer the output shapes of {self.name} by running it on fake tensors "
            f"(no real data): {type(error).__name__}: {error}\n"
        )
        op = custom_op_without_fake_kernel(error)
        if op is not None:
            return text + CUSTOM_OP_HINT.format(op=op)
        flags = [
            self.arg_path(path)
            for path, leaf in _tree.tree_flatten_with_path(args)[0]
            if getattr(leaf, "shape", None) == () and leaf.dtype == np.bool_
        ]
        if flags:
            text += TRACED_FLAG_HINT.format(flags=", ".join(flags))
        numbers = [
            self.arg_path(path)
            for path, leaf in _tree.tree_flatten_with_path(args)[0]
            if getattr(leaf, "shape", None) == ()
            and _weak_type(leaf)
            and np.issubdtype(leaf.dtype, np.integer)
        ]
        if numbers:
            text += TRACED_NUMBER_HINT.format(numbers=", ".join(numbers))
        where = _module_frame(error)
        if where:
            text += f"The fake run stopped in {where}.\n"
        if is_nested_fast_path(error):
            text += NESTED_HINT
        declare = self.hooks.api
        if read_a_value(error):
            reader = _reading_frame(error)
            text += f"It read a value at {reader}\n" if reader else ""
            return text + VALUE_READ_HINT.replace("to_jax(fn, ", declare)
        return text + FAKE_LIMIT_HINT.replace("to_jax(fn, ", declare)

    def call_failure(self, error: Exception, in_tree: Any = None) -> Exception:
        """The user's own exception stays theirs: same type and message, with a note.
        (`in_tree`: the failed call's argument structure, where the caller knows it.)"""
        del in_tree
        return _theirs(error, self.name)


def _user_function(fn: Any, result_shape_dtypes: Any, autocast: tuple, hooks: Any) -> UserFunction:
    return UserFunction(fn, result_shape_dtypes, hooks, autocast=autocast)


VALUE_READ_HINT = """\
Fake tensors have no values, so code that reads one (argument validation such as
torch.distributions' validate_args, .item(), Python control flow on tensor values) cannot
run on them. Two ways out:
  * call the function once eagerly, outside jax.jit, with arrays of these shapes and
    dtypes: that real run finds the output types, and a jax.jit of the same signature uses
    them (each later call is still checked against them);
  * or declare its outputs, so that no fake run happens:
    to_jax(fn, result_shape_dtypes=jax.ShapeDtypeStruct(shape, dtype))
    or a callable mapping the input ShapeDtypeStructs to the outputs."""

FAKE_LIMIT_HINT = """\
Fake tensors have no values, so a function whose output shapes depend on its input values,
or that reads values (.item(), .tolist(), Python control flow on tensor values, argument
validation such as torch.distributions' validate_args), cannot be traced this way. Eager
calls run such a function for real; under jax.jit declare its outputs:
    to_jax(fn, result_shape_dtypes=jax.ShapeDtypeStruct(shape, dtype))
or a callable mapping the input ShapeDtypeStructs to the outputs."""

NESTED_HINT = """\
torch's nested-tensor fast path (nn.TransformerEncoder in eval mode, given a padding mask)
runs only on real tensors. Build the encoder with enable_nested_tensor=False, or:
"""


def _module_frame(error: BaseException) -> str:
    """The innermost nn.Module method the error passed through, with its line
    ("BatchNorm1d.forward (batchnorm.py:193)"), or ""."""
    found, tb = "", error.__traceback__
    for owner in owner_classes(error):
        frame = tb.tb_frame
        if issubclass(owner, torch.nn.Module):
            file = frame.f_code.co_filename.rsplit("/", 1)[-1]
            name = f"{owner.__name__}.{frame.f_code.co_name}"
            found = f"{name} ({file}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found


# Where a fake run's value read comes from: the innermost frame outside torch's dispatch
# machinery (fake tensors, ops, dynamo's wrappers) and torchjax's own.
_DISPATCH_FILES = ("/torch/_", "/torch/utils/_", "/torch/fx/", "/torchjax/")


def _reading_frame(error: BaseException) -> str:
    """The line that read a value in a fake run, as "torch/distributions/distribution.py:76,
    in Normal.__init__: if not valid.all():" (or ""): the innermost frame of `error`'s
    traceback that is not torch's dispatch machinery or torchjax's."""
    found, tb = "", error.__traceback__
    for owner in owner_classes(error):
        code = tb.tb_frame.f_code
        path = code.co_filename.replace("\\", "/")
        if not any(part in path for part in _DISPATCH_FILES):
            none = owner is type(None)
            name = code.co_name if none else f"{owner.__name__}.{code.co_name}"
            where = path.rsplit("site-packages/", 1)[-1]
            source = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            found = f"{where}:{tb.tb_lineno}, in {name}" + (f": {source}" if source else "")
        tb = tb.tb_next
    return found


TRACED_FLAG_HINT = """\
{flags}: a boolean the function may branch on arrived as an array, because jax.jit traces
Python bools passed to it (use_cache=False, return_dict=False). Keep such flags static:
    jax.jit(f, static_argnames=("use_cache", "return_dict"))
or bind them beforehand with functools.partial(f, use_cache=False). Otherwise:
"""

TRACED_NUMBER_HINT = """\
{numbers}: a Python int the function may use as a size, a count or an index arrived as an
array, because jax.jit traces Python numbers passed to it. Keep such numbers static:
    jax.jit(f, static_argnums=...) or jax.jit(f, static_argnames=...)
or bind them beforehand with functools.partial. Otherwise:
"""


def _weak_type(leaf: Any) -> bool:
    """Whether a traced leaf was a Python number (JAX gives those a weak type)."""
    return bool(getattr(getattr(leaf, "aval", leaf), "weak_type", False))


CUSTOM_OP_HINT = """\
{op} is a custom operator without a fake kernel, so torchjax cannot find its output types
without running it. Register one (it computes output shapes and dtypes from the inputs':
    @torch.library.register_fake("{op}")
    def _(x):
        return torch.empty_like(x)
), or declare the function's outputs: to_jax(fn, result_shape_dtypes=...)."""
