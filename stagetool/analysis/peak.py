"""What is live at the memory peak, found without running the program.

How (verified on jax/jaxlib 0.7.2, 0.10.2 and 0.12.0.1, CPU): ``stagetool.staging.stages``
compiles with ``compiler_options={"xla_dump_to": DIR, "xla_dump_hlo_as_text": True}`` (the one
compile of the run) and hands the dump's text over in
:class:`~stagetool.staging.gather.PeakDump`. XLA writes, per module,
``module_NNNN.<name>.<backend>_after_optimizations-live-range.txt`` (its "Live ranges at N
(peak)" section lists every buffer live at the peak with its bytes, followed by a "Stack trace
breakdown for peak usage" tree by op name) and ``...-memory-usage-report.txt``; jaxlib ≤ 0.9.2
writes the same section at the end of ``...-buffer-assignment.txt``
(:func:`stagetool.core.compat.read_live_range` finds either). Op names are read in one
spelling whatever the release (:func:`stagetool.core.compat.normalise_op_name`). ``xla_dump_to`` alone is enough (text is XLA's default
dump format; ``xla_dump_hlo_as_text`` only makes that explicit); no ``xla_dump_hlo_pass_re``
is needed, and per-pass dumps stay off. The dump also holds the pre-optimisation HLO and,
on CPU, a few small LLVM IR / object files; the directory is always removed afterwards.

Buffers are named ``<instruction>{<shape index>}``; the instruction's shape and its
``metadata={op_name=... stack_frame_id=N}`` come from the optimised module text, and the
stack frame resolves through the ``FileNames`` / ``FunctionNames`` / ``FileLocations`` /
``StackFrames`` tables at the top of that text to the user's file and line.

**What the live-range dump counts, and what this module counts.** XLA's "Live ranges at N (peak)"
lists every HLO *value* live at the peak, in every memory space: a donated parameter and the output
that reuses its buffer are two values of one buffer (the donated ``x*2+1`` on ``f32[1024,1024]``:
8,388,608 B listed, 4,194,304 B allocated), a loop's carry is listed as the ``while`` operand and
again as the body's parameter, and on TPU the on-chip VMEM buffers, XLA's async copies
(``copy-start``/``copy-done``: prefetches into on-chip memory, offloads to host) and host buffers
(``pinned_host``, layout ``S(5)``) are listed beside the device's (HBM) buffers. The compile's
buffer assignment (:attr:`PeakDump.buffers`, read by :mod:`stagetool.hlo.buffers`) names each
value's allocation, memory space (color) and offset, so :func:`peak_report` counts every buffer
once (values at the same allocation and offset are one buffer) and splits the bytes by memory
space: ``peak_bytes`` (memory space 0) is the device memory (HBM) live at the peak, an async
copy's value counted in the space its buffer is in (the ``copy-start`` of XLA:TPU's prefetch into
VMEM shares its parameter's HBM buffer); host memory (``S(5)``) and on-chip spaces (VMEM, SMEM) are
apart. Without a buffer assignment ``copy-start``/``copy-done`` values are apart as ``async copy``
(they may alias their operand).

**This is not the gated peak.** The gated peak (:attr:`stagetool.analysis.memory.MemoryRecord.peak_bytes`)
is the larger of ``arguments + outputs - aliased + temporaries`` and XLA's ``peak_memory_in_bytes``,
both from ``Compiled.memory_analysis()``, so that every command gates the same number whether or not
it takes this dump. With a buffer assignment the buffers are listed at the memory timeline's
peak (:mod:`stagetool.analysis.timeline`, the step where the assignment holds the most device
memory), not at XLA's "Live ranges at N (peak)" position, which XLA picks by another sum (see
:func:`peak_report`'s ``at``); then the device bytes are the timeline's peak to the byte and each
on-chip space's bytes are the timeline's ``on_chip`` figure at its peak. The device bytes live at the
peak have been at most the gated peak on every program measured (CPU: equal for the donated
``x*2+1``; TPU ``v5e:2x4`` transformer, libtpu 0.10.2: 5,926,400 B device (HBM) + 34,848,768 B VMEM
live against a gated 47,579,136 B); when they are more,
:attr:`PeakReport.note` says so. :mod:`stagetool.analysis.timeline` sets its own maximum against the
gated peak and names the difference.

Callers can pass their own ``resolve`` callable to :func:`peak_report`.

The dump files' syntax (this live-range text, and the ``HloProto`` with the buffer assignment that
the memory timeline reads) is read by :mod:`stagetool.hlo.buffers` alone; its records are
re-exported here. ``memory_analysis().serialized_buffer_assignment_proto`` is not used: it is
empty on compile-only TPU and GPU targets, while the dump's ``HloProto`` is written everywhere.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stagetool.hlo.buffers import (  # the one reader of the dump's files; re-exported here
    LiveBuffer,
    PeakLiveRange,
    PeakOpShare,
    parse_live_range_peak,
)
from stagetool.core.compat import normalise_op_name
from stagetool.facts import PeakDump

if TYPE_CHECKING:
    from stagetool.facts import StagedFunction
    from stagetool.hlo.parser import HloModule

__all__ = ["BufferSlot", "HOST_MEMORY_SPACE", "space_label", "LiveBuffer", "ModuleIndex", "PeakBuffer", "PeakLiveRange",
           "PeakOpShare", "PeakReport", "SourceLocation", "buffer_slots", "live_at", "parse_live_range_peak",
           "peak_report"]



@dataclasses.dataclass(frozen=True)
class SourceLocation:
    """Where an HLO instruction came from.

    Attributes:
      op_name: the JAX op name from the instruction metadata (``"jit(f)/sin"``), one spelling
        whatever the release (:func:`stagetool.core.compat.normalise_op_name`), or None.
      file: the user's source file (innermost recorded frame), or None.
      line: 1-based line number in ``file``, or None.
      function: the function name of that frame, or None.
    """

    op_name: str | None
    file: str | None
    line: int | None
    function: str | None = None


Resolver = Callable[[str], SourceLocation]
"""``resolve(instruction_name) -> SourceLocation``."""


@dataclasses.dataclass(frozen=True)
class DonatedCopy:
    """A ``copy`` XLA makes of a donated input (:meth:`ModuleIndex.donated_copy`).

    Attributes:
      input: the input's name (its parameter's op name, ``cache``), or ``parameter N``.
      parameter: the entry parameter number.
      read_at / written_at: ``file:line (op)`` of the lines that read the input's old value, and of
        the in-place writes into its buffer.
    """

    input: str
    parameter: int
    read_at: tuple[str, ...]
    written_at: tuple[str, ...]

    def why(self, name: str) -> str:
        """The sentence a report says about it (``name``: the copy's instruction)."""
        read = ", ".join(self.read_at) or "another instruction"
        written = ", ".join(self.written_at) or "the output that reuses its buffer"
        return (f"{name} is a copy of the donated input {self.input} (parameter {self.parameter}) that XLA makes "
                f"anyway: its old value is read at {read} while its buffer is written in place at {written} (the "
                "update that becomes the aliased output), so XLA's copy insertion keeps the old value apart and the "
                "donation does not save these bytes")


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
    """A buffer live at the peak, attributed to the user's code.

    Attributes:
      value_name, instruction_name, size_bytes: see :class:`LiveBuffer` (bytes per device).
      shape: HLO shape of that value, e.g. ``"f32[2048,2048]"`` (layout dropped), or None.
      op_name: JAX op name, or None.
      file, line, function: the user's source location, or None.
      memory_space: ``"device"`` (memory space 0: HBM on TPU and GPU), ``"host"`` (``S(5)``:
        ``pinned_host``), ``"async copy"`` (a ``copy-start``/``copy-done`` value when there is no buffer
        assignment to say where it lives; with one, its memory space: the source of XLA:TPU's
        prefetch into VMEM is the parameter's own HBM buffer, ``"device"``) or the on-chip space
        (``"VMEM"``, ``"SMEM"``, ``XLA memory space N ("name" to XLA)`` or ``XLA memory space N
        (unnamed)``: :func:`space_label`).
      shared_with: the other HLO values live at the peak in this same buffer (a donated parameter's
        output, a loop carry's body parameter), counted once.
    """

    value_name: str
    instruction_name: str
    size_bytes: int
    shape: str | None
    op_name: str | None
    file: str | None
    line: int | None
    function: str | None
    memory_space: str = "device"
    shared_with: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PeakReport:
    """What is live at the per-device memory peak.

    Attributes:
      peak_bytes: device memory (memory space 0: HBM on TPU and GPU) live at the peak on one
        device, each buffer once (bytes, from XLA's live-range dump and buffer assignment), or
        None. Not the gated peak (see the module docstring).
      position: the peak's index in the scheduled instruction sequence, or None.
      buffers: the largest live buffers (at most ``top``), largest first, each buffer once.
      buffer_count: how many buffers are live at the peak in total (each once, every memory space).
      breakdown: XLA's peak breakdown by op name (see :class:`PeakOpShare`).
      dump_compile_seconds: wall time of the compile that wrote the dump (seconds).
      reason: why nothing was found (None on success).
      host_bytes: host memory (``S(5)``) live at the peak, bytes per device (0 when none).
      other_bytes: ``(memory space, bytes)`` of what else is live at the peak: on-chip spaces
        (``VMEM``) and ``"async copy"``; () when nothing.
      xla_listed_bytes: the sum XLA's live-range dump prints for its peak (every value, every
        memory space, shared buffers once per value), or None.
      note: a sentence when something about the figures needs saying (no buffer assignment to
        count shared buffers once; device bytes above the gated peak; XLA's own peak moment is
        another step), else None.
      step: the entry-computation step of the memory timeline these buffers are taken at (the
        timeline's peak, :attr:`stagetool.analysis.timeline.TimelinePeak.position`), or None when
        they are XLA's "Live ranges at N (peak)" list (no timeline).
      xla_position: the schedule position XLA's live-range dump calls its peak (``N``), or None.
    """

    peak_bytes: int | None
    position: int | None
    buffers: tuple[PeakBuffer, ...]
    buffer_count: int
    breakdown: tuple[PeakOpShare, ...]
    dump_compile_seconds: float | None
    reason: str | None = None
    host_bytes: int = 0
    other_bytes: tuple[tuple[str, int], ...] = ()
    xla_listed_bytes: int | None = None
    note: str | None = None
    step: int | None = None
    xla_position: int | None = None


# --------------------------------------------------------------------------- memory spaces


#: XLA's host memory space (``S(5)`` in a layout; ``pinned_host`` in JAX).
HOST_MEMORY_SPACE = 5
#: On-chip memory spaces as XLA:TPU's memory-usage report names them.
_SPACE_NAMES = {1: "VMEM", 2: "SMEM"}


@dataclasses.dataclass(frozen=True)
class BufferSlot:
    """Where one HLO value lives in the compile's buffer assignment.

    Attributes:
      allocation: the allocation's index.
      color: its memory space (0 device memory, 5 host memory ``S(5)``, others on-chip spaces).
      offset: the value's offset in the allocation, bytes.
      size_bytes: the value's size, bytes.
    """

    allocation: int
    color: int
    offset: int
    size_bytes: int


def buffer_slots(assignment: Any) -> dict[str, BufferSlot]:
    """HLO value name (``"fusion.3{}"``, as the live-range dump writes it) → its :class:`BufferSlot`,
    from a :class:`stagetool.hlo.buffers.BufferAssignment` (None gives ``{}``). Values with the same
    ``(allocation, offset)`` share one buffer."""
    if assignment is None:
        return {}
    by_id = {b.id: b for b in assignment.buffers}
    out: dict[str, BufferSlot] = {}
    for a in assignment.allocations:
        for x in a.assigned:
            b = by_id.get(x.buffer_id)
            if b is not None and b.instruction:
                out.setdefault(b.value_name, BufferSlot(a.index, a.color, x.offset, x.size))
    return out


def space_label(color: int, xla_names: Any = ()) -> str:
    """A memory space other than device memory (0) and host memory (5) as the report names it:
    ``VMEM``/``SMEM`` (1, 2 on TPU), else ``XLA memory space N`` with the name XLA's
    memory-usage report gives it (``("host" to XLA)`` for XLA:TPU's space 4, which is not the
    ``pinned_host`` memory, ``S(5)``) or ``(unnamed)`` where it gives none (XLA:TPU's ``color_6``).
    XLA:TPU's numbering of its other spaces is not documented in XLA's public sources (libtpu's
    compiler is closed); ``xla_names`` is ``PeakDump.space_names``."""
    if color in _SPACE_NAMES:
        return _SPACE_NAMES[color]
    name = dict(xla_names).get(color)
    if name and not re.fullmatch(r"color_?\d+", name):
        return f'XLA memory space {color} ("{name}" to XLA)'
    return f"XLA memory space {color} (unnamed)"


def _space(color: int | None, instruction: str, opcode: str | None, xla_names: Any = ()) -> str:
    if color == HOST_MEMORY_SPACE:
        return "host"
    if color == 0:  # in device memory (HBM) by the buffer assignment, an async copy's source included
        return "device"
    if color is not None:
        return space_label(color, xla_names)
    if opcode in ("copy-start", "copy-done") or (opcode is None and re.match(r"copy-(start|done)\b", instruction)):
        return "async copy"
    return "device"


# --------------------------------------------------------------------------- module text


def module_index(facts: StagedFunction) -> ModuleIndex | None:
    """One :class:`ModuleIndex` of a staged function's peak dump, for the timeline and the peak table
    alike, over the compiled module staging already parsed (:attr:`StagedFunction.module`) when the
    dump describes that same module text: a large module is parsed once, not three times. None
    without a peak dump."""
    dump = facts.peak
    if dump is None:
        return None
    same = facts.compiled_text is not None and dump.module_text == facts.compiled_text
    return ModuleIndex(dump.module_text, facts.module if same else None)


class ModuleIndex:
    """Instruction shapes and source locations of optimised HLO module text, by instruction name.

    A thin view over :func:`stagetool.hlo.parser.parse_hlo_module` (instruction names are unique
    within an HLO module, so a flat mapping is enough).
    """

    def __init__(self, module_text: str, module: HloModule | None = None):
        """``module``: ``module_text`` already parsed (e.g. :attr:`StagedFunction.module`), so that a
        large module is not parsed again; parsed here when None."""
        from stagetool.hlo.parser import parse_hlo_module

        self._module = module if module is not None else parse_hlo_module(module_text)
        self._text = module_text
        self._by_name = {i.name: i for c in self._module.computations for i in c.instructions}
        self._library_files: dict[str, bool] = {}

    def shape(self, instruction_name: str, shape_index: tuple[int, ...] = ()) -> str | None:
        """HLO shape of an instruction's result (or of one tuple element), layouts dropped."""
        from stagetool.hlo.parser import ArrayShape, TupleShape

        ins = self._by_name.get(instruction_name)
        shape = ins.shape if ins is not None else None
        for i in shape_index:
            if not isinstance(shape, TupleShape) or i >= len(shape.elements):
                return None
            shape = shape.elements[i]
        if isinstance(shape, ArrayShape):
            return shape.type_text()
        if isinstance(shape, TupleShape):
            return "(" + ", ".join(a.type_text() for a in shape.arrays()) + ")"
        return None

    def entry_names(self) -> frozenset[str]:
        """Names of the entry computation's instructions."""
        entry = self._module.entry
        return frozenset(i.name for i in entry.instructions) if entry is not None else frozenset()

    def root_operands(self) -> dict[str, int]:
        """``operand name -> output index`` of the entry's ROOT tuple (``{root: 0}`` when it is no tuple)."""
        entry = self._module.entry
        root = entry.root if entry is not None else None
        if root is None:
            return {}
        if root.opcode != "tuple":
            return {root.name: 0}
        out: dict[str, int] = {}
        for i, name in enumerate(root.operands):
            out.setdefault(name, i)
        return out

    def opcode(self, instruction_name: str) -> str | None:
        """The instruction's opcode (``"copy-start"``), or None when the module has no such instruction."""
        ins = self._by_name.get(instruction_name)
        return ins.opcode if ins is not None else None

    def op_and_source(self, instruction_name: str) -> tuple[str | None, str | None]:
        """``(op name, "file:line")`` of an instruction, Nones where unknown (see :meth:`resolve`)."""
        loc = self.resolve(instruction_name)
        return loc.op_name, (f"{loc.file}:{loc.line}" if loc.file else None)

    def donated_copy(self, instruction_name: str) -> DonatedCopy | None:
        """What a metadata-less ``copy`` of a donated entry parameter is (:class:`DonatedCopy`): XLA
        keeps the input's old value apart because something reads it while its buffer is written in
        place (a donated carry read beside its update). The readers are the chain's users whose result
        is not of the parameter's shape; the writers the ones whose result is (the in-place update
        that becomes the aliased output). None for any other instruction."""
        ins = self._by_name.get(instruction_name)
        if ins is None or ins.opcode != "copy" or (ins.metadata is not None and ins.metadata.op_name):
            return None
        chain, cur = [ins.name], ins
        while cur is not None and cur.opcode == "copy" and cur.operands:
            cur = self._by_name.get(cur.operands[0])
            if cur is not None:
                chain.append(cur.name)
        if cur is None or cur.opcode != "parameter" or cur.name not in self.entry_names():
            return None
        number = cur.parameter_number
        if number is None or number not in self._donated():
            return None
        users = self._entry_users()
        copies = set(chain)
        seen: set[str] = set()
        frontier = [c for c in chain if c != cur.name]
        while frontier:  # the copies made from this one (XLA:CPU copies the copy before the write)
            name = frontier.pop()
            for u in users.get(name, ()):
                if self._by_name[u].opcode == "copy" and u not in copies:
                    copies.add(u)
                    frontier.append(u)
        readers, writers = [], []
        for name in sorted(copies - {cur.name}, key=lambda n: self._by_name[n].line_number):
            for u in users.get(name, ()):
                if u in copies or u in seen:
                    continue
                seen.add(u)
                user = self._by_name[u]
                if user.opcode == "tuple":
                    continue
                (writers if user.shape_text.split("{")[0] == cur.shape_text.split("{")[0] else readers).append(u)
        op = cur.metadata.op_name if cur.metadata is not None and cur.metadata.op_name else f"parameter {number}"

        def where(names: list[str]) -> tuple[str, ...]:
            out = []
            for n in names:
                loc = self.resolve(n)
                if loc.file:
                    out.append(f"{loc.file}:{loc.line}" + (f" ({_last(loc.op_name)})" if loc.op_name else ""))
            return tuple(dict.fromkeys(out))

        return DonatedCopy(op, number, where(readers), where(writers))

    def _donated(self) -> frozenset[int]:
        if not hasattr(self, "_donated_numbers"):
            from stagetool.hlo.parser import parse_input_output_alias

            self._donated_numbers = frozenset(e.parameter_number for e in parse_input_output_alias(self._text))
        return self._donated_numbers

    def _entry_users(self) -> dict[str, list[str]]:
        if not hasattr(self, "_users"):
            users: dict[str, list[str]] = {}
            entry = self._module.entry
            for i in (entry.instructions if entry is not None else ()):
                for o in i.operands:
                    users.setdefault(o, []).append(i.name)
            self._users = users
        return self._users

    def resolve(self, instruction_name: str) -> SourceLocation:
        """Op name and innermost recorded source frame of an instruction (Nones when unknown). A
        metadata-less copy of a donated input (:meth:`donated_copy`) is named ``copy of INPUT
        (donated)``, at the line that reads the input's old value."""
        ins = self._by_name.get(instruction_name)
        if ins is None:
            return SourceLocation(None, None, None, None)
        copy = self.donated_copy(instruction_name) if ins.opcode == "copy" else None
        if copy is not None:
            read = copy.read_at[0] if copy.read_at else None
            file, _, rest = (read or "").partition(" (")[0].rpartition(":")
            return SourceLocation(f"copy of {copy.input} (donated)", file or None,
                                  int(rest) if rest.isdigit() else None, None)
        op_name = normalise_op_name(ins.metadata.op_name) if ins.metadata is not None else None
        from stagetool.hlo.collectives import program_frames

        # cut at stagetool's first frame: the frames above it are how stagetool was called (the facts
        # cache does not key on them), never the program's
        stack = self._module.source_stack(ins)
        frames = program_frames(stack) or stack[:1]
        if not frames:
            return SourceLocation(op_name, None, None, None)
        from stagetool.core.paths import is_library_file

        # The innermost frame in the user's code (any file outside the libraries), else the innermost.
        # A module names few files, each asked about for many instructions: remember the answer.
        def in_library(file: str) -> bool:
            if file not in self._library_files:
                self._library_files[file] = is_library_file(file)
            return self._library_files[file]

        frame = next((f for f in frames if not in_library(f.file)), frames[0])
        return SourceLocation(op_name, frame.file, frame.line, frame.function)


# --------------------------------------------------------------------------- the report


def peak_report(dump: PeakDump, *, top: int = 10, resolve: Resolver | None = None,
                gated_peak_bytes: int | None = None, at: int | None = None, step: int | None = None,
                index: ModuleIndex | None = None) -> PeakReport:
    """Largest buffers live at the per-device memory peak, from the dump staging took with the
    compile (:class:`stagetool.staging.gather.PeakDump`), each buffer once and in its memory space,
    attributed to its shape, op name and source line.

    Args:
      dump: the dump's live-range text, buffer assignment and the compiled module text.
      top: how many buffers to return (largest first).
      resolve: ``instruction_name -> SourceLocation``; default: the compiled module's own text
        (:class:`ModuleIndex`).
      gated_peak_bytes: the gated peak (``MemoryRecord.peak_bytes``); when the device bytes live at
        the peak are more, ``note`` says so.
      at: a position of the flattened schedule (the memory timeline's peak,
        :attr:`stagetool.analysis.timeline.TimelinePeak.schedule_position`): list the buffers live
        there, counted as the timeline counts them (:func:`live_at`), instead of at the position
        XLA's dump calls its peak. XLA (``HloLiveRange::ComputePeakMemoryMoment``) picks that
        position by adding up HLO values in event order, each at its *instruction's* size (a
        tuple's elements at the tuple's pointer table) and a step's new values before the ones that
        die at that step, so it can be a step where fewer bytes are live than at the maximum (the
        JAX training cookbook on 8 CPU devices: XLA's 253, 12,317,328 B listed, while step 233 holds
        12,458,996 B; the transformer example: 205 against the timeline's 346). Ignored without a
        buffer assignment.
      step: the timeline's step of ``at`` (entry-computation steps), for the title.
      index: a :class:`ModuleIndex` of ``dump.module_text`` (built when None; pass
        :func:`module_index`'s to parse the module once for the timeline and this table).

    Returns:
      A :class:`PeakReport`; with ``reason`` set and no buffers when XLA wrote no live-range file
      (e.g. the executable came from the persistent compilation cache). Never raises for that.
    """
    seconds = dump.compile_seconds
    if dump.live_range_text is None:
        return PeakReport(None, None, (), 0, (), seconds, dump.reason or "no live-range dump")
    live = parse_live_range_peak(dump.live_range_text)
    if live is None:
        return PeakReport(None, None, (), 0, (), seconds, "no 'Live ranges at N (peak)' section in the dump")
    if index is None:
        index = ModuleIndex(dump.module_text)
    res = resolve or index.resolve
    assignment = dump.buffers
    slots = buffer_slots(assignment)
    listed = live.buffers
    whole: dict[int, int] = {}  # parameter and output allocations: counted whole (XLA allocates them for the call)
    if at is not None and slots:
        listed, whole = live_at(dump.live_range_text, at, assignment)
    else:
        at, step = live.position, None
    names = dump.space_names
    device, host, other, counted = _count(listed, slots, whole, index, names)
    counted.sort(key=lambda t: (-t[0].size_bytes, t[0].value_name))
    out = []
    notes = []
    for b, space, shared in counted[:max(top, 0)]:
        loc = res(b.instruction_name)
        out.append(PeakBuffer(b.value_name, b.instruction_name, b.size_bytes,
                              index.shape(b.instruction_name, b.shape_index),
                              loc.op_name, loc.file, loc.line, loc.function, space, shared))
        copy = index.donated_copy(b.instruction_name)
        if copy is not None:
            notes.append(copy.why(b.instruction_name))
    if not slots:
        notes.append("no buffer assignment in the dump (" + (dump.buffers_reason or "not read")
                     + "): values that share a buffer may be counted twice")
    if gated_peak_bytes is not None and device > gated_peak_bytes:
        notes.append(f"the device buffers live at the peak ({device} B) are more than the gated peak "
                     f"({gated_peak_bytes} B): memory_analysis() and the live-range dump disagree")
    if step is not None and live.position is not None and live.position != at and \
            _totals(live_at(dump.live_range_text, live.position, assignment), slots, index, names) \
            != (device, host, tuple(sorted(other.items()))):  # a tie is no news
        notes.append(f"XLA's live-range dump calls schedule position {live.position} its peak "
                     f"({live.peak_bytes:,} B of HLO values listed there): it picks that moment by adding up HLO "
                     "values, a tuple's elements at the tuple's size and a step's new values before the ones that "
                     "die there, not the bytes its buffer assignment holds; this table is at the memory timeline's "
                     "peak, the step holding the most")
    unnamed = sorted(k for k in other if k.startswith("XLA memory space"))
    if unnamed:
        notes.append(f"{', '.join(unnamed)}: the compiler's own numbering; XLA's public sources name only 0 "
                     "(device), 1 (fast, VMEM on TPU) and 5 (host: pinned_host); counted apart from device memory")
    breakdown = tuple(dataclasses.replace(b, name=normalise_op_name(b.name)) for b in live.breakdown)
    return PeakReport(device, at, tuple(out), len(counted), breakdown, seconds,
                      host_bytes=host, other_bytes=tuple(sorted(other.items())), xla_listed_bytes=live.peak_bytes,
                      note="; ".join(notes) or None, step=step, xla_position=live.position)


def _count(listed: Any, slots: dict[str, BufferSlot], whole: dict[int, int], index: ModuleIndex,
           xla_names: Any = ()) -> tuple[int, int, dict[str, int], list[tuple[LiveBuffer, str, tuple[str, ...]]]]:
    """``(device, host, other spaces, buffers)``: the listed values as buffers, each once (values at
    one allocation and offset, or in one parameter/output allocation of ``whole``, are one buffer)."""
    groups: dict[object, list[LiveBuffer]] = {}
    for b in listed:  # largest first: the first value of a buffer names it
        slot = slots.get(b.value_name)
        key = ((slot.allocation,) if slot.allocation in whole else (slot.allocation, slot.offset)) \
            if slot is not None else b.value_name
        groups.setdefault(key, []).append(b)
    device, host = 0, 0
    other: dict[str, int] = {}
    counted: list[tuple[LiveBuffer, str, tuple[str, ...]]] = []
    for members in groups.values():
        first = members[0]
        slot = slots.get(first.value_name)
        space = _space(slot.color if slot is not None else None, first.instruction_name,
                       index.opcode(first.instruction_name), xla_names)
        size = max(m.size_bytes for m in members)
        if slot is not None and slot.allocation in whole:
            size = whole[slot.allocation]
        if space == "device":
            device += size
        elif space == "host":
            host += size
        else:
            other[space] = other.get(space, 0) + size
        counted.append((first, space, tuple(m.value_name for m in members[1:])))
    return device, host, other, counted


def _totals(found: tuple[tuple[LiveBuffer, ...], dict[int, int]], slots: dict[str, BufferSlot],
            index: ModuleIndex, xla_names: Any = ()) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    device, host, other, _ = _count(found[0], slots, found[1], index, xla_names)
    return device, host, tuple(sorted(other.items()))


def live_at(live_range_text: str, at: int, assignment: Any) -> tuple[tuple[LiveBuffer, ...], dict[int, int]]:
    """The HLO values live at position ``at`` of the flattened schedule (the dump's
    ``BufferLiveRange`` section: ``start <= at <= end``), counted as
    :mod:`stagetool.analysis.timeline` counts them, and the parameter and output allocations.

    Values in constant or thread-local allocations are left out; every parameter and output
    allocation (every memory space but host) is live for the whole call, so it is listed with every
    value it holds, live at ``at`` or not (a donated parameter after its last use and the output
    written into its buffer are one buffer).

    Returns:
      ``(values, whole)``: the values, largest first, each with its size in bytes from the buffer
      assignment; ``whole`` maps each parameter or output allocation's index to its size (bytes).
    """
    from stagetool.hlo.buffers import parse_live_ranges

    ranges = parse_live_ranges(live_range_text)
    by_id = {b.id: b for b in assignment.buffers}
    by_value = {b.value_name: b for b in assignment.buffers}
    place: dict[int, tuple[Any, int]] = {}
    for a in assignment.allocations:
        for x in a.assigned:
            place[x.buffer_id] = (a, x.size)
    whole = {a.index: a.size for a in assignment.allocations
             if (a.parameter_number is not None or a.maybe_live_out) and a.color != HOST_MEMORY_SPACE
             and not a.is_constant and not a.is_thread_local}
    out: list[LiveBuffer] = []
    for value, (start, end) in ranges.ranges.items():
        if not start <= at <= end:
            continue
        b = by_value.get(value)
        placed = place.get(b.id) if b is not None else None
        if placed is None or placed[0].is_constant or placed[0].is_thread_local or placed[0].index in whole:
            continue
        out.append(LiveBuffer(value, b.instruction, b.shape_index, placed[1]))
    for a in assignment.allocations:  # every value a parameter or output allocation holds names it
        if a.index in whole:
            for x in a.assigned:
                b = by_id.get(x.buffer_id)
                if b is not None and b.instruction:
                    out.append(LiveBuffer(b.value_name, b.instruction, b.shape_index, x.size))
    out.sort(key=lambda b: (-b.size_bytes, b.value_name))
    return tuple(out), whole


def _last(op_name: str) -> str:
    """The last part of a JAX op name (``jit(step)/mul`` → ``mul``)."""
    return op_name.rstrip("/").rsplit("/", 1)[-1]
