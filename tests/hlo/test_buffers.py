"""Tests of stagetool.hlo.buffers, the one reader of XLA's HloProto and live-range dumps.

Hand-built messages are encoded here with a tiny protobuf writer (the wire format: varint keys
``field << 3 | wire type``, length-delimited sub-messages), so the reader is checked against the
schema's field numbers independently of XLA; a real compile's dump then checks it against XLA's
own text dump of the same buffer assignment.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import pytest

from stagetool.hlo import buffers
from stagetool.staging import stages


# --------------------------------------------------------------------------- a protobuf writer


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def v(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def m(field: int, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return _varint(field << 3 | 2) + _varint(len(body)) + body


def s(field: int, text: str) -> bytes:
    return m(field, text.encode())


def packed(field: int, values) -> bytes:
    return m(field, *(_varint(x) for x in values))


COMP = 3  # the entry computation's id: buffers name instructions by (computation id << 32 | id)


def uid(i: int) -> int:
    return COMP << 32 | i


def hand_built() -> bytes:
    """An HloProto: entry ``main`` with x (param), a, b, c (c updates a in place), out.

    Buffers: 10 x 100 B (parameter 0), 11 a 200 B and 13 c 200 B share offset 0 of the temp block,
    12 b 100 B at offset 200, 14 out 50 B (output). One field the schema does not have (99) and a
    fixed64 field are mixed in: the reader must skip them.
    """
    instructions = [("x", 0), ("a", 1), ("b", 2), ("c", 3), ("out", 4)]
    module = (s(1, "m") + s(2, "main") + v(6, COMP)
              + m(3, s(1, "main"), v(5, COMP), *(m(2, s(1, n), s(2, "add"), v(35, i)) for n, i in instructions))
              + m(3, s(1, "other"), v(5, 7), m(2, s(1, "y"), v(35, 0))))
    def lb(bid, size, ins, index=(), color=0, old_name=None):
        loc = v(4, uid(ins)) + (packed(3, index) if index else b"") + (s(2, old_name) if old_name else b"")
        return m(1, v(1, bid), v(2, size), m(3, loc), v(4, color) if color else b"")
    logical = (lb(10, 100, 0) + lb(11, 200, 1) + lb(12, 100, 2, index=(1, 2)) + lb(13, 200, 3)
               + lb(14, 50, 4, old_name="renamed"))
    def assigned(bid, offset, size):
        return m(9, v(1, bid), v(2, offset), v(3, size), v(4, 11))  # 4: a field this reader does not read
    allocations = (m(3, v(1, 0), v(2, 100), v(5, 1), v(6, 0), assigned(10, 0, 100))
                   + m(3, v(1, 1), v(2, 50), v(7, 1), assigned(14, 0, 50))
                   + m(3, v(1, 2), v(2, 300), assigned(11, 0, 200), assigned(12, 200, 100), assigned(13, 0, 200))
                   + m(3, v(1, 3), v(2, 4), v(3, 1))
                   + m(3, v(1, 4), v(2, 8), v(12, 1))
                   + m(3, v(1, 5), v(2, 64), v(8, 5)))
    events = (m(1, v(2, 11), s(3, "main"), s(4, "a")) + m(1, v(1, 0), v(2, 12), s(4, "b"))
              + m(1, v(1, 2), v(2, 13), s(4, "c"), v(5, 11)) + m(1, v(1, 1), v(2, 12), s(4, "c")))
    trace = m(4, events, v(2, 1), v(3, 2))
    unknown = v(99, 5) + _varint(98 << 3 | 1) + b"\x00" * 8
    return m(1, module) + m(3, logical, allocations, trace, unknown) + unknown


def test_reads_every_message_of_a_hand_built_proto():
    ba = buffers.read_hlo_proto(hand_built())
    assert (ba.module, ba.entry) == ("m", "main")
    assert [(b.id, b.size, b.instruction, b.shape_index, b.color) for b in ba.buffers] == [
        (10, 100, "x", (), 0), (11, 200, "a", (), 0), (12, 100, "b", (1, 2), 0), (13, 200, "c", (), 0),
        (14, 50, "renamed", (), 0)]  # the deprecated instruction_name wins where XLA still writes it
    assert ba.buffers[2].value_name == "b{1,2}"
    a = {x.index: x for x in ba.allocations}
    assert a[0].parameter_number == 0 and not a[0].maybe_live_out and not a[0].is_temp
    assert a[1].parameter_number is None and a[1].maybe_live_out
    assert a[2].is_temp and [(x.buffer_id, x.offset, x.size) for x in a[2].assigned] == [
        (11, 0, 200), (12, 200, 100), (13, 0, 200)]
    assert a[3].is_thread_local and a[4].is_constant and a[5].color == 5
    (trace,) = ba.traces
    assert trace.whole_module and trace.allocation_index == 2
    assert [(e.kind, e.buffer_id, e.instruction) for e in trace.events] == [
        (buffers.ALLOC, 11, "a"), (buffers.ALLOC, 12, "b"), (buffers.SHARE_WITH, 13, "c"), (buffers.FREE, 12, "c")]
    assert ba.shares() == {13: 11}
    assert buffers.read_hlo_proto(hand_built(), traces=False).traces == ()


def test_unpacked_shape_index_and_negative_int64():
    body = m(1, v(1, 7), v(2, 8), m(3, v(3, 0), v(3, 4), v(4, 5)), v(4, -1))
    ba = buffers.read_hlo_proto(m(3, body))
    assert ba.buffers[0].shape_index == (0, 4) and ba.buffers[0].color == -1
    assert ba.buffers[0].instruction == ""  # no module: the id names no instruction


@pytest.mark.parametrize("data, message", [
    (m(1, s(1, "m")), "no buffer_assignment"),
    (m(3, m(1, v(1, 1)))[:-1], "runs past"),
    (b"\x1a\xff", "truncated varint"),
    (m(3, _varint(1 << 3 | 3)), "wire type 3"),
    (m(3, v(1, 5)), "wire type 0, expected 2"),
])
def test_malformed_bytes_raise_proto_error(data, message):
    with pytest.raises(buffers.ProtoError, match=message):
        buffers.read_hlo_proto(data)


LIVE_RANGE = """HloLiveRange (max 4):
  InstructionSequence:
    0:x
    1:a
    2:b
    3:c
  BufferLiveRange:
    x{}:0-4
    a{}:1-3
    b{1,2}:2-3
    c{}:3-4
  Live ranges at 3 (peak):
    a{}: 200 bytes (cumulative: 200 bytes)
    c{}: 200 bytes (cumulative: 400 bytes)
