"""Shared test fixtures and options.

* ``x64``: a fixture that turns JAX's x64 mode on for one test (``x64_off`` turns it off).
* ``--core``: run only the core test modules, those that mark themselves
  ``pytestmark = pytest.mark.core`` (the version matrix runs these on every
  configuration; they need no optional extras such as transformers or flax). The other
  modules are not even imported, so a configuration without their extras collects fine.
* markers: ``core``, ``slow`` (``-m "not slow"`` leaves out soak, conformance and
  subprocess tests), ``gpu`` (skipped without CUDA) and ``cpu_only``, registered in
  pyproject.toml.
* ``TORCHJAX_TEST_DEVICE=cuda`` runs the tests with their data on the GPU: torch's default
  device becomes ``cuda`` and JAX's default device its first GPU, so the fixtures and the
  references (torch tensors made in tests, JAX arrays, modules) move, not each test. Tests
  about the CPU itself (numpy aliasing, the pure_callback fallback, host pointers) carry
  ``cpu_only`` and skip there. It is an error where torch or JAX sees no GPU.
"""

from __future__ import annotations

import os
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


TEST_DEVICE = os.environ.get("TORCHJAX_TEST_DEVICE", "cpu")


def pytest_configure(config: pytest.Config) -> None:
    if TEST_DEVICE == "cpu":
        return
    if TEST_DEVICE != "cuda":
        raise pytest.UsageError(f"TORCHJAX_TEST_DEVICE={TEST_DEVICE!r}: use 'cpu' or 'cuda'.")
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(
            f"TORCHJAX_TEST_DEVICE=cuda, but torch {torch.__version__} sees no CUDA device "
            f"(a CPU build, or no driver). Install requirements-gpu.txt on a GPU machine."
        )
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        raise pytest.UsageError(
            f"TORCHJAX_TEST_DEVICE=cuda, but JAX has no GPU backend ({jax.devices()}): "
            f"install jax[cuda13] (requirements-gpu.txt)."
        )
    torch.set_default_device("cuda")
    jax.config.update("jax_default_device", gpus[0])


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if TEST_DEVICE == "cpu":
        return
    skip = pytest.mark.skip(reason=f"about the CPU itself (TORCHJAX_TEST_DEVICE={TEST_DEVICE})")
    for item in items:
        if item.get_closest_marker("cpu_only"):
            item.add_marker(skip)


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
