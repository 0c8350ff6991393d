"""Renderers of a sweep document: a Rich table, JSON, Markdown, CSV and HTML. Pure: no JAX.

The table has one row per configuration in grid order: the swept values, peak memory per device
and whether it fits, collective bytes per step by mesh axes, XLA's per-device FLOPs, the roofline
step time, compile time, and the failure of a configuration that did not stage. ``★`` marks the
best configuration that fits by ``--rank-by``.
"""

from __future__ import annotations

import csv
import dataclasses
import enum
import io
import json
from typing import Any

from stagetool.core.units import format_bytes, format_count, format_seconds
from stagetool.sweep.rows import DOES_NOT_FIT, OK, best_label, counts
from stagetool.sweep.rows import ERROR as ERROR_STATUS


class SweepFormat(str, enum.Enum):
    """Output formats of ``stagetool sweep``."""

    text = "text"
    """A Rich table on a terminal; plain text when piped or NO_COLOR."""
    json = "json"
    """The sweep document (``kind: sweep``), the input of ``stagetool sweep merge``."""
    markdown = "markdown"
    """A GitHub-flavoured Markdown table."""
    csv = "csv"
    """One line per configuration, raw numbers (bytes, seconds, FLOPs), for a spreadsheet."""
    html = "html"
    """One self-contained page (no script, no network): the table with bars for peak memory,
    collective bytes and step time, the best configuration marked."""


def _value_columns(doc: dict) -> list[str]:
    return [name for name, _ in doc.get("axes", [])]


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _fits(row: dict) -> str:
    if row["status"] == DOES_NOT_FIT:
        return "no"
    if row["status"] != OK:
        return "—"
    return {True: "yes", False: "no", None: "?"}[row["fits"]]


def _peak(row: dict) -> str:
    peak = row.get("peak_bytes_per_device")
    if peak is None:
        return "—" if row["status"] != OK else "n/a"
    cap = row.get("capacity_bytes_per_device")
    host = row.get("host_peak_bytes_per_device")
    return (format_bytes(peak) + (f" ({100 * peak / cap:.0f}%)" if cap else "")
            + (f" + host {format_bytes(host)}" if host else ""))


def _collectives(row: dict) -> str:
    by_axes = row.get("collective_bytes_per_step_by_mesh_axes")
    if by_axes is None:
        return "—"
    if not by_axes:
        return "none"
    text = " · ".join(f"{axes} {format_bytes(b)}" for axes, b in by_axes.items())
    dcn = row.get("dcn_bytes_per_step")
    return (text + (" +?" if row.get("collectives_unknown_runs") else "")
            + (f" (over DCN {format_bytes(dcn)})" if dcn is not None else ""))


def _failure(row: dict) -> str:
    err = row.get("error")
    if err is None:
        return ""
    return f"{err.get('stage')}: {first_line(err.get('message') or '')}"


def first_line(message: str) -> str:
    """The line of an error message that says what went wrong: its first, or, where that only heads
    a list of problems (``invalid spec:``, one problem per following line), the head with the first
    problem, and ``(+N more lines)`` when others follow."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].endswith(":") and len(lines) > 1:
        more = len(lines) - 2
        return f"{lines[0]} {lines[1]}" + (f" (+{more} more line{'s' if more != 1 else ''})" if more else "")
    return lines[0]


def table_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    """Header and cells shared by the text and Markdown tables."""
    chip = doc.get("options", {}).get("chip")
    values = _value_columns(doc)
    head = ["", *values, "peak / device", "fits", "collectives / step by mesh axes", "FLOPs / device (loop-aware)",
            f"step (roofline, {chip})" if chip else "step (roofline)", "step time (estimate)", "compile", "failure"]
    cells = []
    for r in doc["rows"]:
        aware = r.get("flops_per_device_loop_aware")
        if aware is not None:
            flops = format_count(aware) + (" (est.)" if r.get("while_loops") else "")
        elif r.get("flops_per_device_xla") is not None:
            flops = format_count(r["flops_per_device_xla"]) + (" (loops once)" if r.get("while_loops") else "")
        else:
            flops = "—"
        t = (r.get("timings") or {}).get("compile_s")
        cells.append(["★" if r["id"] == doc.get("best") else "",
                      *(_value(r["values"].get(v, "")) for v in values), _peak(r), _fits(r), _collectives(r), flops,
                      _step(r, chip), _step_time(r, chip),
                      format_seconds(t) if t is not None else "—", _failure(r)])
    return head, cells


def _step(row: dict, chip: str | None) -> str:
    """The roofline step cell: the row's chip beside it when the rows have their own (a sweep over
    targets without ``--chip``: each on its own target's chip)."""
    t = row.get("roofline_step_seconds")
    if t is None:
        return "—"
    own = row.get("chip")
    return format_seconds(t) + (f" ({own})" if own and not chip else "")


