# JAX's persistent compilation cache with torch calls inside (docs/recipes.md): a process that
# loads a cached executable runs its own torch code, never the code of the process that wrote
# the cache. Since jax 0.11 the cache stores executables with host callbacks; this test then
# also requires the second process to hit the cache, so that it tests the restored path.
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from packaging.version import Version

pytestmark = [pytest.mark.core, pytest.mark.slow]

CHILD = r"""
import json, logging, sys
import jax, jax.numpy as jnp, numpy as np, torch, torchjax
hits = []
class Hits(logging.Handler):  # jax logs each persistent-cache hit at DEBUG
    def emit(self, record):
        if "Persistent compilation cache hit" in record.getMessage():
            hits.append(1)
logger = logging.getLogger("jax._src.compiler")
logger.setLevel(logging.DEBUG)
logger.addHandler(Hits())
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
scale = float(sys.argv[2])
f = torchjax.to_jax(lambda x: torch.sin(x) * scale)  # the torch code differs per process
step = jax.jit(jax.value_and_grad(lambda x: jnp.sum(f(x) ** 2)))
x = np.linspace(-1.0, 1.0, 5, dtype=np.float32)
value, grad = step(x)
print(json.dumps({"value": float(value), "grad": np.asarray(grad).tolist(), "hits": len(hits)}))
"""


def _run(cache_dir: str, scale: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, cache_dir, str(scale)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _expected(scale: float) -> tuple[float, list[float]]:
    import numpy as np

    x = np.linspace(-1.0, 1.0, 5, dtype=np.float64)
    y = np.sin(x) * scale
    return float(np.sum(y**2)), (2 * y * np.cos(x) * scale).tolist()


def test_a_cached_program_runs_this_process_torch_code(tmp_path):
    first = _run(str(tmp_path), 2.0)
    second = _run(str(tmp_path), 3.0)  # same shapes, other torch code, same cache
    for result, scale in ((first, 2.0), (second, 3.0)):
        value, grad = _expected(scale)
        assert result["value"] == pytest.approx(value, rel=1e-5)
        assert result["grad"] == pytest.approx(grad, rel=1e-5, abs=1e-6)
    if Version(jax.__version__) >= Version("0.11"):
        assert second["hits"] > 0, "jax 0.11+ should have loaded the cached executable"
