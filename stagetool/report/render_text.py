"""The terminal renderer: Rich tables and highlighted module text; plain text when not a terminal.

Knows nothing of JAX: it reads :mod:`stagetool.report.model` records only.
"""

from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console, Group, RenderableType
from rich.highlighter import RegexHighlighter
from rich.measure import Measurement
from rich.rule import Rule
from rich.table import Table
from rich.text import Text
from rich.theme import Theme

from stagetool.analysis.against import AgainstSection
from stagetool.analysis.figures import Figures
from stagetool.analysis.sections import CollectivesSection, CostSection, MemorySection
from stagetool.core.mesh import format_mesh
from stagetool.core.units import dims_str, format_bytes, format_seconds, shape_str
from stagetool.report import views
from stagetool.report.model import DevicesReport, FunctionReport, LeafReport, MeasuredSection, Report

if TYPE_CHECKING:  # the modules roll-up's records: imported by the runs that make one
    from stagetool.analysis.modules import ModulesSection


class ModuleHighlighter(RegexHighlighter):
    """Highlights StableHLO and HLO text: shapes, value names, ops, collectives, metadata."""

    base_style = "hlo."
    highlights = [
        r"(?P<comment>//.*$)",
        r"(?P<collective>\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|collective-broadcast)"
        r"(-start|-done)?\b|\bstablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)\b)",
        r"(?P<shape>\b(pred|[suf]\d+|bf16|f8\w*|c64|c128|token)\[[^\]]*\](\{[^}]*\})?|tensor<[^>]*>)",
        r"(?P<name>%[\w.\-#]+)",
        r"(?P<keyword>\b(ENTRY|ROOT|HloModule|func\.func|module|return)\b)",
        r"(?P<sharding>\b(sharding|sdy\.sharding|mhlo\.sharding)\b)",
        r"(?P<metadata>metadata=\{[^}]*\}|loc\([^)]*\))",
    ]


THEME = Theme({
    "hlo.comment": "dim", "hlo.collective": "bold red", "hlo.shape": "cyan", "hlo.name": "bright_blue",
    "hlo.keyword": "bold magenta", "hlo.sharding": "yellow", "hlo.metadata": "dim",
    "leaf": "bold", "chosen": "green", "unused": "dim", "warn": "yellow", "bad": "bold red",
})

def render(doc: Report | DevicesReport, *, color: bool, width: int = 120, fit: bool = False) -> str:
    """The document as terminal text: ANSI-coloured when ``color``, else plain.

    ``width`` is the least width (columns). With ``fit`` (the text goes to a pipe or a file, not a
    terminal) every cell is whole: a table is as wide as its cells need, however wide that is, and
    the columns a terminal cuts at a width (op names, source lines) fold onto more lines instead;
    without it a table may ask for up to 200 columns, beyond which its cells are folded or cut.

    A report that holds only module text (``lower``, ``compile``) renders without colour as the
    bare module text, so that ``stagetool lower f.py:f > f.mlir`` writes a valid module.
    """
    if isinstance(doc, Report) and not color and _module_only(doc):
        return _bare_modules(doc)
    items = renderables(doc)

    def console(w: int) -> Console:
        return Console(file=io.StringIO(), force_jupyter=False, force_terminal=color, no_color=not color,
                       color_system="truecolor" if color else None, width=w, theme=THEME, highlight=False,
                       soft_wrap=False)

    # Tables are never squeezed below the width their cells need (a cut-off shape or byte count is
    # worse than a long line): on a narrow terminal the lines wrap instead.
    if fit:
        for t in items:
            if isinstance(t, Table):
                _fold_cut_columns(t)
    limit = FIT_WIDTH if fit else _MAX_WIDTH
    probe = console(limit)
    needed = max((Measurement.get(probe, probe.options, t).maximum for t in items if isinstance(t, Table)),
                 default=0)
    out = console(max(width, min(needed, limit)))
    for r in items:
        out.print(r)
    text = out.file.getvalue()
    if not color:  # Rich pads every line to the table's width: drop that padding from plain text
        text = "\n".join(line.rstrip() for line in text.split("\n"))
    return text


