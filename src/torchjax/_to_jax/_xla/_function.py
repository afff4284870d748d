# to_jax(fn, lowering="xla")'s function: per input signature, one torch.export of `fn` and
# its lowered Program, jitted; a call flattens its arguments as the callback path does
# (arrays are operands, every other leaf a hashable static value) and runs the program.
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from torchjax._compat._jax import traceback_boundary
from torchjax._compat._messages import wants_int32
from torchjax._convert import canonical_jax_dtype, is_array, torch_dtype
from torchjax._errors import LoweringError, OutputMismatchError
from torchjax._log import logger, profiled, profiling, signature, timed
from torchjax._primitive._params import check_hashable
from torchjax._to_jax._call._guard import inplace_error
from torchjax._to_jax._context import LOWERING_LOCK
from torchjax._to_jax._xla._export import capture, examples
from torchjax._to_jax._xla._op_table import op_table
from torchjax._to_jax._xla._program import Program
from torchjax._x64 import widens

_tree = jax.tree_util

_WRITES = "torch.export records a write into it"


class Lowered:
    """A torch function lowered to JAX ops, one Program per input signature.

    `callback(op)` gives the callback-path JAX function of a torch op (to_jax of it, with
    the user's options): the route of a node the op table cannot lower. `may_write(path)`
    says whether the function may write the input at a key path in place (module_to_jax's
    buffers, with mutable=True); `describe(path)` names a path as the user wrote the call.
    """

    def __init__(
        self,
        fn: Callable,
        name: str,
        callback: Callable[[Any], Callable],
        describe: Callable[[tuple], str],
        may_write: Callable[[tuple], bool] = lambda path: False,
    ):
        self.fn, self.name, self.callback = fn, name, callback
        self.describe, self.may_write = describe, may_write
        self.programs: dict[Any, tuple[Program, Callable, list]] = {}

    def signature(self, tree_args: Any) -> tuple[Any, list, list]:
        """(cache key, the arrays, their key paths) of a call's (args, kwargs)."""
        with_paths, in_tree = _tree.tree_flatten_with_path(tree_args)
        arrays, paths, template = [], [], []
        for path, leaf in with_paths:
            if is_array(leaf):
                arrays.append(leaf)
                paths.append(path)
                template.append((True, None))
            else:
                takes = f"{self.name} takes non-array leaves as static values"
                check_hashable(leaf, self.describe(path), takes)
                template.append((False, leaf))
        # (a numpy float64 array is float32 to JAX with x64 off: the types JAX will trace)
        types = tuple((tuple(a.shape), canonical_jax_dtype(torch_dtype(a.dtype))) for a in arrays)
        return (in_tree, tuple(template), types), arrays, paths

    def program(self, tree_args: Any) -> tuple[Program, Callable, list, list]:
        """The Program for a call's signature (lowered on its first call), its jitted run
        and the call's arrays and their paths."""
        key, arrays, paths = self.signature(tree_args)
        entry = self.programs.get(key)
        if entry is None:
            with LOWERING_LOCK:
                entry = self.programs.get(key)
                if entry is None:
                    entry = self.programs[key] = self._lower(key, arrays, paths)
        program, jitted, _ = entry
        return program, jitted, arrays, paths

    def _lower(self, key: Any, arrays: list, paths: list) -> tuple:
        in_tree, template, types = key
        avals = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in types]
        names = [self.describe(p) for p in paths]
        widen = widens([a.dtype for a in avals])
        example = examples(avals, names, widen)  # (its errors first: they need no op table)
        table = op_table()
        with timed("torch.export of %s at %s", self.name, signature(avals)):
            try:
                exported, captured = capture(self.fn, self.name, in_tree, template, example, table)
            except LoweringError as error:
                if not widen or not wants_int32(error.__cause__ or error):
                    raise
                # (an op that wants int32, as on the callback path: its int32 tensors)
                example = examples(avals, names)
                exported, captured = capture(self.fn, self.name, in_tree, template, example, table)
        program = Program(self.name, exported, captured, table, self.callback)
        if program.narrowed:
            logger.info(
                "%s: int64 arithmetic computed in int32 (x64 off; it wraps past 2**31): %s",
                self.name,
                ", ".join(program.narrowed),
            )
        for i in program.mutated_inputs:
            if not self.may_write(paths[i]):
                raise inplace_error(self.name, names[i], _WRITES)
        run = program.run
        if captured.autograd_functions:
            run = _without_derivatives(run, self.name, captured.autograd_functions)
        return program, jax.jit(run), paths

    def __call__(self, tree_args: Any, key: Any = None) -> tuple[Any, dict]:
        """(the output pytree, {key path of a written input: its new value})."""
        program, jitted, arrays, paths = self.program(tree_args)
        outs, mutations = jitted(program.constants, arrays, key)
        return self.unflatten(program, outs), {paths[i]: v for i, v in mutations.items()}

    @staticmethod
    def unflatten(program: Program, outs: list) -> Any:
        captured = program.captured
        it = iter(outs)
        leaves = [
            jnp.asarray(captured.constants[i]) if i in captured.constants else next(it)
            for i in range(captured.out_tree.num_leaves)
        ]
        return _tree.tree_unflatten(captured.out_tree, leaves)


