"""The CI gate through the real entry point: ``stagetool snapshot`` / ``check`` / ``diff``.

In-process runs go through :func:`stagetool.cli.main`; a few run ``python -m stagetool`` in a
subprocess (byte-identical snapshots across processes, ``--isolate`` with a function that aborts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from stagetool.cli import main

from helpers import REPO as ROOT  # noqa: E402
from helpers import import_afresh  # noqa: E402
EXAMPLES = ROOT / "examples"
W1_BEFORE = "['params/w1$', [null, model]]"
W1_AFTER = "['params/w1$', [model, null]]"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def run_subprocess(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", COLUMNS="200")
    env.pop("GITHUB_STEP_SUMMARY", None)
    return subprocess.run([sys.executable, "-m", "stagetool", *argv], check=False, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def project(mlp_copy, monkeypatch):
    """The MLP example copied into the working directory, with a fixed width and no step summary."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    return mlp_copy


def set_w1(project: Path, rule: str) -> None:
    spec = project / "mlp.stagetool.yaml"
    text = spec.read_text()
    old = W1_AFTER if rule == W1_BEFORE else W1_BEFORE
    assert old in text or rule in text
    spec.write_text(text.replace(old, rule))


def test_snapshot_check_regression_restore_update(project, capsys, monkeypatch):
    code, out, err = run(capsys, "snapshot", "--spec", "mlp.stagetool.yaml", "-o", "stagetool.lock.json")
    assert code == 0 and out == "" and "wrote stagetool.lock.json" in err
    first = (project / "stagetool.lock.json").read_bytes()
    assert run(capsys, "snapshot", "--spec", "mlp.stagetool.yaml", "-o", "again.json")[0] == 0
    assert (project / "again.json").read_bytes() == first
    doc = json.loads(first)
    assert doc["snapshot_schema"] == 3 and list(doc["functions"]) == ["train_step"]
    assert "timings" not in first.decode() and "_s\"" not in first.decode()

    code, out, _ = run(capsys, "check", "--spec", "mlp.stagetool.yaml")     # default --baseline
    assert code == 0 and "1 function: 1 ok" in out

    set_w1(project, W1_AFTER)
    summary = project / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    code, out, _ = run(capsys, "check", "--spec", "mlp.stagetool.yaml", "--baseline", "stagetool.lock.json",
                       "--junit-xml", "junit.xml")
    assert code == 1
    row = next(line for line in out.splitlines() if "input params/w1: sharding" in line)
    assert "P(None, 'model')" in row and "P('model', None)" in row and "regression" in row
    failing = [line for line in out.splitlines() if "  regression" in line]
    assert len(failing) > 1 and f"1 function: 1 with regressions ({len(failing)} failing changes)" in out, out
    assert doc["functions"]["train_step"]["collectives"]
    new = [line for line in out.splitlines() if "new collective" in line]
    assert new and any("all-gather" in line and "model" in line for line in new), out
    # JUnit: one testcase, failing, naming the leaf and both shardings
    suite = ET.parse(project / "junit.xml").getroot().find("testsuite")
    (case,) = suite.findall("testcase")
    assert case.get("name") == "train_step" and suite.get("failures") == "1"
    assert "input params/w1: sharding: P(None, 'model') -> P('model', None)" in case.find("failure").text
    # GitHub step summary: appended, Markdown
    text = summary.read_text()
    # it leads with the cause: the spec line of params/w1, which changed its declared sharding
    assert text.startswith(f"earlier step\n### ❌ 1 cause → {len(failing)} failing changes · stagetool check: "
                           "1 function: 1 with regressions (")
    assert "#### cause 1 · train_step: the rule at mlp.stagetool.yaml:" in text
    assert "| `input params/w1: sharding` | `P(None, 'model')` | `P('model', None)` |" in text
    monkeypatch.delenv("GITHUB_STEP_SUMMARY")

    code, out, _ = run(capsys, "check", "--spec", "mlp.stagetool.yaml", "--format", "markdown")
    assert code == 1 and out.startswith("### ❌ 1 cause → ") and "stagetool check" in out.splitlines()[0]
    assert "**regression**" in out

    set_w1(project, W1_BEFORE)
    assert run(capsys, "check", "--spec", "mlp.stagetool.yaml")[0] == 0

    set_w1(project, W1_AFTER)
    code, _, err = run(capsys, "check", "--spec", "mlp.stagetool.yaml", "--update")
    assert code == 0 and "updated stagetool.lock.json" in err
    assert json.loads((project / "stagetool.lock.json").read_text())["functions"]["train_step"]["inputs"][2] \
        ["sharding"] == "P('model', None)"
    code, out, _ = run(capsys, "check", "--spec", "mlp.stagetool.yaml", "--format", "json")
    assert code == 0 and json.loads(out)["regressions"] == 0

    # diff of two snapshot files: shown, exit 0 unless --fail-on-regression
    code, out, _ = run(capsys, "diff", "again.json", "stagetool.lock.json")
    assert code == 0 and "input params/w1: sharding" in out
    code, out, _ = run(capsys, "diff", "again.json", "stagetool.lock.json", "--format", "json")
    doc = json.loads(out)
    assert code == 0 and list(doc)[:2] == ["schema_version", "kind"]
    assert (doc["schema_version"], doc["kind"], doc["title"]) == (1, "comparison", "stagetool diff")
    assert (doc["before"], doc["after"]) == ("again.json", "stagetool.lock.json")
    assert doc["regressions"] == sum(c["status"] == "regression" for f in doc["functions"] for c in f["changes"]) > 0
    assert run(capsys, "diff", "again.json", "stagetool.lock.json", "--fail-on-regression")[0] == 1
    assert run(capsys, "diff", "again.json", "again.json", "--fail-on-regression")[0] == 0