#: The widest a table may ask for on a terminal before its flexible columns (op names, notes) are folded.
_MAX_WIDTH = 200

#: The widest a table may ask for in text that goes to a pipe or a file (``fit``): in effect unlimited.
FIT_WIDTH = 100_000


def _fold_cut_columns(table: Table) -> None:
    """Columns that a terminal cuts with "…" at their ``max_width`` fold onto more lines instead."""
    for column in table.columns:
        if column.overflow == "ellipsis":
            column.overflow = "fold"
            column.no_wrap = False


def renderables(doc: Report | DevicesReport) -> list[RenderableType]:
    """Rich renderables for a document, in a fixed order."""
    if isinstance(doc, DevicesReport):
        return _devices(doc)
    out: list[RenderableType] = []
    if doc.answer is not None and doc.answer.devices == "simulated" and doc.command != "lower":
        out.append(_note(doc.answer.statement, "warn"))
    for f in doc.functions:
        out.extend(_function(f, summary=doc.command == "report", config=doc.config))
    return out


def _module_only(doc: Report) -> bool:
    staged = [f for f in doc.functions if f.error is None]
    return bool(staged) and all(f.module is not None and f.inputs is None and f.cost is None and f.memory is None
                                and f.collectives is None for f in staged)


def _bare_modules(doc: Report) -> str:
    staged = [f for f in doc.functions if f.error is None]  # the failed ones are on stderr, exit 3
    if len(staged) == 1:
        text = staged[0].module.text
        return text if text.endswith("\n") else text + "\n"
    parts = []
    for f in staged:
        comment = "//" if f.module.dialect == "stablehlo" else "//"
        parts.append(f"{comment} ---- {f.name} ({f.target}), {f.module.stage} {f.module.dialect}\n{f.module.text.rstrip()}\n")
    return "\n".join(parts)


def _header(f: FunctionReport, config: tuple[tuple[str, str], ...] = ()) -> list[RenderableType]:
    mesh = format_mesh(f.mesh.axes)
    where = f"{f.mesh.device_count} {f.mesh.platform} device{'s' if f.mesh.device_count != 1 else ''}"
    if f.mesh.device_kind not in (f.mesh.platform, ""):
        where += f" ({f.mesh.device_kind})"
    if f.mesh.topology:
        where += f" (topology {f.mesh.target_line()})"
    if f.mesh.process_count > 1:
        where += f", {f.mesh.process_count} processes"
    t = f.timings
    stages = " · ".join(f"{name} {format_seconds(v)}" for name, v in
                        (("trace", t.trace_s), ("lower", t.lower_s), ("compile", t.compile_s)) if v is not None)
    if f.cached:
        stages += " · compile (cached)"
    title = Text.assemble((f.name, "bold"), "  ", (f.target, "dim"))
    sub = Text.assemble("mesh ", (mesh, "bold"), f" on {where}", ("  ·  " + stages if stages else "", "dim"))
    out: list[RenderableType] = [Rule(title, align="left"), sub]
    if config:
        out.append(Text(views.config_line(config), style="dim"))
    if f.compiler_options:
        out.append(Text(views.compiler_options_line(f.compiler_options), style="dim"))
    for note in f.notes:
        out.append(_note(f"note: {note}", "dim"))
    return out


