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

What is counted (per device, bytes): allocations in device memory (memory space 0: HBM on TPU and
GPU), except constants (the executable's data) and thread-local slots. On TPU XLA's buffer
assignment also places buffers in on-chip memory (VMEM, memory space 1; SMEM, 2; and spaces the
compiler numbers itself, e.g. 6): those are never added to the timeline's bytes (they are not HBM);
:attr:`TimelinePeak.on_chip` gives, per space, the bytes live at the timeline's peak and their own
maximum, and :attr:`TimelinePeak.on_chip_buffers` the on-chip buffers live at the peak (the
transformer example on ``v5e:2x4``: 5,926,400 B of HBM at the peak, 34,848,768 B of VMEM live there,
which the timeline used to add to the HBM). Host memory (``S(5)``) is apart too. Parameter and
output allocations are live for the whole program (XLA allocates them around the call; XProf calls
them "indefinite"), an allocation that is both (a donated input reused by an output) counted once;
temp blocks contribute the union of their live values' ranges at each position. A step of the
entry computation's schedule is one point; a ``while`` (or ``call``, ``conditional``) step is the
highest point inside it (its body folded into the loop).

The timeline's maximum is compared with the gated peak (:attr:`MemoryRecord.peak_bytes`), and
whatever separates them is named in :attr:`TimelinePeak.differences`, which sum exactly to
``gated − timeline peak``. Where the gated peak is XLA:TPU's ``peak_memory_in_bytes`` and the
program holds on-chip buffers, that figure counts on-chip memory with HBM (measured: on ``v5e`` it
is the most HBM + VMEM + SMEM bytes live at any step, to the byte, for programs without the
executable's code in it): the first parts bridge the HBM peak to that combined step (the on-chip
bytes live there; the HBM bytes it has below the HBM peak). The rest, for HBM alone or for HBM and
on-chip together: the temp blocks' bytes not live at that step (XLA's heap packing), and the gated
figure's distance from the allocations (e.g. XLA:TPU's ``peak_memory_in_bytes`` can include the
executable's code; its ``temp_size_in_bytes`` is 0 while its temp blocks hold scratch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from stagetool.analysis.memory import MemoryRecord
from stagetool.analysis.peak import ModuleIndex, space_label
from stagetool.analysis.shardings import LeafReport
from stagetool.core.codec import omitted
from stagetool.facts import PeakDump
from stagetool.hlo.buffers import Allocation, BufferAssignment, parse_live_ranges

HOST_COLOR = 5
"""XLA's host memory space (``S(5)``); its allocations are host memory, never device memory."""

SOURCE = ("XLA's buffer assignment (HloProto, xla_dump_hlo_as_proto) and live ranges (*-live-range.txt) "
          "of the compile")

DEVICE_COLOR = 0
"""XLA's device memory space (HBM on TPU and GPU): the only space the timeline's bytes count."""

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
      memory_space: the allocation's memory space (0: device memory, 1: VMEM on TPU, ...); 0 for
        every buffer of :attr:`TimelinePeak.buffers`, another for :attr:`TimelinePeak.on_chip_buffers`.
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
class OnChipSpace:
    """One on-chip memory space of the program (TPU: VMEM, SMEM, ...), never in the timeline's bytes.

    Attributes:
      space: its name (``VMEM``, ``SMEM``, ``XLA memory space 6 (unnamed)``: :func:`space_label`).
      memory_space: XLA's memory space number (the buffer assignment's color).
      at_peak_bytes: bytes live in it at the timeline's (HBM) peak, per device.
      max_bytes: the most bytes live in it at any step, per device.
      allocated_bytes: what XLA's buffer assignment allocates in it, per device.
    """

    space: str
    memory_space: int
    at_peak_bytes: int
    max_bytes: int
    allocated_bytes: int


