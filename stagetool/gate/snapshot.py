"""Snapshots: the deterministic subset of a report that the CI gate compares (``stagetool.lock.json``).

A snapshot (:class:`Snapshot`; per function a :class:`SnapshotEntry`) holds the facts a change to
the model or the spec should not move silently: every input and output leaf (path, shape, dtype,
compiled sharding, bytes per device, unused), the function's
:class:`~stagetool.analysis.figures.Figures` (memory per device, the gated peak being the larger of
``argument + output - alias + temp`` and XLA's ``peak_memory_in_bytes``, the host peak apart; cost
per device with the loop-aware FLOPs), collectives by kind × mesh axes, the mesh, the jax/jaxlib
versions and the configuration that changes the compiled program (``config``); and what ``check``
and ``diff`` need to name the *cause* of a change (issue 22), each optional (a baseline without them
still loads; its changes are then listed as unexplained): each input's declared sharding, who
declared it (``declared_by``) and where (``declared_at``: ``file.yaml:14``), the ``origins`` of
output shardings, the program's sharding ``constraints``, each collective row's ``causes`` and user
``lines``. File names are kept without their folder, so a baseline moves between machines.

The entries are the records' JSON (:func:`stagetool.core.codec.encode`), read back checked against
them (:func:`load_snapshot`). The file is deterministic: no timings, keys sorted, integral floats
written as integers and other floats rounded to 12 significant digits.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from stagetool.analysis.figures import CostFigures, MemoryFigures, flops_estimate
from stagetool.analysis.causes import AxisOrigin
from stagetool.analysis.cpu_artefacts import EXPANDED, SUNK
from stagetool.analysis.sections import CollectivesSection, CostSection, MemorySection
from stagetool.core import codec
from stagetool.core.codec import omitted
from stagetool.core.errors import BaselineError, UsageError
from stagetool.analysis.shardings import LeafReport
from stagetool.report.model import FunctionReport, Report

SNAPSHOT_SCHEMA = 3
"""3: ``memory.peak_bytes`` is the larger of ``argument + output - alias + temp`` and XLA's
``peak_memory_in_bytes``, and ``memory.host_peak_bytes`` is the host memory apart (schema 2 recorded
the sum alone, which misses the temporaries XLA:TPU leaves out of ``temp_size_in_bytes``: 5,923,328 B
against XLA's 47,579,136 B for the transformer example on v5e:2x4; schema 1 recorded XLA's
``peak_memory_in_bytes`` or that sum, picked by a heuristic, so it changed meaning with donation)."""
SNAPSHOT_KIND = "stagetool-snapshot"

# ---- the file's records: what load_snapshot checks (numbers: integers or finite floats) -----------


@dataclasses.dataclass(frozen=True)
class SnapshotMesh:
    """``functions.<name>.mesh``: the mesh staged (``axes``: ``[[name, size], ...]``), its platform,
    device kind and counts, the compile-only topology; ``slices`` for a multi-slice job only."""

    axes: tuple[tuple[str, int], ...] | None = None
    axis_types: str | None = None
    platform: str | None = None
    device_kind: str | None = None
    device_count: int | None = None
    process_count: int | None = None
    topology: str | None = None
    slices: int = omitted(1)


@dataclasses.dataclass(frozen=True)
class SnapshotLeaf:
    """One output leaf: path, shape, dtype, compiled sharding (PartitionSpec text), bytes per device,
    unused; ``chosen`` when the partitioner chose its sharding, ``origins`` of its sharding's axes."""

    path: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    sharding: str | None = None
    bytes_per_device: float | None = None
    unused: bool | None = None
    chosen: bool = omitted(False)
    origins: tuple[str, ...] | None = omitted(None)


