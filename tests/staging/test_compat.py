"""stagetool.core.compat: each difference between the supported JAX releases (0.7.1 to 0.12.x),
checked on the release installed here (tests/matrix.py runs this file on 0.7.2, 0.10.2 and 0.12.0.1)
and, where a release behaves one way only, with a ``jax_version`` marker saying which."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import jaxlib
import pytest
from jax.sharding import PartitionSpec as P

from helpers import write
from stagetool.core import compat
from stagetool.staging import shardy, stages

# ---- the supported range -------------------------------------------------------------------------


def test_version_tuples():
    assert compat.version_tuple("0.12.0.1") == (0, 12, 0, 1)
    assert compat.version_tuple("0.13.0.dev20261101") == (0, 13, 0)
    assert compat.version_tuple("0.7.2rc1") == (0, 7, 2)
    assert compat.version_tuple("") == ()


@pytest.mark.parametrize("version,tested", [
    ("0.7.0", False), ("0.7.1", True), ("0.7.2", True), ("0.9.2", True), ("0.10.2", True), ("0.11.2", True),
    ("0.12.0.1", True), ("0.12.9", True), ("0.13.0", False), ("1.0.0", False), ("0.6.2", False), ("garbage", False),
])
def test_the_tested_range(version, tested):
    assert compat.in_tested_range(version) is tested
    assert (compat.untested_notice(version, version) is None) is tested


def test_the_installed_release_is_in_the_range():
    assert compat.installed_versions() == (jax.__version__, jaxlib.__version__)
    assert compat.untested_notice(jax.__version__, jaxlib.__version__) is None


def test_the_range_is_pyprojects():
    import tomllib

    from helpers import REPO

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lower = ".".join(map(str, compat.TESTED_OLDEST))
    assert f"jax>={lower}" in project["dependencies"] and f"jaxlib>={lower}" in project["dependencies"]
    assert not [d for d in project["dependencies"] if d.startswith("jax") and "<" in d]  # no upper bound
    assert project["requires-python"] == ">=3.11"
    assert {c.rsplit(" ", 1)[-1] for c in project["classifiers"] if re.search(r":: 3\.\d+$", c)} == {
        "3.11", "3.12", "3.13"}
    assert project["optional-dependencies"]["tpu"] == [f"jax[tpu]>={lower}"]  # jax's own extra picks libtpu


def test_an_untested_release_runs_and_says_so_once(run_cli, mlp_copy, monkeypatch):
    monkeypatch.setattr(compat, "installed_versions", lambda: ("0.13.0", "0.13.0"))
    r = run_cli("shardings", "mlp.py:train_step", check=0)
    lines = [ln for ln in r.stderr.splitlines() if "untested" in ln]
    assert lines == ["stagetool: jax 0.13.0 / jaxlib 0.13.0 is untested (tested: 0.7.1 to 0.12.x); it runs, but "
                     "check figures and names against a tested release before trusting a gate"]
    assert "params/w1" in r.stdout
    monkeypatch.setattr(compat, "installed_versions", lambda: (jax.__version__, jaxlib.__version__))
    assert "untested" not in run_cli("shardings", "mlp.py:train_step", check=0).stderr


# ---- live ranges -----------------------------------------------------------------------------------

_SECTION = ("HloLiveRange (max 2):\n  InstructionSequence:\n    0:x.1\n  BufferLiveRange:\n    x.1{}:0-2\n"
            "  Live ranges at 1 (peak):\n    x.1{}: 64 bytes (cumulative: 64 bytes)\n")


def test_live_ranges_from_either_file(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    (old / "module_0001.jit_f.cpu_after_optimizations-buffer-assignment.txt").write_text(
        "BufferAssignment:\nallocation 0: size 64, parameter 0\n\n" + _SECTION)
    (new / "module_0000.jit_f.cpu_after_optimizations-buffer-assignment.txt").write_text("BufferAssignment:\n")
    (new / "module_0000.jit_f.cpu_after_optimizations-live-range.txt").write_text(_SECTION)
    assert compat.read_live_range(str(old), "HloModule jit_f, entry_computation_layout={}") == (_SECTION, None)
    assert compat.read_live_range(str(new), "HloModule jit_f, entry_computation_layout={}") == (_SECTION, None)
    # the prefix names the module's other dump files (its HloProto, for the memory timeline)
    assert compat.live_range_file(str(old), "HloModule jit_f")[1] == "module_0001.jit_f.cpu_after_optimizations"
    assert compat.live_range_file(str(new), "HloModule jit_f")[1] == "module_0000.jit_f.cpu_after_optimizations"
    (old / "module_0001.jit_f.cpu_after_optimizations-buffer-assignment.txt").write_text("BufferAssignment:\n")
    text, reason = compat.read_live_range(str(old), "HloModule jit_f")
    assert text is None and "no live-range dump" in reason


def _dump_files(tmp_path):
    def f(x):
        return jnp.sin(x) @ jnp.cos(x).T

    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    compiled = jax.jit(f).trace(x).lower().compile({"xla_dump_to": str(tmp_path), **stages.DUMP_OPTIONS})
    return compiled, sorted(os.listdir(tmp_path))


@pytest.mark.jax_version("<0.10", reason="jaxlib 0.10 writes the live ranges to a file of their own")
def test_old_jaxlib_writes_live_ranges_inside_the_buffer_assignment(tmp_path):
    _, files = _dump_files(tmp_path)
    assert not [f for f in files if f.endswith(compat.LIVE_RANGE_SUFFIX)]
    (ba,) = [f for f in files if f.endswith(compat.BUFFER_ASSIGNMENT_SUFFIX)]
    assert "HloLiveRange" in (tmp_path / ba).read_text()


@pytest.mark.jax_version(">=0.10", reason="jaxlib 0.9.2 and older write no separate live-range file")
def test_new_jaxlib_writes_a_live_range_file(tmp_path):
    _, files = _dump_files(tmp_path)
    assert [f for f in files if f.endswith(compat.LIVE_RANGE_SUFFIX)]


def test_the_peak_buffers_are_found_on_this_release(tmp_path):
    compiled, _ = _dump_files(tmp_path)
    text, reason = compat.read_live_range(str(tmp_path), compiled.as_text())
    assert reason is None and text.startswith("HloLiveRange")
    peak = re.search(r"Live ranges at \d+ \(peak\):\n((?:    .*\n)+)", text).group(1)
    sizes = [int(m) for m in re.findall(r": (\d+) bytes \(cumulative", peak)]
    # x, sin(x), cos(x) and the product: four f32[64,64] buffers, whatever XLA names them
    assert sizes == [64 * 64 * 4] * 4


def test_the_buffer_assignment_is_found_beside_either_file():
    """The memory timeline's HloProto is named after the live-range file's prefix, whichever file
    holds the live ranges on this release."""
    def f(x):
        return jnp.sin(x) @ jnp.cos(x).T

    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    _, dump = stages.compile_with_dump(jax.jit(f).trace(x).lower())
    assert dump.reason is None and dump.buffers_reason is None and dump.buffers is not None


# ---- configuration ----------------------------------------------------------------------------------


@pytest.mark.jax_version("<0.11", reason="jax 0.11 removed the two optimisation efforts")
def test_old_jax_has_the_optimisation_efforts():
    from stagetool.staging.config import compile_config

    names = dict(compile_config())
    assert set(compat.REMOVED_CONFIG) <= set(names)
    assert names["jax_memory_fitting_effort"] == str(jax.config.jax_memory_fitting_effort)


@pytest.mark.jax_version(">=0.11", reason="before 0.11 jax.config has the two optimisation efforts")
def test_new_jax_has_no_optimisation_efforts():
    from stagetool.staging.config import compile_config

    assert not set(compat.REMOVED_CONFIG) & {n for n, _ in compile_config()}
    for name in compat.REMOVED_CONFIG:
        assert not hasattr(jax.config, name)


def _snapshot(jax_version, config, memory=None, sharding="P('data', None)"):
    memory = memory or {"argument_bytes": 100, "output_bytes": 10, "alias_bytes": 0, "temp_bytes": 50,
                        "peak_bytes": 160}
    from stagetool.gate.snapshot import SNAPSHOT_SCHEMA

    return {"snapshot_schema": SNAPSHOT_SCHEMA, "kind": "stagetool-snapshot", "jax_version": jax_version,
            "jaxlib_version": jax_version, "config": config,
            "functions": {"f": {"target": "m.py:f", "mesh": {"axes": [["data", 2]], "platform": "cpu",
                                                             "device_kind": "cpu"},
                                "inputs": [{"path": "x", "shape": [8], "dtype": "float32", "sharding": sharding,
                                            "bytes_per_device": 16, "unused": False}],
                                "outputs": [], "memory": memory, "cost": None, "collectives": None}}}


def test_an_option_a_release_removed_is_no_difference_in_check():
    from stagetool.gate.compare import compare, environment_notices

    old = {"jax_threefry_partitionable": "True", "jax_exec_time_optimization_effort": "0.0",
           "jax_memory_fitting_effort": "0.0"}
    new = {"jax_threefry_partitionable": "True"}
    notices = environment_notices(_snapshot("0.10.2", old), _snapshot("0.12.0.1", new))
    assert not [n for n in notices if "changes the compiled program" in n]
    assert notices[0].startswith("jax 0.10.2 in the baseline, 0.12.0.1 now (configuration only one of them has, "
                                 "not compared: jax_exec_time_optimization_effort (jax 0.11 removed the option)")
    cmp = compare(_snapshot("0.10.2", old), _snapshot("0.12.0.1", new))
    assert cmp.regressions == [] and all(r.status == "ok" for r in cmp.functions)
    # an option the user changed is still one, with the same JAX or across releases
    changed = {**new, "jax_threefry_partitionable": "False"}
    for before in ("0.12.0.1", "0.10.2"):
        notices = environment_notices(_snapshot(before, {**old, **new} if before == "0.10.2" else new),
                                      _snapshot("0.12.0.1", changed))
        assert ["config jax_threefry_partitionable True in the baseline, False now (it changes the compiled "
                "program)"] == [n for n in notices if n.startswith("config ")]


def test_check_across_releases_marks_what_the_upgrade_may_have_moved():
    from stagetool.gate.compare import compare

    grown = {"argument_bytes": 100, "output_bytes": 10, "alias_bytes": 0, "temp_bytes": 90, "peak_bytes": 200}
    cmp = compare(_snapshot("0.10.2", {}), _snapshot("0.12.0.1", {}, memory=grown, sharding="P(None, None)"))
    by_what = {c.what: c for c in cmp.functions[0].changes}
    assert "may come from jax/jaxlib 0.10.2 → 0.12.0.1" in by_what["memory.peak_bytes"].note
    assert "may come from" in by_what["memory.temp_bytes"].note
    sharding = by_what["input x: sharding"]  # a declared sharding comes from the spec, never from a release
    assert sharding.status == "regression" and "may come from" not in (sharding.note or "")
    (summary,) = [n for n in cmp.notices if n.startswith("jax/jaxlib 0.10.2 → 0.12.0.1:")]
    assert "2 of the 3 differences" in summary and "stagetool check --update" in summary
    same = compare(_snapshot("0.12.0.1", {}), _snapshot("0.12.0.1", {}, memory=grown))
    assert not [c for c in same.functions[0].changes if "may come from" in (c.note or "")]
    assert not [n for n in same.notices if "→" in n]


# ---- memory_analysis() fields -----------------------------------------------------------------------


def _memory_of_a_compile():
    from stagetool.analysis.memory import memory_of
    from stagetool.staging.gather import memory_result

    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    compiled = jax.jit(lambda a: jnp.sin(a) @ a).trace(x).lower().compile()
    return compiled.memory_analysis(), memory_of(memory_result(compiled))


@pytest.mark.jax_version(">=0.11", reason="memory_analysis() has these fields from jax 0.11 on")
def test_new_memory_fields_are_xlas_figures():
    stats, record = _memory_of_a_compile()
    for name in compat.MEMORY_FIELDS_SINCE_0_11:
        assert getattr(record, name) == getattr(stats, name) and isinstance(getattr(record, name), int)


@pytest.mark.jax_version("<0.11", reason="memory_analysis() has these fields from jax 0.11 on")
def test_old_releases_have_no_new_memory_fields():
    stats, record = _memory_of_a_compile()
    for name in compat.MEMORY_FIELDS_SINCE_0_11:
        assert not hasattr(stats, name) and getattr(record, name) is None


def test_new_memory_fields_are_shown_where_present(run_cli, mlp_copy):
    """JSON always has the keys (null before 0.11); the snapshot and the text table only where
    this release reports them, with XLA's own figures."""
    has = hasattr(_memory_of_a_compile()[0], "peak_unpadded_heap_bytes")
    doc = run_cli("memory", "mlp.py:train_step", "--no-peak", "--format", "json", check=0).json()
    record = doc["functions"][0]["memory"]["record"]
    assert all((record[f] is not None) is has for f in compat.MEMORY_FIELDS_SINCE_0_11)
    run_cli("snapshot", "mlp.py:train_step", "-o", "s.json", check=0)
    import json

    snap = json.loads((mlp_copy / "s.json").read_text())["functions"]["train_step"]["memory"]
    assert all((f in snap) is has for f in compat.MEMORY_FIELDS_SINCE_0_11)
    if has:
        assert all(snap[f] == record[f] for f in compat.MEMORY_FIELDS_SINCE_0_11)
    text = run_cli("memory", "mlp.py:train_step", "--no-peak", check=0).stdout
    assert ("XLA total_allocation_bytes" in text) is has


