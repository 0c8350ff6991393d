"""Device memory over the program's order, from the one compile's dump (XProf's memory viewer
without a profile).

Sources (verified on jax/jaxlib 0.10.2, XLA:CPU and compile-only XLA:TPU): the compile that takes
the peak dump (:class:`stagetool.facts.PeakDump`) gives

* the **buffer assignment** (``HloProto``, read by :mod:`stagetool.hlo.buffers`): every HLO value's
  allocation and ``[offset, offset + size)`` in it. Values that share memory (XLA's heap simulator
  ``SHARE_WITH``: an in-place update, a bitcast, a loop-carried value) occupy the same bytes of the
  same allocation, so the bytes live at a point are the *union* of the live values' byte ranges, not
  the sum of their sizes (summing per value counted shared buffers twice: 527,364 B instead of XLA's
  266,244 on a small sin/cos program);
* the **live ranges** (``*-live-range.txt``): the flattened schedule (a loop's condition and body
  placed just before the ``while`` that runs them) and each value's ``[start, end]`` in it.

What is counted (per device, bytes): allocations in device memory spaces (every color but host
memory, ``S(5)``), except constants (the executable's data) and thread-local slots. Parameter and
output allocations are live for the whole program (XLA allocates them around the call; XProf calls
them "indefinite"), an allocation that is both (a donated input reused by an output) counted once;
temp blocks contribute the union of their live values' ranges at each position. A step of the
entry computation's schedule is one point; a ``while`` (or ``call``, ``conditional``) step is the
highest point inside it (its body folded into the loop).

The timeline's maximum is compared with the gated peak (:attr:`MemoryRecord.peak_bytes`), and
whatever separates them is named in :attr:`TimelinePeak.differences`, which sum exactly to
``gated − timeline peak``: the temp blocks' bytes not live at the timeline's peak (XLA's heap
packing), and the gated figure's distance from the allocations (e.g. XLA:TPU's
``peak_memory_in_bytes`` includes the executable's code; its ``temp_size_in_bytes`` is 0 while its
temp blocks hold VMEM scratch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from stagetool.analysis.memory import MemoryRecord
from stagetool.analysis.peak import ModuleIndex, space_label
from stagetool.analysis.shardings import LeafReport
from stagetool.facts import PeakDump
from stagetool.hlo.buffers import Allocation, BufferAssignment, parse_live_ranges

HOST_COLOR = 5
"""XLA's host memory space (``S(5)``); its allocations are host memory, never device memory."""

SOURCE = ("XLA's buffer assignment (HloProto, xla_dump_hlo_as_proto) and live ranges (*-live-range.txt) "
          "of the compile")

#: Memory space names as XLA:TPU's memory-usage report prints them.
SPACE_NAMES = {0: "device memory", 1: "VMEM", 2: "SMEM", HOST_COLOR: "host memory"}


@dataclasses.dataclass(frozen=True)
class TimelinePoint:
    """Bytes live on one device at one step of the entry computation's schedule.

    Attributes:
      position: the step's index in the entry computation's schedule (0-based).
      bytes: bytes live on one device at that step (a loop's: the most at any point of its body).
      instruction: the entry instruction scheduled there.
      op: its JAX op name (``jit(f)/while``), or None.
      source_line: the user's ``file:line``, or None.
    """

    position: int
    bytes: int
    instruction: str
    op: str | None = None
    source_line: str | None = None


@dataclasses.dataclass(frozen=True)
class TimelineBuffer:
    """A buffer live at the timeline's peak.

    Attributes:
      bytes: bytes on one device (a temp buffer's slice of its block; a parameter's or output's allocation).
      kind: ``parameter``, ``output``, ``parameter+output`` (donated and reused) or ``temporary``.
      value: the HLO value (``fusion.3{}``) occupying those bytes (of several sharing them: the first defined).
      shape: the value's HLO shape (``f32[128,256]``), or None.
      leaf: the input or output leaf path (``params/layers/wq``), for parameters and outputs.
      op: the JAX op name that defined the value, or None.
      source_line: the user's ``file:line`` of that op, or None.
      memory_space: the allocation's memory space (0: device memory, 1: VMEM on TPU, ...).
    """

    bytes: int
    kind: str
    value: str
    shape: str | None = None
    leaf: str | None = None
    op: str | None = None
    source_line: str | None = None
    memory_space: int = 0


