"""Snapshots and the CI gate: ``stagetool snapshot`` / ``check`` / ``diff``.

A *snapshot* (``stagetool.lock.json``) holds, per function of a spec, the facts a change to the
model or the spec should not move silently:

* every input and output leaf: path, shape, dtype, the compiled sharding
  (``Compiled.input_shardings`` / ``output_shardings``), bytes per device, whether it is unused;
* memory per device, in bytes (``Compiled.memory_analysis()`` through
  :func:`stagetool.analysis.memory.memory_of`): argument, output, alias, temp, peak;
* cost per device (``Compiled.cost_analysis()`` through
  :func:`stagetool.analysis.cost.per_device_cost`): FLOPs, transcendentals, bytes accessed;
* collectives: count and bytes per device by kind × mesh axes (None when not computed);
* the mesh, platform and device kind; jax and jaxlib versions at the top.

The file is deterministic: no timings, keys sorted, integral floats written as integers and other
floats rounded to 12 significant digits, so two runs on the same machine give the same bytes.

:func:`compare` turns two snapshots into a :class:`Comparison`. What counts as a regression:

* a leaf whose compiled sharding, shape, dtype or unused flag changed, a leaf added or removed,
  a different mesh;
* a collective (kind × mesh axes) that appears;
* a function of the baseline that is no longer staged (deleted or renamed in the spec), unless
  the run was restricted on purpose (``--function``, a TARGET: see ``only`` in :func:`compare`);
* growth of a metric beyond its tolerance (:data:`DEFAULT_TOLERANCES`; ``alias_bytes`` is the
  other way round: less aliasing is worse).

Shrinking metrics and collectives that disappear are improvements, and new functions are shown:
neither ever fails. When the two snapshots come from different jax/jaxlib versions, platforms
or device kinds, the comparison still runs, a notice says so, and memory and cost tolerances
are raised to at least :data:`ENV_MISMATCH_FLOOR` (10%): compiler versions move these figures a
little; sharding and collective changes still fail.

Nothing here imports JAX at import time; :func:`take_snapshot` runs the pipeline.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from stagetool.core.errors import BaselineError, UsageError

SNAPSHOT_SCHEMA = 1
SNAPSHOT_KIND = "stagetool-snapshot"

#: Memory fields kept per function (bytes per device). ``alias_bytes``: more is better.
MEMORY_FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes")
#: Cost fields kept per function (per device): FLOPs, transcendental ops, bytes accessed.
COST_FIELDS = ("flops", "transcendentals", "bytes_accessed")


# ---------------------------------------------------------------------------------- tolerances


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How much a metric may grow before it is a regression.

    Attributes:
      fraction: allowed relative growth (``0.01`` for ``1%``), or None.
      absolute: allowed growth in the metric's unit (bytes, FLOPs, count), or None.
      text: as written (``"2%"``, ``"64KiB"``).

    Growth ``after - before`` is a regression when it exceeds both allowances
    (``max(fraction * before, absolute)``); a missing allowance counts as 0.
    """

    fraction: float | None = None
    absolute: float | None = None
    text: str = "0%"

    def allows(self, before: float, after: float) -> bool:
        """Whether growing from ``before`` to ``after`` stays within the tolerance."""
        growth = after - before
        if growth <= 0:
            return True
        limit = max((self.fraction or 0.0) * abs(before), self.absolute or 0.0)
        return growth <= limit


#: Tolerance names and what they govern.
TOLERANCE_KEYS = {
    "memory": "memory per device: argument, output, temp, peak bytes (alias bytes: shrinking)",
    "flops": "FLOPs and transcendentals per device",
    "bytes_accessed": "bytes accessed per device",
    "collective_bytes": "bytes per device moved by the collectives of one kind × mesh axes",
    "collective_count": "number of collectives of one kind × mesh axes",
}

#: The documented defaults.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "memory": Tolerance(0.01, None, "1%"),
    "flops": Tolerance(0.01, None, "1%"),
    "bytes_accessed": Tolerance(0.01, None, "1%"),
    "collective_bytes": Tolerance(0.0, None, "0%"),
    "collective_count": Tolerance(0.0, None, "0"),
}

#: Minimum relative tolerance for memory and cost when the environments differ.
ENV_MISMATCH_FLOOR = 0.10

