"""The version matrix: torchjax's core tests on the corners of its supported range.

``make test`` runs everything on the pinned development versions; this runs the core tests
(CORE_TESTS) on the configurations in CONFIGS, each in a throwaway virtual environment:
the oldest versions pyproject.toml admits, and the newest on every newer Python. pyproject's
bounds are exactly these configurations' (tests/test_versions.py checks), and
docs/install.md has the table.

Each configuration installs torchjax as a user would, from a wheel built from this checkout,
together with its jax and torch requirements: if pyproject's ranges exclude them, pip's
resolver fails and so does the configuration. Wheels are downloaded once into a shared
wheelhouse and installed from there (pip does not cache these downloads here), and venvs are
kept between runs, so only the first run, or a new release, downloads anything.

A configuration passes only if its tests ran and none failed; one that could not run (no
such Python, a failed download) is reported as NOT RUN and fails the matrix like a failure.

Usage:
  python tools/matrix.py                  # every configuration; exit status 0 iff all pass
  python tools/matrix.py --only oldest    # some of them
  python tools/matrix.py --list           # the configurations and the core tests
  python tools/matrix.py --tests tests/test_grad.py   # other tests

Environment:
  TORCHJAX_MATRIX_DIR   venvs, wheelhouse and logs (default ~/.cache/torchjax-matrix)
  TORCHJAX_PYTHON3_12   the interpreter for Python 3.12 (likewise 3_11, 3_13); otherwise
                        python3.12 on PATH, then pyenv's newest 3.12.x
  TORCHJAX_MATRIX_TIMEOUT  seconds per configuration's tests (default 2400)
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The core tests: the test modules that mark themselves `pytestmark = pytest.mark.core`
# (tests/conftest.py's --core option selects them): every transform and their compositions,
# conversion, the primitive, the private-API registry and torch's messages, the in-place
# guard, shard_map and state isolation. They need no optional extras (transformers, flax,
# numpyro, diffrax), only TEST_TOOLS.
CORE_TESTS = ("--core", "tests")


# Test dependencies, at the versions requirements-dev.txt pins (optax: test_multidevice;
# cloudpickle: test_jax_surface).
TEST_TOOLS = ("pytest", "hypothesis", "optax", "cloudpickle")


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    python: str  # major.minor
    requirements: tuple[str, ...]  # what this configuration installs besides torchjax
    env: tuple[tuple[str, str], ...] = ()  # environment variables set for its tests
    venv: str = ""  # the venv it runs in, if another configuration's (the same installs)

    @property
    def venv_name(self) -> str:
        return self.venv or self.name


# The newest releases below pyproject's upper bounds: pip picks the newest patch release.
NEWEST = ("jax>=0.12,<0.13", "jaxlib>=0.12,<0.13", "torch>=2.15,<2.16")

# jax 0.12's upgrade flags that are still off by default (flags declared with upgrade=True
# in jax/_src/config.py). remat3 bypasses the partial-eval rule tables torchjax registers.
# jax_scan3 is left off: in jax 0.12.0.1 its scan has no vmap or reverse-mode rule yet, so
# jax.vmap and jax.grad of a pure-JAX lax.scan raise NotImplementedError with it on.
UPGRADE_FLAGS = (
    ("JAX_REMAT3", "1"),
    ("JAX_CUSTOM_VJP3", "1"),
    ("JAX_CUSTOM_JVP3", "1"),
    ("JAX_REMAT_BARRIER_NO_COTANGENTS", "1"),
)

CONFIGS = (
    # pyproject's lower bounds, exactly. JAX 0.11+ needs Python 3.12, so 3.11 ends at 0.10.
    Config("oldest", "3.11", ("jax==0.8.0", "jaxlib==0.8.0", "torch==2.13.0")),
    Config("py3.12-newest", "3.12", NEWEST),
    # The newest JAX with the oldest torch, on a newer Python: the corner between the two.
    Config("py3.12-jax-newest-torch-oldest", "3.12", (*NEWEST[:2], "torch==2.13.0")),
    Config("py3.13-newest", "3.13", NEWEST),
    # jax 0.12 admits the jaxlib before it (its Requires-Dist: jaxlib>=0.11.2), a pair pip
    # picks where jaxlib 0.12 is not available yet.
    Config("py3.12-jax-0.12-jaxlib-0.11", "3.12", (NEWEST[0], "jaxlib==0.11.2", NEWEST[2])),
    # JAX's new implementations behind flags marked for flipping (jax.config's upgrade=True
    # flags that are still off by default), all on: the day JAX flips them, nothing changes.
    Config("py3.12-newest-jax-upgrades", "3.12", NEWEST, env=UPGRADE_FLAGS, venv="py3.12-newest"),
)


def test_tool_pins() -> list[str]:
    """TEST_TOOLS pinned as requirements-dev.txt pins them (one place for those versions)."""
    pins = {}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m:
            pins[m.group(1).lower()] = line.strip()
    return [pins.get(tool, tool) for tool in TEST_TOOLS]


def declared_dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def _patch_number(path: str) -> int:
    m = re.search(r"/versions/\d+\.\d+\.(\d+)", path)
    return int(m.group(1)) if m else -1


def find_python(version: str) -> str | None:
    """An interpreter of `version` (major.minor) that runs and can make venvs, or None."""
    candidates = [os.environ.get("TORCHJAX_PYTHON" + version.replace(".", "_"))]
    candidates.append(shutil.which(f"python{version}"))
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30)
        found = glob.glob(f"{root.stdout.strip()}/versions/{version}.*/bin/python{version}")
        candidates += sorted(found, key=_patch_number, reverse=True)
    except (OSError, subprocess.SubprocessError):
        pass
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        candidates.append(sys.executable)
    for exe in filter(None, candidates):
        probe = "import sys, venv; print('%d.%d' % sys.version_info[:2])"
        try:  # a pyenv shim exists for every version but runs only the selected ones
            out = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return exe
    return None


@dataclasses.dataclass
class Result:
    config: Config
    status: str = "NOT RUN"  # PASSED, FAILED, NOT RUN
    reason: str = ""
    versions: dict = dataclasses.field(default_factory=dict)
    counts: dict = dataclasses.field(default_factory=dict)
    install_s: float = 0.0
    test_s: float = 0.0


class Matrix:
    def __init__(self, home: Path, tests: list[str], timeout: float):
        self.home, self.tests, self.timeout = home, tests, timeout
        self.wheelhouse = home / "wheelhouse"
        self.logs = home / "logs"
        for d in (self.wheelhouse, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        # The configurations pin what they test; a site-wide pip constraints file (such as
        # one capping torch at the versions a machine keeps on disk) would make one install
        # something else than it names. An empty one replaces it.
        empty = home / "no-constraints.txt"
        empty.write_text("")
        self.env = dict(os.environ, PIP_CONSTRAINT=str(empty), PIP_DISABLE_PIP_VERSION_CHECK="1")
        self.env.pop("PYTHONPATH", None)  # the tests must import the installed wheel
        self.wheel: Path | None = None
        self.scratch = tempfile.TemporaryDirectory(prefix="build-", dir=home)

    def build_wheel(self) -> Path:
        """torchjax's wheel, built once from a clean copy of the sources (not a stale
        build/ folder's)."""
        if self.wheel is None:
            out, src = Path(self.scratch.name) / "wheel", Path(self.scratch.name) / "src"
            src.mkdir()
            for name in ("pyproject.toml", "README.md", "LICENSE"):
                shutil.copy(ROOT / name, src / name)
            shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.egg-info"))
            cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out)]
            self._run(cmd + [str(src)], self.logs / "wheel.log", "building torchjax's wheel")
            self.wheel = next(out.glob("torchjax-*.whl"))
        return self.wheel

    def _run(self, cmd: list[str], log: Path, what: str, timeout: float = 3600) -> None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, timeout=timeout
            )
        if rc.returncode:
            tail = "\n".join(
                ln for ln in log.read_text().splitlines() if "is ignored: it is neither" not in ln
            )[-1500:]
            raise RuntimeError(f"{what} failed (exit {rc.returncode}); log {log}:\n{tail}")

    def install(self, config: Config, python: str) -> Path:
        """The configuration's venv with its requirements and torchjax's wheel installed."""
        venv = self.home / "venvs" / config.venv_name
        log = self.logs / f"{config.name}-install.log"
        log.write_text("")
        requirements = [*config.requirements, *test_tool_pins()]
        stamp = venv / "matrix-stamp.json"
        wanted = json.dumps({"python": python, "requirements": requirements})
        if not (stamp.exists() and stamp.read_text() == wanted):
            shutil.rmtree(venv, ignore_errors=True)
            self._run([python, "-m", "venv", str(venv)], log, "creating the venv")
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        # Resolve against the index (with pyproject's own ranges, so an excluded version
        # fails here) and fetch what the wheelhouse lacks; then install from it alone.
        self._run(
            [*pip, "download", "-q", "-d", str(self.wheelhouse), *requirements]
            + declared_dependencies(),
            log,
            "downloading",
        )
        wheel = self.build_wheel()
        self._run(
            [*pip, "install", "-q", "--upgrade", "--no-index", "--find-links", str(self.wheelhouse)]
            + [*requirements, str(wheel)],
            log,
            "installing",
        )
        # The wheel has torchjax's version, unchanged by edits: install this build's copy.
        self._run(
            [*pip, "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], log, "installing"
        )
        stamp.write_text(wanted)
        return venv

    def versions(self, config: Config, venv: Path) -> dict:
        code = (
            "import json, sys, jax, jaxlib, numpy, torch, torchjax\n"
            "print(json.dumps({'python': sys.version.split()[0], 'jax': jax.__version__, "
            "'jaxlib': jaxlib.__version__, 'torch': torch.__version__, "
            "'numpy': numpy.__version__, 'torchjax': torchjax.__file__, "
            f"'flags': {{n: jax.config.values[n.lower()] for n in {[k for k, _ in config.env]}}}"
            "}))"
        )
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-c", code],
            capture_output=True,
            text=True,
            env=dict(self.env, **dict(config.env)),
            cwd=self.home,
            timeout=600,
        )
        if out.returncode:
            raise RuntimeError(f"importing torchjax failed:\n{out.stderr[-1500:]}")
        found = json.loads(out.stdout.strip().splitlines()[-1])
        if "site-packages" not in found["torchjax"]:
            raise RuntimeError(f"imported torchjax from {found['torchjax']}, not the wheel")
        off = [name for name, on in found.pop("flags").items() if not on]
        if off:  # a flag this jax does not read would make the configuration test nothing
            raise RuntimeError(f"jax did not turn on {off} from the environment")
        return found

    def run_tests(self, config: Config, venv: Path) -> dict:
        xml = self.logs / f"{config.name}-junit.xml"
        xml.unlink(missing_ok=True)
        log = self.logs / f"{config.name}-tests.log"
        cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd += [f"--junitxml={xml}", *self.tests]
        env = dict(self.env, **dict(config.env))
        with open(log, "w") as f:
            if config.env:
                f.write(f"environment: {' '.join(f'{k}={v}' for k, v in config.env)}\n")
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            timer = threading.Timer(self.timeout, proc.kill)  # a hang fails, never waits forever
            timer.start()
            try:
                for line in proc.stdout:  # shown as it comes, and kept
                    text = line.decode(errors="replace")
                    sys.stdout.write(text)
                    f.write(text)
                proc.wait()
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "exit": proc.returncode}
        counts["timed_out"] = proc.returncode == -signal.SIGKILL
        if xml.exists():
            for suite in ET.parse(xml).getroot().iter("testsuite"):
                for key in ("tests", "failures", "errors", "skipped"):
                    counts[key] += int(suite.get(key, 0))
        return counts

    def run(self, config: Config) -> Result:
        result = Result(config)
        python = find_python(config.python)
        if python is None:
            result.reason = (
                f"no Python {config.python} found (python{config.python} on PATH, pyenv, or "
                f"TORCHJAX_PYTHON{config.python.replace('.', '_')})"
            )
            return result
        start = time.monotonic()
        try:
            venv = self.install(config, python)
            result.versions = self.versions(config, venv)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            result.reason = str(e)
            return result
        finally:
            result.install_s = time.monotonic() - start
        start = time.monotonic()
        result.counts = self.run_tests(config, venv)
        result.test_s = time.monotonic() - start
        c = result.counts
        ran = c["tests"] - c["skipped"]
        if c["exit"] == 0 and not c["failures"] and not c["errors"] and ran > 0:
            result.status = "PASSED"
        else:
            result.status = "FAILED"
            why = f"timed out after {self.timeout:.0f} s" if c["timed_out"] else f"exit {c['exit']}"
            result.reason = (
                f"pytest {why}: {c['failures']} failed, {c['errors']} errors, "
                f"{c['skipped']} skipped of {c['tests']}; log "
                f"{self.logs / (config.name + '-tests.log')}"
            )
        return result


