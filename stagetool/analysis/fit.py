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
compiles instead of ``max_batch / multiple``. With ``width`` > 1 a round compiles several batches
at once (more compiles, fewer rounds of waiting).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated

from stagetool.core.codec import Check

FITS = "fits"
DOES_NOT_FIT = "does not fit"
UNDECIDED = "undecided"

_COUNT = Annotated[int, Check(lambda n: n >= 0, "not negative")]


@dataclasses.dataclass(frozen=True)
class ReplicatedInput:
    """An input leaf every device of the mesh holds whole (a fully replicated PartitionSpec); a
    ``stagetool fit`` row's ``replicated_inputs`` are these as JSON (:mod:`stagetool.core.codec`).

    Attributes:
      path: its key path (``state/params/norm``).
      shape: its global shape.
      dtype: its dtype name (``float32``).
      bytes_per_device: bytes one device holds (the whole array, as XLA stores the dtype).
      source: ``file:line:col`` of the spec node that set its shape or sharding, or None.
      sharding_source: where its sharding comes from (``spec``, ``rule``, ``init``, ``unknown``...,
        as :class:`stagetool.facts.LeafFacts` says), or None (a spec leaf written without ``@``).
    """

    path: str
    shape: tuple[_COUNT, ...]
    dtype: str
    bytes_per_device: _COUNT
    source: str | None = None
    sharding_source: str | None = None


@dataclasses.dataclass(frozen=True)
class LeafShardingChange:
    """One replicated input leaf sharded over a free mesh axis: what-if's change of one leaf.

    Attributes:
      leaf: the leaf (:class:`ReplicatedInput`).
      axis: the mesh axis it is sharded over (one it does not use: being replicated, it uses none).
      axis_size: that axis's devices.
      dimension: the leaf's dimension sharded (0-based), the largest one ``axis_size`` divides.
      dims: the new PartitionSpec, one entry per dimension (``(None, 'fsdp')``).
      saved_bytes: bytes per device it stops holding: ``bytes_per_device · (axis_size - 1) / axis_size``
        (exact: the dimension divides).
    """

    leaf: ReplicatedInput
    axis: str
    axis_size: int
    dimension: int
    dims: tuple[str | None, ...]
    saved_bytes: int


