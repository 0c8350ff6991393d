"""The Markdown renderer: GitHub-flavoured tables, for pull-request comments and step summaries."""

from __future__ import annotations

from typing import Iterable

from stagetool.analysis.figures import Figures
from stagetool.analysis.modules import ModulesSection
from stagetool.analysis.sections import CollectivesSection, CostSection, MemorySection
from stagetool.core.mesh import format_mesh
from stagetool.core.text import MarkdownText, markdown_code, markdown_text
from stagetool.core.units import dims_str, format_bytes, format_seconds, shape_str
from stagetool.report import views
from stagetool.report.model import DevicesReport, FunctionReport, LeafReport, MeasuredSection, Report


def escape(text: str) -> str:
    """A table cell or a line of text from the report: names, sources and messages come from specs and
    user code, so plain text is shown as written (:func:`~stagetool.core.text.markdown_text`: no
    HTML, link, image, mention or cell break; `` `name` `` spans of the views kept); text already made Markdown
    (:class:`~stagetool.core.text.MarkdownText`, e.g. a :func:`~stagetool.core.text.markdown_code`
    span) is kept."""
    if isinstance(text, MarkdownText):
        return text.replace("\n", " ")
    return markdown_text(text)


def code(text: object) -> MarkdownText:
    """A code span that nothing in ``text`` can break out of."""
    return markdown_code(text)


def table(header: list[str], rows: Iterable[list[str]], align: str | None = None) -> list[str]:
    """A Markdown table; ``align`` is one character per column, ``l`` or ``r``."""
    align = align or "l" * len(header)
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|"]
    for r in rows:
        out.append("| " + " | ".join(escape(c) for c in r) + " |")
    return out


def render(doc: Report | DevicesReport, *, color: bool = False, width: int = 120,
           figures: dict[str, dict[str, str]] | None = None) -> str:
    """The document as Markdown text ending in a newline.

    ``figures``: per function name, picture kind (``layouts``, ``memory``, ``timeline``, ``collectives``) → the
    relative path of its SVG file; each is linked as an image under its section.
    """
    del color, width
    figures = figures or {}
    lines = _devices(doc) if isinstance(doc, DevicesReport) else [
        *([f"> **{escape(doc.answer.statement)}**", ""] if doc.answer is not None
          and doc.answer.devices == "simulated" and doc.command != "lower" else []),
        *(line for f in doc.functions for line in _function(f, summary=doc.command == "report", config=doc.config,
                                                            figures=figures.get(f.name, {})))]
    return "\n".join(lines).rstrip() + "\n"


def render_with_figures(doc: Report, folder: str) -> tuple[str, dict[str, str]]:
    """The Markdown text with its key pictures linked as SVG files in ``folder`` (a path relative to
    the Markdown file, ``report-files``), and those files' texts by name.

    GitHub strips inline ``<svg>`` and ``data:`` images from Markdown but shows an SVG file linked by
    a relative path (in a repository, a rendered artifact, a wiki); see docs/html-report.md.
    """
    from stagetool.report.render_html import _slug, figures

    svgs = figures(doc)
    links: dict[str, dict[str, str]] = {}
    for f in doc.functions:
        for kind in ("layouts", "memory", "timeline", "collectives"):
            name = f"{_slug(f.name)}-{kind}.svg"
            if name in svgs:
                links.setdefault(f.name, {})[kind] = f"{folder}/{name}"
    return render(doc, figures=links), svgs


def _image(figures: dict[str, str], kind: str, alt: str) -> list[str]:
    return [f"![{escape(alt)}]({figures[kind]})", ""] if kind in figures else []