def _function(f: FunctionReport, *, summary: bool = False,
              config: tuple[tuple[str, str], ...] = ()) -> list[RenderableType]:
    """One function's sections; with ``summary`` (the one-screen ``report``) the shardings tables are
    folded into counts by mesh axes (the JSON keeps every leaf)."""
    out = _header(f, config)
    if f.error is not None:
        out.append(Text(f"failed: {f.error}", style="bad"))
        return out
    if f.module is not None:
        label = f"{f.module.stage} module ({f.module.dialect})"
        out.append(Text(label, style="bold"))
        out.append(ModuleHighlighter()(Text(f.module.text.rstrip())))
    if summary and f.inputs is not None:
        out.append(_table("shardings", *views.shardings_summary_rows(f.inputs, f.outputs), {1, 2, 3, 4}))
        out.extend(Text(line, style="dim") for line in views.shardings_summary_notes(f.inputs))
    else:
        if f.inputs is not None:
            out.append(_leaf_table("inputs", f.inputs, inputs=True))
        if f.outputs is not None:
            out.append(_leaf_table("outputs", f.outputs, inputs=False))
    if f.collectives is not None:
        out.extend(_collectives(f.collectives, f.figures))
    if f.why is not None:
        out.extend(Text(line, style=style) for style, line in views.why_lines(f.why))
    if f.cost is not None:
        out.extend(_cost(f.cost, f.figures))
    if f.memory is not None:
        out.extend(_memory(f.memory, f.figures, f.mesh.platform))
    if f.modules is not None:
        out.extend(_modules(f.modules))
    if f.measured is not None:
        out.extend(_measured(f.measured))
    if f.against is not None:
        out.extend(_against(f.against))
    return out


def _against(a: AgainstSection) -> list[RenderableType]:
    header, rows = views.against_rows(a)
    out: list[RenderableType] = [Text(views.against_title(a), style="bold")]
    if rows:
        out.append(_table("differences", header, rows, set()))
    return out + [_note(line, "dim") for line in views.against_notes(a)]


def _measured(m: MeasuredSection) -> list[RenderableType]:
    header, rows = views.measured_rows(m)
    return [_table("measured vs estimated (--measure)", header, rows, {1, 2, 3}),
            Text(views.measured_caption(m), style="dim"), *_notes([("note", n) for n in views.measured_notes(m)])]


def _modules(m: ModulesSection) -> list[RenderableType]:
    from stagetool.report import module_views

    header, rows = module_views.modules_rows(m)
    return [_table("per module", header, rows, {2, 3, 4, 6, 7}), Text(module_views.modules_caption(m), style="dim"),
            *_notes(module_views.modules_notes(m))]


def _leaf_table(title: str, leaves: tuple[LeafReport, ...], *, inputs: bool) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("leaf", style="leaf", no_wrap=True)
    for name in ("shape", "declared", "compiled"):
        table.add_column(name, no_wrap=True)
    table.add_column("shard", justify="right", no_wrap=True)
    table.add_column("per device", justify="right", no_wrap=True)
    padded = any(x.padded_bytes_per_device not in (None, x.bytes_per_device) for x in leaves)
    if padded:
        table.add_column("padded (tiles)", justify="right", no_wrap=True)
    table.add_column("", overflow="fold", min_width=10)
    for leaf in leaves:
        style = "unused" if leaf.unused else None
        compiled = Text(str(leaf.compiled) if leaf.compiled is not None else "—",
                        style="chosen" if leaf.declared.kind == "auto" else "")
        declared = "—" if leaf.declared.kind == "unspecified" else str(leaf.declared)
        cells = [leaf.path, shape_str(leaf.dtype, leaf.shape), declared, compiled, dims_str(leaf.shard_shape),
                 format_bytes(leaf.bytes_per_device)]
        if padded:
            cells.append(format_bytes(leaf.padded_bytes_per_device))
        table.add_row(*cells, "; ".join(views.leaf_notes(leaf)), style=style)
    total = sum(x.bytes_per_device or 0 for x in leaves)
    n = len(leaves)
    table.caption = f"{n} lea{'ves' if n != 1 else 'f'}, {format_bytes(total)} per device" if leaves else "no array leaves"
    if any(views.leaf_notes(x)[:1] == ["chosen"] for x in leaves):
        table.caption += "; chosen: the SPMD partitioner picked the sharding ('auto' in the spec)"
    if any(views.leaf_notes(x)[:1] == ["typed"] for x in leaves):
        table.caption += "; typed: JAX's sharding-in-types rules decided it while tracing (explicit mesh axes)"
    table.caption_justify = "left"
    return table


