"""stagetool.inspect accepts what jax.jit accepts (issue 40, item 2): arguments on another mesh of the
same devices, a static config holding the caller's mesh with ``topology=``, a one-device topology with
no mesh; its errors name its own parameters. Every figure is raw JAX's compile of the same code for
the same devices (the CPU mesh, compile-only v5e:2x4)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import target_devices
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import stagetool
from stagetool.core.errors import UsageError

TARGETS = [None, "v5e:2x4"]


def _xla(compiled) -> tuple:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes)


def _record(report) -> tuple:
    r = report.memory.record
    return (r.argument_bytes, r.output_bytes, r.alias_bytes, r.temp_bytes)


def _collectives(text: str) -> list[str]:
    """The collective instructions of an optimized HLO module, by kind (async starts as their op)."""
    ops = re.findall(r"^\s*(?:ROOT )?\S+ = .+? (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                     r"(?:-start)?\(", text, flags=re.MULTILINE)
    return sorted(ops)


def _meshes(devices):
    """big_vision's: the state on a 2-D (replica, fsdp) mesh, each batch on the same devices flattened."""
    grid = mesh_utils.create_device_mesh((2, 4), devices)
    return Mesh(grid, ("replica", "fsdp")), Mesh(grid.flatten(), ("devices",))


def _bv_step(w, x):
    l, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.1 * g, l


def _bv_args(mesh, batch_mesh):
    return (jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp"))),
            jax.ShapeDtypeStruct((32, 128), jnp.float32, sharding=NamedSharding(batch_mesh, P("devices"))))


@pytest.mark.parametrize("topology", TARGETS)
def test_a_batch_on_a_1d_mesh_of_the_same_devices(topology):
    mesh, batch_mesh = _meshes(jax.devices()[:8])  # the caller's own
    report = stagetool.inspect(_bv_step, *_bv_args(mesh, batch_mesh), topology=topology, donate=0, peak=False)
    fn = report.function()
    assert fn.mesh.axes == (("replica", 2), ("fsdp", 4))
    assert any("argument x is laid on another mesh of the same devices" in n and "P(('replica', 'fsdp'), None)" in n
               for n in fn.notes), fn.notes
    # raw JAX: jax.jit of the same step on the same two meshes of the target's devices
    raw_mesh, raw_batch = _meshes(target_devices(topology))
    compiled = jax.jit(_bv_step, donate_argnums=0).trace(*_bv_args(raw_mesh, raw_batch)).lower().compile()
    assert _record(report) == _xla(compiled)
    assert report.memory.record.alias_bytes == 128 * 128 * 4 // 4
    assert sorted(c.collective.kind for c in report.collectives.items) == _collectives(compiled.as_text())


@dataclasses.dataclass(frozen=True)
class Config:
    """jax-llm-examples-style: the mesh travels in a static config."""

    mesh: Mesh
    d: int = 128


def _cfg_step(x, w, cfg):
    def local(x, w):
        return jax.lax.psum(jnp.tanh(x @ w), "fsdp")
    return jax.shard_map(local, mesh=cfg.mesh, in_specs=(P("replica", "fsdp"), P("fsdp", None)),
                         out_specs=P("replica", None))(x, w)


def _cfg_args(mesh):
    return (jax.ShapeDtypeStruct((32, 128), jnp.float32, sharding=NamedSharding(mesh, P("replica", "fsdp"))),
            jax.ShapeDtypeStruct((128, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None))))


@pytest.mark.parametrize("topology", TARGETS)
def test_a_static_config_holding_the_mesh(topology):
    mesh, _ = _meshes(jax.devices()[:8])
    report = stagetool.inspect(_cfg_step, *_cfg_args(mesh), cfg=Config(mesh), static=("cfg",), topology=topology,
                               peak=False)
    relaid = [n for n in report.function().notes if n.startswith("static='cfg' holds the mesh")]
    assert len(relaid) == (1 if topology else 0), report.function().notes
    raw_mesh, _ = _meshes(target_devices(topology))
    compiled = jax.jit(_cfg_step, static_argnames="cfg").trace(*_cfg_args(raw_mesh), cfg=Config(raw_mesh)).lower() \
        .compile()
    assert _record(report) == _xla(compiled)
    assert sorted(c.collective.kind for c in report.collectives.items) == _collectives(compiled.as_text())
    assert "all-reduce" in _collectives(compiled.as_text())  # the psum over fsdp


