# Every torch callable a torch_call binds: the user's function, and those derived from it.
#
# `torch_call_p.bind(*args, fn=fn, options=options)` means "fn(*args), computed by torch".
# Each rule of torch_call_p that transforms a call binds the same primitive again with a
# callable derived from the one it received, so the rules compose: jax.vmap(jax.grad(f))
# is a BatchedFunction of a VjpFunction, jax.hessian(f) a JvpFunction of a VjpFunction,
# vmap(vmap(f)) a BatchedFunction of a BatchedFunction: one torch call however deep.
#
# | callable | computes | made by |
# |---|---|---|
# | UserFunction(f) | f(*args, **kwargs), grad mode off | to_jax (compared by identity) |
# | BatchedFunction(g, in_dims) | torch.func.vmap(g) over g's tensor leaves (per_example: |
# |   | a loop, for torch.autograd derivatives) | _rule_batching |
# | LeadingAxisFunction(g, size) | g itself, on inputs with a leading batch axis; only its |
# |   | types differ (vmap_method "expand_dims"/"broadcast_all") | _rule_batching |
# | JvpFunction(g, wrt, out_mask, with_primals=True) | g's outputs and the tangents of its |
# |   | inexact outputs, from one torch.func.jvp | _rule_jvp |
# | JvpFunction(g, wrt, out_mask) | the tangents alone: linear in the tangents | the splits |
# |   | of _rule_partial_eval and _rule_batching |
# | JvpFunction(..., with_residuals=True) | the same, called with a RecordedForward's |
# |   | residuals (replays its random draws) | linearization |
# | VjpFunction(g, wrt, out_mask) | cotangents of g's `wrt` leaves (torch.func.vjp, or |
# |   | torch.autograd.grad where nothing differentiates it again) | _rule_transpose |
# | VjpFunction(..., with_residuals=True) | the same through the graph the forward kept |
# |   | (recomputing, with its draws, where the graph is gone) | _rule_transpose |
# | VjpFunction(..., ct_batch=levels) | the same for a batch of cotangents: one forward, |
# |   | the pullback vmapped | _rule_batching (jacrev) |
# | VjpFunction(..., with_tangents=True) | the pullbacks of cotangents and of their |
# |   | tangents, from one forward (the JVP of a VJP in its cotangents) | _rule_jvp |
# | RecordedForward(g, wrt, out_mask) | g's outputs, recording the autograd graph for the |
# |   | VJP; returns the graph's handle and the RNG state as residuals | linearization |
# | ZerosLike(shape, dtype) | not a callable: a static leaf standing for zeros (a linear |
# |   | input's point in a generic transpose) | _rule_transpose |
#
# Derived callables are frozen dataclasses, so equal transformations give equal params and
# hit the same caches. Their output types follow from their inner function's (out_types):
# only the user's function is ever fake-run, once per signature.
#
# This module is over 400 lines by design: every callable, and so how every transform is
# computed in torch, reads in one place. What they share lives beside it: _torch_ops/_autograd.py
# (pullbacks, tape nodes), _torch_ops/_vmap.py (torch.func.vmap's steps),
# _torch_ops/_residual.py (kept graphs).
from __future__ import annotations

import dataclasses
import linecache
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from torchjax import _convert
from torchjax._compat._messages import (
    custom_op_without_fake_kernel,
    is_autodiff_failure,
    is_fake_limit,
    is_nested_fast_path,
    is_reentrant_checkpoint,
    is_vmap_failure,
    lacks_batching_rule,
    lacks_forward_derivative,
    needs_setup_context,
    not_differentiable_input,
    read_a_value,
    refuses_randomness,
    refuses_saved_tensor_hooks,
    runs_autograd_itself,
    wants_int64,
)
from torchjax._compat._torch import FINDS_UNBATCHED, batched_here, is_functorch_wrapped
from torchjax._convert import call_widening, torch_dtype
from torchjax._errors import (
    AutodiffError,
    OutputMismatchError,
    ShapeInferenceError,
    TorchJaxError,
    VmapError,
)
from torchjax._primitive._params import store
from torchjax._to_jax._call._outputs import as_jax_tree
from torchjax._to_jax._call._plan import INT32_NOTE, autograd_inside, leaf_paths
from torchjax._to_jax._fake._run import (
    default_torch_device,
    fake_eval,
    fake_target,
    function_name,
    owner_classes,
)
from torchjax._to_jax._torch_ops._autocast import InAutocast
from torchjax._to_jax._torch_ops._autograd import (
    AUTODIFF_HINT,
    AUTOGRAD_HINT,
    FORWARD_AD_HINT,
    REENTRANT_CHECKPOINT_HINT,
    SAVED_TENSOR_HOOKS_HINT,
    autograd_pullback,
    autograd_pullbacks,
    batch_sizes,
    conj,
    jvp_by_double_vjp,
    on_tape,
    outermost,
    stack_batch,
)
from torchjax._to_jax._torch_ops._residual import (
    GRAPHS,
    OUTPUT_BUFFERS,
    KeptGraph,
    enter_derived_call,
    exit_derived_call,
    held_count,
    recording,
    replaying,
    rng_state,
    rng_state_size,
    take_held,
)
from torchjax._to_jax._torch_ops._vmap import (
    MODULE_RANDOMNESS_HINT,
    RANDOMNESS_HINT,
    VMAP_HINT,
    as_tensor,
    beneath_autograd,
    is_abstract,
    vmap_call,
)

