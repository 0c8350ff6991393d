"""stagetool.inspect: the live function and arrays give the CLI's report on the same program."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import EXAMPLES, write

import stagetool
from stagetool.core.errors import SpecError, StagingError, UsageError

SPEC = """\
version: 1
mesh:
  axes: {data: 2, model: 4}
functions:
  train_step:
    target: mlp.py:train_step
    args:
      - w1: 'f32[64,128] @ [null, model]'
        b1: 'f32[128] @ [model]'
        w2: 'f32[128,32] @ [model, null]'
        b2: 'f32[32]'
      - x: 'f32[16,64] @ [data, null]'
        y: 'i32[16] @ [data]'
    donate: [0]
"""


def _mesh():
    from jax.sharding import AxisType

    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])


def _live_args(mesh):
    def put(shape, spec, dtype=jnp.float32):
        return jax.device_put(jnp.zeros(shape, dtype), NamedSharding(mesh, spec))

    params = {"w1": put((64, 128), P(None, "model")), "b1": put((128,), P("model")),
              "w2": put((128, 32), P("model", None)), "b2": put((32,), P())}
    batch = {"x": put((16, 64), P("data", None)), "y": put((16,), P("data"), jnp.int32)}
    return params, batch


def _figures(doc: dict) -> dict:
    """What both reports must agree on: XLA's memory and cost figures, the collectives, the
    compiled shardings (sources and timings differ by design: a spec line against the caller's)."""
    f = doc["functions"][0]
    return {"memory": f["memory"]["record"], "cost": f["cost"]["per_device"],
            "whole": f["cost"]["whole_program"],
            "collectives": [(c["collective"]["kind"], c["collective"]["mesh_axes"], c["collective"]["bytes_per_device"])
                        for c in f["collectives"]["items"]],
            "inputs": [(x["path"], x["compiled"]) for x in f["inputs"]],
            "outputs": [(x["path"], x["compiled"]) for x in f["outputs"]]}


def test_inspect_gives_the_cli_report_of_the_same_program(run_cli, tmp_path, monkeypatch):
    import shutil

    shutil.copy(EXAMPLES / "mlp.py", tmp_path / "mlp.py")
    write(tmp_path, "mlp.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    cli = run_cli("report", "--format", "json", "--peak", check=0).json()
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        import mlp
    finally:
        sys.path.remove(str(tmp_path))
    mesh = _mesh()
    report = stagetool.inspect(mlp.train_step, *_live_args(mesh), mesh=mesh, donate=0)
    from stagetool.report import Format, render

    live = json.loads(render(report, Format.json))
    assert _figures(live) == _figures(cli)
    assert live["functions"][0]["collectives"]["items"], "the program has collectives to compare"
    # XLA's own figure, independently: the donated parameters alias the updated ones
    record = report.memory.record
    assert record.alias_bytes > 0
    assert report.function().inputs[0].sharding_source == "object"


@pytest.mark.skipif(not __import__("stagetool.devices.tpu_topology", fromlist=["x"]).libtpu_available(),
                    reason="libtpu is not installed: no v5e:2x4 topology")
def test_arrays_on_the_callers_cpu_mesh_stage_on_a_topology_by_axis_name():
    """The notebook's TPU cell: arrays live on the caller's CPU devices, the report is for a TPU
    topology; their PartitionSpecs are laid on its mesh by axis name (a note says so), not refused
    as a mesh built before stagetool could give the code the staged devices."""
    from jax.experimental import topologies

    mesh = _mesh()
    params, batch = _live_args(mesh)

    def step(params, batch):
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] + params["b2"]) ** 2)

    report = stagetool.inspect(step, params, batch, mesh=mesh, topology="v5e:2x4")
    assert report.function().mesh.device_kind == "TPU v5 lite"
    assert any("8 cpu devices" in n and "by axis name" in n for n in report.function().notes)
    # raw JAX on the same topology with the same PartitionSpecs: XLA:TPU's own argument bytes
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4")
    tpu = topologies.make_mesh(topo, (2, 4), ("data", "model"))
    relaid = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        tpu, a.sharding.spec)), (params, batch))
    compiled = jax.jit(step).trace(*relaid).lower().compile()
    assert report.memory.record.argument_bytes == compiled.memory_analysis().argument_size_in_bytes


