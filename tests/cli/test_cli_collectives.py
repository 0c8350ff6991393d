"""`stagetool collectives` on three classic layouts, checked against the module JAX compiles itself.

Expected bytes come from shapes × dtype size and the mesh arithmetic; expected counts and replica
groups from the compiled HLO text of the same function compiled directly with JAX.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import write

MODEL = """\
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def dp_step(w, x):
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)  # DP-GRAD
    return w - 0.1 * g


def contract(a, b):
    return a @ b  # CONTRACT


def fsdp(w, x):
    w = jax.lax.with_sharding_constraint(w, P(None, None))  # FSDP-GATHER
    return jnp.tanh(x @ w)
"""

SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  dp:
    target: m.py:dp_step
    args: ['f32[64,32]', 'f32[16,64] @ [data, null]']
  contract:
    target: m.py:contract
    args: ['f32[16,64] @ [null, model]', 'f32[64,32] @ [model, null]']
  fsdp:
    target: m.py:fsdp
    args: ['f32[64,32] @ [data, null]', 'f32[16,64]']
"""


def line_of(path, marker: str) -> int:
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text)


def groups_of(axis: str) -> set[frozenset[int]]:
    """Device groups (positions in mesh.devices.flat) of one axis of the 2x4 data×model mesh."""
    ids = np.arange(8).reshape(2, 4)
    lines = ids.T if axis == "data" else ids
    return {frozenset(int(i) for i in row) for row in lines}


def jax_compiled_text(fn, *args) -> str:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    structs = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec)) for shape, spec in args]
    with jax.set_mesh(mesh):
        return jax.jit(fn).trace(*structs).lower().compile().as_text()


def count_ops(text: str, kind: str) -> int:
    """Collectives of one kind in HLO text: sync ops plus async starts (a start/done pair is one)."""
    return len(re.findall(rf"= [^=]*\b{kind}(-start)?\(", text))


def run_collectives(run_cli, tmp_path, function: str, *extra: str) -> dict:
    write(tmp_path, "m.py", MODEL)
    spec = write(tmp_path, "m.stagetool.yaml", SPEC)
    r = run_cli("collectives", "--spec", str(spec), "--function", function, "--format", "json", *extra, check=0)
    return r.json()


def test_data_parallel_gradient_all_reduce_over_data(run_cli, tmp_path, isolated_imports):
    doc = run_collectives(run_cli, tmp_path, "dp")
    items = doc["functions"][0]["collectives"]["items"]
    import m

    text = jax_compiled_text(m.dp_step, ((64, 32), P()), ((16, 64), P("data", None)))
    assert len(items) == count_ops(text, "all-reduce") + count_ops(text, "all-gather") + count_ops(text, "reduce-scatter")
    (grad,) = [x for x in items if x["collective"]["kind"] == "all-reduce"]
    c = grad["collective"]
    assert c["mesh_axes"] == ["data"]
    assert c["bytes_per_device"] == 64 * 32 * 4           # the whole replicated gradient, f32
    assert {frozenset(g) for g in c["replica_groups"]} == groups_of("data")
    # relative to the spec's folder (the report root), as every path in a report
    assert grad["source"] == f"m.py:{line_of(tmp_path / 'm.py', 'DP-GRAD')}"
    summary = doc["functions"][0]["collectives"]["summary"]["by_kind_and_mesh_axes"]
    assert [(r["kind"], r["mesh_axes"], r["count"], r["bytes_per_device"]) for r in summary] == [
        ("all-reduce", ["data"], 1, 64 * 32 * 4)]


def test_contracting_dimension_sharded_over_model_is_all_reduced_over_model(run_cli, tmp_path, isolated_imports):
    doc = run_collectives(run_cli, tmp_path, "contract")
    items = doc["functions"][0]["collectives"]["items"]
    import m

    text = jax_compiled_text(m.contract, ((16, 64), P(None, "model")), ((64, 32), P("model", None)))
    reduces = [x for x in items if x["collective"]["kind"] == "all-reduce"]
    assert len(reduces) == count_ops(text, "all-reduce") == 1
    c = reduces[0]["collective"]
    assert c["mesh_axes"] == ["model"]
    assert {frozenset(g) for g in c["replica_groups"]} == groups_of("model")
    assert c["bytes_per_device"] == 16 * 32 * 4            # each device's partial sum of the full result
    assert reduces[0]["source"].endswith(f"m.py:{line_of(tmp_path / 'm.py', 'CONTRACT')}")


