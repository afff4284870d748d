"""Every ```python block in README.md and docs/ runs (blocks of one file share a namespace)."""

import importlib.util
import pathlib
import re
import subprocess
import sys

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


# The Markdown lint of `make docs` (docs-lint): pymarkdown with the repository's .pymarkdown,
# and tools/check_markdown.py for what the site's renderer (Python-Markdown) reads differently.
GLUED = "# Page\n\nThe options are:\n* one\n* two\n"
# CommonMark nests these, so pymarkdown passes them; Python-Markdown breaks both.
GLUED_IN_ITEM = "# Page\n\n* An item whose text ends:\n\n  ```bash\n  ls\n  ```\n\n  More.\n* two\n"
NESTED_BY_2 = "# Page\n\n* An item:\n  * nested\n  * nested\n"
GOOD = "# Page\n\nThe options are:\n\n* one\n\n    * nested\n\n* two\n"


def _check_markdown():
    spec = importlib.util.spec_from_file_location(
        "check_markdown", ROOT / "tools" / "check_markdown.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pymarkdown(*paths) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pymarkdown", "--strict-config", "--config", ".pymarkdown", "scan"]
    return subprocess.run([*cmd, *map(str, paths)], cwd=ROOT, capture_output=True, text=True)


def test_markdown_lint_passes_on_the_docs():
    result = _pymarkdown("README.md", "CHANGELOG.md", "docs")
    assert result.returncode == 0, result.stdout + result.stderr
    check = _check_markdown()
    problems = [p for page in check.PAGES for p in check.check_text(page.read_text(), page.name)]
    assert problems + check.check_docstrings() == []


@pytest.mark.parametrize(
    "text", [GLUED, GLUED_IN_ITEM, NESTED_BY_2], ids=["glued", "in_item", "nested"]
)
def test_markdown_lint_fails_on_a_list_the_site_would_break(tmp_path, text):
    page = tmp_path / "page.md"
    page.write_text(text)
    check = _check_markdown()
    assert check.check_text(text, "page.md"), "tools/check_markdown.py missed it"
    assert check.main([str(page)]) == 1
    result = _pymarkdown(page)
    if text is GLUED:  # a list glued to a paragraph at the top level: pymarkdown's md032 too
        assert result.returncode != 0 and "MD032" in result.stdout, result.stdout
    else:  # what only tools/check_markdown.py catches
        assert result.returncode == 0, result.stdout


def test_markdown_lint_passes_a_list_after_a_blank_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(GOOD)
    assert _pymarkdown(page).returncode == 0
    assert _check_markdown().check_text(GOOD, "page.md") == []


def test_markdown_lint_checks_docstrings_as_the_api_page_renders_them():
    # PytreePrimitive's "Rules" list was glued to its paragraph: after griffe's dedent, as here.
    check = _check_markdown()
    text = "Rules (register each with the decorator of the same name):\n  * ``a``: one\n  * ``b``\n"
    assert check.check_text(text, "docstring")
    assert check.check_text(text.replace(":\n", ":\n\n", 1), "docstring") == []