def test_sections_display_alone_and_why_answers_from_the_report():
    mesh = _mesh()

    def step(w, x):
        return jnp.tanh(x @ w).sum()

    w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    report = stagetool.inspect(step, w, x)  # the mesh: the arguments'
    assert report.function().mesh.axes == (("data", 2), ("model", 4))
    compiled = jax.jit(step).trace(w, x).lower().compile()
    assert report.memory.record.argument_bytes == compiled.memory_analysis().argument_size_in_bytes
    kinds = sorted((c.collective.kind, c.collective.mesh_axes) for c in report.collectives.items)
    assert kinds == [("all-reduce", ("data",)), ("all-reduce", ("model",))]
    page = report.memory._repr_html_()
    assert page.startswith("<iframe") and 'sandbox=""' in page and "&lt;script" not in page
    assert "Memory per device" in page and "Layouts" not in page      # the section alone
    assert "Layouts" in report._repr_html_()
    assert "http://" not in report._repr_html_().replace("http://www.w3.org/2000/svg", "")
    answer = report.why("w")
    assert answer.leaf is not None if hasattr(answer.value, "leaf") else True
    assert "declared P(None, 'model')" in str(answer)
    assert report._repr_markdown_().startswith("#")


def test_a_sharding_the_mesh_cannot_hold_names_the_callers_line():
    def step(x):
        return x * 2

    x = jax.ShapeDtypeStruct((6, 4), jnp.float32, sharding=NamedSharding(
        jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]), P("data", None)))
    line = __import__("inspect").currentframe().f_lineno + 2
    with pytest.raises(SpecError) as e:
        stagetool.inspect(step, x, mesh="data=4")  # 6 rows do not split over 4 devices
    assert f"test_inspect.py:{line}:" in str(e.value) and "x: " in str(e.value), str(e.value)
    assert "divisible" in str(e.value)


@pytest.mark.parametrize("body", ["raise ValueError('boom')", "import sys; sys.exit(0)"])
def test_user_code_that_fails_or_exits_never_gives_a_report(body):
    namespace: dict = {}
    exec(f"def step(x):\n    {body}\n    return x\n", namespace)
    with pytest.raises(StagingError) as e:
        stagetool.inspect(namespace["step"], jnp.zeros((4,)))
    assert "step" in str(e.value)


def test_bad_mesh_is_a_usage_error_before_anything_is_staged():
    with pytest.raises(UsageError, match="mesh"):
        stagetool.inspect(lambda x: x, jnp.zeros(2), mesh="data=two")


def test_a_traced_is_staged_as_its_function_is_and_a_lowered_is_refused():
    mesh = _mesh()

    def step(w, x, n=2):
        return jnp.tanh(x @ w).sum() * n

    w = jax.device_put(jnp.ones((64, 128)), NamedSharding(mesh, P(None, "model")))
    x = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P("data", None)))
    traced = jax.jit(step, donate_argnums=0, static_argnames="n").trace(w, x, n=3)
    from_traced = stagetool.inspect(traced)
    direct = stagetool.inspect(step, w, x, donate=0, static={"n": 3})
    assert from_traced.function().target == "<jax.stages.Traced>:step"
    assert from_traced.memory.record == direct.memory.record
    assert from_traced.cost.per_device == direct.cost.per_device
    # the same lines (named from another report root: the working directory, as the Traced has no file)
    assert [(c.collective.kind, c.collective.mesh_axes, c.source.rpartition("/")[2])
            for c in from_traced.collectives.items] == \
        [(c.collective.kind, c.collective.mesh_axes, c.source.rpartition("/")[2]) for c in direct.collectives.items]
    assert [(x.compiled, x.donated) for x in from_traced.function().inputs] == \
        [(x.compiled, x.donated) for x in direct.function().inputs]
    # XLA's own figure for the user's compile of that Traced
    assert from_traced.memory.record.alias_bytes == traced.lower().compile().memory_analysis().alias_size_in_bytes
    with pytest.raises(UsageError, match="jax.stages.Lowered holds a module lowered for its devices"):
        stagetool.inspect(traced.lower())