def test_fsdp_parameters_are_all_gathered_over_the_fsdp_axis(run_cli, tmp_path, isolated_imports):
    doc = run_collectives(run_cli, tmp_path, "fsdp", "--explain", "w")
    section = doc["functions"][0]["collectives"]
    import m

    text = jax_compiled_text(m.fsdp, ((64, 32), P("data", None)), ((16, 64), P()))
    gathers = [x for x in section["items"] if x["collective"]["kind"] == "all-gather"]
    assert len(gathers) == count_ops(text, "all-gather") == 1
    c = gathers[0]["collective"]
    assert c["mesh_axes"] == ["data"]
    assert c["bytes_per_device"] == 64 * 32 * 4            # the full parameter on every device
    (explained,) = section["explained"]
    assert explained["leaf"] == "w" and explained["collectives"] == [c["name"]]
    assert doc["functions"][0]["inputs"] is None  # the collectives command carries no shardings table


@pytest.mark.jax_version("<0.12", reason="from 0.12 the all-gather's metadata names the parameter, not the line")
def test_fsdp_gather_points_at_the_sharding_constraint(run_cli, tmp_path, isolated_imports):
    doc = run_collectives(run_cli, tmp_path, "fsdp")
    (gather,) = [x for x in doc["functions"][0]["collectives"]["items"] if x["collective"]["kind"] == "all-gather"]
    assert gather["collective"]["op_name"] == "jit(fsdp)/sharding_constraint"
    assert gather["source"].endswith(f"m.py:{line_of(tmp_path / 'm.py', 'FSDP-GATHER')}")


@pytest.mark.jax_version(">=0.12", reason="before 0.12 the all-gather's metadata is the constraint's line")
def test_fsdp_gather_names_the_parameter_from_jax_0_12(run_cli, tmp_path, isolated_imports):
    # XLA of jaxlib 0.12 gives the inserted all-gather the parameter's metadata (op_name "w", no
    # frame): its op name stays XLA's, its line is the nearest instruction's that has one (the dot
    # that reads the gathered w), said as such; --explain w still finds it (above).
    doc = run_collectives(run_cli, tmp_path, "fsdp")
    (gather,) = [x for x in doc["functions"][0]["collectives"]["items"] if x["collective"]["kind"] == "all-gather"]
    assert gather["collective"]["op_name"] == "w"
    dot_line = line_of(tmp_path / "m.py", "FSDP-GATHER") + 1
    assert gather["source"].endswith(f"m.py:{dot_line}") and gather["collective"]["nearest"], gather


def test_explain_names_an_unknown_leaf_with_close_matches(run_cli, tmp_path, isolated_imports):
    write(tmp_path, "m.py", MODEL)
    spec = write(tmp_path, "m.stagetool.yaml", SPEC)
    r = run_cli("collectives", "--spec", str(spec), "--function", "fsdp", "--explain", "ww")
    assert r.code == 2 and "--explain 'ww' names no input leaf" in r.stderr and "Traceback" not in r.stderr


def test_explain_separates_moving_a_leaf_from_what_its_values_flow_into(run_cli, tmp_path, isolated_imports):
    doc = run_collectives(run_cli, tmp_path, "contract", "--explain", "a")
    section = doc["functions"][0]["collectives"]
    (reduce,) = [x["collective"]["name"] for x in section["items"] if x["collective"]["kind"] == "all-reduce"]
    (explained,) = section["explained"]
    # `a` stays sharded on model columns; the partial products it feeds are all-reduced over model.
    assert explained["collectives"] == [] and explained["downstream"] == [reduce]


