"""The CI gate's comparison: two snapshots → a :class:`Comparison` (``stagetool check`` / ``diff``).

:func:`compare` turns two snapshots into a :class:`Comparison`. What counts as a regression:

* a leaf whose compiled sharding, shape, dtype or unused flag changed, a leaf added or removed,
  a different mesh;
* a collective (kind × mesh axes) that appears;
* a function of the baseline that is no longer staged (deleted or renamed in the spec), unless
  the run was restricted on purpose (``--function``, a TARGET: see ``only`` in :func:`compare`);
* growth of a metric beyond its tolerance (:data:`DEFAULT_TOLERANCES`; ``alias_bytes`` is the
  other way round: less aliasing is worse, unless the outputs that need their own buffer did not
  grow, i.e. there were fewer output bytes to alias).

Shrinking metrics and collectives that disappear are improvements, and new functions are shown:
neither ever fails. Between a CPU snapshot and a TPU or GPU one, a change of a collective row that
XLA:CPU's own behaviour explains (the CPU row's ``cpu_only`` marks: an all-reduce left in a loop
body, a collective widened to f32; its ``accelerator_bytes_*`` equal to the accelerator's figure
within tolerance) is filed under the backend (status ``backend``): neither an improvement nor a
regression, never failing (:func:`_backend_change`). When the two snapshots come from different jax/jaxlib versions, platforms
or device kinds, the comparison still runs, a notice says so, and memory and cost tolerances
are raised to at least :data:`ENV_MISMATCH_FLOOR` (10%): compiler versions move these figures a
little; sharding and collective changes still fail. Across JAX releases each change of a figure the
compiler decides is marked "may come from jax A → B" (:func:`from_the_compiler`), and configuration
a release removed is not a difference (:func:`environment_notices`).
"""


