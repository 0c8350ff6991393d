"""Normalise ``Compiled.memory_analysis()``, donation aliasing and device capacity.

Sources (verified on jax/jaxlib 0.10.2, CPU):

* ``jax.stages.Compiled.memory_analysis()`` returns a ``CompiledMemoryStats`` with, per
  device and in bytes: ``argument_size_in_bytes``, ``output_size_in_bytes``,
  ``alias_size_in_bytes``, ``temp_size_in_bytes``, ``generated_code_size_in_bytes``, the
  same five as ``host_*`` (host memory space), ``peak_memory_in_bytes`` and
  ``serialized_buffer_assignment_proto``.
* **One definition of peak** (what is shown, snapshotted, compared with capacity and gated, the
  same number in every command): ``peak_bytes`` is the larger of

  - ``argument + output - alias + temp``: the device memory XLA's buffer assignment allocates for
    one execution (the parameters, the outputs that do not reuse a donated parameter, and the one
    temp block); derived from XLA's figures; and
  - XLA's own ``peak_memory_in_bytes`` where the backend reports one (> 0).

  Why both: their meaning differs by backend. On CPU (jaxlib 0.10.2) ``peak_memory_in_bytes``
  leaves out the temp block (the SGD step of the tests: 12.0 MiB without donation, 8.0 MiB with
  it, while the allocation is 20.0 MiB both ways), so the sum is the larger. On a compile-only TPU
  topology (libtpu 0.10.2) XLA:TPU reports ``temp_size_in_bytes`` 0 for most programs, so the
  sum misses the temporaries and ``peak_memory_in_bytes`` is the larger (the transformer example on
  ``v5e:2x4``: sum 5,923,328 B, XLA 47,579,136 B). ``peak_source`` says which one gave the number.
  The figure never depends on XLA's live-range dump (``memory --peak``): that dump only lists
  what is live at the peak (:mod:`stagetool.analysis.peak`), so every command gates the same number.
  Host memory (``pinned_host``, layout ``S(5)``) is never part of it: ``host_peak_bytes`` is
  ``host_argument + host_output - host_alias + host_temp``, apart.
* Donation: the compiled HLO module header ``input_output_alias={ {0}: (1, {}, may-alias) }``
  maps output shape index ``{0}`` to entry parameter 1 (shape index ``{}``); read by
  :func:`stagetool.hlo.parser.parse_input_output_alias`.
* Capacity: ``jax.Device.memory_stats()["bytes_limit"]`` (None on CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from collections.abc import Mapping
from typing import Any

from stagetool.hlo.parser import AliasEntry, parse_input_output_alias
from stagetool.core.compat import MEMORY_FIELDS_SINCE_0_11
from stagetool.facts import BackendResult

from stagetool.analysis.cost import Suspect

_SOURCE = "jax.stages.Compiled.memory_analysis()"

#: ``peak_source`` when the sum of XLA's figures gives the gated peak.
SUM_SOURCE = "arguments + outputs - aliased + temporaries"
#: ``peak_source`` when XLA's own ``peak_memory_in_bytes`` is the larger and gives the gated peak.
XLA_PEAK_SOURCE = "XLA's peak_memory_in_bytes"
#: What ``MemoryRecord.peak_bytes`` means, on every backend (see the module docstring).
PEAK_DEFINITION = f"the larger of {SUM_SOURCE} and {XLA_PEAK_SOURCE}"
#: Fields whose suspects make the gated peak (and so a capacity verdict built on it) suspect.
_PEAK_INPUTS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes")

_FIELDS = (
    ("argument_bytes", "argument_size_in_bytes"),
    ("output_bytes", "output_size_in_bytes"),
    ("alias_bytes", "alias_size_in_bytes"),
    ("temp_bytes", "temp_size_in_bytes"),
    ("generated_code_bytes", "generated_code_size_in_bytes"),
    ("host_argument_bytes", "host_argument_size_in_bytes"),
    ("host_output_bytes", "host_output_size_in_bytes"),
    ("host_alias_bytes", "host_alias_size_in_bytes"),
    ("host_temp_bytes", "host_temp_size_in_bytes"),
    ("host_generated_code_bytes", "host_generated_code_size_in_bytes"),
)


@dataclasses.dataclass(frozen=True)
class MemoryRecord:
    """Per-device memory figures of one compiled program, in bytes.

    Every ``*_bytes`` field is per device and comes from the attribute of
    ``Compiled.memory_analysis()`` with the matching name (``argument_bytes`` <-
    ``argument_size_in_bytes`` ...); ``None`` when the backend does not report it.

    Attributes:
      argument_bytes, output_bytes, alias_bytes, temp_bytes, generated_code_bytes:
        device-memory figures.
      host_argument_bytes, host_output_bytes, host_alias_bytes, host_temp_bytes,
        host_generated_code_bytes: host-memory-space figures.
      peak_bytes_reported: ``peak_memory_in_bytes`` as XLA reports it (XLA's figure), or None.
      peak_bytes_estimate: ``argument + output - alias + temp`` (derived from XLA's figures; None
        if one of them is missing).
      peak_bytes: the peak that is shown, snapshotted, compared with capacity and gated, the same in
        every command: the larger of ``peak_bytes_estimate`` and ``peak_bytes_reported`` (the
        module docstring says why); None when neither is known.
      peak_source: which of the two gave ``peak_bytes`` (:data:`SUM_SOURCE` or
        :data:`XLA_PEAK_SOURCE`; the sum on a tie), or None.
      host_peak_bytes: host memory (``pinned_host``, ``S(5)``) for one execution:
        ``host_argument + host_output - host_alias + host_temp`` (derived; None when one is
        missing); never part of ``peak_bytes``.
      reason: why nothing was reported (None when memory_analysis() gave an object).
      suspects: figures that look wrong, as :class:`stagetool.analysis.cost.Suspect` records.
      peak_unpadded_heap_bytes, total_allocation_bytes, indefinite_allocations: XLA's figures of
        the same names (bytes per device), which ``memory_analysis()`` has from jax/jaxlib 0.11
        on (:data:`stagetool.core.compat.MEMORY_FIELDS_SINCE_0_11`); None on older releases.
        Shown and snapshotted where present, never gated.
    """

    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    generated_code_bytes: int | None
    host_argument_bytes: int | None
    host_output_bytes: int | None
    host_alias_bytes: int | None
    host_temp_bytes: int | None
    host_generated_code_bytes: int | None
    peak_bytes_reported: int | None
    peak_bytes_estimate: int | None
    peak_bytes: int | None
    peak_source: str | None
    reason: str | None
    suspects: tuple[Suspect, ...] = ()
    source: str = _SOURCE
    host_peak_bytes: int | None = None
    peak_unpadded_heap_bytes: int | None = None
    total_allocation_bytes: int | None = None
    indefinite_allocations: int | None = None

    @property
    def peak_suspects(self) -> tuple[Suspect, ...]:
        """The suspects on a figure the gated peak is built from (the sum's four parts, and XLA's
        ``peak_memory_in_bytes`` when it is the one that gives the peak): a verdict on such a peak
        is unknown (:func:`fit_verdict`)."""
        fields = set(_PEAK_INPUTS) | ({"peak_bytes_reported"} if self.peak_source == XLA_PEAK_SOURCE else set())
        return tuple(s for s in self.suspects if s.field in fields)


def _int_or_none(obj: Any, name: str) -> int | None:
    v = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def normalise_memory(stats: Any) -> MemoryRecord:
    """Turn a ``CompiledMemoryStats`` (or any object with those attributes, or None) into a record.

    ``peak_bytes`` is the larger of ``argument + output - alias + temp`` and XLA's
    ``peak_memory_in_bytes`` (:data:`PEAK_DEFINITION`; the module docstring says why), whatever the
    backend or donation; ``host_peak_bytes`` is the host-memory sum, apart. Suspects: a negative
    figure, aliased bytes beyond the outputs. XLA's peak below its own temp allocation (CPU leaves
    the temporaries out of it) is no suspect: the sum is then the larger and gives the peak. Never
    raises.
    """
    if stats is None:
        empty = {f: None for f, _ in _FIELDS}
        return MemoryRecord(**empty, peak_bytes_reported=None, peak_bytes_estimate=None,
                            peak_bytes=None, peak_source=None,
                            reason=f"{_SOURCE} returned None: the backend reports no memory analysis")
    vals = {f: _int_or_none(stats, attr) for f, attr in _FIELDS}
    reported = _int_or_none(stats, "peak_memory_in_bytes")
    suspects: list[Suspect] = []
    for f, v in [*vals.items(), ("peak_bytes_reported", reported)]:
        if v is not None and v < 0:
            suspects.append(Suspect(f, f"negative byte count {v}"))
    a, o, al, t = (vals["argument_bytes"], vals["output_bytes"], vals["alias_bytes"], vals["temp_bytes"])
    estimate = None
    if None not in (a, o, al, t):
        estimate = a + o - al + t
        if al > o:
            suspects.append(Suspect("alias_bytes", f"aliased bytes {al} exceed output bytes {o}"))
    ha, ho, hal, ht = (vals["host_argument_bytes"], vals["host_output_bytes"], vals["host_alias_bytes"],
                       vals["host_temp_bytes"])
    host = ha + ho - hal + ht if None not in (ha, ho, hal, ht) else None
    if not any(v is not None for v in vals.values()) and reported is None:
        return MemoryRecord(**vals, peak_bytes_reported=None, peak_bytes_estimate=None, peak_bytes=None,
                            peak_source=None, reason=f"{_SOURCE} returned a "
                            f"{type(stats).__name__} without any known size attribute")
    peak, source = estimate, SUM_SOURCE if estimate is not None else None
    if reported is not None and reported > 0 and (estimate is None or reported > estimate):
        peak, source = reported, XLA_PEAK_SOURCE
    return MemoryRecord(**vals, peak_bytes_reported=reported, peak_bytes_estimate=estimate,
                        peak_bytes=peak, peak_source=source,
                        reason=None if peak is not None else
                        f"{_SOURCE} lacks one of argument, output, alias and temp sizes, and reports no "
                        "peak_memory_in_bytes: no peak",
                        suspects=tuple(suspects), host_peak_bytes=host,
                        **{f: _int_or_none(stats, f) for f in MEMORY_FIELDS_SINCE_0_11})


def memory_of(result: BackendResult | None) -> MemoryRecord:
    """Per-device memory record from ``Compiled.memory_analysis()`` as staging read it (an
    exception the backend raised becomes the record's reason)."""
    if result is not None and result.error is not None:
        rec = normalise_memory(None)
        return dataclasses.replace(rec, reason=f"memory_analysis() raised {result.error}")
    return normalise_memory(result.values if result is not None else None)


# --------------------------------------------------------------------------- donation


@dataclasses.dataclass(frozen=True)
class DonationStatus:
    """Donation outcome of one entry parameter.

    Attributes:
      parameter_number: entry computation parameter number.
      requested: whether the caller asked to donate it.
      aliased_output_indices: output shape indices that reuse its buffer (``()`` if none).
      status: ``"aliased"`` (donated and reused), ``"not usable"`` (donated, but XLA found no
        output of matching shape/dtype/sharding: JAX warns "Some donated buffers were not
        usable"), ``"not requested"``, or ``"aliased without request"`` (XLA aliased a buffer
        the caller did not donate, which JAX does not do; kept visible, not hidden).
    """

    parameter_number: int
    requested: bool
    aliased_output_indices: tuple[tuple[int, ...], ...]
    status: str


def donation_status(donated: Sequence[bool], aliases: Iterable[AliasEntry]) -> tuple[DonationStatus, ...]:
    """Per entry parameter: donation requested, aliased to which outputs, or not usable.

    Args:
      donated: one bool per entry parameter, in parameter-number order (the lead maps input
        leaves to entry parameters, accounting for pruned unused arguments).
      aliases: from :func:`parse_input_output_alias`.

    Returns:
      One :class:`DonationStatus` per parameter number ``0..len(donated)-1``, plus any
      parameter number that appears only in ``aliases``.
    """
    by_param: dict[int, list[tuple[int, ...]]] = {}
    for e in aliases:
        by_param.setdefault(e.parameter_number, []).append(e.output_index)
    out = []
    for p in sorted(set(range(len(donated))) | set(by_param)):
        req = bool(donated[p]) if p < len(donated) else False
        outs = tuple(sorted(by_param.get(p, ())))
        if req:
            status = "aliased" if outs else "not usable"
        else:
            status = "aliased without request" if outs else "not requested"
        out.append(DonationStatus(p, req, outs, status))
    return tuple(out)


# --------------------------------------------------------------------------- capacity and sizes



@dataclasses.dataclass(frozen=True)
class FitVerdict:
    """Does the per-device peak fit in the device's capacity?

    Attributes:
      peak_bytes: per-device peak (from :class:`MemoryRecord`), or None.
      capacity_bytes: per-device capacity, or None.
      share_used: ``peak_bytes / capacity_bytes`` (1.0 = exactly full), or None.
      headroom_bytes: ``capacity_bytes - peak_bytes`` (negative when it does not fit), or None.
      fits: True / False, or None when either figure is missing.
      reason: why ``fits`` is None.
    """

    peak_bytes: int | None
    capacity_bytes: int | None
    share_used: float | None
    headroom_bytes: int | None
    fits: bool | None
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class UnknownSharding:
    """Input leaves whose sharding nothing gives (an ``init`` or ``{ref:}`` leaf no rule, run or
    annotation shards: ``sharding_source == "unknown"``), staged replicated: what rides on the guess.

    Attributes:
      paths: the leaves' key paths, in input order.
      staged_bytes: their bytes per device as staged (replicated: each whole), derived.
      least_bytes: their bytes per device were each split evenly over every device (the least they
        could hold), derived (ceil of whole bytes ÷ devices).
    """

    paths: tuple[str, ...]
    staged_bytes: int
    least_bytes: int

    @property
    def at_stake_bytes(self) -> int:
        """Bytes per device the guess may overstate: ``staged_bytes - least_bytes``."""
        return self.staged_bytes - self.least_bytes


def unknown_sharding(inputs: Iterable[Any], device_count: int) -> UnknownSharding | None:
    """The :class:`UnknownSharding` of input leaf reports (``path``, ``shape``, ``bytes_global``,
    ``bytes_per_device``, ``sharding_source``, ``unused``) on ``device_count`` devices, or None when
    every used leaf's sharding is known (or nothing rides on it: one device, scalars)."""
    leaves = [x for x in inputs if x.sharding_source == "unknown" and not x.unused and x.bytes_per_device]
    if not leaves or device_count <= 1:
        return None
    leaves = [x for x in leaves if tuple(x.shape)]  # a scalar cannot be split: nothing rides on it
    staged = sum(int(x.bytes_per_device) for x in leaves)
    least = sum(-(-int(x.bytes_global) // device_count) for x in leaves)
    return UnknownSharding(tuple(x.path for x in leaves), staged, least) if staged > least else None


def unknown_sharding_note(u: UnknownSharding, peak_bytes: int | None = None) -> str:
    """One sentence for the top of a report: how many leaves have no known sharding, the bytes per
    device riding on it, and the peak's range when ``peak_bytes`` is given."""
    from stagetool.core.units import format_bytes

    n = len(u.paths)
    shown = ", ".join(u.paths[:3]) + (f" and {n - 3} more" if n > 3 else "")
    text = (f"sharding unknown for {n} input {'leaves' if n != 1 else 'leaf'} ({shown}): nothing gives "
            f"{'them' if n != 1 else 'it'} one (no rule, no sharding in the init's run, no annotation), so "
            f"{'they are' if n != 1 else 'it is'} staged replicated: {format_bytes(u.staged_bytes)} per device "
            f"({format_bytes(u.least_bytes)} if split over every device)")
    if peak_bytes is not None:
        text += (f"; the peak is between {format_bytes(max(peak_bytes - u.at_stake_bytes, 0))} and "
                 f"{format_bytes(peak_bytes)} per device as they are laid out")
    return text + "; give them rules or shardings in the spec to know"


def fit_verdict(peak_bytes: int | None, capacity_bytes: int | None,
                suspects: Sequence[Suspect] = (), unknown: UnknownSharding | None = None) -> FitVerdict:
    """Compare a per-device peak with a per-device capacity (both bytes). Never raises.

    A peak built on a suspect figure (``suspects``: :attr:`MemoryRecord.peak_suspects`) gives no
    verdict: ``fits`` is None and ``reason`` names the suspect, so that a gate cannot pass on it.
    With ``unknown`` (inputs staged replicated because nothing gives their sharding), the peak is a
    range, from ``peak_bytes - unknown.at_stake_bytes`` to ``peak_bytes``: it fits when the top
    does, does not when the bottom does not, and between the two ``fits`` is None, the reason saying
    the range.
    """
    if suspects and peak_bytes is not None:
        why = "; ".join(f"{s.field}: {s.reason}" for s in suspects)
        return FitVerdict(peak_bytes, capacity_bytes, None, None, None, f"the peak is built on a suspect figure ({why})")
    if peak_bytes is None:
        return FitVerdict(None, capacity_bytes, None, None, None, "peak memory not reported")
    if capacity_bytes is None:
        return FitVerdict(peak_bytes, None, None, None, None,
                          "device capacity unknown (give it with a size such as 16GiB)")
    if capacity_bytes <= 0:
        return FitVerdict(peak_bytes, capacity_bytes, None, None, None, "capacity is not positive")
    if unknown is not None and peak_bytes > capacity_bytes >= peak_bytes - unknown.at_stake_bytes:
        from stagetool.core.units import format_bytes

        return FitVerdict(peak_bytes, capacity_bytes, peak_bytes / capacity_bytes, capacity_bytes - peak_bytes, None,
                          f"the peak is between {format_bytes(peak_bytes - unknown.at_stake_bytes)} and "
                          f"{format_bytes(peak_bytes)} per device against {format_bytes(capacity_bytes)}: "
                          f"{len(unknown.paths)} input leaves have no known sharding and are staged replicated; "
                          "it fits only if they are sharded")
    return FitVerdict(peak_bytes, capacity_bytes, peak_bytes / capacity_bytes,
                      capacity_bytes - peak_bytes, peak_bytes <= capacity_bytes)


# --------------------------------------------------------------------------- out of memory


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
    """The compile stopped because the program does not fit: XLA's figures, and what the inputs say.

    Attributes:
      needed_bytes: per device, what XLA said the program needs (XLA's figure, printed to 0.01 of
        its unit: ``129.73G``), or None.
      available_bytes: per device, what XLA said is available (``15.75G`` on a 16 GiB v5e), or None.
      memory_space: the memory XLA named (``HBM``), or None.
      what: what XLA was sizing (``HLO temporaries``), or None.
      xla_message: XLA's message.
      argument_bytes: per device, the inputs' bytes from their declared shardings (derived: shape ×
        dtype ÷ the mesh axes sharding each dimension), leaves with ``auto`` sharding counted whole.
      auto_leaves: the input leaves counted whole because the partitioner would have chosen their sharding.
    """

    needed_bytes: int | None
    available_bytes: int | None
    memory_space: str | None
    what: str | None
    xla_message: str
    argument_bytes: int | None
    auto_leaves: tuple[str, ...] = ()


def declared_argument_bytes(leaves: Iterable[Any], axis_size: Mapping[str, int]) -> tuple[int | None, tuple[str, ...]]:
    """Per-device bytes of input leaves (``shape``, ``dtype``, ``declared``) from their declared
    shardings, and the paths of ``auto`` leaves (counted whole). None when a dtype is unknown."""
    from stagetool.core.dtypes import array_bytes

    total, auto = 0, []
    for x in leaves:
        shape = list(x.shape)
        declared = x.declared
        if declared.kind == "spec":
            for i, d in enumerate(declared.dims[: len(shape)]):
                for a in () if d is None else ((d,) if isinstance(d, str) else d):
                    shape[i] = -(-shape[i] // axis_size.get(a, 1))
        elif declared.kind == "auto":
            auto.append(x.path)
        b = array_bytes(shape, x.dtype)
        if b is None:
            return None, tuple(auto)
        total += b
    return total, tuple(auto)