@dataclasses.dataclass(frozen=True)
class SnapshotInput(SnapshotLeaf):
    """One input leaf: an output leaf's fields, and its declared sharding, who declared it
    (``spec``, ``rule``, ``model``, ``compiler``) and where (``file.yaml:14``)."""

    declared: str | None = None
    declared_by: str | None = None
    declared_at: str | None = None


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One row of ``collectives``: kind × mesh axes (× network), count, bytes per device per run and
    per step, the cause labels and user lines of its collectives.

    On CPU, a row with collectives only XLA:CPU makes so (``cpu_only``: the distinct marks, an
    all-reduce left in a loop body, a collective widened to f32) also records what an accelerator
    compile of the same program is expected to show for it (``accelerator_bytes_per_device``,
    ``accelerator_bytes_per_step``: each widened collective at its program dtype's bytes, each
    hoisted one run once; None where a row holds an all-gather XLA:CPU hoisted out of a loop, whose
    bytes on XLA:TPU are in a dtype only its compile tells): what ``diff``/``check`` against a TPU or GPU snapshot file under the
    backend (:mod:`stagetool.gate.compare`). Derived from XLA:CPU's figures, not measured."""

    kind: str
    axes: str
    count: float
    bytes_per_device: float
    network: Literal["ici", "dcn"] | None = omitted(None)
    bytes_per_step: float | None = omitted(None)
    causes: tuple[str, ...] | None = omitted(None)
    lines: tuple[str, ...] | None = omitted(None)
    cpu_only: tuple[str, ...] | None = omitted(None)
    accelerator_bytes_per_device: float | None = omitted(None)
    accelerator_bytes_per_step: float | None = omitted(None)


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A sharding constraint of the program: its user line and sharding."""

    line: str
    sharding: str


@dataclasses.dataclass(frozen=True)
class MemoryTimeline:
    """``memory_timeline`` (drawn by ``check --format html``, never compared): bytes per device per step."""

    bytes: tuple[int, ...]
    steps: int
    peak_bytes: int
    peak_position: int
    peak_instruction: str | None = None
    gated_peak_bytes: float | None = None


@dataclasses.dataclass(frozen=True)
class SnapshotProfile:
    """``step_time.profile``: what the step time was computed with (issue 47). ``figures``: the chip's
    figures the model read (:func:`stagetool.core.chips.step_figures`), ``digest`` their
    :func:`~stagetool.core.chips.figures_digest`; ``builtin``: they are stagetool's own table's for the
    chip (no ``chips:`` entry or profile changed them); ``measured``: a calibrated profile's record
    (``measured_on``, ``date``, ``jax``, ``libtpu``, ``command``), left out for none."""

    digest: str
    figures: dict[str, float]
    builtin: bool = False
    measured: dict[str, str] | None = omitted(None)


@dataclasses.dataclass(frozen=True)
class SnapshotBuiltin:
    """``step_time.builtin``: where the profile in force is not the built-in one, the same step timed with
    stagetool's built-in figures of the chip (``digest`` theirs): what ``check`` compares as the code's
    change when two snapshots' profiles differ."""

    digest: str
    seconds: float
    lower_bound: bool = omitted(False)


@dataclasses.dataclass(frozen=True)
class SnapshotStepTime:
    """The step-time estimate of one function (an estimate, one device, seconds): its chip, the
    schedule's figure with its overlapped–serial range, what bounds it, and its parts; ``lower_bound``
    where work no model covers makes it "at least" (``uncounted``: that work, kind at user line);
    ``profile`` (what it was computed with) and ``builtin`` (the same step with stagetool's own figures),
    left out of snapshots written before issue 47."""

    chip: str
    seconds: float
    overlapped_seconds: float
    serial_seconds: float
    parts: dict[str, float]
    bound: str | None = None
    lower_bound: bool = omitted(False)
    uncounted: tuple[str, ...] | None = omitted(None)
    profile: SnapshotProfile | None = omitted(None)
    builtin: SnapshotBuiltin | None = omitted(None)


