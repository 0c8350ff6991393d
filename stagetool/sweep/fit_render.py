"""Renderers of ``stagetool fit``'s documents (the frontier and the what-if list): a Rich table,
JSON, Markdown and HTML. Pure: no JAX.

The frontier has one row per setting of the knobs, in grid order: the knobs' values, the largest
batch that fits, its peak per device against the capacity and the headroom (XLA's memory analysis
of that compile, on the target), the smallest batch refused, and the compiles the search made.
``★`` marks the best setting (the most examples per second where every setting has a step-time
estimate, else the largest batch; ties: the most headroom); its ``--set`` line closes the table.
"""

from __future__ import annotations

import enum
import io
import json
from typing import Any

from stagetool.core.units import format_bytes, format_count, format_seconds


class FitFormat(str, enum.Enum):
    """Output formats of ``stagetool fit``."""

    text = "text"
    """A Rich table on a terminal; plain text when piped or NO_COLOR."""
    json = "json"
    """The fit document (``kind: fit`` or ``kind: what-if``)."""
    markdown = "markdown"
    """A GitHub-flavoured Markdown table."""
    html = "html"
    """One self-contained page (no script, no network)."""


def _value(v: Any) -> str:
    from stagetool.sweep.render import _value as value

    return value(v)


def _bytes(v: int | None) -> str:
    return "—" if v is None else format_bytes(v)


def _share(peak: int | None, cap: int | None) -> str:
    if peak is None:
        return "—"
    return format_bytes(peak) + (f" of {format_bytes(cap)}" if cap else "")


def frontier_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the frontier: one row per setting of the knobs."""
    knobs = [name for name, _ in doc["axes"]]
    batch = doc["batch"]["name"]
    steps = any(st["step_time"] for st in doc["settings"])
    tokens = any(st["tokens_per_second"] for st in doc["settings"])
    head = ["", *knobs, f"largest {batch}", "peak / device", "headroom", f"refused {batch}",
            *(["step (est.)"] if steps else []), *(["tokens/s (est.)"] if tokens else []), "compiles", "status"]
    best = (doc.get("best") or {}).get("id")
    rows = []
    for st in doc["settings"]:
        status = st["status"] + (f": {st['reason']}" if st["reason"] else "")
        speed = []
        if steps:
            t = st["step_time"]
            least = "≥ " if t and t.get("lower_bound") else ""  # at least: work no model covers
            speed.append("—" if t is None else f"{least}{format_seconds(t['schedule_seconds'])} "
                                               f"({least}{format_seconds(t['overlapped_seconds'])}–"
                                               f"{format_seconds(t['serial_seconds'])}, {t['chip']})")
        if tokens:
            r = st["tokens_per_second"]
            speed.append("—" if r is None else ("≤ " if r.get("upper_bound") else "") + format_count(r["schedule"]))
        rows.append(["★" if st["id"] == best else "", *(_value(st["values"].get(k, "")) for k in knobs),
                     "—" if st["largest_batch"] is None else str(st["largest_batch"]),
                     _share(st["peak_bytes_per_device"], st["capacity_bytes_per_device"]), _bytes(st["headroom_bytes"]),
                     "—" if st["smallest_refused_batch"] is None else str(st["smallest_refused_batch"]),
                     *speed, str(st["compiles"]), status])
    return head, rows


def what_if_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the what-if list: every single change compiled, with its outcome."""
    head = ["change", "outcome", "peak / device", "headroom", "options"]
    rows = [[t["change"], t["outcome"] + (f": {t['reason']}" if t.get("reason") else ""),
             _share(t["peak_bytes_per_device"], t["capacity_bytes_per_device"]), _bytes(t["headroom_bytes"]),
             t["set_line"] + (f"; in the spec: {t['spec_line']}" if t.get("spec_line") else "")] for t in doc["tried"]]
    return head, rows


