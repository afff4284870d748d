"""The version matrix: torchjax's core tests on the corners of its supported range.

``make test`` runs everything on the pinned development versions; this runs the core tests
(``pytest --core tests``) in one nox session per configuration in CONFIGS: the oldest
versions pyproject.toml admits, and the newest on every newer Python. pyproject's bounds are
exactly these configurations' (tests/test_versions.py checks), and docs/install.md has the
table. The last session, ``summary``, prints the table of what this run ran and fails unless
every configuration ran and passed.

Each configuration installs torchjax as a user would, from a wheel built from this checkout,
together with its jax and torch requirements: if pyproject's ranges exclude them, pip's
resolver fails and so does the configuration. Wheels are downloaded once into a shared
wheelhouse and installed from there alone (pip does not cache these downloads here; torch's
CUDA wheels are GBs), and venvs are kept between runs (``reuse_venv``), so only the first
run, or a new release, downloads anything. A venv whose interpreter or requirements changed
is made afresh.

Interpreters are never downloaded (``download_python = "never"``): each session is given
the interpreter tools/matrix.py's ``find_python`` finds (TORCHJAX_PYTHON3_12, python3.12 on
PATH, pyenv's newest 3.12.x), since nox's own lookup does not see pyenv's versions. A
configuration whose Python is missing FAILS the matrix (``error_on_missing_interpreters``),
as does one that could not install: none is ever skipped or counted as passing.

Usage (make test-matrix runs the first):
  .venv/bin/nox                                   # every configuration, then the summary
  .venv/bin/nox -s oldest                         # some of them (no summary table)
  .venv/bin/nox -l                                # the configurations
  .venv/bin/nox -s oldest -- tests/test_grad.py   # other tests

Environment:
  TORCHJAX_MATRIX_DIR   venvs (nox/), wheelhouse, logs and summary.md
                        (default ~/.cache/torchjax-matrix)
  TORCHJAX_PYTHON3_12   the interpreter for Python 3.12 (likewise 3_11, 3_13)
  TORCHJAX_MATRIX_TIMEOUT  seconds per configuration's tests (default 2400)
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
import sys
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
from matrix import find_python  # noqa: E402

nox.needs_version = ">=2026.10.20"
nox.options.download_python = "never"
nox.options.error_on_missing_interpreters = True
nox.options.default_venv_backend = "venv"  # as `python -m venv`: the interpreter's own pip

HOME = Path(
    os.environ.get("TORCHJAX_MATRIX_DIR") or Path.home() / ".cache" / "torchjax-matrix"
).resolve()
nox.options.envdir = str(HOME / "nox")
WHEELHOUSE, LOGS, RESULTS = HOME / "wheelhouse", HOME / "logs", HOME / "results"

# One id and start time per `nox` invocation (inherited by --parallel's subprocesses): the
# summary reports the records this run wrote, never an earlier run's.
RUN_ID = os.environ.setdefault("TORCHJAX_MATRIX_RUN", f"{os.getpid()}-{time.time_ns()}")
RUN_START = float(os.environ.setdefault("TORCHJAX_MATRIX_START", repr(time.time())))

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
    venv: str = ""  # the configuration whose venv it runs in (the same installs), if not its own


# The newest releases below pyproject's upper bounds: pip picks the newest patch release.
NEWEST = ("jax>=0.12,<0.13", "jaxlib>=0.12,<0.13", "torch>=2.15,<2.16")

# jax 0.12's upgrade flags that are still off by default (flags declared with upgrade=True
# in jax/_src/config.py). remat3 bypasses the partial-eval rule tables torchjax registers.
# jax_scan3 is left off: in jax 0.12.0.1 and 0.12.1 its scan has no vmap or reverse-mode
# rule, so jax.vmap and jax.grad of a pure-JAX lax.scan raise NotImplementedError with it on.
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
    # It runs in py3.12-newest's venv, so it comes after that session.
    Config("py3.12-newest-jax-upgrades", "3.12", NEWEST, env=UPGRADE_FLAGS, venv="py3.12-newest"),
)

# The interpreter of each Python the configurations use, found once; None where missing.
PYTHONS = {version: find_python(version) for version in sorted({c.python for c in CONFIGS})}


class NotRun(Exception):
    """A configuration that could not run its tests (no interpreter, venv or install)."""


def _missing_python(version: str) -> str:
    return (
        f"no Python {version} found (python{version} on PATH, pyenv, or "
        f"TORCHJAX_PYTHON{version.replace('.', '_')}); nox never downloads one"
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


def _prepare(session: nox.Session) -> None:
    for d in (WHEELHOUSE, LOGS, RESULTS):
        d.mkdir(parents=True, exist_ok=True)
    # The configurations pin what they test; a site-wide pip constraints file (such as one
    # capping torch at the versions a machine keeps on disk) would make one install
    # something else than it names. An empty one replaces it.
    empty = HOME / "no-constraints.txt"
    empty.write_text("")
    session.env.update(PIP_CONSTRAINT=str(empty), PIP_DISABLE_PIP_VERSION_CHECK="1")
    session.env["PYTHONPATH"] = None  # the tests must import the installed wheel


def _wheel(session: nox.Session) -> Path:
    """torchjax's wheel, built once per run from a clean copy of the sources (not a stale
    build/ folder's), whichever session asks first."""
    builds = HOME / "build"
    builds.mkdir(parents=True, exist_ok=True)
    with open(builds / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        here = builds / RUN_ID
        found = sorted((here / "wheel").glob("torchjax-*.whl"))
        if found:
            return found[0]
        for old in builds.iterdir():  # earlier runs' (a day old: not a concurrent run's)
            if old.is_dir() and time.time() - old.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(here, ignore_errors=True)
        src = here / "src"
        src.mkdir(parents=True)
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy(ROOT / name, src / name)
        shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.egg-info"))
        session.run_install(
            sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(here / "wheel"),
            str(src), external=True, silent=True,
        )  # fmt: skip
        return next((here / "wheel").glob("torchjax-*.whl"))


def _install(session: nox.Session, config: Config, python: str, venv: Path) -> None:
    """The configuration's requirements and torchjax's wheel, installed in `venv` from the
    wheelhouse; a venv made for another interpreter or other requirements is made afresh."""
    requirements = [*config.requirements, *test_tool_pins()]
    stamp = venv / "matrix-stamp.json"
    wanted = json.dumps({"python": python, "requirements": requirements})
    if stamp.exists() and stamp.read_text() != wanted:
        if config.venv:
            raise NotRun(f"{config.venv}'s venv is not this configuration's: run it first")
        session.log(f"{venv.name}: its interpreter or requirements changed; a fresh venv")
        session.virtualenv.reuse_existing = False
        session.virtualenv.create()
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    # Resolve against the index (with pyproject's own ranges, so an excluded version fails
    # here) and fetch what the wheelhouse lacks; then install from it alone.
    fetched = session.run_install(
        *pip, "download", "-q", "-d", str(WHEELHOUSE), *requirements, *declared_dependencies(),
        external=True, silent=True,
    )  # fmt: skip
    if fetched is None:  # nox -R (--no-install): the venv as it is, torchjax's copy included
        session.log(f"{venv.name}: installing nothing (--no-install)")
        return
    wheel = _wheel(session)
    session.run_install(
        *pip, "install", "-q", "--upgrade", "--no-index", "--find-links", str(WHEELHOUSE),
        *requirements, str(wheel), external=True, silent=True,
    )  # fmt: skip
    # The wheel has torchjax's version, unchanged by edits: install this build's copy.
    session.run_install(
        *pip, "install", "-q", "--no-deps", "--force-reinstall", str(wheel),
        external=True, silent=True,
    )  # fmt: skip
    stamp.write_text(wanted)


def _versions(session: nox.Session, config: Config, python: Path) -> dict:
    code = (
        "import json, sys, jax, jaxlib, numpy, torch, torchjax\n"
        "print(json.dumps({'python': sys.version.split()[0], 'jax': jax.__version__, "
        "'jaxlib': jaxlib.__version__, 'torch': torch.__version__, "
        "'numpy': numpy.__version__, 'torchjax': torchjax.__file__, "
        f"'flags': {{n: jax.config.values[n.lower()] for n in {[k for k, _ in config.env]}}}"
        "}))"
    )
    with session.chdir(HOME):  # not the checkout, whose src/ must not be what imports
        out = session.run(str(python), "-c", code, env=dict(config.env), external=True, silent=True)
    found = json.loads(out.strip().splitlines()[-1])
    if "site-packages" not in found["torchjax"]:
        raise NotRun(f"imported torchjax from {found['torchjax']}, not the wheel")
    off = [name for name, on in found.pop("flags").items() if not on]
    if off:  # a flag this jax does not read would make the configuration test nothing
        raise NotRun(f"jax did not turn on {off} from the environment")
    return found


def _run_tests(session: nox.Session, config: Config, python: Path, timeout: float) -> dict:
    xml = LOGS / f"{config.name}-junit.xml"
    xml.unlink(missing_ok=True)
    if config.env:
        session.log(f"environment: {' '.join(f'{k}={v}' for k, v in config.env)}")
    tests = session.posargs or list(CORE_TESTS)
    # coreutils' timeout: a hang fails, never waits forever (nox's run has no time limit).
    cmd = ["timeout", "--signal=KILL", f"{timeout:.0f}", str(python), "-m", "pytest", "-q"]
    cmd += ["-p", "no:cacheprovider", f"--junitxml={xml}", *tests]
    exit_code = 0
    try:
        session.run(*cmd, env=dict(config.env), external=True)
    except nox.command.CommandFailed as e:
        exit_code = e.return_code if e.return_code is not None else -1
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "exit": exit_code}
    counts["timed_out"] = exit_code == 137  # timeout's status when it sent SIGKILL
    if xml.exists():
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            for key in ("tests", "failures", "errors", "skipped"):
                counts[key] += int(suite.get(key, 0))
    return counts


