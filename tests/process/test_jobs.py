"""``--jobs N`` (issue 11.3): functions staged in worker processes give the output of a serial run."""

from __future__ import annotations

import json

import pytest

from helpers import run_subprocess, write

MODULE = """
    import jax
    import jax.numpy as jnp


    def matmul(w, x):
        print("user output goes to stderr")
        return jnp.tanh(x @ w)


    def reduce(x):
        return x.sum(axis=0)


    def gather(x):
        return jax.lax.with_sharding_constraint(x * 2, jax.sharding.PartitionSpec())
    """

SPEC = """
    version: 1
    mesh:
      axes: {data: 2, model: 4}
    functions:
      matmul:
        target: m.py:matmul
        args: ['f32[64,32] @ [null, model]', 'f32[16,64] @ [data, null]']
      reduce:
        target: m.py:reduce
        args: ['f32[64,32] @ [data, model]']
      gather:
        target: m.py:gather
        args: ['f32[64,32] @ [data, null]']
    """


@pytest.mark.multiprocess
@pytest.mark.slow
def test_jobs_give_the_serial_snapshot_and_report(run_cli, tmp_path, monkeypatch):
    """The serial snapshot (the reference) in this process through the CLI's entry point, the others
    in fresh processes as a user's are (the report's user output is printed where each traces)."""
    write(tmp_path, "m.py", MODULE)
    write(tmp_path, "m.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    run_cli("snapshot", "-s", "m.stagetool.yaml", "-o", "serial.json", check=0)
    parallel = run_subprocess("snapshot", "-s", "m.stagetool.yaml", "-o", "parallel.json", "--jobs", "2", cwd=tmp_path)
    assert parallel.code == 0, parallel.stderr
    assert (tmp_path / "serial.json").read_bytes() == (tmp_path / "parallel.json").read_bytes()
    assert list(json.loads((tmp_path / "serial.json").read_text())["functions"]) == ["gather", "matmul", "reduce"]

    reports = []
    for jobs in ("1", "3"):
        r = run_subprocess("report", "-s", "m.stagetool.yaml", "--format", "json", "--jobs", jobs, cwd=tmp_path)
        assert r.code == 0, r.stderr
        assert "user output goes to stderr" in r.stderr  # stdout is the payload alone, in workers too
        doc = r.json()
        for f in doc["functions"]:
            f.pop("timings")
            if f["memory"] and f["memory"].get("peak"):
                f["memory"]["peak"].pop("dump_compile_seconds", None)
        reports.append(doc)
    assert [f["name"] for f in reports[1]["functions"]] == ["matmul", "reduce", "gather"]  # spec order
    assert reports[0] == reports[1]
    check = run_subprocess("check", "-s", "m.stagetool.yaml", "--baseline", "serial.json", "--jobs", "3", cwd=tmp_path)
    assert check.code == 0, check.stdout + check.stderr


def test_a_bad_spec_under_jobs_is_exit_2(tmp_path):
    write(tmp_path, "m.py", MODULE)
    write(tmp_path, "m.stagetool.yaml", SPEC.replace("f32[64,32] @ [data, model]", "f32[63,32] @ [data, model]"))
    r = run_subprocess("snapshot", "-s", "m.stagetool.yaml", "-o", "x.json", "--jobs", "2", cwd=tmp_path)
    assert r.code == 2 and "not divisible" in r.stderr, r.stderr


class _BreaksInTheWorker:
    """Pickles, but raises when a spawned worker unpickles it: the worker dies before it starts."""

    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise RuntimeError("cannot start")


def _never_called(common, item):  # pragma: no cover - the workers die first
    return item


def test_workers_that_die_starting_end_the_run_with_every_item_failed():
    """A worker that cannot start is replaced, each one charged to an item, so the pool ends
    (before, it replaced such workers forever) and every item says why."""
    from stagetool.process.workers import run_in_workers

    outcomes = run_in_workers(_never_called, ["a", "b", "c"], jobs=2, common=_BreaksInTheWorker())
    assert [o.value for o in outcomes] == [None, None, None]
    assert all(o.died and o.died.startswith("the worker died before it started: the process exited with code 1")
               for o in outcomes), outcomes


class _HangsInTheWorker:
    """Pickles, but a spawned worker that unpickles it sleeps for ever: it never says "ready"."""

    def __reduce__(self):
        return (_sleep_for_ever, ())


def _sleep_for_ever():
    import time

    time.sleep(3600)


def test_a_worker_that_never_starts_is_bounded_by_the_timeout(monkeypatch):
    """--timeout covers a worker stuck before it reports ready (issue 25): it is killed once the
    start allowance (max(timeout, START_S)) is over, and the next item is charged with it."""
    from stagetool.process import workers

    monkeypatch.setattr(workers, "START_S", 1.0)
    outcomes = workers.run_in_workers(_never_called, ["a"], jobs=1, common=_HangsInTheWorker(), timeout_s=2)
    assert outcomes[0].value is None
    assert outcomes[0].died == "the worker did not start within 2 s; the process was killed", outcomes
