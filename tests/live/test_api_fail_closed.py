"""Fail closed from Python: a function that exits (sys.exit, os._exit) or aborts its process never
gives a report; isolate=True stages in a worker process whose death is a StagingError."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from helpers import REPO, write

import stagetool
from stagetool.core.errors import StagingError, UsageError

PROGRAM = """\
import os

import jax.numpy as jnp


def step(w, x):
    return jnp.tanh(x @ w).sum()


def aborts(x):
    os.abort()


def exits_quietly(x):
    os._exit(0)
"""


def test_os_exit_in_the_function_is_a_staging_error_not_a_clean_exit(tmp_path):
    """In this process: os._exit(0) while staging raises instead of ending the caller with 0. Run in
    a child process, since a regression would end this test session with success."""
    write(tmp_path, "program.py", PROGRAM)
    code = ("import sys, jax.numpy as jnp, stagetool, program\n"
            "try:\n    stagetool.inspect(program.exits_quietly, jnp.zeros(4))\n"
            "except stagetool.StagingError as e:\n    print('raised:', e); sys.exit(7)\n"
            "print('returned a report'); sys.exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)]),
                            "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 7, r.stdout + r.stderr
    assert "os._exit(0) was called while stagetool staged the function" in r.stdout
    assert os._exit.__module__ in ("posix", "nt")  # this process's os._exit is the real one


@pytest.mark.slow
def test_isolated_gives_the_same_report_and_a_worker_that_aborts_is_a_staging_error(tmp_path, monkeypatch):
    write(tmp_path, "program.py", PROGRAM)
    monkeypatch.syspath_prepend(str(tmp_path))
    import program

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    w = jax.device_put(jnp.zeros((64, 128)), NamedSharding(mesh, P(None, "model")))
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    here = stagetool.inspect(program.step, w, x)
    there = stagetool.inspect(program.step, w, x, isolate=True, timeout_s=300)
    assert there.memory.record == here.memory.record
    assert there.cost.per_device == here.cost.per_device
    assert [(c.collective.kind, c.collective.mesh_axes) for c in there.collectives.items] == \
        [(c.collective.kind, c.collective.mesh_axes) for c in here.collectives.items]
    assert [(x.path, str(x.compiled)) for x in there.shardings.value[0]] == \
        [(x.path, str(x.compiled)) for x in here.shardings.value[0]]
    with pytest.raises(StagingError, match="SIGABRT"):
        stagetool.inspect(program.aborts, jnp.zeros(4), isolate=True, timeout_s=300)


def test_isolated_refuses_a_function_a_worker_cannot_import():
    def local(x):
        return x

    with pytest.raises(UsageError, match="cannot be imported by a worker process"):
        stagetool.inspect(local, jnp.zeros(4), isolate=True)


# ---- issue 42: the live API checks what a spec checks, before any trace --------------------------

BAD_OPTIONS = [
    ({"mesh": {"data": 2.5}}, "mesh="), ({"mesh": {"data": True}}, "mesh="), ({"mesh": {"data": 0}}, "mesh="),
    ({"mesh": {}}, "mesh="), ({"donate": True}, "donate=True"), ({"donate": -1}, "donate=-1"),
    ({"donate": 1.5}, "donate=1.5"), ({"donate": [0, None]}, "donate=None"), ({"top": 2.5}, "top=2.5"),
    ({"top": True}, "top=True"), ({"top": -1}, "top=-1"), ({"peak": "no"}, "peak='no'"), ({"slices": 0}, "slices=0"),
    ({"slices": 1.5}, "slices=1.5"), ({"platform": 3}, "platform=3"), ({"chip": 5}, "chip=5"),
    ({"device_memory": 16}, "device_memory=16"), ({"name": 5}, "name=5"), ({"name": ""}, "name=''"),
    ({"explain": 5}, "explain=5"), ({"explain": [1]}, "explain=[1]"), ({"static": 5}, "static=5"),
    ({"isolate": "yes"}, "isolate='yes'"), ({"timeout_s": -1}, "timeout_s=-1"),
    ({"timeout_s": float("nan")}, "timeout_s=nan"), ({"timeout_s": "10"}, "timeout_s='10'"),
]


@pytest.mark.parametrize("options, named", BAD_OPTIONS, ids=[n for _, n in BAD_OPTIONS])
def test_a_bad_option_is_a_usage_error_naming_it_never_coerced(options, named, monkeypatch):
    import stagetool.live as live

    def never(*a, **k):
        raise AssertionError("staged despite a bad option")

    monkeypatch.setattr(live, "inspect_here", never)

    def step(x):
        return x * 2

    with pytest.raises(UsageError) as e:
        stagetool.inspect(step, jax.ShapeDtypeStruct((8,), jnp.float32), **options)
    assert named in e.value.message and e.value.message.startswith("stagetool.inspect"), e.value.message


HUGE = """\
import sys

