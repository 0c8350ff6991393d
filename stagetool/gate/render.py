"""Renderers of a :class:`stagetool.gate.compare.Comparison` (``check`` / ``diff``): text, JSON, Markdown,
and JUnit XML. Pure: no JAX, no printing; each returns text.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable

from stagetool.core.units import format_change
from stagetool.gate.compare import BOUND_HEADING, PROFILE_HEADING, Cause, Change, Comparison
from stagetool.report import Format

_STATUS_WORD = {"ok": "ok", "regression": "REGRESSION", "failed": "FAILED", "new": "new (not in the baseline)",
                "removed": "removed (in the baseline, no longer staged)"}


def _pct(c: Change) -> str:
    return format_change(c.change, c.before_value, c.after_value)


def _n(count: int, noun: str, plural: str | None = None) -> str:
    """``1 function``, ``2 functions`` (``plural`` when it is not ``noun + "s"``)."""
    return f"{count} {noun if count == 1 else (plural or noun + 's')}"


def summary_line(cmp: Comparison) -> str:
    """One line of counts, functions first, then changes that do not fail.

    ``3 functions: 1 with regressions (3 failing changes), 1 failed to stage, 1 ok; 2 improvements``.
    Every function is counted once, by its status: with regressions, removed (in the baseline, no
    longer staged: fails), failed to stage, ok, new (not in the baseline: does not fail).
    """
    by_status: dict[str, list] = {}
    for f in cmp.functions:
        by_status.setdefault(f.status, []).append(f)
    parts = []
    for status in ("regression", "removed", "failed", "ok", "new"):
        fs = by_status.get(status, [])
        if not fs:
            continue
        if status == "regression":
            failing = sum(1 for f in fs for c in f.changes if c.status == "regression")
            parts.append(f"{len(fs)} with regressions ({_n(failing, 'failing change')})")
        elif status == "removed":
            parts.append(f"{len(fs)} removed (in the baseline, no longer staged)")
        elif status == "failed":
            parts.append(f"{len(fs)} failed to stage")
        elif status == "new":
            parts.append(f"{len(fs)} new (not in the baseline)")
        else:
            parts.append(f"{len(fs)} ok")
    text = f"{_n(len(cmp.functions), 'function')}: " + (", ".join(parts) if parts else "nothing to compare")
    improvements = sum(1 for f in cmp.functions for c in f.changes if c.status == "improvement")
    within = sum(1 for f in cmp.functions for c in f.changes if c.status == "changed")
    backend = sum(len(f.backend) for f in cmp.functions)
    extra = ([_n(improvements, "improvement")] if improvements else []) + \
        ([f"{_n(within, 'change')} shown, not failing"] if within else []) + \
        ([f"{_n(backend, 'difference')} of the backend (XLA:CPU against an accelerator), not failing"]
         if backend else [])
    return text + ("; " + ", ".join(extra) if extra else "")


def _has_changes(cmp: Comparison) -> bool:
    """Whether there is anything to lead with ``N causes → M failing changes``."""
    return any(f.changes for f in cmp.functions)


BACKEND_HEADING = "backend"
"""The heading word of the changes filed under the backend (a CPU against an accelerator snapshot)."""


def _groups(cmp: Comparison) -> list[tuple[str | None, Cause | None, list[tuple[Change, bool]]]]:
    """The changes by cause, causes first (in function order), then each function's unexplained
    changes: ``(heading, cause or None, [(change, linked)])``. A function with no causes and no
    unexplained changes (a comparison made without them) has its changes in an unexplained group."""
    out: list[tuple[str | None, Cause | None, list[tuple[Change, bool]]]] = []
    n = 0
    for f in cmp.functions:
        for c in f.causes:
            n += 1
            out.append((f"cause {n} · {f.name}: {c.what}", c, list(zip(c.consequences, c.linked))))
    for f in cmp.functions:
        if f.status == "removed":  # its one change is listed with the functions that failed or are new
            continue
        rest = list(f.unexplained) if (f.causes or f.unexplained) else [
            c for c in f.changes if c.status != "backend" and c.apart is None]
        if rest:
            # with two or more edits, a whole-program figure (memory, FLOPs) is linked to none of them
            # though they made it: "no recorded edit" would be untrue
            head = (None if not cmp.causes else
                    f"unexplained · {f.name}: not linked to one of its {len(f.causes)} edits above (no record "
                    "ties these to a single edit; whole-program figures move with any of them)"
                    if len(f.causes) >= 2 else f"unexplained · {f.name}: no recorded edit leads to these")
            out.append((head, None, [(c, True) for c in rest]))
    for f in cmp.functions:
        for heading, why in APART_HEADINGS.items():
            mine = [c for c in f.apart if c.apart == heading]
            if mine:
                out.append((f"{heading} · {f.name}: {why}", None, [(c, True) for c in mine]))
    for f in cmp.functions:
        if f.backend:
            out.append((f"{BACKEND_HEADING} · {f.name}: what only XLA:CPU does, not an improvement or a regression",
                        None, [(c, True) for c in f.backend]))
    return out


APART_HEADINGS = {
    PROFILE_HEADING: "the chip figures the step time was computed with differ between the two snapshots (a spec's "
                     "chips: entry, a calibrated profile); their change is not the code's",
    BOUND_HEADING: "at least: work no model covers on either side, so these are not full figures "
                   "(docs/ci-gate.md#lower-bounds)",
}
"""The headings of changes listed apart from the edits (:attr:`stagetool.gate.compare.Change.apart`), with
what each says."""


def render_text(cmp: Comparison, *, color: bool = False, width: int = 120) -> str:
    """The causes first (``N causes → M failing changes``), each with its edits and a Rich table of
    its consequences (what, before, after, change, status); changes no edit leads to apart; then the
    functions that failed, are new or were removed, and a summary."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(file=io.StringIO(), force_jupyter=False, force_terminal=color, no_color=not color,
                      color_system="truecolor" if color else None, width=width, highlight=False, soft_wrap=False)
    console.print(Text(f"{cmp.title}: {cmp.before} → {cmp.after}", style="bold"))
    for n in cmp.notices:
        console.print(Text(f"notice: {n}", style="yellow"))
    styles = {"regression": "bold red", "improvement": "green", "changed": "", "failed": "bold red", "backend": "cyan"}
    bad = bool(cmp.regressions or cmp.failed)
    if _has_changes(cmp):
        console.print(Text(cmp.headline(), style="bold red" if bad else "bold"))

    def table(with_function: bool) -> Table:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        cols = ((("function", "left"),) if with_function else ()) + (
            ("what", "left"), ("before", "right"), ("after", "right"), ("change", "right"), ("status", "left"))
        for col, just in cols:
            t.add_column(col, justify=just, overflow="fold")
        return t

    rows = 0
    for head, cause, changes in _groups(cmp):
        if head:
            console.print(Text(head, style="bold"))
        if cause is not None:
            for e in cause.edits:
                console.print(Text(f"    {e}"))
        t = table(with_function=head is None)
        for c, linked in changes:
            status = c.status + (f" ({c.note})" if c.note else "") + ("" if linked else " [no other edit found]")
            cells = ([Text(c.function)] if head is None else []) + [Text(c.what), Text(c.before), Text(c.after),
                                                                     _pct(c), Text(status, style=styles[c.status])]
            t.add_row(*cells)
            rows += 1
        if changes:  # an edit with no consequence of its own (they are listed elsewhere): no empty table
            console.print(t)
    t = table(with_function=True)
    extra = 0
    for f in cmp.functions:
        if f.status == "failed":
            t.add_row(Text(f.name), "staging", "", "", "", Text(f"FAILED: {f.error}", style="bold red"))
            extra += 1
        elif f.status == "new":  # a removed function's row is its change (a regression)
            t.add_row(Text(f.name), "function", "—", "present", "", _STATUS_WORD[f.status])
            extra += 1
        elif f.status == "removed":
            for c in f.changes:
                t.add_row(Text(c.function), Text(c.what), Text(c.before), Text(c.after), _pct(c),
                          Text(c.status + (f" ({c.note})" if c.note else ""), style=styles[c.status]))
                extra += 1
    if extra:
        console.print(t)
    if not rows and not extra:
        console.print("no changes")
    console.print(Text(summary_line(cmp), style="bold red" if bad else "bold green"))
    return console.file.getvalue()


