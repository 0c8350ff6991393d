"""Snapshots: the deterministic subset of a report that the CI gate compares (``stagetool.lock.json``).

A *snapshot* holds, per function of a spec, the facts a change to the model or the spec should
not move silently:

* every input and output leaf: path, shape, dtype, the compiled sharding
  (``Compiled.input_shardings`` / ``output_shardings``), bytes per device, whether it is unused;
* memory per device, in bytes (``Compiled.memory_analysis()`` through
  :func:`stagetool.analysis.memory.memory_of`): argument, output, alias, temp, the gated peak (the
  larger of ``argument + output - alias + temp`` and XLA's ``peak_memory_in_bytes``: one definition
  on every backend, whatever donation, the same in every command) and, apart, the host-memory peak
  ``host_peak_bytes`` (``pinned_host``, ``S(5)``); with jax/jaxlib 0.11+ also XLA's
  ``peak_unpadded_heap_bytes``, ``total_allocation_bytes`` and ``indefinite_allocations`` (recorded,
  not compared; absent with older releases);
* cost per device (``Compiled.cost_analysis()`` through
  :func:`stagetool.analysis.cost.per_device_cost`): FLOPs, transcendentals, bytes accessed, and
  the loop-aware FLOPs estimate (``loop_aware_flops``: each loop body × its trip count);
* collectives: count and bytes per device by kind × mesh axes (None when not computed);
* the mesh, platform and device kind; jax and jaxlib versions and the configuration that changes
  the compiled program (``config``: ``jax_threefry_partitionable``, the default matmul precision,
  ``XLA_FLAGS`` ...) at the top;
* what ``check`` and ``diff`` need to name the *cause* of a change (issue 22), each optional (a
  baseline without them still loads; its changes are then listed as unexplained): per input leaf its
  declared sharding, where that came from (``declared_by``: ``spec``, ``rule``, ``model``,
  ``compiler``) and the spec line that set it (``declared_at``: ``file.yaml:14``); per output leaf the
  ``origins`` of its compiled sharding's axes (``input params/layers/wo``, ``constraint model.py:8``);
  the program's sharding ``constraints`` (``{line, sharding}``); per collective row the ``causes``
  (the same labels, from each collective's cause) and the user ``lines`` of its collectives. File
  names are kept without their folder, so a baseline moves between machines.

The file is deterministic: no timings, keys sorted, integral floats written as integers and other
floats rounded to 12 significant digits, so two runs on the same machine give the same bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from stagetool.core.errors import BaselineError, UsageError
from stagetool.core.compat import MEMORY_FIELDS_SINCE_0_11

SNAPSHOT_SCHEMA = 3
"""3: ``memory.peak_bytes`` is the larger of ``argument + output - alias + temp`` and XLA's
``peak_memory_in_bytes``, and ``memory.host_peak_bytes`` is the host memory apart (schema 2 recorded
the sum alone, which misses the temporaries XLA:TPU leaves out of ``temp_size_in_bytes``: 5,923,328 B
against XLA's 47,579,136 B for the transformer example on v5e:2x4; schema 1 recorded XLA's
``peak_memory_in_bytes`` or that sum, picked by a heuristic, so it changed meaning with donation)."""
SNAPSHOT_KIND = "stagetool-snapshot"

#: Memory fields kept per function (bytes per device). ``alias_bytes``: more is better.
MEMORY_FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes", "host_peak_bytes")
#: Cost fields kept per function (per device): FLOPs, transcendental ops, bytes accessed.
COST_FIELDS = ("flops", "transcendentals", "bytes_accessed")
#: Derived cost fields: ``loop_aware_flops``, the estimate with each loop body × its trip count
#: (:class:`stagetool.analysis.loops.LoopAwareCost`), so that a deeper ``scan`` is a change.
DERIVED_COST_FIELDS = ("loop_aware_flops",)


#: Memory fields only jax/jaxlib 0.11+ report: recorded where present (absent, not null, on older
#: releases), never compared.
REPORTED_ONLY_MEMORY_FIELDS = MEMORY_FIELDS_SINCE_0_11


def _reported_only(mem: Any) -> dict:
    return {f: _num(getattr(mem, f)) for f in REPORTED_ONLY_MEMORY_FIELDS if getattr(mem, f, None) is not None}


def _loop_aware_flops(section: Any, per_device: Any) -> Any:
    la = getattr(section, "loop_aware", None)
    return la.flops if la is not None else getattr(per_device, "flops", None)


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


def _leaf(leaf: Any, output: bool = False, origins: Any = None) -> dict:
    out = {"path": leaf.path, "shape": list(leaf.shape), "dtype": leaf.dtype,
           "sharding": None if leaf.compiled is None else str(leaf.compiled),
           "bytes_per_device": leaf.bytes_per_device, "unused": bool(leaf.unused)}
    if output and leaf.chosen_by_partitioner:
        out["chosen"] = True  # no out_shardings: the compiler's choice, compared apart (gate.compare)
    if not output:
        out["declared"] = str(leaf.declared)
        out["declared_by"] = getattr(leaf, "sharding_source", None)
        out["declared_at"] = short_location(getattr(leaf, "source", None))
    if origins is not None:
        out["origins"] = sorted({o.label for o in origins})
    return out


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


def _cause_fields(collectives: Any, rows: list[dict] | None) -> list[dict] | None:
    """``rows`` with each row's ``causes`` (labels of its collectives' origins) and ``lines`` (their
    user source lines), from a section whose items carry causes."""
    items = getattr(collectives, "items", None)
    if rows is None or items is None or callable(items):
        return rows
    causes: dict[tuple[str, str, str], set[str]] = {}
    lines: dict[tuple[str, str, str], set[str]] = {}
    explained = getattr(collectives, "causes_unavailable", None) is None
    for item in items:
        c = item.collective
        key = (c.kind, "?" if c.mesh_axes is None else ",".join(c.mesh_axes) or "-", getattr(c, "network", None) or "")
        cause = getattr(item, "cause", None)
        if cause is not None:
            causes.setdefault(key, set()).update(o.label for o in cause.origins)
        if item.source:
            lines.setdefault(key, set()).add(short_location(item.source))
    out = []
    for row in rows:
        key = (row["kind"], row["axes"], row.get("network") or "")
        extra = {"lines": sorted(lines.get(key, ()))}
        if explained:
            extra["causes"] = sorted(causes.get(key, ()))
        out.append({**row, **extra})
    return out


def _unwrap(obj: Any, *names: str) -> Any:
    """The record inside a section wrapper (``.per_device`` / ``.record``), or the object itself."""
    for name in names:
        inner = getattr(obj, name, None)
        if inner is not None:
            return inner
    return obj


def collective_rows(collectives: Any) -> list[dict] | None:
    """Collectives as sorted ``{kind, axes, count, bytes_per_device[, bytes_per_step]}`` rows, or None.

    From a :class:`stagetool.analysis.sections.CollectivesSection` (``.items``), each row also has
    ``bytes_per_step``: bytes × runs, summed (a collective whose runs are unknown counts once), so
    that a loop that runs longer (a deeper ``scan``) is a change even when its ops are the same.

    Accepts what ``FunctionReport.collectives`` may hold: an object with ``.summary`` or
    ``.by_kind_and_mesh_axes`` (``stagetool.analysis.collectives.CollectiveSummary``: rows with
    ``kind``, ``mesh_axes``, ``count``, ``bytes_per_device``), an iterable of such rows, or an
    iterable of single collectives (``kind``, ``mesh_axes``, ``bytes_per_device``), which are
    counted here. Mappings with the same keys work too (``axes`` is accepted for ``mesh_axes``).
    ``axes`` is ``"data,model"``; ``"?"`` for a collective matched to no mesh axes; ``"-"`` for an
    empty axis tuple. Bytes are one execution each (a collective inside a loop counts once).
    """
    if collectives is None:
        return None
    items_of_section = getattr(collectives, "items", None)
    if items_of_section is not None and not callable(items_of_section):
        per_step: dict[tuple[str, str, str], list[int]] = {}
        for item in items_of_section:
            c = item.collective
            axes = "?" if c.mesh_axes is None else ",".join(c.mesh_axes) or "-"
            row = per_step.setdefault((c.kind, axes, getattr(c, "network", None) or ""), [0, 0, 0])
            b = c.bytes_per_device or 0
            row[0] += 1
            row[1] += b
            row[2] += b * (c.executions if c.executions is not None else 1)
        # a multi-slice job's rows say their network (ici | dcn); one slice's rows have no such key
        return [{"kind": k, "axes": a, **({"network": w} if w else {}), "count": n, "bytes_per_device": b,
                 "bytes_per_step": t} for (k, a, w), (n, b, t) in sorted(per_step.items())]
    src = getattr(collectives, "summary", None) or collectives
    rows = getattr(src, "by_kind_and_mesh_axes", None)
    items = list(rows if rows is not None else (getattr(src, "collectives", None) or src))

    def get(x: Any, *names: str) -> Any:
        for n in names:
            if isinstance(x, Mapping) and n in x:
                return x[n]
            if hasattr(x, n):
                return getattr(x, n)
        return None

    acc: dict[tuple[str, str], list[int]] = {}
    for x in items:
        kind = str(get(x, "kind"))
        axes = get(x, "mesh_axes", "axes")
        axes_text = axes if isinstance(axes, str) else ("?" if axes is None else ",".join(axes) or "-")
        count = get(x, "count")
        b = get(x, "bytes_per_device", "bytes") or 0
        row = acc.setdefault((kind, axes_text), [0, 0])
        row[0] += int(count) if count is not None else 1
        row[1] += int(b)
    return [{"kind": k, "axes": a, "count": c, "bytes_per_device": b} for (k, a), (c, b) in sorted(acc.items())]


def function_snapshot(fr: Any) -> dict:
    """The snapshot entry of one :class:`stagetool.report.model.FunctionReport` (a JSON-ready dict).

    Sections the report lacks are None (``inputs`` and ``outputs`` need ``Section.SHARDINGS``,
    ``memory`` ``Section.MEMORY``, ``cost`` ``Section.COST``, ``collectives``
    ``Section.COLLECTIVES``).
    """
    m = fr.mesh
    mem = _unwrap(fr.memory, "per_device", "record") if fr.memory is not None else None
    cost = _unwrap(fr.cost, "per_device") if fr.cost is not None else None
    origins = getattr(fr.collectives, "origins", None) if fr.collectives is not None else None
    out_origins = list(origins.outputs) if origins is not None and fr.outputs is not None \
        and len(origins.outputs) == len(fr.outputs) else None
    in_origins = list(origins.inputs) if origins is not None and fr.inputs is not None \
        and len(origins.inputs) == len(fr.inputs) else None  # an auto leaf's: what the partitioner followed
    entry = {
        "target": fr.target,
        "mesh": {"axes": [[n, int(s)] for n, s in m.axes], "axis_types": m.axis_types, "platform": m.platform,
                 "device_kind": m.device_kind, "device_count": m.device_count, "process_count": m.process_count,
                 "topology": m.topology, **({"slices": m.slices} if getattr(m, "slices", 1) > 1 else {})},
        "inputs": None if fr.inputs is None else [
            _leaf(x, origins=in_origins[i] if in_origins and getattr(x, "sharding_source", None) == "compiler" else None)
            for i, x in enumerate(fr.inputs)],
        "outputs": None if fr.outputs is None else [_leaf(x, output=True, origins=out_origins[i] if out_origins else None)
                                                    for i, x in enumerate(fr.outputs)],
        "memory": None if mem is None else {**{f: _num(getattr(mem, f, None)) for f in MEMORY_FIELDS},
                                            **_reported_only(mem)},
        "cost": None if cost is None else {**{f: _num(getattr(cost, f, None)) for f in COST_FIELDS},
                                           "loop_aware_flops": _num(_loop_aware_flops(fr.cost, cost))},
        "collectives": _cause_fields(fr.collectives, collective_rows(fr.collectives)),
        **_dcn(fr.collectives),
        **_timeline_entry(fr.memory),
        **({"compiler_options": dict(fr.compiler_options)} if getattr(fr, "compiler_options", ()) else {}),
    }
    if origins is not None:
        # a constraint traced twice (forward and backward of a grad) is one line of the user's code
        entry["constraints"] = [{"line": line, "sharding": sharding} for line, sharding in
                                sorted({(short_location(c.line) or "?", c.sharding) for c in origins.constraints})]
    return entry


def _dcn(collectives: Any) -> dict:
    """``{"dcn_bytes_per_step": N}`` for a multi-slice job (bytes each device sends between slices
    per step), else nothing: one slice's snapshots keep their keys."""
    summary = getattr(collectives, "summary", None)
    value = getattr(summary, "dcn_bytes_per_step", None)
    return {} if value is None else {"dcn_bytes_per_step": int(value)}


