"""The code's own mesh (issue 30): user code that builds its mesh from ``jax.devices()`` at import
stages on the devices stagetool stages for, and a mesh other than the staged one is re-laid by axis
name (said in a note) or refused with exit 2 — never a silent mixed program.

Every figure is checked against raw JAX compiling the same code for the same devices: the model
modules below build everything from a ``build(devices, ...)`` function that the module itself calls
with ``jax.devices()`` at import, and that the test calls with the compile-only devices stagetool
uses (``tpu_topology``/``gpu_topology``), then ``.lower(...).compile()``.
"""

from __future__ import annotations

import re
import sys

import jax
import pytest
from helpers import NNX_FSDP_TENSOR_MODULE, memory_of, raw_module, target_devices, write
from jax.sharding import PartitionSpec as P

from stagetool.devices import tpu_topology

MAXTEXT_STYLE = '''
"""MaxText-style: a config builds the mesh from jax.devices() at import; init and step are jitted
with shardings on that mesh, the step donating its state."""
import jax
import jax.numpy as jnp
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

D, H, B = 256, 512, 64


def build(devices, fsdp=4, tensor=2):
    mesh = Mesh(mesh_utils.create_device_mesh((fsdp, tensor), devices), ("fsdp", "tensor"))
    params = {"w1": NamedSharding(mesh, P("fsdp", "tensor")), "w2": NamedSharding(mesh, P("tensor", "fsdp"))}
    batch = NamedSharding(mesh, P("fsdp", None))

    def _init(key):
        k1, k2 = jax.random.split(key)
        return {"w1": jax.random.normal(k1, (D, H)) * 0.02, "w2": jax.random.normal(k2, (H, D)) * 0.02}

    def _step(p, x):
        def loss(p):
            return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] - x) ** 2)
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l

    init = jax.jit(_init, out_shardings=params)
    step = jax.jit(_step, in_shardings=(params, batch), out_shardings=(params, NamedSharding(mesh, P())),
                   donate_argnums=(0,))
    structs = ({k: jax.ShapeDtypeStruct((D, H) if k == "w1" else (H, D), jnp.float32, sharding=s)
                for k, s in params.items()}, jax.ShapeDtypeStruct((B, D), jnp.float32, sharding=batch))
    return mesh, init, step, structs


MESH, init_state, train_step, _ = build(jax.devices())
'''

MAXTEXT_SPEC = '''
version: 1
mesh:
  axes: {fsdp: 4, tensor: 2}
functions:
  train_step:
    target: mt.py:train_step
    args:
      - init: mt.py:init_state
        init_args: [key(0)]
      - f32[64,256]
'''

EXAMPLES_STYLE = '''
"""examples-style: a Config holds the mesh (made at import); the step uses shard_map(mesh=cfg.mesh)."""
import dataclasses

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
    mesh: jax.sharding.Mesh
    d: int = 256


def make_config(mesh=None, devices=None):
    if mesh is None:
        mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2, devices=devices)
    return Config(mesh)


cfg = make_config()


def mlp(x, w1, w2):
    return jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, "y")


def step_of(cfg):
    def step(x, w1, w2):
        out = jax.shard_map(mlp, mesh=cfg.mesh, in_specs=(P("x", None), P(None, "y"), P("y", None)),
                            out_specs=P("x", None))(x, w1, w2)
        return jax.lax.with_sharding_constraint(out, NamedSharding(cfg.mesh, P("x", None)))
    return step


step = jax.jit(step_of(cfg))


step_cfg = jax.jit(lambda x, w1, w2, cfg: step_of(cfg)(x, w1, w2), static_argnames=("cfg",))
'''

EXAMPLES_SPEC = '''
version: 1
mesh:
  axes: {x: 2, y: 4}
functions:
  step:
    target: ex.py:step
    args: &args
      - f32[64,256] @ [x, null]
      - f32[256,1024] @ [null, y]
      - f32[1024,256] @ [y, null]
  step_cfg:
    target: ex.py:step_cfg
    args: *args
    static:
      cfg: {call: ex.py:make_config, kwargs: {mesh: {mesh: staged}}}
'''

