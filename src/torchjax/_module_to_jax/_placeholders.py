# Tensors without data that say why when torch computes with them: what a module's slots
# hold when no call's tensors are in them.
#
# A plain meta tensor is not enough: torch 2.13's F.linear of a CPU input and a meta weight
# returns uninitialized memory, without an error. A DatalessTensor is a meta tensor whose
# __torch_function__ answers questions about its type (shape, dtype, requires_grad, repr,
# copying, pickling) and raises a VariablesError with its own explanation for anything
# else. Idle copies of a module hold them between calls (a computation with one means the
# module kept a tensor outside its slots), and so does a module after
# module_to_jax(copy="move").
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from torchjax._errors import VariablesError

# `why` of a moved module's tensor: {name} is its place in variables.
MOVED = """\
{{func}} of {name}, which module_to_jax({module}, copy="move") moved into JAX variables:
the module holds only its type, shape and dtype now, no data. Call it from JAX as
apply(variables, ...), or put the weights back into the module first:
    module.load_state_dict(
        torchjax.tree_to_torch({{{{**variables["params"], **variables["buffers"]}}}}),
        assign=True)
(tied weights appear once in variables: for a model with them pass strict=False too, and
re-tie them after, e.g. model.tie_weights() in Hugging Face)."""

# `why` of an idle copy's tensor.
IDLE = """\
{{func}} of a tensor of {module} outside a call's slots: module_to_jax runs each call in a
private copy of the module, whose parameter and buffer slots hold that call's tensors
while it runs, and tensors without data otherwise. This one was reached some other way: a
reference kept in __init__ (a list, a closure, another object's attribute), or a tensor
read after the call returned. Read parameters and buffers through the module's attributes
(self.weight) when forward runs."""

# `why` of a tensor attribute computed from parameters before module_to_jax (see
# computed_attributes below).
COMPUTED = """\
{{func}} of {module}'s attribute {name}, a tensor computed from the module's parameters
before module_to_jax (not a parameter or buffer: torch.nn.utils.prune's and the old
torch.nn.utils.weight_norm's hooks set one). A call's private copy of the module holds it
without data: the hook that set it computes it again from the call's variables before
each forward, and this read came before that (or no hook computes it). Compute the tensor
in forward or in a forward pre-hook, or make it permanent first
(torch.nn.utils.prune.remove, torch.nn.utils.remove_weight_norm)."""

BATCHED = """\
{{func}} of a tensor of {module} in a backward under jax.vmap: the forward ran batched under
torch.func.vmap, and a backward that runs the module again (torch.utils.checkpoint, an
adjoint solver) would run it unbatched. Batch such a module with
to_jax(..., vmap_method="sequential"), or leave torch.utils.checkpoint out of the call
that jax.vmap batches."""

_GETTERS = "shape dtype device requires_grad is_leaf layout ndim is_meta is_cuda is_cpu is_sparse"
_GETTERS += " is_quantized is_nested grad grad_fn data itemsize"
_METHODS = "size dim numel nelement element_size is_floating_point is_complex stride"
_METHODS += " is_contiguous detach requires_grad_ __len__ __reduce_ex__ __setstate__ __deepcopy__"
_METHODS += " __hash__ _is_view"
# What a DatalessTensor answers: questions about its type, never about data it lacks.
_TYPE_QUESTIONS = frozenset(
    [getattr(torch.Tensor, name).__get__ for name in _GETTERS.split()]
    + [getattr(torch.Tensor, name) for name in _METHODS.split()]
)


class DatalessTensor(torch.Tensor):
    """A tensor's type, shape and dtype without data (meta); any computation with it raises
    a VariablesError that says why it has none (`why`, with `{func}` for the operation)."""

    why: str

    @staticmethod
    def __new__(cls, like: torch.Tensor, why: str) -> DatalessTensor:
        meta = torch.empty(like.shape, dtype=like.dtype, device="meta")
        t = torch.Tensor._make_subclass(cls, meta, like.requires_grad)
        t.why = why
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in _TYPE_QUESTIONS:
            out = super().__torch_function__(func, types, args, kwargs or {})
            if isinstance(out, DatalessTensor) and not hasattr(out, "why"):
                out.why = args[0].why  # detach() and .data keep the explanation
            return out
        found = (a for a in (*args, *(kwargs or {}).values()) if isinstance(a, DatalessTensor))
        why = getattr(next(found, None), "why", "{func} of a tensor without data")
        what = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise VariablesError(why.format(func=what))

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"DatalessTensor(shape={list(self.shape)}, dtype={self.dtype})"


def placeholder(t: torch.Tensor, why: str) -> torch.Tensor:
    """A DatalessTensor like `t`, a Parameter if `t` is one (a parameter of a tensor
    subclass, the way torch makes those), so that the slot keeps its kind."""
    empty = DatalessTensor(t, why)
    if isinstance(t, torch.nn.Parameter):
        empty = torch.nn.Parameter(empty, requires_grad=t.requires_grad)
        empty.why = why
    return empty


def computed_attributes(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Placeholders (id -> tensor) for the tensors computed from parameters that submodules
    hold as plain attributes: torch.nn.utils.prune's `weight` (weight_orig * weight_mask)
    and the old torch.nn.utils.weight_norm's, set when the hook is registered. deepcopy
    refuses such a tensor (it is not a graph leaf), and its graph reaches the module's own
    parameters, never a call's variables. Their hooks compute them again, from the call's
    tensors, before each forward reads them; any other read raises (COMPUTED) instead of
    using a value from outside the call."""
    found = {}
    for _, _, where, value in computed_tensor_attributes(module, remove_duplicate=False):
        why = COMPUTED.format(module=type(module).__name__, name=where)
        found.setdefault(id(value), placeholder(value, why))
    return found


def computed_tensor_attributes(
    module: torch.nn.Module, remove_duplicate: bool = True
) -> Iterator[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """(submodule, attribute, dotted name from `module`, tensor) for each tensor that a
    submodule of `module` holds as a plain attribute and that is not a graph leaf: one
    computed from parameters (see computed_attributes). Parameters and buffers live in
    their own dicts, not here."""
    for path, sub in module.named_modules(remove_duplicate=remove_duplicate):
        for key, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                yield sub, key, f"{path}.{key}" if path else key, value
