"""Issue 47, item 5: what ``stagetool calibrate`` writes, its own loader reads back; what the loader
would refuse is found before any benchmark.

The round trip writes a profile with the writer (:func:`stagetool.measure.calibrate.profile_yaml`,
from benchmark results made here, so no benchmark runs) and loads it with the loader the spec uses
(``chips:`` through :func:`stagetool.spec.parse.parse_spec`, then :func:`merge_chips`): every figure
written as a key comes back equal; a figure the loader refuses (a kernel overhead measured as 0, a
rate no chip can have) is a comment saying why, not a key that makes the file unloadable.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stagetool.core.chips import merge_chips
from stagetool.core.errors import UsageError
from stagetool.measure.calibrate import (BenchmarkResult, Calibration, check_profile_name, profile_name_for,
                                         profile_yaml)
from stagetool.measure.timing import Timing
from stagetool.spec.parse import parse_spec


def _result(name: str, key: str | None, rate: float, unit: str = "byte") -> BenchmarkResult:
    t = Timing(1e-3, 0.9e-3, 1.2e-3, 0.3, 10, 1, 2)
    return BenchmarkResult(name, key, f"{name} shape", rate * 1e-3, unit, t, rate)


def _calibration(chip: str, kind: str = "TPU v5 lite", platform: str = "tpu", overhead: float = 0.0) -> Calibration:
    results = (
        _result("matmul_bf16", "matmul_flops_per_second.bf16", 1.7986e14, "FLOP"),
        _result("matmul_f32", "matmul_flops_per_second.f32", 1.5589e14, "FLOP"),
        _result("matmul_f32_highest", "matmul_flops_per_second.f32_highest", 1e-30, "FLOP"),  # no chip's rate
        _result("hbm_copy", "hbm_copy_bytes_per_second", 6.2277e11),
        _result("elementwise", "elementwise_bytes_per_second", 6.5098e11),
        _result("kernel_overhead", "kernel_overhead_seconds", overhead, "second"),  # clamped at 0: noise
        _result("dispatch", None, 2e-5, "second"),
    )
    return Calibration(chip, kind, platform, 1, {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": None},
                       "2026-12-06", f"stagetool calibrate --name {chip} -o x.yaml", results,
                       ("one device: collectives not measured",))


def _load(text: str) -> dict:
    """The profile as the spec's chips: loader reads it (file:line problems raise SpecError)."""
    spec = parse_spec("functions: {f: m.py:f}\n" + text, file="p.yaml", base_dir=Path("/base"))
    table = merge_chips(spec.chips)
    return {"raw": spec.chips, "table": table}


@pytest.mark.parametrize("name", ["tpu-v5e", "my-npu", "npu2.b+c_d"])
def test_what_the_writer_writes_the_loader_reads_back(name):
    cal = _calibration(name)
    text = profile_yaml(cal)
    got = _load(text)
    (entry,) = got["raw"].values()
    chip = got["table"][name]
    # every key written is a figure the loader kept, equal to the measured rate (4 significant digits)
    assert chip.matmul_rate("bf16") == pytest.approx(1.7986e14, rel=1e-4)
    assert dict(chip.matmul_flops_per_second)["f32"] == pytest.approx(1.5589e14, rel=1e-4)
    assert chip.hbm_copy_bytes_per_second == pytest.approx(6.2277e11, rel=1e-4)
    assert chip.elementwise_bytes_per_second == pytest.approx(6.5098e11, rel=1e-4)
    assert dict(chip.profile)["measured_on"] == "TPU v5 lite"
    # what it would refuse is a comment with the reason, not a key
    assert "kernel_overhead_seconds" not in entry and "f32_highest" not in entry["matmul_flops_per_second"]
    assert "# kernel_overhead_seconds: 0.0000e+00 not written: measured as 0, within the timing's noise" in text
    assert "# f32_highest: 1.0000e-30 not written: 1e-30 is outside what one chip's figure can be" in text
    if name == "tpu-v5e":  # the table's own figures stand where the profile gave none
        assert chip.kernel_overhead_seconds == 1e-6


def test_a_measured_overhead_is_written_and_read_back():
    chip = _load(profile_yaml(_calibration("my-npu", overhead=2.5e-6)))["table"]["my-npu"]
    assert chip.kernel_overhead_seconds == pytest.approx(2.5e-6, rel=1e-4)


@pytest.mark.parametrize("bad", ["a#b", "a: b", "", "  ", "x" * 65, "-lead", "tpu v5e", "é"])
def test_a_name_the_loader_would_misread_is_refused(bad):
    with pytest.raises(UsageError, match="a chip name is 1 to 64 of a-z, 0-9"):
        check_profile_name(bad)


def test_names_are_lower_case_and_the_attached_chip_must_be_the_named_table_chip():
    assert check_profile_name(" My-NPU ") == "my-npu"
    assert profile_name_for(None, "TPU v5 lite") == "tpu-v5e"
    assert profile_name_for("my-h100", "NVIDIA H100 80GB HBM3") == "my-h100"
    with pytest.raises(UsageError, match=r"--name tpu-v5e: the attached device is a NVIDIA H100 80GB HBM3 \(h100-sxm\)"):
        profile_name_for("tpu-v5e", "NVIDIA H100 80GB HBM3")
    with pytest.raises(UsageError, match="not in the chip table"):
        profile_name_for(None, "cpu")