def _devices(d: DevicesReport) -> list[RenderableType]:
    out: list[RenderableType] = []
    summary = Table(box=None, show_header=False, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    rows = [
        ("platform", d.platform + (f" (compile-only topology {d.topology})" if d.topology else "")),
        ("device kind", d.device_kind),
        ("devices", str(d.device_count)),
        ("processes", str(d.process_count)),
        ("memory per device", format_bytes(d.memory_bytes_per_device) if d.memory_bytes_per_device else "not reported"),
        ("jax / jaxlib", f"{d.jax_version} / {d.jaxlib_version}"),
        ("stagetool", d.stagetool_version),
    ]
    for k, v in rows:
        summary.add_row(k, Text(v))  # Text: a device kind from a target config is no Rich markup
    out.append(summary)
    if d.mesh:
        out.append(Text(f"\nmesh {format_mesh(d.mesh)} (device ids in mesh order)", style="bold"))
        out.append(_mesh_grid(d.mesh, d.mesh_device_ids or ()))
    if any(x.coords for x in d.devices):
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for c in ("id", "process", "kind", "coords"):
            table.add_column(c)
        for x in d.devices:
            table.add_row(str(x.id), str(x.process_index), Text(x.device_kind), dims_str(x.coords))
        out.append(table)
    return out


def _mesh_grid(axes: tuple[tuple[str, int], ...], ids: tuple[int, ...]) -> RenderableType:
    """The device ids laid out as a grid: rows are the second-to-last axis, columns the last."""
    sizes = [s for _, s in axes]
    if not sizes:
        return Text(str(ids[0]) if ids else "")
    cols = sizes[-1]
    rows = len(ids) // cols
    table = Table(box=box.SIMPLE, show_header=True, pad_edge=False)
    table.add_column("")
    for c in range(cols):
        table.add_column(f"{axes[-1][0]}={c}", justify="right")
    import itertools

    lead = list(itertools.product(*[range(s) for s in sizes[:-1]])) or [()]
    for r in range(rows):
        label = ",".join(f"{axes[i][0]}={v}" for i, v in enumerate(lead[r]))
        table.add_row(label, *[str(i) for i in ids[r * cols:(r + 1) * cols]])
    return Group(table)


# ---- cost and memory ----------------------------------------------------------------------------

_NOTE_STYLE = {"warn": "warn", "info": "dim", "fits": "bold green", "over": "bad"}


def _table(title: str, header: list[str], rows: list[list[str]], right: set[int] = frozenset(),
           styles: dict[int, dict] | None = None) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for i, h in enumerate(header):
        t.add_column(h, justify="right" if i in right else "left", **(styles or {}).get(i, {}))
    for r in rows:
        # cells are data (names from specs and user code), never Rich markup: '[/]' in a name is text
        t.add_row(*(Text(c) if isinstance(c, str) else c for c in r))
    return t


#: A command a note quotes for the reader to run (``stagetool cost m.py:f --topology v5e:2x4``,
#: ``pip install -e '.[tpu]'``): wrapped as one word, so that it is never split over two lines.
_COMMAND = re.compile(r"\bstagetool [a-z][a-z-]* [^\s;,]+(?: --?[a-z][\w-]*(?:[ =](?!-)[^\s;,()]+)?)*"
                      r"|\bpip install (?:-e )?(?:'[^']+'|\"[^\"]+\"|[^\s;,()]+)")


class _KeepCommands:
    """A line of text wrapped at its spaces like Rich's, except the spaces inside the commands it quotes
    (:data:`_COMMAND`): a command that does not fit on the rest of a line starts the next one whole.
    One longer than the whole width is wrapped as Rich would."""

    def __init__(self, text: Text):
        self.text = text

    def _units(self, plain: str) -> list[tuple[int, int]]:
        """``(start, end)`` of each run of text between the spaces a line may break at."""
        keep = [m.span() for m in _COMMAND.finditer(plain)]
        units, start = [], 0
        for i, ch in enumerate(plain):
            if ch == " " and not any(a < i < b for a, b in keep):
                if i > start:
                    units.append((start, i))
                start = i + 1
        if start < len(plain):
            units.append((start, len(plain)))
        return units

    def __rich_console__(self, console, options):
        width = max(1, options.max_width)
        for paragraph in self.text.split("\n"):
            units = self._units(paragraph.plain)
            if not units:
                yield Text("")
                continue
            line_start, line_end = units[0]
            for start, end in units[1:]:
                if end - line_start <= width:
                    line_end = end
                    continue
                yield paragraph[line_start:line_end]
                line_start, line_end = start, end
            yield paragraph[line_start:line_end]

    def __rich_measure__(self, console, options):
        plain = self.text.plain
        units = self._units(plain)
        return Measurement(max((b - a for a, b in units), default=0), len(plain))


def _note(text: str, style: str = "") -> _KeepCommands:
    """A note line that keeps the commands it quotes whole when it wraps."""
    return _KeepCommands(Text(text, style=style))


def _notes(notes: list[tuple[str, str]]) -> list[RenderableType]:
    return [_note(text, _NOTE_STYLE.get(kind, "")) for kind, text in notes]


def _collectives(c: CollectivesSection, fig: Figures) -> list[RenderableType]:
    if not c.items:
        out: list[RenderableType] = [Text("collectives: none (no communication between devices)", style="bold")]
    else:
        header, rows = views.collectives_rows(c)
        table = _table(f"collectives ({len(c.items)})", header, rows, {3},
                       styles={0: {"style": "hlo.collective", "no_wrap": True, "min_width": 10},
                               **{i: {"no_wrap": True, "min_width": len(header[i])} for i in range(1, 6)},
                               6: {"overflow": "ellipsis", "min_width": 10, "max_width": 40}})
        out = [table, _table("collectives by kind and mesh axes", *views.collectives_summary_rows(c, fig), {2, 3, 4})]
    causes = views.cause_lines(c)
    if causes:
        out.append(Text("why each collective is there (Shardy's propagation, rerun with sharding origins)", style="bold"))
    for head, reason, origins in causes:
        out.append(Text(f"{head}: {reason}"))
        if origins:
            out.append(Text("    from " + "; ".join(origins), style="dim"))
    for line in views.explain_lines(c):
        out.append(Text("explain " + line))
    return out


def _cost(c: CostSection, fig: Figures) -> list[RenderableType]:
    header, rows = views.cost_rows(c, fig)
    out = [_table("cost", header, rows, {1, 2}), Text(views.cost_caption(c), style="dim"), *_notes(views.cost_notes(c, fig))]
    out += _notes(views.step_time_notes(c))
    top_header, top_rows = views.step_time_rows(c)
    if top_rows:
        out.append(_table("longest instructions over the step (estimate)", top_header, top_rows, {2, 3}))
    return out


def _memory(m: MemorySection, fig: Figures, platform: str | None = None) -> list[RenderableType]:
    header, rows = views.memory_rows(m, fig)
    out: list[RenderableType] = [_table("memory per device", header, rows, {1, 2}),
                                 *_notes(views.memory_notes(m, fig, platform))]
    if m.largest_inputs:
        out.append(_table("largest inputs", *views.largest_inputs_rows(m), {2, 3}))
    summary = views.donation_summary(m)
    if summary:
        out.append(Text(summary))
        header, rows = views.donation_rows(m)
        if rows:
            out.append(_table("donation that did not take", header, rows))
    if m.peak is not None:
        if m.peak.reason:
            out.append(Text(f"buffers at the peak: n/a: {m.peak.reason}", style="warn"))
        else:
            out.append(_table(views.peak_title(m.peak), *views.peak_rows(m.peak), {0},
                              styles={3: {"max_width": 48, "overflow": "ellipsis", "no_wrap": True}}))
            if m.peak.note:
                out.append(_note(f"note: {m.peak.note}", "warn"))
    out += [Text(line) for line in views.timeline_lines(m)]
    return out