_tree = jax.tree_util


# -- the user's function ------------------------------------------------------------------
def types_key(args: Any) -> tuple:
    """A call's signature as abstract eval sees it: structure, input types and static
    leaves, x64, torch's default dtype (a new trace after set_default_dtype finds its
    types again)."""
    leaves, tree = _tree.tree_flatten(args)
    return (tree, tuple(leaves), jax.config.jax_enable_x64, torch.get_default_dtype())


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
        return (_user_function, (self.fn, self.result_shape_dtypes, self.autocast))

    def variant(self, autocast: tuple) -> UserFunction:
        """This function as called in autocast state `autocast` (kept: jit caches hit)."""
        found = self.variants.get(autocast)
        if found is None:
            fn = InAutocast(self.fn, autocast)
            found = UserFunction(fn, self.result_shape_dtypes, autocast=autocast)
            self.variants[autocast] = found
        return found

    @property
    def name(self) -> str:
        fn = self.fn.fn if type(self.fn) is InAutocast else self.fn  # a variant: fn's own
        return function_name(fn)

    @property
    def root(self) -> UserFunction:
        return self

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        # (x64 off: int32 inputs reach torch as int64, its indices' dtype; see _convert.)
        return as_jax_tree(call_widening(self.fn, self.facts, *args, **kwargs))

    def arg_path(self, path: tuple) -> str:
        # bind's args are (args, kwargs): report paths as the user wrote the call, or as the
        # function describes its own arguments (module_to_jax's forward: variables[...]).
        describe = getattr(self.fn, "describe_path", None)
        if describe is not None:
            return describe(path)
        head = "args" if path[0].idx == 0 else "kwargs"
        return head + _tree.keystr(tuple(path[1:]))

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
            call = lambda a, k: as_jax_tree(call_widening(target, self.facts, *a, **k))
            facts = {} if getattr(self.fn, "seeded", False) else self.facts
            return fake_eval(call, args, self.name, self.arg_path, state_of=self.fn, facts=facts)
        except TorchJaxError:
            raise
        except Exception as e:
            if not is_fake_limit(e):
                if wants_int64(e) and not jax.config.jax_enable_x64 and not _convert.WIDEN_INT32:
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
        module = getattr(self.fn, "describe_path", None) is not None  # module_to_jax's
        declare = "module_to_jax(module, " if module else "to_jax(fn, "
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


def _user_function(fn: Any, result_shape_dtypes: Any, autocast: tuple) -> UserFunction:
    return UserFunction(fn, result_shape_dtypes, autocast=autocast)


EMPTY_BATCH_NOTE = """\
(jax.vmap over an empty batch: torchjax ran {name} on one example of zeros, batched, to
compute the call's outputs and derivatives, and that run failed.)"""

UNBATCHED_CHANGED = """\
{name}, batched by torch.func.vmap, batched its output {j} (in flattening order) that the
run that found which outputs depend on the batched inputs (on fake tensors, when the call
was traced) left unbatched, so JAX was told it is unbatched. Which outputs depend on the
batched inputs changes with the values (control flow on values, or random draws with
vmap_randomness='different'). Batch this function one example at a time instead:
to_jax(fn, vmap_method='sequential')."""

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


def _theirs(error: Exception, name: str) -> Exception:
    note = f"(raised by {name}, called through torchjax)"
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)
    return error


def _aval(x: Any) -> Any:
    return x if isinstance(x, jax.core.ShapedArray | jax.ShapeDtypeStruct) else jax.typeof(x)


# types_of(fn, *args): the output types of fn(*args) under the call's options. The abstract
# eval rule hands it to out_types, so callables find their inner function's types without
# knowing the primitive that computes them.
TypesOf = Callable[..., Any]


