"""`make gpu-check`: everything torchjax claims on a GPU, checked on a fresh GPU machine.

Needs only Python 3.12+ and the package index. In order, each step with a time limit so the
whole stays within 8 minutes on a machine with a fast index:

1. finds an NVIDIA GPU (nvidia-smi); with none it says so and exits 0, having done nothing;
2. installs requirements-gpu.txt and this checkout (editable) into .venv-gpu;
3. checks that torch sees CUDA and JAX a GPU;
4. runs the GPU tests (`-m gpu`: streams, devices, zero-copy, kept graphs, OOM advice);
5. runs the core suite with its data on the GPU (TORCHJAX_TEST_DEVICE=cuda);
6. runs benchmarks/gpu_bench.py: per call, vmap, grad and a training step against torch.

It ends with one summary table (each step PASSED or FAILED, and its time) and the benchmark
table, written also to build/gpu-check.md for docs/benchmarks.md. Exit status 0 iff every
step passed (or no GPU exists).

Usage:  make gpu-check      (or: python3 tools/gpu_check.py [--skip-install])
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix import find_python  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-gpu"
REPORT = ROOT / "build" / "gpu-check.md"


def gpus() -> list[str]:
    """The NVIDIA GPUs nvidia-smi lists (none where it is missing or finds no device)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in out.stdout.splitlines() if line.startswith("GPU ")]


class Steps:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float]] = []

    def run(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> bool:
        print(f"\n== {name}: {' '.join(cmd)}", flush=True)
        start = time.monotonic()
        try:
            code = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode
            status = "PASSED" if code == 0 else f"FAILED (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"FAILED (over {timeout:.0f} s)"
        self.rows.append((name, status, time.monotonic() - start))
        return status == "PASSED"

    def table(self) -> str:
        lines = ["| step | result | seconds |", "|---|---|---:|"]
        lines += [f"| {name} | {status} | {s:.0f} |" for name, status, s in self.rows]
        return "\n".join(lines)

    @property
    def passed(self) -> bool:
        return all(status == "PASSED" for _, status, _ in self.rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-install", action="store_true", help="reuse .venv-gpu as it is")
    args = parser.parse_args(argv)
    found = gpus()
    if not found:
        print("gpu-check: no CUDA device on this machine (nvidia-smi lists no GPU); nothing to do.")
        print("Run `make gpu-check` on a machine with an NVIDIA GPU and its driver.")
        return 0
    print("gpu-check: " + "; ".join(found))
    python = next(filter(None, map(find_python, ("3.12", "3.13", "3.14"))), None)
    if python is None:
        print("gpu-check: needs Python 3.12 or newer (jax 0.12), and found none.")
        return 1
    steps = Steps()
    py = str(VENV / "bin" / "python")
    if not args.skip_install:
        if not (VENV / "bin" / "python").exists():
            subprocess.run([python, "-m", "venv", str(VENV)], check=True)
        pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        ok = steps.run("install", [*pip, "-r", "requirements-gpu.txt"], 300)
        ok = ok and steps.run("install torchjax", [*pip, "--no-deps", "-e", "."], 120)
        if not ok:
            print("\n" + steps.table())
            return 1
    probe = (
        "import jax, torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; "
        "g = [d for d in jax.devices() if d.platform == 'gpu']; "
        "assert g, f'JAX sees no GPU: {jax.devices()}'; "
        "print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), "
        "'| jax', jax.__version__, g)"
    )
    if steps.run("torch and JAX see the GPU", [py, "-c", probe], 120):
        pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--core", "tests"]
        steps.run("GPU tests (-m gpu)", [*pytest, "-m", "gpu", "-rs"], 180)
        on_gpu = dict(os.environ, TORCHJAX_TEST_DEVICE="cuda")
        core = [*pytest, "-m", "not slow", "--maxfail=50"]
        steps.run("core suite on CUDA", core, 240, on_gpu)
        REPORT.parent.mkdir(exist_ok=True)
        REPORT.unlink(missing_ok=True)
        bench = [py, "benchmarks/gpu_bench.py", "--device", "cuda", "--out", str(REPORT)]
        steps.run("benchmarks on GPU", bench, 180)
    print("\n## gpu-check\n\n" + steps.table())
    if REPORT.exists():
        print("\n" + REPORT.read_text())
    return 0 if steps.passed else 1


if __name__ == "__main__":
    sys.exit(main())
