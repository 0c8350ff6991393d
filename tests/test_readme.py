"""The README's commands: its quick-start block, and the test command CI runs.

Every ``stagetool`` line of the README (and of the documentation site's pages) is run by
tests/test_docs.py, which also checks that the quick start writes the lock file and the Markdown
report; here, what is the README's alone."""

from __future__ import annotations

import re

from helpers import REPO


def readme_block(after: str) -> list[str]:
    """The `stagetool ...` lines of the first ```sh block after the line ``after``, comments dropped."""
    text = (REPO / "README.md").read_text()
    block = re.search(re.escape(after) + r"\s*```sh\n(.*?)```", text, re.S)
    assert block, f"no ```sh block after {after!r} in README.md"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.startswith("stagetool ")]


def test_the_quick_start_block_has_its_eight_commands():
    """The block tests/test_docs.py runs first: the commands people use most, in the order that
    lets ``check`` find the baseline ``snapshot`` writes."""
    commands = readme_block("Then:")
    assert len(commands) == 8
    assert [c.split()[1] for c in commands] == ["lower", "compile", "collectives", "cost", "memory", "report",
                                                 "snapshot", "check"]


def test_ci_runs_exactly_the_readmes_test_command():
    text = (REPO / "README.md").read_text()
    block = re.search(r"Install and run the tests.*?```sh\n(.*?)\n```", text, re.S)
    assert block and "\n" not in block.group(1), "the README's test command is one line"
    command = block.group(1)
    assert command.endswith(".venv/bin/python tests/matrix.py")
    ci = [ln for ln in (REPO / ".ci/run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert command in ci


def test_the_readme_is_short_and_starts_with_the_two_commands():
    """Issue 43: at most 250 lines, the install + main job and install + tests commands first."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    fences = re.findall(r"```sh\n(.*?)\n```", text, re.S)
    assert fences[0].endswith(".venv/bin/stagetool lower examples/mlp.py:train_step --mesh 2x4")
    assert fences[1].endswith(".venv/bin/python tests/matrix.py")