@dataclasses.dataclass(frozen=True)
class SnapshotEntry:
    """One function's entry; a section the run did not take is null. ``flops_not_counted``: the work
    the cost figures leave out (kind at user line), present only where some is: the FLOPs are then a
    lower bound."""

    mesh: SnapshotMesh | None
    inputs: tuple[SnapshotInput, ...] | None
    outputs: tuple[SnapshotLeaf, ...] | None
    memory: MemoryFigures | None
    cost: CostFigures | None
    collectives: tuple[CollectiveRow, ...] | None
    target: str | None = None
    constraints: tuple[Constraint, ...] | None = omitted(None)
    dcn_bytes_per_step: int | None = omitted(None)
    memory_timeline: MemoryTimeline | None = omitted(None)
    compiler_options: dict[str, str] | None = omitted(None)
    step_time: SnapshotStepTime | None = omitted(None)
    flops_not_counted: tuple[str, ...] | None = omitted(None)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The snapshot document (``kind`` and ``snapshot_schema`` are checked before it is read)."""

    jax_version: str | None
    jaxlib_version: str | None
    functions: dict[str, SnapshotEntry]
    kind: str = SNAPSHOT_KIND
    snapshot_schema: int = SNAPSHOT_SCHEMA
    stagetool_version: str | None = None
    spec: str | None = None
    config: dict[str, Any] | None = None
    libtpu_version: str | None = omitted(None)


def _num(v: Any) -> int | float | None:
    """A stable JSON number: integral values as int, others rounded to 12 significant digits."""
    if v is None:
        return None
    f = float(v)
    if not math.isfinite(f):
        return None
    if f.is_integer():
        return int(f)
    return float(f"{f:.12g}")


def _leaf(leaf: LeafReport, output: bool, origins: tuple[AxisOrigin, ...] | None = None) -> SnapshotLeaf:
    """An output leaf's record, or an input's (``declared``: the spec's; ``chosen``: the partitioner's)."""
    common = dict(path=leaf.path, shape=tuple(leaf.shape), dtype=leaf.dtype, bytes_per_device=leaf.bytes_per_device,
                  sharding=None if leaf.compiled is None else str(leaf.compiled), unused=bool(leaf.unused),
                  origins=None if origins is None else tuple(sorted({o.label for o in origins})))
    if output:  # chosen: no out_shardings, the compiler's choice, compared apart (gate.compare)
        return SnapshotLeaf(**common, chosen=bool(leaf.chosen_by_partitioner))
    return SnapshotInput(**common, declared=str(leaf.declared), declared_by=leaf.sharding_source,
                         declared_at=short_location(leaf.source))


_Figures = TypeVar("_Figures", MemoryFigures, CostFigures)


def _rounded(record: _Figures) -> _Figures:
    """``record`` with every number :func:`_num`-stable."""
    return dataclasses.replace(record, **{f.name: _num(getattr(record, f.name)) for f in dataclasses.fields(record)})


def short_location(source: str | None) -> str | None:
    """``/abs/spec.stagetool.yaml:14:9`` → ``spec.stagetool.yaml:14``: the file name and line, as the
    snapshot records places (a baseline moves between machines and folders)."""
    if not source:
        return None
    parts = str(source).rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return f"{Path(parts[0]).name}:{parts[1]}"
    if len(parts) >= 2 and parts[-1].isdigit():
        return f"{Path(':'.join(parts[:-1])).name}:{parts[-1]}"
    return Path(str(source)).name


def collective_rows(section: CollectivesSection | None) -> tuple[CollectiveRow, ...] | None:
    """A collectives section as sorted rows by kind × mesh axes (× network on a multi-slice job), or None.

    ``axes`` is ``"data,model"``; ``"?"`` for a collective matched to no mesh axes; ``"-"`` for an empty
    axis tuple. ``bytes_per_device`` sums one execution of each; ``bytes_per_step`` sums bytes × runs
    (a collective whose runs are unknown counts once), so that a loop that runs longer (a deeper
    ``scan``) is a change even when its ops are the same. ``lines``: the user source lines of its
    collectives; ``causes``: the labels of their origins (when the run explained collectives).
    """
    if section is None:
        return None
    rows: dict[tuple[str, str, str], list] = {}
    for item in section.items:
        c = item.collective
        key = (c.kind, "?" if c.mesh_axes is None else ",".join(c.mesh_axes) or "-", c.network or "")
        row = rows.setdefault(key, [0, 0, 0, set(), set(), set(), 0, 0])
        b = c.bytes_per_device or 0
        runs = c.executions if c.executions is not None else 1
        row[0], row[1], row[2] = row[0] + 1, row[1] + b, row[2] + b * runs
        if item.cause is not None:
            row[3].update(o.label for o in item.cause.origins)
        if item.source:
            row[4].add(short_location(item.source))
        # what an accelerator is expected to show: the widened part at half its f32 bytes, a hoisted one once
        ab = b - (item.widened_bytes or 0) // 2 if item.widened_from else b
        row[5].update(([item.cpu_only] if item.cpu_only else [])
                      + ([f"f32 on XLA:CPU, {item.widened_from} in the program"] if item.widened_from else []))
        if item.cpu_only in (SUNK, EXPANDED) or row[6] is None:  # runs known, bytes in XLA:TPU's dtype not: no figure
            row[6] = row[7] = None
        else:
            row[6], row[7] = row[6] + ab, row[7] + ab * (item.accelerator_runs or 1 if item.cpu_only else runs)
    explained = section.causes_unavailable is None
    return tuple(CollectiveRow(kind, axes, n, b, network or None, t, tuple(sorted(causes)) if explained else None,
                               tuple(sorted(lines)), tuple(sorted(marks)) if marks else None,
                               ab if marks else None, at if marks else None)
                 for (kind, axes, network), (n, b, t, causes, lines, marks, ab, at) in sorted(rows.items()))


def function_snapshot(fr: FunctionReport) -> dict:
    """The snapshot entry of one :class:`stagetool.report.model.FunctionReport` (a JSON-ready dict).

    Sections the report lacks are None (``inputs`` and ``outputs`` need ``Section.SHARDINGS``,
    ``memory`` ``Section.MEMORY``, ``cost`` ``Section.COST``, ``collectives``
    ``Section.COLLECTIVES``).
    """
    m, fig, origins = fr.mesh, fr.figures, None
    if fr.collectives is not None:
        origins = fr.collectives.origins
    out_origins = origins.outputs if origins is not None and len(origins.outputs) == len(fr.outputs or ()) else None
    in_origins = origins.inputs if origins is not None and len(origins.inputs) == len(fr.inputs or ()) else None
    return codec.encode(SnapshotEntry(
        target=fr.target,
        mesh=SnapshotMesh(tuple((n, int(s)) for n, s in m.axes), m.axis_types, m.platform, m.device_kind,
                          m.device_count, m.process_count, m.topology, m.slices),
        inputs=None if fr.inputs is None else tuple(  # an auto leaf's origins: what the partitioner followed
            _leaf(x, False, in_origins[i] if in_origins and x.sharding_source == "compiler" else None)
            for i, x in enumerate(fr.inputs)),
        outputs=None if fr.outputs is None else tuple(_leaf(x, True, out_origins[i] if out_origins else None)
                                                      for i, x in enumerate(fr.outputs)),
        memory=None if fig.memory is None else _rounded(fig.memory),
        cost=None if fig.cost is None else _rounded(dataclasses.replace(  # XLA's FLOPs where there is no estimate
            fig.cost, loop_aware_flops=flops_estimate(fig.cost.loop_aware_flops, fig.cost.flops))),
        collectives=collective_rows(fr.collectives),
        dcn_bytes_per_step=fig.dcn_bytes_per_step,
        memory_timeline=_timeline(fr.memory),
        step_time=_step_time(fr.cost),
        flops_not_counted=_not_counted(fr.cost),
        compiler_options=dict(fr.compiler_options) or None,
        # a constraint traced twice (forward and backward of a grad) is one line of the user's code
        constraints=None if origins is None else tuple(Constraint(line, sharding) for line, sharding in sorted(
            {(short_location(c.line) or "?", c.sharding) for c in origins.constraints}))))


def _not_counted(cost: CostSection | None) -> tuple[str, ...] | None:
    """The instructions whose work the cost figures leave out (``Pallas kernel (Mosaic TPU) at
    k.py:14``), sorted; None (the key left out) where nothing is missing: then ``cost.flops`` and
    ``cost.loop_aware_flops`` are a lower bound, and the gate says so beside a change of them."""
    rows = sorted({f"{u.kind} at {short_location(u.source) or '?'}" for u in (cost.uncounted if cost else ())
                   if not u.counted})
    return tuple(rows) or None


TIMELINE_POINTS = 400
"""At most this many points of a memory timeline in a snapshot (the highest of each group of steps)."""


def _step_time(cost: CostSection | None) -> SnapshotStepTime | None:
    """The cost section's step-time estimate as a snapshot holds it, or None (then the key is left
    out: a snapshot of the CPU mesh without ``--chip`` keeps its keys)."""
    from stagetool.core.chips import CHIPS, builtin_step_figures, figures_digest

    e = cost.step_time if cost is not None else None
    if e is None:
        return None
    uncounted = sorted({f"{u.kind} at {short_location(u.source) or '?'}" for u in e.uncounted})
    profile = builtin = None
    if e.chip_figures:
        own = builtin_step_figures(e.chip)
        chip = CHIPS.get(e.chip)
        measured = dict(chip.profile) if chip is not None and own == e.chip_figures and chip.profile else None
        profile = SnapshotProfile(figures_digest(e.chip_figures), {k: _num(v) for k, v in e.chip_figures},
                                  own == e.chip_figures, measured)
        if own is not None and e.builtin_seconds is not None:
            builtin = SnapshotBuiltin(figures_digest(own), e.builtin_seconds, e.builtin_lower_bound)
    return SnapshotStepTime(e.chip, e.schedule_seconds, e.overlapped_seconds, e.serial_seconds, dict(e.parts), e.bound,
                            e.lower_bound, tuple(uncounted) or None, profile, builtin)


def _timeline(memory: MemorySection | None) -> MemoryTimeline | None:
    """The memory timeline when the run took the peak dump, else None (left out: snapshots taken
    without it are as before): bytes per device per step, at most :data:`TIMELINE_POINTS` of them
    (each the highest of the steps it stands for), the peak's bytes and step, the step count and
    the gated peak; what ``check --format html`` draws, never compared by the gate."""
    if memory is None or memory.timeline_peak is None or not memory.timeline or memory.timeline_peak.bytes is None:
        return None
    tp, values = memory.timeline_peak, [int(p.bytes) for p in memory.timeline]
    n = len(values)
    cols = min(n, TIMELINE_POINTS)
    drawn = tuple(max(values[c * n // cols:(c + 1) * n // cols]) for c in range(cols))
    return MemoryTimeline(drawn, n, int(tp.bytes), int(tp.position), tp.instruction, _num(tp.gated_peak_bytes))


def snapshot_from_report(report: Report, *, spec: str | None = None) -> dict:
    """A snapshot document from a :class:`stagetool.report.model.Report` (functions by name); with
    ``libtpu_version`` where a function's figures come from a TPU compile or a TPU chip."""
    functions = {f.name: function_snapshot(f) for f in report.functions}
    libtpu = _libtpu_version(functions)
    return {
        "snapshot_schema": SNAPSHOT_SCHEMA,
        "kind": SNAPSHOT_KIND,
        "stagetool_version": report.stagetool_version,
        "jax_version": report.jax_version,
        "jaxlib_version": report.jaxlib_version,
        "spec": spec,
        "config": dict(report.config),
        "functions": functions,
        **({"libtpu_version": libtpu} if libtpu else {}),
    }


