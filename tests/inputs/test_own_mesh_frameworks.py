"""The code's own mesh under ``nnx.jit`` and ``eqx.filter_jit`` (issue 30, item 2): a step whose mesh
is built at import from ``jax.devices()`` as (4, 2), staged on another shape (``--mesh 2x4``,
``--mesh 8x1``, a sweep row), is either re-laid by axis name with every figure equal to the framework
compiling the same code built at that shape (on the CPU mesh and on a compile-only v5e:2x4), or
exit 2 naming both meshes and the user's line — never a silent mixed program.

The raw side imports the same module as plain Python and calls its ``build(devices, fsdp, tensor)``
at the staged shape on the same 8 devices (simulated CPU, or libtpu's compile-only v5e:2x4), then
``.lower(...).compile()``.
"""

from __future__ import annotations


import jax
import numpy as np
import pytest
from helpers import NNX_FSDP_TENSOR_MODULE, memory_of, raw_module, write
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

NNX_STEP = '''
"""nnx.jit step: the wrapper's in/out_shardings on the module's own mesh (nnx.StateSharding from
nnx.get_named_sharding), donating the model."""
''' + NNX_FSDP_TENSOR_MODULE + '''    state = nnx.StateSharding(nnx.get_named_sharding(nnx.state(abstract), mesh))

    def _step(model, x):
        def loss(m):
            return jnp.mean((m(x) - x) ** 2)
        l, g = nnx.value_and_grad(loss)(model)
        nnx.update(model, jax.tree.map(lambda p, d: p - 0.1 * d, nnx.state(model, nnx.Param), g))
        return l

    step = nnx.jit(_step, in_shardings=(state, NamedSharding(mesh, P("fsdp", None))),
                   out_shardings=NamedSharding(mesh, P()), donate_argnums=(0,))
    return mesh, abstract, step


MESH, _abstract, train_step = build(jax.devices())


def make_model():
    return M(nnx.Rngs(0))
'''

NNX_SPEC = '''
version: 1
mesh:
  axes: {fsdp: 4, tensor: 2}
functions:
  train_step:
    target: nj.py:train_step
    args:
      - init: nj.py:make_model
      - f32[64,256]
'''

NNX_METADATA = '''
"""A plain nnx.jit step; the mesh is in the Variables' metadata (nnx.with_partitioning(..., mesh=mesh)),
so the model's arrays are laid on the module's own mesh when it is built."""
import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh


def build(devices, fsdp=4, tensor=2):
    mesh = Mesh(mesh_utils.create_device_mesh((fsdp, tensor), devices), ("fsdp", "tensor"))

    class M(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.lin = nnx.Linear(256, 512, kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor"), mesh=mesh),
                                  rngs=rngs)
            self.out = nnx.Linear(512, 256, kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp"), mesh=mesh),
                                  rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.lin(x)))

    @nnx.jit
    def step(model, x):
        def loss(m):
            return jnp.mean((m(x) - x) ** 2)
        l, g = nnx.value_and_grad(loss)(model)
        nnx.update(model, jax.tree.map(lambda p, d: p - 0.1 * d, nnx.state(model, nnx.Param), g))
        return l

    return mesh, M, step


MESH, M, train_step = build(jax.devices())


def make_model():
    return M(nnx.Rngs(0))
'''

EQX_STEP = '''
"""eqx.filter_jit step: its shardings baked in by the module's own mesh (eqx.filter_shard and
jax.lax.with_sharding_constraint on NamedSharding(mesh, ...))."""
import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def build(devices, fsdp=4, tensor=2):
    mesh = Mesh(mesh_utils.create_device_mesh((fsdp, tensor), devices), ("fsdp", "tensor"))

    @eqx.filter_jit
    def step(model, x):
        x = eqx.filter_shard(x, NamedSharding(mesh, P("fsdp", None)))

        def loss(m):
            h = jax.lax.with_sharding_constraint(jax.vmap(m)(x), NamedSharding(mesh, P("fsdp", "tensor")))
            return jnp.mean(h ** 2)
        return eqx.filter_value_and_grad(loss)(model)

    return mesh, step


MESH, train_step = build(jax.devices())


def make_model():
    return eqx.nn.MLP(256, 256, 512, 1, key=jax.random.key(0))
'''

