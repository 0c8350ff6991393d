"""Several meshes over the staged devices (issue 40, item 1): code that uses another mesh of the same
devices beside its state mesh stages as raw JAX compiles it.

- big_vision-style: the state on a 2-D ``(replica, fsdp)`` mesh, mixup inside
  ``shard_map(mesh=Mesh(devices.flatten(), ("data",)))`` — JAX refuses that shard_map under a
  context mesh of another shape, so stagetool stages it under none but the code's own, as raw JAX
  compiles the code (with or without its ``with mesh:``);
- a module that builds its mesh as ``Mesh(np.array(jax.devices()), ("data",))``: on a TPU topology
  ``jax.devices()`` lists the chips by id (``[0, 1, 2, 3]`` on v5e:2x2) where stagetool's mesh walks
  the torus (``[0, 1, 3, 2]``); the module's order is the one its code runs on, and is staged.

Every figure (argument, output, alias, temp and code bytes; the optimized program's instructions,
collectives among them) is checked against raw JAX compiling the module's own ``build(devices)``
for the same devices, on the CPU mesh and the compile-only TPU topologies.
"""

from __future__ import annotations

import importlib.util
import re

import jax
import numpy as np
import pytest
from helpers import target_devices, write
from jax.sharding import Mesh

BIG_VISION = '''
"""big_vision-style: the state on a 2-D (replica, fsdp) mesh built from jax.devices(); mixup inside
shard_map on the same devices flattened into a 1-D ("data",) mesh."""
import jax
import jax.numpy as jnp
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

D, B = 128, 32


def build(devices, replica=2, fsdp=4):
    devices = mesh_utils.create_device_mesh((replica, fsdp), devices)
    mesh = Mesh(devices, ("replica", "fsdp"))
    flat = Mesh(devices.flatten(), ("data",))

    def mixup(x):
        def local(x):
            return 0.5 * x + 0.5 * jnp.roll(x, 1, axis=0) + jax.lax.pmean(x.mean(), "data")
        return jax.shard_map(local, mesh=flat, in_specs=P("data"), out_specs=P("data"))(x)

    def _step(w, x):
        x = mixup(x)
        l, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g, l

    step = jax.jit(_step, donate_argnums=(0,))
    structs = (jax.ShapeDtypeStruct((D, D), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp"))),
               jax.ShapeDtypeStruct((B, D), jnp.float32, sharding=NamedSharding(mesh, P(("replica", "fsdp")))))
    return mesh, step, structs


MESH, train_step, _ = build(jax.devices())
'''

BIG_VISION_SPEC = '''
version: 1
mesh:
  axes: {replica: 2, fsdp: 4}
functions:
  train_step:
    target: bv.py:train_step
    args:
      - f32[128,128] @ [null, fsdp]
      - f32[32,128] @ [[replica, fsdp]]
'''

DEVICE_ORDER = '''
"""A module that builds its mesh from jax.devices() in id order and places its outputs with it."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def build(devices):
    mesh = Mesh(np.array(devices), ("data",))
    out = NamedSharding(mesh, P("data"))

    def _step(x, w):
        return jax.lax.with_sharding_constraint(jnp.tanh(x @ w), out)

    step = jax.jit(_step, out_shardings=out)
    structs = (jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=out),
               jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=NamedSharding(mesh, P())))
    return mesh, step, structs


MESH, step, _ = build(jax.devices())
'''

DEVICE_ORDER_SPEC = '''
version: 1
mesh:
  axes: {data: 4}
functions:
  step:
    target: ordm.py:step
    args:
      - f32[64,128] @ [data]
      - f32[128,128]
'''


def _raw_module(path, name):
    spec = importlib.util.spec_from_file_location(f"_raw_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _figures(record: dict) -> tuple:
    return tuple(record[k] for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                                     "generated_code_bytes"))


def _xla(compiled) -> tuple:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes,
            m.generated_code_size_in_bytes)