def test_the_memory_peak_op_column_drops_the_shared_jit_prefix_as_collectives_do(run_cli, tmp_path):
    """Every op of a function starts with ``jit(train_step)/``; the collectives table leaves it out,
    and so does the table of buffers live at the memory peak (it showed it, once or twice)."""
    from helpers import REPO

    out = run_cli("memory", str(REPO / "examples" / "mlp.py") + ":train_step", "--cache-dir",
                  str(tmp_path / "cache"), check=0).stdout
    table = out[out.index("live at the peak"):]
    assert "jit(train_step)" not in table
    assert " transpose(jvp())/dot_general " in table


@pytest.mark.jax_version(">=0.10", reason="jaxlib 0.7.2's XLA names a combined all-reduce by its first op only: "
                         "there is no long name to shorten (not checked between 0.7.2 and 0.10.2)")
def test_a_combined_collective_shows_its_first_op_and_how_many_more(run_cli, tmp_path):
    """Trial 2, finding 14c: XLA names a combined all-reduce by every op it merged (``(op1:op2:…)``,
    600 characters on the training cookbook). Text and Markdown show the first op and how many more
    (one per operand of the combined op: its result types); JSON keeps XLA's whole name."""
    from helpers import REPO

    target = str(REPO / "examples" / "mlp.py") + ":train_step"
    cache = ("--cache-dir", str(tmp_path / "cache"))
    items = run_cli("collectives", target, *cache, "--format", "json", check=0).json()["functions"][0][
        "collectives"]["items"]
    combined = [x["collective"] for x in items if ":" in (x["collective"]["op_name"] or "")]
    assert combined, "the MLP's data-parallel gradient all-reduce is one combined op"
    c = combined[0]
    merged = c["op_name"].split("/", 1)[1].strip("()").split(":")  # jit(train_step)/(a:b:…)
    assert len(merged) == len(c["result_types"]) >= 2
    short = f"{merged[0]} +{len(merged) - 1} more"
    text = run_cli("collectives", target, *cache, check=0).stdout
    md = run_cli("collectives", target, *cache, "--format", "markdown", check=0).stdout
    for out in (text, md):
        assert short in out and c["op_name"].split("/", 1)[1] not in out
    row = next(ln for ln in text.splitlines() if short in ln)
    assert len(row) < 200


SHARED_HELPER = """\
def dense(x, w):  # a DenseGeneral-like helper: every projection's matmul is this line
    return x @ w


def attention(x, wq, wk, wv):
    return tuple(dense(x, w) for w in (wq, wk, wv))  # one call line for all three
"""


@pytest.mark.jax_version("<0.12", reason="jaxlib 0.12's partitioner gives a collective it inserts the "
                                          "parameter's metadata, not the op's: the causes cannot be read back")
def test_projections_sharing_one_helper_line_name_their_own_weight(run_cli, tmp_path, monkeypatch):
    """Issue 30, item 5: wq, wk and wv go through one helper line (the same source line, op name and
    callers); wv alone is sharded over ``data`` on its contraction dimension. With wv laid out like
    the others the program has no collective at all, so every collective there is wv's: each cause
    names wv (its operand and the origin of its axes), none the first projection's weight."""
    write(tmp_path, "proj.py", SHARED_HELPER)

    def spec(wv: str) -> str:
        return write(tmp_path, "proj.stagetool.yaml", f"""
            version: 1
            mesh:
              axes: {{data: 2, model: 4}}
            functions:
              attention:
                target: proj.py:attention
                args:
                  - 'f32[16,256] @ [data, null]'
                  - 'f32[256,512] @ [null, model]'
                  - 'f32[256,512] @ [null, model]'
                  - 'f32[256,512] @ {wv}'
        """)

    monkeypatch.chdir(tmp_path)
    spec("[null, model]")
    same = run_cli("collectives", "proj.py:attention", "--format", "json", check=0).json()
    assert same["functions"][0]["collectives"]["items"] == []
    spec("[data, null]")
    doc = run_cli("collectives", "proj.py:attention", "--format", "json", check=0).json()
    section = doc["functions"][0]["collectives"]
    assert section["causes_unavailable"] is None and len(section["items"]) >= 2
    for item in section["items"]:
        cause = item["cause"]
        assert cause["line"] == "proj.py:2" and [o["name"] for o in cause["operands"]] == ["x", "wv"], cause
        assert {o["leaf"] for o in cause["origins"]} <= {"wv", "x"} and "wq" not in cause["reason"]
