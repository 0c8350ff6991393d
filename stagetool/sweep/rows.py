"""A sweep's rows (one per configuration), the ranking, and the sweep document.

A row is a plain JSON-able dict (written to ``--output-dir`` as each configuration finishes, read
back by ``--resume`` and ``sweep merge``), checked against the :class:`Row` record (:data:`ROW_FIELDS`
says what each field holds). Everything
in a row but ``timings`` is a deterministic function of the configuration, so two runs of one grid
— in one process, ``--jobs N``, on Ray, or as shards merged — give equal documents once
``timings`` are dropped (:func:`without_timings`).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from stagetool.analysis.figures import flops_estimate
from stagetool.analysis.fit import ReplicatedInput
from stagetool.core import codec
from stagetool.core.codec import Check
from stagetool.core.errors import UsageError

SWEEP_SCHEMA_VERSION = 2
"""2: rows of failed configurations are ``error`` rows (1 could say ``ok`` with no figures), the
header carries the spec text's sha256, and a shard's document names no best row."""

OK = "ok"
DOES_NOT_FIT = "does not fit"
ERROR = "error"

_COUNT = Annotated[int, Check(lambda n: n >= 0, "not negative")]


def _doc(text: str) -> Any:
    return dataclasses.field(metadata={"doc": text})


@dataclasses.dataclass(frozen=True)
class RowError:
    """Why a configuration did not stage: the stage, the exit code it would have had, the message."""

    stage: str
    exit_code: _COUNT
    message: str


@dataclasses.dataclass(frozen=True)
class RowStepTime:
    """A row's step-time estimate (seconds per step on one device, an estimate): its chip, the range
    and the schedule's figure; sweep rows add what bounds it, where the spec names
    ``tokens_per_step`` tokens per second per chip, and whether the figure is a lower bound (work no
    model covers: the step takes at least it)."""

    chip: str
    overlapped_seconds: float
    schedule_seconds: float
    serial_seconds: float
    bound: str | None = None
    tokens_per_second_per_chip: float | None = None
    lower_bound: bool = False


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration's row as a file holds it (``--output-dir``, a worker's row, ``sweep merge``'s
    inputs): every field present, each of its type (:func:`row_problem`); what each holds is its
    ``doc`` (:data:`ROW_FIELDS`)."""

    index: _COUNT = _doc("position in the whole grid (0-based)")
    id: Annotated[str, Check(lambda s: 0 < len(s) <= 4096, "of 1 to 4096 characters")] = _doc(
        "the configuration's stable id, also its file name in --output-dir")
    values: dict[str, Any] = _doc("the swept axes' values: topology, mesh, --set variables (YAML scalars)")
    status: Literal["ok", "does not fit", "error"] = _doc(
        "'ok'; 'does not fit' (peak over capacity, or XLA ran out of memory compiling); 'error'")
    mesh: tuple[tuple[str, _COUNT], ...] | None = _doc("[[axis, size], ...] staged, or null when it did not get that far")
    platform: str | None = _doc("cpu | gpu | tpu, or null")
    device_kind: str | None = _doc("e.g. cpu, TPU v5 lite, or null")
    device_count: _COUNT | None = _doc("devices in the mesh, or null")
    peak_bytes_per_device: float | None = _doc(
        "the memory section's gated peak (bytes, one device): the larger of arguments + outputs - aliased + "
        "temporaries and XLA's peak_memory_in_bytes, as every command gates it")
    host_peak_bytes_per_device: float | None = _doc(
        "host memory (pinned_host, S(5)) for one execution, apart from the device peak (bytes, one device)")
    capacity_bytes_per_device: float | None = _doc(
        "memory of one device: --device-memory, the device, the topology or the chip")
    capacity_source: str | None = _doc("where the capacity comes from")
    fits: bool | None = _doc("peak <= capacity; null when either is unknown")
    collective_bytes_per_step: float | None = _doc(
        "bytes each device receives through collectives per step (known runs)")
    collective_bytes_per_step_by_mesh_axes: dict[str, float] | None = _doc(
        "{'data': bytes, 'data,model': bytes, '(no axes)': ..., '(unmatched)': ...} from the collectives summary")
    collectives_unknown_runs: _COUNT | None = _doc(
        "collectives whose trip count is unknown (left out of the bytes per step)")
    dcn_bytes_per_step: float | None = _doc(
        "on a multi-slice TPU job (slices: N), bytes each device sends between slices per step (XLA's DCN "
        "transfers); null for one slice")
    flops_per_device_xla: float | None = _doc(
        "Compiled.cost_analysis() FLOPs of one device: XLA counts a while body once")
    flops_per_device_loop_aware: float | None = _doc(
        "a derived estimate: XLA's FLOPs plus (trip count - 1) x each loop body's (the cost section's "
        "loop_aware), the figure the roofline uses")
    while_loops: _COUNT | None = _doc("while loops in the compiled module (with loops the XLA FLOPs are a lower bound)")
    chip: str | None = _doc("the --chip of the roofline, or null")
    roofline_step_seconds: float | None = _doc("roofline lower bound of one step on --chip (an estimate), or null")
    roofline_bound: str | None = _doc("compute | memory, or null")
    error: RowError | None = _doc("{stage, exit_code, message} for a configuration that did not stage, else null")
    timings: dict[str, float | None] = _doc(
        "{trace_s, lower_s, compile_s}: wall-clock, the one part that differs between runs")
    program_sha256: str | None = dataclasses.field(default=None, metadata={
        "omit": True, "doc": "stagetool fit only: sha256 of the lowered StableHLO text, or null (not a sweep row's field)"})
    step_time: RowStepTime | None = dataclasses.field(default=None, metadata={
        "omit": True, "doc": "the step-time estimate (an estimate, seconds per step on one device) as {chip, "
                             "overlapped_seconds, schedule_seconds, serial_seconds, bound, tokens_per_second_per_chip, "
                             "lower_bound (true: at least this, work no model covers)}, or null; absent from rows "
                             "written before it existed"})
    replicated_inputs: tuple[ReplicatedInput, ...] | None = dataclasses.field(default=None, metadata={
        "omit": True, "doc": "stagetool fit only: the largest input leaves every device holds whole (compiled "
                             "sharding fully replicated; a refused compile's declared one), largest first, as "
                             "{path, shape, dtype, bytes_per_device, source, sharding_source}; null when not known"})


