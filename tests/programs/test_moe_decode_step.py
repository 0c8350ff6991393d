"""Findings of a new user's trial on an MoE decode step (jax-llm-examples' qwen3 `decode_step`, a
program with shard_map parts), each on a small hand-written program of the same shape."""

from __future__ import annotations

import pytest
from helpers import import_afresh, write

from stagetool.devices import tpu_topology as topology

needs_libtpu = pytest.mark.skipif(not topology.libtpu_available(),
                                  reason="libtpu not installed: pip install -e '.[tpu]'")

PARTLY_MANUAL = """\
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P

def f(x, w):
    def local(x, w):
        return jax.lax.psum(x @ w, "model")
    return jax.shard_map(local, in_specs=(P("data", "model"), P("model", None)), out_specs=P("data", None))(x, w)

def whole(x, w):
    return f(x, w)

def partly(x, w):
    return f(x, w) + jnp.tanh(x @ w)
"""

SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  whole:
    target: sm.py:whole
    args: ['f32[256,512] @ [data, model]', 'f32[512,128] @ [model, null]']
  partly:
    target: sm.py:partly
    args: ['f32[256,512] @ [data, model]', 'f32[512,128] @ [model, null]']
"""


@needs_libtpu
def test_no_scope_note_on_a_whole_program_figure_the_backend_did_not_report(run_cli, tmp_path):
    """XLA:TPU's Lowered.cost_analysis() is None: the cost view said 'whole program: not reported' and
    then that the (absent) whole-program figure 'mixes the two scopes' (or is multiplied by the shards)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from stagetool.plan.target import parse_target

    write(tmp_path, "sm.py", PARTLY_MANUAL)
    spec = write(tmp_path, "sm.stagetool.yaml", SPEC)
    topo = topology.tpu_topology(parse_target("v5e:2x4"))
    mesh = topology.topology_mesh(topo.devices, (2, 4), ("data", "model"))
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    w = jax.ShapeDtypeStruct((512, 128), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
    ns: dict = {}
    exec(PARTLY_MANUAL, ns)
    with jax.set_mesh(mesh):
        lowered = jax.jit(ns["partly"]).trace(x, w).lower()
    assert lowered.cost_analysis() is None  # raw JAX: no whole-program figure on XLA:TPU
    assert "sdy.manual_computation" in lowered.as_text()  # the program has a shard_map part

    r = run_cli("cost", "--spec", str(spec), "--topology", "v5e:2x4", "--format", "json", check=0)
    for fn in r.json()["functions"]:
        cost = fn["cost"]
        assert cost["whole_program"]["flops"] is None, fn["name"]
        assert cost["scope_notes"] == [], (fn["name"], cost["scope_notes"])
    text = " ".join(run_cli("cost", "--spec", str(spec), "--topology", "v5e:2x4", check=0).stdout.split())
    assert "whole program: not reported" in text
    assert "mixes the two scopes" not in text and "multiplied by the" not in text
    # on the simulated CPU mesh XLA:CPU reports the whole program, and the notes are there
    cpu = {f["name"]: f["cost"] for f in run_cli("cost", "--spec", str(spec), "--format", "json",
                                                   check=0).json()["functions"]}
    assert "multiplied by the 8 shards" in cpu["whole"]["scope_notes"][0]
    assert "mixes the two scopes" in cpu["partly"]["scope_notes"][0]


BF16_DOT = """\
def mm(a, b):
    return (a @ b).sum()
"""

BF16_SPEC = """\
version: 1
mesh: {axes: {d: 2, m: 4}}
functions:
  mm:
    target: m.py:mm
    args: ['bf16[256,512] @ [d, m]', 'bf16[512,256] @ [m, null]']
"""


def _answer(doc) -> str:
    (note,) = [n for n in doc["functions"][0]["notes"] if "XLA:CPU computes bf16 dot products in f32" in n]
    return note.rpartition("the accelerator's answer: ")[2]


def test_the_accelerators_answer_names_the_spec_and_mesh_it_was_run_with(run_cli, tmp_path, monkeypatch):
    """qwen3's spec was `qwen3.stagetool.yaml` (not found from the TARGET alone) and the run had
    `--mesh 1x4x2`: the note's command (`stagetool memory TARGET --topology v5e:2x4`) was exit 2 (no
    spec found) and, with the spec, would have staged the spec's mesh, not the one asked for."""
    write(tmp_path, "sub/m.py", BF16_DOT)
    write(tmp_path, "sub/mine.stagetool.yaml", BF16_SPEC)
    monkeypatch.chdir(tmp_path)
    doc = run_cli("memory", "--spec", "sub/mine.stagetool.yaml", "--mesh", "8x1", "--format", "json", check=0).json()
    # the report's paths are written from the spec's folder: so is the command
    assert _answer(doc) == "stagetool memory --spec mine.stagetool.yaml --function mm --topology v5e:2x4 --mesh d=8,m=1"
    doc = run_cli("memory", "--spec", "sub/mine.stagetool.yaml", "--format", "json", check=0).json()
    assert _answer(doc) == "stagetool memory --spec mine.stagetool.yaml --function mm --topology v5e:2x4"
    # a spec the TARGET finds (beside the module) keeps the short form
    write(tmp_path, "sub/m.stagetool.yaml", BF16_SPEC)
    doc = run_cli("memory", "sub/m.py:mm", "--format", "json", check=0).json()
    assert _answer(doc) == "stagetool memory m.py:mm --topology v5e:2x4"
    monkeypatch.chdir(tmp_path / "sub")
    args = "memory --spec mine.stagetool.yaml --function mm --mesh 8x1".split()
    if topology.libtpu_available():  # the command runs, on the mesh the CPU run had
        (fn,) = run_cli(*args, "--topology", "v5e:2x4", "--format", "json", check=0).json()["functions"]
        assert fn["mesh"]["axes"] == [["d", 8], ["m", 1]]
        assert fn["mesh"]["platform"] == "tpu"


def test_a_module_target_beside_the_spec_says_where_to_run_from(run_cli, tmp_path, monkeypatch):
    """qwen3's spec names `qwen3_jax.model:decode_step` (a package without __init__.py beside the
    spec); run from the folder above, the error was 'no module named' with the hint 'a file target
    needs its path and .py', though the module is there: a module target imports from the working
    directory, as `python -m` does."""
    write(tmp_path, "sub/qwen3like/mod.py", "def f(x):\n    return x * 2\n")
    write(tmp_path, "sub/s.stagetool.yaml", """\
version: 1
functions:
  f: {target: 'qwen3like.mod:f', args: ['f32[8]']}
""")
    monkeypatch.chdir(tmp_path)
    r = run_cli("shardings", "--spec", "sub/s.stagetool.yaml", check=2)
    err = " ".join(r.stderr.split())
    assert "no module named 'qwen3like'" in err
    assert f"qwen3like is in the spec's folder {(tmp_path / 'sub').resolve()}" in err and "run stagetool from" in err
    assert "a file target needs its path" not in err
    monkeypatch.chdir(tmp_path / "sub")  # where the hint says: it stages
    doc = run_cli("shardings", "--spec", "s.stagetool.yaml", "--format", "json", check=0).json()
    assert doc["functions"][0]["outputs"][0]["shape"] == [8]


def test_a_target_the_spec_lacks_lists_the_specs_targets_as_written_from_here(run_cli, tmp_path, monkeypatch):
    """`stagetool memory m.py:mm --spec sub/mine.stagetool.yaml` from the folder above said 'does not
    describe m.py:mm; it has: mm (m.py:mm)': the same text on both sides, since the TARGET's file is
    relative to the working directory and the spec's to its folder."""
    write(tmp_path, "sub/m.py", BF16_DOT)
    write(tmp_path, "sub/mine.stagetool.yaml", BF16_SPEC)
    monkeypatch.chdir(tmp_path)
    r = run_cli("memory", "m.py:mm", "--spec", "sub/mine.stagetool.yaml", check=2)
    err = " ".join(r.stderr.split())
    assert "does not describe m.py:mm; it has: mm (sub/m.py:mm)" in err
    assert "relative to the working directory" in err
    # the target as listed is the one that runs
    assert run_cli("memory", "sub/m.py:mm", "--spec", "sub/mine.stagetool.yaml", check=0).code == 0


TWO_EDITS = """\
import jax
from jax.sharding import PartitionSpec as P

def step(w, x):
    h = jax.lax.with_sharding_constraint(x @ w, P("d", CONSTRAINT))
    return (h * 2).sum()
"""

TWO_EDITS_SPEC = """\
version: 1
mesh: {axes: {d: 2, m: 4}}
functions:
  step:
    target: m.py:step
    args: ['f32[512,1024] @ [null, ${W}]', 'f32[256,512] @ [d, null]']
"""


def test_changes_made_by_two_edits_are_not_said_to_come_from_no_edit(run_cli, tmp_path, monkeypatch):
    """qwen3: one edit of ShardingRules (vocab_out) changed an init's sharding (cause 1) and a
    constraint (cause 2); argument bytes and FLOPs grew by the lm_head's share, yet were listed as
    'unexplained · decode_step: no recorded edit leads to these'. With two edits a whole-program
    figure is linked to neither; the heading says that, not that no edit leads to it."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "m.py", TWO_EDITS.replace("CONSTRAINT", '"m"'))
    write(tmp_path, "m.stagetool.yaml", TWO_EDITS_SPEC.replace("${W}", "m"))
    run_cli("snapshot", "--spec", "m.stagetool.yaml", "-o", "base.json", check=0)
    import_afresh("m", tmp_path)  # the CLI runs in this process: import the edited m.py afresh
    write(tmp_path, "m.py", TWO_EDITS.replace("CONSTRAINT", "None"))
    write(tmp_path, "m.stagetool.yaml", TWO_EDITS_SPEC.replace("${W}", "null"))
    r = run_cli("check", "--spec", "m.stagetool.yaml", "--baseline", "base.json", "--format", "json", check=1)
    (fn,) = r.json()["functions"]
    assert len(fn["causes"]) == 2
    assert any(c["subject"] == ["memory", "argument_bytes"] for c in fn["unexplained"]), fn["unexplained"]
    out = " ".join(run_cli("check", "--spec", "m.stagetool.yaml", "--baseline", "base.json", check=1).stdout.split())
    assert "unexplained · step: not linked to one of its 2 edits above" in out
    assert "no recorded edit leads to these" not in out