EQX_SPEC = '''
version: 1
mesh:
  axes: {fsdp: 4, tensor: 2}
functions:
  train_step:
    target: ej.py:train_step
    args:
      - init: ej.py:make_model
      - f32[64,256] @ [fsdp, null]
'''

PLAIN_STEP = '''
import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH = Mesh(mesh_utils.create_device_mesh((4, 2), jax.devices()), ("fsdp", "tensor"))


@jax.jit
def step(w, x):
    h = x @ w
    return jax.lax.with_sharding_constraint(h, NamedSharding(MESH, P(None, "fsdp")))
'''

PLAIN_SPEC = '''
version: 1
mesh:
  axes: {fsdp: 4, tensor: 2}
functions:
  step:
    target: pj.py:step
    args: ['f32[256,512] @ [null, tensor]', 'f32[64,256] @ [fsdp, null]']
'''

SHAPES = {None: (4, 2), "2x4": (2, 4), "8x1": (8, 1)}


def _figures(record) -> tuple:
    return (record["argument_bytes"], record["output_bytes"], record["alias_bytes"], record["temp_bytes"],
            record["generated_code_bytes"])


def _xla(compiled) -> tuple:
    s = compiled.memory_analysis()
    return (s.argument_size_in_bytes, s.output_size_in_bytes, s.alias_size_in_bytes, s.temp_size_in_bytes,
            s.generated_code_size_in_bytes)


def _devices(topology: str | None) -> list:
    if topology is None:
        return jax.devices()[:8]
    from stagetool.devices import tpu_topology
    from stagetool.plan.target import parse_target

    if not tpu_topology.libtpu_available():
        pytest.skip("libtpu not installed: pip install -e '.[tpu]'")
    return list(tpu_topology.tpu_topology(parse_target(topology)).devices)


@pytest.mark.parametrize(("topology", "mesh"), [(None, None), (None, "2x4"), (None, "8x1"), ("v5e:2x4", None),
                                                ("v5e:2x4", "2x4")])
def test_nnx_jit_own_shardings_are_relaid_as_nnx_compiles_them(run_cli, tmp_path, monkeypatch, topology, mesh):
    """nnx.jit(in_shardings=StateSharding on the module's (4, 2) mesh, out_shardings, donate): staged
    at another shape, the wrapper is jitted again by nnx.jit with its shardings re-laid by axis name
    (a note names both meshes), and every XLA figure is nnx.jit's own for the module built at that shape."""
    pytest.importorskip("flax.nnx")
    model = write(tmp_path, "nj.py", NNX_STEP)
    write(tmp_path, "nj.stagetool.yaml", NNX_SPEC)
    monkeypatch.chdir(tmp_path)
    devices = _devices(topology)
    f = memory_of(run_cli, "nj.py:train_step", mesh=mesh, topology=topology)
    relaid = [n for n in f["notes"] if "re-laid by axis name" in n]
    fsdp, tensor = SHAPES[mesh]
    kind = getattr(devices[0], "device_kind", "cpu")
    if mesh is None:
        assert relaid == []
    else:
        assert len(relaid) == 1 and "own nnx.jit shardings" in relaid[0]
        assert f"(fsdp=4 × tensor=2 on 8 {kind} devices)" in relaid[0]
        assert f"(fsdp={fsdp} × tensor={tensor} on 8 {kind} devices)" in relaid[0]
    raw = raw_module(model, "nj")
    _, abstract, step = raw.build(devices, fsdp, tensor)
    x = jax.ShapeDtypeStruct((64, 256), jax.numpy.float32, sharding=step.in_shardings[1])  # the module's own
    compiled = step.lower(abstract, x).compile()
    assert _figures(f["memory"]["record"]) == _xla(compiled)
    assert f["memory"]["record"]["alias_bytes"] > 0  # the wrapper's donation holds after the re-lay