ROW_FIELDS = {f.name: f.metadata["doc"] for f in dataclasses.fields(Row) if not f.metadata.get("omit")}
"""Each field of a sweep row, with what it holds."""
OPTIONAL_ROW_FIELDS = {f.name: f.metadata["doc"] for f in dataclasses.fields(Row) if f.metadata.get("omit")}
"""Fields a row may have beyond :data:`ROW_FIELDS` (``stagetool fit``'s)."""


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
    step_time = "step_time"
    """The step-time estimate's schedule figure (:mod:`stagetool.analysis.step_time`: compute,
    collectives by link class, overlap) on ``--chip`` or each target's chip."""


def metric(row: dict, rank_by: RankBy) -> float | None:
    """The row's figure for ``rank_by``, or None."""
    if rank_by == RankBy.step:
        return row.get("roofline_step_seconds")
    if rank_by == RankBy.step_time:
        return (row.get("step_time") or {}).get("schedule_seconds")
    if rank_by == RankBy.peak:
        return row.get("peak_bytes_per_device")
    if rank_by == RankBy.collectives:
        return row.get("collective_bytes_per_step")
    if rank_by == RankBy.flops:
        return flops_estimate(row.get("flops_per_device_loop_aware"), row.get("flops_per_device_xla"))
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
    every = list(rows)
    rows = [r for r in every if eligible(r)]
    if not rows:
        return None, None, "no configuration stages and fits"
    note = None
    used = rank_by
    if all(metric(r, rank_by) is None for r in rows):
        if rank_by in (RankBy.step, RankBy.step_time):
            note = (f"no {'roofline ' if rank_by == RankBy.step else ''}step time (give --chip NAME): ranked by "
                    "peak memory per device instead")
        else:
            note = f"no configuration reports {rank_by.value}: ranked by peak memory per device instead"
        used = RankBy.peak
    ranked = [r for r in rows if metric(r, used) is not None]
    if not ranked:
        return None, None, "no configuration reports the figure to rank by"
    top = min(ranked, key=lambda r: (metric(r, used), r["index"]))
    if used == RankBy.step_time and _lower_bound(top):
        complete = [r for r in ranked if not _lower_bound(r)]
        bounds = sum(1 for r in ranked if _lower_bound(r))
        if complete:  # a lower bound is never ranked above a complete figure: it may take far longer
            top = min(complete, key=lambda r: (metric(r, used), r["index"]))
            note = _join(note, f"{bounds} configuration{'s' if bounds != 1 else ''} with a step time that is only a "
                               "lower bound (work no model covers) not ranked above complete figures")
        else:
            none = len(every) - len(ranked)  # failed, does not fit, or no figure: no step time at all
            said = ("every step time is a lower bound" if not none else
                    f"every step time given is a lower bound ({none} configuration{'s' if none != 1 else ''} "
                    "gave none)")
            note = _join(note, f"{said} (work no model covers): ranked by those floors")
    return top["id"], used, note


def _lower_bound(row: dict) -> bool:
    return bool((row.get("step_time") or {}).get("lower_bound"))


def _join(a: str | None, b: str) -> str:
    return f"{a}; {b}" if a else b


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


def row_problem(row: Any) -> str | None:
    """Why ``row`` is not a well-formed row (a :class:`Row`: every field of :data:`ROW_FIELDS`, each of
    its type, ``status`` agreeing with ``error``); None when it is. Rows come back from files
    (``--output-dir``, a worker's row, ``sweep merge``'s inputs), so nothing in them is used before
    this passes."""
    if not isinstance(row, dict):
        return f"a row is a JSON object, not {type(row).__name__}"
    try:
        codec.decode(Row, row)
    except codec.CodecError as e:
        return str(e)
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


@dataclasses.dataclass(frozen=True)
class _Header:
    """What ``sweep merge`` reads of a document's header (the rows are each a :class:`Row`)."""

    target: str
    function: str
    spec: str
    spec_sha256: Annotated[str, Check(lambda s: len(s) == 64, "of 64 hexadecimal digits")]
    axes: tuple[tuple[str, Annotated[tuple[str, ...], Check(bool, "not empty")]], ...]
    options: dict[str, Any]
    grid_size: Annotated[int, Check(lambda n: n >= 1, "at least 1")]
    shard: str | None
    rank_by: RankBy
    rows: list[Any]


def _header_problem(d: dict) -> str | None:
    try:
        codec.decode(_Header, d, unknown=True)
    except codec.CodecError as e:
        return str(e)
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
