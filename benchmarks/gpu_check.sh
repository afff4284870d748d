#!/usr/bin/env bash
# GPU check: the `gpu`-marked tests and the to_jax overhead benchmark on a CUDA machine.
#
# Needs a CUDA build of torch and of jax (e.g. `pip install "jax[cuda12]==0.10.2"` beside a
# CUDA torch) in the active Python; runs in well under 5 minutes. Usage:
#   bash benchmarks/gpu_check.sh            # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" - <<'PY'
import jax, torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
assert any(d.platform == "gpu" for d in jax.devices()), f"JAX sees no GPU: {jax.devices()}"
print("torch", torch.__version__, torch.cuda.get_device_name(0), "| jax", jax.__version__, jax.devices())
PY
timeout 240 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider
timeout 120 "$PY" benchmarks/run.py to_jax
