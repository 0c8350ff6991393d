"""The HTML renderer: one self-contained page with pictures (inline SVG and CSS; no script, no network).

Built from the same report model as the other renderers, through Jinja2 templates
(``stagetool/report/templates/``); the geometry of each picture comes from
:mod:`stagetool.report.charts`, the device → shard assignment from :mod:`stagetool.report.layout`.
Never imports JAX. The page is deterministic: element ids come from positions in the report.

:func:`figures` gives the same pictures as standalone SVG files, which the Markdown report links
(``report -o report.md`` writes them into ``report-files/``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Mapping, Sequence

from stagetool.analysis.figures import Figures, MemoryFigures
from stagetool.analysis.modules import ModulesSection
from stagetool.analysis.sections import CollectivesSection, CostSection, MemorySection
from stagetool.analysis.timeline import BufferGroup
from stagetool.report import charts, views
from stagetool.report.layout import LeafLayout, leaf_layout, parse_partition_spec
from stagetool.report.model import DevicesReport, FunctionReport, LeafReport, Report
from stagetool.core.units import (dims_str, format_bytes, format_change, format_percent, format_seconds, shape_str,
                                  short_path)


@functools.lru_cache(maxsize=1)
def environment() -> Any:
    """The Jinja2 environment over the package's templates (HTML-escaped, undefined names are errors)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("stagetool.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "svg", "j2"], default=True),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    env.filters.update(bytes=format_bytes, seconds=format_seconds, percent=format_percent, change=format_change,
                       num=_num,
                       first_upper=lambda t: t[:1].upper() + t[1:])
    return env


def _num(v: float) -> str:
    """A coordinate for SVG: at most two decimals, no trailing zeros."""
    text = f"{v:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "x"


# ---------------------------------------------------------------------------------------- view model


@dataclasses.dataclass(frozen=True)
class LayoutFigure:
    """The leaves that share one layout (same shape, declared and compiled sharding)."""

    id: str
    leaves: tuple[str, ...]
    shape: str
    declared: str
    compiled: str | None
    chosen: bool
    differs: bool
    per_device: str
    summary: str
    grid: charts.DeviceGrid | None
    array: charts.ArrayView | None
    declared_grid: charts.DeviceGrid | None


def _summary(layout: LeafLayout | None) -> str:
    if layout is None:
        return ""
    sharded = [f"d{i} over {' × '.join(axes)}" for i, axes in enumerate(layout.dims) if axes]
    text = ("; ".join(sharded) if sharded else "replicated") + f": {layout.shard_count} shard" \
        + ("s" if layout.shard_count != 1 else "")
    if layout.replicas > 1:
        text += f", each on {layout.replicas} devices"
        if layout.replicated_over:
            text += f" (copied along {' × '.join(layout.replicated_over)})"
    return text


def layout_figures(leaves: Sequence[LeafReport] | None, axes: Sequence[tuple[str, int]], prefix: str
                   ) -> tuple[list[LayoutFigure], list[str]]:
    """Figures for the used leaves, grouped by (shape, declared, compiled), and the unused leaves' paths.

    Sharded layouts come first (in leaf order), replicated ones after them: the pictures worth a look
    lead.
    """
    groups: dict[tuple, list[LeafReport]] = {}
    unused = []
    for x in leaves or ():
        if x.compiled is None:
            unused.append(x.path)
            continue
        groups.setdefault((tuple(x.shape), x.dtype, x.declared, str(x.compiled)), []).append(x)
    out = []
    replicated = {key: all(not d for d in (parse_partition_spec(key[3], len(key[0])) or ((),)))
                  for key in groups}
    ordered = sorted(groups, key=lambda key: replicated[key])  # stable: leaf order within each kind
    for k, key in enumerate(ordered):
        members = groups[key]
        x = members[0]
        layout = leaf_layout(x.shape, x.compiled, axes)
        declared_dims = parse_partition_spec(x.declared, len(x.shape))
        compiled_dims = parse_partition_spec(x.compiled, len(x.shape))
        differs = declared_dims is not None and compiled_dims is not None and declared_dims != compiled_dims
        declared_grid = None
        if differs:
            dl = leaf_layout(x.shape, x.declared, axes)
            declared_grid = charts.device_grid(dl, name=x.path) if dl is not None else None
        out.append(LayoutFigure(
            f"{prefix}-{k}", tuple(m.path for m in members), shape_str(x.dtype, x.shape), str(x.declared),
            str(x.compiled), x.chosen_by_partitioner and str(x.declared) in ("auto", "unspecified"), differs,
            format_bytes(x.bytes_per_device) + (f" ({dims_str(x.shard_shape)})" if x.shard_shape is not None else ""),
            _summary(layout), charts.device_grid(layout, name=x.path) if layout is not None else None,
            charts.array_view(layout) if layout is not None else None, declared_grid))
    return out, unused


