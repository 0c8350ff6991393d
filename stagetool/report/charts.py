"""Geometry of the HTML report's pictures: plain records that the SVG templates draw (no markup here).

Every figure is computed from the report model (or a snapshot's plain data) and carries its own
size, so that a template only places rectangles and text. Pure, deterministic, no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from stagetool.analysis.roofline import RooflineEstimate
from stagetool.analysis.step_time import StepTimeEstimate

from stagetool.report.layout import DeviceShard, LeafLayout, ranges_text
from stagetool.core.units import format_bytes


def hue(index: int) -> int:
    """A distinct hue for shard ``index`` (the golden angle spreads neighbours apart)."""
    return int(round((index * 137.508) % 360))


# ---------------------------------------------------------------------------------------- device grid


@dataclasses.dataclass(frozen=True)
class Cell:
    """One device of a grid: position, colour (hue of its shard), label lines and DOM data."""

    x: float
    y: float
    w: float
    h: float
    device: int
    hue: int
    shard_id: int
    lines: tuple[str, ...]
    title: str
    shard: str
    coords: str


@dataclasses.dataclass(frozen=True)
class Panel:
    """One 2-D slice of an N-D mesh (the leading axes fixed); its label names them."""

    x: float
    y: float
    w: float
    h: float
    label: str


@dataclasses.dataclass(frozen=True)
class DeviceGrid:
    """The mesh as a grid of devices, each cell coloured by the shard it holds."""

    width: float
    height: float
    cells: tuple[Cell, ...]
    panels: tuple[Panel, ...]
    row_label: str
    col_label: str
    row_label_y: float
    shard_count: int
    replicas: int


CELL_W, GAP, PAD, PANEL_GAP, LABEL_H = 92.0, 4.0, 18.0, 14.0, 16.0


def _cell_lines(layout: LeafLayout, d: DeviceShard) -> tuple[str, ...]:
    lines = [f"dev {d.device}"]
    sharded = [(i, r) for i, (r, axes) in enumerate(zip(d.ranges, layout.dims)) if axes]
    if not sharded:
        lines.append("whole array")
    for i, (a, b) in sharded:
        lines.append(f"d{i} {a}:{b}")
    return tuple(lines)


def device_grid(layout: LeafLayout, *, name: str = "") -> DeviceGrid:
    """Lay the mesh's devices out as a grid.

    1 axis: one row; 2 axes: rows along the first, columns along the second; N axes: one 2-D panel
    (rows: axis N-2, columns: axis N-1) per combination of the leading N-2 axes, side by side.
    A cell shows the device (its position in ``mesh.devices.flat``) and, per sharded dimension,
    the element range it holds; its colour is the shard's, so replicas share a colour.
    """
    axes = layout.axes
    names = [n for n, _ in axes]
    sizes = [s for _, s in axes]
    if len(axes) == 0:
        rows, cols, lead = 1, 1, []
    elif len(axes) == 1:
        rows, cols, lead = 1, sizes[0], []
    else:
        rows, cols, lead = sizes[-2], sizes[-1], list(range(len(axes) - 2))
    n_lines = max(len(_cell_lines(layout, d)) for d in layout.devices)
    cell_h = 14.0 * n_lines + 10.0
    panel_w = cols * CELL_W + (cols - 1) * GAP
    panel_h = rows * cell_h + (rows - 1) * GAP
    n_panels = math.prod(sizes[i] for i in lead) if lead else 1
    top = PAD + (LABEL_H if lead else 0.0)
    cells = []
    panels = []
    per_panel = rows * cols
    for p in range(n_panels):
        px = PAD + p * (panel_w + PANEL_GAP)
        if lead:
            first = layout.devices[p * per_panel]
            label = ", ".join(f"{names[i]}={first.coords[i]}" for i in lead)
            panels.append(Panel(px, top, panel_w, panel_h, label))
        for k in range(per_panel):
            d = layout.devices[p * per_panel + k]
            r, c = divmod(k, cols)
            where = ", ".join(f"{n}={x}" for n, x in zip(names, d.coords))
            held = ", ".join(f"{a}:{b}" for a, b in d.ranges)
            title = f"device {d.device} ({where}) holds {name}[{held}]" if name else \
                f"device {d.device} ({where}) holds [{held}]"
            cells.append(Cell(px + c * (CELL_W + GAP), top + r * (cell_h + GAP), CELL_W, cell_h, d.device,
                              hue(d.shard_id), d.shard_id, _cell_lines(layout, d), title,
                              ranges_text(d.ranges), where))
    width = 2 * PAD + n_panels * panel_w + (n_panels - 1) * PANEL_GAP
    height = top + panel_h + PAD
    if len(axes) == 0:
        row_label, col_label = "", "one device"
    elif len(axes) == 1:
        row_label, col_label = "", f"{names[0]} →"
    else:
        row_label, col_label = f"{names[-2]} →", f"{names[-1]} →"
    return DeviceGrid(width, height, tuple(cells), tuple(panels), row_label, col_label, top + panel_h / 2,
                      layout.shard_count, layout.replicas)


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of the array view: which devices hold it."""

    x: float
    y: float
    w: float
    h: float
    hue: int
    label: str
    title: str