@dataclasses.dataclass(frozen=True)
class BufferGroup:
    """Buffers live at the peak that have one name for the reader: a parameter's or output's leaf
    path, else the user's source line of the op that defined them (else the op, else the HLO value).

    Attributes:
      label: the leaf path, ``file:line``, op name or HLO value.
      kind: ``parameter``, ``output``, ``parameter+output`` or ``temporary``.
      bytes: their bytes together (per device).
      count: how many buffers.
      shapes: their distinct HLO shapes, sorted (at most 3).
      op: the op that defined the largest of them, or None.
    """

    label: str
    kind: str
    bytes: int
    count: int
    shapes: tuple[str, ...] = ()
    op: str | None = None


@dataclasses.dataclass(frozen=True)
class TimelineDifference:
    """One named part of ``gated peak − timeline peak`` (bytes; negative where the timeline counts more)."""

    what: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class TimelinePeak:
    """The timeline's maximum, set against the gated peak.

    Attributes:
      bytes: the most bytes live at any step (per device), or None when there is no timeline.
      position: the first step at that maximum, or None.
      instruction, op, source_line: that step's entry instruction, op name and the user's ``file:line``.
      gated_peak_bytes: the function's gated peak (``memory.record.peak_bytes``), or None.
      differences: what separates the two; they sum to ``gated_peak_bytes − bytes`` (empty when equal).
      baseline_bytes: parameters and outputs, live for the whole program (part of every point).
      allocated_bytes: the baseline plus every counted temp block's size: what XLA's buffer
        assignment allocates in device memory spaces.
      host_bytes: allocations in host memory (``S(5)``), never in the timeline.
      buffers: the largest buffers live at the peak (at most ``top``), largest first.
      buffer_count: how many buffers are live at the peak.
      groups: every buffer live at the peak, grouped by leaf path or source line
        (:class:`BufferGroup`), largest first: what the HTML chart stacks.
      steps: steps in the entry computation's schedule (points of the timeline).
      source: where the figures come from.
      reason: why there is no timeline (None when there is).
      inside, inside_op, inside_source_line: when the peak step runs a called computation (a loop's
        body), the instruction in it at which the bytes peak, its op name and the user's
        ``file:line``; None otherwise.
      schedule_position: the peak's position in the flattened schedule (the live-range dump's
        numbering, a loop's body included), where :func:`stagetool.analysis.peak.peak_report` lists
        the buffers live at the peak; None when there is no timeline.
    """

    bytes: int | None
    position: int | None
    instruction: str | None
    op: str | None
    source_line: str | None
    gated_peak_bytes: int | None
    differences: tuple[TimelineDifference, ...] = ()
    baseline_bytes: int | None = None
    allocated_bytes: int | None = None
    host_bytes: int | None = None
    buffers: tuple[TimelineBuffer, ...] = ()
    buffer_count: int = 0
    groups: tuple[BufferGroup, ...] = ()
    steps: int = 0
    source: str = SOURCE
    reason: str | None = None
    inside: str | None = None
    inside_op: str | None = None
    inside_source_line: str | None = None
    schedule_position: int | None = None


def _unavailable(reason: str, gated: int | None) -> TimelinePeak:
    return TimelinePeak(None, None, None, None, None, gated, reason=reason)


def _counted(a: Allocation) -> bool:
    return a.color != HOST_COLOR and not a.is_constant and not a.is_thread_local


def _union(slices: Sequence[tuple[int, int, int]]) -> int:
    """Bytes covered by ``(allocation, start, end)`` ranges (each byte of an allocation once)."""
    total = 0
    cur_alloc = cur_lo = cur_hi = None
    for alloc, lo, hi in sorted(slices):
        if alloc == cur_alloc and lo <= cur_hi:
            cur_hi = max(cur_hi, hi)
            continue
        if cur_alloc is not None:
            total += cur_hi - cur_lo
        cur_alloc, cur_lo, cur_hi = alloc, lo, hi
    if cur_alloc is not None:
        total += cur_hi - cur_lo
    return total


