"""The run's chip is one value decided once (issue 50): ``--chip``, else a compile-only target's own
chip, else the attached device's (:func:`stagetool.plan.plan.run_chip`), carried on the device setup
and read alike by the roofline, the step-time estimate, the modules roll-up and the memory capacity,
with its source shown where the report names the chip."""

from __future__ import annotations

import pytest
from helpers import EXAMPLES, REPO  # noqa: F401
from test_examples import _in_repo  # noqa: F401 - the fixture runs in the repo

from stagetool.core.chips import CHIPS, RunChip
from stagetool.devices import tpu_topology as topology
from stagetool.plan.options import Options
from stagetool.plan.plan import make_plan, run_chip

MLP = str(EXAMPLES / "mlp.py") + ":train_step"


def _plan(**options):
    return make_plan(Options(target=MLP, **options))


def test_the_chip_comes_from_chip_else_the_topology_else_the_attached_device():
    assert run_chip(_plan(chip="tpu-v5e"), "cpu", "cpu") == RunChip(CHIPS["tpu-v5e"], "--chip")
    assert run_chip(_plan(topology="v5e:2x4"), "tpu", "TPU v5 lite") == RunChip(CHIPS["tpu-v5e"],
                                                                                "topology v5e:2x4")
    assert run_chip(_plan(topology="h100:8"), "gpu", "NVIDIA H100 80GB HBM3") == RunChip(CHIPS["h100-sxm"],
                                                                                         "topology h100:8")
    # an attached accelerator: its device_kind names the chip
    assert run_chip(_plan(), "tpu", "TPU v5 lite") == RunChip(CHIPS["tpu-v5e"], "device TPU v5 lite")
    # --chip wins over the device (and over a target, where check_chip_for_target allows it)
    assert run_chip(_plan(chip="tpu-v6e"), "tpu", "TPU v5 lite").source == "--chip"
    # the CPU mesh without --chip, or a device the table does not know: no chip (and no roofline, no step time)
    assert run_chip(_plan(), "cpu", "cpu") is None
    assert run_chip(_plan(), "gpu", "Some Future GPU") is None


def test_the_spec_chips_entry_gives_the_figures_of_the_chip_the_topology_chose(tmp_path):
    (tmp_path / "m.py").write_text((EXAMPLES / "mlp.py").read_text())
    spec = (EXAMPLES / "mlp.stagetool.yaml").read_text()
    (tmp_path / "m.stagetool.yaml").write_text(spec.replace("mlp.py", "m.py")
                                               + "\nchips:\n  tpu-v5e:\n    hbm_bandwidth_bytes_per_second: 1.0e12\n")
    plan = make_plan(Options(target=f"{tmp_path / 'm.py'}:train_step", topology="v5e:2x4"))
    chosen = run_chip(plan, "tpu", "TPU v5 lite")
    assert chosen.source == "topology v5e:2x4" and chosen.spec_figures
    assert chosen.chip.hbm_bandwidth_bytes_per_second == 1.0e12 != CHIPS["tpu-v5e"].hbm_bandwidth_bytes_per_second
    assert chosen.chip.peak_flops_per_second_bf16 == CHIPS["tpu-v5e"].peak_flops_per_second_bf16
    assert chosen.describe() == "from topology v5e:2x4; figures from the spec's chips:"


@pytest.mark.skipif(not topology.libtpu_available(), reason="libtpu not installed: pip install -e '.[tpu]'")
def test_a_topology_without_chip_gives_the_roofline_step_time_and_modules_on_its_chip(run_cli_shared):
    """The issue's case: ``--topology v5e:2x4`` without ``--chip`` gave a step time on tpu-v5e and a
    null roofline while the text said "the roofline uses them"."""
    doc = run_cli_shared("report", "examples/mlp.py:train_step", "--topology", "v5e:2x4", "--modules",
                         "--format", "json", check=0).json()
    f = doc["functions"][0]
    cost, chip = f["cost"], CHIPS["tpu-v5e"]
    assert cost["chip_source"] == "from topology v5e:2x4"
    r = cost["roofline"]
    assert r is not None and r["chip"] == "tpu-v5e" == cost["step_time"]["chip"] == f["modules"]["chip"]
    # the roofline's terms from the chip table's figures and the loop-aware per-device cost, independently
    la = cost["loop_aware"]
    assert r["compute_seconds"] == pytest.approx(la["flops"] / chip.peak_flops_per_second_bf16, rel=1e-12)
    # the roofline's bytes are those through HBM: XLA's bytes accessed less what it counts for arrays in
    # on-chip VMEM (issue 48)
    hbm_bytes = la["bytes_accessed"] - r["on_chip_bytes"]
    assert r["bytes_accessed_per_device"] == hbm_bytes
    assert r["memory_seconds"] == pytest.approx(hbm_bytes / chip.hbm_bandwidth_bytes_per_second, rel=1e-12)
    assert r["lower_bound_seconds"] == max(r["compute_seconds"], r["memory_seconds"])
    text = run_cli_shared("report", "examples/mlp.py:train_step", "--topology", "v5e:2x4", check=0).stdout
    assert "roofline estimate on tpu-v5e (bf16, from topology v5e:2x4)" in text
    assert "step time on tpu-v5e (estimate, from topology v5e:2x4)" in text


def test_the_cpu_mesh_with_chip_names_its_source_for_the_roofline_step_time_and_capacity(run_cli_shared):
    f = run_cli_shared("report", "examples/mlp.py:train_step", "--chip", "tpu-v5e", "--format", "json",
                       check=0).json()["functions"][0]
    assert f["cost"]["chip_source"] == "from --chip"
    assert f["cost"]["roofline"]["chip"] == f["cost"]["step_time"]["chip"] == "tpu-v5e"
    # the CPU device reports no capacity: the run's chip gives it, and says which and why
    assert f["memory"]["capacity_bytes"] == CHIPS["tpu-v5e"].hbm_capacity_bytes
    assert f["memory"]["capacity_source"] == "chip table (tpu-v5e, from --chip)"
