"""Issue 25: every way out of user code fails closed, and odd inputs are exit 2 without being read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import CLI_ENV, REPO, run_subprocess, write

MODEL = """
import os

if os.environ.get("WHERE") == "import":
    os._exit(0)


class Boom(BaseException):
    pass


def init():
    if os.environ.get("WHERE") == "init":
        os._exit(0)
    import jax.numpy as jnp
    return jnp.zeros((8,))


def f(x):
    if os.environ.get("WHERE") == "trace":
        os._exit(0)
    if os.environ.get("WHERE") == "kill":
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("WHERE") == "boom":
        raise Boom("kaboom")
    return x * 2


def g(x):
    return x + 1
"""

SPEC = """
version: 1
functions:
  f:
    target: m.py:f
    args:
      - init: m.py:init
  g:
    target: m.py:g
    args: ['f32[8]']
"""


@pytest.fixture(scope="module")
def project_made(tmp_path_factory):
    """MODEL, its spec and the lock.json a fresh process's ``snapshot`` wrote: made once for the file."""
    folder = tmp_path_factory.mktemp("fail-closed-project")
    write(folder, "m.py", MODEL)
    write(folder, "m.stagetool.yaml", SPEC)
    r = run_subprocess("snapshot", "-o", "lock.json", cwd=folder)
    assert r.code == 0, r.stderr
    return folder


@pytest.fixture
def project(tmp_path, project_made):
    """A copy of :func:`project_made` of the test's own (the lock's paths are relative to the spec's folder)."""
    import shutil

    for name in ("m.py", "m.stagetool.yaml", "lock.json"):
        shutil.copy(project_made / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("where,command", [
    ("import", ("check", "-b", "lock.json")),
    ("init", ("check", "-b", "lock.json")),
    ("trace", ("snapshot", "-o", "new.json")),
    ("import", ("check", "-b", "lock.json", "--jobs", "2", "--junit-xml", "j.xml")),
])
def test_os_exit_in_user_code_is_exit_3_never_a_pass(project, where, command):
    r = run_subprocess(*command, cwd=project, env={"WHERE": where, "STAGETOOL_NO_CACHE": "1"})
    assert r.code == 3, (r.code, r.stderr)
    assert "called os._exit()" in r.stderr and "Traceback" not in r.stderr
    assert not (project / "new.json").exists()


def test_a_run_killed_by_a_signal_reports_it(project):
    r = run_subprocess("check", "-b", "lock.json", cwd=project, env={"WHERE": "kill", "STAGETOOL_NO_CACHE": "1"})
    assert r.code == 128 + signal.SIGKILL and "died with SIGKILL" in r.stderr


def test_a_base_exception_from_user_code_is_exit_3_not_1(run_cli, project, monkeypatch):
    monkeypatch.chdir(project)
    monkeypatch.setenv("WHERE", "boom")
    r = run_cli("check", "-b", "lock.json")
    assert r.code == 3, r.stderr
    assert "Traceback" not in r.stderr and "kaboom" in r.stderr


def test_unsupervised_the_exit_code_passes_through(project):
    """The supervisor changes nothing for a run that finishes: a regression is still exit 1."""
    lock = json.loads((project / "lock.json").read_text())
    lock["functions"]["g"]["cost"]["flops"] = 0  # the baseline had fewer FLOPs: today's run regressed
    (project / "old.json").write_text(json.dumps(lock))
    r = run_subprocess("check", "-b", "old.json", cwd=project)
    assert r.code == 1, r.stderr


# ---- special files are exit 2 without being read -------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder"])
@pytest.mark.parametrize("role", ["spec", "baseline"])
def test_special_files_as_spec_or_baseline_are_exit_2(run_cli, project, monkeypatch, kind, role):
    monkeypatch.chdir(project)
    path = project / "special"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path = "/dev/zero"
    args = ("snapshot", "--spec", path, "-o", "x.json") if role == "spec" else ("check", "-b", path)
    r = run_cli(*args, check=2)
    assert "Traceback" not in r.stderr and "unexpected" not in r.stderr, r.stderr
    assert "not a regular file" in r.stderr or "is a FIFO" in r.stderr or "character device" in r.stderr \
        or "folder" in r.stderr or "directory" in r.stderr.lower(), r.stderr


def test_a_full_stdout_is_a_clean_exit_with_a_message(project):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "stagetool", "lower", "m.py:g"], cwd=project, env=env,
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "cannot write to stdout" in proc.stderr and "No space left" in proc.stderr
    assert "Traceback" not in proc.stderr and "unexpected" not in proc.stderr and "Exception ignored" not in proc.stderr


@pytest.mark.parametrize("value", ["inf", "nan", "1e308", "1e400", "604801", "0", "-1"])
def test_a_timeout_that_is_no_number_of_seconds_is_exit_2_for_check(run_cli, project, monkeypatch, value):
    """inf and nan are refused alike (leaving --timeout out is no limit); 1e308 was 'unexpected OverflowError'."""
    monkeypatch.chdir(project)
    r = run_cli("check", "-b", "lock.json", "--function", "g", "--timeout", value, check=2)
    assert "--timeout" in r.stderr and "unexpected" not in r.stderr
    assert "at most 604800" in r.stderr or value in ("0", "-1")  # those two: Typer's own range check


def test_the_longest_timeout_is_taken_for_check(run_cli, project, monkeypatch):
    """604800 s (a week), the bound the refused values above are measured against, runs the check."""
    monkeypatch.chdir(project)
    run_cli("check", "-b", "lock.json", "--function", "g", "--timeout", "604800", check=0)