@pytest.mark.parametrize("mesh", [None, "2x4", "8x1"])
def test_nnx_partitioning_metadata_on_the_modules_mesh(run_cli, tmp_path, monkeypatch, mesh):
    """nnx.with_partitioning(init, names, mesh=mesh) resolved on the module's (4, 2) mesh when the init
    runs: its shardings are taken by axis name on the staged mesh (a note names both), and every figure
    is nnx.jit's for the module built at that shape (leaves without an annotation replicated, as
    stagetool lays them)."""
    pytest.importorskip("flax.nnx")
    from flax import nnx

    model = write(tmp_path, "nm.py", NNX_METADATA)
    write(tmp_path, "nm.stagetool.yaml", NNX_SPEC.replace("nj.py", "nm.py"))
    monkeypatch.chdir(tmp_path)
    f = memory_of(run_cli, "nm.py:train_step", mesh=mesh)
    fsdp, tensor = SHAPES[mesh]
    taken = [n for n in f["notes"] if "taken by axis name" in n]
    assert len(taken) == (0 if mesh is None else 1)
    if mesh:
        assert "fsdp=4 × tensor=2" in taken[0] and f"(fsdp={fsdp} × tensor={tensor} on 8 cpu devices)" in taken[0]
    raw = raw_module(model, "nm")
    mesh_, cls, step = raw.build(jax.devices()[:8], fsdp, tensor)
    replicated = NamedSharding(mesh_, P())
    abstract = jax.tree.map(lambda a: a if getattr(a, "sharding", None) is not None
                            else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                            nnx.eval_shape(lambda: cls(nnx.Rngs(0))))
    x = jax.ShapeDtypeStruct((64, 256), jax.numpy.float32, sharding=replicated)
    assert _figures(f["memory"]["record"]) == _xla(step.lower(abstract, x).compile())


@pytest.mark.parametrize("mesh", ["2x4", "8x1"])
def test_eqx_filter_jit_with_the_modules_mesh_in_the_body_is_exit_2(run_cli, tmp_path, monkeypatch, mesh):
    """eqx.filter_shard / with_sharding_constraint on NamedSharding(the module's mesh): JAX accepts the
    mixed program (same devices, same order), so staging stops before lowering, naming both meshes and
    the user's line; on the module's own shape every figure is Equinox's."""
    pytest.importorskip("equinox")
    model = write(tmp_path, "ej.py", EQX_STEP)
    write(tmp_path, "ej.stagetool.yaml", EQX_SPEC)
    monkeypatch.chdir(tmp_path)
    r = run_cli("memory", "ej.py:train_step", "--no-peak", "--mesh", mesh, check=2)
    fsdp, tensor = SHAPES[mesh]
    assert "fsdp=4 × tensor=2 on 8 cpu devices" in r.stderr
    assert f"fsdp={fsdp} × tensor={tensor} on 8 cpu devices" in r.stderr
    line = next(i for i, t in enumerate(model.read_text().splitlines(), 1) if "eqx.filter_shard(x" in t)
    assert f"ej.py:{line} in build.<locals>.step" in r.stderr and "--mesh fsdp=4,tensor=2" in r.stderr

    f = memory_of(run_cli, "ej.py:train_step")
    raw = raw_module(model, "ej")
    mesh_, step = raw.build(jax.devices()[:8])
    replicated = NamedSharding(mesh_, P())  # as stagetool lays an init's leaves that name no sharding
    mlp = jax.tree.map(lambda a: jax.device_put(a, replicated) if isinstance(a, jax.Array) else a, raw.make_model())
    x = jax.numpy.zeros((64, 256), jax.numpy.float32)
    x = jax.device_put(x, NamedSharding(mesh_, P("fsdp", None)))
    compiled = step.lower(mlp, x).compile().compiled  # Equinox's Compiled holds jax's
    assert _figures(f["memory"]["record"]) == _xla(compiled)


