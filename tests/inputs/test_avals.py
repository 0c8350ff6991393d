"""Abstract inputs and staging: ShapeDtypeStructs on the mesh, auto leaves, rules, local avals,
early shape errors, jitted targets, the ambient mesh — each checked against JAX called directly."""

from __future__ import annotations

import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import write
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.analysis.shardings import input_leaves, output_leaves
from stagetool.staging.gather import input_facts, output_facts
from stagetool.core.errors import SpecError, StagingError
from stagetool.inputs.avals import build_inputs
from stagetool.inputs.leaves import check_fits
from stagetool.inputs.out_shardings import check_out_shardings, fit_out_shardings
from stagetool.devices.provision import local_mesh_sizes, provision
from stagetool.staging.stages import jit_function, stage
from stagetool.inputs.target import load_target
from stagetool.core.mesh import MeshSpec
from stagetool.core.sharding import Sharding
from stagetool.spec.parse import parse_spec

pytestmark = pytest.mark.usefixtures("isolated_imports")

MESH = MeshSpec((("data", 2), ("model", 4)))


def prepare(tmp_path, source: str, functions: str, *, mesh: MeshSpec = MESH, avals: str = "global",
            processes: int | None = None, name: str = "f"):
    """Write model.py and a spec; return (fspec, target, setup, inputs)."""
    write(tmp_path, "model.py", source)
    axes = ", ".join(f"{n}: {s}" for n, s in mesh.axes)
    text = f"version: 1\nmesh: {{axes: {{{axes}}}}}\nfunctions:\n" + textwrap.indent(
        textwrap.dedent(functions).lstrip("\n"), "  ")
    spec = parse_spec(text, file="spec.yaml", base_dir=tmp_path)
    fspec = spec.functions[name]
    target = load_target(fspec.target, base_dir=tmp_path)
    setup = provision(mesh, processes=processes)
    inputs = build_inputs(fspec, target.fn, setup, mesh, avals=avals)
    return fspec, target, setup, inputs


def run_stages(fspec, target, setup, inputs, until="compile"):
    jitted = jit_function(target, fspec, inputs, setup.mesh)
    return stage(jitted, inputs, setup.mesh, name=fspec.name, user_files=[target.module_file], until=until)


MATMUL = """
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

def f(x, w, unused, scale=1.0):
    return jax.lax.with_sharding_constraint(x @ w, P(None, "model")) * scale
"""


def test_leaves_become_named_shardings_and_auto_is_the_partitioners(tmp_path):
    fspec, target, setup, inputs = prepare(tmp_path, MATMUL, """
        f:
          target: model.py:f
          args: ['f32[16,32] @ [data, null]', 'f32[32,64] @ auto', 'bf16[8]']
          kwargs: {scale: 'f32[]'}
    """)
    x, w, unused = inputs.args
    assert x.shape == (16, 32) and x.sharding == NamedSharding(setup.mesh, P("data", None))
    assert w.sharding is None                     # auto: no sharding, the partitioner decides
    assert unused.dtype == jnp.bfloat16 and unused.sharding.spec == P()    # no '@': replicated
    assert inputs.kwargs["scale"].shape == ()
    assert [leaf.path for leaf in inputs.leaves] == ["x", "w", "unused", "scale"]
    staged = run_stages(fspec, target, setup, inputs)

    # The same function through JAX directly, on the same mesh and structs.
    mesh = setup.mesh
    with jax.set_mesh(mesh):
        direct = jax.jit(target.fn).trace(
            jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("data", None))),
            jax.ShapeDtypeStruct((32, 64), jnp.float32),
            jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
            scale=jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))).lower().compile()
    ours = jax.tree_util.tree_leaves(staged.compiled.input_shardings, is_leaf=lambda s: s is None)
    theirs = jax.tree_util.tree_leaves(direct.input_shardings, is_leaf=lambda s: s is None)
    assert [None if s is None else s.spec for s in ours] == [None if s is None else s.spec for s in theirs]
    assert theirs[1].spec == P(None, "model")     # the partitioner's choice after the constraint
    assert theirs[2] is None                      # `unused` was pruned

    report = {leaf.path: leaf for leaf in input_leaves(input_facts(inputs, staged.compiled, setup.mesh))}
    assert str(report["w"].declared) == "auto" and str(report["w"].compiled) == "P(None, 'model')"
    assert report["w"].chosen_by_partitioner and report["w"].shard_shape == (32, 16)
    assert report["w"].bytes_per_device == 32 * 64 // 4 * 4
    assert report["x"].shard_shape == (8, 32) and report["x"].bytes_per_device == 16 * 32 * 4 // 2
    assert report["x"].bytes_global == 16 * 32 * 4
    assert report["unused"].unused and report["unused"].compiled is None and report["unused"].parameter is None
    assert [report[p].parameter for p in ("x", "w", "scale")] == [0, 1, 2]
    out = output_leaves(output_facts(staged.traced, staged.compiled, fspec.out_shardings, setup.mesh))
    assert [(o.path, o.shape, str(o.compiled)) for o in out] == [("out", (16, 64), "P(None, 'model')")]
    assert out[0].bytes_per_device == 16 * 64 * 4 // 4