TARGETS = [None, "v5e:2x4", "h100:8"]


def _assert_xlas(record, compiled):
    stats = compiled.memory_analysis()
    assert (record["argument_bytes"], record["output_bytes"], record["alias_bytes"], record["temp_bytes"],
            record["generated_code_bytes"]) == (stats.argument_size_in_bytes, stats.output_size_in_bytes,
                                                 stats.alias_size_in_bytes, stats.temp_size_in_bytes,
                                                 stats.generated_code_size_in_bytes)


def _program(text: str) -> list[tuple[str, str]]:
    """The optimized HLO's instructions as sorted (result shape, opcode) pairs: equal for one program."""
    return sorted(re.findall(r"^\s*(?:ROOT )?\S+ = (.+?) ([a-z][\w-]*)\(", text, flags=re.MULTILINE))


@pytest.mark.parametrize("topology", TARGETS)
def test_maxtext_style_stages_on_the_target_as_raw_jax(run_cli, tmp_path, monkeypatch, topology):
    model = write(tmp_path, "mt.py", MAXTEXT_STYLE)
    write(tmp_path, "mt.stagetool.yaml", MAXTEXT_SPEC)
    monkeypatch.chdir(tmp_path)
    devices = target_devices(topology)
    f = memory_of(run_cli, "mt.py:train_step", topology=topology)
    assert f["mesh"]["device_count"] == 8 and f["mesh"]["platform"] == devices[0].platform
    # the module's mesh is the staged one: nothing re-laid
    assert not [n for n in f["notes"] if "re-laid" in n or "taken by axis name" in n]

    raw = raw_module(model, "mt")
    _, _, step, structs = raw.build(devices)
    compiled = step.lower(*structs).compile()
    _assert_xlas(f["memory"]["record"], compiled)
    staged = run_cli("compile", "mt.py:train_step", *(["--topology", topology] if topology else []), check=0).stdout
    assert _program(staged) == _program(compiled.as_text()) and any(
        op in {o for _, o in _program(staged)} for op in ("all-gather", "all-gather-start", "all-reduce", "fusion"))
    assert jax.devices.__module__.startswith("jax")  # JAX's own again
    if topology is None:  # outputs the step's own out_shardings pin say so, with those shardings
        doc = run_cli("shardings", "mt.py:train_step", "--format", "json", check=0).json()
        outs = {o["path"]: o for o in doc["functions"][0]["outputs"]}
        assert {o["sharding_source"] for o in outs.values()} == {"target"}
        assert outs["out/0/w1"]["declared"] == "P('fsdp', 'tensor')" and outs["out/1"]["declared"] == "P()"


def test_maxtext_style_other_mesh_is_relaid_faithfully(run_cli, tmp_path, monkeypatch):
    """--mesh of another shape: the step's own shardings are re-laid by axis name (a note says so),
    and every figure is raw JAX's for the same code with its mesh built at that shape."""
    model = write(tmp_path, "mt.py", MAXTEXT_STYLE)
    write(tmp_path, "mt.stagetool.yaml", MAXTEXT_SPEC)
    monkeypatch.chdir(tmp_path)
    f = memory_of(run_cli, "mt.py:train_step", mesh="fsdp=2,tensor=4")
    notes = " ".join(f["notes"])
    assert "re-laid by axis name on the staged mesh (fsdp=2 × tensor=4 on 8 cpu devices)" in notes
    assert "fsdp=4 × tensor=2" in notes and "the init's shardings" in notes
    raw = raw_module(model, "mt")
    _, _, step, structs = raw.build(jax.devices()[:8], fsdp=2, tensor=4)
    _assert_xlas(f["memory"]["record"], step.lower(*structs).compile())


def test_own_mesh_missing_axis_is_refused(run_cli, tmp_path, monkeypatch):
    write(tmp_path, "mt.py", MAXTEXT_STYLE)
    write(tmp_path, "mt.stagetool.yaml", MAXTEXT_SPEC.replace("{fsdp: 4, tensor: 2}", "{fsdp: 8}"))
    monkeypatch.chdir(tmp_path)
    r = run_cli("memory", "mt.py:train_step", "--no-peak", check=2)
    assert "mesh axis 'tensor'" in r.stderr and "fsdp=4 × tensor=2" in r.stderr and "fsdp=8" in r.stderr
    assert "mt.py:" in r.stderr and "MESH, init_state, train_step" in r.stderr  # where the module holds it


