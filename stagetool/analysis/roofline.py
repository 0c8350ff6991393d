"""A roofline lower bound on one device's step time, from the chip table and the cost analysis."""

from __future__ import annotations

import dataclasses

from stagetool.core.chips import Chip
from stagetool.core.errors import UsageError


@dataclasses.dataclass(frozen=True)
class RooflineEstimate:
    """A lower bound on one device's run time from the roofline model -- an ESTIMATE.

    ``compute_seconds = flops_per_device / peak_flops_per_second``;
    ``memory_seconds = bytes_accessed_per_device / hbm_bandwidth_bytes_per_second``, the bytes being
    those that move through HBM: XLA's bytes accessed less what it counts for arrays in XLA:TPU's
    on-chip vector memory (``on_chip_bytes``: a cross-program prefetch's copy into VMEM and the reads of
    the prefetched array, which XLA counts 5 times over for the one read of HBM);
    ``lower_bound_seconds = max(compute_seconds, memory_seconds)``. It ignores communication,
    overlap limits, launch overheads and the gap between peak and achieved throughput, so a
    real step takes longer.

    Attributes:
      chip: chip name.
      dtype: ``"bf16"`` or ``"f32"`` (which peak FLOP/s was used).
      flops_per_device: FLOPs of one device's program: the loop-aware estimate (XLA's
        ``Compiled.cost_analysis()`` figure with each loop body × its trip count), or None.
      bytes_accessed_per_device: HBM bytes read and written by one device's program (XLA's bytes
        accessed, loop-aware, less ``on_chip_bytes``), or None.
      peak_flops_per_second: the chip's peak for ``dtype``, or None.
      hbm_bandwidth_bytes_per_second: the chip's HBM bandwidth, or None.
      compute_seconds, memory_seconds, lower_bound_seconds: seconds, or None.
      bound: ``"compute"`` or ``"memory"`` (which term dominates; compute on a tie), or None.
      reason: why some figure is None (None when all are present).
      label: always ``"estimate"``.
      on_chip_bytes: the bytes of XLA's bytes accessed left out as arrays in on-chip memory (VMEM,
        layout ``S(1)``; :func:`stagetool.hlo.loops.on_chip_bytes`), 0 where there are none.
    """

    chip: str
    dtype: str
    flops_per_device: float | None
    bytes_accessed_per_device: float | None
    peak_flops_per_second: float | None
    hbm_bandwidth_bytes_per_second: float | None
    compute_seconds: float | None
    memory_seconds: float | None
    lower_bound_seconds: float | None
    bound: str | None
    reason: str | None = None
    label: str = "estimate"
    on_chip_bytes: float = 0.0


def roofline(chip: Chip, *, flops_per_device: float | None, bytes_accessed_per_device: float | None,
             dtype: str = "bf16", flops_suspect: str | None = None,
             bytes_suspect: str | None = None, on_chip_bytes: float = 0.0) -> RooflineEstimate:
    """Roofline lower bound of one device's run time on ``chip``.

    Args:
      chip: from :func:`get_chip` / :data:`CHIPS`.
      flops_per_device: FLOPs of the per-device program (``Compiled.cost_analysis()['flops']``).
      bytes_accessed_per_device: its ``'bytes accessed'`` (bytes).
      on_chip_bytes: the part of them that XLA counts for arrays in on-chip memory (bytes), left out
        of the memory term: they move no HBM bytes.
      dtype: ``"bf16"`` or ``"f32"``: which peak FLOP/s applies.
      flops_suspect / bytes_suspect: why the cost analysis' FLOPs / bytes were flagged as suspect;
        such a figure is no input (pass None for it) and ``reason`` says why its term is missing.

    Returns:
      A :class:`RooflineEstimate`; terms whose inputs are missing (or negative) are None and
      ``reason`` says which. ``lower_bound_seconds``/``bound`` need both terms.

    Raises:
      UsageError: ``dtype`` is not ``"bf16"`` or ``"f32"``.
    """
    if dtype not in ("bf16", "f32"):
        raise UsageError(f"unknown roofline dtype {dtype!r}", hint="use bf16 or f32")
    peak = chip.peak_flops_per_second_bf16 if dtype == "bf16" else chip.peak_flops_per_second_f32
    bw = chip.hbm_bandwidth_bytes_per_second
    reasons = []
    compute = memory = None
    if flops_suspect:
        reasons.append(f"FLOPs left out, flagged as suspect: {flops_suspect}")
    elif flops_per_device is None or flops_per_device < 0:
        reasons.append("FLOPs not reported" if flops_per_device is None else "FLOPs negative")
    elif not peak:
        reasons.append(f"no published {dtype} peak FLOP/s for {chip.name}")
    else:
        compute = flops_per_device / peak
    if bytes_suspect:
        reasons.append(f"bytes accessed left out, flagged as suspect: {bytes_suspect}")
    elif bytes_accessed_per_device is None or bytes_accessed_per_device < 0:
        reasons.append("bytes accessed not reported" if bytes_accessed_per_device is None
                       else "bytes accessed negative")
    elif not bw:
        reasons.append(f"no HBM bandwidth for {chip.name}")
    else:
        bytes_accessed_per_device = max(bytes_accessed_per_device - on_chip_bytes, 0.0)
        memory = bytes_accessed_per_device / bw
    lower = bound = None
    if compute is not None and memory is not None:
        lower = max(compute, memory)
        bound = "compute" if compute >= memory else "memory"
    return RooflineEstimate(chip.name, dtype, flops_per_device, bytes_accessed_per_device, peak, bw,
                            compute, memory, lower, bound, "; ".join(reasons) or None, on_chip_bytes=on_chip_bytes)