def _md_escape(text: str) -> str:
    """Plain text from names and messages for the Markdown comment: shown as written, never read as
    HTML, a link, an image or a mention (:func:`stagetool.core.text.markdown_text`)."""
    from stagetool.core.text import markdown_text

    return markdown_text(text)


def _code(text: str) -> str:
    """``text`` as a code span (:func:`stagetool.core.text.markdown_code`)."""
    from stagetool.core.text import markdown_code

    return markdown_code(text)


def render_markdown(cmp: Comparison, *, color: bool = False, width: int = 120) -> str:
    """GitHub-flavoured Markdown: a heading that begins with ``N causes → M failing changes`` when the
    comparison found edits, the verdict, notices, then one section per cause (its edits, and the table
    of its consequences), the unexplained changes apart, and the functions that failed, are new or were
    removed."""
    del color, width
    bad = bool(cmp.regressions or cmp.failed)
    icon = "❌" if bad else "✅"
    lead = f"{cmp.headline()} · " if _has_changes(cmp) else ""
    out = [f"### {icon} {_md_escape(lead + cmp.title + ': ' + summary_line(cmp))}", "",
           f"{_code(cmp.before)} → {_code(cmp.after)}", ""]
    out += [f"> **Notice:** {_md_escape(n)}" for n in cmp.notices] + ([""] if cmp.notices else [])

    def rows_of(changes: list[tuple[Change, bool]], with_function: bool) -> list[str]:
        head = ("| function " if with_function else "| ") + "| what | before | after | change | status |"
        sep = ("|:---" if with_function else "") + "|:---|---:|---:|---:|:---|"
        lines = [head.replace("| |", "|", 1) if not with_function else head, sep]
        for c, linked in changes:
            status = ("**regression**" if c.status == "regression" else _md_escape(c.status)) + (
                f" ({_md_escape(c.note)})" if c.note else "")
            if not linked:
                status += " _(no other edit found)_"
            cells = ([_code(c.function)] if with_function else []) + [
                _code(c.what), _code(c.before), _code(c.after), _md_escape(_pct(c)), status]
            lines.append("| " + " | ".join(cells) + " |")
        return lines

    any_rows = False
    for head, cause, changes in _groups(cmp):
        if head:
            out += [f"#### {_md_escape(head)}", ""]
        if cause is not None and cause.edits:
            out += [f"- {_code(e)}" for e in cause.edits] + [""]
        out += rows_of(changes, with_function=head is None) + [""]
        any_rows = True
    rows = []
    for f in cmp.functions:
        if f.status == "failed":
            rows.append([_code(f.name), "`staging`", "", "", "", f"**FAILED**: {_md_escape(f.error or '')}"])
        elif f.status == "new":  # a removed function's row is its change (a regression)
            rows.append([_code(f.name), "`function`", "`—`", "`present`", "", _md_escape(_STATUS_WORD[f.status])])
        elif f.status == "removed":
            for c in f.changes:
                status = ("**regression**" if c.status == "regression" else _md_escape(c.status)) + (
                    f" ({_md_escape(c.note)})" if c.note else "")
                rows.append([_code(c.function), _code(c.what), _code(c.before), _code(c.after), _md_escape(_pct(c)),
                             status])
    if rows:
        out += ["| function | what | before | after | change | status |", "|:---|:---|---:|---:|---:|:---|"]
        out += ["| " + " | ".join(r) + " |" for r in rows]
    elif not any_rows:
        out.append("No changes.")
    return "\n".join(out).rstrip() + "\n"


