"""Work XLA's cost analysis does not count: Pallas kernels, top-k and other custom calls.

XLA's ``HloCostAnalysis`` (behind ``Compiled.cost_analysis()``) knows the arithmetic of HLO's own
opcodes. A ``custom-call`` is opaque to it: it counts no FLOPs for one (XLA:CPU records its -1
"unknown" for each, summed into the total; XLA:TPU records nothing), so a program with a Pallas
kernel, a ``lax.top_k`` (the ``TopK`` custom call) or a LAPACK call reports fewer FLOPs than it does.
Two exceptions are counted:

* a Pallas TPU kernel (``tpu_custom_call``, Mosaic) whose ``pallas_call`` was given a
  ``cost_estimate``: XLA:TPU adds the kernel author's ``CostEstimate`` (read here from the
  instruction's ``backend_config``: ``custom_call_config.cost_estimate``). The figure is the
  author's estimate, not a count;
* XLA:GPU's cuBLAS/cuBLASLt GEMM calls (``__cublas$gemm``, ``__cublas$lt$matmul``) and cuDNN
  convolutions (``__cudnn$conv…``): XLA:GPU's cost model counts them. Where the GPU backend reports
  no cost analysis (a compile-only ``--topology h100:8``), stagetool derives the per-device figures
  from the module (:func:`stagetool.hlo.loops.counted_cost`) and counts these calls itself, a GEMM
  from its operand shapes and its backend config's contracting dimensions, a convolution from its
  shapes, window and ``feature_group_count``: they are then listed with :data:`LIBRARY_DERIVED`
  and their FLOPs. Any other cuBLAS/cuDNN call (cuDNN's fused attention, a triangular solve) is
  not counted.

A ``sort`` is counted by XLA with its own rule (elements × log2 of the elements, measured:
1,024 × 4,096 f32 sorted along the last axis → 92,274,688 FLOPs = 4,194,304 × 22); the comparator's
own work is not, so sorts are listed as counted by that rule.

Each instruction found is a :class:`UncountedWork` row with its user source line; renderers list
them beside the cost table and say the FLOP total is a lower bound when any is not counted.
"""

from __future__ import annotations

import dataclasses
import math

from stagetool.analysis.cost import CostRecord
from stagetool.hlo.loops import is_library_matmul, kernel_cost_estimate, library_call_flops
from stagetool.hlo.parser import (
    HloComputation,
    HloInstruction,
    HloModule,
    array_leaves,
    shape_bytes,
)

NOT_COUNTED = "not counted by XLA"
"""``UncountedWork.status`` of an instruction XLA's cost analysis gives no FLOPs."""
KERNEL_ESTIMATE = "counted from the kernel's cost_estimate"
"""``UncountedWork.status`` of a Pallas TPU kernel whose ``CostEstimate`` XLA:TPU adds."""
SORT_RULE = "counted by XLA's sort rule (elements × log2 elements)"
"""``UncountedWork.status`` of a ``sort``: XLA counts comparisons by its rule, not the comparator."""
LIBRARY_DERIVED = "counted by stagetool from the call's shapes (derived)"
"""``UncountedWork.status`` of a cuBLAS GEMM or cuDNN convolution call whose FLOPs stagetool derived
from its shapes, window and feature groups (a GPU target whose backend reports no cost analysis)."""

# custom calls that move, annotate or reshape data and do no arithmetic: nothing is missing
_NO_WORK = frozenset({
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "AllocateBuffer", "annotate_device_placement",
    "MoveToHost", "MoveToDevice", "LayoutConstraint", "PadToStatic", "SliceToDynamic", "SetBound",
    "X64Combine", "X64SplitLow", "X64SplitHigh", "Pin", "Unpin", "CreateBuffer", "TopologyAwareBarrier",
    # XLA:TPU's mark on a gather's indices (every jnp indexing, an embedding lookup): s32[n] in, the same out
    "AssumeGatherIndicesInBound",
    # XLA:TPU's wrappers of an asynchronous collective (an all-gather it runs across a loop's iterations)
    "AsyncCollectiveStart", "AsyncCollectiveDone",
})
XLA_HELPERS: dict[str, str] = {
    "GatherScatterIndicesBitpacked": "XLA:TPU helper: packs a gather's or scatter's indices into bits",
    "ConcatBitcast": "XLA:TPU helper: a concatenate done as a bitcast of adjacent buffers",
    "AssumeGatherIndicesInBound": "XLA:TPU helper: marks a gather's indices in bounds",
    "X64SplitLow": "XLA:TPU helper: the low halves of a 64-bit array (c64's real parts)",
    "X64SplitHigh": "XLA:TPU helper: the high halves of a 64-bit array (c64's imaginary parts)",
    "X64Combine": "XLA:TPU helper: a 64-bit array (c64) made from its two halves",
}
"""Custom calls XLA:TPU's own passes insert that do trivial work (move or re-mark a few bytes), by
target: what each is. They are not uncounted work: the step-time model times them as data movement
and they do not make a figure a lower bound."""

