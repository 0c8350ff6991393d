"""Compile-only GPU targets (``h100:8``) on a machine without a GPU or NVIDIA libraries.

Uses the public ``jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=TEXT, topology="1xHxD")``, which needs the CUDA PJRT plugin of the same version as
jax (``jax-cuda12-plugin`` + ``jax-cuda12-pjrt``, no NVIDIA libraries, no driver:
``pip install -e '.[gpu-aot]'`` in stagetool's checkout). ``TEXT`` is an XLA ``stream_executor.GpuTargetConfigProto``
in protobuf text form: what XLA:GPU would otherwise ask the attached GPU (SM count, memory,
bandwidth, clock, compute capability, ...). stagetool writes it from :data:`GPU_MODELS`, a table of
NVIDIA's published figures, or takes the user's (``--gpu-target-config FILE``, for instance one
captured on a real machine with ``stagetool devices --target-config -o FILE``).

Facts measured with jax 0.10.2 and jax-cuda12-plugin 0.10.2, ``JAX_PLATFORMS=cpu``:

- ``topology`` is ``"<slices>x<hosts per slice>x<devices per host>"``; ``1x2x8`` gives 16 devices on
  2 processes. ``h100:8`` → ``1x1x8``, ``h100:2x8`` → ``1x2x8``.
- The devices are ``platform == "gpu"``, ``device_kind`` the config's ``device_description_str``
  (``"NVIDIA H100 80GB HBM3"``); trace, lower and compile work, ``memory_analysis()`` (with
  ``peak_memory_in_bytes``) works, ``Compiled.cost_analysis()`` is None and
  ``Lowered.cost_analysis()`` raises: the pipeline derives FLOPs and bytes from the compiled module
  (:mod:`stagetool.analysis.loops`).
- No GPU is there to time kernels, so XLA picks GEMM and fusion configurations without
  autotuning (its heuristics); the report says so.
- Loading the plugin's libraries prints ``cudart_stub.cc ... Could not find cuda drivers`` on fd 2
  (C++, not silenced by any environment variable); ``jax.devices()`` with the CUDA platform
  enabled prints the plugin's "Unable to load CUDA" traceback. stagetool never starts the CUDA
  backend for a compile-only target (:mod:`stagetool.devices.backends`) and captures fd 2 while
  the plugin loads; the text is shown only inside an error.
- A malformed config is ``FAILED_PRECONDITION: Failed to parse GpuTargetConfigProto``, with the
  parser's line:column on fd 2; :func:`gpu_topology` turns both into one exit-2 message. A user's
  config is read first as that proto by stagetool itself (:mod:`stagetool.devices.gpu_target_proto`):
  ``threads_per_warp: 0`` would end the compile with SIGFPE inside XLA, and the capacity stagetool
  reports is the parsed ``device_memory_size``, never a regex's guess.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import re
from pathlib import Path
from typing import Any

from stagetool.core.errors import UsageError

__all__ = [
    "GPU_INSTALL_LINE",
    "GPU_MODELS",
    "GpuModel",
    "GpuTopology",
    "cuda_plugin_available",
    "gpu_topology",
    "is_gpu_topology_name",
    "parse_gpu_topology_name",
    "target_config_text",
]

GPU_INSTALL_LINE = ("pip install -e '.[gpu-aot]' in stagetool's checkout, as the README says   (or: pip install "
                    '"jax[cuda12-local]==<your jax version>": the CUDA plugin without NVIDIA libraries)')
"""What to install for compile-only GPU targets (shown in errors)."""

_GIB = 1024**3
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
_AMBIGUOUS = {"a100": ("the A100 comes with 40 GB and 80 GB of memory, and only the 80 GB part is a target here",
                       "write a100-80gb:N for the A100-SXM4-80GB (80 GiB per device); for an A100-40GB give its "
                       "target config: --topology gpu:N --gpu-target-config FILE")}
"""Names a GPU user may write that stand for more than one part: refused (a size is never assumed)."""
GENERIC_KIND = "gpu"
"""The topology kind for ``--gpu-target-config FILE`` alone (``gpu:8``): the file says which GPU."""
_NAME_RE = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*:\s*([0-9]{1,6})(?:x([0-9]{1,6}))?\s*$", re.ASCII)
ACCEPTED = ("accepted: <gpu>:<devices per host> or <gpu>:<hosts>x<devices per host> with gpu one of "
            + ", ".join(m.alias for m in GPU_MODELS) + " (or gpu with --gpu-target-config); "
            "e.g. h100:8, h100:2x8, a100-80gb:4")


def is_gpu_topology_name(name: str | None) -> bool:
    """Whether a ``--topology`` value names a GPU target (its kind is in :data:`GPU_MODELS` or ``gpu``)."""
    if not name or ":" not in name:
        return False
    kind = name.split(":", 1)[0].strip().lower()
    return kind in _BY_ALIAS or kind == GENERIC_KIND or kind in _AMBIGUOUS


def gpu_kinds() -> tuple[str, ...]:
    """Every GPU kind ``--topology KIND:N`` accepts (the aliases of :data:`GPU_MODELS` and ``h100-sxm``)."""
    return tuple(_BY_ALIAS)


def parse_gpu_topology_name(name: str) -> tuple[str, int, int]:
    """Split ``"h100:2x8"`` into ``("h100", 2, 8)`` (kind, hosts, devices per host); ``h100:8`` is one host.

    Pure, no plugin needed. Raises :class:`UsageError` listing the accepted forms when the name has
    no such shape, a count is 0, or the kind is unknown.
    """
    m = _NAME_RE.match(name or "")
    if not m:
        from stagetool.core.text import clipped

        raise UsageError(f"bad GPU topology name {clipped(name or '')}", hint=ACCEPTED)
    kind = m.group(1).lower()
    if kind in _AMBIGUOUS:
        why, fix = _AMBIGUOUS[kind]
        raise UsageError(f"GPU {m.group(1)!r} in topology {name!r} is ambiguous: {why}", hint=fix)
    if kind not in _BY_ALIAS and kind != GENERIC_KIND:
        raise UsageError(f"unknown GPU {m.group(1)!r} in topology {name!r}", hint=ACCEPTED)
    hosts, per_host = (int(m.group(2)), int(m.group(3))) if m.group(3) else (1, int(m.group(2)))
    if hosts < 1 or per_host < 1:
        raise UsageError(f"GPU topology {name!r} has no devices", hint=ACCEPTED)
    from stagetool.core.mesh import MAX_DEVICES

    if hosts * per_host > MAX_DEVICES:
        raise UsageError(f"GPU topology {name!r} has more than {MAX_DEVICES} devices", hint=ACCEPTED)
    return (_BY_ALIAS[kind].alias if kind in _BY_ALIAS else kind), hosts, per_host


def gpu_device_count(name: str) -> int:
    """Devices of GPU topology ``name`` from its name alone (``h100:2x8`` → 16)."""
    _kind, hosts, per_host = parse_gpu_topology_name(name)
    return hosts * per_host


def gpu_model(alias: str) -> GpuModel:
    """The :data:`GPU_MODELS` entry of ``alias`` (``"h100"``, ``"h100-sxm"``). Raises ``KeyError``."""
    return _BY_ALIAS[alias.lower()]


def target_config_text(model: GpuModel, *, cudnn_version: tuple[int, int, int] = (9, 8, 0)) -> str:
    """An XLA ``GpuTargetConfigProto`` in text form for ``model``'s published figures.

    The limits every NVIDIA GPU since Volta shares (1024 threads per block, warps of 32, 48 KiB
    default shared memory per block, 2048 threads and 64 Ki registers per SM, grid limits) are
    fixed; the rest comes from the table. ``cudnn_version`` is the cuDNN XLA may assume (the plugin
    of jax 0.10 requires ≥ 9.8).
    """
    major, minor = model.compute_capability
    cc = f"major: {major}" + (f" minor: {minor}" if minor else "")
    lines = [
        "# written by stagetool from " + model.source,
        "gpu_device_info {",
        "  threads_per_block_limit: 1024",
        "  threads_per_warp: 32",
        "  shared_memory_per_block: 49152",
        f"  shared_memory_per_core: {model.shared_memory_per_sm_bytes}",
        "  threads_per_core_limit: 2048",
        f"  core_count: {model.sm_count}",
        f"  fpus_per_core: {model.fp32_cores_per_sm}",
        "  block_dim_limit_x: 2147483647",
        "  block_dim_limit_y: 65535",
        "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {model.memory_bandwidth_bytes_per_second}",
        f"  l2_cache_size: {model.l2_cache_bytes}",
        f"  clock_rate_ghz: {model.boost_clock_ghz}",
        f"  device_memory_size: {model.memory_bytes}",
        f"  shared_memory_per_block_optin: {model.shared_memory_per_block_optin_bytes}",
        f"  cuda_compute_capability {{ {cc} }}",
        "  registers_per_core_limit: 65536",
        "  registers_per_block_limit: 65536",
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info {{ major: {} minor: {} patch: {} }}".format(*cudnn_version),
        f'device_description_str: "{model.device_kind}"',
    ]
    return "\n".join(lines) + "\n"


def cuda_plugin_available() -> bool:
    """True when JAX's CUDA PJRT plugin (``jax_plugins.xla_cuda12``, from ``jax-cuda12-plugin``) is importable.

    Looks for the package without importing it (importing loads CUDA stubs that print on fd 2).
    """
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except (ImportError, ValueError):
        return False


def cuda_plugin_version() -> str | None:
    """The installed ``jax-cuda12-plugin`` distribution's version, or None."""
    from importlib import metadata

    try:
        return metadata.version("jax-cuda12-plugin")
    except metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class GpuTopology:
    """A compile-only GPU target and the facts stagetool reports about it.

    Attributes:
      name: the topology name as given (``"h100:2x8"``).
      device_kind: ``device.device_kind`` (the config's ``device_description_str``).
      model: the :data:`GPU_MODELS` alias, or None for a user's config of another GPU.
      devices: the compile-only devices in id order.
      num_processes: hosts (``device.process_index`` values).
      devices_per_host: devices on each host.
      memory_bytes_per_device: the config's ``device_memory_size`` in bytes (a config without one is refused).
      memory_source: where that figure comes from.
      config_source: ``"stagetool's GPU table (h100)"`` or the ``--gpu-target-config`` path.
      config_sha256: sha256 of the config text (part of the facts-cache key).
    """

    name: str
    device_kind: str
    model: str | None
    devices: tuple[Any, ...]
    num_processes: int
    devices_per_host: int
    memory_bytes_per_device: int
    memory_source: str
    config_source: str
    config_sha256: str

    @property
    def num_devices(self) -> int:
        """Number of devices (``len(devices)``)."""
        return len(self.devices)