def footer(doc: dict) -> list[str]:
    """The lines under the table: the best setting, the compile count, the problems, what the figures are."""
    lines = []
    if doc["kind"] == "fit":
        b = doc["batch"]
        lines.append(f"{len(doc['settings'])} setting(s) searched over {b['name']} = {b['multiple']}, "
                     f"{2 * b['multiple']}, … {b['max']} (from {b['start']}): {doc['compiles']} compiles "
                     f"(cap {doc['max_compiles']}; a facts-cache hit counts as one); a brute-force sweep of "
                     f"that grid is {len(doc['settings']) * (b['max'] // b['multiple'])}")
        if doc["best"] is not None:
            lines.append(f"★ best by {doc['best']['by']}: {doc['best']['set_line']}")
        if any(st["status"] == "at the maximum" for st in doc["settings"]):
            lines.append(f"at the maximum: the largest {b['name']} allowed (--max-batch {b['max']}) fits; a larger "
                         "one may too")
    else:
        f = doc["from"]
        lines.append(f"as given ({f['set_line']}): {f['outcome']}"
                     + (f", peak {format_bytes(f['peak_bytes_per_device'])}" if f["peak_bytes_per_device"] else ""))
        if f["outcome"] == "does not fit":
            lines.append("fits with one change: " + ("; ".join(doc["fits"]) if doc["fits"] else "none of those tried"))
        lines.append(f"{doc['compiles']} compiles; every change listed was compiled."
                     + (" Not tried: " + "; ".join(doc["not_tried"]) if doc["not_tried"] else ""))
    if doc["kind"] == "fit" and any(st["step_time"] for st in doc["settings"]):
        lines.append("step (est.): the step-time estimate at the largest batch, the schedule's figure (overlapped–"
                     "serial range) on the chip named; tokens/s (est.) = batch × --tokens-per-example ÷ that figure")
        if any((st["step_time"] or {}).get("lower_bound") for st in doc["settings"]):
            lines.append("≥: a lower bound, work no model covers (the step takes at least it; tokens/s ≤: at most)")
    lines.append("peak: the gated peak of each compile (XLA's memory analysis on the target, per device); "
                 "capacity: --device-memory, the topology's HBM or the device (XLA's available HBM where it refused)")
    lines += [f"UNDECIDED: {p}" for p in doc["problems"]]
    return lines


def _rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    return frontier_rows(doc) if doc["kind"] == "fit" else what_if_rows(doc)


def _title(doc: dict) -> str:
    return f"{'fit' if doc['kind'] == 'fit' else 'what-if'} {doc.get('function')}  {doc.get('target')}"


def render_text(doc: dict, *, color: bool = False, width: int = 160) -> str:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    head, cells = _rows(doc)
    table = Table(box=box.SIMPLE_HEAD, title=_title(doc), title_justify="left", pad_edge=False)
    for h in head:
        table.add_column(h, justify="right" if h.startswith(("largest", "peak", "headroom", "refused", "compiles", "step", "tokens"))
                         else "left", overflow="fold")
    for row in cells:
        table.add_row(*(Text(c) for c in row), style="bold green" if row[0] == "★" else None)
    console = Console(file=io.StringIO(), force_jupyter=False, force_terminal=color, no_color=not color,
                      color_system="truecolor" if color else None, width=width, highlight=False)
    console.print(table)
    for line in footer(doc):
        console.print(Text(line))
    text = console.file.getvalue()
    return text if color else "\n".join(line.rstrip() for line in text.split("\n"))


def render_markdown(doc: dict, **_: Any) -> str:
    from stagetool.core.text import markdown_safe as esc

    head, cells = _rows(doc)
    out = [f"### {esc(_title(doc))}", "", "| " + " | ".join(esc(h) or " " for h in head) + " |",
           "|" + "|".join("---:" if h.startswith(("largest", "peak", "headroom", "refused", "compiles", "step", "tokens")) else ":---"
                          for h in head) + "|"]
    out += ["| " + " | ".join(esc(c) for c in row) + " |" for row in cells]
    out.append("")
    out += [esc(line) + "  " for line in footer(doc)]
    return "\n".join(out).rstrip() + "\n"


def render_html(doc: dict, **_: Any) -> str:
    from stagetool.report.render_html import environment

    head, cells = _rows(doc)
    return environment().get_template("fit.html.j2").render(doc=doc, title=_title(doc), head=head, rows=cells,
                                                             footer=footer(doc))


def render(doc: dict, fmt: FitFormat, *, color: bool = False, width: int = 160) -> str:
    """The fit or what-if document in ``fmt``; text and Markdown show every string with control
    characters escaped (values and messages come from the spec and the user's code), HTML is escaped
    by its template, JSON keeps the strings as they are."""
    fmt = FitFormat(fmt)
    if fmt == FitFormat.json:
        return json.dumps(doc, indent=2) + "\n"
    from stagetool.core.text import sanitized

    doc = sanitized(doc)
    if fmt == FitFormat.text:
        return render_text(doc, color=color, width=width)
    return {FitFormat.markdown: render_markdown, FitFormat.html: render_html}[fmt](doc)
