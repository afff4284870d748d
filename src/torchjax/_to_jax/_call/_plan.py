# The call plan: what one call signature fixes, and how one real call of fn goes.
#
# A plan is built once per signature (function, argument structure, static leaves, output
# types): once per jit lowering, and kept in the signature's memo for eager calls. A call
# then only fills in tensors, runs fn behind the in-place guard (_call/_guard.py), and checks the
# outputs against the declared or inferred types. The eager impl and the jit callback share
# it, so both see the same checks and the same errors. Over 400 lines: the plan's
# construction, its call and the explanations of a failed call (dtypes, int32, numbers)
# are kept together, since every check the call makes is one the construction precomputed
# and every note reads what the plan knows of the arguments.
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import torch

from torchjax import _convert
from torchjax._compat._jax import uncommitted
from torchjax._compat._messages import (
    expects_tensor,
    is_write_refusal,
    mismatched_dtypes,
    runs_autograd_itself,
    wants_int64,
)
from torchjax._compat._torch import is_fake, is_zerotensor, set_grad_enabled, tensor_version
from torchjax._convert import (
    call_widening,
    canonical_torch_dtype,
    check_has_data,
    several_devices,
    tensor_to_jax,
    torch_dtype,
    widens,
)
from torchjax._errors import (
    ConversionError,
    CopyWarning,
    OutputMismatchError,
    TorchJaxError,
    warn,
)
from torchjax._log import logger
from torchjax._primitive._params import ARRAY, is_operand
from torchjax._to_jax import _hot as hot_paths
from torchjax._to_jax._call._cuda import gpu_oom_note
from torchjax._to_jax._call._guard import (
    check_versions,
    inplace_error,
    owns_memory_alone,
    refuse_writes,
    same_bytes,
)
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


@functools.lru_cache(maxsize=1024)
def leaf_paths(tree: Any) -> list[tuple]:
    """The key path of every leaf of a treedef, in flattening order (for messages)."""
    dummy = _tree.tree_unflatten(tree, range(tree.num_leaves))
    return [p for p, _ in _tree.tree_flatten_with_path(dummy)[0]]


