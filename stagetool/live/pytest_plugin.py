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

import os
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

    Each call has a snapshot file of its own: ``<test>.<function>.json``, and for the n-th call of
    the same function in one test ``<test>.<function>.<n>.json``. A test name or parametrize id with
    characters other than ``A-Za-z0-9_.-`` gets a short hash of the exact name appended, so that ids
    ``a b`` and ``a-b`` never share a file; two calls that would still share one (``name=`` given
    twice) are an error naming both.

    Attributes:
      folder: where this test's snapshots are (``__stagetool__/<test file stem>`` beside the test).
      update: ``--stagetool-update`` was given.
      isolate: ``--stagetool-isolate`` was given.
    """

    def __init__(self, test_path: Path, test_name: str, update: bool, isolate: bool,
                 owners: dict[str, str] | None = None, nodeid: str | None = None) -> None:
        self.root = test_path.parent
        self.folder = test_path.parent / SNAPSHOT_FOLDER / test_path.stem
        self.test_name = test_name
        self.update = update
        self.isolate = isolate
        self._owners = owners if owners is not None else {}  # snapshot file → who uses it (this session)
        self._nodeid = nodeid or test_name
        self._calls: dict[str, int] = {}

    def path(self, function: str, call: int = 1) -> Path:
        """The snapshot file of the ``call``-th call of ``function`` in this test."""
        suffix = f".{call}" if call > 1 else ""
        return self.folder / f"{_safe(self.test_name)}.{_safe(function)}{suffix}.json"

    def __call__(self, fn: Any, *args: Any, **options: Any) -> Any:
        """Stage ``fn(*args, **kwargs)`` (:func:`stagetool.inspect`'s arguments and options) and
        compare its snapshot with the recorded one.

        Returns:
          The :class:`stagetool.report.model.Report`, for more assertions.

        Raises (as test failures):
          ``pytest.fail``: a regression (the comparison's text, causes first); no snapshot yet, or a
            snapshot file without this function's entry; a snapshot that does not read; a snapshot
            path that is a link or not this user's regular file (never written through); two
            calls that would share one snapshot file.
          UsageError, SpecError, StagingError: as :func:`stagetool.inspect`: a function that fails
            to stage is never a pass.
        """
        from stagetool.core.errors import BaselineError
        from stagetool.gate.compare import compare
        from stagetool.gate.render import render_text
        from stagetool.gate.snapshot import load_snapshot, snapshot_from_report
        from stagetool.live import function_label, run_inspect
        from stagetool.live.options import caller_loc

        isolate = options.pop("isolate", False)
        if not isinstance(isolate, bool):
            pytest.fail(f"stagetool: isolate={isolate!r} must be True or False", pytrace=False)
        isolate = isolate or self.isolate
        name = function_label(fn, options.get("name"))
        call = self._calls.get(name, 0) + 1
        self._calls[name] = call
        path = self.path(name, call)
        owner = f"{self._nodeid} (call {call} of {name})"
        key = str(path)
        if self._owners.setdefault(key, owner) != owner:
            pytest.fail(f"stagetool: {owner} and {self._owners[key]} would share the snapshot file {path}; "
                        "give the calls distinct names (name=...) or the tests distinct parametrize ids",
                        pytrace=False)
        report = run_inspect(fn, args, {k: v for k, v in options.items() if k not in _INSPECT_OPTIONS},
                             loc=caller_loc(sys._getframe(1)), isolate=isolate,
                             **{k: v for k, v in options.items() if k in _INSPECT_OPTIONS})
        name = report.function().name
        now = snapshot_from_report(report)
        if self.update:
            self._record(path, now)
            return report
        record = "record it with pytest --stagetool-update"
        if not os.path.lexists(path):
            pytest.fail(f"stagetool: no snapshot of {name} yet ({path}); {record}", pytrace=False)
        unread = None
        try:
            before = load_snapshot(path)
        except BaselineError as e:  # failed outside the except: no chained internal traceback
            unread = e.message.replace("the baseline", "the snapshot").replace("baseline ", "", 1)
        if unread is not None:
            pytest.fail(f"stagetool: the snapshot of {name} does not read: {unread}; {record} anew", pytrace=False)
        if name not in before.get("functions", {}):
            held = ", ".join(sorted(before.get("functions", {}))) or "none"
            pytest.fail(f"stagetool: no snapshot of {name} in {path} (it holds {held}); {record}", pytrace=False)
        cmp = compare(before, now, title="stagetool snapshot", before_label=str(path), after_label="now",
                      only=[name], order=[name])
        if int(cmp.exit_code()) != 0:
            pytest.fail(f"stagetool: {name} regressed against {path}\n{render_text(cmp, width=120)}\n"
                        "If the change is intended, record it with pytest --stagetool-update", pytrace=False)
        return report

    def _record(self, path: Path, snapshot: dict) -> None:
        """Write the snapshot: the folders made or checked one by one (real folders of this user,
        no links), the file written atomically at its own path, never through a link."""
        from stagetool.gate.snapshot import dumps
        from stagetool.process.fileio import FileProblem, owned_folder, write_atomic

        where = self.root
        try:
            for part in (SNAPSHOT_FOLDER, self.folder.name):
                where = where / part
                owned_folder(where)
            where = path
            write_atomic(path, dumps(snapshot), follow_symlinks=False)
        except FileProblem as e:
            pytest.fail(f"stagetool: {where} {e}; stagetool writes snapshots only to regular files and folders it "
                        "made or you own, never through a link: remove it and run pytest --stagetool-update again",
                        pytrace=False)
        except OSError as e:
            pytest.fail(f"stagetool: cannot write the snapshot {where}: {e.strerror or e}", pytrace=False)


#: The keyword options of stagetool.inspect the fixture passes on (the rest are the function's kwargs).
_INSPECT_OPTIONS = frozenset({"mesh", "topology", "platform", "slices", "donate", "static", "out_shardings", "chip",
                              "device_memory", "peak", "top", "explain", "name", "timeout_s", "context_mesh"})

_PLAIN = re.compile(r"[A-Za-z0-9_.-]+(\[[A-Za-z0-9_.-]*\])?")


def _safe(text: str) -> str:
    """``text`` as a file name part: other characters than ``A-Za-z0-9_.-`` become ``-``, and then
    (a name that lost something: ``a b``) a hash of the exact text is appended; ``test[a-b]`` stays
    ``test-a-b``, as before. Long names are cut, with the hash."""
    import hashlib

    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    if not _PLAIN.fullmatch(text) or len(safe) > 120:
        safe = f"{safe[:100]}-{digest}"
    return safe


_OWNERS = pytest.StashKey[dict]()


@pytest.fixture
def stagetool_snapshot(request: Any) -> StagetoolSnapshot:
    """Stage a function as :func:`stagetool.inspect` does and compare its facts with the snapshot
    recorded beside the test (``--stagetool-update`` records it anew); see :class:`StagetoolSnapshot`."""
    owners = request.config.stash.setdefault(_OWNERS, {})
    return StagetoolSnapshot(Path(str(request.node.path)), request.node.name,
                             request.config.getoption("stagetool_update"),
                             request.config.getoption("stagetool_isolate"), owners, request.node.nodeid)
