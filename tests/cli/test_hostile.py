"""Hostile input, faults and signals (issue #15): a gate never passes by accident, no file but the
one asked for is touched, and the process ends with a fixed exit code, never a crash."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import CLI_ENV, EXAMPLES, REPO, run_subprocess, signals_at_default, write

from stagetool.process import fileio

# ---- fail closed: user code that raises SystemExit ---------------------------------------------

USER = """\
    import sys

    if {at_import!r}:
        sys.exit({code!r})

    class Cfg:
        def __init__(self):
            if {at_call!r}:
                sys.exit({code!r})

    def init(n):
        import jax.numpy as jnp
        if {at_init!r}:
            sys.exit({code!r})
        return {{"w": jnp.zeros((n,))}}

    def f(params, x, cfg=None):
        if {at_trace!r}:
            raise SystemExit({code!r})
        return params["w"] * x

    def g(x):
        return x + 1
"""


def _gate_files(tmp_path: Path, where: str, code: object) -> Path:
    flags = {k: k == f"at_{where}" for k in ("at_import", "at_call", "at_init", "at_trace")}
    write(tmp_path, "u.py", USER.format(code=code, **flags))
    return write(tmp_path, "u.stagetool.yaml", """\
        functions:
          f:
            target: u.py:f
            args: [{init: u.py:init, init_args: [4]}, 'f32[4]']
            static: {cfg: {call: u.py:Cfg}}
          g: {target: u.py:g, args: ['f32[4]']}
    """.replace("static: {cfg: {call: u.py:Cfg}}", "kwargs: {}"))


@pytest.mark.parametrize("where,expected", [("import", 2), ("init", 3), ("trace", 3)])
@pytest.mark.parametrize("code", [0, None, "a message"])
def test_user_code_that_exits_never_passes_the_gate(run_cli, tmp_path, monkeypatch, where, expected, code):
    spec = _gate_files(tmp_path, where, code)
    monkeypatch.chdir(tmp_path)
    r = run_cli("snapshot", "--spec", spec, "-o", tmp_path / "lock.json")
    assert r.code == expected, r.stderr
    assert "SystemExit" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "lock.json").exists()
    # a baseline of g alone: check of the whole spec must fail, with the JUnit file written
    run_cli("snapshot", "--spec", spec, "-f", "g", "-o", tmp_path / "g.json", check=0) if where != "import" else None
    if where != "import":
        r = run_cli("check", "--spec", spec, "-b", tmp_path / "g.json", "--junit-xml", tmp_path / "j.xml")
        assert r.code == 3, r.stderr
        assert "SystemExit" in (tmp_path / "j.xml").read_text()


def test_a_call_that_exits_is_a_target_error_at_its_spec_line(run_cli, tmp_path):
    write(tmp_path, "c.py", "import sys\nclass Cfg:\n    def __init__(self):\n        sys.exit(0)\n"
                            "def f(x, cfg=None):\n    return x\n")
    spec = write(tmp_path, "c.stagetool.yaml", "functions:\n  f:\n    target: c.py:f\n    args: ['f32[4]']\n"
                                               "    static: {cfg: {call: c.py:Cfg}}\n")
    r = run_cli("snapshot", "--spec", spec, "-o", tmp_path / "o.json", check=2)
    assert f"{spec}:5:" in r.stderr and "SystemExit(0)" in r.stderr and "c.py:4" in r.stderr
    assert not (tmp_path / "o.json").exists()


# ---- bad baselines are exit 2 --------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_snapshot(tmp_path_factory):
    doc = json.loads((REPO / "tests/golden/jax-0.10.2/mlp.snapshot.json").read_text())
    return {"jax_version": "0.0", "jaxlib_version": "0.0", **doc}


@pytest.mark.parametrize("mutate,expect", [
    (lambda t: t.replace('"flops": ', '"flops": NaN, "x": ', 1), "non-finite number NaN"),
    (lambda t: t.replace('"peak_bytes": ', '"peak_bytes": -Infinity, "y": ', 1), "non-finite number -Infinity"),
    (lambda t: t.replace('"peak_bytes": ', '"peak_bytes": "12", "y": ', 1), "peak_bytes: must be a number"),
    (lambda t: t.replace('"memory": {', '"memory": ["x"], "z": {', 1), "memory: must be an object"),
    (lambda t: t.replace('"collectives": [', '"collectives": 7, "z": [', 1), "collectives: must be a list"),
    (lambda t: t.replace('"shape": [', '"shape": ["a", ', 1), "shape: must be a list of integers"),
    (lambda t: t[:40] + "\udcff" + t[40:], "byte 40: the baseline is not UTF-8"),
    (lambda t: "[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_a_damaged_baseline_is_exit_2(tmp_path, mlp_snapshot, mutate, expect):
    from stagetool.core.errors import BaselineError
    from stagetool.gate.snapshot import load_snapshot

    text = mutate(json.dumps(mlp_snapshot, indent=1))
    p = tmp_path / "b.json"
    p.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(BaselineError) as e:
        load_snapshot(p)
    assert expect in e.value.message and e.value.exit_code == 2


def test_a_nan_baseline_is_exit_2_from_check(run_cli, mlp_copy):
    run_cli("snapshot", "-o", "lock.json", check=0)
    text = Path("lock.json").read_text().replace('"flops": ', '"flops": NaN, "old_flops": ', 1)
    Path("lock.json").write_text(text)
    r = run_cli("check", "-b", "lock.json", check=2)
    assert "non-finite number NaN" in r.stderr and "improvement" not in r.stdout


# ---- writing only what was asked ---------------------------------------------------------------


def test_a_regular_file_is_replaced_atomically_keeping_its_mode(tmp_path):
    p = tmp_path / "out.txt"
    p.write_text("old")
    p.chmod(0o640)
    fileio.write_atomic(p, "new")
    assert p.read_text() == "new" and stat.S_IMODE(p.stat().st_mode) == 0o640
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.txt"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "out.txt"
    p.write_text("old")

    def boom(*a):
        raise KeyboardInterrupt  # a signal in the write window

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        fileio.write_atomic(p, "new")
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["out.txt"]


def test_a_symlink_is_followed_and_stays_a_link(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target.name)
    fileio.write_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == "real.json" and target.read_text() == "new"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_a_character_device_is_written_in_place_never_replaced(tmp_path):
    dev = tmp_path / "null"
    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a private /dev/null, never the real one
    before = os.stat(dev)
    fileio.write_atomic(dev, "payload")
    after = os.stat(dev)
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino and after.st_rdev == before.st_rdev
    assert sorted(x.name for x in tmp_path.iterdir()) == ["null"]


def test_a_fifo_is_written_in_place_and_never_read_first(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as fh:
            got.append(fh.read())

    reader = threading.Thread(target=read)
    reader.start()
    fileio.write_atomic(fifo, "through the pipe")
    reader.join(10)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert not fileio.is_special(tmp_path) and fileio.is_special(fifo)


def test_snapshot_to_dev_stdout_does_not_hang_and_prints_the_snapshot(tmp_path):
    for name in ("mlp.py", "mlp.stagetool.yaml"):
        (tmp_path / name).write_text((EXAMPLES / name).read_text())
    r = run_subprocess("snapshot", "--spec", tmp_path / "mlp.stagetool.yaml", "-o", "/dev/stdout", cwd=tmp_path,
                       timeout=120)
    assert r.code == 0, r.stderr
    assert json.loads(r.stdout)["kind"] == "stagetool-snapshot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.py", "mlp.stagetool.yaml"]


def test_the_lock_serialises_read_modify_write(tmp_path):
    p = tmp_path / "b.json"
    order: list[str] = []
    with fileio.locked(p):
        t = threading.Thread(target=lambda: (fileio.locked(p).__enter__(), order.append("second")))
        t.start()
        time.sleep(0.3)
        order.append("first")
    t.join(5)
    assert order == ["first", "second"]


def test_concurrent_updates_of_different_functions_both_land(tmp_path):
    write(tmp_path, "two.py", "def a(x):\n    return x + 1\n\ndef b(x):\n    return x * 2\n")
    spec = write(tmp_path, "two.stagetool.yaml",
                 "functions:\n  a: {target: two.py:a, args: ['f32[8]']}\n  b: {target: two.py:b, args: ['f32[8]']}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    # a baseline whose a and b are stale (f32[4] inputs); each run updates one of them
    stale = write(tmp_path, "stale.stagetool.yaml",
                  "functions:\n  a: {target: two.py:a, args: ['f32[4]']}\n  b: {target: two.py:b, args: ['f32[4]']}\n")
    base = tmp_path / "lock.json"
    assert subprocess.run([sys.executable, "-m", "stagetool", "snapshot", "--spec", str(stale), "-o", str(base)],
                          env=env, cwd=tmp_path, capture_output=True, timeout=120).returncode == 0
    procs = [subprocess.Popen([sys.executable, "-m", "stagetool", "check", "--spec", str(spec), "-b", str(base),
                               "--update", "-f", name], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    doc = json.loads(base.read_text())
    assert {n: doc["functions"][n]["inputs"][0]["shape"] for n in ("a", "b")} == {"a": [8], "b": [8]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock.json", "stale.stagetool.yaml", "two.py",
                                                          "two.stagetool.yaml"]


# ---- validate before JAX sees it -----------------------------------------------------------------


@pytest.mark.parametrize("text,expect", [
    ('mesh: {axes: {"d\\u00e4ta": 2}}\nfunctions:\n  f: {target: m.py:f, args: ["f32[4]"]}\n',
     ":1:15: mesh.axes: mesh axis name 'd\u00e4ta' must be an ASCII identifier"),
    ('mesh: {axes: {a: 99999, b: 99999}}\nfunctions:\n  f: {target: m.py:f, args: ["f32[4]"]}\n',
     "more than 65536 devices"),
    ('functions:\n  f: {target: m.py:f, args: ["f32[8589934592]"]}\n', "larger than 4294967296"),
    ('functions:\n  f: {target: m.py:f, args: [{shape: [4294967296, 4294967296], dtype: f32}]}\n',
     "more than 144115188075855872 (2**57)"),
    ('functions:\n  f: {target: m.py:f, args: ["f32[4] @ [data"]}\n', "sharding '[data' is not a list"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "functions: {}\n",
     "more than 200000 nodes (an alias bomb?)"),
    ("functions: &x\n  f: *x\n", ":1:12: an alias refers to a node that contains it (a recursive alias)"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\nfunctions: {}\n", "nested more than 64 levels deep"),
    ('functions:\n  f: {target: "m.py:f\\x01", args: ["f32[4]\x01"]}\n', ":2:43: not valid YAML"),
])
def test_bad_specs_are_exit_2_naming_the_line(run_cli, tmp_path, text, expect):
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    start = time.perf_counter()
    r = run_cli("shardings", "--spec", spec, check=2)
    assert expect in r.stderr and "Traceback" not in r.stderr
    assert time.perf_counter() - start < 10


def test_a_spec_that_is_not_utf8_names_the_byte(run_cli, tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_bytes(b"functions:\n  f: {target: m.py:\xff, args: ['f32[4]']}\n")
    r = run_cli("shardings", "--spec", spec, check=2)
    assert f"{spec}:2:20: byte 30 (0xff) is not UTF-8" in r.stderr


@pytest.mark.parametrize("mesh,expect", [("99999x99999", "more than 65536 devices"),
                                         ("d\u00e4=2", "must be an ASCII identifier"),
                                         ("data=\u00b2", "is not 'axis=size'"),
                                         # sizes for axes the spec does not have: the forms that work
                                         ("2x2x2", "give one size per axis, in that order (--mesh 2x4, or --mesh "
                                                   "data=2,model=4)")])
def test_bad_mesh_options_are_exit_2(run_cli, mlp_copy, mesh, expect):
    r = run_cli("shardings", "--mesh", mesh, check=2)
    assert expect in r.stderr


@pytest.mark.parametrize("flags,expect", [
    ("--typo", "'--typo' is not an XLA flag"),
    ("--xla_typo_flag", "XLA refuses it: Unknown flag in XLA_FLAGS: --xla_typo_flag"),
    ("--xla_force_host_platform_device_count=abc", "XLA refuses it: Couldn't interpret value abc"),
])
def test_a_bad_xla_flag_is_shown_not_a_silent_exit_1(tmp_path, flags, expect):
    r = run_subprocess("devices", env={"XLA_FLAGS": flags}, cwd=tmp_path)
    assert r.code == 2 and expect in r.stderr, r.stderr


FLAGS_AT_IMPORT = """\
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
import jax.numpy as jnp

