"""A sweep's rows (one per configuration), the ranking, and the sweep document.

A row is a plain JSON-able dict (written to ``--output-dir`` as each configuration finishes, read
back by ``--resume`` and ``sweep merge``); its fields are listed in :data:`ROW_FIELDS`. Everything
in a row but ``timings`` is a deterministic function of the configuration, so two runs of one grid
— in one process, ``--jobs N``, on Ray, or as shards merged — give equal documents once
``timings`` are dropped (:func:`without_timings`).
"""

from __future__ import annotations

import copy
import enum
import math
from typing import Any, Iterable

from stagetool.core.errors import UsageError

SWEEP_SCHEMA_VERSION = 2
"""2: rows of failed configurations are ``error`` rows (1 could say ``ok`` with no figures), the
header carries the spec text's sha256, and a shard's document names no best row."""

OK = "ok"
DOES_NOT_FIT = "does not fit"
ERROR = "error"

ROW_FIELDS = {
    "index": "position in the whole grid (0-based)",
    "id": "the configuration's stable id, also its file name in --output-dir",
    "values": "the swept axes' values: topology, mesh, --set variables (YAML scalars)",
    "status": "'ok'; 'does not fit' (peak over capacity, or XLA ran out of memory compiling); 'error'",
    "mesh": "[[axis, size], ...] staged, or null when it did not get that far",
    "platform": "cpu | gpu | tpu, or null", "device_kind": "e.g. cpu, TPU v5 lite, or null",
    "device_count": "devices in the mesh, or null",
    "peak_bytes_per_device": "the memory section's gated peak (bytes, one device): the larger of arguments + "
                             "outputs - aliased + temporaries and XLA's peak_memory_in_bytes, as every command gates it",
    "host_peak_bytes_per_device": "host memory (pinned_host, S(5)) for one execution, apart from the device peak "
                                  "(bytes, one device)",
    "capacity_bytes_per_device": "memory of one device: --device-memory, the device, the topology or the chip",
    "capacity_source": "where the capacity comes from",
    "fits": "peak <= capacity; null when either is unknown",
    "collective_bytes_per_step": "bytes each device receives through collectives per step (known runs)",
    "collective_bytes_per_step_by_mesh_axes": "{'data': bytes, 'data,model': bytes, '(no axes)': ..., "
                                              "'(unmatched)': ...} from the collectives summary",
    "collectives_unknown_runs": "collectives whose trip count is unknown (left out of the bytes per step)",
    "dcn_bytes_per_step": "on a multi-slice TPU job (slices: N), bytes each device sends between slices per step "
                          "(XLA's DCN transfers); null for one slice",
    "flops_per_device_xla": "Compiled.cost_analysis() FLOPs of one device: XLA counts a while body once",
    "flops_per_device_loop_aware": "a derived estimate: XLA's FLOPs plus (trip count - 1) x each loop body's "
                                   "(the cost section's loop_aware), the figure the roofline uses",
    "while_loops": "while loops in the compiled module (with loops the XLA FLOPs are a lower bound)",
    "chip": "the --chip of the roofline, or null",
    "roofline_step_seconds": "roofline lower bound of one step on --chip (an estimate), or null",
    "roofline_bound": "compute | memory, or null",
    "error": "{stage, exit_code, message} for a configuration that did not stage, else null",
    "timings": "{trace_s, lower_s, compile_s}: wall-clock, the one part that differs between runs",
}

OPTIONAL_ROW_FIELDS = {
    "program_sha256": "stagetool fit only: sha256 of the lowered StableHLO text, or null (not a sweep row's field)",
    "step_time": "stagetool fit only: the step-time estimate (an estimate, seconds per step on one device) as "
                 "{chip, overlapped_seconds, schedule_seconds, serial_seconds}, or null",
}


class RankBy(str, enum.Enum):
    """What ``--rank-by`` orders fitting configurations by (smallest first)."""

    step = "step"
    """Roofline step-time estimate on ``--chip`` (the default)."""
    peak = "peak"
    """Peak memory per device."""
    collectives = "collectives"
    """Collective bytes per device per step."""
    flops = "flops"
    """Loop-aware per-device FLOPs (a derived estimate; XLA's figure where there is none)."""
    compile = "compile"
    """Compile time (a timing: it varies between runs)."""