# -- what derived callables share -------------------------------------------------------
class DerivedFunction:
    """Base of the torch callables a transformation derives from another one, `inner`.

    They report errors under the user's function (`root`) and name arguments as it does,
    unless their own arguments are laid out differently (then they override arg_path).
    Their output types follow from inner's (`out_types`): they are never fake-run.
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

    @property
    def maps_a_batch(self) -> bool:
        """A derivative of a batched call: over an empty batch, where every output is
        empty, it computes nothing either (CallPlan.empty_batch)."""
        return getattr(self.inner, "maps_a_batch", False)

    def arg_path(self, path: tuple) -> str:
        return self.inner.arg_path(path)

    def out_types(self, types_of: TypesOf, *args: Any) -> Any:
        raise NotImplementedError

    def call_failure(self, error: Exception, in_tree: Any = None) -> Exception:
        return self.inner.call_failure(error, in_tree)


@dataclasses.dataclass(frozen=True)
class ZerosLike:
    """A static leaf standing for zeros of this shape and dtype (a linear input's point)."""

    shape: tuple
    dtype: np.dtype


class _Derivative(DerivedFunction):
    """Shared plumbing of JvpFunction and VjpFunction: select leaves, name errors."""

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str

    @property
    def method(self) -> str:
        """The grad_method in force: torch.autograd's where the function runs it itself."""
        return "autograd" if autograd_inside() else self.grad_method

    def arg_path(self, path: tuple) -> str:
        # Their args are (primals, tangents or cotangents); the primals are inner's args.
        if path and getattr(path[0], "idx", None) == 0 and len(path) > 1:
            return self.inner.arg_path(path[1:])
        return "args" + _tree.keystr(path)

    def _restricted(self, primals: tuple) -> tuple[Any, list]:
        """(g, x): g(*x) is inner's masked outputs as a function of the `wrt` leaves.

        g returns ``(masked, rest)``, both tensors: the masked outputs, and the others,
        which torch.func passes through as aux, untouched by the transform.
        """
        # This runs on every call: its loops stay in C where they can (map, `in`).
        leaves, tree = _tree.tree_flatten(primals)
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), None)
        if ZerosLike in map(type, leaves):
            leaves = [
                torch.zeros(x.shape, dtype=torch_dtype(x.dtype), device=device)
                if isinstance(x, ZerosLike)
                else x
                for x in leaves
            ]

        def g(*diff: torch.Tensor) -> tuple:
            new = list(leaves)
            for i, t in zip(self.wrt, diff, strict=True):
                new[i] = t
            outs = _tree.tree_leaves(self.inner(*_tree.tree_unflatten(tree, new)))
            # A Python number output is a constant: as a tensor, its derivative is zero.
            outs = [o if isinstance(o, torch.Tensor) else as_tensor(o, device) for o in outs]
            if all(self.out_mask):
                return tuple(outs), []
            masked = tuple(o for o, m in zip(outs, self.out_mask, strict=True) if m)
            return masked, [o for o, m in zip(outs, self.out_mask, strict=True) if not m]

        return g, [leaves[i] for i in self.wrt]

    grad_mode = True  # see _CallPlan: torch.func runs derivatives with grad mode on

    def call_failure(self, error: Exception, in_tree: Any = None) -> Exception:
        text = f"{type(error).__name__}: {error}"
        if not is_autodiff_failure(error):
            return self.inner.call_failure(error, in_tree)  # the function's own exception
        if not_differentiable_input(error):
            return AutodiffError(self._not_differentiable(text, in_tree))
        if is_reentrant_checkpoint(error):
            hint = REENTRANT_CHECKPOINT_HINT
        elif self.method == "autograd":
            hint = AUTOGRAD_HINT
        elif lacks_forward_derivative(error):
            hint = FORWARD_AD_HINT
        elif refuses_saved_tensor_hooks(error):
            hint = SAVED_TENSOR_HOOKS_HINT
        else:
            hint = AUTODIFF_HINT
        return AutodiffError(hint.format(name=self.root.name, error=text))

    def _not_differentiable(self, text: str, in_tree: Any) -> str:
        """torch refuses to differentiate one of the inputs: name those differentiated."""
        names = []
        if in_tree is not None:
            paths = leaf_paths(in_tree)  # the primals' leaves come first
            names = [self.arg_path(paths[i]) for i in self.wrt if i < len(paths)]
        buffers = [n for n in names if n.startswith("variables['buffers']")]
        if buffers:
            return NOT_DIFFERENTIABLE_BUFFER.format(
                name=self.root.name, error=text, buffers=", ".join(buffers)
            )
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        return NOT_DIFFERENTIABLE.format(name=self.root.name, error=text, inputs=shown or "?")


NOT_DIFFERENTIABLE_BUFFER = """\
torch cannot differentiate {name} with respect to some of its module's buffers: {error}
The buffers being differentiated: {buffers}. Buffers such as BatchNorm's running
statistics are the module's state, not parameters: differentiate variables['params'] only,
    jax.grad(lambda p: loss({{"params": p, "buffers": variables["buffers"]}}))(params)
or mark the buffers constant with jax.lax.stop_gradient (with equinox's filter_grad, keep
them out of the differentiated part of the model: eqx.partition)."""

NOT_DIFFERENTIABLE = """\
torch cannot differentiate {name} with respect to one of the inputs being differentiated:
{error}
The differentiated inputs: {inputs}. Keep the one torch names out of what JAX
differentiates (as a non-differentiated argument), or wrap it in jax.lax.stop_gradient."""


