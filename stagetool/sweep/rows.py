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
from typing import Iterable

from stagetool.core.errors import UsageError

SWEEP_SCHEMA_VERSION = 1

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


def document(header: dict, rows: Iterable[dict], rank_by: RankBy) -> dict:
    """The sweep document: ``header`` (kind, target, axes, options, grid size, shard), the rows in grid
    order, and the best one."""
    ordered = sorted(rows, key=lambda r: r["index"])
    top, used, note = best(ordered, rank_by)
    doc = dict(header)
    doc.update(rank_by=rank_by.value, ranked_by=used.value if used else None, best=top, ranking_note=note,
               rows=ordered)
    return doc


HEADER_KEYS = ("schema_version", "kind", "stagetool_version", "jax_version", "jaxlib_version", "target",
               "function", "spec", "axes", "options", "grid_size", "shard")


def without_timings(doc: dict) -> dict:
    """A copy of a sweep document without the wall-clock parts (the rows' ``timings``), and without
    a ranking by compile time: what two runs of one grid agree on."""
    out = copy.deepcopy(doc)
    for r in out.get("rows", []):
        r.pop("timings", None)
    if out.get("rank_by") == RankBy.compile.value:
        out.pop("best", None)
    return out


def merge(docs: list[dict]) -> dict:
    """Join the documents of one sweep's shards (``--shard I/N``) into one.

    Rows are taken by id; a row in two documents must be the same (timings aside).

    Raises:
      UsageError: not sweep documents, documents of different sweeps (target, axes, options), or
        one id with two different rows.
    """
    if not docs:
        raise UsageError("sweep merge needs at least one JSON document")
    for d in docs:
        if not isinstance(d, dict) or d.get("kind") != "sweep" or d.get("schema_version") != SWEEP_SCHEMA_VERSION:
            raise UsageError("sweep merge reads sweep JSON documents (stagetool sweep --format json); "
                             f"one is not (kind {d.get('kind') if isinstance(d, dict) else None!r})")
    same = [k for k in HEADER_KEYS if k != "shard"] + ["rank_by"]
    first = docs[0]
    for d in docs[1:]:
        differs = [k for k in same if d.get(k) != first.get(k)]
        if differs:
            raise UsageError("sweep merge: the documents are of different sweeps; they differ in "
                             + ", ".join(differs), hint="merge the shards of one command line only")
    by_id: dict[str, dict] = {}
    for d in docs:
        for r in d["rows"]:
            seen = by_id.get(r["id"])
            if seen is not None and without_timings({"rows": [seen]}) != without_timings({"rows": [r]}):
                raise UsageError(f"sweep merge: configuration {r['id']} has two different rows")
            by_id.setdefault(r["id"], r)
    header = {k: first.get(k) for k in HEADER_KEYS}
    header["shard"] = None
    return document(header, by_id.values(), RankBy(first["rank_by"]))