def test_plain_jit_with_the_modules_mesh_in_the_body_is_exit_2(run_cli, tmp_path, monkeypatch):
    """The same for a plain jax.jit step (its jit has no shardings to re-lay; its body names the mesh)."""
    model = write(tmp_path, "pj.py", PLAIN_STEP)
    write(tmp_path, "pj.stagetool.yaml", PLAIN_SPEC)
    monkeypatch.chdir(tmp_path)
    r = run_cli("collectives", "pj.py:step", "--mesh", "2x4", check=2)
    assert "in sharding_constraint" in r.stderr and "fsdp=2 × tensor=4 on 8 cpu devices" in r.stderr
    line = next(i for i, t in enumerate(model.read_text().splitlines(), 1) if "with_sharding_constraint" in t)
    assert f"pj.py:{line} in step" in r.stderr
    plain = run_cli("collectives", "pj.py:step", "--format", "json", check=0).json()
    # a size-1 axis more on the staged mesh lays every device as the module's mesh does: the same program
    write(tmp_path, "pj1.stagetool.yaml", PLAIN_SPEC.replace("{fsdp: 4, tensor: 2}", "{replica: 1, fsdp: 4, tensor: 2}"))
    one = run_cli("collectives", "pj.py:step", "--spec", "pj1.stagetool.yaml", "--format", "json", check=0).json()
    kinds = [sorted((i["collective"]["kind"], i["collective"]["bytes_per_device"])
                    for i in doc["functions"][0]["collectives"]["items"]) for doc in (plain, one)]
    assert kinds[0] == kinds[1] and kinds[0]


@pytest.mark.slow  # a sweep: each of its six configurations in a process of its own
def test_a_sweep_over_mesh_shapes_is_faithful_or_an_error_row(run_cli, tmp_path, monkeypatch):
    """Rows of the nnx.jit step are re-laid (each row's figures are the single run's at that shape);
    rows of the Equinox step at another shape are failed rows naming both meshes, never ranked."""
    pytest.importorskip("flax.nnx")
    pytest.importorskip("equinox")
    write(tmp_path, "nj.py", NNX_STEP)
    write(tmp_path, "nj.stagetool.yaml", NNX_SPEC)
    write(tmp_path, "ej.py", EQX_STEP)
    write(tmp_path, "ej.stagetool.yaml", EQX_SPEC)
    monkeypatch.chdir(tmp_path)
    doc = run_cli("sweep", "ej.py:train_step", "--mesh", "4x2,2x4,8x1", "--jobs", "1", "--format", "json").json()
    rows = {r["values"]["mesh"]: r for r in doc["rows"]}
    assert [rows[m]["status"] for m in ("4x2", "2x4", "8x1")] == ["ok", "error", "error"]
    assert "fsdp=4 × tensor=2" in rows["2x4"]["error"]["message"] and rows["2x4"]["peak_bytes_per_device"] is None
    assert doc["best"] == "mesh=4x2"

    doc = run_cli("sweep", "nj.py:train_step", "--mesh", "4x2,2x4,8x1", "--jobs", "1", "--format", "json",
                  check=0).json()
    rows = {r["values"]["mesh"]: r for r in doc["rows"]}
    assert all(r["status"] == "ok" for r in rows.values())
    for m in ("2x4", "8x1"):
        single = run_cli("memory", "nj.py:train_step", "--mesh", m, "--format", "json", check=0).json()
        assert rows[m]["peak_bytes_per_device"] == single["functions"][0]["memory"]["record"]["peak_bytes"]
    assert doc["best"] == min(rows.values(), key=lambda r: (r["peak_bytes_per_device"], r["index"]))["id"]


def test_which_meshes_differ():
    """Another shape of the same devices differs; a size-1 axis more, another device order or other
    axis types do not (the same layout, or refused by JAX itself); devices outside the staged ones do."""
    from jax.sharding import AxisType, Mesh

    from stagetool.staging.foreign_mesh import differs

    devices = jax.devices()[:8]
    staged = Mesh(np.array(devices).reshape(4, 2), ("fsdp", "tensor"))
    assert not differs(staged, staged)
    assert differs(Mesh(np.array(devices).reshape(2, 4), ("fsdp", "tensor")), staged)
    assert differs(Mesh(np.array(devices).reshape(4, 2), ("data", "tensor")), staged)
    assert not differs(Mesh(np.array(devices).reshape(1, 4, 2), ("replica", "fsdp", "tensor")), staged)
    assert not differs(Mesh(np.array(devices[::-1]).reshape(4, 2), ("fsdp", "tensor")), staged)
    assert not differs(Mesh(np.array(devices).reshape(4, 2), ("fsdp", "tensor"),
                            axis_types=(AxisType.Explicit,) * 2), staged)
    assert differs(Mesh(np.array(devices[:4]).reshape(4, 1), ("fsdp", "tensor")),
                   Mesh(np.array(devices[4:]).reshape(4, 1), ("fsdp", "tensor")))


