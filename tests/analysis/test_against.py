"""Issue 48: ``--against TARGET`` stages the same program for a compile-only target too (one more
compile) and marks every difference, from that compile: each figure of the target's side equals a
raw ``jax.jit(...).lower().compile()`` for the target's compile-only devices, each of this run's
side a raw compile on the simulated CPU devices."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections import Counter
from pathlib import Path

import pytest
from helpers import raw_collective_kinds, target_devices, write

CODE = """\
import jax
import jax.numpy as jnp


def at_set(x, y):
    return x.at[0:3].set(y)


def paged_write(cache, new, pages):
    return cache.at[pages].set(new)


def accum(w, xs):
    def body(g, x):
        return g + jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w), None
    g, _ = jax.lax.scan(body, jnp.zeros_like(w), xs)
    return g
"""

SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  at_set:
    target: m.py:at_set
    args: ['f32[1024,2048] @ [data, model]', 'f32[3,2048]']
  paged_write:
    target: m.py:paged_write
    args: ['bf16[64,16,8,128] @ [null, null, model]', 'bf16[4,16,8,128] @ [null, null, model]', 'i32[4]']
    donate: [0]
  accum:
    target: m.py:accum
    args: ['f32[256,256]', 'f32[4,64,256] @ [null, data]']
"""

ARGS = {  # (shape, dtype, PartitionSpec) of each argument, as the spec writes them
    "at_set": ([((1024, 2048), "float32", ("data", "model")), ((3, 2048), "float32", ())], ()),
    "paged_write": ([((64, 16, 8, 128), "bfloat16", (None, None, "model")),
                     ((4, 16, 8, 128), "bfloat16", (None, None, "model")), ((4,), "int32", ())], (0,)),
    "accum": ([((256, 256), "float32", ()), ((4, 64, 256), "float32", (None, "data"))], ()),
}


