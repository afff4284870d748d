# A call plan's checks of fn's outputs against its signature's declared or inferred types:
# the tree, each output's shape and dtype, numbers made 0-d tensors, JAX's x64 policy on
# dtypes (a float64 output is float32's where x64 is off), and the messages of a mismatch.
from __future__ import annotations

import math
from typing import Any

import jax
import torch

from torchjax._compat._torch import is_fake, is_zerotensor
from torchjax._convert import canonical_torch_dtype
from torchjax._errors import ConversionError, OutputMismatchError

_tree = jax.tree_util


class OutputChecks:
    """CallPlan's output checks. They read the plan's name, out_tree, structs, out_shapes,
    out_dtypes, out_paths, one_tensor_out and grad_mode."""

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
