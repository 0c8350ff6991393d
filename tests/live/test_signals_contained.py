"""Issue 42: what the staged function does to the process's signals is contained alike in every mode.

A function (or a module imported while staging) that installs SIGINT/SIGTERM handlers and arms an
alarm or an interval timer changes nothing the caller sees: after ``stagetool.inspect`` (in process
and ``isolate=True``), the ``stagetool_snapshot`` fixture (in process and ``--stagetool-isolate``) and
the CLI, the caller's handlers are the ones before (``signal.getsignal``), no timer is pending, SIGINT
still raises ``KeyboardInterrupt``, and the report names what was set and where. A SIGINT arriving
while staging does what it does to the caller. Each run is a child process with a bound on its
time: a regression (a handler that swallows SIGINT, an alarm that kills the process) cannot take this
session with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, run_subprocess, signals_at_default, write

pytestmark = pytest.mark.slow  # each test starts a child process

MODEL = """\
import os
import signal
import sys
import time
from signal import alarm as bound_alarm, signal as bound_signal  # bound before any staging

import jax.numpy as jnp

if os.environ.get("HANDLER_AT_IMPORT"):
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))


def swallow(signum, frame):
    print("swallowed", signum, flush=True)


def installs(x):
    signal.signal(signal.SIGINT, swallow)
    signal.signal(signal.SIGTERM, swallow)
    signal.alarm(1)
    signal.setitimer(signal.ITIMER_VIRTUAL, 0.5)
    return x * 2


def installs_bound(x):
    bound_signal(signal.SIGINT, swallow)
    bound_alarm(2)  # left armed, it would end the caller with SIGALRM two seconds later
    return x + 1


def interrupted(x):
    signal.signal(signal.SIGINT, swallow)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    return x - 1
"""

CALLER = """\
import json, os, signal, sys, time
import jax, jax.numpy as jnp
import stagetool, model


def main():
    isolate = sys.argv[1] == "isolated"
    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGHUP)
    out = {}
    for name in ("installs", "installs_bound"):
        before = {s: signal.getsignal(s) for s in SIGNALS}
        report = stagetool.inspect(getattr(model, name), jax.ShapeDtypeStruct((8,), jnp.float32), isolate=isolate)
        after = {s: signal.getsignal(s) for s in SIGNALS}
        timers = [signal.getitimer(w) for w in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL)]
        out[name] = {"same": before == after, "alarm": signal.alarm(0), "itimer": timers,
                     "notes": [n for n in report.functions[0].notes if "handler" in n or "timer" in n or "alarm" in n]}
    try:
        stagetool.inspect(model.interrupted, jax.ShapeDtypeStruct((8,), jnp.float32), isolate=isolate)
        out["interrupted"] = "returned"
    except KeyboardInterrupt:
        out["interrupted"] = "KeyboardInterrupt"
    except stagetool.StagingError as e:
        out["interrupted"] = "StagingError: " + str(e)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(3)  # an alarm left armed would end the process here
        out["sigint"] = "swallowed"
    except KeyboardInterrupt:
        out["sigint"] = "KeyboardInterrupt"
    print("RESULT", json.dumps(out))


if __name__ == "__main__":
    main()
