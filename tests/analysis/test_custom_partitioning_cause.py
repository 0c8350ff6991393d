"""Issue 48: a gather that a ``custom_partitioning`` rule asked for (its ``arg_shardings`` ask for
the operand whole, ``P(None, None)``) names the rule and its line, not "the partitioner's choice"."""

from __future__ import annotations

import importlib.util

from helpers import raw_collective_kinds, write

CODE = """\
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P


@custom_partitioning
def my_op(x):
    return jnp.sin(x)


def whole(mesh, arg_shapes, result_shape):
    rep = NamedSharding(mesh, P(None, None))
    return mesh, jnp.sin, rep, (rep,)


def infer(mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, P(None, None))


my_op.def_partition(partition=whole, infer_sharding_from_operands=infer, sharding_rule="i j -> i j")


def step(x):
    return my_op(x) * 2
"""


def test_a_gather_a_custom_partitioning_rule_asked_for_names_the_rule(run_cli, tmp_path, monkeypatch):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    write(tmp_path, "c.py", CODE)
    write(tmp_path, "c.stagetool.yaml", "version: 1\nmesh: {axes: {data: 8}}\nfunctions:\n  step:\n"
          "    target: c.py:step\n    args: ['f32[1024,512] @ [data, null]']\n")
    monkeypatch.chdir(tmp_path)
    fn = run_cli("collectives", "--no-cache", "--format", "json", check=0).json()["functions"][0]
    # raw JAX: the same step on the same 8 CPU devices gathers x once
    spec = importlib.util.spec_from_file_location("cp_cause_raw", tmp_path / "c.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    x = jax.ShapeDtypeStruct((1024, 512), np.float32, sharding=NamedSharding(mesh, P("data", None)))
    raw = jax.jit(module.step).lower(x).compile()
    assert raw_collective_kinds(raw) == {"all-gather": 1}
    (item,) = fn["collectives"]["items"]
    assert item["collective"]["kind"] == "all-gather" and item["source"].endswith("c.py:24")
    reason = item["cause"]["reason"]
    assert reason.startswith("the custom_partitioning rule whole (c.py:11), called at c.py:24, asks for a layout "
                             "of its operands or result without `data`"), reason
    assert "partitioner's choice" not in reason