_CUSTOM_BACKWARD = """\
lowering="xla": {name} applies torch.autograd.Function {functions}. torch.export records
the ops of its forward and drops its own backward, so JAX's derivative of the lowered ops
would not be torch's: lowering="xla" computes its values and refuses its derivatives. Use
lowering="callback" (the default) to differentiate it: torch then runs its backward."""


def _without_derivatives(run: Callable, name: str, functions: list[str]) -> Callable:
    """`run`, whose JAX derivatives (jvp, and so grad, vjp, hessian) raise a LoweringError."""
    message = _CUSTOM_BACKWARD.format(name=name, functions=", ".join(functions))
    if "CheckpointFunction" in functions:
        message += (
            "\nCheckpointFunction is torch.utils.checkpoint's with use_reentrant=True: "
            "use_reentrant=False lowers, derivatives included."
        )

    @jax.custom_jvp
    def refusing(constants: list, arrays: list, key: Any) -> Any:
        return run(constants, arrays, key)

    @refusing.defjvp
    def _jvp(primals: tuple, tangents: tuple) -> Any:
        raise LoweringError(message)

    return refusing


def lowered_function(fn: Callable, lowered: Lowered, declared: Any = None) -> Callable:
    """to_jax's public function for a Lowered: the user's call signature. `declared`
    (result_shape_dtypes) is checked against the types the capture gives."""

    range_name = f"torchjax {lowered.name}"

    def call(args: tuple, kwargs: dict) -> Any:
        out, _ = lowered((args, kwargs))
        if declared is not None:
            check_declared(lowered.name, declared, args, kwargs, out)
        return out

    @functools.wraps(fn)
    @traceback_boundary  # an error's traceback starts at the user's call, as to_jax's
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if profiling():  # a named range in the torch or jax profiler that records
            with profiled(range_name):
                return call(args, kwargs)
        return call(args, kwargs)

    wrapped.lowered = lowered  # lowering_report reads the routes from here
    return wrapped


def check_declared(name: str, declared: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Raise OutputMismatchError where `out` differs from result_shape_dtypes (a pytree of
    ShapeDtypeStructs, or a callable of the inputs' types giving one) in structure, shape or
    dtype: the declaration is the user's statement of what the function returns."""
    if callable(declared):
        struct = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
        declared = declared(
            *_tree.tree_map(lambda x: struct(x) if is_array(x) else x, args),
            **_tree.tree_map(lambda x: struct(x) if is_array(x) else x, kwargs),
        )
    want, want_tree = _tree.tree_flatten_with_path(declared)
    got, got_tree = _tree.tree_flatten(out)
    if want_tree != got_tree:
        raise OutputMismatchError(
            f"{name} returns {got_tree}, but result_shape_dtypes declares {want_tree}. "
            f"Declare the structure the function returns, or drop result_shape_dtypes: "
            f'lowering="xla" finds the output types from the capture.'
        )
    for (path, spec), value in zip(want, got, strict=True):
        shape = tuple(getattr(spec, "shape", ()))
        dtype = jax.dtypes.canonicalize_dtype(getattr(spec, "dtype", None) or np.float32)
        if tuple(jnp.shape(value)) != shape or jnp.result_type(value) != dtype:
            raise OutputMismatchError(
                f"{name}: out{_tree.keystr(path)} is {jnp.result_type(value)}"
                f"{list(jnp.shape(value))}, but result_shape_dtypes declares {dtype}"
                f"{list(shape)}. Correct the declaration, or drop result_shape_dtypes: "
                f'lowering="xla" finds the output types from the capture.'
            )
