"""Published facts of the compile-only targets: TPU generations (:data:`TPU_CHIPS`: the names
libtpu's topologies take, HBM per chip, torus shapes, devices per chip) and GPU models
(:data:`GPU_MODELS`: NVIDIA's figures, enough for XLA:GPU to compile for one). Pure tables, no JAX:
the plan parses a ``--topology`` name against them (:mod:`stagetool.plan.target`) and the devices
build the targets from them (:mod:`stagetool.devices.tpu_topology`, :mod:`stagetool.devices.gpu_topology`).
"""

from __future__ import annotations

import dataclasses

_GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """Published facts about one TPU generation.

    Attributes:
      alias: the topology-name prefix, e.g. ``"v5e"``.
      device_kind: ``device.device_kind`` as libtpu spells it, e.g. ``"TPU v5 lite"``.
      hbm_bytes_per_chip: HBM capacity of one chip in bytes, as Google publishes it
        (Google's pages say "GB"; the figures are binary, GiB).
      source: the page the figure comes from.
    """

    alias: str
    device_kind: str
    hbm_bytes_per_chip: int
    source: str


TPU_CHIPS: tuple[TpuChip, ...] = (
    TpuChip("v2", "TPU v2", 16 * _GIB, "https://cloud.google.com/tpu/docs/v2"),
    TpuChip("v3", "TPU v3", 32 * _GIB, "https://cloud.google.com/tpu/docs/v3"),
    TpuChip("v4", "TPU v4", 32 * _GIB, "https://cloud.google.com/tpu/docs/v4"),
    TpuChip("v5e", "TPU v5 lite", 16 * _GIB, "https://cloud.google.com/tpu/docs/v5e"),
    TpuChip("v5p", "TPU v5", 95 * _GIB, "https://cloud.google.com/tpu/docs/v5p"),
    TpuChip("v6e", "TPU v6 lite", 32 * _GIB, "https://cloud.google.com/tpu/docs/v6e"),
    TpuChip("tpu7x", "TPU7x", 192 * _GIB, "https://cloud.google.com/tpu/docs/tpu7x"),
)
"""Known TPU generations, oldest first. Per-chip HBM; divide by devices per chip for a device."""

_ALIASES = {c.alias: c for c in TPU_CHIPS} | {"v5": TPU_CHIPS[4]}
_BY_KIND = {c.device_kind: c for c in TPU_CHIPS}


def generation_of(kind: str) -> str | None:
    """The :data:`TPU_CHIPS` alias of a topology kind as written (``"v5e"``, ``"TPU v5 lite"``), or None."""
    k = kind.strip()
    if k.lower() in _ALIASES:
        return _ALIASES[k.lower()].alias
    chip = _BY_KIND.get(k)
    return chip.alias if chip else None


def tpu_chip_of_kind(device_kind: str) -> TpuChip | None:
    """The :data:`TPU_CHIPS` entry of a ``device.device_kind`` as libtpu spells it (``"TPU v5 lite"``), or None."""
    return _BY_KIND.get(device_kind)


