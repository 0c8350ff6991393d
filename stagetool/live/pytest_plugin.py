"""The pytest plugin (entry point ``pytest11``: ``stagetool``): snapshot a function's facts beside
the test, and fail the test when they regress.

::

    def test_train_step(stagetool_snapshot):
        report = stagetool_snapshot(train_step, params, batch, mesh="data=2,model=4", donate=0)
        assert_no_collective(report, "all-gather", axis="data")

The first run (and any run with ``--stagetool-update``) records
``__stagetool__/<test file>/<test>.<function>.json`` beside the test file: the CI gate's snapshot
(:mod:`stagetool.gate.snapshot`; ``stagetool diff`` reads it). Later runs stage the function again
and compare (:func:`stagetool.gate.compare.compare`, ``stagetool check``'s rules and tolerances): a
regression fails the test with its causes listed first. A missing snapshot fails too, saying how to
record it, so that a CI run never passes on nothing. ``--stagetool-isolate`` stages each call in a
worker process of its own (see :func:`stagetool.inspect`'s ``isolate``).

Loading the plugin imports neither JAX nor stagetool's pipeline: that happens at the first call.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

SNAPSHOT_FOLDER = "__stagetool__"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("stagetool", "stagetool snapshots of staged JAX functions")
    group.addoption("--stagetool-update", action="store_true", default=False,
                    help="record the stagetool_snapshot fixture's snapshots anew (the tests pass unless a function "
                         "fails to stage)")
    group.addoption("--stagetool-isolate", action="store_true", default=False,
                    help="stage each stagetool_snapshot call in a worker process of its own")


class StagetoolSnapshot:
    """What the ``stagetool_snapshot`` fixture gives: call it as :func:`stagetool.inspect`.

    Attributes:
      folder: where this test's snapshots are (``__stagetool__/<test file stem>`` beside the test).
      update: ``--stagetool-update`` was given.
      isolate: ``--stagetool-isolate`` was given.
    """

    def __init__(self, test_path: Path, test_name: str, update: bool, isolate: bool) -> None:
        self.folder = test_path.parent / SNAPSHOT_FOLDER / test_path.stem
        self.test_name = test_name
        self.update = update
        self.isolate = isolate

    def path(self, function: str) -> Path:
        """The snapshot file of ``function`` in this test."""
        return self.folder / f"{_safe(self.test_name)}.{_safe(function)}.json"

    def __call__(self, fn: Any, *args: Any, **options: Any) -> Any:
        """Stage ``fn(*args, **kwargs)`` (:func:`stagetool.inspect`'s arguments and options) and
        compare its snapshot with the recorded one.

        Returns:
          The :class:`stagetool.report.model.Report`, for more assertions.

        Raises (as test failures):
          ``pytest.fail``: a regression (the comparison's text, causes first), or no snapshot yet.
          UsageError, SpecError, StagingError: as :func:`stagetool.inspect`: a function that fails
            to stage is never a pass.
        """
        from stagetool.gate.compare import compare
        from stagetool.gate.render import render_text
        from stagetool.gate.snapshot import load_snapshot, snapshot_from_report, write_snapshot
        from stagetool.live import _caller, run_inspect

        isolate = options.pop("isolate", False) or self.isolate
        report = run_inspect(fn, args, {k: v for k, v in options.items() if k not in _INSPECT_OPTIONS},
                             loc=_caller(sys._getframe(1)), isolate=isolate,
                             **{k: v for k, v in options.items() if k in _INSPECT_OPTIONS})
        name = report.function().name
        path = self.path(name)
        now = snapshot_from_report(report)
        if self.update:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_snapshot(path, now)
            return report
        if not path.exists():
            pytest.fail(f"stagetool: no snapshot of {name} yet ({path}); record it with pytest --stagetool-update",
                        pytrace=False)
        before = load_snapshot(path)
        cmp = compare(before, now, title="stagetool snapshot", before_label=str(path), after_label="now",
                      only=[name], order=[name])
        if int(cmp.exit_code()) != 0:
            pytest.fail(f"stagetool: {name} regressed against {path}\n{render_text(cmp, width=120)}\n"
                        "If the change is intended, record it with pytest --stagetool-update", pytrace=False)
        return report


#: The keyword options of stagetool.inspect the fixture passes on (the rest are the function's kwargs).
_INSPECT_OPTIONS = frozenset({"mesh", "topology", "platform", "slices", "donate", "static", "out_shardings", "chip",
                              "device_memory", "peak", "top", "explain", "name", "timeout_s"})


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


@pytest.fixture
def stagetool_snapshot(request: Any) -> StagetoolSnapshot:
    """Stage a function as :func:`stagetool.inspect` does and compare its facts with the snapshot
    recorded beside the test (``--stagetool-update`` records it anew); see :class:`StagetoolSnapshot`."""
    return StagetoolSnapshot(Path(str(request.node.path)), request.node.name,
                             request.config.getoption("stagetool_update"),
                             request.config.getoption("stagetool_isolate"))
