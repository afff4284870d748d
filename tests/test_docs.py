"""Every ```python block in README.md and docs/ runs (blocks of one file share a namespace)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_markdown_python_blocks_run(path):
    blocks = BLOCK.findall(path.read_text())
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # re-raise with the block's place, for a readable failure
            raise AssertionError(f"{path.name} block {i} failed: {type(e).__name__}: {e}") from e


def test_api_reference_lists_every_public_name():
    # docs/api.md is rendered from the docstrings by mkdocstrings (`make docs`, which fails on
    # a name it cannot find); this checks it leaves none of torchjax.__all__ out.
    import torchjax

    listed = re.findall(r"^::: torchjax\.(\w+)$", (ROOT / "docs" / "api.md").read_text(), re.M)
    assert sorted(listed) == sorted(torchjax.__all__)
