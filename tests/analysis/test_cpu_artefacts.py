"""XLA:CPU's artefacts named where they occur (issue 20 item 5, and item 3's CPU note): a collective
widened by the 16-bit dot upcast says so on its row, XLA:CPU's rolled threefry loops are kept out of
the loop-aware FLOPs, host offload ignored on CPU is said; each note ends with the command that gives
the accelerator's answer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import write

from stagetool.analysis import cpu_artefacts

MODEL = """\
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


def sgd_bf16(w, x):
    def loss(w):
        return jnp.mean((x @ w.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)
    return w - 0.1 * jax.grad(loss)(w)


def sgd_f32(w, x):
    def loss(w):
        return jnp.mean((x.astype(jnp.float32) @ w) ** 2)
    return w - 0.1 * jax.grad(loss)(w)


def dropout(w, x, key):
    def loss(w):
        h = jnp.tanh(x @ w)
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        return jnp.mean(jnp.where(keep, h / 0.9, 0) ** 2)
    return w - 0.1 * jax.grad(loss)(w)


def layer(w, x):
    h = checkpoint_name(jnp.tanh(x @ w), "h")
    return jnp.tanh(h @ w)


OFFLOAD = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_src="device",
    offload_dst="pinned_host")


def offloaded(w, x):
    def loss(w):
        return jnp.sum(jax.checkpoint(layer, policy=OFFLOAD)(w, x) ** 2)
    return w - 0.1 * jax.grad(loss)(w)


def kept(w, x):
    def loss(w):
        return jnp.sum(layer(w, x) ** 2)
    return w - 0.1 * jax.grad(loss)(w)
"""

SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  sgd_bf16:
    target: m.py:sgd_bf16
    args: ['f32[1024,1024]', 'bf16[256,1024] @ [data]']
  sgd_f32:
    target: m.py:sgd_f32
    args: ['f32[1024,1024]', 'bf16[256,1024] @ [data]']
  dropout:
    target: m.py:dropout
    args: ['f32[256,256]', 'f32[128,256] @ [data]', 'key<fry>[]']
  offloaded:
    target: m.py:offloaded
    args: ['f32[128,128]', 'f32[128,128]']
  kept:
    target: m.py:kept
    args: ['f32[128,128]', 'f32[128,128]']
"""


@pytest.fixture
def spec(tmp_path, monkeypatch):
    write(tmp_path, "m.py", MODEL)
    monkeypatch.chdir(tmp_path)
    return write(tmp_path, "m.stagetool.yaml", SPEC)


def _fn(doc, name):
    (fn,) = [f for f in doc["functions"] if f["name"] == name]
    return fn


def test_the_all_reduce_says_it_is_f32_only_because_of_the_cpu_upcast(run_cli, spec):
    """Weights f32[1024,1024] replicated, x bf16[256,1024] @ [data], w - 0.1*grad(mean((x @ w.astype(bf16))
    .astype(f32)**2))(w) on 2x4 CPU: the gradient's all-reduce is f32[1024,1024] (4 MiB) on CPU only
    because XLA:CPU computes the bf16 dots in f32; the row says so and names the program's bf16."""
    doc = run_cli("collectives", "--spec", str(spec), "-f", "sgd_bf16", "--format", "json", check=0).json()
    fn = _fn(doc, "sgd_bf16")
    (item,) = fn["collectives"]["items"]
    assert item["collective"]["kind"] == "all-reduce" and item["collective"]["result_types"] == ["f32[1024,1024]"]
    assert item["collective"]["bytes_per_device"] == 1024 * 1024 * 4 and item["widened_from"] == "bf16"
    (note,) = [n for n in fn["notes"] if "XLA:CPU computes bf16 dot products in f32" in n]
    assert note.endswith("the accelerator's answer: stagetool collectives m.py:sgd_bf16 --topology v5e:2x4")
    assert not any("up to 2x" in n for n in fn["notes"])
    text = run_cli("collectives", "--spec", str(spec), "-f", "sgd_bf16", check=0).stdout
    assert "f32[1024,1024] (f32 on CPU: bf16 in the program)" in text


