"""Tests of stagetool.analysis.peak: the buffers live at the memory peak, with source lines."""

from __future__ import annotations

import inspect
import os
import tempfile

import jax
import jax.numpy as jnp
import pytest

from stagetool.analysis import peak
from stagetool.staging import stages

N = 1024
F32 = 4


def outer_then_reduce(x, y):
    # The N x N intermediate that dominates the peak. Sorted, so that every release keeps it in
    # memory: XLA:CPU fuses sin(outer) into a sum without materialising it (jaxlib 0.10+) or
    # reduces it in 32-row windows (0.7); a sort needs the whole array.
    big = jnp.sort(jnp.sin(x[:, None] * y[None, :]), axis=1)
    return big[:, 0]


def _line_of(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if marker in ln)


def peak_buffers(lowered, *, top=10, resolve=None):
    """The peak report of one compile with XLA's dump (as the pipeline takes it)."""
    return peak.peak_report(stages.compile_with_dump(lowered)[1], top=top, resolve=resolve)


@pytest.fixture(scope="module")
def lowered():
    x = jax.ShapeDtypeStruct((N,), jnp.float32)
    return jax.jit(outer_then_reduce).trace(x, x).lower()


def test_peak_names_the_large_intermediate_and_its_source_line(lowered):
    report = peak_buffers(lowered, top=3)
    assert report.reason is None
    top = report.buffers[0]
    assert top.size_bytes == N * N * F32
    assert top.shape == f"f32[{N},{N}]"
    assert top.file == __file__
    assert top.line == _line_of(outer_then_reduce, "big = jnp.sort")
    assert top.op_name.endswith("/sort")
    # inputs and output are live too: peak = big + 2 inputs + output, all per device
    assert report.peak_bytes == N * N * F32 + 3 * N * F32
    assert report.buffer_count == 4 and len(report.buffers) == 3
    assert [b.size_bytes for b in report.buffers] == sorted((b.size_bytes for b in report.buffers), reverse=True)
    assert report.breakdown[0].depth == 0 and report.breakdown[0].total_bytes == report.peak_bytes
    assert any(s.name.endswith("/sort") and s.current_bytes == N * N * F32 for s in report.breakdown)
    assert report.dump_compile_seconds > 0


@pytest.mark.jax_version(">=0.8", reason="jax 0.7 records one frame per op (source_file/source_line), no function")
def test_peak_names_the_function_of_the_source_line(lowered):
    assert peak_buffers(lowered, top=1).buffers[0].function == "outer_then_reduce"


def test_resolve_callable_is_used(lowered):
    seen = []

    def resolve(name):
        seen.append(name)
        return peak.SourceLocation("op:" + name, "f.py", 7, "g")

    report = peak_buffers(lowered, top=1, resolve=resolve)
    assert seen == [report.buffers[0].instruction_name]
    assert (report.buffers[0].op_name, report.buffers[0].file, report.buffers[0].line) == (
        "op:" + seen[0], "f.py", 7)


def _tracking_mkdtemp(monkeypatch):
    made = []
    real = tempfile.mkdtemp

    def mkdtemp(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return made


def test_dump_dir_is_removed(lowered, monkeypatch):
    made = _tracking_mkdtemp(monkeypatch)
    peak_buffers(lowered, top=1)
    assert len(made) == 1 and not os.path.exists(made[0])


def test_dump_dir_removed_and_reason_given_when_compile_fails(monkeypatch):
    made = _tracking_mkdtemp(monkeypatch)

    class Broken:
        def compile(self, compiler_options=None):
            with open(os.path.join(compiler_options["xla_dump_to"], "partial.txt"), "w") as fh:
                fh.write("x")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):  # the pipeline reports it as the compile's failure
        stages.compile_with_dump(Broken())
    assert not os.path.exists(made[0])


def test_no_live_range_file_gives_reason(monkeypatch):
    class NoDump:
        def compile(self, compiler_options=None):
            return type("C", (), {"as_text": lambda self: "HloModule jit_f\n"})()

    report = peak_buffers(NoDump())  # e.g. an executable from the persistent compilation cache
    assert "no live-range dump" in report.reason and report.peak_bytes is None


def test_dump_options_are_exactly_these():
    # the only options the dump compile adds (besides xla_dump_to): keep the dump small; the proto
    # holds the buffer assignment the memory timeline reads
    assert stages.DUMP_OPTIONS == {"xla_dump_hlo_as_text": True, "xla_dump_hlo_as_proto": True}


_LIVE_RANGE = """\
HloLiveRange (max 9):
  InstructionSequence:
    0:p.1
  BufferLiveRange:
    p.1{}:0-9
  Live ranges at 5 (peak):
    tuple.2{1}: 64 bytes (cumulative: 64 bytes)
    fusion.7{}: 4096 bytes (cumulative: 4160 bytes)
    p.1{}: 64 bytes (cumulative: 4224 bytes)
  Stack trace breakdown for peak usage: 4 224 bytes
    main.9 (100.0%, total: 4 224 bytes, current: 0 bytes, remaining: 4 224 bytes)
      ├── jit(f)/outer (98.5%, total: 4 160 bytes, current: 64 bytes, remaining: 64 bytes)
      │   └── jit(f)/inner (97.0%, total: 4 096 bytes, current: 4 096 bytes, remaining: 0 bytes)
      └── p (1.5%, total: 64 bytes, current: 64 bytes, remaining: 0 bytes)
"""