def _libtpu_version(functions: Mapping[str, Mapping]) -> str | None:
    """The installed libtpu's version where a function was compiled for a TPU or timed on a TPU chip (its
    figures then come from it), else None (the key is left out: a CPU snapshot is as before)."""
    tpu = any((e.get("mesh") or {}).get("platform") == "tpu" or str((e.get("step_time") or {}).get("chip", "")
                                                                    ).startswith("tpu") for e in functions.values())
    if not tpu:
        return None
    import importlib.metadata as md

    for dist in ("libtpu", "libtpu-nightly"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def merge_snapshots(parts: Iterable[dict]) -> dict:
    """One snapshot from several (e.g. one per isolated function); the first one's header wins."""
    parts = list(parts)
    if not parts:
        raise ValueError("nothing to merge")
    out = {k: v for k, v in parts[0].items() if k != "functions"}
    out["functions"] = {}
    for p in parts:
        out["functions"].update(p["functions"])
        if p.get("libtpu_version") and not out.get("libtpu_version"):  # a later function's TPU figures
            out["libtpu_version"] = p["libtpu_version"]
    return out


def dumps(snapshot: Mapping) -> str:
    """The snapshot as deterministic JSON text: sorted keys, 2-space indent, trailing newline."""
    return json.dumps(snapshot, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def write_snapshot(path: str | Path, snapshot: Mapping) -> None:
    """Write a snapshot atomically (:func:`stagetool.process.fileio.write_atomic`).

    Raises:
      UsageError: the file cannot be written.
    """
    from stagetool.process.fileio import write_atomic

    try:
        write_atomic(path, dumps(snapshot))
    except OSError as e:
        raise UsageError(f"{path}: cannot write the snapshot: {e.strerror or e}") from None


MAX_SNAPSHOT_BYTES = 256 * 2**20
"""A baseline larger than this (256 MiB) is refused unread."""


def load_snapshot(path: str | Path) -> dict:
    """Read and validate a snapshot file.

    Raises:
      BaselineError: the file is missing or unreadable, not JSON, not a stagetool snapshot, of
        another ``snapshot_schema``, or lacks a required field (naming it).
    """
    p = Path(path)
    hint = f"create it with: stagetool snapshot --spec SPEC -o {p}  (or stagetool check --update)"
    from stagetool.process.fileio import FileProblem, read_regular_bytes

    try:
        if p.is_dir():
            raise BaselineError(f"baseline {p} is a folder, not a snapshot file", hint=hint)
        data = read_regular_bytes(p, max_bytes=MAX_SNAPSHOT_BYTES)  # a FIFO or /dev/zero: refused unread
    except FileNotFoundError:
        raise BaselineError(f"baseline {p} not found", hint=hint) from None
    except FileProblem as e:
        raise BaselineError(f"baseline {p} {e}; a baseline is a regular JSON file", hint=hint) from None
    except OSError as e:
        raise BaselineError(f"baseline {p}: cannot read: {e.strerror or e}") from None
    return parse_snapshot(data, str(p), hint=hint)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def parse_snapshot(data: bytes, where: str, *, hint: str | None = None) -> dict:
    """Parse and validate snapshot bytes (UTF-8 JSON); see :func:`load_snapshot`.

    Raises:
      BaselineError: not UTF-8 (naming the byte offset), not JSON (line:col), a non-finite number
        (``NaN``, ``Infinity``: every metric compared with one would read as an improvement), nested
        too deeply, or not a valid snapshot (:func:`validate_snapshot`).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BaselineError(f"{where}: byte {e.start}: the baseline is not UTF-8 text", hint=hint) from None
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise BaselineError(f"{where}:{e.lineno}:{e.colno}: the baseline is not valid JSON: {e.msg}", hint=hint) from None
    except ValueError as e:
        raise BaselineError(f"{where}: the baseline holds a {e}; numbers must be finite", hint=hint) from None
    except RecursionError:
        raise BaselineError(f"{where}: the baseline is nested too deeply to be a snapshot", hint=hint) from None
    return validate_snapshot(doc, where)


def validate_snapshot(doc: Any, where: str = "<snapshot>") -> dict:
    """Check the structure of a parsed snapshot against :class:`Snapshot` (keys this stagetool does not
    know are left aside); see :func:`load_snapshot`. Returns ``doc`` itself."""
    if not isinstance(doc, dict) or doc.get("kind") != SNAPSHOT_KIND:
        raise BaselineError(f"{where}: not a stagetool snapshot (expected \"kind\": \"{SNAPSHOT_KIND}\")",
                            hint="write one with stagetool snapshot")
    version = doc.get("snapshot_schema")
    if version == 1:
        raise BaselineError(f"{where}: snapshot_schema 1: its memory.peak_bytes is XLA's peak_memory_in_bytes or "
                            "arguments + outputs - aliased + temporaries, picked by a heuristic (it changed meaning "
                            "with donation); this stagetool records the latter always (snapshot_schema 2), so the "
                            "two cannot be compared",
                            hint="regenerate the baseline with this stagetool: stagetool check --update")
    if version == 2:
        raise BaselineError(f"{where}: snapshot_schema 2: its memory.peak_bytes is arguments + outputs - aliased + "
                            "temporaries alone, which misses the temporaries XLA:TPU leaves out of temp_size_in_bytes; "
                            "this stagetool gates the larger of that sum and XLA's peak_memory_in_bytes, and the host "
                            "memory apart (snapshot_schema 3), so the two cannot be compared",
                            hint="regenerate the baseline with this stagetool: stagetool check --update")
    if version != SNAPSHOT_SCHEMA:
        raise BaselineError(f"{where}: snapshot_schema {version!r} is not supported; this stagetool reads "
                            f"snapshot_schema {SNAPSHOT_SCHEMA}",
                            hint="regenerate the baseline with this stagetool: stagetool check --update")
    try:
        codec.decode(Snapshot, doc, unknown=True)
    except codec.CodecError as e:
        raise BaselineError(f"{where}: malformed snapshot: {e}",
                            hint="regenerate it: stagetool check --update") from None
    return doc