def test_a_dot_the_program_writes_in_f32_is_not_marked(run_cli, spec):
    """x.astype(f32) @ w is the program's own f32 dot: its all-reduce is f32 on every backend."""
    fn = _fn(run_cli("collectives", "--spec", str(spec), "-f", "sgd_f32", "--format", "json", check=0).json(), "sgd_f32")
    assert [i["widened_from"] for i in fn["collectives"]["items"]] == [None]
    assert not any("XLA:CPU" in n for n in fn["notes"])


def _libtpu() -> bool:
    from stagetool.devices import tpu_topology as topology

    return topology.libtpu_available()


@pytest.mark.slow
@pytest.mark.skipif(not _libtpu(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_on_v5e_the_all_reduce_is_bf16(run_cli, spec):
    """The accelerator's answer the note points to: on v5e:2x4 the same all-reduce moves bf16, 2 MiB."""
    fn = _fn(run_cli("collectives", "--spec", str(spec), "-f", "sgd_bf16", "--topology", "v5e:2x4", "--format",
                     "json", check=0).json(), "sgd_bf16")
    reduces = [i for i in fn["collectives"]["items"] if i["collective"]["kind"] in ("all-reduce", "reduce-scatter")]
    assert reduces and all(i["widened_from"] is None for i in reduces)
    assert [i["collective"]["result_types"] for i in reduces] == [["bf16[1024,1024]"]]
    assert reduces[0]["collective"]["bytes_per_device"] == 1024 * 1024 * 2
    assert not any("XLA:CPU" in n for n in fn["notes"])


def test_threefry_loops_are_named_and_kept_out_of_the_loop_aware_flops(run_cli, spec):
    """jax.random.bernoulli on CPU is XLA:CPU's rolled threefry loop (5 iterations); the loop-aware
    FLOPs count it once, as XLA's own cost analysis does, and its further iterations are shown apart."""
    doc = run_cli("cost", "--spec", str(spec), "-f", "dropout", "--format", "json", check=0).json()
    fn = _fn(doc, "dropout")
    la = fn["cost"]["loop_aware"]
    (apart,) = la["apart"]
    name, trips, body = apart
    assert trips == 5 and body > 0
    assert la["loops"] == [] and la["flops"] == fn["cost"]["per_device"]["flops"]
    # each further iteration: the body's FLOPs and the condition's one compare
    assert la["apart_extra_flops"] == (trips - 1) * (body + 1)
    (note,) = [n for n in fn["notes"] if n.startswith("random numbers:")]
    assert name in note and note.endswith("stagetool cost m.py:dropout --topology v5e:2x4")
    text = run_cli("cost", "--spec", str(spec), "-f", "dropout", check=0).stdout
    assert "while loop (trip count" not in text  # the generic loop note is not about this loop


def test_host_offload_on_cpu_is_said_to_be_ignored(run_cli, spec):
    """jax.checkpoint offloading to pinned_host: XLA:CPU has one memory; the note says where the
    program asks for host memory and gives the TPU command (one device: a mesh for the topology)."""
    fn = _fn(run_cli("memory", "--spec", str(spec), "-f", "offloaded", "--no-peak", "--format", "json",
                     check=0).json(), "offloaded")
    (note,) = [n for n in fn["notes"] if n.startswith("host offload ignored")]
    assert "m.py:" in note and fn["memory"]["record"]["host_peak_bytes"] == 0
    assert note.endswith("stagetool memory m.py:offloaded --topology v5e:2x4")
    kept = _fn(run_cli("memory", "--spec", str(spec), "-f", "kept", "--no-peak", "--format", "json", check=0).json(),
               "kept")
    assert not any("host offload" in n for n in kept["notes"])


def test_host_transfers_are_read_from_the_traced_program():
    from stagetool.staging.gather import host_transfers

    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_src="device",
        offload_dst="pinned_host")

    def f(w):
        from jax.ad_checkpoint import checkpoint_name

        return jnp.sum(jax.checkpoint(lambda w: jnp.sin(checkpoint_name(jnp.cos(w), "h")), policy=policy)(w))

    assert host_transfers(jax.jit(jax.grad(f)).trace(x), [__file__])
    assert host_transfers(jax.jit(jax.grad(lambda w: jnp.sum(jnp.sin(jnp.cos(w))))).trace(x), [__file__]) == ()


@pytest.mark.parametrize("devices, axes, expected", [
    (8, 2, "stagetool memory m.py:f --topology v5e:2x4"),
    (1, 0, "stagetool memory m.py:f --topology v5e:1x1 --mesh data=1"),
    (4, 1, "stagetool memory m.py:f --topology v5e:2x2"),
    (6, 2, "stagetool memory m.py:f --topology v5e:AxB (A·B = 6)"),
])
def test_accelerator_command(devices, axes, expected):
    assert cpu_artefacts.accelerator_command("memory", "m.py:f", devices, mesh_axes=axes) == expected


def test_narrow_dot_types_read_the_lowered_program():
    x = jax.ShapeDtypeStruct((8, 8), jnp.bfloat16)
    assert cpu_artefacts.narrow_dot_types(jax.jit(lambda a: a @ a).trace(x).lower().as_text()) == {"bf16"}
    f = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    assert cpu_artefacts.narrow_dot_types(jax.jit(lambda a: a @ a).trace(f).lower().as_text()) == frozenset()


FSDP = """\
import jax
import jax.numpy as jnp

bf16 = jnp.bfloat16


def fsdp_bf16(w1, w2, x):
    def loss(ws):
        h = jnp.tanh(x @ ws[0])
        return jnp.mean((h @ ws[1]).astype(jnp.float32) ** 2)
    l, g = jax.value_and_grad(loss)((w1, w2))
    return l, w1 - (0.1 * g[0]).astype(bf16), w2 - (0.1 * g[1]).astype(bf16)


def embed_bf16(e, w, ids):
    def loss(e):
        return jnp.mean((e[ids] @ w).astype(jnp.float32) ** 2)
    l, g = jax.value_and_grad(loss)(e)
    return l, e - (0.1 * g).astype(bf16)


def fsdp_f32(w1, w2, x):
    def loss(ws):
        h = jnp.tanh(x.astype(jnp.float32) @ ws[0].astype(jnp.float32))
        return jnp.mean((h @ ws[1].astype(jnp.float32)) ** 2)
    l, g = jax.value_and_grad(loss)((w1, w2))
    return l, w1 - (0.1 * g[0]).astype(bf16), w2 - (0.1 * g[1]).astype(bf16)
"""

FSDP_ARGS = ["bf16[256,512] @ [fsdp]", "bf16[512,256] @ [fsdp]", "bf16[64,256] @ [fsdp]"]
FSDP_SPEC = "version: 1\nmesh: {axes: {fsdp: 8}}\nfunctions:\n" + "".join(
    f"  {name}:\n    target: f.py:{name}\n    args: {args!r}\n"
    for name, args in (("fsdp_bf16", FSDP_ARGS), ("fsdp_f32", FSDP_ARGS), ("embed_bf16", ["bf16[256,128]", "bf16[128,128]", "i32[64] @ [fsdp]"])))


@pytest.fixture
def fsdp_spec(tmp_path, monkeypatch):
    write(tmp_path, "f.py", FSDP)
    monkeypatch.chdir(tmp_path)
    return write(tmp_path, "f.stagetool.yaml", FSDP_SPEC)


def _raw_collectives(name: str) -> list[tuple[str, list[str]]]:
    """``(kind, result types)`` of each all-gather/all-reduce of the same function compiled by JAX
    itself on the same 8 CPU devices (the conftest's ``jax_num_cpu_devices``)."""
    import re

    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    ns: dict = {}
    exec(FSDP, ns)  # noqa: S102 - the test's own model text
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
            for s in ((256, 512), (512, 256), (64, 256))]
    text = jax.jit(ns[name]).lower(*args).compile().as_text()
    out = []
    for m in re.finditer(r"= (\([^)]*\)|\S+) (all-gather|all-reduce)\(", text):
        out.append((m.group(2), re.findall(r"(\w+\[[\d,]*\])", m.group(1))))
    return out


