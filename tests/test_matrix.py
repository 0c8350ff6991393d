"""tests/matrix.py's choice of parallel workers (the README's test command): ``-n`` from the CPUs or
``STAGETOOL_TEST_WORKERS``, never over the caller's own choice."""

from __future__ import annotations

import os
import sys

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tests"))
import matrix  # noqa: E402

sys.path.remove(str(REPO / "tests"))


def test_workers_default_to_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.delenv("STAGETOOL_TEST_WORKERS", raising=False)
    assert matrix.workers() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("STAGETOOL_TEST_WORKERS", "3")
    assert matrix.workers() == 3
    monkeypatch.setenv("STAGETOOL_TEST_WORKERS", "0")
    assert matrix.workers() == 1
    monkeypatch.setenv("STAGETOOL_TEST_WORKERS", "two")
    with pytest.raises(SystemExit, match="STAGETOOL_TEST_WORKERS='two' is not a whole number"):
        matrix.workers()


@pytest.mark.parametrize(("user_args", "want"), [
    ([], ["-n", "2", "--dist", "loadfile"]),
    (["-x", "-k", "golden"], ["-n", "2", "--dist", "loadfile"]),
    (["-n", "4"], []), (["-n4"], []), (["--numprocesses=4"], []), (["--dist", "load"], []),
    (["-p", "no:xdist"], []), (["-pno:xdist"], []), (["--pdb"], []), (["-s"], []),
])
def test_parallel_args_leave_the_callers_choice_alone(user_args, want):
    # this interpreter has pytest-xdist (the test extra)
    assert matrix.parallel_args(sys.executable, user_args, n=2) == want


def test_one_worker_or_no_xdist_runs_serially(tmp_path):
    assert matrix.parallel_args(sys.executable, [], n=1) == []
    no_xdist = tmp_path / "python"  # an interpreter where `import xdist` fails
    no_xdist.write_text("#!/bin/sh\nexit 1\n")
    no_xdist.chmod(0o755)
    assert matrix.parallel_args(str(no_xdist), [], n=2) == []


def test_a_leg_set_up_in_the_background_keeps_its_error_and_output(monkeypatch):
    monkeypatch.setattr(matrix, "find_python", lambda version: None)
    leg = matrix.Leg("jaxnone", "3.99", ("jax==0.0.1", "jaxlib==0.0.1"))
    setup = matrix.prepare_quietly(leg)
    assert setup.python is None and setup.seconds >= 0 and setup.output == ""
    assert setup.error.startswith("no Python 3.99 on this machine for jax 0.0.1")


@pytest.mark.parametrize(("user_args", "whole"), [
    ([], True), (["-n", "4"], True), (["-v", "--tb=short"], True),
    (["-k", "golden"], False), (["-m", "not slow"], False), (["-x"], False), (["--fast"], False),
    (["tests/test_api.py"], False), (["--maxfail=3"], False), (["--lf"], False),
])
def test_only_a_whole_suite_run_replaces_the_durations_table(user_args, whole):
    assert matrix.whole_suite(user_args) is whole


def test_write_durations_replaces_the_table_and_names_the_costly_files(tmp_path, capsys, monkeypatch):
    recorded = tmp_path / "recorded.json"
    recorded.write_text('{"total_cpu_s": 12.5, "files": {"tests/test_a.py": [10.0, 20.0, 2]},\n'
                        '"tests": {"tests/test_a.py::test_big": [9.5, 15.0], "tests/test_a.py::test_small": [0.5, 5.0]}}\n')
    table = tmp_path / "sub" / "durations.json"
    table.parent.mkdir()
    monkeypatch.setattr(matrix, "REPO", tmp_path)  # the table's name is said relative to the checkout
    matrix.write_durations(recorded, table)
    assert table.read_text() == recorded.read_text()
    out = capsys.readouterr().out
    assert "wrote sub/durations.json: 2 tests, 12 CPU s; 1 over the fast lane's 0.75 CPU s" in out
    assert "10.0 CPU s" in out and "tests/test_a.py" in out


# ---- the fast lane and the durations table (tests/durations.py) ---------------------------------

sys.path.insert(0, str(REPO / "tests"))
import durations  # noqa: E402

sys.path.remove(str(REPO / "tests"))


class _Item:
    def __init__(self, nodeid: str, *markers: str):
        self.nodeid, self.markers = nodeid, markers

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


class _Config:
    def __init__(self, fast: bool):
        self.fast, self.deselected = fast, []
        self.hook = self

    def getoption(self, name: str):
        return self.fast if name == "fast" else None

    def pytest_deselected(self, items):
        self.deselected += items


def test_the_fast_lane_leaves_out_marked_tests_and_those_over_budget_in_the_table(tmp_path, monkeypatch):
    table = tmp_path / "durations.json"
    over = durations.FAST_BUDGET_S + 0.5
    table.write_text(durations.dumps({"tests": {"t.py::heavy": [over, over * 3], "t.py::light": [0.2, 9.0]}}))
    monkeypatch.setattr(durations, "TABLE", table)
    items = [_Item("t.py::heavy"), _Item("t.py::light"), _Item("t.py::new"), _Item("t.py::compiles", "slow"),
             _Item("t.py::hosts", "multiprocess")]
    config = _Config(fast=True)
    durations.fast_lane(config, items)
    assert [i.nodeid for i in items] == ["t.py::light", "t.py::new"]  # wall time does not count; a new test runs
    assert [i.nodeid for i in config.deselected] == ["t.py::heavy", "t.py::compiles", "t.py::hosts"]
    assert config._stagetool_fast == (2, 2, 1)
    everything = [_Item("t.py::heavy"), _Item("t.py::compiles", "slow")]
    durations.fast_lane(_Config(fast=False), everything)
    assert len(everything) == 2