def _record(result: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{result['name']}.json").write_text(json.dumps(result))


def _run_config(session: nox.Session, config: Config) -> None:
    result = {"name": config.name, "run": RUN_ID, "status": "NOT RUN", "reason": ""}
    result.update(python=config.python, versions={}, counts={}, install_s=0.0, test_s=0.0)
    _prepare(session)
    timeout = float(os.environ.get("TORCHJAX_MATRIX_TIMEOUT", 2400))
    start = time.monotonic()
    try:
        try:
            python = PYTHONS[config.python]
            if python is None:
                raise NotRun(_missing_python(config.python))
            if config.venv:  # another configuration's venv: nox's records where it made it
                owner = RESULTS / f"{config.venv}.venv"
                venv = Path(owner.read_text()) if owner.exists() else None
                if venv is None or not (venv / "bin" / "python").exists():
                    raise NotRun(f"{config.venv}'s venv does not exist: run that session first")
                session.env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
            else:
                venv = Path(session.virtualenv.location)
                RESULTS.mkdir(parents=True, exist_ok=True)
                (RESULTS / f"{config.name}.venv").write_text(str(venv))
            _install(session, config, python, venv)
            result["versions"] = _versions(session, config, venv / "bin" / "python")
        except (NotRun, nox.command.CommandFailed, OSError, ValueError) as e:
            result["reason"] = str(e) or "a command failed (its output is above)"
            session.error(f"NOT RUN: {result['reason']}")
        finally:
            result["install_s"] = time.monotonic() - start
        start = time.monotonic()
        c = result["counts"] = _run_tests(session, config, venv / "bin" / "python", timeout)
        result["test_s"] = time.monotonic() - start
        ran = c["tests"] - c["skipped"]
        if c["exit"] == 0 and not c["failures"] and not c["errors"] and ran > 0:
            result["status"] = "PASSED"
        else:
            result["status"] = "FAILED"
            why = f"timed out after {timeout:.0f} s" if c["timed_out"] else f"exit {c['exit']}"
            result["reason"] = (
                f"pytest {why}: {c['failures']} failed, {c['errors']} errors, "
                f"{c['skipped']} skipped of {c['tests']}; junit {LOGS / config.name}-junit.xml"
            )
            session.error(f"FAILED: {result['reason']}")
    finally:
        _record(result)


def _session(config: Config) -> None:
    """Registers `config` as the nox session of its name."""

    def run(session: nox.Session) -> None:
        _run_config(session, config)

    env = "".join(f" {k}={v}" for k, v in config.env)
    where = f" (in {config.venv}'s venv)" if config.venv else ""
    run.__doc__ = f"Python {config.python}, {' '.join(config.requirements)}{env}{where}"
    if config.venv:  # runs the other venv's interpreter; nox makes none for it
        nox.session(name=config.name, venv_backend="none")(run)
    else:
        # The interpreter's path where one was found; else the bare version, which nox
        # (never downloading) does not find either: the session FAILS, it is not skipped.
        python = PYTHONS[config.python] or config.python
        nox.session(name=config.name, python=python, reuse_venv=True)(run)


for _config in CONFIGS:
    _session(_config)


def summary_table(results: list[dict]) -> str:
    rows = [
        "| configuration | python | jax | jaxlib | torch | result | tests (passed / skipped) "
        "| install s | tests s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        v, c = r["versions"], r["counts"]
        passed = c.get("tests", 0) - c.get("failures", 0) - c.get("errors", 0) - c.get("skipped", 0)
        tests = f"{passed} / {c.get('skipped', 0)}" if c else "-"
        rows.append(
            f"| {r['name']} | {v.get('python', r['python'])} | {v.get('jax', '-')} "
            f"| {v.get('jaxlib', '-')} | {v.get('torch', '-')} | {r['status']} | {tests} "
            f"| {r['install_s']:.0f} | {r['test_s']:.0f} |"
        )
    lines = rows + [""]
    for r in results:
        if r["status"] != "PASSED":
            lines.append(f"{r['name']}: {r['status']}: {r['reason']}")
    return "\n".join(lines)


@nox.session(venv_backend="none")
def summary(session: nox.Session) -> None:
    """The table of what this run ran; fails unless every configuration ran and passed."""
    results = []
    for config in CONFIGS:
        path = RESULTS / f"{config.name}.json"
        found = json.loads(path.read_text()) if path.exists() else {}
        if found.get("run") != RUN_ID:  # nox never called it: no interpreter, or not selected
            found = {"name": config.name, "python": config.python, "status": "NOT RUN"}
            found.update(versions={}, counts={}, install_s=0.0, test_s=0.0)
            found["reason"] = (
                _missing_python(config.python)
                if PYTHONS[config.python] is None
                else "not run by this nox invocation (not selected, or nox stopped before it)"
            )
        results.append(found)
    text = summary_table(results)
    text += f"\n\nmatrix wall time: {time.time() - RUN_START:.0f} s"
    HOME.mkdir(parents=True, exist_ok=True)
    (HOME / "summary.md").write_text(text + "\n")
    shutil.rmtree(HOME / "build" / RUN_ID, ignore_errors=True)
    print("\n" + text, flush=True)
    failed = [r["name"] for r in results if r["status"] != "PASSED"]
    if failed:
        session.error(f"the version matrix FAILED: {', '.join(failed)} did not run and pass")