_KINDS = (
    ("__cudnn$conv", "cuDNN convolution"),
    ("__cublas$lt$matmul", "cuBLASLt GEMM"),
    ("__cublas$gemm", "cuBLAS GEMM"),
    ("__cudnn$fmha", "cuDNN fused attention"),
    ("__cudnn$", "cuDNN call"),
    ("__cublas$", "cuBLAS call"),
    ("__cub$", "CUB call (sort)"),
    ("cu_threefry2x32", "threefry random bits (CUDA kernel)"),
    ("tpu_custom_call", "Pallas kernel (Mosaic TPU)"),
    ("__gpu$xla.gpu.triton", "Pallas kernel (Triton)"),
    ("mosaic_gpu", "Pallas kernel (Mosaic GPU)"),
    ("TopK", "top-k"),
    ("__gpu$TopK", "top-k"),
    ("ApproxTopK", "approximate top-k"),
    ("PartialReduce", "approximate top-k"),
    ("lapack_", "LAPACK call"),
    ("cusolver", "cuSOLVER call"),
    ("xla_python_", "host callback"),
    ("xla_ffi_python_", "host callback"),
)


@dataclasses.dataclass(frozen=True)
class UncountedWork:
    """One instruction of the compiled (per-device) module whose work XLA does not count, or counts
    only from an estimate.

    Attributes:
      instruction: the HLO instruction's name.
      kind: what it is: ``Pallas kernel (Mosaic TPU)``, ``top-k``, ``sort``, ``custom call FOO``...
      target: the ``custom_call_target`` (``sort`` for a sort).
      status: :data:`NOT_COUNTED`, :data:`KERNEL_ESTIMATE` or :data:`SORT_RULE`.
      flops: FLOPs XLA added for it, per execution, one device: the kernel's ``cost_estimate``
        (an author's estimate) or the sort rule's figure; None when not counted.
      bytes_accessed: bytes of the kernel's ``cost_estimate`` (per execution, one device), or None.
      output_bytes: bytes of its result (per execution, one device), or None when the shape is unknown.
      op_name: JAX's op name (``jit(f)/pallas_call``), or None.
      source: ``file:line`` of the user's code that made it, or None.
    """

    instruction: str
    kind: str
    target: str
    status: str
    flops: float | None
    bytes_accessed: float | None
    output_bytes: int | None
    op_name: str | None
    source: str | None

    @property
    def counted(self) -> bool:
        """Whether XLA's total includes a figure for it (an estimate: the kernel's or the sort rule's)."""
        return self.status != NOT_COUNTED


def custom_call_kind(target: str) -> str:
    """What a custom call is, by its target: ``Pallas kernel (Mosaic TPU)``, ``top-k``, an XLA:TPU
    helper's description (:data:`XLA_HELPERS`), ``custom call FOO``..."""
    if target in XLA_HELPERS:
        return XLA_HELPERS[target]
    return _kind(target)


def is_trivial_custom_call(target: str) -> bool:
    """A custom call that only moves, annotates or re-marks data (``Sharding``, ``MoveToHost``, XLA:TPU's
    helpers): no work is missing from a figure for it."""
    return target in _NO_WORK or target in XLA_HELPERS


def pallas_cost_estimate(ins: HloInstruction) -> tuple[float | None, float | None]:
    """``(flops, bytes_accessed)`` of a Pallas TPU kernel's ``cost_estimate`` (the author's estimate, per
    execution; :func:`stagetool.hlo.loops.kernel_cost_estimate`), or ``(None, None)`` when its
    ``pallas_call`` was given none."""
    est = kernel_cost_estimate(ins)
    return (_as_float(est.get("flops")), _as_float(est.get("bytes_accessed"))) if est else (None, None)


def _kind(target: str) -> str:
    for prefix, kind in _KINDS:
        if target.startswith(prefix):
            return kind
    return f"custom call {target}"


def _kernel_estimate(ins: HloInstruction) -> dict | None:
    return kernel_cost_estimate(ins)


def _as_float(v: object) -> float | None:
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _recorded(module: HloModule, comp: HloComputation, ins: HloInstruction) -> HloInstruction:
    """``ins``, or where XLA dropped its metadata (XLA:GPU's ``__gpu$TopK`` keeps none) the first
    ``get-tuple-element`` of it that kept JAX's op name and source: the same op's result."""
    md = ins.metadata
    if md is not None and (md.op_name or md.stack_frame_id is not None):
        return ins
    for user in comp.instructions:
        umd = user.metadata
        if (user.opcode == "get-tuple-element" and user.operands[:1] == (ins.name,) and umd is not None
                and umd.op_name and umd.stack_frame_id is not None):
            return user
    return ins


