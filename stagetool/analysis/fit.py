"""What fits: the largest batch that fits one device's memory, searched with real compiles (issue 32).

Pure: no JAX. The search asks a ``probe`` — one compile of the function at one batch size, made
elsewhere (:mod:`stagetool.sweep.fit` runs it in a process of its own through the facts cache) —
and reads back a :class:`Probe`: fits, does not fit (XLA refused the compile for memory, or its
peak is over the capacity), or could not be decided (any other failure, a timeout, the compile cap).

The search assumes what a batch size is to memory: the peak does not fall as the batch grows. It
gallops up from the first batch (×2 each compile) until a batch does not fit (or the largest
batch allowed fits), then bisects between the largest batch that fitted and the smallest that did
not, in steps of ``multiple`` (a batch the data axes divide). Where the first batch does not fit,
it bisects between ``multiple`` and it. So on the grid ``multiple, 2·multiple, …, max_batch`` it
finds what a brute-force sweep of that grid finds, in about ``2·log2(max_batch / multiple)``
compiles instead of ``max_batch / multiple``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

FITS = "fits"
DOES_NOT_FIT = "does not fit"
UNDECIDED = "undecided"


@dataclasses.dataclass(frozen=True)
class Probe:
    """One compile of the search.

    Attributes:
      batch: the batch size compiled (the whole batch, as the spec's ``${batch}`` takes it).
      outcome: :data:`FITS`, :data:`DOES_NOT_FIT` or :data:`UNDECIDED`.
      peak_bytes: the gated peak per device in bytes (XLA's memory analysis of the compiled program),
        or None (XLA refused the compile, or it failed).
      capacity_bytes: memory of one device in bytes (``--device-memory``, the topology's HBM, the
        device), or None when unknown.
      needed_bytes: per device, what XLA said a refused program needs (its message), or None.
      reason: why the outcome is :data:`UNDECIDED` (the failure's message), else None.
      program: a digest of the lowered program (StableHLO), or None where it was not kept.
      step_time: the step-time estimate of the compiled program (an estimate, seconds per step on one
        device) as ``(chip, overlapped, schedule, serial)`` seconds, low to high, or None.
    """

    batch: int
    outcome: str
    peak_bytes: int | None = None
    capacity_bytes: int | None = None
    needed_bytes: int | None = None
    reason: str | None = None
    program: str | None = None
    step_time: tuple[str, float, float, float] | None = None


@dataclasses.dataclass(frozen=True)
class Search:
    """The search for one setting of the other knobs.

    Attributes:
      largest: the largest batch that fits (a multiple of ``multiple``), or None when none does or
        the search could not decide.
      smallest_refused: the smallest batch compiled that did not fit, or None when none was compiled
        (then ``largest`` is the largest batch allowed: the search was capped by ``max_batch``).
      probes: every compile, in the order made.
      status: ``found``; ``at the maximum`` (the largest batch allowed fits, so a larger one may
        too); ``none fits`` (not even ``multiple``); ``undecided`` (a compile failed otherwise,
        timed out, or the compile cap was reached: ``reason`` says which).
      reason: for ``undecided``, why; else None.
    """

    largest: int | None
    smallest_refused: int | None
    probes: tuple[Probe, ...]
    status: str
    reason: str | None = None

    def at(self, batch: int | None) -> Probe | None:
        """The probe of ``batch``, or None."""
        return next((p for p in self.probes if p.batch == batch), None)


class CompileCap(Exception):
    """Raised by a probe function when the search's cap on compiles is reached (the search stops
    there, ``undecided``)."""


def search_largest(probe: Callable[[int], Probe], *, start: int, multiple: int, max_batch: int) -> Search:
    """Find the largest batch in ``multiple, 2·multiple, …, max_batch`` that fits, compiling through
    ``probe`` (see the module's docstring for the order of compiles).

    Args:
      probe: compiles the function at one batch; may raise :class:`CompileCap`.
      start: the first batch compiled (rounded down to a multiple of ``multiple``, at least it).
      multiple: every batch compiled is a multiple of this (≥ 1).
      max_batch: no batch above this is compiled (≥ ``multiple``).

    Raises:
      ValueError: ``multiple`` < 1 or ``max_batch`` < ``multiple``.
    """
    if multiple < 1 or max_batch < multiple:
        raise ValueError(f"multiple {multiple} and max_batch {max_batch}: need 1 <= multiple <= max_batch")
    top = max_batch // multiple  # in units of `multiple`
    k = min(max(start // multiple, 1), top)
    probes: list[Probe] = []
    lo, hi = 0, None  # largest unit known to fit (0: none yet), smallest unit known not to

    def ask(units: int) -> Probe | None:
        try:
            p = probe(units * multiple)
        except CompileCap as e:
            probes.append(Probe(units * multiple, UNDECIDED, reason=str(e)))
            return None
        probes.append(p)
        return p if p.outcome != UNDECIDED else None

    def undecided() -> Search:
        return Search(None, hi * multiple if hi else None, tuple(probes), UNDECIDED, probes[-1].reason)

    while hi is None:  # gallop up
        p = ask(k)
        if p is None:
            return undecided()
        if p.outcome == FITS:
            lo = k
            if k == top:
                return Search(k * multiple, None, tuple(probes), "at the maximum")
            k = min(2 * k, top)
        else:
            hi = k
    while hi - lo > 1:  # bisect
        mid = (lo + hi) // 2
        p = ask(mid)
        if p is None:
            return undecided()
        if p.outcome == FITS:
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return Search(None, hi * multiple, tuple(probes), "none fits")
    return Search(lo * multiple, hi * multiple, tuple(probes), "found")


def same_program(a: Search, b: Search) -> bool:
    """Whether two searches compiled the same program at every batch both compiled (their lowered
    programs' digests equal, and at least one such batch): the knob that tells them apart does not
    change the program."""
    common = [(p, b.at(p.batch)) for p in a.probes if p.program is not None]
    common = [(p, q) for p, q in common if q is not None and q.program is not None]
    return bool(common) and all(p.program == q.program for p, q in common)
