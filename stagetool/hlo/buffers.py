"""The one reader of XLA's buffer-assignment dumps: the ``HloProto`` binary and the live-range text.

Why a reader of our own: the compile that takes the peak dump (``stagetool.staging.stages``, with
``xla_dump_to``) also writes ``<module>.<backend>_after_optimizations.hlo.pb`` when
``xla_dump_hlo_as_proto`` is set: an ``xla.HloProto`` whose ``buffer_assignment`` says which
allocation (and offset in it) every HLO value occupies and holds XLA's heap-simulator trace. jaxlib
ships no Python class for ``hlo.proto`` and no pip package does, so the few messages needed are
decoded here from the protobuf wire format, following the public schema
(``xla/service/hlo.proto`` in openxla/xla; field numbers below). Nothing else in stagetool reads
protobuf bytes or these dump files' syntax.

Messages read (field numbers of the schema):

* ``HloProto``: ``hlo_module`` = 1, ``buffer_assignment`` = 3.
* ``HloModuleProto``: ``name`` = 1, ``entry_computation_name`` = 2, ``computations`` = 3;
  ``HloComputationProto``: ``name`` = 1, ``instructions`` = 2, ``id`` = 5;
  ``HloInstructionProto``: ``name`` = 1, ``opcode`` = 2, ``id`` = 35. Only names and ids are read:
  XLA 0.10's ``LogicalBufferProto.Location`` names its instruction by id alone (the deprecated
  ``instruction_name`` is empty), and the id is the *unique* id, ``computation id << 32 |
  instruction id``.
* ``BufferAssignmentProto``: ``logical_buffers`` = 1, ``buffer_allocations`` = 3,
  ``heap_simulator_traces`` = 4.
* ``LogicalBufferProto``: ``id`` = 1, ``size`` = 2, ``defined_at`` = 3 (``Location``:
  ``instruction_name`` = 2, ``shape_index`` = 3, ``instruction_id`` = 4), ``color`` = 4.
* ``BufferAllocationProto``: ``index`` = 1, ``size`` = 2, ``is_thread_local`` = 3,
  ``is_entry_computation_parameter`` = 5, ``parameter_number`` = 6, ``maybe_live_out`` = 7,
  ``color`` = 8, ``assigned`` = 9 (``logical_buffer_id`` = 1, ``offset`` = 2, ``size`` = 3),
  ``is_tuple`` = 11, ``is_constant`` = 12.
* ``HeapSimulatorTrace``: ``events`` = 1 (``kind`` = 1: ALLOC 0, FREE 1, SHARE_WITH 2;
  ``buffer_id`` = 2; ``computation_name`` = 3; ``instruction_name`` = 4;
  ``share_with_canonical_id`` = 5), ``whole_module_simulation`` = 2,
  ``buffer_allocation_index`` = 3.

Fields this reader does not know are skipped (the wire format says how long each is), so a newer
XLA that adds fields still reads; a truncated or malformed message raises :class:`ProtoError`.

The live-range text (``*-live-range.txt``, written with ``xla_dump_to``) gives the flattened
instruction sequence XLA's ``HloLiveRange`` works on (called computations — loop bodies and
conditions — placed just before the instruction that calls them) and, per HLO value
(``name{shape index}``), its ``[start, end]`` positions in that sequence; its "Live ranges at N
(peak)" section lists the values live at XLA's peak. Verified on jax/jaxlib 0.10.2 (CPU and
compile-only TPU).
"""

from __future__ import annotations

import dataclasses
import re

__all__ = [
    "ALLOC",
    "FREE",
    "SHARE_WITH",
    "Allocation",
    "AssignedBuffer",
    "BufferAssignment",
    "HeapEvent",
    "LiveBuffer",
    "LiveRanges",
    "LogicalBuffer",
    "PeakLiveRange",
    "PeakOpShare",
    "ProtoError",
    "parse_live_range_peak",
    "parse_live_ranges",
    "read_hlo_proto",
]

ALLOC, FREE, SHARE_WITH = 0, 1, 2
"""``HeapSimulatorTrace.Event.Kind`` values."""


class ProtoError(ValueError):
    """The bytes are not a well-formed protobuf message of the expected kind."""


