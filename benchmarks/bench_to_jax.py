# Per-call cost of to_jax against the floor for any Python callback, measured in one run.
#
# The floors are the fastest hand-written bridges that work for any f, with nothing checked.
# Under jit: a buffer_callback that wraps XLA's buffers with torch._C._from_dlpack (no
# Python wrapper), calls f and copy_s into XLA's output buffer; every Python-callback bridge
# pays at least that. The same callback through torch.utils.dlpack.from_dlpack is the
# previous, slower floor; the same callback with the checks to_jax makes on every call
# inlined shows what those checks cost. Eager: jaxlib's DLPack export of the input,
# torch._C._from_dlpack, f, torch._C._to_dlpack, jaxlib's DLPack import of the output.
# jax.pure_callback and native torch are shown for reference, and native torch under a
# dispatch mode that only counts ops (what finding the op that makes an output would cost
# each op). For 2**24 elements the question is extra copies, not overhead: the copy into
# XLA's output buffer against a hand-written callback whose op writes there itself (out=),
# and what asking the kernel for huge pages on that buffer saves (_call/_huge_pages.py; off where
# the kernel does not give them on request): the hand-written callbacks do not ask.
# Grad mode and int32 inputs: the checks against the same with grad mode switched off
# around f (as torchjax did before issue 46); to_jax eager called in torch.enable_grad()
# against torch.no_grad() (nothing requires grad: torch records nothing), and with f
# closing over a parameter that requires grad (torch records the graph plain torch
# would); an int32 index array widened to an int64 copy with x64 off, against
# TORCHJAX_WIDEN_INT32=0.
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import torch
from _timing import Table, format_tables, paired_row
from jax.experimental.buffer_callback import buffer_callback
from torch.utils._python_dispatch import TorchDispatchMode

import torchjax
from torchjax import _x64
from torchjax._compat._jax import dlpack_export, dlpack_import
from torchjax._compat._torch import cpu_array_from_tensor
from torchjax._to_jax._call import _huge_pages as _huge_pages

_from_capsule = torch._C._from_dlpack  # torch.utils.dlpack.from_dlpack without its wrapper


def _dl(buf):
    return torch.utils.dlpack.from_dlpack(buf.__dlpack__())


def hand_callback(op, n, wrap=_dl):
    """A floor: a buffer_callback that runs `op` in torch and copies into `out`."""

    def cb(ctx, out, x):
        wrap(out).copy_(op(wrap(x)))

    return jax.jit(buffer_callback(cb, jax.ShapeDtypeStruct((n,), jnp.float32)))


def fastest_callback(op, n):
    """The jit floor: hand_callback with torch._C._from_dlpack on the capsules."""
    return hand_callback(op, n, wrap=lambda buf: _from_capsule(buf.__dlpack__()))


def checked_callback(op, n, grad_off=False):
    """The jit floor with torchjax's invariants: fastest_callback plus, inlined, the checks
    to_jax makes on every call (neither inference mode nor torch.autocast on, the input's
    storage refuses writes, no version counter moved, the output's type, dtype and shape,
    and no reference to the input kept past the call). What those checks cost is this row's
    ratio to the floor. Like the floor, it wraps XLA's output buffer before the input
    (measured 0.3 µs faster than after f). With `grad_off`, grad mode is switched off around
    op, as torchjax did before it left the caller's grad mode to the function (issue 46)."""
    refuse, grad_on, set_grad = (
        torch._C._set_throw_on_mutable_data_ptr,
        torch.is_grad_enabled,
        torch._C._set_grad_enabled,
    )
    inference_mode, any_autocast = (
        torch.is_inference_mode_enabled,
        torch._C._is_any_autocast_enabled,
    )
    use_count, storage_uses, storage_id = (
        torch.Tensor._use_count,
        torch._C._storage_Use_Count,
        torch._C._storage_id,
    )
    refs, shape = sys.getrefcount, (n,)

    def cb(ctx, outs, x):
        if inference_mode() or any_autocast():
            raise RuntimeError("a mode torchjax's callback sets aside: the full way")
        dst = _from_capsule(outs[0].__dlpack__())
        t = _from_capsule(x.__dlpack__())
        refuse(t)
        was_on = grad_off and grad_on()
        if was_on:
            set_grad(False)
        try:
            out = op(t)
        finally:
            if was_on:
                set_grad(True)
        if t._version:
            raise RuntimeError("an in-place view op")
        if type(out) is not torch.Tensor or out.dtype is not torch.float32 or out.shape != shape:
            raise RuntimeError("an output of another type")
        dst.copy_(out)
        out = dst = None
        if refs(t) != 2 or use_count(t) != 1 or storage_uses(storage_id(t)) != 1:
            raise RuntimeError("an input kept")

    call = buffer_callback(cb, [jax.ShapeDtypeStruct((n,), jnp.float32)])
    return jax.jit(lambda x: call(x)[0])