@pytest.fixture
def cases(tmp_path, monkeypatch):
    write(tmp_path, "m.py", CODE)
    write(tmp_path, "m.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _raw(folder: Path, name: str, topology: str | None):
    """Raw JAX's compile of one case on a 2x4 (data, model) mesh of ``topology``'s devices (None: the CPU's)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from stagetool.devices.tpu_topology import topology_mesh

    spec = importlib.util.spec_from_file_location(f"raw_against_{name}", folder / "m.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    devices = target_devices(topology)
    mesh = topology_mesh(devices, (2, 4), ("data", "model")) if topology else \
        Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    args, donate = ARGS[name]
    shardings = [NamedSharding(mesh, P(*spec)) for _, _, spec in args]
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=s) for (shape, dtype, _), s in zip(args, shardings)]
    return jax.jit(getattr(module, name), in_shardings=shardings, donate_argnums=donate).lower(*structs).compile()


def _differences(fn: dict) -> dict[str, dict]:
    return {f"{d['what']}: {d['key']}": d for d in fn["against"]["differences"]}


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x4", "h100:8"])
def test_every_difference_is_marked_from_the_second_compile(run_cli, cases, topology):
    target_devices(topology)  # skips without libtpu / the CUDA plugin
    doc = run_cli("report", "--against", topology, "--no-cache", "--format", "json", check=0).json()
    assert doc["answer"]["devices"] == "simulated"
    fns = {f["name"]: f for f in doc["functions"]}
    for name in ("at_set", "paged_write", "accum"):
        fn, cpu, there = fns[name], _raw(cases, name, None), _raw(cases, name, topology)
        a = fn["against"]
        assert a["target"] == topology and a["here"] == "XLA:CPU" and a["error"] is None
        diffs = _differences(fn)
        # temporaries: each side's is its raw compile's, and the row is there exactly when they differ
        cpu_temp, there_temp = cpu.memory_analysis().temp_size_in_bytes, there.memory_analysis().temp_size_in_bytes
        row = diffs.get("temporaries: temporaries per device")
        assert (row is not None) == (cpu_temp != there_temp)
        if row:
            assert (row["here_value"], row["there_value"]) == (cpu_temp, there_temp)
        # FLOPs: XLA's on each side (XLA:GPU reports none without a GPU: then stagetool's derived count)
        there_cost = there.cost_analysis()
        row = diffs.get("FLOPs: FLOPs per device")
        if there_cost and "flops" in there_cost:
            assert (row is not None) == (cpu.cost_analysis()["flops"] != there_cost["flops"])
            if row:
                assert (row["here_value"], row["there_value"]) == (cpu.cost_analysis()["flops"], there_cost["flops"])
        # collectives: the kinds only one side has are marked on that side
        cpu_kinds, there_kinds = raw_collective_kinds(cpu), raw_collective_kinds(there)
        only_here = Counter(d["key"].split(" over ")[0] for d in a["differences"]
                            if d["what"] == "collective" and d["status"] == "only here")
        for kind in set(cpu_kinds) - set(there_kinds):
            assert only_here[kind] >= 1, (name, kind, a["differences"])
    # the case: x.at[0:3].set(...) on a sharded array: XLA:CPU's whole-row all-gather, which the
    # accelerator's compile does not make, is marked on its row and in the section
    at_set = fns["at_set"]
    assert raw_collective_kinds(_raw(cases, "at_set", None))["all-gather"] == 1
    assert raw_collective_kinds(_raw(cases, "at_set", topology))["all-gather"] == 0
    row = [i for i in at_set["collectives"]["items"] if i["collective"]["kind"] == "all-gather"]
    assert len(row) == 1 and row[0]["against"] == f"not on {topology}"
    # the donated paged-cache write: XLA:CPU's temporaries, the accelerator's 0 B
    assert _differences(fns["paged_write"])["temporaries: temporaries per device"]["there_value"] == \
        _raw(cases, "paged_write", topology).memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_a_rule_the_compile_confirms_keeps_its_mark_and_says_so(run_cli, cases):
    """The loop accumulator's all-reduce: the CPU rule says XLA:TPU hoists it (runs once); the v5e
    compile does (at the scan's line), so the rule agrees and the row keeps its mark."""
    target_devices("v5e:2x4")
    fn = run_cli("collectives", "-f", "accum", "--against", "v5e:2x4", "--no-cache", "--format", "json",
                 check=0).json()["functions"][0]
    (rule,) = fn["against"]["rules"]
    assert rule["agrees"] and rule["rule"].startswith("in the loop body on XLA:CPU")
    (item,) = fn["collectives"]["items"]
    assert item["cpu_only"] and item["against"].startswith("v5e:2x4: 1 × f32[256,256], runs 1")
    raw = _raw(cases, "accum", "v5e:2x4")
    assert raw_collective_kinds(raw) == Counter({"all-reduce": 1})
    assert fn["cost"] is None and fn["memory"] is None  # compared on both sides, shown only where asked


def test_a_rule_the_compile_contradicts_loses_its_mark(cases):
    """Where a CPU rule and the target's compile disagree, the compile wins: the row's rule mark is
    dropped and the section keeps what the rule said."""
    from stagetool.analysis.against import AgainstSection, RuleCheck, collective_key, marked_collectives
    from stagetool.pipeline import Options, Section, analyze

    fn = analyze(Options(target="m.py:accum", cache_dir=None), [Section.COLLECTIVES]).functions[0]
    (item,) = fn.collectives.items
    assert item.cpu_only is not None and item.accelerator_runs == 1
    key = collective_key(item)
    for agrees, kept in ((True, True), (False, False)):
        section = AgainstSection("v5e:2x4", "XLA:TPU", "XLA:CPU", rules=(RuleCheck(key, item.cpu_only, agrees, "x"),))
        (marked,) = marked_collectives(fn.collectives, section).items
        assert (marked.cpu_only is not None) == kept and (marked.accelerator_runs is not None) == kept
        assert marked.against is None  # no difference listed for it: nothing to mark


@pytest.mark.parametrize("argv, says", [
    (("collectives", "--against", "v5e:2x4", "--mesh", "2x2"), "--against v5e:2x4: v5e:2x4 has 8 devices, but the mesh"),
    (("collectives", "--against", "cpu"), "--against cpu: hardware 'cpu' is neither a TPU generation nor a GPU"),
    (("collectives", "--against", ""), "--against '': an empty target name"),
    (("collectives", "--against", "v5e", "--mesh", "3x1"), "no published v5e slice has 3 chips"),
    (("lower", "--against", "v5e:2x4"), "'lower' prints one module"),
    (("snapshot", "--against", "v5e:2x4", "-o", "s.json"), "a snapshot records one compile"),
])
def test_a_bad_against_is_exit_2_before_any_compile(run_cli, cases, argv, says):
    r = run_cli(*argv, "-f", "at_set", "--no-cache")
    assert r.code == 2 and says in " ".join(r.stderr.split()), r.stderr
    assert "compile" not in r.stderr.split("error")[0]


def test_two_byte_counts_that_round_alike_are_shown_exactly():
    """A temporaries row of 4,194,308 B against 4,194,564 B must not read '4.00 MiB | 4.00 MiB | differs'."""
    from stagetool.analysis.against import _bytes_pair

    assert _bytes_pair(4_194_308, 4_194_564) == ("4.00 MiB (4,194,308 B)", "4.00 MiB (4,194,564 B)")
    assert _bytes_pair(2 * 2**20, 158 * 2**10) == ("2.00 MiB", "158 KiB")


@pytest.mark.slow
def test_ragged_dots_rule_is_checked_per_collective_not_per_line(run_cli, tmp_path, monkeypatch):
    """ragged_dot on the CPU mesh all-gathers the s32 group sizes and all-reduces dense partial
    products (the rule's mark); v5e:2x4 all-gathers the bf16 expert weights at the same line instead.
    That gather is another collective: the rule agrees for both rows and their marks stay."""
    target_devices("v5e:2x4")
    write(tmp_path, "r.py", "import jax\n\n\ndef moe(x, w, sizes):\n    return jax.lax.ragged_dot(x, w, sizes)\n")
    write(tmp_path, "r.stagetool.yaml", "version: 1\nmesh: {axes: {data: 2, model: 4}}\nfunctions:\n  moe:\n"
          "    target: r.py:moe\n    args: ['bf16[1024,512] @ [data, null]', 'bf16[8,512,1024] @ [model, null, null]', "
          "'i32[8]']\n")
    monkeypatch.chdir(tmp_path)
    fn = run_cli("collectives", "--against", "v5e:2x4", "--no-cache", "--format", "json", check=0).json()["functions"][0]
    rules = fn["against"]["rules"]
    assert len(rules) == 2 and all(r["agrees"] for r in rules), rules
    marked = [i for i in fn["collectives"]["items"] if i["cpu_only"]]
    assert sorted(i["collective"]["result_types"][0] for i in marked) == ["f32[512,1024]", "s32[8]"]