# -- jax.vmap ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BatchedFunction(DerivedFunction):
    """``torch.func.vmap(inner)`` over the tensor leaves of inner's positional args.

    Attributes:
      inner: the torch callable being batched.
      in_dims: one int (batched axis) or None per tensor leaf, in flattening order.
      randomness: torch.func.vmap's randomness policy.
      per_example: call inner once per example instead (a derivative by torch.autograd.grad).
      out_dims: 0 or None per output leaf, None where the output does not depend on the
        batched inputs and stays unbatched (jax.vmap's out_axes=None); None for all
        batched.
    """

    inner: Any
    in_dims: tuple
    randomness: str
    per_example: bool = False
    out_dims: tuple | None = None

    maps_a_batch = True  # over an empty batch, nothing to compute (CallPlan.empty_batch)

    def with_out_dims(self, args: tuple) -> BatchedFunction:
        """This call, with the outputs that depend on no batched input left unbatched.

        Asked of the user's function only, where some tensor input is unbatched (with every
        input batched only a constant output could be), by one fake run per signature of it
        under torch.func.vmap. Where that run fails, every output is batched, as it always
        can be.
        """
        root = self.inner
        if root is not root.root or self.per_example or not FINDS_UNBATCHED:
            return self
        if None not in self.in_dims:
            return self
        leaves, tree = _tree.tree_flatten(args)
        abstract = [_aval(x) if is_abstract(x) else x for x in leaves]
        signature = tuple(x if is_abstract(x) else (type(x), x) for x in abstract)
        key = (self.in_dims, self.randomness, tree, signature)
        out_dims = root.batched_outputs.get(key, False)
        if out_dims is False:
            out_dims = self._probe(_tree.tree_unflatten(tree, abstract))
            store(root.batched_outputs, key, out_dims)
        return self if out_dims is None else dataclasses.replace(self, out_dims=out_dims)

    def _probe(self, args: tuple) -> tuple | None:
        """with_out_dims's fake run: the out_dims it found, or None (all batched)."""
        root = self.inner
        seen: list = []
        probe = dataclasses.replace(self, inner=UserFunction(fake_target(root.fn)))

        def run(*a: Any) -> Any:
            leaves, tree = _tree.tree_flatten(a)
            positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            return probe._vmap(leaves, tree, positions, seen=seen)

        try:
            fake_eval(run, args, root.name, root.arg_path, state_of=root.fn)
        except Exception:  # noqa: BLE001 - batched outputs are always right, if wasteful
            return None
        if not seen or all(seen[-1]):
            return None
        return tuple(0 if b else None for b in seen[-1])

    def __call__(self, *args: Any) -> Any:
        leaves, tree = _tree.tree_flatten(args)
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        mapped = [(i, d) for i, d in zip(positions, self.in_dims, strict=True) if d is not None]
        if mapped and leaves[mapped[0][0]].shape[mapped[0][1]] == 0:
            return self._empty_batch(leaves, tree, mapped)
        if self.per_example or autograd_inside():  # autograd cannot run under torch.func.vmap
            return self._loop(leaves, tree, positions)
        try:
            return self._vmap(leaves, tree, positions)
        except Exception as e:
            if isinstance(e, TorchJaxError) or runs_autograd_itself(e):
                raise  # ours; or: the call runs again with a loop (CallPlan.invoke)
            if lacks_batching_rule(e):
                # Composite ops (column_stack) decompose into batchable ones only beneath
                # an autograd level, as under torch.func.vmap(torch.func.grad(f)).
                try:
                    return self._vmap(leaves, tree, positions, decompose=True)
                except Exception:
                    raise e from None
            if is_vmap_failure(e):
                raise  # torch.func.vmap's own message: call_failure adds the advice
            # Ambiguous (an in-place op into an unbatched tensor fails with a shape
            # error): the function's own failure if one example alone fails too.
            self._one_example(leaves, tree, positions)
            raise VmapError(self._hint(e)) from e

    def _empty_batch(self, leaves: list, tree: Any, mapped: list) -> Any:
        """An empty batch, which torch.func.vmap cannot run many ops over (no example to
        select): one example of zeros appended, and the batched outputs cut back to none,
        detached. Exact, derivatives too: nothing flows back from the cut-off example (a
        gradient of an unbatched input sums over no example, as JAX's does), and an
        output that stays unbatched depends on no batched input."""
        padded = list(leaves)
        for i, d in mapped:
            x = leaves[i]
            padded[i] = torch.cat([x, x.new_zeros((*x.shape[:d], 1, *x.shape[d + 1 :]))], d)
        try:
            out = self(*_tree.tree_unflatten(tree, padded))
        except Exception as e:
            e.add_note(EMPTY_BATCH_NOTE.format(name=self.root.name))
            raise
        outs, out_tree = _tree.tree_flatten(out)
        dims = self.out_dims or (0,) * len(outs)
        # Detached: no derivative flows back from the cut-off example at all (a zero
        # cotangent times its derivative at the zeros, inf for w / x, would be NaN).
        cut = [o if d is None else o.detach()[:0] for o, d in zip(outs, dims, strict=True)]
        return _tree.tree_unflatten(out_tree, cut)

    def _one_example(self, leaves: list, tree: Any, positions: list) -> None:
        new = list(leaves)
        for i, d in zip(positions, self.in_dims, strict=True):
            if d is not None:
                if not leaves[i].shape[d]:
                    return
                new[i] = leaves[i].select(d, 0)
        self.inner(*_tree.tree_unflatten(tree, new))

    def _loop(self, leaves: list, tree: Any, positions: list) -> Any:
        """inner once per example, outputs stacked: for what torch.func.vmap cannot run."""
        mapped = [(i, d) for i, d in zip(positions, self.in_dims, strict=True) if d is not None]
        size = leaves[mapped[0][0]].shape[mapped[0][1]]
        device = leaves[mapped[0][0]].device
        rows, out_tree = [], None
        for k in range(size):
            new = list(leaves)
            for i, d in mapped:
                new[i] = leaves[i].select(d, k)
            out_leaves, out_tree = _tree.tree_flatten(self.inner(*_tree.tree_unflatten(tree, new)))
            rows.append([as_tensor(o, device) for o in out_leaves])
        dims = self.out_dims or (0,) * out_tree.num_leaves
        stacked = [
            torch.stack([r[j] for r in rows]) if d is not None else self._same(rows, j)
            for j, d in enumerate(dims)
        ]
        return _tree.tree_unflatten(out_tree, stacked)

    def _same(self, rows: list, j: int) -> torch.Tensor:
        """Output j, which out_dims keeps unbatched: equal in every example, checked."""
        if not all(torch.equal(r[j], rows[0][j]) for r in rows[1:]):
            raise VmapError(UNBATCHED_CHANGED.format(name=self.root.name, j=j))
        return rows[0][j]

    def _vmap(
        self, leaves: list, tree: Any, positions: list, decompose: bool = False, seen: Any = None
    ) -> Any:
        """One torch.func.vmap call; `seen` (a list) collects which outputs were batched."""
        out_tree = []
        device = leaves[positions[0]].device if positions else None
        # Only the batched tensors go through vmap's arguments; the others are captured,
        # which torch.func.vmap treats exactly like in_dims=None, and saves its per-argument
        # Python work on every call.
        mapped = [(i, d) for i, d in zip(positions, self.in_dims, strict=True) if d is not None]

        def flat(*tensors: torch.Tensor) -> Any:
            new = list(leaves)
            for (i, _), t in zip(mapped, tensors, strict=True):
                new[i] = t
            out_leaves, treedef = _tree.tree_flatten(self.inner(*_tree.tree_unflatten(tree, new)))
            out_tree.append(treedef)
            out = [x if isinstance(x, torch.Tensor) else as_tensor(x, device) for x in out_leaves]
            # One output goes back bare: vmap's per-output Python work is per call.
            return out[0] if len(out) == 1 else tuple(out)

        call = beneath_autograd(flat) if decompose else flat
        unbatched: dict = {}
        if seen is not None or self.out_dims is not None:
            call = self._watching(call, seen, unbatched)
        dims = tuple(d for _, d in mapped)
        out = vmap_call(call, [leaves[i] for i, _ in mapped], dims, self.randomness)
        outs = [out] if out_tree[-1].num_leaves == 1 else list(out)
        for j, o in unbatched.items():
            outs[j] = o  # not batched at this level: as it left the function (vmap expanded it)
        return _tree.tree_unflatten(out_tree[-1], outs)

    def _watching(self, call: Any, seen: Any, unbatched: dict) -> Any:
        """`call`, noting which outputs are batched at this vmap level (into `seen`), or
        keeping those out_dims leaves unbatched (into `unbatched`), checked to be so."""

        def watched(*tensors: torch.Tensor) -> Any:
            out = call(*tensors)
            outs = [out] if isinstance(out, torch.Tensor) else out
            if seen is not None:
                seen.append([batched_here(o) for o in outs])
                return out
            for j, d in enumerate(self.out_dims):
                if d is None:
                    if batched_here(outs[j]):
                        raise VmapError(UNBATCHED_CHANGED.format(name=self.root.name, j=j))
                    unbatched[j] = outs[j]
            return out

        return watched

    def out_types(self, types_of: TypesOf, *args: Any) -> Any:
        leaves, tree = _tree.tree_flatten(args)
        dims = iter(self.in_dims)
        size, unbatched = None, []
        for x in leaves:
            d = next(dims) if is_abstract(x) else None
            if d is not None:
                size = x.shape[d]
                x = jax.ShapeDtypeStruct(x.shape[:d] + x.shape[d + 1 :], x.dtype)
            unbatched.append(x)
        inner = types_of(self.inner, *_tree.tree_unflatten(tree, unbatched))
        structs, out_tree = _tree.tree_flatten(inner)
        dims = self.out_dims or (0,) * len(structs)
        return _tree.tree_unflatten(
            out_tree,
            [
                s if d is None else jax.ShapeDtypeStruct((size, *s.shape), s.dtype)
                for s, d in zip(structs, dims, strict=True)
            ],
        )

    def call_failure(self, error: Exception, in_tree: Any = None) -> Exception:
        if not is_vmap_failure(error):
            return self.inner.call_failure(error, in_tree)  # not vmap's: the function's own
        if self.inner.grad_mode and needs_setup_context(error):
            return self.inner.call_failure(error, in_tree)  # torch.func cannot differentiate it
        return VmapError(self._hint(error))

    def _hint(self, error: Exception) -> str:
        module = getattr(self.root.fn, "describe_path", None) is not None  # module_to_jax's
        hint = VMAP_HINT.replace("to_jax(fn, ", "module_to_jax(module, ") if module else VMAP_HINT
        if self.randomness == "error" and refuses_randomness(error):
            hint = MODULE_RANDOMNESS_HINT if module else RANDOMNESS_HINT
        return hint.format(name=self.root.name, error=f"{type(error).__name__}: {error}")


