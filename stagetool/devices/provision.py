"""Devices and the mesh: simulated CPU devices, attached GPUs/TPUs, or a compile-only TPU topology.

On CPU, :func:`provision` asks JAX for as many host devices as the mesh needs
(``jax_num_cpu_devices``) before the backend starts, so ``--mesh 2x4`` works on a one-core laptop.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from stagetool.core.chips import RunChip
from stagetool.core.errors import UsageError
from stagetool.core.mesh import MeshSpec
from stagetool.facts import Interconnect
from stagetool.plan.target import COMPILE_ONLY, Attached, DeviceTarget, GpuTarget, TpuTarget


@dataclasses.dataclass(frozen=True)
class DeviceSetup:
    """The devices a function is staged on and the mesh laid over them.

    Attributes:
      platform: ``cpu``, ``gpu`` or ``tpu`` (JAX's platform name of the devices).
      device_kind: ``device.device_kind`` of the first mesh device (e.g. ``"cpu"``, ``"TPU v5 lite"``).
      devices: the mesh's devices in mesh order (``mesh.devices.flat``).
      mesh: the ``jax.sharding.Mesh`` (axis types Auto unless the spec says explicit).
      topology: the compile-only topology name, or None for attached devices.
      process_count: how many processes (hosts) the devices span; with ``--processes N`` the
        simulated count.
      process_of_device: for each mesh device, in mesh order, the process (host) index it belongs to.
      capacity_bytes: memory of one device in bytes when known without asking the device (a
        topology's HBM from the chip table), else None.
      capacity_source: where ``capacity_bytes`` comes from.
      target_config_sha256: for a compile-only GPU target, sha256 of its ``GpuTargetConfigProto``
        text (what XLA compiled for; part of the facts-cache key), else None.
      target_config_source: where that config comes from (stagetool's GPU table or a file), else None.
      slices: TPU slices joined over DCN (``--slices N``), 1 otherwise; the mesh's first axis spans them.
      slice_of_device: for each mesh device, in mesh order, its slice (all 0 for one slice).
      chip: the chip the run's figures are for and what chose it (:func:`stagetool.plan.plan.run_chip`,
        set once by :func:`stagetool.pipeline.provision_devices`), or None (the CPU mesh without
        ``--chip``, or a device the chip table does not know). The roofline, the step-time estimate,
        the modules roll-up and the memory capacity all read this one value.
    """

    platform: str
    device_kind: str
    devices: tuple
    mesh: Any
    topology: str | None
    process_count: int
    process_of_device: tuple[int, ...]
    capacity_bytes: int | None = None
    capacity_source: str | None = None
    target_config_sha256: str | None = None
    target_config_source: str | None = None
    slices: int = 1
    slice_of_device: tuple[int, ...] = ()
    chip: RunChip | None = None


def provision(mesh_spec: MeshSpec, target: DeviceTarget = Attached(), *, processes: int | None = None,
              job_processes: int | None = None, slices: int | None = None) -> DeviceSetup:
    """Make the devices ready and lay the mesh over them.

    Args:
      mesh_spec: axis names and sizes; no axes means a single device.
      target: what to compile for, as the plan parsed it (:mod:`stagetool.plan.target`): a
        compile-only :class:`~stagetool.plan.target.TpuTarget` (``v5e:2x4``) or
        :class:`~stagetool.plan.target.GpuTarget` (``h100:8``, :mod:`stagetool.devices.gpu_topology`),
        simulated CPU devices (:class:`~stagetool.plan.target.CpuMesh`), or the devices JAX finds
        (:class:`~stagetool.plan.target.Attached`; platform None: an attached accelerator if there
        is one, else CPU).
      processes: simulate this many processes (hosts) laid over the devices in order, for local
        avals; None uses the real process layout.
      job_processes: in a multi-process job (``jax.distributed``), how many processes share the
        mesh: each asks for its share of host CPU devices.
      slices: stage this many slices of a TPU target joined over DCN (``--slices``); the mesh's
        first axis spans them (:func:`stagetool.devices.tpu_topology.multislice_mesh`).

    Only the backends the run uses are started (:func:`stagetool.devices.backends.limit_platforms`).

    Raises:
      UsageError: too few devices, a mesh that does not use a compile-only target whole, slices
        without a TPU target, or a process count that does not divide the devices.
    """
    needed = max(mesh_spec.device_count, 1)
    from stagetool.devices.backends import limit_platforms, start_backends

    limit_platforms(target)
    if isinstance(target, COMPILE_ONLY):
        # The host CPU backend beside the compile-only devices gets as many devices as the mesh, as a
        # simulated mesh does: model code that builds its own mesh from jax.devices() at import
        # (jax.make_mesh, as launchers do) then finds enough of them.
        from stagetool.devices.backends import import_jax

        _request_cpu_devices(import_jax(), -(-needed // (job_processes or 1)))
        start_backends()  # the CPU backend beside the compile-only devices, quietly
    if (slices or 1) > 1 and not isinstance(target, TpuTarget):
        raise UsageError(f"--slices {slices}: slices are TPU slices joined over DCN, and need a TPU topology",
                         hint=f"add --topology, e.g. --topology v5e:2x4 --slices {slices}")
    if isinstance(target, GpuTarget):
        return _gpu_setup(mesh_spec, needed, target, processes)
    if isinstance(target, TpuTarget):
        return _tpu_setup(mesh_spec, needed, target, processes, slices or 1)
    return _attached_setup(mesh_spec, needed, target.platform, processes, job_processes)


def _gpu_setup(mesh_spec: MeshSpec, needed: int, target: GpuTarget, processes: int | None) -> DeviceSetup:
    """The compile-only devices of a GPU target, used whole."""
    from stagetool.devices.gpu_topology import gpu_topology
    from stagetool.devices.tpu_topology import topology_mesh

    gpu = gpu_topology(target)
    devices = list(gpu.devices)
    _check_whole(mesh_spec, needed, target.name, len(devices))
    mesh = _make_mesh(mesh_spec, devices) if not mesh_spec.axes else \
        topology_mesh(devices, mesh_spec.sizes, mesh_spec.names, explicit=mesh_spec.axis_types == "explicit")
    setup = _setup(mesh, devices, target.name, processes, (gpu.memory_bytes_per_device, gpu.memory_source))
    return dataclasses.replace(setup, target_config_sha256=gpu.config_sha256, target_config_source=gpu.config_source)


def _tpu_setup(mesh_spec: MeshSpec, needed: int, target: TpuTarget, processes: int | None, n: int) -> DeviceSetup:
    """The compile-only devices of ``n`` slices of a TPU topology, used whole."""
    from stagetool.devices.tpu_topology import multislice_mesh, topology_mesh, tpu_topology

    topo = tpu_topology(target, num_slices=n)
    devices = list(topo.devices)
    _check_whole(mesh_spec, needed, target.name + (f" × {n} slices" if n > 1 else ""), len(devices))
    explicit = mesh_spec.axis_types == "explicit"
    if not mesh_spec.axes:  # one chip, no mesh axes (_check_whole)
        mesh = _make_mesh(mesh_spec, devices)
    elif n > 1:
        mesh = multislice_mesh(devices, mesh_spec.sizes, mesh_spec.names, n, explicit=explicit)
    else:
        mesh = topology_mesh(devices, mesh_spec.sizes, mesh_spec.names, explicit=explicit)
    setup = _setup(mesh, devices, target.name, processes, (topo.hbm_bytes_per_device, topo.hbm_source))
    return dataclasses.replace(setup, slices=n, slice_of_device=tuple(
        int(getattr(d, "slice_index", 0) or 0) for d in setup.devices))


def _attached_setup(mesh_spec: MeshSpec, needed: int, platform: str | None, processes: int | None,
                    job_processes: int | None) -> DeviceSetup:
    """The devices JAX finds on ``platform`` (simulated CPU devices, as many as the mesh needs, on CPU)."""
    import jax

    if platform in (None, "cpu"):
        _request_cpu_devices(jax, -(-needed // (job_processes or 1)))
    from stagetool.devices.tpu_topology import captured_stderr_fd, check_xla_flags, quiet_libtpu_logs

    quiet_libtpu_logs()
    check_xla_flags()
    try:
        # Backends start here. With libtpu installed but no TPU attached, its plugin prints
        # start-up warnings on fd 2 before JAX falls back to the CPU: keep them off the terminal.
        with captured_stderr_fd():
            devices = jax.devices(platform) if platform else jax.devices()
    except RuntimeError as e:
        raise UsageError(f"--platform {platform}: no such backend here ({str(e).splitlines()[0]})",
                         hint="run 'stagetool devices' to see what JAX finds, or use --platform cpu") from None
    if len(devices) < needed:
        if devices[0].platform == "cpu":
            hint = ("the CPU backend started with fewer host devices; run stagetool in a fresh process "
                    "(or set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)")
        else:
            hint = "use --platform cpu to simulate the mesh on host devices, or a smaller --mesh"
        raise UsageError(f"the mesh {mesh_spec} needs {needed} devices, but platform {devices[0].platform} has "
                         f"{len(devices)}", hint=hint)
    used = devices[:needed]
    return _setup(_make_mesh(mesh_spec, used), used, None, processes, (None, None))


def _check_whole(mesh_spec: MeshSpec, needed: int, topology: str, count: int) -> None:
    """A compile-only topology is used whole: the mesh's sizes multiply to its device count (a
    one-device topology needs no mesh axes: the function is staged on its one device)."""
    if not mesh_spec.axes and count == 1:
        return
    if not mesh_spec.axes:
        raise UsageError(f"--topology {topology} needs a mesh to lay over its {count} devices",
                         hint=f"give --mesh, e.g. --mesh data={count}")
    if needed != count:
        raise UsageError(f"the mesh {mesh_spec} has {needed} devices, but topology {topology} has {count}",
                         hint="a compile-only topology is used whole: make the mesh's sizes multiply to its "
                              "device count")


def _setup(mesh: Any, used: list, topology: str | None, processes: int | None,
           capacity: tuple[int | None, str | None]) -> DeviceSetup:
    ordered = tuple(mesh.devices.flat)
    if processes is not None:
        if processes < 1 or len(ordered) % processes:
            raise UsageError(f"--processes {processes} must divide the mesh's {len(ordered)} devices")
        per = len(ordered) // processes
        position = {d: i for i, d in enumerate(used)}
        process_of = tuple(position[d] // per for d in ordered)
        count = processes
    else:
        process_of = tuple(getattr(d, "process_index", 0) for d in ordered)
        count = len(set(process_of))
    return DeviceSetup(
        platform=ordered[0].platform,
        device_kind=str(getattr(ordered[0], "device_kind", ordered[0].platform)),
        devices=ordered,
        mesh=mesh,
        topology=topology,
        process_count=count,
        process_of_device=process_of,
        capacity_bytes=capacity[0],
        capacity_source=capacity[1],
    )


def _request_cpu_devices(jax: Any, n: int) -> None:
    """Ask for ``n`` host CPU devices; a no-op when the backend has already started."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    try:
        current = jax.config.jax_num_cpu_devices  # -1: not set
        if current < n:
            jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # the backend already runs (a notebook, a test session): use the devices it has


def _make_mesh(mesh_spec: MeshSpec, devices: list) -> Any:
    import numpy as np
    from jax.sharding import AxisType, Mesh

    if not mesh_spec.axes:
        return Mesh(np.array(devices[:1]).reshape(()), ())
    kind = AxisType.Explicit if mesh_spec.axis_types == "explicit" else AxisType.Auto
    import jax

    try:
        return jax.make_mesh(mesh_spec.sizes, mesh_spec.names, axis_types=(kind,) * len(mesh_spec.axes),
                             devices=devices)
    except (ValueError, NotImplementedError):
        # make_mesh insists on a physical-topology-aware order on some platforms; the plain order works.
        return Mesh(np.array(devices).reshape(mesh_spec.sizes), mesh_spec.names,
                    axis_types=(kind,) * len(mesh_spec.axes))


def local_mesh_sizes(mesh_spec: MeshSpec, process_of_device: tuple[int, ...], process: int = 0) -> dict[str, int]:
    """How many mesh positions along each axis belong to one process (its local mesh).

    ``process_of_device`` lists the process of each mesh device in mesh (row-major) order. A
    host-local array dimension sharded over axes ``A`` covers ``prod(local sizes along A)`` of the
    ``prod(mesh sizes along A)`` shards, so its global size is ``local × mesh(A) / local(A)``, as in
    ``jax.experimental.multihost_utils.host_local_array_to_global_array``.

    Raises:
      UsageError: when the process's devices do not form a sub-mesh (a box) of the mesh.
    """
    import itertools

    sizes = mesh_spec.sizes
    coords = [c for c, p in zip(itertools.product(*[range(s) for s in sizes]), process_of_device) if p == process]
    local = {}
    box = 1
    for axis, name in enumerate(mesh_spec.names):
        n = len({c[axis] for c in coords})
        local[name] = n
        box *= n
    if box != len(coords):
        raise UsageError(f"the devices of process {process} do not form a sub-mesh of {mesh_spec}; "
                         "local avals need each process to hold a box of the mesh")
    return local


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Memory capacity of one device, in bytes.

    Attributes:
      bytes_limit: bytes the allocator may use on the device, or None.
      source: where the figure comes from (``"jax.Device.memory_stats()['bytes_limit']"``,
        ``"user"`` or a chip-table name).
      reason: why it is None.
    """

    bytes_limit: int | None
    source: str | None
    reason: str | None = None


def device_capacity(device: Any) -> Capacity:
    """Capacity of a ``jax.Device`` from ``device.memory_stats()['bytes_limit']``.

    ``memory_stats()`` is None on CPU (and on compile-only TPU devices it may raise);
    both give a :class:`Capacity` with ``bytes_limit=None`` and a reason.
    """
    try:
        stats = device.memory_stats()
    except Exception as e:  # noqa: BLE001
        return Capacity(None, None, f"memory_stats() raised {type(e).__name__}: {e}")
    if not stats:
        return Capacity(None, None, f"{getattr(device, 'platform', 'this')} device reports no memory_stats()")
    limit = stats.get("bytes_limit")
    if limit is None:
        return Capacity(None, None, "memory_stats() has no 'bytes_limit'")
    return Capacity(int(limit), "jax.Device.memory_stats()['bytes_limit']")


def interconnect_of(setup: DeviceSetup) -> Interconnect:
    """Where each mesh device sits, as the JAX-free record the step-time estimate reads.

    On TPU, each device's chip coordinates (``jax.Device.coords``) in mesh order (= HLO partition
    ids) and the slice's chip grid (the coordinates' extent over the first slice's devices); on GPU
    and CPU no coordinates, the host (process) of each device.
    """
    names = tuple(str(n) for n in setup.mesh.axis_names)
    sizes = tuple(int(s) for s in setup.mesh.devices.shape)
    coords = torus = None
    if setup.platform == "tpu" and setup.devices and all(hasattr(d, "coords") for d in setup.devices):
        coords = tuple(tuple(int(c) for c in d.coords) for d in setup.devices)
        first = [c for c, s in zip(coords, setup.slice_of_device or (0,) * len(coords)) if s == 0] or list(coords)
        torus = tuple(max(c[i] for c in first) - min(c[i] for c in first) + 1 for i in range(len(first[0])))
    chips = {(s, c) for s, c in zip(setup.slice_of_device or (0,) * len(coords), coords)} if coords else set()
    per_chip = max(1, len(setup.devices) // len(chips)) if chips else 1
    return Interconnect(setup.platform, names, sizes, coords, torus, tuple(setup.process_of_device), setup.slices,
                        per_chip)