def test_mesh_built_before_stagetool_could_act_is_exit_2(run_cli, tmp_path, monkeypatch):
    if not tpu_topology.libtpu_available():
        pytest.skip("libtpu not installed: pip install -e '.[tpu]'")
    write(tmp_path, "mt.py", MAXTEXT_STYLE.replace("build(jax.devices())", "build(jax.devices('cpu')[:8])"))
    write(tmp_path, "mt.stagetool.yaml", MAXTEXT_SPEC)
    monkeypatch.chdir(tmp_path)
    r = run_cli("memory", "mt.py:train_step", "--topology", "v5e:2x4", "--no-peak", check=2)
    assert "8 cpu devices" in r.stderr and "TPU v5 lite" in r.stderr and "built before stagetool" in r.stderr
    assert re.search(r"mt\.py:\d+", r.stderr) and "{mesh: staged}" in r.stderr


@pytest.mark.parametrize("topology", TARGETS)
def test_examples_style_config_mesh_and_shard_map(run_cli, tmp_path, monkeypatch, topology):
    model = write(tmp_path, "ex.py", EXAMPLES_STYLE)
    write(tmp_path, "ex.stagetool.yaml", EXAMPLES_SPEC)
    monkeypatch.chdir(tmp_path)
    devices = target_devices(topology)
    raw = raw_module(model, "ex")
    cfg = raw.make_config(devices=devices)
    structs = [jax.ShapeDtypeStruct(s, jax.numpy.float32, sharding=jax.sharding.NamedSharding(cfg.mesh, p))
               for s, p in (((64, 256), P("x", None)), ((256, 1024), P(None, "y")),
                            ((1024, 256), P("y", None)))]
    compiled = jax.jit(raw.step_of(cfg)).lower(*structs).compile()
    for target in ("ex.py:step", "ex.py:step_cfg"):  # the module's Config, and the spec's {mesh: staged}
        f = memory_of(run_cli, target, topology=topology)
        _assert_xlas(f["memory"]["record"], compiled)


def test_examples_style_other_mesh(run_cli, tmp_path, monkeypatch):
    """--mesh of another shape: the module's own Config mesh cannot follow (exit 2, both meshes named);
    the spec's {mesh: staged} does, equal to raw JAX at that shape."""
    model = write(tmp_path, "ex.py", EXAMPLES_STYLE)
    write(tmp_path, "ex.stagetool.yaml", EXAMPLES_SPEC)
    monkeypatch.chdir(tmp_path)
    r = run_cli("memory", "ex.py:step", "--mesh", "x=4,y=2", "--no-peak", check=2)
    assert "x=4 × y=2 on 8 cpu devices" in r.stderr and "x=2 × y=4 on 8 cpu devices" in r.stderr and "ex.py:" in r.stderr
    assert "the staged mesh's axes at other sizes" in r.stderr  # what in the code makes it so
    f = memory_of(run_cli, "ex.py:step_cfg", mesh="x=4,y=2")
    raw = raw_module(model, "ex")
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])
    cfg = raw.Config(mesh)
    structs = [jax.ShapeDtypeStruct(s, jax.numpy.float32, sharding=jax.sharding.NamedSharding(mesh, p))
               for s, p in (((64, 256), P("x", None)), ((256, 1024), P(None, "y")),
                            ((1024, 256), P("y", None)))]
    _assert_xlas(f["memory"]["record"], jax.jit(raw.step_of(cfg)).lower(*structs).compile())


