"""``{ref: module.py:obj, rules: [...]}``: a module-level object whose arrays the code has not placed
yet (a model built on one device that the training loop shards later, as Equinox's parallelism
example does before its loop) is sharded by the spec's rules, as an ``init``'s leaves are. Before,
a ``{ref:}`` took no ``rules`` key ("unknown key 'rules'") while the report's note about those
leaves said "give them rules or shardings in the spec to know". Every figure is raw
``jax.jit(...).lower().compile()`` of the same step on the arrays placed as the rules say."""

from __future__ import annotations

import jax
import numpy as np
from helpers import raw_module, write
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MODULE = '''
import jax
import jax.numpy as jnp

# built at import on the default device; the training loop would place them on the mesh later
params = {"w_in": jax.random.normal(jax.random.key(0), (64, 256)), "w_out": jax.random.normal(jax.random.key(1), (256, 64)),
          "scale": jnp.ones((64,))}


@jax.jit
def step(params, x):
    h = jax.nn.relu(x @ params["w_in"]) @ params["w_out"]
    return jnp.mean((h * params["scale"]) ** 2)
'''

SPEC = '''
version: 1
mesh:
  axes: {data: 2, model: 4}
functions:
  step:
    target: rr.py:step
    args:
      - {ref: rr.py:params, rules: [['w_in$', [null, model]], ['w_out$', [model, null]], ['.*', replicated]]}
      - 'f32[32,64] @ [data, null]'
'''


def test_a_refs_rules_shard_its_arrays_as_raw_jax_placed_so(run_cli, tmp_path, monkeypatch, isolated_imports):
    module = write(tmp_path, "rr.py", MODULE)
    write(tmp_path, "rr.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    f = run_cli("report", "rr.py:step", "--format", "json", check=0).json()["functions"][0]
    inputs = {x["path"]: x for x in f["inputs"]}
    assert inputs["params/w_in"]["compiled"] == "P(None, 'model')" and inputs["params/w_in"]["sharding_source"] == "rule"
    assert inputs["params/w_out"]["compiled"] == "P('model', None)"
    assert not [n for n in f["notes"] if "sharding unknown" in n]

    raw = raw_module(module, "rr")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    specs = {"w_in": P(None, "model"), "w_out": P("model", None), "scale": P()}
    params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
              for k, v in raw.params.items()}
    x = jax.ShapeDtypeStruct((32, 64), np.float32, sharding=NamedSharding(mesh, P("data", None)))
    m = raw.step.lower(params, x).compile().memory_analysis()
    rec = f["memory"]["record"]
    assert (rec["argument_bytes"], rec["output_bytes"], rec["temp_bytes"]) == (
        m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes)


def test_a_ref_rule_that_matches_no_leaf_is_named(run_cli, tmp_path, monkeypatch, isolated_imports):
    write(tmp_path, "rr.py", MODULE)
    write(tmp_path, "rr.stagetool.yaml", SPEC.replace(", ['.*', replicated]", ""))
    monkeypatch.chdir(tmp_path)
    r = run_cli("memory", "rr.py:step", "--no-peak", check=2)
    assert "no rule matches leaf 'params/scale'" in r.stderr and "rr.stagetool.yaml:" in r.stderr
