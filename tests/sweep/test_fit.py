"""Issue 32, what fits: a refused compile explained, the largest batch per knob setting (``fit``),
and what-if changes on an out-of-memory, each compiled."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from helpers import REPO, write

from stagetool.devices import tpu_topology as topology
from stagetool.plan.options import Options

DATA = REPO / "tests" / "data"
needs_libtpu = pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")

ATTENTION_SPEC = """
version: 1
mesh:
  axes: {data: 8}
functions:
  attention:
    target: attention_scores.py:attention
    args:
      - 'f32[${batch},16,1024,128] @ [data, null, null, null]'
      - 'f32[${batch},16,1024,128] @ [data, null, null, null]'
      - 'f32[${batch},16,1024,128] @ [data, null, null, null]'
    static: {remat: '${remat}'}
"""


def _scores_line() -> int:
    lines = (DATA / "attention_scores.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith("# scores"))


@pytest.fixture
def attention_dir(tmp_path, monkeypatch, isolated_imports):
    monkeypatch.chdir(tmp_path)
    shutil.copy(DATA / "attention_scores.py", tmp_path / "attention_scores.py")
    return tmp_path


@needs_libtpu
def test_a_refused_compile_names_its_largest_buffer_and_line(run_cli, attention_dir):
    """Batch 2048 on data=8 (256 per device): the scores are f32[256,16,1024,1024] = 16 GiB per device,
    q, k, v and the output 2 GiB each: 24 GiB, over a v5e's 15.75 GiB. XLA refuses the compile; the
    buffers come from the dump it wrote before refusing, and the largest is the scores, made on the
    ``# scores`` line."""
    write(attention_dir, "a.stagetool.yaml", ATTENTION_SPEC.replace("${batch}", "2048").replace("${remat}", "none"))
    r = run_cli("memory", "--spec", "a.stagetool.yaml", "--topology", "v5e:2x4", "--no-cache", "--format", "json",
                check=0)
    m = r.json()["functions"][0]["memory"]
    assert m["verdict"]["fits"] is False and m["out_of_memory"]["needed_bytes"] == 24 * 2**30
    peak = m["peak"]
    assert peak["reason"] is None and "refused" in peak["note"]
    top = peak["buffers"][0]
    per_device_batch = 2048 // 8
    assert top["shape"] == f"f32[{per_device_batch},16,1024,1024]"
    assert top["size_bytes"] == per_device_batch * 16 * 1024 * 1024 * 4
    assert top["file"].endswith("attention_scores.py") and top["line"] == _scores_line()
    assert peak["peak_bytes"] == top["size_bytes"] + 4 * per_device_batch * 16 * 1024 * 128 * 4
    # the inputs are named by their leaf paths (q, k, v)
    assert {b["op_name"] for b in peak["buffers"]} >= {"q", "k", "v"}
    text = run_cli("memory", "--spec", "a.stagetool.yaml", "--topology", "v5e:2x4", "--no-cache", check=0).stdout
    assert "over by 8.25 GiB" in text and f"attention_scores.py:{_scores_line()}" in text
    assert "buffers of the program XLA refused" in text


# -- the search, against a brute-force sweep of the same grid ------------------------------------

CPU_SPEC = """
version: 1
mesh:
  axes: {data: 8}
functions:
  attention:
    target: attention_scores.py:attention
    args:
      - 'f32[${batch},4,256,64] @ [data, null, null, null]'
      - 'f32[${batch},4,256,64] @ [data, null, null, null]'
      - 'f32[${batch},4,256,64] @ [data, null, null, null]'
    static: {remat: '${remat}'}
"""


def _in_process(payload: dict, timeout_s: float | None) -> dict:
    """The sweep worker's row, staged in this process (the test's 8 CPU devices): the search's
    compiles without a process each."""
    from stagetool.sweep.run import run_config

    return run_config(payload)