def test_staged_world_answers_and_restores():
    from jax.experimental import mesh_utils

    from stagetool.core.mesh import MeshSpec
    from stagetool.devices.provision import provision
    from stagetool.devices.world import staged_world
    from stagetool.plan.target import CpuMesh

    before = (jax.devices, jax.device_count, jax.local_devices, jax.local_device_count, jax.make_mesh,
              mesh_utils.create_device_mesh, mesh_utils.create_hybrid_device_mesh)
    setup = provision(MeshSpec((("a", 4),)), CpuMesh())
    with staged_world(setup):
        assert jax.devices() == sorted(setup.devices, key=lambda d: d.id) and jax.device_count() == 4
        assert jax.local_devices() == jax.devices() and jax.local_device_count() == 4
        assert jax.devices("cpu") == jax.devices()
        assert jax.make_mesh((2, 2), ("p", "q")).devices.size == 4
        assert mesh_utils.create_device_mesh((4,)).size == 4
        assert mesh_utils.create_hybrid_device_mesh((4,), (1,), process_is_granule=True).size == 4
    after = (jax.devices, jax.device_count, jax.local_devices, jax.local_device_count, jax.make_mesh,
             mesh_utils.create_device_mesh, mesh_utils.create_hybrid_device_mesh)
    assert after == before and jax.device_count() == 8


def test_staged_value_forms_in_the_spec(tmp_path):
    from stagetool.spec.model import StagedSpec
    from stagetool.spec.parse import load_spec

    write(tmp_path, "m.py", "def f(x, cfg): return x\ndef Config(**kw): return kw\n")
    spec = write(tmp_path, "s.yaml", '''
        version: 1
        functions:
          f:
            target: m.py:f
            args: ['f32[4]', {mesh: 'f32[2]'}]
            static:
              cfg: {call: m.py:Config, kwargs: {mesh: {mesh: staged}, devs: {devices: staged}, am: {mesh: abstract}}}
        ''')
    fspec = load_spec(spec).functions["f"]
    kw = fspec.static["cfg"].kwargs
    assert [(v.kind, v.form) for v in kw.values()] == [("mesh", "staged"), ("devices", "staged"), ("mesh", "abstract")]
    assert all(isinstance(v, StagedSpec) for v in kw.values())
    assert not isinstance(fspec.args[1], StagedSpec)  # a pytree whose key is 'mesh' stays one
    bad = write(tmp_path, "bad.yaml", spec.read_text().replace("devs: {devices: staged}", "devs: {devices: abstract}"))
    from stagetool.core.errors import SpecError

    with pytest.raises(SpecError, match=r"bad.yaml:\d+.*\{devices: 'abstract'\} is not a form"):
        load_spec(bad)


def test_no_patch_left_in_sys_modules():
    assert "stagetool" not in getattr(jax.devices, "__module__", "")
    assert sys.modules["jax"].devices.__module__.startswith("jax")


HIDDEN_JIT = '''
import functools

import jax
import jax.numpy as jnp


def _sgd(p, g):
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


class NamedJit:
    """A library-style wrapper holding a jax.jit stagetool does not unwrap (as haliax named_jit)."""

    def __init__(self, fn, donate_argnums):
        self._jitted = jax.jit(fn, donate_argnums=donate_argnums)

    def __call__(self, *args):
        return self._jitted(*args)


step = NamedJit(_sgd, donate_argnums=(0,))
partial_step = functools.partial(jax.jit(_sgd, donate_argnums=(0,)))


def plain(p, g):
    return _sgd(p, g)
'''


def test_a_jit_stagetool_does_not_unwrap_is_named(run_cli, tmp_path, monkeypatch):
    """Its donation is not the program's (JAX inlines a nested jit): a note says so, and the figures are
    raw JAX's for the function staged nested (no alias), never a silent drop."""
    write(tmp_path, "hj.py", HIDDEN_JIT)
    write(tmp_path, "hj.stagetool.yaml", """
        version: 1
        functions:
          step: {target: hj.py:step, args: &a ['f32[256,256]', 'f32[256,256]']}
          partial_step: {target: hj.py:partial_step, args: *a}
          plain: {target: hj.py:plain, args: *a}
        """)
    monkeypatch.chdir(tmp_path)
    for target in ("hj.py:step", "hj.py:partial_step"):
        f = memory_of(run_cli, target)
        notes = [n for n in f["notes"] if "does not unwrap" in n]
        assert len(notes) == 1 and "donation (donate_argnums=(0,))" in notes[0] and target in notes[0]
        raw = jax.jit(lambda p, g: raw_module(tmp_path / "hj.py", "hj").step(p, g))
        s = jax.ShapeDtypeStruct((256, 256), jax.numpy.float32)
        _assert_xlas(f["memory"]["record"], raw.lower(s, s).compile())
        assert f["memory"]["record"]["alias_bytes"] == 0
    f = memory_of(run_cli, "hj.py:plain")
    assert not [n for n in f["notes"] if "does not unwrap" in n]


