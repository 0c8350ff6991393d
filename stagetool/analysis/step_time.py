"""How long one step takes on one device: an ESTIMATE with its range, from the compiled module.

Input: the parsed compiled (partitioned, scheduled) module of one device, the chip's figures
(:class:`stagetool.core.chips.Chip`), where the devices sit (:class:`stagetool.facts.Interconnect`)
and the module's collectives (:func:`stagetool.hlo.collectives.find_collectives`). No JAX.

The model, per instruction of the schedule (the order XLA printed, which is its schedule):

* **kernels**: each instruction that computes (a fusion, a lone op, a custom call) is one kernel,
  put in a class and timed at that class's rate on the chip, with what bounds it
  (:func:`stagetool.analysis.kernel_time.kernel_time`): matmuls at the precision XLA compiled with
  the matrix unit's tile padding (or XLA:TPU's own ``estimated_cycles`` where the compiled module
  carries it), element-wise and reduction kernels at the vector unit's measured byte rates (with
  transcendentals), gathers, scatters and copies at theirs, a Pallas kernel from its
  ``cost_estimate``, plus a fixed cost per kernel. Work no model covers (a Pallas kernel without
  ``cost_estimate``, top-k, sort, an unknown custom call) is timed at a floor and makes the step
  time a **lower bound** ("at least"), each such instruction named with its line; its figure then takes
  every counted kernel at the low end of its class's measured spread, so that a kernel the model
  over-counts cannot lift it above the truth (``modelled_seconds`` keeps the model's). A ``while`` body
  counts × its trip count, a ``conditional`` its costliest branch. XLA:TPU's cross-program prefetch
  of an argument into VMEM (a ``copy-start`` with ``cross_program_prefetch_index``) is a row of its
  own: its bytes read from HBM at the HBM copy rate, waited for before the kernels after it.
* **collectives**: ``latency + bytes × algorithm factor / bandwidth``, with the factor of a ring
  (n devices in the group; ``bytes`` the per-device result): all-reduce ``2(n−1)/n``, all-gather
  and all-to-all ``(n−1)/n``, reduce-scatter ``n−1`` (its result is the shard), permute and
  broadcast ``1``. The bandwidth is the link class the replica groups span: on TPU, the ICI links
  of each torus dimension the group's devices differ in (one link each way per dimension, both
  directions used when the dimension wraps around — the whole axis of a full pod/cube — and one
  when it is a line; the dimensions' bandwidths add); between slices, the chip's DCN; on GPU,
  NVLink when the group sits in one host (``gpus_per_host``), else the host network (one NIC per
  GPU). A DCN transfer (XLA's megascale ``send``) moves its bytes once.
* **overlap**: an asynchronous collective (``-start``/``-done``, an ``async-start`` wrapper, or
  XLA:TPU's start/continuation/done fusions) runs on a communication queue while the instructions
  scheduled between its start and its done compute; the done waits for it. Collectives share one
  queue, in issue order. This gives three figures: **overlapped** (every asynchronous collective
  hidden behind compute: ``max(compute + synchronous collectives, all collectives)``), **schedule**
  (the wait the schedule itself implies), and **serial** (nothing overlaps: compute + all
  collectives).

* **device time only**: the host's dispatch of the step and its wait for the result are not counted
  (0.6 ms of wall clock per step on the lent v5e, where each step was waited for).

What bounds the step is the part of the schedule figure that is largest: compute (FLOP-bound
kernels), memory bandwidth (byte-bound kernels), latency (kernels' fixed cost on TPU; kernel
launches on GPU are ``kernel launch``), the exposed time of
one link class (``ICI (data)``: the ICI of the collectives over mesh axis ``data``; ``DCN``;
``NVLink``; ``host network``) or exposed latency (many small collectives).

It assumes a program alone on its devices, each kernel at its class's rate, no host work, no
contention between collectives on shared links, and XLA's printed schedule: real steps take
longer (``bench/bench_step_time.py`` measures how much).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from stagetool.analysis.kernel_time import FROM_KERNEL, FROM_MODEL, LATENCY, is_cross_program_prefetch, kernel_time
from stagetool.hlo.collectives import Collective, program_frames
from stagetool.core.chips import Chip, step_figures
from stagetool.facts import Interconnect
from stagetool.hlo.parser import HloComputation, HloInstruction, HloModule, SourceFrame

__all__ = ["CollectiveTime", "InstructionTime", "StepTimeEstimate", "UncountedKernel", "algorithm_factor",
           "collective_time", "step_time"]

_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
                   "partition-id", "replica-id", "iota", "add-dependency", "domain", "copy-start", "copy-done",
                   "async-update", "send-done", "recv-done", "recv", "slice-start"})
_CONTROL = frozenset({"while", "conditional", "call"})
LOOP_ITERATION = "while-loop iteration"
"""The class of a ``while`` loop's own cost per iteration beyond its kernels (``class_rates`` ``loop_iterations``,
where the chip's profile measured it): a row named after the loop."""
_NO_KERNEL = frozenset({"copy-start", "send"})
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
          "collective-broadcast")

COMPUTE, MEMORY, LAUNCH = "compute", "memory bandwidth", "kernel launch"


