"""One typed codec for the frozen records: records to JSON values and back, checked by their type hints.

Every file stagetool reads back (a snapshot, a sweep's rows, a facts-cache entry) is JSON a user, a
shard or an older stagetool may have written; nothing in it is used before it is checked against
the record its type hints describe. The hints drive both ways:

- :func:`encode`: a record to a JSON object (its fields in declaration order; a field declared with
  :func:`omitted` is left out while it holds its default), tuples and lists to lists, enums to their
  values;
- :func:`decode`: a JSON value checked against a type hint, raising one :class:`CodecError` that
  names the key path (``functions.f.memory.peak_bytes: must be a number or null, not a string``).
  Forms: ``int``, ``float`` (an integer is a number too; never a bool, NaN or an infinity),
  ``str``, ``bool``, ``None``, unions and ``Optional``, ``Literal``, enums, ``tuple[X, ...]``,
  fixed tuples, ``list[X]``, ``dict[str, X]``, nested records, ``Annotated[X, Check(...)]``, ``Any``;
- :func:`pack` / :func:`unpack`: the same values as a table of distinct values, for the facts
  cache, whose entries repeat a few hundred distinct records tens of thousands of times;
- :func:`map_strings`: a copy of a value with a function applied to every string in it (paths made
  relative or portable, control characters escaped), the one generic walk over records.

JAX-free and standard library only.
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
from typing import Any

_NONE = type(None)


class CodecError(ValueError):
    """A JSON value that is not what the type hint says.

    Attributes:
      path: the key path of the value (``functions.f.inputs[2].shape``; ``""`` for the whole value).
      message: what was wrong (``must be a list of integers, not a string``).
    """

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}" if path else message)
        self.path, self.message = path, message


@dataclasses.dataclass(frozen=True)
class Check:
    """A condition beyond the type: ``Annotated[int, Check(lambda n: n >= 0, "not negative")]``."""

    test: Callable[[Any], bool]
    says: str


def omitted(default: Any = None) -> Any:
    """A record field left out of its JSON object while it holds ``default`` (and ``default`` when
    the object has no such key): ``chosen: bool = omitted(False)``."""
    return dataclasses.field(default=default, metadata={"omit": True})


@dataclasses.dataclass(frozen=True)
class _Omitted:
    value: Any


@functools.cache
def fields_of(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    """``(name, type hint, default)`` of each field of the record class ``cls``; the default is
    ``MISSING`` for a required field, and wrapped in ``_Omitted`` for an :func:`omitted` one."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        out.append((f.name, hints[f.name], _Omitted(default) if f.metadata.get("omit") else default))
    return tuple(out)


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