_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")


def parse_tolerance(value: Any) -> Tolerance:
    """Parse ``"2%"`` (relative growth), ``"64KiB"`` / ``"1.5GB"`` (absolute bytes) or a plain number
    (absolute, in the metric's unit).

    Raises:
      UsageError: anything else, or a negative value.
    """
    from stagetool.analysis.memory import parse_size

    if isinstance(value, bool):
        raise UsageError(f"invalid tolerance {value!r}", hint="write e.g. 2% or 64KiB")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise UsageError(f"invalid tolerance {value!r}: must be a finite number >= 0")
        return Tolerance(None, float(value), str(value))
    text = str(value).strip()
    m = _PERCENT.match(text)
    if m:
        return Tolerance(float(m.group(1)) / 100.0, None, text.replace(" ", ""))
    try:
        return Tolerance(None, float(parse_size(text)), text)
    except UsageError:
        raise UsageError(f"invalid tolerance {text!r}: expected a percentage (2%) or an amount (64KiB, 1000)",
                         hint="e.g. --tolerance memory=2% --tolerance collective_bytes=64KiB") from None


def parse_tolerance_options(items: Iterable[str]) -> dict[str, Tolerance]:
    """Parse ``--tolerance NAME=VALUE`` options (later ones win).

    Raises:
      UsageError: no ``=``, an unknown name (listing the known ones), or a bad value.
    """
    out: dict[str, Tolerance] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise UsageError(f"--tolerance {item!r}: expected NAME=VALUE, e.g. memory=2%")
        out[check_tolerance_name(name, f"--tolerance {item!r}")] = parse_tolerance(value)
    return out


def check_tolerance_name(name: str, where: str) -> str:
    """Return ``name`` if it is a tolerance name; else raise :class:`UsageError` listing them."""
    if name not in TOLERANCE_KEYS:
        import difflib

        close = difflib.get_close_matches(name, list(TOLERANCE_KEYS), n=1)
        raise UsageError(f"{where}: unknown tolerance {name!r}; expected one of {', '.join(TOLERANCE_KEYS)}"
                         + (f" (did you mean {close[0]!r}?)" if close else ""))
    return name


def effective_tolerances(function: str, *, spec_check: Any = None,
                         cli: Mapping[str, Tolerance] | None = None) -> dict[str, Tolerance]:
    """Tolerances for one function: defaults, then the spec's ``check.tolerances``, then its
    ``check.functions.<name>.tolerances``, then ``--tolerance`` options (the last one wins)."""
    out = dict(DEFAULT_TOLERANCES)
    if spec_check is not None:
        out.update(getattr(spec_check, "tolerances", {}) or {})
        out.update((getattr(spec_check, "functions", {}) or {}).get(function, {}) or {})
    out.update(cli or {})
    return out


# ---------------------------------------------------------------------------------- snapshot


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


def _leaf(leaf: Any) -> dict:
    return {"path": leaf.path, "shape": list(leaf.shape), "dtype": leaf.dtype, "sharding": leaf.compiled,
            "bytes_per_device": leaf.bytes_per_device, "unused": bool(leaf.unused)}


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
        per_step: dict[tuple[str, str], list[int]] = {}
        for item in items_of_section:
            c = item.collective
            axes = "?" if c.mesh_axes is None else ",".join(c.mesh_axes) or "-"
            row = per_step.setdefault((c.kind, axes), [0, 0, 0])
            b = c.bytes_per_device or 0
            row[0] += 1
            row[1] += b
            row[2] += b * (c.executions if c.executions is not None else 1)
        return [{"kind": k, "axes": a, "count": n, "bytes_per_device": b, "bytes_per_step": t}
                for (k, a), (n, b, t) in sorted(per_step.items())]
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
    return {
        "target": fr.target,
        "mesh": {"axes": [[n, int(s)] for n, s in m.axes], "axis_types": m.axis_types, "platform": m.platform,
                 "device_kind": m.device_kind, "device_count": m.device_count, "process_count": m.process_count,
                 "topology": m.topology},
        "inputs": None if fr.inputs is None else [_leaf(x) for x in fr.inputs],
        "outputs": None if fr.outputs is None else [_leaf(x) for x in fr.outputs],
        "memory": None if mem is None else {f: _num(getattr(mem, f, None)) for f in MEMORY_FIELDS},
        "cost": None if cost is None else {f: _num(getattr(cost, f, None)) for f in COST_FIELDS},
        "collectives": collective_rows(fr.collectives),
    }


