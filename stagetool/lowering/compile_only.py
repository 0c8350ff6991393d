"""Which compile-only target a ``--topology`` names (a TPU topology or a GPU target), checked before
JAX starts, and its device count from the name alone.

``v5e:2x4`` (any kind of :data:`stagetool.lowering.topology.TPU_CHIPS`) is a TPU topology;
``h100:8`` (a kind of :data:`stagetool.lowering.gpu_topology.GPU_MODELS`, or ``gpu`` with
``--gpu-target-config``) a GPU target.
"""

from __future__ import annotations

import math

from stagetool.core.errors import UsageError
from stagetool.lowering.gpu_topology import (
    GPU_INSTALL_LINE,
    cuda_plugin_available,
    gpu_device_count,
    is_gpu_topology_name,
    parse_gpu_topology_name,
    read_target_config,
)
from stagetool.lowering.topology import (
    DEVICES_PER_CHIP,
    TPU_INSTALL_LINE,
    check_tpu_shape,
    generation_of,
    libtpu_available,
)

__all__ = ["check_topology", "is_gpu_target", "topology_device_count"]


def is_gpu_target(name: str | None, gpu_target_config: str | None = None) -> bool:
    """Whether ``--topology name`` (with ``--gpu-target-config``) is a compile-only GPU target."""
    return name is not None and (is_gpu_topology_name(name) or gpu_target_config is not None)


def topology_device_count(name: str, gpu_target_config: str | None = None) -> int:
    """Devices of a compile-only topology from its name alone, no backend started: a TPU's chips ×
    devices per chip (``v5e:4x4`` → 16, ``v4:2x2x1`` → 8), a GPU target's hosts × devices (``h100:2x8`` → 16).

    Raises:
      UsageError: a malformed name or a shape that does not exist.
    """
    if is_gpu_topology_name(name) or gpu_target_config is not None:
        return gpu_device_count(name)
    kind, dims = check_tpu_shape(name)
    return math.prod(dims) * DEVICES_PER_CHIP.get(generation_of(kind) or kind.strip().lower(), 1)


def check_topology(name: str | None, gpu_target_config: str | None = None) -> None:
    """Everything about a ``--topology`` (and ``--gpu-target-config``) that can be said before JAX
    starts: the name's form and shape, the config file, and that the library it needs is installed.

    Raises:
      UsageError: what is wrong and how to fix it (the install line for a missing library).
    """
    if name is None:
        if gpu_target_config is not None:
            raise UsageError(f"--gpu-target-config {gpu_target_config} needs a GPU topology to compile for",
                             hint="add --topology gpu:8 (one host of 8 GPUs) or gpu:2x8 (2 hosts)")
        return
    if is_gpu_topology_name(name) or gpu_target_config is not None:
        kind, _hosts, _per_host = parse_gpu_topology_name(name)
        if gpu_target_config is not None:
            read_target_config(gpu_target_config)
        elif kind == "gpu":
            raise UsageError(f"topology {name!r}: the generic GPU kind needs --gpu-target-config FILE")
        if not cuda_plugin_available():
            raise UsageError(f"GPU topology {name!r} needs JAX's CUDA plugin, which is not installed",
                             hint=GPU_INSTALL_LINE)
        return
    check_tpu_shape(name)
    if not libtpu_available():
        raise UsageError(f"TPU topology {name!r} needs libtpu, which is not installed", hint=TPU_INSTALL_LINE)