def _program(text: str) -> list[tuple[str, str]]:
    """The optimized HLO's instructions as sorted (result shape, opcode) pairs: equal for one program."""
    return sorted(re.findall(r"^\s*(?:ROOT )?\S+ = (.+?) ([a-z][\w-]*)\(", text, flags=re.MULTILINE))


def _stage(run_cli, target, topology, *extra):
    where = ["--topology", topology] if topology else []
    doc = run_cli("memory", target, "--no-peak", "--format", "json", *where, *extra, check=0).json()
    (f,) = doc["functions"]
    assert f.get("error") is None
    return f, run_cli("compile", target, *where, *extra, check=0).stdout


@pytest.mark.parametrize("topology", [None, "v5e:2x4"])
def test_a_shard_map_on_a_flattened_mesh_beside_the_state_mesh(run_cli, tmp_path, monkeypatch, topology):
    model = write(tmp_path, "bv.py", BIG_VISION)
    write(tmp_path, "bv.stagetool.yaml", BIG_VISION_SPEC)
    monkeypatch.chdir(tmp_path)
    devices = target_devices(topology)
    f, staged = _stage(run_cli, "bv.py:train_step", topology)
    notes = [n for n in f["notes"] if "another mesh of the staged devices" in n]
    line = next(i for i, t in enumerate(model.read_text().splitlines(), 1) if "jax.shard_map(" in t)
    assert len(notes) == 1 and "data=8" in notes[0] and f"bv.py:{line}" in notes[0]

    raw = _raw_module(model, "bv")
    mesh, step, structs = raw.build(devices)
    compiled = step.lower(*structs).compile()  # raw JAX: no context mesh
    assert _figures(f["memory"]["record"]) == _xla(compiled)
    assert f["memory"]["record"]["alias_bytes"] == 128 * 128 * 4 // 4  # the donated state, one fsdp shard
    assert _program(staged) == _program(compiled.as_text())
    assert any(op.startswith("all-reduce") for _, op in _program(staged))  # the pmean over "data"
    with pytest.warns(DeprecationWarning), mesh:  # the code's own `with mesh:`: the same program
        assert _xla(raw.build(devices)[1].lower(*structs).compile()) == _xla(compiled)


def test_the_flattened_mesh_follows_another_staged_shape(run_cli, tmp_path, monkeypatch):
    """--mesh replica=1,fsdp=8: the code's flattened mesh lists the same devices in the same order, and
    the program is raw JAX's for the code's state mesh at that shape."""
    model = write(tmp_path, "bv.py", BIG_VISION)
    write(tmp_path, "bv.stagetool.yaml", BIG_VISION_SPEC)
    monkeypatch.chdir(tmp_path)
    f, _ = _stage(run_cli, "bv.py:train_step", None, "--mesh", "replica=1,fsdp=8")
    assert any("another mesh of the staged devices (data=8" in n and "replica=1 × fsdp=8" in n for n in f["notes"])
    raw = _raw_module(model, "bv")
    _, step, structs = raw.build(jax.devices()[:8], replica=1, fsdp=8)
    assert _figures(f["memory"]["record"]) == _xla(step.lower(*structs).compile())


@pytest.mark.parametrize(("topology", "size"), [(None, 4), ("v5e:2x2", 4), ("v5e:2x4", 8)])
def test_a_mesh_in_jax_devices_order_is_the_codes(run_cli, tmp_path, monkeypatch, topology, size):
    model = write(tmp_path, "ordm.py", DEVICE_ORDER)
    write(tmp_path, "ordm.stagetool.yaml", DEVICE_ORDER_SPEC.replace("{data: 4}", f"{{data: {size}}}"))
    monkeypatch.chdir(tmp_path)
    devices = sorted(target_devices(topology)[:size], key=lambda d: d.id)  # jax.devices() lists them by id
    f, staged = _stage(run_cli, "ordm.py:step", topology)
    raw = _raw_module(model, "ordm")
    _, step, structs = raw.build(devices)
    compiled = step.lower(*structs).compile()
    assert _figures(f["memory"]["record"]) == _xla(compiled)
    assert _program(staged) == _program(compiled.as_text())
    ordered = [n for n in f["notes"] if "another order" in n]
    if topology == "v5e:2x2":  # the torus walk is not the id order: the module's order is staged, and said
        assert len(ordered) == 1 and "ids [0, 1, 2, 3]" in ordered[0] and "[0, 1, 3, 2]" in ordered[0]
    if topology is None:
        assert not ordered