from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from stagetool.core.errors import ExitCode
from stagetool.core.mesh import format_mesh
from stagetool.core.tolerances import DEFAULT_TOLERANCES, ENV_MISMATCH_FLOOR, Tolerance
from stagetool.analysis.figures import COST_FIELDS, DERIVED_COST_FIELDS, MEMORY_FIELDS


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
      status: ``regression`` (fails the check), ``improvement`` (shown, never fails),
        ``changed`` (shown, within tolerance or not failing for a stated reason), or ``backend`` (a
        CPU-only difference between a CPU and an accelerator snapshot, shown apart, never fails).
      note: why, e.g. ``tolerance 1%``.
      subject: what the change is about, for grouping it under its cause: ``("input", path)``,
        ``("output", path)``, ``("collective", kind, axes, network or "")``, ``("dcn",)``, ``("memory", field)``, ``("cost", field)``,
        ``("mesh",)``, ``("function",)``, ``("step_time",)``, ``("step_time", "profile")``.
      apart: the heading it is listed under instead of a cause (issue 47): :data:`PROFILE_HEADING` (the
        chip's figures differ between the two snapshots: the profile's change, never the code's) or
        :data:`BOUND_HEADING` (a figure that is a lower bound on either side: not a full figure); None
        for a change listed under its cause. A regression listed apart still fails.
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
    subject: tuple[str, ...] = ()
    apart: str | None = None


PROFILE_HEADING = "chip profile changed"
"""The heading of a step time whose chip figures (a spec's ``chips:`` entry, a calibrated profile) differ
between the two snapshots: the profile's change, shown, never the code's."""
BOUND_HEADING = "lower bound"
"""The heading of a figure that is a lower bound ("at least": work no model covers) on either side."""


@dataclasses.dataclass(frozen=True)
class Cause:
    """An edit that the two snapshots show, with the changes that follow from it (issue 22).

    Attributes:
      function: the spec's function name.
      kind: ``declared`` (inputs whose declared sharding changed: a spec line, a rule, a model
        annotation), ``constraint`` (a sharding constraint in the user's code), ``mesh``,
        ``compiler_options`` (the target's own jit's) or ``environment`` (jax/jaxlib, device, configuration).
      what: one sentence: ``rule at transformer.stagetool.yaml:14 changed the declared sharding of 6 inputs``.
      where: the spec or source line of the edit (``transformer.stagetool.yaml:14``), or None.
      edits: one line per edited thing: ``params/layers/wo: P(None, 'model', None) → P(None, None, 'model')``.
      consequences: the changes it leads to: those recorded as coming from it (a leaf it declares, a
        collective or output whose sharding origins name it), and, when it is the function's only
        edit, every other change of the function (``linked`` says which).
      linked: for each consequence, True when the snapshots record the link (origins), False when it is
        attributed because no other edit was found.
    """

    function: str
    kind: str
    what: str
    where: str | None
    edits: tuple[str, ...]
    consequences: tuple[Change, ...] = ()
    linked: tuple[bool, ...] = ()


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
      causes: the edits found between the two snapshots, each with its consequences (:class:`Cause`).
      unexplained: changes no recorded edit leads to (listed apart).
      backend: the changes with status ``backend`` (XLA:CPU against an accelerator), listed apart
        (also in ``changes``; never in ``causes`` or ``unexplained``).
      apart: the changes listed under :data:`PROFILE_HEADING` or :data:`BOUND_HEADING` (their ``apart``),
        also in ``changes``, never in ``causes`` or ``unexplained``; a regression among them fails.
    """

    name: str
    status: str
    changes: tuple[Change, ...] = ()
    error: str | None = None
    causes: tuple[Cause, ...] = ()
    unexplained: tuple[Change, ...] = ()
    backend: tuple[Change, ...] = ()
    apart: tuple[Change, ...] = ()


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
    def causes(self) -> list[Cause]:
        """Every cause, in function order; the same edit in several functions (a rule shared by them,
        the environment) once, with the first function's consequences."""
        out, seen = [], set()
        for f in self.functions:
            for c in f.causes:
                key = (c.kind, c.what, c.where)
                if key not in seen:
                    seen.add(key)
                    out.append(c)
        return out

    def headline(self) -> str:
        """``2 causes → 19 failing changes``: the first words of the Markdown, JUnit and step summary."""
        n, m = len(self.causes), len(self.regressions)
        return f"{n} {'cause' if n == 1 else 'causes'} → {m} failing {'change' if m == 1 else 'changes'}"

    @property
    def failed(self) -> list[FunctionResult]:
        """Functions that failed to compile."""
        return [f for f in self.functions if f.status == "failed"]

    def exit_code(self, *, fail_on_regression: bool = True) -> ExitCode:
        """``JAX`` (3) when a function failed, else ``FINDINGS`` (1) for a regression (if it counts),
        else ``OK`` (0)."""
        if self.failed:
            return ExitCode.JAX
        return ExitCode.FINDINGS if fail_on_regression and self.regressions else ExitCode.OK


def _fmt_leaf(leaf: Mapping | None) -> str:
    if leaf is None:
        return "—"
    if leaf.get("unused"):
        return "unused"
    return str(leaf.get("sharding"))


def _bytes_in(group: dict) -> str:
    """A collective group's bytes and how many collectives carry them: ``256 B in 2`` (the bytes are
    the group's sum per device, not each one's)."""
    return f"{_fmt_number(group['bytes_per_device'], 'bytes')} in {group['count']}"


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
        subject = (side, path)
        if x is None:
            out.append(Change(name, what, "—", f"{_shape(y)} {_fmt_leaf(y)}", "regression", note="leaf added",
                              subject=subject))
        elif y is None:
            out.append(Change(name, what, f"{_shape(x)} {_fmt_leaf(x)}", "—", "regression", note="leaf removed",
                              subject=subject))
        else:
            if (x.get("shape"), x.get("dtype")) != (y.get("shape"), y.get("dtype")):
                out.append(Change(name, f"{what}: shape", _shape(x), _shape(y), "regression", subject=subject))
            if (x.get("sharding"), bool(x.get("unused"))) != (y.get("sharding"), bool(y.get("unused"))):
                note = None
                if x.get("bytes_per_device") != y.get("bytes_per_device"):
                    note = (f"per device {_fmt_number(x.get('bytes_per_device'), 'bytes')} → "
                            f"{_fmt_number(y.get('bytes_per_device'), 'bytes')}")
                status, label = "regression", f"{what}: sharding"
                if x.get("chosen") and y.get("chosen"):
                    # An output sharding nobody declared (no out_shardings) is the compiler's choice: it is
                    # compared apart, and a new choice that holds fewer bytes per device is no regression.
                    label = f"{what}: sharding (the compiler's choice)"
                    bx, by = x.get("bytes_per_device"), y.get("bytes_per_device")
                    if bx is not None and by is not None and by < bx:
                        status = "changed"
                out.append(Change(name, label, _fmt_leaf(x), _fmt_leaf(y), status,
                                  x.get("bytes_per_device"), y.get("bytes_per_device"), note=note, subject=subject))
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


def _donation_moved_temps(before: Mapping, after: Mapping) -> str | None:
    """Why temporaries that grew do not fail: with more donation XLA computes the donated outputs in
    the temp block (the SGD step of issue #10: temps 8 -> 12 MiB as 4 MiB become aliased), so temp
    growth up to the growth of aliased bytes is what donation does; the peak
    (arguments + outputs - aliased + temporaries) is the gated figure."""
    keys = ("temp_bytes", "alias_bytes")
    if any(not isinstance(d.get(k), (int, float)) for d in (before, after) for k in keys):
        return None
    grew = after["temp_bytes"] - before["temp_bytes"]
    aliased = after["alias_bytes"] - before["alias_bytes"]
    if 0 < grew <= aliased:
        return "temporaries grew by no more than the newly aliased (donated) bytes; the peak is the gated figure"
    return None


def _aliasing_kept(before: Mapping, after: Mapping, tol: Tolerance) -> str | None:
    """Why fewer aliased bytes do not fail: no output lost its donated buffer. The output bytes that
    need a buffer of their own (``output_bytes - alias_bytes``) did not grow beyond ``tol``, so the
    aliased bytes fell with the outputs they alias: on a mesh that shards the donated state more
    finely (``diff --mesh-a 4x2 --mesh-b 2x4``) every figure per device falls, aliased bytes too.
    A donated leaf that stops being aliased keeps its output's bytes and moves them out of the
    aliased ones: that growth still fails."""
    keys = ("alias_bytes", "output_bytes")
    if any(not isinstance(d.get(k), (int, float)) for d in (before, after) for k in keys):
        return None
    own_b = before["output_bytes"] - before["alias_bytes"]
    own_a = after["output_bytes"] - after["alias_bytes"]
    if tol.allows(own_b, own_a):
        return (f"fewer output bytes to alias: outputs {before['output_bytes']:,} → {after['output_bytes']:,} B, "
                f"those needing their own buffer {own_b:,} → {own_a:,} B")
    return None


def _axes_display(axes: str) -> str:
    """A snapshot's collective axes (``"data,fsdp"``; ``"-"`` none, ``"?"`` unknown) written as the
    ``collectives`` table writes them: ``data × fsdp``, ``(within a device)``."""
    if axes == "-":
        return "(within a device)"
    return " × ".join(axes.split(",")) if axes != "?" else axes


def _floored(tol: Tolerance, floor: float) -> Tolerance:
    if (tol.fraction or 0.0) >= floor:
        return tol
    return Tolerance(floor, tol.absolute, f"{floor * 100:g}% (environment differs)")


def cpu_against_accelerator(before: Mapping, after: Mapping) -> bool:
    """Whether one snapshot entry was compiled by XLA:CPU and the other for an accelerator (its
    ``mesh.platform`` ``tpu``, ``gpu``, ``cuda`` or ``rocm``)."""
    platforms = {(e.get("mesh") or {}).get("platform") for e in (before, after)}
    return "cpu" in platforms and bool(platforms & {"tpu", "gpu", "cuda", "rocm"})


def _backend_change(change: Change, field: str, x: Mapping, y: Mapping, cpu_first: bool, tol: Tolerance) -> Change:
    """``change`` (of a collective row's ``field``: ``count``, ``bytes_per_device``, ``bytes_per_step``)
    with status ``backend`` when the CPU side's row marks collectives only XLA:CPU makes so and the
    accelerator's figure is what it expects (``accelerator_*``, within ``tol``; the count: equal);
    else unchanged."""
    cpu, acc = (x, y) if cpu_first else (y, x)
    marks = cpu.get("cpu_only")
    if not marks:
        return change
    expected = cpu.get("count") if field == "count" else cpu.get(f"accelerator_{field}")
    got = acc.get(field)
    if got is not None and expected is None and field != "count":  # the placement differs, its bytes unknown
        return dataclasses.replace(change, status="backend", note=(
            f"XLA:CPU's: {'; '.join(marks)}; the accelerator's figure is not known from the CPU compile"))
    if expected is None or got is None:
        return change
    if field == "count" and expected != got:
        return change
    if field != "count" and not (tol.allows(expected, got) and tol.allows(got, expected)):
        return change
    return dataclasses.replace(change, status="backend", note=(
        f"XLA:CPU's: {'; '.join(marks)}; expected on the accelerator: "
        f"{_fmt_number(expected, 'bytes' if field != 'count' else '')}, as here"))


def _compiler(mesh: Mapping) -> str:
    platform = str(mesh.get("platform") or "?")
    return "XLA:" + {"cuda": "GPU", "rocm": "GPU"}.get(platform, platform.upper())


def _across_backends(change: Change, mb: Mapping, ma: Mapping) -> Change:
    """A memory, cost or step-time ``change`` between a CPU snapshot and an accelerator's, filed under
    the backend (status ``backend``, never failing): the two compilers lay out, fuse, schedule and
    allocate the same program differently (XLA:TPU's tiled layouts and its own temporaries, XLA:CPU's
    f32 dots), so the figures differ without any edit. Shardings and collectives are compared as
    before; a CPU-only collective is filed by :func:`_backend_change`."""
    why = (f"{_compiler(mb)} → {_compiler(ma)}: the two compilers lay out, fuse and allocate the same program "
           "differently; compare snapshots of one backend to gate this figure")
    return dataclasses.replace(change, status="backend", note=f"{change.note}; {why}" if change.note else why,
                               apart=None)


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
    backends = cpu_against_accelerator(before, after)

    def axes_text(m: Mapping) -> str:
        return format_mesh(m.get("axes") or [], empty="1 device")

    if axes_text(mb) != axes_text(ma):
        changes.append(Change(name, "mesh", axes_text(mb), axes_text(ma),
                              "regression" if same_mesh_expected else "changed", subject=("mesh",)))
    ob, oa = before.get("compiler_options") or {}, after.get("compiler_options") or {}
    if ob != oa:  # the target's own jit(compiler_options=...): shown; the figures it moves are compared below
        def options_text(o: Mapping) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(o.items())) or "none"

        changes.append(Change(name, "compiler_options", options_text(ob), options_text(oa), "changed",
                              note="the target's own jit options; they change the compiled program",
                              subject=("compiler_options",)))
    for side, key in (("input", "inputs"), ("output", "outputs")):
        changes += _compare_leaves(name, side, before.get(key), after.get(key))
    for section, fields, unit_of, key_of in (
            ("memory", MEMORY_FIELDS, lambda f: "bytes", lambda f: "memory"),
            ("cost", COST_FIELDS + DERIVED_COST_FIELDS,
             lambda f: "bytes" if f == "bytes_accessed" else ("FLOP" if f.endswith("flops") else ""),
             lambda f: "bytes_accessed" if f == "bytes_accessed" else "flops")):
        b, a = before.get(section), after.get(section)
        if b is None or a is None:
            if (b is None) != (a is None):
                notices.append(f"{name}: {section} is in only one of the two snapshots; not compared")
            continue
        for f in fields:
            c = _metric(name, f"{section}.{f}", b.get(f), a.get(f), unit_of(f), tol[key_of(f)],
                        lower_is_worse=(f == "alias_bytes"),
                        non_failing=(_donation_moved_temps(b, a) if (section, f) == ("memory", "temp_bytes")
                                     else _aliasing_kept(b, a, tol["memory"]) if (section, f) == ("memory", "alias_bytes")
                                     else None))
            nb, na = before.get("flops_not_counted"), after.get("flops_not_counted")
            if section == "cost" and f != "transcendentals" and (nb or na) and None not in (b.get(f), a.get(f)):
                c = _bounded(c, name, f"{section}.{f}", b[f], a[f], bool(nb), bool(na), nb, na, tol[key_of(f)],
                             lambda v, u=unit_of(f): _fmt_number(v, u))
            if c and backends:
                c = _across_backends(c, mb, ma)
            if c:
                changes.append(dataclasses.replace(c, subject=(section, f)))
    cb, ca = before.get("collectives"), after.get("collectives")
    if cb is None or ca is None:
        if (cb is None) != (ca is None):
            notices.append(f"{name}: collectives are in only one of the two snapshots; not compared")
    else:
        rb = {(r["kind"], r["axes"], r.get("network") or ""): r for r in cb}
        ra = {(r["kind"], r["axes"], r.get("network") or ""): r for r in ca}
        for key in sorted(set(rb) | set(ra)):
            x, y = rb.get(key), ra.get(key)
            what = f"collective {key[0]} over {_axes_display(key[1])}" + (f" ({key[2]})" if key[2] else "")
            subject = ("collective", *key)
            only = x if y is None else y if x is None else None
            if only is not None and backends and only.get("cpu_only") and (only is x) == (mb.get("platform") == "cpu"):
                # a row only the CPU side has, made by XLA:CPU alone (its marks say so): the backend's
                changes.append(Change(name, what, "—" if x is None else _bytes_in(x), "—" if y is None else _bytes_in(y),
                                      "backend", None if x is None else x["bytes_per_device"],
                                      None if y is None else y["bytes_per_device"],
                                      note=f"XLA:CPU's: {'; '.join(only['cpu_only'])}; the accelerator makes none",
                                      subject=subject))
            elif x is None:
                changes.append(Change(name, what, "—", _bytes_in(y),
                                      "regression", 0, y["bytes_per_device"], note=_at_lines("new collective", y),
                                      subject=subject))
            elif y is None:
                changes.append(Change(name, what, _bytes_in(x), "—",
                                      "improvement", x["bytes_per_device"], 0, note=_at_lines("collective gone", x),
                                      subject=subject))
            else:
                metrics = [("count", _metric(name, f"{what}: count", x["count"], y["count"], "",
                                             tol["collective_count"])),
                           ("bytes_per_device", _metric(name, f"{what}: bytes", x["bytes_per_device"],
                                                        y["bytes_per_device"], "bytes", tol["collective_bytes"]))]
                if x.get("bytes_per_step") is not None and y.get("bytes_per_step") is not None:
                    metrics.append(("bytes_per_step", _metric(name, f"{what}: bytes per step", x["bytes_per_step"],
                                                              y["bytes_per_step"], "bytes", tol["collective_bytes"])))
                for field, c in metrics:
                    if c and backends:
                        c = _backend_change(c, field, x, y, (mb.get("platform") == "cpu"), tol["collective_bytes"])
                    if c:
                        changes.append(dataclasses.replace(c, subject=subject))
    for c in _step_time_changes(name, before.get("step_time"), after.get("step_time"), tol["step_time"], notices):
        changes.append(_across_backends(c, mb, ma) if backends else c)
    db, da = before.get("dcn_bytes_per_step"), after.get("dcn_bytes_per_step")
    if db is not None or da is not None:  # a multi-slice job: the bytes between slices, a figure of its own
        c = _metric(name, "bytes over DCN per step", db or 0, da or 0, "bytes", tol["collective_bytes"])
        if c:
            changes.append(dataclasses.replace(c, subject=("dcn",)))
    order = {"regression": 0, "changed": 1, "improvement": 2, "backend": 3}
    changes.sort(key=lambda c: order[c.status])
    return changes, notices