MESH = jax.make_mesh((2, 4), ("data", "model"))  # starts JAX's backend at import


def step(x):
    return jnp.tanh(x) * 2
"""


def test_xla_flags_set_by_the_target_bring_no_fork_warning(tmp_path):
    """Trial 2, finding 13: a target that sets XLA_FLAGS and starts a backend at import (Flax's FSDP
    toy example) made stagetool fork its multithreaded process to check the flags, and JAX warned of
    a deadlock ("os.fork() was called ..."). Once a backend runs, XLA has read XLA_FLAGS and never
    reads it again: nothing is forked, and the diff of two meshes runs as before."""
    from helpers import write

    write(tmp_path, "m.py", FLAGS_AT_IMPORT)
    write(tmp_path, "m.stagetool.yaml", "version: 1\nmesh: {axes: {data: 2, model: 4}}\nfunctions:\n  step:\n"
          "    target: m.py:step\n    args: ['f32[64,64] @ [data, model]']\n")
    r = run_subprocess("diff", "--spec", "m.stagetool.yaml", "--mesh-a", "2x4", "--mesh-b", "4x2", cwd=tmp_path)
    assert r.code in (0, 1), r.stderr
    assert "os.fork()" not in r.stderr and "deadlock" not in r.stderr
    assert "data=2 × model=4 → data=4 × model=2" in r.stdout


def test_backends_running_is_read_from_jax_without_changing_anything():
    import jax

    from stagetool.devices.tpu_topology import backends_running

    jax.devices()  # the test session's backend runs
    before = jax.config.jax_num_cpu_devices
    assert backends_running() is True and jax.config.jax_num_cpu_devices == before


def test_libtpu_writes_no_log_files_on_a_cpu_run(tmp_path):
    start = time.time()
    env = {"TMPDIR": str(tmp_path), "JAX_PLATFORMS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "stagetool", "devices", "--platform", "cpu"], cwd=tmp_path,
                            env={**{k: v for k, v in os.environ.items() if not k.startswith("TPU_")}, **CLI_ENV,
                                 "PYTHONPATH": str(REPO), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert list(tmp_path.iterdir()) == []
    logs = Path("/tmp/tpu_logs")
    # a log of this process: its pid in the name, written since it started (pids are reused, and
    # /tmp/tpu_logs keeps the logs of earlier processes)
    assert not [p for p in (logs.iterdir() if logs.is_dir() else [])
                if p.name.endswith(f".{proc.pid}") and p.stat().st_mtime >= start - 1]


# ---- terminal safety -----------------------------------------------------------------------------


def test_escape_sequences_in_names_are_escaped(run_cli, tmp_path):
    write(tmp_path, "e.py", "def g(x):\n    return x\n")
    spec = tmp_path / "e.stagetool.yaml"
    spec.write_text('functions:\n  "g\\e[31mRED[/]": {target: e.py:g, args: ["f32[4]"]}\n'
                    '  "h\\e]0;t\\a": {target: e.py:nope, args: ["f32[4]"]}\n')
    for fmt in ("text", "markdown"):
        r = run_cli("shardings", "--spec", spec, "-f", "g\x1b[31mRED[/]", "--format", fmt, check=0)
        assert "\x1b" not in r.stdout and "g\\x1b[31mRED[/]" in r.stdout
    r = run_cli("shardings", "--spec", spec, check=2)
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr


# ---- signals -------------------------------------------------------------------------------------

SLOW = """\
import sys

