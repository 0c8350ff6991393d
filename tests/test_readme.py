"""The README's commands run as written: its quick-start block, in order, each exiting 0."""

from __future__ import annotations

import re
import shlex
import shutil

import pytest
from helpers import REPO


def readme_block(after: str) -> list[str]:
    """The `stagetool ...` lines of the first ```sh block after the line ``after``, comments dropped."""
    text = (REPO / "README.md").read_text()
    block = re.search(re.escape(after) + r"\s*```sh\n(.*?)```", text, re.S)
    assert block, f"no ```sh block after {after!r} in README.md"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.startswith("stagetool ")]


@pytest.mark.slow
def test_the_quick_start_commands_run(run_cli, tmp_path, monkeypatch):
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    commands = readme_block("Then:")
    assert len(commands) == 8
    for line in commands:
        argv = shlex.split(line)[1:]
        out_file = None
        if ">" in argv:
            out_file = tmp_path / argv[argv.index(">") + 1]
            argv = argv[: argv.index(">")]
        r = run_cli(*argv)
        assert r.code == 0, f"{line}\n{r.stderr}"
        if out_file is not None:
            out_file.write_text(r.stdout)
    assert (tmp_path / "stagetool.lock.json").exists()
    assert (tmp_path / "report.md").read_text().startswith("## `train_step`")


def test_ci_runs_exactly_the_readmes_test_command():
    text = (REPO / "README.md").read_text()
    block = re.search(r"Install and run the tests.*?```sh\n(.*?)\n```", text, re.S)
    assert block and "\n" not in block.group(1), "the README's test command is one line"
    command = block.group(1)
    assert command.endswith(".venv/bin/python tests/matrix.py")
    ci = [ln for ln in (REPO / ".ci/run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert command in ci
