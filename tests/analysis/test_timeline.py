"""Tests of stagetool.analysis.timeline: device memory over the program's order.

Peaks are checked against figures known without the timeline: sizes computed by hand from the
shapes, XLA's own ``memory_analysis()`` (its ``peak_memory_in_bytes`` where it counts what the
timeline counts; its argument/output/alias/temp sizes for the allocations), and the function's gated
peak as the report gives it (the timeline's maximum plus the named differences must equal it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from tests.analysis.test_buffers import LIVE_RANGE, hand_built

from stagetool.analysis import timeline
from stagetool.plan.target import parse_target
from stagetool.analysis.memory import normalise_memory
from stagetool.hlo import buffers
from stagetool.staging import stages
from stagetool.devices import tpu_topology as topology

F32 = 4

MODULE = """HloModule m, is_scheduled=true

ENTRY %main (x: f32[25]) -> f32[50] {
  %x = f32[25]{0} parameter(0), metadata={op_name="x"}
  %a = f32[50]{0} broadcast(%x), dimensions={}, metadata={op_name="jit(f)/a" source_file="/u/model.py" source_line=3}
  %b = f32[25]{0} negate(%x), metadata={op_name="jit(f)/b" source_file="/u/model.py" source_line=4}
  ROOT %c = f32[50]{0} add(%a, %a), metadata={op_name="jit(f)/c" source_file="/u/model.py" source_line=5}
}
"""


def test_shared_bytes_count_once_on_a_hand_built_program():
    """x (100 B) and the output (50 B) live throughout; a (200 B) from step 1, b (100 B) at steps
    2-3, and c updating a in place (same 200 B) at step 3: 150, 350, 450, 450 bytes. Summing values
    would give 650 at step 3 (a and c counted apart)."""
    dump = stages.PeakDump(LIVE_RANGE, MODULE, 1.0, None, buffers.read_hlo_proto(hand_built()))
    points, peak = timeline.memory_timeline(dump, gated_peak=450)
    assert [(p.position, p.instruction, p.bytes) for p in points] == [
        (0, "x", 150), (1, "a", 350), (2, "b", 450), (3, "c", 450)]
    assert points[1].op == "jit(f)/a" and points[1].source_line == "/u/model.py:3"
    assert (peak.bytes, peak.position, peak.instruction, peak.differences) == (450, 2, "b", ())
    assert (peak.baseline_bytes, peak.allocated_bytes, peak.host_bytes) == (150, 450, 64)
    assert [(b.bytes, b.kind, b.value) for b in peak.buffers] == [
        (200, "temporary", "a{}"), (100, "temporary", "b{1,2}"), (100, "parameter", "x{}"), (50, "output", "renamed{}")]


def test_a_gated_peak_apart_from_the_timeline_is_named_to_the_byte():
    dump = stages.PeakDump(LIVE_RANGE, MODULE, 1.0, None, buffers.read_hlo_proto(hand_built()))
    record = normalise_memory({"argument_size_in_bytes": 100, "output_size_in_bytes": 50, "alias_size_in_bytes": 0,
                               "temp_size_in_bytes": 300, "generated_code_size_in_bytes": 20,
                               "peak_memory_in_bytes": 470})
    record = dataclasses.replace(record, peak_bytes=470)
    for gated in (470, 440, 400):
        _, peak = timeline.memory_timeline(dump, gated_peak=gated, record=record)
        assert peak.bytes + sum(d.bytes for d in peak.differences) == gated
        assert all(d.what for d in peak.differences)
    _, peak = timeline.memory_timeline(dump, gated_peak=470, record=record)
    assert "peak_memory_in_bytes counts 20 B more" in peak.differences[0].what


def test_no_timeline_without_the_dump_says_why():
    points, peak = timeline.memory_timeline(stages.PeakDump(None, "", None, "no live-range dump"), gated_peak=5)
    assert points is None and peak.bytes is None and peak.reason == "no live-range dump" and peak.gated_peak_bytes == 5
    points, peak = timeline.memory_timeline(stages.PeakDump(LIVE_RANGE, MODULE, 1.0, None, None, "unreadable"),
                                            gated_peak=None)
    assert points is None and peak.reason == "unreadable"


def _timeline(fn, *args, donate=()):
    compiled, dump = stages.compile_with_dump(jax.jit(fn, donate_argnums=donate).lower(*args))
    record = normalise_memory(compiled.memory_analysis())
    points, peak = timeline.memory_timeline(dump, gated_peak=record.peak_bytes, record=record)
    return points, peak, record


def test_sin_cos_peak_is_known_by_hand():
    """x, sin(x) and cos(x) f32[128,256] and the f32[128,128] product: all live at the dot."""
    points, peak, record = _timeline(lambda x: jnp.sin(x) @ jnp.cos(x).T, jax.ShapeDtypeStruct((128, 256), jnp.float32))
    assert peak.bytes == 3 * 128 * 256 * F32 + 128 * 128 * F32 == record.peak_bytes
    assert peak.differences == () and max(p.bytes for p in points) == peak.bytes
    assert points[0].bytes == peak.baseline_bytes == 128 * 256 * F32 + 128 * 128 * F32


def test_donated_step_equals_xla_peak_memory():
    """``x * 2 + 1`` donated: one f32[1024,1024] buffer, in and out; XLA's peak_memory_in_bytes agrees."""
    _, peak, record = _timeline(lambda x: x * 2 + 1, jax.ShapeDtypeStruct((1024, 1024), jnp.float32), donate=(0,))
    assert peak.bytes == 1024 * 1024 * F32 == record.peak_bytes_reported == record.peak_bytes