@dataclasses.dataclass(frozen=True)
class CollectiveTime:
    """The estimated time of one collective, per execution (an estimate).

    Attributes:
      name / kind: the collective's HLO instruction and kind (:class:`Collective`).
      link: ``ICI``, ``DCN``, ``NVLink`` or ``host network``.
      mesh_axes: the mesh axes its groups span (None: not matched).
      group_size: devices per group (n).
      bytes_per_device: the per-device result buffer (bytes).
      factor: the algorithm's bytes moved per device ÷ ``bytes_per_device``.
      bandwidth_bytes_per_second: the bandwidth one device drives for it (bytes/s), or None.
      latency_seconds: the fixed cost (seconds).
      seconds: ``latency + bytes × factor / bandwidth``.
      executions: times it runs per step (loop trip counts multiplied; 1 when unknown).
      is_async: overlaps with the compute scheduled between its start and done.
      torus: on TPU, ``(dimension, chips along it, ring|line)`` per torus dimension it spans.
    """

    name: str
    kind: str
    link: str
    mesh_axes: tuple[str, ...] | None
    group_size: int
    bytes_per_device: int
    factor: float
    bandwidth_bytes_per_second: float | None
    latency_seconds: float
    seconds: float
    executions: int
    is_async: bool
    torus: tuple[tuple[int, int, str], ...] = ()

    @property
    def category(self) -> str:
        """The link class with its mesh axes (``ICI (data)``), the stacked bar's label."""
        return f"{self.link} ({', '.join(self.mesh_axes)})" if self.mesh_axes else self.link


@dataclasses.dataclass(frozen=True)
class InstructionTime:
    """One instruction's estimated time over the step (an estimate).

    Attributes:
      name / opcode / computation: the HLO instruction and where it sits.
      seconds: per execution (seconds); ``total_seconds`` = × ``executions`` (loop trip counts).
      flops / bytes_accessed: per execution (FLOPs, bytes), 0 for a collective.
      bound: ``compute``, ``memory bandwidth`` or the collective's link class.
      op_name: JAX's op name path, or None.
      source: ``file:line`` of the user's code, or None.
      via: when ``source`` is a thin helper (a line the step's instructions reach from two or more user
        lines, a one-line ``einsum`` wrapper), the lines it was called from, outward, up to the first
        that is not a helper (:func:`stagetool.analysis.callers.helper_callers`, as the collectives
        table shows them); () otherwise.
      kind: the kernel's class (``matmul bf16``, ``element-wise``, ``reduction``, ``top-k``...; a
        collective's kind for a collective), :class:`stagetool.analysis.kernel_time.KernelTime`.
      figure: where its figure comes from: ``model``, ``XLA estimated_cycles``, ``kernel cost_estimate``,
        ``floor: work not counted`` (a lower bound) or ``collective model``.
      xla_seconds: XLA:TPU's own ``estimated_cycles`` ÷ the chip clock, per execution, where the module
        carries one (beside the model's figure), else None.
    """

    name: str
    opcode: str
    computation: str
    seconds: float
    executions: int
    total_seconds: float
    flops: float
    bytes_accessed: float
    bound: str
    op_name: str | None
    source: str | None
    via: tuple[str, ...] = ()
    kind: str = ""
    figure: str = "model"
    xla_seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class UncountedKernel:
    """A kernel whose time the estimate knows only a floor of, so that the step time is "at least".

    Attributes:
      name: the HLO instruction; kind: what it is (``top-k``, ``Pallas kernel (Mosaic TPU)``, ``sort``...).
      source: ``file:line`` of the user's code that made it, or None.
      floor_seconds: what the estimate counts for it over the step (seconds, × runs).
      executions: times it runs per step.
      why: ``no model covers its work`` (counted at its bytes at the HBM peak), ``timed from its
        cost_estimate at the chip's full rates`` (a Pallas kernel: its own efficiency is unknown), or XLA:TPU's
        own cost model gives the fusion up (its ``estimated_cycles`` "unknown": timed by its class, a floor).
    """

    name: str
    kind: str
    source: str | None
    floor_seconds: float
    executions: int
    why: str = "no model covers its work"