def shard_largest_replicated(leaves: tuple[ReplicatedInput, ...], mesh_axes: tuple[tuple[str, int], ...]
                             ) -> tuple[LeafShardingChange | None, str | None]:
    """The change sharding the largest replicated input leaf over a free mesh axis, or why there is none.

    Leaves are taken largest first (bytes per device, then path); for one, the mesh axes of more
    than one device largest first (then mesh order) and, for an axis, the leaf's dimensions largest
    first (then the first): the first dimension the axis's size divides is sharded over it. A leaf
    no axis divides any dimension of (a scalar, a vector of odd length) is passed over for the next.

    Returns ``(change, None)``, or ``(None, reason)``: no replicated leaf, no mesh axis of more than
    one device, or no replicated leaf with a dimension a mesh axis divides."""
    if not leaves:
        return None, "no input leaf is replicated: every one is sharded over some mesh axis already"
    free = sorted(((a, n) for a, n in mesh_axes if n > 1), key=lambda an: -an[1])
    if not free:
        return None, "no mesh axis is free: the mesh has no axis of more than one device"
    for leaf in sorted(leaves, key=lambda x: (-x.bytes_per_device, x.path)):
        for axis, n in free:
            dims = sorted(range(len(leaf.shape)), key=lambda i: (-leaf.shape[i], i))
            d = next((i for i in dims if leaf.shape[i] % n == 0), None)
            if d is not None:
                new = tuple(axis if i == d else None for i in range(len(leaf.shape)))
                return LeafShardingChange(leaf, axis, n, d, new, leaf.bytes_per_device * (n - 1) // n), None
    shown = ", ".join(f"{x.path} {list(x.shape)}" for x in leaves[:3])
    return None, (f"no replicated input leaf has a dimension a free mesh axis divides ({shown}; axes "
                  + ", ".join(f"{a}={n}" for a, n in free) + ")")


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
      step_time_lower_bound: the estimate is a lower bound ("at least": work no model covers).
      replicated_inputs: the largest input leaves every device holds whole (their compiled sharding,
        or for a refused compile the declared one, is fully replicated), largest first.
      mesh_axes: the staged mesh's ``(axis, size)`` in mesh order; () when not known.
    """

    batch: int
    outcome: str
    peak_bytes: int | None = None
    capacity_bytes: int | None = None
    needed_bytes: int | None = None
    reason: str | None = None
    program: str | None = None
    step_time: tuple[str, float, float, float] | None = None
    step_time_lower_bound: bool = False
    replicated_inputs: tuple[ReplicatedInput, ...] = ()
    mesh_axes: tuple[tuple[str, int], ...] = ()


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


def search_largest(probe: Callable[[int], Probe], *, start: int, multiple: int, max_batch: int, width: int = 1,
                   probe_many: Callable[[list[int]], list[Probe]] | None = None) -> Search:
    """Find the largest batch in ``multiple, 2·multiple, …, max_batch`` that fits, compiling through
    ``probe`` (see the module's docstring for the order of compiles).

    With ``width`` > 1 each round compiles up to ``width`` batches at once through ``probe_many``
    (the galloping round ``k, 2k, 4k, …``; the bisecting round the points splitting the open
    interval into ``width + 1`` parts): fewer rounds, more compiles, the same answer.

    Args:
      probe: compiles the function at one batch; may raise :class:`CompileCap`.
      start: the first batch compiled (rounded down to a multiple of ``multiple``, at least it).
      multiple: every batch compiled is a multiple of this (≥ 1).
      max_batch: no batch above this is compiled (≥ ``multiple``).
      width: batches compiled per round (≥ 1).
      probe_many: compiles several batches (at once), returning their probes in order; a batch the
        compile cap stopped is an :data:`UNDECIDED` probe. Default: ``probe`` on each in turn.

    Raises:
      ValueError: ``multiple`` < 1, ``max_batch`` < ``multiple`` or ``width`` < 1.
    """
    if multiple < 1 or max_batch < multiple or width < 1:
        raise ValueError(f"multiple {multiple}, max_batch {max_batch}, width {width}: need 1 <= multiple <= "
                         "max_batch and width >= 1")
    top = max_batch // multiple  # in units of `multiple`
    k = min(max(start // multiple, 1), top)
    probes: list[Probe] = []
    lo, hi = 0, None  # largest unit known to fit (0: none yet), smallest unit known not to

    def one(batch: int) -> Probe:
        try:
            return probe(batch)
        except CompileCap as e:
            return Probe(batch, UNDECIDED, reason=str(e))

    many = probe_many or (lambda batches: [one(b) for b in batches])

    def ask(units: list[int]) -> list[Probe] | None:
        got = many([u * multiple for u in units])
        probes.extend(got)
        return None if any(p.outcome == UNDECIDED for p in got) else got

    def undecided() -> Search:
        why = next(p.reason for p in reversed(probes) if p.outcome == UNDECIDED)
        return Search(None, hi * multiple if hi else None, tuple(probes), UNDECIDED, why)

    def update(units: list[int], got: list[Probe]) -> None:
        nonlocal lo, hi
        for u, p in zip(units, got):
            if p.outcome != FITS and (hi is None or u < hi):
                hi = u
        lo = max([lo] + [u for u, p in zip(units, got) if p.outcome == FITS and (hi is None or u < hi)])

    while hi is None:  # gallop up: k, 2k, 4k, ... (width at a time)
        units = sorted({min(k << i, top) for i in range(width)})
        got = ask(units)
        if got is None:
            return undecided()
        update(units, got)
        if hi is None:
            if lo == top:
                return Search(top * multiple, None, tuple(probes), "at the maximum")
            k = min(2 * units[-1], top)
    while hi - lo > 1:  # bisect: the points splitting (lo, hi) into width + 1 parts
        units = sorted({lo + (hi - lo) * i // (width + 1) for i in range(1, width + 1)} - {lo, hi})
        got = ask(units)
        if got is None:
            return undecided()
        update(units, got)
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