def test_ambient_mesh_lets_bare_partition_specs_work(tmp_path):
    # Without jax.set_mesh, a bare P in with_sharding_constraint has no mesh to refer to.
    fspec, target, setup, inputs = prepare(tmp_path, MATMUL, """
        f: {target: model.py:f, args: ['f32[16,32]', 'f32[32,64]', 'f32[1]']}
    """)
    with pytest.raises(RuntimeError, match="requires a non-empty mesh in context"):
        jax.jit(target.fn).trace(*inputs.args).lower()
    staged = run_stages(fspec, target, setup, inputs)
    assert staged.compiled.output_shardings.spec == P(None, "model")


def test_rules_first_match_wins_and_shard_shapes(tmp_path):
    source = """
    import jax, jax.numpy as jnp

    def init(key, d):
        return {"layer": {"w": jnp.zeros((d, 2 * d)), "b": jnp.zeros((2 * d,))}, "out": {"w": jnp.zeros((2 * d, d))},
                "step": jnp.zeros((), jnp.int32)}

    def f(params):
        return jax.tree.map(lambda p: p + 1, params)
    """
    fspec, target, setup, inputs = prepare(tmp_path, source, """
        f:
          target: model.py:f
          args:
            - init: model.py:init
              init_args: [key(0), 8]
              rules:
                - ['layer/w$', [data, model]]
                - ['/w$', [model, null]]      # also matches layer/w, but the first rule won
                - ['/b$', [[data, model]]]
                - ['.*', replicated]
    """)
    params = inputs.args[0]
    assert params["layer"]["w"].sharding.spec == P("data", "model")
    assert params["out"]["w"].sharding.spec == P("model", None)
    assert params["layer"]["b"].sharding.spec == P(("data", "model"))
    assert params["step"].sharding.spec == P() and params["step"].dtype == jnp.int32
    by_path = {leaf.path: leaf for leaf in inputs.leaves}
    assert by_path["params/layer/w"].source == "spec.yaml:10:13"     # the rule that matched
    staged = run_stages(fspec, target, setup, inputs)
    report = {leaf.path: leaf for leaf in input_leaves(input_facts(inputs, staged.compiled, setup.mesh))}
    assert report["params/layer/w"].shard_shape == (8 // 2, 16 // 4)
    assert report["params/layer/b"].shard_shape == (16 // 8,)
    assert report["params/out/w"].shard_shape == (16 // 4, 8)
    assert report["params/layer/b"].bytes_per_device == 2 * 4


def test_a_leaf_no_rule_matches_is_an_error(tmp_path):
    source = "import jax.numpy as jnp\n\ndef init():\n    return {'w': jnp.zeros((4, 4)), 'b': jnp.zeros(4)}\n\ndef f(p):\n    return p\n"
    with pytest.raises(SpecError) as info:
        prepare(tmp_path, source, """
            f:
              target: model.py:f
              args:
                - init: model.py:init
                  rules: [['/w$', replicated]]
        """)
    assert info.value.issues == [
        "spec.yaml:7:9: functions.f.args[0].rules: no rule matches leaf 'p/b' (float32[4]); "
        "add a rule such as ['.*', replicated] at the end"]
    assert info.value.hint is None         # not the divisibility hint: the message says what to do


def test_indivisible_dimension_and_rank_are_caught_before_lowering(tmp_path):
    with pytest.raises(SpecError) as info:
        prepare(tmp_path, "def f(a, b, c):\n    return a\n", """
            f:
              target: model.py:f
              args:
                - {x: 'f32[6,8] @ [model, null]'}
                - 'f32[4] @ [data, model]'
                - 'f32[6,12] @ [null, [data, model]]'
        """)
    assert info.value.issues == [
        "spec.yaml:7:13: a/x: dimension 0 of size 6 is not divisible by 4, the size of mesh axis 'model'",
        "spec.yaml:8:9: b: sharding P('data', 'model') has 2 entries, but the array has rank 1 (shape [4])",
        "spec.yaml:9:9: c: dimension 1 of size 12 is not divisible by 8, the size of mesh axis 'data' × 'model' (2 × 4)",
    ]
    assert info.value.hint == ("shard a dimension only over mesh axes whose sizes divide it; a sharding has at most "
                               "one entry per array dimension (trailing dimensions are replicated)")
    with pytest.raises(SpecError) as info:
        prepare(tmp_path / "rank", "def f(a):\n    return a\n", "f: {target: model.py:f, args: ['f32[4] @ [data, model]']}")
    assert info.value.hint == "a sharding has at most one entry per array dimension (trailing dimensions are replicated)"
    assert "for scalars write 'replicated'" in check_fits((), Sharding("spec", ("data",)), {"data": 2})


def test_check_fits_agrees_with_jax():
    # Every case check_fits accepts, JAX accepts too, and vice versa (shard_shape raises otherwise).
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sizes = {"data": 2, "model": 4}
    for shape in [(6, 8), (8, 6), (2, 12), (16,), (4, 4)]:
        for dims in [("data",), ("model", None), (None, "model"), (("data", "model"),), (None, ("model", "data"))]:
            if len(dims) > len(shape):
                continue
            ours = check_fits(shape, Sharding("spec", dims), sizes) is None
            try:
                NamedSharding(mesh, P(*dims)).shard_shape(shape)
                theirs = True
            except ValueError:
                theirs = False
            assert ours == theirs, (shape, dims)


def test_python_scalars_keys_and_static_objects(tmp_path):
    source = """
    import dataclasses, jax

    @dataclasses.dataclass(frozen=True)
    class Config:
        width: int
        depth: int = 1

    def f(x, n, key, *, cfg, train):
        assert isinstance(cfg, Config) and cfg.width == 8 and train is True
        return x * n + jax.random.uniform(key, x.shape) * cfg.depth
    """
    fspec, target, setup, inputs = prepare(tmp_path, source, """
        f:
          target: model.py:f
          args: ['f32[8]', 3, 'key<fry>[]']
          static: {cfg: {call: model.py:Config, args: [8], kwargs: {depth: 2}}, train: true}
    """)
    n = inputs.args[1]
    assert n.shape == () and n.dtype == jnp.int32 and n.weak_type
    key = inputs.args[2]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert inputs.static_argnames == ("cfg", "train")
    assert inputs.kwargs["cfg"].width == 8 and inputs.kwargs["cfg"].depth == 2
    staged = run_stages(fspec, target, setup, inputs, until="lower")
    assert staged.compiled is None and staged.timings.compile_s is None and staged.timings.lower_s > 0


def test_concrete_key_as_function_argument_is_an_error(tmp_path):
    with pytest.raises(SpecError, match=r"key\(0\) is a concrete key for init_args"):
        prepare(tmp_path, "def f(k):\n    return k\n", "f: {target: model.py:f, args: [key(0)]}")


def test_local_avals_follow_the_process_blocks(tmp_path):
    source = "def f(batch, w):\n    return batch['x'] @ w\n"
    fspec, target, setup, inputs = prepare(tmp_path, source, """
        f:
          target: model.py:f
          args:
            - {x: 'f32[8,16] @ [data, null]', y: 'f32[8,16] @ [model, null]', z: 'f32[8,16] @ [[data, model], null]'}
            - 'f32[16,32] @ [null, model]'
    """, avals="local", processes=2)
    # Two processes over a 2x4 mesh in device order: process p holds the row data=p, all of model.
    grid = np.array(setup.process_of_device).reshape(2, 4)
    assert grid.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert local_mesh_sizes(MESH, setup.process_of_device) == {"data": 1, "model": 4}

    # multihost_utils semantics: a host-local dim grows by the number of process blocks along the
    # mesh axes that shard it; count them from the process grid independently.
    def blocks(axes):
        per_axis = {"data": len(set(grid[:, 0])), "model": len(set(grid[0, :]))}
        return math.prod(per_axis[a] for a in axes)

    by_path = {leaf.path: leaf for leaf in inputs.leaves}
    assert by_path["batch/x"].shape == (8 * blocks(["data"]), 16) == (16, 16)       # doubles
    assert by_path["batch/y"].shape == (8 * blocks(["model"]), 16) == (8, 16)       # stays
    assert by_path["batch/z"].shape == (8 * blocks(["data", "model"]), 16) == (16, 16)
    assert by_path["w"].shape == (16, 32) and by_path["w"].local_shape == (16, 32)
    assert by_path["batch/x"].local_shape == (8, 16)
    assert inputs.args[0]["x"].shape == (16, 16)
    # Each process's share of the global array is its local shape: global shard × devices it holds
    # along the axis.
    staged = run_stages(fspec, target, setup, inputs)
    x = staged.compiled.input_shardings[0][0]["x"]
    assert x.shard_shape((16, 16))[0] * 1 == 8


def test_process_count_must_divide_the_devices():
    from stagetool.core.errors import UsageError

    with pytest.raises(UsageError, match="--processes 3 must divide the mesh's 8 devices"):
        provision(MESH, processes=3)


def test_too_few_devices_is_a_usage_error():
    from stagetool.core.errors import UsageError

    with pytest.raises(UsageError) as info:
        provision(MeshSpec((("data", 4), ("model", 4))))
    assert info.value.message == "the mesh data=4 × model=4 needs 16 devices, but platform cpu has 8"
    assert "fresh process" in info.value.hint


def test_explicit_axis_types(tmp_path):
    setup = provision(MeshSpec((("data", 2), ("model", 4)), "explicit"))
    assert setup.mesh.axis_types == (jax.sharding.AxisType.Explicit,) * 2
    assert provision(MESH).mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2


def test_already_jitted_target_keeps_its_own_options(tmp_path):
    source = """
    import functools, jax

    @functools.partial(jax.jit, static_argnames=("n",), donate_argnums=(0,))
    def f(x, y, n):
        return x * n + y
    """
    fspec, target, setup, inputs = prepare(tmp_path, source, """
        f: {target: model.py:f, args: ['f32[8,4] @ [data, null]', 'f32[8,4] @ [data, null]'], static: {n: 3}}
    """)
    jitted = jit_function(target, fspec, inputs, setup.mesh)
    assert jitted is target.fn
    staged = run_stages(fspec, target, setup, inputs)
    args_info = staged.compiled.args_info[0]
    assert [a.donated for a in args_info] == [True, False]
    report = {leaf.path: leaf for leaf in input_leaves(input_facts(inputs, staged.compiled, setup.mesh))}
    assert report["x"].donated and not report["y"].donated


def test_trace_failure_is_a_staging_error_with_the_users_line(tmp_path):
    source = "import jax.numpy as jnp\n\ndef f(x, w):\n    y = x @ w\n    return y\n"
    fspec, target, setup, inputs = prepare(tmp_path, source, "f: {target: model.py:f, args: ['f32[8,3]', 'f32[4,5]']}")
    with pytest.raises(StagingError) as info:
        run_stages(fspec, target, setup, inputs)
    e = info.value
    assert e.stage == "trace" and e.exit_code == 3
    assert "dot_general requires contracting dimensions to have the same shape" in e.message
    assert e.user_frame.startswith(f"{tmp_path / 'model.py'}:4 in f")


def test_compile_failure_is_a_staging_error(tmp_path):
    source = """
    import jax

    def f(x):
        return jax.ffi.ffi_call("stagetool_test_no_such_handler", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    """
    fspec, target, setup, inputs = prepare(tmp_path, source, "f: {target: model.py:f, args: ['f32[8]']}")
    staged = run_stages(fspec, target, setup, inputs, until="lower")      # lowering is fine
    assert staged.lowered is not None
    with pytest.raises(StagingError) as info:
        run_stages(fspec, target, setup, inputs)
    assert info.value.stage == "compile"
    assert "No FFI handler registered for stagetool_test_no_such_handler" in info.value.message


def test_init_failure_is_a_staging_error(tmp_path):
    source = "import jax.numpy as jnp\n\ndef init(d):\n    return {'w': jnp.zeros((d, d)) @ jnp.zeros((d + 1, d))}\n\ndef f(p):\n    return p\n"
    with pytest.raises(StagingError) as info:
        prepare(tmp_path, source, "f: {target: model.py:f, args: [{init: model.py:init, init_args: [4]}]}")
    assert info.value.stage == "init" and info.value.user_frame.startswith(f"{tmp_path / 'model.py'}:4 in init")


def test_donation_and_out_shardings_from_the_spec(tmp_path):
    source = "def f(a, b):\n    return {'s': a + b, 't': a * b}\n"
    fspec, target, setup, inputs = prepare(tmp_path, source, """
        f:
          target: model.py:f
          args: ['f32[8,8] @ [data, null]', 'f32[8,8] @ [data, null]']
          donate: [1]
          out_shardings: {s: [data, null], t: replicated}
    """)
    staged = run_stages(fspec, target, setup, inputs)
    assert [a.donated for a in staged.compiled.args_info[0]] == [False, True]
    outs = staged.compiled.output_shardings
    assert outs["s"].spec == P("data", None) and outs["t"].spec == P()
    report = {o.path: o for o in output_leaves(output_facts(staged.traced, staged.compiled, fspec.out_shardings, setup.mesh))}
    assert str(report["out/s"].declared) == "P('data', None)" and str(report["out/s"].compiled) == "P('data', None)"
    assert str(report["out/t"].declared) == "P(None, None)" and not report["out/t"].chosen_by_partitioner
    assert report["out/s"].shard_shape == (4, 8)


def test_call_arguments_are_plain_strings_and_nested_calls_are_built(tmp_path):
    source = """
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Sub:
        name: str

    @dataclasses.dataclass(frozen=True)
    class Config:
        act: str
        subs: tuple = ()

    def f(x, *, cfg):
        return x
    """
    _, _, _, inputs = prepare(tmp_path, source, """
        f:
          target: model.py:f
          args: ['f32[8]']
          static:
            cfg: {call: model.py:Config, kwargs: {act: tanh, subs: !tuple [{call: model.py:Sub, args: [gelu]}]}}
    """)
    cfg = inputs.kwargs["cfg"]
    assert cfg.act == "tanh" and len(cfg.subs) == 1 and cfg.subs[0].name == "gelu"


SIG_SOURCE = """
import functools, jax

def f(x, w, *, scale=1.0):
    return x @ w * scale

@jax.jit
def g(x):
    return x

def h(x, /, y):
    return x + y

def init(d, *, depth=1):
    return {"w": jax.numpy.zeros((d, d))}
"""


@pytest.mark.parametrize("functions, expected", [
    # a static name the function does not take (jax.jit(static_argnames=...) raised a raw ValueError)
    ("f: {target: model.py:f, args: ['f32[4,4]', 'f32[4,4]'], static: {cfg: 3}}",
     ["spec.yaml:4:68: functions.f.static: f(x, w, *, scale=1.0) has no parameter 'cfg'"]),
    ("g: {target: model.py:g, args: ['f32[4]'], static: {y: 3}}",
     ["spec.yaml:4:54: functions.g.static: g(x) has no parameter 'y'"]),
    # a missing positional argument was an exit-3 "missing 1 required positional argument" from JAX
    ("f: {target: model.py:f, args: ['f32[4,4]']}",
     ["spec.yaml:4:3: functions.f: f(x, w, *, scale=1.0) missing required argument 'w'"]),
    ("f: {target: model.py:f, args: ['f32[4,4]', 'f32[4,4]', 'f32[4]']}",
     ["spec.yaml:4:27: functions.f.args: f(x, w, *, scale=1.0) takes 2 positional arguments, but the spec gives 3"]),
    ("f: {target: model.py:f, args: ['f32[4,4]', 'f32[4,4]'], kwargs: {scal: 'f32[]'}}",
     ["spec.yaml:4:68: functions.f.kwargs: f(x, w, *, scale=1.0) has no parameter 'scal' (did you mean 'scale'?)"]),
    ("h: {target: model.py:h, args: ['f32[4]'], kwargs: {x: 'f32[4]', y: 'f32[4]'}}",
     ["spec.yaml:4:54: functions.h.kwargs: h(x, /, y) parameter 'x' is positional-only; give it under 'args'"]),
    ("f: {target: model.py:f, args: ['f32[4,4]', 'f32[4,4]'], static: {scale: [1, 2]}}",
     ["spec.yaml:4:68: functions.f.static.scale: a static value must be hashable, and a list is not; "
      "write a list as a tuple: !tuple [...]"]),
    ("f: {target: model.py:f, args: [{init: model.py:init, init_args: [4, 5]}, 'f32[4,4]']}",
     ["spec.yaml:4:34: functions.f.args[0].init_args: init(d, *, depth=1) takes 1 positional argument, "
      "but the spec gives 2"]),
])
def test_arguments_are_bound_to_the_signature_before_tracing(tmp_path, functions, expected):
    name = functions.split(":")[0]
    with pytest.raises(SpecError) as info:
        prepare(tmp_path, SIG_SOURCE, functions, name=name)
    assert info.value.issues == expected and info.value.exit_code == 2


def test_jax_jit_rejecting_the_options_is_a_spec_error(tmp_path):
    import dataclasses

    fspec, target, setup, inputs = prepare(tmp_path, SIG_SOURCE, "f: {target: model.py:f, args: ['f32[4,4]', 'f32[4,4]']}")
    bad = dataclasses.replace(inputs, static_argnames=("cfg",))           # what the signature check stops
    with pytest.raises(SpecError, match=r"spec.yaml:4:3: functions.f.static: jax.jit does not accept the spec's options "
                                        r"for model.py:f: .*invalid argnames \{'cfg'\} in static_argnames"):
        jit_function(target, fspec, bad, setup.mesh)


OUT_SOURCE = """
def pair(x):
    return (x, x * 2)

def as_list(x):
    return [x, x]

def named(x):
    return {"loss": x.sum(), "y": (x, x)}
"""


def _out_info(target, inputs, setup, fspec):
    import dataclasses

    probe = jit_function(target, dataclasses.replace(fspec, out_shardings=None), inputs, setup.mesh)
    with jax.set_mesh(setup.mesh):
        return probe.trace(*inputs.args, **inputs.kwargs).out_info


@pytest.mark.parametrize("name, out, message", [
    ("pair", "[[data], [data], [data]]",
     "spec.yaml:4:51: functions.pair.out_shardings: the spec gives a list of 3 shardings, but the function returns "
     "a tuple of 2 (f32[8], f32[8]) (out_shardings: a tuple of 3 (P('data'), P('data'), P('data')))"),
    ("named", "{loss: replicated, z: auto}",
     "spec.yaml:4:53: functions.named.out_shardings: the spec gives a mapping with keys loss, z, but the function "
     "returns a dict {loss: f32[], y: (f32[8], f32[8])} (out_shardings: a dict {loss: P(), z: auto})"),
    ("named", "{loss: replicated, y: [[data], [data], auto]}",
     "spec.yaml:4:53: functions.named.out_shardings: at y: the spec gives a list of 3 shardings, but the function "
     "returns a tuple of 2 (f32[8], f32[8]) (out_shardings: a dict {loss: P(), y: (P('data'), P('data'), auto)})"),
])
def test_out_shardings_that_do_not_fit_the_outputs_are_a_spec_error(tmp_path, name, out, message):
    fspec, target, setup, inputs = prepare(
        tmp_path, OUT_SOURCE, f"{name}: {{target: model.py:{name}, args: ['f32[8]'], out_shardings: {out}}}", name=name)
    with pytest.raises(StagingError, match="pytree structure error"):     # what JAX says without the check
        run_stages(fspec, target, setup, inputs, until="lower")
    with pytest.raises(SpecError) as info:
        check_out_shardings(fspec, _out_info(target, inputs, setup, fspec))
    assert info.value.issues == [message]


def test_out_shardings_that_fit_are_returned_in_the_outputs_container_types(tmp_path):
    import dataclasses

    fspec, target, setup, inputs = prepare(
        tmp_path, OUT_SOURCE, "as_list: {target: model.py:as_list, args: ['f32[8]'], out_shardings: [[data], auto]}",
        name="as_list")
    assert fspec.out_shardings == (Sharding("spec", ("data",)), None)
    with pytest.raises(StagingError, match="different types"):        # JAX wants the list a list
        run_stages(fspec, target, setup, inputs, until="lower")
    fitted = check_out_shardings(fspec, _out_info(target, inputs, setup, fspec))
    assert fitted == [Sharding("spec", ("data",)), None]
    staged = run_stages(dataclasses.replace(fspec, out_shardings=fitted), target, setup, inputs)
    assert staged.compiled.output_shardings[0].spec == P("data")
    # The one-call form for the pipeline: the same tree; a misfit is a SpecError before staging.
    assert fit_out_shardings(fspec, target.fn, inputs, setup.mesh).out_shardings == fitted
    bad = dataclasses.replace(fspec, out_shardings=(None, None, None))
    with pytest.raises(SpecError, match="the spec gives a list of 3 shardings, but the function returns a list of 2"):
        fit_out_shardings(bad, target.fn, inputs, setup.mesh)


INIT_SOURCE = """
import jax.numpy as jnp

def init_raises(d):
    raise ValueError(f"no layout for d={d}")

def init_shapes(d):
    return {"w": jnp.zeros((d, d)) @ jnp.zeros((d + 1, d))}

def f(p):
    return p
"""


@pytest.mark.parametrize("init, line, message", [
    ("init_raises", 4, "ValueError: no layout for d=4"),
    ("init_shapes", 7, "TypeError: dot_general requires contracting dimensions to have the same shape"),
])
def test_a_failing_init_points_at_the_users_line_once(tmp_path, init, line, message):
    with pytest.raises(StagingError) as info:
        prepare(tmp_path, INIT_SOURCE, f"f: {{target: model.py:f, args: [{{init: model.py:{init}, init_args: [4]}}]}}")
    e = info.value
    source_line = INIT_SOURCE.lstrip("\n").splitlines()[line - 1].strip()
    assert e.stage == "init" and e.exit_code == 3 and e.message.startswith(message)
    assert e.user_frame == f"{tmp_path / 'model.py'}:{line} in {init}\n    {source_line}"
    assert source_line not in e.message and "stagetool" not in e.user_frame


def test_an_init_called_with_a_wrong_keyword_is_a_spec_error_not_a_staging_error(tmp_path):
    # The TypeError would be raised at stagetool's own call of init (no user frame at all).
    with pytest.raises(SpecError) as info:
        prepare(tmp_path, INIT_SOURCE, "f: {target: model.py:f, args: [{init: model.py:init_raises, init_kwargs: {dim: 4}}]}")
    assert info.value.issues == [
        "spec.yaml:4:34: functions.f.args[0].init_kwargs: init_raises(d) has no parameter 'dim'",
        "spec.yaml:4:34: functions.f.args[0]: init_raises(d) missing required argument 'd'",
    ]
