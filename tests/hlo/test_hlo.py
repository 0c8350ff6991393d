"""Tests of the HLO text parser: shapes, tables, totality, real modules (what replica groups mean is
tested with the collectives, tests/hlo/test_collectives.py)."""

from __future__ import annotations

import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.hlo import parser as hlo
from stagetool.hlo.parser import ArrayShape, TupleShape

DATA = pathlib.Path(__file__).parent / "data"


# ---------------------------------------------------------------------------------------------
# Shapes and byte sizes


def test_array_shape_with_layout():
    s = hlo.parse_shape("f32[16,32]{1,0}")
    assert s == ArrayShape("f32", (16, 32), "1,0")
    assert s.byte_size == 16 * 32 * 4
    assert s.type_text() == "f32[16,32]"


def test_tpu_tiled_layout_kept_and_sized_logically():
    s = hlo.parse_shape("bf16[1024,4096]{1,0:T(8,128)(2,1)}")
    assert isinstance(s, ArrayShape)
    assert (s.dtype, s.dims, s.layout) == ("bf16", (1024, 4096), "1,0:T(8,128)(2,1)")
    assert s.byte_size == 1024 * 4096 * 2


def test_scalar_token_pred_and_sub_byte():
    assert hlo.parse_shape("f32[]") == ArrayShape("f32", ())
    assert hlo.parse_shape("f32[]").byte_size == 4
    assert hlo.parse_shape("token[]").byte_size == 0
    assert hlo.parse_shape("pred[10]").byte_size == 10
    assert hlo.parse_shape("c64[3]").byte_size == 3 * 8
    assert hlo.parse_shape("f8e4m3fn[5]").byte_size == 5
    # unpacked s4 takes a byte per element; a packed layout (E(4)) two elements per byte
    assert hlo.parse_shape("s4[7]").byte_size == 7
    assert hlo.parse_shape("s4[7]{0:T(1024)E(4)}").byte_size == 4
    assert hlo.parse_shape("u32[]{:S(2)}").byte_size == 4


def test_dynamic_dims():
    s = hlo.parse_shape("f32[<=10,3]{1,0}")
    assert s.dims == (10, 3) and s.dynamic


def test_tuple_shapes_nested_with_index_comments():
    s = hlo.parse_shape("(s32[], f32[32,8]{1,0}, (bf16[2]{0}, pred[]), /*index=3*/f32[6,32,8]{2,1,0})")
    assert isinstance(s, TupleShape)
    assert len(s.elements) == 4
    assert s.elements[2] == TupleShape((ArrayShape("bf16", (2,), "0"), ArrayShape("pred", ())))
    assert [a.dtype for a in s.arrays()] == ["s32", "f32", "bf16", "pred", "f32"]
    assert hlo.shape_bytes(s) == 4 + 32 * 8 * 4 + 2 * 2 + 1 + 6 * 32 * 8 * 4
    assert hlo.parse_shape("()") == TupleShape(())


def test_unknown_shapes_are_none_not_errors():
    for text in ["", "f32", "f32[a,b]", "(f32[2]", "weird stuff"]:
        assert hlo.parse_shape(text) is None
    assert hlo.shape_bytes(None) is None
    assert hlo.parse_shape("zz[2]").byte_size is None
    assert hlo.shape_bytes(TupleShape((ArrayShape("zz", (2,)),))) is None


# ---------------------------------------------------------------------------------------------
# Module text: the hand-written fixture


@pytest.fixture(scope="module")
def fixture_module() -> hlo.HloModule:
    return hlo.parse_hlo_module((DATA / "async_tpu_like.hlo").read_text())


def test_header_attributes(fixture_module):
    m = fixture_module
    assert m.name == "jit_fixture"
    assert m.num_partitions == 8
    assert m.attributes["input_output_alias"] == "{ {1}: (1, {}, may-alias) }"
    assert m.attributes["entry_computation_layout"].startswith("{(bf16[256,4096]{1,0:T(8,128)(2,1)}, ")
    assert m.attributes["entry_computation_layout"].endswith("f32[8,128]{1,0:T(8,128)})}")


def test_unknown_lines_are_kept_raw(fixture_module):
    assert [t for _, t in fixture_module.unparsed_lines] == [
        "this line is not HLO and must be kept verbatim",
        "  this instruction line is garbage and must be kept",
    ]
    # and the instructions around the garbage still parse
    entry = fixture_module.entry
    assert entry.instruction("ag2").opcode == "all-gather"
    assert entry.instruction("rs").opcode == "reduce-scatter"


