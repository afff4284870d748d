"""The GPU path (docs/how_it_works.md, "Streams"): stream order with torch's own stream,
devices other than the first, zero-copy, kept graphs across streams, out-of-memory advice.

Every test here needs CUDA in torch and a GPU backend in JAX, and skips without them; the
out-of-memory note's wording is also checked on the CPU, with stand-in devices. `make
gpu-check` runs this module on a GPU machine, then the core suite with
TORCHJAX_TEST_DEVICE=cuda.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import as_numpy
from torch._subclasses.fake_tensor import FakeTensor

import torchjax
from torchjax._to_jax._call._cuda import gpu_oom_note

pytestmark = pytest.mark.core  # runs in the version matrix too, where the GPU tests skip


def _jax_gpus() -> list:
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


GPUS = _jax_gpus() if torch.cuda.is_available() else []
needs_gpu = pytest.mark.skipif(not GPUS, reason="needs CUDA in torch and a GPU in JAX")
needs_two_gpus = pytest.mark.skipif(len(GPUS) < 2, reason="needs two GPUs")

# About 50 ms of GPU time on current GPUs (torch.cuda._sleep spins for this many cycles):
# long enough that work queued behind it without an event between would visibly run first.
SLOW = 100_000_000
N = 1 << 20


def _on(device, x):
    return jax.device_put(x, device)


@pytest.mark.gpu
@needs_gpu
def test_torch_work_queued_before_a_jitted_call_is_seen_by_it():
    w = torch.zeros(N, device="cuda")
    f = jax.jit(torchjax.to_jax(lambda x: x * w))
    x = _on(GPUS[0], jnp.ones(N))
    f(x).block_until_ready()  # compiled: the next call only queues work
    torch.cuda._sleep(SLOW)  # on torch's current stream, before the write
    w.fill_(2.0)
    np.testing.assert_array_equal(np.asarray(f(x)), np.full(N, 2.0, np.float32))


@pytest.mark.gpu
@needs_gpu
def test_jax_work_after_the_call_sees_torchs_output():
    def slow_double(x):
        torch.cuda._sleep(SLOW)  # on XLA's stream, inside the callback
        return x * 2

    f = jax.jit(lambda x: torchjax.to_jax(slow_double)(x) + 1)
    x = _on(GPUS[0], jnp.arange(N, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(f(x)), np.arange(N, dtype=np.float32) * 2 + 1)


@pytest.mark.gpu
@needs_gpu
def test_torch_work_after_the_call_sees_what_the_call_wrote():
    cache = torch.zeros(N, device="cuda")

    def fill(x):
        torch.cuda._sleep(SLOW)
        cache.copy_(x * 3)  # the function's own state, written on XLA's stream
        return x.sum()

    # Declared outputs: no fake run of a function that writes its own state.
    f = jax.jit(torchjax.to_jax(fill, result_shape_dtypes=jax.ShapeDtypeStruct((), jnp.float32)))
    x = _on(GPUS[0], jnp.ones(N))
    f(x)  # compiled and run once
    f(x * 2)  # queued: nothing waits for it on the host
    # torch's current stream waits for the call, so this reads the second call's values.
    assert cache.sum().item() == 6.0 * N


@pytest.mark.gpu
@needs_gpu
def test_zero_copy_on_the_gpu():
    seen = {}

    def f(x):
        out = torch.sin(x)
        if not isinstance(x, FakeTensor):
            seen["in"] = x.const_data_ptr()  # data_ptr() asks for write access: refused
            seen["out"] = out.data_ptr()
        return out

    x = _on(GPUS[0], jnp.linspace(0.0, 1.0, N))
    eager = torchjax.to_jax(f)(x)
    assert seen["in"] == x.unsafe_buffer_pointer()  # the input is XLA's buffer
    assert eager.unsafe_buffer_pointer() == seen["out"]  # the output is torch's memory
    jitted = jax.jit(torchjax.to_jax(f))(x)
    assert seen["in"] == x.unsafe_buffer_pointer()  # under jit too: XLA's own buffer
    np.testing.assert_allclose(np.asarray(jitted), np.sin(np.asarray(x)), rtol=1e-6)
    t = torchjax.tree_to_torch(x)
    assert t.data_ptr() == x.unsafe_buffer_pointer() and t.is_cuda


@pytest.mark.gpu
@needs_two_gpus
def test_eager_and_jitted_calls_on_the_second_gpu():
    made = {}

    def f(x, w):
        made["device"] = torch.zeros(1, device="cuda").device  # torch's current device
        return torch.tanh(x @ w)

    x = _on(GPUS[1], jax.random.normal(jax.random.key(0), (64, 32)))
    w = _on(GPUS[1], jax.random.normal(jax.random.key(1), (32, 16)))
    want = np.tanh(np.asarray(x) @ np.asarray(w))
    g = torchjax.to_jax(f)
    eager = g(x, w)
    assert eager.devices() == {GPUS[1]}
    assert made["device"] == torch.device("cuda", 1)
    np.testing.assert_allclose(np.asarray(eager), want, rtol=1e-4, atol=1e-5)
    jitted = jax.jit(g)(x, w)
    assert jitted.devices() == {GPUS[1]}
    np.testing.assert_allclose(np.asarray(jitted), want, rtol=1e-4, atol=1e-5)
    grad = jax.jit(jax.grad(lambda x, w: g(x, w).sum(), argnums=1))(x, w)
    assert grad.devices() == {GPUS[1]}
    xt, wt = (torch.tensor(np.asarray(a), device="cuda:1") for a in (x, w))
    wt.requires_grad_(True)
    torch.tanh(xt @ wt).sum().backward()
    np.testing.assert_allclose(np.asarray(grad), as_numpy(wt.grad), rtol=1e-4, atol=1e-5)
    # A tensor of the function's own on that GPU: the fake run (jit) must put its fake
    # inputs there too, and abstract values carry no device: jax.default_device says it.
    bias = torch.ones(16, device="cuda:1")
    h = torchjax.to_jax(lambda x, w: torch.tanh(x @ w) + bias)
    with jax.default_device(GPUS[1]):
        np.testing.assert_allclose(np.asarray(jax.jit(h)(x, w)), want + 1, rtol=1e-4, atol=1e-5)
    # JAX inside torch, on the second GPU.
    back = torchjax.to_torch(lambda a: jnp.sin(a) * 2)(xt)
    assert back.device == torch.device("cuda", 1)
    np.testing.assert_allclose(as_numpy(back), np.sin(np.asarray(x)) * 2, rtol=1e-5)


@pytest.mark.gpu
@needs_gpu
def test_kept_graph_used_after_mixing_eager_and_jitted_calls():
    def f(x, w):
        torch.cuda._sleep(SLOW)  # a slow forward: its saved tensors come late
        return torch.tanh(x @ w) ** 2

    g = torchjax.to_jax(f)
    x = _on(GPUS[0], jax.random.normal(jax.random.key(0), (256, 128)))
    w = _on(GPUS[0], jax.random.normal(jax.random.key(1), (128, 64)))
    xt = torch.tensor(np.asarray(x), device="cuda")
    wt = torch.tensor(np.asarray(w), device="cuda", requires_grad=True)
    (torch.tanh(xt @ wt) ** 2).sum().backward()
    want = as_numpy(wt.grad)
    # Eager forward (graph kept on torch's stream), backward under jit (XLA's stream).
    out, pullback = jax.vjp(g, x, w)
    jitted_pullback = jax.jit(lambda ct: pullback(ct))
    np.testing.assert_allclose(
        np.asarray(jitted_pullback(jnp.ones_like(out))[1]), want, rtol=1e-4, atol=1e-4
    )
    # And jitted calls in between an eager forward and its eager backward.
    out, pullback = jax.vjp(g, x, w)
    for _ in range(3):
        jax.jit(g)(x, w)
    np.testing.assert_allclose(
        np.asarray(pullback(jnp.ones_like(out))[1]), want, rtol=1e-4, atol=1e-4
    )
    # The whole gradient under jit.
    grad = jax.jit(jax.grad(lambda w: g(x, w).sum()))(w)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_gpu
def test_forced_out_of_memory_says_what_to_set():
    def huge(x):
        return x + torch.empty(1 << 48, device=x.device).sum()  # 1 PiB of float32: never fits

    x = _on(GPUS[0], jnp.ones(4))
    for call in (torchjax.to_jax(huge), jax.jit(torchjax.to_jax(huge))):
        with pytest.raises(Exception, match="torch and JAX share the GPU") as info:
            call(x)
        assert "XLA_PYTHON_CLIENT" in str(info.value) + "".join(
            getattr(info.value, "__notes__", [])
        )


# ------------------------------------------------ out-of-memory advice (runs on the CPU)


class _Device:
    def __init__(self, platform, stats):
        self.platform, self._stats = platform, stats

    def memory_stats(self):
        return self._stats

    def __str__(self):
        return f"{self.platform}:0"


def test_oom_note_names_jax_preallocation_only_where_it_is_on():
    gpu = _Device("gpu", {"bytes_in_use": 2 * 2**30, "bytes_limit": 60 * 2**30})
    note = gpu_oom_note([gpu], environ={})
    assert "2.0 GiB in use of a 60.0 GiB pool" in note
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in note
    assert "expandable_segments:True" in note
    off = gpu_oom_note(
        [gpu],
        environ={
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        },
    )
    assert "already off" in off
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX" not in off
    assert "expandable_segments" not in off
    assert ".5 of the GPU" in gpu_oom_note([gpu], {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})


def test_oom_note_is_absent_where_jax_holds_no_gpu():
    assert gpu_oom_note([_Device("cpu", {})], environ={}) is None

    def f(x):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    if GPUS:
        pytest.skip("JAX holds a GPU here: the note is added (test_forced_out_of_memory)")
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        torchjax.to_jax(f)(jnp.ones(2))
    assert str(info.value).startswith("CUDA out of memory")  # the user's exception, as raised
    assert not any("share the GPU" in n for n in getattr(info.value, "__notes__", []))


# ------------------------------------- the order of the waits (runs on the CPU, stand-ins)


class _Stream:
    """A stand-in for torch.cuda.Stream that logs waits."""

    def __init__(self, ptr, log, device=None):
        self.cuda_stream, self.log, self.device = ptr, log, device

    def wait_stream(self, other):
        self.log.append(f"{self.cuda_stream} waits for {other.cuda_stream}")


@pytest.fixture
def streams(monkeypatch):
    import contextlib

    log = []
    current = {"ptr": 7}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _Stream(current["ptr"], log))
    monkeypatch.setattr(
        torch.cuda, "ExternalStream", lambda ptr, device=None: _Stream(ptr, log, device)
    )

    @contextlib.contextmanager
    def stream(s):
        before, current["ptr"] = current["ptr"], s.cuda_stream
        log.append(f"on {s.cuda_stream}")
        yield
        current["ptr"] = before

    monkeypatch.setattr(torch.cuda, "stream", stream)
    return log, current


def test_jitted_call_waits_for_torchs_stream_and_torch_waits_for_it(streams):
    from torchjax._to_jax._call._cuda import on_xla_stream

    log, _ = streams
    with on_xla_stream(99, 0):
        log.append("torch work")
    assert log == ["99 waits for 7", "on 99", "torch work", "7 waits for 99"]
    log.clear()
    with on_xla_stream(7, 0):  # torch's current stream is XLA's: no event either way
        log.append("torch work")
    assert log == ["on 7", "torch work"]
    log.clear()
    with pytest.raises(ValueError), on_xla_stream(99, 0):
        raise ValueError("the user's")
    assert log[-1] == "7 waits for 99"  # torch's stream is ordered after a failed call too


def test_kept_graph_backward_on_another_stream_is_ordered_both_ways(streams):
    from torchjax._to_jax._call._cuda import ordered_with

    log, current = streams
    forward = _Stream(99, log, device=torch.device("cuda", 0))  # XLA's, under jit
    with ordered_with(forward):  # an eager backward on torch's stream 7
        log.append("backward")
    assert log == ["7 waits for 99", "backward", "99 waits for 7"]
    log.clear()
    current["ptr"] = 99
    with ordered_with(forward):  # the backward on the forward's own stream
        log.append("backward")
    assert log == ["backward"]
    log.clear()
    with ordered_with(None):  # a forward off the GPU
        log.append("backward")
    assert log == ["backward"]
