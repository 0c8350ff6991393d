"""docs/json-schema.md against the report: every key the JSON can hold is on the page, and every key
on the page is one the JSON can hold.

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
