"""mkdocs hooks for the documentation site (mkdocs.yml's `hooks:`).

The Markdown in the repository is written to be read where it lies: README.md at the root
links to docs/to_jax.md, a page in docs/ links to ../tools/matrix.py. The site keeps those
files as its sources instead of copies that could drift:

* the home page is README.md and the changelog page is CHANGELOG.md, added as generated
  pages;
* every relative link is resolved from the file's place in the repository: one to a page
  of docs/ becomes a link between site pages; one to a file the site does not hold (an
  example script, a tool) becomes its repository path in code style, since the site has no
  copy of it to link to. mkdocs then checks every link that is left (strict mode).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
DOCS = "docs"
# Site page -> the repository file it is made from, for pages that live outside docs/.
GENERATED = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}

_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)", re.M)


def on_files(files, config):
    for page, source in GENERATED.items():
        content = (ROOT / source).read_text()
        files.append(File.generated(config, page, content=content))
    return files


def _repository_path(page_src: str) -> str:
    """Where the page's Markdown lives in the repository (posix, relative to the root)."""
    return GENERATED.get(page_src, posixpath.join(DOCS, page_src))


def _rewrite(match: re.Match, source_dir: str, page_dir: str) -> str:
    bang, text, target = match.groups()
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):  # absolute URL, anchor, site path
        return match.group(0)
    path, _, anchor = target.partition("#")
    in_repo = posixpath.normpath(posixpath.join(source_dir, path))
    if in_repo == DOCS or in_repo.startswith(DOCS + "/"):
        new = posixpath.relpath(in_repo, start=posixpath.join(DOCS, page_dir))
        return f"{bang}[{text}]({new}{'#' + anchor if anchor else ''})"
    shown = in_repo + ("/" if path.endswith("/") else "")
    label = text.strip("`")
    if label in (in_repo, shown, path):
        return f"`{shown}`"
    return f"{text} (`{shown}`)"


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    source_dir = posixpath.dirname(_repository_path(src))
    page_dir = posixpath.dirname(src)
    # _FENCE.split alternates text and fence markers; each marker opens or closes a code
    # block, whose links are left as written.
    parts = _FENCE.split(markdown)
    out, inside = [], False
    for i, part in enumerate(parts):
        if i % 2 == 1:  # a fence marker
            inside = not inside
            out.append(part)
        elif inside:
            out.append(part)
        else:
            out.append(_LINK.sub(lambda m: _rewrite(m, source_dir, page_dir), part))
    return "".join(out)