def memory_timeline(dump: PeakDump | None, *, gated_peak: int | None, record: MemoryRecord | None = None,
                    inputs: Sequence[LeafReport] = (), outputs: Sequence[LeafReport] = (), top: int = 10,
                    index: ModuleIndex | None = None
                    ) -> tuple[tuple[TimelinePoint, ...] | None, TimelinePeak]:
    """Bytes live on one device at each step of the entry computation's schedule, and its peak.

    Args:
      dump: the compile's :class:`~stagetool.facts.PeakDump` (live-range text, module text,
        buffer assignment).
      gated_peak: the function's gated peak in bytes (per device), to compare the maximum with.
      record: the :class:`~stagetool.analysis.memory.MemoryRecord` the gated peak comes from (its
        ``peak_source`` and XLA's figures name the difference), or None.
      inputs / outputs: leaf reports (``path``; inputs' ``parameter``) to name parameter and output buffers.
      top: how many buffers live at the peak to keep.
      index: a :class:`stagetool.analysis.peak.ModuleIndex` of ``dump.module_text`` (built when None).

    Returns:
      ``(points, peak)``; points None and ``peak.reason`` set when the dump lacks what is needed.
      Never raises for a missing or partial dump.
    """
    if dump is None:
        return None, _unavailable("the peak dump was not taken", gated_peak)
    assignment: BufferAssignment | None = dump.buffers
    if dump.live_range_text is None or assignment is None:
        why = dump.reason if dump.live_range_text is None else dump.buffers_reason
        return None, _unavailable(why or "no buffer assignment in the dump", gated_peak)
    ranges = parse_live_ranges(dump.live_range_text)
    if not ranges.sequence:
        return None, _unavailable("the live-range dump has no instruction sequence", gated_peak)
    if index is None:
        index = ModuleIndex(dump.module_text)
    entry = index.entry_names()
    if not entry:
        return None, _unavailable("the compiled module has no entry computation", gated_peak)

    buffer_by_id = {b.id: b for b in assignment.buffers}
    buffer_by_value = {b.value_name: b for b in assignment.buffers}
    place: dict[int, tuple[Allocation, int, int]] = {}
    for a in assignment.allocations:
        for x in a.assigned:
            place[x.buffer_id] = (a, x.offset, x.size)
    counted = [a for a in assignment.allocations if _counted(a)]
    whole = [a for a in counted if a.parameter_number is not None or a.maybe_live_out]
    temps = [a for a in counted if a.is_temp]
    baseline = sum(a.size for a in whole)
    allocated = baseline + sum(a.size for a in temps)
    host = sum(a.size for a in assignment.allocations if a.color == HOST_COLOR)

    # Temp values: their byte range in their block, live from start to end (inclusive).
    steps_count = len(ranges.sequence)
    starts: dict[int, list[tuple[int, int, int, str]]] = {}
    ends: dict[int, list[tuple[int, int, int, str]]] = {}
    for value, (start, end) in ranges.ranges.items():
        b = buffer_by_value.get(value)
        placed = place.get(b.id) if b is not None else None
        if placed is None or not placed[0].is_temp or not _counted(placed[0]):
            continue
        a, offset, size = placed
        key = (a.index, offset, offset + size, value)
        starts.setdefault(max(start, 0), []).append(key)
        ends.setdefault(min(end, steps_count - 1) + 1, []).append(key)
    live: dict[tuple[int, int, int, str], None] = {}
    flat: list[int] = []
    for t in range(steps_count):
        for key in ends.get(t, ()):
            live.pop(key, None)
        for key in starts.get(t, ()):
            live[key] = None
        flat.append(baseline + _union([(k[0], k[1], k[2]) for k in live]))

    # Fold into the entry computation's steps: called computations come just before their caller.
    points: list[TimelinePoint] = []
    best = -1
    for t, name in enumerate(ranges.sequence):
        best = max(best, flat[t])
        if name in entry:
            op, src = index.op_and_source(name)
            points.append(TimelinePoint(len(points), best, name, op, src))
            best = -1
    if best >= 0 and points:  # positions after the last entry step (none seen) join it
        last = points[-1]
        points[-1] = dataclasses.replace(last, bytes=max(last.bytes, best))
    if not points:
        return None, _unavailable("no entry instruction in the live-range dump's sequence", gated_peak)

    peak_point = max(points, key=lambda p: (p.bytes, -p.position))
    t_peak = flat.index(max(flat))
    buffers = _buffers_at(t_peak, ranges, buffer_by_value, buffer_by_id, place, whole, index, inputs, outputs)
    differences = _differences(peak_point.bytes, gated_peak, allocated, record, temps,
                               dump.space_names)
    inner = ranges.sequence[t_peak]
    inside = (inner, *index.op_and_source(inner)) if inner not in entry else (None, None, None)
    peak = TimelinePeak(peak_point.bytes, peak_point.position, peak_point.instruction, peak_point.op,
                        peak_point.source_line, gated_peak, differences, baseline, allocated, host,
                        tuple(buffers[:max(top, 0)]), len(buffers), _groups(buffers), len(points),
                        inside=inside[0], inside_op=inside[1], inside_source_line=inside[2],
                        schedule_position=t_peak)
    return tuple(points), peak


