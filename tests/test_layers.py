"""The package layering (pyproject's import-linter contracts): imports go only down the data flow,
no sibling modules import each other in a cycle, and the records staging hands analysis (``facts``)
and everything that reads them (analysis, report, gate) never import JAX."""

from __future__ import annotations

import shutil
import subprocess
import sys

from helpers import REPO


def lint_imports(root) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``stagetool`` package found in ``root`` (its pyproject's contracts)."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_layers_contract_holds():
    r = lint_imports(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 kept, 0 broken" in r.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The contract is live: the analysis importing the report (an upward import) fails it."""
    shutil.copytree(REPO / "stagetool", tmp_path / "stagetool", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    cost = tmp_path / "stagetool" / "analysis" / "cost.py"
    cost.write_text(cost.read_text() + "\n\ndef _upward():\n    from stagetool.report import model  # noqa: F401\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0
    assert "stagetool.analysis.cost -> stagetool.report.model" in r.stdout


def test_a_jax_import_in_analysis_breaks_the_contract(tmp_path):
    """The JAX-free contract is live: analysis importing jax, even inside a function, fails it."""
    shutil.copytree(REPO / "stagetool", tmp_path / "stagetool", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    cost = tmp_path / "stagetool" / "analysis" / "cost.py"
    cost.write_text(cost.read_text() + "\n\ndef _jax():\n    import jax  # noqa: F401\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0
    assert "hlo, facts, analysis, report and gate are JAX-free BROKEN" in r.stdout
    assert "stagetool.analysis.cost -> jax" in r.stdout
