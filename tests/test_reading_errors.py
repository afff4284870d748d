"""How a torch error reads under jax.jit against eagerly (issue #46): ten mistakes a new
user makes, each raised eagerly and under jit. Under jit, where jaxlib writes the error
into a JaxRuntimeError's text, torchjax's own frames are at most two, and the text ends
with the original exception's type and message, intact, and torchjax's note under it.

``python tests/test_reading_errors.py`` prints the table in docs/to_jax.md ("Reading
errors").
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest
import torch

import torchjax

pytestmark = pytest.mark.core


@dataclass
class Mistake:
    what: str
    call: Callable[[], Callable]  # -> the wrapped function, called on `args`
    args: Callable[[], tuple]
    message: str  # torch's (or torchjax's) message, in full or its start
    note: str = ""  # what torchjax's note must say ("" where torchjax cannot tell more)
    vmap: bool = False


def _linear(x):
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)(x)


def _sequential_dropout():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5))
    apply, variables = torchjax.module_to_jax(model)
    return lambda x: apply(variables, x)


def _validates(x):
    if bool((x < 0).any()):
        raise ValueError("x must be non-negative")
    return x.sqrt()


def _one_output(x):
    return x * 2


MISTAKES = [
    Mistake(
        "an int32 array into a float nn.Linear",
        lambda: torchjax.to_jax(_linear),
        lambda: (jnp.arange(6, dtype=jnp.int32).reshape(2, 3),),
        "mat1 and mat2 must have the same dtype, but got Long and Float",
        "`args[0].astype(jnp.float32)`",
    ),
    Mistake(
        "a float64 array into a float32 model (x64 on)",
        lambda: torchjax.to_jax(_linear),
        lambda: (jnp.ones((2, 3), dtype=jnp.float64),),
        "mat1 and mat2 must have the same dtype, but got Double and Float",
        "`args[0].astype(jnp.float32)`",
    ),
    Mistake(
        "cross_entropy with a class index out of range",
        lambda: torchjax.to_jax(lambda z, y: torch.nn.functional.cross_entropy(z, y)),
        lambda: (jnp.zeros((2, 3)), jnp.array([0, 5])),
        "Target 5 is out of bounds.",
    ),
    Mistake(
        "an embedding id out of range",
        lambda: torchjax.to_jax(lambda w, i: torch.nn.functional.embedding(i, w)),
        lambda: (jnp.zeros((4, 2)), jnp.array([1, 7])),
        "index out of range in self",
    ),
    Mistake(
        "the user's own validation (declared output types)",
        lambda: torchjax.to_jax(
            _validates, result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32)
        ),
        lambda: (jnp.array([1.0, -1.0, 4.0]),),
        "x must be non-negative",
    ),
    Mistake(
        "an in-place write into an input only real data reaches",
        lambda: torchjax.to_jax(
            lambda x: x.clamp_(min=0) if bool((x < 0).any()) else x * 1,
            result_shape_dtypes=jax.ShapeDtypeStruct((2,), jnp.float32),
        ),
        lambda: (jnp.array([1.0, -1.0]),),
        "modifies its input args[0] in place",
        "x = x.clone()",
    ),
    Mistake(
        "an output of another shape than declared",
        lambda: torchjax.to_jax(
            lambda x: x[: int(x.sum().item())],
            result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32),
        ),
        lambda: (jnp.array([1.0, 1.0, 0.0]),),
        "returned float32[2] at out, but float32[3] was declared",
    ),
    Mistake(
        "dropout in train mode under jax.vmap",
        _sequential_dropout,
        lambda: (jnp.ones((4, 3)),),
        "torch.func.vmap could not batch Sequential.forward",
        "module_to_jax(module, vmap_randomness='different')",
        vmap=True,
    ),
    Mistake(
        ".item() under jax.vmap",
        lambda: torchjax.to_jax(
            lambda x: x * x.sum().item(),
            result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32),
        ),
        lambda: (jnp.ones((4, 3)),),
        "torch.func.vmap could not batch <lambda>",
        "vmap_method='sequential'",
        vmap=True,
    ),
    Mistake(
        "a matrix of the wrong shape, found only when run (declared output types)",
        lambda: torchjax.to_jax(
            lambda a, b: a @ b, result_shape_dtypes=jax.ShapeDtypeStruct((2, 2), jnp.float32)
        ),
        lambda: (jnp.ones((2, 3)), jnp.ones((2, 2))),
        "mat1 and mat2 shapes cannot be multiplied (2x3 and 2x2)",
    ),
]


def _raise(mistake: Mistake, jit: bool) -> BaseException:
    f = mistake.call()
    if mistake.vmap:
        f = jax.vmap(f)
    if jit:
        f = jax.jit(f)
    x64 = "x64 on" in mistake.what
    with jax.enable_x64(x64) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64(x64):
        args = mistake.args()
        try:
            jax.block_until_ready(f(*args))
        except Exception as e:
            return e
    raise AssertionError(f"{mistake.what}: no error")


def read(error: BaseException) -> str:
    """The text a user reads: the printed traceback eagerly, the message under jit."""
    if isinstance(error, jax.errors.JaxRuntimeError):
        return str(error)
    return "".join(traceback.format_exception(error))


def torchjax_frames(text: str) -> int:
    return len(re.findall(r'File "[^"]*/torchjax/', text))


def lines_before(text: str, message: str) -> int:
    """How many lines a reader passes before the message (from the top of the text)."""
    return text[: text.index(message)].count("\n")


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.what for m in MISTAKES])
def test_a_torch_error_under_jit_reads_as_the_eager_one(mistake):
    eager, jitted = _raise(mistake, jit=False), _raise(mistake, jit=True)
    eager_text = read(eager)
    assert mistake.message in eager_text
    assert isinstance(jitted, jax.errors.JaxRuntimeError) or type(jitted) is type(eager)
    text = read(jitted)
    assert torchjax_frames(text) <= 2, text
    # The message intact and last: after it, only torchjax's notes (and JAX's own line
    # about filtered frames, which it prints after every error it filtered).
    tail = text[text.index(mistake.message) :].split("\n--------------------\n")[0]
    assert mistake.message in tail.splitlines()[0] or mistake.message in tail
    assert 'File "' not in tail
    if mistake.note:
        assert mistake.note in tail, tail
        assert mistake.note in eager_text
    if isinstance(jitted, jax.errors.JaxRuntimeError):
        type_line = next(line for line in text.splitlines() if mistake.message[:30] in line)
        assert type_line.startswith(type(eager).__name__ + ": "), type_line


def table() -> str:
    rows = [
        "| mistake | eager: lines before the message | under jit: lines before it | "
        "under jit: torchjax frames | torchjax's advice under jit |",
        "|---|---:|---:|---:|---|",
    ]
    for m in MISTAKES:
        eager, jitted = read(_raise(m, False)), read(_raise(m, True))
        advice = "-" if not m.note else (m.note if m.note in jitted else "missing")
        rows.append(
            f"| {m.what} | {lines_before(eager, m.message)} | {lines_before(jitted, m.message)} "
            f"| {torchjax_frames(jitted)} | {advice} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())


class _BackwardRefuses(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        raise ValueError("this backward refuses")


@pytest.mark.parametrize("grad_method", ["torch.func", "autograd"])
def test_a_backward_that_raises_under_jit_reads_as_eagerly(grad_method):
    f = torchjax.to_jax(lambda x: _BackwardRefuses.apply(x).sum(), grad_method=grad_method)
    x = jnp.ones(3)
    with pytest.raises(ValueError, match="this backward refuses"):
        jax.grad(f)(x)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.jit(jax.grad(f))(x).block_until_ready()
    text = str(info.value)
    assert torchjax_frames(text) <= 2, text
    last = text.rstrip().splitlines()[-2:]
    assert last[0] == "ValueError: this backward refuses", last
    assert "raised by" in last[1]
    assert "/torch/autograd/" in text  # torch's frames are kept: where the backward ran