def _memory_parts(rec: Any) -> list[tuple[str, str, int | None]]:
    """Arguments, outputs not aliased to an argument, temporaries, code: what adds up to the peak."""
    out_not_aliased = None
    if rec.output_bytes is not None:
        out_not_aliased = max(rec.output_bytes - (rec.alias_bytes or 0), 0)
    return [("arguments", "args", rec.argument_bytes), ("outputs (not aliased)", "outs", out_not_aliased),
            ("temporaries", "temps", rec.temp_bytes), ("generated code", "code", rec.generated_code_bytes)]


def memory_view(m: MemorySection, fig: Figures, platform: str | None = None) -> dict[str, Any]:
    rec, mem = m.record, fig.memory or MemoryFigures()
    bar = charts.memory_bar(_memory_parts(rec), peak=mem.peak_bytes, capacity=fig.capacity_bytes)
    peak_chart = None
    p = m.peak
    if p is not None and not p.reason and p.buffers:
        rows = []
        for b in p.buffers:
            src = f"{short_path(b.file)}:{b.line}" if b.file else "—"
            label = (f"{b.file.rsplit('/', 1)[-1]}:{b.line} " if b.file else "") + (b.shape or b.value_name)
            rows.append((label, b.size_bytes, format_bytes(b.size_bytes), "buffer",
                         f"{b.value_name} {b.shape or ''} {b.op_name or ''} at {src}: {b.size_bytes} B"))
        peak_chart = charts.bar_chart(rows)
    header, rows = views.memory_rows(m, fig)
    return {"bar": bar, "rows": rows, "notes": views.memory_notes(m, fig, platform), "aliased": mem.alias_bytes,
            "aliased_label": views.aliased_label(m),
            "timeline": timeline_view(m),
            "peak": p, "peak_title": views.peak_title(p) if p is not None and not p.reason else None,
            "peak_chart": peak_chart, "peak_rows": views.peak_rows(p)[1] if p is not None and not p.reason else [],
            "largest": views.largest_inputs_rows(m)[1] if m.largest_inputs else [],
            "donation": views.donation_summary(m)}


_KIND_CLASS = {"parameter": "args", "parameter+output": "args", "output": "outs", "temporary": "temps"}


def _group_label(g: BufferGroup) -> str:
    """A group of buffers at the peak as the chart names it: the leaf path, or ``file:line`` (basename),
    with the count when more than one (``model.py:12 (3 buffers)``: the size drawn is the group's
    sum, so never ``×3``, which reads as three of that size)."""
    label = g.label
    if g.kind == "temporary" and ":" in label and "/" in label:
        label = views.short_source(label).rsplit("/", 1)[-1]
    return label + (f" ({g.count} buffers)" if g.count > 1 else "")


