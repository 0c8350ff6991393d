"""Compile-only TPU topologies through the CLI (issue 6): real TPU memory analysis on a CPU machine.

Skipped, with the reason, where libtpu is not installed (`pip install -e '.[tpu]'`; `.ci/run`
installs it).
"""

from __future__ import annotations

import math

import jax
import pytest
from helpers import leaves_by_path
from test_examples import _in_repo, transformer_stages  # noqa: F401 - the fixture runs in the repo

from stagetool.lowering import topology

pytestmark = pytest.mark.skipif(not topology.libtpu_available(),
                                reason="libtpu not installed: pip install -e '.[tpu]'")


@pytest.mark.slow
def test_transformer_memory_on_v5e_matches_jax(run_cli):
    r = run_cli("memory", "examples/transformer.py:train_step", "--topology", "v5e:2x4", "--no-peak",
                "--format", "json", check=0)
    f = r.json()["functions"][0]
    assert f["mesh"]["platform"] == "tpu" and f["mesh"]["device_kind"] == "TPU v5 lite"
    assert f["mesh"]["topology"] == "v5e:2x4" and f["mesh"]["device_count"] == 8
    m = f["memory"]

    topo = topology.tpu_topology("v5e:2x4")
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
def test_shardings_on_v5e_show_tile_padding(run_cli):
    doc = run_cli("shardings", "examples/mlp.py:train_step", "--topology", "v5e:2x4", "--format", "json",
                  check=0).json()
    ins = leaves_by_path(doc)
    # batch/y: s32[128] on data → 64 elements per device, padded to one (128,) tile: 512 bytes.
    assert ins["batch/y"]["bytes_per_device"] == 64 * 4 and ins["batch/y"]["padded_bytes_per_device"] == 512
    # w1: f32[512,1024] on model columns → [512,256]: whole (8,128) tiles, no padding.
    assert ins["params/w1"]["padded_bytes_per_device"] == ins["params/w1"]["bytes_per_device"] == 512 * 256 * 4
    # Tiled bytes of all arguments add up to XLA's argument size.
    args = sum(x["padded_bytes_per_device"] for x in ins.values())
    mem = run_cli("memory", "examples/mlp.py:train_step", "--topology", "v5e:2x4", "--no-peak", "--format", "json",
                  check=0).json()["functions"][0]["memory"]["record"]
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
