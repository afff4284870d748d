"""`make dist`: build torchjax's wheel and sdist, check them, and run the quickstart from the
installed wheel, as a user who got it from PyPI would.

Steps (each one's failure fails the whole):
  1. `python -m build` into dist/ (an sdist, then a wheel built from that sdist, so a file
     missing from the sdist breaks the wheel too).
  2. `twine check --strict`: the metadata and the long description render.
  3. The wheel's contents and metadata: the package with py.typed, the LICENSE, the version
     of src/torchjax/_version.py, the dependency ranges of pyproject.toml.
  4. A fresh venv outside the repository gets the wheel with the pinned CPU torch and jax
     of requirements-dev.txt; examples/quickstart.py is copied to a temporary folder and run
     there, so it can import only the installed package.

Usage: python tools/check_dist.py [--keep-venv]
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "dist"
# What the fresh venv installs beside the wheel: the development pins (torch's CPU wheel).
RUNTIME_PINS = ("torch", "jax", "jaxlib", "numpy")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def version() -> str:
    text = (ROOT / "src" / "torchjax" / "_version.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def pins() -> list[str]:
    found = {}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m and m.group(1).lower() in RUNTIME_PINS:
            found[m.group(1).lower()] = line.strip()
    missing = set(RUNTIME_PINS) - set(found)
    if missing:
        raise SystemExit(f"requirements-dev.txt pins none of {sorted(missing)}")
    return [found[name] for name in RUNTIME_PINS]


def check_wheel(wheel: Path, expected_version: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"torchjax-{expected_version}.dist-info"
        metadata = z.read(f"{info}/METADATA").decode()
    problems = []
    for needed in ("torchjax/__init__.py", "torchjax/py.typed", f"{info}/licenses/LICENSE"):
        if needed not in names:
            problems.append(f"the wheel lacks {needed}")
    stray = sorted(n for n in names if n.startswith(("tests/", "docs/", "examples/")))
    if stray:
        problems.append(f"the wheel holds files outside the package: {stray[:5]}")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    meta = email.parser.Parser().parsestr(metadata)
    if meta["Version"] != expected_version:
        problems.append(f"METADATA's Version is {meta['Version']}, not {expected_version}")
    if meta["License-Expression"] != project["license"]:
        problems.append(f"METADATA's License-Expression is not {project['license']}")
    if SpecifierSet(meta["Requires-Python"]) != SpecifierSet(project["requires-python"]):
        problems.append(f"METADATA's Requires-Python is not {project['requires-python']}")
    required = {Requirement(r).name: Requirement(r) for r in meta.get_all("Requires-Dist") or []}
    for dep in map(Requirement, project["dependencies"]):
        if dep.name not in required or required[dep.name].specifier != dep.specifier:
            problems.append(f"METADATA does not require {dep}")
    if "Description-Content-Type: text/markdown" not in metadata:
        problems.append("the long description is not marked as Markdown")
    if problems:
        raise SystemExit("wheel check failed:\n  " + "\n  ".join(problems))
    print(f"wheel contents and metadata: ok ({len(names)} files)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-venv", action="store_true", help="print the venv, keep it")
    args = parser.parse_args()
    shutil.rmtree(DIST, ignore_errors=True)
    # --no-isolation: build with this venv's setuptools (pinned) instead of downloading one.
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(DIST), str(ROOT)])
    expected = version()
    wheel = DIST / f"torchjax-{expected}-py3-none-any.whl"
    sdist = DIST / f"torchjax-{expected}.tar.gz"
    for path in (wheel, sdist):
        if not path.exists():
            made = sorted(p.name for p in DIST.iterdir())
            raise SystemExit(f"the build made no {path.name}: {made}")
    run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)])
    check_wheel(wheel, expected)

    scratch = Path(tempfile.mkdtemp(prefix="torchjax-dist-"))
    try:
        venv = scratch / "venv"
        run([sys.executable, "-m", "venv", str(venv)])
        python = venv / "bin" / "python"
        run([str(python), "-m", "pip", "install", "-q", *pins(), str(wheel)])
        work = scratch / "user"
        work.mkdir()
        shutil.copy(ROOT / "examples" / "quickstart.py", work / "quickstart.py")
        code = (
            "import torchjax, sys; print(torchjax.__version__, torchjax.__file__); "
            f"sys.exit(torchjax.__version__ != {expected!r} or 'site-packages' not in "
            "torchjax.__file__)"
        )
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no checkout
        run([str(python), "-c", code], cwd=work, env=env)
        run([str(python), "quickstart.py"], cwd=work, env=env)
    finally:
        if args.keep_venv:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"dist: ok: {wheel.name} and {sdist.name} in {DIST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