def test_check_tolerance_option_and_spec_tolerances(project, capsys):
    assert run(capsys, "snapshot", "-s", "mlp.stagetool.yaml")[0] == 0
    set_w1(project, W1_AFTER)   # moving w1 also grows bytes accessed by far more than 1%
    code, out, _ = run(capsys, "check", "-s", "mlp.stagetool.yaml", "--format", "json")
    regressions = [c["what"] for f in json.loads(out)["functions"] for c in f["changes"] if c["status"] == "regression"]
    assert code == 1 and "cost.bytes_accessed" in regressions
    code, out, _ = run(capsys, "check", "-s", "mlp.stagetool.yaml", "--format", "json",
                       "--tolerance", "bytes_accessed=1000%")
    regressions = [c["what"] for f in json.loads(out)["functions"] for c in f["changes"] if c["status"] == "regression"]
    assert code == 1 and "cost.bytes_accessed" not in regressions and "input params/w1: sharding" in regressions
    spec = project / "mlp.stagetool.yaml"
    spec.write_text(spec.read_text() + "check:\n  functions:\n    train_step: {tolerances: {bytes_accessed: 1000%}}\n")
    code, out, _ = run(capsys, "check", "-s", "mlp.stagetool.yaml", "--format", "json")
    regressions = [c["what"] for f in json.loads(out)["functions"] for c in f["changes"] if c["status"] == "regression"]
    assert "cost.bytes_accessed" not in regressions
    code, _, err = run(capsys, "check", "-s", "mlp.stagetool.yaml", "--tolerance", "memroy=2%")
    assert code == 2 and "did you mean 'memory'" in err


@pytest.mark.parametrize("content, message", [
    (None, "baseline stagetool.lock.json not found"),
    ("[1, 2", "the baseline is not valid JSON"),
    ('{"kind": "stagetool-snapshot", "snapshot_schema": 99}', "snapshot_schema 99 is not supported"),
])
def test_bad_baseline_exits_2_with_a_message(project, capsys, content, message):
    if content is not None:
        (project / "stagetool.lock.json").write_text(content)
    code, out, err = run(capsys, "check", "-s", "mlp.stagetool.yaml")
    assert code == 2 and out == ""
    assert message in err and "hint:" in err


def test_diff_usage_errors(project, capsys):
    code, _, err = run(capsys, "diff", "a.json")
    assert code == 2 and "two snapshot files" in err
    code, _, err = run(capsys, "diff", "--mesh-a", "2x4")
    assert code == 2 and "both --mesh-a and --mesh-b" in err
    code, _, err = run(capsys, "diff", "a.json", "b.json")
    assert code == 2 and "baseline a.json not found" in err


