"""The GitHub Action's script (action/gate.sh) runs the gate on examples/mlp.py without GitHub:
snapshot writes the baseline, the HTML report and the Markdown summary; check passes on the same
code and fails (exit 1, the cause in the summary) after a sharding edit. action.yml and
.pre-commit-hooks.yaml run that script and those commands."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from helpers import EXAMPLES, REPO


def _gate(folder, command, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GITHUB_STEP_SUMMARY")}
    full.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", NO_COLOR="1", STAGETOOL_COMMAND=command,
                STAGETOOL=f"{sys.executable} -m stagetool", STAGETOOL_OUTPUT_DIR=str(folder / "out"), **env)
    return subprocess.run(["bash", str(REPO / "action" / "gate.sh")], cwd=folder, env=full, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_the_actions_script_runs_the_gate_on_the_example(tmp_path):
    shutil.copy(EXAMPLES / "mlp.py", tmp_path / "mlp.py")
    shutil.copy(EXAMPLES / "mlp.stagetool.yaml", tmp_path / "stagetool.yaml")
    out = tmp_path / "out"

    r = _gate(tmp_path, "snapshot")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "stagetool.lock.json").is_file()
    page = (out / "stagetool-report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "train_step" in page
    summary = (out / "summary.md").read_text()
    assert summary.startswith("## stagetool snapshot: stagetool.lock.json") and "train_step" in summary

    r = _gate(tmp_path, "check", GITHUB_STEP_SUMMARY=str(tmp_path / "step-summary.md"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "stagetool-check.html").read_text().startswith("<!DOCTYPE html>")
    assert "0 failing changes" in (tmp_path / "step-summary.md").read_text() or \
        "no changes" in (tmp_path / "step-summary.md").read_text().lower()

    spec = tmp_path / "stagetool.yaml"
    spec.write_text(spec.read_text().replace("['params/w1$', [null, model]]", "['params/w1$', [model, null]]"))
    r = _gate(tmp_path, "check", GITHUB_STEP_SUMMARY=str(tmp_path / "step-summary.md"))
    assert r.returncode == 1, r.stdout + r.stderr
    summary = (tmp_path / "step-summary.md").read_text()
    assert "the rule at stagetool.yaml:" in summary and "w1" in summary, summary
    assert (out / "stagetool-junit.xml").is_file()


def test_action_yml_runs_the_script_and_uploads_the_report():
    action = yaml.safe_load((REPO / "action.yml").read_text())
    assert action["runs"]["using"] == "composite"
    steps = action["runs"]["steps"]
    gate = next(s for s in steps if s.get("id") == "gate")
    assert 'bash "$GITHUB_ACTION_PATH/action/gate.sh"' in gate["run"]
    assert gate["env"]["STAGETOOL_COMMAND"] == "${{ inputs.command }}"
    upload = next(s for s in steps if "upload-artifact" in s.get("uses", ""))
    assert upload["if"] == "always()" and upload["with"]["path"] == gate["env"]["STAGETOOL_OUTPUT_DIR"]
    assert steps[-1]["run"] == 'exit "${{ steps.gate.outputs.exit-code }}"'   # the verdict after the upload
    hooks = {h["id"]: h for h in yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())}
    assert hooks["stagetool-check"]["entry"] == "stagetool check" and not hooks["stagetool-check"]["pass_filenames"]
    assert hooks["stagetool-snapshot"]["entry"] == "stagetool snapshot"
