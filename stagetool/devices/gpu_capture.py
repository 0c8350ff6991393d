"""Capture the ``GpuTargetConfigProto`` of the GPU attached here (``stagetool devices --target-config``).

JAX has no public call that returns the target config XLA:GPU builds for a device, so this asks
the NVIDIA driver directly, through its stable C API (``libcuda.so.1``: ``cuInit``,
``cuDeviceGet``, ``cuDeviceGetName``, ``cuDeviceTotalMem_v2``, ``cuDeviceGetAttribute`` with the
``CU_DEVICE_ATTRIBUTE_*`` numbers of ``cuda.h``, which never change), for the figures XLA reads
when it describes a device: SM count, compute capability, clocks, memory bus, L2, shared memory
and register limits. Memory bandwidth is XLA's formula ``2 × memory clock × bus width / 8``
(double data rate). The text is written with
:func:`stagetool.devices.gpu_topology.target_config_text`'s layout and can be given back with
``--gpu-target-config FILE`` on a machine without a GPU.

This is the one module that calls the driver; without ``libcuda.so.1`` or without a device it raises
:class:`~stagetool.core.errors.UsageError` (exit 2) saying so.
"""

from __future__ import annotations

import ctypes
from typing import Any

from stagetool.core.errors import UsageError

__all__ = ["capture_target_config"]

# CU_DEVICE_ATTRIBUTE_* (cuda.h)
_ATTRIBUTES = {
    "threads_per_block_limit": 1,     # MAX_THREADS_PER_BLOCK
    "block_dim_limit_x": 5,           # MAX_GRID_DIM_X
    "block_dim_limit_y": 6,           # MAX_GRID_DIM_Y
    "block_dim_limit_z": 7,           # MAX_GRID_DIM_Z
    "shared_memory_per_block": 8,     # MAX_SHARED_MEMORY_PER_BLOCK
    "threads_per_warp": 10,           # WARP_SIZE
    "registers_per_block_limit": 12,  # MAX_REGISTERS_PER_BLOCK
    "clock_khz": 13,                  # CLOCK_RATE (kHz)
    "core_count": 16,                 # MULTIPROCESSOR_COUNT
    "memory_clock_khz": 36,           # MEMORY_CLOCK_RATE (kHz)
    "bus_width_bits": 37,             # GLOBAL_MEMORY_BUS_WIDTH
    "l2_cache_size": 38,              # L2_CACHE_SIZE
    "threads_per_core_limit": 39,     # MAX_THREADS_PER_MULTIPROCESSOR
    "cc_major": 75,                   # COMPUTE_CAPABILITY_MAJOR
    "cc_minor": 76,                   # COMPUTE_CAPABILITY_MINOR
    "shared_memory_per_core": 81,     # MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    "registers_per_core_limit": 82,   # MAX_REGISTERS_PER_MULTIPROCESSOR
    "shared_memory_per_block_optin": 97,  # MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
}

_NO_GPU_HINT = ("run it on a machine with the GPU (it reads the figures from the NVIDIA driver), or use a "
                "built-in GPU: --topology h100:8")


def _driver() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise UsageError("--target-config: no NVIDIA driver here (libcuda.so.1 is not loadable), so there is "
                         "no attached GPU to describe", hint=_NO_GPU_HINT) from None


def _check(status: int, call: str) -> None:
    if status != 0:
        raise UsageError(f"--target-config: the NVIDIA driver's {call} failed (CUresult {status}): no usable "
                         "GPU here", hint=_NO_GPU_HINT)


def device_figures(ordinal: int = 0) -> dict[str, Any]:
    """The driver's figures of GPU ``ordinal``: ``name``, ``memory_bytes`` and every :data:`_ATTRIBUTES` key.

    Raises:
      UsageError: no driver or no such device.
    """
    cuda = _driver()
    _check(cuda.cuInit(0), "cuInit")
    device = ctypes.c_int()
    _check(cuda.cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
    name = ctypes.create_string_buffer(256)
    _check(cuda.cuDeviceGetName(name, 256, device), "cuDeviceGetName")
    total = ctypes.c_size_t()
    _check(cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device), "cuDeviceTotalMem_v2")
    out: dict[str, Any] = {"name": name.value.decode("utf-8", "replace"), "memory_bytes": int(total.value)}
    for key, attribute in _ATTRIBUTES.items():
        value = ctypes.c_int()
        _check(cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, device), f"cuDeviceGetAttribute({key})")
        out[key] = int(value.value)
    return out


def config_from_figures(f: dict[str, Any], *, cudnn_version: tuple[int, int, int] = (9, 8, 0)) -> str:
    """A ``GpuTargetConfigProto`` text from :func:`device_figures`' dict (pure; tested without a GPU)."""
    bandwidth = 2 * f["memory_clock_khz"] * 1000 * f["bus_width_bits"] // 8
    cc = f"major: {f['cc_major']}" + (f" minor: {f['cc_minor']}" if f["cc_minor"] else "")
    lines = [
        f"# captured by stagetool devices --target-config from the NVIDIA driver ({f['name']})",
        "gpu_device_info {",
        *(f"  {k}: {f[k]}" for k in ("threads_per_block_limit", "threads_per_warp", "shared_memory_per_block",
                                     "shared_memory_per_core", "threads_per_core_limit", "core_count")),
        f"  fpus_per_core: {64 if f['cc_major'] == 8 and f['cc_minor'] == 0 else 128}",
        *(f"  {k}: {f[k]}" for k in ("block_dim_limit_x", "block_dim_limit_y", "block_dim_limit_z")),
        f"  memory_bandwidth: {bandwidth}",
        f"  l2_cache_size: {f['l2_cache_size']}",
        f"  clock_rate_ghz: {f['clock_khz'] / 1e6:g}",
        f"  device_memory_size: {f['memory_bytes']}",
        f"  shared_memory_per_block_optin: {f['shared_memory_per_block_optin']}",
        f"  cuda_compute_capability {{ {cc} }}",
        f"  registers_per_core_limit: {f['registers_per_core_limit']}",
        f"  registers_per_block_limit: {f['registers_per_block_limit']}",
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info {{ major: {} minor: {} patch: {} }}".format(*cudnn_version),
        f'device_description_str: "{f["name"]}"',
    ]
    return "\n".join(lines) + "\n"


def capture_target_config(ordinal: int = 0) -> str:
    """The ``GpuTargetConfigProto`` text of the attached GPU ``ordinal``.

    Raises:
      UsageError: no NVIDIA driver or GPU here (exit 2, with what to do instead).
    """
    return config_from_figures(device_figures(ordinal))