import jax.numpy as jnp


def f(x):
    for i in range(400):
        x = jnp.sin(x) * (i + 1.0) + jnp.cos(x[::-1])
    print("traced", file=sys.stderr, flush=True)
    return x
"""


def _start(tmp_path: Path, *args: str, program: str = SLOW, spec_extra: str = "") -> subprocess.Popen:
    work = tmp_path / "work"
    work.mkdir()
    (work / "slow.py").write_text(program)
    spec = f"functions:\n  f: {{target: slow.py:f, args: ['f32[1024]']{spec_extra}}}\n"
    (work / "slow.stagetool.yaml").write_text(spec)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", TMPDIR=str(tmp))
    with signals_at_default():  # the run gets SIGHUP/SIGINT at their defaults under nohup or `&` too
        return subprocess.Popen([sys.executable, "-m", "stagetool", *args, "--spec", "slow.stagetool.yaml"],
                                cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


@contextlib.contextmanager
def _reading_stderr(proc: subprocess.Popen):
    """``(lines, reader)``: a thread reading ``proc``'s stderr into ``lines`` (join ``reader`` before
    reading the last line); on the way out a run still going is killed and its pipes closed."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr))
    reader.start()
    try:
        yield lines, reader
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        reader.join(10)
        proc.stdout.close()
        proc.stderr.close()