def test_parse_live_range_peak():
    live = peak.parse_live_range_peak(_LIVE_RANGE)
    assert live.position == 5 and live.peak_bytes == 4224
    assert [(b.value_name, b.instruction_name, b.shape_index, b.size_bytes) for b in live.buffers] == [
        ("fusion.7{}", "fusion.7", (), 4096), ("p.1{}", "p.1", (), 64), ("tuple.2{1}", "tuple.2", (1,), 64)]
    assert [(s.name, s.depth, s.total_bytes, s.current_bytes) for s in live.breakdown] == [
        ("main.9", 0, 4224, 0), ("jit(f)/outer", 1, 4160, 64), ("jit(f)/inner", 2, 4096, 4096), ("p", 1, 64, 64)]
    assert live.breakdown[1].share == pytest.approx(0.985)
    assert peak.parse_live_range_peak("HloLiveRange (max 1):\n") is None


_MODULE = """\
HloModule jit_f, is_scheduled=true

FileNames
1 "/src/model.py"

FunctionNames
1 "layer"

FileLocations
1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=3 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

ENTRY %main.3 (p.1: f32[16]) -> (f32[16], s32[2,3]) {
  %p.1 = f32[16]{0} parameter(0), metadata={op_name="p"}
  %fusion.7 = f32[32,32]{1,0:T(8,128)} fusion(%p.1), kind=kLoop, metadata={op_name="jit(f)/mul" stack_frame_id=1}
  ROOT %tuple.2 = (f32[16]{0}, s32[2,3]{1,0}) tuple(%p.1, %c), metadata={op_name="jit(f)/t"}
}
"""


def test_module_index_shapes_and_locations():
    idx = peak.ModuleIndex(_MODULE)
    assert idx.shape("fusion.7") == "f32[32,32]"
    assert idx.shape("tuple.2", (1,)) == "s32[2,3]"
    assert idx.shape("tuple.2") == "(f32[16], s32[2,3])"
    assert idx.shape("p.1", (0,)) is None and idx.shape("nope") is None
    assert idx.resolve("fusion.7") == peak.SourceLocation("jit(f)/mul", "/src/model.py", 42, "layer")
    assert idx.resolve("p.1") == peak.SourceLocation("p", None, None, None)
    assert idx.resolve("nope") == peak.SourceLocation(None, None, None, None)


def test_peak_is_per_device_on_a_sharded_mesh():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct((N,), jnp.float32, sharding=NamedSharding(mesh, P(("data", "model"))))
    y = jax.ShapeDtypeStruct((N,), jnp.float32, sharding=NamedSharding(mesh, P()))
    report = peak_buffers(jax.jit(outer_then_reduce).trace(x, y).lower(), top=1)
    top = report.buffers[0]
    assert top.size_bytes == N // 8 * N * F32
    assert top.shape == f"f32[{N // 8},{N}]"
    assert top.line == _line_of(outer_then_reduce, "big = jnp.sort")


def test_a_donated_buffer_and_its_output_count_once():
    """Donated x*2+1 on f32[1024,1024]: XLA's live-range dump lists the parameter and the output that
    reuses its buffer (8,388,608 B); they are one buffer, counted once: 4,194,304 B, equal to
    memory_analysis()'s arguments + outputs - aliased + temporaries and to XLA's peak_memory_in_bytes."""
    from stagetool.analysis import memory

    x = jax.ShapeDtypeStruct((N, N), jnp.float32)
    compiled, dump = stages.compile_with_dump(jax.jit(lambda x: x * 2 + 1, donate_argnums=0).trace(x).lower())
    report = peak.peak_report(dump)
    assert report.xla_listed_bytes == 2 * N * N * F32
    assert report.peak_bytes == N * N * F32 and report.buffer_count == 1
    (only,) = report.buffers
    assert only.memory_space == "device" and len(only.shared_with) == 1
    stats = compiled.memory_analysis()
    rec = memory.normalise_memory(stats)
    assert rec.peak_bytes == N * N * F32 == stats.peak_memory_in_bytes
    assert report.note is None