def _step_time_changes(name: str, b: Mapping | None, a: Mapping | None, tol: Tolerance,
                       notices: list[str]) -> list[Change]:
    """The step-time estimate compared (issue 47): its schedule figure (``subject ("step_time",)``), a growth
    beyond ``tol`` a regression whose note names the parts that grew (compute, memory bandwidth, a link
    class, latency), largest first; an improvement names the parts that shrank. Estimates on different
    chips are not compared (a notice).

    Where the chip's figures differ between the snapshots (``profile.digest``: a ``chips:`` entry, a
    calibrated profile), the change under each side's own figures is listed under
    :data:`PROFILE_HEADING`, never failing, with the figures that differ; the code's change is the step
    timed with stagetool's built-in figures of the chip on both sides (``builtin``, or the figures
    themselves where they are the built-in ones), gated with ``tol`` as usual: a forged profile cannot
    hide what the code did. Where no figures time both sides, the growth cannot be told from the
    profile's: beyond ``tol`` it fails under :data:`PROFILE_HEADING`. A lower bound on either side:
    :func:`_bounded`."""
    if b is None or a is None:
        if (b is None) != (a is None):
            notices.append(f"{name}: the step-time estimate is in only one of the two snapshots; not compared")
        return []
    if b.get("chip") != a.get("chip"):  # another chip: another question, shown under the profile's heading
        notices.append(f"{name}: step time estimated on {b.get('chip')} before and {a.get('chip')} now; not compared")
        return [Change(name, f"step time (estimate): chip {b.get('chip')} → {a.get('chip')}",
                       _fmt_seconds(b["seconds"]), _fmt_seconds(a["seconds"]), "changed", b["seconds"], a["seconds"],
                       (a["seconds"] - b["seconds"]) / b["seconds"] if b["seconds"] else None,
                       note=f"{PROFILE_HEADING}: estimated on another chip, not compared: the code's change of the "
                            "step time is not gated across chips", subject=("step_time", "profile"),
                       apart=PROFILE_HEADING)]
    chip = a["chip"]
    pb, pa = b.get("profile"), a.get("profile")
    if pb is None or pa is None:  # a snapshot from before issue 47: the figures it used are not known
        if pb is not pa:
            side = "baseline" if pb is None else "current snapshot"
            notices.append(f"{name}: the {side} does not record the chip figures its step time was computed with "
                           "(written before stagetool recorded them): a changed chip profile cannot be told from a "
                           "change of the code there; regenerate it (check --update) to separate them")
    if pb is None or pa is None or pb.get("digest") == pa.get("digest"):
        c = _timed(name, f"step time (estimate, {chip})", b, a, tol)
        return [c] if c else []
    differ = _figures_differ(pb.get("figures") or {}, pa.get("figures") or {})
    rb, ra = _builtin_timing(b), _builtin_timing(a)
    out = []
    if rb is not None and ra is not None and rb["digest"] == ra["digest"]:
        code = _timed(name, f"step time (estimate, {chip}, both sides with stagetool's built-in figures)",
                      {**b, **rb}, {**a, **ra}, tol, parts=False)
        if code:
            out.append(code)
        profile = _timed(name, f"step time (estimate, {chip}) under each side's chip profile", b, a, tol)
        why = (f"{PROFILE_HEADING}: {differ}; not the code's: the code's change is the step timed with stagetool's "
               f"built-in {chip} figures on both sides" + (f" ({_fmt_seconds(rb['seconds'])} → "
                                                            f"{_fmt_seconds(ra['seconds'])}, gated)"))
        if profile is None:  # the same figure under both profiles: the profile changed all the same
            profile = Change(name, f"step time (estimate, {chip}) under each side's chip profile",
                             _fmt_seconds(b["seconds"]), _fmt_seconds(a["seconds"]), "changed", b["seconds"],
                             a["seconds"], 0.0)
        out.append(dataclasses.replace(profile, status="changed", note=why, subject=("step_time", "profile"),
                                       apart=PROFILE_HEADING))
        return out
    c = _timed(name, f"step time (estimate, {chip}) under each side's chip profile", b, a, tol)
    if c is None:
        c = Change(name, f"step time (estimate, {chip}) under each side's chip profile", _fmt_seconds(b["seconds"]),
                   _fmt_seconds(a["seconds"]), "changed", b["seconds"], a["seconds"], 0.0)
    missing = "the baseline" if rb is None else "the current snapshot" if ra is None else None
    common = (f"no figures time both sides ({missing} has no step timed with stagetool's built-in {chip} figures"
              if missing else f"stagetool's built-in {chip} figures differ between the two snapshots (another "
              "stagetool release")
    why = (f"{PROFILE_HEADING}: {differ}; {common}), so the profile's change cannot be told from the code's"
           + ("; review it, then check --update" if c.status == "regression" else ""))
    return [dataclasses.replace(c, note=f"{c.note}; {why}" if c.note else why, subject=("step_time", "profile"),
                                apart=PROFILE_HEADING)]


