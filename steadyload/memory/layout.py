"""How `SharedList` lays records out in its segment, and the reader built for that layout.

The layout is chosen once, from all the records (docs/design/shm.md#sharedlist):

- A *shape*: ``value`` (each record is one field), ``tuple`` (tuples of the same length) or
  ``dict`` (exact dicts with the same keys in the same order).
- A *code* per field. Fixed width: ``b h i q`` (int, smallest that holds every value),
  ``d`` (float), ``?`` (bool), ``N`` (None: not stored). Variable width: ``s`` (str as
  UTF-8), ``S`` (str with lone surrogates), ``y`` (bytes), ``m`` (marshal: values made only
  of None/bool/int/float/complex/str/bytes/tuple/list/dict/set/frozenset), ``o`` (marshal
  where it can, else pickle, told apart by the first byte: pickle's is 0x80, which no
  marshal type code is).
- A record's bytes: one struct with the fixed fields and the byte lengths of all variable
  fields but the last, then the variable fields. Without variable fields records have a
  fixed width and need no offsets table.

Reading a record is one generated function (like `dataclasses` and `namedtuple` build
theirs), so a dict of a str and two ints costs two offset reads, one `struct` unpack, one
slice decoded and one dict display: no pickle, and no per-record type tag.
"""

from __future__ import annotations

import marshal
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_FIXED = frozenset("bhiqd?")
_INT_RANGES = (("b", 1 << 7), ("h", 1 << 15), ("i", 1 << 31), ("q", 1 << 63))
_MARSHAL_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes})
_MARSHAL_DEPTH = 64  # deeper values are pickled (marshal refuses very deep nesting)
_MAX_FIELDS = 64  # wider records are stored whole: one generated line per field is plenty
_PICKLE_FIRST_BYTE = 0x80  # PROTO opcode, first byte of every protocol >= 2 pickle


@dataclass(frozen=True, slots=True)
class Layout:
    """What a segment holds; written into its header so that workers rebuild the reader."""

    shape: str
    """"value", "tuple" or "dict"."""
    keys: tuple[Any, ...]
    """The dict keys in order (shape "dict"), the field positions (shape "tuple")."""
    codes: str
    """One code per field (see the module docstring)."""

    @property
    def fixed(self) -> struct.Struct:
        """The struct that starts each record: fixed fields, then variable lengths."""
        fixed = "".join(c for c in self.codes if c in _FIXED)
        return struct.Struct("<" + fixed + "Q" * max(self.n_var - 1, 0))

    @property
    def n_var(self) -> int:
        """How many fields are stored with a variable width."""
        return sum(c not in _FIXED and c != "N" for c in self.codes)

    def to_bytes(self) -> bytes:
        """A plain-tuple pickle: the header names no steadyload class."""
        return pickle.dumps((self.shape, self.keys, self.codes), pickle.HIGHEST_PROTOCOL)

    @classmethod
    def from_bytes(cls, data: bytes) -> Layout:
        """The inverse of `to_bytes`."""
        shape, keys, codes = pickle.loads(data)
        return cls(shape, keys, codes)


def _marshal_safe(obj: Any, depth: int = 0) -> bool:
    """True when marshal gives ``obj`` back equal and of the same types (it writes any
    buffer, such as a numpy array, as bytes, and refuses subclasses)."""
    t = type(obj)
    if t in _MARSHAL_SCALARS:
        return True
    if depth >= _MARSHAL_DEPTH:
        return False
    if t is tuple or t is list or t is set or t is frozenset:
        return all(_marshal_safe(x, depth + 1) for x in obj)
    if t is dict:
        return all(_marshal_safe(k, depth + 1) and _marshal_safe(v, depth + 1)
                   for k, v in obj.items())
    return False


def _encode_object(obj: Any) -> bytes:
    if _marshal_safe(obj):
        return marshal.dumps(obj)
    return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)


def _field_code(values: Sequence[Any]) -> str:
    if not values:
        return "o"
    t = type(values[0])
    if all(type(v) is t for v in values):
        if t is int:
            low, high = min(values), max(values)
            for code, bound in _INT_RANGES:
                if -bound <= low and high < bound:
                    return code
        elif t is float:
            return "d"
        elif t is bool:
            return "?"
        elif t is type(None):
            return "N"
        elif t is bytes:
            return "y"
        elif t is str:
            try:
                for v in values:
                    v.encode()
            except UnicodeEncodeError:
                return "S"  # lone surrogates: UTF-8 with surrogatepass
            return "s"
    return "m" if all(_marshal_safe(v) for v in values) else "o"


def _shape(records: Sequence[Any]) -> tuple[str, tuple[Any, ...]]:
    if not records:
        return "value", ()
    first = records[0]
    if type(first) is dict and 0 < len(first) <= _MAX_FIELDS:
        keys = list(first)
        if all(type(r) is dict and len(r) == len(keys) and list(r) == keys for r in records):
            return "dict", tuple(keys)
    elif type(first) is tuple and 0 < len(first) <= _MAX_FIELDS:
        n = len(first)
        if all(type(r) is tuple and len(r) == n for r in records):
            return "tuple", tuple(range(n))
    return "value", ()


_ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "s": str.encode,
    "S": lambda v: v.encode("utf-8", "surrogatepass"),
    "y": bytes,
    "m": marshal.dumps,
    "o": _encode_object,
}