def test_live_diff_across_meshes(project, capsys):
    code, out, _ = run(capsys, "diff", "-s", "mlp.stagetool.yaml", "--mesh-a", "2x4", "--mesh-b", "4x2")
    assert code == 0
    assert "mesh 2x4 → mesh 4x2" in out
    mesh_row = next(line for line in out.splitlines() if " mesh " in line and "data=" in line)
    assert "data=2 × model=4" in mesh_row and "data=4 × model=2" in mesh_row and "changed" in mesh_row
    # batch/x is f32[128,512] over data: 128*512*4/2 bytes per device on 2x4, /4 on 4x2; same PartitionSpec,
    # so no sharding row, but the argument bytes per device shrink
    assert "input batch/x" not in out
    assert "memory.argument_bytes" in out


def test_fewer_aliased_bytes_on_a_finer_mesh_do_not_fail_but_lost_donation_does(project, capsys):
    """``diff --mesh-a 2x4 --mesh-b 1x8``: the donated params are split over 8 devices instead of 4,
    so the aliased bytes per device fall with the outputs they alias (788,480 → 394,752 B, the
    MLP's params per device) while the outputs needing their own buffer stay 44 B: not a regression
    (before: "memory.alias_bytes -49.9% regression", exit 1). Dropping ``donate: [0]`` leaves
    the same outputs unaliased: that still fails ``check``."""
    code, out, _ = run(capsys, "diff", "-s", "mlp.stagetool.yaml", "--mesh-a", "2x4", "--mesh-b", "1x8",
                       "--format", "json")
    changes = {c["what"]: c for c in json.loads(out)["functions"][0]["changes"]}
    alias, output = changes["memory.alias_bytes"], changes["memory.output_bytes"]
    # w1 f32[512,1024], w2 f32[1024,256], b1 f32[1024] over model (4, then 8 devices); b2 f32[256] replicated
    sharded = (512 * 1024 + 1024 * 256 + 1024) * 4
    assert (alias["before_value"], alias["after_value"]) == (sharded // 4 + 1024, sharded // 8 + 1024)
    assert alias["status"] == "changed", alias
    assert output["before_value"] - alias["before_value"] == output["after_value"] - alias["after_value"] == 44
    assert code == 0 and not [w for w, c in changes.items() if w.startswith("memory.") and c["status"] == "regression"]

    assert run(capsys, "snapshot", "-s", "mlp.stagetool.yaml", "-o", "lock.json")[0] == 0
    spec = project / "mlp.stagetool.yaml"
    spec.write_text(spec.read_text().replace("    donate: [0]", "    donate: []"))
    code, out, _ = run(capsys, "check", "-s", "mlp.stagetool.yaml", "--baseline", "lock.json", "--format", "json")
    changes = {c["what"]: c for c in json.loads(out)["functions"][0]["changes"]}
    assert changes["memory.alias_bytes"]["status"] == "regression" and changes["memory.alias_bytes"]["after_value"] == 0
    assert code == 1


_TWO = """\
import jax.numpy as jnp


def keep(x):
    return jnp.sin(x) * 2


def drop(x):
    return jnp.cos(x) + 1
"""

_TWO_SPEC = """\
version: 1
mesh:
  axes: {data: 8}
functions:
  keep:
    target: two.py:keep
    args: ['f32[64,16] @ [data, null]']
  drop:
    target: two.py:drop
    args: ['f32[64,16] @ [data, null]']
"""


def test_check_fails_when_a_baseline_function_is_no_longer_staged(project, capsys):
    (project / "two.py").write_text(_TWO)
    spec = project / "two.stagetool.yaml"
    spec.write_text(_TWO_SPEC)
    assert run(capsys, "snapshot", "-s", "two.stagetool.yaml", "-o", "two.lock.json")[0] == 0
    code, out, _ = run(capsys, "check", "-s", "two.stagetool.yaml", "-b", "two.lock.json")
    assert code == 0 and "2 functions: 2 ok" in out

    spec.write_text(_TWO_SPEC.split("  drop:")[0])     # `drop` deleted from the spec
    code, out, _ = run(capsys, "check", "-s", "two.stagetool.yaml", "-b", "two.lock.json", "--junit-xml", "j.xml")
    assert code == 1, out
    row = next(line for line in out.splitlines() if line.strip().startswith("drop"))
    assert "regression" in row and "no longer staged" in row
    code, out, _ = run(capsys, "check", "-s", "two.stagetool.yaml", "-b", "two.lock.json", "--format", "json")
    doc = json.loads(out)
    assert code == 1 and doc["regressions"] == 1
    assert {f["name"]: f["status"] for f in doc["functions"]} == {"keep": "ok", "drop": "removed"}
    cases = {c.get("name"): c for c in ET.parse(project / "j.xml").getroot().iter("testcase")}
    assert cases["drop"].find("failure") is not None and cases["keep"].find("failure") is None
    code, out, _ = run(capsys, "check", "-s", "two.stagetool.yaml", "-b", "two.lock.json", "--format", "markdown")
    assert code == 1 and out.startswith("### ❌") and "| `drop` | `function` |" in out

    # restricted on purpose: only the selected function is compared, the other is not mentioned
    spec.write_text(_TWO_SPEC)
    for argv in (["-f", "keep"], ["two.py:keep"]):
        code, out, _ = run(capsys, "check", *argv, "-s", "two.stagetool.yaml", "-b", "two.lock.json")
        assert code == 0 and "1 function: 1 ok" in out and "drop" not in out, (argv, out)

    # a rename: the old name fails, the new one is shown as new
    spec.write_text(_TWO_SPEC.replace("  drop:", "  dropped:"))
    code, out, _ = run(capsys, "check", "-s", "two.stagetool.yaml", "-b", "two.lock.json", "--format", "json")
    assert code == 1
    assert {f["name"]: f["status"] for f in json.loads(out)["functions"]} == {"keep": "ok", "dropped": "new",
                                                                              "drop": "removed"}


def test_update_restricted_to_one_function_keeps_the_others(project, capsys):
    (project / "two.py").write_text(_TWO)
    spec = project / "two.stagetool.yaml"
    spec.write_text(_TWO_SPEC)
    assert run(capsys, "snapshot", "-s", "two.stagetool.yaml", "-o", "two.lock.json")[0] == 0
    lock = project / "two.lock.json"
    doc = json.loads(lock.read_text())
    spec.write_text(_TWO_SPEC.replace("[data, null]']\n  drop:", "[null, data]']\n  drop:", 1))   # `keep` moves
    code, _, err = run(capsys, "check", "-s", "two.stagetool.yaml", "-b", "two.lock.json", "-f", "keep", "--update")
    assert code == 0 and "(1 function; 1 other kept as it was)" in err, err
    after = json.loads(lock.read_text())
    assert list(after["functions"]) == ["drop", "keep"]
    assert after["functions"]["drop"] == doc["functions"]["drop"]
    assert after["functions"]["keep"]["inputs"][0]["sharding"] != doc["functions"]["keep"]["inputs"][0]["sharding"]
    code, out, _ = run(capsys, "check", "-s", "two.stagetool.yaml", "-b", "two.lock.json")
    assert code == 0 and "2 functions: 2 ok" in out
    # a baseline from another jax: a partial update would mix the two environments
    lock.write_text(json.dumps(dict(after, jax_version="0.0.1")))
    code, _, err = run(capsys, "check", "-s", "two.stagetool.yaml", "-b", "two.lock.json", "-f", "keep", "--update")
    assert code == 2 and "partial update would mix" in err
    assert json.loads(lock.read_text())["jax_version"] == "0.0.1"


def _workflow_commands() -> tuple[list[str], list[str]]:
    """The example workflow's ``stagetool ...`` command lines (run steps and the header comment), and
    its ``pip install`` lines; backslash continuations joined."""
    import yaml

    text = (EXAMPLES / "ci" / "stagetool-check.yml").read_text()
    doc = yaml.safe_load(text)
    runs = [step["run"] for step in doc["jobs"]["stagetool"]["steps"] if "run" in step]
    script = "\n".join(runs).replace("\\\n", " ").splitlines()
    comments = [ln.lstrip("# ").strip() for ln in text.splitlines() if ln.startswith("#")]
    stagetool = [ln.strip() for ln in script + comments if ln.strip().startswith("stagetool ")]
    pip = [ln.strip() for ln in script if "pip install" in ln]
    return stagetool, pip


def test_example_workflow_commands_run_against_the_real_cli(project, capsys):
    import shlex

    commands, pip = _workflow_commands()
    # stagetool is not on PyPI: nothing installs a package named "stagetool" from an index
    for line in pip:
        assert "stagetool" not in shlex.split(line), line
    assert any("install -e ./.stagetool" in line for line in pip)
    check = next(c for c in commands if "--junit-xml" in c)
    update = next(c for c in commands if "--update" in c)
    (project / "mlp.stagetool.yaml").rename(project / "stagetool.yaml")
    assert run(capsys, "snapshot", "--spec", "stagetool.yaml")[0] == 0
    code, _, err = run(capsys, *shlex.split(check)[1:])
    assert code == 0, err
    assert (project / "stagetool-check.md").read_text().startswith("### ✅ stagetool check: 1 function: 1 ok")
    assert ET.parse(project / "stagetool-junit.xml").getroot().find("testsuite").get("tests") == "1"
    assert run(capsys, *shlex.split(update)[1:])[0] == 0


def test_snapshot_is_byte_identical_across_processes(project, capsys):
    assert run(capsys, "snapshot", "-s", "mlp.stagetool.yaml", "-o", "inproc.json")[0] == 0
    proc = run_subprocess("snapshot", "-s", "mlp.stagetool.yaml", "-o", "sub.json", cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert (project / "sub.json").read_bytes() == (project / "inproc.json").read_bytes()


_FUNCS = """\
import os
import sys

import jax.numpy as jnp


def good(x):
    return jnp.sin(x) * 2


def bad(x):
    print("LLVM ERROR: out of registers (simulated)", file=sys.stderr, flush=True)
    os.abort()
"""

_FUNCS_SPEC = """\
version: 1
mesh:
  axes: {data: 8}
functions:
  good:
    target: funcs.py:good
    args: ['f32[64,16] @ [data, null]']
  bad:
    target: funcs.py:bad
    args: ['f32[64,16] @ [data, null]']
"""


def test_isolate_reports_an_aborting_function_and_checks_the_others(tmp_path):
    (tmp_path / "funcs.py").write_text(_FUNCS)
    (tmp_path / "funcs.stagetool.yaml").write_text(_FUNCS_SPEC)
    proc = run_subprocess("snapshot", "-s", "funcs.stagetool.yaml", "-f", "good", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = run_subprocess("check", "-s", "funcs.stagetool.yaml", "--isolate", "--junit-xml", "j.xml", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    # the worker's last stderr line is in the failure: what a CI log needs to say why
    assert "bad: the process died with SIGABRT: LLVM ERROR: out of registers (simulated)" in proc.stderr
    assert "FAILED: the process died with SIGABRT" in proc.stdout
    assert "2 functions: 1 failed to stage, 1 ok" in proc.stdout
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "j.xml").getroot().iter("testcase")}
    assert cases["bad"].find("error") is not None and cases["good"].find("error") is None
    proc = run_subprocess("snapshot", "-s", "funcs.stagetool.yaml", "--isolate", "-o", "all.json", cwd=tmp_path)
    assert proc.returncode == 3 and not (tmp_path / "all.json").exists()
    # the same workers as --jobs: two at a time, the same outcome
    proc = run_subprocess("check", "-s", "funcs.stagetool.yaml", "--isolate", "--jobs", "2", cwd=tmp_path)
    assert proc.returncode == 3 and "2 functions: 1 failed to stage, 1 ok" in proc.stdout, proc.stderr


def test_a_loop_that_runs_longer_is_a_regression(tmp_path, capsys, monkeypatch):
    """Same ops, more trips: per-step collective bytes grow although no op changed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop.py").write_text(
        "import jax\nimport jax.numpy as jnp\nfrom jax.sharding import PartitionSpec as P\n\n\n"
        "def f(w, h, n):\n"
        "    def body(i, h):\n"
        "        g = jax.lax.with_sharding_constraint(h, P())\n"
        "        return jax.lax.with_sharding_constraint(jnp.tanh(g @ w), P('data', None))\n"
        "    return jax.lax.fori_loop(0, n, body, h)\n")
    spec = tmp_path / "loop.stagetool.yaml"
    text = ("mesh: {axes: {data: 2}}\nfunctions:\n  f:\n    target: loop.py:f\n"
            "    args: ['f32[64,64]', 'f32[64,64] @ [data, null]']\n    static: {n: N}\n")
    spec.write_text(text.replace("N", "4"))
    assert run(capsys, "snapshot", "--spec", str(spec), "-o", "lock.json")[0] == 0
    doc = json.loads((tmp_path / "lock.json").read_text())
    (row,) = [r for r in doc["functions"]["f"]["collectives"] if r["kind"] == "all-gather"]
    assert row["bytes_per_step"] == 4 * row["bytes_per_device"] == 4 * 64 * 64 * 4
    spec.write_text(text.replace("N", "40"))
    code, out, _ = run(capsys, "check", "--spec", str(spec), "--baseline", "lock.json")
    assert code == 1 and "bytes per step" in out


def test_a_partial_snapshot_over_a_fuller_one_says_what_it_drops(project, capsys):
    assert run(capsys, "snapshot", "--spec", "mlp.stagetool.yaml", "-o", "full.json")[0] == 0
    doc = json.loads((project / "full.json").read_text())
    doc["functions"]["other_step"] = doc["functions"]["train_step"]   # as if the spec had a second function
    (project / "full.json").write_text(json.dumps(doc))
    code, _, err = run(capsys, "snapshot", "--spec", "mlp.stagetool.yaml", "-f", "train_step", "-o", "full.json")
    assert code == 0 and "held other_step, which this snapshot does not" in err and "check --update -f" in err


def test_text_and_html_write_each_change_the_same_way():
    """One formatter for a change's percentage (``core.units.format_change``): the text table and the
    HTML page of ``check`` show ``+0.5%``, ``+<0.001%``, ``-12.5%``, ``0.0%`` and ``new`` alike (the page
    wrote ``0.5%`` and ``0.0%`` for the first two)."""
    import html as html_lib
    import re

    from stagetool.gate.compare import Change, Comparison, FunctionResult
    from stagetool.gate.render import render_html, render_text

    def metric(what, before, after, status="regression"):
        change = None if before == 0 else after / before - 1
        return Change("f", what, str(before), str(after), status, before_value=before, after_value=after, change=change)

    changes = (metric("memory.peak_bytes", 2000, 2010), metric("cost.flops", 1_000_000_000, 1_000_000_001),
               metric("memory.temp_bytes", 800, 700, "improvement"), metric("memory.alias_bytes", 10, 10, "changed"),
               metric("cost.transcendentals", 0, 64))
    cmp = Comparison("stagetool check", "base.json", "now", (FunctionResult("f", "regression", changes),))
    want = ["+0.5%", "+<0.001%", "-12.5%", "0.0%", "new"]
    text = render_text(cmp, width=200)
    for c, pct in zip(changes, want):
        (row,) = [line for line in text.splitlines() if c.what in line]
        assert f" {pct} " in f" {row} ", (c.what, row)
    page = render_html(cmp)
    cells = [html_lib.unescape(m) for m in re.findall(r'</code></td>\s*<td class="r">([^<]*)</td>', page)]
    assert cells == want


def test_an_edit_with_no_consequence_prints_no_empty_table():
    """jax-llm-examples' llama3 with a rule edited: its second cause (constraints changed with the
    rule) leads to no change of its own (they are the first cause's or unexplained); the text lists
    its edit lines and no table head without rows."""
    from stagetool.gate.compare import Cause, Change, Comparison, FunctionResult
    from stagetool.gate.render import render_text

    peak = Change("f", "memory.peak_bytes", "1.70 MiB", "4.33 MiB", "regression", before_value=1783148,
                  after_value=4538000, change=4538000 / 1783148 - 1)
    rule = Cause("f", "declared", "the init's own sharding changed the declared sharding of 1 input", "s.yaml:8",
                 ("w: P(None, 'y') → P(None, None)",), (peak,), (True,))
    bare = Cause("f", "constraint", "the sharding constraint at model.py:930 changed", "model.py:930",
                 ("model.py:930: P(None, 'y') → P(None, None)",))
    cmp = Comparison("stagetool check", "base.json", "now",
                     (FunctionResult("f", "regression", (peak,), causes=(rule, bare)),))
    lines = render_text(cmp, width=200).splitlines()
    heads = [i for i, line in enumerate(lines) if line.split() == ["what", "before", "after", "change", "status"]]
    assert len(heads) == 1  # the first cause's table only
    at = next(i for i, line in enumerate(lines) if line.startswith("cause 2 · f: the sharding constraint at model.py:930"))
    assert lines[at + 1].strip() == "model.py:930: P(None, 'y') → P(None, None)" and heads[0] < at


def test_a_long_leaf_path_is_never_folded_in_a_file_or_a_pipe(project, capsys, tmp_path):
    """A check/diff table written to a file (-o) or a pipe keeps every cell whole, as report's text
    does: a long leaf path (Keras', MaxText's) on one line, not folded mid-word at the terminal width."""
    code, _, err = run(capsys, "snapshot", "-o", "a.json")
    assert code == 0, err
    doc = json.loads(Path("a.json").read_text())
    (fn,) = doc["functions"].values()
    long = "/".join(["state/model/transformer_blocks/layer_017/self_attention/query_projection"] * 3) + "/kernel"
    assert len(long) > 200  # wider than the terminal the fixture sets (COLUMNS=200)
    fn["inputs"][0]["path"] = long
    Path("a.json").write_text(json.dumps(doc))
    fn["inputs"][0]["sharding"] = "P(None)"
    Path("b.json").write_text(json.dumps(doc))
    for out in (["-o", "out.txt"], []):
        code, stdout, _ = run(capsys, "diff", "a.json", "b.json", *out)
        text = Path("out.txt").read_text() if out else stdout
        (row,) = [line for line in text.splitlines() if "P(None)" in line]
        assert f"input {long}: sharding" in row, text


# --------------------------------------------------- issue 47: a faster step, a chip profile changed, lower bounds

PRECISE = """\
import jax
import jax.numpy as jnp

PREC = jax.lax.Precision.HIGHEST


def step(x, w):
    return jnp.dot(x, w, precision=PREC)
"""
PRECISE_SPEC = """\
mesh: {axes: {data: 2}}
functions:
  step:
    target: precise47.py:step
    args: ['f32[2048,2048] @ [data, null]', 'f32[2048,2048]']
"""


def test_a_faster_step_is_an_improvement_in_check_and_diff(tmp_path, capsys, monkeypatch, isolated_imports):
    """Issue 47 item 1: a Precision.HIGHEST matmul changed to the default precision made the step time
    an improvement whose note was None + str: check, diff and the fixture exited 3 "unexpected TypeError"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "precise47.py").write_text(PRECISE)
    (tmp_path / "m.stagetool.yaml").write_text(PRECISE_SPEC)
    argv = ("--spec", "m.stagetool.yaml", "--chip", "tpu-v5e", "--no-cache")
    assert run(capsys, "snapshot", *argv, "-o", "highest.json")[0] == 0
    (tmp_path / "precise47.py").write_text(PRECISE.replace("HIGHEST", "DEFAULT"))
    import_afresh("precise47", tmp_path)  # the edited code, as a new process would import it
    code, out, err = run(capsys, "check", *argv, "--baseline", "highest.json", "--format", "json")
    assert code == 0, out + err
    (change,) = [c for c in json.loads(out)["functions"][0]["changes"] if c["what"].startswith("step time")]
    before, after = json.loads((tmp_path / "highest.json").read_text())["functions"]["step"]["step_time"]["seconds"], \
        change["after_value"]
    assert change["status"] == "improvement" and change["before_value"] == before and after < before / 2
    assert change["note"].startswith("shrank: compute −") and "bound by compute" in change["note"]
    assert run(capsys, "snapshot", *argv, "-o", "default.json")[0] == 0
    code, out, _ = run(capsys, "diff", "highest.json", "default.json")
    assert code == 0 and "improvement" in out and "shrank: compute" in out
    code, out, _ = run(capsys, "diff", "default.json", "highest.json", "--fail-on-regression")  # the other way: fails
    assert code == 1 and "regression" in out and "grew: compute +" in out


FORGED_CHIP = "chips:\n  tpu-v5e:\n    matmul_flops_per_second: {f32_highest: 1.5589e14}\n"


def test_a_forged_chip_profile_cannot_hide_a_slower_step_and_a_new_one_is_not_the_codes(tmp_path, capsys, monkeypatch,
                                                                                      isolated_imports):
    """Issue 47 item 2: a chips: entry whose f32_highest rate is the f32 one made a step the code made 5x
    slower (DEFAULT → HIGHEST) read as before: "no changes", exit 0. The snapshot now records the figures
    (their digest) and the step timed with the built-in ones; the profile's change is listed apart."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "precise47.py").write_text(PRECISE.replace("HIGHEST", "DEFAULT"))
    (tmp_path / "m.stagetool.yaml").write_text(PRECISE_SPEC)
    argv = ("--spec", "m.stagetool.yaml", "--chip", "tpu-v5e", "--no-cache")
    assert run(capsys, "snapshot", *argv, "-o", "lock.json")[0] == 0
    recorded = json.loads((tmp_path / "lock.json").read_text())
    st = recorded["functions"]["step"]["step_time"]
    from stagetool.devices.tpu_topology import libtpu_version

    assert st["profile"]["builtin"] is True and "builtin" not in st
    assert recorded.get("libtpu_version") == libtpu_version()  # a TPU chip's figures: the libtpu beside them
    assert st["profile"]["figures"]["matmul.f32_highest"] == 2.9412e13  # the calibrated v5e rate
    (tmp_path / "precise47.py").write_text(PRECISE)
    import_afresh("precise47", tmp_path)
    (tmp_path / "m.stagetool.yaml").write_text(FORGED_CHIP + PRECISE_SPEC)
    code, out, err = run(capsys, "check", *argv, "--baseline", "lock.json", "--format", "json")
    assert code == 1, out + err
    changes = json.loads(out)["functions"][0]["changes"]
    (gated,) = [c for c in changes if c["status"] == "regression"]
    assert "built-in figures" in gated["what"] and gated["after_value"] > 4 * gated["before_value"]
    (profile,) = [c for c in changes if c["apart"] == "chip profile changed"]
    assert profile["status"] == "changed" and "matmul.f32_highest 2.94e+13 → 1.56e+14" in profile["note"]
    # the code unchanged, the profile changed: listed apart, never the code's, exit 0
    assert run(capsys, "snapshot", *argv[:-1], "-o", "forged.json")[0] == 0
    (tmp_path / "m.stagetool.yaml").write_text(PRECISE_SPEC)
    code, out, _ = run(capsys, "check", *argv, "--baseline", "forged.json")
    assert code == 0 and "chip profile changed · step" in out and "regression" not in out, out


def test_a_sort_that_makes_the_step_a_lower_bound_fails_check(tmp_path, capsys, monkeypatch, isolated_imports):
    """Issue 47 item 3: a sort counted at a floor moved the estimate a few percent ("within tolerance"); a
    step time that becomes a lower bound now fails, under its own heading, written "at least"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "precise47.py").write_text(PRECISE.replace("HIGHEST", "DEFAULT"))
    (tmp_path / "m.stagetool.yaml").write_text(PRECISE_SPEC)
    argv = ("--spec", "m.stagetool.yaml", "--chip", "tpu-v5e", "--no-cache")
    assert run(capsys, "snapshot", *argv, "-o", "lock.json")[0] == 0
    (tmp_path / "precise47.py").write_text(PRECISE.replace("HIGHEST", "DEFAULT").replace(
        "    return jnp.dot(x, w, precision=PREC)", "    return jnp.sort(jnp.dot(x, w, precision=PREC), axis=-1)"))
    import_afresh("precise47", tmp_path)
    code, out, _ = run(capsys, "check", *argv, "--baseline", "lock.json")
    assert code == 1 and "lower bound · step" in out and "at least" in out, out
    code, out, _ = run(capsys, "check", *argv, "--baseline", "lock.json", "--format", "json")
    (c,) = [c for c in json.loads(out)["functions"][0]["changes"] if c["subject"] == ["step_time"]]
    assert (c["status"], c["apart"]) == ("regression", "lower bound") and c["after"].startswith("at least ")
    assert c["note"].startswith("now a lower bound (work not counted now: sort at precise47.py:8)")
    code, out, _ = run(capsys, "check", *argv, "--baseline", "lock.json", "--format", "markdown")
    assert code == 1 and "#### lower bound · step" in out and "`at least" in out