# --------------------------------------------------------------------------- wire format


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise ProtoError("truncated varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ProtoError("varint longer than 10 bytes")


def _fields(data: bytes):
    """Yield ``(field number, wire type, value)``: an int for varints (wire type 0), bytes for
    length-delimited fields (2), the raw 8 or 4 bytes for fixed ones (1, 5)."""
    i, n = 0, len(data)
    while i < n:
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            length, i = _varint(data, i)
            if i + length > n:
                raise ProtoError(f"field {number}: length {length} runs past the message")
            value = data[i:i + length]
            i += length
        elif wire == 1:
            value, i = data[i:i + 8], i + 8
        elif wire == 5:
            value, i = data[i:i + 4], i + 4
        else:
            raise ProtoError(f"field {number}: unknown wire type {wire}")
        if i > n:
            raise ProtoError(f"field {number}: runs past the message")
        yield number, wire, value


def _int64(value: int) -> int:
    """A varint read as a two's-complement int64 (proto ``int64``)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _ints(wire: int, value) -> list[int]:
    """A repeated int64 field's values: packed (wire type 2) or one unpacked varint."""
    if wire == 0:
        return [_int64(value)]
    if wire != 2:
        raise ProtoError("repeated int64 with a fixed-width wire type")
    out, i = [], 0
    while i < len(value):
        v, i = _varint(value, i)
        out.append(_int64(v))
    return out


def _text(value) -> str:
    return bytes(value).decode("utf-8", errors="replace")


def _need(wire: int, expected: int, what: str) -> None:
    if wire != expected:
        raise ProtoError(f"{what}: wire type {wire}, expected {expected}")


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class LogicalBuffer:
    """One HLO value as buffer assignment sees it (``LogicalBufferProto``).

    Attributes:
      id: the buffer's id (the ``<id name @0>`` of XLA's buffer-assignment text).
      size: bytes (per device: the module is the partitioned one).
      instruction: the name of the instruction that defines it ("" when the id names none).
      shape_index: where in that instruction's (tuple) result, ``()`` for the whole.
      color: the memory space (0: device memory; on TPU 1 is VMEM, 5 host memory).
    """

    id: int
    size: int
    instruction: str
    shape_index: tuple[int, ...]
    color: int = 0

    @property
    def value_name(self) -> str:
        """``name{i,j}`` as the live-range dump writes it."""
        return f"{self.instruction}{{{','.join(str(i) for i in self.shape_index)}}}"


@dataclasses.dataclass(frozen=True)
class AssignedBuffer:
    """A logical buffer placed in an allocation: ``[offset, offset + size)`` bytes of it."""

    buffer_id: int
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One ``BufferAllocationProto``: a block of memory and the buffers placed in it.

    Attributes:
      index: the allocation's index.
      size: bytes.
      color: memory space (as :attr:`LogicalBuffer.color`).
      is_thread_local, is_tuple, is_constant: XLA's flags (thread-local: a stack slot, not device
        memory XLA allocates; constant: the executable's own data).
      parameter_number: the entry parameter this allocation holds, or None.
      maybe_live_out: holds (part of) the program's output.
      assigned: the buffers placed in it, in XLA's order.
    """

    index: int
    size: int
    color: int
    is_thread_local: bool
    is_tuple: bool
    is_constant: bool
    parameter_number: int | None
    maybe_live_out: bool
    assigned: tuple[AssignedBuffer, ...]

    @property
    def is_temp(self) -> bool:
        """Neither a parameter, an output, a constant nor thread-local: XLA's temp block."""
        return (self.parameter_number is None and not self.maybe_live_out and not self.is_constant
                and not self.is_thread_local)


@dataclasses.dataclass(frozen=True)
class HeapEvent:
    """One heap-simulator event: ``kind`` (:data:`ALLOC`, :data:`FREE`, :data:`SHARE_WITH`) of
    ``buffer_id``, while XLA processed ``instruction`` of ``computation``; ``share_with`` is the
    canonical buffer a SHARE_WITH reuses (None otherwise)."""

    kind: int
    buffer_id: int
    computation: str
    instruction: str
    share_with: int | None = None


@dataclasses.dataclass(frozen=True)
class HeapTrace:
    """One ``HeapSimulatorTrace``: the events in XLA's order, for one allocation (or the whole
    module, ``whole_module``)."""

    events: tuple[HeapEvent, ...]
    whole_module: bool
    allocation_index: int


@dataclasses.dataclass(frozen=True)
class BufferAssignment:
    """What :func:`read_hlo_proto` reads from an ``HloProto``.

    Attributes:
      module: the module's name.
      entry: the entry computation's name.
      buffers: every logical buffer, by id order.
      allocations: every allocation, by index.
      traces: the heap-simulator traces.
    """

    module: str
    entry: str
    buffers: tuple[LogicalBuffer, ...]
    allocations: tuple[Allocation, ...]
    traces: tuple[HeapTrace, ...] = ()

    def shares(self) -> dict[int, int]:
        """``buffer id -> canonical buffer id`` for every SHARE_WITH event of the traces (a buffer
        that reuses another's memory instead of a region of its own)."""
        return {e.buffer_id: e.share_with for t in self.traces for e in t.events
                if e.kind == SHARE_WITH and e.share_with is not None}


# --------------------------------------------------------------------------- HloProto


def _instruction_names(module: bytes) -> tuple[str, str, dict[int, str]]:
    """``(module name, entry computation name, {unique id: instruction name})``."""
    name = entry = ""
    names: dict[int, str] = {}
    for number, wire, value in _fields(module):
        if number == 1 and wire == 2:
            name = _text(value)
        elif number == 2 and wire == 2:
            entry = _text(value)
        elif number == 3 and wire == 2:
            comp_id, instructions = 0, []
            for n2, w2, v2 in _fields(value):
                if n2 == 5 and w2 == 0:
                    comp_id = _int64(v2)
                elif n2 == 2 and w2 == 2:
                    ins_name, ins_id = "", 0
                    for n3, w3, v3 in _fields(v2):
                        if n3 == 1 and w3 == 2:
                            ins_name = _text(v3)
                        elif n3 == 35 and w3 == 0:
                            ins_id = _int64(v3)
                    instructions.append((ins_id, ins_name))
            for ins_id, ins_name in instructions:
                # Buffer locations name an instruction by its unique id (computation id << 32 | id);
                # older XLA wrote the bare id, which is kept as a second key when it is free.
                names[(comp_id << 32) | (ins_id & 0xFFFFFFFF)] = ins_name
                names.setdefault(ins_id, ins_name)
    return name, entry, names


def _logical_buffer(data: bytes, names: dict[int, str]) -> LogicalBuffer:
    bid = size = color = 0
    instruction, index, ins_id = "", [], None
    for number, wire, value in _fields(data):
        if number == 1 and wire == 0:
            bid = _int64(value)
        elif number == 2 and wire == 0:
            size = _int64(value)
        elif number == 4 and wire == 0:
            color = _int64(value)
        elif number == 3:
            _need(wire, 2, "LogicalBufferProto.defined_at")
            for n2, w2, v2 in _fields(value):
                if n2 == 2 and w2 == 2:
                    instruction = _text(v2)
                elif n2 == 3:
                    index.extend(_ints(w2, v2))
                elif n2 == 4 and w2 == 0:
                    ins_id = _int64(v2)
    if not instruction and ins_id is not None:
        instruction = names.get(ins_id, "")
    return LogicalBuffer(bid, size, instruction, tuple(index), color)


def _allocation(data: bytes) -> Allocation:
    f = {"index": 0, "size": 0, "color": 0, "thread_local": False, "tuple": False, "constant": False,
         "is_param": False, "param": 0, "live_out": False}
    assigned = []
    flags = {3: "thread_local", 5: "is_param", 7: "live_out", 11: "tuple", 12: "constant"}
    ints = {1: "index", 2: "size", 6: "param", 8: "color"}
    for number, wire, value in _fields(data):
        if wire == 0 and number in flags:
            f[flags[number]] = bool(value)
        elif wire == 0 and number in ints:
            f[ints[number]] = _int64(value)
        elif number == 9:
            _need(wire, 2, "BufferAllocationProto.assigned")
            a = {1: 0, 2: 0, 3: 0}
            for n2, w2, v2 in _fields(value):
                if w2 == 0 and n2 in a:
                    a[n2] = _int64(v2)
            assigned.append(AssignedBuffer(a[1], a[2], a[3]))
    return Allocation(f["index"], f["size"], f["color"], f["thread_local"], f["tuple"], f["constant"],
                      f["param"] if f["is_param"] else None, f["live_out"], tuple(assigned))


def _trace(data: bytes) -> HeapTrace:
    events, whole, index = [], False, 0
    for number, wire, value in _fields(data):
        if number == 1:
            _need(wire, 2, "HeapSimulatorTrace.events")
            e = {1: 0, 2: 0, 5: None}
            comp = ins = ""
            for n2, w2, v2 in _fields(value):
                if w2 == 0 and n2 in e:
                    e[n2] = _int64(v2)
                elif n2 == 3 and w2 == 2:
                    comp = _text(v2)
                elif n2 == 4 and w2 == 2:
                    ins = _text(v2)
            events.append(HeapEvent(e[1], e[2], comp, ins, e[5] if e[1] == SHARE_WITH else None))
        elif number == 2 and wire == 0:
            whole = bool(value)
        elif number == 3 and wire == 0:
            index = _int64(value)
    return HeapTrace(tuple(events), whole, index)


def read_hlo_proto(data: bytes, *, traces: bool = True) -> BufferAssignment:
    """Read the buffer assignment of a serialized ``xla.HloProto`` (the ``*.hlo.pb`` file XLA
    dumps after optimisations with ``xla_dump_hlo_as_proto``).

    Instruction names of the buffers come from the proto's own module (unique ids → names).
    ``traces=False`` leaves the heap-simulator events out (two per buffer; what a buffer shares is
    also in its allocation offset, which is what the memory timeline reads).

    Raises:
      ProtoError: the bytes are not an ``HloProto`` with a buffer assignment.
    """
    module = assignment = None
    for number, wire, value in _fields(bytes(data)):
        if number == 1 and wire == 2:
            module = value
        elif number == 3 and wire == 2:
            assignment = value
    if assignment is None:
        raise ProtoError("the HloProto holds no buffer_assignment (field 3)")
    name, entry, names = _instruction_names(module) if module is not None else ("", "", {})
    buffers, allocations, kept = [], [], []
    for number, wire, value in _fields(assignment):
        if number == 1:
            _need(wire, 2, "BufferAssignmentProto.logical_buffers")
            buffers.append(_logical_buffer(value, names))
        elif number == 3:
            _need(wire, 2, "BufferAssignmentProto.buffer_allocations")
            allocations.append(_allocation(value))
        elif number == 4 and traces:
            _need(wire, 2, "BufferAssignmentProto.heap_simulator_traces")
            kept.append(_trace(value))
    buffers.sort(key=lambda b: b.id)
    allocations.sort(key=lambda a: a.index)
    return BufferAssignment(name, entry, tuple(buffers), tuple(allocations), tuple(kept))


# --------------------------------------------------------------------------- live-range text


@dataclasses.dataclass(frozen=True)
class LiveRanges:
    """The ``InstructionSequence`` and ``BufferLiveRange`` sections of a live-range dump.

    Attributes:
      sequence: instruction names in the flattened schedule, position by position.
      ranges: ``value name -> (start, end)`` positions (inclusive), e.g. ``"x.1{}" -> (0, 4)``; an
        end one past the last position means live out of the program.
    """

    sequence: tuple[str, ...]
    ranges: dict[str, tuple[int, int]]


_SEQ_LINE = re.compile(r"^\s+(\d+):(\S+)\s*$")
_RANGE_LINE = re.compile(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)\s*$")


def parse_live_ranges(text: str) -> LiveRanges:
    """Read the flattened schedule and every value's ``[start, end]`` from a live-range dump.

    Lines this reader does not recognise are skipped; a file without those sections gives an
    empty sequence.
    """
    sequence: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "InstructionSequence:":
            section = "seq"
            continue
        if stripped == "BufferLiveRange:":
            section = "ranges"
            continue
        if stripped.startswith("Live ranges at") or not line.startswith(" "):
            section = None if not stripped.startswith("HloLiveRange") else section
            continue
        if section == "seq":
            m = _SEQ_LINE.match(line)
            if m and int(m.group(1)) == len(sequence):
                sequence.append(m.group(2))
        elif section == "ranges":
            m = _RANGE_LINE.match(line)
            if m:
                ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return LiveRanges(tuple(sequence), ranges)


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """One buffer live at the peak, as listed in the live-range dump.

    Attributes:
      value_name: the HLO value, ``"<instruction>{<shape index>}"`` (``"fusion.3{}"``).
      instruction_name: the instruction that defines it.
      shape_index: shape index within the instruction's (tuple) result, ``()`` for the whole.
      size_bytes: bytes of this buffer on one device.
    """

    value_name: str
    instruction_name: str
    shape_index: tuple[int, ...]
    size_bytes: int


@dataclasses.dataclass(frozen=True)
class PeakOpShare:
    """One node of the "Stack trace breakdown for peak usage" tree.

    Attributes:
      name: op name (``"jit(f)/sin"``) or computation name at the root.
      depth: 0 for the root, 1 for its children, ...
      share: fraction of the peak (0..1), as XLA printed it (one decimal of a percent).
      total_bytes: bytes attributed to this node and its children.
      current_bytes: bytes attributed to this node itself.
    """

    name: str
    depth: int
    share: float
    total_bytes: int
    current_bytes: int


@dataclasses.dataclass(frozen=True)
class PeakLiveRange:
    """The peak section of one live-range dump file.

    Attributes:
      position: index in the instruction sequence where the peak occurs.
      peak_bytes: bytes live at the peak (per device), from the breakdown header or the
        last cumulative figure.
      buffers: every buffer live at the peak, largest first (ties by name).
      breakdown: the stack-trace breakdown tree in file order.
    """

    position: int | None
    peak_bytes: int | None
    buffers: tuple[LiveBuffer, ...]
    breakdown: tuple[PeakOpShare, ...]


_PEAK_HEADER = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_BUFFER_LINE = re.compile(r"^\s+(\S+?)(\{[\d,]*\}): (\d+) bytes")
_BREAKDOWN_HEADER = re.compile(r"^\s*Stack trace breakdown for peak usage: ([\d ]+) bytes")
_BREAKDOWN_LINE = re.compile(
    r"^(?P<prefix>[\s│├└─]*)(?P<name>.+?) \((?P<pct>[\d.]+)%, total: (?P<total>[\d ]+) bytes, "
    r"current: (?P<cur>[\d ]+) bytes")


def _num(text: str) -> int:
    return int(text.replace(" ", ""))


def _shape_index(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.strip("{}").split(",") if p)


def parse_live_range_peak(text: str) -> PeakLiveRange | None:
    """Parse the "Live ranges at N (peak)" section of an XLA ``*-live-range.txt`` dump.

    Returns None when the file has no peak section.
    """
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if _PEAK_HEADER.match(ln)), None)
    if start is None:
        return None
    position = int(_PEAK_HEADER.match(lines[start]).group(1))
    buffers: list[LiveBuffer] = []
    breakdown: list[PeakOpShare] = []
    peak = None
    last_cumulative = None
    in_breakdown = False
    root_width = 0
    first_child_width = 0
    for ln in lines[start + 1:]:
        hb = _BREAKDOWN_HEADER.match(ln)
        if hb:
            peak = _num(hb.group(1))
            in_breakdown = True
            continue
        if in_breakdown:
            m = _BREAKDOWN_LINE.match(ln)
            if not m:
                continue
            width = len(m.group("prefix"))
            if not breakdown:
                root_width = width
            if width <= root_width:
                depth = 0
            else:
                # children start one branch ("├── ") right of the root; each deeper level
                # adds one 4-character column ("│   ").
                first_child_width = first_child_width or width
                depth = 1 + max(width - first_child_width, 0) // 4
            breakdown.append(PeakOpShare(m.group("name"), depth, float(m.group("pct")) / 100.0,
                                         _num(m.group("total")), _num(m.group("cur"))))
            continue
        m = _BUFFER_LINE.match(ln)
        if m:
            buffers.append(LiveBuffer(m.group(1) + m.group(2), m.group(1), _shape_index(m.group(2)),
                                      int(m.group(3))))
            cm = re.search(r"cumulative: (\d+) bytes", ln)
            if cm:
                last_cumulative = int(cm.group(1))
        elif ln.strip() and not ln.startswith(" "):
            break
    if peak is None:
        peak = last_cumulative
    buffers.sort(key=lambda b: (-b.size_bytes, b.value_name))
    return PeakLiveRange(position, peak, tuple(buffers), tuple(breakdown))


# --------------------------------------------------------------------------- memory-usage report


_SPACE_LINE = re.compile(r"^Memory Space: (\S+) \(color=(\d+)\)\s*$")


def parse_memory_space_names(text: str) -> tuple[tuple[int, str], ...]:
    """``((color, name), ...)`` from the ``Memory Space: vmem (color=1)`` headings of XLA's
    ``*-memory-usage-report.txt`` dump, in color order; XLA:TPU (libtpu 0.0.42.1) writes
    ``default`` (0), ``vmem`` (1), ``smem`` (2), ``host`` (4) and ``color_6`` (6: no name of its own).
    Lines this reader does not recognise are skipped."""
    found: dict[int, str] = {}
    for line in text.splitlines():
        m = _SPACE_LINE.match(line)
        if m:
            found.setdefault(int(m.group(2)), m.group(1))
    return tuple(sorted(found.items()))