def metric(row: dict, rank_by: RankBy) -> float | None:
    """The row's figure for ``rank_by``, or None."""
    if rank_by == RankBy.step:
        return row.get("roofline_step_seconds")
    if rank_by == RankBy.peak:
        return row.get("peak_bytes_per_device")
    if rank_by == RankBy.collectives:
        return row.get("collective_bytes_per_step")
    if rank_by == RankBy.flops:
        aware = row.get("flops_per_device_loop_aware")
        return aware if aware is not None else row.get("flops_per_device_xla")
    return (row.get("timings") or {}).get("compile_s")


def eligible(row: dict) -> bool:
    """A configuration that staged and is not known not to fit."""
    return row.get("status") == OK and row.get("fits") is not False


def best(rows: Iterable[dict], rank_by: RankBy) -> tuple[str | None, RankBy | None, str | None]:
    """``(id of the best row, what it was ranked by, a note)``.

    The best is the eligible row (:func:`eligible`) with the smallest figure, ties by grid order.
    When no eligible row has a figure for ``rank_by`` (no ``--chip`` for ``step``), rows are ranked
    by peak memory instead and the note says so; None when nothing is eligible.
    """
    rows = [r for r in rows if eligible(r)]
    if not rows:
        return None, None, "no configuration stages and fits"
    note = None
    used = rank_by
    if all(metric(r, rank_by) is None for r in rows):
        if rank_by == RankBy.step:
            note = "no roofline step time (give --chip NAME): ranked by peak memory per device instead"
        else:
            note = f"no configuration reports {rank_by.value}: ranked by peak memory per device instead"
        used = RankBy.peak
    ranked = [r for r in rows if metric(r, used) is not None]
    if not ranked:
        return None, None, "no configuration reports the figure to rank by"
    top = min(ranked, key=lambda r: (metric(r, used), r["index"]))
    return top["id"], used, note


def row_label(row: dict) -> str:
    """A row's configuration as the table shows it, values as written (``topology=v5e:2x4,mesh=2x4``);
    its ``id`` (the file-name-safe ``topology=v5e_2x4``) when it has no values."""
    values = row.get("values") or {}
    return ",".join(f"{k}={v}" for k, v in values.items()) or row.get("id", "")


def best_label(doc: dict) -> str | None:
    """:func:`row_label` of the document's best row (``doc["best"]`` is its id), or None."""
    best = doc.get("best")
    if not best:
        return None
    return next((row_label(r) for r in doc.get("rows", ()) if r.get("id") == best), best)


def counts(rows: Iterable[dict]) -> dict[str, int]:
    """``{"fit": ..., "do not fit": ..., "unknown fit": ..., "failed": ...}``: configurations that staged
    and fit, that do not fit (peak over capacity, or XLA ran out of memory compiling), that staged
    with no capacity to compare with, and that failed (``error``)."""
    out = {"fit": 0, "do not fit": 0, "unknown fit": 0, "failed": 0}
    for r in rows:
        if r.get("status") == ERROR:
            out["failed"] += 1
        elif r.get("status") == DOES_NOT_FIT or r.get("fits") is False:
            out["do not fit"] += 1
        elif r.get("fits") is None:
            out["unknown fit"] += 1
        else:
            out["fit"] += 1
    return out


def document(header: dict, rows: Iterable[dict], rank_by: RankBy) -> dict:
    """The sweep document: ``header`` (kind, target, axes, options, grid size, shard), the rows in grid
    order, and the best one.

    The best is named only for the whole grid: a shard's document, or one missing rows, has
    ``best: null`` and a ``ranking_note`` saying why (``sweep merge`` of every shard names it).
    """
    ordered = sorted(rows, key=lambda r: r["index"])
    missing = header.get("grid_size") is not None and len(ordered) < header["grid_size"]
    if header.get("shard") or missing:
        top, used = None, None
        note = (f"shard {header['shard']} of the grid: 'stagetool sweep merge' of every shard names the best"
                if header.get("shard") else f"{header['grid_size'] - len(ordered)} configuration(s) of the grid "
                                            "have no row: no best is named")
    else:
        top, used, note = best(ordered, rank_by)
    doc = dict(header)
    doc.update(rank_by=rank_by.value, ranked_by=used.value if used else None, best=top, ranking_note=note,
               counts=counts(ordered), rows=ordered)
    return doc


HEADER_KEYS = ("schema_version", "kind", "stagetool_version", "jax_version", "jaxlib_version", "target",
               "function", "spec", "spec_sha256", "axes", "options", "grid_size", "shard")


# ---- validation of rows read back (--resume, sweep merge, a worker's row file) ---------------------


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _opt(check, v: Any) -> bool:
    return v is None or check(v)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