#: ``schema_version`` of the comparison JSON (``check`` / ``diff --format json``).
COMPARISON_SCHEMA_VERSION = 1


def render_json(cmp: Comparison, *, color: bool = False, width: int = 120) -> str:
    """The comparison as JSON: ``schema_version`` and ``kind: "comparison"`` first (like the report's
    JSON), then the :class:`stagetool.gate.compare.Comparison` fields (``title``, ``before``, ``after``,
    ``functions``: ``[{name, status, changes: [Change fields], error, causes, unexplained, backend, apart}]``:
    ``backend`` the changes filed under the backend, ``apart`` those listed under ``chip profile changed`` or
    ``lower bound`` (each change's ``apart``), ``notices``), then
    ``regressions`` (the number of failing changes) and ``failed`` (the number of functions that
    failed to stage)."""
    del color, width
    from stagetool.report.model import to_jsonable

    body = {"schema_version": COMPARISON_SCHEMA_VERSION, "kind": "comparison", **to_jsonable(cmp),
            "regressions": len(cmp.regressions), "failed": len(cmp.failed)}
    return json.dumps(body, indent=2, ensure_ascii=False) + "\n"


def render_html(cmp: Comparison, *, color: bool = False, width: int = 120, before: dict | None = None,
                after: dict | None = None) -> str:
    """One HTML page: the verdict, each function's changes, and, from the two snapshots when given,
    the device grids of every leaf whose sharding changed and the memory bars when the peak
    changed, before and after side by side."""
    del color, width
    from stagetool.report.render_html import render_comparison

    return render_comparison(cmp, before=before, after=after, summary=summary_line(cmp))


