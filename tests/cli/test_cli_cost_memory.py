"""`stagetool cost`, `memory` and `report` through the CLI: analytic FLOPs, missing data, the peak
buffer and its source line, the fit verdict, and Markdown that renders as tables."""

from __future__ import annotations

import re

import jax
import pytest
from helpers import write
from markdown_it import MarkdownIt

MODEL = """\
import jax.numpy as jnp


def matmul(a, b):
    return a @ b


def outer_then_sum(x, y):
    # sorted, so that every release keeps the product in memory (XLA:CPU of jaxlib 0.12 fuses
    # sin(outer) into a sum and never materialises it; 0.7 reduces it in windows)
    big = jnp.sort(jnp.sin(x[:, None] * y[None, :]), axis=1)  # BIG
    return jnp.sum(big, axis=1)
"""

SPEC = """\
version: 1
mesh: {axes: {data: 2, model: 4}}
functions:
  matmul:
    target: m.py:matmul
    args: ['f32[256,512] @ [data, null]', 'f32[512,128] @ [null, model]']
  outer:
    target: m.py:outer_then_sum
    args: ['f32[2048]', 'f32[2048]']
"""

M, K, N = 256, 512, 128


@pytest.fixture
def spec(tmp_path):
    write(tmp_path, "m.py", MODEL)
    return write(tmp_path, "m.stagetool.yaml", SPEC)


def test_matmul_flops_whole_program_and_per_device(run_cli, spec):
    doc = run_cli("cost", "--spec", str(spec), "-f", "matmul", "--format", "json", check=0).json()
    cost = doc["functions"][0]["cost"]
    assert cost["whole_program"]["flops"] == 2 * M * N * K
    assert cost["per_device"]["flops"] == 2 * M * N * K / 8        # fully sharded: rows on data, cols on model
    assert cost["device_count"] == 8
    assert cost["per_device"]["suspects"] == [] and cost["whole_program"]["suspects"] == []


def test_missing_cost_analysis_is_derived_or_na_not_a_crash(run_cli, spec, monkeypatch):
    """A backend that reports no cost analysis (XLA:GPU compile-only): per device, the FLOPs are derived
    from the compiled module and labelled so; the whole program is n/a with the reason."""
    monkeypatch.setattr(jax.stages.Compiled, "cost_analysis", lambda self: None)
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: {})
    r = run_cli("cost", "--spec", str(spec), "-f", "matmul", check=0)
    assert "n/a" in r.stdout and "not reported" in r.stdout and "derived" in r.stdout
    doc = run_cli("cost", "--spec", str(spec), "-f", "matmul", "--format", "json", check=0).json()
    cost = doc["functions"][0]["cost"]
    per_device = cost["per_device"]
    # a f32[256,512] over data (2) @ f32[512,128] over model (4): each device a [128,512] @ [512,32]
    assert per_device["flops"] == 2 * 128 * 32 * 512 and per_device["source"].startswith("derived")
    assert cost["whole_program"]["flops"] is None and cost["whole_program"]["reason"]
    assert any("derived" in n for n in cost["scope_notes"])


def test_memory_names_the_peak_buffer_and_its_line(run_cli, spec, tmp_path):
    doc = run_cli("memory", "--spec", str(spec), "-f", "outer", "--format", "json", check=0).json()
    peak = doc["functions"][0]["memory"]["peak"]
    top = peak["buffers"][0]
    assert top["size_bytes"] == 2048 * 2048 * 4                    # the f32[2048,2048] outer product
    line = next(i for i, t in enumerate((tmp_path / "m.py").read_text().splitlines(), 1) if "# BIG" in t)
    assert (top["file"], top["line"]) == ("m.py", line)  # relative to the spec's folder
    assert top["size_bytes"] > sum(b["size_bytes"] for b in peak["buffers"][1:])


def test_fail_if_over_exits_1_with_a_verdict(run_cli, spec):
    r = run_cli("memory", "--spec", str(spec), "-f", "outer", "--no-peak", "--device-memory", "1MiB",
                "--fail-if-over")
    assert r.code == 1 and "DOES NOT FIT" in r.stdout and "does not fit: outer" in r.stderr
    r = run_cli("memory", "--spec", str(spec), "-f", "outer", "--no-peak", "--device-memory", "1GiB",
                "--fail-if-over")
    assert r.code == 0 and "fits: peak" in r.stdout


def test_bad_device_memory_is_a_usage_error(run_cli, spec):
    r = run_cli("memory", "--spec", str(spec), "-f", "outer", "--device-memory", "lots")
    assert r.code == 2 and "lots" in r.stderr and "Traceback" not in r.stderr


def test_report_markdown_renders_as_tables(run_cli, spec):
    text = run_cli("report", "--spec", str(spec), "--format", "markdown", check=0).stdout
    html = MarkdownIt("commonmark").enable("table").render(text)
    # Per function: shardings summary, cost, memory, largest inputs (neither function communicates:
    # the matmul is sharded on rows and columns only, so "Collectives" says none).
    assert html.count("<table>") == 2 * 4
    assert html.count("None: no communication between devices.") == 2
    assert re.search(r"<th[^>]*>sharded over</th>", html)
    assert re.search(r"<th[^>]*>per device</th>", html) and re.search(r"<th[^>]*>whole program</th>", html)
    assert re.search(r"<td[^>]*>FLOPs</td>", html)
    # No row lost its cells: every row has as many cells as its table's header.
    for table in html.split("<table>")[1:]:
        body = table.split("</table>")[0]
        header = len(re.findall(r"<th[ >]", body.split("</tr>")[0]))
        rows = [r for r in body.split("</tr>")[1:] if "<td" in r]
        assert header and rows and all(len(re.findall(r"<td[ >]", r)) == header for r in rows)


def test_function_repeats_to_run_several(run_cli, spec):
    doc = run_cli("cost", "--spec", str(spec), "-f", "outer", "-f", "matmul", "--format", "json", check=0).json()
    assert [f["name"] for f in doc["functions"]] == ["matmul", "outer"]  # in spec order


def test_a_suspect_flop_count_does_not_feed_the_roofline(run_cli, spec, monkeypatch):
    """Compiled.cost_analysis() giving 1 FLOP for the sharded matmul (below its own dot's 2·M·N·K/8) is
    flagged suspect; the roofline then has no compute term and says why, rather than a step time."""
    monkeypatch.setattr(jax.stages.Compiled, "cost_analysis", lambda self: {"flops": 1.0, "bytes accessed": 4096.0})
    doc = run_cli("cost", "--spec", str(spec), "-f", "matmul", "--chip", "tpu-v5e", "--format", "json",
                  check=0).json()
    c = doc["functions"][0]["cost"]
    assert [s["field"] for s in c["per_device"]["suspects"]] == ["flops"]
    r = c["roofline"]
    assert r["flops_per_device"] is None and r["compute_seconds"] is None and r["lower_bound_seconds"] is None
    assert r["memory_seconds"] == pytest.approx(4096.0 / r["hbm_bandwidth_bytes_per_second"])
    assert "FLOPs left out, flagged as suspect" in r["reason"] and f"{2 * M * N * K // 8:.6g}" in r["reason"]
    text = run_cli("cost", "--spec", str(spec), "-f", "matmul", "--chip", "tpu-v5e", check=0).stdout
    assert "roofline (tpu-v5e, from --chip): n/a: FLOPs left out, flagged as suspect" in text
