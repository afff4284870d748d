# The public surface: what `torchjax/__init__.py` exports, that it is documented, and that
# importing the package leaves every global JAX and torch setting as it was.
from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchjax

INIT = Path(torchjax.__file__)


def _names_defined_in_init() -> set[str]:
    """Top-level names that __init__.py binds (imports, defs, assignments), dunders aside."""
    names: set[str] = set()
    for node in ast.parse(INIT.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("__")}


def test_all_matches_names_defined_in_init():
    assert len(torchjax.__all__) == len(set(torchjax.__all__)), "duplicates in __all__"
    assert set(torchjax.__all__) == _names_defined_in_init()


def test_init_only_reexports():
    # The public __init__ is a list of re-exports: no logic of its own.
    for node in ast.parse(INIT.read_text()).body:
        is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        is_all = isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"]
        assert is_doc or is_all or isinstance(node, ast.ImportFrom), ast.dump(node)[:80]


@pytest.mark.parametrize("name", torchjax.__all__)
def test_public_name_imports_and_is_documented(name):
    obj = getattr(importlib.import_module("torchjax"), name)
    doc = inspect.getdoc(obj)
    assert doc and len(doc.split()) >= 5, f"torchjax.{name} has no docstring"
    if callable(obj):
        assert "Example" in doc, f"torchjax.{name}'s docstring has no example"


@pytest.mark.parametrize("name", torchjax.__all__)
def test_docstring_examples_run(name):
    obj = getattr(torchjax, name)
    tests = doctest.DocTestFinder(recurse=False).find(obj, f"torchjax.{name}", globs={})
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 or not callable(obj), f"torchjax.{name}: no runnable example"
    assert result.failed == 0, f"torchjax.{name}: {result.failed} example(s) failed"


def test_star_import_gives_exactly_all():
    scope: dict = {}
    exec("from torchjax import *", scope)
    assert {k for k in scope if k != "__builtins__"} == set(torchjax.__all__)


# Run in a fresh interpreter: this process has long since imported torchjax.
_SNAPSHOT = """
import json, sys
import jax, torch

def snapshot():
    return {
        "jax": {k: repr(v) for k, v in sorted(jax.config.values.items())},
        "torch": {
            "default_dtype": str(torch.get_default_dtype()),
            "grad_enabled": torch.is_grad_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "threads": torch.get_num_threads(),
            "matmul_precision": torch.get_float32_matmul_precision(),
        },
        "x64": bool(jax.config.jax_enable_x64),
    }

before = snapshot()
import torchjax
after = snapshot()
json.dump({"before": before, "after": after}, sys.stdout)
"""


@pytest.mark.parametrize("x64_env", [None, "1"], ids=["default", "JAX_ENABLE_X64=1"])
def test_import_changes_no_global_setting(x64_env):
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    if x64_env is not None:
        env["JAX_ENABLE_X64"] = x64_env
    proc = subprocess.run(
        [sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["before"]["x64"] is (x64_env is not None)  # the subprocess saw the env var
    assert result["after"] == result["before"]