def _fmt_seconds(v: float) -> str:
    from stagetool.core.units import format_seconds

    return format_seconds(v)


def _builtin_timing(e: Mapping) -> dict | None:
    """A step-time record's figure with stagetool's built-in figures of its chip: its own where its profile
    is the built-in one, else its ``builtin`` record; ``{"digest", "seconds", "lower_bound"}`` or None."""
    p = e.get("profile") or {}
    if p.get("builtin"):
        return {"digest": p.get("digest"), "seconds": e["seconds"], "lower_bound": bool(e.get("lower_bound"))}
    r = e.get("builtin")
    return None if r is None else {"digest": r["digest"], "seconds": r["seconds"],
                                   "lower_bound": bool(r.get("lower_bound"))}


def _figures_differ(fb: Mapping[str, float], fa: Mapping[str, float], most: int = 6) -> str:
    """``matmul.f32_highest 2.94e+13 → 1.56e+14`` for each figure that differs (at most ``most``, then how
    many more); the figures' digests differ even where the listed ones are all the same number."""
    rows = [f"{k} {_g(fb.get(k))} → {_g(fa.get(k))}" for k in sorted(set(fb) | set(fa)) if fb.get(k) != fa.get(k)]
    shown = ", ".join(rows[:most]) + (f" and {len(rows) - most} more" if len(rows) > most else "")
    return f"the chip's figures differ: {shown}" if rows else "the chip's figures differ"