def test_fsdp_gathers_of_bf16_parameters_and_the_tuple_gradient_all_reduce_are_marked(run_cli, fsdp_spec):
    """The JAX training cookbook's shape (trial 2, finding 2): bf16 parameters sharded over fsdp are
    converted to f32 by XLA:CPU *before* their all-gather, and the gradient all-reduce is one tuple
    with the f32 loss. Every all-gather says f32 on CPU, bf16 in the program; the tuple all-reduce is
    marked by its gradient's bytes only (the loss is f32 in the program). Raw JAX's own compile on the
    same 8 CPU devices shows the same f32 collectives (XLA:CPU's figures, what the marks annotate)."""
    raw = _raw_collectives("fsdp_bf16")
    fn = _fn(run_cli("collectives", "--spec", str(fsdp_spec), "-f", "fsdp_bf16", "--format", "json", check=0).json(),
             "fsdp_bf16")
    items = fn["collectives"]["items"]
    assert sorted((i["collective"]["kind"], i["collective"]["result_types"]) for i in items
                  if i["collective"]["kind"] in ("all-gather", "all-reduce")) == sorted(raw)
    gathers = [i for i in items if i["collective"]["kind"] == "all-gather"]
    assert len(gathers) == 4 and all(t.startswith("f32[") for g in gathers for t in g["collective"]["result_types"])
    for g in gathers:
        assert g["widened_from"] == "bf16" and g["widened_bytes"] == g["collective"]["bytes_per_device"]
    (reduce,) = [i for i in items if i["collective"]["kind"] == "all-reduce"]
    assert reduce["collective"]["result_types"] == ["f32[]", "f32[256,512]"]
    assert reduce["widened_from"] == "bf16" and reduce["widened_bytes"] == 256 * 512 * 4  # the loss's 4 B left out
    moved = sum(i["widened_bytes"] for i in items)
    (note,) = [n for n in fn["notes"] if "XLA:CPU computes bf16 dot products in f32" in n]
    assert f"({moved:,} B here per device)" in note
    text = run_cli("collectives", "--spec", str(fsdp_spec), "-f", "fsdp_bf16", check=0).stdout
    assert "f32[256,512] (f32 on CPU: bf16 in the program)" in text
    assert "f32[], f32[256,512] (f32 on CPU: 512 KiB of it bf16 in the program)" in text


