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