def test_a_one_device_topology_needs_no_mesh():
    (device,) = target_devices("v5e:1x1")

    def step(w, x):
        return jnp.tanh(x @ w).sum()

    shapes = (jax.ShapeDtypeStruct((128, 128), jnp.float32), jax.ShapeDtypeStruct((32, 128), jnp.float32))
    report = stagetool.inspect(step, *shapes, topology="v5e:1x1", peak=False)
    assert report.function().mesh.device_kind == "TPU v5 lite"
    one = jax.sharding.SingleDeviceSharding(device)
    compiled = jax.jit(step).trace(*(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one) for s in shapes)).lower() \
        .compile()
    assert _record(report) == _xla(compiled)


def test_errors_name_the_apis_parameters():
    """A topology with no mesh, and code whose own mesh has the staged axes at other sizes: the message
    and hint speak of mesh= and topology=, never --mesh, --topology or the spec's {mesh: staged}."""
    pytest.importorskip("jax.experimental.topologies")
    target_devices("v5e:2x4")  # skips without libtpu
    with pytest.raises(UsageError) as e:
        stagetool.inspect(lambda x: x * 2, jax.ShapeDtypeStruct((8,), jnp.float32), topology="v5e:2x4")
    text = f"{e.value.message}\n{e.value.hint}"
    assert "topology=v5e:2x4 needs a mesh" in text and "mesh='data=8'" in text and "--" not in text, text

    fixed = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("replica", "fsdp"))  # the code's, at a fixed shape

    def step(x, w):
        return _cfg_step(x, w, Config(fixed))

    mesh, _ = _meshes(jax.devices()[:8])
    with pytest.raises(UsageError) as e:
        stagetool.inspect(step, *_cfg_args(mesh), peak=False)
    text = f"{e.value.message}\n{e.value.hint}"
    assert "replica=4 × fsdp=2" in text and "staged mesh's axes at other sizes" in text, text
    assert "--mesh" not in text and "{mesh: staged}" not in text and "{call:" not in text, text
    assert "mesh='replica=4,fsdp=2'" in text and "static=" in text, text


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class StaticConfig:
    """jax-llm-examples' form: a config class registered static, passed positionally (``step(x, w, cfg)``),
    its mesh read inside (``shard_map(mesh=cfg.mesh)``); jax.jit takes it as part of the call's structure."""

    mesh: Mesh
    d: int = 128


@pytest.mark.parametrize("topology", TARGETS)
def test_a_registered_static_config_passed_positionally_holding_the_mesh(topology):
    mesh, _ = _meshes(jax.devices()[:8])
    report = stagetool.inspect(_cfg_step, *_cfg_args(mesh), StaticConfig(mesh), topology=topology, peak=False)
    relaid = [n for n in report.function().notes if n.startswith("argument cfg holds the mesh")]
    assert len(relaid) == (1 if topology else 0), report.function().notes
    raw_mesh, _ = _meshes(target_devices(topology))
    compiled = jax.jit(_cfg_step).trace(*_cfg_args(raw_mesh), StaticConfig(raw_mesh)).lower().compile()
    assert _record(report) == _xla(compiled)
    assert sorted(c.collective.kind for c in report.collectives.items) == _collectives(compiled.as_text())
    assert "all-reduce" in _collectives(compiled.as_text())


@pytest.mark.parametrize("topology", TARGETS)
def test_structs_sharded_over_an_abstract_mesh_give_the_mesh(topology):
    """ShapeDtypeStructs whose NamedSharding names a jax.sharding.AbstractMesh (no devices): with no
    mesh=, its axes are the staged mesh's, as for arrays on a concrete mesh."""
    abstract = jax.sharding.AbstractMesh((8,), ("data",))

    def step(x, w):
        return jnp.tanh(x @ w)

    def args(mesh):
        return (jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
                jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P())))

    report = stagetool.inspect(step, *args(abstract), topology=topology, peak=False)
    assert report.function().mesh.axes == (("data", 8),)
    raw = Mesh(np.array(target_devices(topology)), ("data",))
    assert _record(report) == _xla(jax.jit(step).trace(*args(raw)).lower().compile())