def test_write_atomic_removes_temporaries_of_dead_writers(tmp_path):
    """A snapshot killed mid-write leaves .<name>.<pid>.<random>.tmp; the next write of the file
    removes those whose writer is gone (and nothing else)."""
    from stagetool.process.fileio import write_atomic

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stray = tmp_path / f".lock.json.{dead}.abc123.tmp"
    stray.write_text("half")
    alive = tmp_path / f".lock.json.{os.getppid()}.abc123.tmp"  # a live writer's: kept
    alive.write_text("half")
    other = tmp_path / f".other.json.{dead}.abc123.tmp"  # another file's: kept
    other.write_text("half")
    write_atomic(tmp_path / "lock.json", "{}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["lock.json", alive.name, other.name])


def test_junit_holds_only_characters_xml_allows():
    import xml.etree.ElementTree as ET

    from stagetool.gate.render import _xml_legal

    text = _xml_legal('<a n="x\ufffey\ud800z\x01">ok\u00e9\x1b</a>')
    root = ET.fromstring(text.encode("utf-8"))  # parses: U+FFFE, a lone surrogate, controls are escaped
    assert root.get("n") == "x\\ufffey\\ud800z\\u0001" and root.text == "ok\u00e9\\u001b"


# ---- odd inputs: deep regexes, an unreachable coordinator -----------------------------------------------

DEEP = "(" * 1000 + "a" + ")" * 1000


def test_a_rule_regex_with_1000_nested_groups_is_exit_2(run_cli, tmp_path, monkeypatch):
    write(tmp_path, "d.py", "import jax.numpy as jnp\n\ndef init():\n    return {'w': jnp.zeros((8,))}\n\n"
                            "def g(p):\n    return p['w'] * 2\n")
    (tmp_path / "d.stagetool.yaml").write_text(
        "version: 1\nfunctions:\n  g:\n    target: d.py:g\n    args:\n      - init: d.py:init\n"
        f"        rules:\n          - ['{DEEP}', [null]]\n")
    monkeypatch.chdir(tmp_path)
    r = run_cli("shardings", "--spec", "d.stagetool.yaml", check=2)
    assert "d.stagetool.yaml:8:14" in r.stderr and "nested too deeply" in r.stderr and "Recursion" not in r.stderr
    r = run_cli("collectives", "--spec", "d.stagetool.yaml", "--explain", DEEP, check=2)
    assert "--explain" in r.stderr and "nested too deeply" in r.stderr


def test_an_unreachable_coordinator_is_a_bounded_exit_2(run_cli, project, monkeypatch):
    import socket

    monkeypatch.chdir(project)
    monkeypatch.setenv("STAGETOOL_COORDINATOR_WAIT_S", "1")
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        r = run_cli("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1",
                    "shardings", "m.py:g", check=2)
    assert "nothing accepted a connection there within 1 s" in r.stderr
    r = run_cli("--coordinator", "no-such-host.invalid:1234", "--num-processes", "2", "--process-id", "1",
                "shardings", "m.py:g", check=2)
    assert "cannot resolve 'no-such-host.invalid'" in r.stderr


# ---- outputs safe for their readers ---------------------------------------------------------------------

HOSTILE = "<img src=http://evil.example/x.png>`](http://evil.example) @team #1 | *x*"


def _no_live_markdown(md: str) -> None:
    """Nothing a reader's Markdown engine would turn into HTML, a link, an image or a mention: outside
    code spans (shown literally; a span ends only at a fence of its own length) no raw ``<``, no
    ``](``, no bare URL, no unescaped ``@``."""
    import re

    outside = re.sub(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", "", md)
    assert not re.search(r"<[A-Za-z/!?]", outside.replace("<sub>", "").replace("</sub>", "")), outside
    assert not re.search(r"(?<!\\)\]\(", outside), outside
    assert "http://" not in outside and "www." not in outside, outside
    assert not re.search(r"(?<!\\)@", outside), outside


def test_the_gate_markdown_shows_hostile_names_and_messages_as_text():
    from stagetool.gate import compare as gate_compare
    from stagetool.gate import render as render_changes
    from stagetool.core.text import markdown_code

    snap = {"snapshot_schema": 2, "kind": "stagetool-snapshot", "stagetool_version": "0", "jax_version": "0",
            "jaxlib_version": "0", "spec": "s.yaml", "functions": {}}
    cmp = gate_compare.compare(snap, snap, failed={HOSTILE: f"trace failed: {HOSTILE}"})
    md = render_changes.render_markdown(cmp)
    _no_live_markdown(md)
    assert markdown_code(HOSTILE) in md  # the name, whole, in a code span its backtick cannot close
    assert "&lt;img src=http:\u2060//evil.example/x.png>" in md  # the message as text


def test_the_report_markdown_shows_hostile_names_and_notes_as_text():
    from stagetool.report.model import FunctionReport, MeshReport, Report, StageTimes
    from stagetool.report.render_markdown import render

    fn = FunctionReport(HOSTILE, "m.py:f", MeshReport((("data", 2),), None, "cpu", "cpu", 2, 1, None),
                        StageTimes(None, None, None), notes=(HOSTILE,), error=f"trace failed: {HOSTILE}")
    md = render(Report("report", "0", "0", "0", (fn,)))
    _no_live_markdown(md)
    assert md.count("&lt;img") == 2 and "\\@team" in md
