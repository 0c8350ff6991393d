"""Compile-only TPU topologies through the CLI (issue 6): real TPU memory analysis on a CPU machine.

Skipped, with the reason, where libtpu is not installed (`pip install -e '.[tpu]'`; `.ci/run`
installs it).
"""

from __future__ import annotations

import json
import math
import os

import jax
import pytest
from helpers import REPO, leaves_by_path
from test_examples import _in_repo, transformer_stages  # noqa: F401 - the fixture runs in the repo

from stagetool.devices import tpu_topology as topology
from stagetool.plan.target import parse_target

pytestmark = pytest.mark.skipif(not topology.libtpu_available(),
                                reason="libtpu not installed: pip install -e '.[tpu]'")


@pytest.mark.slow
def test_transformer_memory_on_v5e_matches_jax(run_cli_shared):
    r = run_cli_shared("memory", "examples/transformer.py:train_step", "--topology", "v5e:2x4", "--no-peak",
                       "--format", "json", check=0)
    f = r.json()["functions"][0]
    assert f["mesh"]["platform"] == "tpu" and f["mesh"]["device_kind"] == "TPU v5 lite"
    assert f["mesh"]["topology"] == "v5e:2x4" and f["mesh"]["device_count"] == 8
    m = f["memory"]

    topo = topology.tpu_topology(parse_target("v5e:2x4"))
    mesh = topology.topology_mesh(topo.devices, (2, 4), ("data", "model"))
    _, _, _, compiled = transformer_stages(mesh)
    stats = compiled.memory_analysis()
    assert m["record"]["argument_bytes"] == stats.argument_size_in_bytes
    assert m["record"]["output_bytes"] == stats.output_size_in_bytes
    assert m["record"]["alias_bytes"] == stats.alias_size_in_bytes
    assert m["record"]["temp_bytes"] == stats.temp_size_in_bytes
    assert m["record"]["generated_code_bytes"] == stats.generated_code_size_in_bytes > 0
    # The chip's HBM is the capacity: 16 GiB per v5e chip, one device per chip.
    assert m["capacity_bytes"] == 16 * 2**30 and m["verdict"]["fits"] is True


@pytest.mark.slow
def test_shardings_on_v5e_show_tile_padding(run_cli_shared):
    doc = run_cli_shared("shardings", "examples/mlp.py:train_step", "--topology", "v5e:2x4", "--format", "json",
                         check=0).json()
    ins = leaves_by_path(doc)
    # batch/y: s32[128] on data → 64 elements per device, padded to one (128,) tile: 512 bytes.
    assert ins["batch/y"]["bytes_per_device"] == 64 * 4 and ins["batch/y"]["padded_bytes_per_device"] == 512
    # w1: f32[512,1024] on model columns → [512,256]: whole (8,128) tiles, no padding.
    assert ins["params/w1"]["padded_bytes_per_device"] == ins["params/w1"]["bytes_per_device"] == 512 * 256 * 4
    # Tiled bytes of all arguments add up to XLA's argument size.
    args = sum(x["padded_bytes_per_device"] for x in ins.values())
    mem = run_cli_shared("memory", "examples/mlp.py:train_step", "--topology", "v5e:2x4", "--no-peak",
                         "--format", "json", check=0).json()["functions"][0]["memory"]["record"]
    assert args == mem["argument_bytes"]


def test_devices_lists_a_topology(run_cli):
    doc = run_cli("devices", "--topology", "v5e:2x4", "--mesh", "data=2,model=4", "--format", "json", check=0).json()
    assert doc["platform"] == "tpu" and doc["device_count"] == 8 and doc["topology"] == "v5e:2x4"
    assert doc["memory_bytes_per_device"] == 16 * 2**30
    assert sorted(d["id"] for d in doc["devices"]) == list(range(8))
    assert all(len(d["coords"]) == 3 for d in doc["devices"])
    assert doc["mesh"] == [["data", 2], ["model", 4]] and sorted(doc["mesh_device_ids"]) == list(range(8))
    assert math.prod(s for _, s in doc["mesh"]) == len(jax.tree_util.tree_leaves(doc["mesh_device_ids"]))


def test_a_mesh_that_does_not_cover_the_topology_is_a_usage_error(run_cli):
    r = run_cli("shardings", "examples/mlp.py:train_step", "--topology", "v5e:2x4", "--mesh", "2x2")
    assert r.code == 2 and "topology v5e:2x4 has 8" in r.stderr


MESH_AT_IMPORT = """\
import sys

import jax
import jax.numpy as jnp

MESH = jax.make_mesh((8,), ("fsdp",))  # as launchers do: the job's mesh from jax.devices(), at import
print(f"devices at import: {len(jax.devices())} {jax.devices()[0].platform}", file=sys.stderr)


def step(w, x):
    return jnp.tanh(x @ w)
"""


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5e:2x4", "h100:8"])
def test_model_code_that_builds_its_mesh_at_import_works_on_a_compile_only_target(tmp_path, target):
    """Trial 2, finding 5, and issue 30: under ``--topology`` a module calling ``jax.make_mesh`` on
    ``jax.devices()`` at import finds the target's 8 devices (the compile-only TPU/GPU devices, not the
    host's CPU ones: devices.world). Fresh processes: JAX starts as a user's would."""
    from helpers import run_subprocess, write

    from stagetool.devices import gpu_topology

    if target.startswith("h100") and not gpu_topology.cuda_plugin_available():
        pytest.skip("JAX's CUDA plugin is not installed: pip install -e '.[gpu-aot]'")
    write(tmp_path, "m.py", MESH_AT_IMPORT)
    write(tmp_path, "m.stagetool.yaml", "version: 1\nmesh: {axes: {fsdp: 8}}\nfunctions:\n  step:\n"
          "    target: m.py:step\n    args: ['f32[256,256]', 'f32[64,256] @ [fsdp]']\n")
    r = run_subprocess("memory", "--spec", "m.stagetool.yaml", "--topology", target, "--no-peak", "--format", "json",
                       cwd=tmp_path,
                       env={"PYTHONPATH": os.pathsep.join([str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])})
    assert r.code == 0, r.stderr
    assert f"devices at import: 8 {'tpu' if target.startswith('v5e') else 'gpu'}" in r.stderr
    f = json.loads(r.stdout)["functions"][0]
    assert f["mesh"]["topology"] == target and f["mesh"]["device_count"] == 8
    assert f["mesh"]["platform"] == ("tpu" if target.startswith("v5e") else "gpu")


