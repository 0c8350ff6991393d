"""'Why' where it was missing (issue 33, item 4): collectives XLA inserts without metadata are tied
to the nearest instruction that has a line, and say so."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import write

from stagetool.hlo.collectives import MeshAxes, find_collectives
from stagetool.devices import tpu_topology as topology
from stagetool.hlo.parser import parse_hlo_module

needs_libtpu = pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")

_HLO = """HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %mul = f32[8]{0} multiply(%p, %p), metadata={op_name="jit(f)/mul" source_file="/src/m.py" source_line=7}
  %copy = f32[8]{0} copy(%mul)
  %ar = f32[8]{0} all-reduce(%copy), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %ar.2 = f32[8]{0} all-reduce(%mul), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %neg = f32[8]{0} negate(%ar), metadata={op_name="jit(f)/neg" source_file="/src/m.py" source_line=9}
}
"""


def test_a_collective_without_metadata_borrows_the_nearest_line():
    by_name = {c.name: c for c in find_collectives(parse_hlo_module(_HLO), MeshAxes(("x", "y"), (2, 2)))}
    # %ar: its operand (a copy) has no line, its user %neg (one hop) has: the user's, not %mul's (two hops)
    ar = by_name["ar"]
    assert (ar.kind, ar.mesh_axes, ar.bytes_per_device) == ("all-reduce", ("x", "y"), 8 * 4)
    assert ar.nearest == "neg" and ar.op_name == "jit(f)/neg" and (ar.source.file, ar.source.line) == ("/src/m.py", 9)
    # %ar.2: its operand %mul has one, one hop away (operands before users)
    ar2 = by_name["ar.2"]
    assert ar2.mesh_axes == ("y",) and ar2.nearest == "mul" and ar2.source.line == 7


TAKE = """import jax.numpy as jnp


def take(a, i):
    return a[i]
"""
TAKE_SPEC = """version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  take:
    target: gat.py:take
    args: ['f32[64,256] @ [data, model]', 'i32[16] @ [model]']
