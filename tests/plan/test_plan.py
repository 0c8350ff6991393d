"""Every usage error before the first trace: ``make_plan`` resolves and checks all options at once.

Each bad option is driven through the real CLI entry point; spies count what ran after the plan:
device provisioning, the trace (``lowering.stages.stage``) and ``jax.stages.Lowered.compile``.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import jax
import pytest

import stagetool.staging.stages as stages_mod
import stagetool.pipeline as pipeline
from helpers import REPO, isolated_imports, run_cli  # noqa: F401 - fixtures

MLP = str(REPO / "examples" / "mlp.py") + ":train_step"


@pytest.fixture
def ran(monkeypatch):
    """Names of what ran past the plan, in order: ``provision``, ``trace``, ``compile``."""
    calls: list[str] = []

    def spy(name, real):
        def wrapper(*a, **k):
            calls.append(name)
            return real(*a, **k)
        return wrapper

    monkeypatch.setattr(pipeline, "provision_devices", spy("provision", pipeline.provision_devices))
    monkeypatch.setattr(stages_mod, "stage", spy("trace", stages_mod.stage))
    monkeypatch.setattr(jax.stages.Lowered, "compile", spy("compile", jax.stages.Lowered.compile))
    return calls


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder where creating a file really fails. Tests may run as root, for whom a 0o555 folder is
    writable (and ``os.access`` says yes everywhere): then /sys, where root cannot create files."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    for folder in (ro, Path("/sys")):
        try:
            (folder / "probe").write_text("x")
        except OSError:
            return folder
        (folder / "probe").unlink()
    pytest.skip("no folder here refuses a new file (root on a writable /sys)")


@pytest.mark.parametrize("args, message", [
    (["memory", MLP, "--no-peak", "--device-memory", "12XB"], "--device-memory 12XB: invalid size '12XB'"),
    (["memory", MLP, "--no-peak", "--device-memory", "0"], "--device-memory 0: the memory of a device must be more"),
    (["cost", MLP, "--chip", "tpu-v99"], "--chip tpu-v99: unknown chip 'tpu-v99'"),
    (["cost", MLP, "--chip", "h100"], "unknown chip 'h100': did you mean h100-pcie or h100-sxm?"),
    # a GPU typo is answered as one, before libtpu (no TPU kinds only, no libtpu message)
    (["memory", MLP, "--no-peak", "--topology", "h10:8"], "unknown topology kind 'h10' in 'h10:8': did you mean h100:8?"),
    # an A100's memory is never assumed: 40 GB and 80 GB parts exist, only a100-80gb is a target
    (["memory", MLP, "--no-peak", "--topology", "a100:8"], "GPU 'a100' in topology 'a100:8' is ambiguous"),
    (["collectives", MLP, "--explain", "(["], "--explain '([' is a bad regular expression"),
    (["shardings", MLP, "-o", "{tmp}/missing/x.txt"], "--output {tmp}/missing/x.txt: cannot write: the folder"),
    (["report", MLP, "-o", "{tmp}"], "--output {tmp}: cannot write: {tmp} is a folder"),
    (["report", MLP, "--jobs", "0"], "--jobs 0: give at least 1"),
    (["lower", MLP, "--dialect", "mlir"], "--dialect 'mlir' must be 'stablehlo' or 'hlo'"),
    (["snapshot", MLP, "-o", "{tmp}/missing/lock.json"], "--output {tmp}/missing/lock.json: cannot write"),
    (["check", MLP, "--update", "-b", "{file}/lock.json"], "--baseline {file}/lock.json: cannot write: {file} is not"),
    (["check", MLP, "--update", "-b", "{tmp}/lock.json", "--junit-xml", "{ro}/j.xml"],
     "--junit-xml {ro}/j.xml: cannot write: cannot create a file in {ro}"),
    (["shardings", MLP, "--cache-dir", "{file}"], "--cache-dir {file}: not a folder"),
    # an unwritable cache folder the user named is not silently ignored (it was: exit 0, no cache)
    (["shardings", MLP, "--cache-dir", "{ro}/cache"], "--cache-dir {ro}/cache: cannot write: cannot create a file in {ro}"),
    (["sweep", MLP, "--mesh", "2x4", "--chip", "tpu-v99"], "--chip tpu-v99: unknown chip"),
    (["sweep", MLP, "--mesh", "2x4", "-o", "{tmp}/missing/s.txt"], "--output {tmp}/missing/s.txt: cannot write"),
])
def test_a_bad_option_is_exit_2_before_anything_is_staged(run_cli, ran, tmp_path, args, message):
    file = tmp_path / "a-file"
    file.write_text("x")
    where = {"tmp": str(tmp_path), "file": str(file)}
    if any("{ro}" in a for a in args):
        where["ro"] = str(_unwritable_folder(tmp_path))
    r = run_cli(*(a.format(**where) for a in args))
    assert r.code == 2, r.stderr
    assert message.format(**where) in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert ran == []  # no devices provisioned, no trace, no compile


def test_a_gpu_topology_typo_names_the_gpu_targets_and_a100_names_its_only_target(run_cli, ran):
    r = run_cli("memory", MLP, "--no-peak", "--topology", "h10:8")
    assert r.code == 2 and "libtpu" not in r.stderr and "Invalid TPU" not in r.stderr
    assert "GPU targets" in r.stderr and "a100-80gb, h100, h100-pcie, h200, b200" in r.stderr and "v5e" in r.stderr
    r = run_cli("memory", MLP, "--no-peak", "--topology", "a100:8")
    assert r.code == 2 and "40 GB and 80 GB" in r.stderr and "a100-80gb:N" in r.stderr
    assert ran == []


def test_a_sweep_reports_its_bad_options_at_once_before_any_worker_starts(run_cli, ran):
    r = run_cli("sweep", MLP, "--mesh", "2x4,4x2", "--chip", "tpu-v99", "--device-memory", "12XB")
    assert r.code == 2 and "--chip tpu-v99" in r.stderr and "--device-memory 12XB" in r.stderr
    assert ran == []


def test_several_bad_options_are_reported_at_once(run_cli, ran, tmp_path):
    r = run_cli("report", MLP, "--jobs", "0", "--chip", "tpu-v99", "--device-memory", "12XB",
                "-o", str(tmp_path / "missing" / "r.txt"))
    assert r.code == 2
    assert "4 problems, nothing was staged" in r.stderr
    for part in ("--jobs 0", "--chip tpu-v99", "--device-memory 12XB", f"--output {tmp_path / 'missing' / 'r.txt'}"):
        assert part in r.stderr
    assert ran == []


def test_an_option_problem_and_a_spec_problem_are_reported_together(run_cli, ran, tmp_path):
    r = run_cli("cost", MLP, "--chip", "tpu-v99", "--mesh", "3x3x3")
    assert r.code == 2 and "2 problems" in r.stderr and "--chip tpu-v99" in r.stderr and "3x3x3" in r.stderr
    assert ran == []


def test_an_explain_pattern_naming_no_leaf_is_found_before_lowering(run_cli, ran):
    """Checked against the input leaves' key paths once the inputs are built: devices are up, but
    nothing is traced or compiled."""
    r = run_cli("collectives", MLP, "--explain", "w9", "--explain", "w[12]")
    assert r.code == 2
    assert "--explain 'w9' names no input leaf of train_step" in r.stderr and "w[12]" not in r.stderr
    assert ran == ["provision"]


def test_explain_patterns_are_regular_expressions_over_key_paths_or_their_last_parts():
    from stagetool.plan.selectors import leaf_patterns

    paths = ["params/w1", "params/w2", "params/b1", "x"]
    names = {p.text: [x for x in paths if p.names(x)]
             for p in leaf_patterns(("w1", "w[12]", "params/b1", "/x", "params/.*", "1"))}
    assert names == {"w1": ["params/w1"], "w[12]": ["params/w1", "params/w2"], "params/b1": ["params/b1"],
                     "/x": ["x"], "params/.*": ["params/w1", "params/w2", "params/b1"], "1": []}


def test_the_plan_is_typed_and_resolved(tmp_path):
    """What make_plan hands on: a Chip (the spec's chips: merged), bytes, compiled patterns."""
    from stagetool.core.chips import CHIPS

    plan = pipeline.make_plan(pipeline.Options(target=MLP, chip="TPU-v5e", device_memory="16GiB",
                                               explain=("w1",), jobs=2, outputs=(("--output", tmp_path / "r"),)))
    assert plan.chip is CHIPS["tpu-v5e"]
    assert plan.device_memory_bytes == 16 * 2**30
    assert [p.text for p in plan.explain] == ["w1"] and plan.explain[0].names("params/w1")
    assert plan.jobs == 2 and not (tmp_path / "r").exists() and os.listdir(tmp_path) == []


def test_no_pipeline_helper_takes_both_the_plan_and_the_options():
    import stagetool.plan.plan as plan_module

    for module in (pipeline, plan_module):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__:
                params = set(inspect.signature(fn).parameters)
                assert not {"plan", "options"} <= params, name
