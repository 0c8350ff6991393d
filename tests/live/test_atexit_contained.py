"""Issue 47, item 4: an ``atexit`` handler the staged code registers does not outlive the staging.

``atexit.register(os._exit, 0)`` in a staged function (or a module imported while staging) used to
run when the caller's interpreter ended: a pytest session with a failing test exited 0, a script's
own exit status was replaced. The unit tests drive :func:`caller_atexit` without JAX; the slow ones
run the caller as a child process (``stagetool.inspect`` in a script, the fixture in a pytest
session) and read its exit status.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from atexit import register as bound_register

import pytest

from helpers import REPO, write
from stagetool.process.exit_handlers import caller_atexit


def _handler():
    pass


def test_a_handler_registered_while_staging_is_dropped_and_named():
    seen = []
    before = atexit._ncallbacks()
    notes: list[str] = []
    with caller_atexit(notes):
        assert atexit.register(os._exit, 0) is os._exit  # as atexit.register answers
        got = atexit.register(_handler)
        line = sys._getframe().f_lineno - 1
        assert got is _handler
        atexit.unregister(seen.append)  # nothing of the caller's is touched
    assert atexit._ncallbacks() == before
    assert atexit.register is atexit.__dict__["register"] and atexit.register.__module__ == "atexit"
    assert notes[0].startswith("an atexit handler (os._exit) registered at ") and "was dropped" in notes[0], notes
    assert notes[1].startswith(f"an atexit handler ({__name__}._handler) registered at {__file__}:{line} ")
    assert len(notes) == 2


def test_the_callers_own_handler_stays_and_staged_unregister_cannot_remove_it():
    atexit.register(_handler)
    try:
        before = atexit._ncallbacks()
        with caller_atexit():
            atexit.unregister(_handler)  # the staged code's unregister: only its own list
        assert atexit._ncallbacks() == before
    finally:
        atexit.unregister(_handler)


def test_a_thread_started_while_staging_is_contained_after_and_another_thread_is_not():
    before = atexit._ncallbacks()
    go, done = threading.Event(), threading.Event()

    def late():
        go.wait(10)
        atexit.register(os._exit, 3)  # after the staging ended
        done.set()

    with caller_atexit():
        t = threading.Thread(target=late)
        t.start()
    go.set()
    done.wait(10)
    t.join(10)
    assert atexit._ncallbacks() == before
    atexit.register(_handler)  # the caller's, once no staged thread runs: the real one
    try:
        assert atexit._ncallbacks() == before + 1
        assert atexit.register is atexit.__dict__["register"] and atexit.register.__module__ == "atexit"
    finally:
        atexit.unregister(_handler)


def test_one_bound_before_the_staging_reaches_the_process_and_is_named():
    notes: list[str] = []
    with caller_atexit(notes):
        bound_register(_handler)
    atexit.unregister(_handler)
    assert notes == ["1 atexit handler(s) registered while staging, through an atexit.register bound before it, "
                     "will run when this process ends"]


MODEL = """\
import atexit
import os

import jax.numpy as jnp



def step(x):
    atexit.register(os._exit, int(os.environ["EXIT_CODE"]))
    return jnp.tanh(x).sum()
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_ADDOPTS", "JAX_NUM_CPU_DEVICES")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), "."]), JAX_PLATFORMS="cpu", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               STAGETOOL_NO_CACHE="1", **extra)
    return env


@pytest.mark.slow
def test_inspect_leaves_the_callers_exit_status_as_it_was(tmp_path):
    write(tmp_path, "model.py", MODEL)
    write(tmp_path, "caller.py", """\
        import sys
        import jax
        import jax.numpy as jnp
        import stagetool
        from model import step

        stagetool.inspect(step, jax.ShapeDtypeStruct((8,), jnp.float32))
        sys.exit(5)
    """)
    r = subprocess.run([sys.executable, "caller.py"], cwd=tmp_path, env=_env(EXIT_CODE="7"),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 5, (r.returncode, r.stderr[-2000:])


@pytest.mark.slow
def test_a_pytest_session_with_a_failing_test_still_fails(tmp_path):
    write(tmp_path, "conftest.py", "import os\nos.environ.setdefault('JAX_PLATFORMS', 'cpu')\n")
    write(tmp_path, "model.py", MODEL)
    write(tmp_path, "test_m.py", """\
        import jax
        import jax.numpy as jnp
        from model import step


        def test_step(stagetool_snapshot):
            stagetool_snapshot(step, jax.ShapeDtypeStruct((8,), jnp.float32))
            assert False, "fails after staging"
    """)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "stagetool.live.pytest_plugin", "--stagetool-update"], cwd=tmp_path, env=_env(EXIT_CODE="0"),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, (r.returncode, r.stdout[-2000:])
    assert "1 failed" in r.stdout