# ---- op names ---------------------------------------------------------------------------------------


def test_op_names_have_one_spelling():
    assert compat.normalise_op_name("jit(f)/while/body/eval_jaxpr/dot_general") == \
        "jit(f)/while/body/closed_call/dot_general"
    assert compat.normalise_op_name("jit(f)/while/body/closed_call/dot_general") == \
        "jit(f)/while/body/closed_call/dot_general"
    assert compat.normalise_op_name("jit(eval_jaxpr_like)/x") == "jit(eval_jaxpr_like)/x"  # whole scopes only
    assert compat.normalise_op_name(None) is None


SCAN_MODEL = """\
import jax
import jax.numpy as jnp


def step(w, xs):
    def body(c, x):
        return c + jnp.sum(x @ w), None  # BODY
    return jax.lax.scan(body, 0.0, xs)[0]
"""

SCAN_SPEC = """\
version: 1
mesh: {axes: {model: 8}}
functions:
  step:
    target: m.py:step
    args: ['f32[64,64] @ [model, null]', 'f32[4,16,64] @ [null, null, model]']
"""


def test_a_scan_bodys_collective_reads_closed_call_on_every_release(run_cli, tmp_path, isolated_imports):
    write(tmp_path, "m.py", SCAN_MODEL)
    spec = write(tmp_path, "m.stagetool.yaml", SCAN_SPEC)
    doc = run_cli("collectives", "--spec", str(spec), "--format", "json", check=0).json()
    names = [x["collective"]["op_name"] for x in doc["functions"][0]["collectives"]["items"]]
    assert any("/while/body/closed_call/" in (n or "") for n in names)
    assert not any("eval_jaxpr" in (n or "") for n in names)
    # what this release writes itself, compiled directly with JAX (the CLI put m.py's folder on sys.path)
    import m

    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=jax.sharding.NamedSharding(mesh, p))
            for s, p in (((64, 64), P("model", None)), ((4, 16, 64), P(None, None, "model")))]
    with jax.set_mesh(mesh):
        text = jax.jit(m.step).trace(*args).lower().compile().as_text()
    raw = {n for n in re.findall(r'op_name="([^"]*)"', text) if "/while/body/" in n}
    new_spelling = compat.version_tuple(jax.__version__) >= (0, 12)
    assert any(("/eval_jaxpr/" if new_spelling else "/closed_call/") in n for n in raw)