def test_the_api_words_keep_the_mesh_value_whole():
    """A CLI hint "(--mesh data=8), or ..." in the API's words: mesh='data=8' inside the parenthesis."""
    from stagetool.live import api_words

    assert api_words("stage with its own axis sizes (--mesh data=8), or build it") == \
        "stage with its own axis sizes (mesh='data=8'), or build it"
    assert api_words("give --mesh, e.g. --mesh data=8") == "give mesh=, e.g. mesh='data=8'"
    assert api_words("stage on it (--mesh replica=2,fsdp=4); then") == "stage on it (mesh='replica=2,fsdp=4'); then"


def _mm(w, x):
    return jnp.tanh(x @ w)


def _second_mesh_args(names):
    """The staged 2x4 ('data', 'model') mesh holds w; x sits on a 4x2 mesh of the same devices."""
    devices = np.array(jax.devices()[:8])
    mesh, other = Mesh(devices.reshape(2, 4), ("data", "model")), Mesh(devices.reshape(4, 2), names)
    spec = P("x", "y") if names == ("x", "y") else P("data")
    return (jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))),
            jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(other, spec)))


@pytest.mark.parametrize("names", [("x", "y"), ("data", "model")])
def test_an_argument_on_a_second_mesh_of_the_same_devices_keeps_its_own_sharding(names):
    """Issue 47 item 7: a 4x2 mesh beside the staged 2x4 one, with other axis names (was refused: 'the
    mesh does not have x, y') or the same ones (was P('data') re-read on the 2x4 mesh: shard (4, 16)
    where jax.jit gives (2, 16)); each as raw jax.jit compiles the same arguments."""
    args = _second_mesh_args(names)
    report = stagetool.inspect(_mm, *args, peak=False)
    fn = report.function()
    compiled = jax.jit(_mm).trace(*args).lower().compile()
    raw_in = [s.shard_shape(a.shape) for s, a in zip(compiled.input_shardings[0], args)]
    assert [x.shard_shape for x in fn.inputs] == raw_in == [(16, 4), (2, 8) if names == ("x", "y") else (2, 16)]
    assert report.memory.record.argument_bytes == compiled.memory_analysis().argument_size_in_bytes
    assert _record(report) == _xla(compiled)
    assert sorted(c.collective.kind for c in report.collectives.items) == _collectives(compiled.as_text())
    raw_out = compiled.output_shardings
    assert [o.shard_shape for o in fn.outputs] == [raw_out.shard_shape((8, 16))]
    assert str(fn.outputs[0].compiled) == str(P(*raw_out.spec))
    assert any("x is laid on another mesh of the staged devices" in n and "staged with its own sharding" in n
               for n in fn.notes), fn.notes
    assert not any("taken by axis name" in n for n in fn.notes), fn.notes


def test_an_argument_on_other_devices_is_refused_naming_both_meshes():
    """A mesh over 4 of the 8 devices beside the staged one: jax.jit refuses it, and so does inspect,
    naming both meshes."""
    from stagetool.core.errors import SpecError

    devices = np.array(jax.devices()[:8])
    w, _ = _second_mesh_args(("x", "y"))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(Mesh(devices[:4].reshape(2, 2), ("x", "y")),
                                                                          P("x", "y")))
    with pytest.raises(ValueError, match="incompatible devices"):
        jax.jit(_mm).trace(w, x).lower()
    with pytest.raises(SpecError, match=r"its mesh \(x=2 × y=2 on 4 cpu devices\) is not on the staged devices "
                                        r"\(data=2 × model=4 on 8 cpu devices\)"):
        stagetool.inspect(_mm, w, x, peak=False)