def _g(v: float | None) -> str:
    return "unset" if v is None else f"{v:.3g}"


def _timed(name: str, what: str, b: Mapping, a: Mapping, tol: Tolerance, *, parts: bool = True) -> Change | None:
    """Two step-time figures (``seconds``, ``lower_bound``, ``uncounted``, ``parts``, ``bound``) compared:
    the tolerance when both are full figures (the parts that grew or shrank in the note, ``parts``), else
    :func:`_bounded`."""
    c = _metric(name, what, b["seconds"], a["seconds"], "", tol)
    c = _bounded(c, name, what, b["seconds"], a["seconds"], bool(b.get("lower_bound")), bool(a.get("lower_bound")),
                 b.get("uncounted"), a.get("uncounted"), tol, _fmt_seconds)
    if c is None:
        return None
    words = [c.note] if c.note else []
    if parts:
        pb, pa = b.get("parts") or {}, a.get("parts") or {}
        moved = sorted(((pa.get(k, 0.0) - pb.get(k, 0.0), k) for k in set(pb) | set(pa)), reverse=True)
        grew = ", ".join(f"{k} +{_fmt_seconds(d)}" for d, k in moved if d > 0)[:300]
        shrank = ", ".join(f"{k} −{_fmt_seconds(-d)}" for d, k in reversed(moved) if d < 0)[:300]
        # an improvement has no tolerance note (None): the parts that moved say why, the worse ones first
        words += [f"grew: {grew}"] if grew else []
        words += [f"shrank: {shrank}"] if shrank else []
        if a.get("bound"):
            words.append(f"bound by {a.get('bound')}")
    least = "at least "
    return dataclasses.replace(c, before=(least if b.get("lower_bound") else "") + _fmt_seconds(b["seconds"]),
                               after=(least if a.get("lower_bound") else "") + _fmt_seconds(a["seconds"]),
                               note="; ".join(words) or None, subject=("step_time",))


