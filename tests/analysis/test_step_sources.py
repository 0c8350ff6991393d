"""Issue 48: step time "by source of the figure" sums to the step: the kernels' sources, the
collectives' model and the time their overlap hides add up to the step as scheduled."""

from __future__ import annotations

import math

import pytest

from stagetool.core.units import format_seconds


@pytest.mark.parametrize("example", ["mlp", "transformer"])
def test_the_step_time_by_source_sums_to_the_step(run_cli_shared, example):
    target = f"examples/{example}.py:train_step"
    doc = run_cli_shared("cost", target, "--chip", "tpu-v5e", "--format", "json", check=0).json()
    e = doc["functions"][0]["cost"]["step_time"]
    kernels = sum(v for _, v in e["sources"])
    assert math.isclose(kernels, e["compute_seconds"], rel_tol=1e-9)
    assert e["collective_seconds"] > 0  # both examples all-reduce: the line needs the collectives' term
    hidden = e["serial_seconds"] - e["schedule_seconds"]
    assert math.isclose(kernels + e["collective_seconds"] - hidden, e["schedule_seconds"], rel_tol=1e-9)
    text = " ".join(run_cli_shared("cost", target, "--chip", "tpu-v5e", check=0).stdout.split())
    line = text.split("step time by source of the figure: ", 1)[1].split(" (the step as scheduled)", 1)[0]
    assert f"collective model {format_seconds(e['collective_seconds'])}" in line
    assert line.endswith(f"= {'at least ' if e['lower_bound'] else ''}{format_seconds(e['schedule_seconds'])}")