def timeline_view(m: MemorySection) -> dict[str, Any] | None:
    """The memory timeline's chart, its peak and the named differences; None without the peak dump."""
    tp = m.timeline_peak
    if tp is None:
        return None
    if tp.reason or not m.timeline:
        return {"reason": tp.reason or "no timeline", "chart": None}
    where = ", ".join(x for x in (views._op(tp.op) if tp.op else None,
                                  views.short_source(tp.source_line) if tp.source_line else None) if x)
    stack = [(_group_label(g), g.bytes,
              f"{g.kind}: {g.label}, {g.count} buffer{'s' if g.count != 1 else ''} {', '.join(g.shapes)}"
              f"{' (' + views._op(g.op) + ')' if g.op else ''}: {g.bytes} B", _KIND_CLASS.get(g.kind, "temps"))
             for g in tp.groups]
    chart = charts.timeline_chart([p.bytes for p in m.timeline], peak_index=tp.position,
                                  peak_label=f"peak {format_bytes(tp.bytes)} at step {tp.position}",
                                  capacity=m.capacity_bytes, gated=tp.gated_peak_bytes, buffers=stack,
                                  buffer_total=tp.bytes)
    inside_where = ", ".join(x for x in (views._op(tp.inside_op) if tp.inside_op else None,
                                         views.short_source(tp.inside_source_line) if tp.inside_source_line else None)
                             if x)
    return {"reason": None, "chart": chart, "tp": tp, "where": where, "inside_where": inside_where,
            "rows": views.timeline_buffer_rows(tp)[1],
            "on_chip": views.on_chip_text(tp).capitalize() if tp.on_chip else None}


def collectives_view(c: CollectivesSection, fig: Figures) -> dict[str, Any]:
    rows = []
    for t in c.summary.by_kind_and_mesh_axes:
        axes = views._axes(t.mesh_axes)
        value = t.executed_bytes_per_device
        text = format_bytes(value) + (" + ?" if t.unknown_executions_count else "")
        rows.append((f"{t.kind} · {axes}", value, text, _slug(t.kind),
                     f"{t.count} × {t.kind} over {axes}: {text} per device per step"))
    items = []
    for i, item in enumerate(c.items):
        x = item.collective
        runs = "?" if x.executions is None else str(x.executions)
        items.append({"id": i, "kind": x.kind + (" (async)" if x.is_async else ""), "axes": views._axes(x.mesh_axes),
                      "bytes": format_bytes(x.bytes_per_device), "runs": runs, "loop": x.in_loop,
                      "source": views._source(item.source), "op": views._op(x.op_name),
                      "result": ", ".join(x.result_types[:2]) + (f" +{len(x.result_types) - 2} more"
                                                                  if len(x.result_types) > 2 else "")})
    return {"chart": charts.bar_chart(rows), "items": items, "summary": views.collectives_summary_rows(c, fig)[1],
            "explain": views.explain_lines(c), "causes": views.cause_lines(c)}


def cost_view(c: CostSection, fig: Figures) -> dict[str, Any]:
    header, rows = views.cost_rows(c, fig)
    return {"rows": rows, "caption": views.cost_caption(c), "notes": views.cost_notes(c, fig), "figures": fig,
            "roofline": c.roofline, "roofline_chart": charts.roofline_chart(c.roofline, format_seconds),
            "step": c.step_time, "step_notes": views.step_time_notes(c), "step_rows": views.step_time_rows(c)[1],
            "step_chart": charts.step_time_chart(c.step_time, format_seconds),
            "loops": c.loop_trip_counts,
            "roofline_chip": views.chip_named(fig.chip, c),
            "step_chip": views.chip_named(c.step_time.chip, c) if c.step_time is not None else None}


def function_view(f: FunctionReport, index: int) -> dict[str, Any]:
    t = f.timings
    stages = [(n, format_seconds(v)) for n, v in (("trace", t.trace_s), ("lower", t.lower_s),
                                                   ("compile", t.compile_s)) if v is not None]
    if f.cached:
        stages.append(("compile", "(cached)"))
    prefix = f"f{index}"
    inputs, unused_in = layout_figures(f.inputs, f.mesh.axes, f"{prefix}-in")
    outputs, unused_out = layout_figures(f.outputs, f.mesh.axes, f"{prefix}-out")
    return {
        "id": prefix, "f": f, "mesh": " × ".join(f"{n}={s}" for n, s in f.mesh.axes) or "no mesh (one device)",
        "stages": stages, "inputs": inputs, "outputs": outputs, "unused": unused_in + unused_out,
        "shardings": f.inputs is not None or f.outputs is not None,
        "memory": memory_view(f.memory, f.figures, f.mesh.platform) if f.memory is not None else None,
        "collectives": collectives_view(f.collectives, f.figures) if f.collectives is not None else None,
        "cost": cost_view(f.cost, f.figures) if f.cost is not None else None,
        "why": views.why_lines(f.why) if f.why is not None else None,
        "modules": modules_view(f.modules) if f.modules is not None else None,
        "against": {"title": views.against_title(f.against), "table": views.against_rows(f.against),
                    "notes": [("info", n) for n in views.against_notes(f.against)]} if f.against is not None else None,
    }


