"""``stagetool sweep``: the grid, placeholders, rows checked against single runs, executors, shards, resume."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import warnings
from pathlib import Path

import pytest
from helpers import EXAMPLES, REPO, run_subprocess, write

from stagetool.core.errors import UsageError
from stagetool.plan.options import Options
from stagetool.spec.variables import check_names, find_placeholders, parse_set_options, substitute
from stagetool.sweep import RankBy, SweepOptions, merge, run_sweep, without_timings
from stagetool.sweep.grid import build_grid, factorisations, shard_of
from stagetool.sweep.rows import best

# ---- placeholders ---------------------------------------------------------------------------------

SPEC_TEXT = """\
version: 1
mesh:
  axes: {data: ${d}, model: 4}   # ${ignored} in a comment
functions:
  f:
    target: m.py:f
    args: ['f32[${batch},8] @ [data, null]']
    static: {mode: ${mode}}
"""


def test_placeholders_found_outside_comments_with_their_lines():
    found = [(p.name, p.line, p.col) for p in find_placeholders(SPEC_TEXT)]
    assert found == [("d", 3, 16), ("batch", 7, 17), ("mode", 8, 20)]


def test_substitution_fills_values_and_keeps_comments_and_lines():
    out = substitute(SPEC_TEXT, {"d": "2", "batch": "16", "mode": "dots"})
    assert out.splitlines()[2] == "  axes: {data: 2, model: 4}   # ${ignored} in a comment"
    assert out.splitlines()[6] == "    args: ['f32[16,8] @ [data, null]']"
    assert len(out.splitlines()) == len(SPEC_TEXT.splitlines())


def test_unfilled_placeholder_names_file_line_and_the_set_to_pass():
    with pytest.raises(UsageError) as e:
        substitute(SPEC_TEXT, {"d": "2"}, file="s.yaml")
    assert "s.yaml:7:17 ${batch}" in e.value.message and "s.yaml:8:20 ${mode}" in e.value.message
    assert "--set batch=VALUE" in e.value.hint and "--set mode=VALUE" in e.value.hint


def test_set_of_an_unused_name_is_an_error_with_a_suggestion():
    with pytest.raises(UsageError) as e:
        check_names(SPEC_TEXT, ["batc"], file="s.yaml")
    assert "s.yaml has no ${batc}" in e.value.message and "batch, d, mode" in e.value.message
    assert "did you mean batch" in e.value.hint


@pytest.mark.parametrize("option", ["batch", "1x=2", "batch=", "batch=8,,16", "batch=8,8", "b=[1]", "b='x'"])
def test_bad_set_options(option):
    with pytest.raises(UsageError):
        parse_set_options([option])


def test_values_are_yaml_scalars_once_the_spec_is_parsed(tmp_path):
    from stagetool.spec.variables import load_spec_with

    write(tmp_path, "m.py", "def f(x, mode):\n    return x\n")
    spec = write(tmp_path, "s.yaml", SPEC_TEXT.replace("${ignored}", "x"))
    loaded = load_spec_with(spec, {"d": "2", "batch": "16", "mode": "true"})
    assert loaded.mesh.axes == (("data", 2), ("model", 4))
    f = loaded.functions["f"]
    assert f.args[0].shape == (16, 8)
    assert f.static == {"mode": True}


def test_a_plain_command_on_a_spec_with_placeholders_says_what_to_fill(run_cli, tmp_path):
    write(tmp_path, "m.py", "def f(x, mode):\n    return x\n")
    spec = write(tmp_path, "s.yaml", SPEC_TEXT)
    r = run_cli("shardings", "--spec", spec, check=2)
    assert f"{spec}:3:16 ${{d}}" in r.stderr and "--set d=VALUE" in r.stderr


# ---- the grid -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(8, 2), (12, 3), (16, 1), (1, 3), (7, 2)])
def test_factorisations_are_every_ordered_product_in_lexicographic_order(n, k):
    brute = [f for f in itertools.product(range(1, n + 1), repeat=k) if math.prod(f) == n]
    assert list(factorisations(n, k)) == sorted(brute)


def test_grid_order_ids_and_shards():
    g = build_grid(meshes=("2x4", "4x2"), topologies=None, variables={"batch": ("8", "16"), "remat": ("full",)})
    assert [c.id for c in g.configs] == ["mesh=2x4,batch=8,remat=full", "mesh=2x4,batch=16,remat=full",
                                         "mesh=4x2,batch=8,remat=full", "mesh=4x2,batch=16,remat=full"]
    assert [c.index for c in g.configs] == [0, 1, 2, 3]
    assert g.configs[1].values() == {"mesh": "2x4", "batch": 16, "remat": "full"}
    shards = [shard_of(g.configs, (i, 3)) for i in (1, 2, 3)]
    assert sorted(c.index for s in shards for c in s) == [0, 1, 2, 3]
    assert [c.index for c in shards[0]] == [0, 3]


def test_ids_that_would_collide_get_a_hash():
    g = build_grid(meshes=None, topologies=("v5e:2x4", "v5e_2x4"), variables={})
    a, b = (c.id for c in g.configs)
    assert a != b and a.startswith("topology=v5e_2x4-") and b.startswith("topology=v5e_2x4-")


def test_best_is_the_smallest_figure_among_rows_that_stage_and_fit():
    rows = [{"index": 0, "id": "a", "status": "ok", "fits": False, "roofline_step_seconds": 1.0},
            {"index": 1, "id": "b", "status": "ok", "fits": True, "roofline_step_seconds": 3.0},
            {"index": 2, "id": "c", "status": "ok", "fits": None, "roofline_step_seconds": 2.0},
            {"index": 3, "id": "d", "status": "error", "fits": None, "roofline_step_seconds": None},
            {"index": 4, "id": "e", "status": "ok", "fits": True, "roofline_step_seconds": 2.0}]
    assert best(rows, RankBy.step) == ("c", RankBy.step, None)
    top, used, note = best([{**r, "roofline_step_seconds": None, "peak_bytes_per_device": 10 - r["index"]}
                            for r in rows], RankBy.step)
    assert (top, used) == ("e", RankBy.peak) and "--chip" in note


# ---- sweeps that stage ----------------------------------------------------------------------------


def _batch_spec(folder: Path) -> Path:
    """examples/mlp with its batch size a placeholder."""
    shutil.copy(EXAMPLES / "mlp.py", folder / "mlp.py")
    text = (EXAMPLES / "mlp.stagetool.yaml").read_text()
    text = text.replace("f32[128,512]", "f32[${batch},512]").replace("i32[128]", "i32[${batch}]")
    assert text.count("${batch}") == 2
    spec = folder / "mlp.stagetool.yaml"
    spec.write_text(text)
    return spec


def _single(target: str, spec: Path, mesh: str | None, variables=(), device_memory=None):
    """One plain `report`-equivalent run in this process (the independent figures)."""
    from stagetool.pipeline import REPORT_SECTIONS, Options, analyze
    from stagetool.report.model import document_to_json

    report = analyze(Options(target=target, spec=spec, mesh=mesh, variables=tuple(variables),
                             device_memory=device_memory), list(REPORT_SECTIONS), command="report")
    return json.loads(document_to_json(report))["functions"][0]


@pytest.fixture(scope="module")
def transformer_sweep() -> dict:
    """The documentation's sweep of the transformer over every mesh (docs/sweeps-fit.md, README.md), run
    once (in a fresh process)."""
    r = run_subprocess("sweep", "examples/transformer.py:train_step", "--mesh", "all", "--jobs", "2",
                       "--chip", "tpu-v5e", "--format", "json", timeout=900)
    assert r.code == 0, r.stderr
    return r.json()


@pytest.mark.slow
def test_mesh_all_on_the_transformer_gives_one_row_per_factorisation_equal_to_report(run_cli_shared,
                                                                                      isolated_imports,
                                                                                      transformer_sweep):
    doc = transformer_sweep
    assert [row["values"]["mesh"] for row in doc["rows"]] == ["1x8", "2x4", "4x2", "8x1"]
    for row in doc["rows"]:
        assert row["status"] == "ok", row["error"]
        one = run_cli_shared("report", "examples/transformer.py:train_step", "--mesh", row["values"]["mesh"],
                             "--chip", "tpu-v5e", "--format", "json", check=0).json()["functions"][0]
        assert row["mesh"] == [list(a) for a in one["mesh"]["axes"]]
        assert row["peak_bytes_per_device"] == one["memory"]["record"]["peak_bytes"]
        assert row["fits"] == one["memory"]["verdict"]["fits"] is True
        assert row["flops_per_device_xla"] == one["cost"]["per_device"]["flops"]
        assert row["flops_per_device_loop_aware"] == one["cost"]["loop_aware"]["flops"]
        assert row["roofline_step_seconds"] == one["cost"]["roofline"]["lower_bound_seconds"]
        assert row["while_loops"] == len(one["cost"]["loop_trip_counts"]) == 2  # the scan over layers, forward and back
        summary = one["collectives"]["summary"]
        by_axes = {("(unmatched)" if t["mesh_axes"] is None else ",".join(t["mesh_axes"]) or "(no axes)"):
                   t["executed_bytes_per_device"] for t in summary["by_mesh_axes"]}
        assert row["collective_bytes_per_step_by_mesh_axes"] == by_axes
        assert row["collective_bytes_per_step"] == summary["total"]["executed_bytes_per_device"] == sum(by_axes.values())
    fastest = min(doc["rows"], key=lambda x: (x["roofline_step_seconds"], x["index"]))
    assert doc["best"] == fastest["id"] and doc["ranked_by"] == "step"


@pytest.mark.slow
@pytest.mark.jax_version("==0.10.2", reason="the documentation's table shows jax 0.10.2's figures")
def test_the_documentations_sweep_table_is_this_sweep(transformer_sweep):
    """The table of docs/sweeps-fit.md is this sweep's (compile times aside)."""
    from stagetool.sweep.render import table_rows

    doc = transformer_sweep
    readme = (REPO / "docs/sweeps-fit.md").read_text().split("$ stagetool sweep examples/transformer.py:train_step --mesh all")[1]
    readme_lines = readme.split("```")[0].splitlines()
    head, cells = table_rows(doc)
    for cell in cells:
        line = next(x for x in readme_lines if x[5:].startswith(cell[1] + " "))
        assert line.startswith(" " + (cell[0] or " ") + " ")
        for i, value in enumerate(cell[2:], start=2):
            if head[i] != "compile" and value:
                assert f" {value} " in line + " ", (head[i], value, line)


