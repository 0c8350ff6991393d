"""docs/json-schema.md against the report: every key the JSON can hold is on the page, and every key
on the page is one the JSON can hold; and each key's type on the page is the one its records'
annotations write and the golden reports hold.

The keys the JSON can hold are read two ways: from the report's dataclasses (the fields
``report.model.to_jsonable`` writes, following each field's type hints down to the records it
holds), and from the JSON real reports wrote (the golden reports, ``tests/golden``). The page's keys
are the quoted names of its ``text`` blocks that stand where a key stands (``"chip": str``,
``{"name", "opcode"}``), not a quoted value (``"label": "estimate"``, ``"compute"|"memory"``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from pathlib import Path

from helpers import REPO

PAGE = REPO / "docs/json-schema.md"
#: Keys the document writes around the records (``document_to_json``).
ENVELOPE = {"schema_version", "kind"}


def page_keys(text: str) -> set[str]:
    """The keys the page's ``text`` blocks name: a quoted word not preceded by ``:``, ``|`` or ``(``
    (where a value or an alternative stands)."""
    keys = set()
    for block in re.findall(r"```text\n(.*?)```", text, re.S):
        for m in re.finditer(r'"(\w+)"', block):
            if not block[:m.start()].rstrip().endswith((":", "|", "(")):
                keys.add(m.group(1))
    return keys


#: The packages whose records a report holds (JAX-free: importing them all is cheap).
RECORD_PACKAGES = ("stagetool.core", "stagetool.hlo", "stagetool.analysis", "stagetool.report")


def _namespace() -> dict[str, type]:
    """Every class of the modules of :data:`RECORD_PACKAGES`: the names that type hints written
    under ``if TYPE_CHECKING:`` refer to."""
    import importlib
    import pkgutil

    ns: dict[str, type] = {}
    for package in RECORD_PACKAGES:
        names = [package, *(m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__,
                                                                   package + "."))]
        for name in names:
            module = importlib.import_module(name)
            for attr, value in vars(module).items():
                if isinstance(value, type) and value.__module__ == name:
                    ns.setdefault(attr, value)
    return ns


def record_keys(*roots: type) -> dict[str, set[str]]:
    """``{key: names of the records that have it}`` over every record the JSON of ``roots`` can
    hold: the fields ``to_jsonable`` writes (not ``json_skip``), a sharding being its text."""
    from stagetool.report.model import Sharding

    ns = _namespace()
    keys: dict[str, set[str]] = {}
    seen: set[type] = set()

    def visit(hint: typing.Any) -> None:
        if isinstance(hint, type) and issubclass(hint, Sharding):
            return  # written as JAX's PartitionSpec text
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            if hint in seen:
                return
            seen.add(hint)
            hints = typing.get_type_hints(hint, localns=ns, include_extras=True)
            for f in dataclasses.fields(hint):
                if not f.metadata.get("json_skip"):
                    keys.setdefault(f.name, set()).add(hint.__name__)
                    visit(hints[f.name])
            return
        args = typing.get_args(hint)
        if typing.get_origin(hint) is dict:
            args = args[1:]  # a dict's keys are data, not the schema's
        elif typing.get_origin(hint) is typing.Annotated:
            args = args[:1]
        for arg in args:
            if not isinstance(arg, (str, int, bool, types.NoneType)):
                visit(arg)

    for root in roots:
        visit(root)
    return keys


def json_keys(value: typing.Any, out: set[str] | None = None) -> set[str]:
    out = set() if out is None else out
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(k)
            json_keys(v, out)
    elif isinstance(value, list):
        for v in value:
            json_keys(v, out)
    return out


def golden_reports() -> list[Path]:
    return sorted((REPO / "tests/golden").glob("jax-*/*.report.json"))


def test_the_page_lists_every_key_the_report_can_hold_and_no_other():
    from stagetool.report.model import DevicesReport, Report

    records = record_keys(Report, DevicesReport)
    written: dict[str, set[str]] = {}
    for p in golden_reports():
        for k in json_keys(json.loads(p.read_text())):
            written.setdefault(k, set()).add(f"written in {p.parent.name}/{p.name}")
    on_page = page_keys(PAGE.read_text())
    missing = sorted((set(records) | set(written)) - on_page - ENVELOPE)
    extra = sorted(on_page - set(records) - set(written) - ENVELOPE)
    assert not missing, ("docs/json-schema.md does not list these keys of the JSON report; add each where "
                         "its record is described:\n" + "\n".join(
                             f"  {k} ({', '.join(sorted(records.get(k, set()) | written.get(k, set())))})"
                             for k in missing))
    assert not extra, f"docs/json-schema.md lists keys no report has (renamed or removed?): {extra}"


def test_the_walks_see_the_whole_report():
    """The three readings find what they must (a walk that found nothing could not fail): the
    dataclasses' keys reach the step time's and the peak's records, the golden reports exist, and
    the page's reading tells keys from values."""
    from stagetool.report.model import Report

    records = record_keys(Report)
    assert len(records) > 250, len(records)
    assert {"step_time_reason", "latency_seconds", "breakdown", "names_nothing", "lower_bound_seconds"} <= set(records)
    assert "error_traceback" not in records and "figures" not in records  # json_skip
    assert len(golden_reports()) >= 3
    keys = page_keys('x\n```text\n{"label": "estimate", "bound": "compute"|"memory", "top": [{"name", "opcode"}],'
                     ' "a": int (b: "c"|"d")}\n```\n"outside": 1\n')
    assert keys == {"label", "bound", "top", "name", "opcode", "a"}


