"""Check that requirements-gpu.txt resolves to one CUDA stack, without downloading it.

pip resolves the file for Linux x86_64 and Python 3.12 (`pip install --dry-run --report`),
and the resolution must hold: torch and jax at the file's pins, torch's CUDA build (it
requires CUDA's wheels), JAX's CUDA 13 plugin, and every CUDA library wheel of one CUDA major
version (no -cu12 wheel beside the -cu13 ones). As a control, the same check must reject the
same file with jax[cuda12] in place of jax[cuda13]: a check that cannot fail proves nothing.

The resolution must not download the wheels: they are about 3 GB (torch's CUDA build,
cuDNN, cuBLAS, ...), and a CI machine's disk filled up doing so. An index without PEP 658
metadata files (this project's registries) makes a plain `--dry-run` download every wheel
whole to read its METADATA, so pip runs with `--use-feature=fast-deps`, which reads METADATA
from the end of each wheel with HTTP range requests. pip 23's dry run still downloaded the
wheels after resolving with it; pip 26.3's does not, so the check runs a pinned pip in a
throwaway venv, and fails if pip reports downloading any wheel over a megabyte whole.

Usage:  python tools/check_gpu_requirements.py      (CI runs it; exit status 0 iff it holds)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix import find_python  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements-gpu.txt"
RESOLVER_PIP = "pip==26.3"  # the first pip seen to dry-run fast-deps without downloading


def resolver_python(python: str, workdir: Path) -> str:
    """A throwaway venv's interpreter made from `python`, with RESOLVER_PIP in it."""
    venv = workdir / "resolver-venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    exe = str(venv / "bin" / "python")
    cmd = [exe, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", RESOLVER_PIP]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"could not install {RESOLVER_PIP} to resolve with:\n{out.stderr[-3000:]}")
    return exe


def resolve(python: str, requirements: Path, workdir: Path) -> list[dict]:
    """The packages pip would install for `requirements` with `python` (on this machine's
    platform, Linux x86_64): the report's entries."""
    report = workdir / f"{requirements.stem}.json"
    empty = workdir / "no-constraints.txt"  # a site-wide cap (as on this project's machines)
    empty.write_text("")
    cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--progress-bar=off"]
    cmd += ["--only-binary=:all:", "--use-feature=fast-deps"]
    cmd += ["--report", str(report), "-r", str(requirements)]
    env = {"PIP_CONSTRAINT": str(empty), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if out.returncode:
        raise SystemExit(f"pip could not resolve {requirements.name}:\n{out.stderr[-3000:]}")
    whole = re.findall(r"Downloading (\S+\.whl) \(([\d.]+) (MB|GB)\)", out.stdout + out.stderr)
    big = [
        f"{name} ({size} {unit})" for name, size, unit in whole if unit == "GB" or float(size) > 1
    ]
    if big:
        raise SystemExit(
            f"pip downloaded whole wheels to resolve {requirements.name} (range requests not "
            f"served by the index, or a pip that ignores fast-deps in a dry run): {', '.join(big)}"
        )
    return json.loads(report.read_text())["install"]


def _pins(requirements: Path) -> dict[str, str]:
    pins = {}
    for line in requirements.read_text().splitlines():
        m = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==(\S+)", line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(3)
    return pins


def problems(installs: list[dict], pins: dict[str, str]) -> list[str]:
    """What is wrong with a resolution (an empty list: nothing)."""
    found = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"] for i in installs}
    wrong = []
    for name in ("torch", "jax", "jaxlib"):
        got = found.get(name, {}).get("version")
        if got != pins.get(name):
            wrong.append(f"{name}: resolved {got}, the file pins {pins.get(name)}")
    torch_needs = " ".join(found.get("torch", {}).get("requires_dist", []))
    if not re.search(r"(cuda-toolkit|nvidia-cuda-runtime|nvidia-[a-z-]+-cu\d+)", torch_needs):
        wrong.append("torch: the resolved wheel needs no CUDA library wheels (not a CUDA build)")
    if "jax-cuda13-plugin" not in found:
        wrong.append("jax-cuda13-plugin: missing (JAX would run on the CPU only)")
    majors = {}
    for name, meta in found.items():
        m = re.search(r"-cu(\d+)$", name)
        if m:
            majors.setdefault(m.group(1), []).append(name)
        elif name in ("nvidia-cuda-runtime", "cuda-toolkit"):
            majors.setdefault(meta["version"].split(".")[0], []).append(name)
    if len(majors) != 1:
        stacks = "; ".join(f"CUDA {k}: {', '.join(sorted(v))}" for k, v in sorted(majors.items()))
        wrong.append(f"more than one CUDA stack: {stacks}")
    return wrong


def main() -> int:
    python = find_python("3.12") or find_python("3.13")
    if python is None:
        print("check_gpu_requirements: no Python 3.12 or 3.13 to run pip with", file=sys.stderr)
        return 1
    pins = _pins(REQUIREMENTS)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        python = resolver_python(python, workdir)
        installs = resolve(python, REQUIREMENTS, workdir)
        wrong = problems(installs, pins)
        control = workdir / "requirements-gpu-cuda12.txt"
        control.write_text(REQUIREMENTS.read_text().replace("jax[cuda13]", "jax[cuda12]"))
        rejected = problems(resolve(python, control, workdir), pins)
    cuda = sorted(
        f"{i['metadata']['name']}=={i['metadata']['version']}"
        for i in installs
        if re.match(r"(nvidia|jax-cuda|cuda)", i["metadata"]["name"].lower())
    )
    print(f"requirements-gpu.txt resolves to {len(installs)} packages; CUDA wheels:")
    print("  " + "\n  ".join(cuda))
    two_stacks = [r for r in rejected if r.startswith("more than one CUDA stack")]
    if not two_stacks:
        print(f"FAILED: the control (jax[cuda12]) was not seen as two CUDA stacks: {rejected}")
        return 1
    print(f"control jax[cuda12] rejected, as it must be: {two_stacks[0][:160]}...")
    if wrong:
        print("FAILED:\n  " + "\n  ".join(wrong))
        return 1
    print("requirements-gpu.txt: one CUDA stack (CUDA 13), torch and jax as pinned: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