def test_batch_sweep_finds_where_it_stops_fitting_as_single_runs_do(run_cli, tmp_path, monkeypatch, isolated_imports):
    spec = _batch_spec(tmp_path)
    monkeypatch.chdir(tmp_path)
    r = run_cli("sweep", "mlp.py:train_step", "--set", "batch=101,16384,65536,262144", "--device-memory", "256MiB",
                "--jobs", "2", "--format", "json")
    assert r.code == 3, r.stderr  # batch 101 does not split over data=2: an error row, and the sweep says so
    rows = {row["values"]["batch"]: row for row in r.json()["rows"]}
    assert rows[101]["status"] == "error" and "not divisible by 2" in rows[101]["error"]["message"]
    assert [rows[b]["status"] for b in (16384, 65536, 262144)] == ["ok", "ok", "does not fit"]
    assert r.json()["best"] == rows[16384]["id"]  # no --chip: ranked by peak memory (a note says so)
    assert "--chip" in r.json()["ranking_note"]
    # the boundary lies between 65536 and 262144: one single run on either side of it agrees
    for batch, fits in ((65536, True), (262144, False)):
        one = _single("mlp.py:train_step", spec, None, [("batch", str(batch))], "256MiB")
        assert one["memory"]["verdict"]["fits"] is fits
        assert one["memory"]["capacity_bytes"] == 256 * 2**20
        assert rows[batch]["peak_bytes_per_device"] == one["memory"]["record"]["peak_bytes"]
        assert (one["memory"]["record"]["peak_bytes"] <= 256 * 2**20) is fits