@dataclasses.dataclass(frozen=True)
class LeadingAxisFunction(DerivedFunction):
    """``inner`` called on inputs that all carry a leading batch axis of ``size`` (or 1).

    vmap_method "expand_dims" and "broadcast_all": inner handles the batch axis itself, so
    the call is inner's own. Only its declared output types differ: result_shape_dtypes
    describes one example, so they are inner's on the inputs without their leading axis,
    with ``size`` in front.
    """

    inner: Any
    size: int

    def __call__(self, *args: Any) -> Any:
        return self.inner(*args)

    def out_types(self, types_of: TypesOf, *args: Any) -> Any:
        if self.root.result_shape_dtypes is None:
            # Found types describe what fn does with these very inputs, batch axis and all.
            return types_of(self.inner, *args)
        leaves, tree = _tree.tree_flatten(args)
        unbatched = [
            jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if is_abstract(x) else x for x in leaves
        ]
        inner = types_of(self.inner, *_tree.tree_unflatten(tree, unbatched))
        return _tree.tree_map(lambda s: jax.ShapeDtypeStruct((self.size, *s.shape), s.dtype), inner)


# -- autodiff ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class JvpFunction(_Derivative):
    """``(primals, tangents) -> tangents of inner's masked outputs``; linear in tangents.

    With ``with_primals`` it returns inner's outputs too, flat and first: ``(*outputs,
    *tangents)``, from the one torch.func.jvp that computes both. The JVP rule binds that
    form; where JAX needs the halves apart (linearize, grad, checkpoint, jacfwd), the
    rules in _torch_call/_partial_eval.py split it back into the primal call and the linear form.

    ``taped``: the linear form that follows a RecordedForward, called as ``(primals,
    residuals, tangents)`` with that call's residuals; it replays the forward's random
    draws, and its transpose pulls back through the kept graph.
    """

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str
    with_primals: bool = False
    with_residuals: bool = False

    @property
    def linear(self) -> JvpFunction:
        return dataclasses.replace(self, with_primals=False)

    def __call__(self, primals: tuple, *rest: tuple) -> tuple:
        enter_derived_call()  # a module copy the forward runs in stays as it is until the end
        try:
            if not self.with_residuals:
                return self._jvp(primals, rest[0])
            (_, state), tangents = rest
            with replaying(unbatched_residual(state, 1), device_of(primals)):
                return self._jvp(primals, tangents)
        finally:
            exit_derived_call()

    def _jvp(self, primals: tuple, tangents: tuple) -> tuple:
        g, x = self._restricted(primals)
        if self.method == "torch.func":
            with FORWARD_AD:
                outs, t_outs, rest = torch.func.jvp(g, tuple(x), tuple(tangents), has_aux=True)
        else:
            outs, t_outs, rest = jvp_by_double_vjp(g, x, tangents)
        if not self.with_primals:
            return tuple(t_outs)
        done, others = iter(outs), iter(rest)
        merged = [next(done) if m else next(others) for m in self.out_mask]
        return (*merged, *t_outs)

    def out_types(self, types_of: TypesOf, primals: tuple, *rest: tuple) -> tuple:
        del rest
        out = types_of(self.inner, *primals)
        every = _tree.tree_leaves(out)
        masked = tuple(s for s, m in zip(every, self.out_mask, strict=True) if m)
        return (*every, *masked) if self.with_primals else masked