def plan(records: Sequence[Any]) -> tuple[Layout, list[bytes] | None]:
    """Choose the layout for ``records``, and encode them.

    Returns:
        The layout, and each record's bytes (None when the layout has fixed-width records:
        ``fixed_bytes`` then packs them without building a list of small objects).
    """
    shape, keys = _shape(records)
    if shape == "dict":
        columns: list[Sequence[Any]] = [[r[k] for r in records] for k in keys]
    elif shape == "tuple":
        columns = [[r[j] for r in records] for j in keys]
    else:
        columns = [records]
    layout = Layout(shape, keys, "".join(_field_code(c) for c in columns))
    if layout.n_var == 0:
        return layout, None
    fixed = [c for c, code in zip(columns, layout.codes, strict=True) if code in _FIXED]
    var = [(c, _ENCODERS[code]) for c, code in zip(columns, layout.codes, strict=True)
           if code not in _FIXED and code != "N"]
    if not fixed and len(var) == 1:  # e.g. a list of str: the bytes are the record
        column, encode = var[0]
        return layout, [encode(v) for v in column]
    pack = layout.fixed.pack
    encoded = []
    for j in range(len(records)):
        parts = [encode(column[j]) for column, encode in var]
        encoded.append(
            pack(*(c[j] for c in fixed), *(len(p) for p in parts[:-1])) + b"".join(parts)
        )
    return layout, encoded


def fixed_bytes(layout: Layout, records: Sequence[Any]) -> bytes:
    """All records of a fixed-width layout, packed back to back."""
    if layout.shape == "value":
        rows: Any = ((r,) for r in records) if layout.codes != "N" else (() for _ in records)
    else:
        idx = [j for j, c in enumerate(layout.codes) if c != "N"]
        keys = [layout.keys[j] for j in idx]
        rows = ([r[k] for k in keys] for r in records)
    pack = layout.fixed.pack
    return b"".join(pack(*row) for row in rows)


def getitem(layout: Layout, data_at: int) -> Callable[[Any, int], Any]:
    """Build ``__getitem__(self, i)`` for a `SharedList` laid out as ``layout``.

    The method reads ``self._mm`` (the mapping), ``self._offsets`` (absolute offsets, None
    for fixed-width records, which start at ``data_at + i * width``), ``self._column`` (a
    typed view, for lists of numbers) and ``self._count``; any index but an int in range
    goes to ``self._other_index``.
    """
    codes = layout.codes
    fixed = layout.fixed
    names: dict[str, Any] = {"U": fixed.unpack_from, "ML": marshal.loads, "PL": pickle.loads,
                             "PB": _PICKLE_FIRST_BYTE}
    body = ["if type(i) is not int or not 0 <= i < self._count:",
            "    return self._other_index(i)"]
    stored = [c for c in codes if c != "N"]
    if layout.shape == "value" and len(stored) == 1 and stored[0] in _FIXED:
        body.append("return self._column[i]")  # a typed view: the fastest read there is
        return _compile(body, names)
    body.append("M = self._mm")
    if layout.n_var:
        body += ["O = self._offsets", "a = O[i]", "b = O[i + 1]"]
    else:
        body.append(f"a = {data_at} + {fixed.size} * i")
    n_fixed = sum(c in _FIXED for c in codes)
    n_var = layout.n_var
    unpacked = [f"f{j}" for j in range(n_fixed)] + [f"n{j}" for j in range(max(n_var - 1, 0))]
    if unpacked:
        body.append(f"{', '.join(unpacked)}, = U(M, a)")
    if n_var:
        body.append(f"p0 = a + {fixed.size}" if fixed.size else "p0 = a")
    exprs = []
    f = v = 0
    for code in codes:
        if code == "N":
            exprs.append("None")
        elif code in _FIXED:
            exprs.append(f"f{f}")
            f += 1
        else:
            if v < n_var - 1:
                body.append(f"p{v + 1} = p{v} + n{v}")
                span = f"M[p{v}:p{v + 1}]"
            else:
                span = f"M[p{v}:b]"
            exprs.append({
                "s": f"{span}.decode()",
                "S": f"{span}.decode('utf-8', 'surrogatepass')",
                "y": span,
                "m": f"ML({span})",
                "o": f"(PL if M[p{v}] == PB else ML)({span})",
            }[code])
            v += 1
    if layout.shape == "value":
        body.append(f"return {exprs[0]}")
    elif layout.shape == "tuple":
        body.append(f"return ({', '.join(exprs)},)")
    else:
        for j, key in enumerate(layout.keys):
            names[f"K{j}"] = key
        items = ", ".join(f"K{j}: {e}" for j, e in enumerate(exprs))
        body.append(f"return {{{items}}}")
    return _compile(body, names)


def _compile(body: list[str], names: dict[str, Any]) -> Callable[[Any, int], Any]:
    # The method's constants (dict keys, the struct) are closure cells, the fastest
    # lookup there is, so the source is a factory taking them and returning the method.
    params = ", ".join(names)
    src = f"def factory({params}):\n    def __getitem__(self, i):\n"
    src += "".join(f"        {line}\n" for line in body)
    src += "    return __getitem__\n"
    scope: dict[str, Any] = {}
    exec(compile(src, "<steadyload.SharedList.__getitem__>", "exec"), scope)  # noqa: S102
    method: Callable[[Any, int], Any] = scope["factory"](**names)
    return method
