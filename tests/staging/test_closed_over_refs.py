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
