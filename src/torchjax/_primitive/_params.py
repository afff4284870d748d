# The values PytreePrimitive passes around: operand placeholders, linear-input markers,
# per-signature output types, and the helpers that rebuild pytrees from flat operands.
# Split from _core.py so the class there reads as bind plus one adapter per rule.
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from torchjax._compat._jax import ARRAY_TYPES, core, manual_axes_of
from torchjax._errors import OutputMismatchError, StaticArgumentError

_tree = jax.tree_util


class ArrayLeaf:
    """Placeholder for an operand's position among the static leaves (a singleton)."""

    def __repr__(self) -> str:
        return "<array>"


ARRAY = ArrayLeaf()


class Linear:
    """Marks an argument leaf that is a linear input of a transpose rule.

    A transpose rule receives a `Linear` wherever the primal value is undefined, i.e.
    where JAX asks for a cotangent. Test for it with ``isinstance(x, PytreePrimitive.Linear)``.

    Attributes:
      shape: the input's shape.
      dtype: the input's dtype.
      aval: the input's ``jax.core.ShapedArray``.
    """

    __slots__ = ("aval",)

    def __init__(self, aval: core.ShapedArray):
        self.aval = aval

    @property
    def shape(self) -> tuple[int, ...]:
        return self.aval.shape

    @property
    def dtype(self) -> np.dtype:
        return self.aval.dtype

    def __repr__(self) -> str:
        return f"Linear({self.aval.str_short()})"


class Signature:
    """The output side of one bind signature, found once by abstract_eval and reused.

    One object per distinct (structure, static leaves, avals, params), so rules may memoize
    per-signature work in ``memo`` (a dict). Travels as the ``signature`` param of the
    underlying primitive; compares by value (``out_tree``, ``out_avals``).
    """

    __slots__ = ("out_tree", "out_avals", "memo", "_hash", "_out_types", "_traced")

    def __init__(self, out_tree: Any, out_avals: tuple):
        self.out_tree, self.out_avals = out_tree, out_avals
        self.memo: dict = {}
        self._hash = hash((out_tree, out_avals))
        self._out_types = None
        self._traced: Signature | None = None

    @property
    def traced(self) -> Signature:
        """This signature as the params of traced calls carry it: equal to it, with a memo
        of its own. JAX's caches keep params, so eager work kept in this memo (which may
        refer to the function) stays out of them and dies with the function."""
        if self._traced is None:
            self._traced = Signature(self.out_tree, self.out_avals)
            self._traced._out_types = self._out_types
        return self._traced

    @property
    def out_types(self) -> Any:
        """The outputs as a pytree of ``jax.ShapeDtypeStruct`` (shared: do not mutate)."""
        if self._out_types is None:
            structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.out_avals]
            self._out_types = _tree.tree_unflatten(self.out_tree, structs)
        return self._out_types

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Signature)
            and self.out_tree == other.out_tree
            and self.out_avals == other.out_avals
        )

    def __repr__(self) -> str:
        return f"Signature({self.out_tree}, {[a.str_short() for a in self.out_avals]})"


OPERAND_TYPES = ARRAY_TYPES  # a tuple: isinstance's fastest form


def is_operand(x: Any) -> bool:
    return isinstance(x, OPERAND_TYPES)


def as_operand(x: Any) -> Any:
    """An operand as an array. JAX hands rules the values it was given: a Python or numpy
    scalar (or JAX's own typed literal) where an array was bound, the differentiated
    `x` of jax.grad(f)(2.0) or a cotangent 1.0 among them. A leaf's role is fixed at bind:
    an operand there stays an operand in every rule (rules tell operands from static leaves
    by type), so such a value becomes the array it stands for."""
    return x if isinstance(x, OPERAND_TYPES) else jnp.asarray(x)


def as_operands(xs: Any) -> list:
    return [x if isinstance(x, OPERAND_TYPES) else jnp.asarray(x) for x in xs]


class BoundParams:
    """A primitive's keyword params as bound: sorted ``(name, value)`` pairs, checked
    hashable once, and the signature caches of calls made with them: ``signatures`` keyed
    by (structure, static leaves, avals, x64), ``eager_signatures`` by the same with plain
    shapes and dtypes in place of avals (cheaper to hash). They live and die with the
    params, so that a dropped function leaves nothing behind in a global cache. ``hot``
    is a subclass's own shortcut for the next eager call (see torch_call's HotCall)."""

    __slots__ = ("items", "eager_signatures", "signatures", "hot")

    def __init__(self, items: tuple):
        self.items = items
        self.eager_signatures: dict[tuple, Any] = {}  # Signature, or a subclass's own
        self.signatures: dict[tuple, Signature] = {}
        self.hot: Any = None

    def __reduce__(self) -> Any:
        return (BoundParams, (self.items,))  # the caches are this process's: not sent


