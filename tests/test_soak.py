"""Soak: many calls, and many wrappers and modules created and dropped, keep memory flat.

A leak per call, or a cache that keeps a dropped wrapper's closure or module alive, shows
up here as resident memory that grows with the count; every dropped object is also
checked dead through a weak reference.
"""

import ctypes
import gc
import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax

pytestmark = pytest.mark.slow  # leave out with -m 'not slow'

MB = 2**20
BIG = 2**21  # float32 elements: 8 MB


def _rss() -> float:
    """Resident memory in MB, after handing freed heap memory back to the OS."""
    gc.collect()
    gc.collect()  # torch tensors in a reference cycle can take two passes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measure as it is
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _summed(f, *rest):
    return lambda x: f(x, *rest).sum()


def test_calls_wrappers_and_modules_keep_memory_flat():
    x = jnp.arange(16.0)
    f = torchjax.to_jax(lambda t: t * 2 + 1)
    f_jit = jax.jit(f)
    for _ in range(500):  # warm up: compile, fill caches, settle the allocator
        f(x), f_jit(x)
    start = _rss()
    for _ in range(20_000):
        f(x)
    for _ in range(20_000):
        f_jit(x)
    np.testing.assert_array_equal(f_jit(x), 2 * np.arange(16.0) + 1)
    calls = _rss()
    assert calls - start < 16, f"20,000 eager and 20,000 jit calls grew RSS by {calls - start} MB"

    alive = []
    for i in range(200):  # 200 wrappers closing over 8 MB each: 1.6 GB if any is kept
        w = torch.full((BIG,), float(i))
        alive.append(weakref.ref(w))
        g = torchjax.to_jax(lambda t, w=w: t * w[:16])
        np.testing.assert_array_equal(g(x), np.arange(16.0) * i)
        if i % 20 == 0:
            jax.block_until_ready((jax.jit(g)(x), jax.grad(_summed(g))(x)))
        del w, g
    wrappers = _rss()
    assert sum(r() is not None for r in alive) == 0
    assert wrappers - calls < 100, f"200 dropped wrappers grew RSS by {wrappers - calls} MB"

    for i in range(50):  # 50 modules of 8 MB of parameters each
        module = torch.nn.Linear(1024, 2048)
        alive.append(weakref.ref(module))
        apply, variables = torchjax.module_to_jax(module)
        jax.block_until_ready(apply(variables, jnp.ones((2, 1024))))
        if i % 10 == 0:
            jax.block_until_ready(jax.grad(_summed(apply, jnp.ones((2, 1024))))(variables))
        del module, apply, variables
    modules = _rss()
    assert sum(r() is not None for r in alive) == 0
    assert modules - wrappers < 100, f"50 dropped modules grew RSS by {modules - wrappers} MB"
