"""Huge-page advice on XLA's large CPU output buffers under jit (_call/_huge_pages.py): which
buffers get it, that the kernel records it for the buffer the call wrote, and that every
number stays what torch computes."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax
from torchjax._to_jax._call import _huge_pages as _huge_pages

HUGE = 2 * 2**20
LIBC_MADVISE = _huge_pages._libc_madvise() if sys.platform.startswith("linux") else None
KERNEL_GIVES_ON_REQUEST = LIBC_MADVISE is not None and _huge_pages._kernel_gives_on_request()


@pytest.fixture
def recorded(monkeypatch):
    """The advice taken, as (start, length, advice), and passed on to the kernel if it can."""
    calls = []
    real = LIBC_MADVISE if KERNEL_GIVES_ON_REQUEST else None

    def madvise(start, length, advice):
        calls.append((start, length, advice))
        return real(start, length, advice) if real is not None else 0

    monkeypatch.setattr(_huge_pages, "_madvise", madvise)
    monkeypatch.setattr(_huge_pages, "ENABLED", True)
    return calls


def _vm_flags(addr):
    """The kernel's flags for the mapping that holds `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not line.startswith("VmFlags"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif line.startswith("VmFlags") and inside:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_only_buffers_of_4_mib_or_more_get_the_advice(recorded):
    structs = [
        jax.ShapeDtypeStruct((2**20 - 1,), jnp.float32),  # 4 bytes short
        jax.ShapeDtypeStruct((2**20,), jnp.float32),
        jax.ShapeDtypeStruct((2**19, 2), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.float32),
        jax.ShapeDtypeStruct((0, 2**22), jnp.float32),  # empty
    ]
    assert _huge_pages.large_outputs(structs) == (1, 2)
    _huge_pages.ENABLED = False
    assert _huge_pages.large_outputs(structs) == ()


def test_the_advice_covers_whole_huge_pages_inside_the_output_buffer(recorded):
    # An odd size: the buffer neither starts nor ends on a huge page.
    f = jax.jit(torchjax.to_jax(lambda x: x * 2))
    x = jnp.arange(2**22 + 5, dtype=jnp.float32)
    y = f(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
    assert len(recorded) == 1  # once per call, not again on the first call's detour
    start, length, advice = recorded[0]
    buf = y.unsafe_buffer_pointer()  # the callback's output is the jitted call's result
    assert advice == 14  # MADV_HUGEPAGE
    assert start % HUGE == 0 and length % HUGE == 0 and length > 0
    assert buf <= start and start + length <= buf + y.nbytes
    assert start - buf < HUGE and (buf + y.nbytes) - (start + length) < HUGE
    f(x).block_until_ready()
    assert len(recorded) == 2  # and on every call: XLA's buffer is a new one each time


def test_small_outputs_are_not_advised(recorded):
    f = jax.jit(torchjax.to_jax(lambda x: (x + 1, x.sum())))
    x = jnp.ones(2**20 - 1)
    out = f(x)
    np.testing.assert_array_equal(np.asarray(out[0]), np.full(2**20 - 1, 2.0, np.float32))
    assert recorded == []


@pytest.mark.skipif(not KERNEL_GIVES_ON_REQUEST, reason="the kernel gives no huge pages on request")
def test_the_kernel_records_huge_pages_for_the_written_buffer():
    assert _huge_pages.ENABLED, "on by default where the kernel gives huge pages on request"
    f = jax.jit(torchjax.to_jax(lambda x: torch.sin(x)))
    x = jnp.linspace(0, 1, 2**23, dtype=jnp.float32)
    y = f(x)
    np.testing.assert_array_equal(np.asarray(y), torch.sin(torch.from_numpy(np.array(x))).numpy())
    start = (y.unsafe_buffer_pointer() + HUGE - 1) & -HUGE
    assert "hg" in _vm_flags(start)
    assert "hg" in _vm_flags(start + 8 * 2**20)


def test_every_write_path_keeps_torchs_numbers(recorded):
    """Large outputs of each way the callback writes: the plain one-output path, several
    outputs of mixed dtypes, a float64 result narrowed (x64 off), and gradients of a module
    written as the backward makes them; each against torch itself."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(2**21 + 3).astype(np.float32)
    b = rng.standard_normal((1024, 1030)).astype(np.float32)

    def several(x, y):
        return {"sum": x + 1, "idx": torch.argsort(y, dim=1), "prod": y @ y.T}

    got = jax.jit(torchjax.to_jax(several))(jnp.asarray(a), jnp.asarray(b))
    tb = torch.from_numpy(b)
    np.testing.assert_array_equal(np.asarray(got["sum"]), a + 1)
    np.testing.assert_array_equal(np.asarray(got["idx"]), torch.argsort(tb, dim=1).numpy())
    np.testing.assert_array_equal(np.asarray(got["prod"]), (tb @ tb.T).numpy())

    narrowed = jax.jit(torchjax.to_jax(lambda x: x.double() * 3))(jnp.asarray(a))
    np.testing.assert_array_equal(np.asarray(narrowed), (torch.from_numpy(a).double() * 3).float())

    model = torch.nn.Sequential(
        torch.nn.Linear(1030, 1100), torch.nn.Tanh(), torch.nn.Linear(1100, 1024)
    )
    apply, variables = torchjax.module_to_jax(model)
    xs = torch.from_numpy(b[:16])

    def loss(params):
        return jnp.sum(
            apply({"params": params, "buffers": variables["buffers"]}, jnp.asarray(b[:16])) ** 2
        )

    grads = jax.jit(jax.grad(loss))(variables["params"])
    (model(xs) ** 2).sum().backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[name]), p.grad.numpy(), rtol=1e-5, atol=1e-5)
    n_large = sum(p.numel() * 4 >= _huge_pages.THRESHOLD for p in model.parameters())
    assert n_large == 2 and len(recorded) == 3 + 1 + n_large  # each path above, once


def test_torchjax_huge_pages_0_turns_the_advice_off():
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from torchjax._to_jax._call import _huge_pages as _huge_pages
        big = jax.ShapeDtypeStruct((2**22,), jnp.float32)
        print(_huge_pages.ENABLED, _huge_pages.large_outputs([big]))
        """
    )
    env = dict(os.environ, TORCHJAX_HUGE_PAGES="0")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "()"]


def test_a_buffer_dlpack_cannot_wrap_is_written_without_advice(recorded, monkeypatch):
    def refuse(capsule):
        raise BufferError("this dtype has no DLPack form")

    monkeypatch.setattr(_huge_pages, "tensor_from_capsule", refuse)
    x = jnp.arange(2**21, dtype=jnp.float32)
    y = jax.jit(torchjax.to_jax(lambda x: x - 1))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) - 1)
    assert recorded == []
