"""haliax ``named_jit`` (Levanter's train step) staged as its own program (issue 30, item 3).

On marin-haliax 0.2 (the distribution Levanter ships haliax as; the ``haliax`` extra) and on the
old ``haliax`` 1.4 pre-releases alike, the Levanter-style step of ``tests/data/levanter_step.py`` (NamedArrays, ``hax.nn.Linear``, an
optax optimizer as a static field, a Python-number field, ``named_jit(axis_resources=...,
donate_args=(True, False))``) is staged from its spec with no adapter, and every figure —
argument/output/alias/temp bytes, FLOPs, bytes accessed, collectives by kind, input and output
shardings — equals what haliax itself compiles:

- on the simulated CPU mesh, raw haliax: ``train_step.lower(state, x).compile()`` on real sharded
  arrays (the state made by ``eqx.filter_jit(init_state)``, as Levanter makes it);
- on ``--topology v5e:2x4`` and ``h100:8``, where no array can be made (and haliax's own ``lower``
  cannot run: its ``is_in_jit`` runs an op eagerly), the same program written by hand with public
  JAX and haliax's public ``infer_resource_partitions`` — checked first to be raw haliax's program
  on the CPU mesh.

The static fields (``lr_scale``, the optimizer) are neither inputs nor outputs, and the donated
state's bytes are aliased.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import warnings
from collections import Counter

import jax
import pytest
from jax.sharding import AxisType

from helpers import REPO, leaves_by_path, target_devices

pytest.importorskip("optax")
with warnings.catch_warnings():  # haliax imports deprecated JAX names (jax.experimental.shard_map)
    warnings.simplefilter("ignore", DeprecationWarning)
    hax = pytest.importorskip("haliax")
    import equinox as eqx
    from haliax.partitioning import infer_resource_partitions

#: haliax 1.4 calls JAX names deprecated since 0.8 (thread_resources, jax.experimental.shard_map): the
#: user's code warns, which pytest's ``filterwarnings = error`` would turn into the step's failure
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DATA = REPO / "tests" / "data"
TARGET = "levanter_step.py:train_step"
#: the two named_jit forms: (step, its batch's init, the mapping it traces under, the batch's mapping)
STEPS = {"train_step": ("make_batch", "PARAMS", "COMPUTE"),  # named_jit(axis_resources=PARAMS, donate_args=...)
         "fsdp_step": ("make_param_batch", "COMPUTE", "PARAMS")}  # + in/out_axis_resources=PARAMS
COLLECTIVE_RE = re.compile(r"=\s*\S.*?\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


@functools.cache
def _module():
    """The step's module imported as plain Python (the raw side's own copy), once for the file."""
    spec = importlib.util.spec_from_file_location("_raw_levanter_step", DATA / "levanter_step.py")
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        spec.loader.exec_module(module)
    return module


def _mesh(devices: list, shape: tuple[int, int] = (2, 4)):
    return jax.make_mesh(shape, ("data", "model"), devices=devices, axis_types=(AxisType.Auto, AxisType.Auto))


@functools.cache
def raw_haliax(L, name: str = "train_step", shape: tuple[int, int] = (2, 4)):
    """haliax's own compile of the step on real arrays of the CPU mesh (as Levanter runs it): once per
    step and mesh shape for the file (several tests compare with the same program)."""
    mesh = _mesh(jax.devices()[:8], shape)
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        state = eqx.filter_jit(L.init_state)(jax.random.key(0))
        x = eqx.filter_jit(getattr(L, STEPS[name][0]))()
        assert isinstance(state.lr_scale, float)  # static, as named_jit sees it
        return getattr(L, name).lower(state, x).compile()


def _infer(tree, mapping, mesh):
    """haliax's infer_resource_partitions as its named_jit calls it: haliax 1.4's _call passes
    preserve_existing_shardings=False; marin-haliax 0.2 (Levanter's) has no such parameter."""
    import inspect

    extra = ({"preserve_existing_shardings": False}
             if "preserve_existing_shardings" in inspect.signature(infer_resource_partitions).parameters else {})
    return infer_resource_partitions(tree, mapping, mesh=mesh, **extra)


def written_out(L, devices: list, name: str = "train_step"):
    """What ``named_jit`` compiles, written with public JAX: the step over the state's arrays
    (donated) and the batch, the static fields closed over, traced under its axis mapping, the
    outputs sharded by the parameter mapping (haliax's public ``infer_resource_partitions``), the
    inputs as the inits' ``hax.shard`` leave them (for ``fsdp_step`` also what its
    ``in_axis_resources`` give)."""
    make_batch, trace_mapping, batch_mapping = STEPS[name]
    trace_mapping, batch_mapping = getattr(L, trace_mapping), getattr(L, batch_mapping)
    mesh = _mesh(devices)
    is_struct = lambda v: isinstance(v, jax.ShapeDtypeStruct)  # noqa: E731
    key = jax.random.key(0)  # made on the default device: compile-only devices run nothing
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        state = eqx.filter_eval_shape(L.init_state, key)
        x = eqx.filter_eval_shape(getattr(L, make_batch))
        with hax.axis_mapping(trace_mapping):
            out_shape = eqx.filter_eval_shape(getattr(L, name).__wrapped__, state, x)
    dyn, static = eqx.partition(state, is_struct)

    def sharded(tree, mapping):
        shardings = _infer(tree, mapping, mesh)

        def one(sh, s):  # a sharding per NamedArray (a prefix of its array) or per plain array
            if isinstance(s, hax.NamedArray):
                return hax.NamedArray(jax.ShapeDtypeStruct(s.array.shape, s.array.dtype, sharding=sh), s.axes)
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)

        return jax.tree_util.tree_map(one, shardings, tree)

    dyn, x = sharded(dyn, L.PARAMS), sharded(x, batch_mapping)
    out_shardings = _infer(eqx.filter(out_shape, is_struct), L.PARAMS, mesh)

    def step(dyn, x):
        new_state, loss = getattr(L, name).__wrapped__(eqx.combine(dyn, static), x)
        return eqx.filter(new_state, eqx.is_array), loss

    jitted = jax.jit(step, donate_argnums=0, out_shardings=out_shardings)
    with jax.set_mesh(mesh), hax.axis_mapping(trace_mapping), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return jitted.trace(dyn, x).lower().compile()