# ---- jaxlib's MLIR bindings ------------------------------------------------------------------------


def test_mlir_values_come_back_as_their_concrete_class():
    from jax.interpreters.mlir import make_ir_context
    from jaxlib.mlir import ir

    with make_ir_context():
        module = ir.Module.parse("func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n"
                                 "  %0 = stablehlo.add %a, %a : tensor<2xf32>\n  return %0 : tensor<2xf32>\n}")
        (main,) = module.body.operations
        add, ret = main.regions[0].blocks[0].operations
        arg, result = shardy.mlir_value(add.operands[0]), shardy.mlir_value(ret.operands[0])
        assert isinstance(arg, ir.BlockArgument) and arg.arg_number == 0
        assert isinstance(result, ir.OpResult) and result.result_number == 0 and result.owner == add.operation


# ---- PartitionSpec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,text", [
    (P("data", None), "P('data', None)"), (P(), "P()"), (P(("data", "model"),), "P(('data', 'model'))"),
    (P(None, ("fsdp",)), "P(None, 'fsdp')"),
])
def test_partition_specs_print_as_stagetool_prints_them(spec, text):
    assert compat.partition_spec_text(spec) == text


@pytest.mark.jax_version("<0.9", reason="from 0.9 JAX prints P(...) itself")
def test_old_jax_prints_partition_spec_in_full():
    assert repr(P("data", None)) == "PartitionSpec('data', None)"
    assert compat.partition_spec_text(P("data", None)) == "P('data', None)"