import jax
import jax.numpy as jnp
import numpy as np

import stagetool


def step(params, x):
    return x.sum()


cases = {
    "2**31 x 2**31": lambda: stagetool.inspect(step, {}, jax.ShapeDtypeStruct((2**31, 2**31), jnp.float32)),
    "2**58": lambda: stagetool.inspect(step, {"w": jax.ShapeDtypeStruct((2**29, 2**29), jnp.float32)},
                                       jax.ShapeDtypeStruct((4,), jnp.float32)),
    "ndarray.sum": lambda: stagetool.inspect(np.ndarray.sum, jnp.zeros(4)),
}
for name, case in cases.items():
    try:
        case()
        print(name, "-> a report")
    except stagetool.StagetoolError as e:
        print(name, "->", type(e).__name__ + ":", e.message.splitlines()[0])
    sys.stdout.flush()
print("the caller lives")
"""


def test_an_oversized_leaf_or_a_failing_method_never_ends_the_caller(tmp_path):
    """A 2**31 x 2**31 leaf aborted the caller and a 2**58-element one gave a report of 1,048,576 TiB;
    jax.jit(np.ndarray.sum) failed, and staging it a second time crashed the process (SIGSEGV)."""
    write(tmp_path, "huge.py", HUGE)
    r = subprocess.run([sys.executable, "huge.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0 and "the caller lives" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = dict(line.split(" -> ", 1) for line in r.stdout.splitlines() if " -> " in line)
    assert lines["2**31 x 2**31"].startswith("UsageError: stagetool.inspect: argument x: shape [2147483648, "
                                             "2147483648] has 4611686018427387904 elements"), lines
    assert lines["2**58"].startswith("UsageError: stagetool.inspect: argument params['w']: shape"), lines
    assert lines["ndarray.sum"].startswith("StagingError:"), lines


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's SystemExit
def test_another_threads_os_exit_while_staging_is_a_staging_error():
    import threading

    def step(x):
        t = threading.Thread(target=os._exit, args=(0,))
        t.start()
        t.join()
        return x * 2

    with pytest.raises(StagingError, match=r"called os._exit\(0\) while stagetool staged"):
        stagetool.inspect(step, jax.ShapeDtypeStruct((4,), jnp.float32), peak=False)
    assert os._exit.__module__ in ("posix", "nt")  # the real one again


def test_the_staged_function_object_dies_with_the_report():
    """JAX's compile cache keeps an executable per distinct dump folder for as long as the staged
    function object lives: the staged object is a copy that dies with the report (issue 42, item 8:
    +0.2 MB a call with peak=True; bench/bench_hostile.py measures the memory over 60 calls)."""
    import gc
    import weakref

    def step(x):
        return x * 2

    report = stagetool.inspect(step, jax.ShapeDtypeStruct((4,), jnp.float32))
    staged = report._once.prep.target.fn
    assert staged is not step and staged.__code__ is step.__code__
    gone = weakref.ref(staged)
    del report, staged
    gc.collect()
    assert gone() is None