def _figures(compiled) -> dict:
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}  # None: a compile-only GPU
    return {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
            "collectives": Counter(m.group(1) for line in compiled.as_text().splitlines()
                                   for m in [COLLECTIVE_RE.search(line)] if m),
            "in": Counter(_trimmed(s.spec) for s in jax.tree_util.tree_leaves(compiled.input_shardings)),
            "out": Counter(_trimmed(s.spec) for s in jax.tree_util.tree_leaves(compiled.output_shardings))}


def _program(text: str) -> list[tuple[str, str]]:
    """The optimized HLO's instructions as sorted (result shape, opcode) pairs: equal for one program."""
    return sorted(re.findall(r"^\s*(?:ROOT )?\S+ = (.+?) ([a-z][\w-]*)\(", text, flags=re.MULTILINE))


def _trimmed(dims) -> tuple:
    dims = list(dims)
    while dims and dims[-1] is None:
        dims.pop()
    return tuple(dims)


def _stagetool_figures(fn: dict) -> dict:
    record, cost = fn["memory"]["record"], fn["cost"]["per_device"]
    spec = lambda text: _trimmed(eval(text, {"P": lambda *a: a}))  # noqa: E731,S307 - our own output
    return {"argument_bytes": record["argument_bytes"], "output_bytes": record["output_bytes"],
            "alias_bytes": record["alias_bytes"], "temp_bytes": record["temp_bytes"],
            "flops": cost["flops"], "bytes_accessed": cost["bytes_accessed"],
            "collectives": Counter(i["collective"]["kind"] for i in fn["collectives"]["items"]),
            "in": Counter(spec(x["compiled"]) for x in fn["inputs"]),
            "out": Counter(spec(x["compiled"]) for x in fn["outputs"])}


def _report(run_cli, monkeypatch, topology: str | None, name: str = "train_step") -> dict:
    monkeypatch.chdir(DATA)
    args = ["report", f"levanter_step.py:{name}", "--format", "json"] + (["--topology", topology] if topology else [])
    fn = run_cli(*args, check=0).json()["functions"][0]
    assert fn.get("error") is None
    return fn


def _train_step_spec() -> str:
    """The example spec with train_step alone (last, so that keys can be added to it)."""
    text = (DATA / "levanter_step.stagetool.yaml").read_text()
    assert text.count("  fsdp_step:\n") == 1
    return text[:text.index("  fsdp_step:\n")]


@pytest.mark.parametrize("name", STEPS)
def test_the_written_out_program_is_raw_haliaxs(name):
    """The hand-written reference the topology tests use is haliax's own program on the CPU mesh."""
    L = _module()
    raw = _figures(raw_haliax(L, name))
    assert raw["alias_bytes"] > 0 and raw["collectives"]
    assert _figures(written_out(L, jax.devices()[:8], name)) == raw