def test_resume_redoes_only_missing_or_stale_rows(tmp_path, monkeypatch, isolated_imports):
    shutil.copy(EXAMPLES / "mlp.py", tmp_path)
    shutil.copy(EXAMPLES / "mlp.stagetool.yaml", tmp_path)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "rows"
    opts = SweepOptions(Options(target="mlp.py:train_step"), mesh="2x4,4x2", output_dir=out, jobs=2)
    ran: list[str] = []
    first = run_sweep(opts, on_row=lambda row, done, total: ran.append(row["id"]))
    assert sorted(ran) == ["mesh=2x4", "mesh=4x2"]
    assert sorted(p.name for p in out.iterdir()) == ["mesh=2x4.json", "mesh=4x2.json"]
    saved = json.loads((out / "mesh=4x2.json").read_text())
    assert saved["row"] == first["rows"][1]
    (out / "mesh=2x4.json").unlink()
    ran.clear()
    reused: list[list[str]] = []
    again = run_sweep(SweepOptions(**{**opts.__dict__, "resume": True}), on_row=lambda row, d, t: ran.append(row["id"]),
                      on_resume=reused.append)
    assert ran == ["mesh=2x4"] and reused == [["mesh=4x2"]]
    assert without_timings(again) == without_timings(first)
    assert again["rows"][1]["timings"] == first["rows"][1]["timings"]  # taken from the file, not rerun
    # another --device-memory is another sweep: its rows are not reused
    ran.clear()
    run_sweep(dataclasses.replace(opts, resume=True, options=dataclasses.replace(opts.options, device_memory="1GiB")),
              on_row=lambda row, d, t: ran.append(row["id"]))
    assert sorted(ran) == ["mesh=2x4", "mesh=4x2"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ray_executor_and_shards_give_the_same_document_as_local_jobs(run_cli, tmp_path, monkeypatch,
                                                                        isolated_imports):
    ray = pytest.importorskip("ray")
    shutil.copy(EXAMPLES / "mlp.py", tmp_path)
    shutil.copy(EXAMPLES / "mlp.stagetool.yaml", tmp_path)
    monkeypatch.chdir(tmp_path)
    args = ("sweep", "mlp.py:train_step", "--mesh", "2x4,4x2", "--chip", "tpu-v5e", "--format", "json")
    local = run_cli(*args, "--jobs", "2", check=0).json()
    assert len(local["rows"]) == 2 and all(r["status"] == "ok" for r in local["rows"])
    run_cli(*args, "--shard", "1/2", "-o", "a.json", check=0)
    run_cli(*args, "--shard", "2/2", "-o", "b.json", check=0)
    a, b = (json.loads(Path(f).read_text()) for f in ("a.json", "b.json"))
    assert (a["shard"], a["rows"][0]["id"], b["shard"], b["rows"][0]["id"]) == ("1/2", "mesh=2x4", "2/2", "mesh=4x2")
    merged = run_cli("sweep", "merge", "a.json", "b.json", "--format", "json", check=0).json()
    assert without_timings(merged) == without_timings(local)
    with pytest.raises(UsageError, match="different sweeps"):
        merge([a, {**b, "options": {**b["options"], "chip": "h100-sxm"}}])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR")
    try:
        address = ctx.address_info["gcs_address"]
        r = run_subprocess(*args, "--executor", "ray", cwd=tmp_path, env={"RAY_ADDRESS": address}, timeout=180)
        assert r.code == 0, r.stderr
        assert without_timings(r.json()) == without_timings(local)
    finally:
        ray.shutdown()


def test_option_errors_are_one_message_before_anything_runs(run_cli, tmp_path, monkeypatch, isolated_imports):
    spec = _batch_spec(tmp_path)
    monkeypatch.chdir(tmp_path)
    r = run_cli("sweep", "mlp.py:train_step", "--set", "bach=8", check=2)
    assert "has no ${bach}" in r.stderr and "did you mean batch" in r.stderr
    r = run_cli("sweep", "mlp.py:train_step", check=2)
    assert f"{spec.name}:16:17 ${{batch}}" in r.stderr and "--set batch=VALUE" in r.stderr
    r = run_cli("sweep", "mlp.py:train_step", "--set", "batch=8", "--shard", "3/2", check=2)
    assert "--shard '3/2'" in r.stderr
    r = run_cli("sweep", "mlp.py:train_step", "--set", "batch=8", "--resume", check=2)
    assert "--output-dir" in r.stderr
    r = run_cli("sweep", "mlp.py:train_step", "--set", "batch=8", "--mesh", "2x4,3x3x3", check=2)
    assert "has 3 sizes" in r.stderr
    r = run_cli("sweep", "mlp.py:train_step", "--set", "batch=8", "--format", "yaml", check=2)
    assert "--format text|json|markdown|csv" in r.stderr
    r = run_cli("sweep", "mlp.py:train_step", "--set", "batch=8", "--topology", "v5e:2x4,v5e", check=2)
    assert "bad TPU topology name 'v5e'" in r.stderr
    r = run_cli("sweep", "merge", check=2)
    assert "needs the JSON documents" in r.stderr


def test_mesh_all_factorises_the_spec_mesh_or_devices(tmp_path, monkeypatch, isolated_imports):
    from stagetool.sweep import plan_sweep

    spec = _batch_spec(tmp_path)
    monkeypatch.chdir(tmp_path)
    plan = plan_sweep(SweepOptions(Options(target="mlp.py:train_step"), mesh="all", set=("batch=8",)))
    assert [c.mesh for c in plan.configs] == ["1x8", "2x4", "4x2", "8x1"]
    plan = plan_sweep(SweepOptions(Options(spec=spec), mesh="all", devices=4, set=("batch=8",)))
    assert [c.mesh for c in plan.configs] == ["1x4", "2x2", "4x1"]


@pytest.mark.slow
def test_out_of_memory_compile_on_a_topology_is_does_not_fit(run_cli, tmp_path, monkeypatch, isolated_imports):
    from stagetool.devices.tpu_topology import libtpu_available

    if not libtpu_available():
        pytest.skip("needs libtpu (the tpu extra)")
    _batch_spec(tmp_path)
    monkeypatch.chdir(tmp_path)
    r = run_cli("sweep", "mlp.py:train_step", "--set", "batch=16777216", "--topology", "v5e:2x4", "--format", "json",
                check=0)
    (row,) = r.json()["rows"]
    assert row["status"] == "does not fit" and row["fits"] is False
    assert row["error"] is None  # XLA's RESOURCE_EXHAUSTED is the memory section's verdict (issue 10), not an error
    assert row["peak_bytes_per_device"] is None or row["peak_bytes_per_device"] > row["capacity_bytes_per_device"]
    assert r.json()["best"] is None


def test_text_markdown_and_csv_render_every_row(tmp_path):
    from stagetool.sweep.render import SweepFormat, render

    row = {"index": 0, "id": "mesh=2x4", "values": {"mesh": "2x4"}, "status": "ok", "peak_bytes_per_device": 2048,
           "capacity_bytes_per_device": 4096, "fits": True, "collective_bytes_per_step": 3072,
           "collective_bytes_per_step_by_mesh_axes": {"data": 1024, "model[minor 2 of 4]": 2048}, "collectives_unknown_runs": 0,
           "flops_per_device_xla": 1.5e9, "while_loops": 1, "roofline_step_seconds": 2e-3, "error": None,
           "timings": {"compile_s": 0.25}}
    bad = {**row, "index": 1, "id": "mesh=8x1", "values": {"mesh": "8x1"}, "status": "error",
           "peak_bytes_per_device": None, "collective_bytes_per_step_by_mesh_axes": None, "flops_per_device_xla": None,
           "roofline_step_seconds": None, "fits": None,
           "error": {"stage": "setup", "exit_code": 2, "message": "not divisible\nmore"}, "timings": {}}
    doc = {"kind": "sweep", "function": "f", "target": "m.py:f", "axes": [["mesh", ["2x4", "8x1"]]],
           "options": {"chip": "tpu-v5e"}, "grid_size": 2, "shard": None, "best": "mesh=2x4", "ranked_by": "step",
           "ranking_note": None, "rows": [row, bad]}
    text = render(doc, SweepFormat.text)
    assert "2.00 KiB (50%)" in text and "data 1.00 KiB · model[minor 2 of 4] 2.00 KiB" in text and "1.50 G (loops once)" in text
    assert "setup: not divisible" in text and "★ best by step: mesh=2x4" in text
    md = render(doc, SweepFormat.markdown)
    assert "| ★ | 2x4 | 2.00 KiB (50%) | yes |" in md
    lines = render(doc, SweepFormat.csv).splitlines()
    assert lines[0].startswith("mesh,index,id,best,status,peak_bytes_per_device")
    assert lines[0].endswith("collective_bytes_per_step[data],collective_bytes_per_step[model[minor 2 of 4]]")
    assert lines[1].startswith("2x4,0,mesh=2x4,true,ok,2048,,4096,true,3072,,1500000000.0,,1,")
    assert lines[1].endswith(",1024,2048") and lines[2].endswith("setup: not divisible,,")
    assert json.loads(render(doc, SweepFormat.json)) == doc


def test_html_is_the_table_with_bars_and_the_best_marked():
    """``--format html``: one row per configuration, each with its peak (against its capacity),
    collective bytes and step time as bars on one scale per column, and the best row marked."""
    from html.parser import HTMLParser

    from stagetool.sweep.render import SweepFormat, render

    def row(i, mesh, peak, coll, step, status="ok"):
        return {"index": i, "id": f"mesh={mesh}", "values": {"mesh": mesh}, "status": status,
                "peak_bytes_per_device": peak, "capacity_bytes_per_device": 4096, "fits": None if peak is None else peak <= 4096,
                "collective_bytes_per_step": coll, "collective_bytes_per_step_by_mesh_axes": {"data": coll} if coll else None,
                "collectives_unknown_runs": 0, "flops_per_device_xla": 1e9, "while_loops": 0,
                "roofline_step_seconds": step, "timings": {"compile_s": 0.5},
                "error": None if status != "error" else {"stage": "setup", "exit_code": 2, "message": "no <mesh>"}}

    rows = [row(0, "1x8", 2048, 1000, 4e-3), row(1, "2x4", 1024, 4000, 2e-3), row(2, "4x2", 8192, 500, 1e-3, "does not fit"),
            row(3, "8x1", None, None, None, "error")]
    doc = {"kind": "sweep", "function": "f", "target": "m.py:f", "axes": [["mesh", ["1x8", "2x4", "4x2", "8x1"]]],
           "options": {"chip": "tpu-v5e"}, "grid_size": 4, "shard": None, "best": "mesh=2x4", "ranked_by": "step",
           "ranking_note": None, "rows": rows}
    page = render(doc, SweepFormat.html)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "default-src 'none'" in page
    assert "no &lt;mesh&gt;" in page  # the failure is text, escaped

    class Rows(HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self.cell = {}, None

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "tr" and "data-config" in a:
                self.current = self.rows.setdefault(a["data-config"], {"best": a["data-best"], "bars": {}})
            elif tag == "td" and a.get("class") in ("peak", "collectives", "step"):
                self.cell = a["class"]
            elif tag == "rect" and self.cell and a.get("class") != "track":
                self.current["bars"][self.cell] = (a["class"], float(a["width"]))
            elif tag == "line" and self.cell == "peak":
                self.current["capacity_x"] = float(a["x1"])

        def handle_endtag(self, tag):
            if tag == "td":
                self.cell = None

    parsed = Rows()
    parsed.feed(page)
    got = parsed.rows
    assert [k for k, v in got.items() if v["best"] == "true"] == ["mesh=2x4"]
    # one scale per column: the largest value (or the capacity) fills the 120-pixel bar
    assert got["mesh=4x2"]["bars"]["peak"] == ("over", 120.0)  # over its capacity: drawn as such
    assert got["mesh=1x8"]["bars"]["peak"] == ("peak", 30.0) and got["mesh=1x8"]["capacity_x"] == 60.0
    assert got["mesh=2x4"]["bars"]["collectives"] == ("collectives", 120.0)
    assert got["mesh=1x8"]["bars"]["step"] == ("step", 120.0) and got["mesh=4x2"]["bars"]["step"] == ("step", 30.0)
    assert got["mesh=8x1"]["bars"] == {}  # the failed configuration has no figures to draw


# ---- --chip and compile-only targets (trial 2, finding 3) -----------------------------------------

TARGETS_MODEL = "import jax.numpy as jnp\n\n\ndef step(w, x):\n    return jnp.tanh(x @ w)\n"
TARGETS_SPEC = ("version: 1\nmesh: {axes: {data: 8}}\nfunctions:\n  step:\n    target: s.py:step\n"
                "    args: ['f32[256,256]', 'f32[64,256] @ [data]']\n")


@pytest.fixture
def targets_spec(tmp_path, monkeypatch):
    write(tmp_path, "s.py", TARGETS_MODEL)
    monkeypatch.chdir(tmp_path)
    return write(tmp_path, "s.stagetool.yaml", TARGETS_SPEC)


def test_one_chip_over_a_target_of_another_chip_is_refused_before_anything_runs(run_cli, targets_spec):
    """``--topology v5e:2x4,h100:8 --chip tpu-v5e`` ranked the H100 compile by v5e's roofline and named
    a best; now it is exit 2 at plan time, naming the target, its chip and the fix."""
    r = run_cli("sweep", "s.py:step", "--topology", "v5e:2x4,h100:8", "--chip", "tpu-v5e", check=2)
    assert "--chip tpu-v5e does not match --topology h100:8, which compiles for the h100-sxm chip" in r.stderr
    assert "give --chip h100-sxm, or leave --chip out" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("cost", "s.py:step", "--topology", "v5e:2x4", "--chip", "h100-sxm", check=2)
    assert "--chip h100-sxm does not match --topology v5e:2x4, which compiles for the tpu-v5e chip" in r.stderr


def test_the_target_chip_comes_from_the_name():
    from stagetool.plan.target import parse_target

    assert [parse_target(t).roofline_chip for t in ("v5e:2x4", "v6e:2x2", "v5p:2x2x2", "h100:8", "a100-80gb:2x8", "v2:2x2")] == \
        ["tpu-v5e", "tpu-v6e", "tpu-v5p", "h100-sxm", "a100-80gb", None]


@pytest.mark.slow
@pytest.mark.skipif(not __import__("stagetool.devices.tpu_topology", fromlist=["x"]).libtpu_available(),
                    reason="libtpu not installed: pip install -e '.[tpu]'")
def test_a_sweep_over_targets_without_chip_gives_each_row_its_own_chip(run_cli, targets_spec):
    """Each row's roofline is on its own target's chip, equal to a single run with that ``--chip``; the
    best and progress lines name the configuration as the table does (``v5e:2x4``, not ``v5e_2x4``)."""
    r = run_cli("sweep", "s.py:step", "--topology", "v5e:2x4,v6e:2x4", "--format", "json", check=0)
    assert r.code == 0, r.stderr
    rows = {row["values"]["topology"]: row for row in r.json()["rows"]}
    for topo, chip in (("v5e:2x4", "tpu-v5e"), ("v6e:2x4", "tpu-v6e")):
        assert rows[topo]["chip"] == chip
        one = run_cli("cost", "s.py:step", "--topology", topo, "--chip", chip, "--format", "json",
                      check=0).json()["functions"][0]
        assert rows[topo]["roofline_step_seconds"] == one["cost"]["roofline"]["lower_bound_seconds"] > 0
    fastest = min(rows.values(), key=lambda x: x["roofline_step_seconds"])
    assert r.json()["best"] == fastest["id"] and r.json()["ranked_by"] == "step"
    text = run_cli("sweep", "s.py:step", "--topology", "v5e:2x4,v6e:2x4", check=0)
    label = f"topology={fastest['values']['topology']}"
    assert f"★ best by step: {label}" in text.stdout and "_2x4" not in text.stdout
    assert "1/2 topology=v5e:2x4" in text.stderr and "_2x4" not in text.stderr
    assert "(tpu-v5e)" in text.stdout and "(tpu-v6e)" in text.stdout


def test_a_quoted_placeholder_as_a_mesh_size_says_to_unquote_it(run_cli, targets_spec, tmp_path):
    """Trial 2, finding 12: ``{fsdp: '${n}'}`` with ``--set n=8,4`` read as the string '8' and said only
    "not '8'"; the message now says it is quoted and how to write it (exit 2, before anything runs)."""
    spec = write(tmp_path, "q.stagetool.yaml", TARGETS_SPEC.replace("{data: 8}", "{data: '${n}'}"))
    r = run_cli("sweep", "--spec", str(spec), "--set", "n=8,4", check=2)
    assert "mesh.axes.data: axis size must be a positive integer, not the string '8': it is quoted" in r.stderr
    assert "{data: ${NAME}}, not {data: '${NAME}'}" in r.stderr
    r = run_cli("sweep", "--spec", str(write(tmp_path, "u.stagetool.yaml", TARGETS_SPEC.replace("{data: 8}", "{data: ${n}}"))),
                "--set", "n=8", "--format", "json", check=0)
    assert r.code == 0 and r.json()["rows"][0]["device_count"] == 8


def test_a_failed_cell_shows_the_first_problem_of_an_invalid_spec(run_cli, tmp_path, monkeypatch, isolated_imports):
    """Issue 30, item 6: a row whose spec has several problems shows the first of them in its
    failure cell (the one a single run reports first), not only 'setup: invalid spec:'."""
    from stagetool.core.errors import SpecError
    from stagetool.sweep.render import first_line

    spec = _batch_spec(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as single:
        _single("mlp.py:train_step", spec, None, [("batch", "101")])
    assert len(single.value.issues) == 2
    r = run_cli("sweep", "mlp.py:train_step", "--set", "batch=101,128", "--jobs", "1", "--format", "markdown")
    assert r.code == 3, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("|  | 101 |"))
    assert row.rstrip(" |").endswith(f"setup: invalid spec: {single.value.issues[0]} (+1 more line)")
    assert "is not divisible by 2" in single.value.issues[0]
    assert first_line("invalid spec:\n  a\n  b\n  c") == "invalid spec: a (+2 more lines)"
    assert first_line("one line\nits frame") == "one line" and first_line("") == ""


def test_the_csv_carries_the_step_time_and_whether_it_is_a_lower_bound():
    """Issue 47 item 3: the sweep CSV had no step time at all; a floor must say it is one."""
    import csv
    import io

    from stagetool.sweep.render import render_csv

    rows = [{"id": f"r{i}", "values": {"mesh": m}, "status": "ok", "step_time": st}
            for i, (m, st) in enumerate((("8x1", {"schedule_seconds": 2.5e-4, "lower_bound": True, "bound": "compute"}),
                                         ("4x2", {"schedule_seconds": 3e-4, "bound": "ICI (data)"}), ("2x4", None)))]
    out = list(csv.DictReader(io.StringIO(render_csv({"axes": [["mesh", ["8x1", "4x2", "2x4"]]], "rows": rows}))))
    assert [(r["mesh"], r["step_time_seconds"], r["step_time_lower_bound"], r["step_time_bound"]) for r in out] == [
        ("8x1", "0.00025", "true", "compute"), ("4x2", "0.0003", "false", "ICI (data)"), ("2x4", "", "", "")]