def modules_view(m: ModulesSection) -> dict[str, Any]:
    """The per-module roll-up: its tree (each node a ``<details>``), caption and notes."""
    from stagetool.report import module_views

    header, rows = module_views.modules_rows(m)
    return {"tree": module_views.tree_view(m), "total": rows[-1], "caption": module_views.modules_caption(m),
            "notes": module_views.modules_notes(m)}


def render(doc: Report | DevicesReport, *, color: bool = False, width: int = 120) -> str:
    """The document as one self-contained HTML page."""
    del color, width
    env = environment()
    if isinstance(doc, DevicesReport):
        return env.get_template("devices.html.j2").render(d=doc)
    return env.get_template("report.html.j2").render(
        doc=doc, functions=[function_view(f, i) for i, f in enumerate(doc.functions)])


# ---------------------------------------------------------------------------------------- SVG files


def figures(doc: Report) -> dict[str, str]:
    """Standalone SVG files of the key pictures, by file name: per function its input layouts,
    memory, memory over time and collectives (those it has). For the Markdown report (GitHub shows
    SVG files)."""
    env = environment()
    template = env.get_template("figure.svg.j2")
    out: dict[str, str] = {}
    for i, f in enumerate(doc.functions):
        v = function_view(f, i)
        base = _slug(f.name)
        grids = [fig for fig in v["inputs"] if fig.grid is not None]
        if grids:
            out[f"{base}-layouts.svg"] = template.render(kind="layouts", figures=grids, **_stack(grids))
        mem = v["memory"]
        if mem is not None and mem["bar"] is not None:
            out[f"{base}-memory.svg"] = template.render(kind="memory", memory=mem)
        tl = mem["timeline"] if mem is not None else None
        if tl is not None and tl["chart"] is not None:
            out[f"{base}-timeline.svg"] = template.render(kind="timeline", timeline=tl)
        col = v["collectives"]
        if col is not None and col["chart"] is not None:
            out[f"{base}-collectives.svg"] = template.render(kind="collectives", chart=col["chart"])
    return out


def _stack(figs: Sequence[LayoutFigure]) -> dict[str, Any]:
    """Vertical offsets of stacked layout figures (a 34 px title above each grid)."""
    y, offsets, width = 0.0, [], 0.0
    for fig in figs:
        offsets.append(y)
        y += 34.0 + fig.grid.height
        width = max(width, fig.grid.width, 8.0 * len(fig.leaves[0]) + 240.0)
    return {"offsets": offsets, "width": width, "height": y}


# ---------------------------------------------------------------------------------------- check / diff


def _snapshot_leaf_figure(leaf: Mapping | None, axes: Sequence, ident: str) -> dict[str, Any] | None:
    if leaf is None:
        return None
    shape = leaf.get("shape") or []
    layout = None if leaf.get("unused") else leaf_layout(shape, leaf.get("sharding"), axes)
    return {"id": ident, "sharding": "unused" if leaf.get("unused") else str(leaf.get("sharding")),
            "shape": shape_str(str(leaf.get("dtype")), shape),
            "per_device": format_bytes(leaf.get("bytes_per_device")), "summary": _summary(layout),
            "grid": charts.device_grid(layout, name=str(leaf.get("path"))) if layout is not None else None}