def test_a_program_that_converts_its_parameters_to_f32_itself_is_not_marked(run_cli, fsdp_spec):
    """``w.astype(f32)`` before an f32 dot is the program's own f32: nothing is marked (the same f32
    all-gathers as raw JAX's compile)."""
    raw = _raw_collectives("fsdp_f32")
    fn = _fn(run_cli("collectives", "--spec", str(fsdp_spec), "-f", "fsdp_f32", "--format", "json", check=0).json(),
             "fsdp_f32")
    items = fn["collectives"]["items"]
    assert sorted((i["collective"]["kind"], i["collective"]["result_types"]) for i in items
                  if i["collective"]["kind"] in ("all-gather", "all-reduce")) == sorted(raw)
    assert [i["widened_from"] for i in items] == [None] * len(items) and items
    assert not any("XLA:CPU" in n for n in fn["notes"])


@pytest.mark.slow
@pytest.mark.skipif(not _libtpu(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_on_v5e_the_fsdp_gathers_are_bf16(run_cli, fsdp_spec):
    """The accelerator's answer the marks point to: on v5e:2x4 every all-gather of the bf16 program is bf16."""
    fn = _fn(run_cli("collectives", "--spec", str(fsdp_spec), "-f", "fsdp_bf16", "--topology", "v5e:2x4",
                     "--format", "json", check=0).json(), "fsdp_bf16")
    gathers = [i for i in fn["collectives"]["items"] if i["collective"]["kind"] == "all-gather"]
    assert gathers and all(t.startswith("bf16[") for g in gathers for t in g["collective"]["result_types"])
    assert all(i["widened_from"] is None for i in fn["collectives"]["items"])


def test_a_bf16_embeddings_scatter_add_gradient_in_the_tuple_all_reduce_is_marked(run_cli, fsdp_spec):
    """The cookbook's embedding gradient (trial 2): ``e[ids] @ w`` of a bf16 table gives a scatter-add
    gradient that XLA:CPU computes in f32 (into an f32 buffer converted from bf16) and all-reduces with
    the f32 loss in one tuple; the gradient's bytes are marked, the loss's 4 B not. (Marks need the
    program's own 16-bit dots, hence ``@ w``.)"""
    fn = _fn(run_cli("collectives", "--spec", str(fsdp_spec), "-f", "embed_bf16", "--format", "json", check=0).json(),
             "embed_bf16")
    (item,) = [i for i in fn["collectives"]["items"] if i["collective"]["kind"] == "all-reduce"]
    assert item["collective"]["result_types"] == ["f32[]", "f32[256,128]"]
    assert item["widened_from"] == "bf16" and item["widened_bytes"] == 256 * 128 * 4


GATHER = """\
import jax.numpy as jnp


def lookup(table, idx):
    return jnp.take(table, idx, axis=0)
"""
GATHER_SPEC = """\
version: 1
mesh: {axes: {model: 8}}
functions:
  lookup:
    target: g.py:lookup
    args: ['bf16[8192,64] @ [model, null]', 'i32[8192]']
"""


def test_a_bf16_gathers_all_reduce_widened_on_cpu_is_named(run_cli, tmp_path):
    """Issue 33, item 4: a program with no 16-bit dot, whose bf16 gather over a vocabulary-sharded table
    is all-reduced: f32 on CPU (2,097,152 B = 8192 × 64 × 4, XLA:CPU's promoted reducer), marked with
    its bf16 type and the accelerator's bytes; on v5e:2x4 the same all-reduce is bf16, half of it."""
    from helpers import write

    from stagetool.devices import tpu_topology

    write(tmp_path, "g.py", GATHER)
    spec = write(tmp_path, "g.stagetool.yaml", GATHER_SPEC)
    fn = run_cli("collectives", "--spec", str(spec), "--format", "json", check=0).json()["functions"][0]
    [item] = fn["collectives"]["items"]
    assert item["collective"]["kind"] == "all-reduce" and item["collective"]["bytes_per_device"] == 8192 * 64 * 4
    assert (item["widened_from"], item["widened_bytes"]) == ("bf16", 8192 * 64 * 4)
    (note,) = [n for n in fn["notes"] if "marked 'f32 on CPU'" in n]
    assert "widens the program's bf16 values to f32" in note and "--topology v5e:2x4" in note
    if tpu_topology.libtpu_available():
        tpu = run_cli("collectives", "--spec", str(spec), "--topology", "v5e:2x4", "--format", "json",
                      check=0).json()["functions"][0]
        reduces = [i["collective"] for i in tpu["collectives"]["items"] if i["collective"]["kind"] == "all-reduce"]
        assert reduces and all(c["bytes_per_device"] == 8192 * 64 * 2 for c in reduces)
        assert all(i["widened_from"] is None for i in tpu["collectives"]["items"])


RAGGED = """\
import jax


def moe(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes)  # RAGGED
"""
RAGGED_SPEC = """\
version: 1
mesh: {axes: {data: 8}}
functions:
  moe:
    target: r.py:moe
    args: ['f32[1024,512] @ [data]', 'f32[8,512,1024] @ [data]', 'i32[8]']
"""


def _raw_ragged(topology: str | None) -> str:
    import re

    import numpy as np
    from helpers import target_devices
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(target_devices(topology)[:8]), ("data",))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p)) for s, d, p in
            (((1024, 512), jnp.float32, P("data")), ((8, 512, 1024), jnp.float32, P("data")),
             ((8,), jnp.int32, P()))]
    text = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s)).lower(*args).compile().as_text()
    found = set()
    for m in re.finditer(r"= ([^=\n]*?) (all-reduce|all-gather)(?:-start)?\(", text):
        found |= {f"{m.group(2)}:{shape}" for shape in re.findall(r"\w+\[[\d,]*\]", m.group(1))}
    return " ".join(sorted(found))