def test_fsdp_step_on_cpu_is_raw_haliaxs(run_cli, monkeypatch, isolated_imports):
    """in_axis_resources / out_axis_resources / axis_resources all given (hax.fsdp's form)."""
    fn = _report(run_cli, monkeypatch, None, "fsdp_step")
    raw = raw_haliax(_module(), "fsdp_step")
    assert _stagetool_figures(fn) == _figures(raw)
    assert _figures(raw) != _figures(raw_haliax(_module()))  # another program than train_step's
    assert leaves_by_path({"functions": [fn]})["x/0"]["compiled"] == "P(None, 'data')"


def test_named_jit_step_on_cpu_is_raw_haliaxs(run_cli, monkeypatch, isolated_imports):
    fn = _report(run_cli, monkeypatch, None)
    raw = raw_haliax(_module())
    assert _stagetool_figures(fn) == _figures(raw)
    inputs, outputs = leaves_by_path({"functions": [fn]}), leaves_by_path({"functions": [fn]}, "outputs")
    # static fields (a Python number, the optimizer) are neither inputs nor outputs
    assert len(inputs) == len(jax.tree_util.tree_leaves(raw.input_shardings)) == 15
    assert len(outputs) == len(jax.tree_util.tree_leaves(raw.output_shardings)) == 15
    assert not [p for p in [*inputs, *outputs] if "lr_scale" in p or "optimizer" in p]
    # donate_args=(True, False): the state is donated and aliased, the batch is not
    assert all(leaf["donated"] for path, leaf in inputs.items() if path.startswith("state/"))
    assert not inputs["x/0"]["donated"]
    requested = [d for d in fn["memory"]["donation"] if d["requested"]]
    assert len(requested) == 14 and all(d["status"] == "aliased" for d in requested)
    # the parameter mapping's shardings, on the outputs haliax pins
    assert outputs["out/0/model/up/weight/0"]["compiled"] == "P('model', 'data')"
    assert not [n for n in fn["notes"] if "does not unwrap" in n or "named_jit" in n]


def test_named_jit_on_another_mesh_is_raw_haliax_at_that_shape(run_cli, monkeypatch, isolated_imports):
    """--mesh data=4,model=2: named_jit's mappings name axes, so the step is laid on the staged
    mesh as haliax lays it there (faithful, not a mixed program)."""
    monkeypatch.chdir(DATA)
    fn = run_cli("report", TARGET, "--format", "json", "--mesh", "data=4,model=2", check=0).json()["functions"][0]
    assert fn.get("error") is None
    want = _figures(raw_haliax(_module(), shape=(4, 2)))
    assert want != _figures(raw_haliax(_module()))  # another program than on 2 × 4
    assert _stagetool_figures(fn) == want


@pytest.mark.parametrize("name", STEPS)
@pytest.mark.parametrize("topology", ["v5e:2x4", "h100:8"])
def test_named_jit_step_on_a_topology_is_haliaxs_program(run_cli, monkeypatch, isolated_imports, topology, name):
    devices = target_devices(topology)
    fn = _report(run_cli, monkeypatch, topology, name)
    assert fn["mesh"]["device_count"] == 8 and fn["mesh"]["platform"] == devices[0].platform
    compiled = written_out(_module(), devices, name)
    want, got = _figures(compiled), _stagetool_figures(fn)
    assert want["alias_bytes"] > 0
    # stagetool lists a TPU collective once where XLA's async fusions repeat it (one channel): the
    # program's collectives are compared instruction by instruction instead
    del want["collectives"], got["collectives"]
    if want["flops"] is None:  # XLA gives no cost analysis for a compile-only GPU: stagetool derives its own
        assert topology.startswith("h100") and got["flops"] > 0
        del want["flops"], got["flops"], want["bytes_accessed"], got["bytes_accessed"]
    assert got == want
    staged = run_cli("compile", f"levanter_step.py:{name}", "--topology", topology, check=0).stdout
    assert _program(staged) == _program(compiled.as_text())
    assert {"all-gather", "all-reduce"} <= {op.removesuffix("-start") for _, op in _program(staged)}


def test_named_jit_fields_read_are_pinned():
    """The private fields stagetool reads from a named_jit object and haliax's jit builder exist
    (another haliax: staged nested, with a note)."""
    from haliax import partitioning

    from stagetool.inputs.frameworks import haliax as adapter

    L = _module()
    assert adapter.is_named_jit(L.train_step)
    assert all(hasattr(L.train_step, f) for f in adapter._FIELDS)
    assert callable(partitioning._named_pjit_cache)
    settings = adapter.jit_settings(L.train_step, 2)
    assert settings.kind == "haliax.named_jit" and settings.donate_argnums == (0,)