def test_the_cpu_profile_loads(tmp_path):
    """A profile of the CPU backend (--cpu-for-tests: no device kind in the table) under a name of its own."""
    cal = _calibration("test-cpu", kind="cpu", platform="cpu", overhead=1e-7)
    text = profile_yaml(cal)
    assert yaml.safe_load(text)["chips"]["test-cpu"]["profile"]["measured_on"] == "cpu"
    assert _load(text)["table"]["test-cpu"].kernel_overhead_seconds == pytest.approx(1e-7, rel=1e-4)


@pytest.mark.parametrize("args,says", [
    (("--name", "a#b"), "--name 'a#b': a chip name is"),
    (("--name", "npu", "-o", "/nonexistent-folder/p.yaml"), "--output /nonexistent-folder/p.yaml: cannot write: the "
                                                            "folder /nonexistent-folder does not exist"),
])
def test_calibrate_refuses_a_bad_name_or_output_before_any_benchmark(run_cli, args, says):
    r = run_cli("calibrate", "--cpu-for-tests", "--repeats", "3", *args, check=2)
    assert says in r.stderr and "calibrating" not in r.stderr and "matmul_bf16" not in r.stderr


def test_the_calibrate_texts_name_only_options_a_command_has():
    """Item 9: ``profile_yaml``'s docstring named ``--chips FILE``, which no command has."""
    import re

    import typer.main

    import stagetool.cli.commands.calibrate as command
    import stagetool.measure.calibrate as measure
    from stagetool.cli import app

    group = typer.main.get_command(app)
    have = {o for c in group.commands.values() for p in c.params for o in (*p.opts, *p.secondary_opts)}
    for module in (measure, command):
        text = Path(module.__file__).read_text()
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", text))
        assert named <= have, (module.__name__, named - have)


def test_calibrate_refuses_a_table_chips_name_for_a_device_that_is_not_it(run_cli, tmp_path):
    """Gap 1: on the CPU backend (no table chip) ``--name tpu-v5e`` wrote the CPU's rates under the TPU's
    name (exit 0, ``measured_on: "cpu"``); now exit 2 naming ``--name`` before any benchmark, no file."""
    out = tmp_path / "v5e.yaml"
    r = run_cli("calibrate", "--cpu-for-tests", "--repeats", "3", "--warmup", "1", "--name", "tpu-v5e", "-o", out,
                check=2)
    assert ("--name tpu-v5e: tpu-v5e is a chip of the table and the attached device is a cpu (not a tpu-v5e)"
            in r.stderr), r.stderr
    assert "--name my-cpu" in r.stderr and "calibrating" not in r.stderr and not out.exists()
    assert profile_name_for("my-cpu", "cpu") == "my-cpu"  # a name of its own is the way
    with pytest.raises(UsageError, match="--name tpu-v4: tpu-v4 is a chip of the table and the attached device is "
                                         "a Some NPU 2"):
        profile_name_for("tpu-v4", "Some NPU 2")


def test_the_loader_refuses_a_cpu_measured_profile_under_a_tpus_name_at_its_line(run_cli, tmp_path):
    """Gap 1: a profile the writer made on the CPU, put under ``tpu-v5e`` in a spec, timed every v5e program
    at the CPU's rates (``cost --chip tpu-v5e``: exit 0, an 8.70 ms step for the MLP); now exit 2 at the
    ``measured_on`` line, before any compile. Under a name of its own it loads."""
    text = profile_yaml(_calibration("tpu-v5e", kind="cpu", platform="cpu", overhead=1e-7))
    spec = (Path(__file__).parents[2] / "examples" / "mlp.stagetool.yaml").read_text()
    (tmp_path / "mlp.py").write_text((Path(__file__).parents[2] / "examples" / "mlp.py").read_text())
    path = tmp_path / "mlp.stagetool.yaml"
    path.write_text(spec + text)
    line = 1 + (spec + text).splitlines().index('      measured_on: "cpu"')
    r = run_cli("cost", "--spec", path, "--chip", "tpu-v5e", check=2)
    assert (f"mlp.stagetool.yaml:{line}:20: chips.tpu-v5e.profile.measured_on: 'cpu' is the CPU backend, not a "
            "tpu-v5e: a profile measured on another device; name it for what it measured (chips.my-cpu, then "
            "--chip my-cpu), or calibrate on a tpu-v5e") in " ".join(r.stderr.split()), r.stderr
    assert "Traceback" not in r.stderr and "compile" not in r.stdout
    own = _load(profile_yaml(_calibration("my-cpu", kind="cpu", platform="cpu", overhead=1e-7)))["table"]["my-cpu"]
    assert dict(own.profile)["measured_on"] == "cpu"


def test_a_profile_under_a_table_chips_name_must_say_what_it_was_measured_on():
    with pytest.raises(Exception) as e:
        _load("chips:\n  tpu-v5e:\n    hbm_copy_bytes_per_second: 6.0e+11\n    profile: {date: '2026-12-06'}\n")
    assert e.value.issues == [
        "p.yaml:5:14: chips.tpu-v5e.profile: no measured_on: a profile under a table chip's name records the device "
        "kind it was measured on (what `stagetool calibrate` writes, e.g. measured_on: TPU v5 lite); add it, or give "
        "the figures without a profile:"]
    # without a profile: the user's figures (provenance "user"); a kind the table does not know is refused too
    assert _load("chips:\n  tpu-v5e: {hbm_copy_bytes_per_second: 6.0e+11}\n")["table"]["tpu-v5e"]
    with pytest.raises(Exception, match="'Some NPU 2' is a device kind the chip table does not know, not a tpu-v5e"):
        _load("chips:\n  tpu-v5e:\n    clock_hz: 1.0e+9\n    profile: {measured_on: Some NPU 2}\n")