def _source(module: HloModule, ins: HloInstruction) -> str | None:
    from stagetool.hlo.collectives import frames_by_op_name

    from stagetool.analysis.callers import user_source

    return user_source(frames_by_op_name(module, ins))  # the user's line, not a library's


def _sort_flops(module: HloModule, ins: HloInstruction) -> float | None:
    leaves = array_leaves(ins.shape)
    if not leaves:
        return None
    n = leaves[0].element_count
    return float(n * math.ceil(math.log2(n))) if n > 1 else 0.0


def uncounted_work(module: HloModule, *, derived: bool = False) -> tuple[UncountedWork, ...]:
    """Every instruction of ``module`` (a compiled, per-device module: every computation, fusion and
    loop bodies included) whose work XLA's cost analysis leaves out or counts from an estimate, in
    text order. Custom calls that only move or annotate data (``Sharding``, ``MoveToHost``...) and
    XLA:TPU's own helper calls (:data:`XLA_HELPERS`) are not listed. XLA:GPU's cuBLAS GEMM and cuDNN convolution calls are counted by XLA:GPU's cost
    model, and not listed; with ``derived`` (the per-device figures are stagetool's count of the
    module, the backend having reported none) they are listed as :data:`LIBRARY_DERIVED` with the
    FLOPs stagetool counted for them (:func:`stagetool.hlo.loops.library_call_flops`)."""
    out = []
    for comp in module.computations:
        for ins in comp.instructions:
            if ins.opcode == "sort":
                target, kind = "sort", "sort"
                status, flops, moved = SORT_RULE, _sort_flops(module, ins), None
            elif ins.opcode == "custom-call" and is_library_matmul(ins):
                if not derived:
                    continue
                target = (ins.attributes.get("custom_call_target") or "?").strip('"')
                kind, status, flops, moved = _kind(target), LIBRARY_DERIVED, library_call_flops(comp, ins), None
            elif ins.opcode == "custom-call":
                target = (ins.attributes.get("custom_call_target") or "?").strip('"')
                if target in _NO_WORK or target in XLA_HELPERS:
                    continue
                kind = _kind(target)
                est = _kernel_estimate(ins) if target == "tpu_custom_call" else None
                status = KERNEL_ESTIMATE if est else NOT_COUNTED
                flops = _as_float(est.get("flops")) if est else None
                moved = _as_float(est.get("bytes_accessed")) if est else None
            else:
                continue
            recorded = _recorded(module, comp, ins)
            md = recorded.metadata
            out.append(UncountedWork(ins.name, kind, target, status, flops, moved, shape_bytes(ins.shape),
                                     md.op_name if md else None, _source(module, recorded)))
    return tuple(out)


def not_counted(rows: tuple[UncountedWork, ...]) -> tuple[UncountedWork, ...]:
    """The rows XLA's total has nothing for (:data:`NOT_COUNTED`)."""
    return tuple(r for r in rows if r.status == NOT_COUNTED)


def unknown_not_zero(record: CostRecord, rows: tuple[UncountedWork, ...]) -> CostRecord:
    """``record`` (one device's cost) with the reason of an absent FLOPs or bytes figure saying that
    XLA did not count the listed instructions (the figure is unknown, not the "usually 0" of a plain
    absent key), and XLA:CPU's -1 "unknown" FLOPs of a lone uncounted call no longer a suspect figure.
    Unchanged when no row is :data:`NOT_COUNTED`."""
    missing = not_counted(rows)
    if not missing:
        return record
    why = (f"XLA's cost analysis does not count {len(missing)} instruction{'s' if len(missing) != 1 else ''} "
           f"({', '.join(sorted({r.kind for r in missing}))}): unknown, not 0")
    absent = [(f, why if f in ("flops", "bytes_accessed") else r) for f, r in record.absent_reasons]
    fields = {}
    for field in ("flops", "bytes_accessed"):  # XLA:CPU's -1 "unknown" of a program of nothing else
        v = getattr(record, field)
        if v is not None and v < 0:
            fields[field] = None
            absent.append((field, why))
    if fields:
        fields["arithmetic_intensity_flops_per_byte"] = None
    suspects = tuple(s for s in record.suspects
                     if not (s.field in ("flops", "bytes_accessed") and s.reason.startswith(("negative", "'bytes accessed' absent"))))
    return dataclasses.replace(record, absent_reasons=tuple(absent), suspects=suspects, **fields)