def test_a_loop_body_is_folded_into_its_while():
    """scan of ``tanh(c @ c.T @ c)``: at the peak, inside the body, x, the output, the loop's carry,
    ``c @ c.T`` and the s32 counter are live (4 arrays of f32[256,256] and 4 bytes); the timeline
    shows it at the ``while`` step of the entry computation."""
    def scanned(x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ c.T @ c), None), x, None, length=4)[0]

    points, peak, record = _timeline(scanned, jax.ShapeDtypeStruct((256, 256), jnp.float32))
    assert peak.bytes == 4 * 256 * 256 * F32 + 4
    assert peak.instruction.startswith("while") and peak.op.endswith("/while")
    # inside the loop, the bytes peak at one of the body's instructions (the dots of the step)
    assert peak.inside is not None and "/while/body/" in peak.inside_op and peak.inside_op.endswith("dot_general")
    assert peak.steps == len(points) < len(buffers.parse_live_ranges(
        stages.compile_with_dump(jax.jit(scanned).lower(jax.ShapeDtypeStruct((256, 256), jnp.float32)))[1]
        .live_range_text).sequence)
    # CPU: the allocations are XLA's arguments + outputs + temp block; what the peak leaves of the
    # block is the one named difference.
    assert peak.allocated_bytes == record.peak_bytes
    assert [d.bytes for d in peak.differences] == [record.peak_bytes - peak.bytes]


@pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_on_a_tpu_topology_the_timeline_is_xla_peak_memory():
    """Compile-only v5e: sin and cos fuse into the dot, so x and the product are all there is, and
    XLA:TPU's peak_memory_in_bytes (its heap simulation) is the timeline's peak."""
    device = topology.tpu_topology(parse_target("v5e:2x2")).devices[0]
    x = jax.ShapeDtypeStruct((128, 256), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    _, peak, record = _timeline(lambda x: jnp.sin(x) @ jnp.cos(x).T, x)
    assert peak.bytes == 128 * 256 * F32 + 128 * 128 * F32 == record.peak_bytes_reported


def test_sparkline_scales_to_the_maximum():
    pts = [timeline.TimelinePoint(i, b, "i") for i, b in enumerate([0, 50, 100, 25])]
    assert timeline.sparkline(pts) == "▁▄█▂"
    assert len(timeline.sparkline(pts * 30, width=40)) == 40 and timeline.sparkline([]) == ""
