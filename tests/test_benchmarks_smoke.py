# Smoke tests of benchmarks/compare.py (every section runs end to end and renders), of
# benchmarks/gpu_bench.py on the CPU and of `make gpu-check` without a GPU; no timing
# is asserted. --quick makes each number a median of 2 short runs, tiny sizes keep the sweep
# short, and the doc goes to a temporary folder, never to docs/.
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # leave out with -m 'not slow'

ROOT = Path(__file__).resolve().parent.parent
COMPARE = ROOT / "benchmarks" / "compare.py"


def test_compare_quick_runs_and_renders(tmp_path):
    docs_before = {p: p.stat().st_mtime_ns for p in (ROOT / "docs").iterdir()}
    proc = subprocess.run(
        [sys.executable, str(COMPARE), "--quick", "--sizes", "16,256", "--no-optional"]
        + ["--write", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # Each section's table header, the sweep's one, and the note for the skipped bridges.
    # Sixteen tables with ratios: to_jax 2, vmap 2, grad 1, hessian 2, train 1, gpt2 2
    # (the second with glibc keeping freed memory), resnet 1, module 2, concurrent 1,
    # to_torch 2.
    assert "| call | elements (float32) | median µs |" in out
    assert out.count("| case | median µs | baseline | baseline µs | ratio |") == 16
    assert "| jax.jit(value_and_grad + optax.sgd) via module_to_jax, mutable=True |" in out
    assert '| torchjax, copy="move" |' in out  # bench_gpt2's memory table
    assert "| jax.jit(value_and_grad) via module_to_jax, no optimizer |" in out
    assert "| torch forward, loss, backward, no optimizer |" in out
    assert "The optimizer's update (a step's median less" in out
    assert "glibc keeping freed memory (GLIBC_TUNABLES=glibc.malloc.arena_max=1" in out
    assert "| elements | native torch | to_jax eager | jax.jit(to_jax) |" in out
    assert "| 256 |" in out and "| 4,096 |" not in out
    assert "| cache, filled |" in out  # bench_compile_cache: its fresh processes ran
    assert "wrap_torch2jax: not measured; optional libraries not requested" in out

    doc = (tmp_path / "benchmarks.md").read_text()
    for heading in ["## Machine", "## How to reproduce", "## Size sweep", "![", "torch 2."]:
        assert heading in doc
    # docs/benchmarks.md's hand-written blocks, carried over once each, in its order
    source = (ROOT / "docs" / "benchmarks.md").read_text()
    kept = [line for line in source.splitlines() if line.startswith("#") and "(issue 4" in line]
    assert len(kept) >= 4, kept
    assert [line for line in doc.splitlines() if line in kept] == kept
    assert (tmp_path / "benchmark_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "docs").iterdir()} == docs_before


def test_gpu_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "table.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--device", "cpu"]
        + ["--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = out.read_text()
    for case in ("jit(to_jax(x + 1))", "jit(vmap(to_jax(mlp)))", "jit(grad(", "training step"):
        assert case in table


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_gpu_check_without_a_gpu_says_so_and_passes():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device on this machine" in proc.stdout
    assert "== install" not in proc.stdout  # no step ran


def _compare_module():
    sys.path.insert(0, str(COMPARE.parent))
    try:
        import compare
    finally:
        sys.path.remove(str(COMPARE.parent))
    return compare


def test_write_keeps_hand_written_blocks_where_they_were():
    compare = _compare_module()
    start, end = compare.HAND_WRITTEN, compare.HAND_WRITTEN_END
    old = "\n".join(
        ["# B", "", "## A", "", "old table A", "", start, "### note on A", "", end, ""]
        + ["## Gone", "", start, "kept from a section no longer generated", end, ""]
        + [start, "## Own section", "", "text", end, start, "after own", end, ""]
        + ["## C", "old table C", "", "## On a GPU", "", "none"]
    )
    new = "\n".join(
        ["# B", "", "## A", "", "new table A", "", "## C", "new table C", "", "## On a GPU"]
        + ["", "none"]
    )
    got = compare.carry_hand_written(old, new).splitlines()
    # A block under a heading `new` lacks goes before the GPU section; one that followed
    # another block's own section follows it there.
    assert got == (
        ["# B", "", "## A", "", "new table A", "", start, "### note on A", "", end, ""]
        + ["## C", "new table C", ""]
        + [start, "kept from a section no longer generated", end, ""]
        + [start, "## Own section", "", "text", end, ""]
        + [start, "after own", end, ""]
        + ["## On a GPU", "", "none"]
    )
    assert compare.carry_hand_written("", new) == new + "\n"
    with pytest.raises(ValueError, match="end of hand-written block"):
        compare.carry_hand_written("\n".join(["## A", start, "never closed"]), new)