TIMELINE_POINTS = 400
"""At most this many points of a memory timeline in a snapshot (the highest of each group of steps)."""


def _timeline_entry(memory: Any) -> dict:
    """``{"memory_timeline": {...}}`` when the report has a memory timeline (the run took the peak
    dump), else ``{}``, so snapshots taken without it are as before. Bytes per device per step, at
    most :data:`TIMELINE_POINTS` of them (each the highest of the steps it stands for), the peak's
    bytes and step, the step count and the gated peak: what ``check --format html`` draws. Never
    compared by the gate."""
    tp = getattr(memory, "timeline_peak", None)
    points = getattr(memory, "timeline", None)
    if tp is None or not points or tp.bytes is None:
        return {}
    values = [int(p.bytes) for p in points]
    n = len(values)
    cols = min(n, TIMELINE_POINTS)
    drawn = [max(values[c * n // cols:(c + 1) * n // cols]) for c in range(cols)]
    return {"memory_timeline": {"bytes": drawn, "steps": n, "peak_bytes": int(tp.bytes),
                                "peak_position": int(tp.position), "peak_instruction": tp.instruction,
                                "gated_peak_bytes": _num(tp.gated_peak_bytes)}}


def snapshot_from_report(report: Any, *, spec: str | None = None) -> dict:
    """A snapshot document from a :class:`stagetool.report.model.Report` (functions by name)."""
    return {
        "snapshot_schema": SNAPSHOT_SCHEMA,
        "kind": SNAPSHOT_KIND,
        "stagetool_version": report.stagetool_version,
        "jax_version": report.jax_version,
        "jaxlib_version": report.jaxlib_version,
        "spec": spec,
        "config": dict(getattr(report, "config", ()) or ()),
        "functions": {f.name: function_snapshot(f) for f in report.functions},
    }


def merge_snapshots(parts: Iterable[dict]) -> dict:
    """One snapshot from several (e.g. one per isolated function); the first one's header wins."""
    parts = list(parts)
    if not parts:
        raise ValueError("nothing to merge")
    out = {k: v for k, v in parts[0].items() if k != "functions"}
    out["functions"] = {}
    for p in parts:
        out["functions"].update(p["functions"])
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
    """Check the structure of a parsed snapshot; see :func:`load_snapshot`."""
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
    problems = []
    for key in ("jax_version", "jaxlib_version", "functions"):
        if key not in doc:
            problems.append(f"missing {key!r}")
    functions = doc.get("functions")
    if not isinstance(functions, dict):
        problems.append("'functions' must be an object of function name to entry")
    else:
        for name, entry in functions.items():
            if not isinstance(entry, dict):
                problems.append(f"functions.{_key(name)}: must be an object")
                continue
            for key in ("mesh", "inputs", "outputs", "memory", "cost", "collectives"):
                if key not in entry:
                    problems.append(f"functions.{_key(name)}: missing {key!r}")
            for key in ("inputs", "outputs"):
                leaves = entry.get(key)
                if leaves is not None and (not isinstance(leaves, list)
                                           or not all(isinstance(x, dict) and "path" in x for x in leaves)):
                    problems.append(f"functions.{_key(name)}.{key}: must be a list of leaves with a 'path'")
    if not problems and isinstance(functions, dict):
        for name, entry in functions.items():
            _check_entry(problems, f"functions.{_key(name)}", entry)
        for key in ("jax_version", "jaxlib_version", "stagetool_version", "spec"):
            if doc.get(key) is not None and not isinstance(doc.get(key), str):
                problems.append(f"{key}: must be a string, not {_kind(doc.get(key))}")
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
        raise BaselineError(f"{where}: malformed snapshot: " + "; ".join(shown),
                            hint="regenerate it: stagetool check --update")
    return doc


def _key(name: Any) -> str:
    return name if isinstance(name, str) and name.isidentifier() else json.dumps(name, ensure_ascii=True)


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _check_entry(problems: list[str], path: str, entry: dict) -> None:
    """The types of one function's entry, as :mod:`stagetool.gate.compare` reads them (JSON paths)."""
    if entry.get("target") is not None and not isinstance(entry["target"], str):
        problems.append(f"{path}.target: must be a string, not {_kind(entry['target'])}")
    mesh = entry.get("mesh")
    if mesh is not None:
        if not isinstance(mesh, dict):
            problems.append(f"{path}.mesh: must be an object, not {_kind(mesh)}")
        else:
            axes = mesh.get("axes")
            if axes is not None and not (isinstance(axes, list) and all(
                    isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and _is_int(a[1]) for a in axes)):
                problems.append(f"{path}.mesh.axes: must be a list of [name, size] pairs")
            for k in ("platform", "device_kind", "axis_types", "topology"):
                if mesh.get(k) is not None and not isinstance(mesh[k], str):
                    problems.append(f"{path}.mesh.{k}: must be a string, not {_kind(mesh[k])}")
            for k in ("device_count", "process_count"):
                if mesh.get(k) is not None and not _is_int(mesh[k]):
                    problems.append(f"{path}.mesh.{k}: must be an integer, not {_kind(mesh[k])}")
    for key in ("inputs", "outputs"):
        for i, leaf in enumerate(entry.get(key) or []):
            where = f"{path}.{key}[{i}]"
            if not isinstance(leaf.get("path"), str):
                problems.append(f"{where}.path: must be a string, not {_kind(leaf.get('path'))}")
            shape = leaf.get("shape")
            if shape is not None and not (isinstance(shape, list) and all(_is_int(d) for d in shape)):
                problems.append(f"{where}.shape: must be a list of integers")
            for k in ("dtype", "sharding"):
                if leaf.get(k) is not None and not isinstance(leaf[k], str):
                    problems.append(f"{where}.{k}: must be a string, not {_kind(leaf[k])}")
            if leaf.get("bytes_per_device") is not None and not _is_number(leaf["bytes_per_device"]):
                problems.append(f"{where}.bytes_per_device: must be a number, not {_kind(leaf['bytes_per_device'])}")
            if leaf.get("unused") is not None and not isinstance(leaf["unused"], bool):
                problems.append(f"{where}.unused: must be true or false, not {_kind(leaf['unused'])}")
            for k in ("declared", "declared_by", "declared_at"):
                if leaf.get(k) is not None and not isinstance(leaf[k], str):
                    problems.append(f"{where}.{k}: must be a string, not {_kind(leaf[k])}")
            if leaf.get("origins") is not None and not _strings(leaf["origins"]):
                problems.append(f"{where}.origins: must be a list of strings")
    constraints = entry.get("constraints")
    if constraints is not None and not (isinstance(constraints, list) and all(
            isinstance(c, dict) and isinstance(c.get("line"), str) and isinstance(c.get("sharding"), str)
            for c in constraints)):
        problems.append(f"{path}.constraints: must be a list of {{line, sharding}} strings")
    timeline = entry.get("memory_timeline")
    if timeline is not None and not (
            isinstance(timeline, dict) and isinstance(timeline.get("bytes"), list)
            and all(_is_int(b) for b in timeline["bytes"])
            and all(_is_int(timeline.get(k)) for k in ("steps", "peak_bytes", "peak_position"))):
        problems.append(f"{path}.memory_timeline: must be an object with 'bytes' (a list of integers), 'steps', "
                        "'peak_bytes' and 'peak_position'")
    for section, fields in (("memory", MEMORY_FIELDS + REPORTED_ONLY_MEMORY_FIELDS), ("cost", COST_FIELDS)):
        value = entry.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            problems.append(f"{path}.{section}: must be an object or null, not {_kind(value)}")
            continue
        for f in fields:
            if value.get(f) is not None and not _is_number(value[f]):
                problems.append(f"{path}.{section}.{f}: must be a number or null, not {_kind(value[f])}")
    rows = entry.get("collectives")
    if rows is not None:
        if not isinstance(rows, list):
            problems.append(f"{path}.collectives: must be a list or null, not {_kind(rows)}")
            return
        for i, row in enumerate(rows):
            where = f"{path}.collectives[{i}]"
            if not isinstance(row, dict):
                problems.append(f"{where}: must be an object, not {_kind(row)}")
                continue
            for k in ("kind", "axes"):
                if not isinstance(row.get(k), str):
                    problems.append(f"{where}.{k}: must be a string, not {_kind(row.get(k))}")
            for k in ("count", "bytes_per_device"):
                if not _is_number(row.get(k)):
                    problems.append(f"{where}.{k}: must be a number, not {_kind(row.get(k))}")
            if row.get("network") is not None and row["network"] not in ("ici", "dcn"):
                problems.append(f"{where}.network: must be 'ici' or 'dcn', not {row['network']!r}")
            if row.get("bytes_per_step") is not None and not _is_number(row["bytes_per_step"]):
                problems.append(f"{where}.bytes_per_step: must be a number, not {_kind(row['bytes_per_step'])}")
            for k in ("causes", "lines"):
                if row.get(k) is not None and not _strings(row[k]):
                    problems.append(f"{where}.{k}: must be a list of strings")


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)