@dataclasses.dataclass(frozen=True)
class StepTimeEstimate:
    """One device's step time on ``chip``: an ESTIMATE, as a range (see the module docstring).

    Attributes:
      chip: the chip table's name.
      overlapped_seconds / schedule_seconds / serial_seconds: the range, low to high, with the
        schedule's figure between (seconds per step).
      compute_seconds: Σ over computing instructions of ``max(FLOPs/peak, bytes/bandwidth)`` (+ launch).
      collective_seconds: Σ of every collective's time (hidden or not).
      parts: ``(category, seconds)`` of the schedule figure, largest first: ``compute``, ``memory
        bandwidth``, ``kernel launch``, each link class's exposed transfer time, exposed ``latency``;
        they add up to ``schedule_seconds``.
      bound: the largest part's category.
      top: the instructions that take longest over the step, longest first.
      collectives: every collective's time, in schedule order (each once).
      flops: FLOPs of one step on one device, loop bodies × trip counts (counted from the module).
      mfu: Σ over matmul kernels of FLOPs ÷ the chip's peak for the precision each ran at (int8, fp8,
        bf16; f32 as the bf16 passes XLA:TPU runs: one at DEFAULT, three at HIGH, six at HIGHEST), ÷
        ``schedule_seconds``: at most 1; ``mfu_peak`` says which peak. None where no peak is known.
      xla_optimal_seconds: XLA:TPU's own ``optimal_seconds`` from ``Compiled.cost_analysis()``
        (XLA's figure), or None where the backend gives none.
      assumptions: what the figures assume, one sentence each.
      reason: why a part is missing (unknown trip counts, no bandwidth for a link), or None.
      label: always ``"estimate"``.
      tokens_per_step: the spec's ``tokens_per_step`` (all devices together), or None.
      tokens_per_second_per_chip: ``tokens_per_step / schedule_seconds / chips`` (an estimate), or None.
      lower_bound: True when work is missing from the figures (``uncounted``, or a loop whose trip count
        is unknown counted once): the step takes **at least** the figures.
      uncounted: the kernels no model covers, in schedule order.
      sources: ``(figure source, seconds)`` of the kernels' time per step by where it comes from
        (``model``, ``XLA estimated_cycles``, ``kernel cost_estimate``, ``floor: work not counted``),
        largest first.
      xla_optimal_note: why XLA's ``optimal_seconds`` is not shown (negative, or a program with loops,
        whose bodies it counts once), or None.
    """

    chip: str
    overlapped_seconds: float
    schedule_seconds: float
    serial_seconds: float
    compute_seconds: float
    collective_seconds: float
    parts: tuple[tuple[str, float], ...]
    bound: str
    top: tuple[InstructionTime, ...]
    collectives: tuple[CollectiveTime, ...]
    flops: float
    mfu: float | None
    xla_optimal_seconds: float | None
    assumptions: tuple[str, ...]
    reason: str | None = None
    label: str = "estimate"
    tokens_per_step: int | None = None
    tokens_per_second_per_chip: float | None = None
    lower_bound: bool = False
    uncounted: tuple[UncountedKernel, ...] = ()
    sources: tuple[tuple[str, float], ...] = ()
    xla_optimal_note: str | None = None
    likely_seconds: tuple[float, float] | None = None
    """``(low, high)`` seconds per step: each kernel's time × its class's spread measured on the lent chip
    (:func:`class_spread`), collectives as estimated: where the step's time is likely to fall. A class not
    validated on the chip widens it (× 0.5 to × 2) and is named in ``not_validated``."""
    not_validated: tuple[str, ...] = ()
    """The kernel classes of the step whose spread was not validated on a chip (largest share first)."""
    mfu_peak: str = ""
    """Which peak ``mfu`` is against: ``the bf16 peak (197 TFLOP/s)``, ``the int8 peak (393 TOP/s)``, or for
    a step of several precisions ``each kernel's precision peak (bf16 62%, int8 38% of the FLOPs)``."""
    matmul_flops: float = 0.0
    """FLOPs of the step's matmul and convolution kernels and Pallas kernels' ``cost_estimate`` (loop bodies ×
    trip counts): MFU's numerator
    (element-wise and reduction FLOPs, which XLA:TPU's reduce-window rewrites can inflate, left out)."""
    chip_figures: tuple[tuple[str, float], ...] = ()
    """The chip's figures the estimate was computed with (:func:`stagetool.core.chips.step_figures`: rates,
    bandwidths, latencies, the matmul tile): what a snapshot records so that the gate tells a changed chip
    profile from a change of the code (issue 47)."""
    builtin_seconds: float | None = None
    """Where the chip's figures in force differ from stagetool's built-in table's for the chip (a spec's
    ``chips:`` entry, a calibrated profile): the same module's schedule figure timed with the built-in
    figures (seconds, an estimate), which no spec changes; else None. The gate compares the code's change
    with it when the two snapshots' profiles differ."""
    builtin_lower_bound: bool = False
    """``builtin_seconds`` is a lower bound (work no model covers), as :attr:`lower_bound`."""
    modelled_seconds: float | None = None
    """Where the step is a lower bound: the schedule figure with every counted kernel at the model's estimate
    (seconds); ``schedule_seconds``, the "at least" figure, takes each at the low end of its class's measured
    spread instead (a floor as it is), so that a kernel the model over-counts cannot put it above the truth.
    None where the step is no lower bound (then the two are one figure)."""


_UNVALIDATED = (0.5, 2.0)
"""The spread of a kernel class no chip measurement validated: × 0.5 to × 2 of its time."""
CLASS_SPREAD = {
    "tpu-v5e": {
        # (low, high) factors on a kernel's time that held the measured time of that class's kernels of the
        # validation suite's FIT half on the lent TPU v5e (bench/step_time_suite/kinds.yaml; per-kernel device
        # times from the profiler, bench/results/step_time_suite/; issue 46), by the rule of
        # bench/step_time_suite/table.py:spreads (printed by `table.py --spreads`): each kernel of a complete
        # estimate taking at least 2% of its program's time, 0.9 x the 10th percentile of measured / estimated
        # (at most 1) to 1.1 x the 90th (at least 1), at least 0.8 to 1.25 for a class of fewer than 3 programs.
        # The held-out half set none; a class the fit half has no kernel of (sort, scatter, vector-unit-bound
        # element-wise work, cross-program prefetch: the profiler times its copy-start, not its DMA) is not here:
        # not validated, x 0.5 to x 2, and named.
        "matmul": (0.8, 1.2),  # 13 kernels of 5 programs
        "convolution": (0.58, 1.28),  # 56 kernels of 7 programs
        "FFT": (0.8, 1.25),  # 17 kernels of 1 program (XLA's figure x xla_fft)
        "batched matmul": (0.74, 1.37),  # 2 kernels of 1 program
        "element-wise": (0.84, 1.83),  # 9 kernels of 4 programs
        "reduction": (0.85, 2.58),  # 7 kernels of 3 programs
        "cumulative": (0.8, 1.25),  # 1 kernel
        "gather": (0.8, 1.25),  # 3 kernels of 2 programs
        "copy": (0.79, 1.9),  # 9 kernels of 4 programs
        "random bits": (0.8, 1.25),  # 1 kernel
    },
}
"""Per chip, the measured spread of each kernel class (:func:`class_spread`); a class missing is not validated."""


