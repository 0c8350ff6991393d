"""One configuration of a sweep, staged in a process of its own → one row.

:func:`run_isolated` starts ``python -m stagetool.sweep.run PAYLOAD ROW`` and reads the row it
writes; that process calls :func:`run_config`, which stages the function through
:func:`stagetool.pipeline.analyze` (cost, memory, collectives) and turns the report into a row
(:mod:`stagetool.sweep.rows`). A process per configuration, because JAX fixes the number of
simulated CPU devices and the compile-only topology when its backend starts; it also means that a
configuration that aborts the process (an XLA ``LLVM ERROR``) is one error row, not a lost sweep.

A payload is a JSON-able dict: ``{"config": {index, id, mesh, topology, variables},
"common": {target, spec, function, platform, chip, device_memory}, "cwd": str, "pythonpath": str}``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from stagetool.sweep.rows import DOES_NOT_FIT, ERROR, OK

_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|out of memory|\bOOM\b", re.IGNORECASE)
"""How XLA says a program does not fit when compiling (TPU: "RESOURCE_EXHAUSTED: ... Ran out of
memory in memory space hbm")."""


def _empty_row(config: dict) -> dict:
    from stagetool.sweep.grid import Config

    c = Config(config["index"], config["id"], config["mesh"], config["topology"],
               tuple(tuple(v) for v in config["variables"]))
    return {"index": c.index, "id": c.id, "values": c.values(), "status": ERROR, "mesh": None, "platform": None,
            "device_kind": None, "device_count": None, "peak_bytes_per_device": None,
            "host_peak_bytes_per_device": None,
            "capacity_bytes_per_device": None, "capacity_source": None, "fits": None,
            "collective_bytes_per_step": None, "collective_bytes_per_step_by_mesh_axes": None,
            "collectives_unknown_runs": None, "dcn_bytes_per_step": None, "flops_per_device_xla": None, "flops_per_device_loop_aware": None, "while_loops": None,
            "chip": None, "roofline_step_seconds": None, "roofline_bound": None, "error": None,
            "timings": {"trace_s": None, "lower_s": None, "compile_s": None}}


def _axes_key(axes: tuple[str, ...] | None) -> str:
    if axes is None:
        return "(unmatched)"
    return ",".join(axes) if axes else "(no axes)"


def row_from_function(row: dict, fn: Any) -> dict:
    """Fill ``row`` from one :class:`~stagetool.report.model.FunctionReport` (cost, memory, collectives)."""
    row.update(mesh=[list(a) for a in fn.mesh.axes], platform=fn.mesh.platform, device_kind=fn.mesh.device_kind,
               device_count=fn.mesh.device_count,
               timings={"trace_s": fn.timings.trace_s, "lower_s": fn.timings.lower_s,
                        "compile_s": fn.timings.compile_s})
    if fn.memory is not None:
        v = fn.memory.verdict
        row.update(peak_bytes_per_device=fn.memory.record.peak_bytes,
                   host_peak_bytes_per_device=fn.memory.record.host_peak_bytes, capacity_bytes_per_device=fn.memory.capacity_bytes,
                   capacity_source=fn.memory.capacity_source, fits=v.fits)
    if fn.collectives is not None:
        s = fn.collectives.summary
        row.update(collective_bytes_per_step=s.total.executed_bytes_per_device,
                   collective_bytes_per_step_by_mesh_axes={_axes_key(t.mesh_axes): t.executed_bytes_per_device
                                                           for t in s.by_mesh_axes},
                   collectives_unknown_runs=s.total.unknown_executions_count,
                   dcn_bytes_per_step=getattr(s, "dcn_bytes_per_step", None))
    if fn.cost is not None:
        aware = fn.cost.loop_aware
        row.update(flops_per_device_xla=fn.cost.per_device.flops, while_loops=len(fn.cost.loop_trip_counts),
                   flops_per_device_loop_aware=aware.flops if aware is not None else None)
        if fn.cost.roofline is not None:
            r = fn.cost.roofline
            row.update(chip=r.chip, roofline_step_seconds=r.lower_bound_seconds, roofline_bound=r.bound)
    row["status"] = DOES_NOT_FIT if row["fits"] is False else OK
    return row


def run_config(payload: dict) -> dict:
    """Stage one configuration in this process and return its row (never raises for the user's or
    JAX's errors: they become the row's ``error``; an out-of-memory compile is ``does not fit``)."""
    from stagetool.core.errors import StagetoolError, StagingError
    from stagetool.pipeline import Options, Section, analyze

    config, common = payload["config"], payload["common"]
    row = _empty_row(config)
    options = Options(target=common["target"], spec=Path(common["spec"]), mesh=config["mesh"],
                      platform=common.get("platform"), topology=config["topology"] or common.get("topology"),
                      function=common.get("function"), chip=common.get("chip"),
                      device_memory=common.get("device_memory"), slices=common.get("slices"),
                      gpu_target_config=common.get("gpu_target_config"),
                      variables=tuple(tuple(v) for v in config["variables"]))
    try:
        report = analyze(options, [Section.COST, Section.MEMORY, Section.COLLECTIVES], command="sweep")
    except StagingError as e:
        oom = _OUT_OF_MEMORY.search(e.message) is not None
        row.update(status=DOES_NOT_FIT if oom else ERROR, fits=False if oom else None,
                   error={"stage": e.stage, "exit_code": int(e.exit_code), "message": _first_lines(e.message)})
        return row
    except StagetoolError as e:
        row["error"] = {"stage": "setup", "exit_code": int(e.exit_code), "message": _first_lines(e.message)}
        return row
    except Exception as e:  # noqa: BLE001 - one configuration's failure must not end the sweep
        row["error"] = {"stage": "unknown", "exit_code": 3, "message": _first_lines(f"{type(e).__name__}: {e}")}
        return row
    return row_from_function(row, report.functions[0])


def _first_lines(text: str, n: int = 6) -> str:
    lines = [line.rstrip() for line in str(text).strip().splitlines()]
    return "\n".join(lines[:n]) + (f"\n… ({len(lines) - n} more lines)" if len(lines) > n else "")


def run_isolated(payload: dict) -> dict:
    """Run :func:`run_config` in a fresh ``python -m stagetool.sweep.run`` process and return its row.

    The process starts in ``payload["cwd"]`` with ``payload["pythonpath"]`` first on ``PYTHONPATH``
    (the stagetool that planned the sweep). A process that dies without a row gives an error row
    with its exit status and the end of its stderr.
    """
    env = dict(os.environ)
    if payload.get("pythonpath"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (payload["pythonpath"], env.get("PYTHONPATH")) if p)
    cwd = payload.get("cwd")
    if cwd and not os.path.isdir(cwd):
        row = _empty_row(payload["config"])
        row["error"] = {"stage": "setup", "exit_code": 2,
                        "message": f"the working directory {cwd} does not exist on this host; a sweep's "
                                   "workers need the spec and the code at the same paths (a shared file system)"}
        return row
    with tempfile.TemporaryDirectory(prefix="stagetool-sweep-") as tmp:
        src, dst = Path(tmp) / "payload.json", Path(tmp) / "row.json"
        src.write_text(json.dumps(payload))
        proc = subprocess.run([sys.executable, "-m", "stagetool.sweep.run", str(src), str(dst)], cwd=cwd or None,
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, errors="replace")
        if dst.exists():
            return json.loads(dst.read_text())
    row = _empty_row(payload["config"])
    tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
    row["error"] = {"stage": "process", "exit_code": 3,
                    "message": f"the worker process exited with status {proc.returncode} without a row"
                               + (f":\n{tail}" if tail else "")}
    return row


def main(argv: list[str]) -> int:
    """``python -m stagetool.sweep.run PAYLOAD.json ROW.json``: stage one configuration, write its row."""
    import contextlib

    from stagetool.core.fileio import write_atomic

    payload = json.loads(Path(argv[0]).read_text())
    with contextlib.redirect_stdout(sys.stderr):  # the user's prints are not the row
        row = run_config(payload)
    write_atomic(argv[1], json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