def _groups(buffers: Sequence[TimelineBuffer]) -> tuple[BufferGroup, ...]:
    """The buffers grouped by the name a reader knows them by, largest group first (ties by label)."""
    grouped: dict[tuple[str, str], list[TimelineBuffer]] = {}
    for b in buffers:
        grouped.setdefault((b.leaf or b.source_line or b.op or b.value, b.kind), []).append(b)
    out = []
    for (label, kind), members in grouped.items():
        largest = max(members, key=lambda b: (b.bytes, b.value))
        shapes = tuple(sorted({b.shape for b in members if b.shape}))[:3]
        out.append(BufferGroup(label, kind, sum(b.bytes for b in members), len(members), shapes, largest.op))
    out.sort(key=lambda g: (-g.bytes, g.label, g.kind))
    return tuple(out)


def _buffers_at(t: int, ranges: Any, by_value: dict, by_id: dict, place: dict, whole: list[Allocation],
                index: ModuleIndex, inputs: Sequence[LeafReport], outputs: Sequence[LeafReport]) -> list[TimelineBuffer]:
    """Every buffer live at flattened position ``t``: each temp byte range once (named by the first
    value defined in it), then each parameter and output allocation; largest first."""
    slices: dict[tuple[int, int, int], tuple[int, str, int]] = {}
    for value, (start, end) in ranges.ranges.items():
        if not start <= t <= end:
            continue
        b = by_value.get(value)
        placed = place.get(b.id) if b is not None else None
        if placed is None or not placed[0].is_temp or not _counted(placed[0]):
            continue
        a, offset, size = placed
        key = (a.index, offset, size)
        if key not in slices or (start, value) < (slices[key][0], slices[key][1]):
            slices[key] = (start, value, a.color)
    out = []
    for (_, _, size), (_, value, color) in slices.items():
        b = by_value[value]
        op, src = index.op_and_source(b.instruction)
        out.append(TimelineBuffer(size, "temporary", value, index.shape(b.instruction, b.shape_index), None, op,
                                  src, color))
    by_param = {x.parameter: x.path for x in inputs if x.parameter is not None}
    root_operands = index.root_operands()
    for a in whole:
        kind = ("parameter+output" if a.parameter_number is not None and a.maybe_live_out
                else "parameter" if a.parameter_number is not None else "output")
        first = by_id.get(a.assigned[0].buffer_id) if a.assigned else None
        value = first.value_name if first is not None else f"allocation {a.index}"
        leaf = by_param.get(a.parameter_number) if a.parameter_number is not None else None
        if leaf is None and a.maybe_live_out:
            for x in a.assigned:
                b = by_id.get(x.buffer_id)
                if b is not None and b.instruction in root_operands and root_operands[b.instruction] < len(outputs):
                    leaf = outputs[root_operands[b.instruction]].path
                    value = b.value_name
                    break
        shape = index.shape(first.instruction, first.shape_index) if first is not None else None
        op, src = index.op_and_source(first.instruction) if first is not None else (None, None)
        out.append(TimelineBuffer(a.size, kind, value, shape, leaf, op, src, a.color))
    out.sort(key=lambda b: (-b.bytes, b.value))
    return out