def test_which_meshes_conflict():
    """Refused: the staged mesh's axes at other sizes (the module's copy at a fixed shape), or other
    devices. Not: another mesh of the staged devices with axes of its own, a size-1 axis more."""
    from stagetool.staging.foreign_mesh import conflicts

    devices = np.array(jax.devices()[:8])
    staged = Mesh(devices.reshape(2, 4), ("replica", "fsdp"))
    assert not conflicts(staged, staged)
    assert not conflicts(Mesh(devices, ("data",)), staged)
    assert not conflicts(Mesh(devices.reshape(2, 2, 2), ("replica", "fsdp", "seq")), staged)
    assert not conflicts(Mesh(devices.reshape(1, 2, 4), ("stage", "replica", "fsdp")), staged)
    assert conflicts(Mesh(devices.reshape(4, 2), ("replica", "fsdp")), staged)
    assert conflicts(Mesh(devices.reshape(2, 4), ("replica", "fsdp")), Mesh(devices.reshape(8, 1), ("replica", "fsdp")))
    assert conflicts(Mesh(np.array(jax.devices()[:4]), ("data",)), Mesh(np.array(jax.devices()[4:8]), ("data",)))


def test_equivalent_spec_over_the_staged_axes():
    """A layout on another mesh of the same devices, spelled over the staged mesh's axes where JAX
    finds one equal (``Sharding.is_equivalent_to``: the same device per shard, the same device order)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from stagetool.inputs.own_mesh import equivalent_spec

    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("replica", "fsdp"))
    flat = Mesh(devices.flatten(), ("devices",))
    assert equivalent_spec(NamedSharding(flat, P("devices")), mesh, 2) == P(("replica", "fsdp"), None)
    assert equivalent_spec(NamedSharding(flat, P(None, "devices")), mesh, 2) == P(None, ("replica", "fsdp"))
    assert equivalent_spec(NamedSharding(flat, P()), mesh, 1) == P(None)
    assert equivalent_spec(NamedSharding(Mesh(devices.T.flatten(), ("devices",)), P("devices")), mesh, 2) is None


def test_the_same_devices_in_two_orders_is_exit_2_saying_so(run_cli, tmp_path, monkeypatch):
    """A flattened mesh in another device order than the state mesh: JAX compiles one device order per
    program (a real run of this code fails the same way), so exit 2 names both orders and the fix."""
    write(tmp_path, "bv.py", BIG_VISION.replace('flat = Mesh(devices.flatten(), ("data",))',
                                                'flat = Mesh(devices.flatten()[[1, 0, 2, 3, 4, 5, 6, 7]], ("data",))'))
    write(tmp_path, "bv.stagetool.yaml", BIG_VISION_SPEC)
    monkeypatch.chdir(tmp_path)
    r = run_cli("memory", "bv.py:train_step", "--no-peak", check=2)
    assert "ids [0, 1, 2, 3, 4, 5, 6, 7] and [1, 0, 2, 3, 4, 5, 6, 7]" in r.stderr or \
        "ids [1, 0, 2, 3, 4, 5, 6, 7] and [0, 1, 2, 3, 4, 5, 6, 7]" in r.stderr, r.stderr
    assert "mesh.devices.flatten()" in r.stderr and "Traceback" not in r.stderr
