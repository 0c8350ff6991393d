"""One typed codec for the frozen records: records to JSON values and back, checked by their type hints.

Every file stagetool reads back (a snapshot, a sweep's rows, a facts-cache entry) is JSON that a
user, a shard or an older stagetool may have written; nothing in it is used before it is checked
against the record its type hints describe:

- :func:`encode`: a record to a JSON object (fields in declaration order; an :func:`omitted` field
  left out while it holds its default), tuples and lists to lists, enums to their values;
- :func:`decode`: a JSON value as a type hint describes it, or one :class:`CodecError` naming the key
  path (``functions.f.memory.peak_bytes: must be a number or null, not a string``). Hints: ``int``,
  ``float`` (an integer too; never a bool, NaN or an infinity), ``str``, ``bool``, ``None``, unions,
  ``Literal``, enums, ``tuple[X, ...]``, fixed tuples, ``list[X]``, ``dict[str, X]``, records,
  ``Annotated[X, Check(...)]``, ``Any``, ``pathlib.Path`` (a string);
- :func:`pack` / :func:`unpack`: the same as a table of distinct values (the facts cache, whose
  entries repeat a few hundred distinct records tens of thousands of times);
- :func:`map_strings`: a value with a function applied to every string in it, the one walk over records.

JAX-free, standard library only.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import json
import math
import types
import typing
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

_NONE = type(None)
_SCALARS = (_NONE, bool, int, float, str)


class CodecError(ValueError):
    """A JSON value that is not what its type hint says: ``path`` (``functions.f.inputs[2].shape``,
    ``""`` for the whole value) and ``message`` (``must be a list of integers, not a string``)."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}" if path else message)
        self.path, self.message = path, message


@dataclasses.dataclass(frozen=True)
class Check:
    """A condition beyond the type: ``Annotated[int, Check(lambda n: n >= 0, "not negative")]``."""

    test: Callable[[Any], bool]
    says: str


@dataclasses.dataclass(frozen=True)
class _Omitted:
    value: Any


def omitted(default: Any = None) -> Any:
    """A record field left out of its JSON object while it holds ``default`` (and ``default`` when the
    object has no such key): ``chosen: bool = omitted(False)``."""
    return dataclasses.field(default=default, metadata={"omit": True})


