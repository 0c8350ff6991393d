"""Issue 47, item 8: the user's or the machine's failures are named as such, never "unexpected ...
report it" (stagetool's own bugs only).

* the machine's memory running out while ``--measure`` runs the step, JAX unable to start the backend
  ``JAX_PLATFORMS`` names, a dependency of stagetool missing: one line naming the cause, exit 2;
* a host callback of the user's that raises while the step runs: exit 3 with its exception and the
  user's frame;
* ``--measure-steps`` without ``--measure``: exit 2 (it was silently ignored).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import REPO, run_subprocess, write
from stagetool.core.errors import StagingError, UsageError, known_failure, missing_dependency

CALLBACK_TEXT = '''INTERNAL: CpuCallback error calling callback: Traceback (most recent call last):
  File "/usr/lib/python3.11/site-packages/jax/_src/callback.py", line 90, in pure_callback_impl
    return callback(*args)
  File "/home/me/model.py", line 3, in bad
    raise ValueError("the user's callback failed")
ValueError: the user's callback failed
'''


def test_the_causes_are_named():
    oom = known_failure(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 17179869184 bytes."))
    assert isinstance(oom, UsageError) and oom.message == (
        "this run ran out of device memory on the attached device: RESOURCE_EXHAUSTED: Out of memory allocating "
        "17179869184 bytes.")
    assert known_failure(MemoryError()).message == "this run ran out of host memory: MemoryError"
    # the runtime's other wording of a device allocation that failed (was: an "unexpected" error)
    buffer = known_failure(RuntimeError("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate "
                                        "4.00G. That was not possible. There are 3.10G free.\nmore detail"))
    assert isinstance(buffer, UsageError) and buffer.exit_code == 2 and buffer.message == (
        "this run ran out of device memory on the attached device: RESOURCE_EXHAUSTED: Error allocating device "
        "buffer: Attempting to allocate 4.00G. That was not possible. There are 3.10G free.")
    backend = known_failure(RuntimeError("Unable to initialize backend 'tpu': NOT_FOUND: TPU initialization failed"))
    assert isinstance(backend, UsageError)
    assert backend.message.startswith("JAX could not start its 'tpu' backend") and backend.message.endswith(
        ": NOT_FOUND: TPU initialization failed")
    cb = known_failure(RuntimeError(CALLBACK_TEXT))
    assert isinstance(cb, StagingError) and cb.exit_code == 3
    assert cb.message == "a host callback raised while the step ran: ValueError: the user's callback failed"
    assert cb.user_frame == "/home/me/model.py:3 in bad"
    assert known_failure(TypeError("unsupported operand")) is None  # a bug of stagetool's stays one


def test_a_missing_module_is_a_dependency_only_when_stagetool_or_a_library_imported_it(tmp_path):
    lib = tmp_path / "site-packages" / "somelib"
    write(lib, "__init__.py", "from no_such_module_47 import Doc\n")
    write(tmp_path, "mine.py", "import not_installed_anywhere\n")
    sys.path.insert(0, str(tmp_path / "site-packages"))
    sys.path.insert(0, str(tmp_path))
    try:
        for name, by in (("somelib", "somelib"), ("mine", None)):
            try:
                __import__(name)
            except ImportError as e:
                said = missing_dependency(e, str(REPO / "stagetool"))
            if by is None:
                assert said is None
            else:
                assert said.message == ("a dependency of stagetool is missing: somelib needs the module "
                                        "'no_such_module_47', which cannot be imported (ModuleNotFoundError: No "
                                        "module named 'no_such_module_47')")
                assert "pip install no-such-module-47" in said.hint
    finally:
        sys.path[:2] = []
        sys.modules.pop("somelib", None)


MODEL = """\
import jax
import jax.numpy as jnp


def bad(x):
    raise ValueError("the user's callback failed")


def step(x):
    y = jax.pure_callback(bad, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return (y * 2).sum()


def huge(x):
    return jnp.broadcast_to(x, (1 << 24, 1024)) * 2
"""

SPEC = """\
functions:
  step: {target: model.py:step, args: ['f32[8]']}
  huge: {target: model.py:huge, args: ['f32[1024]']}
"""


def test_a_host_callback_that_raises_is_the_users_failure_with_its_frame(tmp_path, run_cli, monkeypatch):
    write(tmp_path, "model.py", MODEL)
    write(tmp_path, "s.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    r = run_cli("cost", "--spec", "s.yaml", "-f", "step", "--measure", "--measure-steps", "1", check=3)
    assert "error: a host callback raised while the step ran: ValueError: the user's callback failed" in r.stderr
    assert f"at {tmp_path / 'model.py'}:6 in bad" in r.stderr and "unexpected" not in r.stderr


def test_measure_steps_without_measure_is_refused(tmp_path, run_cli, monkeypatch):
    write(tmp_path, "model.py", MODEL)
    write(tmp_path, "s.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    for command in ("cost", "report"):
        r = run_cli(command, "--spec", "s.yaml", "--measure-steps", "3", check=2)
        assert "--measure-steps 3: the steps --measure times, and --measure is not given" in r.stderr


@pytest.mark.slow
def test_the_host_running_out_of_memory_in_measure_is_the_machines(tmp_path):
    write(tmp_path, "model.py", MODEL)
    write(tmp_path, "s.yaml", SPEC)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", STAGETOOL_NO_CACHE="1", NO_COLOR="1")
    limit_kib = 8 * 2**20  # 8 GiB of address space: the 64 GiB output cannot be allocated under it
    r = subprocess.run(["sh", "-c", f'ulimit -v {limit_kib} && exec "$@"', "sh", sys.executable, "-m", "stagetool",
                        "cost", "--spec", "s.yaml", "-f", "huge", "--measure", "--measure-steps", "1"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, r.stderr[-2000:]
    # --measure's own one line (issue 46: the function, what its inputs take, the runtime's first line);
    # on the CPU the attached device's memory is the machine's
    assert re.search(r"error: --measure: huge ran out of (host|device) memory on the attached device", r.stderr), \
        r.stderr[-2000:]
    assert "RESOURCE_EXHAUSTED" in r.stderr or "MemoryError" in r.stderr
    assert "unexpected" not in r.stderr


@pytest.mark.slow
def test_a_backend_jax_platforms_names_that_is_not_here(tmp_path):
    r = run_subprocess("calibrate", env={"JAX_PLATFORMS": "tpu"}, cwd=tmp_path, timeout=240)
    assert r.code == 2, r.stderr[-2000:]
    assert "error: JAX could not start its 'tpu' backend (JAX_PLATFORMS=tpu)" in r.stderr
    assert "error: unexpected" not in r.stderr


@pytest.mark.slow
def test_a_missing_dependency_of_stagetool_is_named_not_blamed_on_user_code(tmp_path):
    write(tmp_path / "shadow" / "annotated_doc", "__init__.py",
          "raise ModuleNotFoundError(\"No module named 'annotated_doc'\", name='annotated_doc')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), str(REPO)]), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "stagetool", "devices"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("error: a dependency of stagetool is missing: typer needs the module 'annotated_doc', which cannot be "
            "imported") in r.stderr
    assert "os._exit" not in r.stderr and "Traceback" not in r.stderr
