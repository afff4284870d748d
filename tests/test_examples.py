"""Every examples/*.py runs to completion as a script and prints its result.

Each example checks its own result against an independent reference (jax.numpy, plain
torch, an exact posterior) with `assert`, so exit code 0 means those checks passed.

The scripts are started together, as many at a time as there are CPUs: each spends most of
its time in single-threaded Python (imports, tracing), so on two cores this nearly halves
the wall time. Only the examples selected for this pytest run are started.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow  # leave out with -m 'not slow'

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 600


def _run(path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[dict[pathlib.Path, Future]]:
    selected = [
        item.callspec.params["path"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {path: pool.submit(_run, path) for path in selected}
        yield futures
        for future in futures.values():
            future.cancel()  # those not started yet, if the session was interrupted


def test_there_are_examples():
    assert len(EXAMPLES) >= 7, EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path: pathlib.Path, runs: dict[pathlib.Path, Future]) -> None:
    result = runs[path].result()
    report = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    assert result.returncode == 0, f"{path.name} exited with {result.returncode}\n{report}"
    assert result.stdout.strip(), f"{path.name} printed nothing\n{report}"