def _family(kind: str) -> str:
    """The spread class of a kernel kind (``convolution bf16 (conv_dense)`` → ``convolution``)."""
    if "batched_matmul" in kind:
        return "batched matmul"
    if kind.startswith("FFT"):
        return "FFT"
    if kind.startswith(("matmul", "convolution")):
        return kind.split()[0]
    if "vector-unit" in kind:
        return "vector"
    if kind.startswith("cumulative"):
        return "cumulative"
    if kind.startswith(("copy", "XLA:TPU helper")):
        return "copy"
    return kind.split(" (")[0]


def class_spread(chip: Chip, kind: str) -> tuple[float, float, bool]:
    """``(low, high, validated)``: the factors on a kernel's time of class ``kind`` that held the measured
    time of that class on ``chip`` (:data:`CLASS_SPREAD`), or × 0.5 to × 2 and False for a class (or a chip)
    no measurement validated. A floor (top-k, a Pallas kernel) is never validated."""
    table = CLASS_SPREAD.get(chip.name, {})
    fam = _family(kind)
    if fam in table:
        lo, hi = table[fam]
        return lo, hi, True
    return _UNVALIDATED[0], _UNVALIDATED[1], False


def _precision_of(kind: str) -> str:
    """The matmul precision class of a kernel's kind (``matmul int8`` → ``int8``; ``convolution bf16+f32
    (conv_dense)`` → ``bf16``, the first; a Pallas kernel → ``bf16``)."""
    m = re.search(r"\b(int8|fp8|bf16|f32_highest|f32_high|f32)\b", kind)
    return m.group(1) if m else "bf16"


def _peak_text(chip: Chip, peaks: dict) -> str:
    from stagetool.core.units import format_count

    if not peaks:
        return (f"the bf16 peak ({format_count(chip.peak_flops_per_second_bf16, 'FLOP')}/s)"
                if chip.peak_flops_per_second_bf16 else "")
    if len(peaks) == 1:
        (prec, _), = peaks.items()
        peak = chip.precision_peak(prec)
        unit = "OP" if prec == "int8" else "FLOP"
        passes = {"f32": ", f32 as one bf16 pass", "f32_high": ", f32 HIGH as three bf16 passes",
                  "f32_highest": ", f32 HIGHEST as six bf16 passes"}.get(prec, "")
        return f"the {prec} peak ({format_count(peak, unit)}/s{passes})" if peak else ""
    total = sum(peaks.values())
    shares = ", ".join(f"{p} {v / total * 100:.0f}%" for p, v in sorted(peaks.items(), key=lambda kv: -kv[1]))
    return f"each kernel's precision peak ({shares} of the FLOPs)"


def algorithm_factor(kind: str, n: int) -> float:
    """Bytes one device moves over its links for a collective ÷ its per-device result bytes, for a
    ring of ``n`` devices: all-reduce ``2(n−1)/n``, all-gather / all-to-all ``(n−1)/n``,
    reduce-scatter ``n−1`` (the result is one shard), permute / broadcast / a DCN transfer ``1``;
    0 for a group of one."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all-gather", "all-to-all", "ragged-all-to-all"):
        return (n - 1) / n
    if kind == "reduce-scatter":
        return float(n - 1)
    return 1.0


def _synthetic_coords(net: Interconnect) -> tuple[tuple[int, ...], ...]:
    """Row-major mesh positions as coordinates: each mesh axis one torus dimension (no coords known)."""
    out = []
    for p in range(max(1, _prod(net.mesh_sizes))):
        c, rest = [], p
        for s in reversed(net.mesh_sizes):
            c.append(rest % s)
            rest //= s
        out.append(tuple(reversed(c)))
    return tuple(out)


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _ici(chip: Chip, net: Interconnect, groups) -> tuple[float | None, tuple[tuple[int, int, str], ...]]:
    """Bandwidth one device drives over ICI for groups of devices, and the torus dimensions spanned."""
    coords = net.device_coords or _synthetic_coords(net)
    shape = net.torus_shape or (tuple(net.mesh_sizes) if not net.device_coords else None)
    link = chip.ici_bandwidth_bytes_per_second_per_link
    if link is None or not groups:
        return None, ()
    group = groups[0]
    if any(d >= len(coords) for d in group):
        return None, ()
    members = [coords[d] for d in group]
    spans = []
    for dim in range(len(members[0])):
        values = {m[dim] for m in members}
        if len(values) > 1:
            full = shape[dim] if shape is not None and dim < len(shape) else None
            wrap = chip.ici_wraparound_multiple
            ring = full is not None and len(values) == full and wrap is not None and full % wrap == 0
            spans.append((dim, len(values), "ring" if ring else "line"))
    if not spans:
        return None, ()
    return sum(link * (2 if kind == "ring" else 1) for _, _, kind in spans), tuple(spans)


def collective_time(c: Collective, chip: Chip, net: Interconnect) -> CollectiveTime:
    """The estimated seconds of one execution of collective ``c`` on ``chip`` (see the module docstring)."""
    n = c.group_size or (len(c.replica_groups[0]) if c.replica_groups else 1)
    size = c.bytes_per_device or 0
    torus: tuple = ()
    if c.network == "dcn":
        link, bw, lat, factor = "DCN", chip.dcn_bandwidth_bytes_per_second, chip.dcn_latency_seconds, 1.0
    elif net.platform == "gpu" or (net.platform == "cpu" and chip.nvlink_bandwidth_bytes_per_second):
        per_host = chip.gpus_per_host or 8
        groups = c.replica_groups or ((tuple(d for pair in c.source_target_pairs for d in pair),)
                                      if c.source_target_pairs else ())
        hosts = net.process_of_device
        one_host = all(len({(hosts[d] if d < len(hosts) and net.platform == "gpu" else d // per_host)
                            for d in g}) <= 1 for g in groups)
        if one_host:
            link, bw, lat = "NVLink", chip.nvlink_bandwidth_bytes_per_second, chip.collective_latency_seconds
        else:
            link, bw, lat = "host network", chip.dcn_bandwidth_bytes_per_second, chip.dcn_latency_seconds
        factor = algorithm_factor(c.kind, n)
    else:
        groups = c.replica_groups
        if groups is None and c.source_target_pairs:
            groups = tuple((s, t) for s, t in c.source_target_pairs if s != t)[:1]
        bw, torus = _ici(chip, net, groups)
        link, lat, factor = "ICI", chip.collective_latency_seconds, algorithm_factor(c.kind, n)
        if c.kind == "collective-permute":
            factor = 1.0
    lat = lat or 0.0
    moved = size * factor
    seconds = 0.0 if moved == 0 and n <= 1 else lat + (moved / bw if bw else 0.0)
    return CollectiveTime(c.name, c.kind, link, c.mesh_axes, n, size, factor, bw, lat, seconds, 1, c.is_async, torus)


# ---------------------------------------------------------------------------------------- the walk


@dataclasses.dataclass
class _Walk:
    """Totals of one computation's schedule (per execution of it)."""

    schedule: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    sync_comm: float = 0.0
    flops: float = 0.0
    matmul_flops: float = 0.0
    peak_seconds: float = 0.0
    peaks: dict = dataclasses.field(default_factory=dict)
    low: float = 0.0
    high: float = 0.0
    least: float = 0.0  # each kernel at the low end of its class's spread, a floor as it is: what a "≥" may say
    unvalidated: dict = dataclasses.field(default_factory=dict)
    parts: dict = dataclasses.field(default_factory=dict)
    sources: dict = dataclasses.field(default_factory=dict)

    def add_source(self, key: str, seconds: float) -> None:
        if seconds > 0:
            self.sources[key] = self.sources.get(key, 0.0) + seconds

    def add_part(self, key: str, seconds: float) -> None:
        if seconds > 0:
            self.parts[key] = self.parts.get(key, 0.0) + seconds

    def absorb(self, other: _Walk, k: float) -> None:
        self.schedule += other.schedule * k
        self.compute += other.compute * k
        self.comm += other.comm * k
        self.sync_comm += other.sync_comm * k
        self.flops += other.flops * k
        self.matmul_flops += other.matmul_flops * k
        self.peak_seconds += other.peak_seconds * k
        self.low += other.low * k
        self.high += other.high * k
        self.least += other.least * k
        for key, v in other.unvalidated.items():
            self.unvalidated[key] = self.unvalidated.get(key, 0.0) + v * k
        for key, v in other.peaks.items():
            self.peaks[key] = self.peaks.get(key, 0.0) + v * k
        for key, v in other.parts.items():
            self.add_part(key, v * k)
        for key, v in other.sources.items():
            self.add_source(key, v * k)


