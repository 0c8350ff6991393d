"""The YAML spec: every form it accepts, and every error with file:line:col and key path."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from stagetool.core.errors import SpecError, TargetError, UsageError
from stagetool.core.mesh import MeshSpec, parse_mesh_option
from stagetool.core.sharding import AUTO, REPLICATED, Sharding, UNSPECIFIED
from stagetool.spec.discovery import find_spec, spec_candidates
from stagetool.spec.model import CallSpec, InitSpec, KeySpec, LeafSpec
from stagetool.spec.leaves import parse_leaf, parse_sharding
from stagetool.spec.parse import load_spec, parse_spec
from helpers import isolated_imports, run_cli  # noqa: F401 - fixtures


def parse(text: str, **kw):
    return parse_spec(textwrap.dedent(text).lstrip("\n"), file="s.yaml", base_dir=Path("/base"), **kw)


def issues_of(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse(text)
    return info.value.issues


MESH = "version: 1\nmesh: {axes: {data: 2, model: 4}}\n"


def one_function(body: str):
    spec = parse(MESH + "functions:\n  f:\n" + textwrap.indent(textwrap.dedent(body).lstrip("\n"), "    "))
    return spec.functions["f"]


# ---- leaves and shardings ---------------------------------------------------------------------


@pytest.mark.parametrize("text, shape, dtype, sharding", [
    ("f32[64,1024] @ [data, null]", (64, 1024), "float32", Sharding("spec", ("data", None))),
    ("bf16[8]", (8,), "bfloat16", UNSPECIFIED),
    ("f32[]", (), "float32", UNSPECIFIED),
    ("float32[ 2 , 3 ]@replicated", (2, 3), "float32", REPLICATED),
    ("i32[4,4] @ auto", (4, 4), "int32", AUTO),
    ("s8[4] @ []", (4,), "int8", REPLICATED),
    ("pred[3]", (3,), "bool", UNSPECIFIED),
    ("u32[2]", (2,), "uint32", UNSPECIFIED),                  # a raw PRNG key
    ("key<fry>[]", (), "key<fry>", UNSPECIFIED),              # a typed PRNG key
    ("key[4]", (4,), "key<fry>", UNSPECIFIED),
    ("f32[8,16] @ [[data, model], null]", (8, 16), "float32", Sharding("spec", (("data", "model"), None))),
    ("f32[8,16] @ [null, [model]]", (8, 16), "float32", Sharding("spec", (None, "model"))),
    ("F32[4]", (4,), "float32", UNSPECIFIED),                 # dtype names in any case
    ("BF16[2] @ [data]", (2,), "bfloat16", Sharding("spec", ("data",))),
    ("Float32[1]", (1,), "float32", UNSPECIFIED),
    ("Key<Fry>[]", (), "key<fry>", UNSPECIFIED),
])
def test_compact_leaf(text, shape, dtype, sharding):
    leaf = parse_leaf(text, loc=None)
    assert (leaf.shape, leaf.dtype, leaf.sharding) == (shape, dtype, sharding)


@pytest.mark.parametrize("text, message", [
    ("f33[4]", "unknown dtype 'f33' (did you mean 'f32'?)"),
    ("f32[4,x]", "shape [4,x] must be a list of non-negative integers"),
    ("f32[-1]", "shape [-1] must be a list of non-negative integers"),
    ("f32", "is not a leaf"),
    ("f32[4] @ everything", "is not 'auto', 'replicated' or a list"),
])
def test_bad_compact_leaf(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_leaf(text, loc=None)


def test_sharding_forms():
    assert parse_sharding(None) == UNSPECIFIED
    assert parse_sharding("auto") == AUTO
    assert parse_sharding("replicated") == REPLICATED == parse_sharding([])
    s = parse_sharding([["data", "model"], None])
    assert s.dims == (("data", "model"), None) and s.axes == ("data", "model")
    assert str(s) == "P(('data', 'model'), None)"
    assert str(Sharding("spec", (("data",),))) == "P(('data',))"
    with pytest.raises(ValueError, match="must be a mesh axis name"):
        parse_sharding([3])


def test_every_tree_form_in_one_function():
    f = one_function("""
        target: model.py:step
        args:
          - {shape: [8, 16], dtype: bf16, sharding: [data, model]}
          - !tuple ['f32[8] @ [data]', 'f32[] @ replicated', 3, 2.5, true, null]
          - ['key<fry>[]', 'u32[2]']
          - {a: {b: 'f32[4,8] @ auto'}}
          - !tuple []
        kwargs:
          scale: 'f32[]'
          cfg: {call: model.py:Config, args: [1], kwargs: {n: 2}}
        static:
          train: true
          layers: [1, 2]
          config: {call: model.py:Config, kwargs: {width: 8}}
        donate: [0, scale]
        out_shardings: [[data, null], replicated, auto]
    """)
    a0, a1, a2, a3, a4 = f.args
    assert isinstance(a0, LeafSpec) and a0.shape == (8, 16) and a0.dtype == "bfloat16"
    assert a0.sharding == Sharding("spec", ("data", "model"))
    assert (a0.loc.file, a0.loc.line, a0.loc.column) == ("s.yaml", 7, 9)
    assert isinstance(a1, tuple) and len(a1) == 6
    assert a1[0].sharding == Sharding("spec", ("data",)) and a1[1].sharding == REPLICATED
    assert a1[2:] == (3, 2.5, True, None)
    assert isinstance(a2, list) and [x.dtype for x in a2] == ["key<fry>", "uint32"]
    assert a3["a"]["b"].sharding == AUTO
    assert a4 == ()
    assert set(f.kwargs) == {"scale", "cfg"} and isinstance(f.kwargs["cfg"], CallSpec)
    assert f.kwargs["cfg"].args == (1,) and f.kwargs["cfg"].kwargs == {"n": 2}
    assert f.static["train"] is True and f.static["layers"] == [1, 2]
    assert isinstance(f.static["config"], CallSpec) and f.static["config"].target == "model.py:Config"
    assert f.static["config"].kwargs == {"width": 8}
    assert f.donate == (0, "scale")
    assert f.out_shardings == (Sharding("spec", ("data", None)), REPLICATED, None)
    assert f.base_dir == Path("/base")


def test_out_shardings_forms():
    assert one_function("target: m.py:f\nout_shardings: auto").out_shardings is None
    assert one_function("target: m.py:f\nout_shardings: [data, null]").out_shardings == \
        Sharding("spec", ("data", None))
    assert one_function("target: m.py:f\nout_shardings: {loss: replicated, p: [model]}").out_shardings == \
        {"loss": REPLICATED, "p": Sharding("spec", ("model",))}


def test_function_as_bare_target_and_many_functions():
    spec = parse(MESH + "functions:\n  a: m.py:a\n  b: {target: pkg.mod:obj.b}\n  c: {target: m.py:c}\n")
    assert list(spec.functions) == ["a", "b", "c"]                 # file order
    assert spec.functions["a"].target == "m.py:a" and spec.functions["a"].args == ()
    assert spec.functions["b"].target == "pkg.mod:obj.b"


def test_key_calls_and_init():
    f = one_function("""
        target: m.py:f
        args:
          - init: m.py:init
            init_args: [key(7), 64, 'f32[3]']
            init_kwargs: {depth: 2}
            rules:
              - ['/w$', [null, model]]
              - ['.*', auto]
    """)
    init = f.args[0]
    assert isinstance(init, InitSpec) and init.target == "m.py:init" and init.path == "functions.f.args[0]"
    assert isinstance(init.args[0], KeySpec) and init.args[0].seed == 7
    assert init.args[1] == 64 and isinstance(init.args[2], LeafSpec)
    assert init.kwargs == {"depth": 2}
    assert [r.pattern.pattern for r in init.rules] == ["/w$", ".*"]
    assert [r.sharding for r in init.rules] == [Sharding("spec", (None, "model")), AUTO]
    assert (init.rules[0].loc.line, init.rules[0].loc.column) == (11, 13)


def test_mesh_and_top_level():
    spec = parse("""
        version: 1
        mesh: {axes: {x: 2, y: 1, z: 4}, axis_types: explicit}
        platform: cpu
        topology: v5e:2x4
        avals: local
        functions: {f: m.py:f}
    """)
    assert spec.mesh == MeshSpec((("x", 2), ("y", 1), ("z", 4)), "explicit", spec.mesh.loc)
    assert spec.mesh.device_count == 8 and spec.mesh.names == ("x", "y", "z")
    assert (spec.platform, spec.topology, spec.avals) == ("cpu", "v5e:2x4", "local")
    no_mesh = parse("functions: {f: m.py:f}")
    assert no_mesh.mesh.axes == () and no_mesh.avals == "global" and no_mesh.platform is None


def test_yaml_is_loaded_safely():
    # A python/object tag must not construct anything; as a leaf it is just text that is not a leaf.
    issues = issues_of(MESH + "functions:\n  f:\n    target: m.py:f\n"
                       "    args: [!!python/object/apply:os.system ['echo pwned']]\n")
    assert issues == ["s.yaml:6:45: functions.f.args[0][0]: 'echo pwned' is not a leaf; write dtype[d0,d1,...] "
                      "with an optional '@ sharding', e.g. 'bf16[64,1024] @ [data, null]'"]


# ---- errors -----------------------------------------------------------------------------------


def test_every_error_is_reported_with_location_and_key_path():
    issues = issues_of("""
        version: 1
        mesh: {axes: {data: 2, model: 4}, axis_tipes: auto}
        platfrom: cpu
        functions:
          f:
            target: m.py:f
            args:
              - 'f33[4]'
              - {shape: [4], dtype: f32, sharding: [dta]}
              - x: 'f32[8] @ [modle]'
              - 'f32[8,8] @ [data, data]'
            donate: [5]
            statik: {}
    """)
    assert issues == [
        "s.yaml:2:35: mesh: unknown key 'axis_tipes'; expected one of axes, axis_types, context (did you mean "
            "'axis_types'?)",
        "s.yaml:3:1: unknown key 'platfrom'; expected one of avals, check, chips, functions, gpu_target_config, logical_axis_rules, "
            "mesh, platform, slices, topology, "
        "version "
        "(did you mean 'platform'?)",
        "s.yaml:8:9: functions.f.args[0]: unknown dtype 'f33' (did you mean 'f32'?); use HLO short names "
        "(f32 bf16 i32 u32 pred ...), numpy names, or key<fry>",
        "s.yaml:9:9: functions.f.args[1]: sharding P('dta') names mesh axis 'dta', but the mesh has 'data', "
        "'model' (did you mean 'data'?)",
        "s.yaml:10:12: functions.f.args[2].x: sharding P('modle') names mesh axis 'modle', but the mesh has "
        "'data', 'model' (did you mean 'model'?)",
        "s.yaml:11:9: functions.f.args[3]: sharding P('data', 'data') uses mesh axis 'data' twice",
        "s.yaml:12:13: functions.f.donate: donate index 5 is out of range: the function has 4 positional args",
        "s.yaml:13:5: functions.f: unknown key 'statik'; expected one of args, donate, kwargs, logical_axis_rules, "
        "out_shardings, static, target, tokens_per_step (did you mean 'static'?)",
    ]


@pytest.mark.parametrize("body, expected", [
    ("version: 2\nfunctions: {f: m.py:f}", "s.yaml:1:10: version: unsupported spec version 2"),
    ("functions: {f: {args: []}}", "s.yaml:1:16: functions.f.target: target must be"),
    ("functions: {f: {target: nocolon}}", "s.yaml:1:25: functions.f.target: target must be"),
    ("mesh: {axes: {data: 0}}\nfunctions: {f: m.py:f}", "s.yaml:1:21: mesh.axes.data: axis size must be a positive"),
    ("mesh: {axes: [data]}\nfunctions: {f: m.py:f}", "s.yaml:1:14: mesh.axes: axes must be an ordered mapping"),
    ("mesh: {axis_types: explicit}\nfunctions: {f: m.py:f}", "s.yaml:1:7: mesh: mesh needs 'axes'"),
    ("mesh: {axes: {a: 2}, axis_types: manual}\nfunctions: {f: m.py:f}", "mesh.axis_types: axis_types must be"),
    ("avals: host\nfunctions: {f: m.py:f}", "s.yaml:1:8: avals: avals must be 'global' or 'local'"),
    ("platform: fpga\nfunctions: {f: m.py:f}", "s.yaml:1:11: platform: platform must be cpu, gpu or tpu"),
    ("version: 1", "s.yaml:1:1: the spec has no 'functions' mapping"),
    ("functions: [a]", "s.yaml:1:12: functions: functions must be a mapping"),
    ("functions: {f: {target: m.py:f, args: {a: 1}}}", "functions.f.args: must be a list"),
    ("functions: {f: {target: m.py:f, kwargs: [1]}}", "functions.f.kwargs: must be a mapping"),
    ("functions: {f: {target: m.py:f, static: [1]}}", "functions.f.static: static must be a mapping"),
    ("functions: {f: {target: m.py:f, donate: [true]}}", "functions.f.donate: donate entries are"),
    ("functions: {f: {target: m.py:f, donate: [z]}}", "donate names 'z', which is not one of kwargs"),
    ("functions: {f: {target: m.py:f, args: [{shape: [a], dtype: f32}]}}",
     "functions.f.args[0].shape: shape must be a list of non-negative integers"),
    ("functions: {f: {target: m.py:f, args: [{shape: [2], dtype: f99}]}}", "functions.f.args[0].dtype: unknown dtype"),
    ("functions: {f: {target: m.py:f, args: [{init: nocolon}]}}", "functions.f.args[0].init: init must name"),
    ("functions: {f: {target: m.py:f, args: [{init: m.py:i, rules: {a: b}}]}}", "rules must be a list"),
    ("functions: {f: {target: m.py:f, args: [{init: m.py:i, rules: [[a]]}]}}", "a rule is a pair [regex, sharding]"),
    ("functions: {f: {target: m.py:f, args: [{init: m.py:i, rules: [['(', auto]]}]}}", "bad regular expression '('"),
    ("functions: {f: {target: m.py:f, args: [{init: m.py:i, rules: [['.*', everything]]}]}}", "is not 'auto'"),
    ("functions: {f: {target: m.py:f, args: [{init: m.py:i, initargs: []}]}}", "unknown key 'initargs'"),
    ("functions: {f: {target: m.py:f, static: {c: {call: m.py:C, kw: 1}}}}", "functions.f.static.c: unknown key 'kw'"),
    ("functions: {f: {target: m.py:f, static: {c: {call: 3}}}}", "functions.f.static.c.call: call must name"),
    ("functions: {f: {target: m.py:f, out_shardings: [[data], everything]}}", "out_shardings[1]: sharding"),
])
def test_single_errors(body, expected):
    issues = issues_of(body + "\n")
    assert any(expected in i for i in issues), issues


def test_out_sharding_naming_an_unknown_axis_points_at_itself():
    issues = issues_of(MESH + "functions:\n  f:\n    target: m.py:f\n"
                       "    out_shardings: {a: [data], b: [null, modl]}\n")
    assert issues == ["s.yaml:6:35: functions.f.out_shardings.b: sharding P(None, 'modl') names mesh axis "
                      "'modl', but the mesh has 'data', 'model' (did you mean 'model'?)"]


def test_rule_naming_an_unknown_axis_points_at_the_rule():
    issues = issues_of(MESH + "functions:\n  f:\n    target: m.py:f\n    args:\n"
                       "      - init: m.py:i\n        rules:\n          - ['.*', [modl]]\n")
    assert issues == ["s.yaml:9:13: functions.f.args[0].rules[0]: sharding P('modl') names mesh axis 'modl', "
                      "but the mesh has 'data', 'model' (did you mean 'model'?)"]


@pytest.mark.parametrize("text, where", [
    ("functions: {f: [", "s.yaml:1:17: not valid YAML: expected the node content"),
    ("a: b\n- c", "s.yaml:2:1: not valid YAML: expected <block end>, but found '-'"),
])
def test_bad_yaml(text, where):
    with pytest.raises(SpecError, match=re.escape(where)):
        parse_spec(text, file="s.yaml")


def test_empty_and_non_mapping_spec():
    with pytest.raises(SpecError, match=r"s.yaml:1:1: the spec is empty"):
        parse_spec("", file="s.yaml")
    with pytest.raises(SpecError, match=r"s.yaml:1:1: the spec must be a mapping"):
        parse_spec("[1, 2]", file="s.yaml")


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match="spec file not found"):
        load_spec(tmp_path / "nope.yaml")


def test_load_spec_resolves_against_its_folder(tmp_path):
    p = tmp_path / "sub" / "x.yaml"
    p.parent.mkdir()
    p.write_text("functions: {f: m.py:f}\n")
    spec = load_spec(p)
    assert spec.path == p and spec.functions["f"].base_dir == p.parent.resolve()


# ---- spec search and --mesh -------------------------------------------------------------------


def test_spec_search(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert spec_candidates("models/m.py:f") == [Path("models/m.stagetool.yaml"), tmp_path / "stagetool.yaml"]
    assert spec_candidates("pkg.mod:f") == [tmp_path / "stagetool.yaml"]
    assert find_spec("models/m.py:f") == (None, spec_candidates("models/m.py:f"))
    (tmp_path / "stagetool.yaml").write_text("functions: {}\n")
    assert find_spec("models/m.py:f")[0] == tmp_path / "stagetool.yaml"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.stagetool.yaml").write_text("functions: {}\n")
    assert find_spec("models/m.py:f")[0] == Path("models/m.stagetool.yaml")    # beside the module wins


SPEC_MESH = MeshSpec((("data", 2), ("model", 4)))


@pytest.mark.parametrize("text, axes", [
    ("4x2", (("data", 4), ("model", 2))),
    ("1X8", (("data", 1), ("model", 8))),
    ("data=4,model=2", (("data", 4), ("model", 2))),
    ("model=2, data=4", (("data", 4), ("model", 2))),          # reordered into the spec's order
])
def test_mesh_option(text, axes):
    assert parse_mesh_option(text, SPEC_MESH).axes == axes


def test_mesh_option_without_spec_mesh():
    assert parse_mesh_option("a=2,b=2", MeshSpec(())).axes == (("a", 2), ("b", 2))


@pytest.mark.parametrize("text, message, mesh", [
    ("2x", "is not sizes like 2x4", SPEC_MESH),
    ("2x0", "is not sizes like 2x4", SPEC_MESH),
    ("2x2x2", "has 3 sizes, but the spec's mesh has 2 axes (data, model)", SPEC_MESH),
    ("2x2x2", "give one size per axis, in that order (--mesh 2x4, or --mesh data=2,model=4)", SPEC_MESH),
    # a 1-D data-parallel spec staged as the README's 2x4: the same devices over its one axis
    ("2x4", "the spec's mesh has 1 axis (batch): give one size per axis, in that order (--mesh 8, or --mesh batch=8)",
     MeshSpec((("batch", 8),))),
    ("data=2", "give every axis of the spec once", SPEC_MESH),
    ("data=2,fsdp=4", "give every axis of the spec once", SPEC_MESH),
    ("data=x", "is not 'axis=size'", SPEC_MESH),
    ("2x4", "there is no spec mesh to name the axes", MeshSpec(())),
    ("data=2,data=4", "names axis 'data' twice", MeshSpec(())),
    ("data=2,data=4", "names axis 'data' twice", SPEC_MESH),
])
def test_bad_mesh_option(text, message, mesh):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_mesh_option(text, mesh)


def test_a_single_spec_in_the_working_directory_is_found_without_a_target(tmp_path, monkeypatch):
    from stagetool.spec.discovery import find_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.stagetool.yaml").write_text("functions: {}\n")
    found, tried = find_spec(None)
    assert found == tmp_path / "a.stagetool.yaml"
    assert tried == [tmp_path / "stagetool.yaml", tmp_path / "*.stagetool.yaml"]
    (tmp_path / "b.stagetool.yaml").write_text("functions: {}\n")
    with pytest.raises(UsageError) as info:    # two are ambiguous
        find_spec(None)
    assert info.value.message == (f"no single spec found; tried {tmp_path / 'stagetool.yaml'}, "
                                  f"{tmp_path / '*.stagetool.yaml'} (2 found: a.stagetool.yaml, "
                                  "b.stagetool.yaml — pass --spec)")
    assert find_spec("m.py:f")[0] is None      # with a TARGET, only the fixed search


@pytest.mark.parametrize("target", ["mlp.py", "examples/mlp.py", "pkg.mod", "mlp.py:"])
def test_a_target_without_func_is_a_target_error_before_the_spec_search(tmp_path, monkeypatch, target):
    monkeypatch.chdir(tmp_path)
    for call in (find_spec, spec_candidates):
        with pytest.raises(TargetError, match=re.escape(
                f"target {target!r} must be 'path/to/file.py:func', 'package.module:func' or 'module:obj.attr'")):
            call(target)


def test_duplicate_keys_are_errors_where_they_are_written():
    issues = issues_of("""
        version: 1
        mesh: {axes: {data: 2, data: 4}}
        functions:
          f:
            target: m.py:f
            args: [{a: 'f32[2]', a: 'f32[4]'}]
            kwargs: {k: 1, k: 2}
            static: {s: 1, s: 2}
          f: m.py:g
        """)
    assert issues == [
        "s.yaml:2:24: mesh.axes: duplicate key 'data' (first written at line 2, column 15); "
        "YAML would keep only the last one: remove or rename one",
        "s.yaml:6:26: functions.f.args[0]: duplicate key 'a' (first written at line 6, column 13); "
        "YAML would keep only the last one: remove or rename one",
        "s.yaml:7:20: functions.f.kwargs: duplicate key 'k' (first written at line 7, column 14); "
        "YAML would keep only the last one: remove or rename one",
        "s.yaml:8:20: functions.f.static: duplicate key 's' (first written at line 8, column 14); "
        "YAML would keep only the last one: remove or rename one",
        "s.yaml:9:3: functions: duplicate key 'f' (first written at line 4, column 3); "
        "YAML would keep only the last one: remove or rename one",
    ]


def test_arguments_of_call_are_plain_values_and_init_args_keep_plain_strings():
    f = one_function("""
        target: m.py:f
        args:
          - init: m.py:init
            init_args: [key(1), relu, 'f32[3]', [gelu, 2]]
            init_kwargs: {act: tanh, x: 'bf16[2] @ [data]', names: {a: silu}}
        static:
          cfg: {call: m.py:Config, args: ['f32[4]', [a, b]], kwargs: {act: tanh, sub: {call: m.py:Sub, args: [x]}}}
    """)
    init = f.args[0]
    assert isinstance(init.args[0], KeySpec) and init.args[1] == "relu"
    assert isinstance(init.args[2], LeafSpec) and init.args[3] == ["gelu", 2]
    assert init.kwargs["act"] == "tanh" and init.kwargs["names"] == {"a": "silu"}
    assert isinstance(init.kwargs["x"], LeafSpec) and init.kwargs["x"].dtype == "bfloat16"
    cfg = f.static["cfg"]
    assert cfg.args == ("f32[4]", ["a", "b"])                    # a string, never an array leaf
    assert cfg.kwargs["act"] == "tanh"
    sub = cfg.kwargs["sub"]
    assert isinstance(sub, CallSpec) and sub.target == "m.py:Sub" and sub.args == ("x",)


def test_an_expanded_leaf_with_an_unknown_key_is_reported_as_a_leaf():
    issues = issues_of(MESH + "functions:\n  f:\n    target: m.py:f\n"
                       "    args: [{shape: [4], dtype: f32, sharding: [data], extra: 1}]\n")
    assert issues == ["s.yaml:6:55: functions.f.args[0]: unknown key 'extra'; expected one of dtype, shape, sharding"]


def test_chips_are_validated_at_load_with_locations():
    spec = parse(MESH + "functions: {f: m.py:f}\nchips:\n  npu: {peak_flops_per_second_bf16: 4.0e14}\n")
    assert spec.chips == {"npu": {"peak_flops_per_second_bf16": "4.0e14"}}      # merge_chips reads it
    issues = issues_of(MESH + "functions: {f: m.py:f}\nchips:\n"
                       "  npu: {peak_flops_per_second_bf16: fast, bogus: 1}\n  gpu: {note: x}\n  tpu: 3\n")
    needs = ("a new chip needs at least one of peak_flops_per_second_bf16, peak_flops_per_second_f32, "
             "hbm_bandwidth_bytes_per_second, hbm_capacity_bytes, matmul_flops_per_second, hbm_copy_bytes_per_second")
    assert issues == [
        f"s.yaml:5:3: chips.npu: {needs}",
        "s.yaml:5:37: chips.npu.peak_flops_per_second_bf16: expected a number, got 'fast'",
        "s.yaml:5:43: chips.npu.bogus: unknown field; valid fields: peak_flops_per_second_bf16, "
        "peak_flops_per_second_f32, hbm_bandwidth_bytes_per_second, hbm_capacity_bytes, "
        "peak_flops_per_second_fp8, peak_flops_per_second_int8, ici_bandwidth_bytes_per_second_per_link, "
        "ici_links_per_chip, ici_torus_dims, ici_wraparound_multiple, nvlink_bandwidth_bytes_per_second, "
        "gpus_per_host, dcn_bandwidth_bytes_per_second, collective_latency_seconds, dcn_latency_seconds, "
        "kernel_launch_seconds, clock_hz, hbm_copy_bytes_per_second, elementwise_bytes_per_second, "
        "reduction_bytes_per_second, transcendentals_per_second, gather_bytes_per_second, "
        "scatter_bytes_per_second, kernel_overhead_seconds, matmul_flops_per_second, class_rates, matmul_tile, profile, "
        "sources, note",
        f"s.yaml:6:3: chips.gpu: {needs}",
        "s.yaml:7:3: chips.tpu: expected a mapping of figures, got int",
    ]


def test_a_chip_count_that_is_a_fraction_is_refused_never_truncated_to_zero():
    """issue 42, item 6: ici_wraparound_multiple 0.5 became 0 and every command was a ZeroDivisionError."""
    from stagetool.core.chips import merge_chips

    with pytest.raises(SpecError) as e:
        merge_chips({"tpu-v5e": {"ici_wraparound_multiple": 0.5, "ici_links_per_chip": 4.5, "gpus_per_host": 8.0,
                                 "hbm_capacity_bytes": 1.5}})
    assert e.value.issues == [
        "chips.tpu-v5e.hbm_capacity_bytes: must be a whole number (bytes), got 1.5",
        "chips.tpu-v5e.ici_links_per_chip: must be a whole number (links), got 4.5",
        "chips.tpu-v5e.ici_wraparound_multiple: must be a whole number (chips along a slice axis), got 0.5",
    ]
    assert merge_chips({"tpu-v5e": {"gpus_per_host": 8.0}})["tpu-v5e"].gpus_per_host == 8  # a whole float is fine


_ALIASED = """\
version: 1
{mesh_key}:
  axes: {{data: 4, model: 2}}
