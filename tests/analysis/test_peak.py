"""Tests of stagetool.analysis.peak: the buffers live at the memory peak, with source lines."""

from __future__ import annotations

import inspect
import os
import tempfile

import jax
import jax.numpy as jnp
import pytest

from stagetool.analysis import peak
from stagetool.lowering import stages

N = 1024
F32 = 4


def outer_then_reduce(x, y):
    big = jnp.sin(x[:, None] * y[None, :])  # the N x N intermediate that dominates the peak
    return big.sum(axis=1)


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
    assert top.line == _line_of(outer_then_reduce, "big = jnp.sin")
    assert top.function == "outer_then_reduce"
    assert top.op_name.endswith("/sin")
    # inputs and output are live too: peak = big + 2 inputs + output, all per device
    assert report.peak_bytes == N * N * F32 + 3 * N * F32
    assert report.buffer_count == 4 and len(report.buffers) == 3
    assert [b.size_bytes for b in report.buffers] == sorted((b.size_bytes for b in report.buffers), reverse=True)
    assert report.breakdown[0].depth == 0 and report.breakdown[0].total_bytes == report.peak_bytes
    assert any(s.name.endswith("/sin") and s.current_bytes == N * N * F32 for s in report.breakdown)
    assert report.dump_compile_seconds > 0


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
    assert top.line == _line_of(outer_then_reduce, "big = jnp.sin")
