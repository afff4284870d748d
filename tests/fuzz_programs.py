"""A differential program fuzzer: random torch programs, run by torch and through to_jax.

Bugs live in how ops compose (a write into a fresh buffer that loses its gradient, float64
arithmetic computed in float32), not in single ops, which the OpInfo sweep covers. Not a test
module (pytest collects ``test_*.py`` only); tests/fuzz_suite.py runs it (in a
fresh process of its own: tests/test_fuzz.py). Three parts:

* ``OPS``, the op table. An entry has a name, ``when`` (which state tensors it can take) and
  ``build``, which draws the op's extra arguments (dims, slices, literal index tensors, the
  smooth function applied) from hypothesis strategies and renders the op as lines of torch
  code; ``Op.apply`` runs those lines on torch values.
* ``programs()``, a hypothesis strategy for a ``Program``: 2-10 ops applied to a state (the
  live tensors, starting with the inputs ``x`` and ``y``), rendered as the source of
  ``def program(x, y)``, which returns a float32 scalar (a weighted sum of every tensor the
  ops made). What runs is what is printed: the function is the ``exec`` of that source, so a
  failure's source (``Program.repro``) is a complete reproduction.
* the oracle, ``check(program, lowering)``: the program through ``torchjax.to_jax(program,
  lowering=L)`` under ``jax.jit`` (value), ``jax.grad``, ``jax.vmap`` (a leading batch axis)
  and ``jax.jvp``, JAX's x64 off, against torch itself: the eager value, ``torch.autograd``'s
  gradient, a loop over the examples (torch.func.vmap only says where the callback path,
  built on it, may refuse), and ``torch.func.jvp``; for lowering="xla", plain JAX whose
  forward derivative is its reverse one's transpose, the gradient's inner product with the
  tangent passes too (the two differ where torch's forward mode ignores a ``torch.no_grad()``
  block, a documented difference, docs/limitations.md, and where torch's own forward formula
  is wrong). Each (lowering, transform) is "pass", "refused" (lowering="xla" raising
  ``LoweringError``, or lowering="callback" failing where the torch.func transform it is
  built on fails on the program itself) or "mismatch" (a wrong number, or any other
  exception).

Programs are deterministic and differentiable almost everywhere, with margins: smooth
functions only (no abs, no clamp, guarded divisions), amax/amin/max and scatter_reduce's
amax/amin over ``tanh(v) + 2.5 * <a permutation>`` (a unique maximum by a margin of 0.5), a
norm of ``v + 0.37`` (structural zeros are common: a zeros_like buffer), ``scatter`` and
``index_put_`` without accumulation only with distinct indices, no in-place write into a
tensor another op reads. The tolerance is float32's, plus what the reference itself moves
when the inputs move by a few float32 ulps (cancellation; a float-to-int cast near a step).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import re
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from hypothesis import strategies as st

import torchjax
from torchjax.errors import LoweringError

LOWERINGS = ("callback", "xla")
TRANSFORMS = ("jit", "grad", "vmap", "jvp")
# Which torch.func transform lowering="callback" builds each JAX transform on: where that
# one fails on the program itself, the callback path cannot do better (a refusal, not a bug).
_TORCH_FUNC_OF = {"jit": None, "grad": "grad", "vmap": "vmap", "jvp": "jvp"}

MAX_NUMEL = 24  # per state tensor: literal index tensors stay readable
MAX_RANK = 3
MAX_DIM = 4

Shape = tuple[int, ...]

# ---------------------------------------------------------------------------------------
# Rendering helpers
# ---------------------------------------------------------------------------------------

# Smooth functions of one tensor ({0}), bounded or slowly growing, defined everywhere.
UNARY = (
    "torch.sin({0})",
    "torch.cos({0})",
    "torch.tanh({0})",
    "torch.sigmoid({0})",
    "torch.exp(-{0} * {0})",
    "torch.log1p({0} * {0})",
    "torch.sqrt(1 + {0} * {0})",
    "{0} / (1 + {0} * {0})",
    "torch.nn.functional.softplus({0})",
    "torch.erf({0})",
    "torch.atan({0})",
    "2 * {0} - 0.5",
    "{0} * torch.sigmoid({0})",
    "torch.exp(torch.tanh({0}))",
    "torch.rsqrt(2 + torch.cos({0}))",
)
CONSTANTS = (0.5, -1.5, 2.0, 0.25, 3.0)
_ATOM = re.compile(r"^[A-Za-z_][\w.]*(\(\))?(\[[^\[\]]*\])?$")  # x, x.double(), x[1:]


def paren(expr: str) -> str:
    """`expr` as an operand: a name, a method call without arguments or a subscripted name
    as is, anything else in parens."""
    return expr if _ATOM.match(expr) else f"({expr})"


def smooth(template: str, expr: str) -> str:
    return template.format(paren(expr))


def literal(array: np.ndarray) -> str:
    """`torch.tensor(<nested list>)` for an int, bool or float numpy array."""
    return f"torch.tensor({array.tolist()!r})"


def shape_text(shape: Shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def index_at(dim: int, item: str) -> str:
    """The subscript selecting `item` along `dim`: `[:, item]` for dim 1."""
    return "[" + ":, " * dim + item + "]"


def numel(shape: Shape) -> int:
    return math.prod(shape)


def broadcast(a: Shape, b: Shape) -> Shape | None:
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


# ---------------------------------------------------------------------------------------
# The op table
# ---------------------------------------------------------------------------------------


class Ctx:
    """What an op's `build` sees: hypothesis's `draw`, the state (name -> shape), the name
    of the tensor it makes, and helpers drawing common arguments."""

    def __init__(self, draw: Callable, state: dict[str, Shape], out: str):
        self.draw, self.state, self.out = draw, state, out
        self.dynamic = False  # the op's output shape depends on values (a boolean mask)

    def room(self, shape: Shape, dim: int) -> int:
        """The largest size along `dim` (at most MAX_DIM) that keeps `shape` small."""
        rest = numel(shape) // shape[dim] if shape[dim] else 1
        return max(1, min(MAX_DIM, MAX_NUMEL // max(1, rest)))

    def unary(self) -> str:
        return self.draw(st.sampled_from(UNARY))

    def const(self) -> float:
        return self.draw(st.sampled_from(CONSTANTS))

    def dim(self, shape: Shape, at_least: int = 1) -> int:
        dims = [d for d, n in enumerate(shape) if n >= at_least]
        return self.draw(st.sampled_from(dims))

    def ints(self, shape: Shape, high: int, unique_along: int | None = None) -> np.ndarray:
        """A literal int64 tensor of `shape` with values in [0, high); with `unique_along`,
        every 1-D slice along that dim holds distinct values (needs shape[dim] <= high)."""
        if unique_along is None:
            flat = self.draw(
                st.lists(st.integers(0, high - 1), min_size=numel(shape), max_size=numel(shape))
            )
            return np.array(flat, dtype=np.int64).reshape(shape)
        moved = list(shape)
        n = moved.pop(unique_along)
        rows = [self.draw(st.permutations(range(high)))[:n] for _ in range(numel(tuple(moved)))]
        out = np.array(rows, dtype=np.int64).reshape((*moved, n))
        return np.moveaxis(out, -1, unique_along)

    def mask(self, shape: Shape, some_true: bool = False) -> np.ndarray:
        flat = self.draw(st.lists(st.booleans(), min_size=numel(shape), max_size=numel(shape)))
        if some_true and not any(flat):
            flat[0] = True
        return np.array(flat, dtype=bool).reshape(shape)

    def tiebreak(self, expr: str, shape: Shape) -> str:
        """`tanh(expr) + 2.5 * P` for a random permutation P: a unique max/min by 0.5."""
        perm = np.array(self.draw(st.permutations(range(numel(shape)))), dtype=np.float32)
        return f"torch.tanh({expr}) + 2.5 * {literal(perm.reshape(shape))}"

    def index_source(self, length: int, high: int) -> str:
        """An int64 index tensor of `length` values in [0, high): a literal, or computed in
        int64 arithmetic (a cast path of its own under lowering="xla")."""
        if self.draw(st.booleans()):
            k = self.draw(st.integers(1, 3))
            c = self.draw(st.integers(0, 3))
            return f"(torch.arange({length}) * {k} + {c}) % {high}"
        return literal(self.ints((length,), high))

    def other(self, shape: Shape) -> str | None:
        """A state tensor broadcastable with `shape` (a small result), or None."""
        names = [
            n
            for n, s in self.state.items()
            if (b := broadcast(shape, s)) is not None and numel(b) <= MAX_NUMEL
        ]
        return self.draw(st.sampled_from(names)) if names else None

    def buffer(self, a: str, shape: Shape, like: bool) -> str:
        """A fresh tensor made from `a` (same dtype): zeros_like / new_zeros / full_like /
        empty_like + fill_ ...; of `a`'s own shape when `like`, else of `shape`."""
        c = self.const()
        if like:
            choices = [
                f"torch.zeros_like({a})",
                f"torch.ones_like({a})",
                f"torch.full_like({a}, {c})",
                f"torch.empty_like({a}).fill_({c})",
            ]
        else:
            choices = []
        s = shape_text(shape)
        choices += [
            f"{a}.new_zeros({s})",
            f"{a}.new_ones({s})",
            f"{a}.new_full({s}, {c})",
            f"{a}.new_empty({s}).fill_({c})",
            f"torch.zeros({s}, dtype={a}.dtype)",
        ]
        return self.draw(st.sampled_from(choices))