functions:
  step:
    target: m.py:step
    args:
      - init: m.py:make
        rules: &rules
          - ['w$', [modle, null]]
          - ['.*', replicated]
      - 'f32[8,4] @ [data, null]'
      - init: m.py:make
        rules: *rules
"""


def test_a_problem_in_an_aliased_rule_is_reported_once_naming_both_uses(run_cli, tmp_path):
    (tmp_path / "m.py").write_text("def make():\n    return {}\n\ndef step(a, x, b):\n    return x\n")
    spec = tmp_path / "a.stagetool.yaml"
    spec.write_text(_ALIASED.format(mesh_key="mesh"))
    r = run_cli("shardings", "--spec", str(spec))
    lines = [line for line in r.stderr.splitlines() if "names mesh axis 'modle'" in line]
    assert r.code == 2 and len(lines) == 1, r.stderr
    assert "a.stagetool.yaml:10:13: functions.step.args[0].rules[0] (also functions.step.args[2].rules[0]" in lines[0]


def test_a_misspelt_mesh_key_is_the_only_error_not_one_per_sharding(run_cli, tmp_path):
    (tmp_path / "m.py").write_text("def make():\n    return {}\n\ndef step(a, x, b):\n    return x\n")
    spec = tmp_path / "a.stagetool.yaml"
    spec.write_text(_ALIASED.format(mesh_key="mseh"))
    r = run_cli("shardings", "--spec", str(spec))
    assert r.code == 2 and "unknown key 'mseh'" in r.stderr and "(did you mean 'mesh'?)" in r.stderr
    assert "the mesh has no axes" not in r.stderr, r.stderr
    # without a mesh and no misspelt key, a named axis is still an error
    spec.write_text(_ALIASED.format(mesh_key="x-unused"))
    r = run_cli("shardings", "--spec", str(spec))
    assert r.code == 2 and "names mesh axis 'data', but the mesh has no axes" in r.stderr, r.stderr


def test_tokens_per_step_is_a_positive_whole_number():
    spec = parse(MESH + "functions:\n  f: {target: m.py:f, tokens_per_step: 4096}\n")
    assert spec.functions["f"].tokens_per_step == 4096
    assert issues_of(MESH + "functions:\n  f: {target: m.py:f, tokens_per_step: 1.5}\n") == [
        "s.yaml:4:40: functions.f.tokens_per_step: tokens_per_step must be a positive whole number (the tokens one "
        "step processes, all devices together), not 1.5"]
