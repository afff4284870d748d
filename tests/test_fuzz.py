"""The differential program fuzzer's CI share (tests/fuzz_suite.py), run in a fresh process.

The suite's process grows to gigabytes of Python objects by the time it gets here, and a
fake run that fails (the fuzzer's refused programs) looks through the whole heap for fake
tensors it left behind (_fake/_isolation.py): seconds a program there, a fraction of one in
a fresh process. The fuzzer's tests run unchanged there; this test fails with their output
if any fails, and checks they ran (none skipped where torchax is installed).
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

SUITE = pathlib.Path(__file__).with_name("fuzz_suite.py")


@pytest.mark.slow
def test_fuzzer_in_a_fresh_process():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SUITE)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=SUITE.parent.parent,
    )
    output = result.stdout[-12000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= 19, output  # 2 fuzz runs, 16 regressions, 1 break
    if importlib.util.find_spec("torchax") is not None:
        assert "skipped" not in result.stdout.splitlines()[-1], output
    assert re.search(r"fuzz: \d+ programs.*0 mismatches", result.stdout), output
    print(next(line for line in result.stdout.splitlines() if line.startswith("fuzz:")))