_ROW_CHECKS = {
    "index": _count,
    "id": lambda v: isinstance(v, str) and 0 < len(v) <= 4096,
    "values": lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    "status": lambda v: v in (OK, DOES_NOT_FIT, ERROR),
    "mesh": lambda v: v is None or (isinstance(v, list) and all(
        isinstance(a, list) and len(a) == 2 and _str(a[0]) and _count(a[1]) for a in v)),
    "platform": lambda v: _opt(_str, v), "device_kind": lambda v: _opt(_str, v),
    "device_count": lambda v: _opt(_count, v),
    "peak_bytes_per_device": lambda v: _opt(_number, v), "host_peak_bytes_per_device": lambda v: _opt(_number, v),
    "capacity_bytes_per_device": lambda v: _opt(_number, v),
    "capacity_source": lambda v: _opt(_str, v), "fits": lambda v: v is None or isinstance(v, bool),
    "collective_bytes_per_step": lambda v: _opt(_number, v),
    "collective_bytes_per_step_by_mesh_axes": lambda v: v is None or (
        isinstance(v, dict) and all(_str(k) and _number(n) for k, n in v.items())),
    "collectives_unknown_runs": lambda v: _opt(_count, v),
    "dcn_bytes_per_step": lambda v: _opt(_number, v),
    "flops_per_device_xla": lambda v: _opt(_number, v), "flops_per_device_loop_aware": lambda v: _opt(_number, v),
    "while_loops": lambda v: _opt(_count, v), "chip": lambda v: _opt(_str, v),
    "roofline_step_seconds": lambda v: _opt(_number, v), "roofline_bound": lambda v: _opt(_str, v),
    "error": lambda v: v is None or (isinstance(v, dict) and set(v) == {"stage", "exit_code", "message"}
                                     and _str(v["stage"]) and _count(v["exit_code"]) and _str(v["message"])),
    "timings": lambda v: isinstance(v, dict) and all(_str(k) and _opt(_number, n) for k, n in v.items()),
}


def row_problem(row: Any) -> str | None:
    """Why ``row`` is not a well-formed row (:data:`ROW_FIELDS`, each of its type, ``status`` agreeing
    with ``error``); None when it is. Rows come back from files (``--output-dir``, a worker's row,
    ``sweep merge``'s inputs), so nothing in them is used before this passes."""
    if not isinstance(row, dict):
        return f"a row is a JSON object, not {type(row).__name__}"
    if set(row) - set(OPTIONAL_ROW_FIELDS) != set(ROW_FIELDS):
        extra = sorted(set(row) - set(ROW_FIELDS) - set(OPTIONAL_ROW_FIELDS))
        absent = sorted(set(ROW_FIELDS) - set(row))
        return "fields " + "; ".join(p for p in (f"unknown: {', '.join(map(repr, extra))}" if extra else "",
                                               f"missing: {', '.join(absent)}" if absent else "") if p)
    for name, ok in _ROW_CHECKS.items():
        if not ok(row[name]):
            return f"{name}: {_shown(row[name])} is not {ROW_FIELDS[name]}"
    if not _opt(_str, row.get("program_sha256")):
        return f"program_sha256: {_shown(row['program_sha256'])} is not {OPTIONAL_ROW_FIELDS['program_sha256']}"
    step = row.get("step_time")
    if step is not None and not (isinstance(step, dict) and _str(step.get("chip")) and all(
            _number(step.get(k)) for k in ("overlapped_seconds", "schedule_seconds", "serial_seconds"))):
        return f"step_time: {_shown(step)} is not {OPTIONAL_ROW_FIELDS['step_time']}"
    if (row["status"] == ERROR and row["error"] is None) or (row["status"] == OK and row["error"] is not None):
        return f"status {row['status']!r} with error {_shown(row['error'])}"
    return None