RENDERERS: dict[Format, Callable[..., str]] = {
    Format.text: render_text,
    Format.json: render_json,
    Format.markdown: render_markdown,
    Format.html: render_html,
}


def render(cmp: Comparison, fmt: Format, *, color: bool = False, width: int = 120,
           snapshots: tuple[dict, dict] | None = None) -> str:
    """Render a comparison in any :class:`stagetool.report.Format`; ``snapshots`` (before, after) let
    the HTML page draw what changed."""
    fmt = Format(fmt)
    if fmt is Format.html and snapshots is not None:
        return render_html(cmp, color=color, width=width, before=snapshots[0], after=snapshots[1])
    return RENDERERS[fmt](cmp, color=color, width=width)


def junit_xml(cmp: Comparison, *, suite: str = "stagetool") -> str:
    """JUnit XML: one ``<testcase>`` per function; ``<failure>`` (message ``N causes → M failing
    changes``) lists its regressions under the edits that caused them, then the unexplained ones; ``<error>``
    a function that failed to compile; a function in the baseline but no longer staged is a
    ``<failure>`` too; a new one is ``<skipped>``."""
    import xml.etree.ElementTree as ET

    root = ET.Element("testsuites", name=suite)
    failures = sum(1 for f in cmp.functions if f.status in ("regression", "removed"))
    errors = len(cmp.failed)
    skipped = sum(1 for f in cmp.functions if f.status == "new")
    ts = ET.SubElement(root, "testsuite", name=cmp.title, tests=str(len(cmp.functions)), failures=str(failures),
                       errors=str(errors), skipped=str(skipped))
    if _has_changes(cmp):  # what a CI page shows first: the causes, then what they broke
        props = ET.SubElement(ts, "properties")
        ET.SubElement(props, "property", name="summary", value=cmp.headline())
    for f in cmp.functions:
        tc = ET.SubElement(ts, "testcase", classname=suite, name=f.name)
        if f.status == "failed":
            ET.SubElement(tc, "error", message=f"{f.name} failed to stage (trace, lower or compile)").text = f.error or ""
        elif f.status == "removed":
            el = ET.SubElement(tc, "failure", message=_STATUS_WORD[f.status])
            el.text = "\n".join(_change_line(c) for c in f.changes)
        elif f.status == "regression":
            regs = [c for c in f.changes if c.status == "regression"]
            n = len(f.causes)
            el = ET.SubElement(tc, "failure", message=f"{n} {'cause' if n == 1 else 'causes'} → "
                                                      f"{_n(len(regs), 'failing change')}")
            lines = []
            for cause in f.causes:
                lines.append(f"cause: {cause.what}")
                lines += [f"  edit: {e}" for e in cause.edits]
                lines += [f"  - {_change_line(c)}" for c in cause.consequences if c.status == "regression"]
            unexplained = [c for c in (f.unexplained if f.causes or f.unexplained else f.changes)
                           if c.status == "regression" and c.apart is None]
            if unexplained:
                lines.append(f"unexplained (not linked to one of the {len(f.causes)} edits):" if len(f.causes) >= 2
                             else "unexplained (no recorded edit leads to these):")
                lines += [f"  - {_change_line(c)}" for c in unexplained]
            for heading in APART_HEADINGS:
                apart = [c for c in f.apart if c.apart == heading and c.status == "regression"]
                if apart:
                    lines.append(f"{heading}:")
                    lines += [f"  - {_change_line(c)}" for c in apart]
            el.text = "\n".join(lines)
        elif f.status == "new":
            ET.SubElement(tc, "skipped", message=_STATUS_WORD[f.status])
        others = [c for c in f.changes if c.status != "regression"]
        if others:
            ET.SubElement(tc, "system-out").text = "\n".join(_change_line(c) for c in others)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + _xml_legal(ET.tostring(root, encoding="unicode")) + "\n"


def _xml_legal(text: str) -> str:
    """``text`` with every character XML 1.0 does not allow (C0 controls but tab and newlines, lone
    surrogates, U+FFFE, U+FFFF) written as ``\\uXXXX``: a name or message from user code must not
    make the JUnit file unreadable to the CI that parses it."""
    import re

    return re.sub("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]",
                  lambda m: f"\\u{ord(m.group(0)):04x}", text)


def _change_line(c: Change) -> str:
    pct = _pct(c)
    return (f"{c.what}: {c.before} -> {c.after}" + (f" ({pct})" if pct else "") + f" [{c.status}"
            + (f", {c.note}" if c.note else "") + "]")