# ---- each key's type: the page's against the dataclasses' annotations and the golden reports ------

#: The page's type words, as JSON kinds.
_WORDS = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "null": "null"}


def _value_kinds(block: str, i: int) -> tuple[set[str], bool]:
    """The JSON kinds of the type written at ``block[i:]`` (``int|null``, ``"a"|"b"``, ``[int]``,
    ``{...} | null``, ``Cost``), and whether one was written there (a bare ``(comment)`` or nothing is not)."""
    kinds: set[str] = set()
    while True:
        while i < len(block) and block[i] in " \n":
            i += 1
        rest = block[i:]
        if rest.startswith(("[", "{")):
            depth, j = 0, i
            for j in range(i, len(block)):  # to the matching bracket (quoted text holds none unbalanced)
                depth += block[j] in "[{"
                depth -= block[j] in "]}"
                if depth == 0:
                    break
            kinds.add("array" if rest[0] == "[" else "object")
            i = j + 1
        elif m := re.match(r'"[^"\n]*"', rest):
            kinds.add("string")
            i += m.end()
        elif m := re.match(r"(str|int|float|bool|null)\b", rest):
            kinds.add(_WORDS[m.group(1)])
            i += m.end()
        elif m := re.match(r"(Cost|Tensor|Totals|Frame|Origin)\b", rest):
            kinds.add("object")
            i += m.end()
        elif rest.startswith("..."):
            i += 3
        else:
            return kinds, bool(kinds)
        j = i
        while j < len(block) and block[j] in " \n":
            j += 1
        if not block.startswith("|", j):
            return kinds, bool(kinds)
        i = j + 1


def page_types(text: str) -> dict[str, set[str]]:
    """``{key: JSON kinds}`` the page's ``text`` blocks write for each key given a type (``"key": type``),
    over every place the key stands; keys written without a type (``{"name", "opcode"}``) are not in it."""
    out: dict[str, set[str]] = {}
    for block in re.findall(r"```text\n(.*?)```", text, re.S):
        for m in re.finditer(r'"(\w+)"(?: / "(\w+)")?:', block):  # "inputs" / "outputs": one type, two keys
            if block[:m.start()].rstrip().endswith((":", "|", "(")):
                continue
            kinds, typed = _value_kinds(block, m.end())
            for key in filter(None, m.groups()) if typed else ():
                out.setdefault(key, set()).update(kinds)
    return out


def _hint_kinds(hint: typing.Any) -> set[str]:
    """The JSON kinds ``to_jsonable`` writes for a value of type ``hint`` (``{"any"}`` where the hint does not say)."""
    import enum

    from stagetool.report.model import Sharding

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is types.NoneType or hint is None:
        return {"null"}
    if origin is typing.Annotated:
        return _hint_kinds(args[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_hint_kinds(a) for a in args))
    if origin is typing.Literal:
        return set().union(*(_hint_kinds(type(a)) for a in args))
    if origin is not None:
        hint = origin
    if not isinstance(hint, type):
        return {"any"}
    if issubclass(hint, Sharding) or issubclass(hint, str):
        return {"string"}
    if issubclass(hint, enum.Enum):
        return set().union(*(_hint_kinds(type(m.value)) for m in hint))
    if issubclass(hint, bool):
        return {"boolean"}
    if issubclass(hint, int):
        return {"integer"}
    if issubclass(hint, float):
        return {"number", "null"}  # a non-finite float is written null
    if issubclass(hint, (list, tuple, frozenset, set)) or hint.__name__ in ("Sequence",):
        return {"array"}
    if issubclass(hint, dict) or dataclasses.is_dataclass(hint):
        return {"object"}
    return {"any"}