def read_target_config(path: str | Path) -> str:
    """The text of a ``--gpu-target-config`` file, once it has been read as the protobuf XLA reads
    and checked (:func:`stagetool.devices.gpu_target_proto.read_target_config_file`).

    Raises:
      UsageError: the file cannot be read, is not a regular file of sensible size, or is not a
        valid ``GpuTargetConfigProto`` (a field XLA divides by, or ``device_memory_size``, missing
        or not above 0).
    """
    from stagetool.devices.gpu_target_proto import read_target_config_file

    return read_target_config_file(path).text


def gpu_topology(name: str, target_config: str | Path | None = None) -> GpuTopology:
    """Compile-only devices of GPU topology ``name`` (``"h100:8"`` → 8 devices on one host).

    ``target_config`` is a ``--gpu-target-config`` file; it replaces the table's config (and is
    required for the generic kind ``gpu:N``).

    Raises:
      UsageError: a malformed name, an unknown GPU, a missing or malformed config (XLA's parser
        message), or the CUDA plugin not installed (the hint gives the install line).
    """
    kind, hosts, per_host = parse_gpu_topology_name(name)
    if target_config is not None:
        from stagetool.devices.gpu_target_proto import read_target_config_file

        config = read_target_config_file(target_config)
        text, memory = config.text, config.memory_bytes
        source = str(target_config)
    elif kind == GENERIC_KIND:
        raise UsageError(f"topology {name!r}: the generic GPU kind needs --gpu-target-config FILE",
                         hint="or name a GPU: " + ", ".join(m.alias for m in GPU_MODELS))
    else:
        text = target_config_text(gpu_model(kind))
        memory = gpu_model(kind).memory_bytes
        source = f"stagetool's GPU table ({kind})"
    if not cuda_plugin_available():
        raise UsageError(f"GPU topology {name!r} needs JAX's CUDA plugin, which is not installed",
                         hint=GPU_INSTALL_LINE)
    from stagetool.devices.tpu_topology import captured_stderr_fd, check_xla_flags

    check_xla_flags()
    from jax.experimental import topologies

    with captured_stderr_fd() as noise:
        try:
            topo = topologies.get_topology_desc(platform="cuda", target_config=text,
                                                topology=f"1x{hosts}x{per_host}")
            error = None
        except Exception as e:  # JaxRuntimeError, NotImplementedError, RuntimeError
            topo, error = None, e
    if error is not None:
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        parser = [ln.split("] ", 1)[-1] for ln in "".join(noise).splitlines() if "text_format" in ln or "Error parsing" in ln]
        if parser or "GpuTargetConfigProto" in detail:
            raise UsageError(f"{source}: XLA cannot read the GPU target config: {detail}"
                             + (f" ({parser[0]})" if parser else ""),
                             hint="fix the file (protobuf text of stream_executor.GpuTargetConfigProto)") from None
        version = cuda_plugin_version()
        raise UsageError(f"GPU topology {name!r}: {detail}",
                         hint=f"jax-cuda12-plugin {version} must be the version of jax; {GPU_INSTALL_LINE}") from None
    devices = tuple(sorted(topo.devices, key=lambda d: d.id))
    return GpuTopology(
        name=name,
        device_kind=str(devices[0].device_kind),
        model=kind if kind != GENERIC_KIND and target_config is None else None,
        devices=devices,
        num_processes=len({d.process_index for d in devices}),
        devices_per_host=per_host,
        memory_bytes_per_device=memory,
        memory_source=f"device_memory_size of {source}",
        config_source=source,
        config_sha256=hashlib.sha256(text.encode()).hexdigest(),
    )
