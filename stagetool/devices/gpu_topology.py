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
  (:mod:`stagetool.hlo.loops`).
- No GPU is there to time kernels, so XLA picks GEMM and fusion configurations without
  autotuning (its heuristics); the report says so.
- Loading the plugin's libraries prints ``cudart_stub.cc ... Could not find cuda drivers`` on fd 2
  (C++, not silenced by any environment variable); ``jax.devices()`` with the CUDA platform
  enabled prints the plugin's "Unable to load CUDA" traceback. stagetool never starts the CUDA
  backend for a compile-only target (:mod:`stagetool.devices.backends`) and captures fd 2 while
  the plugin loads; the text is shown only inside an error.
- A malformed config is ``FAILED_PRECONDITION: Failed to parse GpuTargetConfigProto``, with the
  parser's line:column on fd 2; :func:`gpu_topology` turns both into one exit-2 message. A user's
  config is read first as that proto by stagetool itself (:mod:`stagetool.plan.gpu_target_proto`):
  ``threads_per_warp: 0`` would end the compile with SIGFPE inside XLA, and the capacity stagetool
  reports is the parsed ``device_memory_size``, never a regex's guess.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from stagetool.core.accelerators import GENERIC_KIND, GPU_MODELS, GpuModel, gpu_model
from stagetool.core.errors import UsageError
from stagetool.plan.target import GPU_INSTALL_LINE, GpuTarget, cuda_plugin_available

__all__ = [
    "GPU_INSTALL_LINE",
    "GPU_MODELS",
    "GpuModel",
    "GpuTopology",
    "cuda_plugin_available",
    "gpu_topology",
    "target_config_text",
]


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


def gpu_topology(target: GpuTarget) -> GpuTopology:
    """Compile-only devices of a GPU target as the plan parsed it
    (:func:`stagetool.plan.target.parse_target`; ``h100:8`` → 8 devices on one host).

    The target's ``--gpu-target-config`` file, as the plan read and checked it
    (:attr:`stagetool.plan.target.GpuTarget.config_read`), replaces the table's config (and is
    required for the generic kind ``gpu:N``).

    Raises:
      UsageError: a config XLA's parser refuses (its message), or the CUDA plugin not installed
        (the hint gives the install line).
      ValueError: a target with a config file that :func:`stagetool.plan.target.check_target` has
        not read.
    """
    name, kind, hosts, per_host = target.name, target.kind, target.hosts, target.devices_per_host
    if target.config is not None:
        config = target.config_read
        if config is None:
            raise ValueError(f"{name}: the GPU target's config file is read by plan.target.check_target, not here")
        text, memory = config.text, config.memory_bytes
        source = str(target.config)
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
        model=kind if kind != GENERIC_KIND and target.config is None else None,
        devices=devices,
        num_processes=len({d.process_index for d in devices}),
        devices_per_host=per_host,
        memory_bytes_per_device=memory,
        memory_source=f"device_memory_size of {source}",
        config_source=source,
        config_sha256=hashlib.sha256(text.encode()).hexdigest(),
    )