# torch's forward-mode levels are process-wide, not per thread (torch.autograd.forward_ad
# keeps the current level in a module global, and its C++ side one stack): two threads in
# torch.func.jvp at once close or reuse each other's level, and a tangent comes out zero
# or the call fails. So torch.func.jvp runs in one thread at a time (re-entrant: a JVP of
# a JVP, or a wrapped function calling another, nests on its own thread).
FORWARD_AD = threading.RLock()


@dataclasses.dataclass(frozen=True)
class VjpFunction(_Derivative):
    """``(primals, cotangents) -> cotangents of the wrt leaves``; linear in cotangents.

    ``ct_batch`` holds one entry per jax.vmap over the cotangents alone (jax.jacrev,
    hessian, the JVP of a VJP with respect to its cotangents), innermost first: the
    cotangent leaves' batch axes at that level (None where not batched). The forward then
    runs once, and only the pullback is batched, as torch.func.jacrev does: the function
    is not re-run under vmap, so random draws, data-dependent code and kernels without a
    batching rule work. Outputs carry the batch axes in front, outermost first.
    """

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str
    ct_batch: tuple = ()
    with_residuals: bool = False  # called as (primals, residuals, cotangents): see JvpFunction
    # Called with two sets of cotangents, (..., cotangents, more): the pullbacks of both from
    # one forward, (*of cotangents, *of more). The JVP of a VJP in its cotangents.
    with_tangents: bool = False

    def __call__(self, primals: tuple, *rest: tuple) -> tuple:
        # A module copy the forward runs in stays as it is until the pullback is done.
        enter_derived_call()
        try:
            return self._call(primals, *rest)
        finally:
            exit_derived_call()

    def _call(self, primals: tuple, *rest: tuple) -> tuple:
        into = OUTPUT_BUFFERS.take()  # XLA's buffers for the gradients, at the top call only
        if self.with_tangents:
            *head, cts, more = rest
            stacked = tuple(torch.stack([c, m]) for c, m in zip(cts, more, strict=True))
            both = dataclasses.replace(
                self, with_tangents=False, ct_batch=(*self.ct_batch, (0,) * len(cts))
            )
            out = both._call(primals, *head, stacked)
            return (*[o[0] for o in out], *[o[1] for o in out])
        cotangents = rest[-1]
        # torch pulls back with the conjugate of JAX's cotangent convention for complex
        # numbers: JAX's vjp(ct) is conj(torch's vjp(conj(ct))). Real leaves are unaffected.
        if any(map(torch.is_complex, cotangents)):
            cotangents = tuple(map(conj, cotangents))
            into = None  # conjugated after: not what the buffers should hold
        if self.with_residuals:
            grads = self._after_taped(primals, rest[0], cotangents, into)
        elif self.ct_batch:
            grads = self._batched_pullback(primals, cotangents)
        else:
            grads = self._pullback(primals, cotangents)
        # A sparse gradient (nn.Embedding(sparse=True)'s) holds the same numbers as the
        # dense array JAX takes.
        grads = [g if g.layout is torch.strided else g.to_dense() for g in grads]
        return tuple(map(conj, grads)) if any(map(torch.is_complex, grads)) else tuple(grads)

    def _after_taped(
        self, primals: tuple, residuals: tuple, cotangents: tuple, into: Any = None
    ) -> tuple:
        """Through the graph the forward kept, if it is still there and nothing outside
        differentiates this call (writing the gradients into `into`, XLA's buffers, where
        given); otherwise recompute, replaying the forward's draws."""
        handle, state = (
            unbatched_residual(r, ndim) for r, ndim in zip(residuals, (0, 1), strict=True)
        )
        graph = GRAPHS.take(int(handle)) if handle is not None and int(handle) else None
        if graph is not None and not self.ct_batch and outermost((primals, cotangents)):
            if into is not None and len(into) != len(self.wrt):
                into = None
            return graph.backward(_tensors_of(primals), self.out_mask, cotangents, into)
        with replaying(state, device_of(primals)):
            if self.ct_batch:
                return self._batched_pullback(primals, cotangents)
            return self._pullback(primals, cotangents)

    def _pullback(self, primals: tuple, cotangents: tuple) -> tuple:
        g, x = self._restricted(primals)
        if self.method == "autograd":
            return autograd_pullback(g, x, cotangents, create_graph=True)
        if outermost((primals, cotangents)):
            # Nothing outside this call to differentiate it further: torch.func.vjp would
            # compute the same with plain autograd, plus its transform's per-op overhead.
            return autograd_pullback(g, x, cotangents, create_graph=False)
        _, pullback, _ = torch.func.vjp(g, *x, has_aux=True)
        return tuple(pullback(tuple(cotangents)))

    def _batched_pullback(self, primals: tuple, cotangents: tuple) -> tuple:
        """One forward, then the pullback of every cotangent in the batch."""
        flat, lead = stack_batch(cotangents, self.ct_batch)
        g, x = self._restricted(primals)
        if flat[0].shape[0] == 0:  # an empty batch: nothing to pull back
            return tuple(xi.new_zeros(*lead, *xi.shape) for xi in x)
        if self.method == "autograd":
            grads = autograd_pullbacks(g, x, flat)
        else:
            _, pullback, _ = torch.func.vjp(g, *x, has_aux=True)
            grads = vmap_call(lambda *c: tuple(pullback(c)), list(flat), (0,) * len(flat), "error")
        return tuple(gr.reshape(*lead, *gr.shape[1:]) for gr in grads)

    def out_types(self, types_of: TypesOf, primals: tuple, *rest: tuple) -> tuple:
        del types_of
        cotangents = rest[-2] if self.with_tangents else rest[-1]
        leaves = _tree.tree_leaves(primals)
        lead = batch_sizes([c.shape for c in cotangents], self.ct_batch)
        out = tuple(
            jax.ShapeDtypeStruct((*lead, *leaves[i].shape), leaves[i].dtype) for i in self.wrt
        )
        return (*out, *out) if self.with_tangents else out