def test_the_topology_is_parsed_once_per_run(run_cli, monkeypatch):
    """One CLI run on a compile-only topology parses its name once, in the plan: the devices, the
    report's notes and the facts read the plan's typed target. Both the parse and the grammar under it
    are counted, so a module that took the name apart again on its own would show."""
    from stagetool.plan import target as plan_target

    calls = {"parse_target": 0, "grammar": 0}

    def counted(name, real):
        def wrapper(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return wrapper

    monkeypatch.setattr(plan_target, "parse_target", counted("parse_target", plan_target.parse_target))
    monkeypatch.setattr(plan_target, "_tpu_target", counted("grammar", plan_target._tpu_target))
    monkeypatch.setattr(plan_target, "_gpu_target", counted("grammar", plan_target._gpu_target))
    doc = run_cli("report", "examples/mlp.py:train_step", "--topology", "v5e:2x4", "--no-peak", "--format", "json",
                  check=0).json()
    assert doc["functions"][0]["mesh"]["topology"] == "v5e:2x4"
    assert doc["functions"][0]["mesh"]["device_kind"] == "TPU v5 lite"
    assert calls == {"parse_target": 1, "grammar": 1}


SHARDING_AT_IMPORT = """\
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

MESH = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.{},))
REPLICATED = NamedSharding(MESH, P())  # as Equinox's parallelism example builds model_sharding


def step(w, x):
    w = jax.lax.with_sharding_constraint(w, REPLICATED)
    return jnp.tanh(x @ w)
"""


@pytest.mark.slow
@pytest.mark.parametrize("axes", ["Auto", "Explicit"])
def test_a_sharding_made_at_import_and_used_inside_follows_the_topology(tmp_path, axes):
    """Equinox's parallelism example (docs/examples/parallelism.ipynb) builds ``NamedSharding(mesh,
    P())`` at import from ``jax.devices()`` and constrains with it inside the step. Under ``--topology``
    ``jax.devices()`` gives the target's devices while the module is imported (issue 30,
    devices.world), so with auto axes it stages; with ``jax.make_mesh``'s Explicit axes and no
    ``axis_types`` in the spec the module's own mesh gives the axis types (issue 49, with a note), and a
    spec that says ``axis_types: auto`` against them is exit 2 naming the user's line and
    ``axis_types: explicit``, before any compile."""
    from helpers import run_subprocess, write

    model = SHARDING_AT_IMPORT.replace("{}", axes)
    write(tmp_path, "m.py", model)
    spec = ("version: 1\nmesh: {axes: {fsdp: 8}}\nfunctions:\n  step:\n"
            "    target: m.py:step\n    args: ['f32[256,256]', 'f32[64,256] @ [fsdp]']\n")
    write(tmp_path, "m.stagetool.yaml", spec)
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}
    r = run_subprocess("memory", "--spec", "m.stagetool.yaml", "--topology", "v5e:2x4", "--no-peak",
                       cwd=tmp_path, env=env)
    assert r.code == 0, r.stderr
    if axes == "Auto":
        assert "with Explicit axes" not in r.stdout
        return
    assert "with Explicit axes (m.py:5)" in r.stdout and "staged with Explicit axes, as the code runs" in r.stdout
    write(tmp_path, "m.stagetool.yaml", spec.replace("{axes: {fsdp: 8}}", "{axes: {fsdp: 8}, axis_types: auto}"))
    r = run_subprocess("memory", "--spec", "m.stagetool.yaml", "--topology", "v5e:2x4", "--no-peak",
                       cwd=tmp_path, env=env)
    assert r.code == 2, r.stderr
    assert "Mesh for all inputs should be equal" in r.stderr and "fsdp=8 on 8 TPU v5 lite devices" in r.stderr
    assert "m.py:11 in step" in r.stderr and "axis_types: explicit" in r.stderr


def test_the_host_mesh_hint_only_for_host_devices_beside_a_target():
    from stagetool.staging.stages import _host_mesh_hint

    jax_says = ("Received incompatible devices for jitted computation. Got jit's context mesh with device ids "
                "[0, 1] on platform {} and sharding_constraint inside jit with device ids [0, 1] on platform {}")
    assert _host_mesh_hint(jax_says.format("TPU", "CPU")) is not None
    assert _host_mesh_hint(jax_says.format("CPU", "GPU")) is not None
    assert _host_mesh_hint(jax_says.format("CPU", "CPU")) is None
    assert _host_mesh_hint("ValueError: something else on platform TPU and on platform CPU") is None
    explicit = ("For primitive dot_general, context mesh AbstractMesh('fsdp': 8, axis_types=(Auto,), device_kind=TPU "
                "v5 lite, num_cores=1, platform=tpu) should match the aval mesh AbstractMesh('fsdp': 8, "
                "axis_types=(Explicit,), device_kind=cpu, num_cores=None, platform=cpu) for shape float32[256,256].")
    assert _host_mesh_hint(explicit) is not None
    assert _host_mesh_hint(explicit.replace("platform=tpu", "platform=cpu")) is None