def test_a_named_jit_the_spec_gives_out_shardings_is_nested_and_says_so(run_cli, monkeypatch, isolated_imports,
                                                                         tmp_path):
    """out_shardings in the spec: named_jit's own program cannot take them, so the step is staged
    nested; a note names what is and is not taken, and its donation still holds (aliased as raw)."""
    import shutil

    shutil.copy(DATA / "levanter_step.py", tmp_path / "levanter_step.py")
    spec = _train_step_spec() + "    out_shardings: [auto, '[]']\n"
    (tmp_path / "levanter_step.stagetool.yaml").write_text(spec)
    monkeypatch.chdir(tmp_path)
    fn = run_cli("report", TARGET, "--format", "json", check=0).json()["functions"][0]
    note = " ".join(n for n in fn["notes"] if "named_jit staged nested" in n)
    assert "because the spec gives out_shardings" in note and "donate_argnums=(0,)" in note
    assert fn["memory"]["record"]["alias_bytes"] == raw_haliax(_module()).memory_analysis().alias_size_in_bytes


def test_the_specs_donate_is_given_to_named_jit(run_cli, monkeypatch, isolated_imports, tmp_path):
    """A named_jit without donate_args and the spec's ``donate: [0]``: staged as named_jit with that
    donation (its own program, no note), the figures of raw haliax's step that donates the state."""
    source = (DATA / "levanter_step.py").read_text()
    assert source.count("@hax.named_jit(axis_resources=PARAMS, donate_args=(True, False))") == 1
    (tmp_path / "levanter_step.py").write_text(source.replace(
        "@hax.named_jit(axis_resources=PARAMS, donate_args=(True, False))", "@hax.named_jit(axis_resources=PARAMS)"))
    spec = _train_step_spec() + "    donate: [0]\n"
    (tmp_path / "levanter_step.stagetool.yaml").write_text(spec)
    monkeypatch.chdir(tmp_path)
    fn = run_cli("report", TARGET, "--format", "json", check=0).json()["functions"][0]
    assert not [n for n in fn["notes"] if "named_jit" in n]
    assert _stagetool_figures(fn) == _figures(raw_haliax(_module()))


def test_a_named_jit_without_a_mapping_says_so(run_cli, monkeypatch, isolated_imports, tmp_path):
    """``@hax.named_jit`` alone takes the caller's mapping: none while staging, and a note says so."""
    source = (DATA / "levanter_step.py").read_text()
    (tmp_path / "levanter_step.py").write_text(source.replace(
        "@hax.named_jit(axis_resources=PARAMS, donate_args=(True, False))", "@hax.named_jit(donate_args=(True, False))"))
    (tmp_path / "levanter_step.stagetool.yaml").write_text(_train_step_spec())
    monkeypatch.chdir(tmp_path)
    fn = run_cli("report", TARGET, "--format", "json", check=0).json()["functions"][0]
    assert any("train_step is a named_jit without axis_resources" in n for n in fn["notes"])
    assert fn["memory"]["record"]["alias_bytes"] > 0


def test_inspect_of_a_live_named_jit_step_is_raw_haliaxs(isolated_imports):
    """``stagetool.inspect(train_step, state, x)`` on the real arrays: the same program as raw haliax's."""
    import stagetool

    L = _module()
    mesh = _mesh(jax.devices()[:8])
    with jax.set_mesh(mesh):
        state = eqx.filter_jit(L.init_state)(jax.random.key(0))
        x = eqx.filter_jit(L.make_batch)()
    raw = raw_haliax(L).memory_analysis()
    fn = stagetool.inspect(L.train_step, state, x, mesh=mesh, peak=False).functions[0]
    assert not [n for n in fn.notes if "named_jit" in n]  # its own program, not nested
    record = fn.memory.record
    assert (record.argument_bytes, record.output_bytes, record.alias_bytes, record.temp_bytes) == (
        raw.argument_size_in_bytes, raw.output_size_in_bytes, raw.alias_size_in_bytes, raw.temp_size_in_bytes)
    assert record.alias_bytes > 0


