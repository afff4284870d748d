"""Wrapped torch functions inside jax.shard_map: 4 host devices, then 2 processes (subprocesses)."""

import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.core, pytest.mark.slow]  # the version matrix runs this module

SCRIPT = pathlib.Path(__file__).with_name("multidevice_script.py")


def test_multidevice_script():
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    checks = ("shard_map: local shards", "sharded input under jit", "data-parallel training")
    checks += ("module_to_jax in shard_map, two variable sets", "declared types with sharded")
    for check in checks:
        assert check in result.stdout, result.stdout


MULTIHOST_SCRIPT = pathlib.Path(__file__).with_name("multihost_script.py")


def test_multihost_script():
    """Two processes (2 CPU devices each, gloo collectives) share one 4-device mesh."""
    result = subprocess.run(
        [sys.executable, str(MULTIHOST_SCRIPT)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for i in range(2):
        assert f"process {i}: multi-host data-parallel grad matches pure JAX: ok" in (
            result.stdout
        ), result.stdout