class CallPlan:
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
        grad_was_enabled = _is_grad_enabled()
        if self.grad_mode:
            set_grad_enabled(True)
        refused = False
        try:
            if self.direct is not None:
                out = as_jax_tree(self.direct(*tensors))
            else:
                out = self.fn(*_tree.tree_unflatten(self.in_tree, self._fill(tensors)))
        except Exception as e:
            refused = self.refused(e, tensors)
        finally:
            if self.grad_mode:
                set_grad_enabled(grad_was_enabled)
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
        self.refused_at = _innermost_line(error)
        return True

    def _run(self, tensors: list[torch.Tensor]) -> Any:
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
            self._explain(error, tensors or [])
            raise error
        raise err from error

    def _explain(self, error: Exception, tensors: list) -> None:
        """Notes on the user's own exception, where torchjax knows more of the cause."""
        if isinstance(error, torch.cuda.OutOfMemoryError):
            note = gpu_oom_note(jax.devices())
            if note is not None:
                error.add_note(note)
        if wants_int64(error) and not jax.config.jax_enable_x64 and not _convert.WIDEN_INT32:
            if any(t.dtype == torch.int32 for t in tensors):
                error.add_note(INT32_NOTE)
        if self.fn is self.fn.root and tensors:
            note = self._dtype_note(error, tensors)
            if note is not None:
                error.add_note(note)
        if expects_tensor(error) and self.fn is self.fn.root and self.has_statics:
            paths = leaf_paths(self.in_tree)
            numbers = [
                self.fn.arg_path(paths[i])
                for i, leaf in enumerate(self.template)
                if leaf is not ARRAY and isinstance(leaf, bool | int | float | complex)
            ]
            if numbers:
                error.add_note(NUMBER_NOTE.format(paths=", ".join(numbers[:6])))

    def _dtype_note(self, error: Exception, tensors: list) -> str | None:
        """DTYPE_NOTE where torch's message names a dtype an argument reached torch with
        and another that no argument had (what the torch code wanted), else None."""
        named = mismatched_dtypes(error)
        if len(tensors) != len(self.positions) or not named:
            return None
        widened = (
            _convert.WIDEN_INT32
            and not jax.config.jax_enable_x64
            and not self.fn.facts.get("keeps_int32")
        )
        reached = []
        for t in tensors:
            widen = widened and t.dtype is torch.int32
            reached.append(("int64" if widen else str(t.dtype).removeprefix("torch."), widen))
        wanted = [d for d in named if d not in {r for r, _ in reached}]
        got = [(k, r, w) for k, (r, w) in enumerate(reached) if r in named]
        if not wanted or not got:
            return None
        parts = []
        for k, dtype, widen in got[:4]:
            how = " (from JAX's int32: with x64 off, integer inputs reach torch as int64)"
            parts.append(f"{self.input_path(k)} as {dtype}{how if widen else ''}")
        first = self.input_path(got[0][0])
        return DTYPE_NOTE.format(
            got="; ".join(parts), wanted=" or ".join(wanted), first=first, dtype=wanted[0]
        )

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

    def check_outputs(self, out: Any, strict: bool) -> Any:
        """run's output checks, on fn's output `out` (the only reference to it: see
        owns_memory_alone)."""
        if self.one_tensor_out and type(out) is torch.Tensor and not self.grad_mode:
            if out.dtype is self.out_dtypes[0] and out.shape == self.out_shapes[0]:
                # the common case, checked; an output on a graph (closed-over parameters
                # that require grad) leaves it, as DLPack takes no such tensor
                return [out.detach() if out.requires_grad else out]
            results = [out]
        else:
            results, got_tree = _tree.tree_flatten(out)
            if got_tree != self.out_tree:
                if not strict:
                    return None, [out]
                self._raise_structure(got_tree)
        del out  # the outputs' only references are now in `results` (see owns_memory_alone)
        if self.grad_mode:
            results = [materialized(v) for v in results]
        for k in range(len(results)):
            value = results[k]
            if type(value) is not torch.Tensor or value.dtype is not self.out_dtypes[k]:
                if not strict and not self._coerces(k, value):
                    return None, [_tree.tree_unflatten(self.out_tree, results)]
                results[k] = self._coerce(k, value)
            elif value.shape != self.out_shapes[k]:
                if not strict:
                    return None, [_tree.tree_unflatten(self.out_tree, results)]
                self._raise_mismatch(k, value)
            elif value.requires_grad:  # (see the common case above)
                results[k] = value.detach()
        return results

    def _coerces(self, k: int, value: Any) -> bool:
        """Whether _coerce(k, value) succeeds: a number, or a tensor of the declared shape
        whose dtype becomes the declared one under JAX's x64 policy."""
        if isinstance(value, bool | int | float | complex):
            return self.out_shapes[k] == ()
        if not isinstance(value, torch.Tensor) or is_fake(value):
            return False
        want = self.out_dtypes[k]
        return value.shape == self.out_shapes[k] and canonical_torch_dtype(value.dtype) == want

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
        if isinstance(value, torch.Tensor) and is_fake(value):
            raise fake_output_error(self.name, self.out_paths[k])
        if not isinstance(value, torch.Tensor):
            if isinstance(value, bool | int | float | complex):
                if self.out_shapes[k] != ():  # (under jit a copy would broadcast it)
                    self._raise_mismatch(k, value)
                return number_tensor(value, want, self.out_paths[k])
            raise OutputMismatchError(
                f"{self.name} returned a {type(value).__name__} at {self.out_paths[k]}; a "
                f"function wrapped by to_jax must return tensors, Python numbers, or pytrees "
                f"of them."
            )
        if value.shape != self.out_shapes[k] or canonical_torch_dtype(value.dtype) != want:
            self._raise_mismatch(k, value)
        return value.detach() if value.requires_grad else value

    def _raise_structure(self, got: Any) -> None:
        text = (
            f"{self.name} returned an output of structure {got}, but {self.out_tree} was "
            f"declared (result_shape_dtypes) or inferred (fake-tensor run)."
        )
        if str(got) == str(self.out_tree):
            twin = _twin_class(got, self.out_tree)
            named = f" ({twin.__qualname__}, two class objects of one name)" if twin else ""
            text += (
                f" The two print alike, so a node's class differs between calls{named}: a "
                f"namedtuple or other class created inside the function on every call is a "
                f"new class each time. Define it once, at module level."
            )
        raise OutputMismatchError(text)

    def _raise_mismatch(self, k: int, value: torch.Tensor | bool | int | float | complex) -> None:
        s = self.structs[k]
        if isinstance(value, torch.Tensor):
            got = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        else:
            got = f"the Python number {value!r} (a 0-d array)"
        raise OutputMismatchError(
            f"{self.name} returned {got} at {self.out_paths[k]}, but {s.dtype}{list(s.shape)} was "
            f"declared (result_shape_dtypes) or inferred (fake-tensor run). Make "
            f"result_shape_dtypes match what the function returns, or make the function's "
            f"output independent of the input values. Types are found once per input "
            f"signature and kept: if the types follow state the function reads besides its "
            f"inputs (a module attribute, a closed-over tensor) that changed since, wrap the "
            f"function again (a new to_jax) and trace that."
        )

    def input_path(self, k: int) -> str:
        return self.fn.arg_path(leaf_paths(self.in_tree)[self.positions[k]])

    def raise_mutated(self, tensors: list) -> None:
        names = [self.input_path(k) for k in range(len(tensors))]
        check_versions(tensors, [0] * len(tensors), names, self.name, "seen after the real call")


