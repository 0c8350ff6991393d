"""Rows, caption and tree of the per-module roll-up (:class:`stagetool.analysis.modules.ModulesSection`),
shared by the text, Markdown and HTML renderers (JSON takes the record as it is)."""

from __future__ import annotations

from typing import Any

from stagetool.analysis.modules import ModuleNode, ModuleRow, ModulesSection
from stagetool.core.units import format_bytes, format_count, format_seconds

HEADER = ["module", "phase", "FLOPs", "share", "bytes accessed", "collectives", "live at the peak"]
"""Columns of the table (text and Markdown)."""


def _share(flops: float, total: float | None) -> str:
    return f"{100 * flops / total:.1f}%" if total else "—"


def collectives_text(row: ModuleRow) -> str:
    """``2 all-reduce over data: 1.00 MiB; ...`` (count, kind, mesh axes, bytes per device each once), or ``—``."""
    parts = []
    for t in row.collectives:
        axes = "?" if t.mesh_axes is None else (" × ".join(t.mesh_axes) or "within a device")
        parts.append(f"{t.count} {t.kind} over {axes}: {format_bytes(t.bytes_per_device)}")
    return "; ".join(parts) or "—"


def _peak(v: int | None) -> str:
    return "n/a" if v is None else format_bytes(v)


def modules_rows(m: ModulesSection) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: one row per (module path, phase), then the total (XLA's figures)."""
    total = m.xla_flops if m.xla_flops is not None else m.derived_flops
    timed = m.chip is not None
    rows = [[r.path, r.phase, format_count(r.flops, "FLOP"), _share(r.flops, total), format_bytes(r.bytes_accessed),
             collectives_text(r), _peak(r.peak_bytes)] + ([format_seconds(r.seconds)] if timed else []) for r in m.rows]
    count = sum(t.count for r in m.rows for t in r.collectives)
    moved = sum(t.bytes_per_device for r in m.rows for t in r.collectives)
    rows.append(["total", "", format_count(total, "FLOP"), "100.0%" if total else "—",
                 format_bytes(m.xla_bytes_accessed if m.xla_bytes_accessed is not None else m.derived_bytes_accessed),
                 f"{count}: {format_bytes(moved)}" if count else "—", _peak(m.peak_bytes)]
                + ([format_seconds(m.serial_seconds)] if timed else []))
    return list(HEADER) + (["time (estimate)"] if timed else []), rows


def modules_caption(m: ModulesSection) -> str:
    """Where each column comes from (one sentence each)."""
    paths = ("module paths from " + " and ".join(m.path_sources) if m.path_sources
             else "no module path found (no named scope in the op names, no module method in the source frames)")
    return ("per device, one execution (while bodies once, as XLA counts); " + paths
            + "; FLOPs and bytes derived from the compiled module with XLA's HloCostAnalysis rules, the rows adding "
            "up to XLA's Compiled.cost_analysis() (the row (XLA's total beyond the derived count): XLA's figure minus "
            "the derived sum); a fusion's bytes (its operands and outputs, as XLA counts them) go to the fusion's op "
            "name, so an op fused into another's fusion shows its FLOPs and 0 B; phase compiler-inserted: instructions "
            "XLA added (layout copies, async prefetches), no line of the code; collectives from the compiled module (count, bytes per device each "
            "once); live at the peak: device buffers XLA's buffer assignment holds at the memory timeline's peak"
            + (f"; time: an estimate on {m.chip}, each instruction's time in the step-time model (loops × trip "
               "counts) added up with nothing overlapped" if m.chip is not None else ""))


def modules_notes(m: ModulesSection) -> list[tuple[str, str]]:
    """``(severity, text)`` notes."""
    out = [("info", n) for n in m.notes]
    if m.peak_bytes is None and m.peak_reason:
        out.append(("info", f"live at the peak: n/a: {m.peak_reason}"))
    return out


def tree_view(m: ModulesSection) -> list[dict[str, Any]]:
    """The module tree for the HTML page: per node its name, path, totals as text, own rows as table
    rows and children (nested the same way)."""
    total = m.xla_flops if m.xla_flops is not None else m.derived_flops

    def node(n: ModuleNode) -> dict[str, Any]:
        return {"name": n.name, "path": n.path, "flops": format_count(n.flops, "FLOP"), "share": _share(n.flops, total),
                "bytes": format_bytes(n.bytes_accessed), "collective_bytes": format_bytes(n.collective_bytes),
                "peak": _peak(n.peak_bytes), "time": format_seconds(n.seconds) if n.seconds is not None else None,
                "rows": [[r.phase, format_count(r.flops, "FLOP"), format_bytes(r.bytes_accessed), collectives_text(r),
                          _peak(r.peak_bytes)] + ([format_seconds(r.seconds)] if r.seconds is not None else [])
                         for r in n.rows],
                "children": [node(c) for c in n.children]}

    return [node(n) for n in m.tree()]