def into_callback(n):
    """What computing into XLA's buffer would reach for f(x) = x * 2: a buffer_callback
    whose op writes its result there itself (torch.mul's out=), no copy after. torchjax
    cannot do this for an arbitrary f (docs/limitations.md, "Outputs under jit")."""

    def cb(ctx, outs, x):
        torch.mul(_from_capsule(x.__dlpack__()), 2, out=_from_capsule(outs[0].__dlpack__()))

    call = buffer_callback(cb, [jax.ShapeDtypeStruct((n,), jnp.float32)])
    return jax.jit(lambda x: call(x)[0])


class CountingMode(TorchDispatchMode):
    """The least a dispatch mode does that finds the op producing an output: count ops."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def fastest_eager(op, like):
    """The eager floor: jaxlib's DLPack export and import around op, nothing checked."""
    device = like.devices().pop()
    cpu_array_from_tensor(torch.zeros(1), device)  # settles this jaxlib's import signature
    form = cpu_array_from_tensor.forms[0]

    def call(x):
        out = op(_from_capsule(dlpack_export(x, stream=None)))
        return dlpack_import(torch._C._to_dlpack(out), device, *form)

    return call


def measure() -> list[Table]:
    """Two tables of medians and ratios: overhead on 16 elements, copies on 2**24."""
    add_one = lambda x: x + 1
    n = 16
    x = jnp.arange(n, dtype=jnp.float32)
    t = torch.arange(n, dtype=torch.float32)
    f = torchjax.to_jax(add_one)
    f_jit = jax.jit(f)
    hand = hand_callback(add_one, n)
    fastest = fastest_callback(add_one, n)
    checked = checked_callback(add_one, n)
    checked_grad_off = checked_callback(add_one, n, grad_off=True)
    table = jnp.linspace(0.0, 1.0, 64, dtype=jnp.float32)
    ids = jnp.arange(n, dtype=jnp.int32) * 3  # JAX's integers with x64 off
    lookup = torchjax.to_jax(lambda w, i: w[i])  # indexing takes int32 and int64 alike
    lookup_jit = jax.jit(lookup)
    weight = torch.nn.Parameter(torch.tensor(2.0))  # closed over; requires grad
    scale = lambda x: x * weight
    f_scale = torchjax.to_jax(scale)
    eager_floor = fastest_eager(add_one, x)
    mode = CountingMode()
    assert bool((eager_floor(x) == x + 1).all()) and bool((fastest(x) == x + 1).all())
    assert bool((checked(x) == x + 1).all())
    pure = jax.jit(
        lambda x: jax.pure_callback(
            lambda a: a + 1, jax.ShapeDtypeStruct((n,), jnp.float32), x, vmap_method="sequential"
        )
    )
    floor_name = "fastest hand-written buffer_callback"
    floor = lambda: fastest(x).block_until_ready()
    eager_name = "fastest hand-written eager bridge"
    small = (
        "f(x) = x + 1 on 16 float32",
        [
            paired_row("to_jax under jit", lambda: f_jit(x).block_until_ready(), floor_name, floor),
            paired_row(
                "to_jax eager",
                lambda: f(x).block_until_ready(),
                eager_name,
                lambda: eager_floor(x).block_until_ready(),
            ),
            paired_row(
                "hand-written buffer_callback with to_jax's checks",
                lambda: checked(x).block_until_ready(),
                floor_name,
                floor,
            ),
            paired_row(
                "to_jax under jit",
                lambda: f_jit(x).block_until_ready(),
                "hand-written buffer_callback with to_jax's checks",
                lambda: checked(x).block_until_ready(),
            ),
            paired_row(
                "hand-written buffer_callback with to_jax's checks",
                lambda: checked(x).block_until_ready(),
                "the same, grad mode switched off around f (torchjax before issue 46)",
                lambda: checked_grad_off(x).block_until_ready(),
            ),
            paired_row(
                "to_jax under jit, w[i] with int32 i widened to int64 (x64 off)",
                lambda: lookup_jit(table, ids).block_until_ready(),
                "the same, TORCHJAX_WIDEN_INT32=0 (int32 to torch)",
                lambda: _unwidened(lookup_jit, table, ids).block_until_ready(),
            ),
            paired_row(
                "to_jax eager, w[i] with int32 i widened to int64 (x64 off)",
                lambda: lookup(table, ids).block_until_ready(),
                "the same, TORCHJAX_WIDEN_INT32=0 (int32 to torch)",
                lambda: _unwidened(lookup, table, ids).block_until_ready(),
            ),
            paired_row(
                "to_jax eager, called in torch.enable_grad()",
                lambda: _in(torch.enable_grad, f, x).block_until_ready(),
                "to_jax eager, called in torch.no_grad()",
                lambda: _in(torch.no_grad, f, x).block_until_ready(),
            ),
            paired_row(
                "to_jax eager, f closing over a parameter that requires grad, in enable_grad()",
                lambda: _in(torch.enable_grad, f_scale, x).block_until_ready(),
                "the same, called in torch.no_grad()",
                lambda: _in(torch.no_grad, f_scale, x).block_until_ready(),
            ),
            paired_row(
                "buffer_callback through torch.utils.dlpack",
                lambda: hand(x).block_until_ready(),
                floor_name,
                floor,
            ),
            paired_row(
                "jax.pure_callback under jit",
                lambda: pure(x).block_until_ready(),
                floor_name,
                floor,
            ),
            paired_row("native torch", lambda: add_one(t), floor_name, floor),
            paired_row(
                "native torch under a dispatch mode that counts ops",
                lambda: _under(mode, add_one, t),
                "native torch",
                lambda: add_one(t),
            ),
        ],
    )

    times_two = lambda x: x * 2
    n = 2**24
    x = jnp.arange(n, dtype=jnp.float32)
    t = torch.arange(n, dtype=torch.float32)
    f = torchjax.to_jax(times_two)
    f_jit = jax.jit(f)
    advice, _huge_pages.ENABLED = _huge_pages.ENABLED, False  # read when a call is lowered
    f_plain_pages = jax.jit(lambda x: f(x))
    f_plain_pages(x).block_until_ready()
    _huge_pages.ENABLED = advice
    hand = hand_callback(times_two, n)
    into = into_callback(n)
    assert bool((into(x) == x * 2).all())
    large = (
        "f(x) = x * 2 on 2**24 float32",
        [
            paired_row(
                "to_jax under jit",
                lambda: f_jit(x).block_until_ready(),
                "hand-written compute-then-copy",
                lambda: hand(x).block_until_ready(),
            ),
            paired_row(
                "to_jax under jit",
                lambda: f_jit(x).block_until_ready(),
                "to_jax under jit without huge-page advice",
                lambda: f_plain_pages(x).block_until_ready(),
            ),
            paired_row(
                "to_jax eager",
                lambda: f(x).block_until_ready(),
                "native torch",
                lambda: times_two(t),
            ),
            paired_row(
                "hand-written compute-then-copy",
                lambda: hand(x).block_until_ready(),
                "native torch",
                lambda: times_two(t),
            ),
            paired_row(
                "hand-written buffer_callback computing into XLA's buffer (out=)",
                lambda: into(x).block_until_ready(),
                "native torch",
                lambda: times_two(t),
            ),
        ],
    )
    return [small, large]


def _unwidened(fn, *args):
    """fn(*args) as with TORCHJAX_WIDEN_INT32=0 (read at each call; set at import)."""
    _x64.WIDEN_INT32 = False
    try:
        return fn(*args)
    finally:
        _x64.WIDEN_INT32 = True


def _in(grad_mode, fn, x):
    """fn(x) in a grad mode's context manager (both sides of a row pay for one)."""
    with grad_mode():
        return fn(x)


def _under(mode, op, t):
    with mode:
        return op(t)


format_results = format_tables  # measure()'s tables as the markdown that main() prints


def main() -> None:
    print(format_results(measure()), end="")


if __name__ == "__main__":
    main()
