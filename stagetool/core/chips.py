"""Published peak figures of common accelerators (the roofline's chip table).

Every figure is the vendor's public number for **one chip** (one TPU chip; one GPU), with
its source URL in the table. Conventions:

* ``peak_flops_per_second_bf16``: dense (no structured sparsity) bf16 matrix FLOP/s. NVIDIA
  datasheets print the sparse figure for H100/H200 tensor cores; the dense one is half of it.
* ``peak_flops_per_second_f32``: non-tensor-core FP32 FLOP/s where the vendor publishes it;
  None for TPUs (Google publishes no f32 peak).
* ``hbm_bandwidth_bytes_per_second`` and ``hbm_capacity_bytes`` are read as the vendor writes
  them, with decimal units (GB = 10**9 bytes, TB/s = 10**12 bytes/s). HBM is built in binary
  sizes and the allocator reserves some of it, so the usable limit differs; prefer
  ``jax.Device.memory_stats()['bytes_limit']`` (see ``stagetool.analysis.memory``) when a real
  device is attached. The decimal reading is the smaller one, so a fits-check using it errs
  on the safe side.

These are upper bounds for an *estimate*; real programs reach a fraction of them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from stagetool.core.errors import SpecError, UsageError

_T = 10**12
_G = 10**9
_GIB = 2**30
"""FLOP/s and bandwidths are decimal (vendors' TFLOPS, GB/s); HBM capacities are binary: an HBM
stack sold as "16 GB" holds 16 GiB (``memory_stats()['bytes_limit']`` on a v5e is just under 16 GiB),
and ``stagetool.core.accelerators.TPU_CHIPS`` uses the same figures."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """Peak figures of one accelerator chip.

    Attributes:
      name: table key, lower case (``"tpu-v5e"``).
      peak_flops_per_second_bf16: dense bf16 FLOP/s of one chip, or None.
      peak_flops_per_second_f32: FP32 FLOP/s of one chip, or None when not published.
      hbm_bandwidth_bytes_per_second: HBM bandwidth of one chip (bytes/s), or None.
      hbm_capacity_bytes: HBM capacity of one chip (bytes), or None.
      sources: the public pages the figures come from (``("user",)`` for user entries).
      note: how the figures were read (dense vs sparse, units).
      peak_flops_per_second_fp8 / peak_flops_per_second_int8: dense FP8 / INT8 matrix FLOP/s (OP/s)
        of one chip, or None where the chip has no such unit published.
      ici_bandwidth_bytes_per_second_per_link: TPU ICI, bytes/s one link carries in ONE direction.
      ici_links_per_chip: TPU ICI links of one chip (2 per torus dimension).
      ici_torus_dims: 2 (v5e, v6e) or 3 (v4, v5p).
      ici_wraparound_multiple: a slice axis whose size is a multiple of this wraps around (a ring);
        shorter axes are lines (v4/v5p: 4, full cubes through the optical switches; v5e/v6e: 16,
        only the full pod's axes).
      nvlink_bandwidth_bytes_per_second: GPU NVLink, bytes/s one GPU sends in ONE direction over
        all its links (half NVIDIA's bidirectional figure).
      gpus_per_host: GPUs that share one NVLink domain (an HGX/DGX board: 8).
      dcn_bandwidth_bytes_per_second: bytes/s one chip sends in one direction between slices (TPU
        DCN) or between hosts (the GPU host network: one NIC per GPU).
      collective_latency_seconds: fixed cost of one collective on ICI / NVLink (seconds).
      dcn_latency_seconds: fixed cost of one collective over DCN / the host network (seconds).
      kernel_launch_seconds: GPU cost per kernel launched (seconds); None (0) on TPU, whose program
        runs as one executable.
      clock_hz: the core clock (Hz), which turns XLA:TPU's per-instruction ``estimated_cycles`` into
        seconds; None where not known.
      matmul_flops_per_second: sustained dense matmul FLOP/s of one chip per operand class, as
        ``((class, rate), ...)``: ``bf16`` (bf16 × bf16 → f32), ``f32`` (f32 at DEFAULT precision: what
        XLA really compiles, on TPU bf16 passes), ``f32_high`` (Precision.HIGH), ``f32_highest``
        (Precision.HIGHEST), ``int8`` (s8 × s8 → s32), ``fp8``; () where none was measured (the peaks
        then stand in: :meth:`matmul_rate`).
      class_rates: measured rates of the kernel classes beyond matmuls and plain element-wise work, as
        ``((key, rate), ...)`` (:data:`CLASS_RATES` names each key and its unit: convolutions of each form
        and their gradients, batched small matmuls, vector-unit ops, FFT, in-place updates, gathers of
        several row widths, sort, cumulative ops); () where none was measured (the class then takes
        the nearest base rate, and the estimate says it is not validated for that class).
      matmul_tile: ``(rows, columns)`` the matrix unit pads small or odd matmul dimensions to (TPU v5e:
        its 128 × 128 MXU), or None (no padding modelled).
      hbm_copy_bytes_per_second: (read + write) bytes/s of a large copy or layout change.
      elementwise_bytes_per_second: (operands + result) bytes/s of a large fused element-wise kernel.
      reduction_bytes_per_second: (operands + result) bytes/s of a large row reduction.
      transcendentals_per_second: exp/tanh/log... elements/s of the vector unit.
      gather_bytes_per_second: 2 × the gathered rows' bytes (read and written) per second of a large gather.
      scatter_bytes_per_second: 3 × the updates' bytes (the update read, its row read and written) per second
        of a large scatter-add.
      kernel_overhead_seconds: fixed time of one launched kernel (a top-level fusion) on the chip.
      profile: ``((key, value), ...)`` of a calibrated profile (``measured_on``, ``date``, ``jax``,
        ``libtpu``, ``command``): where its ``measured`` figures come from; () for none.
      provenance: ``(field, kind, source)`` per figure of a built-in chip: kind ``published`` (the
        vendor's number as printed), ``derived`` (arithmetic on published numbers, said in the
        source text), ``measured`` (a calibration on the chip itself: date, jax and libtpu in the
        source text) or ``assumption`` (no vendor figure: a typical value, said why); ``user`` for
        a figure a ``chips:`` entry gave. A figure with no entry is the user's on a user chip.
    """

    name: str
    peak_flops_per_second_bf16: float | None
    peak_flops_per_second_f32: float | None
    hbm_bandwidth_bytes_per_second: float | None
    hbm_capacity_bytes: int | None
    sources: tuple[str, ...]
    note: str = ""
    peak_flops_per_second_fp8: float | None = None
    peak_flops_per_second_int8: float | None = None
    ici_bandwidth_bytes_per_second_per_link: float | None = None
    ici_links_per_chip: int | None = None
    ici_torus_dims: int | None = None
    ici_wraparound_multiple: int | None = None
    nvlink_bandwidth_bytes_per_second: float | None = None
    gpus_per_host: int | None = None
    dcn_bandwidth_bytes_per_second: float | None = None
    collective_latency_seconds: float | None = None
    dcn_latency_seconds: float | None = None
    kernel_launch_seconds: float | None = None
    clock_hz: float | None = None
    matmul_flops_per_second: tuple[tuple[str, float], ...] = ()
    class_rates: tuple[tuple[str, float], ...] = ()
    matmul_tile: tuple[int, int] | None = None
    hbm_copy_bytes_per_second: float | None = None
    elementwise_bytes_per_second: float | None = None
    reduction_bytes_per_second: float | None = None
    transcendentals_per_second: float | None = None
    gather_bytes_per_second: float | None = None
    scatter_bytes_per_second: float | None = None
    kernel_overhead_seconds: float | None = None
    profile: tuple[tuple[str, str], ...] = ()
    provenance: tuple[tuple[str, str, str], ...] = ()

    @property
    def is_tpu(self) -> bool:
        """True for a TPU (ICI torus figures), False for a GPU or an unknown user chip."""
        return self.ici_links_per_chip is not None or self.name.startswith("tpu")

    def peak_for(self, dtype: str) -> float | None:
        """Peak matrix FLOP/s of one chip for an HLO element type of a dot's operands.

        ``bf16``/``f16`` → the bf16 peak; ``f8e4m3fn``-style types → the fp8 peak (else bf16);
        ``s8``/``u8`` → int8 (else bf16); ``f32``/``f64`` → the f32 peak where published, else the
        bf16 one (a TPU runs an f32 matmul at default precision as bf16 passes on the MXU).
        """
        if dtype.startswith("f8"):
            return self.peak_flops_per_second_fp8 or self.peak_flops_per_second_bf16
        if dtype in ("s8", "u8", "s4", "u4"):
            return self.peak_flops_per_second_int8 or self.peak_flops_per_second_bf16
        if dtype in ("f32", "f64", "c64", "c128"):
            return self.peak_flops_per_second_f32 or self.peak_flops_per_second_bf16
        return self.peak_flops_per_second_bf16

    def matmul_rate(self, kind: str) -> float | None:
        """Sustained matmul FLOP/s of one chip for a matmul class (``bf16``, ``f32``, ``f32_high``,
        ``f32_highest``, ``int8``, ``fp8``): the measured rate where the chip has one, else derived from
        the peaks: ``f32`` on a TPU the bf16 peak (DEFAULT precision is one bf16 pass), ``f32_high`` a
        third and ``f32_highest`` a sixth of it (XLA:TPU's bf16_3x and bf16_6x passes); on a GPU the
        f32 peak (:meth:`peak_for`)."""
        rates = dict(self.matmul_flops_per_second)
        if kind in rates:
            return rates[kind]
        bf16 = rates.get("bf16") or self.peak_flops_per_second_bf16
        if kind in ("f32", "f32_high", "f32_highest"):
            if not self.is_tpu and self.peak_flops_per_second_f32:
                return self.peak_flops_per_second_f32
            return None if bf16 is None else bf16 / {"f32": 1, "f32_high": 3, "f32_highest": 6}[kind]
        if kind == "int8":
            return self.peak_flops_per_second_int8 or bf16
        if kind == "fp8":
            return self.peak_flops_per_second_fp8 or bf16
        return bf16

    def precision_peak(self, kind: str) -> float | None:
        """The peak FLOP/s of one chip for work of matmul class ``kind`` as it really runs: ``int8`` the int8
        peak, ``fp8`` the fp8 peak, ``bf16`` the bf16 peak; f32 on a TPU is bf16 passes of the MXU (``f32``
        one: the bf16 peak, ``f32_high`` three: a third of it, ``f32_highest`` six: a sixth), on a GPU the
        f32 peak. MFU divides each kernel's FLOPs by it, so that no precision reads above 100%."""
        bf16 = self.peak_flops_per_second_bf16
        if kind == "int8":
            return self.peak_flops_per_second_int8 or bf16
        if kind == "fp8":
            return self.peak_flops_per_second_fp8 or bf16
        if kind in ("f32", "f32_high", "f32_highest"):
            if not self.is_tpu and self.peak_flops_per_second_f32:
                return self.peak_flops_per_second_f32
            return None if bf16 is None else bf16 / {"f32": 1, "f32_high": 3, "f32_highest": 6}[kind]
        return bf16

    def class_rate(self, key: str) -> float | None:
        """The measured rate of kernel class ``key`` (:data:`CLASS_RATES`), or None where not measured."""
        return dict(self.class_rates).get(key)

    def figure_kind(self, field: str) -> str:
        """``published``, ``derived``, ``assumption`` or ``user`` for one figure (see ``provenance``)."""
        for f, kind, _ in self.provenance:
            if f == field:
                return kind
        return "user" if self.sources == ("user",) or getattr(self, field) is not None else "unknown"


_A100_PDF = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
             "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")

_BASE: dict[str, Chip] = {
    c.name: c for c in (
        Chip("tpu-v4", 275 * _T, None, 1200 * _G, 32 * _GIB, ("https://cloud.google.com/tpu/docs/v4",),
             "bf16 275 TFLOPs; HBM2 32 GiB, 1200 GBps per chip"),
        Chip("tpu-v5e", 197 * _T, None, 819 * _G, 16 * _GIB, ("https://cloud.google.com/tpu/docs/v5e",),
             "bf16 197 TFLOPs; HBM2 16 GB, 819 GBps per chip"),
        Chip("tpu-v5p", 459 * _T, None, 2765 * _G, 95 * _GIB, ("https://cloud.google.com/tpu/docs/v5p",),
             "bf16 459 TFLOPs; HBM2e 95 GB, 2765 GBps per chip"),
        Chip("tpu-v6e", 918 * _T, None, 1638 * _G, 32 * _GIB, ("https://cloud.google.com/tpu/docs/v6e",),
             "bf16 918 TFLOPs; HBM 32 GB, 1638 GBps per chip (Trillium)"),
        Chip("a100-40gb", 312 * _T, 19.5 * _T, 1555 * _G, 40 * _GIB, (_A100_PDF,),
             "SXM; BF16 tensor core 312 TFLOPS dense (624 sparse); FP32 19.5 TFLOPS; HBM2 1,555 GB/s"),
        Chip("a100-80gb", 312 * _T, 19.5 * _T, 2039 * _G, 80 * _GIB, (_A100_PDF,),
             "SXM; BF16 tensor core 312 TFLOPS dense (624 sparse); FP32 19.5 TFLOPS; HBM2e 2,039 GB/s"),
        Chip("h100-sxm", 989.5 * _T, 67 * _T, 3350 * _G, 80 * _GIB,
             ("https://www.nvidia.com/en-us/data-center/h100/",),
             "BF16 tensor core 1,979 TFLOPS with sparsity -> 989.5 dense; FP32 67 TFLOPS; 3.35 TB/s"),
        Chip("h200", 989.5 * _T, 67 * _T, 4800 * _G, 141 * _GIB,
             ("https://www.nvidia.com/en-us/data-center/h200/",),
             "SXM; BF16 tensor core 1,979 TFLOPS with sparsity -> 989.5 dense; FP32 67 TFLOPS; 4.8 TB/s"),
        Chip("h100-pcie", 756.5 * _T, 51 * _T, 2000 * _G, 80 * _GIB,
             ("https://www.nvidia.com/en-us/data-center/h100/",),
             "PCIe; BF16 tensor core 1,513 TFLOPS with sparsity -> 756.5 dense; FP32 51 TFLOPS; 2 TB/s"),
        Chip("b200", 2250 * _T, 75 * _T, 8000 * _G, 180 * _GIB,
             ("https://www.nvidia.com/en-us/data-center/dgx-b200/",),
             "per GPU of DGX B200 (8 GPUs): FP16/BF16 tensor core 36 PFLOPS with sparsity -> 2,250 TFLOPS "
             "dense; FP32 600 TFLOPS -> 75; 64 TB/s -> 8 TB/s; 1,440 GB -> 180 GB"),
    )
}

_SCALING_BOOK = "https://jax-ml.github.io/scaling-book/tpus/"
_TPU_LATENCY = ("collective_latency_seconds", "assumption",
                "no published figure; ~1 µs per ICI hop (" + _SCALING_BOOK + ") and a few hops of setup: 5 µs")
_DCN_LATENCY = ("dcn_latency_seconds", "assumption", "no published figure; a data-center network round trip: 25 µs")
_NCCL_LATENCY = ("collective_latency_seconds", "assumption",
                 "no published figure; NCCL's small-message all-reduce inside one NVLink host: ~10 µs")
_IB_LATENCY = ("dcn_latency_seconds", "assumption", "no published figure; InfiniBand between hosts: ~20 µs")
_LAUNCH = ("kernel_launch_seconds", "assumption",
           "no published figure; a CUDA kernel launch (stream or graph) costs a few µs: 4 µs")
_HOST8 = ("gpus_per_host", "assumption", "an HGX/DGX board: 8 GPUs on one NVLink switch domain")


def _tpu(name, *, link, links, dims, wrap, dcn, int8=None, fp8=None, prov=()):
    base = _BASE[name]
    kinds = ((("ici_links_per_chip", "published" if links else "assumption", f"{links} ICI ports per chip"),
              ("ici_torus_dims", "published", f"{dims}-D torus"), _TPU_LATENCY, _DCN_LATENCY) + tuple(prov))
    return dataclasses.replace(
        base, peak_flops_per_second_int8=int8, peak_flops_per_second_fp8=fp8,
        ici_bandwidth_bytes_per_second_per_link=link, ici_links_per_chip=links, ici_torus_dims=dims,
        ici_wraparound_multiple=wrap, dcn_bandwidth_bytes_per_second=dcn, collective_latency_seconds=5e-6,
        dcn_latency_seconds=25e-6, provenance=_peaks(base) + kinds)


def _gpu(name, *, nvlink, host_net, fp8, int8, prov):
    base = _BASE[name]
    return dataclasses.replace(
        base, peak_flops_per_second_fp8=fp8, peak_flops_per_second_int8=int8,
        nvlink_bandwidth_bytes_per_second=nvlink, gpus_per_host=8, dcn_bandwidth_bytes_per_second=host_net,
        collective_latency_seconds=10e-6, dcn_latency_seconds=20e-6, kernel_launch_seconds=4e-6,
        provenance=_peaks(base) + (_HOST8, _NCCL_LATENCY, _IB_LATENCY, _LAUNCH) + tuple(prov))


def _peaks(base: Chip) -> tuple[tuple[str, str, str], ...]:
    src = base.sources[0]
    out = [(f, "published", f"{src}: {base.note}") for f in
           ("peak_flops_per_second_bf16", "hbm_bandwidth_bytes_per_second", "hbm_capacity_bytes")]
    if base.peak_flops_per_second_f32 is not None:
        out.append(("peak_flops_per_second_f32", "published", f"{src}: {base.note}"))
    return tuple(out)


_V5E, _V5P, _V6E, _V4 = (f"https://cloud.google.com/tpu/docs/{v}" for v in ("v5e", "v5p", "v6e", "v4"))
_H100_NET = ("https://www.nvidia.com/en-us/data-center/dgx-h100/: 8x ConnectX-7 400 Gb/s, one per GPU "
             "-> 50 GB/s per GPU each way")
CHIPS: dict[str, Chip] = {c.name: c for c in (
    _tpu("tpu-v4", link=45 * _G, links=6, dims=3, wrap=4, dcn=6.25 * _G, int8=275 * _T, prov=(
        ("ici_bandwidth_bytes_per_second_per_link", "assumption", _SCALING_BOOK + ": ~4.5e10 B/s one way per link"),
        ("ici_wraparound_multiple", "assumption", _SCALING_BOOK + ": axes of full 4-chip cubes wrap around (OCS)"),
        ("dcn_bandwidth_bytes_per_second", "assumption", "v5p's published 50 Gbps per chip taken for v4"),
        ("peak_flops_per_second_int8", "published", _V4 + ": 275 TOPS int8"))),
    _tpu("tpu-v5e", link=50 * _G, links=4, dims=2, wrap=16, dcn=3.125 * _G, int8=393 * _T, prov=(
        ("ici_bandwidth_bytes_per_second_per_link", "derived",
         _V5E + ": bidirectional ICI 400 GBps per chip over 4 ports -> 50 GB/s per link each way"),
        ("ici_wraparound_multiple", "assumption", _SCALING_BOOK + ": only the full 16x16 pod's axes wrap around"),
        ("dcn_bandwidth_bytes_per_second", "derived", _V5E + ": 6.4 Tbps DCN per 256-chip pod -> 25 Gbps per chip"),
        ("peak_flops_per_second_int8", "published", _V5E + ": 393 TOPS int8"))),
    _tpu("tpu-v5p", link=100 * _G, links=6, dims=3, wrap=4, dcn=6.25 * _G, int8=918 * _T, fp8=459 * _T, prov=(
        ("ici_bandwidth_bytes_per_second_per_link", "derived",
         _V5P + ": bidirectional ICI 1200 GBps per chip over 6 links -> 100 GB/s per link each way"),
        ("ici_wraparound_multiple", "assumption", _SCALING_BOOK + ": axes of full 4-chip cubes wrap around (OCS)"),
        ("dcn_bandwidth_bytes_per_second", "published", _V5P + ": DCN 50 Gbps per chip"),
        ("peak_flops_per_second_int8", "assumption", "2x the bf16 peak, as on v5e/v6e"),
        ("peak_flops_per_second_fp8", "published", _V5P + ": FP8 459 TFLOPs (the bf16 rate)"))),
    _tpu("tpu-v6e", link=100 * _G, links=4, dims=2, wrap=16, dcn=12.5 * _G, int8=1836 * _T, prov=(
        ("ici_bandwidth_bytes_per_second_per_link", "derived",
         _V6E + ": bidirectional ICI 800 GBps per chip over 4 ports -> 100 GB/s per link each way"),
        ("ici_wraparound_multiple", "assumption", _SCALING_BOOK + ": only the full 16x16 pod's axes wrap around"),
        ("dcn_bandwidth_bytes_per_second", "derived", _V6E + ": 25.6 Tbps DCN per 256-chip pod -> 100 Gbps per chip"),
        ("peak_flops_per_second_int8", "published", _V6E + ": 1836 TOPS int8"))),
    *(_gpu(n, nvlink=300 * _G, host_net=25 * _G, fp8=None, int8=624 * _T, prov=(
        ("nvlink_bandwidth_bytes_per_second", "derived", _A100_PDF + ": NVLink 600 GB/s (bidirectional) -> 300 each way"),
        ("dcn_bandwidth_bytes_per_second", "published",
         "https://www.nvidia.com/en-us/data-center/dgx-a100/: 8x 200 Gb/s HDR InfiniBand, one per GPU -> 25 GB/s"),
        ("peak_flops_per_second_int8", "derived", _A100_PDF + ": INT8 1248 TOPS with sparsity -> 624 dense")))
      for n in ("a100-40gb", "a100-80gb")),
    *(_gpu(n, nvlink=450 * _G, host_net=50 * _G, fp8=1979 * _T, int8=1979 * _T, prov=(
        ("nvlink_bandwidth_bytes_per_second", "derived",
         f"https://www.nvidia.com/en-us/data-center/{'h200' if n == 'h200' else 'h100'}/: NVLink 900 GB/s "
         "(bidirectional) -> 450 each way"),
        ("dcn_bandwidth_bytes_per_second", "published", _H100_NET),
        ("peak_flops_per_second_fp8", "derived", "FP8 tensor core 3,958 TFLOPS with sparsity -> 1,979 dense"),
        ("peak_flops_per_second_int8", "derived", "INT8 tensor core 3,958 TOPS with sparsity -> 1,979 dense")))
      for n in ("h100-sxm", "h200")),
    _gpu("h100-pcie", nvlink=300 * _G, host_net=50 * _G, fp8=1513 * _T, int8=1513 * _T, prov=(
        ("nvlink_bandwidth_bytes_per_second", "derived",
         "https://www.nvidia.com/en-us/data-center/h100/: PCIe NVLink bridge 600 GB/s -> 300 each way"),
        ("dcn_bandwidth_bytes_per_second", "assumption", "one 400 Gb/s NIC per GPU, as in a DGX H100"),
        ("peak_flops_per_second_fp8", "derived", "FP8 3,026 TFLOPS with sparsity -> 1,513 dense"),
        ("peak_flops_per_second_int8", "derived", "INT8 3,026 TOPS with sparsity -> 1,513 dense"))),
    _gpu("b200", nvlink=900 * _G, host_net=50 * _G, fp8=4500 * _T, int8=4500 * _T, prov=(
        ("nvlink_bandwidth_bytes_per_second", "derived",
         "https://www.nvidia.com/en-us/data-center/dgx-b200/: NVLink 14.4 TB/s per 8 GPUs -> 1.8 TB/s per GPU, "
         "900 GB/s each way"),
        ("dcn_bandwidth_bytes_per_second", "published",
         "https://www.nvidia.com/en-us/data-center/dgx-b200/: 8x ConnectX-7 400 Gb/s -> 50 GB/s per GPU"),
        ("peak_flops_per_second_fp8", "derived", "DGX B200 FP8 72 PFLOPS with sparsity -> 4.5 PFLOPS dense per GPU"),
        ("peak_flops_per_second_int8", "assumption", "the FP8 rate"))),
)}
"""The built-in table, keyed by lower-case chip name."""

_MATMUL_CLASSES = ("bf16", "f32", "f32_high", "f32_highest", "int8", "fp8")
"""The keys of ``matmul_flops_per_second``."""
ELEMENT_OPS: dict[str, tuple[str, str]] = {
    "op_exponential": ("exponential", "f32"), "op_log": ("log", "f32"), "op_log_plus_one": ("log-plus-one", "f32"),
    "op_erf": ("erf", "f32"), "op_sine": ("sine", "f32"), "op_rsqrt": ("rsqrt", "f32"), "op_power": ("power", "f32"),
    "op_divide_f32": ("divide", "f32"), "op_divide_s32": ("divide", "s32"), "op_remainder_s32": ("remainder", "s32"),
}
"""Element-wise ops whose cost on the vector unit is their own (XLA:TPU expands each into many instructions
after the HLO the step-time model reads): ``class_rates`` key → (HLO opcode, element type). ``stagetool calibrate``
measures each as a chain of the op over one array (elements × ops per second)."""
CLASS_RATES: dict[str, str] = {
    "conv_dense": "FLOP/s of a stride-1 convolution with a window (XLA's FLOPs)",
    "conv_depthwise": "FLOP/s of a depthwise convolution (one feature per group)",
    "conv_grouped": "FLOP/s of a grouped convolution (several features per group)",
    "conv_strided": "FLOP/s of a strided convolution",
    "conv_transposed": "FLOP/s of a transposed convolution (an input dilated: lhs_dilate)",
    "conv_input_gradient": "FLOP/s of a convolution's gradient with respect to its input",
    "conv_weight_gradient": "FLOP/s of a convolution's gradient with respect to its weights",
    "batched_matmul": "FLOP/s (M, K and N each padded up to the matrix unit's tile) of a batched matmul whose M and "
                      "N fit in one tile",
    "vector_ops": "element-ops/s of the vector unit: each element-wise instruction of a fusion, per element",
    "random_bits": "u32 random bits/s of threefry (jax.random.bits)",
    "fft": "FLOP/s (XLA's FLOPs) of the matmuls XLA:TPU lowers an FFT to",
    "xla_fft": "the factor on XLA:TPU's own estimated_cycles time of an FFT's matmul kernels (measured ÷ XLA's): "
               "where set, an FFT kernel is timed from XLA's figure × it, not from the fft rate",
    "dynamic_update_slice": "bytes/s (the update read and written) of a slice written into a donated buffer",
    "scatter_set_rows": "rows/s of a scatter that sets (not adds) rows of 512 bytes at unsorted ids into a donated "
                        "buffer: where measured, a set scatter takes at least its rows over it",
    "gather_128": "2 x gathered bytes/s of a gather of 128-byte rows",
    "gather_512": "2 x gathered bytes/s of a gather of 512-byte rows",
    "gather_32768": "2 x gathered bytes/s of a gather of 32 KiB rows (pages)",
    "sort": "comparator stages/s of a sort: elements x log2(n)(log2(n)+1)/2",
    "cumulative": "bytes/s (read + written) of a cumulative op (cumsum: XLA:TPU's reduce-window over a row)",
    "scatter_add_unique_4": "rows/s of a scatter-add of 4-byte rows at unique, regular ids into a donated table",
    "scatter_add_unique_512": "rows/s of a scatter-add of 512-byte rows at unique, regular ids into a donated table",
    "scatter_add_unique_2048": "rows/s of a scatter-add of 2 KiB rows at unique, regular ids into a donated table",
    "scatter_add_segment_4": "rows/s of a segment sum of 4-byte rows at random ids into few segments",
    "scatter_add_segment_512": "rows/s of a segment sum of 512-byte rows at random ids into few segments",
    "scatter_add_segment_2048": "rows/s of a segment sum of 2 KiB rows at random ids into few segments",
    "scatter_add_upsample": "update bytes/s of the scatters in the gradient of a nearest x2 upsample: scatter-adds "
                            "of whole windows at regular ids",
    "gather_scalar_vmem": "elements/s of a gather of single f32 elements (take_along_axis) from a 4 MiB table",
    "scatter_add_scalar_vmem": "elements/s of a scatter-add of single f32 elements (take_along_axis's gradient) "
                               "into a 4 MiB table",
    "conv_strided_4x4": "FLOP/s (XLA's FLOPs) of a strided convolution whose window is a multiple of its stride "
                        "(4x4 stride 2 at 16 px, 128 -> 256 features)",
    # class coverage (issue 46): the classes the audit bench/results/step_time_suite/class_coverage.md found
    # timed from no measurement of their own
    **{k: f"elements/s of the element-wise op {op} ({dt}): its elements, each op of a fusion"
       for k, (op, dt) in ELEMENT_OPS.items()},
    "pool_window": "bytes/s (read + written) of a pooling window (a reduce-window that is no prefix scan: max pool)",
    "select_and_scatter": "bytes/s (operand, pooled gradient, result) of a pooling window's gradient "
                          "(select-and-scatter)",
    "conv_dilated": "FLOP/s of a convolution whose window is dilated (rhs_dilate: atrous)",
    "conv_1d": "FLOP/s of a convolution over one spatial dimension (a sequence: conv1d, causal)",
    "batched_matmul_f32_highest": "FLOP/s (M, K and N padded to the tile) of batched f32 products whose M and N fit "
                                  "in one tile, at Precision.HIGHEST",
    "pad_interior": "bytes/s (read + written) of a pad with interior padding (an interleave: associative_scan)",
    "reduction_major": "bytes/s (read) of a reduction over the major axis (column sums)",
    "top_k": "operand elements/s of lax.top_k (XLA:TPU's TopK custom call)",
    "loop_iterations": "iterations/s of a while loop (fori_loop, scan) beyond the model's time of its body",
    "cholesky_64": "batch x n^3/s of XLA:TPU's Cholesky custom call on 64 x 64 matrices",
    "cholesky_128": "batch x n^3/s of XLA:TPU's Cholesky custom call on 128 x 128 matrices (its block)",
    "triangular_invert": "batch x n^3/s of XLA:TPU's InvertDiagBlocksLowerTriangular (a triangular_solve's blocks)",
    "qr": "batch x m x n x min(m, n)/s of XLA:TPU's QR custom calls (QrDecompositionBlock, CompactWyHelper)",
    "eigh": "batch x n^3/s of XLA:TPU's EighTpu custom call",
}
"""The keys of ``class_rates`` and their units (``stagetool calibrate`` measures each)."""
_V5E_ARCH = "https://cloud.google.com/tpu/docs/system-architecture-tpu-vm"
_V5E_MEASURED = ("measured by stagetool calibrate on the lent TPU v5 lite chip, 2026-12-06, jax 0.10.2, jaxlib 0.10.2, "
                 "libtpu 0.0.42.1 (work / median seconds)")
_V5E_PROFILE = dict(
    clock_hz=1.5e9,
    matmul_flops_per_second=(("bf16", 1.7986e14), ("f32", 1.5589e14), ("f32_high", 1.7986e14 / 3),
                             ("f32_highest", 2.9412e13), ("int8", 3.6750e14)),
    matmul_tile=(128, 128),
    hbm_copy_bytes_per_second=6.2277e11, elementwise_bytes_per_second=6.5098e11, reduction_bytes_per_second=7.1086e11,
    transcendentals_per_second=1.4110e12, gather_bytes_per_second=2.5681e11, scatter_bytes_per_second=1.9123e11,
    kernel_overhead_seconds=1e-6,
    class_rates=tuple(sorted({
        "conv_dense": 1.4543e14, "conv_depthwise": 3.2978e12, "conv_grouped": 2.3269e12, "conv_strided": 1.2017e14,
        "conv_transposed": 1.3651e14, "conv_input_gradient": 1.6183e14, "conv_weight_gradient": 1.7635e14,
        "batched_matmul": 3.632e13, "vector_ops": 2.2709e12, "random_bits": 4.7353e10, "fft": 4.7374e12, "xla_fft": 0.8432,
        "dynamic_update_slice": 1.1324e11, "gather_128": 2.1055e10, "gather_512": 8.2175e10,
        "gather_32768": 3.6329e11, "sort": 1.2913e11, "cumulative": 2.7131e11,
        "scatter_set_rows": 1.1776e7, "scatter_add_upsample": 3.5314e11, "scatter_add_scalar_vmem": 1.1188e8,
        "scatter_add_segment_4": 1.4230e8, "scatter_add_segment_512": 1.3995e8, "scatter_add_segment_2048": 1.0681e8,
        "gather_scalar_vmem": 7.8883e7,
        # class coverage (calibrate_tpu_v5e_classes3.yaml): each elements x ops over the median less the model's time
        # of the chain's one cheap op a link (a multiply or an add, at vector_ops)
        "op_log_plus_one": 5.7229e11, "op_erf": 1.4892e11, "op_sine": 1.4888e10, "op_rsqrt": 6.6476e11}.items())),
    profile=(("measured_on", "TPU v5 lite"), ("date", "2026-12-06"), ("jax", "0.10.2"), ("jaxlib", "0.10.2"),
             ("libtpu", "0.0.42.1"), ("command", "stagetool calibrate -o tpu-v5e.yaml")),
)
_V5E_PROVENANCE = (
    ("clock_hz", "derived", _V5E_ARCH + ": 4 MXUs of 128x128 per TensorCore; 197 TFLOP/s / (4 x 128 x 128 x 2 "
     "FLOPs) -> 1.5 GHz"),
    ("matmul_tile", "published", _V5E_ARCH + ": the MXU is a 128x128 systolic array"),
    ("matmul_flops_per_second", "measured", _V5E_MEASURED + ": bf16 8192^3 in 6.113 ms; f32 (DEFAULT precision) "
     "8192^3 in 7.053 ms; f32 at HIGHEST 4096^3 in 4.673 ms; int8 8192^3 in 2.992 ms; f32_high (not measured) "
     "a third of bf16, XLA:TPU's three bf16 passes"),
    ("hbm_copy_bytes_per_second", "measured", _V5E_MEASURED + ": copy of f32[67108864] (read + write) in 0.8621 ms"),
    ("elementwise_bytes_per_second", "measured", _V5E_MEASURED + ": x * 1.5 + y over f32[67108864] in 1.237 ms"),
    ("reduction_bytes_per_second", "measured", _V5E_MEASURED + ": row sums of f32[16384,8192] in 0.7552 ms"),
    ("transcendentals_per_second", "measured", _V5E_MEASURED + ": 32 chained tanh over f32[33554432] in 0.761 ms"),
    ("gather_bytes_per_second", "measured", _V5E_MEASURED + ": rows f32[262144,512][i32[131072]] in 2.091 ms "
     "(2 x the gathered bytes: read and written)"),
    ("scatter_bytes_per_second", "measured", _V5E_MEASURED + ": f32[262144,512].at[i32[131072]].add in 4.211 ms "
     "(3 x the update bytes: the update read, the row read and written)"),
    ("class_rates", "measured", _V5E_MEASURED + " (issue 46's classes, bench/results/step_time_suite/"
     "calibrate_tpu_v5e_issue46.txt): convolutions bf16[32,56,56,256] (dense 3x3 0.795 ms, depthwise 7x7 0.717 ms, "
     "grouped 3x3 of 8 features 1.552 ms, input and weight gradients 1.429 / 1.311 ms), strided 3x3 of "
     "bf16[32,112,112,128] 0.487 ms, transposed 4x4 0.757 ms; 8192 products of 64x64 bf16 1.814 ms (the rate is its FLOPs padded to the 128 tile, 2 x 8192 x 128^3, over 0.946 ms: the median less the model's 0.868 ms for the benchmark's own layout copies, which the model times as copies beside the matmul); 30 u32 ops over "
     "33.5 M elements 0.443 ms; threefry bits u32[33554432] 0.709 ms; fft2 of complex64[16,1024,1024] 5.865 ms; "
     "gathers of 128 / 512 B / 32 KiB rows 25.5 / 6.53 / 1.478 ms; sort of f32[4096,4096] rows 10.13 ms; cumsum of "
     "f32[8192,8192] rows 6.270 ms less 4.291 ms the step-time model gives its four layout copies and the broadcast "
     "that adds the row blocks (stagetool.measure.calibrate.others_seconds on the same program compiled for v5e:1x1: "
     "the rate of 8.5624e10 over the whole 6.27 ms counted them twice; the fit half's cumsum kernel took 1.863 ms on "
     "the profiler for the 1.979 left); a 16 MiB dynamic_update_slice into a donated 512 MiB buffer 0.296 ms "
     "(12.8% spread; not used: the model's in-place update is at the copy rate); xla_fft 0.8432 from the validation "
     "suite's fit half (measured_tpu_v5e_issue46.json, fft2d's 24 FFT kernels, the profiler's device times: 21.23 ms "
     "measured for 25.18 ms of XLA's estimated_cycles, each kernel 0.82-0.87 of it, where the fft rate was 0.94-4.35x "
     "off: kernels of equal FLOPs took 0.42 to 1.19 ms); scatter_set_rows 1.1776e7 rows/s: bf16[524288,256].at["
     "i32[65536]].set (donated, 512-byte rows) in 5.565 ms, median of 10 x 3 calls, spread 1.3% (85 ns a row; "
     "bench/results/step_time_suite/calibrate_tpu_v5e_scatter_set.yaml, calibrate(only={'scatter_set'}), 383d72c); "
     "held-back round 2's classes (bench/results/step_time_suite/calibrate_tpu_v5e_classes3.yaml, calibrate(only="
     "model46c's names), 2026-12-06 15:50-15:55Z, medians of 10 samples, spreads 0.5-2.2%): scatter_add_upsample "
     "3.5314e11 update bytes/s (the gradient of jax.image.resize(bf16[32,28,28,256], x2, 'nearest'): 77.1 MB of "
     "updates in its two scatters, 0.3244 ms less 0.106 ms the model gives its copies); scatter_add_scalar_vmem "
     "1.1188e8 and gather_scalar_vmem 7.8883e7 elements/s (take_along_axis of i32[32,32,4096] single f32 elements of a "
     "4 MiB f32[32,32,1024] table and its gradient: 37.58 and 53.23 ms); scatter_add_segment_4 / _512 / _2048 "
     "1.4230e8 / 1.3995e8 / 1.0681e8 rows/s (jax.ops.segment_sum of 131072 f32 rows of 4 B / 512 B / 2 KiB at random "
     "ids into 4096 segments: 0.921 / 0.937 / 1.227 ms). Not taken: conv_strided_4x4 (1.1333e14, 0.149 ms a call, "
     "20.6% spread: a call that short carries the program's fixed cost, about 40-70 us on the ladder beside it; the "
     "same shape ran at 166 TFLOP/s inside gan_train on the profiler) and the scatter_add_unique rates (the general "
     "row rule they check: 1.60 / 1.63 / 4.21 ms estimated for 1.21 / 1.44 / 4.19 measured)"),
    ("kernel_overhead_seconds", "assumption", "1 us, fitted on the validation suite's fit half: of 0, 0.5, 1, 1.5 "
     "and 2 us its median |error| is lowest at 1 us (4.6%; the latency-bound KV-cache update +3%, -20% with none); "
     "first set on the held-out decode at batch 1 (issue 39's suite, before the halves), which the fit half "
     "now confirms; tiny fusions took 0.03-1.2 us each on the profiler (the calibration's chained-kernel "
     "difference, 0.05 us with a 165% spread, is noise)"),
    # class coverage (issue 46): calibrate's _coverage_benchmarks on the lent v5e
    ("class_rates", "measured", _V5E_MEASURED + " (class coverage, bench/results/step_time_suite/"
     "calibrate_tpu_v5e_classes3.yaml, 15:50-15:55Z, stagetool at 6462e6f's parent): 16 chained ops over f32[8388608] "
     "in one fusion, elements x 16 over the median less the model's time of the link's one cheap op (a multiply or "
     "an add at vector_ops: 0.059 ms): log1p 0.2345 ms (no other op) -> op_log_plus_one 5.7229e11/s; erf (x 2) "
     "0.9604 ms -> op_erf 1.4892e11/s (7 ps an element: XLA:TPU's polynomial, 6x the tanh-measured transcendental); "
     "sine (x 2) 9.074 ms -> op_sine 1.4888e10/s (67 ps an element: its range reduction, 60x the transcendental "
     "rate; cosine timed alike); rsqrt (+ 1) 0.2610 ms -> op_rsqrt 6.6476e11/s (sqrt alike). exp (0.1325 ms) and log "
     "(0.1290 ms) not used: within 1.3x of their 67 MB's time at the element-wise rate (0.103 ms), so memory-bound, "
     "no measure of the op (the generic transcendental and vector rates give 1.15 ps an element, under both)"),
)
CHIPS["tpu-v5e"] = dataclasses.replace(CHIPS["tpu-v5e"], **_V5E_PROFILE,
                                       provenance=CHIPS["tpu-v5e"].provenance + _V5E_PROVENANCE)

_DEVICE_KIND_HINTS = (
    ("tpu v4", "tpu-v4"), ("tpu v5 lite", "tpu-v5e"), ("tpu v5e", "tpu-v5e"), ("tpu v5p", "tpu-v5p"),
    ("tpu v5", "tpu-v5p"), ("tpu v6 lite", "tpu-v6e"), ("tpu v6e", "tpu-v6e"),
    ("a100-sxm4-40gb", "a100-40gb"), ("a100-sxm4-80gb", "a100-80gb"), ("a100 80gb", "a100-80gb"),
    ("a100", "a100-40gb"), ("h100 80gb hbm3", "h100-sxm"), ("h100 sxm", "h100-sxm"), ("h100 pcie", "h100-pcie"),
    ("h200", "h200"), ("b200", "b200"),
)

_NUMERIC_FIELDS = ("peak_flops_per_second_bf16", "peak_flops_per_second_f32",
                   "hbm_bandwidth_bytes_per_second", "hbm_capacity_bytes")
"""The figures a new chip needs at least one of."""
_FABRIC_FIELDS = ("peak_flops_per_second_fp8", "peak_flops_per_second_int8",
                   "ici_bandwidth_bytes_per_second_per_link", "ici_links_per_chip", "ici_torus_dims",
                   "ici_wraparound_multiple", "nvlink_bandwidth_bytes_per_second", "gpus_per_host",
                   "dcn_bandwidth_bytes_per_second", "collective_latency_seconds", "dcn_latency_seconds",
                   "kernel_launch_seconds")
_RATE_FIELDS = ("clock_hz", "hbm_copy_bytes_per_second", "elementwise_bytes_per_second",
                "reduction_bytes_per_second", "transcendentals_per_second", "gather_bytes_per_second",
                "scatter_bytes_per_second", "kernel_overhead_seconds")
"""The step-time model's measured rates (a calibrated profile's figures, :mod:`stagetool.analysis.step_time`)."""
_INT_FIELDS = frozenset({"hbm_capacity_bytes", "ici_links_per_chip", "ici_torus_dims", "ici_wraparound_multiple",
                         "gpus_per_host"})
_FIGURES = (*_NUMERIC_FIELDS, *_FABRIC_FIELDS, *_RATE_FIELDS)
CHIP_FIELDS = (*_FIGURES, "matmul_flops_per_second", "class_rates", "matmul_tile", "profile", "sources", "note")


@dataclasses.dataclass(frozen=True)
class RunChip:
    """The chip a run's figures are for, and where that choice comes from: decided once per run
    (:func:`stagetool.plan.plan.run_chip`), carried on the device setup
    (:attr:`stagetool.devices.provision.DeviceSetup.chip`) and read alike by the roofline, the
    step-time estimate, the modules roll-up and the memory capacity.

    Attributes:
      chip: the chip's figures: the plan's chip table entry (the built-in one, or the spec's
        ``chips:`` entry of that name over it).
      source: what chose it: ``"--chip"``, ``"topology v5e:2x4"`` (a compile-only target's own
        chip), ``"device TPU v5 lite"`` (the attached device's ``device_kind``).
      spec_figures: the spec's ``chips:`` gives (some of) the figures, over the built-in entry.
    """

    chip: Chip
    source: str
    spec_figures: bool = False

    @property
    def name(self) -> str:
        """The chip's table name (``"tpu-v5e"``)."""
        return self.chip.name

    def describe(self) -> str:
        """Where the chip comes from, as a report says it: ``"from topology v5e:2x4"``, with
        ``"; figures from the spec's chips:"`` where the spec gives them."""
        return f"from {self.source}" + ("; figures from the spec's chips:" if self.spec_figures else "")


def chip_for_device_kind(device_kind: str) -> str | None:
    """Table name for a ``jax.Device.device_kind`` string (``"TPU v5 lite"`` -> ``"tpu-v5e"``), or None.

    A best-effort match on known device_kind spellings; None for CPUs and unknown chips.
    """
    k = device_kind.lower()
    for hint, name in _DEVICE_KIND_HINTS:
        if hint in k:
            return name
    return None


def get_chip(name: str, table: Mapping[str, Chip] | None = None) -> Chip:
    """Look up a chip by name (case-insensitive).

    Raises:
      UsageError: unknown name; the message lists the known names.
    """
    t = CHIPS if table is None else table
    key = name.strip().lower()
    if key not in t:
        import difflib

        close = [n for n in sorted(t) if n.startswith(key + "-")] or difflib.get_close_matches(key, list(t), n=2)
        guess = f": did you mean {' or '.join(close)}?" if close else ""
        raise UsageError(f"unknown chip {name!r}{guess}", hint=f"known chips: {', '.join(sorted(t))}")
    return t[key]


_NUMERIC_TEXT = re.compile(r"^[+-]?(\d[\d_]*(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def _number(value: Any, field: str, where: str, issues: list[str]) -> float | int | None:
    """A positive finite figure from a user entry, or None after recording the problem in ``issues``.

    Numbers, and strings that spell one (``"4.0e14"``, ``"4e14"``: YAML 1.1, which PyYAML reads,
    takes ``4.0e14`` without a sign in the exponent for a string), are accepted; for
    ``hbm_capacity_bytes`` also sizes such as ``"16GiB"``.
    """
    if value is None:
        return None
    if isinstance(value, str) and _NUMERIC_TEXT.match(value.strip()):
        value = float(value.strip().replace("_", ""))
    if field == "hbm_capacity_bytes" and isinstance(value, str):
        from stagetool.core.units import parse_size
        try:
            return parse_size(value)
        except UsageError as e:
            issues.append(f"{where}.{field}: {e.message}")
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        expect = "a number or a size such as '16GiB'" if field == "hbm_capacity_bytes" else "a number"
        issues.append(f"{where}.{field}: expected {expect}, got {value!r}")
        return None
    shown = _shown(value)
    try:
        as_float = float(value)  # an integer of 400 digits: OverflowError
    except OverflowError:
        as_float = math.inf
    if math.isnan(as_float) or as_float <= 0 or (not math.isfinite(as_float) and not isinstance(value, int)):
        issues.append(f"{where}.{field}: must be a positive finite number, got {shown}")
        return None
    if field in _INT_FIELDS and isinstance(value, float) and value != int(value):  # a count: 0.5 must not become 0
        issues.append(f"{where}.{field}: must be a whole number ({_INT_UNITS.get(field, 'a count')}), got {shown}")
        return None
    low, high, unit = _RANGES.get(field, _RANGES["*"])
    if not low <= as_float <= high:
        issues.append(f"{where}.{field}: {shown} is outside what one chip's figure can be ({low:g} to {high:g} "
                      f"{unit}): a step time from it would be no figure or a false one")
        return None
    return int(value) if field in _INT_FIELDS else as_float


def _shown(value: Any) -> str:
    """``value`` as a message shows it: an integer of hundreds of digits by its digit count."""
    text = repr(value)
    return text if len(text) <= 40 else f"an integer of {len(text)} digits"


_SECONDS = (1e-12, 60.0, "seconds")
_RANGES: dict[str, tuple[float, float, str]] = {
    "*": (1.0, 1e21, "per second"),  # FLOP/s, bytes/s, elements/s
    "clock_hz": (1e3, 1e12, "Hz"),
    "hbm_capacity_bytes": (1.0, float(2**64), "bytes"),
    "ici_links_per_chip": (1.0, 1024.0, "links"), "ici_torus_dims": (1.0, 16.0, "torus dimensions"),
    "ici_wraparound_multiple": (1.0, 2.0**20, "chips along a slice axis"), "gpus_per_host": (1.0, 2.0**16, "GPUs"),
    "collective_latency_seconds": _SECONDS, "dcn_latency_seconds": _SECONDS, "kernel_launch_seconds": _SECONDS,
    "kernel_overhead_seconds": _SECONDS,
}
"""What one chip's figure can be, per field: beyond it a figure is a typo or a forgery, and a step time
computed from it overflows (a rate of 1e-308 gives infinite seconds) or vanishes."""


_INT_UNITS = {"hbm_capacity_bytes": "bytes", "ici_links_per_chip": "links", "ici_torus_dims": "torus dimensions",
              "ici_wraparound_multiple": "chips along a slice axis", "gpus_per_host": "GPUs"}


def merge_chips(user: Mapping[str, Any], base: Mapping[str, Chip] | None = None) -> dict[str, Chip]:
    """Merge user chip entries into the table (a new dict; the built-in table is unchanged).

    Args:
      user: ``{name: {field: value, ...}}``. Fields: ``peak_flops_per_second_bf16``,
        ``peak_flops_per_second_f32``, ``hbm_bandwidth_bytes_per_second`` and every other figure
        of :class:`Chip` (ICI/NVLink/DCN bandwidths, links, latencies: positive numbers),
        ``hbm_capacity_bytes`` (a positive number or a size string like ``"16GiB"``),
        ``sources`` (a string or list of strings), ``note`` (a string). An entry for a known
        chip overrides only the fields it gives; a new chip needs at least one figure.
      base: the table to extend (default: :data:`CHIPS`).

    Returns:
      ``{name: Chip}`` sorted by name.

    Raises:
      SpecError: listing every problem, each as ``chips.<name>.<field>: what is wrong``.
    """
    table = dict(CHIPS if base is None else base)
    issues: list[str] = []
    if not isinstance(user, Mapping):
        raise SpecError([f"chips: expected a mapping of chip name to figures, got {type(user).__name__}"])
    seen: dict[str, str] = {}
    for raw_name, entry in user.items():
        where = f"chips.{raw_name}"
        if not isinstance(raw_name, str) or not raw_name.strip():
            issues.append(f"{where}: chip name must be a non-empty string")
            continue
        name = raw_name.strip().lower()
        if name in seen:
            issues.append(f"{where}: the same chip as {seen[name]!r} (chip names are read in lower case); give its "
                          "figures once")
            continue
        seen[name] = raw_name
        if not isinstance(entry, Mapping):
            issues.append(f"{where}: expected a mapping of figures, got {type(entry).__name__}")
            continue
        unknown = sorted(set(map(str, entry)) - set(CHIP_FIELDS))
        for u in unknown:
            issues.append(f"{where}.{u}: unknown field; valid fields: {', '.join(CHIP_FIELDS)}")
        values: dict[str, Any] = {}
        for f in _FIGURES:
            if f in entry:
                values[f] = _number(entry[f], f, where, issues)
        if "sources" in entry:
            s = entry["sources"]
            if isinstance(s, str):
                values["sources"] = (s,)
            elif isinstance(s, (list, tuple)) and all(isinstance(x, str) for x in s):
                values["sources"] = tuple(s)
            else:
                issues.append(f"{where}.sources: expected a string or a list of strings")
        if "note" in entry:
            if isinstance(entry["note"], str):
                values["note"] = entry["note"]
            else:
                issues.append(f"{where}.note: expected a string")
        _profile_fields(entry, where, values, issues)
        measured = values.get("profile")
        kind, src = (("measured", f"{where} (profile: " + ", ".join(f"{k} {v}" for k, v in measured) + ")")
                     if measured else ("user", None))
        given = {f for f in values if f in _FIGURES or f in ("matmul_flops_per_second", "class_rates", "matmul_tile")}
        prov = tuple((f, kind, src or f"{where}.{f}") for f in sorted(given))
        if name in table and "class_rates" in values:  # a class given overrides that class only
            values["class_rates"] = tuple(sorted({**dict(table[name].class_rates),
                                                  **dict(values["class_rates"])}.items()))
        if name in table and "matmul_flops_per_second" in values:  # a class given overrides that class only
            values["matmul_flops_per_second"] = tuple(sorted(
                {**dict(table[name].matmul_flops_per_second), **dict(values["matmul_flops_per_second"])}.items(),
                key=lambda kv: _MATMUL_CLASSES.index(kv[0])))
        if name in table:
            kept = tuple(p for p in table[name].provenance if p[0] not in given)
            values["provenance"] = kept + prov
            table[name] = dataclasses.replace(table[name], **values)
        else:
            if not any(values.get(f) for f in _NEW_CHIP_NEEDS):
                issues.append(f"{where}: a new chip needs at least one of {', '.join(_NEW_CHIP_NEEDS)}")
                continue
            table[name] = Chip(name=name, **{f: values.get(f) for f in _FIGURES},
                               sources=values.get("sources", ("user",)), note=values.get("note", ""),
                               matmul_flops_per_second=values.get("matmul_flops_per_second", ()),
                               class_rates=values.get("class_rates", ()),
                               matmul_tile=values.get("matmul_tile"), profile=values.get("profile", ()),
                               provenance=prov if measured else ())
        if name in table and not issues:
            issues += _false_figures(table[name], where, given)
    if issues:
        raise SpecError(issues, hint="see stagetool.core.chips.merge_chips for the fields")
    return dict(sorted(table.items()))


_NEW_CHIP_NEEDS = (*_NUMERIC_FIELDS, "matmul_flops_per_second", "hbm_copy_bytes_per_second")
"""A new chip needs one of these (a calibrated profile of a chip not in the table gives the last two)."""

_PEAK_SLACK = 1.05
"""A measured matmul rate may exceed the published peak by this much (clock boost, rounding) and no more."""


def _false_figures(chip: Chip, where: str, given: set[str]) -> list[str]:
    """Problems of a merged entry whose figures pass one by one but cannot all be true: a profile
    under a table chip's name without ``profile.measured_on`` or measured on another device (a device
    kind of another table chip, the CPU, one the table does not know), a matmul rate above the chip's
    own peak (an MFU over 100%)."""
    out = []
    measured_on = dict(chip.profile).get("measured_on")
    other = chip_for_device_kind(measured_on) if measured_on else None
    if chip.profile and chip.name in CHIPS and not measured_on:
        out.append(f"{where}.profile: no measured_on: a profile under a table chip's name records the device kind it "
                   f"was measured on (what `stagetool calibrate` writes, e.g. measured_on: TPU v5 lite); add it, or "
                   f"give the figures without a profile:")
    elif chip.profile and chip.name in CHIPS and other is not None and other != chip.name:
        out.append(f"{where}.profile.measured_on: {measured_on!r} is a {other}, not a {chip.name}: a profile "
                   f"measured on another chip; put it under chips.{other} (or calibrate on a {chip.name})")
    elif chip.profile and chip.name in CHIPS and other is None:  # the CPU (calibrate --cpu-for-tests), a new device
        what = "the CPU backend" if measured_on.strip().lower() == "cpu" else "a device kind the chip table does not know"
        out.append(f"{where}.profile.measured_on: {measured_on!r} is {what}, not a {chip.name}: a profile measured "
                   f"on another device; name it for what it measured (chips.{own_chip_name(measured_on)}, then "
                   f"--chip {own_chip_name(measured_on)}), or calibrate on a {chip.name}")
    peak = chip.peak_flops_per_second_bf16
    if peak and "matmul_flops_per_second" in given:
        for cls, rate in chip.matmul_flops_per_second:
            if cls in ("bf16", "f32", "f32_high", "f32_highest") and rate > peak * _PEAK_SLACK:
                out.append(f"{where}.matmul_flops_per_second.{cls}: {rate:.4g} FLOP/s is above {chip.name}'s peak "
                           f"bf16 rate ({peak:.4g}): no matmul runs faster than the peak (an MFU over 100%); a "
                           "profile of another chip? (give peak_flops_per_second_bf16 too if the peak differs)")
    return out


def own_chip_name(device_kind: str) -> str:
    """A chip name of the user's own for a device kind no table chip is (``"cpu"`` -> ``my-cpu``,
    ``"Some NPU 2"`` -> ``my-some-npu-2``): what a hint suggests for a profile measured on it."""
    return "my-" + (re.sub(r"[^a-z0-9.+_]+", "-", device_kind.lower()).strip("-") or "chip")


def _profile_fields(entry: Mapping[str, Any], where: str, values: dict[str, Any], issues: list[str]) -> None:
    """Read a chip entry's ``matmul_flops_per_second`` (``{class: FLOP/s}``), ``matmul_tile``
    (``[rows, columns]``) and ``profile`` (``{key: text}``) into ``values``; problems into ``issues``."""
    if "matmul_flops_per_second" in entry:
        rates = entry["matmul_flops_per_second"]
        if not isinstance(rates, Mapping):
            issues.append(f"{where}.matmul_flops_per_second: expected a mapping of {', '.join(_MATMUL_CLASSES)} to "
                          f"FLOP/s, got {rates!r}")
        else:
            out = []
            for k, v in rates.items():
                if k not in _MATMUL_CLASSES:
                    issues.append(f"{where}.matmul_flops_per_second.{k}: unknown matmul class; valid: "
                                  + ", ".join(_MATMUL_CLASSES))
                    continue
                r = _number(v, f"matmul_flops_per_second.{k}", where, issues)
                if r is not None:
                    out.append((str(k), float(r)))
            values["matmul_flops_per_second"] = tuple(sorted(out, key=lambda kv: _MATMUL_CLASSES.index(kv[0])))
    if "class_rates" in entry:
        rates = entry["class_rates"]
        if not isinstance(rates, Mapping):
            issues.append(f"{where}.class_rates: expected a mapping of {', '.join(CLASS_RATES)} to rates, got {rates!r}")
        else:
            got = []
            for k, v in rates.items():
                if k not in CLASS_RATES:
                    issues.append(f"{where}.class_rates.{k}: unknown kernel class; valid: " + ", ".join(CLASS_RATES))
                    continue
                r = _number(v, f"class_rates.{k}", where, issues)
                if r is not None:
                    got.append((str(k), float(r)))
            values["class_rates"] = tuple(sorted(got))
    if "matmul_tile" in entry:
        tile = entry["matmul_tile"]
        if (isinstance(tile, (list, tuple)) and len(tile) == 2
                and all(isinstance(t, int) and not isinstance(t, bool) and 0 < t <= 4096 for t in tile)):
            values["matmul_tile"] = (int(tile[0]), int(tile[1]))
        else:
            issues.append(f"{where}.matmul_tile: expected [rows, columns], two integers from 1 to 4096, got {tile!r}")
    if "profile" in entry:
        prof = entry["profile"]
        if isinstance(prof, Mapping) and all(isinstance(k, str) for k in prof) and all(
                isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in prof.values()):
            values["profile"] = tuple((k, str(v)) for k, v in prof.items())
        else:
            issues.append(f"{where}.profile: expected a mapping of text (measured_on, date, jax, libtpu, command)")


# ---- what a step time was computed with (issue 47): the figures the step-time model reads, and their digest ----

_NOT_STEP_FIGURES = frozenset({"hbm_capacity_bytes"})
"""Figures of a chip the step-time model never reads (the memory verdict's capacity)."""


def step_figures(chip: Chip) -> tuple[tuple[str, float], ...]:
    """The figures of ``chip`` the step-time model reads, ``(name, value)`` sorted by name: each number of
    the chip entry that is set (peaks, link bandwidths and latencies, measured rates, fixed costs), each
    matmul class's rate as the model takes it (``matmul.f32_highest``: the measured one, else derived from
    the peaks by :meth:`Chip.matmul_rate`) and the matrix unit's tile (``matmul_tile.rows``,
    ``matmul_tile.columns``). Two chips with equal figures give every step the same estimate."""
    out = {f: float(getattr(chip, f)) for f in _FIGURES
           if f not in _NOT_STEP_FIGURES and getattr(chip, f) is not None}
    for cls in _MATMUL_CLASSES:
        rate = chip.matmul_rate(cls)
        if rate is not None:
            out[f"matmul.{cls}"] = float(rate)
    for key, rate in chip.class_rates:
        out[f"class.{key}"] = float(rate)
    if chip.matmul_tile:
        out["matmul_tile.rows"], out["matmul_tile.columns"] = float(chip.matmul_tile[0]), float(chip.matmul_tile[1])
    return tuple(sorted(out.items()))


def figures_digest(figures: Mapping[str, float] | tuple[tuple[str, float], ...]) -> str:
    """16 hex digits of the SHA-256 of ``figures`` (:func:`step_figures`; each value written with 12
    significant digits, as a snapshot keeps numbers): equal figures, equal digest."""
    import hashlib

    items = sorted(dict(figures).items())
    text = ";".join(f"{k}={float(v):.12g}" for k, v in items)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def builtin_step_figures(name: str) -> tuple[tuple[str, float], ...] | None:
    """:func:`step_figures` of the built-in table's chip ``name`` (stagetool's own figures, which no spec
    entry changes), or None for a chip the table does not have."""
    chip = CHIPS.get(name.strip().lower())
    return None if chip is None else step_figures(chip)