def test_flax_nnx_module_and_equinox_module_arguments():
    nnx = pytest.importorskip("flax.nnx")
    eqx = pytest.importorskip("equinox")
    mesh = _mesh()
    x = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P("data", None)))
    with jax.set_mesh(mesh):
        layer = nnx.Linear(64, 128, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), (None, "model")))

    def loss(layer, x):
        return (layer(x) ** 2).mean()

    report = stagetool.inspect(loss, layer, x, mesh=mesh)
    leaves = {leaf.path: leaf for leaf in report.function().inputs}
    assert str(leaves["layer/kernel/value"].compiled) == "P(None, 'model')"
    assert leaves["layer/kernel/value"].sharding_source == "model"  # Flax's own annotation
    compiled = nnx.jit(loss).lower(layer, x).compile()
    assert report.memory.record.argument_bytes == compiled.memory_analysis().argument_size_in_bytes

    class Dense(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x @ self.w

    model = Dense(jax.device_put(jnp.ones((64, 128)), NamedSharding(mesh, P(None, "model"))))
    report = stagetool.inspect(eqx.filter_jit(lambda m, x: m(x).sum()), model, x)
    assert [(leaf.path, str(leaf.compiled)) for leaf in report.function().inputs] == \
        [("m/w", "P(None, 'model')"), ("x", "P('data', None)")]


def test_sections_are_analysed_from_the_one_compile_when_asked_for(monkeypatch):
    from stagetool import pipeline

    mesh = _mesh()
    compiles = []
    real = pipeline._stage
    monkeypatch.setattr(pipeline, "_stage", lambda *a, **k: compiles.append(1) or real(*a, **k))
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    report = stagetool.inspect(lambda w, x: jnp.tanh(x @ w).sum(), w, x)
    once = report._once
    assert compiles == [1] and once.staged.compiled is not None
    memory = report.memory
    assert memory.record.argument_bytes == once.staged.compiled.memory_analysis().argument_size_in_bytes
    assert once.facts.propagation is None and once.facts.propagation_error is None  # collectives not analysed yet
    assert len(report.collectives.items) == 2
    assert once.facts.propagation is not None or once.facts.propagation_error is not None
    full = report.functions[0]
    assert full.memory == memory.value and full.cost is not None and full.inputs is not None
    assert compiles == [1]                                      # one compile for every section
    import pickle

    plain = pickle.loads(pickle.dumps(report))                  # pickled: the plain Report of every section
    assert type(plain) is stagetool.Report and plain == stagetool.Report(*[getattr(report, f) for f in (
        "command", "stagetool_version", "jax_version", "jaxlib_version", "functions", "config")])


def test_out_shardings_and_options_named_as_the_api_takes_them():
    mesh = _mesh()
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    report = stagetool.inspect(lambda x: {"a": x * 2, "b": x.sum()}, x, out_shardings={"a": P(None, "model"), "b": P()})
    assert [(o.path, str(o.compiled), o.sharding_source) for o in report.function().outputs] == \
        [("out/a", "P(None, 'model')", "spec"), ("out/b", "P()", "spec")]
    with pytest.raises(UsageError, match=r"^stagetool.inspect: chip=v5e: unknown chip 'v5e': did you mean tpu-v5e\?"):
        stagetool.inspect(lambda x: x, x, chip="v5e")