NAMED_JIT_FORMS = '''
"""named_jit as the issue's new users wrote it: a Python-number learning rate passed positionally (static
to haliax), donation of the model only; and Levanter's trainer form with axis_resources,
out_axis_resources and donate_args."""
import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax

Batch = hax.Axis("batch", 16)
Embed = hax.Axis("embed", 64)
Hidden = hax.Axis("mlp", 128)
PARAMS = {"mlp": "model", "embed": "data"}
COMPUTE = {"batch": "data", "mlp": "model"}


def init_model(key):
    return hax.shard(hnn.Linear.init(Embed, Hidden, key=key), PARAMS)


def make_batch():
    return hax.shard(hax.zeros((Batch, Embed)), COMPUTE)


def _sgd(model, x, lr):
    with hax.axis_mapping(COMPUTE):
        loss, grads = eqx.filter_value_and_grad(lambda m: hax.mean(m(x) ** 2).scalar())(model)
    return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -lr * g, grads)), loss


step = hax.named_jit(_sgd, donate_args=(True, False))
levanter_step = hax.named_jit(_sgd, axis_resources=COMPUTE, out_axis_resources=PARAMS,
                              donate_args=(True, False, False))
'''

NAMED_JIT_FORMS_SPEC = '''
version: 1
mesh:
  axes: {data: 2, model: 4}
functions:
  step:
    target: nj.py:step
    args: &args
      - init: nj.py:init_model
        init_args: [key(0)]
      - init: nj.py:make_batch
      - 0.1
  levanter_step:
    target: nj.py:levanter_step
    args: *args
'''


@pytest.fixture(scope="module")
def named_jit_forms(tmp_path_factory):
    """The module and spec in a folder, and haliax's own compile of each step on the CPU mesh (real
    arrays, ``named_jit(...).lower(model, x, 0.1).compile()``), compiled once for the module."""
    folder = tmp_path_factory.mktemp("named_jit_forms")
    (folder / "nj.py").write_text(NAMED_JIT_FORMS)
    (folder / "nj.stagetool.yaml").write_text(NAMED_JIT_FORMS_SPEC)
    spec = importlib.util.spec_from_file_location("_raw_named_jit_forms", folder / "nj.py")
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        spec.loader.exec_module(module)
        with jax.set_mesh(_mesh(jax.devices()[:8])):
            model = eqx.filter_jit(module.init_model)(jax.random.key(0))
            x = eqx.filter_jit(module.make_batch)()
            raw = {name: getattr(module, name).lower(model, x, 0.1).compile().memory_analysis()
                   for name in ("step", "levanter_step")}
    return folder, raw


@pytest.mark.parametrize("name", ["step", "levanter_step"])
def test_named_jit_forms_have_haliaxs_own_bytes(run_cli, monkeypatch, isolated_imports, named_jit_forms, name):
    """``named_jit(step, donate_args=(True, False))(model, x, 0.1)``: the learning rate is static to
    haliax (no 4-byte input), the model donated; the Levanter form with axis_resources,
    out_axis_resources and donate_args likewise: argument, output, alias and temp bytes are haliax's."""
    folder, raw = named_jit_forms
    monkeypatch.chdir(folder)
    fn = run_cli("memory", f"nj.py:{name}", "--no-peak", "--format", "json", check=0).json()["functions"][0]
    assert fn.get("error") is None
    record, want = fn["memory"]["record"], raw[name]
    assert (record["argument_bytes"], record["output_bytes"], record["alias_bytes"], record["temp_bytes"]) == (
        want.argument_size_in_bytes, want.output_size_in_bytes, want.alias_size_in_bytes, want.temp_size_in_bytes)
    assert record["alias_bytes"] > 0  # the model, donated
    doc = run_cli("shardings", f"nj.py:{name}", "--format", "json", check=0).json()
    assert not [p for p in leaves_by_path(doc) if p.startswith("lr") or p == "2"]  # the number is no input


def test_a_haliax_whose_named_jit_cannot_be_rebuilt_is_exit_2(run_cli, monkeypatch, isolated_imports,
                                                               named_jit_forms):
    """A haliax release whose infer_resource_partitions lacks the mesh parameter stagetool passes: exit 2
    naming the release and what it lacks, never a TypeError."""
    from haliax import partitioning

    folder, _ = named_jit_forms
    monkeypatch.chdir(folder)
    monkeypatch.setattr(partitioning, "infer_resource_partitions", lambda tree, resource_mapping=None: None)
    r = run_cli("memory", "nj.py:levanter_step", "--no-peak", check=2)
    assert "infer_resource_partitions(mesh=...)" in r.stderr and "haliax" in r.stderr
    assert "TypeError" not in r.stderr and "marin-haliax>=0.2" in r.stderr