@dataclasses.dataclass(frozen=True)
class RecordedForward(_Derivative):
    """``(*primals) -> (*inner's flat outputs, handle, rng_state)``: the primal half of a
    call that reverse mode splits (_torch_call/_partial_eval.py), run with autograd recording on the
    `wrt` leaves. The graph is kept under `handle` (0: none kept, e.g. under a torch.func
    transform) for the VJP to pull back through; `rng_state` is torch's generator state
    from before the forward, for a VJP that must recompute. See _torch_ops/_residual.py.
    """

    inner: Any
    wrt: tuple
    out_mask: tuple
    grad_method: str
    keep_graph: bool = True  # False: the linear half is applied forward, and recomputes

    n_residuals = 2  # the handle and the RNG state, after the outputs (CallPlan.empty_batch)

    def arg_path(self, path: tuple) -> str:
        return self.inner.arg_path(path)  # its args are inner's own

    def __call__(self, *primals: Any) -> tuple:
        enter_derived_call()
        try:
            return self._call(primals)
        finally:
            exit_derived_call()

    def _call(self, primals: tuple) -> tuple:
        into = OUTPUT_BUFFERS.take()  # XLA's buffers for the outputs, under jit
        tensors = [x for x in _tree.tree_leaves(primals) if isinstance(x, torch.Tensor)]
        device = tensors[0].device if tensors else default_torch_device()
        state = rng_state(device).to(device)
        g, x = self._restricted(primals)
        graph = None
        # A derivative (grad of grad) is differentiated again by torch.func, which does
        # not take saved-tensor hooks: only the user's own function keeps its graph.
        if self.keep_graph and outermost(primals) and not self.inner.grad_mode:
            try:
                masked, rest, graph = self._keep_graph(g, x, tensors)
            except RuntimeError as e:
                if not refuses_saved_tensor_hooks(e):
                    raise
                # fn uses torch.func itself: run it again as it is, with the same draws.
                with replaying(state, device):
                    masked, rest = g(*x)
        else:
            masked, rest = g(*x)
        done, others = iter(masked), iter(rest)
        outs = [next(done) if m else next(others) for m in self.out_mask]
        del masked, rest, done, others  # (the outputs' references: see write_outputs)
        handle = 0
        if graph is not None:
            if into is not None:
                graph.write_outputs(outs, into)
            handle = GRAPHS.put(graph)
        return (*outs, torch.tensor(handle, dtype=torch.int32, device=device), state)

    def _keep_graph(self, g: Any, x: list, tensors: list) -> tuple:
        graph = KeptGraph()
        mark = held_count()
        with torch.enable_grad(), recording(graph, tensors):
            graph.leaves = on_tape(x)
            masked, rest = g(*graph.leaves)
        if not any(o.requires_grad for o in masked):
            return masked, rest, None
        # What the forward left held (a module copy with this call's tensors) is the
        # graph's now: its backward may read it again (checkpointing, adjoint solvers).
        graph.keep_held(take_held(mark), tensors)
        graph.let_go_of_inputs(tensors, [*masked, *rest])
        found = iter(masked)
        graph.outputs = [next(found) if m else None for m in self.out_mask]
        return masked, rest, graph

    def out_types(self, types_of: TypesOf, *primals: Any) -> tuple:
        out = types_of(self.inner, *primals)
        return (*_tree.tree_leaves(out), *self.residual_types())

    @staticmethod
    def residual_types() -> tuple:
        """The types of the graph handle and the RNG state."""
        size = rng_state_size(default_torch_device())
        return jax.ShapeDtypeStruct((), np.int32), jax.ShapeDtypeStruct((size,), np.uint8)


def unbatched_residual(t: Any, ndim: int) -> Any:
    """t if it is a plain tensor of `ndim` dims; None if a torch.func transform wraps it or
    it carries a batch axis (vmap_method="broadcast_all"): a batch of handles or RNG
    states has no single graph or generator state to use."""
    if isinstance(t, torch.Tensor) and t.dim() == ndim:
        if not is_functorch_wrapped(t):
            return t
    return None


def _tensors_of(primals: tuple) -> list[torch.Tensor]:
    return [x for x in _tree.tree_leaves(primals) if isinstance(x, torch.Tensor)]


def device_of(primals: tuple) -> torch.device | None:
    return next((x.device for x in _tree.tree_leaves(primals) if isinstance(x, torch.Tensor)), None)