#: TPU generations whose chips form a 2-D torus (names AxB), with Google's published slice shapes.
TWO_D_SHAPES = {
    "v2": ("2x2", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v3": ("2x2", "4x4", "4x8", "8x8", "8x16", "16x16", "16x32", "32x32"),
    "v5e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v6e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
}
DEVICES_PER_CHIP = {"v2": 2, "v3": 2, "v4": 2, "tpu7x": 2}
"""Compile-only topologies with two devices per chip (:mod:`stagetool.devices.tpu_topology`); others one."""


_MIB = 1024**2
_KIB = 1024


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """NVIDIA's published figures for one GPU, enough for XLA:GPU to compile for it.

    Attributes:
      alias: the topology-name prefix (``"h100"``).
      device_kind: what ``device.device_kind`` is on the real GPU (``"NVIDIA H100 80GB HBM3"``).
      sm_count: streaming multiprocessors.
      compute_capability: ``(major, minor)``.
      memory_bytes: HBM capacity of one GPU in bytes (NVIDIA's "80GB" read as GiB, as
        :mod:`stagetool.core.chips` does; the driver reserves a little of it).
      memory_bandwidth_bytes_per_second: HBM bandwidth (NVIDIA's TB/s, decimal).
      l2_cache_bytes: L2 cache size in bytes.
      boost_clock_ghz: SM boost clock in GHz.
      shared_memory_per_sm_bytes / shared_memory_per_block_optin_bytes: shared memory per SM, and
        the most one block may opt in to.
      fp32_cores_per_sm: FP32 lanes per SM.
      chip: the roofline table's name for it (:data:`stagetool.core.chips.CHIPS`), or None.
      source: where the figures come from.
    """

    alias: str
    device_kind: str
    sm_count: int
    compute_capability: tuple[int, int]
    memory_bytes: int
    memory_bandwidth_bytes_per_second: int
    l2_cache_bytes: int
    boost_clock_ghz: float
    shared_memory_per_sm_bytes: int
    shared_memory_per_block_optin_bytes: int
    fp32_cores_per_sm: int
    chip: str | None
    source: str


_HOPPER_SMEM = (228 * _KIB, 227 * _KIB)  # per SM, per block opt-in (Hopper and Blackwell tuning guides)
_AMPERE_SMEM = (164 * _KIB, 163 * _KIB)

GPU_MODELS: tuple[GpuModel, ...] = (
    GpuModel("a100-80gb", "NVIDIA A100-SXM4-80GB", 108, (8, 0), 80 * _GIB, 2_039 * 10**9, 40 * _MIB, 1.410,
             *_AMPERE_SMEM, 64, "a100-80gb",
             "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
             "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; A100 whitepaper (108 SMs, 40 MB L2)"),
    GpuModel("h100", "NVIDIA H100 80GB HBM3", 132, (9, 0), 80 * _GIB, 3_350 * 10**9, 50 * _MIB, 1.980,
             *_HOPPER_SMEM, 128, "h100-sxm",
             "https://www.nvidia.com/en-us/data-center/h100/ (SXM5: 132 SMs, 50 MB L2, 3.35 TB/s)"),
    GpuModel("h100-pcie", "NVIDIA H100 PCIe", 114, (9, 0), 80 * _GIB, 2_000 * 10**9, 50 * _MIB, 1.755,
             *_HOPPER_SMEM, 128, "h100-pcie",
             "https://www.nvidia.com/en-us/data-center/h100/ (PCIe: 114 SMs, 50 MB L2, 2 TB/s)"),
    GpuModel("h200", "NVIDIA H200", 132, (9, 0), 141 * _GIB, 4_800 * 10**9, 50 * _MIB, 1.980,
             *_HOPPER_SMEM, 128, "h200",
             "https://www.nvidia.com/en-us/data-center/h200/ (SXM: 141 GB HBM3e, 4.8 TB/s; H100's SMs and L2)"),
    GpuModel("b200", "NVIDIA B200", 148, (10, 0), 180 * _GIB, 8_000 * 10**9, 126 * _MIB, 1.965,
             *_HOPPER_SMEM, 128, "b200",
             "https://www.nvidia.com/en-us/data-center/dgx-b200/ (8 × 180 GB HBM3e, 64 TB/s per 8 GPUs; "
             "148 SMs, 126 MB L2)"),
)
"""GPUs ``--topology <alias>:N`` knows, oldest first. ``h100`` is the SXM part."""

_BY_ALIAS = {m.alias: m for m in GPU_MODELS} | {"h100-sxm": GPU_MODELS[1]}
AMBIGUOUS_GPUS = {"a100": ("the A100 comes with 40 GB and 80 GB of memory, and only the 80 GB part is a target here",
                           "write a100-80gb:N for the A100-SXM4-80GB (80 GiB per device); for an A100-40GB give its "
                           "target config: --topology gpu:N --gpu-target-config FILE")}
"""Names a GPU user may write that stand for more than one part: refused (a size is never assumed)."""
GENERIC_KIND = "gpu"
"""The topology kind for ``--gpu-target-config FILE`` alone (``gpu:8``): the file says which GPU."""


def gpu_kinds() -> tuple[str, ...]:
    """Every GPU kind ``--topology KIND:N`` accepts (the aliases of :data:`GPU_MODELS` and ``h100-sxm``)."""
    return tuple(_BY_ALIAS)


def gpu_model(alias: str) -> GpuModel:
    """The :data:`GPU_MODELS` entry of ``alias`` (``"h100"``, ``"h100-sxm"``). Raises ``KeyError``."""
    return _BY_ALIAS[alias.lower()]
