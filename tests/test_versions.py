# Declared ranges are tested ranges: pyproject.toml's bounds on Python, jax and torch are the
# configurations noxfile.py runs (the lower bounds exactly, the upper ones as the newest
# release below them), the pinned development versions lie inside them, and docs/install.md
# shows the same table. A bound moved without the matrix (or the other way round) fails here.
from __future__ import annotations

import importlib.util
import os
import sys
import tomllib
from pathlib import Path

import jax
import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _matrix():
    """noxfile.py as a module (nox.options set, its sessions registered, os.environ as it was)."""
    spec = importlib.util.spec_from_file_location("torchjax_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    environ, path = dict(os.environ), list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:  # it records its run's id and start in the environment, and puts tools/ on the path
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
    return module


MATRIX = _matrix()


def _declared(name: str) -> SpecifierSet:
    for line in PROJECT["dependencies"]:
        req = Requirement(line)
        if req.name == name:
            return req.specifier
    raise AssertionError(f"pyproject.toml does not declare {name}")


def _bound(spec: SpecifierSet, operator: str) -> Version:
    (found,) = [Version(s.version) for s in spec if s.operator == operator]
    return found


def _requirement(config, name: str) -> SpecifierSet:
    (found,) = [
        Requirement(r).specifier for r in config.requirements if Requirement(r).name == name
    ]
    return found


OLDEST = MATRIX.CONFIGS[0]


@pytest.mark.parametrize("name", ["jax", "jaxlib", "torch"])
def test_oldest_configuration_pins_the_lower_bounds(name):
    pin = _bound(_requirement(OLDEST, name), "==")
    assert pin == _bound(_declared("jax" if name == "jaxlib" else name), ">=")


@pytest.mark.parametrize("name", ["jax", "jaxlib", "torch"])
def test_newest_configurations_reach_the_upper_bounds(name):
    upper = _bound(_declared("jax" if name == "jaxlib" else name), "<")
    newest = [c for c in MATRIX.CONFIGS if c.name.endswith("-newest")]
    assert len(newest) >= 2
    for config in newest:
        spec = _requirement(config, name)
        assert _bound(spec, "<") == upper, config.name
        # The newest minor series below the bound: nothing between it and the bound.
        low = _bound(spec, ">=")
        assert (low.major, low.minor + 1) == (upper.major, upper.minor), config.name


def test_the_newest_jax_meets_the_oldest_torch():
    mixed = MATRIX.CONFIGS[2]
    assert _requirement(mixed, "torch") == _requirement(OLDEST, "torch")
    for name in ["jax", "jaxlib"]:
        assert _bound(_requirement(mixed, name), "<") == _bound(_declared("jax"), "<")
    assert mixed.python != OLDEST.python


def test_every_declared_python_has_a_configuration():
    spec = SpecifierSet(PROJECT["requires-python"])
    lowest, upper = _bound(spec, ">="), _bound(spec, "<")
    wanted = [f"3.{m}" for m in range(lowest.minor, upper.minor)]
    assert sorted({c.python for c in MATRIX.CONFIGS}, key=Version) == wanted
    assert OLDEST.python == wanted[0]
    classifiers = {c.rsplit(" ", 1)[-1] for c in PROJECT["classifiers"] if ":: 3." in c}
    assert classifiers == set(wanted)


def test_pinned_development_versions_are_inside_the_declared_ranges():
    for name, version in [("jax", jax.__version__), ("torch", torch.__version__)]:
        assert Version(version).public in _declared(name), (name, version)
    assert f"{sys.version_info.major}.{sys.version_info.minor}.0" in SpecifierSet(
        PROJECT["requires-python"]
    )


def test_install_doc_shows_the_matrix_and_the_readme_links_it():
    doc = (ROOT / "docs" / "install.md").read_text()
    for config in MATRIX.CONFIGS:
        assert f"`{config.name}`" in doc, config.name
    for line in ["python" + PROJECT["requires-python"], *PROJECT["dependencies"]]:
        for spec in Requirement(line).specifier:
            assert f"`{spec}`" in doc, f"docs/install.md does not state {line!r}"
    assert "docs/install.md" in (ROOT / "README.md").read_text()


def test_ci_runs_the_matrix_after_the_pinned_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("make test") < ci.index("make test-matrix")
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("\ntest-matrix:") :].split("\n\n")[0]
    assert "$(BIN)/nox" in recipe, recipe


def test_the_matrix_never_downloads_a_python_and_fails_without_one():
    import nox

    assert nox.options.download_python == "never"
    assert nox.options.error_on_missing_interpreters
    sessions = nox.registry.get()
    for config in MATRIX.CONFIGS:
        assert config.name in sessions, config.name
        if not config.venv:  # its own venv, kept between runs
            assert sessions[config.name].reuse_venv is True, config.name
    # The summary comes last, so its table reports every configuration's result.
    assert list(sessions)[-1] == "summary"