def snapshot_from_report(report: Any, *, spec: str | None = None) -> dict:
    """A snapshot document from a :class:`stagetool.report.model.Report` (functions by name)."""
    return {
        "snapshot_schema": SNAPSHOT_SCHEMA,
        "kind": SNAPSHOT_KIND,
        "stagetool_version": report.stagetool_version,
        "jax_version": report.jax_version,
        "jaxlib_version": report.jaxlib_version,
        "spec": spec,
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
    """Write a snapshot atomically (:func:`stagetool.core.fileio.write_atomic`).

    Raises:
      UsageError: the file cannot be written.
    """
    from stagetool.core.fileio import write_atomic

    try:
        write_atomic(path, dumps(snapshot))
    except OSError as e:
        raise UsageError(f"{path}: cannot write the snapshot: {e.strerror or e}") from None


def load_snapshot(path: str | Path) -> dict:
    """Read and validate a snapshot file.

    Raises:
      BaselineError: the file is missing or unreadable, not JSON, not a stagetool snapshot, of
        another ``snapshot_schema``, or lacks a required field (naming it).
    """
    p = Path(path)
    hint = f"create it with: stagetool snapshot --spec SPEC -o {p}  (or stagetool check --update)"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BaselineError(f"baseline {p} not found", hint=hint) from None
    except OSError as e:
        raise BaselineError(f"baseline {p}: cannot read: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise BaselineError(f"{p}:{e.lineno}:{e.colno}: the baseline is not valid JSON: {e.msg}", hint=hint) from None
    return validate_snapshot(doc, str(p))


def validate_snapshot(doc: Any, where: str = "<snapshot>") -> dict:
    """Check the structure of a parsed snapshot; see :func:`load_snapshot`."""
    if not isinstance(doc, dict) or doc.get("kind") != SNAPSHOT_KIND:
        raise BaselineError(f"{where}: not a stagetool snapshot (expected \"kind\": \"{SNAPSHOT_KIND}\")",
                            hint="write one with stagetool snapshot")
    version = doc.get("snapshot_schema")
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
                problems.append(f"functions.{name}: must be an object")
                continue
            for key in ("mesh", "inputs", "outputs", "memory", "cost", "collectives"):
                if key not in entry:
                    problems.append(f"functions.{name}: missing {key!r}")
            for key in ("inputs", "outputs"):
                leaves = entry.get(key)
                if leaves is not None and (not isinstance(leaves, list)
                                           or not all(isinstance(x, dict) and "path" in x for x in leaves)):
                    problems.append(f"functions.{name}.{key}: must be a list of leaves with a 'path'")
    if problems:
        raise BaselineError(f"{where}: malformed snapshot: " + "; ".join(problems),
                            hint="regenerate it: stagetool check --update")
    return doc


# ---------------------------------------------------------------------------------- compare


@dataclasses.dataclass(frozen=True)
class Change:
    """One difference between baseline and current.

    Attributes:
      function: the spec's function name.
      what: what changed: ``input params/w1: sharding``, ``memory.peak_bytes``,
        ``collective all-reduce over model``, ``function``, ``mesh``.
      before / after: human text of the old and new value (``—`` when absent).
      before_value / after_value: the numbers compared, for metrics; else None.
      change: relative change ``(after - before) / before`` for metrics, None otherwise (or when
        ``before`` is 0).
      status: ``regression`` (fails the check), ``improvement`` (shown, never fails), or
        ``changed`` (shown, within tolerance or not failing for a stated reason).
      note: why, e.g. ``tolerance 1%``.
    """

    function: str
    what: str
    before: str
    after: str
    status: str
    before_value: float | None = None
    after_value: float | None = None
    change: float | None = None
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class FunctionResult:
    """The outcome for one function.

    Attributes:
      name: the spec's function name.
      status: ``ok``, ``regression``, ``failed`` (did not compile, or its process died),
        ``new`` (not in the baseline; never fails) or ``removed`` (in the baseline, not staged
        now; fails: its one change is :func:`removed_change`, a regression).
      changes: what changed, regressions first.
      error: for ``failed``, the error message.
    """

    name: str
    status: str
    changes: tuple[Change, ...] = ()
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Comparison:
    """What ``check`` / ``diff`` found.

    Attributes:
      title: ``stagetool check`` or ``stagetool diff``.
      before / after: labels of the two sides (file names, ``mesh 2x4``).
      functions: one result per function, in the order of the current run, then removed ones.
      notices: sentences for the reader (environment differences, sections not compared).
    """

    title: str
    before: str
    after: str
    functions: tuple[FunctionResult, ...]
    notices: tuple[str, ...] = ()

    @property
    def regressions(self) -> list[Change]:
        """Every regression, in function order."""
        return [c for f in self.functions for c in f.changes if c.status == "regression"]

    @property
    def failed(self) -> list[FunctionResult]:
        """Functions that failed to compile."""
        return [f for f in self.functions if f.status == "failed"]

    def exit_code(self, *, fail_on_regression: bool = True) -> int:
        """3 when a function failed, else 1 for a regression (if it counts), else 0."""
        if self.failed:
            return 3
        return 1 if fail_on_regression and self.regressions else 0


def _fmt_leaf(leaf: Mapping | None) -> str:
    if leaf is None:
        return "—"
    if leaf.get("unused"):
        return "unused"
    return str(leaf.get("sharding"))


def _fmt_number(v: Any, unit: str) -> str:
    from stagetool.core.units import format_bytes, format_count

    if v is None:
        return "n/a"
    return format_bytes(v) if unit == "bytes" else format_count(v, unit)


def _compare_leaves(name: str, side: str, before: list | None, after: list | None) -> list[Change]:
    if before is None or after is None:
        return []
    out: list[Change] = []
    b = {x["path"]: x for x in before}
    a = {x["path"]: x for x in after}
    for path in list(b) + [p for p in a if p not in b]:
        x, y = b.get(path), a.get(path)
        what = f"{side} {path}"
        if x is None:
            out.append(Change(name, what, "—", f"{_shape(y)} {_fmt_leaf(y)}", "regression", note="leaf added"))
        elif y is None:
            out.append(Change(name, what, f"{_shape(x)} {_fmt_leaf(x)}", "—", "regression", note="leaf removed"))
        else:
            if (x.get("shape"), x.get("dtype")) != (y.get("shape"), y.get("dtype")):
                out.append(Change(name, f"{what}: shape", _shape(x), _shape(y), "regression"))
            if (x.get("sharding"), bool(x.get("unused"))) != (y.get("sharding"), bool(y.get("unused"))):
                note = None
                if x.get("bytes_per_device") != y.get("bytes_per_device"):
                    note = (f"per device {_fmt_number(x.get('bytes_per_device'), 'bytes')} → "
                            f"{_fmt_number(y.get('bytes_per_device'), 'bytes')}")
                out.append(Change(name, f"{what}: sharding", _fmt_leaf(x), _fmt_leaf(y), "regression",
                                  x.get("bytes_per_device"), y.get("bytes_per_device"), note=note))
    return out


def _shape(leaf: Mapping | None) -> str:
    from stagetool.core.units import shape_str

    return "—" if leaf is None else shape_str(str(leaf.get("dtype")), leaf.get("shape"))


def _metric(name: str, what: str, before: Any, after: Any, unit: str, tol: Tolerance, *,
            lower_is_worse: bool = False, non_failing: str | None = None) -> Change | None:
    if before is None or after is None:
        if before is None and after is None:
            return None
        return Change(name, what, _fmt_number(before, unit), _fmt_number(after, unit), "changed",
                      before, after, note="reported on one side only")
    if before == after:
        return None
    change = (after - before) / abs(before) if before else None
    worse = after < before if lower_is_worse else after > before
    if not worse:
        status, note = "improvement", None
    else:
        b, a = (-before, -after) if lower_is_worse else (before, after)
        within = tol.allows(b, a)
        status = "changed" if within else "regression"
        note = f"within tolerance {tol.text}" if within else f"tolerance {tol.text}"
        if status == "regression" and non_failing:
            status, note = "changed", non_failing
    b_text, a_text = _fmt_number(before, unit), _fmt_number(after, unit)
    if b_text == a_text:  # a change too small for three significant figures: show the exact values
        suffix = {"bytes": " B", "FLOP": " FLOP"}.get(unit, "")
        b_text, a_text = f"{before:,}{suffix}", f"{after:,}{suffix}"
    return Change(name, what, b_text, a_text, status, before, after, change, note)


def _floored(tol: Tolerance, floor: float) -> Tolerance:
    if (tol.fraction or 0.0) >= floor:
        return tol
    return Tolerance(floor, tol.absolute, f"{floor * 100:g}% (environment differs)")


def compare_function(name: str, before: Mapping, after: Mapping, tolerances: Mapping[str, Tolerance], *,
                     env_differs: bool = False, same_mesh_expected: bool = True) -> tuple[list[Change], list[str]]:
    """Changes between two snapshot entries of one function, and notices.

    Args:
      tolerances: by name (see :data:`TOLERANCE_KEYS`); missing names take the default.
      env_differs: the two sides come from different jax/jaxlib/device kinds: memory and cost
        tolerances are raised to at least :data:`ENV_MISMATCH_FLOOR`.
      same_mesh_expected: a different mesh is a regression (``check``); with False (``diff``
        across meshes) it is shown as ``changed``.
    """
    tol = {**DEFAULT_TOLERANCES, **tolerances}
    if env_differs:
        for k in ("memory", "flops", "bytes_accessed"):
            tol[k] = _floored(tol[k], ENV_MISMATCH_FLOOR)
    changes: list[Change] = []
    notices: list[str] = []
    mb, ma = before.get("mesh") or {}, after.get("mesh") or {}

    def axes_text(m: Mapping) -> str:
        return " × ".join(f"{n}={s}" for n, s in m.get("axes") or []) or "1 device"

    if axes_text(mb) != axes_text(ma):
        changes.append(Change(name, "mesh", axes_text(mb), axes_text(ma),
                              "regression" if same_mesh_expected else "changed"))
    for side, key in (("input", "inputs"), ("output", "outputs")):
        changes += _compare_leaves(name, side, before.get(key), after.get(key))
    for section, fields, unit_of, key_of in (
            ("memory", MEMORY_FIELDS, lambda f: "bytes", lambda f: "memory"),
            ("cost", COST_FIELDS, lambda f: "bytes" if f == "bytes_accessed" else ("FLOP" if f == "flops" else ""),
             lambda f: "bytes_accessed" if f == "bytes_accessed" else "flops")):
        b, a = before.get(section), after.get(section)
        if b is None or a is None:
            if (b is None) != (a is None):
                notices.append(f"{name}: {section} is in only one of the two snapshots; not compared")
            continue
        for f in fields:
            c = _metric(name, f"{section}.{f}", b.get(f), a.get(f), unit_of(f), tol[key_of(f)],
                        lower_is_worse=(f == "alias_bytes"))
            if c:
                changes.append(c)
    cb, ca = before.get("collectives"), after.get("collectives")
    if cb is None or ca is None:
        if (cb is None) != (ca is None):
            notices.append(f"{name}: collectives are in only one of the two snapshots; not compared")
    else:
        rb = {(r["kind"], r["axes"]): r for r in cb}
        ra = {(r["kind"], r["axes"]): r for r in ca}
        for key in sorted(set(rb) | set(ra)):
            x, y = rb.get(key), ra.get(key)
            what = f"collective {key[0]} over {key[1]}"
            if x is None:
                changes.append(Change(name, what, "—", f"{y['count']}× {_fmt_number(y['bytes_per_device'], 'bytes')}",
                                      "regression", 0, y["bytes_per_device"], note="new collective"))
            elif y is None:
                changes.append(Change(name, what, f"{x['count']}× {_fmt_number(x['bytes_per_device'], 'bytes')}", "—",
                                      "improvement", x["bytes_per_device"], 0, note="collective gone"))
            else:
                metrics = [_metric(name, f"{what}: count", x["count"], y["count"], "", tol["collective_count"]),
                           _metric(name, f"{what}: bytes", x["bytes_per_device"], y["bytes_per_device"], "bytes",
                                   tol["collective_bytes"])]
                if x.get("bytes_per_step") is not None and y.get("bytes_per_step") is not None:
                    metrics.append(_metric(name, f"{what}: bytes per step", x["bytes_per_step"], y["bytes_per_step"],
                                           "bytes", tol["collective_bytes"]))
                for c in metrics:
                    if c:
                        changes.append(c)
    order = {"regression": 0, "changed": 1, "improvement": 2}
    changes.sort(key=lambda c: order[c.status])
    return changes, notices


def removed_change(name: str) -> Change:
    """The regression of a function that is in the baseline but was not staged now."""
    return Change(name, "function", "present", "—", "regression",
                  note="in the baseline, no longer staged; --update accepts the removal")


def environment_notices(before: Mapping, after: Mapping) -> list[str]:
    """Sentences naming jax/jaxlib versions, platforms or device kinds that differ (empty if none)."""
    out = []
    for key in ("jax_version", "jaxlib_version"):
        if before.get(key) != after.get(key):
            out.append(f"{key.replace('_version', '')} {before.get(key)} in the baseline, {after.get(key)} now")
    kinds = lambda d: sorted({(e.get("mesh") or {}).get("platform", "?") + ":" +
                              str((e.get("mesh") or {}).get("device_kind", "?"))
                              for e in (d.get("functions") or {}).values()})
    if kinds(before) != kinds(after):
        out.append(f"device {', '.join(kinds(before)) or '?'} in the baseline, {', '.join(kinds(after)) or '?'} now")
    return out


def compare(before: Mapping, after: Mapping, *, tolerances_for=None, failed: Mapping[str, str] | None = None,
            title: str = "stagetool check", before_label: str = "baseline", after_label: str = "current",
            only: Iterable[str] | None = None, order: Iterable[str] | None = None,
            same_mesh_expected: bool = True) -> Comparison:
    """Compare two snapshots.

    A function of ``before`` that is neither in ``after`` nor failed is ``removed``, and that is a
    regression (one :func:`removed_change`): deleting or renaming a function must not pass the gate
    silently. A function only in ``after`` is ``new``: shown, never failing.

    Args:
      before / after: snapshot documents (:func:`load_snapshot`, :func:`snapshot_from_report`).
      tolerances_for: ``function name -> {tolerance name: Tolerance}``; None for the defaults.
      failed: functions that failed to compile now, with their error message.
      only: for a run restricted on purpose (``--function``, a TARGET): compare only these
        functions of the baseline; the others are not mentioned. None: all of them.
      order: the order of the results (the spec's; ``only`` when given); None: ``after``'s order,
        then failed functions. Removed functions come last, in ``before``'s order.
      same_mesh_expected: see :func:`compare_function`.
    """
    failed = dict(failed or {})
    env = environment_notices(before, after)
    notices = []
    if env:
        notices.append("the baseline comes from another environment (" + "; ".join(env) + "): compared "
                       f"anyway; memory and cost tolerances raised to at least {ENV_MISMATCH_FLOOR:.0%}")
    fb, fa = before.get("functions") or {}, after.get("functions") or {}
    results: list[FunctionResult] = []
    names = list(fa) + [n for n in failed if n not in fa]
    order = only if only is not None else order
    if order is not None:  # spec order
        rank = {n: i for i, n in enumerate(order)}
        names.sort(key=lambda n: rank.get(n, len(rank)))
    for name in names:
        if name in failed:
            results.append(FunctionResult(name, "failed", error=failed[name]))
        elif name not in fb:
            results.append(FunctionResult(name, "new"))
        else:
            tols = tolerances_for(name) if tolerances_for else DEFAULT_TOLERANCES
            changes, more = compare_function(name, fb[name], fa[name], tols, env_differs=bool(env),
                                             same_mesh_expected=same_mesh_expected)
            notices += more
            status = "regression" if any(c.status == "regression" for c in changes) else "ok"
            results.append(FunctionResult(name, status, tuple(changes)))
    wanted = set(fb) if only is None else set(only)
    for name in fb:
        if name not in fa and name not in failed and name in wanted:
            results.append(FunctionResult(name, "removed", (removed_change(name),)))
    return Comparison(title, before_label, after_label, tuple(results), tuple(notices))


# ---------------------------------------------------------------------------------- running


@dataclasses.dataclass(frozen=True)
class SnapshotRun:
    """A snapshot taken now, and the functions that failed.

    Attributes:
      snapshot: the document (functions that failed are left out).
      failed: function name → error message (a compile error, or how its process died).
      functions: every function of the plan, in spec order.
      spec_path: the spec used.
      spec_check: the spec's ``check:`` section (tolerances), or None.
    """

    snapshot: dict
    failed: dict[str, str]
    functions: tuple[str, ...]
    spec_path: Path | None
    spec_check: Any = None


SNAPSHOT_SECTIONS = ("shardings", "cost", "memory", "collectives")


def _sections() -> list:
    from stagetool.pipeline import Section

    return [s for s in Section if s.value in SNAPSHOT_SECTIONS]


def take_snapshot(options: Any, *, isolate: bool = False, on_stage=None) -> SnapshotRun:
    """Stage every function of ``options`` (a :class:`stagetool.pipeline.Options`) and snapshot it.

    Each function is staged on its own: one that fails to trace, lower or compile
    (:class:`stagetool.core.errors.StagingError`) is recorded in ``failed`` and the others still run.
    With ``isolate``, each function runs in its own ``python -m stagetool snapshot --function``
    process, so that one that aborts the process (an XLA ``LLVM ERROR``, ``os.abort()``) is
    recorded too.

    Raises:
      UsageError, SpecError, TargetError: bad options, spec or target.
    """
    from stagetool.core.errors import StagingError
    from stagetool.pipeline import analyze, make_plan

    plan = make_plan(options)
    names = tuple(f.name for f in plan.functions)
    spec_path = plan.spec.path
    parts: list[dict] = []
    failed: dict[str, str] = {}
    for name in names:
        one = dataclasses.replace(options, function=name)
        if isolate:
            part, error = _snapshot_in_subprocess(one, spec_path)
            if error is not None:
                failed[name] = error
            else:
                parts.append(part)
            continue
        try:
            report = analyze(one, _sections(), command="snapshot", on_stage=on_stage)
        except StagingError as e:
            failed[name] = e.message + (f" (at {e.user_frame})" if e.user_frame else "")  # "f: trace failed: ..."
            continue
        parts.append(snapshot_from_report(report, spec=_spec_label(spec_path)))
    if parts:
        snap = merge_snapshots(parts)
    else:
        import jax
        import jaxlib

        from stagetool._version import __version__

        snap = {"snapshot_schema": SNAPSHOT_SCHEMA, "kind": SNAPSHOT_KIND, "stagetool_version": __version__,
                "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
                "spec": _spec_label(spec_path), "functions": {}}
    snap["spec"] = _spec_label(spec_path)
    return SnapshotRun(snap, failed, names, spec_path, getattr(plan.spec, "check", None))


def _spec_label(spec_path: Path | None) -> str | None:
    return None if spec_path is None else Path(spec_path).name


def _snapshot_in_subprocess(options: Any, spec_path: Path | None) -> tuple[dict | None, str | None]:
    """Run ``python -m stagetool snapshot --function NAME`` into a temporary file."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="stagetool-isolate-") as tmp:
        out = Path(tmp) / "snapshot.json"
        argv = [sys.executable, "-m", "stagetool", "snapshot", "--function", options.function, "-o", str(out)]
        if spec_path is not None:
            argv += ["--spec", str(Path(spec_path).resolve())]
        elif options.target:
            argv.insert(4, options.target)
        for flag, value in (("--mesh", options.mesh), ("--platform", options.platform),
                            ("--topology", options.topology), ("--processes", options.processes)):
            if value is not None:
                argv += [flag, str(value)]
        if options.local_avals:
            argv.append("--local-avals")
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, cwd=os.getcwd())
        tail = _tail(proc.stderr)
        if proc.returncode < 0:
            try:
                sig = signal.Signals(-proc.returncode).name
            except ValueError:
                sig = f"signal {-proc.returncode}"
            return None, f"the process died with {sig}" + (f": {tail}" if tail else "")
        if proc.returncode != 0:
            return None, tail or f"exit code {proc.returncode}"
        try:
            return validate_snapshot(json.loads(out.read_text(encoding="utf-8")), str(out)), None
        except (OSError, ValueError, BaselineError) as e:
            return None, f"no snapshot from the isolated process: {e}"


def _tail(stderr: str, lines: int = 3) -> str:
    kept = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("wrote ")]
    return " | ".join(kept[-lines:])
