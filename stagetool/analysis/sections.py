"""Report sections built from the analysis records: cost and memory of one staged function.

Each builder takes the JAX stage objects (``jax.stages.Lowered`` / ``Compiled``) and the per-leaf
sharding reports, and returns a frozen record that renderers read without touching JAX.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from stagetool.analysis.causes import CollectiveCause, ShardingOrigins
from stagetool.core.codec import omitted
from stagetool.hlo.collectives import (
    Collective,
    CollectiveSummary,
    MeshAxes,
    collectives_from_parameter,
    find_collectives,
    summarize,
    while_loops,
)
from stagetool.analysis.cost import (
    SCOPE_PER_DEVICE,
    CostRecord,
    Suspect,
    has_dot_or_convolution,
    manual_scope,
    per_device_cost,
    scaled_to_shards,
    whole_program_cost,
)
from stagetool.hlo.loops import (
    LoopAwareCost,
    counted_cost,
    dot_flops_lower_bound,
    loop_aware_cost,
    on_chip_bytes,
)
from stagetool.analysis.memory import (
    DonationStatus,
    FitVerdict,
    MemoryRecord,
    OutOfMemory,
    UnknownSharding,
    declared_argument_bytes,
    donation_status,
    fit_verdict,
    memory_of,
    normalise_memory,
    parse_input_output_alias,
    unknown_sharding,
)
from stagetool.plan.selectors import LeafPattern, leaf_patterns, unmatched_leaf_patterns
from stagetool.analysis.shardings import LeafReport
from stagetool.hlo.parser import HloModule
from stagetool.facts import StagedFunction

if TYPE_CHECKING:  # imported where used: only --chip and the peak buffers need them
    from stagetool.analysis.peak import PeakReport
    from stagetool.analysis.timeline import TimelinePeak, TimelinePoint
    from stagetool.analysis.replicated import ReplicatedWork
    from stagetool.analysis.uncounted import UncountedWork
    from stagetool.analysis.roofline import RooflineEstimate
    from stagetool.analysis.step_time import StepTimeEstimate
    from stagetool.facts import Interconnect, Propagation
    from stagetool.core.chips import Chip, RunChip
    from stagetool.core.errors import OutOfMemoryError


@dataclasses.dataclass(frozen=True)
class CostSection:
    """Cost of one function, labelled by scope.

    Attributes:
      per_device: from ``Compiled.cost_analysis()``: one device's partitioned, optimized module.
      whole_program: from ``Lowered.cost_analysis()``: the unpartitioned program, all devices together.
      device_count: devices in the mesh (whole program ≈ per device × devices for fully sharded work).
      roofline: the lower bound on step time (an estimate) on the run's chip from the loop-aware
        per-device figures, or None when the run has no chip.
      loop_trip_counts: the trip count of every ``while`` loop of the compiled module (None when
        unknown). XLA's cost analysis counts a loop body once, so with loops its FLOPs and bytes
        are a lower bound; a ``scan`` over N layers is undercounted about N-fold in its body.
      loop_aware: the **derived estimate** of one device's cost with each loop body × its trip
        count (:class:`stagetool.hlo.loops.LoopAwareCost`: flops, transcendentals,
        bytes_accessed, method, reason); equal to XLA's figures when the module has no loops.
        None when the compiled module is not available.
      scope_notes: where a figure is not what its scope's name claims: a program that is one
        ``shard_map`` over all devices has its whole-program figures scaled from one shard's
        (``Lowered.cost_analysis()`` costs one shard); a partly manual one says which part is
        counted per shard.
      step_time: the step-time estimate (:mod:`stagetool.analysis.step_time`: a range from
        overlapped to serial, what bounds it, the top instructions) on the run's chip, or None
        when there is no chip or no compiled module.
      step_time_reason: why there is no step-time estimate, or None.
      uncounted: the compiled module's instructions whose work XLA's cost analysis leaves out (Pallas
        kernels without a ``cost_estimate``, top-k and other custom calls) or counts from an estimate
        (a kernel's ``cost_estimate``, the sort rule), with their source line
        (:mod:`stagetool.analysis.uncounted`); with any not counted, the per-device FLOPs and bytes
        are a lower bound and the roofline leaves that work out.
      flops_lower_bound: True when XLA's per-device FLOPs and bytes leave out work it cannot count
        (some :attr:`uncounted` row is not counted): the figures are then a lower bound.
      replicated: instructions every device of some mesh axes computes whole from data split over them
        (:mod:`stagetool.analysis.replicated`: "computed whole on each of N devices"), heaviest first;
        () without a mesh, on a multi-slice job, or when none is above the threshold.
      chip_source: where the run's chip (the roofline's and the step time's, one chip) comes from
        (:meth:`stagetool.core.chips.RunChip.describe`: ``"from topology v5e:2x4"``, ``"from --chip"``,
        ``"from device TPU v5 lite"``), or None without a chip.
    """

    per_device: CostRecord
    whole_program: CostRecord
    device_count: int
    roofline: RooflineEstimate | None = None
    loop_trip_counts: tuple[int | None, ...] = ()
    loop_aware: LoopAwareCost | None = None
    scope_notes: tuple[str, ...] = ()
    step_time: StepTimeEstimate | None = None
    step_time_reason: str | None = None
    uncounted: tuple[UncountedWork, ...] = ()
    flops_lower_bound: bool = False
    replicated: tuple[ReplicatedWork, ...] = ()
    chip_source: str | None = None


@dataclasses.dataclass(frozen=True)
class InputBytes:
    """An input leaf and its bytes per device (for "which parameters dominate")."""

    path: str
    shape: str
    bytes_per_device: int


@dataclasses.dataclass(frozen=True)
class LeafDonation:
    """Donation of one input leaf.

    Attributes:
      path: the input leaf.
      requested: donation was asked for (``donate`` in the spec, or the jit's ``donate_argnums``).
      status: ``aliased`` (its buffer is reused for an output), ``not usable`` (requested, but no
        output can reuse it: XLA found no output of the same shape and layout),
        ``Ref write-back`` (a ``jax.Ref`` argument: JAX writes its new value into its own buffer,
        no donation involved), or ``aliased without request``.
      aliased_to: the output leaf paths that reuse its buffer (the module's ``input_output_alias``).
      reason: for ``not usable``, why: no output has the leaf's shape and dtype, or the outputs that
        have them already reuse other donated buffers, or they differ in sharding (bytes per device).
    """

    path: str
    requested: bool
    status: str
    aliased_to: tuple[str, ...]
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class MemorySection:
    """Memory of one function, per device, in bytes.

    Attributes:
      record: ``Compiled.memory_analysis()`` normalised (arguments, outputs, aliased, temporaries,
        generated code, host figures, peak).
      capacity_bytes: memory of one device, or None when unknown.
      capacity_source: where ``capacity_bytes`` comes from (``--device-memory``,
        ``Device.memory_stats()``, the chip table), or None.
      verdict: whether the peak fits in the capacity.
      largest_inputs: the input leaves with the most bytes per device, largest first (ties by path).
      donation: per input leaf that is donated or aliased.
      peak: what is live at the peak (from the compile's XLA dump), or None when not asked.
      out_of_memory: the compile stopped because the program does not fit (XLA's needed and available
        bytes); then ``record`` is empty, ``verdict`` compares XLA's needed with its available bytes
        and ``capacity_bytes`` is XLA's available figure.
      timeline: bytes live on one device at each step of the entry computation's schedule
        (:mod:`stagetool.analysis.timeline`, from the same dump as ``peak``), or None.
      timeline_peak: the timeline's maximum set against the gated peak (the difference named), or
        None when the peak dump was not asked for.
      unknown_sharding: the input leaves whose sharding nothing gives (staged replicated) and the
        bytes per device riding on that guess, or None; the verdict is then a range
        (:func:`stagetool.analysis.memory.fit_verdict`).
    """

    record: MemoryRecord
    capacity_bytes: int | None
    capacity_source: str | None
    verdict: FitVerdict
    largest_inputs: tuple[InputBytes, ...]
    donation: tuple[LeafDonation, ...]
    peak: PeakReport | None = None
    out_of_memory: OutOfMemory | None = None
    timeline: tuple[TimelinePoint, ...] | None = None
    timeline_peak: TimelinePeak | None = None
    unknown_sharding: UnknownSharding | None = dataclasses.field(default=None,
                                                                 metadata={"omit": True, "json_omit_none": True})


def cost_section(facts: StagedFunction, device_count: int, run_chip: RunChip | None = None,
                 dtype: str = "bf16", *, cpu: bool = False, interconnect: Interconnect | None = None,
                 mesh: MeshAxes | None = None, tokens_per_step: int | None = None) -> CostSection:
    """Build :class:`CostSection` from a staged function's facts (never raises on missing data).

    Whole program: ``Lowered.cost_analysis()``; per device: ``Compiled.cost_analysis()``, both as
    staging read them. ``dtype`` picks the chip's peak FLOP/s for the roofline (``bf16`` or
    ``f32``) of ``run_chip`` (the run's one chip, :func:`stagetool.plan.plan.run_chip`; no roofline
    without one); the compiled module's loops give the trip counts. With ``cpu``, XLA:CPU's rolled
    random-number loops (:func:`stagetool.analysis.cpu_artefacts.rng_loops`) are kept out of the
    loop-aware estimate (counted once) and shown apart (``loop_aware.apart``). With ``interconnect``
    and the chip, the step-time estimate
    (:func:`stagetool.analysis.step_time.step_time`) is added, with its tokens per second per chip
    where ``tokens_per_step`` (the spec's, all devices together) is given. With ``mesh`` (the user's mesh; not on a
    multi-slice job), the work computed whole on every device of some mesh axes is listed
    (:func:`stagetool.analysis.replicated.replicated_work`).
    """
    chip = run_chip.chip if run_chip is not None else None
    text = facts.stablehlo_text
    whole = whole_program_cost(facts.whole_program_cost, program_text=text)
    has_dot = has_dot_or_convolution(text) if text is not None else None
    per_device = per_device_cost(facts.per_device_cost, has_dot_or_conv=has_dot, program_text=facts.compiled_text)
    module = facts.module
    derived_note: tuple[str, ...] = ()
    if not per_device.reported and module is not None:
        derived_note = (f"per device: {per_device.source} reported nothing ({per_device.reason}); FLOPs, "
                        "transcendentals and bytes accessed are derived from the compiled module with XLA's "
                        "HloCostAnalysis rules, every loop body once as XLA counts (derived figures, not XLA's)",)
        per_device = derived_per_device_cost(module)
    uncounted: tuple[UncountedWork, ...] = ()
    if module is not None:
        from stagetool.analysis.uncounted import uncounted_work, unknown_not_zero

        uncounted = uncounted_work(module, derived=bool(derived_note))
        per_device = unknown_not_zero(per_device, uncounted)
        whole = unknown_not_zero(whole, uncounted)  # the same kernels and calls are in the lowered program
    loops = while_loops(module) if module is not None else ()
    aware = None
    if module is not None:
        aware = loop_aware_cost(module, dict(loops), flops=per_device.flops,
                                transcendentals=per_device.transcendentals, bytes_accessed=per_device.bytes_accessed)
        rng = ()
        if cpu:
            from stagetool.analysis.cpu_artefacts import rng_loops

            rng = rng_loops(module)
        if rng:  # XLA:CPU's rolled threefry: once, as XLA counts it; what more iterations add, apart
            once = loop_aware_cost(module, {**dict(loops), **{n: 1 for n in rng}}, flops=per_device.flops,
                                   transcendentals=per_device.transcendentals,
                                   bytes_accessed=per_device.bytes_accessed)
            aware = dataclasses.replace(
                once, loops=tuple(x for x in aware.loops if x[0] not in rng),
                apart=tuple(x for x in aware.loops if x[0] in rng),
                apart_extra_flops=max((aware.flops or 0.0) - (once.flops or 0.0), 0.0))
    scope = manual_scope(text)
    notes: tuple[str, ...] = ()
    if not whole.reported:
        pass  # a scope note is about the whole-program figure: none without one (XLA:TPU's Lowered is None)
    elif scope.kind == "entire" and scope.shards and scope.shards > 1:
        whole = scaled_to_shards(whole, scope.shards)
        notes = (f"whole program: the program is one shard_map over all devices (manual axes "
                 f"{', '.join(scope.axes)}); Lowered.cost_analysis() costs one shard, so its figures are "
                 f"multiplied by the {scope.shards} shards",)
    elif scope.kind == "partial":
        notes = (f"whole program: Lowered.cost_analysis() counts the shard_map parts (manual axes "
                 f"{', '.join(scope.axes)}) as one shard's work, not × {scope.shards or '?'} shards, and the rest "
                 "of the program whole: the figure mixes the two scopes",)
    notes = (*derived_note, *notes)
    per_device, whole = _cross_checked(per_device, whole, module, device_count)
    estimate = None
    if chip is not None:
        flops, moved = (aware.flops, aware.bytes_accessed) if aware is not None else (
            per_device.flops, per_device.bytes_accessed)
        from stagetool.analysis.roofline import roofline

        # a suspect figure is not an input: the roofline says why its term is missing
        flops_suspect = "; ".join(s.reason for s in per_device.suspects if s.field == "flops") or None
        bytes_suspect = "; ".join(s.reason for s in per_device.suspects if s.field == "bytes_accessed") or None
        on_chip = on_chip_bytes(module, dict(loops)) if module is not None and moved is not None else 0.0
        estimate = roofline(chip, flops_per_device=None if flops_suspect else flops,
                            bytes_accessed_per_device=None if bytes_suspect else moved, dtype=dtype,
                            flops_suspect=flops_suspect, bytes_suspect=bytes_suspect, on_chip_bytes=on_chip)
    step, step_reason = _step_time(facts, per_device, chip, interconnect, dict(loops))
    if step is not None and tokens_per_step and step.schedule_seconds > 0 and interconnect is not None:
        devices = 1
        for size in interconnect.mesh_sizes:
            devices *= size
        chips = max(1, devices // max(1, interconnect.cores_per_chip))
        step = dataclasses.replace(step, tokens_per_step=tokens_per_step,
                                   tokens_per_second_per_chip=tokens_per_step / step.schedule_seconds / chips)
    return CostSection(per_device, whole, device_count, estimate, tuple(n for _, n in loops), aware, notes,
                       step, step_reason, uncounted, any(not u.counted for u in uncounted),
                       _replicated(module, mesh, interconnect, per_device, aware, dict(loops)),
                       run_chip.describe() if run_chip is not None else None)


def _replicated(module: HloModule | None, mesh: MeshAxes | None, net: Interconnect | None,
                per_device: CostRecord, aware: LoopAwareCost | None,
                trips: dict[str, int | None]) -> tuple[ReplicatedWork, ...]:
    """The work computed whole on every device of some mesh axes, per step (loop bodies × their trip
    counts, shares of the loop-aware FLOPs), or () where it cannot be told."""
    if module is None or mesh is None or (net is not None and net.slices > 1):
        return ()
    from stagetool.analysis.replicated import replicated_work

    total = aware.flops if aware is not None and aware.flops else per_device.flops
    return replicated_work(module, mesh, find_collectives(module, mesh),
                           total_flops=total if total and total > 0 else None, trips=trips)


def _step_time(facts: StagedFunction, per_device: CostRecord, chip: Chip | None, net: Interconnect | None,
               trips: dict) -> tuple[StepTimeEstimate | None, str | None]:
    """The step-time estimate of one function, or why there is none."""
    module = facts.module
    if net is None:
        return None, None
    if chip is None:
        return None, ("no chip to time the step on: give --chip NAME (the CPU mesh, or a device the chip table "
                      "does not know)")
    if module is None:
        return None, "no compiled module"
    from stagetool.analysis.step_time import step_time
    from stagetool.core.chips import CHIPS, step_figures

    mesh = MeshAxes(net.mesh_names, net.mesh_sizes) if net.mesh_names else None
    collectives = find_collectives(module, mesh, slices=net.slices)
    optimal = per_device.extra_by_key().get("optimal_seconds")
    xla = optimal.value if optimal is not None else None  # step_time leaves out a negative or looped one
    est = step_time(module, chip, net, collectives, trips, xla_optimal_seconds=xla)
    builtin = CHIPS.get(chip.name)
    if builtin is not None and step_figures(builtin) != est.chip_figures:
        # figures of the spec's or a profile's: the same module timed with stagetool's own too, which the
        # gate compares when two snapshots' profiles differ (a profile cannot hide what the code did)
        ref = step_time(module, builtin, net, collectives, trips, top=0)
        est = dataclasses.replace(est, builtin_seconds=ref.schedule_seconds, builtin_lower_bound=ref.lower_bound)
    return est, None


DERIVED_COST_SOURCE = ("derived: the compiled module counted with XLA's HloCostAnalysis rules "
                       "(stagetool.hlo.loops.counted_cost)")
"""``CostRecord.source`` of per-device figures stagetool derived because the backend reported none."""


def derived_per_device_cost(module: HloModule) -> CostRecord:
    """Per-device FLOPs, transcendentals and bytes accessed derived from the compiled (partitioned)
    module, for a backend whose ``Compiled.cost_analysis()`` is None (compile-only GPU targets).

    Counted by :func:`stagetool.hlo.loops.counted_cost`: XLA's HloCostAnalysis rules (dot and
    cuBLAS GEMM calls, convolution windows, element-wise, transcendental, reduce), every loop body
    once as XLA counts. ``source`` is :data:`DERIVED_COST_SOURCE`; no operand slots.
    """
    c = counted_cost(module)
    intensity = c.flops / c.bytes_accessed if c.bytes_accessed > 0 else None
    return CostRecord(scope=SCOPE_PER_DEVICE, source=DERIVED_COST_SOURCE, flops=c.flops,
                      transcendentals=c.transcendentals, bytes_accessed=c.bytes_accessed, output_bytes_accessed=None,
                      arithmetic_intensity_flops_per_byte=intensity, operand_slots=(), extra=(), reason=None)


BYTES_DISAGREEMENT = 10.0
"""How many times the devices' bytes accessed together (after optimisation) the whole program's figure
(before it) may be before it is flagged: fusion alone commonly halves or quarters it, never 10×
without an op chain the compiler fused away."""


def _cross_checked(per_device: CostRecord, whole: CostRecord, module: HloModule | None,
                   device_count: int) -> tuple[CostRecord, CostRecord]:
    """Suspects no single record can see: XLA's per-device FLOPs below the FLOPs of the compiled
    module's own dots and convolutions; the per-device and whole-program figures further apart
    than partitioning explains (the devices together doing under half the program, or one device
    over twice the whole program); the whole program's bytes accessed more than
    :data:`BYTES_DISAGREEMENT` times the devices' together (unfused ops counted before optimisation)."""
    extra_pd: list[Suspect] = []
    extra_whole: list[Suspect] = []
    if module is not None and per_device.flops is not None:
        floor = dot_flops_lower_bound(module)
        if floor > 0 and per_device.flops < 0.99 * floor:
            extra_pd.append(Suspect("flops", f"{per_device.flops:.6g} FLOPs is below the {floor:.6g} FLOPs of the "
                                    "compiled module's dot/convolution instructions alone (2 × output elements × "
                                    "contracted size)"))
    p, w = per_device.flops, whole.flops
    if p is not None and w is not None and w > 0 and device_count >= 1:
        if p * device_count < 0.5 * w:
            extra_whole.append(Suspect("flops", f"the whole program's {w:.6g} FLOPs is more than twice what the "
                                       f"{device_count} devices do together ({p:.6g} each): partitioning does "
                                       "not explain it"))
        elif p > 2 * w:
            extra_pd.append(Suspect("flops", f"one device's {p:.6g} FLOPs is more than twice the whole program's "
                                    f"{w:.6g}: partitioning does not explain it"))
    pb, wb = per_device.bytes_accessed, whole.bytes_accessed
    if pb is not None and wb is not None and pb > 0 and device_count >= 1 and wb > BYTES_DISAGREEMENT * pb * device_count:
        extra_whole.append(Suspect("bytes_accessed", (
            f"the whole program's {wb:,.0f} bytes accessed (before optimisation) is {wb / (pb * device_count):,.0f}× "
            f"what the {device_count} device{'s' if device_count != 1 else ''} move together after it ({pb:,.0f} B "
            "each): Lowered.cost_analysis() counts every unfused op's reads and writes, which fusion keeps in "
            "registers; partitioning does not explain it, and it is no estimate of memory traffic")))
    if extra_pd:
        per_device = dataclasses.replace(per_device, suspects=(*per_device.suspects, *extra_pd))
    if extra_whole:
        whole = dataclasses.replace(whole, suspects=(*whole.suspects, *extra_whole))
    return per_device, whole


def _memory_suspects(record: MemoryRecord, inputs: tuple[LeafReport, ...]) -> MemoryRecord:
    """An all-zero ``memory_analysis()`` for a program whose inputs have bytes is suspect."""
    figures = (record.argument_bytes, record.output_bytes, record.temp_bytes, record.peak_bytes_reported)
    given = sum(x.bytes_per_device or 0 for x in inputs if not x.unused)
    if given > 0 and all(v == 0 for v in figures if v is not None) and any(v is not None for v in figures):
        why = Suspect("argument_bytes", f"memory_analysis() reports 0 bytes for everything, but the used inputs "
                      f"hold {given} bytes per device: the backend's figures are not usable")
        return dataclasses.replace(record, suspects=(*record.suspects, why))
    return record


def memory_section(facts: StagedFunction, inputs: tuple[LeafReport, ...], outputs: tuple[LeafReport, ...],
                   *, capacity_bytes: int | None, capacity_source: str | None, top: int = 10,
                   device_count: int = 1) -> MemorySection:
    """Build :class:`MemorySection` from a staged function's facts.

    Args:
      facts: ``Compiled.memory_analysis()``, the compiled text (its ``input_output_alias``) and the
        live-range dump when the peak was asked for, as staging read them.
      inputs / outputs: per-leaf reports (for names, bytes per device and parameter numbers).
      capacity_bytes / capacity_source: the device's memory, if known.
      top: how many largest inputs and peak buffers to keep.
      device_count: the devices of the mesh (for inputs whose sharding is unknown: the least they
        could hold, :func:`unknown_sharding`).
    """
    record = _memory_suspects(memory_of(facts.memory), inputs)
    unknown = unknown_sharding(inputs, device_count)
    verdict = fit_verdict(record.peak_bytes, capacity_bytes, suspects=record.peak_suspects, unknown=unknown)
    used = [x for x in inputs if x.bytes_per_device is not None]
    largest = sorted(used, key=lambda x: (-(x.bytes_per_device or 0), x.path))[:top]
    largest_inputs = tuple(InputBytes(x.path, _shape(x), int(x.bytes_per_device or 0)) for x in largest)
    donation = _donation(facts.compiled_text or "", inputs, outputs)
    timeline = timeline_peak = peak = None
    if facts.peak is not None:  # what is live at the peak: shown, never a part of the gated figure
        from stagetool.analysis.peak import module_index, peak_report
        from stagetool.analysis.timeline import memory_timeline

        index = module_index(facts)
        timeline, timeline_peak = memory_timeline(facts.peak, gated_peak=record.peak_bytes, record=record,
                                                  inputs=inputs, outputs=outputs, top=top, index=index)

        # At the timeline's peak (the step XLA's buffer assignment holds the most bytes), so that the
        # table and the timeline name one peak; XLA's own peak position is said in the note when apart.
        at = timeline_peak.schedule_position if timeline_peak is not None else None
        peak = peak_report(facts.peak, top=top, gated_peak_bytes=record.peak_bytes, at=at,
                           step=timeline_peak.position if at is not None else None, index=index)
    return MemorySection(record, capacity_bytes, capacity_source, verdict, largest_inputs, donation, peak,
                         timeline=timeline, timeline_peak=timeline_peak, unknown_sharding=unknown)


REFUSED_PEAK_NOTE = ("buffers of the program XLA refused, from the dump XLA wrote before refusing it (its buffer "
                     "assignment and live ranges, per device): XLA's figures for a program that was not compiled")
"""The note on the peak table of a refused compile: what those buffers are."""


def out_of_memory_section(error: OutOfMemoryError, leaves: Any, axis_size: dict[str, int], *, capacity_bytes: int | None,
                          capacity_source: str | None, top: int = 10) -> MemorySection:
    """:class:`MemorySection` of a compile that ran out of memory (a
    :class:`stagetool.core.errors.OutOfMemoryError`): "does not fit", with XLA's needed and
    available bytes and the argument bytes known from the inputs' declared shardings. Where the
    compile was taken with XLA's dump (``error.refused_dump``, a :class:`~stagetool.facts.PeakDump`),
    ``peak`` lists the ``top`` largest buffers live at the peak of the refused program (shape, bytes,
    op, source line; XLA's buffer assignment, labelled by :data:`REFUSED_PEAK_NOTE`)."""
    args, auto = declared_argument_bytes(leaves, axis_size)
    oom = OutOfMemory(error.needed_bytes, error.available_bytes, error.memory_space, error.what, error.xla_message,
                      args, auto)
    record = dataclasses.replace(normalise_memory(None), reason="the compile ran out of memory: XLA gives no "
                                 "memory_analysis() for a program that does not fit")
    if error.available_bytes is not None:
        capacity_bytes, capacity_source = error.available_bytes, "XLA's compile (available)"
    verdict = fit_verdict(error.needed_bytes, capacity_bytes)
    if verdict.fits is not False:  # XLA said it does not fit, whatever figures its message carried
        verdict = dataclasses.replace(verdict, fits=False, reason="XLA's compile ran out of memory")
    peak = None
    if error.refused_dump is not None:
        from stagetool.analysis.peak import peak_report

        peak = peak_report(error.refused_dump, top=top)
        if not peak.reason:
            peak = dataclasses.replace(peak, note=REFUSED_PEAK_NOTE + (f"; {peak.note}" if peak.note else ""))
    return MemorySection(record, capacity_bytes, capacity_source, verdict, (), (), peak, oom)


def _shape(x: LeafReport) -> str:
    from stagetool.core.units import shape_str

    return shape_str(x.dtype, x.shape)


def _donation(compiled_text: str, inputs: tuple[LeafReport, ...], outputs: tuple[LeafReport, ...]) -> tuple[LeafDonation, ...]:
    aliases = parse_input_output_alias(compiled_text or "")
    params = [x for x in inputs if x.parameter is not None]
    donated = [False] * len(params)
    for x in params:
        donated[x.parameter] = x.donated
    statuses: dict[int, DonationStatus] = {s.parameter_number: s for s in donation_status(donated, aliases)}
    out = []
    for x in inputs:
        if x.parameter is None:
            if x.donated:
                out.append(LeafDonation(x.path, True, "unused (pruned)", ()))
            continue
        s = statuses.get(x.parameter)
        if s is None or (not s.requested and not s.aliased_output_indices):
            continue
        names = tuple(_output_name(idx, outputs) for idx in s.aliased_output_indices)
        reason = _not_usable_reason(x, inputs, outputs, statuses) if s.status == "not usable" else None
        status = s.status
        if status == "aliased without request" and all(_writes_back(idx, x, outputs) for idx in s.aliased_output_indices):
            status = "Ref write-back"  # the Ref's new value written in place: JAX aliases it, no donation
        out.append(LeafDonation(x.path, s.requested, status, names, reason))
    return tuple(out)


def _writes_back(index: tuple[int, ...], x: LeafReport, outputs: tuple[LeafReport, ...]) -> bool:
    """The output at an HLO result index is the Ref write-back of input ``x``."""
    if len(index) != 1 or not 0 <= index[0] < len(outputs):
        return False
    o = outputs[index[0]]
    return o.ref_write_back and o.path == x.path


def _not_usable_reason(x: LeafReport, inputs: tuple[LeafReport, ...], outputs: tuple[LeafReport, ...],
                       statuses: dict[int, DonationStatus]) -> str:
    """Why XLA could reuse no output buffer for a donated input (XLA matches shape, dtype and the
    per-device buffer)."""
    from stagetool.core.units import shape_str

    same = [o for o in outputs if tuple(o.shape) == tuple(x.shape) and o.dtype == x.dtype]
    if not same:
        return f"no output has shape and dtype {shape_str(x.dtype, x.shape)}"
    fits = [o for o in same if o.bytes_per_device == x.bytes_per_device]
    if not fits:
        return (f"the outputs of that shape and dtype ({', '.join(o.path for o in same)}) have another sharding: "
                f"{_fmt(same[0].bytes_per_device)} per device, not {_fmt(x.bytes_per_device)}")
    taken = {_output_name(i, outputs) for s in statuses.values() for i in s.aliased_output_indices}
    if all(o.path in taken for o in fits):
        return (f"the outputs of that shape and dtype ({', '.join(o.path for o in fits)}) already reuse other "
                "donated buffers")
    return "XLA found no output whose buffer it could reuse (layout or memory space differ)"


def _fmt(n: int | None) -> str:
    from stagetool.core.units import format_bytes

    return format_bytes(n)


def _output_name(index: tuple[int, ...], outputs: tuple[LeafReport, ...]) -> str:
    """The output leaf at an HLO result shape index: ``(i,)`` is flat output i of a tuple result."""
    if not index and len(outputs) == 1:
        return outputs[0].path
    if len(index) == 1 and 0 <= index[0] < len(outputs):
        return outputs[index[0]].path
    return "out{" + ",".join(str(i) for i in index) + "}"


# ---- collectives ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveItem:
    """One collective and the user's source line that caused it.

    Attributes:
      collective: the record from :func:`stagetool.hlo.collectives.find_collectives`.
      source: ``file:line`` of the innermost frame in the user's code (the target's file when it is
        in the chain, else the first frame outside JAX and the standard library), or None.
      cause: why it is there (:class:`stagetool.analysis.causes.CollectiveCause`: the op, its
        operands' shardings and their origins, the reason); None when not explained (see
        :attr:`CollectivesSection.causes_unavailable`) or when its metadata names no op.
      widened_from: on CPU, the program's own 16-bit type (``bf16``) when this f32 collective is f32
        only because XLA:CPU computes 16-bit dot products in f32 (a dot's result, a parameter
        converted before its all-gather, a gradient widened back before its all-reduce:
        :func:`stagetool.analysis.cpu_artefacts.widened_collectives`); None otherwise.
      widened_bytes: with ``widened_from``, the bytes per device of its result that are f32 only by
        that upcast: all of ``bytes_per_device`` for one array, the widened elements' for a tuple
        all-reduce (its f32 loss left out); None otherwise or when a size is unknown.
      via: when ``source`` is a thin helper — a user line that the function's collectives reach from
        two or more different user lines (a one-line ``einsum`` wrapper) — the user frames it was
        called from, outward, up to the first that is not itself a helper (``layers.py:88 ←
        attention.py:41``: the model line); () otherwise.
      cpu_only: on CPU, what about this collective only XLA:CPU does, said on its row:
        :data:`stagetool.analysis.cpu_artefacts.HOISTED` for an all-reduce of a loop's accumulated
        sum that runs in the ``while`` body (once per iteration) where XLA:TPU/GPU all-reduce the sum
        once after the loop (:func:`stagetool.analysis.cpu_artefacts.accumulated_in_loop`);
        :data:`stagetool.analysis.cpu_artefacts.SUNK` for an all-gather XLA:CPU hoisted out of a loop
        that XLA:TPU runs in it, once per iteration
        (:func:`stagetool.analysis.cpu_artefacts.gathered_before_loop`); None otherwise (the f32
        widening is ``widened_from``).
      accelerator_runs: with ``cpu_only``, the runs per step an accelerator compile makes of it: 1 for
        :data:`~stagetool.analysis.cpu_artefacts.HOISTED`, the loop's trip count for
        :data:`~stagetool.analysis.cpu_artefacts.SUNK` (None where unknown).
      against: with ``--against TARGET``, what the target's compile shows for this row's group
        (kind, mesh axes, source line) where it differs (``not on v5e:2x4``, ``v5e:2x4: 1 × bf16[8,128],
        runs 1: 2.00 KiB per step``; :func:`stagetool.analysis.against.marked_collectives`); None
        where it is the same or without ``--against`` (absent from the JSON then).
    """

    collective: Collective
    source: str | None
    cause: CollectiveCause | None = None
    widened_from: str | None = None
    widened_bytes: int | None = None
    via: tuple[str, ...] = ()
    cpu_only: str | None = None
    accelerator_runs: int | None = omitted(None)
    against: str | None = dataclasses.field(default=None, metadata={"omit": True, "json_omit_none": True})


@dataclasses.dataclass(frozen=True)
class Explanation:
    """``--explain LEAF``: the collectives that move one input leaf.

    Attributes:
      leaf: the input leaf's key path.
      parameter: its entry parameter number in the compiled module; None when pruned as unused.
      collectives: names of the collectives whose operands carry the parameter's values (through
        fusions, calls, loops and layout/slice ops; not through arithmetic): what moves the leaf.
      downstream: names of the further collectives whose operands depend on it through computation
        (a partial sum of a sharded matmul, a gradient): what the leaf's sharding causes.
    """

    leaf: str
    parameter: int | None
    collectives: tuple[str, ...]
    downstream: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class CollectivesSection:
    """The collectives the SPMD partitioner inserted into one function's compiled module.

    Attributes:
      items: every collective in module text order (an async start/done pair counts once), with
        the user's source line.
      summary: count and bytes per device by kind, by mesh axes, and by both.
      explained: the ``--explain`` answers, or () when none was asked.
      causes_unavailable: why no collective has a cause (the propagation rerun for explanation is not
        the compiled program's, or could not run), or None.
      origins: where every entry argument's and result's sharding came from, and the program's
        sharding constraints (:class:`stagetool.analysis.causes.ShardingOrigins`); None when the
        explanation is unavailable.
    """

    items: tuple[CollectiveItem, ...]
    summary: CollectiveSummary
    explained: tuple[Explanation, ...] = ()
    causes_unavailable: str | None = None
    origins: ShardingOrigins | None = None


def collectives_section(module: HloModule, mesh: MeshAxes, inputs: tuple[LeafReport, ...] | None,
                        user_files: list[str], explain: tuple[LeafPattern | str, ...] = (), *,
                        slices: int = 1, outputs: tuple[LeafReport, ...] | None = None,
                        propagation: Propagation | None = None,
                        propagation_error: str | None = None,
                        cpu_upcast: frozenset[str] = frozenset(),
                        cpu_promoted: frozenset[str] = frozenset(), cpu: bool = False,
                        cpu_grouped: tuple[str, ...] = ()) -> CollectivesSection:
    """Build :class:`CollectivesSection` from the parsed compiled module.

    Args:
      module: ``parse_hlo_module(compiled.as_text())``.
      mesh: the mesh's axis names and sizes (replica groups are matched against its axes).
      inputs: per-leaf reports with entry parameter numbers (needed for ``explain``).
      user_files: the user's source files, preferred when picking the source frame.
      explain: the input leaves to explain (:class:`LeafPattern`, or text compiled as one).
      slices: TPU slices of a multi-slice job: collectives get ``network`` ici/dcn (see
        :func:`~stagetool.hlo.collectives.find_collectives`).
      outputs: per-leaf reports of the outputs (for causes that come from an output's sharding).
      propagation / propagation_error: Shardy's propagation rerun with origins, or why there is none;
        each collective gets a cause (:func:`stagetool.analysis.causes.cause_of`) when the
        propagation agrees with the compiled shardings (:func:`~stagetool.analysis.causes.unfaithful_reason`).
      cpu_upcast: on CPU, the program's own 16-bit dot types
        (:func:`stagetool.analysis.cpu_artefacts.narrow_dot_types`): an f32 collective of such a dot's
        result gets ``widened_from``. Empty on other backends.
      cpu_promoted: on CPU, the 16-bit types of any value of the program
        (:func:`stagetool.analysis.cpu_artefacts.narrow_value_types`): an f32 all-reduce whose reducer is
        XLA:CPU's ``*_promoted`` gets ``widened_from`` too (a bf16 gather's all-reduce), a value the
        program itself converts to f32 does not.
      cpu: the module is XLA:CPU's: an all-reduce of a loop's accumulated sum left in the loop body
        gets ``cpu_only`` (:func:`stagetool.analysis.cpu_artefacts.accumulated_in_loop`), an all-gather
        hoisted out of a loop too (:func:`stagetool.analysis.cpu_artefacts.gathered_before_loop`).
      cpu_grouped: on CPU, the ``file:line`` of the program's ``ragged_dot`` calls
        (:attr:`stagetool.facts.StagedFunction.grouped_matmuls`): a collective at one of them gets
        ``cpu_only`` :data:`stagetool.analysis.cpu_artefacts.EXPANDED`.

    Raises:
      UsageError: an ``explain`` pattern that names no input leaf.
    """
    from pathlib import Path

    from stagetool.core.paths import library_dirs

    found = find_collectives(module, mesh, slices=slices)
    user = {str(Path(f).resolve()) for f in user_files}
    library = library_dirs()
    found = [_without_tool_frames(c) for c in found]
    unavailable = None
    origins = None
    if propagation is None:
        unavailable = (f"explanation unavailable: {propagation_error}" if propagation_error
                       else "explanation unavailable: Shardy's propagation was not rerun")
    else:
        from stagetool.analysis.causes import sharding_origins, unfaithful_reason

        unavailable = unfaithful_reason(propagation, inputs or (), outputs or ())
        if unavailable is None:
            origins = sharding_origins(propagation, inputs or (), outputs or ())
    if found and unavailable is None:
        from stagetool.analysis.causes import cause_of
        from stagetool.hlo.collectives import feeding_parameters

        feeding = feeding_parameters(module, found)
        items = tuple(CollectiveItem(c, _user_source(c, user, library),
                                     cause_of(c, propagation, inputs or (), outputs or (),
                                              feeding.get((c.computation, c.name))))
                      for c in found)
    else:
        items = tuple(CollectiveItem(c, _user_source(c, user, library)) for c in found)
    if (cpu_upcast or cpu_promoted) and items:
        from stagetool.analysis.cpu_artefacts import widened_collectives

        reducers = {c.name: _reducer(module, c) for c in found}
        widened = widened_collectives(module, [(c.name, c.computation, reducers[c.name]) for c in found])

        def marked(name: str) -> bool:
            kind = widened.get(name, ("",))[0]
            return kind in cpu_upcast or (kind in cpu_promoted and (reducers[name] or "").endswith("_promoted"))

        items = tuple(dataclasses.replace(i, widened_from=widened[i.collective.name][0],
                                          widened_bytes=widened[i.collective.name][1])
                      if marked(i.collective.name) else i for i in items)
    if cpu and items:
        from stagetool.analysis.cpu_artefacts import HOISTED, SUNK, accumulated_in_loop, gathered_before_loop

        hoisted = set(accumulated_in_loop(module, [(c.name, c.computation, c.reduction) for c in found]))
        sunk = gathered_before_loop(module, found, dict(while_loops(module)))
        items = tuple(dataclasses.replace(i, cpu_only=HOISTED, accelerator_runs=1) if i.collective.name in hoisted
                      else dataclasses.replace(i, cpu_only=SUNK, accelerator_runs=sunk[i.collective.name])
                      if i.collective.name in sunk else i for i in items)
        if cpu_grouped:
            from stagetool.analysis.cpu_artefacts import EXPANDED, same_line

            def expanded(i: CollectiveItem) -> bool:  # the dense expansion's own: partial sums, group sizes
                c = i.collective
                own = c.kind in ("all-reduce", "reduce-scatter") or all(
                    t.startswith(("s32", "s64", "u32", "u64")) for t in c.result_types)
                return bool(own and i.cpu_only is None and i.source
                            and any(same_line(i.source, g) for g in cpu_grouped))

            items = tuple(dataclasses.replace(i, cpu_only=EXPANDED, accelerator_runs=None) if expanded(i) else i
                          for i in items)
    items = _with_helper_callers(items, user, library)
    explained = []
    for leaf in match_leaves(explain, inputs or ()):
        if leaf.parameter is None:
            explained.append(Explanation(leaf.path, None, ()))
            continue
        moved = tuple(c.name for c in collectives_from_parameter(module, found, leaf.parameter))
        after = collectives_from_parameter(module, found, leaf.parameter, through_compute=True)
        explained.append(Explanation(leaf.path, leaf.parameter, moved,
                                     tuple(c.name for c in after if c.name not in moved)))
    return CollectivesSection(items, summarize(found), tuple(explained), unavailable, origins)


def _reducer(module: HloModule, c: Collective) -> str | None:
    comp = module.computation(c.computation)
    ins = comp.instruction(c.name) if comp is not None else None
    reducer = ins.attributes.get("to_apply") if ins is not None else None
    return reducer.lstrip("%") if reducer else None


def match_leaves(patterns: tuple[LeafPattern | str, ...], leaves: tuple[LeafReport, ...]) -> list[LeafReport]:
    """The input leaves the patterns name (see :class:`LeafPattern`; text is compiled first). In leaf
    order, each once.

    Raises:
      UsageError: a bad regular expression, or a pattern that names no leaf (with close matches).
    """
    from stagetool.core.errors import UsageError

    compiled = tuple(p for p in patterns if isinstance(p, LeafPattern))
    compiled += leaf_patterns(tuple(p for p in patterns if not isinstance(p, LeafPattern)))
    problems = unmatched_leaf_patterns(compiled, [x.path for x in leaves])
    if problems:
        raise UsageError("; ".join(problems),
                         hint="give a leaf path as 'stagetool shardings' lists it, or its last part")
    return [x for x in leaves if any(p.names(x.path) for p in compiled)]


def _with_helper_callers(items: tuple, user: set[str], library: tuple[str, ...]) -> tuple:
    """Each item with :attr:`CollectiveItem.via` set where its source is a thin helper: a user line
    that the function's collectives reach from two or more different user lines
    (:func:`stagetool.analysis.callers.helper_callers`)."""
    import dataclasses

    from stagetool.analysis.callers import helper_callers, user_frames

    vias = helper_callers([item.source for item in items],
                          [user_frames(item.collective.source_chain, library) for item in items])
    return tuple(dataclasses.replace(item, via=via) if via else item for item, via in zip(items, vias))


def _user_source(c: Collective, user: set[str], library: tuple[str, ...]) -> str | None:
    """``file:line`` of the innermost frame in the user's code (any file outside ``library``, wherever
    it lies), else of the innermost frame in the user's files, else the innermost frame."""
    from pathlib import Path

    from stagetool.analysis.callers import user_frames

    chain = c.source_chain or ((c.source,) if c.source else ())
    if not chain:
        return None
    mine = user_frames(chain, library)
    if mine:
        return mine[0]
    for frame in chain:
        if str(Path(frame.file).resolve()) in user:
            return f"{frame.file}:{frame.line}"
    return f"{chain[0].file}:{chain[0].line}"


def _without_tool_frames(c: Collective) -> Collective:
    """``c`` with stagetool's own frames and the CLI's (Typer, Click) dropped from its source chain:
    they are how stagetool called the user's function, not the user's code."""
    import dataclasses
    from pathlib import Path

    own = str(Path(__file__).resolve().parents[1]) + "/"
    if not c.source_chain:
        return c

    def tool(frame) -> bool:
        resolved = str(Path(frame.file).resolve())
        return resolved.startswith(own) or "/typer/" in resolved or "/click/" in resolved

    kept = tuple(f for f in c.source_chain if not tool(f))
    return c if len(kept) == len(c.source_chain) else dataclasses.replace(c, source_chain=kept)
