# The registry of private names: where each is looked up, what its absence costs.
#
# Every private JAX, jaxlib and torch name torchjax uses is looked up by `private` (or
# recorded by `register`, where looking it up would cost seconds or it names an attribute of
# instances made elsewhere) in _jax.py or _torch.py, and nowhere else. PRIVATE_NAMES then
# holds every name, its alternatives across versions joined by " | ", and what its absence
# costs; MISSING the ones the installed versions lack. tests/test_compat.py reads the list
# from these files' source (so it can name a missing one even where importing torchjax
# fails) and checks each against the installed versions.
from __future__ import annotations

import importlib
import warnings
from typing import Any

# name (alternatives joined by " | ", first found wins) -> what its absence costs
PRIVATE_NAMES: dict[str, str] = {}
# The names of PRIVATE_NAMES that the installed versions lack.
MISSING: list[str] = []

REQUIRED = "required"
ABSENT = object()


def resolve(path: str) -> Any:
    """The object a dotted path names, or ABSENT.

    The longest importable prefix is the module, the rest attributes; ``()`` after a part
    calls it with no arguments (instance attributes: ``torch.nn.Module()._parameters``).
    An attribute whose access warns of its deprecation counts as absent: it is on its way
    out, and under ``-W error`` it would fail anyway.
    """
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if "()" in module:
            continue
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for part in parts[i:]:
                    obj = getattr(obj, part.removesuffix("()"))
                    if part.endswith("()"):
                        obj = obj()
            except AttributeError:
                return ABSENT
        if any(issubclass(w.category, DeprecationWarning) for w in caught):
            return ABSENT
        return obj
    return ABSENT


def register(name: str, fallback: str = REQUIRED) -> None:
    """Record a private name that is not looked up here (importing it would cost seconds,
    or it is an attribute of instances made elsewhere); tests/test_compat.py checks it."""
    PRIVATE_NAMES[name] = fallback


def private(*paths: str, fallback: str = REQUIRED) -> Any:
    """Look up the first of `paths` that exists; record the name and what it costs to lack.

    Returns the object, or ABSENT when none exists (callers then use their fallback).
    """
    name = " | ".join(paths)
    PRIVATE_NAMES[name] = fallback
    for path in paths:
        obj = resolve(path)
        if obj is not ABSENT:
            return obj
    MISSING.append(name)
    return ABSENT


def or_(obj: Any, default: Any) -> Any:
    return default if obj is ABSENT else obj


def check_required(versions: str) -> None:
    """Raise ImportError naming every required private name the installed versions lack."""
    missing = [name for name in MISSING if PRIVATE_NAMES[name] == REQUIRED]
    if missing:
        raise ImportError(
            f"torchjax cannot run with {versions}: it needs {', '.join(missing)}, which they "
            f"lack or deprecate. Install versions from the table in docs/install.md (pip "
            f"install torchjax picks them)."
        )