"""


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]), JAX_PLATFORMS="cpu", **extra)
    return env


@pytest.mark.parametrize("mode", ["in-process", "isolated"])
def test_inspect_keeps_the_callers_handlers_and_timers(tmp_path, mode):
    write(tmp_path, "model.py", MODEL)
    write(tmp_path, "caller.py", CALLER)
    with signals_at_default():  # the caller's SIGINT at its default also when the suite runs as `cmd &`
        r = subprocess.run([sys.executable, "caller.py", mode], cwd=tmp_path, capture_output=True, text=True,
                           timeout=180, env=_env(tmp_path))
    assert r.returncode == 0 and "RESULT" in r.stdout, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    got = json.loads(r.stdout.split("RESULT", 1)[1])
    for name in ("installs", "installs_bound"):
        assert got[name]["same"], got
        assert got[name]["alarm"] == 0 and got[name]["itimer"] == [[0.0, 0.0], [0.0, 0.0]], got
    installs, bound = got["installs"]["notes"], got["installs_bound"]["notes"]
    # what went through the signal module never reached the process; the report names it and its line
    assert any(n.startswith("a SIGINT handler set at model.py:13 was not installed") for n in installs), installs
    assert any(n.startswith("a SIGTERM handler set at model.py:13 was not installed") for n in installs), installs
    assert any(n.startswith("an alarm (signal.alarm(1)) armed at model.py:20 was not armed") for n in installs)
    assert any(n.startswith("ITIMER_VIRTUAL timer (0.5 s) armed at model.py:21 was not armed") for n in installs)
    # what reached it through functions bound before the staging is undone, and said
    assert any(n.startswith("a SIGINT handler (set at model.py:13) was installed while staging; the caller's is "
                            "restored") for n in bound), bound
    assert any("ITIMER_REAL timer was armed while staging" in n and "cancelled" in n for n in bound), bound
    # a SIGINT while staging does what it does to the caller (the worker's KeyboardInterrupt is raised here)
    assert got["interrupted"] == "KeyboardInterrupt", got
    assert got["sigint"] == "KeyboardInterrupt", got
    assert "swallowed" not in r.stdout


CONFTEST = """\
import os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.config.update("jax_num_cpu_devices", 2)
"""

TESTS = """\
import os
import signal
import time

import jax.numpy as jnp

import model


def test_installs(stagetool_snapshot):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    stagetool_snapshot(model.installs, jnp.zeros(4))
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.alarm(0) == 0 and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    except KeyboardInterrupt:
        return
    raise AssertionError("SIGINT was swallowed")
"""


@pytest.mark.parametrize("mode", ["in-process", "isolated"])
def test_the_fixture_keeps_the_callers_handlers_and_timers(tmp_path, mode):
    write(tmp_path, "conftest.py", CONFTEST)
    write(tmp_path, "model.py", MODEL)
    write(tmp_path, "test_signals.py", TESTS)
    env = _env(tmp_path, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    with signals_at_default():
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                            "stagetool.live.pytest_plugin", "--stagetool-update",
                            *(["--stagetool-isolate"] if mode == "isolated" else [])],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


SPEC = "functions:\n  f: {target: model.py:installs, args: ['f32[8]']}\n"


def test_the_cli_keeps_its_handlers_and_a_module_that_installs_one_at_import_stages(tmp_path):
    """In the CLI user code runs in the command's thread, where ``signal.signal`` would raise: a module
    that installs a handler at import stages there as in process, and the note names the line."""
    write(tmp_path, "model.py", MODEL)
    spec = write(tmp_path, "s.stagetool.yaml", SPEC)
    r = run_subprocess("shardings", "--spec", spec, "--format", "json", cwd=tmp_path,
                       env={"HANDLER_AT_IMPORT": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])})
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    notes = json.loads(r.stdout)["functions"][0]["notes"]
    assert any(n.startswith("a SIGTERM handler set at model.py:10 was not installed") for n in notes), notes
    assert any(n.startswith("a SIGINT handler set at model.py:13 was not installed") for n in notes), notes
    assert any(n.startswith("an alarm (signal.alarm(1)) armed at model.py:20") for n in notes), notes


SLEEPER = """\
import pathlib
import signal
import time


def sleeps(x):
    signal.signal(signal.SIGTERM, lambda s, f: None)
    pathlib.Path("staging").write_text("1")
    time.sleep(60)
    return x
"""


def test_sigterm_while_the_cli_stages_still_ends_the_run(tmp_path):
    """The staged function's SIGTERM handler never displaces the CLI's: SIGTERM ends the run, 143."""
    write(tmp_path, "sleeper.py", SLEEPER)
    spec = write(tmp_path, "s.stagetool.yaml", "functions:\n  f: {target: sleeper.py:sleeps, args: ['f32[8]']}\n")
    env = _env(tmp_path, COLUMNS="120", NO_COLOR="1")
    with signals_at_default():
        proc = subprocess.Popen([sys.executable, "-m", "stagetool", "shardings", "--spec", str(spec)],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "staging").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "staging").exists(), proc.communicate(timeout=30)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, (proc.returncode, out[-2000:], err[-2000:])
    assert "terminated (SIGTERM)" in err
