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
from tests.hlo.test_buffers import LIVE_RANGE, hand_built

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


# ---- HBM and on-chip memory apart (issue 41, item 5), compile-only TPU ------------------------------

def _dumped(lowered, folder):
    """Compile with XLA's dump kept in ``folder``: ``(memory record, PeakDump, folder)``; the dump's
    text files stay for an independent count."""
    compiled = lowered.compile({**stages.DUMP_OPTIONS, "xla_dump_to": str(folder)})
    text = compiled.as_text()
    live, reason = stages.read_live_range(str(folder), text)
    assignment, why = stages.read_buffer_assignment(str(folder), text)
    dump = stages.PeakDump(live, text, 1.0, reason, assignment, why, stages.read_space_names(str(folder), text))
    return normalise_memory(compiled.memory_analysis()), dump


def _live_by_space(folder) -> tuple[int, dict[int, list[int]]]:
    """Bytes live per memory space at each position of the flattened schedule, read straight from
    XLA's text dump (``*-buffer-assignment.txt``'s allocations and values, ``*-live-range.txt``'s
    ``BufferLiveRange``), not from the HloProto stagetool reads: parameter and output allocations whole
    at every position, a temp block's live values as the union of their byte ranges; constants,
    thread-local slots and host memory (color 5) left out. Returns ``(positions, {color: bytes})``."""
    import re
    from pathlib import Path

    (assign,) = Path(folder).glob("*after_optimizations-buffer-assignment.txt")
    (ranges,) = Path(folder).glob("*after_optimizations-live-range.txt")
    whole: dict[int, int] = {}
    temp_values: list[tuple[int, int, int, int, str]] = []  # color, allocation, offset, end, value
    kind = color = index = None
    for line in assign.read_text().splitlines():
        m = re.match(r"allocation (\d+): size (\d+), (?:color (\d+), )?(.*):$", line)
        if m:
            index, size, color = int(m[1]), int(m[2]), int(m[3] or 0)
            flags = m[4]
            kind = ("skip" if "constant" in flags or "thread-local" in flags or color == 5 else
                    "whole" if "parameter" in flags or "output" in flags or "maybe-live-out" in flags else "temp")
            if kind == "whole":
                whole[index] = (color, size)
            continue
        m = re.match(r" value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)", line)
        if m and kind == "temp":
            name = m[1] if "{" in m[1] else m[1] + "{}"
            temp_values.append((color, index, int(m[3]), int(m[3]) + int(m[2]), name))
    text = ranges.read_text()
    live = {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"^\s+(\S+\{[\d,]*\}):(-?\d+)-(-?\d+)$",
                                                              text.split("BufferLiveRange:")[1], re.M)}
    positions = max(end for _, end in live.values()) + 1
    colors = {c for c, _ in whole.values()} | {v[0] for v in temp_values}
    out = {c: [sum(s for cc, s in whole.values() if cc == c)] * positions for c in colors}
    for c in colors:
        for t in range(positions):
            spans = sorted((a, lo, hi) for cc, a, lo, hi, name in temp_values
                           if cc == c and name in live and live[name][0] <= t <= live[name][1])
            covered, cur = 0, None
            for a, lo, hi in spans:
                if cur and cur[0] == a and lo <= cur[2]:
                    cur = (a, cur[1], max(cur[2], hi))
                    continue
                covered += cur[2] - cur[1] if cur else 0
                cur = (a, lo, hi)
            out[c][t] += covered + (cur[2] - cur[1] if cur else 0)
    return positions, out


libtpu = pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")


@pytest.fixture(scope="module")
def v5e_transformer(tmp_path_factory):
    """The transformer example on a compile-only v5e:2x4 (XLA:TPU keeps its activations in VMEM),
    compiled once with XLA's dump kept: ``(record, dump, folder)``."""
    from test_examples import transformer_stages

    topo = topology.tpu_topology(parse_target("v5e:2x4"))
    lowered = transformer_stages(topology.topology_mesh(topo.devices, (2, 4), ("data", "model")))[2]
    folder = tmp_path_factory.mktemp("v5e-transformer-dump")
    return (*_dumped(lowered, folder), folder)


