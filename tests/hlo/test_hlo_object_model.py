"""The HLO text parser held against jaxlib's own object model of the same compiled module.

``compiled.runtime_executable().hlo_modules()`` (public methods of ``jax.stages.Compiled`` and of
the executable it wraps) returns jaxlib ``HloModule`` objects. In jaxlib 0.10 their public surface
is: ``name``, ``to_string()``, ``computations()`` (each with ``name`` and ``instructions()``;
each instruction with ``name``, ``opcode`` as an ``HloOpcode`` enum member such as
``kAllReduce``, ``operands()`` and ``to_string()``) and ``as_serialized_hlo_module_proto()``.

Two independent views are compared with what :func:`stagetool.hlo.parser.parse_hlo_module`
reads from ``compiled.as_text()``:

* The serialized ``HloModuleProto``. jaxlib ships no importable ``hlo_pb2`` (and ``jax._src`` is
  off limits), so the bytes are decoded here with a small protobuf wire-format reader and the
  field numbers of XLA's ``xla/service/hlo.proto``, which XLA keeps stable (renumbering would
  break every serialized module): module ``name`` 1, ``entry_computation_name`` 2, ``computations`` 3; computation
  ``name`` 1, ``instructions`` 2; instruction ``name`` 1, ``opcode`` 2 (the opcode as XLA spells it
  in text, e.g. ``all-reduce``), ``id`` 35, ``operand_ids`` 36 (ids resolved to names within the
  computation). This is the one public route to the opcode *text*; the enum's names differ from
  the text in ways no rule recovers (``kOptimizationBarrier`` is ``opt-barrier``, ``kExp`` is
  ``exponential``).
* The accessor API: instruction names and operand names exactly, and opcodes up to naming: the
  pairing of parser opcode text with enum member must be one-to-one over the whole module.

The program is a MaxText-like train step: ``lax.scan`` over stacked layers (matmul + tanh), its
gradient and an SGD update, on a 2x4 (data, model) mesh of the 8 simulated CPU devices with the
batch and the weights sharded, so the module holds a while loop, fusions, tuples and collectives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.hlo import parser as hlo

LAYERS, BATCH, WIDTH = 4, 16, 64


def _train_step(params, x, y):
    def loss(params):
        def layer(h, w):
            return jnp.tanh(h @ w["w"] + w["b"]), None

        h, _ = jax.lax.scan(layer, x, params)
        return jnp.mean((h - y) ** 2)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.fixture(scope="module")
def compiled():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    params = {"w": arg((LAYERS, WIDTH, WIDTH), P(None, "data", "model")), "b": arg((LAYERS, WIDTH), P(None, "model"))}
    batch = arg((BATCH, WIDTH), P("data", None))
    with jax.set_mesh(mesh):
        return jax.jit(_train_step).lower(params, batch, batch).compile()


# ---------------------------------------------------------------------------------------------
# A minimal protobuf wire-format reader (varint, 64-bit, length-delimited, 32-bit fields)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def _fields(buf: bytes):
    """(field number, wire type, value) of every field of one message, in order; a varint's value
    is an int, any other field's the raw bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"wire type {wire} (groups) is not used by HloModuleProto")
        yield number, wire, value


def _packed_varints(raw) -> list[int]:
    if isinstance(raw, int):  # a repeated field may also be written unpacked
        return [raw]
    out, i = [], 0
    while i < len(raw):
        v, i = _varint(raw, i)
        out.append(v)
    return out


