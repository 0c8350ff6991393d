"""A jitted function that closes over a module-level ``jax.Ref`` made at import on the default device
(the Ref guide's first form, as a decode step writing its KV cache): JAX takes the Ref as an input of
the program that it cannot move onto the mesh, and refuses ("Received incompatible devices ...
ARG_SHARDING with device ids [0]"), as raw ``jax.jit(...).lower()`` does. stagetool said "the code
names a mesh of its own that is not the staged mesh" with a hint about --mesh and {mesh: staged},
neither of which applies; it now names the value the function reads and how to stage it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import raw_module, write
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MODULE = '''
import jax
import jax.numpy as jnp

cache = jax.new_ref(jnp.zeros((8, 16, 32)))   # made at import, on the default device


@jax.jit
def decode(w, x, pos):
    cache[:, pos] = x @ w
    return jnp.sum(cache[...], axis=1)
'''

SPEC = '''
version: 1
mesh: {axes: {data: 8}}
functions:
  decode:
    target: cr.py:decode
    args: ['f32[32,32]', 'f32[8,32] @ [data, null]', 'i32[]']
'''


def test_a_closed_over_ref_on_one_device_is_named(run_cli, tmp_path, monkeypatch, isolated_imports):
    if not hasattr(jax, "new_ref"):
        pytest.skip("this JAX has no jax.new_ref")
    module = write(tmp_path, "cr.py", MODULE)
    write(tmp_path, "cr.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    r = run_cli("memory", "cr.py:decode", "--no-peak", check=2)
    assert "the function reads cache (float32[8,16,32] on device 0)" in r.stderr, r.stderr
    assert "{ref: module.py:NAME}" in r.stderr and "jax.device_put" in r.stderr
    assert "names a mesh of its own" not in r.stderr and "{mesh: staged}" not in r.stderr

    raw = raw_module(module, "cr")  # raw JAX refuses the same program on the same devices
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    with pytest.raises(ValueError, match="incompatible devices.*ARG_SHARDING"):
        raw.decode.lower(jax.ShapeDtypeStruct((32, 32), np.float32, sharding=NamedSharding(mesh, P())),
                         jax.ShapeDtypeStruct((8, 32), np.float32, sharding=NamedSharding(mesh, P("data", None))),
                         jax.ShapeDtypeStruct((), np.int32))


def test_closed_over_refs_made_on_the_mesh_stage_with_raw_jaxs_figures(run_cli, tmp_path, monkeypatch,
                                                                      isolated_imports):
    """The same step with its cache made on the mesh: JAX lowers and compiles it, the Ref an input
    after the arguments and a write-back after the outputs, but its ``Compiled.input_shardings`` and
    ``output_shardings`` fail on them ("Too many leaves for PyTreeDef"); stagetool stopped there with
    "unexpected ValueError". Now every memory figure and the FLOPs are raw JAX's, the arguments' and
    the output's compiled shardings are given, and a note names the Ref the input table leaves out."""
    if not hasattr(jax, "new_ref"):
        pytest.skip("this JAX has no jax.new_ref")
    text = MODULE.replace("cache = jax.new_ref(jnp.zeros((8, 16, 32)))   # made at import, on the default device",
                          "MESH = jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))\n"
                          "cache = jax.new_ref(jax.device_put(jnp.zeros((8, 16, 32)), "
                          "jax.sharding.NamedSharding(MESH, jax.sharding.PartitionSpec('data'))))")
    assert "device_put" in text
    module = write(tmp_path, "cr.py", text)
    write(tmp_path, "cr.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    f = run_cli("report", "cr.py:decode", "--no-peak", "--format", "json", check=0).json()["functions"][0]
    assert [x["compiled"] for x in f["inputs"]] == ["P(None, None)", "P('data', None)", "P()"]
    assert [x["compiled"] for x in f["outputs"]] == ["P('data', None)"]  # sum over axis 1 of a data-sharded cache
    (note,) = [n for n in f["notes"] if "closes over" in n]
    assert "1 jax.Ref (cache (float32[8,16,32]))" in note and "2.00 KiB per device" in note  # [1,16,32] f32

    raw = raw_module(module, "cr")
    compiled = raw.decode.lower(
        jax.ShapeDtypeStruct((32, 32), np.float32, sharding=NamedSharding(raw.MESH, P())),
        jax.ShapeDtypeStruct((8, 32), np.float32, sharding=NamedSharding(raw.MESH, P("data", None))),
        jax.ShapeDtypeStruct((), np.int32)).compile()
    m = compiled.memory_analysis()
    rec = f["memory"]["record"]
    assert (rec["argument_bytes"], rec["output_bytes"], rec["alias_bytes"], rec["temp_bytes"]) == (
        m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes)
    assert rec["alias_bytes"] == 1 * 16 * 32 * 4  # the Ref's shard, written back in place
    assert f["cost"]["per_device"]["flops"] == compiled.cost_analysis()["flops"]