@functools.cache
def _form(hint: Any) -> tuple:
    """``hint`` normalised: ``("any",)``, ``("scalar", type)``, ``("union", alternatives)``,
    ``("literal", values)``, ``("enum", cls)``, ``("seq", item, tuple|list)``, ``("fixed", items)``,
    ``("dict", value)``, ``("record", cls)``, ``("checked", hint, checks)``."""
    if hint is Any or hint is object:
        return ("any",)
    if hint in (int, float, str, bool, _NONE, None):
        return ("scalar", _NONE if hint is None else hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return ("checked", args[0], tuple(a for a in args[1:] if isinstance(a, Check)))
    if origin is typing.Union or origin is types.UnionType:
        return ("union", args)
    if origin is typing.Literal:
        return ("literal", args)
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return ("fixed", args)
        return ("seq", args[0] if args else Any, origin)
    if origin is dict:
        return ("dict", args[1] if args else Any)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return ("enum", hint)
    if _is_record(hint):
        return ("record", hint)
    raise TypeError(f"the codec has no form for the type hint {hint!r}")


_SCALAR_SAYS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", _NONE: "null"}
_PLURAL = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


@functools.cache
def says(hint: Any) -> str:
    """What a value of ``hint`` is, in words: ``a list of integers or null``."""
    form = _form(hint)
    kind = form[0]
    if kind == "scalar":
        return _SCALAR_SAYS[form[1]]
    if kind == "union":
        alts = [a for a in form[1] if a is not _NONE] + [a for a in form[1] if a is _NONE]
        return " or ".join(dict.fromkeys(says(a) for a in alts))
    if kind in ("literal", "enum"):
        values = form[1] if kind == "literal" else tuple(m.value for m in form[1])
        return "one of " + ", ".join(repr(v) for v in values)
    if kind == "seq":
        item = _form(form[1])
        return f"a list of {_PLURAL[item[1]]}" if item[0] == "scalar" and item[1] in _PLURAL else "a list"
    if kind == "fixed":
        return f"a list of {len(form[1])}"
    if kind in ("dict", "record"):
        return "an object"
    if kind == "checked":
        return ", ".join([says(form[1]), *(c.says for c in form[2])])
    return "any value"


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", _NONE: "null",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def _scalar_ok(t: type, v: Any) -> bool:
    if t is float:
        return type(v) in (int, float) and math.isfinite(v)
    return type(v) is t


def _flat(hint: Any) -> bool:
    """Whether ``hint`` holds no container (a wrong item is said at its container's path)."""
    form = _form(hint)
    return form[0] in ("scalar", "literal", "enum") or (form[0] == "union" and all(_flat(a) for a in form[1]))


def _key(path: str, name: Any) -> str:
    name = name if isinstance(name, str) and name.isidentifier() else json.dumps(name, ensure_ascii=True)
    return f"{path}.{name}" if path else name


def _fits(hint: Any, v: Any) -> bool:
    """Whether ``v`` has the JSON shape of ``hint`` (a union's alternative is picked by it)."""
    form = _form(hint)
    kind = form[0]
    if kind == "scalar":
        return _scalar_ok(form[1], v)
    if kind in ("seq", "fixed"):
        return type(v) is list
    if kind in ("dict", "record"):
        return type(v) is dict
    if kind == "union":
        return any(_fits(a, v) for a in form[1])
    if kind == "checked":
        return _fits(form[1], v)
    return kind == "any" or kind in ("literal", "enum")


def decode(hint: Any, value: Any, path: str = "", *, unknown: bool = False) -> Any:
    """``value`` (parsed JSON) as ``hint`` describes it: records built, lists made tuples where the
    hint says ``tuple``, enums made members.

    Args:
      hint: a type hint (a record class, ``tuple[int, ...]``, ``str | None`` ...).
      value: the JSON value.
      path: the key path of ``value``, for messages.
      unknown: accept (and drop) keys a record does not have; by default they are an error.

    Raises:
      CodecError: the first value that is not of its hint, naming its key path; a record's missing
        key (one without a default) or, unless ``unknown``, a key it does not have.
    """
    form = _form(hint)
    kind = form[0]
    if kind == "any":
        return value
    if kind == "scalar":
        if not _scalar_ok(form[1], value):
            raise CodecError(path, f"must be {says(hint)}, not {_kind(value)}")
        return value
    if kind == "union":
        for alt in form[1]:
            if _fits(alt, value):
                return decode(alt, value, path, unknown=unknown)
        raise CodecError(path, f"must be {says(hint)}, not {_kind(value)}")
    if kind == "literal":
        if value not in form[1] or type(value) not in (str, int, _NONE):
            raise CodecError(path, f"must be {says(hint)}, not {_shown(value)}")
        return value
    if kind == "enum":
        try:
            return form[1](value)
        except (ValueError, TypeError):
            raise CodecError(path, f"must be {says(hint)}, not {_shown(value)}") from None
    if kind == "checked":
        out = decode(form[1], value, path, unknown=unknown)
        for check in form[2]:
            if not check.test(out):
                raise CodecError(path, f"must be {says(hint)}, not {_shown(value)}")
        return out
    if kind in ("seq", "fixed"):
        if type(value) is not list or (kind == "fixed" and len(value) != len(form[1])):
            raise CodecError(path, f"must be {says(hint)}, not {_kind(value)}")
        items = form[1] if kind == "fixed" else (form[1],) * len(value)
        if kind == "seq" and _flat(form[1]) and not all(_fits(form[1], v) for v in value):
            raise CodecError(path, f"must be {says(hint)}")
        out = [decode(h, v, f"{path}[{i}]", unknown=unknown) for i, (h, v) in enumerate(zip(items, value))]
        return out if kind == "seq" and form[2] is list else tuple(out)
    if type(value) is not dict:
        raise CodecError(path, f"must be {says(hint)}, not {_kind(value)}")
    if kind == "dict":
        for k in value:
            if type(k) is not str:
                raise CodecError(path, "must be an object with string keys")
        return {k: decode(form[1], v, _key(path, k), unknown=unknown) for k, v in value.items()}
    cls = form[1]
    args = {}
    for name, h, default in fields_of(cls):
        if name in value:
            args[name] = decode(h, value[name], _key(path, name), unknown=unknown)
        elif default is dataclasses.MISSING:
            raise CodecError(path, f"missing {name!r}")
    if not unknown and len(args) != len(value):
        extra = sorted(set(value) - {name for name, _, _ in fields_of(cls)})
        raise CodecError(path, "unknown " + ", ".join(repr(k) for k in extra))
    return cls(**args)


def _shown(v: Any, n: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= n else text[:n] + "…"


def encode(value: Any) -> Any:
    """``value`` as JSON values: a record as an object of its fields in declaration order (a field
    declared with :func:`omitted` left out while it holds its default), tuples and lists as lists,
    dicts as objects, enums as their values; scalars as they are.

    Raises:
      TypeError: a value of no JSON form (a set, a callable, a dict with non-string keys).
    """
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if not all(type(k) is str for k in value):
            raise TypeError("cannot encode a mapping with non-string keys")
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for name, _, default in fields_of(type(value)):
            v = getattr(value, name)
            if not (type(default) is _Omitted and v == default.value):
                out[name] = encode(v)
        return out
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
    scalars, tuples, lists, dicts with string keys and records of those.

    Raises:
      TypeError: a value of another kind (an enum, a set, a callable).
    """
    table: list[list] = []
    memo: dict[tuple, int] = {}
    records: dict[str, list[str]] = {}

    def add(node: list, key: tuple | None) -> int:
        if key is not None:
            found = memo.get(key)
            if found is not None:
                return found
            memo[key] = len(table)
        table.append(node)
        return len(table) - 1

    def enc(value: Any) -> int:
        t = type(value)
        if value is None or t in (bool, int, str):
            return add(["v", value], ("v", t, value))
        if t is float:
            return add(["v", value], ("v", float, repr(value)))  # -0.0 is not 0.0; nan is itself
        if isinstance(value, tuple):
            node = ["t", *(enc(v) for v in value)]
            return add(node, tuple(node))
        if t is list:
            return add(["l", *(enc(v) for v in value)], None)
        if t is dict:
            if not all(type(k) is str for k in value):
                raise TypeError("cannot pack a mapping with non-string keys")
            return add(["d", *(x for k, v in value.items() for x in (k, enc(v)))], None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names = records.setdefault(t.__name__, [f.name for f in dataclasses.fields(value)])
            node = ["r", t.__name__, *(enc(getattr(value, n)) for n in names)]
            return add(node, tuple(node))
        raise TypeError(f"cannot pack a {t.__name__}")

    return {"fields": {name: enc(v) for name, v in values.items()}, "records": records, "table": table}


@dataclasses.dataclass(eq=False)
class _Plan:
    """How :func:`unpack` reads a node as one hint: ``kind`` (``any``, ``scalar``, ``union``, ``seq``,
    ``fixed``, ``dict``, ``record``, ``checked``, ``choice``), the node's ``tag`` (``v t l d r``),
    ``arg`` (the scalar type, the record class, the checks, the choices) and the children's plans."""

    hint: Any
    kind: str = ""
    tag: str = ""
    arg: Any = None
    kids: tuple = ()
    tuple_out: bool = True


@functools.cache
def _plan(hint: Any) -> _Plan:
    form = _form(hint)
    kind = form[0]
    plan = _Plan(hint, kind)
    if kind == "scalar":
        plan.tag, plan.arg = "v", form[1]
    elif kind in ("literal", "enum"):
        plan.kind, plan.tag, plan.arg = "choice", "v", frozenset(form[1] if kind == "literal" else ())
        if kind == "enum":
            plan.kind, plan.arg = "enum", form[1]
    elif kind == "union":
        plan.kids = tuple(_plan(a) for a in form[1])
    elif kind == "seq":
        plan.tag, plan.kids, plan.tuple_out = ("t" if form[2] is tuple else "l"), (_plan(form[1]),), form[2] is tuple
    elif kind == "fixed":
        plan.tag, plan.kids = "t", tuple(_plan(a) for a in form[1])
    elif kind == "dict":
        plan.tag, plan.kids = "d", (_plan(form[1]),)
    elif kind == "record":
        plan.tag, plan.arg = "r", form[1]
        plan.kids = tuple(_plan(h) for _, h, _ in fields_of(form[1]))
    elif kind == "checked":
        plan.arg, plan.kids = form[2], (_plan(form[1]),)
    return plan


def unpack(payload: dict[str, Any], hints: dict[str, Any]) -> dict[str, Any]:
    """The values of a :func:`pack` payload, each checked against its hint in ``hints`` (one per
    field, no more, no fewer).

    The table is read in one pass, children before parents: a record node is built only once each
    of its fields holds a value of the field's type (a child record was checked when it was built,
    so that is its class; a tuple shared by many records is checked once).

    Raises:
      CodecError: the payload is not such a table (a field missing, a node of no known form, a
        record of no class the hints reach or whose fields are not its class's) or a value is not
        of its hint.
      IndexError, TypeError: a reference that does not point back to an earlier node.
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
    except (IndexError, TypeError):
        raise CodecError(f"table[{len(out)}]", "a reference that does not point back to an earlier node, "
                                               "or a record of another number of fields") from None
    got = {}
    for name, hint in hints.items():
        got[name] = value = out[refs[name]]
        if not _checker(hint)(value):
            raise CodecError(name, f"must be {says(hint)}")
    return got


_SCALARS = (type(None), bool, int, float, str)


@functools.cache
def _records_reached(hints: tuple) -> tuple[type, ...]:
    """Every record class ``hints`` name, and the ones their fields name, and so on."""
    found: dict[type, None] = {}
    todo = [_plan(h) for h in hints]
    while todo:
        p = todo.pop()
        if p.kind == "record" and p.arg not in found:
            found[p.arg] = None
        elif p.kind == "record":
            continue
        todo.extend(p.kids)
    return tuple(found)


def _record_error(i: int, node: list, cls: type | None, out: list) -> CodecError:
    """Why record node ``i`` was not built: no class, or the first field not of its type."""
    if cls is None:
        return CodecError(f"table[{i}]", f"a record of no class the fields reach ({node[1]!r})")
    for (name, hint, _), k in zip(fields_of(cls), node[2:]):
        if not _checker(hint)(out[k]):
            return CodecError(f"table[{i}].{name}", f"must be {says(hint)}")
    return CodecError(f"table[{i}]", f"must be {says(cls)}")


@functools.cache
def _maker(cls: type) -> Callable[..., Any]:
    """``make(*field_values)``: a ``cls`` record, or None when a value is not of its field's type (as
    :func:`_checker` tests, written out as one expression: record nodes are the most frequent of a
    table). A plain frozen dataclass (no ``__post_init__``, no slots) gets its fields set directly,
    as its ``__init__`` would, at a third of the cost of its ``object.__setattr__`` per field."""
    ns: dict[str, Any] = {"new": object.__new__, "cls": cls}

    def expr(hint: Any, x: str) -> str:
        p = _plan(hint)
        name = f"c{len(ns)}"
        if p.kind == "scalar" and p.arg is not float or p.kind == "record":
            ns[name] = p.arg
            return f"type({x}) is {name}"
        if p.kind == "union" and all(k.kind in ("scalar", "record") for k in p.kids):
            ns[name] = frozenset(k.arg for k in p.kids) | ({int} if float in {k.arg for k in p.kids} else set())
            return f"type({x}) in {name}"
        if p.kind == "union" and len(p.kids) == 2 and _NONE in {k.arg for k in p.kids}:
            (other,) = (k for k in p.kids if k.arg is not _NONE)
            return f"({x} is None or {expr(other.hint, x)})"
        if p.kind == "seq" and p.kids[0].kind in ("scalar", "record"):
            ns[name] = frozenset({p.kids[0].arg} | ({int} if p.kids[0].arg is float else set()))
            ns[name + "t"] = tuple if p.tuple_out else list
            return f"(type({x}) is {name}t and set(map(type, {x})) <= {name})"
        ns[name] = _checker(hint)
        return f"{name}({x})"

    names = [f for f, _, _ in fields_of(cls)]
    args = [f"v{n}" for n in range(len(names))]
    test = " and ".join(expr(h, a) for a, (_, h, _) in zip(args, fields_of(cls))) or "True"
    direct = not (hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"))
    made = ("o = new(cls)\n    o.__dict__.update({" + ", ".join(f"{n!r}: {a}" for n, a in zip(names, args)) + "})"
            if direct else f"o = cls({', '.join(args)})")
    exec(f"def make({', '.join(args)}):\n    if not ({test}):\n        return None\n    {made}\n    return o\n",
         ns)  # noqa: S102 - the source is our own field types and names
    return ns["make"]


@functools.cache
def _checker(hint: Any) -> Callable[[Any], bool]:
    """A fast test that a value built by :func:`unpack` is of ``hint`` (records in it were checked
    when built, so a record is of its class)."""
    p = _plan(hint)
    kind = p.kind
    if kind == "scalar":
        t = p.arg
        return (lambda v: type(v) in (int, float)) if t is float else (lambda v: type(v) is t)
    if kind == "record":
        cls = p.arg
        return lambda v: type(v) is cls
    if kind == "union":
        tests = tuple(_checker(k.hint) for k in p.kids if k.kind != "scalar" or k.arg is not _NONE)
        if len(tests) == 1 and len(p.kids) == 2:
            (one,) = tests
            return lambda v: v is None or one(v)
        nullable = len(tests) < len(p.kids)
        return lambda v: (nullable and v is None) or any(t(v) for t in tests)
    if kind == "seq":
        container, item = (tuple if p.tuple_out else list), p.kids[0]
        if item.kind in ("record", "scalar") and item.arg is not float:
            cls = item.arg
            return lambda v: type(v) is container and all(type(x) is cls for x in v)
        test = _checker(item.hint)
        return lambda v: type(v) is container and all(map(test, v))
    if kind == "fixed":
        tests = tuple(_checker(k.hint) for k in p.kids)
        return lambda v: type(v) is tuple and len(v) == len(tests) and all(t(x) for t, x in zip(tests, v))
    if kind == "dict":
        test = _checker(p.kids[0].hint)
        return lambda v: type(v) is dict and all(type(k) is str and test(x) for k, x in v.items())
    if kind == "choice":
        return lambda v: type(v) in (str, int, _NONE) and v in p.arg
    if kind == "enum":
        return lambda v: isinstance(v, p.arg)
    if kind == "checked":
        inner = _checker(p.kids[0].hint)
        return lambda v: inner(v) and all(c.test(v) for c in p.arg)
    return lambda v: True


# ---- one walk over every string ------------------------------------------------------------------


def map_strings(value: Any, fn: Callable[[str], str], *, skip: frozenset[str] = frozenset(),
                keys: bool = False, _depth: int = 0) -> Any:
    """``value`` with ``fn`` applied to every string in it: in records (copied with the changed
    fields set; fields named in ``skip`` left as they are), tuples (named tuples too), lists and
    dicts (their keys too with ``keys``). Whatever did not change is the same object; other values
    are returned as they are, and so is anything nested deeper than 200."""
    if _depth > 200:
        return value
    t = type(value)
    if t is str:
        new = fn(value)
        return value if new == value else new
    again = functools.partial(map_strings, fn=fn, skip=skip, keys=keys, _depth=_depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if f.name not in skip:
                old = getattr(value, f.name)
                new = again(old)
                if new is not old:
                    changes[f.name] = new
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
        return t(*items) if hasattr(value, "_fields") else t(items)
    if isinstance(value, dict):
        out_d = {(again(k) if keys else k): again(v) for k, v in value.items()}
        same = len(out_d) == len(value) and all(k in value and out_d[k] is value[k] for k in out_d)
        return value if same else out_d
    return value
