"""Multi-slice TPU jobs (issue 20, item 4): ``--slices N`` stages N slices of a compile-only
topology joined over DCN. Skipped, with the reason, where libtpu is not installed."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_subprocess, write

from stagetool.hlo.collectives import MeshAxes, find_collectives, summarize
from stagetool.hlo.parser import parse_hlo_module
from stagetool.devices import tpu_topology as topology

needs_libtpu = pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")

SGD = """
import jax, jax.numpy as jnp

def step(w, x):
    g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.1 * g
"""
SPEC = """
version: 1
mesh: {axes: {data: 4, model: 2}}
topology: v5e:2x2
slices: 2
functions:
  step:
    target: sgd.py:step
    args: ['f32[1024,1024]', 'f32[256,1024] @ [data, null]']
"""


def _raw_two_slices():
    """The same step staged with JAX directly on two v5e:2x2 slices (hybrid mesh, data over DCN)."""
    from jax.experimental import mesh_utils, topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu's lock file
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", num_slices=2).devices
    mesh = Mesh(mesh_utils.create_hybrid_device_mesh((2, 2), (2, 1), devices), ("data", "model"))
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))

    def step(w, x):
        g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g

    return mesh, jax.jit(step).trace(w, x).lower().compile()


@needs_libtpu
def test_two_slices_send_the_gradient_over_dcn():
    mesh, compiled = _raw_two_slices()
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert (slices[:2] == 0).all() and (slices[2:] == 1).all()  # the first axis spans the slices
    found = find_collectives(parse_hlo_module(compiled.as_text()), MeshAxes(("data", "model"), (4, 2)), slices=2)
    dcn = [c for c in found if c.network == "dcn"]
    assert dcn and all(c.mesh_axes == ("data",) and c.kind == "all-reduce" for c in dcn)
    assert all(c.network == "ici" for c in found if c not in dcn)
    # what crosses DCN is the reduce-scattered gradient: f32[1024,1024] / 2 devices along data in a slice
    assert sum(c.bytes_per_device for c in dcn) == 1024 * 1024 * 4 // 2
    assert summarize(found).dcn_bytes_per_step == 1024 * 1024 * 4 // 2
    # one slice: no network, no DCN figure
    plain = find_collectives(parse_hlo_module(compiled.as_text()), MeshAxes(("data", "model"), (2, 2)))
    assert all(c.network is None for c in plain) and summarize(plain).dcn_bytes_per_step is None


@needs_libtpu
def test_the_cli_reports_ici_and_dcn(run_cli, tmp_path, monkeypatch):
    write(tmp_path, "sgd.py", SGD)
    spec = write(tmp_path, "sgd.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    f = run_cli("collectives", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    assert f["mesh"]["slices"] == 2 and f["mesh"]["device_count"] == 8
    networks = {c["collective"]["network"] for c in f["collectives"]["items"]}
    assert networks == {"ici", "dcn"}
    assert f["collectives"]["summary"]["dcn_bytes_per_step"] == 1024 * 1024 * 4 // 2
    text = run_cli("collectives", "--spec", spec, check=0).stdout
    assert "network" in text and "over DCN" in text and " dcn " in text
    snap = tmp_path / "lock.json"
    run_cli("snapshot", "--spec", spec, "-o", snap, "--no-cache", check=0)
    import json

    entry = json.loads(snap.read_text())["functions"]["step"]
    assert entry["dcn_bytes_per_step"] == 1024 * 1024 * 4 // 2 and entry["mesh"]["slices"] == 2
    assert {row.get("network") for row in entry["collectives"]} == {"ici", "dcn"}


@pytest.mark.parametrize("args, words", [
    (("--topology", "v5e:2x2x2"), ("2-D", "v5e:2x4")),
    (("--topology", "v6e:4x4x2"), ("2-D", "v6e:4x4")),
    (("--topology", "v5e:2x2", "--slices", "2", "--mesh", "3x2"), ("multiple of 2",)),
    (("--slices", "2"), ("TPU topology",)),
    (("--topology", "v5e:2x2", "--slices", "2", "--mesh", "2x2"), ("8",)),
])
def test_what_cannot_exist_is_exit_2_before_jax(args, words):
    r = run_subprocess("collectives", "examples/mlp.py:train_step", *args)
    assert r.code == 2, r.stderr
    assert all(w in r.stderr for w in words), r.stderr
    assert "Traceback" not in r.stderr


def test_slices_in_the_spec_are_validated(tmp_path):
    write(tmp_path, "sgd.py", SGD)
    spec = write(tmp_path, "sgd.stagetool.yaml", SPEC.replace("slices: 2", "slices: two"))
    r = run_subprocess("collectives", "--spec", spec, cwd=tmp_path)
    assert r.code == 2 and "slices" in r.stderr and "sgd.stagetool.yaml:4" in r.stderr, r.stderr


@pytest.mark.slow
@needs_libtpu
def test_a_sweep_row_carries_the_bytes_over_dcn(tmp_path):
    write(tmp_path, "sgd.py", SGD)
    write(tmp_path, "sgd.stagetool.yaml", SPEC.replace("topology: v5e:2x2\nslices: 2\n", ""))
    r = run_subprocess("sweep", "sgd.py:step", "--topology", "v5e:2x2", "--slices", "2", "--mesh", "4x2,8x1",
                       "--format", "json", cwd=tmp_path, timeout=600)
    assert r.code == 0, r.stderr
    rows = {row["values"]["mesh"]: row for row in r.json()["rows"]}
    # the reduce-scattered gradient crosses DCN: f32[1024,1024] over the in-slice part of data (2, then 4)
    assert rows["4x2"]["dcn_bytes_per_step"] == 1024 * 1024 * 4 // 2
    assert rows["8x1"]["dcn_bytes_per_step"] == 1024 * 1024 * 4 // 4


@needs_libtpu
def test_devices_lists_every_slice():
    r = run_subprocess("devices", "--topology", "v5e:2x2", "--slices", "2", "--format", "json")
    assert r.code == 0, r.stderr
    doc = r.json()
    assert doc["device_count"] == 8 and doc["process_count"] == 2
    r = run_subprocess("devices", "--slices", "2")
    assert r.code == 2 and "TPU topology" in r.stderr
