"""Which compile-only target a ``--topology`` names (a TPU topology or a GPU target), checked before
JAX starts, and its device count from the name alone.

``v5e:2x4`` (any kind of :data:`stagetool.devices.tpu_topology.TPU_CHIPS`) is a TPU topology;
``h100:8`` (a kind of :data:`stagetool.devices.gpu_topology.GPU_MODELS`, or ``gpu`` with
``--gpu-target-config``) a GPU target.
"""

from __future__ import annotations

import math

from stagetool.core.chips import CHIPS
from stagetool.core.errors import UsageError
from stagetool.devices.gpu_topology import (GPU_INSTALL_LINE, cuda_plugin_available, gpu_device_count, gpu_kinds, gpu_model, is_gpu_topology_name, parse_gpu_topology_name, read_target_config)
from stagetool.devices.tpu_topology import (DEVICES_PER_CHIP, TPU_INSTALL_LINE, check_tpu_shape, TPU_CHIPS, generation_of, libtpu_available, parse_topology_name)

__all__ = ["check_chip_for_target", "check_topology", "is_gpu_target", "target_chip", "topology_device_count"]


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
    _refuse_unknown_kind(name)
    check_tpu_shape(name)
    if not libtpu_available():
        raise UsageError(f"TPU topology {name!r} needs libtpu, which is not installed", hint=TPU_INSTALL_LINE)


def _refuse_unknown_kind(name: str) -> None:
    """A kind that is no TPU generation but close to a GPU's (``h10:8``, ``a10080gb:8``) is a GPU typo:
    refused here, before libtpu is loaded, with "did you mean" and both lists. Other unknown kinds
    are left to libtpu, which knows spellings of its own; its refusal names the GPU targets too."""
    import difflib

    kind = name.split(":", 1)[0].strip() if ":" in name else ""
    if not kind or generation_of(kind) is not None:
        return
    gpus = gpu_kinds()
    close = difflib.get_close_matches(kind.lower(), gpus, n=2, cutoff=0.6)
    tpus = difflib.get_close_matches(kind.lower(), [c.alias for c in TPU_CHIPS], n=2, cutoff=0.6)
    if close and not tpus:
        raise UsageError(f"unknown topology kind {kind!r} in {name!r}: did you mean "
                         + " or ".join(f"{c}:{name.split(':', 1)[1].strip()}" for c in close) + "?",
                         hint="TPU topologies: <kind>:<AxB> with kind one of " + ", ".join(c.alias for c in TPU_CHIPS)
                         + " (e.g. v5e:2x4); GPU targets: <gpu>:<devices per host> with gpu one of "
                         + ", ".join(gpus) + " (e.g. h100:8)")


def target_chip(name: str, gpu_target_config: str | None = None) -> str | None:
    """The roofline table's chip (:data:`stagetool.core.chips.CHIPS`) a compile-only target compiles
    for: ``v5e:2x4`` → ``tpu-v5e``, ``h100:8`` → ``h100-sxm``; None when the table has none (``v2``,
    ``tpu7x``, a ``--gpu-target-config`` of the user's). From the name alone, no backend started.

    Raises:
      UsageError: a malformed name.
    """
    if is_gpu_target(name, gpu_target_config):
        if gpu_target_config is not None:
            return None
        kind, _hosts, _per_host = parse_gpu_topology_name(name)
        try:
            return gpu_model(kind).chip
        except KeyError:
            return None
    kind, _dims = parse_topology_name(name)
    generation = generation_of(kind)
    return f"tpu-{generation}" if generation and f"tpu-{generation}" in CHIPS else None


def check_chip_for_target(chip: str, name: str, gpu_target_config: str | None = None, *,
                          sweep: bool = False) -> None:
    """Refuse a ``--chip`` that is not the chip a compile-only target compiles for: its roofline
    would divide one chip's program by another chip's peak figures, which is no step time of
    either. A chip of the built-in table is checked against the target's own chip
    (:func:`target_chip`), or, where that is unknown, against its platform (``tpu-*`` chips are
    TPUs, the others GPUs); a chip only the spec's ``chips:`` names is taken as written.

    Raises:
      UsageError: the chip and the target differ (exit 2, before anything starts).
    """
    key = chip.strip().lower()
    if key not in CHIPS:
        return
    gpu = is_gpu_target(name, gpu_target_config)
    own = target_chip(name, gpu_target_config)
    chip_is_tpu = key.startswith("tpu-")
    if own is not None and own == key:
        return
    if own is None and chip_is_tpu != gpu:
        return
    what = f"the {own} chip" if own else ("a GPU" if gpu else "a TPU")
    fix = (f"give --chip {own}, or leave --chip out: a sweep over topologies then gives each row its own target's "
           "chip" if sweep else f"give --chip {own}" if own else "give a chip of the target's kind, or no --chip")
    if sweep and own is None:
        fix = "leave --chip out (each row then uses its own target's chip where the table knows it)"
    raise UsageError(f"--chip {chip} does not match --topology {name}, which compiles for {what}: a roofline of "
                     f"one chip over another's compile is no step time of either", hint=fix)
