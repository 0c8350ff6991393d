"""A ``{ref:}`` object on a second mesh of the staged devices keeps its own mesh, as ``jax.jit`` takes it
(issue 47's closing note: the spec path still laid it by axis name). The module puts its weight on a
2x4 ``('data', 'model')`` mesh and its batch on a 4x2 mesh of the same names and devices; no
PartitionSpec over the one lays the other alike. Every figure is raw ``jax.jit(...).lower().compile()``
of the same module's arrays: the argument bytes and each input's per-device shape."""

from __future__ import annotations

import pytest
from helpers import raw_module, write

MODULE = '''
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

devices = np.array(jax.devices()[:8])
MESH = Mesh(devices.reshape(2, 4), ("data", "model"))
BATCH_MESH = Mesh(devices.reshape(4, 2), ("data", "model"))
W = jax.device_put(jnp.zeros((16, 32)), NamedSharding(MESH, P(None, "model")))
X = jax.device_put(jnp.zeros((8, 16)), NamedSharding(BATCH_MESH, P("data")))


@jax.jit
def step(w, x):
    return jnp.sum(x @ w)
'''

SPEC = '''
version: 1
mesh:
  axes: {data: 2, model: 4}
functions:
  step:
    target: two.py:step
    args:
      - {ref: two.py:W}
      - {ref: two.py:X}
'''


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    """The module's own arrays compiled by raw JAX: (argument bytes, {leaf: per-device shape})."""
    path = write(tmp_path_factory.mktemp("raw"), "two.py", MODULE)
    m = raw_module(path, "ref_own_mesh")
    compiled = m.step.lower(m.W, m.X).compile()
    (w, x), _ = compiled.input_shardings
    return (compiled.memory_analysis().argument_size_in_bytes,
            {"w": list(w.shard_shape(m.W.shape)), "x": list(x.shard_shape(m.X.shape))})


@pytest.mark.parametrize("mesh", [None, "data=4,model=2"])
def test_a_ref_on_a_second_mesh_keeps_its_own(run_cli, tmp_path, monkeypatch, raw, mesh):
    write(tmp_path, "two.py", MODULE)
    write(tmp_path, "two.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    args = ["report", "two.py:step", "--no-peak", "--no-cache", "--format", "json"] + (["--mesh", mesh] if mesh else [])
    (f,) = run_cli(*args, check=0).json()["functions"]
    assert f["error"] is None
    argument_bytes, shard = raw
    # was, staged on the spec's 2x4 mesh: x as P('data') of that mesh, [4, 16] (256 B), 768 argument bytes
    assert argument_bytes == 640 and shard == {"w": [16, 8], "x": [2, 16]}
    assert f["memory"]["record"]["argument_bytes"] == argument_bytes
    assert {x["path"]: x["shard_shape"] for x in f["inputs"]} == shard
    other = "x" if mesh is None else "w"  # the argument that is not on the staged mesh
    (leaf,) = [x for x in f["inputs"] if x["path"] == other]
    assert "on its own mesh" in leaf["compiled"], leaf
    assert not [n for n in f["notes"] if "taken by axis name" in n], f["notes"]
    assert [n for n in f["notes"] if n.startswith(f"{other} is laid on another mesh of the staged devices")]


def test_on_a_mesh_of_neither_the_refs_are_laid_by_axis_name(run_cli, tmp_path, monkeypatch):
    """--mesh of a shape no argument is on: the caller asks to stage there, and both objects' shardings
    are taken by axis name on it (a note names each mesh), as before."""
    write(tmp_path, "two.py", MODULE)
    write(tmp_path, "two.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    (f,) = run_cli("report", "two.py:step", "--no-peak", "--no-cache", "--format", "json", "--mesh", "data=8,model=1",
                   check=0).json()["functions"]
    assert {x["path"]: x["shard_shape"] for x in f["inputs"]} == {"w": [16, 32], "x": [1, 16]}
    assert len([n for n in f["notes"] if "taken by axis name" in n]) == 2, f["notes"]