def test_search_order_and_edges_on_a_known_threshold():
    """A probe that fits up to 100: galloping 8, 16, 32, 64, 128, then bisecting in steps of 8."""
    from stagetool.analysis.fit import (
        DOES_NOT_FIT,
        FITS,
        CompileCap,
        Probe,
        search_largest,
    )

    asked = []

    def probe(b):
        asked.append(b)
        return Probe(b, FITS if b <= 100 else DOES_NOT_FIT)

    s = search_largest(probe, start=8, multiple=8, max_batch=4096)
    assert (s.largest, s.smallest_refused, s.status) == (96, 104, "found")
    assert asked == [8, 16, 32, 64, 128, 96, 112, 104]
    # brute force on the grid 8..4096 is 512 compiles; the search made 8
    assert max(b for b in range(8, 4097, 8) if b <= 100) == s.largest
    assert search_largest(probe, start=512, multiple=8, max_batch=4096).largest == 96  # the first does not fit
    assert search_largest(lambda b: Probe(b, DOES_NOT_FIT), start=64, multiple=8, max_batch=4096).status == "none fits"
    top = search_largest(lambda b: Probe(b, FITS), start=8, multiple=8, max_batch=60)
    assert (top.largest, top.status) == (56, "at the maximum")

    def capped(b):
        raise CompileCap("cap")

    assert search_largest(capped, start=8, multiple=8, max_batch=64).status == "undecided"


def test_fit_equals_a_brute_force_sweep_with_fewer_compiles(attention_dir):
    """CPU mesh of 8, --device-memory 10MiB, remat none/chunked, batch multiples of 8 up to 128: the
    largest batch per setting equals the largest that fits among every grid point compiled (the
    brute force), with fewer compiles."""
    from stagetool.sweep.driver import payload
    from stagetool.sweep.fit import FitOptions, plan_fit, run_fit

    write(attention_dir, "cpu.stagetool.yaml", CPU_SPEC)
    options = FitOptions(Options(spec=Path("cpu.stagetool.yaml"), platform="cpu", device_memory="10MiB"),
                         set=("remat=none,chunked",), multiple=8, max_batch=128)
    doc = run_fit(options, runner=_in_process)
    assert doc["decided"] and doc["problems"] == []
    grid = list(range(8, 129, 8))
    plan = plan_fit(options, tuple(grid))
    brute: dict[str, int | None] = {}
    for config in plan.configs:  # every (remat, batch) of the grid, compiled
        row = _in_process(payload(plan, config), None)
        remat = config.values()["remat"]
        if row["fits"]:
            brute[remat] = max(brute.get(remat) or 0, config.values()["batch"])
    by_remat = {st["values"]["remat"]: st for st in doc["settings"]}
    assert {k: v["largest_batch"] for k, v in by_remat.items()} == brute
    assert brute["chunked"] != brute["none"]  # the knob changes the program (on XLA:CPU chunking costs more)
    winner = max(brute, key=lambda k: brute[k])
    assert doc["compiles"] == sum(st["compiles"] for st in doc["settings"]) < len(plan.configs) == 2 * len(grid)
    # the peak at the largest batch is that compile's, under the capacity, and the next batch is over
    for st in doc["settings"]:
        assert st["peak_bytes_per_device"] <= st["capacity_bytes_per_device"] == 10 * 2**20
        assert st["smallest_refused_batch"] == st["largest_batch"] + 8
    line = f"--set batch={brute[winner]} --set remat={winner}"
    assert doc["best"]["values"]["remat"] == winner and doc["best"]["set_line"] == line
    from stagetool.sweep.fit_render import FitFormat, render

    text = render(doc, FitFormat.text)
    assert f"★ best by largest batch: {line}" in text  # no step-time estimate on the CPU mesh without --chip
    md = render(doc, FitFormat.markdown)
    assert md.count("\n| ") == 3 and "| ★ |" in md  # the header and one row per setting
    html = render(doc, FitFormat.html)
    assert html.startswith("<!DOCTYPE html>") and 'class="best"' in html