Build = Callable[[Ctx, str, Shape], list[str]]


@dataclasses.dataclass(frozen=True)
class Op:
    """One entry of the op table: `build(ctx, a, shape)` draws the op's extra arguments and
    returns its lines of torch code, which read the state tensor `a` (of `shape`; others
    through `ctx.state`) and assign `ctx.out`; `when(shape)` says which `a` it takes."""

    name: str
    build: Build
    when: Callable[[Shape], bool] = lambda s: True
    kind: str = ""
    rare: bool = False  # drawn at 1 step in 30: lowering="xla" refuses the whole program

    def apply(self, lines: Sequence[str], values: dict[str, torch.Tensor], out: str):
        """Runs the op's rendered `lines` on torch `values` (name -> tensor); its result."""
        namespace = {"torch": torch, **values}
        exec("\n".join(lines), namespace)  # noqa: S102 - our own rendered code
        return namespace[out]


OPS: list[Op] = []


def op(name: str, kind: str, when: Callable[[Shape], bool] = lambda s: True, rare=False):
    def register(build: Build) -> Build:
        OPS.append(Op(name, build, when, kind, rare))
        return build

    return register


rank_ge = lambda r: lambda s: len(s) >= r  # noqa: E731
dim_ge = lambda n: lambda s: any(d >= n for d in s)  # noqa: E731

# -- elementwise math, broadcasting ----------------------------------------------------


@op("unary", "elementwise")
def _unary(c: Ctx, a: str, s: Shape) -> list[str]:
    return [f"{c.out} = {smooth(c.unary(), a)}"]


@op("scalar", "elementwise")
def _scalar(c: Ctx, a: str, s: Shape) -> list[str]:
    k = c.const()
    form = c.draw(st.sampled_from([f"{a} * {k} + 1", f"{k} - {a}", f"{a} / {k}", f"{a} ** 2"]))
    return [f"{c.out} = {form}"]


@op("binary", "broadcasting")
def _binary(c: Ctx, a: str, s: Shape) -> list[str]:
    b = c.other(s)
    assert b is not None  # `a` itself always qualifies
    shape = broadcast(s, c.state[b])
    forms = [
        f"{a} + {b}",
        f"{a} - {b}",
        f"{a} * {b}",
        f"{a} / (1 + {b} * {b})",
        f"torch.lerp({a}, {b}, 0.3)",
        f"torch.where({literal(c.mask(shape))}, {a}, {b})",
    ]
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


