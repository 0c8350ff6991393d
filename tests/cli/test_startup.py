"""Start-up of the command line: the cyclic collector paused through imports and resumed with the
start-up heap frozen (stagetool.process.gc_pause); the Python API leaves the caller's collector alone."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
from helpers import CLI_ENV, REPO

from stagetool.process import gc_pause


@pytest.fixture
def collector():
    """Restore the collector's state (and unfreeze) after the test."""
    was = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if was else gc.disable()
    gc_pause._paused = False


def test_pause_then_resume_freezes_what_start_up_made(collector):
    gc.enable()
    gc_pause.pause()
    assert not gc.isenabled()
    made = [[i] for i in range(1000)]  # noqa: F841 - objects alive at resume
    gc_pause.resume()
    assert gc.isenabled() and gc.get_freeze_count() >= 1000
    frozen = gc.get_freeze_count()
    gc_pause.resume()  # a second call changes nothing
    assert gc.get_freeze_count() == frozen


def test_resume_without_pause_leaves_the_collector_alone(collector):
    gc.disable()  # the caller's choice (the Python API never pauses)
    gc_pause.resume()
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_the_cli_process_collects_again_once_the_devices_are_up(tmp_path):
    """In a real run the collector is back on for tracing and compiling, with the start-up heap
    (JAX's modules) frozen: not one collection walks it."""
    code = ("import atexit, gc, json, sys\n"
            "from stagetool.__main__ import main\n"
            "state = {}\n"
            "import stagetool.pipeline as p\n"
            "real = p.provision_devices\n"
            "def spy(*a, **k):\n"
            "    setup = real(*a, **k)\n"
            "    state.setdefault('after_provision', [gc.isenabled(), gc.get_freeze_count()])\n"
            "    return setup\n"
            "p.provision_devices = spy\n"
            "code = main(['shardings', 'examples/mlp.py:train_step', '--format', 'json', '-o', "
            f"{str(tmp_path / 'r.json')!r}])\n"
            "print(json.dumps([code, 'jax' in sys.modules, state['after_provision']]))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    # the command in this process, not in the supervised child (stagetool.process.supervise), to look at it
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", STAGETOOL_UNSUPERVISED="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    code, jax_loaded, (enabled, frozen) = json.loads(proc.stdout.splitlines()[-1])
    assert code == 0 and jax_loaded and enabled and frozen > 100_000


def test_a_plain_jax_step_stages_without_flax_or_equinox_installed(tmp_path):
    """The README's first command installs stagetool alone (no Flax, Equinox or optax): a plain-JAX
    step stages there, and its memory figures are those of the same step where the frameworks are
    installed (staging a plain step imported Flax unconditionally: exit 3, "No module named 'flax'")."""
    out = {name: tmp_path / f"{name}.json" for name in ("without", "with")}
    block = ("import sys\n"  # the frameworks absent as they are when not installed: no module is found
             "class Absent:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('flax', 'equinox', 'optax', 'haliax', 'keras'):\n"
             "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
             "sys.meta_path.insert(0, Absent())\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", STAGETOOL_UNSUPERVISED="1", STAGETOOL_NO_CACHE="1")
    for name, prelude in (("without", block), ("with", "")):
        code = (prelude + "from stagetool.__main__ import main\n"
                f"raise SystemExit(main(['memory', 'examples/mlp.py:train_step', '--format', 'json', '-o', "
                f"{str(out[name])!r}]))\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=180)
        assert proc.returncode == 0, proc.stderr
    without, with_ = (json.loads(out[n].read_text())["functions"][0]["memory"]["record"] for n in ("without", "with"))
    assert without["argument_bytes"] > 0 and without == with_


@pytest.mark.slow
def test_a_command_imports_only_the_rooms_it_uses():
    """Issue 50: each stagetool module a run imports is compiled from source on every run where no
    bytecode is kept (PYTHONDONTWRITEBYTECODE=1 with an editable install, as CI containers run). The
    command line itself imports no analysis; ``report --format json`` without ``--modules``/``--peak``
    imports neither the text renderer nor the modules roll-up, the memory timeline or the peak buffers."""
    code = ("import json, sys\n"
            "import stagetool.cli\n"
            "cli_only = sorted(m for m in sys.modules if m.startswith('stagetool.'))\n"
            "code = stagetool.cli.main(['report', 'examples/mlp.py:train_step', '--format', 'json', '--no-cache',\n"
            "                           '-o', sys.argv[1]])\n"
            "print(json.dumps([code, cli_only, sorted(m for m in sys.modules if m.startswith('stagetool.'))]))\n")
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", STAGETOOL_UNSUPERVISED="1")
    with __import__("tempfile").TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-c", code, f"{tmp}/r.json"], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    code, cli_only, report = json.loads(proc.stdout.splitlines()[-1])
    assert code == 0
    assert [m for m in cli_only if m.split(".")[1] not in ("cli", "core", "report", "_version")] == []
    assert [m for m in cli_only if m.startswith("stagetool.report.")] == []  # the Format enum alone
    unused = {"stagetool.report.render_text", "stagetool.report.views", "stagetool.analysis.modules",
              "stagetool.analysis.timeline", "stagetool.analysis.peak"}
    assert unused.isdisjoint(report), sorted(unused & set(report))
    assert "stagetool.analysis.sections" in report  # (the check sees the run's modules)
