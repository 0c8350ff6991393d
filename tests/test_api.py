"""The Python API: the same report as the CLI, as typed records; importing it does not import JAX."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO


def test_api_returns_the_report_the_cli_renders(run_cli, monkeypatch):
    monkeypatch.chdir(REPO)
    import stagetool

    report = stagetool.analyze(stagetool.Options(target="examples/mlp.py:train_step", mesh="2x4"),
                               [stagetool.Section.SHARDINGS, stagetool.Section.COST])
    (fn,) = report.functions
    assert isinstance(fn, stagetool.FunctionReport) and isinstance(fn.inputs[0], stagetool.LeafReport)
    assert fn.memory is None and fn.collectives is None        # only what was asked for
    doc = run_cli("shardings", "examples/mlp.py:train_step", "--mesh", "2x4", "--format", "json", check=0).json()
    assert [x["compiled"] for x in doc["functions"][0]["inputs"]] == [str(x.compiled) for x in fn.inputs]  # the report holds structure; JSON holds its text
    assert fn.cost.per_device.flops > 0


def test_import_stagetool_does_not_import_jax():
    code = "import stagetool, sys; stagetool.Options; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