def _bounded(c: Change | None, name: str, what: str, before: float, after: float, lb_before: bool, lb_after: bool,
             unc_before, unc_after, tol: Tolerance, fmt) -> Change | None:
    """``c`` (a figure's change, or None when the values are equal) where either side is a lower bound
    ("at least": work no model covers, ``unc_*`` naming it as ``kind at file:line``), listed under
    :data:`BOUND_HEADING`; the rule (docs/ci-gate.md#lower-bounds):

    * a full figure that becomes a lower bound: a regression, whatever the numbers (a sort that made a
      step 2.05x slower on the v5e moved its floor by +0.3%): the gate can no longer tell how much it
      grew; review, then ``check --update``;
    * both lower bounds: a regression when the work not counted grew (a kind of it more often than
      before) or the floor grew beyond the tolerance; otherwise shown, not failing, never an
      improvement (the floor fell, the work it leaves out is not known);
    * a lower bound that becomes a full figure: an improvement when the figure is below the old floor
      (below even what the step took at least), else shown, not failing.

    Neither side a lower bound: ``c`` unchanged."""
    if not (lb_before or lb_after):
        return c
    grew = after > before and not tol.allows(before, after)
    names_b, names_a = list(unc_before or ()), list(unc_after or ())
    kinds = lambda names: collections.Counter(n.split(" at ")[0] for n in names)  # noqa: E731
    more = sorted((kinds(names_a) - kinds(names_b)).elements())
    if c is None and lb_before == lb_after and not more:
        return None  # the same floor over the same kinds of uncounted work: nothing to say
    now = f"work not counted now: {', '.join(names_a)}" if names_a else "work not counted now"
    if lb_after and not lb_before:
        status, note = "regression", (f"now a lower bound ({now}): the gate cannot tell how much it grew; review it, "
                                      "then check --update")
    elif lb_before and lb_after:
        if more:
            status, note = "regression", f"both lower bounds, more work not counted now: {', '.join(more)} ({now})"
        elif grew:
            status, note = "regression", f"both lower bounds; the floor grew beyond tolerance {tol.text} ({now})"
        else:
            status, note = "changed", (f"both lower bounds: the floors compared, not the steps; the work not counted "
                                       f"({', '.join(names_a) or 'unnamed'}) is not")
    else:
        was = f"work not counted in the baseline: {', '.join(names_b)}" if names_b else "work not counted then"
        if after < before:
            status, note = "improvement", f"a full figure now, below the baseline's floor ({was})"
        else:
            status, note = "changed", f"a full figure now; the baseline's was only a lower bound ({was})"
    change = (after - before) / abs(before) if before else None
    base = c or Change(name, what, fmt(before), fmt(after), status, before, after, change)
    return dataclasses.replace(base, status=status, note=note, apart=BOUND_HEADING)


def _at_lines(note: str, row: Mapping) -> str:
    """``new collective at transformer.py:87, transformer.py:93`` when the row records its lines."""
    lines = row.get("lines") or []
    if not lines:
        return note
    shown = ", ".join(lines[:6]) + (f" and {len(lines) - 6} more" if len(lines) > 6 else "")
    return f"{note} at {shown}"


_HOW = {"rule": "the rule at {at}", "spec": "the spec at {at}", "model": "the model's annotation (init at {at})",
        "init": "the init's own sharding (init at {at})", "target": "the target's in_shardings",
        "object": "the object's own sharding (ref at {at})", "unknown": "the init or ref at {at} (no sharding known)",
        "compiler": "auto at {at}", None: "the default (replicated) for the leaf at {at}"}


