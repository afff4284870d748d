"""docs/recipes.md's keep_freed_memory, run as the recipe says, in fresh processes.

The recipe's claim is about glibc, not torchjax: with its three malloc settings made at run
time (before JAX starts), memory a thread frees is reused without new page faults. Each
check runs in a new process because the settings are process-wide and the arena one counts
only for threads that have not allocated yet; a process without the call is the control.
"""

import json
import pathlib
import platform
import re
import subprocess
import sys

import numpy as np
import pytest

RECIPES = pathlib.Path(__file__).resolve().parent.parent / "docs" / "recipes.md"

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the recipe is for glibc's malloc"
)


def _recipe_function() -> str:
    """The recipe's code block, without its `if __name__ == "__main__":` example."""
    for block in re.findall(r"^```python\n(.*?)^```", RECIPES.read_text(), re.S | re.M):
        if "def keep_freed_memory" in block:
            return block.split('\nif __name__ == "__main__":')[0]
    raise AssertionError("docs/recipes.md has no keep_freed_memory block")


# A new thread allocates 64 MiB with torch, fills it (the first touch faults its pages in),
# frees it, and does the same five times more: each fill's page faults say whether the
# memory came back fresh from the kernel. torch on one thread, so the fill's faults are this
# thread's. (With the recipe, a later fill may still find new memory: another thread's
# small allocation can land in the freed block, and the heap then grows by one block more
# and stays; seen once per process at most.) Then a jitted to_jax gradient, whose numbers
# must not depend on the setting.
_PROBE = r"""
import json, resource, threading
applied = keep_freed_memory() if {call} else None
import jax, jax.numpy as jnp, torch, torchjax
torch.set_num_threads(1)
faults = []

def fill_twice():
    for _ in range(6):
        t = torch.empty(16 * 2**20)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        t.fill_(1.0)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
        del t

thread = threading.Thread(target=fill_twice)
thread.start()
thread.join()
f = torchjax.to_jax(lambda w, x: torch.tanh(x @ w).pow(2).sum())
w, x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), jnp.linspace(0.0, 2.0, 20).reshape(5, 4)
grad = jax.jit(jax.grad(f))(w, x)
print(json.dumps({{"applied": applied, "faults": faults, "grad": grad.tolist()}}))
"""


def _run(call: bool) -> dict:
    code = _recipe_function() + _PROBE.format(call=call)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_keep_freed_memory_reuses_a_threads_freed_memory_without_page_faults():
    kept, control = _run(call=True), _run(call=False)
    assert kept["applied"] is True
    first, *later = control["faults"]
    assert first > 0 and min(later) * 2 >= first, control  # without: fresh pages every time
    first, *later = kept["faults"]
    assert first > 0 and later[-1] * 10 <= first, kept  # with: the same pages, already there
    assert sum(later) * 2 <= 5 * first, kept  # and the heap grew by two blocks at most
    # The setting changes where memory comes from, never a number.
    w = np.linspace(-1.0, 1.0, 12).reshape(4, 3)
    x = np.linspace(0.0, 2.0, 20).reshape(5, 4)
    t = np.tanh(x @ w)  # d/dw sum(tanh(x @ w) ** 2), by hand
    expected = x.T @ (2 * t * (1 - t**2))
    for result in (kept, control):
        np.testing.assert_allclose(result["grad"], expected, rtol=1e-5, atol=1e-5)
