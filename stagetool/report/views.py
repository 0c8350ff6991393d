"""Presentation-neutral rows of the report sections, shared by the text and Markdown renderers.

Each function turns a section record into header + rows of already formatted strings, so that both
renderers show the same facts with the same formatting.
"""

from __future__ import annotations

from collections.abc import Sequence

from stagetool.analysis.against import AgainstSection
from stagetool.analysis.figures import COST_FIELDS, CostFigures, Figures, MemoryFigures
from stagetool.hlo.collectives import NEAREST_HOPS, Collective
from stagetool.analysis.sections import CollectivesSection, CostSection, MemorySection
from stagetool.analysis.shardings import LeafReport
from stagetool.core.sharding import Sharding
from stagetool.core.compat import MEMORY_FIELDS_SINCE_0_11
from typing import TYPE_CHECKING
from stagetool.core.units import (
    dims_str,
    format_bytes,
    format_count,
    format_percent,
    format_seconds,
    short_path,
)

_COST_ROWS = (
    ("FLOPs", "flops", lambda v: format_count(v, "FLOP")),
    ("transcendentals", "transcendentals", format_count),
    ("bytes accessed", "bytes_accessed", format_bytes),
    ("bytes written (outputs)", "output_bytes_accessed", format_bytes),
    ("arithmetic intensity", "arithmetic_intensity_flops_per_byte",
     lambda v: "n/a" if v is None else f"{v:.2f} FLOP/B"),
)

_MEMORY_ROWS = (
    ("arguments", "argument_bytes"), ("outputs", "output_bytes"), ("aliased (donated)", "alias_bytes"),
    ("temporaries", "temp_bytes"), ("generated code", "generated_code_bytes"),
)
_HOST_ROWS = (
    ("host arguments", "host_argument_bytes"), ("host outputs", "host_output_bytes"),
    ("host aliased", "host_alias_bytes"), ("host temporaries", "host_temp_bytes"),
    ("host generated code", "host_generated_code_bytes"),
)
#: ``memory_analysis()`` figures only jax/jaxlib 0.11+ report, shown by XLA's names and not gated.
_XLA_ONLY_ROWS = MEMORY_FIELDS_SINCE_0_11


def _extra_value(metric: ExtraMetric | None) -> str:
    if metric is None:
        return "n/a"
    if metric.unit == "seconds":
        return format_seconds(metric.value) if metric.value >= 0 else f"{metric.value:g} s"
    if metric.unit == "bytes":
        return format_bytes(metric.value)
    return f"{metric.value:g}" + (f" {metric.unit}" if metric.unit not in ("count", "unknown") else "")