def summary(results: list[Result], skipped: list[Config]) -> str:
    rows = [
        "| configuration | python | jax | jaxlib | torch | result | tests (passed / skipped) "
        "| install s | tests s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        v, c = r.versions, r.counts
        passed = c.get("tests", 0) - c.get("failures", 0) - c.get("errors", 0) - c.get("skipped", 0)
        tests = f"{passed} / {c.get('skipped', 0)}" if c else "-"
        rows.append(
            f"| {r.config.name} | {v.get('python', r.config.python)} | {v.get('jax', '-')} "
            f"| {v.get('jaxlib', '-')} | {v.get('torch', '-')} | {r.status} | {tests} "
            f"| {r.install_s:.0f} | {r.test_s:.0f} |"
        )
    lines = rows + [""]
    for r in results:
        if r.status != "PASSED":
            lines.append(f"{r.config.name}: {r.status}: {r.reason}")
    for config in skipped:
        lines.append(f"{config.name}: not selected (--only): NOT tested by this run")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CONFIGS])
    parser.add_argument("--tests", nargs="+", default=list(CORE_TESTS))
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--dir", default=os.environ.get("TORCHJAX_MATRIX_DIR"))
    args = parser.parse_args(argv)
    if args.list:
        for c in CONFIGS:
            env = "".join(f" {k}={v}" for k, v in c.env)
            print(f"{c.name}: Python {c.python}, {' '.join(c.requirements)}{env}")
        print("tests:", " ".join(args.tests))
        return 0
    home = Path(args.dir or Path.home() / ".cache" / "torchjax-matrix").resolve()
    home.mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get("TORCHJAX_MATRIX_TIMEOUT", 2400))
    matrix = Matrix(home, args.tests, timeout)
    selected = [c for c in CONFIGS if not args.only or c.name in args.only]
    results = []
    start = time.monotonic()
    try:
        for config in selected:
            env = "".join(f" {k}={v}" for k, v in config.env)
            needs = " ".join(config.requirements)
            print(f"\n=== {config.name}: Python {config.python}, {needs}{env}")
            sys.stdout.flush()
            result = matrix.run(config)
            print(f"=== {config.name}: {result.status} {result.reason}".rstrip(), flush=True)
            results.append(result)
    finally:
        matrix.scratch.cleanup()
    text = summary(results, [c for c in CONFIGS if c not in selected])
    text += f"\n\nmatrix wall time: {time.monotonic() - start:.0f} s"
    (home / "summary.md").write_text(text + "\n")
    print("\n" + text)
    return 0 if results and all(r.status == "PASSED" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