def test_the_table_in_the_repository_reads_and_lists_one_test_a_line():
    text = durations.TABLE.read_text()
    cpu = durations.read_table()
    assert len(cpu) > 500 and all(v >= 0 for v in cpu.values())
    assert sum(1 for line in text.splitlines() if line.startswith('  "tests/')) >= len(cpu)
    assert "CPU seconds" in text  # it says how it was measured


@pytest.mark.slow
def test_recorded_durations_hold_each_test_with_its_cpu_and_wall_seconds(tmp_path):
    """``--record-durations`` through pytest itself, under two xdist workers (the figures travel from
    the workers in the reports)."""
    import json
    import subprocess

    out = tmp_path / "d.json"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "tests/core/test_codec.py", "tests/core/test_dtypes.py",
                        f"--record-durations={out}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:]
    doc = json.loads(out.read_text())
    assert set(doc["files"]) == {"tests/core/test_codec.py", "tests/core/test_dtypes.py"}
    assert len(doc["tests"]) == sum(n for _, _, n in doc["files"].values()) >= 40
    assert all(cpu >= 0 and wall >= 0 for cpu, wall in doc["tests"].values())
    assert doc["total_cpu_s"] > 0 and "2 pytest worker(s)" in doc["machine"]


@pytest.mark.slow
def test_the_fast_lane_keeps_tests_of_every_package():
    """tests/ mirrors stagetool/ (a folder per package), and ``--fast`` keeps tests in each folder."""
    import collections
    import subprocess

    r = subprocess.run([sys.executable, "-m", "pytest", "--fast", "--collect-only", "-q", "-p", "no:xdist"], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:]
    kept = collections.Counter(line.split("/")[1] for line in r.stdout.splitlines()
                               if line.startswith("tests/") and "::" in line and line.count("/") >= 2)
    packages = sorted(p.name for p in (REPO / "stagetool").iterdir() if (p / "__init__.py").exists())
    assert len(packages) >= 15
    assert not [p for p in packages if not (REPO / "tests" / p).is_dir()], "a package without its tests/ folder"
    assert not [p for p in packages if kept[p] < 3], kept


# ---- tests/ laid out like the package ------------------------------------------------------------

#: The test files that stay at the top of tests/ by design, each with its reason (docs/contributing.md):
#: they test the repository as a whole, not one package of stagetool.
TOP_LEVEL_TESTS = {
    "test_api.py": "the public API's exports and types, across every package",
    "test_docs.py": "the documentation site and every example in it",
    "test_examples.py": "the shipped examples end to end (and the raw-JAX transformer reference others import)",
    "test_golden.py": "the golden files of every release (tests/golden)",
    "test_json_schema.py": "docs/json-schema.md against the report's types",
    "test_layers.py": "the import-linter contracts over the whole package",
    "test_matrix.py": "the test matrix, the durations table, the fast lane and this layout",
    "test_readme.py": "the README's commands and CI's test command",
}


def layout_problems(tests) -> list[str]:
    """What breaks the layout in the folder ``tests``: a ``test_*.py`` at its top beyond
    :data:`TOP_LEVEL_TESTS`, or two test files anywhere below it (``data/`` and ``golden/`` aside) that
    share a name (the folders have no ``__init__.py``: pytest would take the second for the first)."""
    problems = [f"tests/{name} is a test file at the top of tests/ beyond the {len(TOP_LEVEL_TESTS)} there by "
                "design: put it in the folder of the package it tests (docs/contributing.md)"
                for name in sorted(p.name for p in tests.glob("test_*.py")) if name not in TOP_LEVEL_TESTS]
    seen: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        if not {"golden", "data"} & set(path.relative_to(tests).parts[:-1]):
            seen.setdefault(path.name, []).append(path.relative_to(tests).as_posix())
    problems += [f"test files share the name {name}: {', '.join(paths)}" for name, paths in seen.items()
                 if len(paths) > 1]
    return problems


def test_no_new_flat_test_file_and_no_two_test_files_share_a_name(tmp_path):
    """tests/ is laid out like the package: only :data:`TOP_LEVEL_TESTS` at its top, unique names."""
    assert layout_problems(REPO / "tests") == []
    assert sorted(p.name for p in (REPO / "tests").glob("test_*.py")) == sorted(TOP_LEVEL_TESTS)
    for name in (*TOP_LEVEL_TESTS, "test_new.py", "cli/test_twin.py", "live/test_twin.py", "data/test_api.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    assert layout_problems(tmp_path) == [
        "tests/test_new.py is a test file at the top of tests/ beyond the 8 there by design: put it in the folder "
        "of the package it tests (docs/contributing.md)",
        "test files share the name test_twin.py: cli/test_twin.py, live/test_twin.py"]
