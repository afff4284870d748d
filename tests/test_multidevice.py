"""Wrapped torch functions inside jax.shard_map over 4 host devices (a separate process)."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("multidevice_script.py")


def test_multidevice_script():
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for check in ("shard_map: local shards", "sharded input under jit", "data-parallel training"):
        assert check in result.stdout, result.stdout
