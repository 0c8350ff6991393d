"""The pytest plugin: a test project in a temporary folder uses the stagetool_snapshot fixture; it
fails with no snapshot, passes once recorded, fails after a sharding edit naming the cause, and
passes again after --stagetool-update. The assertion helpers fail with what they found."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from helpers import REPO, write

import stagetool
from stagetool.live.asserts import assert_no_collective, assert_peak_under, assert_sharding

CONFTEST = """\
import os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.config.update("jax_num_cpu_devices", 8)
"""

MODEL = """\
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

W_SPEC = P(None, "model")


def step(w, x):
    return jnp.tanh(x @ w).sum()
"""

TEST = """\
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from model import W_SPEC, step


def test_step(stagetool_snapshot):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, W_SPEC))
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    stagetool_snapshot(step, w, x)
"""


def _pytest(folder, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "stagetool.live.pytest_plugin", *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_a_project_using_the_fixture_fails_on_a_sharding_edit_until_updated(tmp_path):
    write(tmp_path, "conftest.py", CONFTEST)
    write(tmp_path, "model.py", MODEL)
    write(tmp_path, "test_model.py", TEST)
    snapshot = tmp_path / "__stagetool__" / "test_model" / "test_step.step.json"

    r = _pytest(tmp_path)
    assert r.returncode == 1 and "no snapshot of step yet" in r.stdout and "--stagetool-update" in r.stdout, r.stdout
    r = _pytest(tmp_path, "--stagetool-update")
    assert r.returncode == 0 and snapshot.is_file(), r.stdout + r.stderr
    recorded = snapshot.read_text()
    r = _pytest(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    write(tmp_path, "model.py", MODEL.replace('W_SPEC = P(None, "model")', 'W_SPEC = P("model", None)'))
    r = _pytest(tmp_path)
    assert r.returncode == 1, r.stdout
    assert "step regressed" in r.stdout
    # the cause first: the input whose declared sharding changed, at the call's line in the test
    assert "cause" in r.stdout and "test_model.py:12" in r.stdout, r.stdout
    assert "P(None, 'model')" in r.stdout and "P('model', None)" in r.stdout, r.stdout
    assert snapshot.read_text() == recorded  # a failing run does not touch the snapshot

    r = _pytest(tmp_path, "--stagetool-update")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _pytest(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


PRECISE_TEST = """\
import jax
import jax.numpy as jnp

PREC = jax.lax.Precision.HIGHEST


def step(x, w):
    return jnp.dot(x, w, precision=PREC)


def test_step(stagetool_snapshot):
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    stagetool_snapshot(step, x, x, chip="tpu-v5e")
"""


@pytest.mark.slow
def test_a_faster_step_passes_the_fixture(tmp_path):
    """Issue 47 item 1: a step made faster (Precision.HIGHEST → DEFAULT under chip="tpu-v5e") failed the
    fixture with "TypeError: unsupported operand type(s) for +: 'NoneType' and 'str'"."""
    write(tmp_path, "conftest.py", CONFTEST)
    write(tmp_path, "test_fast.py", PRECISE_TEST)
    r = _pytest(tmp_path, "--stagetool-update")
    assert r.returncode == 0, r.stdout + r.stderr
    write(tmp_path, "test_fast.py", PRECISE_TEST.replace("HIGHEST", "DEFAULT"))
    r = _pytest(tmp_path)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
    write(tmp_path, "test_fast.py", PRECISE_TEST.replace("HIGHEST", "DEFAULT").replace(
        "return jnp.dot(x, w, precision=PREC)", "return jnp.dot(jnp.dot(x, w, precision=PREC), w, precision=PREC)"))
    r = _pytest(tmp_path)  # and a slower one still fails, naming the step time
    assert r.returncode == 1 and "step time (estimate, tpu-v5e)" in r.stdout, r.stdout


def test_the_plugin_is_registered_for_pytest():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["pytest11"] == {"stagetool": "stagetool.live.pytest_plugin"}
    code = ("import sys, stagetool.live.pytest_plugin as p; assert callable(p.pytest_addoption); "
            "assert 'jax' not in sys.modules, 'loading the plugin imported jax'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def _report():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])

    def step(w, x):
        return (x @ w).sum()

    w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    return stagetool.inspect(step, w, x)


def test_assertion_helpers_pass_and_fail_with_what_they_found():
    report = _report()
    # x's columns are replicated and w's rows split over model: XLA gathers x's shard? No: it
    # all-reduces the partial sums (over model, then data, for the .sum())
    kinds = {(c.collective.kind, c.collective.mesh_axes) for c in report.collectives.items}
    assert ("all-gather", ("model",)) not in kinds
    assert_no_collective(report, "all-gather", axis="model")
    assert ("all-reduce", ("model",)) in kinds
    with pytest.raises(AssertionError, match=r"all-reduce over 'model' in the compiled program:\n  all-reduce over "
                                             r"model: \d+ B per device at test_pytest_plugin.py:\d+"):
        assert_no_collective(report, "all-reduce", axis="model")

    peak = report.memory.record.peak_bytes
    assert peak == report.memory.record.argument_bytes + report.memory.record.output_bytes \
        + report.memory.record.temp_bytes or peak > 0
    assert_peak_under(report, peak + 1)
    with pytest.raises(AssertionError, match="is not under"):
        assert_peak_under(report, peak)
    assert_peak_under(report, "1GiB")

    assert_sharding(report, "w", P("model", None))
    assert_sharding(report, "x", "P('data')")  # trailing None dropped: one sharding
    with pytest.raises(AssertionError, match=r"w: compiled P\('model', None\), declared P\('model', None\) "
                                             r"\(from object at test_pytest_plugin.py:\d+"):
        assert_sharding(report, "w", P(None, "model"))
    with pytest.raises(AssertionError, match="names no leaf"):
        assert_sharding(report, "nope", P())
