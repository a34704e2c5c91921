"""The user's file and line in a remote worker's stack, where cloudpickle sent the code.

Ray pickles a class defined in ``__main__`` (or a module registered with
``cloudpickle.register_pickle_by_value``) by value, and cloudpickle names the file of every
code object it rebuilds ``<dynamic-code>`` (for a deterministic payload): on the actor a
hung sample's stack then reads ``File "<dynamic-code>", line 42, in __getitem__``, with no
source line, since the file may not exist on that host. The code was pickled here, from
this process's own modules, so the frame is matched here: the function of that name whose
lines hold that line, in ``__main__`` and the modules pickled by value; the frame then
names the real file, and the source line is read from this machine's copy.
"""

from __future__ import annotations

import linecache
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

_DYNAMIC = re.compile(r'^(\s*)File "<dynamic-code>", line (\d+), in (\S+)\n', re.MULTILINE)


def located(text: str) -> str:
    """``text`` (a formatted stack) with each ``<dynamic-code>`` frame named by the file
    and line it came from here, and that line's source; frames not found stay as they are."""
    if "<dynamic-code>" not in text:
        return text
    spans = _spans()

    def name(match: re.Match[str]) -> str:
        indent, line, function = match.group(1), int(match.group(2)), match.group(3)
        for first, last, filename in spans.get(function, ()):
            if first <= line <= last:
                source = linecache.getline(filename, line).strip()
                where = f'{indent}File "{filename}", line {line}, in {function}\n'
                return where + (f"{indent}  {source}\n" if source else "")
        return match.group(0)

    return _DYNAMIC.sub(name, text)


def _spans() -> dict[str, list[tuple[int, int, str]]]:
    """Function name -> (first line, last line, file) of the code of the modules that
    cloudpickle pickles by value."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for module in _by_value_modules():
        for code in _codes(vars(module).values(), module.__name__, set()):
            lines = [line for _, _, line in code.co_lines() if line is not None]
            span = (min(lines, default=code.co_firstlineno), max(lines, default=0))
            spans.setdefault(code.co_name, []).append((*span, code.co_filename))
    return spans


def _by_value_modules() -> list[types.ModuleType]:
    names = {"__main__"}
    cloudpickle = sys.modules.get("cloudpickle.cloudpickle")
    names |= set(getattr(cloudpickle, "_PICKLE_BY_VALUE_MODULES", ()))
    return [sys.modules[name] for name in sorted(names) if name in sys.modules]


def _codes(objects: Any, module: str, seen: set[int]) -> Iterator[types.CodeType]:
    """The code objects of the functions and classes defined in ``module`` among
    ``objects`` (methods, nested functions and classes included)."""
    for obj in objects:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        obj = getattr(obj, "__func__", obj)  # staticmethod, classmethod
        if isinstance(obj, property):
            yield from _codes((obj.fget, obj.fset, obj.fdel), module, seen)
        elif isinstance(obj, types.FunctionType) and obj.__module__ == module:
            yield from _nested(obj.__code__)
        elif isinstance(obj, type) and obj.__module__ == module:
            yield from _codes(vars(obj).values(), module, seen)


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)
