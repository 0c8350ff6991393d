"""Hostile input, round 4 (issue 42): the stagetool_snapshot fixture fails closed.

Each test runs a small pytest project in a child process with a bound on its time (a regression
that hangs or ends the process cannot take this session with it), and reads each test's outcome
from its JUnit XML:

* a snapshot path planted as a symbolic link to a file outside the snapshot folder is refused, and
  that file is left as it was (``--stagetool-update`` wrote through the link);
* a snapshot file without the function's entry fails, saying ``pytest --stagetool-update``;
* two calls of one function in one test, and parametrize ids ``a b`` / ``a-b``, get a snapshot
  each: unchanged code passes;
* a bad snapshot fails with a short message and the pytest hint, no internal traceback;
* what the staged function does to the process is contained alike in process and with
  ``--stagetool-isolate``: a thread it started that calls ``os._exit(0)`` after staging; a fork (the
  child ends at once, the parent is not held); a fork-based ``multiprocessing.Process`` and ``Pool``
  (their children run their targets and end: no refusal reaches them); a mesh
  built at import on the caller's simulated devices (the worker sets them up as ``conftest.py``
  did).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from helpers import REPO, write

CONFTEST = """\
import os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.config.update("jax_num_cpu_devices", 8)
"""

MODEL = """\
import jax.numpy as jnp


def step(w, x):
    return jnp.tanh(x @ w).sum()
"""

TESTS = """\
import jax
import jax.numpy as jnp
import pytest

from model import step


def _args(n):
    return jax.ShapeDtypeStruct((16, 8), jnp.float32), jax.ShapeDtypeStruct((n, 16), jnp.float32)


def test_twice(stagetool_snapshot):
    stagetool_snapshot(step, *_args(4))
    stagetool_snapshot(step, *_args(8))


@pytest.mark.parametrize("n", [pytest.param(4, id="a b"), pytest.param(8, id="a-b")])
def test_ids(stagetool_snapshot, n):
    stagetool_snapshot(step, *_args(n))


def test_link(stagetool_snapshot):
    stagetool_snapshot(step, *_args(4))


def test_other_entry(stagetool_snapshot):
    stagetool_snapshot(step, *_args(4))


def test_bad(stagetool_snapshot):
    stagetool_snapshot(step, *_args(4))
"""


def _pytest(folder, *args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    xml = folder / "junit.xml"
    start = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                            "stagetool.live.pytest_plugin", f"--junitxml={xml}", *args], cwd=folder, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the test project ran past {timeout} s (a hang):\n{e.stdout}\n{e.stderr}")
    outcomes = {}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            failed = case.find("failure") if case.find("failure") is not None else case.find("error")
            outcomes[case.get("name")] = ("failed", (failed.get("message") or "") + "\n" + (failed.text or "")) \
                if failed is not None else ("passed", "")
        xml.unlink()
    return r, outcomes, time.monotonic() - start


@pytest.mark.slow
def test_the_fixture_writes_no_link_records_every_call_and_fails_on_a_missing_or_bad_entry(tmp_path):
    write(tmp_path, "conftest.py", CONFTEST)
    write(tmp_path, "model.py", MODEL)
    write(tmp_path, "test_model.py", TESTS)
    folder = tmp_path / "__stagetool__" / "test_model"
    folder.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious.txt"
    precious.write_text("the user's own file\n")
    (folder / "test_link.step.json").symlink_to(precious)

    r, got, _ = _pytest(tmp_path, "--stagetool-update")
    assert precious.read_text() == "the user's own file\n", "--stagetool-update wrote through a symlink"
    assert (folder / "test_link.step.json").is_symlink()
    assert got["test_link"][0] == "failed" and "symbolic link" in got["test_link"][1], got
    for name in ("test_twice", "test_ids[a b]", "test_ids[a-b]", "test_other_entry", "test_bad"):
        assert got[name][0] == "passed", (name, got[name], r.stdout[-3000:])
    files = sorted(p.name for p in folder.iterdir() if not p.is_symlink())
    assert len(files) == 6, files  # twice (2 calls), two ids, other_entry, bad: a file each

    other = folder / "test_other_entry.step.json"
    doc = json.loads(other.read_text())
    doc["functions"] = {"not_step": doc["functions"]["step"]}
    other.write_text(json.dumps(doc))
    (folder / "test_bad.step.json").write_text("{ this is not JSON")

    r, got, _ = _pytest(tmp_path)
    assert r.returncode == 1
    for name in ("test_twice", "test_ids[a b]", "test_ids[a-b]"):
        assert got[name][0] == "passed", (name, got[name])  # unchanged code passes: no shared snapshot
    status, text = got["test_other_entry"]
    assert status == "failed" and "no snapshot of step" in text and "pytest --stagetool-update" in text, text
    status, text = got["test_bad"]
    assert status == "failed" and "pytest --stagetool-update" in text, text
    assert "Traceback" not in text and "stagetool snapshot --spec" not in text and len(text.strip().splitlines()) <= 6, \
        text


PROCESS_MODEL = """\
import multiprocessing
import os
import threading
import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)  # at import: 8 devices