def test_computations_and_calls(fixture_module):
    m = fixture_module
    assert [c.name for c in m.computations] == [
        "add.1",
        "body",
        "cond",
        "branch_0",
        "branch_1",
        "wrapped_all_to_all",
        "main",
    ]
    assert m.entry_name == "main" and m.entry.is_entry
    loop = m.entry.instruction("loop")
    assert loop.called_computations == ("body", "cond")
    assert m.entry.instruction("sel").called_computations == ("branch_0", "branch_1")
    assert m.entry.instruction("rs").called_computations == ("add.1",)
    assert m.entry.instruction("a2a-start").called_computations == ("wrapped_all_to_all",)
    assert hlo.backend_config_json(loop) == {"known_trip_count": {"n": "5"}}
    assert m.computation("body").root.name == "t"
    assert m.computation("body").instruction("p").shape.elements[2] == ArrayShape("f32", (1024,), "0:T(1024)")


def test_instruction_fields(fixture_module):
    e = fixture_module.entry
    ag = e.instruction("ag2")
    assert ag.operands == ("w.out",)
    assert ag.attributes["replica_groups"] == "mesh['axis_0'=2,'axis_1'=4] {'axis_1'}"
    assert ag.attributes["dimensions"] == "{0}"
    assert ag.metadata.op_name == "jit(f)/all_gather" and ag.metadata.stack_frame_id == 2
    assert e.instruction("sel").operands == ("k", "v.out", "v.out")
    assert e.instruction("m").operands == () and e.instruction("m").operand_text == "{...}"
    params = fixture_module.entry_parameters()
    assert [(p.parameter_number, p.metadata.op_name) for p in params] == [(0, "params['w']"), (1, "v"), (2, "k")]
    assert e.root.name == "out" and e.root.is_root


def test_stack_frames_and_old_style_source(fixture_module):
    m = fixture_module
    chain = m.source_stack(m.entry.instruction("ag2"))
    assert [(f.file, f.line, f.function) for f in chain] == [
        ("/src/model.py", 57, "forward"),
        ("/src/model.py", 90, "<module>"),
    ]
    old = m.source_stack(m.computation("body").instruction("all-gather-start"))
    assert [(f.file, f.line) for f in old] == [("/src/model.py", 42)]
    assert m.source_stack(m.entry.instruction("rs")) == ()


def test_parser_is_total_on_junk():
    lines = [
        "HloModule m, num_partitions=x",
        "%c (a: f32[]) -> f32[] {",
        "  %a = f32[] parameter(0)",
        "  %b = f32[ broken(",
        '  %q = f32[] add(%a, %a), metadata={op_name="unterminated',
        "  ROOT %r = f32[] negate(%a)",
        "}",
        "}",
        "ENTRY %e {",
        "  %z = (f32[], s32[]) tuple(",
    ]
    m = hlo.parse_hlo_module("\n".join(lines))
    assert m.num_partitions is None
    assert [c.name for c in m.computations] == ["c", "e"]
    assert [i.name for i in m.computation("c").instructions] == ["a", "q", "r"]
    assert len(m.unparsed_lines) == 3
    assert hlo.parse_hlo_module("").computations == ()


def test_escaped_strings_in_metadata():
    text = (
        "ENTRY %e (p: f32[]) -> f32[] {\n"
        '  ROOT %p = f32[] parameter(0), metadata={op_name="p[\\\'w1\\\']" op_type="a\\"b\\303\\251"}\n'
        "}\n"
    )
    p = hlo.parse_hlo_module(text).entry.instruction("p")
    assert p.metadata.op_name == "p['w1']"
    assert p.metadata.op_type == 'a"b\u00e9'


# ---------------------------------------------------------------------------------------------
# Real modules compiled by JAX on the 8 simulated CPU devices


def _nested_inner(x):
    return jnp.sin(x)  # marker: inner op


def _nested_outer(x):
    y = _nested_inner(x * 2.0)  # marker: call of inner
    return y


def _line_of(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if marker in line)


@pytest.mark.jax_version(">=0.8", reason="jax 0.7 records one frame per op (source_file/source_line): no "
                                         "callers, no function names")