@op("softmax", "elementwise", rank_ge(1))
def _softmax(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    fn = c.draw(st.sampled_from(["torch.softmax", "torch.log_softmax", "torch.cumsum"]))
    return [f"{c.out} = {fn}({a}, {d})"]


# -- views -----------------------------------------------------------------------------


@op("slice", "view", dim_ge(2))
def _slice(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s, 2)
    start = c.draw(st.integers(0, s[d] - 1))
    stop = c.draw(st.integers(start + 1, s[d]))
    step = c.draw(st.sampled_from([1, 2]))
    item = f"{start or ''}:{stop if stop < s[d] else ''}" + (f":{step}" if step > 1 else "")
    return [f"{c.out} = {a}{index_at(d, item)}"]


@op("narrow", "view", dim_ge(2))
def _narrow(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s, 2)
    start = c.draw(st.integers(0, s[d] - 1))
    length = c.draw(st.integers(1, s[d] - start))
    return [f"{c.out} = {a}.narrow({d}, {start}, {length})"]


@op("transpose", "view", rank_ge(2))
def _transpose(c: Ctx, a: str, s: Shape) -> list[str]:
    perm = c.draw(st.permutations(range(len(s))))
    d0, d1 = c.draw(st.sampled_from(list(itertools.combinations(range(len(s)), 2))))
    forms = [f"{a}.transpose({d0}, {d1})", f"{a}.mT", f"{a}.permute{tuple(perm)}"]
    if len(s) == 2:
        forms.append(f"{a}.t()")
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


def _factorizations(n: int) -> list[Shape]:
    out: list[Shape] = [(n,)]
    for i in range(1, n + 1):
        if n % i == 0 and i <= MAX_DIM and n // i <= MAX_DIM * MAX_DIM:
            out.append((i, n // i))
            for j in range(1, n // i + 1):
                if (n // i) % j == 0 and j <= MAX_DIM and n // i // j <= MAX_DIM:
                    out.append((i, j, n // i // j))
    return out


@op("reshape", "view")
def _reshape(c: Ctx, a: str, s: Shape) -> list[str]:
    new = c.draw(st.sampled_from(_factorizations(numel(s))))
    forms = [f"{a}.reshape{shape_text(new)}", f"{a}.contiguous().view{shape_text(new)}"]
    if len(s) >= 1:
        forms.append(f"{a}.flatten()")
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


@op("unsqueeze_expand", "view", lambda s: len(s) < MAX_RANK)
def _unsqueeze_expand(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.draw(st.integers(0, len(s)))
    k = c.draw(st.integers(1, max(1, min(MAX_DIM, MAX_NUMEL // max(1, numel(s))))))
    new = list(s)
    new.insert(d, k)
    forms = [f"{a}.unsqueeze({d}).expand{shape_text(tuple(new))}", f"{a}.unsqueeze({d})"]
    if d == 0:
        forms.append(f"{a}.expand({k}, *{a}.shape)")
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


@op("squeeze_flip", "view", rank_ge(1))
def _squeeze_flip(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    forms = [f"torch.flip({a}, ({d},))", f"torch.roll({a}, 1, {d})"]
    if s[d] == 1:
        forms.append(f"{a}.squeeze({d})")
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


# -- in-place writes into fresh buffers made from an input -----------------------------


@op("fresh_slice_assign", "fresh buffer", dim_ge(2))
def _fresh_slice_assign(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s, 2)
    k = c.draw(st.integers(1, s[d] - 1))
    src = smooth(c.unary(), f"{a}{index_at(d, f':-{k}')}")
    op_ = c.draw(st.sampled_from(["=", "+="]))
    return [f"{c.out} = {c.buffer(a, s, like=True)}", f"{c.out}{index_at(d, f'{k}:')} {op_} {src}"]


@op("fresh_copy", "fresh buffer", dim_ge(2))
def _fresh_copy(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s, 2)
    start = c.draw(st.integers(0, s[d] - 1))
    stop = c.draw(st.integers(start + 1, s[d]))
    part = index_at(d, f"{start}:{stop}")
    src = smooth(c.unary(), f"{a}{part}")
    return [f"{c.out} = {c.buffer(a, s, like=True)}", f"{c.out}{part}.copy_({src})"]


@op("index_add", "fresh buffer", rank_ge(1))
def _index_add(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    m = c.draw(st.integers(1, c.room(s, d)))
    shape = s[:d] + (m,) + s[d + 1 :]
    idx = c.index_source(s[d], m)
    alpha = c.draw(st.sampled_from(["", ", alpha=0.5"]))
    src = c.draw(st.sampled_from([a, smooth(c.unary(), a)]))
    return [
        f"{c.out} = {c.buffer(a, shape, like=False)}",
        f"{c.out}.index_add_({d}, {idx}, {src}{alpha})",
    ]


@op("scatter_add", "fresh buffer", rank_ge(1))
def _scatter_add(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    m = c.draw(st.integers(1, c.room(s, d)))
    shape = s[:d] + (m,) + s[d + 1 :]
    idx = literal(c.ints(s, m))
    return [
        f"{c.out} = {c.buffer(a, shape, like=False)}",
        f"{c.out}.scatter_add_({d}, {idx}, {smooth(c.unary(), a)})",
    ]


@op("scatter_reduce", "fresh buffer", rank_ge(1))
def _scatter_reduce(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    m = c.draw(st.integers(1, c.room(s, d)))
    shape = s[:d] + (m,) + s[d + 1 :]
    idx = literal(c.ints(s, m))
    reduce = c.draw(st.sampled_from(["sum", "prod", "mean", "amax", "amin"]))
    if reduce in ("amax", "amin"):
        src, include_self = c.tiebreak(a, s), False
    else:
        src, include_self = smooth(c.unary(), a), c.draw(st.booleans())
    return [
        f"{c.out} = {c.buffer(a, shape, like=False)}",
        f"{c.out}.scatter_reduce_({d}, {idx}, {src}, reduce={reduce!r}, "
        f"include_self={include_self})",
    ]


@op("index_put", "fresh buffer", rank_ge(1))
def _index_put(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    k = c.draw(st.integers(1, s[d]))
    m = c.draw(st.integers(s[d], max(s[d], c.room(s, d))))
    shape = s[:d] + (m,) + s[d + 1 :]
    src = smooth(c.unary(), f"{a}{index_at(d, f':{k}')}")
    # Repeated indices only where the write accumulates (index_put_(..., accumulate=True)):
    # a plain write, or `+=` (a read, an add, a write), to one place twice is either value.
    if d == 0 and c.draw(st.booleans()):
        repeat = c.draw(st.booleans())
        idx = literal(c.ints((k,), m, unique_along=None if repeat else 0))
        write = f"{c.out}.index_put_(({idx},), {src}, accumulate={repeat})"
    else:
        idx = literal(c.ints((k,), m, unique_along=0))
        write = f"{c.out}{index_at(d, idx)} {c.draw(st.sampled_from(['=', '+=']))} {src}"
    return [f"{c.out} = {c.buffer(a, shape, like=shape == s)}", write]


@op("masked_fill", "fresh buffer", rank_ge(1))
def _masked_fill(c: Ctx, a: str, s: Shape) -> list[str]:
    mask = literal(c.mask(s[c.draw(st.integers(0, len(s) - 1)) :]))
    k = c.const()
    if c.draw(st.booleans()):
        return [f"{c.out} = {a}.clone()", f"{c.out}.masked_fill_({mask}, {k})"]
    inplace = c.draw(st.sampled_from(["mul_", "add_", "sub_"]))
    return [
        f"{c.out} = {c.buffer(a, s, like=True)}",
        f"{c.out}.masked_fill_({mask}, {k})",
        f"{c.out}.{inplace}({smooth(c.unary(), a)})",
    ]


@op("mask_write", "fresh buffer", rank_ge(1))
def _mask_write(c: Ctx, a: str, s: Shape) -> list[str]:
    # (a mask indexes leading dims: its shape is a prefix of the tensor's)
    mask = literal(c.mask(s[: c.draw(st.integers(1, len(s)))], some_true=True))
    return [f"{c.out} = {a}.clone()", f"{c.out}[{mask}] = {c.const()}"]


@op("mask_read", "indexing", rank_ge(1), rare=True)
def _mask_read(c: Ctx, a: str, s: Shape) -> list[str]:
    c.dynamic = True  # its shape depends on the mask's values (lowering="xla" refuses it)
    mask = literal(c.mask(s, some_true=True))
    if c.draw(st.booleans()):  # a read and a write through the same mask
        return [
            f"{c.out}_m = {mask}",
            f"{c.out} = torch.zeros_like({a})",
            f"{c.out}[{c.out}_m] = {smooth(c.unary(), f'{a}[{c.out}_m]')}",
        ]
    return [f"{c.out} = {smooth(c.unary(), f'{a}[{mask}]')}"]  # a read: shape (count,)


# -- in-place writes into input-derived buffers -----------------------------------------


@op("clone_inplace", "clone", rank_ge(1))
def _clone_inplace(c: Ctx, a: str, s: Shape) -> list[str]:
    b = c.other(s)
    forms = [f"{c.out}.mul_({smooth(c.unary(), a)})", f"{c.out}.sin_()"]
    if b is not None and broadcast(s, c.state[b]) == s:
        forms += [f"{c.out}.add_({b}, alpha=0.5)", f"{c.out}.mul_({smooth(c.unary(), b)})"]
    d = c.dim(s)
    if s[d] >= 2:
        k = c.draw(st.integers(1, s[d] - 1))
        src = smooth(c.unary(), f"{a}{index_at(d, f':-{k}')}")
        forms += [
            f"{c.out}{index_at(d, f'{k}:')} += {src}",
            f"{c.out}{index_at(d, f'{k}:')} = {src}",
            f"{c.out}{index_at(d, '0')} = 0",
        ]
    return [f"{c.out} = {a}.clone()", c.draw(st.sampled_from(forms))]


# -- .detach(), torch.no_grad() --------------------------------------------------------


@op("detach", "detach")
def _detach(c: Ctx, a: str, s: Shape) -> list[str]:
    form = c.draw(
        st.sampled_from(
            [
                f"{a} * torch.cos({a}.detach())",
                f"{a} + {a}.detach() ** 2",
                f"{a} - torch.tanh({a}).detach()",
            ]
        )
    )
    return [f"{c.out} = {form}"]


@op("no_grad", "detach")
def _no_grad(c: Ctx, a: str, s: Shape) -> list[str]:
    return [
        "with torch.no_grad():",
        f"    {c.out}_c = {smooth(c.unary(), a)} * {c.const()}",
        f"{c.out} = {a} * {c.out}_c",
    ]


@op("detach_then_write", "detach", dim_ge(2))
def _detach_then_write(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s, 2)
    k = c.draw(st.integers(1, s[d] - 1))
    src = smooth(c.unary(), f"{a}{index_at(d, f':-{k}')}")
    where = index_at(d, f"{k}:")
    if c.draw(st.booleans()):
        first = [f"{c.out} = {a}.detach().clone()"]
    else:
        first = ["with torch.no_grad():", f"    {c.out} = {smooth(c.unary(), a)} * 2"]
    write = c.draw(st.sampled_from([f"{c.out}{where} = {src}", f"{c.out}{where} += {src}"]))
    return [*first, write]


@op("no_grad_write", "detach", dim_ge(2))
def _no_grad_write(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s, 2)
    k = c.draw(st.integers(1, s[d] - 1))
    return [
        f"{c.out} = torch.zeros_like({a})",
        f"{c.out}{index_at(d, f'{k}:')} = {a}{index_at(d, f':-{k}')}",
        "with torch.no_grad():",
        f"    {c.out}.mul_({c.const()})",
    ]


# -- dtype casts -----------------------------------------------------------------------


@op("float64", "cast", rare=True)
def _float64(c: Ctx, a: str, s: Shape) -> list[str]:
    b = c.other(s)
    forms = [
        f"(({a}.to(torch.float64) + 1e8) - 1e8).to(torch.float32)",
        f"{paren(smooth(c.unary(), f'{a}.double()'))}.float()",
        f"({a}.double() * 1.5 + 1e-3).to({a}.dtype)",
        f"({a}.double() * {b}.double()).float()",
    ]
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


@op("int64", "cast")
def _int64(c: Ctx, a: str, s: Shape) -> list[str]:
    form = c.draw(
        st.sampled_from(
            [
                f"{a} + 0.25 * ({a} * 4).to(torch.int64).to(torch.float32)",
                f"{a} * (({a} * 3).long() % 2 + 1).float()",
            ]
        )
    )
    return [f"{c.out} = {form}"]


# -- reductions ------------------------------------------------------------------------


@op("sum_mean", "reduction", rank_ge(1))
def _sum_mean(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    keep = c.draw(st.booleans())
    forms = [f"{a}.sum({d}, keepdim={keep})", f"{a}.mean({d}, keepdim={keep})", f"{a}.sum()"]
    if len(s) >= 2:
        forms.append(f"{a}.mean((0, 1))")
    if s[d] >= 2:
        forms.append(f"{a}.var({d})")
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


@op("amax", "reduction", rank_ge(1))
def _amax(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    keep = c.draw(st.booleans())
    v = paren(c.tiebreak(a, s))
    forms = [
        f"{v}.amax({d}, keepdim={keep})",
        f"{v}.amin({d})",
        f"{v}.max({d}).values",
        f"{v}.amax()",
    ]
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


@op("logsumexp_norm", "reduction", rank_ge(1))
def _logsumexp_norm(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    forms = [
        f"torch.logsumexp({a}, {d})",
        f"torch.logsumexp({a}, {d}, keepdim=True)",
        f"torch.linalg.vector_norm({a} + 0.37, dim={d})",
        f"torch.norm({a} + 0.37)",
        f"({a} + 0.37).norm(dim={d}, keepdim=True)",
    ]
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


# -- indexing, scatter -----------------------------------------------------------------


@op("gather", "indexing", rank_ge(1))
def _gather(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    shape = tuple(
        c.draw(st.integers(1, MAX_DIM)) if i == d else c.draw(st.integers(1, n))
        for i, n in enumerate(s)
    )
    if numel(shape) > MAX_NUMEL:
        shape = s
    idx = literal(c.ints(shape, s[d]))
    forms = [f"torch.gather({a}, {d}, {idx})", f"{a}.gather({d}, {idx})"]
    if all(n == shape[i] for i, n in enumerate(s) if i != d):
        forms.append(f"torch.take_along_dim({a}, {idx}, {d})")
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


@op("index_select", "indexing", rank_ge(1))
def _index_select(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    k = c.draw(st.integers(1, max(1, min(MAX_DIM, MAX_NUMEL * s[d] // numel(s)))))
    return [f"{c.out} = {a}.index_select({d}, {c.index_source(k, s[d])})"]


@op("int_index", "indexing", rank_ge(1))
def _int_index(c: Ctx, a: str, s: Shape) -> list[str]:
    k = c.draw(st.integers(1, MAX_DIM if len(s) == 1 else min(s[:2])))
    i0 = literal(c.ints((k,), s[0]))
    forms = [f"{a}[{i0}]"]
    if len(s) >= 2:
        i1 = literal(c.ints((k,), s[1]))
        forms += [f"{a}[{i0}, {i1}]", f"{a}[:, {literal(c.ints((k,), s[1]))}]"]
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


@op("scatter", "indexing", rank_ge(1))
def _scatter(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    idx = literal(c.ints(s, s[d], unique_along=d))  # distinct targets: deterministic
    forms = [
        f"{a}.scatter({d}, {idx}, {smooth(c.unary(), a)})",
        f"torch.scatter_add({a}, {d}, {literal(c.ints(s, s[d]))}, {smooth(c.unary(), a)})",
        f"{a}.scatter({d}, {literal(c.ints(s, s[d]))}, {c.const()})",
        f"{a}.index_fill({d}, {literal(c.ints((1,), s[d]))}, {c.const()})",
    ]
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


# -- matmul, cat -----------------------------------------------------------------------


@op("matmul_cat", "other", rank_ge(1))
def _matmul_cat(c: Ctx, a: str, s: Shape) -> list[str]:
    d = c.dim(s)
    forms = []
    if numel(s) * 2 <= MAX_NUMEL:
        forms += [
            f"torch.cat([{a}, {smooth(c.unary(), a)}], {d})",
            f"torch.stack([{a}, {smooth(c.unary(), a)}], {d})",
        ]
    if len(s) >= 2 and numel(s) // s[-1] * s[-2] <= MAX_NUMEL:
        forms.append(f"{a} @ {a}.mT")
    if len(s) >= 2 and numel(s) // s[-2] * s[-1] <= MAX_NUMEL:
        forms.append(f"{a}.mT @ torch.tanh({a})")
    if len(s) == 1:
        forms.append(f"torch.dot({a}, torch.sin({a}))")
    if not forms:
        forms.append(f"{a} @ torch.ones({s[-1]})")
    return [f"{c.out} = {c.draw(st.sampled_from(forms))}"]


OPS_BY_NAME = {o.name: o for o in OPS}


# ---------------------------------------------------------------------------------------
# Programs
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
    """A rendered program and how to run it: input shapes, the seed of its input values,
    the vmap batch (size; whether `y` is batched too) and whether the transforms other than
    the value (always jitted) are jitted too."""

    source: str
    ops: tuple[str, ...] = ()
    x_shape: Shape = (3, 4)
    y_shape: Shape = (4,)
    seed: int = 0
    batch: int = 2
    batch_y: bool = False
    jit: bool = True
    dynamic: bool = False  # a boolean-mask read: declare the output (result_shape_dtypes)

    def __repr__(self) -> str:  # what hypothesis prints as the falsifying example
        return f"Program(ops={self.ops}, x{self.x_shape}, y{self.y_shape}, seed={self.seed})"

    def function(self) -> Callable:
        namespace: dict[str, Any] = {"torch": torch}
        exec(self.source, namespace)  # noqa: S102 - our own rendered code
        return namespace["program"]

    def inputs(self) -> dict[str, np.ndarray]:
        """x, y, their batches xb, yb and tangents tx, ty (float32), from the seed."""
        rng = np.random.default_rng(self.seed)
        shapes = {
            "x": self.x_shape,
            "y": self.y_shape,
            "xb": (self.batch, *self.x_shape),
            "yb": (self.batch, *self.y_shape),
            "tx": self.x_shape,
            "ty": self.y_shape,
        }
        return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}

    def repro(self, lowering: str, transforms: Sequence[str] = TRANSFORMS) -> str:
        """A script that runs the program through torchjax and torch, for a bug report."""
        y_axis, y_batch = (0, "yb") if self.batch_y else (None, "y")
        y_each = "torch.tensor(b)" if self.batch_y else "torch.tensor(y)"
        calls = {
            "jit": ("jax.jit(f)(x, y)", "program(xt, yt)"),
            "grad": (
                "jax.grad(f, argnums=(0, 1))(x, y)",
                "torch.autograd.grad(program(xt, yt), (xt, yt), materialize_grads=True)",
            ),
            "vmap": (
                f"jax.vmap(f, in_axes=(0, {y_axis}))(xb, {y_batch})",
                f"[program(torch.tensor(a), {y_each}) for a, b in zip(xb, yb)]",
            ),
            "jvp": (
                "jax.jvp(f, (x, y), (tx, ty))",
                "torch.func.jvp(program, (xt, yt), (torch.tensor(tx), torch.tensor(ty)))",
            ),
        }
        declared = ", result_shape_dtypes=jax.ShapeDtypeStruct((), jnp.float32)"
        lines = [
            "import jax, jax.numpy as jnp, numpy as np, torch, torchjax",
            "",
            self.source.rstrip(),
            "",
            f"rng = np.random.default_rng({self.seed})",
            f"x, y, xb, yb, tx, ty = (rng.standard_normal(s).astype(np.float32) for s in "
            f"[{self.x_shape}, {self.y_shape}, {(self.batch, *self.x_shape)}, "
            f"{(self.batch, *self.y_shape)}, {self.x_shape}, {self.y_shape}])",
            f"f = torchjax.to_jax(program, lowering={lowering!r}"
            f"{declared if self.dynamic and lowering == 'callback' else ''})",
            "xt, yt = torch.tensor(x, requires_grad=True), torch.tensor(y, requires_grad=True)",
        ]
        for t in transforms:
            got, want = calls[t]
            lines += [f"print({t!r}, {got})", f"print('torch', {want})"]
        return "\n".join(lines)


def render(steps: list[tuple[str, list[str]]], state: dict[str, Shape]) -> str:
    """The source of `def program(x, y)`: the ops' lines, then a weighted sum of every
    tensor they made (distinct weights: a gradient sent to the wrong element shows)."""
    made = [n for n in state if n not in ("x", "y")]
    terms = []
    for name in made:
        s = state[name]
        w = f"torch.linspace(0.5, 2.0, {numel(s)}).reshape{shape_text(s)}"
        terms.append(f"{name}.sum() * 0.7" if numel(s) == 1 else f"({name} * {w}).sum()")
    body = [line for op_name, lines in steps for line in (f"# {op_name}", *lines)]
    body += ["# a weighted sum of what the ops made", f"out = {terms[0]}"]
    body += [f"out = out + {t}" for t in terms[1:]]
    body.append("return out")
    return "def program(x, y):\n" + textwrap.indent("\n".join(body), "    ") + "\n"


@st.composite
def shapes(draw: Callable, max_rank: int = MAX_RANK) -> Shape:
    rank = draw(st.integers(0 if max_rank < MAX_RANK else 1, max_rank))
    shape: tuple[int, ...] = ()
    for _ in range(rank):
        limit = min(MAX_DIM, MAX_NUMEL // max(1, numel(shape)))
        shape += (draw(st.integers(1, max(1, limit))),)
    return shape


@st.composite
def _step(draw: Callable, table: Sequence[Op], state: dict, example: dict, stop: bool):
    """One op (name, lines, dynamic), or None where `stop` allows it and the draw says so.
    Drawn as one strategy, its choices are one span, which the shrinker deletes whole."""
    if stop and draw(st.integers(0, 9)) == 0:  # (shrinks to stopping)
        return None
    out = f"v{len(state) - 2}"
    candidates = [o for o in table if any(o.when(s) for s in state.values())]
    rare = [o for o in candidates if o.rare]
    if rare and len(rare) < len(candidates):
        common = [o for o in candidates if not o.rare]
        candidates = rare if draw(st.integers(0, 29)) == 29 else common
    chosen = draw(st.sampled_from(candidates))
    a = draw(st.sampled_from([n for n, s in state.items() if chosen.when(s)]))
    ctx = Ctx(draw, state, out)
    lines = chosen.build(ctx, a, state[a])
    try:
        value = chosen.apply(lines, example, out)
    except Exception as error:  # a builder's bug: say which lines
        code = "\n".join(lines)
        raise AssertionError(f"op {chosen.name} rendered invalid code:\n{code}") from error
    assert value.dtype == torch.float32 and numel(tuple(value.shape)) <= MAX_NUMEL, (
        chosen.name,
        lines,
        value.shape,
    )
    example[out] = value
    state[out] = tuple(value.shape)
    return chosen.name, lines, ctx.dynamic


@st.composite
def programs(draw: Callable, min_ops: int = 2, max_ops: int = 10, ops: Sequence[Op] = ()):
    """A random Program of `min_ops`..`max_ops` ops drawn from `ops` (default: all)."""
    table = list(ops) or OPS
    x_shape = draw(shapes())
    y_shape = draw(
        st.one_of(
            st.just(x_shape),
            st.just(x_shape[1:]),
            st.just(x_shape[-1:]),
            shapes(max_rank=2),
        )
    )
    state: dict[str, Shape] = {"x": x_shape, "y": y_shape}
    example = {  # values to run each op on as it is drawn: its output's shape
        "x": torch.randn(x_shape, generator=torch.Generator().manual_seed(0)),
        "y": torch.randn(y_shape, generator=torch.Generator().manual_seed(1)),
    }
    steps: list[tuple[str, list[str]]] = []
    dynamic = False
    while len(steps) < max_ops:  # after min_ops, each next op with probability ~9/10
        step = draw(_step(table, state, example, stop=len(steps) >= min_ops))
        if step is None:
            break
        name, lines, step_dynamic = step
        steps.append((name, lines))
        dynamic = dynamic or step_dynamic
    return Program(
        source=render(steps, state),
        ops=tuple(name for name, _ in steps),
        x_shape=x_shape,
        y_shape=y_shape,
        seed=draw(st.integers(0, 2**16)),
        batch=draw(st.integers(2, 3)),
        batch_y=draw(st.booleans()),
        jit=draw(st.booleans()),
        dynamic=dynamic,
    )


# ---------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------

RTOL = 1e-4  # float32, after ~10 ops done in two different orders
ATOL = 2e-5  # times the largest magnitude of the compared quantity (at least 1)
SLACK = 8.0  # times what the reference moves when its inputs move by ~8 float32 ulps
_PERTURB = 2.0**-20


@dataclasses.dataclass
class Reference:
    """What torch computes for a program: per transform the expected value (None where the
    torch.func transform lowering="callback" is built on fails: `func_errors`), and how much
    each moves under a tiny perturbation of the inputs (`slack`)."""

    expected: dict[str, Any]
    slack: dict[str, Any]
    func_errors: dict[str, str]


def _torch_quantities(fn: Callable, v: dict[str, np.ndarray], batch_y: bool):
    """value, autograd's gradient, the per-example loop, and the two JVP tangents."""
    t = {k: torch.tensor(a) for k, a in v.items()}
    xt, yt = t["x"].clone().requires_grad_(), t["y"].clone().requires_grad_()
    out = fn(xt, yt)
    if out.requires_grad:
        grads = torch.autograd.grad(out, (xt, yt), allow_unused=True, materialize_grads=True)
    else:
        grads = (torch.zeros_like(xt), torch.zeros_like(yt))
    value = out.detach().numpy()
    grad = tuple(g.numpy() for g in grads)
    with torch.no_grad():
        per_example = np.stack(
            [
                fn(t["xb"][i], t["yb"][i] if batch_y else t["y"]).numpy()
                for i in range(t["xb"].shape[0])
            ]
        )
    reverse = float((grad[0] * v["tx"]).sum() + (grad[1] * v["ty"]).sum())
    return {"jit": value, "grad": grad, "vmap": per_example, "jvp_reverse": (value, reverse)}


def _torch_func(fn: Callable, v: dict[str, np.ndarray], batch_y: bool):
    """torch.func's own transforms of the program: {name: result or the exception}."""
    t = {k: torch.tensor(a) for k, a in v.items()}
    out: dict[str, Any] = {}
    runs = {
        "grad": lambda: torch.func.grad(fn, argnums=(0, 1))(t["x"], t["y"]),
        "vmap": lambda: torch.func.vmap(fn, in_dims=(0, 0 if batch_y else None))(
            t["xb"], t["yb"] if batch_y else t["y"]
        ),
        "jvp": lambda: torch.func.jvp(fn, (t["x"], t["y"]), (t["tx"], t["ty"])),
    }
    for name, run in runs.items():
        try:
            result = run()
        except Exception as error:
            out[name] = error
        else:
            out[name] = jax.tree.map(lambda r: r.detach().numpy(), result)
    return out


@functools.lru_cache(maxsize=64)
def reference(program: Program) -> Reference:
    """torch's answers for `program` (both lowerings ask for the same program: cached)."""
    fn = program.function()
    v = program.inputs()
    base = _torch_quantities(fn, v, program.batch_y)
    funcs = _torch_func(fn, v, program.batch_y)
    rng = np.random.default_rng(program.seed + 1)
    moved = {
        k: (a * (1 + _PERTURB * rng.standard_normal(a.shape))).astype(np.float32)
        for k, a in v.items()
    }
    other = _torch_quantities(fn, moved, program.batch_y)
    other_funcs = _torch_func(fn, moved, program.batch_y)
    expected = dict(base)
    expected["jvp_forward"] = funcs["jvp"]
    other["jvp_forward"] = other_funcs["jvp"]
    slack = {}
    for k, e in expected.items():
        o = other[k]
        if isinstance(e, Exception) or isinstance(o, Exception):
            slack[k] = None
        else:
            slack[k] = jax.tree.map(lambda p, q: np.abs(np.asarray(p) - np.asarray(q)), e, o)
    errors = {k: f"{type(r).__name__}: {r}" for k, r in funcs.items() if isinstance(r, Exception)}
    return Reference(expected, slack, errors)


def compare(actual: Any, expected: Any, slack: Any) -> str:
    """ "" where `actual` agrees with `expected` (pytrees of arrays), else what differs."""
    a_leaves = jax.tree.leaves(actual)
    e_leaves = jax.tree.leaves(expected)
    s_leaves = jax.tree.leaves(slack) if slack is not None else [0.0] * len(e_leaves)
    if len(a_leaves) != len(e_leaves):
        return f"{len(a_leaves)} outputs, torch {len(e_leaves)}"
    problems = []
    for i, (a, e, s) in enumerate(zip(a_leaves, e_leaves, s_leaves, strict=True)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        if a.shape != e.shape:
            problems.append(f"output {i}: shape {a.shape}, torch's {e.shape}")
            continue
        finite = np.abs(e[np.isfinite(e)])
        scale = max(1.0, float(finite.max()) if finite.size else 1.0)
        tol = ATOL * scale + RTOL * np.abs(e) + SLACK * np.nan_to_num(np.asarray(s), nan=0)
        same = (a == e) | (np.isnan(a) & np.isnan(e)) | (np.abs(a - e) <= tol)
        if not same.all():
            bad = np.argwhere(~same)[:3].tolist()
            with np.printoptions(precision=6, threshold=30, linewidth=100):
                problems.append(
                    f"output {i}: {int((~same).sum())} of {e.size} differ (first at {bad});"
                    f"\n  torchjax: {a}\n  torch:    {e}"
                )
    return "\n".join(problems)


@dataclasses.dataclass
class Outcome:
    lowering: str
    transform: str
    status: str  # "pass" | "refused" | "mismatch"
    detail: str = ""


def _run(program: Program, f: Callable, transform: str, v: dict[str, jax.Array]) -> Any:
    wrap = jax.jit if program.jit else (lambda g: g)
    if transform == "jit":
        return jax.jit(f)(v["x"], v["y"])
    if transform == "grad":
        return wrap(jax.grad(f, argnums=(0, 1)))(v["x"], v["y"])
    if transform == "vmap":
        batched = jax.vmap(f, in_axes=(0, 0 if program.batch_y else None))
        return wrap(batched)(v["xb"], v["yb"] if program.batch_y else v["y"])
    assert transform == "jvp"
    jvp = lambda x, y, tx, ty: jax.jvp(f, (x, y), (tx, ty))  # noqa: E731
    return wrap(jvp)(v["x"], v["y"], v["tx"], v["ty"])


def check(
    program: Program,
    lowering: str,
    transforms: Sequence[str] = TRANSFORMS,
    stop_at_mismatch: bool = False,
) -> list[Outcome]:
    """Each of `transforms` of `program` through to_jax(lowering=...) against torch (x64
    off), in order; with `stop_at_mismatch`, none after the first mismatch (shrinking a
    failure: the export, the same for all, costs most of a check)."""
    ref = reference(program)
    kwargs: dict[str, Any] = {"lowering": lowering}
    if program.dynamic and lowering == "callback":  # (xla takes its types from the graph)
        kwargs["result_shape_dtypes"] = jax.ShapeDtypeStruct((), jnp.float32)
    f = torchjax.to_jax(program.function(), **kwargs)
    v = {k: jnp.asarray(a) for k, a in program.inputs().items()}
    outcomes = []
    for transform in transforms:
        outcomes.append(_outcome(program, lowering, transform, f, v, ref))
        if stop_at_mismatch and outcomes[-1].status == "mismatch":
            break
    return outcomes


def _outcome(program: Program, lowering: str, transform: str, f, v, ref: Reference) -> Outcome:
    func = _TORCH_FUNC_OF[transform]
    try:
        with jax.enable_x64(False):
            got = _run(program, f, transform, v)
    except LoweringError as error:
        if lowering == "xla":
            return Outcome(lowering, transform, "refused", _first_line(error))
        return Outcome(lowering, transform, "mismatch", _describe(error))
    except Exception as error:
        if lowering == "callback" and func in ref.func_errors:
            why = f"torch.func.{func} fails on it: {ref.func_errors[func][:120]}"
            return Outcome(lowering, transform, "refused", why)
        return Outcome(lowering, transform, "mismatch", _describe(error))
    if lowering == "xla" and transform == "jvp" and _no_single_jvp_reference(program):
        return Outcome(lowering, transform, "refused", _MIXED_JVP)
    keys = _keys(ref, transform, lowering)
    diffs = [compare(got, ref.expected[k], ref.slack[k]) for k in keys]
    diff = "" if "" in diffs else diffs[0]
    return Outcome(lowering, transform, "mismatch" if diff else "pass", diff)


_MIXED_JVP = (
    "no single torch reference: a no_grad block (reverse mode's semantics under xla) and "
    "scatter_reduce's prod (a callback: torch's forward formula, wrong in torch 2.13)"
)


def _no_single_jvp_reference(program: Program) -> bool:
    """Whether lowering="xla"'s JVP of `program` mixes the two references _keys accepts, so
    that neither is its value: a no_grad block lowered as reverse mode sees it (stopped) and
    scatter_reduce's prod, which runs as a torch callback (listed in _xla/_routes.py) whose JVP is
    torch.func.jvp's, wrong for prod in torch 2.13. Each part is checked alone."""
    return "torch.no_grad()" in program.source and "reduce='prod'" in program.source


def _keys(ref: Reference, transform: str, lowering: str) -> list[str]:
    """The references a transform's result may match. A JVP: lowering="callback" computes
    torch.func.jvp's; lowering="xla" is JAX's, the transpose of its gradient, except where
    an op runs as a torch callback, which computes torch.func.jvp's. The two differ where a
    no_grad block is (forward mode ignores it in torch, docs/limitations.md) and where torch's
    forward formula is wrong (scatter_reduce's prod: 0, torch 2.13); either passes."""
    if transform != "jvp":
        return [transform]
    has_forward = not isinstance(ref.expected["jvp_forward"], Exception)
    if lowering == "callback":
        # (where torch.func.jvp fails and torchjax did not: the gradient's is the reference)
        return ["jvp_forward"] if has_forward else ["jvp_reverse"]
    return ["jvp_reverse", "jvp_forward"] if has_forward else ["jvp_reverse"]


def _first_line(error: BaseException) -> str:
    """A refusal's kind and the start of its message (its first line is the counters' key)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: " + "\n".join(lines[:3])


def _describe(error: BaseException) -> str:
    text = str(error).strip()
    return f"raised {type(error).__name__}: {text[:600]}"


def failure_report(program: Program, outcomes: Sequence[Outcome]) -> str:
    """The message a failing program gives: its source, what differed, a repro script."""
    bad = [o for o in outcomes if o.status == "mismatch"]
    lines = [f"lowering={bad[0].lowering!r} disagrees with torch on this program:", ""]
    lines += [program.source, ""]
    for o in bad:
        how = "under jax.jit" if program.jit or o.transform == "jit" else "eager"
        lines += [f"-- {o.transform} ({how}):", o.detail, ""]
    lines += ["-- reproduce:", program.repro(bad[0].lowering, [o.transform for o in bad])]
    return "\n".join(lines)


class Counters:
    """Programs tried per lowering, and pass / refused / mismatch per lowering x transform."""

    def __init__(self) -> None:
        self.programs: collections.Counter = collections.Counter()
        self.cells: dict[tuple[str, str], collections.Counter] = collections.defaultdict(
            collections.Counter
        )
        self.reasons: collections.Counter = collections.Counter()

    def add(self, outcomes: Sequence[Outcome]) -> None:
        if outcomes:
            self.programs[outcomes[0].lowering] += 1
        for o in outcomes:
            self.cells[o.lowering, o.transform][o.status] += 1
            if o.status == "refused":
                self.reasons[f"{o.lowering}: {o.detail.splitlines()[0][:150]}"] += 1

    def total(self, status: str) -> int:
        return sum(c[status] for c in self.cells.values())

    def summary(self) -> str:
        n = max(self.programs.values(), default=0)
        lowerings = ",".join(sorted(self.programs, key=LOWERINGS.index))
        return (
            f"fuzz: {n} programs, transforms {','.join(TRANSFORMS)}, lowerings {lowerings}: "
            f"{self.total('pass')} passed, {self.total('refused')} refused, "
            f"{self.total('mismatch')} mismatches"
        )

    def breakdown(self) -> str:
        """Per lowering x transform: passed/refused/mismatched."""
        cells = [
            f"{lo}/{t} {c['pass']}/{c['refused']}/{c['mismatch']}"
            for (lo, t), c in sorted(self.cells.items())
        ]
        return "fuzz: pass/refused/mismatch by cell: " + ", ".join(cells)
