"""Markdown that the site's renderer reads differently from the way it was meant.

`make docs` lints the pages with pymarkdown (.pymarkdown), which reads Markdown as CommonMark.
The site is rendered by Python-Markdown (mkdocs), which differs from CommonMark in two ways
that break a page without a warning from either tool, and this script catches both:

1. A list right after a paragraph line, with no blank line between them. CommonMark starts a
   list there (so pymarkdown's blanks-around-lists rule sees nothing wrong in a list item);
   Python-Markdown keeps the lines in the paragraph, and the bullets run together as text.
   Found exactly: each page is rendered with mkdocs.yml's Markdown extensions, and a
   paragraph with a line that starts with a list marker is reported.
2. Inside a list item, a nested list or a code fence indented by other than a multiple of
   4 spaces. CommonMark nests it under the item's text; Python-Markdown needs 4 spaces and
   otherwise makes the nested bullets items of the outer list, or ends the list at the fence
   (the item's later text, and every bullet after it, then run together as in 1).

The docstrings that docs/api.md renders (mkdocstrings) are checked for 1 as well.

    python tools/check_markdown.py            # README.md, CHANGELOG.md, docs/*.md, docstrings
    python tools/check_markdown.py FILE ...   # those files only

Prints one line per problem (`path:line: what, and the fix`) and exits 1 if there is any.
"""

from __future__ import annotations

import html
import logging
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import markdown
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

_MARKER = re.compile(r"^( *)(?:[*+-]|\d+[.)])[ \t]+\S")
_FENCE = re.compile(r"^( *)(```|~~~)")
GLUED = (
    "a list right after a paragraph line: the site renders its items as text of that "
    "paragraph; put a blank line before the list"
)
INDENT = (
    "{what} indented by {n} spaces inside a list item: the site's Markdown needs a multiple "
    "of 4 (CommonMark does not, so other linters miss it); indent it by {fix}"
)


def _renderer() -> markdown.Markdown:
    """Python-Markdown with the extensions and settings of mkdocs.yml, as the site has it."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    names, configs = [], {}
    for entry in config.get("markdown_extensions", []):
        name, options = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        names.append(name)
        if options:
            configs[name] = options
    return markdown.Markdown(extensions=names, extension_configs=configs)


class _Paragraphs(HTMLParser):
    """The text of every <p> element, tags removed, entities decoded."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._depth = 0

    def handle_starttag(self, tag, attrs):
        if tag == "p":
            self._depth += 1
            if self._depth == 1:
                self.paragraphs.append("")

    def handle_endtag(self, tag):
        if tag == "p" and self._depth:
            self._depth -= 1

    def handle_data(self, data):
        if self._depth:
            self.paragraphs[-1] += data


def _glued_lines(text: str, renderer: markdown.Markdown) -> list[str]:
    """The lines of rendered paragraphs that start with a list marker (rule 1)."""
    renderer.reset()
    parser = _Paragraphs()
    parser.feed(renderer.convert(text))
    found = []
    for paragraph in parser.paragraphs:
        for line in paragraph.split("\n")[1:]:
            if _MARKER.match(line):
                found.append(html.unescape(line.strip()))
    return found


def _words(s: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "", s)[:40]


def _source_line(rendered: str, lines: list[str]) -> int | None:
    """The 1-based number of the source line a rendered line came from, matched by its words."""
    want = _words(rendered)
    for number, line in enumerate(lines, 1):
        if _MARKER.match(line.lstrip()) and _words(line) == want:
            return number
    return None


def _indent_problems(lines: list[str]) -> list[tuple[int, str]]:
    """Nested lists and fences in a list item, indented by other than 4k spaces (rule 2)."""
    problems: list[tuple[int, str]] = []
    in_list = False
    fenced_by = None  # the marker of the open code fence, if any
    previous_blank = True
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if fenced_by:
            if fence and fence.group(2) == fenced_by:
                fenced_by = None
            previous_blank = False
            continue
        if not line.strip():
            previous_blank = True
            continue
        indent = len(line) - len(line.lstrip(" "))
        marker = _MARKER.match(line)
        if indent == 0:
            if marker:
                in_list = True
            elif previous_blank or line.startswith("#"):
                in_list = False
        elif in_list and (marker or fence) and indent % 4:
            what = "a code fence" if fence else "a nested list"
            problems.append((number, INDENT.format(what=what, n=indent, fix=indent + -indent % 4)))
        if fence:
            fenced_by = fence.group(2)
        previous_blank = False
    return problems


def check_text(text: str, name: str, renderer: markdown.Markdown | None = None) -> list[str]:
    """Every problem in one Markdown text, as `name:line: message` lines."""
    renderer = renderer or _renderer()
    lines = text.splitlines()
    problems = _indent_problems(lines)
    for rendered in _glued_lines(text, renderer):
        number = _source_line(rendered, lines)
        problems.append((number or 0, f"{GLUED} (it renders as '{rendered[:50]}...')"))
    return [f"{name}:{n}: {m}" for n, m in sorted(problems)]


def _docstring_texts():
    """(object path, Markdown text) for every docstring part docs/api.md renders."""
    import griffe

    logging.getLogger("griffe").setLevel(logging.ERROR)
    package = griffe.load("torchjax", search_paths=[str(ROOT / "src")], docstring_parser="google")
    api = (ROOT / "docs" / "api.md").read_text()
    seen = set()

    def walk(obj):
        obj = obj.final_target if obj.is_alias else obj
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring:
            for section in obj.docstring.parsed:
                value = section.value
                parts = value if isinstance(value, list) else [value]
                for part in parts:
                    if isinstance(part, str):
                        yield obj.path, part
                    elif isinstance(part, tuple) and part[0].value == "text":  # examples
                        yield obj.path, part[1]
                    elif isinstance(getattr(part, "description", None), str):
                        yield obj.path, part.description
        for name, member in obj.members.items():
            if not re.match(r"^_[^_]", name) and name != "__all__":
                yield from walk(member)

    for name in re.findall(r"^::: torchjax\.([\w.]+)$", api, re.M):
        yield from walk(package[name])


def check_docstrings(renderer: markdown.Markdown | None = None) -> list[str]:
    renderer = renderer or _renderer()
    problems = []
    for path, text in _docstring_texts():
        for rendered in _glued_lines(text, renderer):
            problems.append(f"docstring of {path}: {GLUED} (it renders as '{rendered[:50]}...')")
    return problems


def main(argv: list[str]) -> int:
    renderer = _renderer()
    files = [Path(a) for a in argv] or PAGES
    problems = []
    for path in files:
        shown = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
        problems += check_text(path.read_text(), str(shown), renderer)
    if not argv:
        problems += check_docstrings(renderer)
    print("\n".join(problems) or f"check_markdown: {len(files)} files, no problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