@dataclasses.dataclass(frozen=True)
class TimelineDifference:
    """One named part of ``gated peak − timeline peak`` (bytes; negative where the timeline counts more)."""

    what: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class TimelinePeak:
    """The timeline's maximum, set against the gated peak.

    Attributes:
      bytes: the most device-memory (HBM, memory space 0) bytes live at any step (per device), or None
        when there is no timeline. On-chip memory is never in it (see ``on_chip``).
      position: the first step at that maximum, or None.
      instruction, op, source_line: that step's entry instruction, op name and the user's ``file:line``.
      gated_peak_bytes: the function's gated peak (``memory.record.peak_bytes``), or None.
      differences: what separates the two; they sum to ``gated_peak_bytes − bytes`` (empty when equal).
      baseline_bytes: parameters and outputs in device memory, live for the whole program (part of
        every point).
      allocated_bytes: the baseline plus every device-memory temp block's size: what XLA's buffer
        assignment allocates in device memory (HBM), on-chip spaces left out.
      host_bytes: allocations in host memory (``S(5)``), never in the timeline.
      buffers: the largest device-memory buffers live at the peak (at most ``top``), largest first.
      buffer_count: how many device-memory buffers are live at the peak.
      groups: every device-memory buffer live at the peak, grouped by leaf path or source line
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
      on_chip: per on-chip memory space (TPU's VMEM, SMEM, ...), by its number, what is live in it at
        the peak and at most (:class:`OnChipSpace`); () when the program has none (every CPU and GPU
        program measured).
      on_chip_buffers: the largest on-chip buffers live at the peak (at most ``top``), largest
        first, each with its ``memory_space``; never in ``bytes``.
      on_chip_buffer_count: how many on-chip buffers are live at the peak.
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
    on_chip: tuple[OnChipSpace, ...] = omitted(())
    on_chip_buffers: tuple[TimelineBuffer, ...] = omitted(())
    on_chip_buffer_count: int = omitted(0)


def _unavailable(reason: str, gated: int | None) -> TimelinePeak:
    return TimelinePeak(None, None, None, None, None, gated, reason=reason)


def _counted(a: Allocation) -> bool:
    """An allocation in device memory or on chip (host memory, constants and thread-local slots aside)."""
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
    whole_all = [a for a in counted if a.parameter_number is not None or a.maybe_live_out]
    whole = [a for a in whole_all if a.color == DEVICE_COLOR]
    temps = [a for a in counted if a.is_temp and a.color == DEVICE_COLOR]
    baseline = sum(a.size for a in whole)
    allocated = baseline + sum(a.size for a in temps)
    host = sum(a.size for a in assignment.allocations if a.color == HOST_COLOR)
    chip_colors = sorted({a.color for a in counted if a.color != DEVICE_COLOR})
    chip_baseline = {c: sum(a.size for a in whole_all if a.color == c) for c in chip_colors}
    chip_allocated = {c: sum(a.size for a in counted if a.color == c and (a.is_temp or a in whole_all))
                      for c in chip_colors}

    # Temp values: their byte range in their block, live from start to end (inclusive).
    steps_count = len(ranges.sequence)
    starts: dict[int, list[tuple[int, int, int, int, str]]] = {}
    ends: dict[int, list[tuple[int, int, int, int, str]]] = {}
    for value, (start, end) in ranges.ranges.items():
        b = buffer_by_value.get(value)
        placed = place.get(b.id) if b is not None else None
        if placed is None or not placed[0].is_temp or not _counted(placed[0]):
            continue
        a, offset, size = placed
        key = (a.color, a.index, offset, offset + size, value)
        starts.setdefault(max(start, 0), []).append(key)
        ends.setdefault(min(end, steps_count - 1) + 1, []).append(key)
    live: dict[tuple[int, int, int, int, str], None] = {}
    flat: list[int] = []  # device memory (HBM) live at each flattened position
    chip_flat: dict[int, list[int]] = {c: [] for c in chip_colors}  # each on-chip space's
    for t in range(steps_count):
        for key in ends.get(t, ()):
            live.pop(key, None)
        for key in starts.get(t, ()):
            live[key] = None
        by_color: dict[int, list[tuple[int, int, int]]] = {}
        for k in live:
            by_color.setdefault(k[0], []).append((k[1], k[2], k[3]))
        flat.append(baseline + _union(by_color.get(DEVICE_COLOR, ())))
        for c in chip_colors:
            chip_flat[c].append(chip_baseline[c] + _union(by_color.get(c, ())))

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
    names = dump.space_names
    on_chip = tuple(OnChipSpace(_space_name(c, names), c, chip_flat[c][t_peak], max(chip_flat[c]),
                                chip_allocated[c]) for c in chip_colors)
    every = _buffers_at(t_peak, ranges, buffer_by_value, buffer_by_id, place, whole_all, index, inputs, outputs)
    buffers = [b for b in every if b.memory_space == DEVICE_COLOR]
    chip_buffers = [b for b in every if b.memory_space != DEVICE_COLOR]
    combined = None
    if chip_colors and _counts_on_chip(gated_peak, record):
        totals = [flat[t] + sum(chip_flat[c][t] for c in chip_colors) for t in range(steps_count)]
        t_both = totals.index(max(totals))
        combined = _Combined(_entry_step(t_both, ranges.sequence, entry), flat[t_both],
                             tuple((_space_name(c, names), chip_flat[c][t_both]) for c in chip_colors),
                             allocated + sum(chip_allocated.values()))
    differences = _differences(peak_point.bytes, gated_peak, allocated, record, temps, names, combined,
                               tuple(a for a in counted if a.is_temp and a.color != DEVICE_COLOR))
    inner = ranges.sequence[t_peak]
    inside = (inner, *index.op_and_source(inner)) if inner not in entry else (None, None, None)
    peak = TimelinePeak(peak_point.bytes, peak_point.position, peak_point.instruction, peak_point.op,
                        peak_point.source_line, gated_peak, differences, baseline, allocated, host,
                        tuple(buffers[:max(top, 0)]), len(buffers), _groups(buffers), len(points),
                        inside=inside[0], inside_op=inside[1], inside_source_line=inside[2],
                        schedule_position=t_peak, on_chip=on_chip,
                        on_chip_buffers=tuple(chip_buffers[:max(top, 0)]), on_chip_buffer_count=len(chip_buffers))
    return tuple(points), peak


def _space_name(color: int, xla_names: Any = ()) -> str:
    return SPACE_NAMES.get(color) or space_label(color, xla_names)


def _entry_step(t: int, sequence: Sequence[str], entry: frozenset[str]) -> int:
    """The entry-computation step (timeline position) that flattened position ``t`` folds into."""
    step = 0
    for i, name in enumerate(sequence):
        if name in entry:
            if i >= t:
                return step
            step += 1
    return max(step - 1, 0)


def _counts_on_chip(gated: int | None, record: MemoryRecord | None) -> bool:
    """Whether the gated peak is XLA's ``peak_memory_in_bytes``: on TPU, XLA's heap simulation over
    every memory space but host, so on-chip bytes are in it."""
    return gated is not None and record is not None and record.peak_bytes_reported is not None \
        and gated == record.peak_bytes_reported


@dataclasses.dataclass(frozen=True)
class _Combined:
    """The step where device memory and on-chip memory together hold the most (XLA:TPU's peak moment)."""

    step: int
    device_bytes: int
    chip: tuple[tuple[str, int], ...]
    allocated: int


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
                 temps: list[Allocation], xla_names: Any = (), combined: _Combined | None = None,
                 chip_temps: Sequence[Allocation] = ()) -> tuple[TimelineDifference, ...]:
    """Named parts of ``gated − peak`` that sum to it exactly (``peak``: device memory, HBM).

    Where the gated peak counts on-chip memory (``combined``: XLA:TPU's ``peak_memory_in_bytes``),
    the first parts are the on-chip bytes live at the step where HBM and on-chip together peak and
    the HBM bytes that step has below the HBM peak; the rest is set against that step's bytes and the
    allocations of every space. Otherwise everything is HBM: ``allocated − peak`` is temp-block
    space not live at the timeline's peak; ``gated − allocated`` is what the gated figure counts
    beyond (or below) the allocations. Where the gated peak lies between the two, one part says so;
    where it is below, one part says what it leaves out.
    """
    if gated is None or gated == peak:
        return ()
    source = (record.peak_source if record else None) or "the gated peak"
    hbm = "device memory (HBM)" if combined is not None or chip_temps else "device memory"
    if combined is None:
        spaces = ", ".join(hbm if a.color == DEVICE_COLOR else _space_name(a.color, xla_names)
                           for a in sorted({a.color: a for a in temps}.values(), key=lambda a: a.color)) or "none"
        return _rest(peak, gated, allocated, record, source, spaces, "the timeline's peak")
    chip_total = sum(n for _, n in combined.chip)
    listed = ", ".join(f"{name} {n:,} B" for name, n in combined.chip if n) or "none"
    parts = [TimelineDifference(
        f"on-chip memory live at step {combined.step}, where {hbm} and on-chip memory together hold the most "
        f"({listed}): {source} counts it with the HBM, but it is not HBM (the timeline's bytes leave it out)",
        chip_total)]
    if combined.device_bytes != peak:
        parts.append(TimelineDifference(
            f"{hbm} live at step {combined.step} is {peak - combined.device_bytes:,} B below the timeline's peak "
            f"(step {combined.step} is not the HBM peak)", combined.device_bytes - peak))
    colors = sorted({a.color for a in (*temps, *chip_temps)})
    spaces = ", ".join(hbm if c == DEVICE_COLOR else _space_name(c, xla_names) for c in colors) or "none"
    rest = _rest(combined.device_bytes + chip_total, gated, combined.allocated, record, source, spaces,
                 f"step {combined.step}")
    return tuple(p for p in parts if p.bytes) + rest


def _rest(peak: int, gated: int, allocated: int, record: MemoryRecord | None, source: str, spaces: str,
          where: str) -> tuple[TimelineDifference, ...]:
    """``gated − peak`` named against the allocations: the temp blocks' bytes not live at ``where``
    (``allocated − peak``) and the gated figure's distance from the allocations."""
    if gated == peak:
        return ()
    unused, beyond = allocated - peak, gated - allocated
    if beyond >= 0:
        parts = []
        if unused:
            parts.append(TimelineDifference(
                f"temp blocks ({spaces}): bytes not live at {where} (XLA's heap packing leaves gaps; "
                "the buffers placed there are live at other steps)", unused))
        if beyond:
            parts.append(TimelineDifference(_beyond_text(beyond, source, record), beyond))
        return tuple(parts)
    if gated > peak:
        return (TimelineDifference(
            f"{source} counts {gated - peak:,} B of the temp blocks ({spaces}) that are not live at {where} "
            f"(of {unused:,} B: XLA's heap packing leaves gaps)", gated - peak),)
    return (TimelineDifference(
        f"{source} is {peak - gated:,} B below the bytes live at {where}: it leaves out temporaries "
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
