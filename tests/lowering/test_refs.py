"""``jax.Ref`` state (issue 21, item 4): a train step that takes Refs, as the JAX training cookbook
writes it, stages with no wrapper: an ``init`` returning Refs gives abstract refs
(``jax.ref.AbstractRef``), as raw JAX lowers a Ref argument; compared with ``jax.jit`` lowering the
step on the Refs the init really returns (explicit sharding mode: the Ref's type carries its sharding).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import leaves_by_path, write

STEP = '''
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P

def init(key):
    params = {"w": jax.random.normal(key, (64, 64)), "b": jnp.zeros((64,))}
    params = {"w": jax.sharding.reshard(params["w"], P(None, "model")), "b": params["b"]}
    return jax.tree.map(jax.new_ref, params)

@jax.jit
def train_step(params, x):
    def loss(p):
        return jnp.mean((x @ p["w"] + p["b"]) ** 2)
    value = {k: r[...] for k, r in params.items()}
    l, g = jax.value_and_grad(loss)(value)
    for k in params:
        params[k][...] = value[k] - 0.1 * g[k]
    return l
'''


def test_ref_train_step_is_the_real_program(run_cli, tmp_path, isolated_imports):
    write(tmp_path, "cook.py", STEP)
    spec = write(tmp_path, "s.yaml", '''
        version: 1
        mesh:
          axes: {data: 2, model: 4}
          axis_types: explicit
        functions:
          train_step:
            target: cook.py:train_step
            args:
              - init: cook.py:init
                init_args: [key(0)]
              - 'f32[16,64] @ [data, null]'
    ''')
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    sys.path.insert(0, str(tmp_path))
    import cook

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    with jax.set_mesh(mesh):
        refs = cook.init(jax.random.key(0))
        x = jax.device_put(jnp.zeros((16, 64)), NamedSharding(mesh, P("data", None)))
        real = cook.train_step.lower(refs, x).compile()
    mem = real.memory_analysis()
    record = fn["memory"]["record"]
    assert (record["argument_bytes"], record["output_bytes"], record["alias_bytes"], record["temp_bytes"]) == \
        (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes, mem.temp_size_in_bytes)
    assert record["alias_bytes"] > 0  # the refs' new values are written in place
    assert fn["cost"]["per_device"]["flops"] == real.cost_analysis()["flops"]
    leaves = leaves_by_path({"functions": [fn]})
    assert leaves["params/w"]["compiled"] == "P(None, 'model')"
    real_in = jax.tree_util.tree_leaves(real.input_shardings)
    assert [tuple(s.spec) for s in real_in][:2] == [(None,), (None, "model")]


AUTO_STEP = STEP.replace('jax.sharding.reshard(params["w"], P(None, "model"))',
                         'jax.lax.with_sharding_constraint(params["w"], P(None, "model"))')


@pytest.mark.parametrize("static", [False, True])
def test_refs_under_auto_axes_keep_the_sharding_their_value_has(run_cli, tmp_path, isolated_imports, static):
    """Under auto axes a Ref's type carries no sharding, but ``jax.jit`` on a real Ref takes its
    value's placement as the input sharding; stagetool gives the abstract Ref the sharding the init
    gives it (through the jit's in_shardings) and stages the same program: memory four figures,
    FLOPs and input shardings equal ``train_step.lower(init(key), x).compile()``. A spec ``static``
    value is closed over (jax.jit takes no keywords with in_shardings)."""
    assert AUTO_STEP != STEP
    step = AUTO_STEP.replace("def train_step(params, x):", "def train_step(params, x, lr=0.1):") \
        .replace("- 0.1 * g[k]", "- lr * g[k]")
    assert step != AUTO_STEP
    write(tmp_path, "cook.py", step if static else AUTO_STEP)
    spec = write(tmp_path, "s.yaml", '''
        version: 1
        mesh:
          axes: {data: 2, model: 4}
        functions:
          train_step:
            target: cook.py:train_step
            args:
              - init: cook.py:init
                init_args: [key(0)]
              - 'f32[16,64] @ [data, null]'
    ''' + ("        static: {lr: 0.2}\n" if static else ""))
    fn = run_cli("report", "--spec", spec, "--format", "json", check=0).json()["functions"][0]
    sys.path.insert(0, str(tmp_path))
    import cook

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    with jax.set_mesh(mesh):
        refs = cook.init(jax.random.key(0))
        assert refs["w"][...].sharding.spec == P(None, "model")  # the real Ref's value is sharded
        x = jax.device_put(jnp.zeros((16, 64)), NamedSharding(mesh, P("data", None)))
        if static:
            real = jax.jit(cook.train_step.__wrapped__, static_argnames=("lr",)).lower(refs, x, lr=0.2).compile()
        else:
            real = cook.train_step.lower(refs, x).compile()
    mem = real.memory_analysis()
    record = fn["memory"]["record"]
    assert (record["argument_bytes"], record["output_bytes"], record["alias_bytes"], record["temp_bytes"]) == \
        (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes, mem.temp_size_in_bytes)
    assert record["argument_bytes"] == 4 * (64 * 64 // 4 + 64 + 16 * 64 // 2)  # w split over model, x over data
    assert fn["cost"]["per_device"]["flops"] == real.cost_analysis()["flops"]
    leaves = leaves_by_path({"functions": [fn]})
    assert leaves["params/w"]["compiled"] == "P(None, 'model')" and leaves["params/w"]["sharding_source"] == "init"
    real_in = [tuple(s.spec) for s in jax.tree_util.tree_leaves(real.input_shardings)]
    assert real_in[1] == (None, "model")