def record_types(*roots: type) -> dict[str, set[str]]:
    """``{key: JSON kinds}`` of every key of the records the JSON of ``roots`` can hold (as
    :func:`record_keys` walks them), from each field's annotation, over every record that has it."""
    ns = _namespace()
    out: dict[str, set[str]] = {}
    for name in {n for names in record_keys(*roots).values() for n in names}:
        cls = ns[name]
        hints = typing.get_type_hints(cls, localns=ns, include_extras=True)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("json_skip"):
                kinds = _hint_kinds(hints[f.name])
                if f.metadata.get("json_omit_none"):
                    kinds.discard("null")  # absent rather than null
                out.setdefault(f.name, set()).update(kinds)
    return out


def type_drift(documented: dict[str, set[str]], annotated: dict[str, set[str]]) -> list[str]:
    """Keys whose documented JSON kinds are not their annotations' (a float written null only when not
    finite need not say ``|null``; an ``int`` is a number, so a page's ``float`` may stand for one)."""
    problems = []
    for key, kinds in sorted(documented.items()):
        have = annotated.get(key)
        if have is None or "any" in have:
            continue
        want = set(have)
        if "number" in want and "null" not in kinds:
            want.discard("null")
        if "number" in kinds and "integer" in want and "integer" not in kinds:
            want = (want - {"integer"}) | {"number"}
        if kinds != want:
            problems.append(f"{key}: the page says {'|'.join(sorted(kinds))}, the records hold {'|'.join(sorted(want))}")
    return problems


def test_each_keys_documented_type_is_its_records_and_the_golden_reports():
    """A key's type on the page (``"peak_bytes": int|null``) is the JSON kind its dataclass field's
    annotation writes (over every record with that key), and the kind of every value the golden
    reports hold for it: a field whose type changes fails here until the page says so."""
    from stagetool.report.model import DevicesReport, Report

    documented = page_types(PAGE.read_text())
    assert len(documented) > 250, len(documented)  # most keys say their type
    assert not type_drift(documented, record_types(Report, DevicesReport)), "\n".join(
        type_drift(documented, record_types(Report, DevicesReport)))

    def kind(v: typing.Any) -> str:
        return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
                type(None): "null"}[type(v)]

    def walk(value: typing.Any, where: str, out: list[str]) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                kinds = documented.get(k)
                seen = kind(v)
                if kinds is not None and seen not in kinds and not (seen == "integer" and "number" in kinds):
                    out.append(f"{where}: {k} = {v!r:.60} is {seen}; the page says {'|'.join(sorted(kinds))}")
                walk(v, where, out)
        elif isinstance(value, list):
            for v in value:
                walk(v, where, out)

    wrong: list[str] = []
    for p in golden_reports():
        walk(json.loads(p.read_text()), f"{p.parent.name}/{p.name}", wrong)
    assert not wrong, "\n".join(wrong[:20])


def test_a_changed_type_on_the_page_or_in_a_record_is_drift():
    """The type check can fail: the page's ``device_count`` said to be a string, and a record whose
    ``peak_bytes`` became a float."""
    from stagetool.report.model import DevicesReport, Report

    text = PAGE.read_text()
    assert '"device_count": int' in text
    documented = page_types(text.replace('"device_count": int', '"device_count": str'))
    annotated = record_types(Report, DevicesReport)
    assert "device_count: the page says string, the records hold integer" in type_drift(documented, annotated)
    documented = page_types(text)
    assert documented["peak_bytes"] == {"integer", "null"} and documented["verdict"] == {"object"}
    assert documented["kind"] >= {"string"} and documented["mesh_axes"] == {"array", "null"}
    assert type_drift(documented, {**annotated, "peak_bytes": {"string", "null"}}) == [
        "peak_bytes: the page says integer|null, the records hold null|string"]
    assert page_types('```text\n{"a": int|null (b: "c"), "b": "x"|"y", "c": [int]|null, "d": {"e": 1} | null, '
                      '"f" (no type), "g": Cost, "h" / "i": str}\n```') == {"a": {"integer", "null"}, "b": {"string"},
                                                            "c": {"array", "null"}, "d": {"object", "null"},
                                                            "g": {"object"}, "h": {"string"}, "i": {"string"}}