def _step_time(row: dict, chip: str | None) -> str:
    """The step-time estimate cell: the schedule's figure, what bounds it, tokens/s per chip where the
    spec names its tokens per step, the row's chip where rows have their own."""
    st = row.get("step_time")
    if not st:
        return "—"
    least = "≥ " if st.get("lower_bound") else ""  # at least: work no model covers
    text = f"{least}{format_seconds(st['schedule_seconds'])} ({st.get('bound') or '?'}"
    if st.get("tokens_per_second_per_chip") is not None:
        text += f", {format_count(st['tokens_per_second_per_chip'])} tok/s/chip"
    return text + (f", {st['chip']})" if not chip else ")")


def _footer(doc: dict) -> list[str]:
    lines = []
    n, total = len(doc["rows"]), doc.get("grid_size")
    c = counts(doc["rows"])
    scope = f"{n} configuration{'s' if n != 1 else ''}" + (f" of {total}" if total != n else "")
    if doc.get("shard"):
        scope += f" (shard {doc['shard']})"
    fit = c["fit"] + c["unknown fit"]
    parts = [f"{fit} stage{'s' if fit == 1 else ''} and fit{'s' if fit == 1 else ''}"
             + (f" ({c['unknown fit']} with no capacity to compare with)" if c["unknown fit"] else "")]
    if c["do not fit"]:
        parts.append(f"{c['do not fit']} do{'es' if c['do not fit'] == 1 else ''} not fit")
    if c["failed"]:
        parts.append(f"{c['failed']} failed")
    lines.append(f"{scope}; " + ", ".join(parts))
    if doc.get("best"):
        lines.append(f"★ best by {doc.get('ranked_by')}: {best_label(doc)}")
    if doc.get("ranking_note"):
        lines.append(f"note: {doc['ranking_note']}")
    if any(r.get("while_loops") for r in doc["rows"]):
        lines.append("FLOPs (est.) are the loop-aware estimate: XLA's per-device figure counts a while body (a scan) "
                     "once, the estimate adds (trip count - 1) x each body; the roofline uses it")
    return lines


def render_text(doc: dict, *, color: bool = False, width: int = 160) -> str:
    from rich import box
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    head, cells = table_rows(doc)
    title = f"sweep {doc.get('function')}  {doc.get('target')}"
    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    for i, h in enumerate(head):
        numeric = h.startswith(("peak", "FLOPs", "step", "compile"))
        table.add_column(h, justify="right" if numeric else "left", no_wrap=h not in ("failure",),
                         overflow="fold")
    for row, r in zip(cells, doc["rows"]):
        style = "bold green" if r["id"] == doc.get("best") else ("dim" if r["status"] != OK else None)
        table.add_row(*(Text(c) for c in row), style=style)  # Text: "model[minor 2 of 8]" is not markup
    def make(w: int) -> Console:
        return Console(file=io.StringIO(), force_jupyter=False, force_terminal=color, no_color=not color,
                       color_system="truecolor" if color else None, width=w, highlight=False)

    # as the report's tables: never squeezed below what the cells need (a narrow terminal wraps lines)
    probe = make(400)
    needed = Measurement.get(probe, probe.options, table).maximum
    console = make(max(width, min(needed, 400)))
    console.print(table)
    for line in _footer(doc):
        console.print(Text(line))
    text = console.file.getvalue()
    if not color:
        text = "\n".join(line.rstrip() for line in text.split("\n"))
    return text


def render_markdown(doc: dict, **_: Any) -> str:
    head, cells = table_rows(doc)

    from stagetool.core.text import markdown_safe

    def esc(s: str) -> str:
        return markdown_safe(s)

    out = [f"### sweep {esc(str(doc.get('function')))} ({esc(str(doc.get('target')))})", "",
           "| " + " | ".join(esc(h) for h in head) + " |",
           "|" + "|".join(":---" if not h.startswith(("peak", "FLOPs", "step", "compile")) else "---:"
                          for h in head) + "|"]
    out += ["| " + " | ".join(esc(c) for c in row) + " |" for row in cells]
    out.append("")
    out += [esc(line) + "  " for line in _footer(doc)]
    return "\n".join(out).rstrip() + "\n"