def _function(f: FunctionReport, *, summary: bool = False, figures: dict[str, str] | None = None,
              config: tuple[tuple[str, str], ...] = ()) -> list[str]:
    figures = figures or {}
    mesh = format_mesh(f.mesh.axes)
    t = f.timings
    stages = ", ".join(f"{name} {format_seconds(v)}" for name, v in
                       (("trace", t.trace_s), ("lower", t.lower_s), ("compile", t.compile_s)) if v is not None)
    if f.cached:
        stages += ", compile (cached)"
    out = [f"## {code(f.name)} — {code(f.target)}", "",
           f"Mesh **{mesh}** on {f.mesh.device_count} {f.mesh.platform} device{'s' if f.mesh.device_count != 1 else ''}"
           + (f" ({escape(f.mesh.device_kind)})" if f.mesh.device_kind not in (f.mesh.platform, "") else "")
           + (f", topology {code(f.mesh.topology)}" + escape(f.mesh.target_line()[len(f.mesh.topology):])
              if f.mesh.topology else "") + (f"; {stages}" if stages else "") + ".", ""]
    if config:
        out += [f"<sub>{escape(views.config_line(config))}</sub>", ""]
    if f.compiler_options:
        out += [f"<sub>{escape(views.compiler_options_line(f.compiler_options))}</sub>", ""]
    out += [f"> {escape(n)}" for n in f.notes] + ([""] if f.notes else [])
    if f.error is not None:
        return out + [f"**Failed:** {escape(f.error)}", ""]
    if f.module is not None:
        out += [f"### {f.module.stage.capitalize()} module ({f.module.dialect})", "", "```", f.module.text.rstrip(), "```", ""]
    if summary and f.inputs is not None:
        out += ["### Shardings", ""] + table(*views.shardings_summary_rows(f.inputs, f.outputs), "lrrrr") + [""]
        out += [f"- {escape(line)}" for line in views.shardings_summary_notes(f.inputs)] + [""]
        out += _image(figures, "layouts", f"device grids of {f.name}'s input layouts")
    else:
        for title, leaves in (("Inputs", f.inputs), ("Outputs", f.outputs)):
            if leaves is not None:
                out += [f"### {title}", ""] + _leaves(leaves) + [""]
    if f.collectives is not None:
        out += _collectives(f.collectives, f.figures) + _image(figures, "collectives", f"collective bytes of {f.name} by kind and mesh axes")
    if f.why is not None:
        lines = views.why_lines(f.why)
        out += [f"### {escape(lines[0][1][0].upper() + lines[0][1][1:])}", ""]
        out += [f"- **{escape(line)}**" if style == "bold" else f"- {escape(line)}" for style, line in lines[1:]] + [""]
    if f.cost is not None:
        out += _cost(f.cost, f.figures)
    if f.memory is not None:
        out += (_memory(f.memory, f.figures, f.mesh.platform) + _image(figures, "memory", f"memory per device of {f.name}")
                + _image(figures, "timeline", f"memory over time of {f.name}"))
    if f.modules is not None:
        out += _modules(f.modules)
    if f.measured is not None:
        out += _measured(f.measured)
    if f.against is not None:
        header, rows = views.against_rows(f.against)
        out += [f"### {escape(views.against_title(f.against))}", ""] + (table(header, rows, "lllll") + [""] if rows else [])
        out += [f"- {escape(n)}" for n in views.against_notes(f.against)] + [""]
    return out


def _measured(m: MeasuredSection) -> list[str]:
    header, rows = views.measured_rows(m)
    return (["### Measured vs estimated (--measure)", ""] + table(header, rows, "lrrrl") + ["",
            f"<sub>{escape(views.measured_caption(m))}</sub>", ""]
            + [f"- {escape(n)}" for n in views.measured_notes(m)] + ([""] if views.measured_notes(m) else []))


def _modules(m: ModulesSection) -> list[str]:
    from stagetool.report import module_views

    header, rows = module_views.modules_rows(m)
    return (["### Per module", ""] + table(header, rows, "llrrrlr" + "r" * (len(header) - 7)) + ["", f"_{escape(module_views.modules_caption(m))}_", ""]
            + _notes(module_views.modules_notes(m)) + [""])


def _notes(notes: list[tuple[str, str]]) -> list[str]:
    marks = {"warn": "⚠️ ", "over": "❌ ", "fits": "✅ "}
    return [f"- {marks.get(kind, '')}{escape(text)}" for kind, text in notes]