def test_fit_fails_closed(attention_dir):
    """Undecided, said so: a knob whose values compile one program (attention_scores.py reads any
    remat but 'chunked' as 'none'), every batch refused (512 KiB per device; batch 8 peaks at 1 MiB), and the compile cap."""
    from stagetool.sweep.fit import FitOptions, run_fit

    write(attention_dir, "cpu.stagetool.yaml", CPU_SPEC)
    base = FitOptions(Options(spec=Path("cpu.stagetool.yaml"), platform="cpu", device_memory="20MiB"), multiple=8,
                      max_batch=64)
    same = run_fit(dataclasses.replace(base, set=("remat=none,plain",)), runner=_in_process)
    assert not same["decided"] and any("remat=none and remat=plain compile the same program" in p
                                       for p in same["problems"])
    refused = run_fit(dataclasses.replace(base, set=("remat=none",),
                                                options=dataclasses.replace(base.options, device_memory="512KiB")),
                      runner=_in_process)
    assert not refused["decided"] and refused["settings"][0]["status"] == "none fits", refused["settings"][0]["probes"]
    assert refused["best"] is None and refused["compiles"] == 1  # the smallest batch, 8, does not fit: no other
    capped = run_fit(dataclasses.replace(base, set=("remat=none,chunked",), max_compiles=3), runner=_in_process)
    assert not capped["decided"] and capped["compiles"] == 3
    assert any("--max-compiles" in p for p in capped["problems"])


def test_what_if_lists_only_compiled_changes_that_fit(attention_dir):
    """Batch 128 with remat none does not fit 10 MiB; half the batch and remat=chunked are each
    compiled, and the list of those that fit is exactly the ones whose compile fitted (half the
    batch fits; chunking, on XLA:CPU, does not)."""
    from stagetool.sweep.fit import FitOptions, what_if

    write(attention_dir, "cpu.stagetool.yaml", CPU_SPEC)
    options = FitOptions(Options(spec=Path("cpu.stagetool.yaml"), platform="cpu", device_memory="10MiB"),
                         set=("remat=none,chunked",), multiple=8, max_batch=256)
    compiled = []
    doc = what_if(options, 128, runner=_in_process, on_probe=lambda values, p: compiled.append((values["remat"], p.batch)))
    assert doc["from"]["outcome"] == "does not fit" and doc["decided"]
    assert sorted(compiled) == sorted([("none", 128), ("none", 64), ("chunked", 128)])
    assert doc["compiles"] == 3
    tried = {t["change"]: t for t in doc["tried"]}
    assert set(tried) == {"half the batch: batch 128 → 64", "remat: none → chunked"}
    assert doc["fits"] == [c for c, t in tried.items() if t["outcome"] == "fits"] == ["half the batch: batch 128 → 64"]
    for t in tried.values():
        if t["outcome"] == "fits":
            assert t["peak_bytes_per_device"] <= 10 * 2**20 and t["headroom_bytes"] >= 0


@pytest.mark.slow
def test_fit_command_frontier_and_exit_codes(run_cli, attention_dir):
    """``stagetool fit`` through its entry point (a process per compile, three at a time): the
    frontier as JSON; nothing fits → exit 1 saying why; a bad option → exit 2 before any compile."""
    write(attention_dir, "cpu.stagetool.yaml", CPU_SPEC)
    common = ("fit", "--spec", "cpu.stagetool.yaml", "--platform", "cpu", "--set", "remat=none", "--multiple", "8",
              "--no-cache")
    # -j 3 on one setting: rounds of three batches (8 16 32 / 64 128 / 80 96 112 / 88); 80 is what
    # test_fit_equals_a_brute_force_sweep_with_fewer_compiles's brute force finds at 10 MiB
    doc = run_cli(*common, "--device-memory", "10MiB", "--max-batch", "128", "-j", "3", "--format", "json",
                  check=0).json()
    (st,) = doc["settings"]
    assert (st["largest_batch"], st["smallest_refused_batch"], st["status"]) == (80, 88, "found")
    assert [p["batch"] for p in st["probes"]] == [8, 16, 32, 64, 128, 80, 96, 112, 88]
    assert st["peak_bytes_per_device"] <= 10 * 2**20 and doc["best"]["set_line"] == "--set batch=80 --set remat=none"
    r = run_cli(*common, "--device-memory", "512KiB", check=1)
    assert "every batch compiled was refused" in r.stdout and "none fits" in r.stdout
    r = run_cli(*common, "--set", "batch=8,16", check=2)
    assert "--set batch=...: batch is the batch the search finds" in r.stderr and "Traceback" not in r.stderr
    r = run_cli(*common, "--what-if", check=2)
    assert "--what-if needs the batch as given: --set batch=N" in r.stderr