def _assignment():
    """A buffer assignment like XLA:TPU's: a parameter shared with a loop carry (one buffer), a host
    (S(5)) offload buffer, a VMEM buffer, and a temp block holding a fusion and a copy-done."""
    from stagetool.hlo.buffers import Allocation, AssignedBuffer, BufferAssignment, LogicalBuffer

    values = [LogicalBuffer(1, 4096, "p.1", ()), LogicalBuffer(9, 4096, "loop", (1,)),
              LogicalBuffer(2, 4096, "copy-start", (0,), 5), LogicalBuffer(3, 2048, "fusion.1", (), 1),
              LogicalBuffer(4, 4096, "fusion.2", ()), LogicalBuffer(5, 4096, "copy-done", ())]

    def alloc(i, size, color, *placed, parameter=None):
        return Allocation(i, size, color, False, False, False, parameter, False,
                          tuple(AssignedBuffer(b, o, n) for b, o, n in placed))

    return BufferAssignment("m", "main", tuple(values), (
        alloc(0, 4096, 0, (1, 0, 4096), (9, 0, 4096), parameter=0), alloc(1, 8192, 5, (2, 0, 4096)),
        alloc(2, 4096, 1, (3, 0, 2048)), alloc(3, 8192, 0, (4, 0, 4096), (5, 4096, 4096))))


_LIVE = """HloLiveRange (max 5):
  Live ranges at 3 (peak):
    copy-done{}: 4096 bytes (cumulative: 4096 bytes)
    copy-start{0}: 4096 bytes (cumulative: 8192 bytes)
    fusion.2{}: 4096 bytes (cumulative: 12288 bytes)
    loop{1}: 4096 bytes (cumulative: 16384 bytes)
    p.1{}: 4096 bytes (cumulative: 20480 bytes)
    fusion.1{}: 2048 bytes (cumulative: 22528 bytes)
"""


def test_buffer_slots_name_allocation_memory_space_and_offset():
    slots = peak.buffer_slots(_assignment())
    assert slots["p.1{}"] == slots["loop{1}"] == peak.BufferSlot(0, 0, 0, 4096)
    assert slots["copy-start{0}"] == peak.BufferSlot(1, 5, 0, 4096)
    assert slots["fusion.1{}"].color == 1 and slots["copy-done{}"] == peak.BufferSlot(3, 0, 4096, 4096)
    assert peak.buffer_slots(None) == {}


def test_live_buffers_split_by_memory_space_each_once():
    """A loop carry and its parameter share a buffer (once); host (S(5)) is never device memory; an
    async copy's value is in its buffer's memory space (the copy-done written into device memory is
    device memory: issue 41, item 5), and ``async copy`` only without a buffer assignment; an on-chip
    space is named."""
    dump = stages.PeakDump(_LIVE, "HloModule m\n", 0.1, None, _assignment())
    nowhere = lambda name: peak.SourceLocation(None, None, None)  # noqa: E731
    report = peak.peak_report(dump, resolve=nowhere)
    assert report.xla_listed_bytes == 22528
    assert report.peak_bytes == 4096 + 4096 + 4096  # p.1 (= loop{1}), fusion.2 and copy-done
    assert report.host_bytes == 4096
    assert report.other_bytes == (("VMEM", 2048),)
    assert report.buffer_count == 5
    spaces = {b.value_name: (b.memory_space, b.shared_with) for b in report.buffers}
    assert spaces["loop{1}"] == ("device", ("p.1{}",))
    assert spaces["copy-start{0}"][0] == "host" and spaces["copy-done{}"][0] == "device"
    assert spaces["fusion.1{}"][0] == "VMEM"
    assert report.note is None
    over = peak.peak_report(dump, resolve=nowhere, gated_peak_bytes=4096)
    assert "more than the gated peak" in over.note
    blind = peak.peak_report(stages.PeakDump(_LIVE, "HloModule m\n", 0.1, buffers_reason="no .hlo.pb"), resolve=nowhere)
    assert "no buffer assignment in the dump (no .hlo.pb)" in blind.note and blind.host_bytes == 0
    assert {b.value_name: b.memory_space for b in blind.buffers}["copy-done{}"] == "async copy"


def test_memory_space_names_come_from_xlas_memory_usage_report():
    """Trial 2, finding 14d: XLA:TPU's ``*-memory-usage-report.txt`` (libtpu 0.0.42.1, the training
    cookbook on v5e:2x4; headings copied from that dump) names its spaces ``default``, ``vmem``,
    ``smem``, ``host`` (4: not pinned_host, which is 5) and ``color_6`` (no name); XLA's public
    ``Layout`` names only 0, 1 and 5."""
    from stagetool.hlo.buffers import parse_memory_space_names

    report = ("Memory Space: default (color=0)\nTotal bytes: 3241984 (3.09MiB)\n  cumulative_size;\n"
              "Memory Space: vmem (color=1)\nMemory Space: smem (color=2)\nMemory Space: host (color=4)\n"
              "Memory Space: color_6 (color=6)\n")
    names = parse_memory_space_names(report)
    assert names == ((0, "default"), (1, "vmem"), (2, "smem"), (4, "host"), (6, "color_6"))
    assert [peak.space_label(c, names) for c in (1, 2, 4, 6, 7)] == [
        "VMEM", "SMEM", 'XLA memory space 4 ("host" to XLA)', "XLA memory space 6 (unnamed)",
        "XLA memory space 7 (unnamed)"]
