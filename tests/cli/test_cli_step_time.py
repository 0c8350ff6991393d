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
    # MFU is against the peak of the precision the matmuls ran at (issue 46), which the text names
    if st["mfu_peak"].startswith("the "):  # "the f32 peak (67 TFLOP/s)"
        prec = st["mfu_peak"].split()[1]
        assert st["mfu"] == pytest.approx(st["matmul_flops"] / (st["schedule_seconds"]
                                                                * CHIPS[chip].precision_peak(prec)))
    else:  # "each kernel's precision peak (f32 51%, bf16 49% of the FLOPs)": between the two peaks' figures
        precs = re.findall(r"\b(bf16|f32|int8|fp8)\b", st["mfu_peak"])
        peaks = [CHIPS[chip].precision_peak(p) for p in precs]
        assert len(precs) >= 2 and st["mfu_peak"].startswith("each kernel's precision peak")
        base = st["matmul_flops"] / st["schedule_seconds"]
        assert base / max(peaks) * 0.999 <= st["mfu"] <= base / min(peaks) * 1.001
    assert 0 < st["mfu"] <= 1
    lo, hi = st["likely_seconds"]
    assert lo <= st["schedule_seconds"] <= hi
    assert 0 < st["matmul_flops"] <= st["flops"]
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
    # XLA:TPU's optimal_seconds counts the loop body once: not shown as a figure for a program with loops
    assert st["xla_optimal_seconds"] is None and "while-loop body once" in st["xla_optimal_note"]
    assert not st["lower_bound"] and st["uncounted"] == []
    assert {k["figure"] for k in st["top"]} <= {"model", "XLA estimated_cycles", "collective model"}
    text = run_cli("cost", "examples/transformer.py:train_step", "--topology", "v5e:2x4", check=0).stdout
    assert re.search(r"step time on tpu-v5e \(estimate, from topology v5e:2x4\): [\d.]+ [µm]s as scheduled, range", text)
    assert "longest instructions over the step (estimate)" in text and "XLA's optimal_seconds left out" in text


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
    assert "#### Step time (estimate)" in md and "| instruction | kind | time / step |" in md
    html = run_cli("cost", "examples/mlp.py:train_step", "--chip", "tpu-v5e", "--format", "html", check=0).stdout
    bar = re.search(r'<svg class="step-time-chart" width="640".*?</svg>', html, re.DOTALL).group(0)
    widths = [float(w) for w in re.findall(r'<rect x="[\d.]+" y="0" width="([\d.]+)"', bar)]
    assert widths and sum(widths) == pytest.approx(640, abs=0.5)  # the parts fill the bar
    assert "<h4>Step time on tpu-v5e (from --chip):" in html


def test_a_predicted_step_time_regression_fails_check_with_its_cause(run_cli, tmp_path):
    import json

    base = tmp_path / "lock.json"
    run_cli("snapshot", "examples/mlp.py:train_step", "--chip", "tpu-v5e", "-o", base, check=0)
    doc = json.loads(base.read_text())
    st = doc["functions"]["train_step"]["step_time"]
    assert st["chip"] == "tpu-v5e" and st["seconds"] == pytest.approx(sum(st["parts"].values()))
    link = next(k for k in st["parts"] if k.startswith("ICI"))
    grown = st["parts"][link] * 0.5  # the baseline moved half as much over this link: now it takes longer
    st["parts"][link] -= grown
    st["seconds"] -= grown
    base.write_text(json.dumps(doc))
    r = run_cli("check", "examples/mlp.py:train_step", "--chip", "tpu-v5e", "-b", base, "--format", "json")
    change = next(c for c in r.json()["functions"][0]["changes"] if c["what"] == "step time (estimate, tpu-v5e)")
    assert r.code == 1 and change["status"] == "regression"
    assert change["change"] == pytest.approx(grown / st["seconds"], rel=1e-6)
    assert f"grew: {link} +" in change["note"] and "tolerance 5%" in change["note"]
    # within a tolerance that allows it, the same growth passes
    r = run_cli("check", "examples/mlp.py:train_step", "--chip", "tpu-v5e", "-b", base, "--tolerance",
                f"step_time={int(change['change'] * 100) + 1}%")
    assert r.code == 0


@pytest.mark.slow
@pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_a_prefetched_argument_is_timed_and_no_roofline_bound_exceeds_the_estimate(run_cli, tmp_path):
    """``jnp.sum`` over bf16[4096,4096] on v5e:1x1 (issue 48): XLA:TPU's cross-program prefetch of the
    32 MiB argument into VMEM is a row at 32 MiB ÷ the HBM copy rate, and the roofline counts that HBM read
    once (41.0 µs), not XLA's 5 × (205 µs), so it stays under the estimate (54.9 µs)."""
    from helpers import write

    write(tmp_path, "m.py", "import jax.numpy as jnp\n\n\ndef f(a):\n    return jnp.sum(a)\n")
    spec = write(tmp_path, "s.stagetool.yaml", "version: 1\nmesh: {axes: {data: 1}}\nfunctions:\n"
                                               "  total:\n    target: m.py:f\n    args: ['bf16[4096,4096]']\n")
    cost = _step(run_cli("cost", "--spec", str(spec), "--topology", "v5e:1x1", "--format", "json", check=0))
    array, v5e = 4096 * 4096 * 2, CHIPS["tpu-v5e"]
    st, roof = cost["step_time"], cost["roofline"]
    [row] = [i for i in st["top"] if i["opcode"] == "copy-start"]
    assert row["kind"] == "cross-program prefetch (HBM → VMEM)" and row["bytes_accessed"] == array
    assert row["seconds"] == pytest.approx(array / v5e.hbm_copy_bytes_per_second)
    assert roof["on_chip_bytes"] == 4 * array
    assert roof["bytes_accessed_per_device"] == pytest.approx(array, rel=1e-3)
    assert roof["lower_bound_seconds"] == pytest.approx(array / v5e.hbm_bandwidth_bytes_per_second, rel=1e-3)
    assert array / v5e.hbm_bandwidth_bytes_per_second <= roof["lower_bound_seconds"] <= st["schedule_seconds"]
    text = run_cli("cost", "--spec", str(spec), "--topology", "v5e:1x1", check=0).stdout
    assert "less 128 MiB it counts for arrays in on-chip VMEM" in " ".join(text.split())