def _differences(peak: int, gated: int | None, allocated: int, record: MemoryRecord | None,
                 temps: list[Allocation], xla_names: Any = ()) -> tuple[TimelineDifference, ...]:
    """Named parts of ``gated − peak`` that sum to it exactly.

    ``allocated − peak`` is temp-block space not live at the timeline's peak; ``gated − allocated``
    is what the gated figure counts beyond (or below) the allocations. Where the gated peak lies
    between the timeline's peak and the allocations, one part says so; where it is below the
    timeline's peak, one part says what it leaves out.
    """
    if gated is None or gated == peak:
        return ()
    source = (record.peak_source if record else None) or "the gated peak"
    spaces = ", ".join(SPACE_NAMES.get(c) or space_label(c, xla_names)
                       for c in sorted({a.color for a in temps})) or "none"
    unused, beyond = allocated - peak, gated - allocated
    if beyond >= 0:
        parts = []
        if unused:
            parts.append(TimelineDifference(
                f"temp blocks ({spaces}): bytes not live at the timeline's peak (XLA's heap packing leaves gaps; "
                "the buffers placed there are live at other steps)", unused))
        if beyond:
            parts.append(TimelineDifference(_beyond_text(beyond, source, record), beyond))
        return tuple(parts)
    if gated > peak:
        return (TimelineDifference(
            f"{source} counts {gated - peak:,} B of the temp blocks ({spaces}) that are not live at the timeline's "
            f"peak (of {unused:,} B: XLA's heap packing leaves gaps)", gated - peak),)
    return (TimelineDifference(
        f"{source} is {peak - gated:,} B below the bytes live at the timeline's peak: it leaves out temporaries "
        f"XLA's buffer assignment holds live there (temp blocks: {spaces}; memory_analysis() reports "
        f"temp_size_in_bytes {record.temp_bytes if record else None})", gated - peak),)


def _beyond_text(beyond: int, source: str, record: MemoryRecord | None) -> str:
    reported, gated, code = (record.peak_bytes_reported, record.peak_bytes, record.generated_code_bytes) if record \
        else (None, None, None)
    if source == "live at the peak":
        return (f"XLA's live-range dump sums every HLO value live at its peak, so values sharing one buffer "
                f"count once each: {beyond:,} B beyond the allocations of its buffer assignment")
    if reported is not None and gated == reported:
        extra = f" (the executable's code, {code:,} B, among them)" if code else ""
        return f"XLA's peak_memory_in_bytes counts {beyond:,} B more than its buffer assignment allocates{extra}"
    return f"{source} counts {beyond:,} B beyond the allocations of XLA's buffer assignment"


def sparkline(points: Sequence[TimelinePoint], width: int = 48) -> str:
    """The timeline as one line of block characters (``▁▂▃▄▅▆▇█``), ``width`` columns at most, each
    column the highest point it covers, scaled from 0 to the maximum. Empty for no points."""
    if not points:
        return ""
    values = [p.bytes for p in points]
    n = len(values)
    cols = min(width, n)
    top = max(values) or 1
    blocks = "▁▂▃▄▅▆▇█"
    out = []
    for c in range(cols):
        chunk = values[c * n // cols:(c + 1) * n // cols] or [values[min(c * n // cols, n - 1)]]
        out.append(blocks[min(len(blocks) - 1, max(chunk) * len(blocks) // (top + 1))])
    return "".join(out)