class _Timer:
    def __init__(self, module: HloModule, chip: Chip, net: Interconnect, collectives: Sequence[Collective],
                 trips: dict[str, int | None]):
        self.module, self.chip, self.net, self.trips = module, chip, net, trips
        self.gpu = net.platform == "gpu" or (net.platform == "cpu" and not chip.is_tpu)
        self.items: dict[tuple[str, str], InstructionTime] = {}
        self.chains: dict[tuple[str, str], tuple[SourceFrame, ...]] = {}  # each item's source chain (innermost first)
        self.times: dict[str, CollectiveTime] = {}
        self.starts: dict[tuple[str, str], str] = {}  # (computation, instruction) -> collective key
        self.dones: dict[tuple[str, str], str] = {}
        self.sync: dict[tuple[str, str], str] = {}
        self.unknown_trips: list[str] = []
        self.kinds: dict[tuple[str, str], tuple[str, str, float | None]] = {}  # (kind, figure, xla seconds)
        self.floors: dict[tuple[str, str], str] = {}  # kernels known only by a floor: why
        self._index(collectives)

    def _callers(self) -> dict[str, tuple[str, HloInstruction]]:
        out: dict[str, tuple[str, HloInstruction]] = {}
        for comp in self.module.computations:
            for ins in comp.instructions:
                for callee in ins.called_computations:
                    out.setdefault(callee.lstrip("%"), (comp.name, ins))
        return out

    def _index(self, collectives: Sequence[Collective]) -> None:
        """Where each collective starts and ends in a scheduled computation: its own ``-start`` and
        ``-done``; the ``async-start``/``async-done`` around its wrapper; the first and last of the
        fusions XLA:TPU splits it over; or one place (synchronous)."""
        callers = self._callers()
        for c in collectives:
            key = f"{c.computation}/{c.name}"
            self.times[key] = collective_time(c, self.chip, self.net)
            wrapper = callers.get(c.computation)
            if wrapper is not None and wrapper[1].opcode in ("fusion", "async-start"):
                site = (wrapper[0], wrapper[1].name)
                ends = [callers.get(comp) for comp, _ in c.merged]
                ends = [(e[0], e[1].name) for e in ends if e is not None]
                done = self._async_done(site) if wrapper[1].opcode == "async-start" else None
                if ends:
                    self.starts[site], self.dones[ends[-1]] = key, key
                elif done is not None:
                    self.starts[site], self.dones[done] = key, key
                else:
                    self.sync[site] = key
            elif c.done_name is not None:
                self.starts[(c.computation, c.name)], self.dones[(c.computation, c.done_name)] = key, key
            elif c.network == "dcn":
                self.starts[(c.computation, c.name)] = key  # a send: waited for where its done is
                done = self._send_done(c.computation, c.name)
                if done is not None:
                    self.dones[done] = key
            else:
                self.sync[(c.computation, c.name)] = key

    def _send_done(self, comp_name: str, name: str) -> tuple[str, str] | None:
        comp = self.module.computation(comp_name)
        for ins in comp.instructions if comp else ():
            if ins.opcode == "send-done" and ins.operands and ins.operands[0] == name:
                return (comp.name, ins.name)
        return None

    def _async_done(self, site: tuple[str, str]) -> tuple[str, str] | None:
        comp = self.module.computation(site[0])
        for ins in comp.instructions if comp else ():
            if ins.opcode == "async-done" and ins.operands and ins.operands[0] == site[1]:
                return (comp.name, ins.name)
        return None

    def _source(self, ins: HloInstruction) -> str | None:
        from stagetool.analysis.callers import user_source

        return user_source(program_frames(self.module.source_stack(ins)))  # the user's line, not a library's

    def _note(self, comp: HloComputation, ins: HloInstruction, seconds: float, k: int, flops: float,
              moved: float, bound: str) -> None:
        key = (comp.name, ins.name)
        prev = self.items.get(key)
        execs = k + (prev.executions if prev else 0)
        md = ins.metadata
        kind, figure, xla = self.kinds.get(key, (ins.opcode, "collective model", None))
        self.items[key] = InstructionTime(ins.name, ins.opcode, comp.name, seconds, execs, seconds * execs, flops,
                                          moved, bound, md.op_name if md else None, self._source(ins), (),
                                          kind, figure, xla)
        if key not in self.chains:
            self.chains[key] = program_frames(self.module.source_stack(ins))

    def compute_time(self, comp: HloComputation, ins: HloInstruction) -> tuple[float, float, float, str, float, str]:
        """(seconds, fixed seconds, FLOPs, bound, bytes accessed, the larger of compute and memory
        bandwidth) of one kernel (:func:`~stagetool.analysis.kernel_time.kernel_time`); remembers its class
        and where its figure comes from."""
        kt = kernel_time(self.module, comp, ins, self.chip, gpu=self.gpu, cpu_program=self.net.platform == "cpu")
        fixed = kt.overhead_seconds if ins.opcode not in _NO_KERNEL else 0.0
        key = (comp.name, ins.name)
        self.kinds[key] = (kt.kind, kt.figure, kt.xla_seconds)
        if kt.uncounted:
            self.floors[key] = kt.floor_reason or "no model covers its work"
        side = COMPUTE if kt.compute_seconds > kt.memory_seconds else MEMORY
        return kt.seconds - kt.overhead_seconds, fixed, kt.flops, kt.bound, kt.bytes_accessed, side

    def walk(self, comp_name: str, k: int, depth: int = 0) -> _Walk:
        """Simulate one execution of a computation's schedule; ``k`` executions per step (for the top list)."""
        w = _Walk()
        comp = self.module.computation(comp_name)
        if comp is None or depth > 32:
            return w
        t = 0.0
        queue_free = 0.0
        pending: dict[str, float] = {}
        for ins in comp.instructions:
            site = (comp.name, ins.name)
            if site in self.sync or site in self.starts:
                key = self.sync.get(site) or self.starts[site]
                ct = self.times[key]
                begin = max(t, queue_free)
                end = queue_free = begin + ct.seconds
                w.comm += ct.seconds
                self._note(comp, ins, ct.seconds, k, 0.0, 0.0, ct.category)
                if site in self.sync:
                    w.sync_comm += ct.seconds
                    self._exposed(w, ct, end - t)
                    t = end
                else:
                    pending[key] = end
                continue
            if site in self.dones:
                key = self.dones[site]
                end = pending.pop(key, t)
                if end > t:
                    self._exposed(w, self.times[key], end - t)
                    t = end
                continue
            op = ins.opcode
            if (op in _FREE and not is_cross_program_prefetch(ins)) or op.endswith("-done"):
                continue
            if op in _CONTROL:
                sub = self._control(comp, ins, k, depth)
                w.absorb(sub, 1.0)
                t += sub.schedule
                continue
            seconds, launch, flops, bound, moved, side = self.compute_time(comp, ins)
            total = seconds + launch
            w.compute += total
            w.flops += flops
            kind, figure, _ = self.kinds[(comp.name, ins.name)]
            if kind.startswith(("matmul", "convolution", "FFT")) or figure == FROM_KERNEL:
                w.matmul_flops += flops
                prec = _precision_of(kind)
                peak = self.chip.precision_peak(prec)
                if peak:
                    w.peak_seconds += flops / peak
                    w.peaks[prec] = w.peaks.get(prec, 0.0) + flops
            lo, hi, validated = class_spread(self.chip, kind)
            w.low += total * lo
            w.high += total * hi
            w.least += total if (comp.name, ins.name) in self.floors else total * min(lo, 1.0)
            if not validated and total > 0:
                fam = _family(kind)
                w.unvalidated[fam] = w.unvalidated.get(fam, 0.0) + total
            w.add_part(side, seconds)
            w.add_part(LAUNCH if self.gpu else LATENCY, launch)
            w.add_source(self.kinds[(comp.name, ins.name)][1], total)
            t += total
            self._note(comp, ins, total, k, flops, moved, bound)
        for key, end in pending.items():  # a start whose done was not found: waited for at the end
            if end > t:
                self._exposed(w, self.times[key], end - t)
                t = end
        w.schedule = t
        return w

    def _control(self, comp: HloComputation, ins: HloInstruction, k: int, depth: int) -> _Walk:
        out = _Walk()
        if ins.opcode == "while":
            n = self.trips.get(ins.name)
            if n is None:
                self.unknown_trips.append(ins.name)
            n = 1 if n is None else n
            body = self.walk(ins.attributes.get("body", "").lstrip("%"), k * n, depth + 1)
            cond = self.walk(ins.attributes.get("condition", "").lstrip("%"), k * (n + 1), depth + 1)
            out.absorb(body, n)
            out.absorb(cond, n + 1)
            per = None if self.gpu else self.chip.class_rate("loop_iterations")
            if per and n > 0:  # each iteration's own cost beyond its kernels, at the rate calibrate measured
                out.absorb(self._iteration(comp, ins, 1.0 / per, k * n), n)
        elif ins.opcode == "conditional":
            branches = [self.walk(c.lstrip("%"), k, depth + 1) for c in ins.called_computations]
            if branches:
                out.absorb(max(branches, key=lambda b: b.schedule), 1.0)
        else:
            for c in ins.called_computations:
                out.absorb(self.walk(c.lstrip("%"), k, depth + 1), 1.0)
        return out

    def _iteration(self, comp: HloComputation, ins: HloInstruction, cost: float, executions: int) -> _Walk:
        """One iteration's fixed cost (seconds) of the ``while`` loop ``ins`` (:data:`LOOP_ITERATION`), a row of
        its own executed ``executions`` times per step."""
        it = _Walk(schedule=cost, compute=cost)
        lo, hi, validated = class_spread(self.chip, LOOP_ITERATION)
        it.low, it.high, it.least = cost * lo, cost * hi, cost * min(lo, 1.0)
        if not validated:
            it.unvalidated[_family(LOOP_ITERATION)] = cost
        it.add_part(LATENCY, cost)
        it.add_source(FROM_MODEL, cost)
        self.kinds[(comp.name, ins.name)] = (LOOP_ITERATION, FROM_MODEL, None)
        self._note(comp, ins, cost, executions, 0.0, 0.0, LATENCY)
        return it

    @staticmethod
    def _exposed(w: _Walk, ct: CollectiveTime, wait: float) -> None:
        """Split an exposed wait into the link's transfer time and its latency, in proportion."""
        if wait <= 0 or ct.seconds <= 0:
            return
        latency_share = min(wait, wait * ct.latency_seconds / ct.seconds)
        w.add_part(LATENCY, latency_share)
        w.add_part(ct.category, wait - latency_share)