def find_causes(name: str, before: Mapping, after: Mapping, changes: list[Change],
                environment: list[str] | None = None) -> tuple[list[Cause], list[Change]]:
    """The edits between two snapshot entries of one function, each with its consequences, and the
    changes no edit leads to (issue 22).

    Edits: inputs whose *declared* sharding changed, grouped by the spec line that declares them (one
    rule edited changes every leaf it matches: one cause); a sharding constraint whose sharding changed,
    appeared or went (by its source line; under explicit axes a line whose new shardings all came in at
    one earlier edited line is listed under that edit, as its values' sharding types); the mesh; the environment (``environment``: the sentences of
    :func:`environment_notices`). A change is linked to an edit when the snapshots record it: a leaf the
    edit declares, an output or a collective whose recorded origins (``origins``, ``causes``) name a
    leaf or constraint of the edit (on either side). What no edit is linked to goes to the mesh when it
    changed, else to the one edit when there is exactly one, else apart (unexplained). Baselines
    without these records give no declared or constraint edits: their changes are unexplained.
    """
    edits: list[tuple[Cause, set[str]]] = []
    mb, ma = before.get("mesh") or {}, after.get("mesh") or {}
    mesh_text = lambda m: format_mesh(m.get("axes") or [], empty="1 device")  # noqa: E731
    if mesh_text(mb) != mesh_text(ma):
        edits.append((Cause(name, "mesh", f"the mesh changed: {mesh_text(mb)} → {mesh_text(ma)}", None,
                            (f"mesh: {mesh_text(mb)} → {mesh_text(ma)}",)), set()))
    ob, oa = before.get("compiler_options") or {}, after.get("compiler_options") or {}
    if ob != oa:
        text = lambda o: ", ".join(f"{k}={v}" for k, v in sorted(o.items())) or "none"  # noqa: E731
        edits.append((Cause(name, "compiler_options", f"the target's own compiler_options changed: {text(ob)} → "
                            f"{text(oa)}", None, (f"compiler_options: {text(ob)} → {text(oa)}",)), set()))
    groups: dict[tuple, list[tuple[str, str, str]]] = {}
    model_inits: dict[str, None] = {}
    b_in = {x["path"]: x for x in before.get("inputs") or []}
    for y in after.get("inputs") or []:
        x = b_in.get(y["path"])
        if x is None or x.get("declared") is None or y.get("declared") is None or x["declared"] == y["declared"]:
            continue
        at = y.get("declared_at") or x.get("declared_at")
        # the model's own annotations are one place in its code whichever init builds the leaf (a model
        # and its optimizer state): one cause, naming the inits
        key = ("model", None) if y.get("declared_by") == "model" else (y.get("declared_by"), at)
        groups.setdefault(key, []).append((y["path"], x["declared"], y["declared"]))
        if key == ("model", None) and at:
            model_inits.setdefault(at, None)
    for (how, at), leaves in groups.items():
        if key_is_model := (how == "model" and at is None):
            own, inits = _annotation_lines(model_inits, leaves, b_in, after.get("inputs") or [])
            at = ", ".join(own + inits) or None
        who = _HOW.get(how, "{at}").format(at=at or "?")
        if key_is_model:
            who = ("the model's sharding annotations" + (f" at {', '.join(own)}" if own else "")
                   + (f" (init at {', '.join(inits)})" if inits else ""))
        what = f"{who} changed the declared sharding of {len(leaves)} input{'s' if len(leaves) != 1 else ''}"
        edits.append((Cause(name, "declared", what, at, tuple(f"{p}: {b} → {a}" for p, b, a in leaves)),
                      {f"input {p}" for p, _, _ in leaves}))
    cb, ca = before.get("constraints"), after.get("constraints")
    if isinstance(cb, list) and isinstance(ca, list):
        by_line_b: dict[str, list[str]] = {}
        by_line_a: dict[str, list[str]] = {}
        for c in cb:
            by_line_b.setdefault(c["line"], []).append(c["sharding"])
        for c in ca:
            by_line_a.setdefault(c["line"], []).append(c["sharding"])
        # Under explicit axes every op's result type is a constraint of its line, so one edited
        # out_sharding= changes the lines after it that take the value: a line whose new shardings all
        # came in at one earlier edited line follows that edit (its values' types), not an edit itself.
        typed = mb.get("axis_types") == "explicit" and ma.get("axis_types") == "explicit"
        introduced: dict[str, int] = {}  # a sharding -> the edit (index in edits) at whose line it came in
        for line in sorted(set(by_line_b) | set(by_line_a), key=_line_key):
            sb, sa = sorted(by_line_b.get(line, [])), sorted(by_line_a.get(line, []))
            if sb == sa:
                continue
            old, new = " ".join(sb) or "none", " ".join(sa) or "none"
            added = set(sa) - set(sb)
            origin = {introduced.get(x) for x in added}
            if typed and added and len(origin) == 1 and None not in origin:
                i = origin.pop()
                cause, labels = edits[i]
                edits[i] = (dataclasses.replace(cause, edits=(*cause.edits, f"{line}: {old} → {new} (follows "
                                                              f"{cause.where}: the sharding types of its values)")),
                            labels | {f"constraint {line}"})
                continue
            verb = "added" if not sb else "removed" if not sa else "changed"
            edits.append((Cause(name, "constraint", f"the sharding constraint at {line} {verb}", line,
                                (f"{line}: {old} → {new}",)), {f"constraint {line}"}))
            for x in added:
                introduced.setdefault(x, len(edits) - 1)
    if environment:
        edits.append((Cause(name, "environment", "the environment changed: " + "; ".join(environment), None,
                            tuple(environment)), set()))
    consequences: list[list[tuple[Change, bool]]] = [[] for _ in edits]
    unlinked: list[Change] = []
    for change in changes:
        labels = _labels(change, before, after)
        hit = [i for i, (_, lab) in enumerate(edits) if lab & labels]
        if change.subject == ("mesh",):
            hit = [i for i, (c, _) in enumerate(edits) if c.kind == "mesh"]
        if change.subject == ("compiler_options",):
            hit = [i for i, (c, _) in enumerate(edits) if c.kind == "compiler_options"]
        for i in hit:
            consequences[i].append((change, True))
        if not hit:
            unlinked.append(change)
    mesh = [i for i, (c, _) in enumerate(edits) if c.kind == "mesh"]
    unexplained: list[Change] = []
    for change in unlinked:
        if mesh:
            consequences[mesh[0]].append((change, False))
        elif len(edits) == 1:
            consequences[0].append((change, False))
        else:
            unexplained.append(change)
    causes = [dataclasses.replace(c, consequences=tuple(x for x, _ in cons), linked=tuple(k for _, k in cons))
              for (c, _), cons in zip(edits, consequences)]
    return causes, unexplained


def _annotation_lines(lines: Mapping[str, None], leaves: list[tuple[str, str, str]], before: Mapping[str, Mapping],
                      after: list[Mapping]) -> tuple[list[str], list[str]]:
    """The lines the model's changed annotations are credited to (``declared_at`` of the model-declared
    inputs), split into the model's own lines (a module's ``nnx.with_partitioning``) and init lines
    (the spec's ``init:`` line, or the init's line that builds copies of the model's leaves: an
    optimizer's moments, whose paths end with a parameter's path under its argument), each in order."""
    at = {y["path"]: y.get("declared_at") or (before.get(y["path"]) or {}).get("declared_at") for y in after}
    changed = [p for p, _, _ in leaves]
    by_line: dict[str, list[str]] = {}
    for p in changed:
        by_line.setdefault(at.get(p) or "", []).append(p)
    inits, own = [], []
    for line in lines:
        paths = by_line.get(line, [])
        tails = {q.split("/", 1)[1] for other, qs in by_line.items() if other != line for q in qs if "/" in q}
        copies = bool(paths) and all(any(p.endswith("/" + t) for t in tails) for p in paths)
        (inits if copies or line.rsplit(":", 1)[0].endswith((".yaml", ".yml")) else own).append(line)
    return own, inits


def _line_key(line: str) -> tuple:
    file, _, n = line.rpartition(":")
    return (file, int(n) if n.isdigit() else 0, line)