@functools.cache
def fields_of(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    """``(name, type hint, default)`` of each field of the record class ``cls``: ``MISSING`` for a
    required field, the default wrapped in ``_Omitted`` for an :func:`omitted` one."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        out.append((f.name, hints[f.name], _Omitted(default) if f.metadata.get("omit") else default))
    return tuple(out)


@functools.cache
def _form(hint: Any) -> tuple[str, Any, tuple]:
    """``(kind, arg, child hints)``: ``any``; ``scalar`` (arg: the type); ``union``; ``choice`` (arg:
    the Literal's values); ``enum`` (arg: the class); ``seq`` (arg: tuple or list); ``fixed``; ``dict``;
    ``record`` (arg: the class; children: its fields' hints); ``checked`` (arg: the checks); ``path``
    (arg: the class, ``pathlib.Path``: a string in JSON)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return "any", None, ()
    if hint in _SCALARS or hint is None:
        return "scalar", _NONE if hint is None else hint, ()
    if origin is typing.Annotated:
        return "checked", tuple(a for a in args[1:] if isinstance(a, Check)), args[:1]
    if origin is typing.Union or origin is types.UnionType:
        return "union", None, args
    if origin is typing.Literal:
        return "choice", args, ()
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return "fixed", tuple, args
        return "seq", origin, args[:1] or (Any,)
    if origin is dict:
        return "dict", None, args[1:] or (Any,)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "enum", hint, ()
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return "path", hint, ()
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "record", hint, tuple(h for _, h, _ in fields_of(hint))
    raise TypeError(f"the codec has no form for the type hint {hint!r}")


_SAYS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", _NONE: "null"}
_PLURAL = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


@functools.cache
def says(hint: Any) -> str:
    """What a value of ``hint`` is, in words: ``a list of integers or null``."""
    kind, arg, kids = _form(hint)
    if kind == "scalar":
        return _SAYS[arg]
    if kind == "union":
        return " or ".join(dict.fromkeys(says(k) for k in sorted(kids, key=lambda k: k is _NONE)))
    if kind in ("choice", "enum"):
        return "one of " + ", ".join(repr(v) for v in (arg if kind == "choice" else [m.value for m in arg]))
    if kind == "seq":
        item = _form(kids[0])
        return f"a list of {_PLURAL[item[1]]}" if item[0] == "scalar" and item[1] in _PLURAL else "a list"
    if kind == "fixed":
        return f"a list of {len(kids)}"
    if kind == "checked":
        return ", ".join([says(kids[0]), *(c.says for c in arg)])
    if kind == "path":
        return "a path (a string)"
    return "an object" if kind in ("dict", "record") else "any value"


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", _NONE: "null",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def _scalar_ok(t: type, v: Any) -> bool:
    if t is float:
        return type(v) is int or (type(v) is float and math.isfinite(v))
    return type(v) is t


def _fits(hint: Any, v: Any) -> bool:
    """Whether ``v`` has the JSON shape of ``hint`` (how a union's alternative is picked)."""
    kind, arg, kids = _form(hint)
    if kind == "scalar":
        return _scalar_ok(arg, v)
    if kind in ("union", "checked"):
        return any(_fits(k, v) for k in kids)
    if kind == "path":
        return type(v) is str
    if kind in ("seq", "fixed", "dict", "record"):
        return type(v) is (list if kind in ("seq", "fixed") else dict)
    return True


def _key(path: str, name: Any) -> str:
    name = name if isinstance(name, str) and name.isidentifier() else json.dumps(name, ensure_ascii=True)
    return f"{path}.{name}" if path else name


def decode(hint: Any, value: Any, path: str = "", *, unknown: bool = False) -> Any:
    """``value`` (parsed JSON) as ``hint`` describes it: records built, lists made tuples where the hint
    says ``tuple``, enums made members. ``path`` names ``value`` in messages; with ``unknown``, keys a
    record does not have are left aside (by default they are an error).

    Raises:
      CodecError: the first value not of its hint, naming its key path; a record's missing key (one
        without a default) or, unless ``unknown``, a key it does not have.
    """
    kind, arg, kids = _form(hint)

    def wrong(detail: str | None = None) -> CodecError:
        return CodecError(path, f"must be {says(hint)}" + (f", not {detail}" if detail else ""))

    if kind == "any":
        return value
    if kind == "scalar":
        if not _scalar_ok(arg, value):
            raise wrong(_kind(value))
        return value
    if kind == "union":
        alt = next((k for k in kids if _fits(k, value)), None)
        if alt is None:
            raise wrong(_kind(value))
        return decode(alt, value, path, unknown=unknown)
    if kind in ("choice", "enum"):
        ok = type(value) in (str, int, _NONE) and value in (arg if kind == "choice" else [m.value for m in arg])
        if not ok:
            raise wrong(_shown(value))
        return value if kind == "choice" else arg(value)
    if kind == "path":
        if type(value) is not str:
            raise wrong(_kind(value))
        return arg(value)
    if kind == "checked":
        out = decode(kids[0], value, path, unknown=unknown)
        if not all(c.test(out) for c in arg):
            raise wrong(_shown(value))
        return out
    if type(value) is not (list if kind in ("seq", "fixed") else dict):
        raise wrong(_kind(value))
    if kind in ("seq", "fixed"):
        if kind == "fixed" and len(value) != len(kids):
            raise wrong(_kind(value))
        flat = _form(kids[0])[0] in ("scalar", "choice")
        if kind == "seq" and flat and not all(_fits(kids[0], v) for v in value):
            raise wrong()  # a wrong item of a list of scalars is said at the list
        items = kids if kind == "fixed" else kids * len(value)
        out = [decode(h, v, f"{path}[{i}]", unknown=unknown) for i, (h, v) in enumerate(zip(items, value))]
        return out if arg is list else tuple(out)
    if kind == "dict":
        if not all(type(k) is str for k in value):
            raise wrong("an object with other keys")
        return {k: decode(kids[0], v, _key(path, k), unknown=unknown) for k, v in value.items()}
    got = {}
    for name, h, default in fields_of(arg):
        if name in value:
            got[name] = decode(h, value[name], _key(path, name), unknown=unknown)
        elif default is dataclasses.MISSING:
            raise CodecError(path, f"missing {name!r}")
    if not unknown and len(got) != len(value):
        raise CodecError(path, "unknown " + ", ".join(repr(k) for k in sorted(set(value) - set(got))))
    return arg(**got)


def _shown(v: Any, n: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= n else text[:n] + "…"


def encode(value: Any) -> Any:
    """``value`` as JSON values: a record as an object of its fields in declaration order (an
    :func:`omitted` field left out while it holds its default), tuples and lists as lists, dicts as
    objects, enums as their values, scalars as they are.

    Raises:
      TypeError: a value of no JSON form (a set, a callable, a dict with keys that are not strings).
    """
    if value is None or type(value) in _SCALARS:
        return value
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, dict) and all(type(k) is str for k in value):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: encode(getattr(value, name)) for name, _, default in fields_of(type(value))
                if not (type(default) is _Omitted and getattr(value, name) == default.value)}
    raise TypeError(f"cannot encode a {type(value).__name__}")


# ---- a table of distinct values ----------------------------------------------------------------
#
# ``table``: nodes in post-order (children before parents), each ``[tag, ...]``: ``["v", scalar]``;
# ``["t", i...]`` a tuple; ``["l", i...]`` a list; ``["d", key, i, key, i...]`` a dict with string
# keys; ``["r", name, i...]`` a record's fields in declaration order. Immutable values (scalars,
# tuples, records) are written once and referred to by index; lists and dicts once per occurrence,
# so no two places of the values read back share one. ``records``: each record name used with its
# field names (a class whose fields changed since is an error, not a misread); ``fields``: each
# value's index.


def pack(values: dict[str, Any]) -> dict[str, Any]:
    """``{"fields": {name: index}, "records": {name: [field, ...]}, "table": [...]}`` of ``values``:
    scalars, tuples, lists, dicts with string keys, and records of those.

    Raises:
      TypeError: a value of another kind (an enum, a set, a callable).
    """
    table: list[list] = []
    memo: dict[tuple, int] = {}
    records: dict[str, list[str]] = {}

    def add(node: list, key: tuple | None) -> int:
        if key is not None and key in memo:
            return memo[key]
        if key is not None:
            memo[key] = len(table)
        table.append(node)
        return len(table) - 1

    def enc(value: Any) -> int:
        t = type(value)
        if t in (_NONE, bool, int, str):
            return add(["v", value], ("v", t, value))
        if t is float:
            return add(["v", value], ("v", float, repr(value)))  # -0.0 is not 0.0; nan is itself
        if isinstance(value, tuple):
            node = ["t", *(enc(v) for v in value)]
            return add(node, tuple(node))
        if t is list:
            return add(["l", *(enc(v) for v in value)], None)
        if t is dict and all(type(k) is str for k in value):
            return add(["d", *(x for k, v in value.items() for x in (k, enc(v)))], None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names = records.setdefault(t.__name__, [f.name for f in dataclasses.fields(value)])
            node = ["r", t.__name__, *(enc(getattr(value, n)) for n in names)]
            return add(node, tuple(node))
        raise TypeError(f"cannot pack a {t.__name__}")

    return {"fields": {name: enc(v) for name, v in values.items()}, "records": records, "table": table}


def unpack(payload: dict[str, Any], hints: dict[str, Any]) -> dict[str, Any]:
    """The values of a :func:`pack` payload, each checked against its hint in ``hints`` (one per field,
    no more, no fewer). The table is read in one pass, children first: a record node is built only
    once each of its fields holds a value of the field's type (a record in it was checked when it
    was built), so a distinct record is one object however many places hold it.

    Raises:
      CodecError: not such a table (a field missing, a reference that does not point back, a node of
        no known form, a record of no class the hints reach or whose fields are not its class's), or a
        value not of its hint.
    """
    table, records, refs = payload.get("table"), payload.get("records"), payload.get("fields")
    if not (type(table) is list and type(records) is dict and type(refs) is dict and set(refs) == set(hints)):
        raise CodecError("", "not a table of the fields asked for")
    classes, makers = {}, {}
    for cls in _records_reached(tuple(hints.values())):
        if cls.__name__ in records:
            if records[cls.__name__] != [f for f, _, _ in fields_of(cls)]:
                raise CodecError("records", f"{cls.__name__}: its fields are not this stagetool's")
            classes[cls.__name__], makers[cls.__name__] = cls, _maker(cls)
    out: list[Any] = []
    get = out.__getitem__
    try:
        for i, node in enumerate(table):  # out[k] of a later node is an IndexError: nothing refers forward
            tag = node[0]
            if tag == "r":
                make = makers.get(node[1])
                made = None if make is None else make(*map(get, node[2:]))
                if made is None:
                    raise _record_error(i, node, classes.get(node[1]), out)
                out.append(made)
            elif tag == "t":
                out.append(tuple(map(get, node[1:])))
            elif tag == "v" and len(node) == 2 and type(node[1]) in _SCALARS:
                out.append(node[1])
            elif tag == "l":
                out.append(list(map(get, node[1:])))
            elif tag == "d" and len(node) % 2 == 1 and all(type(k) is str for k in node[1::2]):
                out.append(dict(zip(node[1::2], map(get, node[2::2]))))
            else:
                raise CodecError(f"table[{i}]", "a node of no known form")
        got = {name: out[refs[name]] for name in hints}
    except (IndexError, TypeError):
        raise CodecError(f"table[{len(out)}]", "a reference that does not point back, or a record of "
                                               "another number of fields") from None
    for name, hint in hints.items():
        if not _checker(hint)(got[name]):
            raise CodecError(name, f"must be {says(hint)}")
    return got


@functools.cache
def _records_reached(hints: tuple) -> tuple[type, ...]:
    """Every record class ``hints`` name, the ones their fields name, and so on."""
    found: dict[type, None] = {}
    todo = list(hints)
    while todo:
        kind, arg, kids = _form(todo.pop())
        if kind == "record" and arg in found:
            continue
        if kind == "record":
            found[arg] = None
        todo.extend(kids)
    return tuple(found)


def _record_error(i: int, node: list, cls: type | None, out: list) -> CodecError:
    if cls is None:
        return CodecError(f"table[{i}]", f"a record of no class the fields reach ({node[1]!r})")
    name, hint = next((n, h) for (n, h, _), k in zip(fields_of(cls), node[2:]) if not _checker(h)(out[k]))
    return CodecError(f"table[{i}].{name}", f"must be {says(hint)}")


def _types(hint: Any) -> frozenset | None:
    """The exact types a value of ``hint`` may have when checking its type is enough (a scalar, a
    record built checked, a union of those), else None."""
    kind, arg, kids = _form(hint)
    if kind == "scalar":
        return frozenset({arg, int} if arg is float else {arg})
    if kind == "record":
        return frozenset({arg})
    if kind == "union":
        parts = [_types(k) for k in kids]
        return None if None in parts else frozenset().union(*parts)
    return None


@functools.cache
def _checker(hint: Any) -> Callable[[Any], bool]:
    """A fast test that a value :func:`unpack` built is of ``hint``."""
    kind, arg, kids = _form(hint)
    exact = _types(hint)
    if exact is not None:
        return lambda v: type(v) in exact
    if kind == "union":
        tests = tuple(_checker(k) for k in kids)
        return lambda v: any(t(v) for t in tests)
    if kind == "seq" and _types(kids[0]) is not None:
        item = _types(kids[0])
        return lambda v: type(v) is arg and set(map(type, v)) <= item
    if kind in ("seq", "fixed", "dict"):
        tests = tuple(_checker(k) for k in kids)
        if kind == "dict":
            return lambda v: type(v) is dict and all(tests[0](x) for x in v.values())
        if kind == "seq":
            return lambda v: type(v) is arg and all(map(tests[0], v))
        return lambda v: type(v) is tuple and len(v) == len(tests) and all(t(x) for t, x in zip(tests, v))
    if kind == "choice":
        return lambda v: type(v) in (str, int, _NONE) and v in arg
    if kind == "checked":
        inner = _checker(kids[0])
        return lambda v: inner(v) and all(c.test(v) for c in arg)
    return (lambda v: isinstance(v, arg)) if kind in ("enum", "path") else (lambda v: True)


@functools.cache
def _maker(cls: type) -> Callable[..., Any]:
    """``make(*field_values)``: a ``cls`` record, or None when a value is not of its field's type; the
    tests (:func:`_checker`'s) written out as one expression, record nodes being a table's most
    frequent. A plain frozen dataclass (no ``__post_init__``, no slots) gets its fields set as its
    ``__init__`` would, without the ``object.__setattr__`` per field that makes that slow."""
    ns: dict[str, Any] = {"new": object.__new__, "cls": cls}
    names = [n for n, _, _ in fields_of(cls)]
    args = [f"v{i}" for i in range(len(names))]
    tests = []
    for a, (_, hint, _) in zip(args, fields_of(cls)):
        kind, _, kids = _form(hint)
        name = f"c{len(ns)}"
        if _types(hint) is not None:
            ns[name] = _types(hint)
            tests.append(f"type({a}) in {name}")
        elif kind == "seq" and _types(kids[0]) is not None:
            ns[name], ns[name + "s"] = _types(kids[0]), _form(hint)[1]
            tests.append(f"type({a}) is {name}s and set(map(type, {a})) <= {name}")
        else:
            ns[name] = _checker(hint)
            tests.append(f"{name}({a})")
    plain = not (hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"))
    made = ("new(cls)\n    o.__dict__.update({" + ", ".join(f"{n!r}: {a}" for n, a in zip(names, args)) + "})"
            if plain else f"cls({', '.join(args)})")
    source = (f"def make({', '.join(args)}):\n    if not ({' and '.join(tests) or 'True'}):\n        return None\n"
              f"    o = {made}\n    return o\n")
    exec(source, ns)  # noqa: S102 - the source is made of our own field names and the tests above
    return ns["make"]


# ---- one walk over every string ------------------------------------------------------------------


def map_strings(value: Any, fn: Callable[[str], str], *, skip: frozenset[str] = frozenset(),
                keys: bool = False, _depth: int = 0) -> Any:
    """``value`` with ``fn`` applied to every string in it: in records (copied with the changed fields
    set; fields named in ``skip`` left as they are), tuples (named tuples too), lists and dicts (their
    keys too with ``keys``). What did not change is the same object; other values, and anything
    nested deeper than 200, are returned as they are."""
    if _depth > 200:
        return value
    if type(value) is str:
        new = fn(value)
        return value if new == value else new
    again = functools.partial(map_strings, fn=fn, skip=skip, keys=keys, _depth=_depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: again(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name not in skip}
        changes = {k: v for k, v in changes.items() if v is not getattr(value, k)}
        if not changes:
            return value
        out = copy.copy(value)
        for name, new in changes.items():
            object.__setattr__(out, name, new)
        return out
    if isinstance(value, (tuple, list)):
        items = [again(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        out_d = {(again(k) if keys else k): again(v) for k, v in value.items()}
        same = len(out_d) == len(value) and all(k in value and out_d[k] is value[k] for k in out_d)
        return value if same else out_d
    return value
