"""What is live at the memory peak, found without running the program.

How (verified on jax/jaxlib 0.10.2, CPU): ``stagetool.lowering.stages`` compiles with
``compiler_options={"xla_dump_to": DIR, "xla_dump_hlo_as_text": True}`` (the one compile of the
run) and hands the dump's text over in :class:`~stagetool.lowering.facts.PeakDump`. XLA writes,
per module, ``module_NNNN.<name>.<backend>_after_optimizations-live-range.txt`` (its
"Live ranges at N (peak)" section lists every buffer live at the peak with its bytes,
followed by a "Stack trace breakdown for peak usage" tree by op name) and
``...-memory-usage-report.txt``. ``xla_dump_to`` alone is enough (text is XLA's default
dump format; ``xla_dump_hlo_as_text`` only makes that explicit); no ``xla_dump_hlo_pass_re``
is needed, and per-pass dumps stay off. The dump also holds the pre-optimisation HLO and,
on CPU, a few small LLVM IR / object files; the directory is always removed afterwards.

Buffers are named ``<instruction>{<shape index>}``; the instruction's shape and its
``metadata={op_name=... stack_frame_id=N}`` come from the optimised module text, and the
stack frame resolves through the ``FileNames`` / ``FunctionNames`` / ``FileLocations`` /
``StackFrames`` tables at the top of that text to the user's file and line.

Callers can pass their own ``resolve`` callable to :func:`peak_report`.

The dump files' syntax (this live-range text, and the ``HloProto`` with the buffer assignment that
the memory timeline reads) is read by :mod:`stagetool.hlo.buffers` alone; its records are
re-exported here. ``memory_analysis().serialized_buffer_assignment_proto`` is not used: it is
empty on compile-only TPU and GPU targets, while the dump's ``HloProto`` is written everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from stagetool.hlo.buffers import (  # the one reader of the dump's files; re-exported here
    LiveBuffer,
    PeakLiveRange,
    PeakOpShare,
    parse_live_range_peak,
)
from stagetool.lowering.stages import PeakDump

__all__ = ["LiveBuffer", "ModuleIndex", "PeakBuffer", "PeakLiveRange", "PeakOpShare", "PeakReport",
           "SourceLocation", "parse_live_range_peak", "peak_report"]



@dataclasses.dataclass(frozen=True)
class SourceLocation:
    """Where an HLO instruction came from.

    Attributes:
      op_name: the JAX op name from the instruction metadata (``"jit(f)/sin"``), or None.
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
class PeakBuffer:
    """A buffer live at the peak, attributed to the user's code.

    Attributes:
      value_name, instruction_name, size_bytes: see :class:`LiveBuffer` (bytes per device).
      shape: HLO shape of that value, e.g. ``"f32[2048,2048]"`` (layout dropped), or None.
      op_name: JAX op name, or None.
      file, line, function: the user's source location, or None.
    """

    value_name: str
    instruction_name: str
    size_bytes: int
    shape: str | None
    op_name: str | None
    file: str | None
    line: int | None
    function: str | None


@dataclasses.dataclass(frozen=True)
class PeakReport:
    """What is live at the per-device memory peak.

    Attributes:
      peak_bytes: bytes live at the peak on one device (from XLA's live-range dump), or None.
      position: the peak's index in the scheduled instruction sequence, or None.
      buffers: the largest live buffers (at most ``top``), largest first.
      buffer_count: how many buffers are live at the peak in total.
      breakdown: XLA's peak breakdown by op name (see :class:`PeakOpShare`).
      dump_compile_seconds: wall time of the compile that wrote the dump (seconds).
      reason: why nothing was found (None on success).
    """

    peak_bytes: int | None
    position: int | None
    buffers: tuple[PeakBuffer, ...]
    buffer_count: int
    breakdown: tuple[PeakOpShare, ...]
    dump_compile_seconds: float | None
    reason: str | None = None


# --------------------------------------------------------------------------- module text


class ModuleIndex:
    """Instruction shapes and source locations of optimised HLO module text, by instruction name.

    A thin view over :func:`stagetool.hlo.parser.parse_hlo_module` (instruction names are unique
    within an HLO module, so a flat mapping is enough).
    """

    def __init__(self, module_text: str):
        from stagetool.hlo.parser import parse_hlo_module

        self._module = parse_hlo_module(module_text)
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

    def op_and_source(self, instruction_name: str) -> tuple[str | None, str | None]:
        """``(op name, "file:line")`` of an instruction, Nones where unknown (see :meth:`resolve`)."""
        loc = self.resolve(instruction_name)
        return loc.op_name, (f"{loc.file}:{loc.line}" if loc.file else None)

    def resolve(self, instruction_name: str) -> SourceLocation:
        """Op name and innermost recorded source frame of an instruction (Nones when unknown)."""
        ins = self._by_name.get(instruction_name)
        if ins is None:
            return SourceLocation(None, None, None, None)
        op_name = ins.metadata.op_name if ins.metadata is not None else None
        frames = self._module.source_stack(ins)
        if not frames:
            return SourceLocation(op_name, None, None, None)
        from stagetool.lowering.target import is_library_file

        # The innermost frame in the user's code (any file outside the libraries), else the innermost.
        # A module names few files, each asked about for many instructions: remember the answer.
        def in_library(file: str) -> bool:
            if file not in self._library_files:
                self._library_files[file] = is_library_file(file)
            return self._library_files[file]

        frame = next((f for f in frames if not in_library(f.file)), frames[0])
        return SourceLocation(op_name, frame.file, frame.line, frame.function)


# --------------------------------------------------------------------------- the report


def peak_report(dump: PeakDump, *, top: int = 10, resolve: Resolver | None = None) -> PeakReport:
    """Largest buffers live at the per-device memory peak, from the live-range dump lowering took
    with the compile (:class:`stagetool.lowering.facts.PeakDump`), each attributed to its shape,
    op name and source line.

    Args:
      dump: the dump's live-range text and the compiled module text it describes.
      top: how many buffers to return (largest first).
      resolve: ``instruction_name -> SourceLocation``; default: the compiled module's own text
        (:class:`ModuleIndex`).

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
    index = ModuleIndex(dump.module_text)
    res = resolve or index.resolve
    out = []
    for b in live.buffers[:max(top, 0)]:
        loc = res(b.instruction_name)
        out.append(PeakBuffer(b.value_name, b.instruction_name, b.size_bytes,
                              index.shape(b.instruction_name, b.shape_index),
                              loc.op_name, loc.file, loc.line, loc.function))
    return PeakReport(live.peak_bytes, live.position, tuple(out), len(live.buffers), live.breakdown, seconds)
