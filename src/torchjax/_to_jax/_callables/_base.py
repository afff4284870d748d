# What every torch callable a torch_call binds declares, and what derived ones share.
#
# `torch_call_p.bind(*args, fn=fn, options=options)` means "fn(*args), computed by torch".
# The rules and the call plan read a callable only through the contract TorchCallable
# declares here: how its arguments are laid out (`parts`), whether it maps a batch, how
# many residuals follow its outputs, whether it holds module state while it runs, its
# output types (`out_types`, from its inner function's: only the user's function is ever
# fake-run) and how its failures reach the user (`call_failure`). Each family lives in a
# file of its own (see this package's __init__ for the table of them).
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import numpy as np
import torch

from torchjax._compat._torch import is_functorch_wrapped
from torchjax._primitive._params import ARRAY
from torchjax._to_jax._call._callback_errors import TORCHJAX_DIR
from torchjax._to_jax._torch_ops._residual import (
    enter_derived_call,
    exit_derived_call,
)

_tree = jax.tree_util


# types_of(fn, *args): the output types of fn(*args) under the call's options. The abstract
# eval rule hands it to out_types, so callables find their inner function's types without
# knowing the primitive that computes them.
TypesOf = Callable[..., Any]


class TorchCallable:
    """The contract of a callable bound to torch_call: what the rules and the plan read.

    Class attributes, overridden where a family differs:
      parts: the names of the call's positional arguments, in order: the argument layout
        (`layout` finds each part's leaves in a call's flattened arguments).
      grad_mode: whether the call switches torch's grad mode on (derived functions, whose
        torch.func transforms need it); False: it runs in the caller's mode.
      maps_a_batch: it maps a batch: over an empty batch, where every output is empty, it
        computes nothing either (CallPlan.empty_batch).
      n_residuals: how many residuals (a kept graph's handle, the RNG state) follow its
        outputs.
      holds_state: a module copy the call runs in stays as it is until the call is done
        (the forward of a derivative, read again by its backward); __call__ brackets the
        call with the module-state hold where it is set.
    """

    parts: ClassVar[tuple[str, ...]] = ()
    grad_mode: ClassVar[bool] = False
    maps_a_batch: ClassVar[bool] = False
    n_residuals: ClassVar[int] = 0
    holds_state: ClassVar[bool] = False

    @property
    def root(self) -> Any:
        """The user's function (a UserFunction) this one is derived from, or itself."""
        raise NotImplementedError

    def __call__(self, *args: Any) -> Any:
        if not self.holds_state:
            return self._call(*args)
        enter_derived_call()
        try:
            return self._call(*args)
        finally:
            exit_derived_call()

    def _call(self, *args: Any) -> Any:
        """The torch computation, on tensors laid out as `parts`."""
        raise NotImplementedError

    def arg_path(self, path: tuple) -> str:
        """How the user reads the argument at `path` of this call (``args[0]['w']``)."""
        raise NotImplementedError

    def out_types(self, types_of: TypesOf, *args: Any) -> Any:
        """The output types of ``self(*args)`` (args hold ShapedArrays), a pytree of
        ShapeDtypeStruct; `types_of(fn, *args)` gives another callable's."""
        raise NotImplementedError

    def call_failure(self, error: Exception, in_tree: Any = None) -> Exception:
        """The exception the user sees for `error`, raised by the call (`in_tree`: the
        call's argument structure, where the caller knows it)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of a call's arguments: its structure, and where its leaves are among the
    call's flattened leaves (``statics[start:stop]``)."""

    tree: Any
    start: int
    stop: int

    def operands(self, statics: tuple) -> tuple[int, int]:
        """The range of operands (array leaves) the part holds: (first, end)."""
        first = sum(1 for s in statics[: self.start] if s is ARRAY)
        return first, first + sum(1 for s in statics[self.start : self.stop] if s is ARRAY)


def layout(fn: TorchCallable, in_tree: Any) -> dict[str, Part]:
    """The parts of a call of `fn` with argument structure `in_tree`, by name."""
    kids = in_tree.children()
    if len(kids) != len(fn.parts):
        raise AssertionError(f"{type(fn).__name__} takes {fn.parts}, called with {in_tree}")
    found, start = {}, 0
    for name, kid in zip(fn.parts, kids, strict=True):
        found[name] = Part(kid, start, start + kid.num_leaves)
        start += kid.num_leaves
    return found


class DerivedFunction(TorchCallable):
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
    def root(self) -> Any:
        return self.inner.root

    @property
    def parts(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.inner.parts

    @property
    def grad_mode(self) -> bool:  # type: ignore[override]
        return self.inner.grad_mode

    @property
    def maps_a_batch(self) -> bool:  # type: ignore[override]
        """A derivative of a batched call maps the batch too."""
        return self.inner.maps_a_batch

    def arg_path(self, path: tuple) -> str:
        return self.inner.arg_path(path)

    def call_failure(self, error: Exception, in_tree: Any = None) -> Exception:
        return self.inner.call_failure(error, in_tree)


@dataclasses.dataclass(frozen=True)
class ZerosLike:
    """A static leaf standing for zeros of this shape and dtype (a linear input's point)."""

    shape: tuple
    dtype: np.dtype


def _theirs(error: Exception, name: str) -> Exception:
    """`error`, raised while the user's function `name` ran, with a note saying whose it
    is: the function's (raised in its code, or in torch's), or torchjax's own where the
    innermost frame of its traceback is in torchjax's source (a step of the call machinery
    around the function, such as putting back a module's state, failed)."""
    where = _torchjax_frame(error)
    if where is None:
        note = f"(raised by {name}, called through torchjax)"
    else:
        note = INTERNAL_NOTE.format(name=name, where=where)
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)
    return error


INTERNAL_NOTE = """\
(raised inside torchjax, at {where}, while it called {name}: torchjax's own failure, not
{name}'s. Unless the message above says why (out of memory, say), this is a bug in
torchjax: please report it, with this traceback.)"""


def _torchjax_frame(error: BaseException) -> str | None:
    """Where the innermost frame of `error`'s traceback is, if in torchjax's own source
    ("torchjax/_to_jax/_fake/_snapshots.py:95, in restore"); None if elsewhere."""
    tb = error.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = tb.tb_frame.f_code.co_filename
    if not path.startswith(TORCHJAX_DIR):
        return None
    where = "torchjax/" + path[len(TORCHJAX_DIR) :].replace(os.sep, "/")
    return f"{where}:{tb.tb_lineno}, in {tb.tb_frame.f_code.co_name}"


def _aval(x: Any) -> Any:
    return x if isinstance(x, jax.core.ShapedArray | jax.ShapeDtypeStruct) else jax.typeof(x)


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
