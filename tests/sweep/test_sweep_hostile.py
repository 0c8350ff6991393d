"""Issue 25, sweeps: a failure is never a success, files read back are checked, nothing outlives the run."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CLI_ENV, REPO, write

from stagetool.core.errors import UsageError
from stagetool.plan.options import Options
from stagetool.sweep import RankBy, SweepOptions
from stagetool.sweep.rows import ROW_FIELDS, SWEEP_SCHEMA_VERSION, document, merge, row_problem

MODEL = """
import time


def f(x, mode):
    if mode == "bad":
        raise ValueError("<img src=http://example.com/x.png> boom")
    if mode == "slow":
        time.sleep(600)
    if mode == "exit":
        import os
        os._exit(0)
    return (x * 2).sum()
"""

SPEC = """
version: 1
mesh: {axes: {data: 2}}
functions:
  f:
    target: m.py:f
    args: ['f32[8,4] @ [data, null]']
    static: {mode: ${mode}}
"""


@pytest.fixture
def sweep_dir(tmp_path, monkeypatch, isolated_imports):
    write(tmp_path, "m.py", MODEL)
    write(tmp_path, "m.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---- a failure is a failure ---------------------------------------------------------------------------


def _row(index: int, id_: str, **more) -> dict:
    row = {k: None for k in ROW_FIELDS}
    row.update(index=index, id=id_, values={"mode": id_.split("=")[1]}, status="ok", timings={"compile_s": 1.0},
               peak_bytes_per_device=100 + index, fits=True)
    row.update(more)
    return row


def test_every_row_field_is_checked_when_read_back():
    good = _row(0, "mode=good")
    assert row_problem(good) is None
    for name in ROW_FIELDS:  # each field: absent, and of another type, is a problem naming it
        assert name in row_problem({k: v for k, v in good.items() if k != name})
        assert row_problem({**good, name: object()}).startswith(f"{name}: must be")


def test_a_function_report_with_an_error_is_an_error_row_not_ok():
    from stagetool.report.model import FunctionReport, MeshReport, StageTimes
    from stagetool.sweep.run import _empty_row, row_from_function

    fn = FunctionReport("f", "m.py:f", MeshReport((("data", 2),), None, "cpu", "cpu", 2, 1, None),
                        StageTimes(None, None, None), error="f: trace failed: ValueError: boom\nline 2")
    row = row_from_function(_empty_row({"index": 0, "id": "spec", "mesh": None, "topology": None,
                                        "variables": []}), fn)
    assert row["status"] == "error" and row["error"]["message"] == "f: trace failed: ValueError: boom\nline 2"
    assert row_problem(row) is None


def test_failed_configuration_is_a_failed_row_counted_apart_and_exit_3(run_cli, sweep_dir):
    r = run_cli("sweep", "m.py:f", "--set", "mode=good,bad", "--format", "json")
    assert r.code == 3, r.stderr
    doc = r.json()
    good, bad = doc["rows"]
    assert good["status"] == "ok" and good["error"] is None and good["flops_per_device_xla"] is not None
    assert bad["status"] == "error" and "boom" in bad["error"]["message"] and bad["flops_per_device_xla"] is None
    assert doc["counts"] == {"fit": 0, "do not fit": 0, "unknown fit": 1, "failed": 1}
    assert doc["best"] == good["id"]
    text = run_cli("sweep", "m.py:f", "--set", "mode=good,bad", check=3).stdout
    assert "2 configurations; 1 stages and fits (1 with no capacity to compare with), 1 failed" in text
    md = run_cli("sweep", "m.py:f", "--set", "mode=good,bad", "--format", "markdown", check=3).stdout
    assert "<img" not in md and "&lt;img src=http:\u2060//example.com/x.png>" in md


def test_os_exit_in_a_configuration_is_a_failed_row(run_cli, sweep_dir):
    r = run_cli("sweep", "m.py:f", "--set", "mode=exit", "--format", "json", check=3)
    (row,) = r.json()["rows"]
    assert row["status"] == "error" and "exited with code 0 without a row" in row["error"]["message"]


def test_timeout_kills_the_configuration_and_leaves_no_folder(run_cli, sweep_dir, monkeypatch):
    tmp = sweep_dir / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    r = run_cli("sweep", "m.py:f", "--set", "mode=slow,good", "--timeout", "8", "--format", "json", check=3)
    slow, good = r.json()["rows"]
    assert slow["status"] == "error" and slow["error"]["stage"] == "timeout"
    assert "timed out after 8 s" in slow["error"]["message"] and good["status"] == "ok"
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_bad_timeout_is_exit_2(run_cli, sweep_dir, value):
    r = run_cli("sweep", "m.py:f", "--set", "mode=good", "--timeout", value, check=2)
    assert "--timeout" in r.stderr and "Traceback" not in r.stderr


def test_timeout_is_none_when_not_given_and_inf_is_refused_as_nan_is():
    from stagetool.sweep.driver import timeout_s

    assert timeout_s(None) is None and timeout_s(2) == 2.0
    for value in (math.inf, math.nan, 1e308, 0):
        with pytest.raises(UsageError):
            timeout_s(value)


def test_grid_size_is_capped_before_anything_runs(run_cli, sweep_dir):
    values = ",".join(f"v{i}" for i in range(101))
    write(sweep_dir, "big.yaml", SPEC.replace("${mode}", "${a}-${b}"))
    r = run_cli("sweep", "--spec", "big.yaml", "--set", f"a={values}", "--set", f"b={values}", check=2)
    assert "10201 configurations (101 a x 101 b), more than 10000" in r.stderr


def test_mesh_all_over_a_huge_device_count_is_exit_2(run_cli, sweep_dir):
    r = run_cli("sweep", "m.py:f", "--set", "mode=good", "--mesh", "all", "--devices", "1000000000000", check=2)
    assert "at most 65536 devices" in r.stderr


def test_factorisations_of_a_large_prime_are_quick():
    from stagetool.sweep.grid import factorisations

    assert factorisations(1_000_000_007, 2) == ((1, 1_000_000_007), (1_000_000_007, 1))


def test_set_of_a_reserved_axis_name_is_exit_2():
    from stagetool.sweep.grid import build_grid

    with pytest.raises(UsageError, match="name of the --mesh axis"):
        build_grid(meshes=("2x4",), topologies=None, variables={"mesh": ("1",)})


# ---- --resume: rows are checked against the grid ------------------------------------------------------


def test_resume_reindexes_rows_of_a_grown_grid_and_reruns_mistyped_ones(sweep_dir):
    from stagetool.sweep.driver import fingerprint, plan_sweep, read_finished

    out = sweep_dir / "rows"
    out.mkdir()
    small = plan_sweep(SweepOptions(Options(target="m.py:f"), set=("mode=good",), output_dir=out))
    (c,) = small.configs
    row = _row(0, c.id)
    (out / f"{c.id}.json").write_text(json.dumps({"fingerprint": fingerprint(small, c), "row": row}))
    grown = plan_sweep(SweepOptions(Options(target="m.py:f"), set=("mode=other,good",), output_dir=out))
    done = read_finished(grown, out)
    assert list(done) == ["mode=good"] and done["mode=good"]["index"] == 1  # its place in the new grid
    for bad in ({**row, "index": "0"}, {**row, "status": "fine"}, {**row, "peak_bytes_per_device": "x"},
                {**row, "id": "mode=other"}, {k: v for k, v in row.items() if k != "fits"}, [row], None,
                {**row, "status": "error"}):
        (out / f"{c.id}.json").write_text(json.dumps({"fingerprint": fingerprint(grown, grown.configs[1]),
                                                      "row": bad}))
        assert read_finished(grown, out) == {}, bad
    (out / f"{c.id}.json").write_text("[" * 100000)
    assert read_finished(grown, out) == {}
    (out / f"{c.id}.json").unlink()
    os.mkfifo(out / f"{c.id}.json")
    assert read_finished(grown, out) == {}  # a FIFO is not read (no hang)


# ---- sweep merge: inputs are checked; a partial grid is an error ----------------------------------------


def _doc(rows, *, shard=None, grid=("good", "bad"), spec_sha="a" * 64) -> dict:
    header = {"schema_version": SWEEP_SCHEMA_VERSION, "kind": "sweep", "stagetool_version": "x",
              "jax_version": "x", "jaxlib_version": "x", "target": "m.py:f", "function": "f", "spec": "s.yaml",
              "spec_sha256": spec_sha, "axes": [["mode", list(grid)]], "options": {}, "grid_size": len(grid),
              "shard": shard}
    return document(header, rows, RankBy.peak)


def test_a_shard_document_names_no_best_and_the_merge_of_all_shards_does():
    a = _doc([_row(0, "mode=good")], shard="1/2")
    b = _doc([_row(1, "mode=bad")], shard="2/2")
    assert a["best"] is None and "sweep merge" in a["ranking_note"]
    merged = merge([a, b])
    assert merged["best"] == "mode=good" and merged["shard"] is None and len(merged["rows"]) == 2


def test_merge_names_missing_rows_and_refuses_other_specs():
    a = _doc([_row(0, "mode=good")], shard="1/2")
    with pytest.raises(UsageError, match=r"1 of the grid's 2 configurations have no row: mode=bad"):
        merge([a])
    b = _doc([_row(1, "mode=bad")], shard="2/2", spec_sha="b" * 64)
    with pytest.raises(UsageError, match="differ in the spec's text"):
        merge([a, b])
    c = _doc([_row(1, "mode=bad")], shard="2/2", grid=("good", "bad", "ugly"))
    with pytest.raises(UsageError, match="axes, grid_size"):
        merge([a, c])


def _malformed() -> list:
    good = _doc([_row(0, "mode=good"), _row(1, "mode=bad")])
    out = [[], "sweep", {"kind": "sweep"}, {**good, "schema_version": 1}, {**good, "rows": {}},
           {**good, "axes": "mode"}, {**good, "grid_size": -1}, {**good, "rank_by": "speed"},
           {**good, "spec_sha256": None}]
    for change in ({"index": 7}, {"id": "mode=ugly"}, {"status": None}, {"values": []}, {"timings": None},
                   {"error": "x"}, {"fits": "yes"}, {"peak_bytes_per_device": float("inf")}):
        d = copy.deepcopy(good)
        d["rows"][0].update(change)
        out.append(d)
    d = copy.deepcopy(good)
    del d["rows"][1]["mesh"]
    out.append(d)
    d = copy.deepcopy(good)
    d["rows"][1] = 5
    out.append(d)
    d = copy.deepcopy(good)
    d["axes"] = [["mode", ["good", "good"]]]
    out.append(d)
    return out


@pytest.mark.parametrize("doc", _malformed())
def test_merge_refuses_malformed_input_with_a_usage_error(doc):
    with pytest.raises(UsageError):
        merge([doc])


def test_merge_cli_on_special_and_deep_files_is_exit_2(run_cli, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200000)
    for f in ("/dev/zero", str(deep), str(tmp_path)):
        r = run_cli("sweep", "merge", f, check=2)
        assert "Traceback" not in r.stderr and "unexpected" not in r.stderr, r.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = run_cli("sweep", "merge", str(fifo), check=2)
    assert "is a FIFO" in r.stderr
    half = tmp_path / "half.json"
    half.write_text(json.dumps(_doc([_row(0, "mode=good")], shard="1/2")))
    r = run_cli("sweep", "merge", str(half), check=2)
    assert "have no row: mode=bad" in r.stderr


# ---- no process or folder outlives the run ------------------------------------------------------------


def _stagetool(args, cwd, tmp):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", TMPDIR=str(tmp), STAGETOOL_NO_CACHE="1")
    return subprocess.Popen([sys.executable, "-m", "stagetool", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _processes_under(folder: Path) -> list[int]:
    """Pids whose command line names ``folder`` (a sweep worker's payload lives there)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if str(folder) in (d / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def _wait_for(predicate, limit_s: float = 120.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    return predicate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_sweep_ended_by_a_signal_leaves_no_process_or_folder(sweep_dir, how):
    tmp = sweep_dir / "tmp"
    tmp.mkdir()
    proc = _stagetool(["sweep", "m.py:f", "--set", "mode=slow"], sweep_dir, tmp)
    try:
        workers = _wait_for(lambda: _processes_under(tmp))
        assert workers, proc.stderr.read() if proc.poll() is not None else "no worker started"
        os.kill(proc.pid, getattr(signal, how))
        _, err = proc.communicate(timeout=60)
        assert _wait_for(lambda: not _processes_under(tmp), 30), "a configuration process outlived the sweep"
        if how == "SIGTERM":
            assert proc.returncode == 143
            assert err.strip().splitlines()[-1] == "stagetool: terminated (SIGTERM)"
            assert list(tmp.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _processes_under(tmp):
            os.kill(pid, signal.SIGKILL)


# ---- round 3 (issue 35) ---------------------------------------------------------------------------------

TEMP_THEN_SLOW = """
import tempfile
import time


def f(x, mode):
    tempfile.mkdtemp(prefix="stagetool-dump-")  # as a compile's dump is: in the configuration process's TMPDIR
    time.sleep(600)
    return x
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_configuration_killed_by_the_signal_leaves_no_temporary_folder(sweep_dir, jobs):
    """SIGTERM kills the configuration processes (SIGKILL to their groups): what they had in TMPDIR
    (a compile's dump folder) went with their own stagetool-sweep-* folder, which the sweep removes."""
    write(sweep_dir, "m.py", TEMP_THEN_SLOW)
    tmp = sweep_dir / "tmp"
    tmp.mkdir()
    proc = _stagetool(["sweep", "m.py:f", "--set", "mode=a,b,c", "--jobs", jobs], sweep_dir, tmp)
    try:
        assert _wait_for(lambda: list(tmp.rglob("stagetool-dump-*"))), proc.communicate(timeout=5)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, err
        assert _wait_for(lambda: not _processes_under(tmp), 30)
        assert list(tmp.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _processes_under(tmp):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("value", ["inf", "1e308", "700000", "1e400"])
def test_timeouts_inf_nan_or_past_a_week_are_exit_2(run_cli, sweep_dir, value):
    r = run_cli("sweep", "m.py:f", "--set", "mode=good", "--timeout", value, check=2)
    assert "--timeout" in r.stderr and "at most 604800" in r.stderr and "unexpected" not in r.stderr


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_special_file_where_a_row_goes_is_exit_2_before_anything_runs(run_cli, sweep_dir, kind):
    out = sweep_dir / "rows"
    run_cli("sweep", "m.py:f", "--set", "mode=good", "--output-dir", out, check=0)
    (row,) = list(out.iterdir())
    row.unlink()
    os.mkfifo(row) if kind == "fifo" else row.mkdir()
    start = time.monotonic()
    r = run_cli("sweep", "m.py:f", "--set", "mode=good", "--output-dir", out, "--resume", check=2)
    assert f"{row} is a {'FIFO' if kind == 'fifo' else 'folder'}" in r.stderr and time.monotonic() - start < 60


def test_an_unreachable_ray_cluster_is_exit_2_within_the_connect_timeout(sweep_dir):
    pytest.importorskip("ray")
    import socket

    silent = socket.socket()  # accepts TCP connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        tmp = sweep_dir / "tmp"
        tmp.mkdir()
        port = silent.getsockname()[1]
        for address, limit in ((f"127.0.0.1:{port}", 60), ("127.0.0.1:1", 20)):
            env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
            env.update(CLI_ENV, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", RAY_ADDRESS=address,
                       STAGETOOL_RAY_CONNECT_TIMEOUT_S="5")
            start = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "stagetool", "sweep", "m.py:f", "--set", "mode=good",
                                   "--executor", "ray"], cwd=sweep_dir, env=env, capture_output=True, text=True,
                                  timeout=150)
            assert proc.returncode == 2 and "--executor ray:" in proc.stderr, proc.stderr
            assert time.monotonic() - start < limit
    finally:
        silent.close()


def test_a_rows_figures_are_the_figures_record_in_the_rows_order():
    """The figures of a row are :meth:`Figures.row`, in the row's own field order (the JSON's key order)."""
    from stagetool.analysis.figures import CostFigures, Figures

    names = list(ROW_FIELDS)
    figures = list(Figures().row())
    assert figures == names[names.index("peak_bytes_per_device"):names.index("roofline_bound") + 1]
    row = Figures(cost=CostFigures(flops=10.0, loop_aware_flops=None)).row()
    assert (row["flops_per_device_xla"], row["flops_per_device_loop_aware"]) == (10.0, None)  # no estimate: null
