"""The step-time estimate (issue 31) through the CLI: cost in every format, on a compile-only TPU and on
the CPU mesh with --chip."""

from __future__ import annotations

import re

import pytest
from helpers import REPO  # noqa: F401
from test_examples import _in_repo  # noqa: F401 - the fixture runs in the repo

from stagetool.core.chips import CHIPS
from stagetool.devices import tpu_topology as topology


def _step(r):
    return r.json()["functions"][0]["cost"]


def _consistent(st, chip):
    assert st["label"] == "estimate" and st["chip"] == chip
    assert st["overlapped_seconds"] <= st["schedule_seconds"] <= st["serial_seconds"]
    assert sum(v for _, v in st["parts"]) == pytest.approx(st["schedule_seconds"], rel=1e-9)
    assert st["bound"] == st["parts"][0][0]
    assert st["mfu"] == pytest.approx(st["flops"] / (st["schedule_seconds"] * CHIPS[chip].peak_flops_per_second_bf16))
    for c in st["collectives"]:  # latency + bytes x ring factor / bandwidth, each
        assert c["seconds"] == pytest.approx(c["latency_seconds"] + c["bytes_per_device"] * c["factor"]
                                             / c["bandwidth_bytes_per_second"])


@pytest.mark.slow
@pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_cost_on_v5e_gives_a_step_time_range_its_bound_and_top_instructions(run_cli):
    st = _step(run_cli("cost", "examples/transformer.py:train_step", "--topology", "v5e:2x4", "--format", "json",
                       check=0))["step_time"]
    _consistent(st, "tpu-v5e")
    links = {c["link"] for c in st["collectives"]}
    assert links == {"ICI"} and {tuple(c["mesh_axes"]) for c in st["collectives"]} >= {("data",), ("model",)}
    assert st["top"][0]["source"].startswith("transformer.py:")
    assert st["xla_optimal_seconds"] > 0  # XLA:TPU's own figure, shown beside
    text = run_cli("cost", "examples/transformer.py:train_step", "--topology", "v5e:2x4", check=0).stdout
    assert re.search(r"step time on tpu-v5e \(estimate\): [\d.]+ [µm]s as scheduled, range", text)
    assert "longest instructions over the step (estimate)" in text and "XLA's own figure (optimal_seconds" in text


def test_the_cpu_mesh_needs_a_chip_and_times_the_program_on_it(run_cli):
    cost = _step(run_cli("cost", "examples/mlp.py:train_step", "--format", "json", check=0))
    assert cost["step_time"] is None and "--chip" in cost["step_time_reason"]
    st = _step(run_cli("cost", "examples/mlp.py:train_step", "--chip", "h100-sxm", "--format", "json",
                       check=0))["step_time"]
    _consistent(st, "h100-sxm")
    assert {c["link"] for c in st["collectives"]} == {"NVLink"}  # 8 devices: one NVLink host
    assert any("CPU mesh's program" in a for a in st["assumptions"])
    kernels = dict(st["parts"])["kernel launch"] / CHIPS["h100-sxm"].kernel_launch_seconds  # a GPU's launches
    assert kernels >= 1 and kernels == pytest.approx(round(kernels), abs=1e-6)


def test_markdown_and_html_show_the_step_time(run_cli):
    md = run_cli("cost", "examples/mlp.py:train_step", "--chip", "tpu-v5e", "--format", "markdown", check=0).stdout
    assert "#### Step time (estimate)" in md and "| instruction | opcode | time / step |" in md
    html = run_cli("cost", "examples/mlp.py:train_step", "--chip", "tpu-v5e", "--format", "html", check=0).stdout
    bar = re.search(r'<svg class="step-time-chart" width="640".*?</svg>', html, re.S).group(0)
    widths = [float(w) for w in re.findall(r'<rect x="[\d.]+" y="0" width="([\d.]+)"', bar)]
    assert widths and sum(widths) == pytest.approx(640, abs=0.5)  # the parts fill the bar
    assert "<h4>Step time on tpu-v5e:" in html
