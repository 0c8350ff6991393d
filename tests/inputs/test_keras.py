"""Keras 3 on the JAX backend with ``keras.distribution`` (issue 30): a train step written as Keras'
distributed-training guide writes it (a ``DeviceMesh`` over ``keras.distribution.list_devices()``, a
``LayoutMap`` with regex keys, ``ModelParallel`` set at import, ``model.stateless_call`` and the
optimizer's ``stateless_apply`` under ``jax.jit(..., donate_argnums=0)``) stages through stagetool
as raw JAX compiles it: every memory figure, the FLOPs and the collectives equal raw JAX's
``train_step.lower(...).compile()`` of the same module on the same devices, and the state's leaves
carry the Keras variables' own paths (``state/0/hidden/kernel``), not their positions.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections import Counter

import jax
import pytest
from helpers import import_afresh, target_devices, write
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.devices import tpu_topology
from stagetool.plan.target import parse_target

if "keras" not in sys.modules:  # Keras reads its backend once, at its first import
    os.environ["KERAS_BACKEND"] = "jax"
keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":
    pytest.skip(f"Keras was imported with the {keras.backend.backend()} backend", allow_module_level=True)

MODEL = '''
"""Keras 3 on JAX as its distributed-training guide writes it: keras.distribution set at import."""
import jax
import keras
from keras import layers

MESH_SHAPE = (4, 2)
V, D, H, C, T = 512, 64, 256, 16, 8

devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh(shape=MESH_SHAPE, axis_names=("batch", "model"), devices=devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*embedding/embeddings"] = (None, "model")
layout_map[".*hidden/kernel"] = (None, "model")
layout_map[".*logits/kernel"] = ("model", None)
distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
keras.distribution.set_distribution(distribution)

inputs = keras.Input((T,), dtype="int32")
h = layers.Embedding(V, D, name="embedding")(inputs)
h = layers.Flatten(name="flatten")(h)
h = layers.Dense(H, activation="relu", name="hidden")(h)
outputs = layers.Dense(C, name="logits")(h)
model = keras.Model(inputs, outputs, name="classifier")
optimizer = keras.optimizers.Adam(1e-3, name="adam")
optimizer.build(model.trainable_variables)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compute_loss(trainable, non_trainable, x, y):
    y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
    return loss_fn(y, y_pred), non_trainable


grad_fn = jax.value_and_grad(compute_loss, has_aux=True)


def _train_step(state, x, y):
    trainable, non_trainable, opt_vars = state
    (loss, non_trainable), grads = grad_fn(trainable, non_trainable, x, y)
    trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
    return loss, (trainable, non_trainable, opt_vars)


train_step = jax.jit(_train_step, donate_argnums=0)


def init_state():
    return ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables])


STATE = init_state()
'''

SPEC = '''
version: 1
mesh:
  axes: {batch: 4, model: 2}
functions:
  train_step:
    target: kr.py:train_step
    args:
      - STATE
      - i32[64,8] @ [batch, null]
      - i32[64] @ [batch]
'''

STATE_FORMS = {"ref": "{ref: kr.py:STATE}", "init": "{init: kr.py:init_state}", "call": "{call: kr.py:init_state}"}

COLLECTIVE_RE = re.compile(r"=\s*\S.*?\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")

#: the variables of the model and its optimizer, as Keras names them, in the state's order
NAMES = (["embedding/embeddings", "hidden/kernel", "hidden/bias", "logits/kernel", "logits/bias"],
         ["adam/iteration", "adam/learning_rate"]
         + [f"adam/{v}_{slot}" for v in ("embedding_embeddings", "hidden_kernel", "hidden_bias", "logits_kernel",
                                         "logits_bias") for slot in ("momentum", "velocity")])


@pytest.fixture(autouse=True)
def keras_session():
    """Keras' global state (the distribution a module sets at import, its name counters) is the
    process's: clear it around each test, so that no other test sees this one's distribution."""
    keras.backend.clear_session()
    yield
    keras.backend.clear_session()


def _model(tmp_path, monkeypatch, state: str = "ref", text: str = MODEL):
    model = write(tmp_path, "kr.py", text)
    write(tmp_path, "kr.stagetool.yaml", SPEC.replace("STATE", STATE_FORMS[state]))
    monkeypatch.chdir(tmp_path)
    return model


def _raw_module(path, text: str | None = None):
    """The model module imported as plain Python (its own distribution, on this process's devices)."""
    name = f"_raw_kr_{abs(hash(text or ''))}"
    if text is not None:
        path = write(path.parent, f"{name}.py", text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _raw_compile(raw, mesh=None, state=None):
    """Raw JAX: the module's own ``train_step.lower(state, x, y).compile()``, the batch laid out by
    the distribution's data layout (``batch_dim_name``), on ``mesh`` (default: the module's own)."""
    mesh = raw.distribution.device_mesh.backend_mesh if mesh is None else mesh
    x = jax.ShapeDtypeStruct((64, 8), jax.numpy.int32, sharding=NamedSharding(mesh, P("batch", None)))
    y = jax.ShapeDtypeStruct((64,), jax.numpy.int32, sharding=NamedSharding(mesh, P("batch")))
    return raw.train_step.lower(raw.STATE if state is None else state, x, y).compile()


def _report(run_cli, *extra) -> dict:
    doc = run_cli("report", "kr.py:train_step", "--format", "json", *extra, check=0).json()
    f = doc["functions"][0]
    assert f.get("error") is None
    return f


def _trimmed(dims: tuple) -> tuple:
    """PartitionSpec entries without trailing Nones (``P(None,)`` and ``P()`` are one layout)."""
    dims = list(dims)
    while dims and dims[-1] is None:
        dims.pop()
    return tuple(dims)


def _assert_raw(f: dict, compiled) -> None:
    """stagetool's figures are raw JAX's for the same program: memory, FLOPs, collectives (a
    compile-only GPU program has no ``cost_analysis()``: its FLOPs are counted from raw JAX's HLO)."""
    mem = compiled.memory_analysis()
    record = f["memory"]["record"]
    # (not generated_code_bytes: on TPU it holds the HLO's stack-frame tables, and Keras' frames are kept
    # there with every caller's above them: stagetool's CLI frames, this test's: 523,776 vs 521,216 B)
    assert (record["argument_bytes"], record["output_bytes"], record["alias_bytes"], record["temp_bytes"],
            record["peak_bytes_reported"]) == (
        mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes, mem.temp_size_in_bytes,
        mem.peak_memory_in_bytes)
    xla = compiled.cost_analysis()
    if xla is None:
        from stagetool.analysis.sections import derived_per_device_cost
        from stagetool.hlo.parser import parse_hlo_module

        assert f["cost"]["per_device"]["flops"] == derived_per_device_cost(parse_hlo_module(compiled.as_text())).flops
    else:
        assert f["cost"]["per_device"]["flops"] == xla.get("flops")
    ours = Counter(i["collective"]["kind"] for i in f["collectives"]["items"])
    raw = Counter(m.group(1) for line in compiled.as_text().splitlines() for m in [COLLECTIVE_RE.search(line)] if m)
    assert ours == raw and sum(raw.values()) > 0


_RAW_ON_THE_CPU_MESH: list = []


@pytest.mark.parametrize("state", sorted(STATE_FORMS))
def test_keras_step_stages_as_raw_jax_with_named_leaves(run_cli_shared, tmp_path, monkeypatch, state):
    model = _model(tmp_path, monkeypatch, state)
    f = _report(run_cli_shared)  # one program, three spec forms of its state: compiled once in the session
    assert f["mesh"]["device_count"] == 8 and not f["notes"]
    if not _RAW_ON_THE_CPU_MESH:  # raw JAX's side is the same module (MODEL) for every form: compiled once
        raw = _raw_module(model)
        _RAW_ON_THE_CPU_MESH.append((raw, _raw_compile(raw)))
    ((raw, compiled),) = _RAW_ON_THE_CPU_MESH
    _assert_raw(f, compiled)
    assert f["memory"]["record"]["alias_bytes"] > 0  # the donated state is reused

    # every state leaf is named by its Keras variable's path, with the sharding its LayoutMap gives
    inputs = {x["path"]: x for x in f["inputs"]}
    expected = [f"state/0/{n}" for n in NAMES[0]] + [f"state/2/{n}" for n in NAMES[1]]
    assert [p for p in inputs if p.startswith("state/")] == expected
    # the new state the step returns, shaped as the state, is named as it (the loss keeps its key path)
    assert [x["path"] for x in f["outputs"]] == (["out/0"] + [f"out/1/0/{n}" for n in NAMES[0]]
                                                 + [f"out/1/2/{n}" for n in NAMES[1]])
    assert [v.path for v in raw.model.trainable_variables] == NAMES[0]
    assert [v.path for v in raw.optimizer.variables] == NAMES[1]
    assert inputs["state/0/hidden/kernel"]["declared"] == "P(None, 'model')"
    assert inputs["state/2/adam/logits_kernel_velocity"]["declared"] == "P('model', None)"
    assert inputs["state/0/hidden/bias"]["declared"] in ("P(None)", "P()")
    raw_in = [_trimmed(tuple(s.spec)) for s in jax.tree_util.tree_leaves(compiled.input_shardings[0][0])]
    ours_in = [_trimmed(eval(inputs[p]["compiled"], {"P": lambda *a: a})) for p in expected]
    assert raw_in == ours_in and ("model",) in ours_in


def test_keras_leaf_names_in_check(run_cli, run_cli_shared, tmp_path, monkeypatch):
    """A one-line LayoutMap edit makes ``check`` fail naming the Keras variables it moved."""
    _model(tmp_path, monkeypatch)
    run_cli_shared("snapshot", "--spec", "kr.stagetool.yaml", "-o", "lock.json", check=0)
    edited = MODEL.replace('[".*hidden/kernel"] = (None, "model")', '[".*hidden/kernel"] = ("model", None)')
    assert edited != MODEL
    _model(tmp_path, monkeypatch, text=edited)
    import_afresh("kr")  # `check` runs in a new process in CI: the edited file is imported afresh
    r = run_cli("check", "--spec", "kr.stagetool.yaml", "--baseline", "lock.json", check=1)
    out = r.stdout + r.stderr
    assert "state/0/hidden/kernel" in out and "state/2/adam/hidden_kernel_momentum" in out
    assert "state/0/logits/kernel" not in out and not re.search(r"(state|out/1)/\d+/\d+", out)


def test_keras_other_mesh_is_relaid_as_raw_jax_at_that_shape(run_cli, tmp_path, monkeypatch):
    """``--mesh`` of another shape: the state's shardings (on the module's 4×2 mesh) are taken by axis
    name on the staged 2×4 mesh, said in a note, and every figure is raw JAX's for the same code with
    its mesh built at that shape."""
    _model(tmp_path, monkeypatch)
    f = _report(run_cli, "--mesh", "batch=2,model=4")
    notes = " ".join(f["notes"])
    assert "batch=4 × model=2 on 8 cpu devices" in notes and "taken by axis name on the staged mesh (batch=2 × " \
        "model=4 on 8 cpu devices)" in notes
    raw = _raw_module(tmp_path / "kr.py", MODEL.replace("MESH_SHAPE = (4, 2)", "MESH_SHAPE = (2, 4)"))
    _assert_raw(f, _raw_compile(raw))
    assert "state/0/hidden/kernel" in {x["path"] for x in f["inputs"]}


@pytest.mark.parametrize("topology", ["v5e:2x4", "h100:8"])
def test_keras_step_on_a_compile_only_topology(run_cli, tmp_path, monkeypatch, topology):
    """Under ``--topology`` the module's ``keras.distribution.list_devices()`` are the compile-only
    devices, and Keras creates its variables there (their values held on the host, their layouts
    kept): every figure is raw JAX's compile of the same step with the Keras mesh built over those
    devices and each variable laid out as its LayoutMap says."""
    model = _model(tmp_path, monkeypatch)
    devices = target_devices(topology)
    f = _report(run_cli, "--topology", topology)
    assert f["mesh"]["device_count"] == 8 and f["mesh"]["platform"] == devices[0].platform
    relaid = [n for n in f["notes"] if "taken by axis name" in n]  # Keras' mesh is by device id
    assert all("(the staged devices in another order)" in n for n in relaid)
    assert jax.devices()[0].platform == "cpu" and jax.device_put.__module__.startswith("jax")  # JAX's own again
    raw = _raw_module(model)  # on this process's CPU devices: the layouts its LayoutMap gives
    mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"), devices=sorted(devices, key=lambda d: d.id))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh.backend_mesh, a.sharding.spec)), raw.STATE)
    _assert_raw(f, _raw_compile(raw, mesh.backend_mesh, state))
    inputs = {x["path"]: x for x in f["inputs"]}
    assert inputs["state/0/hidden/kernel"]["declared"] == "P(None, 'model')"
    assert inputs["state/2/adam/logits_kernel_momentum"]["compiled"] == "P('model', None)"


def test_device_put_on_compile_only_devices_is_held_on_the_host():
    """Inside the staged world of a topology, ``jax.device_put`` onto its compile-only devices keeps
    the value on the host and remembers the sharding asked for; outside, it is JAX's own again."""
    from stagetool.core.mesh import MeshSpec
    from stagetool.devices.provision import provision
    from stagetool.devices.world import placed_sharding, staged_world

    if not tpu_topology.libtpu_available():
        pytest.skip("libtpu not installed: pip install -e '.[tpu]'")
    setup = provision(MeshSpec((("a", 4), ("b", 2))), parse_target("v5e:2x4"))
    sharding = NamedSharding(setup.mesh, P("a", None))
    with staged_world(setup):
        x = jax.device_put(jax.numpy.ones((8, 4)), sharding)
        y = jax.device_put(jax.numpy.ones(3), jax.devices("cpu")[1])  # a host device: JAX's own placement
    assert float(x.sum()) == 32.0 and x.devices() <= set(jax.devices("cpu"))
    assert placed_sharding(x) is sharding and placed_sharding(jax.numpy.ones((8, 4))) is None
    assert y.devices() == {jax.devices("cpu")[1]} and placed_sharding(y) is None
    with pytest.raises(Exception, match="compile-only"):  # outside the world: JAX's own device_put
        jax.device_put(jax.numpy.ones((8, 4)), sharding)


SEQUENTIAL = '''
"""A Sequential model under ModelParallel whose LayoutMap keys name the layers' own paths without the
model's prefix, as a guide written for an older Keras does: Keras matches keys whole, so 'wide/kernel'
misses 'sequential/wide/kernel'; '.*out/kernel' takes."""
import jax
import keras
from keras import layers

mesh = keras.distribution.DeviceMesh(shape=(2, 4), axis_names=("data", "model"),
                                     devices=keras.distribution.list_devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["wide/kernel"] = (None, "model")
layout_map[".*out/kernel"] = ("model", None)
distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
keras.distribution.set_distribution(distribution)

model = keras.Sequential([layers.Input(shape=(96,)), layers.Dense(128, activation="relu", name="wide"),
                          layers.Dense(8, name="out")])
optimizer = keras.optimizers.SGD(1e-2)
optimizer.build(model.trainable_variables)
loss_fn = keras.losses.MeanSquaredError()


def _loss(trainable, non_trainable, x, y):
    y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x)
    return loss_fn(y, y_pred), non_trainable


@jax.jit
def train_step(state, x, y):
    trainable, non_trainable, opt_vars = state
    (loss, non_trainable), grads = jax.value_and_grad(_loss, has_aux=True)(trainable, non_trainable, x, y)
    trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
    return loss, (trainable, non_trainable, opt_vars)


def init_state():
    return ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables])
'''


def test_a_layout_map_key_that_matches_no_path_is_named(run_cli, tmp_path, monkeypatch):
    """The LayoutMap key that lays out nothing is named in a note with the path it was likely meant
    for and the key that matches it; the key that takes gets none; and the figures are raw Keras's,
    which leaves the missed kernel replicated."""
    module = write(tmp_path, "kseq.py", SEQUENTIAL)
    write(tmp_path, "kseq.stagetool.yaml", '''
version: 1
mesh:
  axes: {data: 2, model: 4}
functions:
  train_step:
    target: kseq.py:train_step
    args: [{call: kseq.py:init_state}, 'f32[32,96] @ [data, null]', 'f32[32,8] @ [data, null]']
''')
    monkeypatch.chdir(tmp_path)
    doc = run_cli("report", "kseq.py:train_step", "--format", "json", check=0).json()
    (f,) = doc["functions"]
    layout_notes = [n for n in f["notes"] if "LayoutMap key" in n]
    assert len(layout_notes) == 1, f["notes"]
    assert "'wide/kernel' lays out nothing" in layout_notes[0] and "sequential/wide/kernel" in layout_notes[0]
    assert "'.*wide/kernel'" in layout_notes[0]
    inputs = {x["path"]: x for x in f["inputs"]}
    assert inputs["state/0/sequential/wide/kernel"]["compiled"] == "P(None, None)"
    assert inputs["state/0/sequential/out/kernel"]["compiled"] == "P('model', None)"

    raw = _raw_module(module)
    mesh = raw.distribution.device_mesh.backend_mesh
    x = jax.ShapeDtypeStruct((32, 96), jax.numpy.float32, sharding=NamedSharding(mesh, P("data", None)))
    y = jax.ShapeDtypeStruct((32, 8), jax.numpy.float32, sharding=NamedSharding(mesh, P("data", None)))
    compiled = raw.train_step.lower(raw.init_state(), x, y).compile()
    _assert_raw(f, compiled)


COMPILED = '''
"""A model compiled as model.fit wants it (model.compile(optimizer=..., loss=...)), its optimizer held
only by the model (model.optimizer), under DataParallel; the step applies that optimizer statelessly."""
import jax
import keras
from keras import layers

keras.distribution.set_distribution(keras.distribution.DataParallel())
model = keras.Sequential([layers.Input(shape=(48,)), layers.Dense(64, activation="relu", name="hid"),
                          layers.Dense(4, name="head")])
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.MeanSquaredError())
model.optimizer.build(model.trainable_variables)


def _loss(trainable, non_trainable, x, y):
    y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x)
    return model.loss(y, y_pred), non_trainable


@jax.jit
def train_step(state, x, y):
    trainable, non_trainable, opt_vars = state
    (loss, non_trainable), grads = jax.value_and_grad(_loss, has_aux=True)(trainable, non_trainable, x, y)
    trainable, opt_vars = model.optimizer.stateless_apply(opt_vars, grads, trainable)
    return loss, (trainable, non_trainable, opt_vars)


def init_state():
    return ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
            [v.value for v in model.optimizer.variables])
'''


def test_a_compiled_models_optimizer_names_its_leaves(run_cli, tmp_path, monkeypatch):
    """The optimizer ``model.compile`` gives a model is held by the model alone (``model.optimizer``),
    not by a module global: its slots were named by position (``state/2/2``); they now carry the
    optimizer's variable paths, as the model's own variables do, and the figures are raw JAX's."""
    module = write(tmp_path, "kc.py", COMPILED)
    write(tmp_path, "kc.stagetool.yaml", '''
version: 1
mesh:
  axes: {batch: 8}
functions:
  train_step:
    target: kc.py:train_step
    args: [{call: kc.py:init_state}, 'f32[32,48] @ [batch, null]', 'f32[32,4] @ [batch, null]']
''')
    monkeypatch.chdir(tmp_path)
    f = run_cli("report", "kc.py:train_step", "--format", "json", check=0).json()["functions"][0]
    raw = _raw_module(module)
    paths = [x["path"] for x in f["inputs"] if x["path"].startswith("state/2/")]
    assert paths == [f"state/2/{v.path}" for v in raw.model.optimizer.variables]
    assert "state/2/adam/sequential_hid_kernel_momentum" in paths, paths

    mesh = raw.model.trainable_variables[0].value.sharding.mesh
    x = jax.ShapeDtypeStruct((32, 48), jax.numpy.float32, sharding=NamedSharding(mesh, P("batch", None)))
    y = jax.ShapeDtypeStruct((32, 4), jax.numpy.float32, sharding=NamedSharding(mesh, P("batch", None)))
    _assert_raw(f, raw.train_step.lower(raw.init_state(), x, y).compile())