"""


def _unlabelled_collectives() -> list[tuple[str, str]]:
    """(kind, result type) of the collectives XLA:TPU compiles for ``take`` with no metadata, from JAX directly."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4").devices
    mesh = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    a = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    i = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=NamedSharding(mesh, P("model")))
    text = jax.jit(lambda a, i: a[i]).trace(a, i).lower().compile().as_text()
    out = []
    for line in text.splitlines():
        m = re.search(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather|all-to-all|collective-permute)(-start)?\(", line)
        if m and "metadata=" not in line:
            out.append((m.group(3), f"{m.group(1)}[{m.group(2)}]"))
    return sorted(out)


@needs_libtpu
def test_the_gathers_index_all_reduces_are_tied_to_the_gather(run_cli, tmp_path, monkeypatch):
    raw = _unlabelled_collectives()
    assert raw == [("all-reduce", "s32[16]"), ("all-reduce", "s32[8]")]  # XLA:TPU gives these no metadata
    write(tmp_path, "gat.py", TAKE)
    write(tmp_path, "gat.stagetool.yaml", TAKE_SPEC)
    monkeypatch.chdir(tmp_path)
    line = TAKE.splitlines().index("    return a[i]") + 1
    r = run_cli("collectives", "gat.py:take", "--topology", "v5e:2x4", "--format", "json", "--no-cache", check=0)
    items = r.json()["functions"][0]["collectives"]["items"]
    near = sorted((it for it in items if it["collective"].get("nearest")), key=lambda it: it["collective"]["result_types"])
    assert [(it["collective"]["kind"], it["collective"]["result_types"][0]) for it in near] == raw
    for it, axes, n in zip(near, (["data"], ["model[major 2 of 4]"]), (16, 8)):
        c = it["collective"]
        assert c["mesh_axes"] == axes and c["bytes_per_device"] == n * 4
        assert it["source"] == f"gat.py:{line}"
        assert it["cause"]["op"] == "gather" and it["cause"]["line"].endswith(f"gat.py:{line}")
        assert it["cause"]["reason"].startswith(f"no metadata of its own; nearest: gather at gat.py:{line}; ")
    # the others have metadata of their own, and say nothing of a neighbour
    assert all("no metadata" not in it["cause"]["reason"] for it in items if it not in near)
    text = run_cli("collectives", "gat.py:take", "--topology", "v5e:2x4", check=0).stdout
    assert text.count("nearest: gather") == 2 + 2  # the op column and the reason, for each


TOP_K = """from jax import lax


def sample(logits):
    values, indices = lax.top_k(logits, 8)
    return values, indices
"""
TOP_K_SPEC = """version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  sample:
    target: topk.py:sample
    args: ['f32[64,32768] @ [data, model]']
"""


#: What each top-k run says, by target: the bytes each gather moves per device and its reasons. On the CPU
#: mesh the vocabulary is gathered whole for each device's rows, then every row; XLA:TPU partitions a top-k
#: its own way (a top-k per shard, each device's 8 candidates from each of the 4 vocabulary shards gathered
#: for its 32 rows, then both row halves' results), and the rerun has no factor rule for it there: the
#: reasons still name the dimension, without its size.
TOP_K_SAYS = {
    None: (64 // 2 * 32768 * 4, 64 * 32768 * 4,
           "top_k needs the last dimension (of 32768) of logits whole on each device, and it is split over `model` "
           "→ all-gather over `model`",
           "`data` splits dimension 0 (of 64) of logits, a batch dimension of top_k (its results stay split on it): "
           "top_k needs only its last dimension whole, so nothing at it asks for this all-gather over `data`"),
    "v5e:2x4": (64 // 2 * 4 * 8 * 4, 2 * 64 // 2 * 8 * 4,
                "top_k needs the last dimension of logits whole on each device, and it is split over `model` → "
                "all-gather over `model`",
                "`data` splits dimension 0 of logits, a batch dimension of top_k: top_k needs only its last dimension "
                "whole"),
}


@pytest.mark.parametrize("topology_name", [None, pytest.param("v5e:2x4", marks=needs_libtpu)])
def test_a_top_k_over_vocabulary_sharded_logits_says_why_each_gather(run_cli, tmp_path, monkeypatch, topology_name):
    """The vocabulary dimension is gathered because top_k needs it whole; the batch dimension's gather
    over `data` is one nothing at top_k asks for (its results stay split over `data`)."""
    write(tmp_path, "topk.py", TOP_K)
    write(tmp_path, "topk.stagetool.yaml", TOP_K_SPEC)
    monkeypatch.chdir(tmp_path)
    line = TOP_K.splitlines().index("    values, indices = lax.top_k(logits, 8)") + 1
    args = ("--topology", topology_name) if topology_name else ()
    r = run_cli("collectives", "topk.py:sample", *args, "--format", "json", "--no-cache", check=0)
    f = r.json()["functions"][0]
    assert f["collectives"]["causes_unavailable"] is None
    items = {tuple(it["collective"]["mesh_axes"]): it for it in f["collectives"]["items"]}
    assert sorted(items) == [("data",), ("model",)]
    vocab, batch = items[("model",)], items[("data",)]
    vocab_bytes, batch_bytes, vocab_reason, batch_reason = TOP_K_SAYS[topology_name]
    assert vocab["collective"]["kind"] == batch["collective"]["kind"] == "all-gather"
    assert vocab["collective"]["bytes_per_device"] == vocab_bytes
    assert batch["collective"]["bytes_per_device"] == batch_bytes
    for it in (vocab, batch):
        assert it["source"] == f"topk.py:{line}"
        assert it["cause"]["op"] == "top_k" and it["cause"]["line"].endswith(f"topk.py:{line}")
    assert vocab["cause"]["reason"] == vocab_reason
    assert [(o["kind"], o["leaf"], o["axis"]) for o in vocab["cause"]["origins"]] == [("input", "logits", "model")]
    assert batch["cause"]["reason"].startswith(batch_reason)


SGD = """import jax, jax.numpy as jnp


def step(w, x):
    g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.1 * g
"""
SGD_SPEC = """version: 1
mesh: {axes: {data: 4, model: 2}}
topology: v5e:2x2
slices: 2
functions:
  step:
    target: sgd.py:step
    args: ['f32[1024,1024]', 'f32[256,1024] @ [data, null]']
"""


@needs_libtpu
def test_the_transfer_between_slices_says_why(run_cli, tmp_path, monkeypatch):
    """Two v5e:2x2 slices, data over DCN: the gradient's partial sums cross the slices; XLA gives the DCN
    transfer no metadata, and its cause is the gradient's contraction, said to be between slices."""
    write(tmp_path, "sgd.py", SGD)
    write(tmp_path, "sgd.stagetool.yaml", SGD_SPEC)
    monkeypatch.chdir(tmp_path)
    line = SGD.splitlines().index("    g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)") + 1
    r = run_cli("collectives", "--spec", "sgd.stagetool.yaml", "--format", "json", "--no-cache", check=0)
    f = r.json()["functions"][0]
    assert f["collectives"]["causes_unavailable"] is None
    (dcn,) = [it for it in f["collectives"]["items"] if it["collective"]["network"] == "dcn"]
    c = dcn["collective"]
    # the gradient f32[1024,1024], reduce-scattered over the 2 devices of `data` within a slice
    assert (c["kind"], c["mesh_axes"], c["bytes_per_device"]) == ("all-reduce", ["data"], 1024 * 1024 * 4 // 2)
    assert dcn["source"] == f"sgd.py:{line}"
    assert dcn["cause"]["op"] == "dot_general" and dcn["cause"]["line"].endswith(f"sgd.py:{line}")
    assert dcn["cause"]["reason"].startswith("between slices over DCN (`data`, the mesh's first axis, spans the slices")
    assert "contraction over a dimension of 256 split over `data`" in dcn["cause"]["reason"]
    assert [(o["kind"], o["leaf"]) for o in dcn["cause"]["origins"]] == [("input", "x")]
    # no other collective says it crosses the slices
    assert all("DCN" not in it["cause"]["reason"] for it in f["collectives"]["items"] if it is not dcn)


def test_a_collective_with_no_cause_says_why_there_is_none():
    from stagetool.hlo.collectives import summarize
    from stagetool.analysis.sections import CollectiveItem, CollectivesSection
    from stagetool.report.views import cause_lines

    bare = _HLO.replace(', metadata={op_name="jit(f)/mul" source_file="/src/m.py" source_line=7}', "").replace(
        ', metadata={op_name="jit(f)/neg" source_file="/src/m.py" source_line=9}', "")
    found = find_collectives(parse_hlo_module(bare), MeshAxes(("x", "y"), (2, 2)))
    assert [(c.name, c.source, c.nearest) for c in found] == [("ar", None, None), ("ar.2", None, None)]
    lines = cause_lines(CollectivesSection(tuple(CollectiveItem(c, None) for c in found), summarize(found)))
    assert lines[0] == ("1 all-reduce over x × y", "no cause: XLA gave it no metadata and no instruction within 8 "
                        "operand/user hops of it has a line of the program", [])
    assert lines[1][0] == "2 all-reduce over y"


MOE = """import jax


def moe(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes)
"""
MOE_SPEC = """version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  moe:
    target: moe.py:moe
    args: ['f32[512,256] @ [data, null]', 'f32[8,256,512] @ [model, null, null]', 'i32[8]']
"""


@needs_libtpu
@pytest.mark.parametrize("experts_over", ["model", "data"])
def test_the_gathered_expert_weights_of_a_ragged_dot_say_why(run_cli, tmp_path, monkeypatch, experts_over):
    """XLA:TPU gathers a ragged_dot's expert weights (sharded by expert) and its rows whole; each
    gather's cause names the dimension ragged_dot needs whole, the operand it moves and the spec line that
    split it. Issue 41, item 4: with the tokens and the experts' weights both sharded over `data`, the
    weights' gather said 'dimension 0 (of 512) of x' and 'from x', the tokens' sentence, before."""
    write(tmp_path, "moe.py", MOE)
    write(tmp_path, "moe.stagetool.yaml", MOE_SPEC.replace("@ [model, null, null]", f"@ [{experts_over}, null, null]"))
    monkeypatch.chdir(tmp_path)
    line = MOE.splitlines().index("    return jax.lax.ragged_dot(x, w, group_sizes)") + 1
    r = run_cli("collectives", "moe.py:moe", "--topology", "v5e:2x4", "--format", "json", "--no-cache", check=0)
    f = r.json()["functions"][0]
    assert f["collectives"]["causes_unavailable"] is None
    items = {it["collective"]["bytes_per_device"]: it for it in f["collectives"]["items"]}
    rows, weights = items[512 * 256 * 4], items[8 * 256 * 512 * 4]  # every row, every expert's weight, whole
    assert rows["collective"]["kind"] == weights["collective"]["kind"] == "all-gather"
    assert (rows["collective"]["mesh_axes"], weights["collective"]["mesh_axes"]) == (["data"], [experts_over])
    for it in (rows, weights):
        assert it["source"] == f"moe.py:{line}" and it["cause"]["op"] == "ragged_dot"
    assert weights["cause"]["reason"].endswith(
        "ragged_dot needs dimension 0 (of 8) of w whole on each device (its groups, one weight each), and it is split "
        f"over `{experts_over}` → all-gather over `{experts_over}`")
    assert rows["cause"]["reason"].endswith("ragged_dot needs dimension 0 (of 512) of x whole on each device (its rows, "
                                            "which group_sizes splits into groups), and it is split over `data` → "
                                            "all-gather over `data`")
    for it, name in ((rows, "x"), (weights, "w")):
        assert [(o["kind"], o["leaf"], o["source"].split(":")[0]) for o in it["cause"]["origins"]] == [
            ("input", name, "moe.stagetool.yaml")]


MICRO = """import jax
import jax.numpy as jnp


def loss(w, x):
    return jnp.mean((x @ w) ** 2)


def micro(w, x):
    xs = x.reshape(4, x.shape[0] // 4, x.shape[1])
    def body(acc, xb):
        return acc + jax.grad(loss)(w, xb), None
    g, _ = jax.lax.scan(body, jnp.zeros_like(w), xs)
    return w - 0.1 * g
"""
MICRO_SPEC = """version: 1
mesh: {axes: {data: 8}}
functions:
  micro:
    target: mb.py:micro
    args: ['f32[256,256]', 'f32[64,256] @ [data]']
"""


@pytest.mark.parametrize("topology_name", [None, pytest.param("v5e:2x4", marks=needs_libtpu)])
def test_the_reshape_that_splits_a_sharded_axis_is_named(run_cli_shared, tmp_path, monkeypatch, topology_name):
    """Issue 41, item 4: a micro-batch reshape of a batch sharded 8 ways into 4 × 16 splits `data` into
    a sub-axis on each part; the scan's slice of a micro-batch then all-gathers (raw JAX: XLA:CPU's
    all-gather f32[4,8,256] with the dynamic_slice's op name). Shardy records no origin past the
    reshape ("an origin Shardy did not name", before): the cause names the reshape's line and the spec
    line of the input whose sharding it split."""
    write(tmp_path, "mb.py", MICRO)
    write(tmp_path, "mb.stagetool.yaml", MICRO_SPEC)
    monkeypatch.chdir(tmp_path)
    line = MICRO.splitlines().index("    xs = x.reshape(4, x.shape[0] // 4, x.shape[1])") + 1
    args = ("--topology", topology_name) if topology_name else ()
    r = run_cli_shared("collectives", "mb.py:micro", *args, "--format", "json", check=0)
    items = r.json()["functions"][0]["collectives"]["items"]
    (gather,) = [i for i in items if i["collective"]["kind"] == "all-gather"]
    assert gather["collective"]["op_name"].endswith("dynamic_slice")
    origins = gather["cause"]["origins"]
    assert [(o["kind"], o["source"].rsplit("/", 1)[-1]) for o in origins] == [("reshape", f"mb.py:{line}")]
    assert origins[0]["leaf"].startswith("x (spec at mb.stagetool.yaml:")
    text = run_cli_shared("collectives", "mb.py:micro", *args, check=0).stdout
    assert f"from the reshape at mb.py:{line}, which splits a dimension sharded over `data` into two" in " ".join(
        text.split())
