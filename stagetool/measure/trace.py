"""Per-instruction device times from JAX's profiler: run a few steps under ``jax.profiler.trace``, read
the XSpace it wrote with ``jax.profiler.ProfileData`` (public), and sum the events of the device planes'
``XLA Ops`` line by HLO instruction name (MEASURED; seconds per step).

The XLA:TPU runtime writes one event per executed HLO instruction (fusion, custom call, copy, ...) on
``/device:TPU:N``'s ``XLA Ops`` line; the CPU backend writes no device plane, but tags its thunks'
host events with an ``hlo_op`` stat, which are read instead (for tests; a host's times).
"""

from __future__ import annotations

import glob
import os
import tempfile
from typing import Any, Callable


def hlo_name(event_name: str) -> str:
    """The instruction's name from a profiler event's name: XLA:TPU names an ``XLA Ops`` event by the
    instruction's whole text (``%fusion.3 = bf16[...] fusion(...), kind=kLoop, ...``); the name is what
    stands between ``%`` and `` = `` (``fusion.3``). Other names are returned as they are."""
    if event_name.startswith("%") and " = " in event_name:
        return event_name[1:event_name.index(" = ")]
    return event_name


def device_op_seconds(space: Any, steps: int) -> dict[str, tuple[float, int]]:
    """``{hlo instruction name: (seconds per step, events per step)}`` from a ``ProfileData``-like object
    (``planes`` → ``lines`` → ``events`` with ``name`` and ``duration_ns``), summed over the device planes'
    ``XLA Ops`` lines (all devices together: divide by the device count for one device's figure); where
    there is no device plane (the CPU backend), the host events that carry an ``hlo_op`` stat. A ``while``
    loop's event spans its body, whose instructions have events of their own: the times of nested
    events overlap, and their sum is no step time."""
    acc: dict[str, list[float]] = {}
    for plane in space.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for ev in line.events:
                a = acc.setdefault(hlo_name(ev.name), [0.0, 0])
                a[0] += ev.duration_ns * 1e-9
                a[1] += 1
    if not acc:  # the CPU backend: host thread events that carry an ``hlo_op`` stat
        for plane in space.planes:
            for line in plane.lines:
                for ev in line.events:
                    op = dict(ev.stats).get("hlo_op")
                    if isinstance(op, str) and op:
                        a = acc.setdefault(hlo_name(op), [0.0, 0])
                        a[0] += ev.duration_ns * 1e-9
                        a[1] += 1
    return {name: (s / steps, round(n / steps)) for name, (s, n) in sorted(acc.items())}


def device_module_seconds(space: Any, steps: int) -> float | None:
    """Device seconds per step of the executables run: the events of the device planes' ``XLA Modules``
    line (one per executable run on one device) summed and divided by ``steps`` (and by the number of
    device planes that have such events); None where there are none (the CPU backend)."""
    total, planes = 0.0, 0
    for plane in space.planes:
        if not plane.name.startswith("/device:"):
            continue
        found = False
        for line in plane.lines:
            if line.name == "XLA Modules":
                for ev in line.events:
                    total += ev.duration_ns * 1e-9
                    found = True
        planes += found
    return total / steps / planes if planes else None


def profile_steps(run_step: Callable[[], Any], steps: int
                  ) -> tuple[dict[str, tuple[float, int]], str | None, float | None]:
    """Run ``run_step()`` (one blocked step) ``steps`` times under the profiler.

    Returns:
      ``(per-instruction seconds per step, reason, device seconds per step)``: the instructions are {}
      with the reason where the profiler gave none or could not run; the device seconds
      (:func:`device_module_seconds`) are None where the trace has no device plane.
    """
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory(prefix="stagetool-trace-") as tmp:
        try:
            with jax.profiler.trace(tmp):
                for _ in range(steps):
                    run_step()
        except Exception as e:  # noqa: BLE001 - the profiler is optional; its failure is a reason
            return {}, f"the profiler failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", None
        files = sorted(glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True))
        if not files:
            return {}, "the profiler wrote no trace", None
        space = ProfileData.from_file(files[-1])
        ops, module = device_op_seconds(space, steps), device_module_seconds(space, steps)
    if not ops:
        return {}, "the profiler recorded no instructions (no 'XLA Ops' line on a device plane, no hlo_op events)", module
    return ops, None, module
