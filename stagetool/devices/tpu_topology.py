"""Compile-only TPU devices for a named topology (``v5e:2x4``) on a machine without a TPU.

Uses the public ``jax.experimental.topologies.get_topology_desc(platform="tpu",
topology_name=...)``, which needs the ``libtpu`` package (``pip install -e '.[tpu]'`` in stagetool's checkout).
The devices it returns can build a ``jax.sharding.Mesh`` and take
``jax.jit(f).trace(...).lower().compile()`` all the way, with TPU memory and cost analysis;
they cannot run anything.

Facts measured with jax 0.10.2 and libtpu 0.0.52 (also 0.0.42.1, the version ``jax[tpu]==0.10.2``
pins):

- ``JAX_PLATFORMS`` does not need to name ``tpu``; with ``JAX_PLATFORMS=cpu`` the CPU backend
  keeps its ``jax_num_cpu_devices`` host devices, ``jax.devices()`` stays the CPU list, and the
  topology devices live beside it in the same process.
- Names are ``<kind>:<AxB[xC]>``. Kinds accepted by libtpu: ``v2``, ``v3``, ``v4``, ``v5e``,
  ``v5p`` (``v5`` is the same), ``v6e``, ``tpu7x``, and libtpu's own device-kind spelling
  (``"TPU v5 lite:2x4"``). ``v5litepod``, ``v6``, ``v7``, ``v7x`` are rejected. An empty name
  gives a default v2 topology, so it is rejected here.
- v2, v3, v4 and tpu7x give two devices per chip (``core_on_chip`` 0 and 1; v4 compile-only
  topologies are *not* megacore), v5e, v5p and v6e one.
- ``memory_stats()`` raises on compile-only devices ("only supported for addressable PjRt
  devices"), so HBM capacity comes from :data:`TPU_CHIPS`, a table of Google's published
  figures.
- On first use libtpu prints warnings about ``TPU_ACCELERATOR_TYPE``, worker host names and
  "Logging before InitGoogle()" to file descriptor 2, from C++. The calls below redirect fd 2
  to a temporary file while libtpu initialises and builds the topology; the captured text is
  only shown inside the error when the call fails. Setting ``TPU_ACCELERATOR_TYPE`` /
  ``TPU_WORKER_HOSTNAMES`` would also silence it, but would lie about the machine; the
  compiled programs are identical either way (checked by hash of the HLO text).
- libtpu holds ``/tmp/libtpu_lockfile`` once loaded, even compile-only; a second process that
  loads it fails ("ABORTED: ... libtpu multi-process lockfile") unless
  ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``, which :func:`tpu_topology_devices` sets (``setdefault``)
  before loading libtpu.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from stagetool.core.accelerators import TPU_CHIPS, TpuChip, tpu_chip_of_kind
from stagetool.core.errors import UsageError
from stagetool.plan.target import TPU_ACCEPTED, TPU_INSTALL_LINE, TpuTarget, libtpu_available

__all__ = [
    "TPU_CHIPS",
    "TPU_INSTALL_LINE",
    "TpuChip",
    "TpuTopology",
    "libtpu_available",
    "libtpu_version",
    "topology_mesh",
    "tpu_topology",
    "tpu_topology_devices",
]


def libtpu_version() -> str | None:
    """The installed ``libtpu`` distribution's version (e.g. ``"0.0.52"``), or None.

    Worth recording beside TPU figures: generated-code size differs between libtpu releases
    (1.33 MB with 0.0.52 vs 0.30 MB with 0.0.42.1 for the same v5e program).
    """
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def quiet_libtpu_logs() -> None:
    """Keep libtpu from writing log files (``/tmp/tpu_logs/tpu_driver.*``, two per process, even
    with ``--platform cpu``) unless the user asked for them: ``TPU_MIN_LOG_LEVEL=3`` (fatal only)
    when neither ``TPU_MIN_LOG_LEVEL`` nor ``TPU_LOG_DIR`` is set. Call before a backend starts."""
    if "TPU_MIN_LOG_LEVEL" not in os.environ and "TPU_LOG_DIR" not in os.environ:
        os.environ["TPU_MIN_LOG_LEVEL"] = "3"


def check_xla_flags() -> None:
    """Say what is wrong with ``XLA_FLAGS`` before XLA reads it: XLA ends the process (exit 1)
    on a flag it does not know, and its message is lost while libtpu's start-up noise is captured.
    Every XLA flag is ``--xla_NAME[=VALUE]``; anything else is refused here (exit 2).

    Raises:
      UsageError: a token of ``XLA_FLAGS`` is not an XLA flag.
    """
    import re

    text = os.environ.get("XLA_FLAGS", "")
    bad = [t for t in text.split() if not re.match(r"--xla_[A-Za-z0-9_]+(=|$)", t)]
    if bad:
        raise UsageError(f"XLA_FLAGS={text!r}: {bad[0]!r} is not an XLA flag (XLA would end the process on it)",
                         hint="XLA flags look like --xla_force_host_platform_device_count=8; fix or unset XLA_FLAGS")
    if text.strip() and _CHECKED_XLA_FLAGS.get("text") != text:
        # Once a backend runs, XLA has read XLA_FLAGS (it reads it once, when the first backend
        # starts) and never reads it again, so a later change cannot end the process: nothing to
        # check, and no fork of a process whose XLA threads run (JAX warns of a deadlock then).
        problem = None if backends_running() else _xla_flags_problem()
        _CHECKED_XLA_FLAGS["text"] = text
        if problem:
            raise UsageError(f"XLA_FLAGS={text!r}: XLA refuses it: {problem}",
                             hint="fix or unset XLA_FLAGS (XLA would end the process on it)")


_CHECKED_XLA_FLAGS: dict[str, str] = {}


def backends_running() -> bool:
    """Whether JAX's backends have started in this process, from public behaviour only:
    ``jax_num_cpu_devices`` can be changed before they start and raises ``RuntimeError`` after
    (JAX's own check). The probe sets it to another value and back, so it changes nothing.
    Measured on jax 0.10.2: once a backend runs, a bogus ``XLA_FLAGS`` set later is never read
    (a compile and ``CompileOptions()`` both succeed)."""
    import jax

    current = jax.config.jax_num_cpu_devices
    try:
        jax.config.update("jax_num_cpu_devices", current + 1)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", current)
    return False


def _xla_flags_problem(timeout_s: float = 20.0) -> str | None:
    """XLA's message if it refuses ``XLA_FLAGS``, else None.

    XLA parses ``XLA_FLAGS`` once, when a compile option is first made, and on an unknown flag ends
    the process (exit 1). A forked child makes one (``jaxlib.xla_client.CompileOptions``, no
    backend started) with its stderr in a pipe; the parent reads XLA's line if the child dies.
    Called only while no backend runs (:func:`backends_running`): JAX installs its "os.fork() was
    called ... deadlock" warning when its first backend starts, and XLA's thread pools run from then.
    """
    if not hasattr(os, "fork"):
        return None
    import re
    import time

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only this one call, then _exit
        try:
            os.close(read_end)
            os.dup2(write_end, 2)
            import jaxlib.xla_client as xc

            xc.CompileOptions()
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:  # never hang on the check itself
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(read_end)
            return None
        time.sleep(0.01)
    with os.fdopen(read_end, "rb") as fh:
        output = fh.read().decode("utf-8", "replace")
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    # XLA's own log lines (E1201 12:00:00.0 pid file.cc:63] message): the first error is the reason
    logged = [m.group(1).strip() for m in re.finditer(r"^[EF]\d{4} [^\]]*\] (.*)$", output, re.M)]
    return logged[0] if logged else "the flags were refused"


@contextlib.contextmanager
def captured_stderr_fd() -> Iterator[list[str]]:
    """Send file descriptor 2 to a temporary file; yields a list that receives its text."""
    captured: list[str] = []
    try:
        sys.stderr.flush()
    except (AttributeError, ValueError):  # pragma: no cover - closed or replaced stderr
        pass
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            captured.append(tmp.read().decode("utf-8", "replace"))


#: TPU generations sold as one host with 8 chips (v5e-8 / v6e-8 VMs); bigger slices use 4-chip hosts.
_EIGHT_CHIP_HOSTS = ("v5e", "v6e")


def host_override_note(target: TpuTarget, num_processes: int) -> str | None:
    """A sentence when stagetool chose the host layout of a TPU topology rather than libtpu's
    default (4-chip hosts): 8-chip v5e/v6e slices are one host, as the v5e-8/v6e-8 VMs are, and a
    slice smaller than libtpu's host is one host. None when libtpu's default applies."""
    if target.kind in _EIGHT_CHIP_HOSTS and target.chips == 8 and len(target.dims) == 2:
        return (f"topology {target.name}: {num_processes} host(s) of 8 chips: stagetool's override of libtpu's "
                "default (hosts of 2x2x1 chips, which would make 2 hosts), because v5e-8/v6e-8 are single-host VMs; "
                "it changes local avals only")
    if target.chips < 4:
        return (f"topology {target.name}: {num_processes} host(s): the slice is smaller than libtpu's default host "
                "of 2x2x1 chips")
    return None


def tpu_topology_devices(target: TpuTarget, chips_per_host_bounds: Sequence[int] | None = None,
                         num_slices: int = 1) -> tuple[Any, ...]:
    """Compile-only TPU devices of a topology as the plan parsed it
    (:func:`stagetool.plan.target.parse_target`; ``v5e:2x4`` → 8 devices).

    Order is libtpu's (device id order). The devices can form a ``Mesh`` and compile, never
    execute. libtpu's start-up chatter on stderr is swallowed.

    ``num_slices`` > 1 stages that many slices of the topology joined over the data-centre network
    (DCN; ``get_topology_desc(..., num_slices=N)``): N × the devices, ``device.slice_index`` 0..N-1.

    ``chips_per_host_bounds`` (e.g. ``(2, 4, 1)``) sets how many chips one host (process) has;
    libtpu's default is ``(2, 2, 1)``. An 8-chip v5e or v6e slice defaults to one host, as the
    v5e-8 / v6e-8 VMs are; larger slices keep libtpu's 4-chip hosts. It only changes
    ``device.process_index`` (and so local avals).

    Raises:
      UsageError: libtpu is not installed (the hint gives the install line), or the kind or shape
        is unknown to libtpu (the hint lists accepted forms).
    """
    name, kind, _dims = target.name, target.kind, target.dims
    if not libtpu_available():
        raise UsageError(f"TPU topology {name!r} needs libtpu, which is not installed",
                         hint=TPU_INSTALL_LINE)
    # libtpu takes /tmp/libtpu_lockfile on start-up, even for compile-only use; without this a
    # second concurrent process (parallel CI jobs, two stagetool runs) fails with "ABORTED:
    # Internal error when accessing libtpu multi-process lockfile".
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    quiet_libtpu_logs()
    check_xla_flags()
    canonical = target.libtpu_name
    if chips_per_host_bounds is None and kind in _EIGHT_CHIP_HOSTS and math.prod(_dims) == 8 and len(_dims) == 2:
        # v5e-8 and v6e-8 are single-host VMs (all 8 chips on one host): so are their topologies.
        chips_per_host_bounds = (*_dims, 1)
    with captured_stderr_fd() as noise:
        # Imported here: with JAX's CUDA plugin installed, importing jax prints its cudart notice on fd 2.
        from jax.experimental import topologies

        kwargs: dict[str, Any] = {} if chips_per_host_bounds is None else {
            "chips_per_host_bounds": [int(b) for b in chips_per_host_bounds]}
        if num_slices > 1:
            kwargs["num_slices"] = int(num_slices)
        try:
            topo = topologies.get_topology_desc(platform="tpu", topology_name=canonical, **kwargs)
            error = None
        except Exception as e:  # JaxRuntimeError (INVALID_ARGUMENT) or RuntimeError
            topo, error = None, e
        if (error is not None and chips_per_host_bounds is None and "not divisible" in str(error)
                and math.prod(_dims) < 4):
            # A slice smaller than libtpu's default host (v5e:1x1 with libtpu 0.0.42) fits on one host.
            one_host = [*_dims, 1, 1][:3]
            try:
                topo = topologies.get_topology_desc(platform="tpu", topology_name=canonical,
                                                    **{**kwargs, "chips_per_host_bounds": one_host})
                error = None
            except Exception:
                pass
    if error is not None:
        text = str(error)
        if "not installed" in text:
            raise UsageError(f"TPU topology {name!r} needs libtpu: {text}", hint=TPU_INSTALL_LINE) from None
        detail = text.splitlines()[0] if text else type(error).__name__
        if "INVALID_ARGUMENT" in detail:
            raise UsageError(f"libtpu rejected TPU topology {name!r}: {detail}",
                             hint=f"{TPU_ACCEPTED}; a compile-only GPU target is <gpu>:<devices per host>, "
                                  "e.g. h100:8, a100-80gb:8, b200:8") from None
        extra = "".join(noise).strip()
        msg = f"libtpu failed to build TPU topology {name!r}: {detail}" + (f"\n{extra}" if extra else "")
        raise UsageError(msg) from None
    return tuple(topo.devices)


@dataclasses.dataclass(frozen=True)
class TpuTopology:
    """A compile-only TPU topology and the facts stagetool reports about it.

    Attributes:
      name: the topology name as given, e.g. ``"v5e:2x4"``.
      device_kind: ``device.device_kind``, e.g. ``"TPU v5 lite"``.
      generation: the alias from :data:`TPU_CHIPS` (``"v5e"``), or None for a kind not in it.
      devices: the compile-only devices, in libtpu's order (``len`` = device count).
      num_chips: distinct chips (coordinates within a slice, times the slices).
      devices_per_chip: devices (TensorCores exposed as devices) per chip.
      num_processes: distinct ``device.process_index`` values, i.e. hosts the slice would have.
      device_coords: per device, ``(x, y, z, core_on_chip)`` from ``device.coords`` and
        ``device.core_on_chip``.
      hbm_bytes_per_chip: from :data:`TPU_CHIPS`, None when the kind is unknown.
      hbm_bytes_per_device: ``hbm_bytes_per_chip / devices_per_chip``, or None.
      hbm_source: where the HBM figure comes from (a URL), or why there is none.
      num_slices: slices joined over DCN (``--slices``); 1 for one slice.
      slice_of_device: per device (in ``devices`` order), its ``slice_index``.
    """

    name: str
    device_kind: str
    generation: str | None
    devices: tuple[Any, ...]
    num_chips: int
    devices_per_chip: int
    num_processes: int
    device_coords: tuple[tuple[int, ...], ...]
    hbm_bytes_per_chip: int | None
    hbm_bytes_per_device: int | None
    hbm_source: str
    num_slices: int = 1
    slice_of_device: tuple[int, ...] = ()

    @property
    def num_devices(self) -> int:
        """Number of devices (``len(devices)``)."""
        return len(self.devices)


def tpu_topology(target: TpuTarget, chips_per_host_bounds: Sequence[int] | None = None,
                 num_slices: int = 1) -> TpuTopology:
    """Devices and chip facts of a compile-only TPU topology as the plan parsed it.

    Arguments and errors as :func:`tpu_topology_devices`.
    """
    devices = tpu_topology_devices(target, chips_per_host_bounds, num_slices)
    kind = devices[0].device_kind
    coords = tuple((*tuple(int(c) for c in getattr(d, "coords", ())), int(getattr(d, "core_on_chip", 0)))
                   for d in devices)
    slices = tuple(int(getattr(d, "slice_index", 0) or 0) for d in devices)
    chips = {(s, *c[:-1]) for s, c in zip(slices, coords)}
    per_chip = len(devices) // max(len(chips), 1)
    chip = tpu_chip_of_kind(kind)
    if chip is None:
        hbm_chip = hbm_dev = None
        source = f"device kind {kind!r} is not in stagetool's TPU_CHIPS table"
    else:
        hbm_chip, hbm_dev, source = chip.hbm_bytes_per_chip, chip.hbm_bytes_per_chip // per_chip, chip.source
    return TpuTopology(
        name=target.name,
        device_kind=kind,
        generation=chip.alias if chip else None,
        devices=devices,
        num_chips=len(chips),
        devices_per_chip=per_chip,
        num_processes=len({d.process_index for d in devices}),
        device_coords=coords,
        hbm_bytes_per_chip=hbm_chip,
        hbm_bytes_per_device=hbm_dev,
        hbm_source=source,
        num_slices=num_slices,
        slice_of_device=slices,
    )


def multislice_mesh(devices: Sequence[Any], shape: Sequence[int], axis_names: Sequence[str], num_slices: int, *,
                    explicit: bool = False):
    """A ``jax.sharding.Mesh`` of ``shape`` over ``num_slices`` TPU slices, the first axis spanning them.

    Laid out by ``jax.experimental.mesh_utils.create_hybrid_device_mesh`` with the per-slice (ICI)
    shape ``(shape[0] / num_slices, *shape[1:])`` and the DCN shape ``(num_slices, 1, ...)``: mesh
    rows ``k·shape[0]/N .. (k+1)·shape[0]/N − 1`` are slice ``k``, each laid along its torus.

    Raises :class:`UsageError` when the first axis is not a multiple of ``num_slices`` or the sizes do
    not multiply to the device count.
    """
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    shape, names = tuple(int(s) for s in shape), tuple(axis_names)
    if len(shape) != len(names):
        raise UsageError(f"mesh shape {shape} has {len(shape)} axes but {len(names)} names {names}")
    if math.prod(shape) != len(devices):
        raise UsageError(f"mesh {'x'.join(map(str, shape))} needs {math.prod(shape)} devices, "
                         f"the {num_slices} slices have {len(devices)}")
    if shape[0] % num_slices:
        raise UsageError(f"--slices {num_slices}: the mesh's first axis {names[0]}={shape[0]} spans the slices, so "
                         f"its size must be a multiple of {num_slices}")
    ici = (shape[0] // num_slices, *shape[1:])
    dcn = (num_slices,) + (1,) * (len(shape) - 1)
    try:
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, list(devices))
    except (ValueError, NotImplementedError, AssertionError):
        # as topology_mesh: two devices per chip, or a slice shape off the torus: slice by slice in id order
        import numpy as np

        by_slice: dict[int, list] = {}
        for d in devices:
            by_slice.setdefault(int(getattr(d, "slice_index", 0) or 0), []).append(d)
        grid = np.concatenate([np.array(sorted(v, key=lambda d: d.id), dtype=object).reshape(ici)
                               for _, v in sorted(by_slice.items())], axis=0)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(grid, names, axis_types=(kind,) * len(names))


def topology_mesh(devices: Sequence[Any], shape: Sequence[int], axis_names: Sequence[str], *,
                  explicit: bool = False):
    """A ``jax.sharding.Mesh`` of ``shape`` over TPU ``devices``, laid out along the ICI torus.

    Device order comes from ``jax.experimental.mesh_utils.create_device_mesh`` (as in
    ``jax.experimental.topologies.make_mesh``), which places mesh axes on physical torus
    axes; a plain ``reshape`` of the device list would not. Axis types are ``Auto``
    (partitioner decides) unless ``explicit``.

    When ``create_device_mesh`` cannot place the shape (two devices per chip on v4, shapes
    that do not follow the torus), the devices are taken in the given order instead.

    Raises :class:`UsageError` when ``prod(shape)`` differs from ``len(devices)`` or the
    number of names differs from the number of axes.
    """
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    shape, names = tuple(int(s) for s in shape), tuple(axis_names)
    if len(shape) != len(names):
        raise UsageError(f"mesh shape {shape} has {len(shape)} axes but {len(names)} names {names}")
    if math.prod(shape) != len(devices):
        raise UsageError(f"mesh {'x'.join(map(str, shape))} needs {math.prod(shape)} devices, "
                         f"the topology has {len(devices)}")
    try:
        grid = mesh_utils.create_device_mesh(shape, list(devices))
    except (ValueError, NotImplementedError, AssertionError):
        # v2/v3/v4/tpu7x compile-only topologies expose two devices per chip, which
        # create_device_mesh refuses for v4 and later ("requires one device per chip"), and
        # some shapes do not map onto the torus: fall back to device-id order.
        grid = np.array(list(devices), dtype=object).reshape(shape)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(grid, names, axis_types=(kind,) * len(names))
