"""The Flax NNX, Flax Linen and Equinox examples, staged by stagetool with no wrapper, against the
same real train step built with raw JAX: the framework's own jit on real (sharded) arrays, with the
step's real donation and out_shardings. Shardings, collectives, cost_analysis() and
memory_analysis() must be the same program's.

Also the CI gate: editing one ``with_partitioning`` annotation (NNX) or one logical axis rule
(Linen) in a copy of the example makes ``check`` fail naming the leaf.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import EXAMPLES, import_afresh, leaves_by_path

pytest.importorskip("optax")

COLLECTIVE_RE = re.compile(r"=\s*\S.*?\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def mesh_2x4():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def collective_counts(hlo_text: str) -> Counter:
    """Collectives by kind in a compiled module's text (async starts counted once, dones not)."""
    return Counter(m.group(1) for line in hlo_text.splitlines() for m in [COLLECTIVE_RE.search(line)] if m)


def stagetool_json(run_cli, target: str) -> dict:
    return run_cli("report", str(EXAMPLES / target), "--format", "json", check=0).json()["functions"][0]


def assert_same_program(fn: dict, compiled) -> None:
    """stagetool's JSON for one function equals what raw JAX compiled for the same step."""
    raw_cost = compiled.cost_analysis()
    for key, field in (("flops", "flops"), ("bytes accessed", "bytes_accessed"), ("transcendentals", "transcendentals")):
        assert fn["cost"]["per_device"][field] == raw_cost.get(key), key
    mem = compiled.memory_analysis()
    record = fn["memory"]["record"]
    assert record["argument_bytes"] == mem.argument_size_in_bytes
    assert record["output_bytes"] == mem.output_size_in_bytes
    assert record["alias_bytes"] == mem.alias_size_in_bytes
    assert record["temp_bytes"] == mem.temp_size_in_bytes
    kinds = Counter()
    bytes_by_kind = Counter()
    for item in fn["collectives"]["items"]:
        kinds[item["collective"]["kind"]] += 1
        bytes_by_kind[item["collective"]["kind"]] += item["collective"]["bytes_per_device"]
    assert kinds == collective_counts(compiled.as_text())
    raw_in = Counter(trimmed(tuple(s.spec)) for s in jax.tree_util.tree_leaves(compiled.input_shardings))
    ours_in = Counter(trimmed(eval_spec(x["compiled"])) for x in fn["inputs"])
    assert ours_in == raw_in
    raw_out = Counter(trimmed(tuple(s.spec)) for s in jax.tree_util.tree_leaves(compiled.output_shardings))
    ours_out = Counter(trimmed(eval_spec(x["compiled"])) for x in fn["outputs"])
    assert ours_out == raw_out


def trimmed(dims: tuple) -> tuple:
    """PartitionSpec entries without trailing Nones (``P(None,)`` and ``P()`` are the same layout)."""
    dims = list(dims)
    while dims and dims[-1] is None:
        dims.pop()
    return tuple(dims)


def eval_spec(text: str) -> tuple:
    """``P('data', None)`` (as stagetool prints it) → the PartitionSpec's entries."""
    return eval(text, {"P": lambda *a: a})  # noqa: S307 - our own output


def real_shardings(tree) -> dict[str, tuple]:
    """key path (``/``-separated, as stagetool names leaves) → the real array's PartitionSpec entries."""
    out = {}
    for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in kp)
        out[path] = trimmed(tuple(x.sharding.spec))
    return out


