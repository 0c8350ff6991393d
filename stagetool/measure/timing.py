"""Wall-clock timing of compiled JAX calls: warm-up, repeats, median and spread.

A sample is ``inner`` back-to-back calls ended by one ``jax.block_until_ready`` (so that the host's
dispatch of call ``i+1`` overlaps the device's work on call ``i``), divided by ``inner``; the figure
is the median sample, with the smallest and largest and their relative spread beside it. Seconds of
wall time on the host clock (``time.perf_counter``), per call.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Sequence

from stagetool.core.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Timing:
    """Measured seconds per call of one program (wall clock, MEASURED).

    Attributes:
      median_seconds: the median over the samples (seconds per call).
      min_seconds / max_seconds: the fastest and slowest sample.
      spread: ``(max - min) / median`` (0.02 is ±1%).
      samples: how many samples the median is over.
      inner: calls per sample (their mean is one sample).
      warmup: untimed calls before the first sample (the first one compiles, where not yet compiled).
    """

    median_seconds: float
    min_seconds: float
    max_seconds: float
    spread: float
    samples: int
    inner: int
    warmup: int

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON-able dict."""
        return dataclasses.asdict(self)


def summarize(samples: Sequence[float], *, inner: int = 1, warmup: int = 0) -> Timing:
    """The :class:`Timing` of per-call ``samples`` (seconds).

    Raises:
      ValueError: no samples, or a sample that is negative or not finite.
    """
    if not samples:
        raise ValueError("summarize: no samples")
    if any(not math.isfinite(s) or s < 0 for s in samples):
        raise ValueError(f"summarize: samples must be finite and >= 0, got {list(samples)}")
    med = statistics.median(samples)
    lo, hi = min(samples), max(samples)
    return Timing(median_seconds=med, min_seconds=lo, max_seconds=hi, spread=(hi - lo) / med if med > 0 else 0.0,
                  samples=len(samples), inner=inner, warmup=warmup)


def time_calls(call: Callable[[], Any], *, warmup: int = 2, repeats: int = 10, inner: int | None = None,
               target_sample_seconds: float = 0.02, clock: Callable[[], float] = time.perf_counter,
               block: Callable[[Any], Any] | None = None) -> Timing:
    """Time ``call()`` (a compiled JAX call returning arrays): ``warmup`` untimed calls, then
    ``repeats`` samples of ``inner`` calls each.

    Args:
      call: runs one step and returns its outputs (not yet blocked on).
      warmup: untimed calls first (>= 1 recommended: the first call may compile and allocate).
      repeats: samples the median is over.
      inner: calls per sample; None chooses it so that a sample lasts about ``target_sample_seconds``
        (from the last warm-up call's time), at most 1000.
      clock: the clock (seconds); tests pass a fake one.
      block: waits for outputs (default ``jax.block_until_ready``).

    Returns:
      The :class:`Timing` (seconds per call).

    Raises:
      ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"time_calls: repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    if block is None:
        import jax

        block = jax.block_until_ready
    last = None
    for _ in range(warmup):
        t0 = clock()
        block(call())
        last = clock() - t0
    if inner is None:
        if last is None:
            t0 = clock()
            block(call())
            last = clock() - t0
        inner = max(1, min(1000, int(target_sample_seconds / last) if last > 0 else 1000))
    samples = []
    for _ in range(repeats):
        t0 = clock()
        out = None
        for _ in range(inner):
            out = call()
        block(out)
        samples.append((clock() - t0) / inner)
    return summarize(samples, inner=inner, warmup=warmup)


def attached_accelerator() -> tuple[str, str, int]:
    """``(platform, device_kind, device count)`` of JAX's default backend (this starts it)."""
    import jax

    devices = jax.devices()
    return devices[0].platform, devices[0].device_kind, len(devices)


def require_accelerator(what: str, option: str | None = None) -> tuple[str, str, int]:
    """The attached accelerator, or a usage error (exit 2) where JAX's default backend is the CPU.

    Args:
      what: the command or option, for the message (``"stagetool calibrate"``).
      option: a flag that would allow the CPU anyway, named in the hint, or None.

    Raises:
      UsageError: the default backend is ``cpu`` (no accelerator attached, or JAX_PLATFORMS=cpu).
    """
    platform, kind, n = attached_accelerator()
    if platform == "cpu":
        raise UsageError(f"{what} measures the attached accelerator, and none is attached (JAX's default "
                         f"backend is the CPU: {n} × {kind})",
                         hint="run it on a machine with a TPU or GPU (JAX_PLATFORMS unset or naming it)"
                              + (f"; {option} measures the CPU anyway" if option else ""))
    return platform, kind, n