def store(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= 4096:  # a bound for pathological callers: every call a new signature
        cache.clear()
    cache[key] = value


def same_static(a: Any, b: Any) -> bool:
    """Static leaves as jax.jit compares static arguments, type included: 1, 1.0 and True
    differ, though Python's == (and hash) identify them; floats (and complex numbers' parts)
    also by sign (-0.0 is not 0.0: torch.full((2,), -0.0) differs from torch.full((2,), 0.0))."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if type(a) is complex:  # both parts by sign: 0j is not complex(-0.0, 0.0)
        return same_static(a.real, b.real) and same_static(a.imag, b.imag)
    return bool(a == b)


class StaticLeaves(tuple):
    """A signature's static leaves (operands replaced by `ARRAY`), compared leaf by leaf
    with `same_static`: in the eager and abstract-eval caches and in the primitive's
    params, which JAX's own caches compare with ==."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, tuple)
            and len(self) == len(other)
            and all(map(same_static, self, other))
        )

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = tuple.__hash__


def path_str(prefix: str, path: tuple) -> str:
    return prefix + _tree.keystr(path)


def arg_path(path: tuple) -> str:
    # Paths of bind's positional args read as `args[0]['a']`.
    return "args" + _tree.keystr(path)


@functools.lru_cache(maxsize=1024)
def leaf_paths(tree: Any) -> list[tuple]:
    """The key path of every leaf of a treedef, in flattening order (for messages)."""
    dummy = _tree.tree_unflatten(tree, range(tree.num_leaves))
    return [p for p, _ in _tree.tree_flatten_with_path(dummy)[0]]


def call_path(path: tuple) -> str:
    """A key path into a call's (args, kwargs) as the user wrote the call: `args[0]['a']`,
    `kwargs['k']`."""
    head = "args" if path[0].idx == 0 else "kwargs"
    return head + _tree.keystr(tuple(path[1:]))


def check_hashable(
    value: Any, where: str, takes: str = "Non-array leaves are static values"
) -> None:
    """A StaticArgumentError naming `where` for an unhashable static leaf; `takes` says who
    takes non-array leaves as static values."""
    try:
        hash(value)
    except TypeError:
        raise StaticArgumentError(
            f"{where} is a {type(value).__name__}, which is neither an array nor hashable. "
            f"{takes}, which must be hashable (they are part of the jit cache key). Pass it "
            f"as an array, or as a tuple/frozenset instead."
        ) from None


def out_aval(leaf: Any, manual: core.ShapedArray | None) -> core.ShapedArray:
    """An output aval; inside shard_map it varies over the manual axes its inputs do."""
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    if manual is None:
        return core.ShapedArray(shape, dtype)
    sharding = jax.sharding.NamedSharding(manual.sharding.mesh, jax.P(*([None] * len(shape))))
    return core.ShapedArray(shape, dtype, sharding=sharding, **manual_axes_of(manual))


def flatten_checked(name: str, out: Any, out_tree: Any, out_avals: tuple, rule: str) -> list:
    """A rule's output flattened, after checking it against what abstract_eval declared."""
    leaves, tree = _tree.tree_flatten(out)
    if tree != out_tree:
        raise OutputMismatchError(
            f"{name}: the {rule} rule returned an output of structure {tree}, but "
            f"abstract_eval declared {out_tree}."
        )
    paths = None
    for i, (leaf, aval) in enumerate(zip(leaves, out_avals, strict=True)):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype != aval.dtype or tuple(shape) != aval.shape:
            if paths is None:
                paths = [p for p, _ in _tree.tree_flatten_with_path(out)[0]]
            got = f"{type(leaf).__name__}" if shape is None else f"{dtype}{list(shape)}"
            raise OutputMismatchError(
                f"{name}: the {rule} rule returned {got} at {path_str('out', paths[i])}, but "
                f"abstract_eval declared {aval.str_short()}. Make the rule and abstract_eval "
                f"agree."
            )
    return leaves


def eager_type(x: Any) -> tuple:
    return (x.shape, x.dtype, getattr(x, "weak_type", False))


def rebuild(in_tree, statics: tuple, operands, fill: Any = ARRAY) -> tuple:
    """Bind's positional args, with `operands` at the array positions.

    With `fill` given, static positions get `fill` instead of their value (used to build
    the batch-axes and tangent trees, which hold None at static leaves).
    """
    it = iter(operands)
    if fill is ARRAY:
        leaves = [next(it) if s is ARRAY else s for s in statics]
    else:
        leaves = [next(it) if s is ARRAY else fill for s in statics]
    return _tree.tree_unflatten(in_tree, leaves)


def broadcast_prefix(value: Any, tree, rule: str, name: str, what: str) -> list:
    """Flatten `value` (an int/None/array per leaf of `tree`, or one for all) to a list."""
    if value is None or isinstance(value, int):
        return [value] * tree.num_leaves
    try:
        return tree.flatten_up_to(value)
    except (ValueError, TypeError) as e:
        got = _tree.tree_structure(value, is_leaf=lambda x: x is None)
        raise OutputMismatchError(
            f"{name}: the {rule} rule returned {what} of structure {got}, which is not a "
            f"prefix of the output's structure {tree} ({e}). Return one value for every "
            f"output, or one per output leaf in the output's own structure."
        ) from None