def test_stack_frame_chain_of_a_real_module():
    compiled = jax.jit(_nested_outer).lower(jax.ShapeDtypeStruct((4,), jnp.float32)).compile()
    m = hlo.parse_hlo_module(compiled.as_text())
    sines = [i for c in m.computations for i in c.instructions if i.opcode == "sine"]
    assert len(sines) == 1
    chain = m.source_stack(sines[0])
    assert chain[0].file == __file__ and chain[0].line == _line_of(_nested_inner, "marker: inner op")
    assert chain[0].function == "_nested_inner"
    assert chain[1].file == __file__ and chain[1].line == _line_of(_nested_outer, "marker: call of inner")
    assert chain[1].function == "_nested_outer"
    assert chain[2].function == "test_stack_frame_chain_of_a_real_module"


def _mlp_step(params, x, y):
    def loss(p):
        h = jnp.tanh(x @ p["w1"])
        return jnp.mean((jax.nn.relu(h @ p["w2"]) - y) ** 2)

    g = jax.grad(loss)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g)


@pytest.fixture(scope="module")
def mlp_compiled():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def s(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    params = {"w1": s((16, 32), P()), "w2": s((32, 8), P(None, "model"))}
    return jax.jit(_mlp_step).lower(params, s((64, 16), P("data")), s((64, 8), P("data"))).compile()


_ENUM_ALIASES = {"exponential": "exp", "sine": "sin", "cosine": "cos"}


@pytest.mark.jax_version(">=0.10", reason="jaxlib's HloComputation has no instructions() before 0.10")
def test_real_module_matches_jaxlib_object_model(mlp_compiled):
    """Names, operands and opcodes agree with jaxlib's own HLO object model of the same program."""
    m = hlo.parse_hlo_module(mlp_compiled.as_text())
    assert m.unparsed_lines == ()
    assert m.num_partitions == 8
    (ref,) = mlp_compiled.runtime_executable().hlo_modules()
    ref_comps = {c.name: c for c in ref.computations()}
    assert {c.name for c in m.computations} == set(ref_comps)
    for comp in m.computations:
        ref_instrs = {i.name: i for i in ref_comps[comp.name].instructions()}
        assert sorted(i.name for i in comp.instructions) == sorted(ref_instrs)
        for ins in comp.instructions:
            r = ref_instrs[ins.name]
            assert ins.operands == tuple(o.name for o in r.operands())
            want = str(r.opcode).split(".k")[-1].lower()
            assert _ENUM_ALIASES.get(ins.opcode, ins.opcode.replace("-", "")) == want
            assert ins.shape is not None, ins.shape_text


def test_entry_parameters_are_the_arguments(mlp_compiled):
    m = hlo.parse_hlo_module(mlp_compiled.as_text())
    params = m.entry_parameters()
    assert [p.metadata.op_name for p in params] == ["params['w1']", "params['w2']", "x", "y"]
    # per-device shapes: w2 split over model (4), x and y over data (2)
    assert [p.shape.dims for p in params] == [(16, 32), (32, 2), (32, 16), (32, 8)]


def test_parse_is_linear_enough():
    """A doubled module takes about twice as long (guards against quadratic scans)."""
    import time

    text = (DATA / "async_tpu_like.hlo").read_text()
    head, _, tail = text.partition("%add.1")
    body = "%add.1" + tail
    small = head + "\n".join(re.sub(r"%(\w[\w.\-]*)", rf"%\1_{k}", body) for k in range(40))
    big = head + "\n".join(re.sub(r"%(\w[\w.\-]*)", rf"%\1_{k}", body) for k in range(160))

    def best(t):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            hlo.parse_hlo_module(t)
            times.append(time.perf_counter() - t0)
        return min(times)

    assert len(hlo.parse_hlo_module(big).computations) == 160 * 7
    assert best(big) < 4 * best(small) * 2.0  # 4x the text: well under 8x the time


def test_behind_follows_the_named_opcodes_within_its_hops():
    module = hlo.parse_hlo_module("""HloModule m

ENTRY %main (p: f32[4,2]) -> f32[8] {
  %p = f32[4,2]{1,0} parameter(0)
  %c = f32[4,2]{1,0} copy(f32[4,2]{1,0} %p)
  %b = f32[4,2]{1,0} bitcast(f32[4,2]{1,0} %c)
  ROOT %r = f32[8]{0} reshape(f32[4,2]{1,0} %b)
}
""")
    comp = module.entry
    through = frozenset({"copy", "bitcast", "reshape"})
    assert comp.behind("r", through, 4).name == "p"  # r, b, c passed, p found: four looked at
    assert comp.behind("r", through, 3) is None
    assert comp.behind("r", frozenset({"copy", "bitcast"}), 8).name == "r"  # a reshape stops it
    assert comp.behind("b", frozenset({"copy", "bitcast"}), 8).name == "p"
    assert comp.behind("nothing", through, 8) is None
