"""What each test costs, kept in ``tests/durations.json``, and the fast lane that reads it.

Hooks (called from ``tests/conftest.py``):

- ``--record-durations=PATH``: each test's CPU seconds (this process's user + system time over the
  test's setup, call and teardown, ``time.process_time``, every thread: XLA compiles on threads of
  its own; plus the child processes it started and waited for, ``resource.getrusage(RUSAGE_CHILDREN)``)
  and wall seconds, written to PATH as JSON when the session ends (by the controller under
  pytest-xdist: each worker hands its figures over in the report's ``user_properties``). CPU time is
  what the table ranks by: on a machine shared with others a test's wall time measures the others
  too, its CPU time much less so. ``tests/matrix.py`` writes ``tests/durations.json`` this way after
  a whole-suite run.
- ``--fast``: the fast lane. Deselects the tests marked ``slow`` or ``multiprocess`` and those the
  table says took more than :data:`FAST_BUDGET_S` CPU seconds (a test the table does not hold yet,
  a new one, stays in). ``pytest --fast -n 2`` is the command (docs/contributing.md).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from pathlib import Path

import pytest

#: The table the fast lane reads and ``tests/matrix.py`` refreshes.
TABLE = Path(__file__).resolve().parent / "durations.json"

#: A test over this many CPU seconds (setup, call and teardown, its child processes included) in
#: :data:`TABLE` is left out of the fast lane. 0.75 (1.0 before): of the lane's 150 CPU s in the
#: table at 1.0, 54 tests of 0.75-1 s held 47 s; without them the lane keeps 1,507 of 1,830 tests for
#: 103 s, which with two workers' collection (~5 CPU s each) fits 90 s on two cores (an estimate).
FAST_BUDGET_S = 0.75

#: Markers the fast lane deselects.
FAST_EXCLUDES = ("slow", "multiprocess")

_KEY = "stagetool_cpu_s"


def _cpu() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stagetool", "stagetool's test lanes (tests/durations.py)")
    group.addoption("--fast", action="store_true",
                    help=f"the fast lane: leave out tests marked {' or '.join(FAST_EXCLUDES)} and those over "
                         f"{FAST_BUDGET_S:g} CPU seconds in tests/durations.json")
    group.addoption("--record-durations", metavar="PATH", default=None,
                    help="write each test's CPU and wall seconds to PATH (JSON, as tests/durations.json)")


def read_table(path: Path | None = None) -> dict[str, float]:
    """``{node id: CPU seconds}`` from a table (:data:`TABLE` by default); empty when there is none."""
    try:
        doc = json.loads((path or TABLE).read_text())
    except FileNotFoundError:
        return {}
    return {node: row[0] for node, row in doc["tests"].items()}


def fast_lane(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--fast``: deselect (in place) what the fast lane leaves out, and say how many and why."""
    if not config.getoption("fast"):
        return
    cpu = read_table()
    keep, drop = [], []
    marked = over = 0
    for item in items:
        if any(item.get_closest_marker(m) for m in FAST_EXCLUDES):
            drop.append(item)
            marked += 1
        elif cpu.get(item.nodeid, 0.0) > FAST_BUDGET_S:
            drop.append(item)
            over += 1
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    config._stagetool_fast = (len(keep), marked, over)  # type: ignore[attr-defined]


def report_header(config: pytest.Config) -> str | None:
    if not config.getoption("fast"):
        return None
    return (f"fast lane: tests marked {' or '.join(FAST_EXCLUDES)} and those over {FAST_BUDGET_S:g} CPU s in "
            f"{TABLE.relative_to(TABLE.parents[1])} are left out")


def terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The fast lane's last line: what it kept and left out (under pytest-xdist the workers collect,
    so the controller says what the lane leaves out without the counts)."""
    if not config.getoption("fast"):
        return
    kept = getattr(config, "_stagetool_fast", None)
    if kept is not None:
        terminalreporter.write_line(f"fast lane: {kept[0]} tests kept; left out {kept[1]} marked "
                                    f"{' or '.join(FAST_EXCLUDES)}, {kept[2]} over {FAST_BUDGET_S:g} CPU s "
                                    "in tests/durations.json")
    else:
        terminalreporter.write_line(f"fast lane: left out the tests marked {' or '.join(FAST_EXCLUDES)} and those "
                                    f"over {FAST_BUDGET_S:g} CPU s in tests/durations.json (the whole suite: "
                                    "tests/matrix.py)")


# ---- recording ----------------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Adds the phase's CPU seconds to its report (the phase started at ``item._stagetool_cpu``)."""
    report = yield
    start = getattr(item, "_stagetool_cpu", None)
    if start is not None and item.config.getoption("record_durations"):
        report.user_properties = [*report.user_properties, (_KEY, _cpu() - start)]
    return report


def phase_starts(item: pytest.Item) -> None:
    item._stagetool_cpu = _cpu()  # type: ignore[attr-defined]


class Recorder:
    """Sums each test's phases (CPU from ``user_properties``, wall from ``report.duration``) and
    writes the table when the session ends."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.tests: dict[str, list[float]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        cpu = sum(v for k, v in report.user_properties if k == _KEY)
        row = self.tests.setdefault(report.nodeid, [0.0, 0.0])
        row[0] += cpu
        row[1] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.tests:
            return
        workers = getattr(session.config.option, "numprocesses", None) or 1
        files: dict[str, list[float]] = {}
        for node, (cpu, wall) in self.tests.items():
            f = files.setdefault(node.split("::")[0], [0.0, 0.0, 0])
            f[0] += cpu
            f[1] += wall
            f[2] += 1
        doc = {
            "how": ("CPU seconds of each test (setup + call + teardown: the pytest process's user + system "
                    "time, all threads, plus the child processes it waited for) and its wall seconds, "
                    "recorded by tests/durations.py (--record-durations); wall time depends on the "
                    "machine's other load, CPU time much less"),
            "machine": f"{os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}, "
                       f"{workers} pytest worker(s)",
            "recorded": time.strftime("%Y-%m-%d", time.gmtime()),
            "total_cpu_s": round(sum(c for c, _ in self.tests.values()), 1),
            "files": {f: [round(c, 2), round(w, 2), n] for f, (c, w, n) in
                      sorted(files.items(), key=lambda kv: (-kv[1][0], kv[0]))},
            "tests": {n: [round(c, 2), round(w, 2)] for n, (c, w) in
                      sorted(self.tests.items(), key=lambda kv: (-kv[1][0], kv[0]))},
        }
        self.path.write_text(dumps(doc))


def dumps(doc: dict) -> str:
    """The table as JSON with one file or test a line (a refreshed table diffs line by line)."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, dict):
            rows = [f"  {json.dumps(k, ensure_ascii=False)}: {json.dumps(v)}" for k, v in value.items()]
            lines.append(f"{json.dumps(key)}: {{\n" + ",\n".join(rows) + "\n}")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def configure(config: pytest.Config) -> None:
    path = config.getoption("record_durations")
    if path and not hasattr(config, "workerinput"):  # the controller (or a run without xdist) writes
        config.pluginmanager.register(Recorder(path), "stagetool-durations")