def test_sigint_during_the_peak_compile_exits_130_and_leaves_nothing(tmp_path):
    proc = _start(tmp_path, "memory", "-o", "report.txt")
    tmp = tmp_path / "tmp"
    _wait_for(proc, lambda: any(p.name.startswith("stagetool-dump-") for p in tmp.iterdir()))
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert time.monotonic() - start < 10  # not after the compile finishes
    assert err.strip().splitlines()[-1] == "stagetool: interrupted (SIGINT)"
    assert "Traceback" not in err and "Fatal Python error" not in err
    assert list(tmp.iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["slow.py", "slow.stagetool.yaml"]


def test_sigterm_during_a_compile_exits_143_with_one_line(tmp_path):
    proc = _start(tmp_path, "snapshot", "-o", "lock.json")
    with _reading_stderr(proc) as (lines, reader):
        _wait_for(proc, lambda: any("traced" in ln for ln in lines))
        time.sleep(0.1)  # into the lowering and compile: the run ends about 0.8 s after "traced" on an idle machine
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(10)
    assert proc.returncode == 143, lines
    assert [ln for ln in lines if "traced" not in ln] == ["stagetool: terminated (SIGTERM)\n"]
    assert list((tmp_path / "tmp").iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["slow.py", "slow.stagetool.yaml"]


@pytest.mark.parametrize("workers", [["--isolate"], ["--jobs", "2"]])
def test_a_timeout_is_that_functions_failure(run_cli, tmp_path, workers):
    """--timeout kills the worker of a function still running after that long (--isolate's
    workers, or --jobs'); the other function is staged, and the run fails closed (exit 3, no file)."""
    write(tmp_path, "t.py", "import time\n\ndef slow(x):\n    time.sleep(60)\n    return x\n\n"
                            "def fast(x):\n    return x\n")
    spec = write(tmp_path, "t.stagetool.yaml", "functions:\n  slow: {target: t.py:slow, args: ['f32[4]']}\n"
                                               "  fast: {target: t.py:fast, args: ['f32[4]']}\n")
    start = time.perf_counter()
    r = run_cli("snapshot", "--spec", spec, *workers, "--timeout", "8", "-o", tmp_path / "o.json", check=3)
    assert time.perf_counter() - start < 50
    assert "slow: timed out after 8 s; the process was killed" in r.stderr
    assert not (tmp_path / "o.json").exists()


def test_a_broken_stdout_pipe_is_one_line_not_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "stagetool", "lower", str(EXAMPLES / "mlp.py") + ":train_step"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader went away before the output
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 2, err
    assert "broken pipe" in err and "Traceback" not in err and "Exception ignored" not in err


def _children_of(pid: int) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the field after the state: the parent's pid
                pids.append(int(p.name))
    return pids


def _descendants_of(pid: int) -> list[int]:
    """Children, grandchildren ...: the console script's supervisor forks the command
    (stagetool.process.supervise), whose --isolate worker is the supervisor's grandchild."""
    out, todo = [], [pid]
    while todo:
        kids = _children_of(todo.pop())
        out += kids
        todo += kids
    return out


def test_sigint_during_isolate_kills_the_child_and_removes_its_files(tmp_path):
    """The --isolate worker runs in a session of its own (Ctrl-C at a terminal does not reach it):
    the parent kills it, and removes the file its stderr went to."""
    proc = _start(tmp_path, "snapshot", "--isolate", "-o", "lock.json")
    tmp = tmp_path / "tmp"
    _wait_for(proc, lambda: list(tmp.glob("stagetool-worker-*/stderr")) and len(_descendants_of(proc.pid)) >= 2)
    time.sleep(1.0)
    children = _descendants_of(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "stagetool: interrupted (SIGINT)"
    time.sleep(0.2)
    assert children and not [pid for pid in children if Path(f"/proc/{pid}").exists()
                             and "Z" not in (Path(f"/proc/{pid}/stat").read_text().split()[2:3] or [""])]
    assert list(tmp.iterdir()) == []


def test_a_platform_from_the_spec_is_named_at_its_line(run_cli, tmp_path):
    write(tmp_path, "p.py", "def f(x):\n    return x\n")
    spec = write(tmp_path, "p.stagetool.yaml", "platform: gpu\nfunctions:\n  f: {target: p.py:f, args: ['f32[4]']}\n")
    r = run_cli("shardings", "--spec", spec, check=2)
    assert f"{spec}:1:11: platform: gpu: no such backend here" in r.stderr


def test_null_inside_an_argument_stages_and_a_null_argument_is_none(run_cli, tmp_path):
    write(tmp_path, "tn.py", "def f(t, k=None):\n    return t[0] * 2\n\ndef none(x):\n    return None\n")
    spec = write(tmp_path, "a.stagetool.yaml", "functions:\n  f: {target: tn.py:f, args: [!tuple ['f32[4]', null]]}\n"
                                               "  none: {target: tn.py:none, args: ['f32[4]']}\n"
                                               "  k: {target: tn.py:f, args: ['f32[4]'], kwargs: {k: null}}\n")
    doc = run_cli("shardings", "--spec", spec, "--format", "json", check=0).json()
    assert [[leaf["path"] for leaf in f["inputs"]] for f in doc["functions"]] == [["t/0"], ["x"], ["t"]]
    assert doc["functions"][1]["outputs"] == []


def test_an_isolate_worker_dies_with_a_parent_killed_by_sigkill(tmp_path):
    """No handler runs on SIGKILL: the kernel's parent-death signal ends the command process (the
    console script's child) and its --isolate worker stuck in the user's code, which once outlived
    its parent for 35 minutes."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "hang.py").write_text("import sys, time\n\ndef f(x):\n    print('started', file=sys.stderr, flush=True)\n"
                                  "    time.sleep(600)\n    return x\n")
    (work / "hang.stagetool.yaml").write_text("functions:\n  f: {target: hang.py:f, args: ['f32[4]']}\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "stagetool", "snapshot", "--isolate", "--spec", "hang.stagetool.yaml",
                             "-o", "lock.json"], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def started() -> bool:
        return any("started" in p.read_text(errors="replace") for p in tmp.glob("stagetool-worker-*/stderr"))

    _wait_for(proc, started)
    family = _descendants_of(proc.pid)
    proc.kill()
    proc.communicate(timeout=60)

    def alive() -> list[int]:
        out = []
        for pid in family:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                out.append(pid)
        return out

    try:
        deadline = time.monotonic() + 60
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(family) >= 2 and not alive(), f"outlived the parent: {alive()} of {family}"
    finally:
        for pid in alive():
            os.kill(pid, signal.SIGKILL)


# ==== round 3 (issue 35) ========================================================================
# ---- the exit code is the reported one ------------------------------------------------------------

LATE = """\
import atexit
import os
import threading
import time

WHERE = os.environ.get("WHERE", "")
if WHERE == "atexit":  # as libraries do to skip a slow teardown
    atexit.register(lambda: os._exit(0))
if WHERE == "daemon":  # a process that double-forks away at import, holding the run's stdout
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(600)
        os._exit(0)
    os.wait()


def f(x):
    if WHERE == "thread":  # a non-daemon thread that ends the process after the command finished
        def late():
            time.sleep(3)
            os._exit(0)
        threading.Thread(target=late, daemon=False).start()
    return x * 2
"""


@pytest.fixture(scope="module")
def late_project(tmp_path_factory):
    """A baseline of f on f32[8], and a spec that now stages f32[16]: a real regression (exit 1)."""
    folder = tmp_path_factory.mktemp("late")
    write(folder, "m.py", LATE)
    write(folder, "m.stagetool.yaml", "functions:\n  f: {target: m.py:f, args: ['f32[8]']}\n")
    assert run_subprocess("snapshot", "-o", "lock.json", cwd=folder).code == 0
    write(folder, "m.stagetool.yaml", "functions:\n  f: {target: m.py:f, args: ['f32[16]']}\n")
    return folder


@pytest.mark.parametrize("where,jobs", [("atexit", ()), ("atexit", ("--jobs", "2")), ("thread", ())])
def test_a_late_exit_does_not_turn_a_regression_into_a_pass(late_project, where, jobs):
    r = run_subprocess("check", "-b", "lock.json", *jobs, cwd=late_project, env={"WHERE": where, "STAGETOOL_NO_CACHE": "1"})
    assert r.code == 1, (r.code, r.stderr)
    assert "regression" in r.stdout and "Traceback" not in r.stderr


def test_the_supervisor_believes_only_one_report_with_this_runs_nonce(capfd):
    from stagetool.process.supervise import verdict

    status = {code: code << 8 for code in (0, 1, 3)}  # the wait statuses of exits 0, 1, 3
    nonce = "ab" * 16
    assert verdict(status[1], f"{nonce} 1\n".encode(), nonce) == 1
    assert verdict(status[0], f"{nonce} 0\n".encode(), nonce) == 0
    for said in (b"0\n", f"{'cd' * 16} 0\n".encode(), f"{nonce} 0\n{nonce} 0\n".encode(), b"0\n" + f"{nonce} 0\n".encode(),
                 f"{nonce} ０\n".encode(), b""):
        assert verdict(status[0], said, nonce) == 3, said  # forged, doubled, or none: never a pass
    assert verdict(status[0], f"{nonce} 1\n".encode(), nonce) == 3  # reported 1, ended 0: os._exit after the end
    assert verdict(signal.SIGKILL, f"{nonce} 0\n".encode(), nonce) == 3  # killed after it reported
    assert verdict(signal.SIGKILL, b"", nonce) == 128 + signal.SIGKILL
    err = capfd.readouterr().err
    assert "reported exit code 1 but its process ended with 0" in err


# ---- standard streams -----------------------------------------------------------------------------


def _run_with_fds(folder: Path, args: list[str], *, close: tuple[int, ...]) -> tuple[int, bytes]:
    """The CLI with file descriptors ``close`` closed (``<&-``, ``>&-``, ``2>&-`` in a shell); its exit
    code and what reached stderr."""
    full = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    full.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    redirections = " ".join({0: "0<&-", 1: "1>&-", 2: "2>&-"}[fd] for fd in close)
    proc = subprocess.run(["sh", "-c", f'exec "$@" {redirections}', "sh", sys.executable, "-m", "stagetool", *args],
                          cwd=folder, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    return proc.returncode, proc.stderr


def test_closed_stdout_is_exit_2_with_one_line_and_closed_stderr_or_stdin_change_nothing(late_project, tmp_path):
    """``check >&-`` of an unchanged spec was exit 1 with the supervisor's traceback, ``2>&-`` exit 1."""
    write(tmp_path, "m.py", LATE)
    write(tmp_path, "m.stagetool.yaml", "functions:\n  f: {target: m.py:f, args: ['f32[8]']}\n")
    assert run_subprocess("snapshot", "-o", "lock.json", cwd=tmp_path).code == 0
    code, err = _run_with_fds(tmp_path, ["check", "-b", "lock.json"], close=(1,))
    assert code == 2 and err.decode().splitlines() == [
        "stagetool: error: stdout is closed (>&-): the output could not reach anyone; send it to /dev/null "
        "(>/dev/null) to discard it, or to a file"]
    for close in ((2,), (0,), (0, 2)):
        code, _ = _run_with_fds(tmp_path, ["check", "-b", "lock.json"], close=close)
        assert code == 0, close  # an unchanged spec passes, whatever else is closed
    code, _ = _run_with_fds(late_project, ["check", "-b", "lock.json"], close=(2,))
    assert code == 1  # and a regression is still one


# ---- nothing outlives a run -----------------------------------------------------------------------


def test_a_process_daemonised_at_import_is_ended_with_the_run(late_project):
    """It holds the run's stdout: without the subreaper, a CI step reading the output never ends."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", WHERE="daemon", STAGETOOL_NO_CACHE="1",
               PYTHONWARNINGS="ignore")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "stagetool", "check", "-b", "lock.json"], cwd=late_project, env=env,
                          capture_output=True, text=True, timeout=150)  # reads stdout to its end
    assert time.monotonic() - start < 150 and proc.returncode == 1, proc.stderr
    assert "ended 1 process the run left behind" in proc.stderr and "check -b lock.json" in proc.stderr


def test_a_stray_temporary_of_a_zombie_writer_is_removed(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(writer.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{writer.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stray = tmp_path / f".out.json.{writer.pid}.abc123.tmp"  # its write was cut short; not reaped yet
        stray.write_text("half")
        fileio.write_atomic(tmp_path / "out.json", "whole")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    finally:
        writer.wait()


def test_a_path_or_child_registered_once_the_run_is_ending_is_removed_at_once(tmp_path, monkeypatch):
    from stagetool.process import cleanup

    monkeypatch.setattr(cleanup, "_ENDING", [True])  # run_all has begun (a signal)
    late = tmp_path / "late"
    late.mkdir()
    with pytest.raises(cleanup.Ending):
        cleanup.register_path(late)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(cleanup.Ending):
        cleanup.make_temp_dir("stagetool-sweep-")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    with pytest.raises(cleanup.Ending):
        cleanup.register_child(proc)
    assert proc.poll() is not None and list(tmp_path.iterdir()) == []


def test_a_worker_keeps_its_temporary_files_in_a_folder_removed_when_it_dies(tmp_path, monkeypatch):
    """A worker killed (a timeout, SIGKILL) leaves no compile dump in TMPDIR: its TMPDIR is its own folder."""
    from stagetool.process.workers import run_in_workers

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    outcomes = run_in_workers(_make_temp_and_die, [0, 1], jobs=2, isolate=True)
    assert [o.died for o in outcomes] == ["the process died with SIGKILL"] * 2
    assert list(tmp_path.iterdir()) == []


def _make_temp_and_die(common, item):
    import tempfile

    tempfile.mkdtemp(prefix="stagetool-dump-")
    os.kill(os.getpid(), signal.SIGKILL)


# ---- the cache trusts no folder it did not check ----------------------------------------------------


@pytest.mark.parametrize("how", ["link", "group-writable"])
def test_a_cache_subfolder_that_is_a_link_or_writable_by_others_is_not_used(tmp_path, monkeypatch, capsys, how):
    from stagetool.staging import cache as cache_mod

    monkeypatch.setenv(cache_mod.SECRET_ENV, str(tmp_path / "key"))
    root = tmp_path / "cache"
    c = cache_mod.FactsCache.open(root)
    assert c is not None
    key = "ab" * 32
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if how == "link":
        (root / "facts").symlink_to(elsewhere)  # another user's link would send entries there
    else:
        (root / "facts").mkdir(mode=0o700)
        os.chmod(root / "facts", 0o777)
    assert c._folders_trusted(key) is False
    assert c.load(key) is None
    assert list(elsewhere.iterdir()) == []
    assert "the facts cache is not used for this entry" in capsys.readouterr().err


# ---- last round's open items ---------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["(.*a){20}$", "(\\w+)*$", "(?:x+)+y", "(a)\\1"])
def test_a_rule_regex_that_can_backtrack_for_ever_is_exit_2_at_once(run_cli, tmp_path, pattern):
    write(tmp_path, "r.py", "import jax.numpy as jnp\n\ndef init():\n    return {'w' * 40: jnp.zeros((4,))}\n\n"
                            "def f(p):\n    return p\n")
    spec = write(tmp_path, "r.stagetool.yaml", "functions:\n  f:\n    target: r.py:f\n    args:\n"
                                               f"      - init: r.py:init\n        rules: [['{pattern}', replicated]]\n")
    start = time.monotonic()
    r = run_cli("shardings", "--spec", spec, check=2)
    assert f"{spec}:6:18: functions.f.args[0].rules[0]: regular expression" in r.stderr, r.stderr
    assert ("exponential time" in r.stderr) and time.monotonic() - start < 30
    r = run_cli("collectives", "--spec", spec, "--explain", pattern, check=2)
    assert "--explain" in r.stderr and "exponential time" in r.stderr


@pytest.mark.parametrize("pattern", [".*/(wq|wk|wv)$", "layers_\\d+/.*", "(ab){3}", "[(*]+x", "a{2,}b", "(a|b)*c", "(wq|wk)+",
                                     "(?:params/)?.*wq$"])
def test_flat_patterns_are_not_refused(pattern):
    from stagetool.core.patterns import backtracking_risk

    assert backtracking_risk(pattern) is None


STUCK = """\
import re
import sys

print("stuck", file=sys.stderr, flush=True)
re.match("(.*a){25}$", "a" * 40 + "b")  # C code that holds the GIL: no Python signal handler runs


def f(x):
    return x
"""


@pytest.mark.parametrize("sig,code,line", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                           (signal.SIGINT, 130, "interrupted (SIGINT)")])
def test_a_signal_ends_a_run_stuck_holding_the_gil(tmp_path, sig, code, line):
    """A catastrophic regex in the user's own code: the command's handler cannot run, so the
    supervisor kills it (supervise.ESCALATE_S after the signal) and prints the last line itself."""
    write(tmp_path, "s.py", STUCK)
    write(tmp_path, "s.stagetool.yaml", "functions:\n  f: {target: s.py:f, args: ['f32[4]']}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", STAGETOOL_ESCALATE_S="3")
    with signals_at_default():
        proc = subprocess.Popen([sys.executable, "-m", "stagetool", "shardings"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with _reading_stderr(proc) as (lines, reader):
        _wait_for(proc, lambda: any("stuck" in ln for ln in lines))
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=60)
        assert time.monotonic() - start < 30
        reader.join(10)
        assert proc.returncode == code, lines
        assert lines[-1] == f"stagetool: {line}\n" and not _descendants_of(proc.pid)
        # killed STAGETOOL_ESCALATE_S (3 s here; 10 by default) after the signal, and said so
        assert any("did not end within 3 s of" in ln for ln in lines), lines


def test_lone_surrogates_from_user_code_are_written_escaped_in_every_format(tmp_path):
    write(tmp_path, "k.py", "import jax.numpy as jnp\n\ndef init():\n    return {'w\\ud800': jnp.zeros((4,))}\n\n"
                            "def f(p):\n    return p['w\\ud800'] * 2\n")
    write(tmp_path, "k.stagetool.yaml", "functions:\n  f: {target: k.py:f, args: [{init: k.py:init}]}\n")
    for fmt in ("text", "json", "markdown", "html"):
        r = run_subprocess("shardings", "--format", fmt, cwd=tmp_path)
        assert r.code == 0 and "w\\ud800" in r.stdout and "unexpected" not in r.stderr, (fmt, r.stderr)
    assert run_subprocess("snapshot", "-o", "k.json", cwd=tmp_path).code == 0
    assert json.loads((tmp_path / "k.json").read_text())["functions"]["f"]["inputs"][0]["path"] == "p/w\ud800"
    assert run_subprocess("check", "-b", "k.json", cwd=tmp_path).code == 0


def test_a_lone_surrogate_in_a_spec_is_exit_2_at_its_line(run_cli, tmp_path):
    spec = write(tmp_path, "s.stagetool.yaml", 'functions:\n  "g\\ud800": {target: m.py:g, args: ["f32[8]"]}\n')
    r = run_cli("shardings", "--spec", spec, check=2)
    assert f"{spec}:2:3: a lone surrogate (\\ud800) is not a character" in r.stderr


def test_a_base_exception_of_a_class_the_parent_cannot_import_is_exit_3_under_isolate(run_cli, tmp_path):
    write(tmp_path, "n.py", "def f(x):\n    class Local(BaseException):\n        pass\n    raise Local('inner')\n")
    spec = write(tmp_path, "n.stagetool.yaml", "functions:\n  f: {target: n.py:f, args: ['f32[8]']}\n")
    r = run_cli("snapshot", "--spec", spec, "--isolate", "-o", tmp_path / "x.json", check=3)
    assert "user code raised Local (a BaseException: inner)" in r.stderr and "unexpected" not in r.stderr


def test_an_init_with_too_many_leaves_is_exit_2_naming_the_limit(run_cli, tmp_path, monkeypatch):
    from stagetool.inputs import avals

    monkeypatch.setattr(avals, "MAX_LEAVES", 10)
    write(tmp_path, "l.py", "import jax.numpy as jnp\n\ndef init():\n    return [jnp.zeros((2,)) for _ in range(11)]\n\n"
                            "def f(p):\n    return p\n")
    spec = write(tmp_path, "l.stagetool.yaml", "functions:\n  f: {target: l.py:f, args: [{init: l.py:init}]}\n")
    r = run_cli("shardings", "--spec", spec, check=2)
    assert "the init gives 11 leaves, more than 10" in r.stderr


@pytest.mark.parametrize("workers", [[], ["--isolate"]])
def test_sighup_ends_the_run_as_sigterm_does_and_leaves_nothing(tmp_path, workers):
    """SIGHUP was forwarded but not handled: the run died without its cleanup, and --isolate left
    stagetool-worker-* behind."""
    # the trace waits 30 s after "traced", so the signal lands inside the run however loaded the machine
    # (the run ends ~0.8 s after "traced" on an idle one: a loaded test process signalled after it ended)
    proc = _start(tmp_path, "snapshot", *workers, "-o", "lock.json",
                  program=SLOW.replace('    return x\n', '    time.sleep(30)\n    return x\n').replace("import sys\n", "import sys\nimport time\n"))
    tmp = tmp_path / "tmp"
    with _reading_stderr(proc) as (lines, reader):
        _wait_for(proc, lambda: any("traced" in ln for ln in lines) or list(tmp.glob("stagetool-worker-*")))
        time.sleep(0.1)  # as before: past the worker's start (its folder appears before it reads its job)
        proc.send_signal(signal.SIGHUP)
        proc.wait(timeout=60)
        reader.join(10)
        assert proc.returncode == 129, lines
        assert lines[-1] == "stagetool: hung up (SIGHUP)\n" and not any("Traceback" in ln for ln in lines)
        assert list(tmp.iterdir()) == []
        assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["slow.py", "slow.stagetool.yaml"]


@pytest.mark.slow
def test_sighup_the_instant_an_isolate_worker_starts_is_still_reported_as_sighup(tmp_path):
    """Signalled as soon as the --isolate worker's folder appears, before the worker has read its job
    (the parent may still be handing it over): the worker then read a cut-short pipe and printed
    "EOFError: Ran out of input" after the parent's last line. The parent's line is the run's last.
    A static value of 100 kB makes the worker's start (the pickled plan, more than a pipe's 64 KiB
    buffer) take until the worker reads it, so the signal lands inside that start."""
    proc = _start(tmp_path, "snapshot", "--isolate", "-o", "lock.json",
                  program=SLOW.replace("def f(x):", "def f(x, tag=None):"),
                  spec_extra=", static: {tag: '" + "x" * 100_000 + "'}")
    tmp = tmp_path / "tmp"
    with _reading_stderr(proc) as (lines, reader):
        deadline = time.monotonic() + 120
        while not list(tmp.glob("stagetool-worker-*")):  # polled tightly
            assert proc.poll() is None and time.monotonic() < deadline, lines
            time.sleep(0.002)
        proc.send_signal(signal.SIGHUP)  # at once: no sleep
        proc.wait(timeout=60)
        reader.join(30)
        assert proc.returncode == 129, lines
        assert lines and lines[-1] == "stagetool: hung up (SIGHUP)\n", lines
        assert not any("Traceback" in ln or "Error" in ln for ln in lines), lines
        assert list(tmp.iterdir()) == []
        assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["slow.py", "slow.stagetool.yaml"]


@pytest.mark.parametrize("args,expect", [
    (("shardings", "--topology", ""), "--topology '': an empty topology name"),
    (("devices", "--topology", ""), "--topology '': an empty topology name"),
    (("shardings", "--topology", "v5e:\uff12x\uff12"), "bad TPU topology name"),
    (("shardings", "--topology", "h100:\uff18"), "bad GPU topology name"),
    (("shardings", "--topology", "v5e:2x" + "9" * 5000), "bad TPU topology name"),
    (("shardings", "--mesh", "data=" + "9" * 5000), "a mesh has at most 65536 devices"),
    (("shardings", "--mesh", "2x" + "9" * 5000), "a mesh has at most 65536 devices"),
    (("memory", "--device-memory", "9" * 5000 + "GiB"), "larger than 9223372036854775808 bytes"),
    (("memory", "--device-memory", "99999999999PiB"), "larger than 9223372036854775808 bytes"),
    (("sweep", "mlp.py:train_step", "--set", "a=1", "--shard", "1/" + "9" * 5000), "is not I/N"),
    (("devices", "--gpu-target-config", "mlp.py"), "needs a GPU topology to compile for"),
])
def test_values_that_name_nothing_or_are_huge_are_exit_2(run_cli, mlp_copy, args, expect):
    r = run_cli(*args, check=2)
    assert expect in r.stderr and "unexpected" not in r.stderr and len(r.stderr) < 2000, r.stderr


def test_backticks_in_a_leaf_path_open_no_code_span_in_markdown():
    """Only the views' own `axis` spans are code spans; a leaf path's backticks are escaped."""
    from stagetool.core.text import markdown_text

    assert markdown_text("all-gather of p/w`x over `data`") == "all-gather of p/w\\`x over `data`"
    assert markdown_text("input p/b`x`: declared") == "input p/b\\`x\\`: declared"
    assert markdown_text("split over `data` × `model`") == "split over `data` × `model`"


@pytest.mark.parametrize("value,seconds", [("2.5", 2.5), ("30", 30.0), ("", 10.0), ("soon", 10.0), ("0", 10.0),
                                           ("-1", 10.0), ("nan", 10.0), ("inf", 10.0), ("1e9", 10.0)])
def test_the_seconds_before_a_signalled_run_is_killed(monkeypatch, value, seconds):
    from stagetool.process import supervise

    monkeypatch.setenv("STAGETOOL_ESCALATE_S", value)
    assert supervise.escalate_seconds() == seconds
    monkeypatch.delenv("STAGETOOL_ESCALATE_S")
    assert supervise.escalate_seconds() == supervise.ESCALATE_S == 10.0
