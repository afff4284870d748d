"""Write docs/api.md from the public docstrings: `python docs/make_api.py`.

tests/test_docs.py checks that docs/api.md is up to date, so the reference cannot drift.
"""

import inspect
import pathlib
import types

import torchjax

HEADER = """# API reference

Generated from the docstrings by `docs/make_api.py`; every example runs as a doctest in the
test suite. The public API is exactly `torchjax.__all__`.
"""


def _render_module(name: str, module: types.ModuleType) -> str:
    """A public submodule (torchjax.errors): its docstring, then each class it exports."""
    parts = [f"## `torchjax.{name}`\n\n```text\n{inspect.cleandoc(module.__doc__ or '')}\n```\n"]
    for cls_name in module.__all__:
        cls = getattr(module, cls_name)
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        doc = inspect.cleandoc(cls.__doc__ or "")
        parts.append(f"### `torchjax.{name}.{cls_name}({bases})`\n\n{doc}\n")
    return "\n".join(parts)


def render() -> str:
    parts = [HEADER]
    for name in torchjax.__all__:
        obj = getattr(torchjax, name)
        if isinstance(obj, types.ModuleType):
            parts.append(_render_module(name, obj))
            continue
        signature = str(inspect.signature(obj)).replace("'", "")
        doc = inspect.cleandoc(obj.__doc__ or "")
        parts.append(f"## `torchjax.{name}{signature}`\n\n```text\n{doc}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    path = pathlib.Path(__file__).with_name("api.md")
    path.write_text(render())
    print(f"wrote {path}")
