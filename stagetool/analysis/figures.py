"""One function's figures, derived once from its analysis (:meth:`Figures.of`), per device.

The snapshot's ``memory`` and ``cost`` are :class:`MemoryFigures` and :class:`CostFigures` as JSON
(:mod:`stagetool.gate.snapshot`), the gate compares their fields (:data:`MEMORY_FIELDS`,
:data:`COST_FIELDS`), a sweep row's figures are :meth:`Figures.row`; what stands for the loop-aware
FLOPs where there is no estimate is said once (:func:`flops_estimate`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from stagetool.core.codec import omitted

if TYPE_CHECKING:
    from stagetool.analysis.sections import CollectivesSection, CostSection, MemorySection


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
    """Memory of one device in bytes (:class:`~stagetool.analysis.memory.MemoryRecord`: XLA's figures, the
    gated peak, the host peak apart; jax/jaxlib 0.11+'s own three where XLA gives them, never compared)."""

    argument_bytes: float | None = None
    output_bytes: float | None = None
    alias_bytes: float | None = None
    temp_bytes: float | None = None
    peak_bytes: float | None = None
    host_peak_bytes: float | None = None
    peak_unpadded_heap_bytes: float | None = omitted(None)
    total_allocation_bytes: float | None = omitted(None)
    indefinite_allocations: float | None = omitted(None)


@dataclasses.dataclass(frozen=True)
class CostFigures:
    """One device's cost: XLA's FLOPs, transcendentals and bytes accessed (``Compiled.cost_analysis()``)
    and ``loop_aware_flops``, the derived estimate with each loop body × its trip count, or None."""

    flops: float | None = None
    transcendentals: float | None = None
    bytes_accessed: float | None = None
    loop_aware_flops: float | None = None



def flops_estimate(loop_aware: float | None, xla: float | None) -> float | None:
    """The FLOPs a figure stands on (the snapshot's ``loop_aware_flops``, ``--rank-by flops``): the
    loop-aware estimate, XLA's per-device FLOPs where there is none."""
    return loop_aware if loop_aware is not None else xla


#: what the gate compares: memory (``alias_bytes``: more is better), XLA's cost, and the loop-aware
#: FLOPs (a deeper ``scan`` is a change); jax 0.11+'s memory fields are recorded, never compared
MEMORY_FIELDS = tuple(f.name for f in dataclasses.fields(MemoryFigures) if not f.metadata.get("omit"))
COST_FIELDS, DERIVED_COST_FIELDS = ("flops", "transcendentals", "bytes_accessed"), ("loop_aware_flops",)


@dataclasses.dataclass(frozen=True)
class Figures:
    """The figures of one function, per device, each None when its section was not taken: memory and
    cost, the device's capacity (where it comes from, whether the peak fits), the while loops, the
    ``--chip`` roofline (an estimate), the collective bytes per step (known runs; by mesh axes; those
    of unknown runs left out and counted) and, on a multi-slice job, the bytes between slices."""

    memory: MemoryFigures | None = None
    cost: CostFigures | None = None
    capacity_bytes: int | None = None
    capacity_source: str | None = None
    fits: bool | None = None
    while_loops: int | None = None
    chip: str | None = None
    roofline_step_seconds: float | None = None
    roofline_bound: str | None = None
    collective_bytes_per_step: int | None = None
    collective_bytes_per_step_by_mesh_axes: dict[str, int] | None = None
    collectives_unknown_runs: int | None = None
    dcn_bytes_per_step: int | None = None

    @classmethod
    def of(cls, cost: CostSection | None, memory: MemorySection | None,
           collectives: CollectivesSection | None) -> Figures:
        out: dict[str, Any] = {}
        if memory is not None:
            m = memory.record
            out.update(memory=MemoryFigures(**{f.name: getattr(m, f.name) for f in dataclasses.fields(MemoryFigures)}),
                       capacity_bytes=memory.capacity_bytes, capacity_source=memory.capacity_source,
                       fits=memory.verdict.fits)
        if cost is not None:
            c, aware = cost.per_device, cost.loop_aware
            out.update(cost=CostFigures(c.flops, c.transcendentals, c.bytes_accessed,
                                        aware.flops if aware is not None else None),
                       while_loops=len(cost.loop_trip_counts))
            if cost.roofline is not None:
                r = cost.roofline
                out.update(chip=r.chip, roofline_step_seconds=r.lower_bound_seconds, roofline_bound=r.bound)
        if collectives is not None:
            s = collectives.summary
            out.update(collective_bytes_per_step=s.total.executed_bytes_per_device,
                       collective_bytes_per_step_by_mesh_axes={_axes_key(t.mesh_axes): t.executed_bytes_per_device
                                                               for t in s.by_mesh_axes},
                       collectives_unknown_runs=s.total.unknown_executions_count,
                       dcn_bytes_per_step=s.dcn_bytes_per_step)
        return cls(**out)

    def row(self) -> dict[str, Any]:
        """The figures as a sweep row (:class:`stagetool.sweep.rows.Row`) holds them."""
        m, c = self.memory or MemoryFigures(), self.cost or CostFigures()
        return {"peak_bytes_per_device": m.peak_bytes, "host_peak_bytes_per_device": m.host_peak_bytes,
                "capacity_bytes_per_device": self.capacity_bytes, "capacity_source": self.capacity_source,
                "fits": self.fits, "collective_bytes_per_step": self.collective_bytes_per_step,
                "collective_bytes_per_step_by_mesh_axes": self.collective_bytes_per_step_by_mesh_axes,
                "collectives_unknown_runs": self.collectives_unknown_runs,
                "dcn_bytes_per_step": self.dcn_bytes_per_step, "flops_per_device_xla": c.flops,
                "flops_per_device_loop_aware": c.loop_aware_flops, "while_loops": self.while_loops,
                "chip": self.chip, "roofline_step_seconds": self.roofline_step_seconds,
                "roofline_bound": self.roofline_bound}


def _axes_key(axes: tuple[str, ...] | None) -> str:
    if axes is None:
        return "(unmatched)"
    return ",".join(axes) if axes else "(no axes)"