@dataclasses.dataclass(frozen=True)
class ArrayView:
    """The array cut into its shards (1-D and 2-D leaves, as ``jax.debug.visualize_sharding``)."""

    width: float
    height: float
    blocks: tuple[Block, ...]


def _devices_text(ids: Sequence[int]) -> str:
    """``0-3``, ``0,4``, ``0-1,4-5``: compact runs of device positions."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def array_view(layout: LeafLayout) -> ArrayView | None:
    """The array as a rectangle cut into blocks (rows: dimension 0, columns: dimension 1 of a 2-D
    leaf; one row for 1-D), each labelled with the devices that hold it; None for other ranks."""
    rank = len(layout.shape)
    if rank not in (1, 2):
        return None
    counts = [1] * rank
    holders: dict[tuple[int, ...], list[int]] = {}
    sid: dict[tuple[int, ...], int] = {}
    for d in layout.devices:
        holders.setdefault(d.block, []).append(d.device)
        sid.setdefault(d.block, d.shard_id)
        counts = [max(c, b + 1) for c, b in zip(counts, d.block)]
    rows, cols = (1, counts[0]) if rank == 1 else (counts[0], counts[1])
    width = max(160.0, min(480.0, 60.0 * cols))
    height = 36.0 if rank == 1 else max(48.0, min(320.0, 36.0 * rows))
    bw, bh = width / cols, height / rows
    blocks = []
    for block, devs in sorted(holders.items()):
        r, c = (0, block[0]) if rank == 1 else block
        text = _devices_text(devs)
        blocks.append(Block(PAD / 2 + c * bw, PAD / 2 + r * bh, bw, bh, hue(sid[block]),
                            ("dev " if len(devs) == 1 else "devs ") + text,
                            f"block {block}: devices {text}"))
    return ArrayView(width + PAD, height + PAD, tuple(blocks))


# ---------------------------------------------------------------------------------------- bars


@dataclasses.dataclass(frozen=True)
class Segment:
    """A piece of a stacked bar or one bar of a bar chart."""

    x: float
    y: float
    w: float
    h: float
    cls: str
    label: str
    value: str
    title: str


@dataclasses.dataclass(frozen=True)
class Marker:
    """A vertical line across a bar (the peak, the capacity)."""

    x: float
    label: str
    cls: str


@dataclasses.dataclass(frozen=True)
class StackedBar:
    """Memory per device: arguments, outputs, temporaries, code, against the capacity."""

    width: float
    height: float
    segments: tuple[Segment, ...]
    markers: tuple[Marker, ...]
    scale_label: str


BAR_W = 560.0


def memory_bar(parts: Sequence[tuple[str, str, int | None]], *, peak: int | None, capacity: int | None,
               width: float = BAR_W, scale_to: int | None = None) -> StackedBar | None:
    """A stacked bar of ``(label, css class, bytes)`` parts with the peak and capacity marked.

    The scale is the largest of the parts' sum, the peak, the capacity and ``scale_to`` (two bars
    drawn side by side share a scale); None when nothing is known.
    """
    known = [(label, cls, int(v)) for label, cls, v in parts if v]
    total = sum(v for _, _, v in known)
    used = max([total, peak or 0, scale_to or 0])
    # A capacity far above what is used would shrink the bar to a sliver: then the bar keeps the
    # scale of what is used, and the capacity is named at its right end with the share used.
    off_scale = bool(capacity) and capacity > 4 * used and used > 0
    scale = used if off_scale else max(used, capacity or 0)
    if scale <= 0:
        return None
    x, y, h = 0.0, 22.0, 30.0
    segs = []
    for label, cls, v in known:
        w = width * v / scale
        segs.append(Segment(x, y, w, h, cls, label, format_bytes(v), f"{label}: {format_bytes(v)} ({v} B)"))
        x += w
    markers = []
    if peak:
        markers.append(Marker(width * peak / scale, f"peak {format_bytes(peak)}", "peak"))
    if capacity and not off_scale:
        markers.append(Marker(width * capacity / scale, f"capacity {format_bytes(capacity)}", "capacity"))
    label = f"0 … {format_bytes(scale)} per device"
    if off_scale:
        label += (f"; capacity {format_bytes(capacity)} is off the scale (the peak uses "
                  f"{100 * (peak or used) / capacity:.1f}% of it)")
    return StackedBar(width, 22.0 + h + 22.0, tuple(segs), tuple(markers), label)


@dataclasses.dataclass(frozen=True)
class BarChart:
    """Horizontal bars, one per row, with a label left and a value right."""

    width: float
    height: float
    label_w: float
    bars: tuple[Segment, ...]


def bar_chart(rows: Sequence[tuple[str, float | None, str, str, str]], *, width: float = BAR_W) -> BarChart | None:
    """``(label, value, value text, css class, title)`` rows as horizontal bars scaled to the largest."""
    if not rows:
        return None
    scale = max((v or 0) for _, v, _, _, _ in rows) or 1.0
    label_w = min(330.0, max(80.0, 7.0 * max(len(r[0]) for r in rows)))
    bar_h, gap = 18.0, 6.0
    bars = []
    for i, (label, value, text, cls, title) in enumerate(rows):
        w = max(1.0, (width - label_w - 120.0) * (value or 0) / scale) if value else 0.0
        bars.append(Segment(label_w, 4.0 + i * (bar_h + gap), w, bar_h, cls, label, text, title))
    return BarChart(width, 8.0 + len(rows) * (bar_h + gap), label_w, tuple(bars))


# ---------------------------------------------------------------------------------------- roofline


def roofline_chart(r: RooflineEstimate | None, seconds: Callable[[float], str]) -> BarChart | None:
    """Compute time vs memory time of a roofline estimate, the dominant one marked ``dominant``."""
    if r is None or r.compute_seconds is None or r.memory_seconds is None:
        return None
    rows = []
    for name, value in (("compute (FLOPs / peak FLOP/s)", r.compute_seconds),
                        ("memory (bytes / HBM bandwidth)", r.memory_seconds)):
        dominant = name.startswith(r.bound or "-")
        rows.append((name, value, seconds(value) + (" ◀ bound" if dominant else ""),
                     "dominant" if dominant else "other", f"{name}: {seconds(value)}"))
    return bar_chart(rows)


# ---------------------------------------------------------------------------------------- step time


@dataclasses.dataclass(frozen=True)
class StepSegment:
    """One part of a stacked bar: its rectangle, fill hue, label, value text and tooltip."""

    x: float
    w: float
    hue: int
    label: str
    value: str
    title: str


@dataclasses.dataclass(frozen=True)
class StepBar:
    """One horizontal bar cut into parts (the step time's compute, each link class, latency)."""

    width: float
    height: float
    bar_h: float
    segments: tuple[StepSegment, ...]


_PART_HUES = {"compute": 24, "memory bandwidth": 210, "kernel launch": 280, "latency": 0}


def step_time_chart(e: StepTimeEstimate | None, seconds: Callable[[float], str], width: float = 640.0) -> StepBar | None:
    """The step-time estimate's schedule figure as one bar of its parts, in the order the estimate
    lists them (largest first); link classes get hues of their own."""
    if e is None or not e.parts or e.schedule_seconds <= 0:
        return None
    total = sum(v for _, v in e.parts)
    x, segs = 0.0, []
    for i, (name, value) in enumerate(e.parts):
        w = width * value / total
        share = f"{value / total * 100:.0f}%"
        segs.append(StepSegment(x, w, _PART_HUES.get(name, hue(i + 3)), name, seconds(value),
                            f"{name}: {seconds(value)} ({share} of {seconds(e.schedule_seconds)})"))
        x += w
    return StepBar(width, 28.0, 22.0, tuple(segs))


# ---------------------------------------------------------------------------------------- memory timeline


@dataclasses.dataclass(frozen=True)
class Tick:
    """An axis tick: its position (x or y, in the chart's pixels) and label."""

    at: float
    label: str


@dataclasses.dataclass(frozen=True)
class Level:
    """A horizontal line across the plot (the capacity, the gated peak) at ``y``; its label at
    ``label_x`` with SVG ``text-anchor`` ``anchor``."""

    y: float
    label: str
    cls: str
    label_x: float = 0.0
    anchor: str = "end"


@dataclasses.dataclass(frozen=True)
class TimelineChart:
    """Bytes live per device over the entry computation's schedule, as an area (XProf's memory
    viewer), with the peak marked and, beside it, the buffers live at the peak stacked by size.

    Attributes:
      width, height: the picture's size.
      plot_x, plot_y, plot_w, plot_h: the plot area (the y axis is bytes, 0 at the bottom).
      area: the SVG path of the area (a step line closed along the x axis).
      peak_x, peak_y: the peak's point; ``peak_label`` at ``peak_label_y`` with ``peak_anchor``.
      levels: horizontal lines: the capacity (when on the scale) and the gated peak (when it differs).
      y_ticks, x_ticks: axis ticks (bytes; steps of the schedule).
      stack: the buffers live at the peak, stacked bottom-up largest first, on the plot's bytes scale.
      stack_x, stack_w: where the stack is drawn.
      caption: scale and what is off it.
    """

    width: float
    height: float
    plot_x: float
    plot_y: float
    plot_w: float
    plot_h: float
    area: str
    peak_x: float
    peak_y: float
    peak_label: str
    peak_label_y: float
    peak_anchor: str
    levels: tuple[Level, ...]
    y_ticks: tuple[Tick, ...]
    x_ticks: tuple[Tick, ...]
    stack: tuple[Segment, ...]
    stack_x: float
    stack_w: float
    caption: str


def _nice(v: float) -> float:
    """The smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 × 10^k that is at least ``v``."""
    if v <= 0:
        return 1.0
    base = 10 ** math.floor(math.log10(v))
    return next(m * base for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if m * base >= v * (1 - 1e-12))


def _nice_bytes(v: float) -> float:
    """A round byte count at least ``v`` in the binary unit ``format_bytes`` prints it in (60 MiB, not 62.9 MB)."""
    unit = 1.0
    while v >= 1000 * unit and unit < 2.0 ** 50:
        unit *= 1024.0
    return _nice(v / unit) * unit


CHAR_W = 6.7
"""Approximate width of one character of the pictures' 11 px monospace font, for placing labels."""


def timeline_chart(values: Sequence[int], *, peak_index: int, peak_label: str, capacity: int | None,
                   gated: int | None, buffers: Sequence[tuple[str, int, str, str]] = (),
                   buffer_total: int | None = None, width: float = 860.0, height: float = 240.0,
                   max_columns: int = 1200, scale_to: int | None = None, steps: int | None = None,
                   stack_w: float = 290.0) -> TimelineChart | None:
    """Geometry of a memory timeline.

    Args:
      values: bytes per step, in schedule order.
      peak_index: the step of the peak; ``peak_label`` its label.
      capacity: per-device capacity (drawn when within 4× the peak, else named in the caption).
      gated: the gated peak, drawn as a level when it differs from the timeline's maximum.
      buffers: ``(label, bytes, title, css class)`` of the buffers (or groups) live at the peak,
        largest first; those under 1/40 of the peak are merged into one segment per css class, and
        the stack reaches ``buffer_total`` (every byte live there) when given.
      max_columns: more steps than this are drawn as the highest of each group (the peak is kept).
      scale_to: at least this many bytes on the y axis (two timelines side by side share a scale).
      steps: the schedule's steps when ``values`` are already grouped (a snapshot keeps at most 400
        points; ``peak_index`` then counts steps, and ticks and the caption name steps).
      stack_w: the room right of the plot for the stacked buffers (0 without them).

    Returns None for no values.
    """
    if not values:
        return None
    n = len(values)
    total_steps = steps or n
    top = max(values)
    on_scale = [top, gated or 0, scale_to or 0] + ([capacity] if capacity and capacity <= 4 * max(top, 1) else [])
    y_max = _nice_bytes(max(on_scale) * 1.06)
    px, py, pw, ph = 74.0, 20.0, width - 74.0 - stack_w, height - 20.0 - 36.0

    def y_of(v: float) -> float:
        return py + ph - ph * v / y_max

    cols = min(n, max_columns)
    xs = [px + pw * i / cols for i in range(cols + 1)]
    heights = [max(values[c * n // cols:(c + 1) * n // cols] or [values[min(c * n // cols, n - 1)]])
               for c in range(cols)]
    path = [f"M{xs[0]:.2f} {py + ph:.2f}"]
    for c, v in enumerate(heights):
        y = y_of(v)
        path.append(f"L{xs[c]:.2f} {y:.2f}L{xs[c + 1]:.2f} {y:.2f}")
    path.append(f"L{xs[-1]:.2f} {py + ph:.2f}Z")
    peak_col = min(peak_index * n // total_steps, n - 1) * cols // n
    peak_x, peak_y = (xs[peak_col] + xs[peak_col + 1]) / 2, y_of(top)
    peak_anchor = "end" if peak_x > px + 0.6 * pw else "start"
    peak_w = CHAR_W * len(peak_label)
    peak_span = (peak_x - peak_w, peak_x) if peak_anchor == "end" else (peak_x, peak_x + peak_w)
    peak_label_y = peak_y - 7 if peak_y - 7 > py + 4 else peak_y + 14
    caption = f"0 … {format_bytes(y_max)} per device over {total_steps} steps of the entry computation's schedule"
    wanted = []
    if capacity:
        if capacity <= 4 * max(top, 1):
            wanted.append((y_of(capacity), f"capacity {format_bytes(capacity)}", "capacity"))
        else:
            caption += f"; capacity {format_bytes(capacity)} is off the scale (the peak uses {100 * top / capacity:.1f}% of it)"
    if gated and gated != top:
        wanted.append((y_of(gated), f"gated peak {format_bytes(gated)}", "gated"))
    levels = []
    for y, label, cls in wanted:
        w = CHAR_W * len(label)
        # right end of the plot, unless the peak's label is there: then the left end
        clash = abs((y - 4) - peak_label_y) < 12 and peak_span[1] > px + pw - w - 4
        levels.append(Level(y, label, cls, px + 4 if clash else px + pw - 2, "start" if clash else "end"))
    y_ticks = tuple(Tick(y_of(y_max * k / 4), format_bytes(y_max * k / 4)) for k in range(5))
    step = _nice(total_steps / 6)
    x_ticks = tuple(Tick(px + pw * i / total_steps, str(int(i)))
                    for i in (k * step for k in range(int(total_steps / step) + 1)) if i < total_steps)
    stack_x, stack_w = px + pw + 22.0, 34.0
    segs = []
    y_base = py + ph
    shown_total = 0
    small: dict[str, list[int]] = {}
    for label, size, title, cls in buffers:
        if size * 40 < top:
            small.setdefault(cls, []).append(size)
            continue
        h = ph * size / y_max
        y_base -= h
        shown_total += size
        segs.append(Segment(stack_x, y_base, stack_w, h, cls, label, format_bytes(size), title))
    names = {"args": "parameters", "outs": "outputs", "temps": "temporaries"}
    for cls, sizes in sorted(small.items(), key=lambda kv: -sum(kv[1])):
        size = sum(sizes)
        h = ph * size / y_max
        y_base -= h
        shown_total += size
        what = f"{len(sizes)} smaller {names.get(cls, 'buffers')}"
        segs.append(Segment(stack_x, y_base, stack_w, h, cls, what, format_bytes(size), f"{what}: {size} B"))
    rest = (buffer_total or 0) - shown_total
    if rest > 0:
        h = ph * rest / y_max
        y_base -= h
        segs.append(Segment(stack_x, y_base, stack_w, h, "other", "other buffers", format_bytes(rest),
                            f"the other buffers live at the peak: {rest} B"))
    return TimelineChart(width, height, px, py, pw, ph, "".join(path), peak_x, peak_y, peak_label, peak_label_y,
                         peak_anchor, tuple(levels), y_ticks, x_ticks, tuple(segs), stack_x, stack_w, caption)


# ---------------------------------------------------------------------------------------- sweep table


@dataclasses.dataclass(frozen=True)
class CellBar:
    """A small horizontal bar inside a table cell: its filled width of ``width`` pixels, and where
    a reference line (the capacity) falls, if anywhere on the bar."""

    width: float
    fill: float
    cls: str
    mark: float | None = None


def cell_bars(values: Sequence[float | None], *, cls: str, width: float = 120.0,
              marks: Sequence[float | None] | None = None) -> list[CellBar | None]:
    """One bar per value on a shared scale (the largest value or mark fills ``width``); None for a
    missing value. ``marks`` (e.g. each row's capacity) are drawn as a line where on the scale."""
    known = [v for v in values if v is not None] + [m for m in (marks or ()) if m is not None]
    scale = max(known, default=0) or 1.0
    out: list[CellBar | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        mark = marks[i] if marks is not None else None
        out.append(CellBar(width, max(1.0, width * v / scale) if v else 0.0, cls,
                           width * mark / scale if mark else None))
    return out
