"""Typed PRNG keys of every impl JAX knows (issue 30, item 4), in specs and in objects: MaxText's
default ``unsafe_rbg`` (dtype ``key<urbg>``), ``rbg``, ``threefry2x32``; figures = raw JAX's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import write

MODEL = '''
import jax

URBG_KEY = jax.random.key(0, impl="unsafe_rbg")
RBG_KEY = jax.random.key(0, impl="rbg")


def draw(key, x):
    return x + jax.random.normal(key, x.shape)
'''


@pytest.mark.parametrize(("written", "impl"), [("key<urbg>", "unsafe_rbg"), ("key<unsafe_rbg>", "unsafe_rbg"),
                                               ("key<rbg>", "rbg"), ("key<threefry2x32>", "threefry2x32"),
                                               ("key<fry>", "threefry2x32"), ({"ref": "keys.py:URBG_KEY"}, "unsafe_rbg"),
                                               ({"ref": "keys.py:RBG_KEY"}, "rbg")])
def test_every_key_impl_stages_as_raw_jax(run_cli, tmp_path, monkeypatch, written, impl):
    import json

    write(tmp_path, "keys.py", MODEL)
    arg = json.dumps(written) if isinstance(written, dict) else f"'{written}[]'"
    write(tmp_path, "keys.stagetool.yaml", "version: 1\nmesh: {axes: {data: 2}}\nfunctions:\n  draw:\n"
          f"    target: keys.py:draw\n    args: [{arg}, 'f32[8,128] @ [data, null]']\n")
    monkeypatch.chdir(tmp_path)
    doc = run_cli("memory", "keys.py:draw", "--no-peak", "--format", "json", check=0).json()
    f = doc["functions"][0]
    assert f.get("error") is None
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("data",))
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype,
                               sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None)))
    draw = lambda k, x: x + jax.random.normal(k, x.shape)  # noqa: E731
    stats = jax.jit(draw).lower(key, x).compile().memory_analysis()
    record = f["memory"]["record"]
    assert (record["argument_bytes"], record["output_bytes"], record["temp_bytes"]) == (
        stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.temp_size_in_bytes)
    assert record["argument_bytes"] == (16 if impl != "threefry2x32" else 8) + 4 * 128 * 4


@pytest.mark.parametrize(("written", "impl"), [("key<urbg>", "unsafe_rbg"), ("key<fry>", "threefry2x32"),
                                               ({"ref": "keys.py:URBG_KEY"}, "unsafe_rbg")])
def test_typed_key_on_a_tpu_topology_has_its_tiled_bytes(run_cli, tmp_path, monkeypatch, written, impl):
    """On TPU a typed key's layout is its uint32 key data's (one dimension more, tiled): the input's
    padded bytes are counted on that (the MaxText state's ``key<urbg>`` leaves crashed before), and
    the inputs' padded bytes add up to XLA:TPU's argument size."""
    import json

    from stagetool.devices import tpu_topology
    from stagetool.plan.target import parse_target

    if not tpu_topology.libtpu_available():
        pytest.skip("libtpu not installed: pip install -e '.[tpu]'")
    write(tmp_path, "keys.py", MODEL)
    arg = json.dumps(written) if isinstance(written, dict) else f"'{written}[]'"
    write(tmp_path, "keys.stagetool.yaml", "version: 1\nmesh: {axes: {data: 8}}\nfunctions:\n  draw:\n"
          f"    target: keys.py:draw\n    args: [{arg}, 'f32[8,128] @ [data, null]']\n")
    monkeypatch.chdir(tmp_path)
    doc = run_cli("memory", "keys.py:draw", "--no-peak", "--topology", "v5e:2x4", "--format", "json", check=0).json()
    f = doc["functions"][0]
    assert f.get("error") is None
    devices = list(tpu_topology.tpu_topology(parse_target("v5e:2x4")).devices)
    mesh = jax.sharding.Mesh(devices, ("data",))
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype,
                               sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None)))
    stats = jax.jit(lambda k, x: x + jax.random.normal(k, x.shape)).lower(key, x).compile().memory_analysis()
    assert f["memory"]["record"]["argument_bytes"] == stats.argument_size_in_bytes
    inputs = run_cli("shardings", "keys.py:draw", "--topology", "v5e:2x4", "--format", "json",
                     check=0).json()["functions"][0]["inputs"]
    padded = [leaf["padded_bytes_per_device"] for leaf in inputs]
    assert padded[0] == 128 * 4  # the key's 2 or 4 uint32 words in one (128,) tile
    assert sum(padded) == stats.argument_size_in_bytes