FAKE_OUTPUT = """\
{name} returned a FakeTensor at {where}: a tensor without data, made when torchjax found the
function's output types by running it on fake tensors (under jax.jit or another transform),
and kept by state the function reads (a cache, a global, an object's attribute) into this
real call. torchjax puts back what it can reach from the function (the modules it closes
over, functools.lru_cache caches); this one it could not. Declare the output types, so
that no fake run happens, and rebuild the object that holds the fake tensor:

    to_jax(fn, result_shape_dtypes=jax.ShapeDtypeStruct(shape, dtype))"""


def fake_output_error(name: str, where: str) -> ConversionError:
    return ConversionError(FAKE_OUTPUT.format(name=name, where=where))


INT32_NOTE = (
    "(torchjax: JAX's x64 mode is off, so JAX's integer arrays are int32, and this torch "
    "op wants int64 indices. TORCHJAX_WIDEN_INT32=0 is set, which hands torch the int32 "
    "arrays as they are: unset it (int32 inputs then reach torch as int64), cast them "
    "inside the function, `index.long()`, or turn x64 on: "
    "jax.config.update('jax_enable_x64', True).)"
)
DTYPE_NOTE = (
    "(torchjax: torch got {got}, where the torch code wanted {wanted}. Pass arrays of the "
    "dtype it wants: convert before the call, e.g. `{first}.astype(jnp.{dtype})`.)"
)
NUMBER_NOTE = (
    "(torchjax: {paths} reached the function as Python numbers, as they were passed: to_jax "
    "hands torch JAX arrays as tensors and every other leaf as it is (a list or dict of "
    "numbers stays one). Pass a JAX array where the function takes a tensor, e.g. "
    "jnp.asarray(values).)"
)


ON_COPIES = """\
{name} asked one of its inputs for a writable pointer without writing to it{at} (.numpy(),
data_ptr(), np.asarray(t), a compiled or extension kernel, a Triton launch). The in-place
guard refuses writable pointers to the caller's arrays, so this call ran again on copies of
its inputs, and later calls of this signature run on copies too: one copy per input per
call. In your own code, read addresses with tensor.const_data_ptr() instead of data_ptr(),
and copy explicitly what must become numpy (t.clone().numpy()), to stay zero-copy. Where
torch's own code asks (some kernels do: a bidirectional LSTM's, a weight_norm
parametrization's, torch.compile'd code), nothing in yours can avoid the copies, and the
warning may be silenced:
    warnings.filterwarnings("ignore", category=torchjax.errors.CopyWarning)"""


def _innermost_line(error: BaseException) -> str:
    """The last Python line the error passed through ("rnn.py:1124 in forward"): where
    the pointer was asked for, or the call into the kernel that asked."""
    tb = error.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno} in {code.co_name}"


