"""Where a sweep's configurations run: here, one after another or N at a time, or as Ray tasks.

Every executor runs each configuration through :func:`stagetool.sweep.run.run_isolated` — a fresh
``python -m stagetool.sweep.run`` process — so a row is the same whichever executor made it, and
device counts and topologies of different configurations never meet in one JAX backend.

* ``local``: ``--jobs N`` threads, each waiting on one worker process at a time (N processes).
* ``ray``: one ``ray.remote`` task per configuration on a running Ray cluster (``RAY_ADDRESS``, or
  the cluster ``ray start`` left on this machine: Ray's ``address="auto"``). The task starts the
  worker process on its node, so the spec and the code must be at the same paths on every node
  (a shared file system, as Slurm clusters have). Ray is imported only here, only then.
"""

from __future__ import annotations

import concurrent.futures
import enum
import os
import threading
from typing import Callable, Iterable

from stagetool.core.errors import UsageError

OnRow = Callable[[dict], None]


class Executor(str, enum.Enum):
    """``--executor``."""

    local = "local"
    """Worker processes on this machine (``--jobs N``, default 1)."""
    ray = "ray"
    """Ray tasks on a running cluster (``pip install 'stagetool[ray]'``)."""


def run_local(payloads: Iterable[dict], *, jobs: int, on_row: OnRow, timeout_s: float | None = None) -> None:
    """Run every payload in its own process, ``jobs`` at a time; ``on_row`` gets each row as it finishes.
    ``timeout_s``: seconds each process may run before it is killed (an error row)."""
    from stagetool.sweep.run import run_isolated

    payloads = list(payloads)
    if jobs <= 1:
        for p in payloads:
            on_row(run_isolated(p, timeout_s))
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="stagetool-sweep") as pool:
        futures = [pool.submit(run_isolated, p, timeout_s) for p in payloads]
        try:
            for f in concurrent.futures.as_completed(futures):
                on_row(f.result())
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _connect_ray(pythonpath: str | None):
    """Import Ray and connect to the running cluster; returns ``(ray, whether we connected)``.

    Raises:
      UsageError: Ray is not installed, or no running cluster is found.
    """
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray, which is not installed",
                         hint="pip install 'stagetool[ray]' (or use --jobs N on this machine)") from None
    if ray.is_initialized():
        return ray, False
    address = os.environ.get("RAY_ADDRESS") or "auto"
    where = f"RAY_ADDRESS={address}" if address != "auto" else "no RAY_ADDRESS, and no cluster started on this machine"
    hint = ("start one with 'ray start --head' (or on a cluster node) and set RAY_ADDRESS=HOST:PORT, or use --jobs N")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)} \
        if pythonpath else {}
    limit = connect_timeout_s()
    problem = _unreachable(address, min(limit, 10.0))
    if problem is not None:
        raise UsageError(f"--executor ray: cannot connect to a Ray cluster ({where}): {problem}", hint=hint)
    outcome: dict[str, BaseException | None] = {}

    def connect() -> None:
        try:
            ray.init(address=address, runtime_env={"env_vars": env} if env else None, logging_level="ERROR",
                     log_to_driver=False)
            outcome["error"] = None
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = e

    # ray.init retries a cluster that does not answer for minutes: it runs in a thread of its own,
    # waited for at most `limit` seconds (the thread is left behind; the run then ends)
    thread = threading.Thread(target=connect, name="stagetool-ray-connect", daemon=True)
    thread.start()
    thread.join(limit)
    if "error" not in outcome:
        raise UsageError(f"--executor ray: no Ray cluster answered within {limit:g} s ({where})",
                         hint=hint + f"; {CONNECT_TIMEOUT_ENV} sets the wait (seconds)")
    e = outcome["error"]
    if e is not None:
        if not isinstance(e, (ConnectionError, RuntimeError, ValueError, TimeoutError)):
            raise e
        first = (str(e).strip().splitlines() or [""])[0]
        raise UsageError(f"--executor ray: cannot connect to a Ray cluster ({where}): {first}", hint=hint) from None
    return ray, True


CONNECT_TIMEOUT_ENV = "STAGETOOL_RAY_CONNECT_TIMEOUT_S"
"""Seconds ``--executor ray`` waits for the cluster to answer (default :data:`CONNECT_TIMEOUT_S`)."""
CONNECT_TIMEOUT_S = 30.0


def connect_timeout_s() -> float:
    """The wait for a Ray cluster: ``$STAGETOOL_RAY_CONNECT_TIMEOUT_S`` (a positive number of seconds up
    to an hour), else :data:`CONNECT_TIMEOUT_S`.

    Raises:
      UsageError: the variable is set to anything else.
    """
    import math

    text = os.environ.get(CONNECT_TIMEOUT_ENV, "").strip()
    if not text:
        return CONNECT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= 3600):
        raise UsageError(f"{CONNECT_TIMEOUT_ENV}={text!r}: give a number of seconds above 0 and at most 3600")
    return value


def _unreachable(address: str, timeout_s: float) -> str | None:
    """Why nothing listens at a ``host:port`` (or ``ray://host:port``) Ray address, from one TCP connect
    of at most ``timeout_s`` seconds; None when something does, or the address is of another form
    (``auto``: Ray finds the cluster this machine started)."""
    import re
    import socket

    m = re.fullmatch(r"(?:ray://)?\[?([^\[\]/]+?)\]?:([0-9]{1,5})", address.strip(), re.ASCII)
    if m is None:
        return None
    host, port = m.group(1), int(m.group(2))
    if not 0 < port < 65536:
        return f"port {port} is not a TCP port"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"{host}:{port} did not answer within {timeout_s:g} s"
    except OSError as e:
        return f"{host}:{port}: {e.strerror or e}"


def run_ray(payloads: Iterable[dict], *, on_row: OnRow, timeout_s: float | None = None) -> None:
    """Run every payload as a Ray task (one CPU each); ``on_row`` gets each row as it finishes.
    ``timeout_s`` bounds each task's process as for :func:`run_local`."""
    from stagetool.sweep.run import run_isolated

    payloads = list(payloads)
    pythonpath = payloads[0].get("pythonpath") if payloads else None
    ray, connected = _connect_ray(pythonpath)
    try:
        task = ray.remote(num_cpus=1, max_retries=0)(run_isolated)
        pending = {task.remote(p, timeout_s): p for p in payloads}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                payload = pending.pop(ref)
                try:
                    row = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - a lost node or worker is one error row
                    from stagetool.sweep.run import _error_row

                    row = _error_row(payload, "ray", f"the Ray task failed: {type(e).__name__}: {e}")
                on_row(row)
    finally:
        if connected:
            ray.shutdown()