def step_time(module: HloModule, chip: Chip, net: Interconnect, collectives: Sequence[Collective],
              trips: dict[str, int | None], *, xla_optimal_seconds: float | None = None,
              top: int = 10) -> StepTimeEstimate:
    """Estimate one device's step time on ``chip`` (see the module docstring for the model).

    Args:
      module: the parsed compiled module of one device (``StagedFunction.module``).
      chip: the chip's figures (:data:`stagetool.core.chips.CHIPS`, or the ``chips:`` entries).
      net: where the mesh's devices sit (torus coordinates on TPU, hosts on GPU).
      collectives: :func:`stagetool.hlo.collectives.find_collectives` of ``module`` over the
        same mesh (their groups, mesh axes, async pairs, DCN transfers).
      trips: trip count per ``while`` instruction (:func:`~stagetool.hlo.collectives.while_loops`).
      xla_optimal_seconds: XLA:TPU's ``optimal_seconds`` (``Compiled.cost_analysis()``), shown beside
        where it is a whole-program figure: positive, and the module has no ``while`` loop (XLA counts a
        loop body once); otherwise left out and ``xla_optimal_note`` says why.
      top: how many instructions to list.

    Returns:
      A :class:`StepTimeEstimate` (seconds per step, one device). Never raises on odd modules:
      an unknown trip count counts once and is named in ``reason``; work no model covers is named in
      ``uncounted`` and makes ``lower_bound`` True.
    """
    timer = _Timer(module, chip, net, collectives, trips)
    entry = module.entry_name or ""
    w = timer.walk(entry, 1)
    overlapped = max(w.compute + w.sync_comm, w.comm)
    serial = w.compute + w.comm
    schedule = min(max(w.schedule, overlapped), serial)
    parts = tuple(sorted(((k, v) for k, v in w.parts.items()), key=lambda kv: (-kv[1], kv[0])))
    bound = parts[0][0] if parts else COMPUTE
    items = sorted(_with_callers(timer), key=lambda i: (-i.total_seconds, i.computation, i.name))
    # each kernel's FLOPs over the peak of the precision it ran at (int8, fp8, bf16, f32 as bf16 passes)
    mfu = min(1.0, w.peak_seconds / schedule) if schedule > 0 and w.peak_seconds > 0 else (
        0.0 if schedule > 0 and chip.peak_flops_per_second_bf16 else None)
    mfu_peak = _peak_text(chip, w.peaks)
    reasons = []
    if timer.unknown_trips:
        reasons.append("trip count unknown for " + ", ".join(sorted(set(timer.unknown_trips)))
                       + ": counted once")
    missing = sorted({ct.category for ct in timer.times.values() if ct.bandwidth_bytes_per_second is None
                      and ct.bytes_per_device and ct.group_size > 1})
    if missing:
        reasons.append(f"no bandwidth for {', '.join(missing)} on {chip.name}: those collectives count their "
                       "latency only")
    unmodelled = _parts_without_figures(chip)
    if unmodelled:
        reasons.append(unmodelled)
        mfu = None  # a step with a part left out is faster than the chip can run it: no utilisation of it
    lower_bound, modelled = bool(timer.floors or timer.unknown_trips or unmodelled), schedule
    if lower_bound:
        # "at least" must hold whatever the kernels' model over-counts (held-back round 1's ragged_moe_train: a
        # ragged dot's gradient counted 10x printed '≥ 18.2 ms' for 5.88 measured): each counted kernel at the
        # low end of its class's measured spread, each floor as it is, the exposed collectives as estimated
        exposed = max(w.schedule - w.compute, 0.0)
        serial = min(serial, w.least + w.comm)
        overlapped = min(overlapped, max(w.least + w.sync_comm, w.comm))
        schedule = min(schedule, max(min(w.schedule, w.least + exposed), overlapped), serial)
        if mfu:
            mfu = min(1.0, w.peak_seconds / schedule) if schedule > 0 else mfu
    by_key = {(i.computation, i.name): i for i in items}
    uncounted = tuple(UncountedKernel(by_key[k].name, timer.kinds[k][0], by_key[k].source, by_key[k].total_seconds,
                                      by_key[k].executions, why) for k, why in timer.floors.items() if k in by_key)
    if uncounted:
        reasons.append(f"at least this: {len(uncounted)} kernel{'s' if len(uncounted) != 1 else ''} counted at a floor "
                       f"({', '.join(sorted({u.kind for u in uncounted}))}): their real time is unknown")
    xla, xla_note = xla_optimal_seconds, None
    if xla is not None and xla <= 0:
        xla, xla_note = None, "XLA's optimal_seconds is not positive for this program: not a figure"
    elif xla is not None and any(i.opcode == "while" for c in module.computations for i in c.instructions):
        xla, xla_note = None, "XLA's optimal_seconds left out: it counts each while-loop body once"
    sources = tuple(sorted(w.sources.items(), key=lambda kv: (-kv[1], kv[0])))
    # the likely range: each kernel's time × its class's measured spread, collectives as they are
    comm = modelled - w.compute if modelled > w.compute else 0.0
    # (a lower bound's low end is its "at least": each counted kernel's low end there already, a floor no lower)
    likely = (schedule if lower_bound else w.low + comm, max(w.high + comm, modelled))
    unvalidated = tuple(k for k, _ in sorted(w.unvalidated.items(), key=lambda kv: (-kv[1], kv[0])))
    return StepTimeEstimate(
        chip.name, overlapped, schedule, serial, w.compute, w.comm, parts, bound, tuple(items[:top]),
        tuple(timer.times.values()),
        w.flops, mfu, xla, _assumptions(chip, net), "; ".join(reasons) or None,
        lower_bound=lower_bound, uncounted=uncounted, sources=sources,
        xla_optimal_note=xla_note, matmul_flops=w.matmul_flops, mfu_peak=mfu_peak,
        likely_seconds=likely, not_validated=unvalidated, chip_figures=step_figures(chip),
        modelled_seconds=modelled if lower_bound else None)