def _shown(v: Any, n: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= n else text[:n] + "…"


def without_timings(doc: dict) -> dict:
    """A copy of a sweep document without the wall-clock parts (the rows' ``timings``), and without
    a ranking by compile time: what two runs of one grid agree on."""
    out = copy.deepcopy(doc)
    for r in out.get("rows", []):
        r.pop("timings", None)
    if out.get("rank_by") == RankBy.compile.value:
        out.pop("best", None)
    return out


def _header_problem(d: dict) -> str | None:
    checks = {"target": _str, "function": _str, "spec": _str,
              "spec_sha256": lambda v: isinstance(v, str) and len(v) == 64,
              "axes": lambda v: isinstance(v, list) and all(
                  isinstance(a, list) and len(a) == 2 and _str(a[0]) and isinstance(a[1], list)
                  and a[1] and all(_str(x) for x in a[1]) for a in v),
              "options": lambda v: isinstance(v, dict), "grid_size": lambda v: _count(v) and v >= 1,
              "shard": lambda v: v is None or _str(v), "rank_by": lambda v: isinstance(v, str) and v in {r.value for r in RankBy},
              "rows": lambda v: isinstance(v, list)}
    for k, ok in checks.items():
        if k not in d:
            return f"it has no {k!r}"
        if not ok(d[k]):
            return f"{k}: {_shown(d[k])} is not valid"
    return None


def merge(docs: list[dict], names: list[str] | None = None) -> dict:
    """Join the documents of one sweep's shards (``--shard I/N``) into one.

    Every input is checked before anything is used: a sweep document of this schema, its header's
    fields typed, every row well formed (:func:`row_problem`) and a configuration of the document's
    own grid (rebuilt from its axes: the id and index must be the grid's). Rows are taken by id; a
    row in two documents must be the same (timings aside). The result is the whole grid: a
    configuration no document has is an error naming it, so a partial merge never names a best.

    Args:
      docs: the parsed JSON documents.
      names: what to call each in messages (file names); default ``document 1``, ``2``, ...

    Raises:
      UsageError: not sweep documents of this schema, malformed headers or rows, documents of
        different sweeps (target, spec text, axes, options, grid), one id with two different rows,
        or configurations of the grid without a row.
    """
    from stagetool.sweep.grid import grid_of_axes

    if not docs:
        raise UsageError("sweep merge needs at least one JSON document")
    names = list(names) if names is not None else [f"document {i + 1}" for i in range(len(docs))]
    for name, d in zip(names, docs):
        if not isinstance(d, dict) or d.get("kind") != "sweep":
            raise UsageError(f"sweep merge: {name} is not a sweep JSON document (stagetool sweep --format json)")
        if d.get("schema_version") != SWEEP_SCHEMA_VERSION:
            raise UsageError(f"sweep merge: {name} has sweep schema {_shown(d.get('schema_version'))}, this "
                             f"stagetool reads {SWEEP_SCHEMA_VERSION}", hint="rerun the shards with this stagetool")
        problem = _header_problem(d)
        if problem:
            raise UsageError(f"sweep merge: {name} is not a valid sweep document: {problem}")
    same = [k for k in HEADER_KEYS if k != "shard"] + ["rank_by"]
    first = docs[0]
    for name, d in zip(names[1:], docs[1:]):
        differs = [k for k in same if d.get(k) != first.get(k)]
        if differs:
            raise UsageError(f"sweep merge: {names[0]} and {name} are of different sweeps; they differ in "
                             + ", ".join("the spec's text" if k == "spec_sha256" else k for k in differs),
                             hint="merge the shards of one command line on one spec only")
    try:
        grid = grid_of_axes(first["axes"])
    except UsageError as e:
        raise UsageError(f"sweep merge: {names[0]}: axes: {e.message}") from None
    if len(grid.configs) != first["grid_size"]:
        raise UsageError(f"sweep merge: {names[0]}: grid_size {first['grid_size']} is not the product of its axes "
                         f"({len(grid.configs)})")
    by_index = {c.index: c for c in grid.configs}
    by_id: dict[str, dict] = {}
    for name, d in zip(names, docs):
        for i, r in enumerate(d["rows"]):
            problem = row_problem(r)
            if problem is None:
                c = by_index.get(r["index"])
                if c is None or c.id != r["id"]:
                    problem = f"configuration {_shown(r['id'])} at index {r['index']} is not in the grid of its axes"
            if problem:
                raise UsageError(f"sweep merge: {name}: rows[{i}]: {problem}")
            seen = by_id.get(r["id"])
            if seen is not None and without_timings({"rows": [seen]}) != without_timings({"rows": [r]}):
                raise UsageError(f"sweep merge: configuration {r['id']} has two different rows")
            by_id.setdefault(r["id"], r)
    missing = [c.id for c in grid.configs if c.id not in by_id]
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise UsageError(f"sweep merge: {len(missing)} of the grid's {len(grid.configs)} configurations have no "
                         f"row: {shown}", hint="merge every shard (--shard 1/N ... N/N); a partial grid has no best")
    header = {k: first.get(k) for k in HEADER_KEYS}
    header["shard"] = None
    return document(header, by_id.values(), RankBy(first["rank_by"]))