@needs_libtpu
@pytest.mark.slow
def test_fit_on_a_tpu_topology_finds_the_analytic_batch(attention_dir):
    """On v5e:2x4 (XLA refuses above 15.75 GiB per device) without remat, a batch of b needs
    b × 12 MiB per device (scores b/8 × 16 × 1024² × 4 B, q, k, v and the output b/8 × 16 × 1024 ×
    128 × 4 B each): the largest multiple of 64 under 15.75 GiB is 1280 (1344 × 12 MiB is 15.75 GiB,
    which XLA refuses with the few other bytes). Chunking the scores fits more. The step-time
    estimate and tokens per second come with the frontier."""
    from stagetool.sweep.fit import FitOptions, run_fit
    from stagetool.sweep.fit_render import FitFormat, render

    write(attention_dir, "a.stagetool.yaml", ATTENTION_SPEC)
    doc = run_fit(FitOptions(Options(spec=Path("a.stagetool.yaml")), topology="v5e:2x4", set=("remat=none,chunked",),
                             multiple=64, start=1024, max_batch=2048, tokens_per_example=1024), runner=_in_process)
    by = {st["values"]["remat"]: st for st in doc["settings"]}
    assert by["none"]["largest_batch"] == 1280 and by["none"]["smallest_refused_batch"] == 1344
    assert by["none"]["peak_bytes_per_device"] == 1280 * 12 * 2**20
    assert by["chunked"]["largest_batch"] > 1280
    per_second = {k: st["largest_batch"] / st["step_time"]["schedule_seconds"] for k, st in by.items()}
    assert doc["best"]["values"]["remat"] == max(per_second, key=per_second.get)
    assert doc["best"]["by"] == "examples per second (estimate)"
    assert doc["compiles"] == by["none"]["compiles"] + by["chunked"]["compiles"] < 2 * (2048 // 64)
    step = by["none"]["step_time"]
    assert step["chip"] == "tpu-v5e" and step["overlapped_seconds"] <= step["schedule_seconds"] <= step["serial_seconds"]
    assert by["none"]["tokens_per_second"]["schedule"] == pytest.approx(1280 * 1024 / step["schedule_seconds"])
    text = render(doc, FitFormat.text)
    assert "step (est.)" in text and "tokens/s (est.)" in text


def test_a_timed_out_compile_leaves_the_setting_undecided(attention_dir):
    """A compile's process killed at --timeout (the sweep worker's timeout row) is neither a fit nor
    an out-of-memory: the setting is undecided, the document says so, and no best is made up."""
    from stagetool.sweep.fit import FitOptions, run_fit
    from stagetool.sweep.run import _error_row

    write(attention_dir, "cpu.stagetool.yaml", CPU_SPEC)
    seen = []

    def slow(payload: dict, timeout_s: float | None) -> dict:
        seen.append(timeout_s)
        return _error_row(payload, "timeout", f"timed out after {timeout_s:g} s; the process was killed")

    doc = run_fit(FitOptions(Options(spec=Path("cpu.stagetool.yaml"), platform="cpu", device_memory="10MiB"),
                             set=("remat=none",), multiple=8, max_batch=64, timeout=5), runner=slow)
    assert seen == [5.0] and not doc["decided"] and doc["best"] is None
    assert doc["settings"][0]["status"] == "undecided"
    assert doc["problems"] == ["remat=none: batch 8: timeout: timed out after 5 s; the process was killed"]


def test_what_if_with_no_change_that_fits_is_undecided(attention_dir):
    """At 2 MiB per device neither half the batch (8 MiB at 64) nor chunking fits batch 128: the
    list of what fits is empty and the document says so (exit 1 from the CLI)."""
    from stagetool.sweep.fit import FitOptions, what_if

    write(attention_dir, "cpu.stagetool.yaml", CPU_SPEC)
    doc = what_if(FitOptions(Options(spec=Path("cpu.stagetool.yaml"), platform="cpu", device_memory="2MiB"),
                             set=("remat=none,chunked",), multiple=8), 128, runner=_in_process)
    assert doc["fits"] == [] and doc["compiles"] == 3 and not doc["decided"]
    assert any("none of the single changes tried fits" in p for p in doc["problems"])


def test_rounds_of_several_batches_find_the_same_batch():
    """width 3: the rounds compile 8, 16, 32 / 64, 128, 256 / 80, 96, 112 / 104 — four rounds instead
    of eight, the same 96."""
    from stagetool.analysis.fit import DOES_NOT_FIT, FITS, Probe, search_largest

    rounds = []

    def many(batches):
        rounds.append(list(batches))
        return [Probe(b, FITS if b <= 100 else DOES_NOT_FIT) for b in batches]

    s = search_largest(lambda b: many([b])[0], start=8, multiple=8, max_batch=4096, width=3, probe_many=many)
    assert (s.largest, s.smallest_refused, s.status) == (96, 104, "found")
    assert rounds == [[8, 16, 32], [64, 128, 256], [80, 96, 112], [104]]
    for threshold in (7, 8, 50, 4095, 4096):  # against the brute force of the grid, widths 1..4
        brute = max((b for b in range(8, 4097, 8) if b <= threshold), default=None)
        for width in (1, 2, 3, 4):
            got = search_largest(lambda b, t=threshold: Probe(b, FITS if b <= t else DOES_NOT_FIT), start=8,
                                 multiple=8, max_batch=4096, width=width)
            assert got.largest == brute, (threshold, width)


# -- what-if: the largest replicated leaf sharded over a free mesh axis --------------------------

REPLICATED_SPEC = """
version: 1
mesh:
  axes: {data: 8}
functions:
  step:
    target: replicated_step.py:step
    args:
      - 'f32[8192,8192]'
      - 'f32[${batch},128] @ [data, null]'
"""

REPLICATED_STEP = '''
import jax.numpy as jnp


def step(w, x):
    return x + jnp.sum(w)
'''


def test_what_if_shards_the_largest_replicated_leaf(attention_dir):
    """A replicated f32[8192,8192] (256 MiB on every device) against 128 MiB per device on data=8:
    half the batch does not fit, the leaf sharded over the free axis data on its dimension 0 does,
    its peak 7/8 of the leaf's bytes (224 MiB, less a 4 B partial sum) below the first compile's, and equal to XLA's
    memory analysis of the same program compiled here with that sharding."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from stagetool.sweep.fit import FitOptions, what_if

    write(attention_dir, "rep.stagetool.yaml", REPLICATED_SPEC)
    write(attention_dir, "replicated_step.py", REPLICATED_STEP)
    options = FitOptions(Options(spec=Path("rep.stagetool.yaml"), platform="cpu", device_memory="128MiB"), multiple=8)
    doc = what_if(options, 64, runner=_in_process)
    leaf_bytes = 8192 * 8192 * 4
    assert doc["from"]["outcome"] == "does not fit" and doc["decided"], doc["problems"]
    tried = {t["change"]: t for t in doc["tried"]}
    change = ("shard w over mesh axis data (8 devices) on dimension 0: f32[8192,8192] replicated, 256 MiB per "
              "device → P('data', None), 32.0 MiB")
    assert set(tried) == {"half the batch: batch 64 → 32", change} and doc["not_tried"] == []
    assert doc["fits"] == [change] and tried["half the batch: batch 64 → 32"]["outcome"] == "does not fit"
    t = tried[change]
    assert t["spec_line"].startswith("'f32[8192,8192] @ [data, null]' (") and "rep.stagetool.yaml:" in t["spec_line"]
    x_bytes = 64 // 8 * 128 * 4  # x's shard, and the output's
    assert doc["from"]["peak_bytes_per_device"] == leaf_bytes + 2 * x_bytes
    # every device stops holding 7/8 of the leaf; the sharded program keeps one more buffer, its
    # partial sum (f32[], 4 B) before the all-reduce
    assert doc["from"]["peak_bytes_per_device"] - t["peak_bytes_per_device"] == leaf_bytes * 7 // 8 - 4
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
    compiled = jax.jit(lambda w, x: x + jax.numpy.sum(w)).lower(
        jax.ShapeDtypeStruct((8192, 8192), jax.numpy.float32, sharding=NamedSharding(mesh, P("data", None))),
        jax.ShapeDtypeStruct((64, 128), jax.numpy.float32, sharding=NamedSharding(mesh, P("data", None)))).compile()
    m = compiled.memory_analysis()
    raw = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    assert t["peak_bytes_per_device"] == max(raw, m.peak_memory_in_bytes)


def test_the_leaf_to_shard_and_why_none(attention_dir):
    """The choice (largest leaf first, the largest axis, the largest dimension it divides; a scalar
    passed over), the reasons for none, and the attention spec (every leaf sharded) saying so."""
    from stagetool.analysis.fit import ReplicatedInput, shard_largest_replicated
    from stagetool.sweep.fit import FitOptions, what_if

    big = ReplicatedInput("s/w", (6, 1024), "float32", 6 * 1024 * 4)
    odd = ReplicatedInput("s/odd", (3, 5, 7, 9, 11), "float32", 10395 * 4 * 10)
    mesh = (("data", 2), ("model", 4), ("one", 1))
    change, why = shard_largest_replicated((big, odd), mesh)
    assert why is None and (change.leaf.path, change.axis, change.dimension, change.dims) == ("s/w", "model", 1,
                                                                                             (None, "model"))
    assert change.saved_bytes == big.bytes_per_device * 3 // 4
    from stagetool.sweep.fit import leaf_change_text

    ruled = dataclasses.replace(change, leaf=dataclasses.replace(big, source="s.yaml:9:11", sharding_source="rule"))
    assert leaf_change_text(ruled)[1] == "rules: ['^s/w$', [null, model]] ahead of the others (s.yaml:9:11)"
    assert shard_largest_replicated((), mesh)[1].startswith("no input leaf is replicated")
    assert shard_largest_replicated((big,), (("one", 1),))[1].startswith("no mesh axis is free")
    assert shard_largest_replicated((odd,), mesh)[1].startswith("no replicated input leaf has a dimension")
    write(attention_dir, "cpu.stagetool.yaml", CPU_SPEC)
    doc = what_if(FitOptions(Options(spec=Path("cpu.stagetool.yaml"), platform="cpu", device_memory="10MiB"),
                             set=("remat=none",), multiple=8), 128, runner=_in_process)
    assert doc["not_tried"] == [("sharding the largest replicated leaf over a free mesh axis: no input leaf is "
                                 "replicated: every one is sharded over some mesh axis already")]


def test_a_leaf_sharding_for_a_leaf_the_function_lacks_is_exit_2(attention_dir):
    """Options.leaf_shardings naming no input leaf: a spec problem before any compile."""
    from stagetool.core.errors import SpecError
    from stagetool.core.sharding import Sharding
    from stagetool.pipeline import analyze
    from stagetool.plan.options import Options, Section
    from stagetool.spec.model import LeafSharding

    write(attention_dir, "rep.stagetool.yaml", REPLICATED_SPEC)
    write(attention_dir, "replicated_step.py", REPLICATED_STEP)
    with pytest.raises(SpecError, match="a sharding is given for input leaf 'nope'"):
        analyze(Options(spec=Path("rep.stagetool.yaml"), platform="cpu", variables=(("batch", "8"),),
                        leaf_shardings=(LeafSharding("nope", Sharding("spec", ("data",))),)), [Section.MEMORY])


@needs_libtpu
def test_what_if_shards_a_replicated_leaf_of_a_refused_compile(attention_dir):
    """On v5e:2x4 a replicated f32[65536,65536] (16 GiB on every device) is over the chip's 15.75
    GiB: XLA refuses the compile, so the leaf is found from its declared sharding; sharded over data
    (8) it is 2 GiB per device and fits, that compile's peak XLA's."""
    from stagetool.sweep.fit import FitOptions, what_if

    write(attention_dir, "rep.stagetool.yaml", REPLICATED_SPEC.replace("8192,8192", "65536,65536"))
    write(attention_dir, "replicated_step.py", REPLICATED_STEP)
    doc = what_if(FitOptions(Options(spec=Path("rep.stagetool.yaml")), topology="v5e:2x4", multiple=8), 64,
                  runner=_in_process)
    assert doc["from"]["outcome"] == "does not fit" and doc["from"]["peak_bytes_per_device"] is None
    change = ("shard w over mesh axis data (8 devices) on dimension 0: f32[65536,65536] replicated, 16.0 GiB per "
              "device → P('data', None), 2.00 GiB")
    assert doc["fits"] == [change] and doc["decided"]
    (t,) = [t for t in doc["tried"] if t["change"] == change]
    assert 2 * 2**30 <= t["peak_bytes_per_device"] < 2 * 2**30 + 2**20


def test_what_if_command_shows_the_spec_line(run_cli, attention_dir):
    """``stagetool fit --what-if`` through its entry point (a process per compile): the leaf's change
    with the line to write in the spec, and its progress line naming the sharding compiled."""
    write(attention_dir, "rep.stagetool.yaml", REPLICATED_SPEC)
    write(attention_dir, "replicated_step.py", REPLICATED_STEP)
    r = run_cli("fit", "--spec", "rep.stagetool.yaml", "--platform", "cpu", "--device-memory", "128MiB",
                "--multiple", "8", "--what-if", "--set", "batch=64", "--no-cache", "--format", "json", check=0)
    doc = r.json()
    (t,) = [t for t in doc["tried"] if t["spec_line"] is not None]
    assert t["outcome"] == "fits" and doc["fits"] == [t["change"]] and t["change"].startswith("shard w over mesh axis")
    assert t["peak_bytes_per_device"] == 8192 * 8192 * 4 // 8 + 2 * (64 // 8 * 128 * 4) + 4
    assert "w=P('data', None) batch=64: fits" in r.stderr


def test_a_step_time_that_is_a_floor_says_so_and_never_ranks_first():
    """Issue 47 item 3: fit's step time had no lower_bound: a floor read as a full figure, and its examples per
    second (an upper bound) could win the ranking over a complete figure."""
    from stagetool.analysis.fit import FITS, Probe
    from stagetool.sweep.fit import _speed, best_setting
    from stagetool.sweep.fit_render import frontier_rows

    floor = _speed(Probe(64, FITS, step_time=("tpu-v5e", 1e-3, 1e-3, 2e-3), step_time_lower_bound=True), 64, 2048)
    full = _speed(Probe(64, FITS, step_time=("tpu-v5e", 2e-3, 2e-3, 3e-3)), 64, 2048)
    assert floor["step_time"]["lower_bound"] is True and floor["tokens_per_second"]["upper_bound"] is True
    assert full["step_time"]["lower_bound"] is False
    settings = [{"id": i, "values": {"remat": r}, "largest_batch": 64, "headroom_bytes": 0, **speed}
                for i, (r, speed) in enumerate((("floor", floor), ("full", full)))]
    best, by = best_setting(settings)
    assert best["values"]["remat"] == "full" and by == "examples per second (estimate)"  # 2x 'faster' on a floor
    doc = {"axes": [["remat", ["floor", "full"]]], "batch": {"name": "batch"}, "best": {"id": 1},
           "settings": [{**st, "peak_bytes_per_device": None, "capacity_bytes_per_device": None,
                         "smallest_refused_batch": None, "compiles": 1, "status": "found", "reason": None}
                        for st in settings]}
    _, rows = frontier_rows(doc)
    assert rows[0][-4].startswith("≥ 1.00 ms (≥ 1.00 ms–2.00 ms") and rows[0][-3].startswith("≤ ")
    assert rows[1][-4].startswith("2.00 ms") and not rows[1][-3].startswith("≤")