def _labels(change: Change, before: Mapping, after: Mapping) -> set[str]:
    """The origin labels the snapshots record for what a change is about, on either side."""
    s = change.subject
    if not s:
        return set()
    if s[0] in ("input", "output"):
        out = {f"{s[0]} {s[1]}"}
        for side in (before, after):
            for leaf in side.get("inputs" if s[0] == "input" else "outputs") or []:
                if leaf.get("path") == s[1]:
                    out.update(leaf.get("origins") or ())
        return out
    if s[0] == "collective":
        out = set()
        for side in (before, after):
            for row in side.get("collectives") or []:
                if (row.get("kind"), row.get("axes"), row.get("network") or "") == tuple(s[1:4]):
                    out.update(row.get("causes") or ())
        return out
    return set()


def removed_change(name: str) -> Change:
    """The regression of a function that is in the baseline but was not staged now."""
    return Change(name, "function", "present", "—", "regression",
                  note="in the baseline, no longer staged; --update accepts the removal")


def environment_notices(before: Mapping, after: Mapping) -> list[str]:
    """Sentences naming jax/jaxlib versions, platforms, device kinds or configuration (``config``:
    ``jax_threefry_partitionable``, matmul precision, ``XLA_FLAGS`` ...) that differ (empty if none).

    A ``config`` option present on one side only because a JAX release removed it
    (:data:`stagetool.core.compat.REMOVED_CONFIG`: 0.11 removed the two optimisation efforts) is
    no difference: it is named in the version sentence, not as a change of configuration."""
    from stagetool.core.compat import absent_by_version

    out = []
    cb, ca = before.get("config"), after.get("config")
    gone: list[str] = []  # options one side's JAX does not have
    config_out = []
    if isinstance(cb, Mapping) and isinstance(ca, Mapping):
        for key in sorted(set(cb) | set(ca)):
            if cb.get(key) != ca.get(key):
                why = absent_by_version(key, cb.get(key), ca.get(key))
                if why:
                    gone.append(f"{key} ({why})")
                    continue
                config_out.append(f"config {key} {cb.get(key, 'unset')} in the baseline, {ca.get(key, 'unset')} now "
                                  "(it changes the compiled program)")
    for key in ("jax_version", "jaxlib_version"):
        if before.get(key) != after.get(key):
            out.append(f"{key.replace('_version', '')} {before.get(key)} in the baseline, {after.get(key)} now")
    lb, la = before.get("libtpu_version"), after.get("libtpu_version")
    if lb and la and lb != la:  # XLA:TPU's own release: it moves the TPU compile's figures (absent: not recorded)
        out.append(f"libtpu {lb} in the baseline, {la} now")
    if gone and out:
        out[0] += f" (configuration only one of them has, not compared: {', '.join(gone)})"
    elif gone:
        out.append(f"configuration only one side has, not compared: {', '.join(gone)}")
    kinds = lambda d: sorted({(e.get("mesh") or {}).get("platform", "?") + ":" +
                              str((e.get("mesh") or {}).get("device_kind", "?"))
                              for e in (d.get("functions") or {}).values()})
    if kinds(before) != kinds(after):
        out.append(f"device {', '.join(kinds(before)) or '?'} in the baseline, {', '.join(kinds(after)) or '?'} now")
    return out + config_out


def version_change(before: Mapping, after: Mapping) -> str | None:
    """``"jax 0.10.2 → 0.12.0.1"`` (and/or jaxlib) when the two snapshots come from different JAX
    releases, else None."""
    parts = [f"{key.replace('_version', '')} {before.get(key)} → {after.get(key)}"
             for key in ("jax_version", "jaxlib_version") if before.get(key) != after.get(key)]
    if len(parts) == 2 and before.get("jax_version") == before.get("jaxlib_version") \
            and after.get("jax_version") == after.get("jaxlib_version"):
        parts = [f"jax/jaxlib {before.get('jax_version')} → {after.get('jax_version')}"]
    return ", ".join(parts) or None


def from_the_compiler(change: Change) -> bool:
    """Whether a change is of a figure the compiler decides (memory, cost, collectives, a sharding
    the compiler chose), which a new JAX release can move by itself; leaves, shapes, the mesh,
    declared shardings and functions come from the spec and the code, never from the release."""
    return (change.what.startswith(("memory.", "cost.", "collective "))
            or change.what.endswith("(the compiler's choice)"))


def _mark_version(change: Change, upgrade: str) -> Change:
    mark = f"may come from {upgrade}"
    return dataclasses.replace(change, note=f"{change.note}; {mark}" if change.note else mark)


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
    upgrade = version_change(before, after)
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
            if upgrade:
                changes = [_mark_version(c, upgrade) if from_the_compiler(c) else c for c in changes]
            notices += more
            status = "regression" if any(c.status == "regression" for c in changes) else "ok"
            # XLA:CPU's, a changed chip profile's and lower bounds: apart from any edit
            own = [c for c in changes if c.status != "backend" and c.apart is None]
            causes, unexplained = find_causes(name, fb[name], fa[name], own, env) if own else ([], [])
            results.append(FunctionResult(name, status, tuple(changes), causes=tuple(causes),
                                          unexplained=tuple(unexplained),
                                          backend=tuple(c for c in changes if c.status == "backend"),
                                          apart=tuple(c for c in changes if c.apart is not None)))
    wanted = set(fb) if only is None else set(only)
    for name in fb:
        if name not in fa and name not in failed and name in wanted:
            results.append(FunctionResult(name, "removed", (removed_change(name),)))
    changed = [c for r in results for c in r.changes]
    if upgrade and changed:
        moved = sum(1 for c in changed if from_the_compiler(c))
        notices.append(f"{upgrade}: {moved} of the {len(changed)} differences are figures the compiler decides "
                       "(memory, cost, collectives, shardings it chose) and may come from the version change "
                       "(marked so); the others come from the spec or the code. After an upgrade, review them "
                       "and re-baseline: stagetool check --update (docs/jax-versions.md)")
    return Comparison(title, before_label, after_label, tuple(results), tuple(notices))