def _parts_without_figures(chip: Chip) -> str | None:
    """Why a part of every kernel's time is left out (a ``chips:`` entry that gives no FLOP rate, or
    no HBM bandwidth): the model counts that part as 0 s, so the step time is a lower bound; None
    when the chip has both."""
    missing = []
    if chip.matmul_rate("bf16") is None:
        missing.append(("compute", "no FLOP rate", "peak_flops_per_second_bf16 or matmul_flops_per_second"))
    if chip.hbm_bandwidth_bytes_per_second is None and chip.hbm_copy_bytes_per_second is None:
        missing.append(("memory", "no HBM bandwidth", "hbm_bandwidth_bytes_per_second"))
    if not missing:
        return None
    return "; ".join(f"{what} for {chip.name}: each kernel's {part} time is left out (counted as 0 s); give "
                     f"chips.{chip.name}.{field}" for part, what, field in missing)


def _with_callers(timer: _Timer) -> list[InstructionTime]:
    """The timer's items, each with :attr:`InstructionTime.via` where its source is a thin helper of the
    step (helpers found over every timed instruction's user frames)."""
    from stagetool.analysis.callers import helper_callers, user_frames
    from stagetool.core.paths import library_dirs

    library = library_dirs()
    keys = list(timer.items)
    items = [timer.items[k] for k in keys]
    vias = helper_callers([i.source for i in items], [user_frames(timer.chains.get(k, ()), library) for k in keys])
    return [dataclasses.replace(i, via=via) if via else i for i, via in zip(items, vias)]


def _assumptions(chip: Chip, net: Interconnect) -> tuple[str, ...]:
    rates = "its calibrated profile's measured rates" if chip.profile else "its peak FLOP/s and HBM bandwidth"
    out = [f"each kernel at its class's rate on {chip.name} ({rates}), compute or bytes whichever binds, plus a "
           "fixed cost per kernel",
           "collectives on ring algorithms at full link bandwidth, one at a time, with no contention"]
    if net.platform == "cpu":
        out.append(f"the CPU mesh's program (XLA:CPU's compile) timed as if on {chip.name}"
                   + ("; each mesh axis taken as one torus dimension" if chip.is_tpu else
                      f"; {chip.gpus_per_host or 8} devices per NVLink host"))
    elif chip.is_tpu and not net.device_coords:
        out.append("no device coordinates: each mesh axis taken as one torus dimension")
    assumed = sorted({f for f, kind, _ in chip.provenance if kind == "assumption"
                      and (f != "kernel_launch_seconds" or net.platform != "tpu")})
    if assumed:
        out.append(f"{chip.name}: assumed (not published): {', '.join(assumed)}")
    return tuple(out)
