"""torchjax's version, in one place: pyproject.toml reads it from here (setuptools'
`dynamic` version) and `torchjax.__version__` re-exports it. CHANGELOG.md has a section for
each release; docs/install.md states what a version number promises."""

__version__ = "0.1.0"
