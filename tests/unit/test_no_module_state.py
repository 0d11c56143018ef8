"""No module-level mutable state in overlay/branchwise: per-scheduler state lives on the runtime's
`scheduler.branchwise` (or on the SGLang object a hook receives), never in a module global.

Every module of the package is imported and each global (and each class attribute of the classes
it defines) is classified, and a global that a function rebinds (`global x`) is state whatever its
value: immutable values (numbers, strings, tuples and frozensets of them, frozen
dataclasses, read-only arrays, compiled patterns, functions, classes, modules) pass; anything that
can hold changing state (dict, list, set, deque, bytearray, threading.local, locks, writeable numpy
arrays, instances of ordinary classes) fails, unless ALLOWED names it with a reason.

cpu_compat/ is skipped: it is a vendored stand-in for SGLang's `sgl_kernel` extension (a CPU-only
copy of its API, installed as its own top-level module), not Branchwise code.
"""

from __future__ import annotations
import __future__

import array
import ast
import collections
import dataclasses
import enum
import importlib
import logging
import operator
import pathlib
import pkgutil
import re
import threading
import types
from typing import Any

import numpy as np
import pytest

import branchwise

SKIPPED_PACKAGES = ("branchwise.cpu_compat",)

# (module, name) -> why a mutable-looking global is allowed
ALLOWED: dict[tuple[str, str], str] = {}

_IMMUTABLE_TYPES = (type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis),
                    re.Pattern, operator.attrgetter, operator.itemgetter, operator.methodcaller,
                    types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
                    type, property, staticmethod, classmethod, enum.Enum, logging.Logger, types.GenericAlias,
                    types.MemberDescriptorType, types.GetSetDescriptorType, types.WrapperDescriptorType,
                    types.MethodDescriptorType, types.MethodWrapperType, types.UnionType, pathlib.PurePath,
                    __future__._Feature)
_MUTABLE_TYPES = (dict, list, set, bytearray, collections.deque, array.array, threading.local, memoryview)


def _module_names() -> list[str]:
    names = ["branchwise"]
    for info in pkgutil.walk_packages(branchwise.__path__, prefix="branchwise."):
        if not info.name.startswith(SKIPPED_PACKAGES):
            names.append(info.name)
    return sorted(names)


def why_mutable(value: Any, depth: int = 0) -> str | None:
    """Why `value` can hold changing state, or None when it cannot."""
    if depth > 8:
        return None
    if isinstance(value, _MUTABLE_TYPES):
        return type(value).__name__
    owner = getattr(value, "__self__", None)  # a bound method carries its object's state
    if isinstance(value, types.MethodType | types.BuiltinMethodType | types.MethodWrapperType) and \
            owner is not None and not isinstance(owner, type | types.ModuleType):
        return why_mutable(owner, depth + 1)
    if isinstance(value, _IMMUTABLE_TYPES) or type(value) is object:  # a bare object() is a sentinel
        return None
    if isinstance(value, tuple | frozenset):
        return next((w for v in value if (w := why_mutable(v, depth + 1))), None)
    if isinstance(value, types.MappingProxyType):
        return next((w for kv in value.items() for v in kv if (w := why_mutable(v, depth + 1))), None)
    if isinstance(value, np.ndarray):
        return "writeable numpy array" if value.flags.writeable else None
    if isinstance(value, np.generic | np.dtype):
        return None
    if _is_typing_construct(value):
        return None
    if dataclasses.is_dataclass(value) and type(value).__dataclass_params__.frozen:
        return next((w for f in dataclasses.fields(value)
                     if (w := why_mutable(getattr(value, f.name), depth + 1))), None)
    if callable(value) and not hasattr(value, "__dict__") and not hasattr(value, "__slots__"):
        return None  # a C-level callable (functools.partial of immutables, torch ops, ...)
    return f"instance of {type(value).__module__}.{type(value).__qualname__}"


def _is_typing_construct(value: Any) -> bool:
    mod = type(value).__module__
    return mod in ("typing", "typing_extensions") or isinstance(value, type(Any))


def _class_attrs(cls: type) -> dict[str, Any]:
    """Attributes a class defines itself that could be shared state (not methods, not enum members)."""
    if issubclass(cls, enum.Enum | BaseException):
        return {}
    out = {}
    for name, v in vars(cls).items():
        if name.startswith("__") and name.endswith("__") or name == "_abc_impl":  # owned by type/abc
            continue
        if isinstance(v, types.FunctionType | staticmethod | classmethod | property):
            continue
        out[name] = v
    return out


def offenders() -> dict[tuple[str, str], str]:
    found: dict[tuple[str, str], str] = {}
    for modname in _module_names():
        mod = importlib.import_module(modname)
        for name, value in vars(mod).items():
            if name.startswith("__") and name.endswith("__"):
                continue  # module metadata, set and owned by the import system (__path__, __all__, ...)
            if isinstance(value, type) and value.__module__ == modname:
                for attr, v in _class_attrs(value).items():
                    if (why := why_mutable(v)) is not None:
                        found[(modname, f"{name}.{attr}")] = why
            elif (why := why_mutable(value)) is not None:
                found[(modname, name)] = why
        for name in _rebound_globals(mod):
            found[(modname, name)] = "rebound by a function (`global`)"
    return found


def _rebound_globals(mod: types.ModuleType) -> set[str]:
    """Names a function of the module rebinds with a `global` statement: state even when each value
    is immutable (a flag or a singleton set at run time)."""
    tree = ast.parse(pathlib.Path(mod.__file__).read_text())
    return {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}


@pytest.fixture(scope="module")
def found() -> dict[tuple[str, str], str]:
    return offenders()


def test_no_module_level_mutable_state(found):
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert new == {}, "module-level mutable state (move it onto the runtime's per-scheduler object):\n" + \
        "\n".join(f"  {m}.{n}: {why}" for (m, n), why in sorted(new.items()))


def test_allowed_entries_exist(found):
    assert sorted(set(ALLOWED) - set(found)) == []


def test_the_check_sees_state():
    """The classifier itself: state is found, constants are not."""

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        a: tuple[int, ...] = (1, 2)

    @dataclasses.dataclass
    class Plain:
        a: int = 0

    ro = np.arange(3)
    ro.setflags(write=False)
    for state in ({}, [], set(), collections.OrderedDict(), collections.Counter(), threading.local(),
                  np.arange(3), Plain(), (1, []), frozenset({(1, threading.local())}), Frozen(a=([],)),
                  types.MappingProxyType({"a": []}), collections.deque(), threading.RLock(), [].append,
                  Plain().__repr__, iter(range(3))):
        assert why_mutable(state) is not None, state
    for const in (None, 1, "s", (1, "a"), frozenset({1}), Frozen(), ro, re.compile("x"), object(),
                  types.MappingProxyType({"a": (1,)}), operator.attrgetter("a"), len, Any, int | None,
                  "a,b".split, dict.fromkeys):
        assert why_mutable(const) is None, const