@pytest.mark.slow
def test_a_second_mesh_in_an_isolated_worker_keeps_its_own_sharding(tmp_path, monkeypatch):
    """isolate=True: the worker rebuilds the 4x2 ('data', 'model') mesh over the same devices (was an
    AbstractMesh laid by axis name: shard (4, 16) where jax.jit gives (2, 16))."""
    (tmp_path / "second_mesh_program.py").write_text("import jax.numpy as jnp\n\n\ndef mm(w, x):\n"
                                                      "    return jnp.tanh(x @ w)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import second_mesh_program

    args = _second_mesh_args(("data", "model"))
    report = stagetool.inspect(second_mesh_program.mm, *args, isolate=True, timeout_s=300, peak=False)
    compiled = jax.jit(_mm).trace(*args).lower().compile()
    assert [x.shard_shape for x in report.function().inputs] == \
        [s.shard_shape(a.shape) for s, a in zip(compiled.input_shardings[0], args)] == [(16, 4), (2, 16)]
    assert _record(report) == _xla(compiled)


@pytest.mark.parametrize("names", [("x", "y"), ("data", "model")])
def test_why_on_an_argument_on_its_own_mesh_answers_with_that_meshs_partitionspec(names):
    """Gap 4: ``why`` on the argument laid on its own (second) mesh said only "no answer: the compiled
    program's sharding of input x is P('x', 'y') on its own mesh ..., not a PartitionSpec over the mesh";
    now its PartitionSpec over its own mesh and which mesh (as raw jax.jit compiles it), then why the
    rest is unavailable (Shardy's rerun over the two meshes is not the compile's), and that reason is
    no longer the argument's own mesh."""
    args = _second_mesh_args(names)
    report = stagetool.inspect(_mm, *args, peak=False)
    compiled = jax.jit(_mm).trace(*args).lower().compile()
    raw = compiled.input_shardings[0][1]
    spec = str(P(*[d for d in raw.spec]))  # JAX's own: P('x', 'y') / P('data',)
    mesh = " × ".join(f"{n}={s}" for n, s in raw.mesh.shape.items()) + " on 8 cpu devices"
    assert mesh == ("x=4 × y=2" if names == ("x", "y") else "data=4 × model=2") + " on 8 cpu devices"
    assert report.function().inputs[1].compiled.dims == tuple(d for d in raw.spec)
    answer = report.why("x")
    (line,) = answer.found
    own = f"{spec.replace(',)', ')')} on its own mesh {mesh}"
    assert line.startswith(f"input x: declared {own} (from the object at ") and line.endswith(f"; compiled {own}")
    assert answer.unavailable.startswith("what it causes and where its sharding goes: ")
    assert "not a PartitionSpec over the mesh" not in answer.unavailable
    shown = " ".join(str(answer).split())
    assert f"why: leaf x input x: declared {own}" in shown and "no answer: what it causes" in shown
    # the argument on the staged mesh is answered the same way
    (w,) = report.why("w").found
    assert w.startswith("input w: declared P(None, 'model') (from the object at ") and \
        w.endswith("; compiled P(None, 'model')")


def test_a_constraint_on_the_callers_own_mesh_under_a_topology_is_told_how_to_stage_it():
    """Equinox's data-parallel example from a notebook: the step's body pins its batch with a
    NamedSharding on the module's mesh, which lives on this process's CPU devices. Under
    ``topology=`` that mesh cannot be re-laid from inside the traced body, so it is refused; the hint
    used to offer the module's own axis sizes (``mesh='data=8'``), the very sizes already staged.
    It now says what does work: staging the module by its file, where its mesh is built on the
    staged devices, or a PartitionSpec in the constraint."""
    pytest.importorskip("jax.experimental.topologies")
    target_devices("v5e:2x4")  # skips without libtpu
    own = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])
    rows = NamedSharding(own, P("data"))

    def step(w, x):
        x = jax.lax.with_sharding_constraint(x, rows)
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    args = (jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(own, P())),
            jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=rows))
    with pytest.raises(UsageError) as e:
        stagetool.inspect(jax.jit(step), *args, topology="v5e:2x4", peak=False)
    assert "data=8 on 8 cpu devices" in e.value.message and "its devices are not the staged ones" in e.value.message
    assert "mesh='data=8'" not in e.value.hint and "--" not in e.value.hint, e.value.hint
    assert "stage it by its file" in e.value.hint and "PartitionSpec in the constraint" in e.value.hint