"""


def test_live_ranges_are_read_with_their_sequence():
    lr = buffers.parse_live_ranges(LIVE_RANGE)
    assert lr.sequence == ("x", "a", "b", "c")
    assert lr.ranges == {"x{}": (0, 4), "a{}": (1, 3), "b{1,2}": (2, 3), "c{}": (3, 4)}
    peak = buffers.parse_live_range_peak(LIVE_RANGE)
    assert peak.position == 3 and peak.peak_bytes == 400
    assert buffers.parse_live_ranges("nothing here") == buffers.LiveRanges((), {})


def _dump(fn, *args):
    """The raw files of one compile with stagetool's dump options (the folder is removed after)."""
    folder = tempfile.mkdtemp()
    try:
        jax.jit(fn).lower(*args).compile({**stages.DUMP_OPTIONS, "xla_dump_to": folder})
        files = os.listdir(folder)
        text = next(f for f in files if f.endswith("-buffer-assignment.txt"))
        proto = text.replace("-buffer-assignment.txt", ".hlo.pb")
        with open(os.path.join(folder, proto), "rb") as fh, open(os.path.join(folder, text)) as th:
            return fh.read(), th.read()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_real_dump_reads_as_xla_prints_it():
    """Every allocation and every value placed in it, against XLA's own text dump of the same
    buffer assignment (``allocation N: size S ...`` and `` value: <id name @0> (size=,offset=)``)."""
    x = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    data, text = _dump(lambda x: jnp.sin(x) @ jnp.cos(x).T, x)
    ba = buffers.read_hlo_proto(data)
    expected_allocs = {int(i): int(n) for i, n in re.findall(r"^allocation (\d+): size (\d+)", text, re.M)}
    assert {a.index: a.size for a in ba.allocations} == expected_allocs
    placed = {(int(bid), name, int(size), int(off)) for bid, name, size, off in
              re.findall(r"value: <(\d+) (\S+) @\d+> \(size=(\d+),offset=(\d+)\)", text)}
    by_id = {b.id: b for b in ba.buffers}
    got = {(x.buffer_id, by_id[x.buffer_id].instruction, x.size, x.offset) for a in ba.allocations for x in a.assigned}
    assert got == placed and len(placed) >= 4
    # sin and cos: two f32[128,256] temporaries side by side in one temp block.
    (temp,) = [a for a in ba.allocations if a.is_temp]
    assert temp.size == 2 * 128 * 256 * 4


def test_shared_buffers_sit_at_the_same_bytes():
    """The heap simulator's SHARE_WITH pairs (a loop's carried value and its body's) are placed at
    the same offset of the same allocation: what the memory timeline's union of byte ranges relies on."""
    def scanned(x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ c.T @ c), None), x, None, length=4)[0]

    data, _ = _dump(scanned, jax.ShapeDtypeStruct((256, 256), jnp.float32))
    ba = buffers.read_hlo_proto(data)
    shares = ba.shares()
    assert len(shares) >= 2
    where = {x.buffer_id: (a.index, x.offset) for a in ba.allocations for x in a.assigned}
    assert all(where[b] == where[c] for b, c in shares.items())
