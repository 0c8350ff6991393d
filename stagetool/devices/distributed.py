"""Multi-process JAX (``jax.distributed``) for staging a function as one process of many.

Call :func:`initialize` once, before anything touches a JAX backend (``jax.devices()``, a
``jax.config`` read of devices, a compile). Then ``jax.devices()`` lists the global devices of
every process, ``jax.local_devices()`` this process's, and a ``Mesh`` over the global devices
compiles the same SPMD program in every process. Only the primary process
(:func:`is_primary`) should write reports.

Host-local shapes ("local avals": what one process feeds) map to global ones as
``jax.experimental.multihost_utils.host_local_array_to_global_array`` does it:
:func:`local_to_global_shape`.

Cluster auto-detection: JAX's own detection lives in its private modules, so
:func:`detect_cluster` reads the same environment variables JAX's detectors read, and only
reports a cluster when it has more than one process:

- Slurm: ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS`` (> 1), ``SLURM_PROCID``,
  ``SLURM_LOCALID`` (``srun``).
- Open MPI: ``OMPI_MCA_orte_hnp_uri`` and ``OMPI_COMM_WORLD_SIZE`` (> 1) (``mpirun``).
- Cloud TPU VM / GKE multi-host slice: ``TPU_WORKER_HOSTNAMES`` with more than one host, or
  ``MEGASCALE_COORDINATOR_ADDRESS``.

On such a cluster ``jax.distributed.initialize()`` is called with no arguments and JAX finds
coordinator, process count and id itself. Not detected here (pass the three options instead):
Kubernetes without TPUs (needs the ``kubernetes`` package), ``mpi4py`` launches, GCE TPU VMs
found only through the metadata server.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from stagetool.core.errors import UsageError

__all__ = [
    "detect_cluster",
    "initialize",
    "is_primary",
    "leave",
    "local_to_global_shape",
    "process_blocks",
    "scale_local_shape",
]

_JOINED: list[bool] = [False]  # this process called jax.distributed.initialize (initialize below)
_ADDRESS_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def _int_env(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env.get(key, ""))
    except ValueError:
        return 0


def detect_cluster(env: Mapping[str, str] | None = None) -> str | None:
    """Name of the multi-process launcher found in ``env`` (default ``os.environ``).

    Returns ``"slurm"``, ``"ompi"`` or ``"tpu"`` when the environment describes more than one
    process (the variables are listed in the module docstring), else None. Pure.
    """
    env = os.environ if env is None else env
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm) and _int_env(env, "SLURM_NTASKS") > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and _int_env(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1 or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    return None


def _check_options(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    missing = [k for k, v in given.items() if v is None]
    if missing and len(missing) < 3:
        have = ", ".join(f"{k} {v}" for k, v in given.items() if v is not None)
        raise UsageError(f"multi-process options are all-or-nothing: got {have} but not {', '.join(missing)}",
                         hint="give --coordinator HOST:PORT, --num-processes N and --process-id I together, "
                              "or none of them to let a Slurm / Open MPI / Cloud TPU launcher be detected")
    if missing:
        return
    if not _ADDRESS_RE.match(coordinator) or not 0 < int(_ADDRESS_RE.match(coordinator).group(2)) < 65536:
        raise UsageError(f"--coordinator {coordinator!r} is not HOST:PORT",
                         hint="e.g. --coordinator 10.0.0.1:1234 (process 0 listens there)")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise UsageError(f"--num-processes must be a positive integer, got {num_processes!r}")
    if isinstance(process_id, bool) or not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise UsageError(f"--process-id must be in [0, {num_processes}), got {process_id!r}")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 300,
               env: Mapping[str, str] | None = None, reach_s: float | None = None) -> bool:
    """Join (or form) a multi-process JAX job; returns True when ``jax.distributed`` is now up.

    - All three options given: ``jax.distributed.initialize(coordinator, num_processes,
      process_id)``; process 0 serves the coordinator at ``coordinator`` (``HOST:PORT``).
    - None given: if :func:`detect_cluster` finds a launcher, ``jax.distributed.initialize()``
      with auto-detection; otherwise nothing happens and False is returned (one process).

    CPU cross-process collectives are set to gloo
    (``jax_cpu_collectives_implementation="gloo"``, JAX 0.10's default, set explicitly so a
    CPU-only job can compile and run collectives); it does not affect GPU or TPU backends.
    Must run before any JAX backend starts. ``timeout_s`` bounds the wait for the other
    processes (``initialization_timeout``, seconds). Caution: when they do not all arrive in
    time, JAX 0.10.2 does not raise; its coordination client *aborts the process* (SIGABRT,
    exit 134, "DEADLINE_EXCEEDED ... RegisterTask") about ``timeout_s`` + 5 s later, so a caller
    should say on stderr what it waits for before calling this. A process other than 0 first waits
    at most ``reach_s`` seconds (default ``$STAGETOOL_COORDINATOR_WAIT_S``, else 60) for the
    coordinator's port to accept a TCP connection (:func:`_wait_for_coordinator`), so that an
    unreachable or mistyped ``--coordinator`` is a clear error, not minutes of silence and an abort.

    Raises:
      UsageError: some but not all options given; a malformed address, count or id; a JAX
        backend already started; the coordinator unreachable within ``reach_s``; or JAX failed to
        connect (the message says which).
    """
    _check_options(coordinator, num_processes, process_id)
    import jax

    if jax.distributed.is_initialized():
        return True
    if coordinator is None and detect_cluster(env) is None:
        return False
    if coordinator is not None and process_id != 0:
        _wait_for_coordinator(coordinator, reach_s if reach_s is not None else _reach_seconds())
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        if coordinator is None:
            jax.distributed.initialize(initialization_timeout=timeout_s)
        else:
            jax.distributed.initialize(coordinator, num_processes, process_id,
                                       initialization_timeout=timeout_s)
    except (RuntimeError, ValueError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = None
        if "before" in text and ("backend" in text or "computation" in text):
            hint = "start multi-process mode before any JAX device is used (first thing in the process)"
        raise UsageError(f"jax.distributed.initialize failed: {text}", hint=hint) from None
    _JOINED[0] = True
    return True


def leave() -> None:
    """Leave the multi-process job that :func:`initialize` joined: ``jax.distributed.shutdown()``.

    Its shutdown barrier waits until every process has reached it, so process 0, which serves the
    coordinator, ends after the others. Without it a process that ends first (``os._exit``, as a
    stagetool run ends) takes the coordinator with it and JAX's client in a slower process aborts
    (SIGABRT: the coordination service reports the job failed). Does nothing when this process did
    not join a job here (a job the caller's own code started is the caller's to end). A failure
    to shut down is not reported: the command's result is already decided.
    """
    if not _JOINED[0]:
        return
    _JOINED[0] = False
    import jax

    try:
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - a process that already died: nothing left to wait for
        pass


def _reach_seconds() -> float:
    try:
        value = float(os.environ.get("STAGETOOL_COORDINATOR_WAIT_S", "60"))
    except ValueError:
        return 60.0
    return value if 0 < value < 1e6 else 60.0


def _wait_for_coordinator(coordinator: str, limit_s: float) -> None:
    """Return once ``HOST:PORT`` accepts a TCP connection (process 0 may start a little later: retried
    every half second); raise after ``limit_s`` seconds, or at once for a host name that does not
    resolve.

    Raises:
      UsageError: the coordinator cannot be reached.
    """
    import socket
    import time

    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--coordinator {coordinator}: cannot resolve {host!r}: {e}",
                         hint="give the address of process 0, HOST:PORT") from None
    deadline = time.monotonic() + limit_s
    last = None
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, max(0.1, limit_s))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    raise UsageError(f"--coordinator {coordinator}: nothing accepted a connection there within {limit_s:g} s "
                     f"({getattr(last, 'strerror', None) or last})",
                     hint="start process 0 (--process-id 0) first, and check the host, the port and any firewall; "
                          "STAGETOOL_COORDINATOR_WAIT_S sets how long to wait")


def is_primary() -> bool:
    """True in process 0 (``jax.process_index() == 0``), the one that should write reports."""
    import jax

    return jax.process_index() == 0


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def scale_local_shape(local_shape: Sequence[int], spec: Sequence[Any],
                      blocks: Mapping[str, int]) -> tuple[int, ...]:
    """Global shape from a host-local one; pure.

    Dim ``i`` is multiplied by the product of ``blocks[a]`` over the mesh axes ``a`` that
    ``spec[i]`` names (``None`` = not sharded, a name, or a tuple of names); dims past
    ``len(spec)`` are unchanged. ``blocks[a]`` is the number of process blocks along mesh axis
    ``a`` (:func:`process_blocks`). Raises ``KeyError`` for an axis not in ``blocks``.
    """
    out = list(local_shape)
    for i, entry in enumerate(tuple(spec)[: len(out)]):
        out[i] *= math.prod(blocks[a] for a in _spec_axes(entry))
    return tuple(out)


def process_blocks(mesh) -> dict[str, int]:
    """Per mesh axis, ``mesh.shape[a] // mesh.local_mesh.shape[a]``: how many processes' blocks
    lie along it (1 when the axis is entirely inside this process).

    Uses ``jax.sharding.Mesh.local_mesh`` (the devices of this process), which raises
    ``ValueError`` when those devices do not form a sub-grid of the mesh.
    """
    local = mesh.local_mesh.shape
    return {a: mesh.shape[a] // local[a] for a in mesh.axis_names}


def local_to_global_shape(local_shape: Sequence[int], spec: Sequence[Any], mesh) -> tuple[int, ...]:
    """The global shape of an array each process holds as ``local_shape``, sharded by ``spec``
    (a ``PartitionSpec``) over ``mesh`` — the shape
    ``multihost_utils.host_local_array_to_global_array`` produces. With one process it is
    ``local_shape``.
    """
    return scale_local_shape(local_shape, spec, process_blocks(mesh))