MAXTEXT_NNX = '''
"""MaxText-style with Flax NNX state: the mesh from jax.devices() at import, nnx.State arguments to a
plain jax.jit step whose in/out shardings come from nnx.get_named_sharding on that mesh."""
''' + NNX_FSDP_TENSOR_MODULE + '''    graphdef, abstract_state = nnx.split(abstract)
    shardings = nnx.get_named_sharding(abstract_state, mesh)
    batch = NamedSharding(mesh, P("fsdp", None))

    def _init():
        return nnx.state(M(nnx.Rngs(0)))

    def _step(state, x):
        def loss(s):
            return jnp.mean((nnx.merge(graphdef, s)(x) - x) ** 2)
        l, g = jax.value_and_grad(loss)(state)
        return jax.tree.map(lambda p, d: p - 0.1 * d, state, g), l

    init = jax.jit(_init, out_shardings=shardings)
    step = jax.jit(_step, in_shardings=(shardings, batch), out_shardings=(shardings, NamedSharding(mesh, P())),
                   donate_argnums=(0,))
    structs = (jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings),
               jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=batch))
    return mesh, init, step, structs


MESH, init_state, train_step, _ = build(jax.devices())
'''


@pytest.mark.parametrize(("topology", "mesh"), [(None, None), ("v5e:2x4", None), ("h100:8", None),
                                                (None, "fsdp=2,tensor=4")])
def test_maxtext_style_nnx_state(run_cli, tmp_path, monkeypatch, topology, mesh):
    pytest.importorskip("flax.nnx")
    model = write(tmp_path, "nxm.py", MAXTEXT_NNX)
    write(tmp_path, "nxm.stagetool.yaml", MAXTEXT_SPEC.replace("mt.py", "nxm.py").replace("        init_args: [key(0)]\n", ""))
    monkeypatch.chdir(tmp_path)
    devices = target_devices(topology)
    f = memory_of(run_cli, "nxm.py:train_step", topology=topology, mesh=mesh)
    relaid = [n for n in f["notes"] if "re-laid by axis name" in n]
    assert len(relaid) == (1 if mesh else 0)
    raw = raw_module(model, "nxm")
    sizes = dict(fsdp=2, tensor=4) if mesh else {}
    _, _, step, structs = raw.build(devices, **sizes)
    _assert_xlas(f["memory"]["record"], step.lower(*structs).compile())
    assert f["memory"]["record"]["alias_bytes"] > 0  # the step's donation holds


def test_a_size_one_mesh_axis_keeps_every_cause(run_cli, tmp_path, monkeypatch):
    """A mesh with a size-1 axis (Levanter's ``replica``, Qwen3's ``(1, 4, n//4)``): the same
    collectives as without it, each with its cause (issue 30, item 5)."""
    write(tmp_path, "mt.py", MAXTEXT_STYLE)
    write(tmp_path, "mt.stagetool.yaml", MAXTEXT_SPEC)
    write(tmp_path, "mt1.stagetool.yaml", MAXTEXT_SPEC.replace("{fsdp: 4, tensor: 2}", "{replica: 1, fsdp: 4, tensor: 2}"))
    monkeypatch.chdir(tmp_path)
    runs = [run_cli("collectives", "mt.py:train_step", "--spec", spec, "--format", "json", check=0).json()
            ["functions"][0]["collectives"] for spec in ("mt.stagetool.yaml", "mt1.stagetool.yaml")]
    kinds = [sorted(i["collective"]["kind"] for i in c["items"]) for c in runs]
    assert kinds[0] == kinds[1] and kinds[0]
    assert runs[1]["causes_unavailable"] is None and all(i.get("cause") for i in runs[1]["items"])
