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
