"""Shared test fixtures and options.

* ``x64``: a fixture that turns JAX's x64 mode on for one test (``x64_off`` turns it off).
* ``--core``: run only the core test modules, those that mark themselves
  ``pytestmark = pytest.mark.core`` (the version matrix runs these on every
  configuration; they need no optional extras such as transformers or flax). The other
  modules are not even imported, so a configuration without their extras collects fine.
* markers: ``core``, ``slow`` (``-m "not slow"`` leaves out soak, conformance and
  subprocess tests) and ``gpu`` (skipped without CUDA), registered in pyproject.toml.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import helpers` from any rootdir

_CORE = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.core\b", re.MULTILINE)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--core", action="store_true", help="run only the core test modules (the matrix's)"
    )


def is_core(path: Path) -> bool:
    return bool(_CORE.search(path.read_text()))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not config.getoption("--core") or collection_path.is_dir():
        return None
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return not is_core(collection_path)
    return None


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def x64_off():
    with jax.enable_x64(False):
        yield