def _proto_view(serialized: bytes) -> tuple[str, str, dict[str, list[tuple[str, str, tuple[str, ...]]]]]:
    """(module name, entry computation name, {computation: [(name, opcode, operand names)]})."""
    name = entry = ""
    computations: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {}
    for number, _, value in _fields(serialized):
        if number == 1:
            name = value.decode()
        elif number == 2:
            entry = value.decode()
        elif number == 3:
            cname, rows = "", []
            for cnum, _, cval in _fields(value):
                if cnum == 1:
                    cname = cval.decode()
                elif cnum == 2:
                    ins = {"operand_ids": []}
                    for inum, _, ival in _fields(cval):
                        if inum == 1:
                            ins["name"] = ival.decode()
                        elif inum == 2:
                            ins["opcode"] = ival.decode()
                        elif inum == 35:
                            ins["id"] = ival
                        elif inum == 36:
                            ins["operand_ids"] += _packed_varints(ival)
                    rows.append(ins)
            by_id = {r["id"]: r["name"] for r in rows}
            computations[cname] = [(r["name"], r["opcode"], tuple(by_id[i] for i in r["operand_ids"])) for r in rows]
    return name, entry, computations


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def views(compiled):
    (xla_module,) = compiled.runtime_executable().hlo_modules()
    parsed = hlo.parse_hlo_module(compiled.as_text())
    return parsed, xla_module, _proto_view(xla_module.as_serialized_hlo_module_proto())


def test_program_is_a_scanned_sharded_train_step(views):
    """The comparison below covers what matters: a loop over the layers, fusions, collectives."""
    parsed, _, _ = views
    opcodes = {i.opcode for c in parsed.computations for i in c.instructions}
    assert {"while", "fusion", "tuple", "get-tuple-element", "parameter"} <= opcodes
    assert opcodes & {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}
    assert parsed.num_partitions == 8
    assert not parsed.unparsed_lines


def test_parser_matches_the_module_proto(views):
    """Module and entry names, the set of computations and, per computation, the set of instruction
    names and every instruction's opcode text and operand names (in operand order). Orders of
    computations and instructions are not compared: the proto keeps creation order, the text of
    a scheduled module prints callees first and instructions in schedule order."""
    parsed, _, (name, entry, computations) = views
    assert parsed.name == name
    assert parsed.entry_name == entry
    assert sorted(c.name for c in parsed.computations) == sorted(computations)
    for comp in parsed.computations:
        theirs = {n: (op, operands) for n, op, operands in computations[comp.name]}
        assert len(theirs) == len(computations[comp.name])  # names are unique
        ours = {i.name: (i.opcode, i.operands) for i in comp.instructions}
        assert len(ours) == len(comp.instructions)
        assert ours == theirs, comp.name


@pytest.mark.jax_version(">=0.10", reason="jaxlib's HloComputation has no instructions() before 0.10")
def test_parser_matches_the_object_model_accessors(views):
    """Names and operand names straight from the accessors; opcodes through a one-to-one pairing of
    the parser's opcode text with the ``HloOpcode`` member."""
    parsed, xla_module, _ = views
    assert parsed.name == xla_module.name
    accessor = {c.name: c for c in xla_module.computations()}
    assert {c.name for c in parsed.computations} == set(accessor)
    text_to_enum: dict[str, set[str]] = {}
    enum_to_text: dict[str, set[str]] = {}
    count = 0
    for comp in parsed.computations:
        theirs = {i.name: i for i in accessor[comp.name].instructions()}
        assert {i.name for i in comp.instructions} == set(theirs), comp.name
        for ins in comp.instructions:
            other = theirs[ins.name]
            assert ins.operands == tuple(o.name for o in other.operands()), ins.name
            text_to_enum.setdefault(ins.opcode, set()).add(other.opcode.name)
            enum_to_text.setdefault(other.opcode.name, set()).add(ins.opcode)
            count += 1
    assert count == sum(len(c.instructions()) for c in xla_module.computations())
    assert all(len(v) == 1 for v in text_to_enum.values()), text_to_enum
    assert all(len(v) == 1 for v in enum_to_text.values()), enum_to_text
    # where the enum name is the text in CamelCase, the pairing must be exactly that
    for text, (member,) in text_to_enum.items():
        camel = "k" + "".join(w.capitalize() for w in text.split("-"))
        if camel.lower() == member.lower():
            assert member == camel