def cost_rows(c: CostSection, fig: Figures) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: each figure per device and for the whole program; ``n/a`` where not reported.
    XLA's per-device FLOPs, transcendentals and bytes accessed are the function's ``fig.cost`` (what
    the snapshot stores and the gate compares)."""
    figures = fig.cost or CostFigures()  # Figures.of sets it wherever there is a cost section
    rows = [[label, fmt(getattr(figures if attr in COST_FIELDS else c.per_device, attr)),
             fmt(getattr(c.whole_program, attr))] for label, attr, fmt in _COST_ROWS]
    if c.flops_lower_bound:  # XLA left work out: its FLOPs are a floor, said on the row itself
        n = sum(1 for u in c.uncounted if not u.counted)
        rows[0][0] = f"FLOPs (lower bound: {n} instruction{'s' if n != 1 else ''} not counted by XLA)"
    a, b = c.per_device.extra_by_key(), c.whole_program.extra_by_key()
    for key in sorted(set(a) | set(b)):
        if key.startswith("utilization"):
            continue  # per-operand use counts: in the JSON, too noisy for a table
        rows.append([key, _extra_value(a.get(key)), _extra_value(b.get(key))])
    la = c.loop_aware
    if la is not None and la.loops:  # beside XLA's figures, never instead of them
        rows += [["FLOPs, loop-aware (estimate)", format_count(la.flops, "FLOP"), "—"],
                 ["transcendentals, loop-aware (estimate)", format_count(la.transcendentals), "—"],
                 ["bytes accessed, loop-aware (estimate)", format_bytes(la.bytes_accessed), "—"]]
    return ["", "per device", "whole program"], rows


def config_line(config: Sequence[tuple[str, str]]) -> str:
    """The configuration that changes the compiled program, on one line (report header)."""
    return "config: " + " · ".join(f"{name}={value}" for name, value in config)


def compiler_options_line(options: Sequence[tuple[str, str]]) -> str:
    """The target's own jit's ``compiler_options`` on one line (report header)."""
    return "compiler_options (the target's jit): " + " · ".join(f"{name}={value}" for name, value in options)


def cost_caption(c: CostSection) -> str:
    per_device = ("derived from one device's compiled module with XLA's HloCostAnalysis rules (the backend "
                  "reports none)" if c.per_device.source.startswith("derived")
                  else "Compiled.cost_analysis() of one device's partitioned module")
    return (f"per device: {per_device}; whole program: "
            f"Lowered.cost_analysis() before partitioning ({c.device_count} devices); "
            "bytes written (outputs): XLA's 'bytes accessedout{}'")


def cost_notes(c: CostSection, fig: Figures) -> list[tuple[str, str]]:
    """``(severity, text)`` notes: ``warn`` for missing or suspect figures, ``info`` otherwise. XLA's
    negative "unknown" seconds (CPU's ``optimal_seconds``) are not data and get no note. The
    roofline's chip, step and bound are the function's ``fig`` (a sweep row's)."""
    from stagetool.analysis.cost import UNKNOWN_SECONDS_REASON

    out = []
    for rec in (c.per_device, c.whole_program):
        scope = rec.scope.replace("_", " ")
        if rec.reason:
            out.append(("warn", f"{scope}: not reported: {rec.reason}"))
        for field, why in rec.absent_reasons:
            if why == UNKNOWN_SECONDS_REASON:  # XLA's -1 'unknown' of a key nobody asked for: not data, no note
                continue
            out.append(("info", f"{scope}: {field} n/a: {why}"))
        for s in rec.suspects:
            out.append(("warn", f"{scope}: suspect {s.field}: {s.reason}"))
    for note in c.scope_notes:
        out.append(("warn", note))
    out += uncounted_notes(c)
    out += replicated_notes(c)
    counts = list(c.loop_trip_counts)
    for _, trip, _ in (c.loop_aware.apart if c.loop_aware else ()):  # XLA:CPU's rng loops: a note of their own
        if trip in counts:
            counts.remove(trip)
    if counts:
        trips = ", ".join("?" if n is None else str(n) for n in counts)
        n = len(counts)
        out.append(("warn", f"{n} while loop{'s' if n != 1 else ''} (trip count{'s' if n != 1 else ''} {trips}): "
                            "XLA's cost analysis counts a loop body once, so its FLOPs and bytes are a lower bound; "
                            "the loop-aware rows are a derived estimate (XLA's figure + (trip count − 1) × each "
                            "body's cost counted from the compiled module), and the roofline uses them"))
        la = c.loop_aware
        if la is not None and la.reason:
            out.append(("info", f"loop-aware estimate: {la.reason}"))
    r = c.roofline
    if r is not None:
        if fig.roofline_step_seconds is None:
            out.append(("warn", f"roofline ({fig.chip}{chip_from(c)}): n/a: {r.reason}"))
        else:
            out.append(("info", f"roofline estimate on {fig.chip} ({r.dtype}{chip_from(c)}): step ≥ "
                                f"{format_seconds(fig.roofline_step_seconds)}, {fig.roofline_bound}-bound (compute {format_seconds(r.compute_seconds)}, memory "
                                f"{format_seconds(r.memory_seconds)}); a lower bound from peak FLOP/s and HBM "
                                "bandwidth, not a prediction"
                                + (f"; its bytes are those through HBM ({format_bytes(r.bytes_accessed_per_device)}): "
                                   f"XLA's bytes accessed less {format_bytes(r.on_chip_bytes)} it counts for arrays "
                                   "in on-chip VMEM (a prefetch's copy there, the reads of the prefetched array)"
                                   if r.on_chip_bytes and r.bytes_accessed_per_device is not None else "")))
    return out


def replicated_notes(c: CostSection) -> list[tuple[str, str]]:
    """One ``warn`` per instruction computed whole on every device of some mesh axes, with its line,
    its FLOPs per device per step (a loop body's: runs × one run's) and what made its input whole."""
    out = []
    for r in c.replicated:
        where = f" at {short_path(r.source)}" if r.source else ""
        made = (f"; its input was made whole by {r.made_whole_by}"
                + (f" at {short_path(r.made_whole_source)}" if r.made_whole_source else "")) if r.made_whole_by else ""
        out.append(("warn", f"computed whole on each of {r.devices} devices (mesh axis{'es' if len(r.axes) != 1 else ''} "
                            f"{', '.join(r.axes)}): {r.opcode} {r.instruction}{where}, {format_count(r.flops, 'FLOP')} "
                            f"per device per step"
                            + (f" ({r.executions} runs × {format_count(r.flops_per_execution, 'FLOP')})"
                               if r.executions > 1 and r.flops_per_execution is not None else "")
                            + f" ({format_percent(r.share)} of the device's), the same on every device although "
                            f"its data was split over {', '.join(r.axes)}{made}"))
    return out


def uncounted_notes(c: CostSection) -> list[tuple[str, str]]:
    """``(severity, text)`` per instruction whose work XLA does not count (``warn``) or counts from an
    estimate (``info``: a Pallas kernel's ``cost_estimate``, the sort rule), with its source line, and
    one ``warn`` that the FLOP total is a lower bound and the roofline leaves that work out."""
    from stagetool.analysis.uncounted import KERNEL_ESTIMATE, LIBRARY_DERIVED, NOT_COUNTED

    out = []
    for u in c.uncounted:
        where = f" at {short_path(u.source)}" if u.source else ""
        if u.status == LIBRARY_DERIVED:
            out.append(("info", f"{u.kind} {u.instruction}{where}: {format_count(u.flops, 'FLOP')} per execution, "
                                "derived from the call's shapes" + (", window and feature groups" if "conv" in u.target
                                                                    else " and contracting dimensions")
                                + " (XLA's dot/convolution rule; the backend reported no cost analysis)"))
        elif u.status == NOT_COUNTED:
            out.append(("warn", f"not counted by XLA: {u.kind} {u.instruction}{where} (result "
                                f"{format_bytes(u.output_bytes)} per execution): its FLOPs and bytes are in no total"))
        elif u.status == KERNEL_ESTIMATE:
            out.append(("info", f"{u.kind} {u.instruction}{where}: {KERNEL_ESTIMATE}: "
                                f"{format_count(u.flops, 'FLOP')}, {format_bytes(u.bytes_accessed)} per execution "
                                "(the kernel author's estimate, not XLA's count)"))
        else:
            out.append(("info", f"sort {u.instruction}{where}: {u.status}: {format_count(u.flops, 'FLOP')} per "
                                "execution (an estimate; the comparator's own work is not counted)"))
    n = sum(1 for u in c.uncounted if not u.counted)
    if n:
        roof = "; the roofline leaves their work out" if c.roofline is not None else ""
        kinds = ", ".join(sorted({u.kind for u in c.uncounted if not u.counted}))
        out.append(("warn", f"per device: FLOPs and bytes accessed are a lower bound: XLA's cost analysis does not "
                            f"count {n} instruction{'s' if n != 1 else ''} ({kinds}){roof}"))
    return out


def chip_named(name: str | None, c: CostSection) -> str:
    """The run's chip as a report names it, with where it comes from: ``tpu-v5e (from topology
    v5e:2x4)``; the name alone where the section does not say (a report written before it did)."""
    return f"{name} ({c.chip_source})" if c.chip_source else str(name)


def chip_from(c: CostSection) -> str:
    """``", from topology v5e:2x4"``: where the run's chip comes from, to end a parenthesis that
    names the chip; "" where the section does not say."""
    return f", {c.chip_source}" if c.chip_source else ""


def not_counted_text(c: CostSection) -> str:
    """``2 instructions not counted: Pallas kernel (Mosaic TPU) mixed.1 at k.py:14, top-k ...``: the
    work a FLOP figure (its MFU, its roofline) leaves out, named with its user lines."""
    rows = [u for u in c.uncounted if not u.counted]
    names = ", ".join(f"{u.kind} {u.instruction}" + (f" at {short_path(u.source)}" if u.source else "")
                      for u in rows[:4]) + (f" and {len(rows) - 4} more" if len(rows) > 4 else "")
    return f"{len(rows)} instruction{'s' if len(rows) != 1 else ''} not counted: {names}"


def step_time_notes(c: CostSection) -> list[tuple[str, str]]:
    """``(severity, text)`` lines of the step-time estimate (:mod:`stagetool.analysis.step_time`):
    the range and the schedule's figure, what bounds it and its parts, MFU, XLA's own figure beside,
    what it assumes; or why there is none."""
    e = c.step_time
    if e is None:
        return [("info", f"step time: n/a: {c.step_time_reason}")] if c.step_time_reason else []
    of = f" of {e.mfu_peak}" if getattr(e, "mfu_peak", "") else ""
    mfu = f", MFU {format_percent(e.mfu)}{of}" if e.mfu is not None else ""
    if e.mfu is not None and c.flops_lower_bound:  # FLOPs left out: the MFU is a floor, never a figure alone
        mfu = f", MFU ≥ {format_percent(e.mfu)}{of} (lower bound: {not_counted_text(c)})"
    elif e.mfu is not None and e.lower_bound:  # FLOPs complete, the step at least its figure: the MFU at most this
        mfu = f", MFU ≤ {format_percent(e.mfu)}{of} (the step time is a lower bound)"
    if e.tokens_per_second_per_chip is not None:
        at_most = "≤ " if e.lower_bound else ""
        mfu += (f", {at_most}{format_count(e.tokens_per_second_per_chip)} tokens/s per chip ({e.tokens_per_step} "
                "tokens per step)")
    least = "at least " if e.lower_bound else ""
    out = [("warn" if e.lower_bound else "info",
            f"step time on {e.chip} (estimate{', a lower bound' if e.lower_bound else ''}{chip_from(c)}): {least}"
            f"{format_seconds(e.schedule_seconds)} as scheduled, range {least}"
            f"{format_seconds(e.overlapped_seconds)} (collectives overlapped) – "
            f"{format_seconds(e.serial_seconds)} (serial); bound: {e.bound}{mfu}")]
    likely = getattr(e, "likely_seconds", None)
    if likely is not None:
        lo, hi = likely
        why = (f"; not validated on a chip, so widened × 0.5 – × 2: {', '.join(e.not_validated)}"
               if e.not_validated else "")
        more = " (at least: floors below)" if e.lower_bound else ""
        out.append(("info", f"step time likely {format_seconds(e.schedule_seconds)} ({format_seconds(lo)} – "
                            f"{format_seconds(hi)}){more}: each kernel × the spread its class showed against "
                            f"the lent {e.chip} (estimate){why}"))
    for u in e.uncounted:
        where = f" ({u.source})" if u.source else ""
        out.append(("warn", f"step time counts only a floor for {u.kind} {u.name}{where}: {u.why}: at least "
                            f"{format_seconds(u.floor_seconds)} per step"))
    if e.parts:
        out.append(("info", "step time by part (exposed): " + " · ".join(
            f"{name} {format_seconds(v)}" for name, v in e.parts)))
    if e.sources:
        out.append(("info", "step time by source of the figure: " + _sources_line(e)))
    if e.xla_optimal_seconds is not None:
        out.append(("info", f"XLA's own figure (optimal_seconds, Compiled.cost_analysis()): "
                            f"{format_seconds(e.xla_optimal_seconds)}"))
    elif e.xla_optimal_note:
        out.append(("info", e.xla_optimal_note))
    if e.reason:
        out.append(("warn", f"step time: {e.reason}"))
    out.append(("info", "step time assumes: " + "; ".join(e.assumptions)))
    return out


def step_time_rows(c: CostSection, top: int = 8) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the instructions that take longest over the step (an estimate)."""
    e = c.step_time
    rows = [[i.name, i.kind or i.opcode, format_seconds(i.total_seconds), str(i.executions), i.bound, i.figure,
             _chain(i.source, i.via), _op(i.op_name)] for i in (e.top[:top] if e is not None else ())]
    return ["instruction", "kind", "time / step", "runs", "bound", "figure", "source", "op"], rows


if TYPE_CHECKING:  # annotations only: a view imports the rooms its report does not hold only when drawn
    from stagetool.analysis.cost import ExtraMetric
    from stagetool.analysis.memory import MemoryRecord
    from stagetool.analysis.peak import PeakReport
    from stagetool.analysis.timeline import TimelinePeak
    from stagetool.analysis.why import WhyAnswer
    from stagetool.report.model import MeasuredSection


def against_title(a: AgainstSection) -> str:
    """``--against``'s heading: ``against v5e:2x4 (XLA:TPU, compile-only): 4 differences from XLA:CPU``."""
    n = len(a.differences)
    return (f"against {a.target} ({a.compiler}, compile-only, one more compile): "
            + ("staging failed" if a.error else f"{n} difference{'s' if n != 1 else ''} from {a.here}"))


def against_rows(a: AgainstSection) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: each row on one side only or differing between this compile and the target's."""
    return (["what", "which", a.here, a.target, ""],
            [[d.what, d.key, d.here or "—", d.there or "—",
              {"only here": f"only on {a.here}", "only there": f"only on {a.target}"}.get(d.status, d.status)]
             for d in a.differences])


def against_notes(a: AgainstSection) -> list[str]:
    """``--against``'s lines under its table: the failure, each CPU rule checked, what was compared."""
    out = [f"{a.target} could not be staged: {a.error}"] if a.error else []
    for r in a.rules:
        out.append(f"rule '{r.rule}' on {r.key}: " + (f"{a.target} agrees ({r.shows})" if r.agrees else
                   f"{a.target} shows {r.shows} instead; the compile wins and the row's mark is dropped"))
    if a.compared:
        out.append("compared: " + "; ".join(a.compared) + f" (from the {a.target} compile, not from rules)")
    return out


def measured_rows(m: MeasuredSection) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of ``--measure``: the step, then the top instructions, measured vs estimated. An
    estimate that is a lower bound reads ``at least 22.1 µs``, and its error ``≥ -99%``: a floor against a
    measurement says how far below it is at most, not the model's error."""
    def err(e: float | None, floor: bool = False) -> str:
        return "n/a" if e is None else ("≥ " if floor else "") + f"{e * 100:+.0f}%"

    def est(s: float | None, floor: bool = False) -> str:
        return ("at least " if floor and s is not None else "") + format_seconds(s)

    lb = m.estimate_lower_bound
    wall_err = None if m.estimated_seconds is None or m.median_seconds <= 0 else \
        (m.estimated_seconds - m.median_seconds) / m.median_seconds
    rows = [["step (wall clock)", format_seconds(m.median_seconds), est(m.estimated_seconds, lb),
             err(m.error if m.device_seconds is None else wall_err, lb), f"{m.steps} steps, spread {m.spread * 100:.1f}%"]]
    if m.device_seconds is not None:
        rows.append(["step (device, profiler)", format_seconds(m.device_seconds), est(m.estimated_seconds, lb),
                     err(m.error, lb), "XLA Modules events"])
    for i in m.instructions:
        e = None if i.estimated_seconds is None or i.measured_seconds <= 0 else \
            (i.estimated_seconds - i.measured_seconds) / i.measured_seconds
        rows.append([i.name, format_seconds(i.measured_seconds), est(i.estimated_seconds, i.estimate_lower_bound),
                     err(e, i.estimate_lower_bound), f"{i.executions} run{'s' if i.executions != 1 else ''}"])
    return ["", "measured", "estimated", "error", ""], rows


def measured_caption(m: MeasuredSection) -> str:
    """The line under ``--measure``'s table: what was measured, on what, against which estimate."""
    est = f"stagetool's estimate for {m.estimate_chip}" if m.estimate_chip else "no estimate (no chip for this device)"
    return (f"measured on {m.device}: median of {m.steps} steps after {m.warmup} warm-up "
            f"(wall clock, {format_seconds(m.min_seconds)}–{format_seconds(m.max_seconds)}); "
            f"instructions: device time per step from JAX's profiler; estimated: {est}")


def measured_notes(m: MeasuredSection) -> list[str]:
    """``--measure``'s notes, and why instructions are missing."""
    floor = (["the estimate is a lower bound (work no model covers, timed at a floor): the step takes at least it, "
              "so its error is at least the one shown (≥), not the model's error"] if m.estimate_lower_bound else [])
    return list(m.notes) + floor + ([f"no per-instruction times: {m.instructions_reason}"]
                                    if m.instructions_reason else [])


def aliased_label(m: MemorySection) -> str:
    """What the aliased bytes are: ``aliased (donated)``, ``aliased (Ref write-backs)`` for a step
    whose jax.Ref arguments are written in place, or both."""
    kinds = []
    donation = m.donation or ()
    if any(d.status != "Ref write-back" for d in donation) or not donation:
        kinds.append("donated")
    if any(d.status == "Ref write-back" for d in donation):
        kinds.append("Ref write-backs")
    return f"aliased ({', '.join(kinds)})"


def memory_rows(m: MemorySection, fig: Figures) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of per-device memory in bytes and human units; host rows only where non-zero.
    The figures the snapshot stores (arguments, outputs, aliased, temporaries, the gated peak, the
    host peak, jax 0.11+'s three) are the function's ``fig.memory``; the rest are the record's."""
    rec, mem = m.record, fig.memory or MemoryFigures()  # Figures.of sets it wherever there is a memory section
    oom = m.out_of_memory
    if oom is not None:  # no compiled program: XLA's figures from its error, and what the inputs say
        rows = [[f"needed (XLA: {oom.what or 'the program'})", _int_text(oom.needed_bytes), format_bytes(oom.needed_bytes)],
                [f"available (XLA: {oom.memory_space or 'device memory'})", _int_text(oom.available_bytes),
                 format_bytes(oom.available_bytes)],
                ["arguments (from the inputs' shardings)", _int_text(oom.argument_bytes), format_bytes(oom.argument_bytes)]]
        return ["", "bytes", ""], rows
    rows = []
    for label, attr in _MEMORY_ROWS:
        v = rec.generated_code_bytes if attr == "generated_code_bytes" else getattr(mem, attr)
        rows.append([aliased_label(m) if attr == "alias_bytes" else label, "n/a" if v is None else str(v),
                     format_bytes(v)])
    for label, attr in _HOST_ROWS:
        v = getattr(rec, attr)
        if v:
            rows.append([label, str(v), format_bytes(v)])
    from stagetool.analysis.memory import XLA_PEAK_SOURCE

    by_xla = rec.peak_source == XLA_PEAK_SOURCE
    if by_xla and rec.peak_bytes_estimate is not None:
        rows.append(["args + outputs − aliased + temps", str(rec.peak_bytes_estimate),
                     format_bytes(rec.peak_bytes_estimate)])
    peak_label = "peak (gated: " + ("XLA peak_memory_in_bytes" if by_xla else "args + outputs − aliased + temps") + ")"
    rows.append([peak_label, "n/a" if mem.peak_bytes is None else str(mem.peak_bytes), format_bytes(mem.peak_bytes)])
    if not by_xla and rec.peak_bytes_reported is not None and rec.peak_bytes_reported != mem.peak_bytes:
        rows.append(["XLA peak_memory_in_bytes", str(rec.peak_bytes_reported), format_bytes(rec.peak_bytes_reported)])
    host = mem.host_peak_bytes
    if host:
        rows.append(["host peak (pinned_host; gated apart)", str(host), format_bytes(host)])
    for attr in _XLA_ONLY_ROWS:  # jax/jaxlib >= 0.11 only: shown where the release reports them
        v = getattr(mem, attr)
        if v is not None:
            rows.append([f"XLA {attr}", str(v), format_bytes(v)])
    return ["", "bytes", ""], rows


def peak_note(rec: MemoryRecord, platform: str | None = None) -> str | None:
    """One sentence on what the gated peak is made of, when XLA's two figures differ (None when they
    agree or one is missing), in the terms of the backend that compiled it (``platform``: ``cpu``,
    ``gpu``, ``tpu``; None says it without naming one)."""
    from stagetool.analysis.memory import XLA_PEAK_SOURCE

    est, rep = rec.peak_bytes_estimate, rec.peak_bytes_reported
    if est is None or rep is None or rec.peak_bytes is None or est == rep:
        return None
    if rec.peak_source == XLA_PEAK_SOURCE:
        if platform in ("tpu", None):
            below = (f"because the backend's temp_size_in_bytes ({format_bytes(rec.temp_bytes)}) leaves temporaries "
                     "out (XLA:TPU reports 0 for most programs)")
        else:
            below = f"(temporaries {format_bytes(rec.temp_bytes)}, as XLA:{platform.upper()} reports them)"
        return ("peak: the gate and the capacity verdict use XLA's peak_memory_in_bytes (the high-water mark of "
                "XLA's schedule), the larger: arguments + outputs − aliased + temporaries is below it "
                f"{below}; every command gates the same figure")
    why = {
        "cpu": "XLA's peak_memory_in_bytes leaves out temporaries on CPU",
        "gpu": (f"XLA:GPU's peak_memory_in_bytes ({format_bytes(rep)}) is below what its buffer assignment "
                f"allocates for one execution (temporaries {format_bytes(rec.temp_bytes)})"),
        "tpu": (f"XLA:TPU's peak_memory_in_bytes ({format_bytes(rep)}) is below what its buffer assignment "
                f"allocates for one execution (temporaries {format_bytes(rec.temp_bytes)})"),
    }.get(platform or "", f"XLA's peak_memory_in_bytes ({format_bytes(rep)}) is below what its buffer assignment "
                          "allocates")
    return ("peak: the gate and the capacity verdict use arguments + outputs − aliased + temporaries (what XLA "
            f"allocates for one execution), the larger: {why}; every command gates the same figure")


def _int_text(v: int | None) -> str:
    return "n/a" if v is None else str(v)


def memory_notes(m: MemorySection, fig: Figures, platform: str | None = None) -> list[tuple[str, str]]:
    """``(severity, text)``: ``fits``/``over`` verdict, missing data, suspects; ``platform`` (the
    mesh's ``cpu``/``gpu``/``tpu``) words the note on what the peak is made of (:func:`peak_note`).
    The verdict, peak and capacity are the function's ``fig`` (what a sweep row holds)."""
    rec = m.record
    out = []
    if rec.reason:
        out.append(("warn", f"not reported: {rec.reason}"))
    for s in rec.suspects:
        out.append(("info", f"suspect {s.field}: {s.reason}"))
    note = peak_note(rec, platform)
    if note:
        out.append(("info", note))
    oom = m.out_of_memory
    if oom is not None:
        over = ""
        if oom.needed_bytes is not None and oom.available_bytes:
            excess = oom.needed_bytes - oom.available_bytes
            over = f", over by {format_bytes(excess)} ({format_percent(excess / oom.available_bytes)} of what it has)"
        out = [("over", f"DOES NOT FIT: the compile ran out of memory: XLA needs {format_bytes(oom.needed_bytes)} "
                        f"and has {format_bytes(oom.available_bytes)} per device{over} ({oom.xla_message})")]
        if oom.auto_leaves:
            out.append(("info", f"arguments count {len(oom.auto_leaves)} 'auto' leaves whole: "
                                + ", ".join(oom.auto_leaves[:5]) + (" ..." if len(oom.auto_leaves) > 5 else "")))
        if m.peak is None:
            out.append(("info", "the largest buffers of the refused program: 'stagetool memory' (or --peak) lists "
                                "them from the dump XLA writes before refusing"))
        out.append(("info", "what would fit: 'stagetool fit' (the largest batch per knob setting) and "
                            "'stagetool fit --what-if' on a spec whose batch is a ${batch} placeholder"))
        return out
    v, fits, peak = m.verdict, fig.fits, (fig.memory or MemoryFigures()).peak_bytes
    if fits is None and (rec.peak_suspects or (m.unknown_sharding is not None and fig.capacity_bytes is not None)):
        out.append(("warn", f"verdict unknown: {v.reason}"))
    elif fits is None:
        out.append(("info", "capacity: unknown (the device reports none; give --device-memory 16GiB or --chip NAME)"))
    else:
        out.append(("fits" if fits else "over",
                    f"{'fits' if fits else 'DOES NOT FIT'}: peak {format_bytes(peak)} is "
                    f"{format_percent(v.share_used)} of {format_bytes(fig.capacity_bytes)} per device "
                    f"({fig.capacity_source}); headroom {format_bytes(v.headroom_bytes)}"))
    return out


def largest_inputs_rows(m: MemorySection) -> tuple[list[str], list[list[str]]]:
    total = m.record.argument_bytes
    rows = [[x.path, x.shape, format_bytes(x.bytes_per_device),
             format_percent(x.bytes_per_device / total if total else None)] for x in m.largest_inputs]
    return ["leaf", "shape", "per device", "of arguments"], rows


def donation_summary(m: MemorySection) -> str | None:
    """One line on donation: how many donated leaves reuse their buffer for an output."""
    requested = [d for d in m.donation if d.requested]
    if not m.donation:
        return None
    refs = sum(1 for d in m.donation if d.status == "Ref write-back")
    ref_text = (f"Ref write-backs: {refs} jax.Ref argument{'s are' if refs != 1 else ' is'} written in place (the "
                "new value reuses the Ref's buffer; no donation involved)")
    if refs and not requested:
        others = len(m.donation) - refs
        return ref_text + ("; the other aliased leaves are listed below" if others else "")
    aliased = sum(1 for d in requested if d.status == "aliased")
    text = f"donation: {aliased} of {len(requested)} donated leaves reuse their buffer for an output"
    if len(requested) > aliased or len(m.donation) - refs > len(requested):
        text += "; the others are listed below"
    return text + (f"; {ref_text}" if refs else "")


def donation_rows(m: MemorySection) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the leaves whose donation did not simply work (not usable, unused,
    aliased without being asked); the aliased ones and the Ref write-backs are counted by
    :func:`donation_summary`."""
    rows = [[d.path, "yes" if d.requested else "no", d.status, ", ".join(d.aliased_to) or "—",
             d.reason or ""] for d in m.donation
            if not (d.requested and d.status == "aliased") and d.status != "Ref write-back"]
    return ["leaf", "requested", "status", "reused by", "why"], rows


def peak_title(p: PeakReport) -> str:
    """``live at the peak (step 7: 4.00 MiB device in 2 buffers[; host …][; vmem …]; largest 2)``: each
    buffer once, the device (memory space 0) figure first and the other memory spaces apart; the step
    is the memory timeline's peak (the same step and bytes as its ``peak … at step 7`` line)."""
    parts = [f"{format_bytes(p.peak_bytes)} device"]
    if p.host_bytes:
        parts.append(f"host {format_bytes(p.host_bytes)}")
    parts += [f"{space} {format_bytes(n)}" for space, n in p.other_bytes]
    at = f"step {p.step}: " if p.step is not None else ""  # the timeline's peak step
    return (f"live at the peak ({at}{'; '.join(parts)} in {p.buffer_count} buffer{'s' if p.buffer_count != 1 else ''}; "
            f"largest {len(p.buffers)})")


def peak_rows(p: PeakReport) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the largest buffers live at the peak; a last ``memory`` column when any is
    not in device memory; a buffer several values share is one row naming them all."""
    spaces = any(b.memory_space != "device" for b in p.buffers)
    rows = []
    for b in p.buffers:
        name = b.value_name + "".join(f" = {v}" for v in b.shared_with)
        row = [format_bytes(b.size_bytes), b.shape or "—", name, _op(b.op_name),
               f"{short_path(b.file)}:{b.line}" if b.file else "—"]
        if spaces:
            row.append(b.memory_space)
        rows.append(row)
    return ["size", "shape", "HLO value", "op", "source"] + (["memory"] if spaces else []), rows


def short_source(source_line: str | None) -> str:
    """A ``file:line`` with the file shortened as :func:`short_path` does; ``—`` for None."""
    if not source_line:
        return "—"
    file, _, line = source_line.rpartition(":")
    return f"{short_path(file)}:{line}" if file and line.isdigit() else source_line


def timeline_lines(m: MemorySection) -> list[str]:
    """The memory timeline in a few lines (text and Markdown): a sparkline with the peak's step, op
    and source, then what separates the timeline's peak from the gated peak; ``[]`` when the peak
    dump was not taken, one ``n/a`` line when it has no timeline."""
    tp = m.timeline_peak
    if tp is None:
        return []
    if tp.reason or not m.timeline:
        return [f"memory over time: n/a: {tp.reason or 'no timeline'}"]
    from stagetool.analysis.timeline import sparkline

    op = _op(tp.op) if tp.op else None
    op = op if op is None or len(op) <= 60 else op[:59] + "…"
    where = ", ".join(x for x in (op, short_source(tp.source_line) if tp.source_line else None) if x)
    hbm = ", HBM only" if tp.on_chip else ""
    lines = [f"memory over time ({tp.steps} steps, per device{hbm}): {sparkline(m.timeline)} "
             f"peak {format_bytes(tp.bytes)} at step {tp.position} ({tp.instruction}{', ' + where if where else ''})"]
    if tp.on_chip:
        lines.append(f"  {on_chip_text(tp)}")
    if tp.inside:
        inner = ", ".join(x for x in (_op(tp.inside_op) if tp.inside_op else None,
                                      short_source(tp.inside_source_line) if tp.inside_source_line else None) if x)
        lines.append(f"  inside it, the bytes peak at {tp.inside}{' (' + inner + ')' if inner else ''}")
    if tp.gated_peak_bytes is not None and not tp.differences:
        lines.append(f"  the timeline's peak is the gated peak ({tp.gated_peak_bytes:,} B)")
    elif tp.differences:
        lines.append(f"  the gated peak ({tp.gated_peak_bytes:,} B) is the timeline's peak ({tp.bytes:,} B) plus:")
        lines += [f"  {'+' if d.bytes >= 0 else '−'} {abs(d.bytes):,} B: {d.what}" for d in tp.differences]
    return lines


def on_chip_text(tp: TimelinePeak) -> str:
    """``on-chip memory, apart from these bytes: VMEM 33.2 MiB live at the peak (33.9 MiB at most), …``:
    each on-chip space (TPU) of the timeline's peak, never added to its device-memory (HBM) bytes."""
    spaces = ", ".join(f"{s.space} {format_bytes(s.at_peak_bytes)} live at the peak "
                       f"({format_bytes(s.max_bytes)} at most)" for s in tp.on_chip)
    return f"on-chip memory, apart from these HBM bytes: {spaces}"


def timeline_buffer_rows(tp: TimelinePeak) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the buffers live at the timeline's peak, largest first."""
    rows = [[format_bytes(b.bytes), b.kind, b.leaf or b.value, b.shape or "—", b.op or "—",
             short_source(b.source_line)] for b in tp.buffers]
    return ["size", "kind", "leaf or HLO value", "shape", "op", "source"], rows


def leaf_notes(leaf: LeafReport) -> list[str]:
    """Short notes on a shardings-table row: where an input's sharding comes from (``rule``:
    an init's rules, ``init``: what the init gives it when run, ``model``: the model's own
    annotations, ``object``: a ``{ref:}``'s array carries it, ``unknown``: nothing says, staged
    replicated), unused, chosen by the partitioner,
    donated, local shape; an output that is a ``jax.Ref``'s new value says ``Ref write-back``."""
    if leaf.ref_write_back:
        return ["Ref write-back (in place)"]
    notes = []
    source = leaf.sharding_source
    if source in ("rule", "model", "init", "target"):
        notes.append(f"from {source}")
    elif source == "object":
        notes.append("from the object")
    elif source == "unknown":
        notes.append("sharding unknown: the init or object gives none, replicated assumed")
    if leaf.unused:
        notes.append("unused (pruned)")
    elif leaf.declared.kind == "auto":
        notes.append("chosen" if leaf.chosen_by != "JAX's sharding types" else "typed")
    if leaf.donated:
        notes.append("donated")
    if leaf.local_shape is not None:
        notes.append(f"local {dims_str(leaf.local_shape)}")
    return notes


def _axes(axes: tuple[str, ...] | None) -> str:
    if axes is None:
        return "(no mesh axes match)"
    return " × ".join(axes) if axes else "(within a device)"


def collectives_rows(c: CollectivesSection) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: one row per collective, in module order."""
    rows = []
    network = any(item.collective.network for item in c.items)  # a multi-slice job
    for item in c.items:
        x = item.collective
        runs = "?" if x.executions is None else str(x.executions)
        if x.in_loop:
            runs += " (loop)"
        types = x.result_types
        result = ", ".join(types) if len(types) <= 2 else f"{types[0]} +{len(types) - 1} more"
        if item.widened_from:  # XLA:CPU's 16-bit dot upcast, said on the row
            part = item.widened_bytes
            if len(types) > 1 and part is not None and x.bytes_per_device is not None and part < x.bytes_per_device:
                result += f" (f32 on CPU: {format_bytes(part)} of it {item.widened_from} in the program)"
            else:
                result += f" (f32 on CPU: {item.widened_from} in the program)"
        if item.cpu_only:  # XLA:CPU's own placement of it, said on the row
            runs += f" ({item.cpu_only})"
        if item.against:  # --against: what the target's compile shows for it instead
            runs += f" ({item.against})"
        rows.append([x.kind + (" (async)" if x.is_async else ""), _axes(x.mesh_axes)]
                    + ([x.network or "—"] if network else [])
                    + [result, format_bytes(x.bytes_per_device), runs,
                       _chain(item.source, item.via),
                       ("nearest: " if x.nearest else "") + _op(x.op_name)])
    return (["kind", "mesh axes"] + (["network"] if network else [])
            + ["result per device", "bytes", "runs", "source", "op"]), rows


def _chain(source: str | None, via: Sequence[str]) -> str:
    """A row's source line, and where it is a thin helper the lines it was called from:
    ``layers.py:12 ← model.py:88`` (the collectives table and the longest instructions alike)."""
    return " ← ".join([_source(source), *(_source(v) for v in via)])


def _source(source: str | None) -> str:
    if not source:
        return "—"
    file, _, line = source.rpartition(":")
    return f"{short_path(file)}:{line}"


def _op(op_name: str | None) -> str:
    """The op name without the leading ``jit(fn)/`` that every op of the function shares; a combined
    op's name (:func:`combined_op_name`) as its first op and how many more."""
    if not op_name:
        return "—"
    head, sep, rest = op_name.partition("/")
    return combined_op_name(rest if sep and head.startswith("jit(") and rest else op_name)


def combined_op_name(name: str) -> str:
    """``prefix/first +N more`` for the name XLA gives an op it made of several (a combined
    all-reduce or all-gather: ``prefix/(op1:op2:…)``, every merged op's name after their shared
    prefix, joined by ``:``; 600 characters for the training cookbook's gradient all-reduce), else
    ``name`` unchanged. Text, Markdown and HTML show this; JSON keeps XLA's full name."""
    depth, colons, opens = 0, [], []
    for i, ch in enumerate(name):
        if ch == "(":
            opens.append(i)
            depth += 1
        elif ch == ")":
            depth -= 1
            if opens:
                opens.pop()
        elif ch == ":":
            colons.append((depth, i, opens[-1] if opens else -1))
    if not colons:
        return name
    level = min(d for d, _, _ in colons)
    cuts = [(i, o) for d, i, o in colons if d == level]
    start = cuts[0][1]
    if any(o != start for _, o in cuts):  # colons in different groups: not one combined name
        return name
    if start < 0:
        prefix, body, suffix = "", name, ""
    else:
        close = _closing(name, start)
        if close is None:
            return name
        prefix, body, suffix = name[:start], name[start + 1:close], name[close + 1:]
    offset = start + 1
    first = body[:cuts[0][0] - offset]
    return f"{prefix}{first}{suffix} +{len(cuts)} more"


def _closing(text: str, start: int) -> int | None:
    """Index of the ``)`` that closes the ``(`` at ``start``, or None."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return None


def collectives_summary_rows(c: CollectivesSection, fig: Figures) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: count and bytes per device by kind × mesh axes, then the total; the total's
    bytes per step, its runs unknown and the bytes over DCN are the function's ``fig`` (a sweep row's)."""
    def per_step(count: int, executed: int | None, unknown: int | None) -> str:
        if unknown == count:
            return "? (runs unknown)"
        return format_bytes(executed) + (" + ?" if unknown else "")

    rows = []
    dcn = fig.dcn_bytes_per_step
    network = dcn is not None  # a multi-slice job: a network column, and the bytes over DCN apart
    for t in c.summary.by_kind_and_mesh_axes:
        rows.append([t.kind, _axes(t.mesh_axes)] + ([t.network or "—"] if network else [])
                    + [str(t.count), format_bytes(t.bytes_per_device),
                       per_step(t.count, t.executed_bytes_per_device, t.unknown_executions_count)])
    t = c.summary.total
    rows.append(["total", ""] + ([""] if network else []) + [str(t.count), format_bytes(t.bytes_per_device),
                                                             per_step(t.count, fig.collective_bytes_per_step,
                                                                      fig.collectives_unknown_runs)])
    if network:
        rows.append(["over DCN", "", "dcn", str(sum(x.count for x in c.summary.by_kind_and_mesh_axes
                                                    if x.network == "dcn")), "", format_bytes(dcn)])
    return (["kind", "mesh axes"] + (["network"] if network else [])
            + ["count", "bytes per device (each once)", "bytes per device per step"]), rows


def cause_lines(c: CollectivesSection) -> list[tuple[str, str, list[str]]]:
    """Why each collective is there (issue 22): ``(head, reason, origins)`` per collective (one without a
    cause says why there is none: :func:`no_cause_reason`),
    in module order — ``("1 all-reduce over model at model.py:9 (dot_general)", "contraction over ...",
    ["w2 (spec at f.stagetool.yaml:10:9)"])``; one ``("why", <the reason there are none>, [])`` when the
    explanation is unavailable."""
    if c.causes_unavailable and c.items:
        return [("why", c.causes_unavailable, [])]
    out = []
    for i, item in enumerate(c.items, start=1):
        cause = item.cause
        x = item.collective
        at = f" at {_source(item.source)}" if item.source else ""
        if cause is None:  # the reason there is none
            out.append((f"{i} {x.kind} over {_axes(x.mesh_axes)}{at}", no_cause_reason(x), []))
            continue
        head = f"{i} {x.kind} over {_axes(x.mesh_axes)}{at} ({cause.op})"
        # one leaf's spec line is one origin however many of the collective's axes it gives
        out.append((head, cause.reason, list(dict.fromkeys(o.describe() for o in cause.origins))))
    return out


def no_cause_reason(x: Collective) -> str:
    """Why a collective has no cause, when the explanation is available for its function."""
    if x.source is None:
        return (f"no cause: XLA gave it no metadata and no instruction within {NEAREST_HOPS} operand/user hops of it "
                "has a line of the program")
    return ("no cause: its line names no op of Shardy's propagation rerun (an op the compiler made that the "
            "lowered module does not hold)")


def why_lines(w: WhyAnswer) -> list[tuple[str, str]]:
    """``stagetool why``'s answer as ``(style, line)`` pairs: the question, what it names, where its
    sharding came from, the reason (a collective), and downstream: collectives and outputs."""
    out = [("bold", f"why: {w.question}")]
    if w.unavailable:  # what is known still said (a leaf's shardings), then why the rest is not
        return out + [("", x) for x in w.found] + [("warn", f"no answer: {w.unavailable}")]
    out += [("", x) for x in w.found]
    if w.origins:
        out.append(("", "sharding from: " + "; ".join(f"`{o.axis}` ← {o.describe()}" for o in w.origins)))
    if w.reason:
        out.append(("", f"because: {w.reason}"))
    if w.collectives:
        out.append(("bold", f"collectives ({len(w.collectives)})"))
        out += [("", f"{n} {head}" + (f": {reason}" if reason else "")) for n, head, reason in w.collectives]
    elif w.reason is None:
        out.append(("", "collectives: none follow from it"))
    if w.outputs:
        out.append(("", "outputs whose sharding follows it: " + ", ".join(w.outputs)))
    return out


def explain_lines(c: CollectivesSection) -> list[str]:
    """One line per ``--explain`` leaf: the collectives that move it, then those its values flow into."""
    by_name = {item.collective.name: item for item in c.items}

    def describe(names: tuple[str, ...]) -> str:
        parts = []
        for name in names:
            item = by_name[name]
            x = item.collective
            where = f" at {_source(item.source)}" if item.source else ""
            parts.append(f"{x.kind} over {_axes(x.mesh_axes)} ({format_bytes(x.bytes_per_device)}){where}")
        return "; ".join(parts)

    out = []
    for e in c.explained:
        if e.parameter is None:
            out.append(f"{e.leaf}: unused (pruned by the compiler): no collective touches it")
            continue
        moved = f"moved by {describe(e.collectives)}" if e.collectives else "no collective moves it (it stays as sharded)"
        line = f"{e.leaf} (parameter {e.parameter}): {moved}"
        if e.downstream:
            groups: dict[tuple, list[int]] = {}
            for name in e.downstream:
                x = by_name[name].collective
                g = groups.setdefault((x.kind, _axes(x.mesh_axes)), [0, 0])
                g[0] += 1
                g[1] += x.bytes_per_device or 0
            flows = ", ".join(f"{n} {kind} over {axes} ({format_bytes(b)})" for (kind, axes), (n, b) in groups.items())
            line += f"; its values flow (through computation) into {flows}"
        out.append(line)
    return out


def _sharded_over(compiled: Sharding | None) -> str:
    """The mesh axes a compiled sharding uses (``P(None, 'model')`` → ``model``), ``replicated``, or
    ``unused (pruned)``."""
    if compiled is None:
        return "unused (pruned)"
    if compiled.kind == "other":
        return "other (no PartitionSpec over the mesh)"
    axes = compiled.axes
    return " × ".join(dict.fromkeys(axes)) if axes else "replicated"


def shardings_summary_rows(inputs: Sequence[LeafReport], outputs: Sequence[LeafReport]) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)``: leaves and bytes per device by the mesh axes their compiled sharding uses,
    for inputs and outputs side by side; a short form of the shardings tables for ``report``."""
    groups: dict[str, list[int]] = {}
    for side, leaves in ((0, inputs or ()), (1, outputs or ())):
        for x in leaves:
            g = groups.setdefault(_sharded_over(x.compiled), [0, 0, 0, 0])
            g[side * 2] += 1
            g[side * 2 + 1] += x.bytes_per_device or 0
    order = sorted(groups, key=lambda k: (k in ("replicated", "unused (pruned)"), k == "unused (pruned)", k))
    rows = [[k, str(g[0]), format_bytes(g[1]), str(g[2]), format_bytes(g[3])] for k, g in
            ((k, groups[k]) for k in order)]
    totals = [sum(groups[k][i] for k in groups) for i in range(4)]
    rows.append(["total", str(totals[0]), format_bytes(totals[1]), str(totals[2]), format_bytes(totals[3])])
    return ["sharded over", "inputs", "per device", "outputs", "per device"], rows


def shardings_summary_notes(inputs: Sequence[LeafReport]) -> list[str]:
    """The input leaves worth a line of their own: chosen by the partitioner, unused, donation count."""
    out = []
    for x in inputs or ():
        if x.declared.kind == "auto" and not x.unused:
            who = "JAX's sharding types (explicit axes)" if x.chosen_by == "JAX's sharding types" \
                else "the partitioner"
            out.append(f"chosen by {who}: {x.path} → {x.compiled}")
    unused = [x.path for x in inputs or () if x.unused]
    if unused:
        out.append("unused (pruned by the compiler): " + ", ".join(unused))
    donated = sum(1 for x in inputs or () if x.donated)
    if donated:
        out.append(f"donated: {donated} of {len(inputs)} input leaves")
    return out


def _sources_line(e) -> str:
    """The step time by where its figures come from, summing to the step as scheduled: the kernels'
    sources, the collectives' model and the time hidden by overlapping them (``model 17.8 µs ·
    collective model 12.6 µs = 30.4 µs``). Where the kernels' sources do not add up to the compute
    time, they are listed alone (no sum is claimed)."""
    terms = [f"{name} {format_seconds(v)}" for name, v in e.sources]
    kernels = sum(v for _, v in e.sources)
    if abs(kernels - e.compute_seconds) > 1e-9 * max(e.compute_seconds, 1e-12) + 1e-15:
        return " · ".join(terms)
    if e.collective_seconds > 0:
        terms.append(f"collective model {format_seconds(e.collective_seconds)}")
    modelled = getattr(e, "modelled_seconds", None)
    if e.lower_bound and modelled is not None:  # the "at least" figure: each counted kernel at its class's low end
        hidden = kernels + e.collective_seconds - modelled
        if hidden > 1e-15:
            terms.append(f"overlapped −{format_seconds(hidden)}")
        if modelled - e.schedule_seconds > 1e-15:
            terms.append(f"counted kernels at their classes' low ends −{format_seconds(modelled - e.schedule_seconds)}")
    else:
        hidden = e.serial_seconds - e.schedule_seconds
        if hidden > 1e-15:
            terms.append(f"overlapped −{format_seconds(hidden)}")
    prefix = "at least " if e.lower_bound else ""
    return " · ".join(terms) + f" = {prefix}{format_seconds(e.schedule_seconds)} (the step as scheduled)"