def _snapshot_memory_bar(mem: Mapping | None, scale_to: int | None) -> charts.StackedBar | None:
    if not mem:
        return None
    from types import SimpleNamespace

    rec = SimpleNamespace(generated_code_bytes=None, **{k: mem.get(k) for k in (
        "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")})
    return charts.memory_bar(_memory_parts(rec), peak=mem.get("peak_bytes"), capacity=None, scale_to=scale_to)


def _drawn_bytes(mem: Mapping | None) -> int:
    """What a memory bar of a snapshot's figures adds up to: the peak, or its parts when larger."""
    m = mem or {}
    parts = sum(m.get(k) or 0 for k in ("argument_bytes", "output_bytes", "temp_bytes")) - (m.get("alias_bytes") or 0)
    return max(parts, m.get("peak_bytes") or 0)


def comparison_view(cmp: Any, before: Mapping | None, after: Mapping | None) -> list[dict[str, Any]]:
    """Per function: its changes, and before → after pictures of each leaf whose sharding changed and
    of the memory when the peak changed (from the two snapshots, when given)."""
    fb = (before or {}).get("functions") or {}
    fa = (after or {}).get("functions") or {}
    out = []
    for i, f in enumerate(cmp.functions):
        b, a = fb.get(f.name) or {}, fa.get(f.name) or {}
        axes_b = [tuple(x) for x in (b.get("mesh") or {}).get("axes") or []]
        axes_a = [tuple(x) for x in (a.get("mesh") or {}).get("axes") or []]
        pairs = []
        for j, c in enumerate(f.changes):
            m = re.fullmatch(r"(input|output) (.+): sharding", c.what)
            if not m:
                continue
            side = "inputs" if m.group(1) == "input" else "outputs"
            find = lambda snap, p=m.group(2), s=side: next((x for x in snap.get(s) or () if x.get("path") == p), None)
            pairs.append({"what": c.what, "before": _snapshot_leaf_figure(find(b), axes_b, f"c{i}-{j}-b"),
                          "after": _snapshot_leaf_figure(find(a), axes_a, f"c{i}-{j}-a")})
        timelines = _snapshot_timelines(b.get("memory_timeline"), a.get("memory_timeline"))
        memory = None
        if any(c.what == "memory.peak_bytes" for c in f.changes):
            scale = max(_drawn_bytes(b.get("memory")), _drawn_bytes(a.get("memory")))
            memory = {"before": _snapshot_memory_bar(b.get("memory"), scale),
                      "after": _snapshot_memory_bar(a.get("memory"), scale)}
        out.append({"f": f, "pairs": pairs, "memory": memory, "timelines": timelines})
    return out


def _snapshot_timelines(before: Mapping | None, after: Mapping | None) -> dict[str, Any] | None:
    """Both sides' memory timelines (a snapshot's ``memory_timeline``) on one bytes scale, or None
    when neither side has one; a side without one says how to record it."""
    if not before and not after:
        return None
    scale = max((t.get("peak_bytes") or 0) for t in (before, after) if t)

    def chart(t: Mapping | None) -> dict[str, Any] | None:
        if not t or not t.get("bytes"):
            return None
        return {"chart": charts.timeline_chart(
                    t["bytes"], peak_index=int(t.get("peak_position") or 0), steps=int(t.get("steps") or 0) or None,
                    peak_label=f"peak {format_bytes(t.get('peak_bytes'))} at step {t.get('peak_position')}",
                    capacity=None, gated=t.get("gated_peak_bytes"), scale_to=scale, width=600.0, height=200.0,
                    stack_w=10.0),
                "peak": t.get("peak_bytes"), "steps": t.get("steps"), "position": t.get("peak_position"),
                "instruction": t.get("peak_instruction")}

    return {"before": chart(before), "after": chart(after)}


def render_comparison(cmp: Any, *, before: Mapping | None = None, after: Mapping | None = None,
                      summary: str = "") -> str:
    """A ``check`` / ``diff`` comparison as one HTML page; ``before``/``after`` are the snapshots."""
    return environment().get_template("changes.html.j2").render(
        cmp=cmp, summary=summary, functions=comparison_view(cmp, before, after),
        bad=bool(cmp.regressions or cmp.failed))
