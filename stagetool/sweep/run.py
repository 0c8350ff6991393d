"""One configuration of a sweep, staged in a process of its own → one row.

:func:`run_isolated` starts ``python -m stagetool.sweep.run PAYLOAD ROW`` and reads the row it
writes; that process calls :func:`run_config`, which stages the function through
:func:`stagetool.pipeline.analyze` (cost, memory, collectives) and turns the report into a row
(:mod:`stagetool.sweep.rows`). A process per configuration, because JAX fixes the number of
simulated CPU devices and the compile-only topology when its backend starts; it also means that a
configuration that aborts the process (an XLA ``LLVM ERROR``) is one error row, not a lost sweep.

A payload is a JSON-able dict: ``{"config": {index, id, mesh, topology, variables},
"common": {"options": the run's :class:`~stagetool.plan.options.Options`, every field, as
:func:`stagetool.core.codec.encode` writes them}, "cwd": str, "pythonpath": str}``; the configuration's
mesh, topology and variables replace the options' own. ``stagetool fit`` adds ``program_digest`` (the row then carries
``program_sha256``, the lowered StableHLO's digest, ``replicated_inputs``, the largest input leaves
every device holds whole, and ``step_time``, the cost section's step-time estimate:
:data:`stagetool.sweep.rows.OPTIONAL_ROW_FIELDS`) to ``common``, and ``what-if`` a payload's
``leaf_shardings`` (``[[leaf path, [dim, ...]], ...]``: those input leaves' PartitionSpecs replaced,
:class:`stagetool.spec.model.LeafSharding`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from stagetool.sweep.rows import DOES_NOT_FIT, ERROR, OK, ROW_FIELDS

if TYPE_CHECKING:
    from stagetool.report.model import FunctionReport

_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|out of memory|\bOOM\b", re.IGNORECASE)
"""How XLA says a program does not fit when compiling (TPU: "RESOURCE_EXHAUSTED: ... Ran out of
memory in memory space hbm")."""


def _empty_row(config: dict) -> dict:
    from stagetool.sweep.grid import Config

    c = Config(config["index"], config["id"], config["mesh"], config["topology"],
               tuple(tuple(v) for v in config["variables"]))
    return {**dict.fromkeys(ROW_FIELDS), "index": c.index, "id": c.id, "values": c.values(), "status": ERROR,
            "timings": {"trace_s": None, "lower_s": None, "compile_s": None}}  # the fields in ROW_FIELDS' order


def row_from_function(row: dict, fn: FunctionReport) -> dict:
    """Fill ``row`` from one :class:`~stagetool.report.model.FunctionReport`: its mesh, timings and
    :class:`~stagetool.analysis.figures.Figures` (cost, memory, collectives)."""
    row.update(mesh=[list(a) for a in fn.mesh.axes], platform=fn.mesh.platform, device_kind=fn.mesh.device_kind,
               device_count=fn.mesh.device_count,
               timings={"trace_s": fn.timings.trace_s, "lower_s": fn.timings.lower_s,
                        "compile_s": fn.timings.compile_s})
    row.update(fn.figures.row())
    est = fn.cost.step_time if fn.cost is not None else None
    row["step_time"] = None if est is None else {
        "chip": est.chip, "overlapped_seconds": est.overlapped_seconds, "schedule_seconds": est.schedule_seconds,
        "serial_seconds": est.serial_seconds, "bound": est.bound,
        "tokens_per_second_per_chip": est.tokens_per_second_per_chip, "lower_bound": est.lower_bound}
    if fn.error is not None:  # the pipeline reports a failed function as data: here it is a failed row
        row.update(status=ERROR, error={"stage": "staging", "exit_code": 3, "message": str(fn.error)})
        return row
    if fn.memory is None and fn.cost is None and fn.collectives is None:
        row.update(status=ERROR, error={"stage": "staging", "exit_code": 3,
                                        "message": "the function staged with no figures (no cost, memory or "
                                                   "collectives section)"})
        return row
    row["status"] = DOES_NOT_FIT if row["fits"] is False else OK
    return row


def run_config(payload: dict) -> dict:
    """Stage one configuration in this process and return its row (never raises for the user's or
    JAX's errors: they become the row's ``error``; an out-of-memory compile is ``does not fit``)."""
    import dataclasses

    from stagetool.core import codec
    from stagetool.core.errors import StagetoolError, StagingError
    from stagetool.pipeline import analyze_plan
    from stagetool.plan.options import Options, Section
    from stagetool.plan.plan import make_plan

    config, common = payload["config"], payload["common"]
    row = _empty_row(config)
    base = codec.decode(Options, common["options"], "common.options")
    options = dataclasses.replace(base, mesh=config["mesh"], topology=config["topology"] or base.topology,
                                  variables=tuple(tuple(v) for v in config["variables"]),
                                  leaf_shardings=leaf_shardings(payload.get("leaf_shardings") or ()))
    digest = bool(common.get("program_digest"))  # stagetool fit: which program this is (a knob that changes nothing)
    sections = [Section.COST, Section.MEMORY, Section.COLLECTIVES] + \
        ([Section.LOWERED_TEXT, Section.SHARDINGS] if digest else [])
    try:
        plan = make_plan(options)  # the configuration's one parse of its target; without --chip, a row over a
        # target has its roofline and step time on that target's own chip (plan.run_chip, as every run)
        report = analyze_plan(plan, sections, command="sweep")
    except StagingError as e:
        oom = _OUT_OF_MEMORY.search(e.message) is not None
        row.update(status=DOES_NOT_FIT if oom else ERROR, fits=False if oom else None,
                   error={"stage": str(e.stage), "exit_code": int(e.exit_code), "message": e.message})
        return row
    except StagetoolError as e:
        row["error"] = {"stage": "setup", "exit_code": int(e.exit_code), "message": e.message}
        return row
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - one configuration's failure (SystemExit included) must not end the sweep
        from stagetool.core.errors import describe_exception

        row["error"] = {"stage": "unknown", "exit_code": 3, "message": describe_exception(e)}
        return row
    fn = report.functions[0]
    row = row_from_function(row, fn)
    if digest:
        import hashlib

        text = fn.module.text if fn.module is not None else None
        row["program_sha256"] = hashlib.sha256(text.encode()).hexdigest() if text else None
        row["replicated_inputs"] = replicated_inputs(fn.inputs)
    return row


REPLICATED_INPUTS_KEPT = 8
"""How many of the largest replicated input leaves a ``stagetool fit`` row keeps."""


def replicated_inputs(inputs: tuple | None) -> list[dict] | None:
    """The :data:`REPLICATED_INPUTS_KEPT` largest input leaves (``LeafReport`` s) whose compiled
    sharding is fully replicated (a PartitionSpec sharding no dimension), largest first (bytes per
    device, then path), as a row's ``replicated_inputs``; None when the inputs are not known."""
    if inputs is None:
        return None
    found = [x for x in inputs if x.compiled is not None and x.compiled.replicated and x.bytes_per_device is not None]
    found.sort(key=lambda x: (-x.bytes_per_device, x.path))
    from stagetool.analysis.fit import ReplicatedInput
    from stagetool.core import codec

    return [codec.encode(ReplicatedInput(x.path, tuple(x.shape), x.dtype, x.bytes_per_device, x.source,
                                         x.sharding_source)) for x in found[:REPLICATED_INPUTS_KEPT]]


def leaf_shardings(given: list | tuple) -> tuple:
    """A payload's ``leaf_shardings`` (``[[path, [dim, ...]], ...]``, a dim None, an axis name or a
    list of them) as :class:`stagetool.spec.model.LeafSharding` records."""
    from stagetool.core.sharding import Sharding
    from stagetool.spec.model import LeafSharding

    return tuple(LeafSharding(path, Sharding("spec", tuple(tuple(d) if isinstance(d, list) else d for d in dims)))
                 for path, dims in given)


def _error_row(payload: dict, stage: str, message: str, exit_code: int = 3) -> dict:
    row = _empty_row(payload["config"])
    row["error"] = {"stage": stage, "exit_code": exit_code, "message": message}
    return row


MAX_ROW_BYTES = 16 * 2**20
"""A worker's row file larger than this is not a row (a row is a few KiB)."""


def run_isolated(payload: dict, timeout_s: float | None = None) -> dict:
    """Run :func:`run_config` in a fresh ``python -m stagetool.sweep.run`` process and return its row.

    The process starts in ``payload["cwd"]`` with ``payload["pythonpath"]`` first on ``PYTHONPATH``
    (the stagetool that planned the sweep), in a session of its own, registered with
    :mod:`stagetool.process.cleanup` (a signal that ends the sweep kills it and what it started) and
    with the kernel's parent-death signal set (it dies if this process is killed). Its temporary
    folder is registered too. A process that dies without a row, writes a malformed one, or runs
    past ``timeout_s`` seconds (then its process group is killed) gives an error row saying so.
    """
    from stagetool.process import cleanup
    from stagetool.process.fileio import FileProblem, read_regular_text
    from stagetool.sweep.rows import row_problem

    env = dict(os.environ)
    if payload.get("pythonpath"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (payload["pythonpath"], env.get("PYTHONPATH")) if p)
    env[cleanup.PARENT_PID_ENV] = str(os.getpid())
    cwd = payload.get("cwd")
    if cwd and not os.path.isdir(cwd):
        return _error_row(payload, "setup", f"the working directory {cwd} does not exist on this host; a sweep's "
                                            "workers need the spec and the code at the same paths (a shared file "
                                            "system)", 2)
    tmp, tmp_token = cleanup.make_temp_dir("stagetool-sweep-")
    cleanup.forget(tmp_token)
    # the worker's own temporary files (its compile's dumps) go inside this folder: killed with
    # SIGKILL (a timeout, a signal that ends the sweep), it leaves nothing in TMPDIR
    env["TMPDIR"] = tmp
    with cleanup.temporary_path(tmp):
        src, dst, err = Path(tmp) / "payload.json", Path(tmp) / "row.json", Path(tmp) / "stderr"
        src.write_text(json.dumps(payload))
        with open(err, "wb") as err_file:
            proc = subprocess.Popen([sys.executable, "-m", "stagetool.sweep.run", str(src), str(dst)],
                                    cwd=cwd or None, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err_file, start_new_session=True)
        token = cleanup.register_child(proc)
        try:
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:
            cleanup.kill_child(proc)  # its group: whatever it started ends with it
            cleanup.forget(token)
        if timed_out:
            return _error_row(payload, "timeout", f"timed out after {timeout_s:g} s; the process was killed")
        if proc.returncode == 0 and os.path.lexists(dst):
            try:
                row = json.loads(read_regular_text(dst, max_bytes=MAX_ROW_BYTES, follow_symlinks=False))
            except (OSError, ValueError, RecursionError, FileProblem) as e:
                return _error_row(payload, "process", f"the worker process wrote no readable row: {e}")
            problem = row_problem(row)
            if problem is None and (row["id"], row["index"]) != (payload["config"]["id"], payload["config"]["index"]):
                problem = f"it is the row of {row['id']!r}"
            if problem is not None:
                return _error_row(payload, "process", f"the worker process wrote a malformed row: {problem}")
            return row
        from stagetool.core.text import file_tail

        tail = "\n".join(file_tail(err, 6))
    from stagetool.process.workers import process_death

    how = process_death(proc.returncode) if proc.returncode < 0 else f"the process exited with code {proc.returncode}"
    hint = " (the code called os._exit, or the process was ended from outside)" if proc.returncode == 0 else ""
    return _error_row(payload, "process", f"{how} without a row{hint}" + (f":\n{tail}" if tail else ""))


def main(argv: list[str]) -> int:
    """``python -m stagetool.sweep.run PAYLOAD.json ROW.json``: stage one configuration, write its row.

    The row is written only when the configuration ran to its end (a ``SystemExit`` or
    ``os._exit`` in the user's code leaves no row, and the parent reports the process's end)."""
    import contextlib

    from stagetool.process import cleanup
    from stagetool.process.fileio import write_atomic

    parent = os.environ.get(cleanup.PARENT_PID_ENV)
    cleanup.die_with_parent(int(parent) if parent and parent.isdigit() else None)
    payload = json.loads(Path(argv[0]).read_text())
    with contextlib.redirect_stdout(sys.stderr):  # the user's prints are not the row
        row = run_config(payload)
    write_atomic(argv[1], json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