CSV_COLUMNS = ("index", "id", "best", "status", "peak_bytes_per_device", "host_peak_bytes_per_device",
               "capacity_bytes_per_device", "fits",
               "collective_bytes_per_step", "dcn_bytes_per_step", "flops_per_device_xla", "flops_per_device_loop_aware",
               "while_loops", "chip", "roofline_step_seconds",
               "roofline_bound", "step_time_seconds", "step_time_lower_bound", "step_time_bound", "compile_s", "error")
"""The CSV's columns after the spec's values: the row's fields; ``step_time_seconds`` is the step-time
estimate's schedule figure (seconds), ``step_time_lower_bound`` true where it is only a floor (at least)."""


def render_csv(doc: dict, **_: Any) -> str:
    values = _value_columns(doc)
    axes_keys = sorted({k for r in doc["rows"] for k in (r.get("collective_bytes_per_step_by_mesh_axes") or {})})
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*values, *CSV_COLUMNS, *(f"collective_bytes_per_step[{k}]" for k in axes_keys)])
    for r in doc["rows"]:
        by_axes = r.get("collective_bytes_per_step_by_mesh_axes") or {}
        st = r.get("step_time") or {}
        fields = {**r, "best": r["id"] == doc.get("best"), "compile_s": (r.get("timings") or {}).get("compile_s"),
                  "error": _failure(r), "step_time_seconds": st.get("schedule_seconds"),
                  "step_time_lower_bound": bool(st.get("lower_bound")) if st else None,
                  "step_time_bound": st.get("bound")}
        w.writerow([_value(r["values"].get(v, "")) for v in values]
                   + ["" if fields.get(c) is None else _value(fields[c]) for c in CSV_COLUMNS]
                   + ["" if by_axes.get(k) is None else by_axes[k] for k in axes_keys])
    return buf.getvalue()


def render_json(doc: dict, **_: Any) -> str:
    return json.dumps(doc, indent=2) + "\n"


def html_rows(doc: dict) -> list[dict]:
    """Per configuration, the cells of the HTML table and its three bars (peak per device against
    the capacity, collective bytes per step, roofline step time), each bar on its column's scale."""
    from stagetool.report.charts import cell_bars

    rows = doc["rows"]
    peaks = [r.get("peak_bytes_per_device") if r["status"] != ERROR_STATUS else None for r in rows]
    caps = [r.get("capacity_bytes_per_device") for r in rows]
    top = max((p for p in peaks if p is not None), default=0)
    # a capacity far above every peak would flatten the bars: then it is named in the text only
    drawn_caps = caps if top and all(c is None or c <= 4 * top for c in caps) else None
    peak_bars = cell_bars(peaks, cls="peak", marks=drawn_caps)
    coll_bars = cell_bars([r.get("collective_bytes_per_step") for r in rows], cls="collectives")
    step_bars = cell_bars([r.get("roofline_step_seconds") for r in rows], cls="step")
    head, cells = table_rows(doc)
    out = []
    for r, c, pb, cb, sb in zip(rows, cells, peak_bars, coll_bars, step_bars):
        if pb is not None and r.get("fits") is False:
            pb = dataclasses.replace(pb, cls="over")
        coll = r.get("collective_bytes_per_step")
        out.append({"row": r, "cells": c, "best": r["id"] == doc.get("best"), "failed": r["status"] == ERROR_STATUS,
                    "peak_bar": pb, "coll_bar": cb, "step_bar": sb,
                    "coll_total": format_bytes(coll) if coll is not None else "—"})
    return out


def render_html(doc: dict, **_: Any) -> str:
    """The sweep as one self-contained HTML page (the report's stylesheet; no script, no network)."""
    from stagetool.report.render_html import environment

    head, _ = table_rows(doc)
    values = _value_columns(doc)
    return environment().get_template("sweep.html.j2").render(
        doc=doc, values=values, head=head, rows=html_rows(doc), footer=_footer(doc), best_label=best_label(doc),
        chip=doc.get("options", {}).get("chip"))


def render(doc: dict, fmt: SweepFormat, *, color: bool = False, width: int = 160) -> str:
    """The sweep document in ``fmt``. Text, Markdown and CSV show every string of the document with
    control characters escaped (names, values and messages come from the spec and the user's code);
    Markdown also escapes HTML and Markdown syntax, HTML is escaped by its templates; JSON keeps the
    strings as they are."""
    fmt = SweepFormat(fmt)
    if fmt != SweepFormat.json:
        from stagetool.core.text import sanitized

        doc = sanitized(doc)
    if fmt == SweepFormat.text:
        return render_text(doc, color=color, width=width)
    return {SweepFormat.json: render_json, SweepFormat.markdown: render_markdown,
            SweepFormat.csv: render_csv, SweepFormat.html: render_html}[fmt](doc)