@libtpu
@pytest.mark.slow
def test_v5e_timeline_counts_hbm_and_keeps_vmem_apart(v5e_transformer):
    """Issue 41 item 5: the timeline's bytes are device memory (HBM, color 0) alone: at its peak, the
    color-0 allocations' live bytes counted from XLA's text dump; VMEM (color 1) is reported apart
    (live at the peak and at most), never added; the named differences still sum to the gated peak.
    Before: 40,776,192 B "at the peak", 34,848,768 B of it VMEM."""
    record, dump, folder = v5e_transformer
    points, peak = timeline.memory_timeline(dump, gated_peak=record.peak_bytes, record=record, top=1000)
    _, live = _live_by_space(folder)
    t = peak.schedule_position
    assert peak.bytes == live[0][t] == max(live[0]) == max(p.bytes for p in points)
    chip = {s.memory_space: s for s in peak.on_chip}
    assert chip[1].space == "VMEM" and chip[1].at_peak_bytes == live[1][t] and chip[1].max_bytes == max(live[1])
    assert chip[1].max_bytes > 5 * peak.bytes > 0  # the VMEM scratch the timeline used to add to the HBM
    assert {c: (s.at_peak_bytes, s.max_bytes) for c, s in chip.items()} == {
        c: (live[c][t], max(live[c])) for c in live if c != 0}
    # buffers: HBM ones in `buffers` (summing to the HBM bytes), on-chip ones apart with their space
    assert all(b.memory_space == 0 for b in peak.buffers) and peak.buffer_count == len(peak.buffers)
    assert sum(b.bytes for b in peak.buffers) == peak.bytes
    assert peak.on_chip_buffer_count == len(peak.on_chip_buffers) > 0
    assert sum(b.bytes for b in peak.on_chip_buffers if b.memory_space == 1) == chip[1].at_peak_bytes
    assert 0 not in {b.memory_space for b in peak.on_chip_buffers}
    # the gated peak is XLA:TPU's peak_memory_in_bytes, which counts on-chip memory with HBM: the
    # differences name the on-chip part as on-chip, and sum exactly
    assert record.peak_bytes == record.peak_bytes_reported
    assert peak.bytes + sum(d.bytes for d in peak.differences) == record.peak_bytes
    first = peak.differences[0]
    both = [live[0][i] + sum(live[c][i] for c in live if c != 0) for i in range(len(live[0]))]
    t_both = both.index(max(both))
    assert first.what.startswith("on-chip memory live at step") and "VMEM" in first.what and "not HBM" in first.what
    assert first.bytes == sum(live[c][t_both] for c in live if c != 0)
    assert not any("leaves out temporaries" in d.what for d in peak.differences)
    # the peak-buffer table at the same position agrees: device bytes are the HBM bytes, VMEM apart
    from stagetool.analysis.peak import peak_report

    table = peak_report(dump, top=1000, at=t, step=peak.position, gated_peak_bytes=record.peak_bytes)
    assert table.peak_bytes == peak.bytes
    assert dict(table.other_bytes)["VMEM"] == chip[1].at_peak_bytes


@libtpu
def test_xla_tpu_peak_memory_counts_vmem_with_hbm(tmp_path):
    """What the first difference says, measured: XLA:TPU's peak_memory_in_bytes on a small v5e train
    step (256×256 weight, 1024×256 batch, three tanh layers) is the most HBM + on-chip bytes live at
    any step, to the byte, and more than the HBM alone; the timeline's peak is the HBM alone and the
    differences bridge the two."""
    device = topology.tpu_topology(parse_target("v5e:2x2")).devices[0]
    sh = jax.sharding.SingleDeviceSharding(device)

    def loss(w, x):
        for _ in range(3):
            x = jnp.tanh(x @ w)
        return (x ** 2).sum()

    lowered = jax.jit(lambda w, x: w - 0.1 * jax.grad(loss)(w, x)).lower(
        jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=sh),
        jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=sh))
    record, dump = _dumped(lowered, tmp_path)
    _, live = _live_by_space(tmp_path)
    both = max(sum(live[c][i] for c in live) for i in range(len(live[0])))
    assert record.peak_bytes_reported == both > max(live[0])
    _, peak = timeline.memory_timeline(dump, gated_peak=record.peak_bytes, record=record)
    assert peak.bytes == max(live[0]) and peak.on_chip
    assert peak.bytes + sum(d.bytes for d in peak.differences) == record.peak_bytes
    assert all("temp blocks" not in d.what and "more than" not in d.what for d in peak.differences)


def test_the_timeline_and_the_peak_table_share_one_parse_of_the_module(monkeypatch):
    """``memory`` parsed the compiled module three times (staging's ``facts.module``, the timeline's
    and the peak table's ModuleIndex; 30 ms each on the transformer example, linear in the text). With
    :func:`module_index` the two analyses reuse staging's parse when the dump describes the same
    text, and give the same answer as with their own parse."""
    import types

    from stagetool.analysis import peak as peak_mod
    from stagetool.hlo import parser

    dump = stages.PeakDump(LIVE_RANGE, MODULE, 1.0, None, buffers.read_hlo_proto(hand_built()))
    own_points, own_peak = timeline.memory_timeline(dump, gated_peak=450)
    own_table = peak_mod.peak_report(dump, at=own_peak.schedule_position, step=own_peak.position)
    facts = types.SimpleNamespace(peak=dump, compiled_text=MODULE, module=parser.parse_hlo_module(MODULE))
    calls = []
    real = parser.parse_hlo_module
    monkeypatch.setattr(parser, "parse_hlo_module", lambda text: calls.append(text) or real(text))
    index = peak_mod.module_index(facts)
    points, peak = timeline.memory_timeline(dump, gated_peak=450, index=index)
    table = peak_mod.peak_report(dump, at=peak.schedule_position, step=peak.position, index=index)
    assert calls == []
    assert (points, peak, table) == (own_points, own_peak, own_table)
    # A dump of another text than the compiled one (never shared): parsed on its own.
    other = types.SimpleNamespace(peak=dump, compiled_text=MODULE + "\n", module=facts.module)
    peak_mod.module_index(other)
    assert calls == [MODULE]
    assert peak_mod.module_index(types.SimpleNamespace(peak=None)) is None