def test_the_collectives_only_xla_cpus_dense_ragged_dot_makes_are_marked(run_cli, tmp_path, monkeypatch):
    """Issue 41, item 2: raw JAX's compile of a ragged_dot (tokens and expert weights over `data`): on
    the CPU mesh an all-gather of the tokens, one of the s32[8] group sizes and an all-reduce of the
    f32[1024,1024] partial products; on v5e:2x4 and h100:8 all-gathers of the tokens and of the
    weights, no all-reduce, no group-size gather. The CPU rows of the two made only by the dense
    expansion are marked, the tokens' gather (made on every backend) is not; diff against v5e:2x4
    files the CPU-only all-reduce row under the backend, not as an improvement."""
    cpu = _raw_ragged(None)
    assert "all-reduce:f32[1024,1024]" in cpu and "all-gather:s32[8]" in cpu and "f32[8,512,1024]" not in cpu
    for topo in ("v5e:2x4", "h100:8"):
        try:
            acc = _raw_ragged(topo)
        except pytest.skip.Exception:
            continue
        assert "all-reduce" not in acc and "s32[8]" not in acc and "f32[8,512,1024]" in acc, (topo, acc)
    write(tmp_path, "r.py", RAGGED)
    spec = write(tmp_path, "r.stagetool.yaml", RAGGED_SPEC)
    monkeypatch.chdir(tmp_path)
    fn = _fn(run_cli("collectives", "--spec", str(spec), "--format", "json", check=0).json(), "moe")
    marks = {(i["collective"]["kind"], i["collective"]["result_types"][0]): i["cpu_only"]
             for i in fn["collectives"]["items"]}
    assert marks == {("all-gather", "f32[1024,512]"): None, ("all-gather", "s32[8]"): cpu_artefacts.EXPANDED,
                     ("all-reduce", "f32[1024,1024]"): cpu_artefacts.EXPANDED}
    (note,) = [n for n in fn["notes"] if "at ragged_dot (r.py:5)" in n]
    assert f"({1024 * 1024 * 4 + 32:,} B per device per step here)" in note and "not known from this compile" in note
    from stagetool.devices import tpu_topology

    if not tpu_topology.libtpu_available():
        return
    assert run_cli("snapshot", "--spec", str(spec), "-o", "cpu.json", check=0).code == 0
    assert run_cli("snapshot", "--spec", str(spec), "--topology", "v5e:2x4", "-o", "tpu.json", check=0).code == 0
    doc = run_cli("diff", "cpu.json", "tpu.json", "--format", "json", check=0).json()
    f = _fn(doc, "moe")
    (gone,) = [c for c in f["changes"] if c["what"] == "collective all-reduce over data"]
    assert gone["status"] == "backend" and "the accelerator makes none" in gone["note"]
    assert doc["regressions"] == 0