class _RetryWithAutograd(Exception):
    """A derived call to run again with torch.autograd (see CallPlan.invoke)."""


def number_tensor(value: bool | int | float | complex, dtype: torch.dtype, where: str):
    """A Python number output as a 0-d tensor of `dtype`; an int that does not fit raises."""
    try:
        t = torch.tensor(value, dtype=dtype)
        # A finite float that overflows float32 (x64 off) would become inf without a word,
        # where a float64 tensor of it raises: the same error for both.
        if not isinstance(value, int) and bool(t.isinf().any()):
            if not math.isinf(abs(complex(value))):
                raise OverflowError
        return t
    except (RuntimeError, OverflowError):
        raise ConversionError(
            f"{where}: the Python number {value} does not fit {dtype}, its type as a JAX "
            f"array{'' if jax.config.jax_enable_x64 else ' while x64 is off'}. Return a "
            f"tensor of a wider dtype"
            f"{'' if jax.config.jax_enable_x64 else ', and enable x64'}, or a smaller number."
        ) from None


def _twin_class(a: Any, b: Any) -> type | None:
    """The first node class of treedef `a` that has the name of `b`'s class at the same
    place but is another class object, or None."""
    try:
        kind_a, kind_b = (a.node_data() or (None,))[0], (b.node_data() or (None,))[0]
        children = zip(a.children(), b.children(), strict=True)
    except Exception:  # a JAX without node_data, or structures that differ in shape
        return None
    if kind_a is not kind_b and isinstance(kind_a, type) and isinstance(kind_b, type):
        if kind_a.__qualname__ == kind_b.__qualname__:
            return kind_a
    for child_a, child_b in children:
        found = _twin_class(child_a, child_b)
        if found is not None:
            return found
    return None


def materialized(value: Any) -> Any:
    """A derived call's output as data JAX can take: torch.func may return a lazy ZeroTensor (a
    tangent or gradient known to be zero, which has no storage for DLPack), and autograd
    outputs that are still on a tape."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.requires_grad:
        value = value.detach()
    if is_zerotensor(value):
        value = torch.zeros(value.shape, dtype=value.dtype, device=value.device)
    return value


def to_jax_outputs(results: list, paths: list, device: Any = None) -> list:
    """The flat outputs of an eager call as JAX arrays on `device` (None: JAX's CPU).

    An output is handed over without a copy only where nothing but the output reaches its
    memory: one that shares it with an input, a closed-over tensor, a parameter, a cache or
    a view of any of them is copied first, or torch could change the JAX array later.
    With `device` None (no input committed to a device) and several devices, the outputs
    are not committed either, as JAX's own results on such inputs.
    """
    outs = []
    for k in range(len(results)):
        value = results[k]
        try:
            if not owns_memory_alone(value, 2):  # our references: the list's and `value`
                value = value.clone(memory_format=torch.contiguous_format)
        except RuntimeError:
            check_has_data(value, paths[k])  # a sparse or meta tensor: say so
            raise
        out = tensor_to_jax(value, paths[k], device)
        if device is None and several_devices(out.platform()):
            out = uncommitted(out)  # as JAX places an op's result on uncommitted inputs
        outs.append(out)
    return outs


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
    widen = flat_fn is not None and widens(in_dtypes)
    return CallPlan(fn, in_tree, template, structs, out_tree, flat_fn, widen)


def _widening(fn: Callable, facts: dict) -> Callable:
    def call(*tensors: torch.Tensor) -> Any:
        return call_widening(fn, facts, *tensors)

    return call


def plan_parts(args: tuple, out_types: Any) -> tuple:
    """(operands, in_tree, template, structs, out_tree) of a call of `args` with these
    output types: plan_for's arguments after the operands."""
    leaves, in_tree = _tree.tree_flatten(args)
    operands = [x for x in leaves if is_operand(x)]
    template = tuple(ARRAY if is_operand(x) else x for x in leaves)
    structs, out_tree = _tree.tree_flatten(out_types)
    return operands, in_tree, template, tuple(structs), out_tree