EQX_DATA_PARALLEL = '''
"""The shape of a data-parallel Equinox step written for a CPU laptop: the module asks JAX for its CPU
devices at import, builds a 1-D mesh over jax.devices(), keeps the model and its optimizer state as
module globals, and the donating filter_jit step pins its arguments and results with filter_shard on
the module's shardings."""
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

jax.config.update("jax_num_cpu_devices", CPU_DEVICES)

mesh = jax.make_mesh((len(jax.devices()),), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

net = eqx.nn.MLP(8, 8, 64, 2, key=jax.random.key(3))
opt = optax.adam(1e-3)
net, opt_state = eqx.filter_shard((net, opt.init(eqx.filter(net, eqx.is_inexact_array))), everywhere)


@eqx.filter_jit(donate="all")
def train_step(net, opt_state, x, y):
    net, opt_state = eqx.filter_shard((net, opt_state), everywhere)
    x, y = eqx.filter_shard((x, y), rows)

    def loss(n):
        return jnp.mean((jax.vmap(n)(x) - y) ** 2)

    grads = eqx.filter_grad(loss)(net)
    updates, opt_state = opt.update(grads, opt_state)
    return eqx.filter_shard((eqx.apply_updates(net, updates), opt_state), everywhere)
'''

EQX_DATA_PARALLEL_SPEC = '''
version: 1
mesh:
  axes: {batch: 8}
functions:
  train_step:
    target: edp.py:train_step
    args:
      - {ref: edp.py:net}
      - {ref: edp.py:opt_state}
      - 'f32[32,8] @ [batch]'
      - 'f32[32,8] @ [batch]'
'''


def test_a_module_that_sets_its_cpu_device_count_at_import_stages(run_cli, tmp_path, monkeypatch):
    """``jax.config.update("jax_num_cpu_devices", n)`` at import, as a CPU-laptop example writes it, is
    refused by JAX once its backend runs, which it always does here (stagetool starts it with the staged
    devices; an ``XLA_FLAGS`` device count does too). The module used to fail to import (exit 2, JAX's
    RuntimeError); its setting is now left out with a note naming the line, and every figure is
    Equinox's own executable's for the same code on the staged 8 devices."""
    pytest.importorskip("equinox")
    pytest.importorskip("optax")
    write(tmp_path, "edp.py", EQX_DATA_PARALLEL.replace("CPU_DEVICES", "4"))  # the backend runs 8
    write(tmp_path, "edp.stagetool.yaml", EQX_DATA_PARALLEL_SPEC)
    monkeypatch.chdir(tmp_path)
    f = memory_of(run_cli, "edp.py:train_step")
    line = next(i for i, t in enumerate(EQX_DATA_PARALLEL.splitlines()) if "jax_num_cpu_devices" in t)
    (note,) = [n for n in f["notes"] if "jax_num_cpu_devices" in n]
    assert note.startswith(f"edp.py:{line} sets jax_num_cpu_devices = 4") and "8 staged cpu devices" in note
    assert f["mesh"]["device_count"] == 8
    assert jax.config.update.__module__.startswith("jax")  # JAX's own again

    # raw side: the same module where the setting is the running count (JAX takes an equal value)
    raw = raw_module(write(tmp_path, "edp_raw.py", EQX_DATA_PARALLEL.replace("CPU_DEVICES", "8")), "edp")
    x = jax.device_put(np.zeros((32, 8), np.float32), raw.rows)
    compiled = raw.train_step.lower(raw.net, raw.opt_state, x, x).compile().compiled
    assert _figures(f["memory"]["record"]) == _xla(compiled)
    assert f["memory"]["record"]["alias_bytes"] > 0  # donate="all": the state's buffers are reused
