# Reading a user's objects without running their code.
#
# Fake runs and module_to_jax's per-call snapshots walk what a function can reach: its
# closure, a module's attributes, the objects and containers those hold. The walk must not
# call anything of the user's: a subclass's __len__, __iter__, __eq__, __hash__ or
# __getattr__, a property. Each may raise (e3nn's o3.Irreps is a tuple whose __len__
# raises NotImplementedError) or have effects. So everything here goes through the built-in
# types' own slots and the classes' own dicts: a tuple subclass is read as the tuple it
# stores, an object's attributes are its instance dict as Python stores it, and an object
# whose state is not in such a dict (slots, C state, a __dict__ property) is left alone.
from __future__ import annotations

import collections
import functools
import types
from typing import Any

_class_dict = type.__dict__["__dict__"].__get__  # a class's own namespace, metaclass aside
# The descriptors CPython itself gives a class's __dict__ (a Python class's, a module's).
_DICT_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)


def instance_dict(obj: Any) -> dict | None:
    """obj's attribute dict as Python stores it, or None where it has none that the walk
    can read without running the class's code (no __dict__ slot, or a property by that
    name)."""
    for klass in type(obj).__mro__:
        attr = _class_dict(klass).get("__dict__")
        if attr is not None:
            if type(attr) not in _DICT_DESCRIPTORS:
                return None
            d = attr.__get__(obj, type(obj))
            return d if type(d) is dict else None
    return None


def class_attribute(klass: type, name: str) -> Any:
    """`name` as klass or a base defines it (not an instance's, not __getattr__'s), or None."""
    for k in klass.__mro__:
        found = _class_dict(k).get(name)
        if found is not None:
            return found
    return None


def is_instance(obj: Any, classes: type | tuple) -> bool:
    """isinstance by the object's real type: never asks its __class__."""
    return issubclass(type(obj), classes)


def items(obj: Any) -> list | None:
    """The elements of a built-in container (or a subclass), as the built-in type stores
    them; None for anything else."""
    t = type(obj)
    if issubclass(t, dict):
        return list(dict.values(obj))
    if issubclass(t, list):
        return list.copy(obj)
    if issubclass(t, tuple):
        return [*tuple.__iter__(obj)]
    if issubclass(t, set | frozenset):
        return [*(set.__iter__ if issubclass(t, set) else frozenset.__iter__)(obj)]
    if issubclass(t, collections.deque):
        return [*collections.deque.__iter__(obj)]
    return None


def size(obj: Any) -> int:
    """len() of a built-in container through the built-in type's own slot."""
    for base in (dict, list, tuple, set, frozenset, collections.deque):
        if issubclass(type(obj), base):
            return base.__len__(obj)
    raise TypeError(f"not a built-in container: {type(obj).__name__}")


def is_lru_cache(obj: Any) -> bool:
    """A functools.lru_cache (or a cache with its interface) by its class's methods."""
    t = type(obj)
    return class_attribute(t, "cache_clear") is not None and (
        class_attribute(t, "cache_info") is not None
    )


_partial_parts = (functools.partial.func, functools.partial.args, functools.partial.keywords)


def partial_parts(obj: Any) -> list | None:
    """A functools.partial's function and bound arguments, read from its own fields."""
    if not issubclass(type(obj), functools.partial):
        return None
    func, args, keywords = (p.__get__(obj) for p in _partial_parts)
    return [func, *args, *dict.values(keywords)]