def _collectives(c: CollectivesSection, fig: Figures) -> list[str]:
    if not c.items:
        out = ["### Collectives", "", "None: no communication between devices.", ""]
    else:
        out = [f"### Collectives ({len(c.items)})", ""] + table(*views.collectives_rows(c), "lllrlll") + [""]
        out += ["#### By kind and mesh axes", ""] + table(*views.collectives_summary_rows(c, fig), "llrrr") + [""]
    causes = views.cause_lines(c)
    if causes:
        out += ["#### Why each collective is there", ""]
        for head, reason, origins in causes:
            out.append(f"- **{escape(head)}**: {escape(reason)}"
                       + (f" — from {'; '.join(escape(o) for o in origins)}" if origins else ""))
        out.append("")
    out += [f"- {escape(line)}" for line in views.explain_lines(c)] + ([""] if c.explained else [])
    return out


def _cost(c: CostSection, fig: Figures) -> list[str]:
    header, rows = views.cost_rows(c, fig)
    out = ["### Cost", ""] + table(header, rows, "lrr") + ["", f"_{escape(views.cost_caption(c))}_", ""] \
        + _notes(views.cost_notes(c, fig)) + [""]
    step = _notes(views.step_time_notes(c))
    if step:
        out += ["#### Step time (estimate)", ""] + step + [""]
    top_header, top_rows = views.step_time_rows(c)
    if top_rows:
        out += table(top_header, top_rows, "llrrlll") + [""]
    return out


def _memory(m: MemorySection, fig: Figures, platform: str | None = None) -> list[str]:
    header, rows = views.memory_rows(m, fig)
    out = (["### Memory per device", ""] + table(header, rows, "lrr") + [""]
           + _notes(views.memory_notes(m, fig, platform)) + [""])
    if m.largest_inputs:
        out += ["#### Largest inputs", ""] + table(*views.largest_inputs_rows(m), "llrr") + [""]
    summary = views.donation_summary(m)
    if summary:
        out += [f"- {escape(summary)}", ""]
        header, rows = views.donation_rows(m)
        if rows:
            out += ["#### Donation that did not take", ""] + table(header, rows) + [""]
    if m.peak is not None:
        if m.peak.reason:
            out += [f"- buffers at the peak: n/a: {escape(m.peak.reason)}", ""]
        else:
            header, rows = views.peak_rows(m.peak)
            out += [f"#### {escape(views.peak_title(m.peak).capitalize())}", ""] + table(header, rows, "r" + "l" * (len(header) - 1)) + [""]
            if m.peak.note:
                out += [f"- note: {escape(m.peak.note)}", ""]
    lines = views.timeline_lines(m)
    if lines:
        out += ["```text", *lines, "```", ""]
    return out


def _leaves(leaves: tuple[LeafReport, ...]) -> list[str]:
    rows = []
    for x in leaves:
        rows.append([code(x.path), code(shape_str(x.dtype, x.shape)),
                     "—" if x.declared.kind == "unspecified" else code(x.declared),
                     code(x.compiled) if x.compiled is not None else "—", dims_str(x.shard_shape),
                     format_bytes(x.bytes_per_device), ", ".join(views.leaf_notes(x))])
    return table(["leaf", "shape", "declared", "compiled", "shard", "per device", ""], rows, "lllllrl")


def _devices(d: DevicesReport) -> list[str]:
    rows = [["platform", MarkdownText(escape(d.platform) + (f" (topology {code(d.topology)})" if d.topology else ""))],
            ["device kind", d.device_kind], ["devices", str(d.device_count)], ["processes", str(d.process_count)],
            ["memory per device", format_bytes(d.memory_bytes_per_device) if d.memory_bytes_per_device else "not reported"],
            ["jax / jaxlib", f"{d.jax_version} / {d.jaxlib_version}"], ["stagetool", d.stagetool_version]]
    return ["## Devices", ""] + table(["", ""], rows)