def step(w, x):
    return jnp.tanh(x @ w).sum()


def exits_later(x):
    def later():
        time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=later).start()
    return x * 2


def forks(x):
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)  # a child that would run on (or hold the parent)
        os._exit(0)
    os.waitpid(pid, 0)
    return x * 2


def forks_process(x):
    p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.1,))
    p.start()
    p.join()  # its os._exit ends it: no refusal reaches a child
    return x + 1


def forks_pool(x):
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.map(abs, [-1, -2, 3]) == [1, 2, 3]
    return x + 1
"""

PROCESS_TESTS = """\
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import model


def test_exits_later(stagetool_snapshot):
    stagetool_snapshot(model.exits_later, jnp.zeros(4))
    assert False, "the test fails after staging"


def test_mesh_at_import(stagetool_snapshot):
    w = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(model.MESH, P(None, "model")))
    stagetool_snapshot(model.step, w, jax.ShapeDtypeStruct((4, 16), jnp.float32))


def test_forks(stagetool_snapshot):
    stagetool_snapshot(model.forks, jnp.zeros(4))


def test_forks_process(stagetool_snapshot):
    stagetool_snapshot(model.forks_process, jnp.zeros(4))


def test_forks_pool(stagetool_snapshot):
    stagetool_snapshot(model.forks_pool, jnp.zeros(4))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in-process", "isolated"])
def test_what_the_staged_function_does_to_the_process_is_contained(tmp_path, mode):
    write(tmp_path, "conftest.py", CONFTEST)
    write(tmp_path, "model.py", PROCESS_MODEL)
    write(tmp_path, "test_process.py", PROCESS_TESTS)
    r, got, seconds = _pytest(tmp_path, "--stagetool-update", *(["--stagetool-isolate"] if mode == "isolated" else []))
    # the thread's os._exit(0) after staging neither ends pytest with 0 nor hides the failing test
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert got["test_exits_later"][0] == "failed" and "the test fails after staging" in got["test_exits_later"][1]
    for name in ("test_mesh_at_import", "test_forks", "test_forks_process", "test_forks_pool"):
        assert got[name][0] == "passed", (name, got[name], r.stderr[-3000:])
    assert seconds < 200, seconds  # no child held the parent (each would sleep an hour)


def test_two_tests_that_would_share_a_snapshot_file_fail_naming_both(tmp_path, monkeypatch):
    """Methods of two classes in one file are both ``test_x``: their snapshots would be one file."""
    import stagetool.live as live
    from stagetool.live.pytest_plugin import StagetoolSnapshot

    class Staged(Exception):
        pass

    def staged(*a, **k):
        raise Staged()

    monkeypatch.setattr(live, "run_inspect", staged)
    owners: dict = {}
    test_file = tmp_path / "test_m.py"
    first = StagetoolSnapshot(test_file, "test_x", False, False, owners, "test_m.py::TestA::test_x")
    second = StagetoolSnapshot(test_file, "test_x", False, False, owners, "test_m.py::TestB::test_x")

    def step(x):
        return x

    with pytest.raises(Staged):
        first(step, 1)
    with pytest.raises(pytest.fail.Exception, match=r"test_m.py::TestB::test_x \(call 1 of step\) and "
                                                    r"test_m.py::TestA::test_x \(call 1 of step\) would share the "
                                                    r"snapshot file .*test_x.step.json"):
        second(step, 1)
    with pytest.raises(Staged):  # a second call in one test has a file of its own
        first(step, 2)
    assert first.path("step", 2).name == "test_x.step.2.json"