def test_nnx_example_is_the_real_step(run_cli_shared, isolated_imports):
    pytest.importorskip("flax")

    import optax
    from flax import nnx

    fn = stagetool_json(run_cli_shared, "nnx_lm.py:train_step")
    sys.path.insert(0, str(EXAMPLES))
    import nnx_lm

    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        model = nnx_lm.LM(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        data = NamedSharding(mesh, P("data", None))
        batch = {"tokens": jax.device_put(jnp.zeros((16, 32), jnp.int32), data),
                 "targets": jax.device_put(jnp.zeros((16, 32), jnp.int32), data)}
        compiled = nnx.jit(nnx_lm.train_step.fun, donate_argnums=(0, 1)).lower(model, optimizer, batch).compile()
        real = {**{f"model/{k}": v for k, v in real_shardings(nnx.state(model)).items()},
                **{f"optimizer/{k}": v for k, v in real_shardings(nnx.state(optimizer)).items()}}
    assert_same_program(fn, compiled)
    inputs = leaves_by_path({"functions": [fn]})
    for path, spec in real.items():
        assert trimmed(eval_spec(inputs[path]["compiled"])) == spec, path
        assert inputs[path]["donated"]
    assert inputs["model/mlp/up/kernel/value"]["sharding_source"] == "model"
    assert all(d["status"] == "aliased" for d in fn["memory"]["donation"] if d["requested"])


def test_linen_example_is_the_real_step(run_cli_shared, isolated_imports):
    pytest.importorskip("flax")

    import flax.linen as nn

    fn = stagetool_json(run_cli_shared, "linen_lm.py:train_step")
    sys.path.insert(0, str(EXAMPLES))
    import linen_lm

    mesh = mesh_2x4()
    rules = linen_lm.LOGICAL_AXIS_RULES
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(linen_lm.create_state, jax.random.key(0))
        state_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
        state = jax.jit(linen_lm.create_state, out_shardings=state_shardings)(jax.random.key(0))
        data = NamedSharding(mesh, P("data", None))
        batch = {"tokens": jax.device_put(jnp.zeros((16, 32), jnp.int32), data),
                 "targets": jax.device_put(jnp.zeros((16, 32), jnp.int32), data)}
        step = jax.jit(linen_lm.train_step, donate_argnums=0,
                       out_shardings=(state_shardings, NamedSharding(mesh, P())))
        compiled = step.lower(state, batch).compile()
        real = {f"state/{k}": v for k, v in real_shardings(state).items()}
    assert_same_program(fn, compiled)
    inputs = leaves_by_path({"functions": [fn]})
    for path, spec in real.items():
        assert trimmed(eval_spec(inputs[path]["compiled"])) == spec, path
    assert inputs["state/params/MLP_0/Dense_0/kernel/value"]["compiled"] == "P(None, 'model')"
    outputs = leaves_by_path({"functions": [fn]}, "outputs")
    assert outputs["out/0/params/MLP_0/Dense_0/kernel/value"]["sharding_source"] == "spec"


def test_equinox_example_is_the_real_step(run_cli_shared, isolated_imports):
    pytest.importorskip("equinox")

    fn = stagetool_json(run_cli_shared, "equinox_lm.py:train_step")
    sys.path.insert(0, str(EXAMPLES))
    import equinox_lm

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        model = equinox_lm.LM(jax.random.key(0))
        opt_state = equinox_lm.init_opt_state(jax.random.key(0))
        data = NamedSharding(mesh, P("data", None))
        tokens = jax.device_put(jnp.zeros((16, 32), jnp.int32), data)
        # What eqx.filter_jit compiles and runs: its own executable (Equinox's marker scalar included).
        compiled = equinox_lm.train_step.lower(model, opt_state, tokens, tokens).compile().compiled
    assert_same_program(fn, compiled)
    assert "marker" in {x["path"] for x in fn["outputs"]}
    assert {x["path"] for x in fn["inputs"]} >= {"model/mlp/layers/0/weight", "opt_state/0/mu/embed/weight"}


# ---- the gate sees a changed annotation in the model


def gate_copy(tmp_path, stem: str):
    for name in (f"{stem}.py", f"{stem}.stagetool.yaml"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    return tmp_path / f"{stem}.py", tmp_path / f"{stem}.stagetool.yaml"


def test_check_sees_an_edited_nnx_annotation(tmp_path, run_cli, run_cli_shared):
    pytest.importorskip("flax")
    module, spec = gate_copy(tmp_path, "nnx_lm")
    lock = tmp_path / "lock.json"
    run_cli_shared("snapshot", "--spec", spec, "-o", lock, check=0)  # the example's program: read back if compiled
    text = module.read_text()
    before = 'kernel_init=nnx.with_partitioning(init, (None, "model")))'
    assert text.count(before) == 1
    module.write_text(text.replace(before, 'kernel_init=nnx.with_partitioning(init, ("model", None)))'))
    import_afresh("nnx_lm", tmp_path)  # `check` runs in a new process in CI: the edited file is imported afresh
    result = run_cli("check", "--spec", spec, "--baseline", lock, check=1)
    assert "model/mlp/up/kernel/value" in result.stdout + result.stderr


def test_check_sees_an_edited_logical_axis_rule(tmp_path, run_cli, run_cli_shared):
    pytest.importorskip("flax")
    module, spec = gate_copy(tmp_path, "linen_lm")
    lock = tmp_path / "lock.json"
    run_cli_shared("snapshot", "--spec", spec, "-o", lock, check=0)  # the example's program: read back if compiled
    text = module.read_text()
    assert text.count('("mlp", "model"),') == 1
    module.write_text(text.replace('("mlp", "model"),', '("mlp", None),'))
    import_afresh("linen_lm", tmp_path)  # `check` runs in a new process in CI: the edited file is imported afresh
    result = run_cli("check", "--spec", spec, "--baseline", lock, check=1)
    assert "state/params/MLP_0/Dense_0/kernel/value" in result.stdout + result.stderr
