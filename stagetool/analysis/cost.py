"""Normalise XLA's cost analysis into frozen records with units and scope.

Two JAX APIs feed this module (verified on jax/jaxlib 0.10.2, CPU):

* ``jax.stages.Lowered.cost_analysis()`` -- the **whole, unpartitioned program**
  (the StableHLO module before SPMD partitioning). Returns a ``dict[str, float]``.
* ``jax.stages.Compiled.cost_analysis()`` -- the **partitioned module of one device**
  (after SPMD partitioning and optimisation). Returns a ``dict[str, float]``.

Older jax versions returned a list with one dict per program, and any backend may
return ``None`` or ``{}``; :func:`normalise_cost` accepts all of these.

Keys seen on CPU: ``flops``, ``transcendentals``, ``bytes accessed``,
``bytes accessed{N}{I}`` / ``bytes accessedout{I}`` and ``utilization{N}{I}``.
TPU adds ``optimal_seconds`` and others. XLA *omits* counters whose value is 0
(a program without transcendental ops has no ``transcendentals`` key; an identity
function has no ``flops`` key), so an absent key is recorded as ``None`` with that
explanation, never silently as 0.

The per-operand keys ``bytes accessed{N}{I}`` are **not** per entry parameter:
XLA's HloCostAnalysis sums, over every instruction of the module, the bytes read
through that instruction's operand slot ``N`` (shape index ``I``); ``out`` is the
bytes written to instructions' outputs. For a single-instruction program
(``a @ b``) slot ``N`` coincides with entry parameter ``N``; in general it does not
(e.g. ``(a * 2, c.sum())`` gives slot 0 = bytes(a) + bytes(c) + 4). They therefore
must not be mapped to input leaf names. Entry parameter numbers are themselves not
flat input-leaf indices either: jit prunes unused arguments from the module.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from stagetool.facts import BackendResult

SCOPE_WHOLE_PROGRAM = "whole_program"
"""Scope of figures from ``Lowered.cost_analysis()``: the unpartitioned program, all devices together."""
SCOPE_PER_DEVICE = "per_device"
"""Scope of figures from ``Compiled.cost_analysis()``: one device's partitioned module."""

_SOURCE = {
    SCOPE_WHOLE_PROGRAM: "jax.stages.Lowered.cost_analysis()",
    SCOPE_PER_DEVICE: "jax.stages.Compiled.cost_analysis()",
}

UNKNOWN_SECONDS_REASON = "XLA's 'unknown' (a negative value, not a figure)"
"""The ``absent_reasons`` entry of a seconds key XLA reported as negative (its -1, summed over a
whole program's parts): kept in the record, never shown as a figure or a note."""

_ABSENT_REASON = ("key absent from cost_analysis(); XLA omits counters whose value is 0, "
                  "so this usually means 0")

_OPERAND_KEY = re.compile(r"^bytes accessed(\d+|out)\{([\d,]*)\}$")
_DOT_OR_CONV = re.compile(
    r"(?<![\w.\-])(?:dot|convolution)\("          # HLO text: %x = f32[..] dot(%a, %b)
    r"|\bstablehlo\.(?:dot_general|dot|convolution)\b"  # StableHLO / MLIR text
)


@dataclasses.dataclass(frozen=True)
class Suspect:
    """A figure that looks wrong.

    Attributes:
      field: the record field (or raw cost-analysis key) concerned.
      reason: one sentence saying what is impossible or inconsistent about it.
    """

    field: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ExtraMetric:
    """A cost-analysis key beyond flops / transcendentals / bytes accessed.

    Attributes:
      key: the raw key, e.g. ``"optimal_seconds"`` or ``"utilization0{}"``.
      value: the raw value (float).
      unit: ``"seconds"``, ``"bytes"``, ``"FLOPs"``, ``"count"`` (utilization: how many
        times operand elements are used, summed over instructions) or ``"unknown"``.
    """

    key: str
    value: float
    unit: str


@dataclasses.dataclass(frozen=True)
class OperandSlotBytes:
    """Bytes accessed through one operand slot, summed over all instructions of the module.

    Attributes:
      slot: the operand position ``N`` of ``bytes accessed{N}{I}``, or ``None`` for
        ``bytes accessedout{I}`` (bytes written to outputs).
      shape_index: the tuple shape index ``I`` as a tuple of ints (``()`` for ``{}``).
      bytes: bytes (float, as XLA reports it), in the record's scope.

    This is **not** per entry parameter; see the module docstring.
    """

    slot: int | None
    shape_index: tuple[int, ...]
    bytes: float


@dataclasses.dataclass(frozen=True)
class CostRecord:
    """Normalised cost analysis of one program, in one scope.

    All figures are in the record's ``scope``: ``"whole_program"`` (from
    ``Lowered.cost_analysis()``) or ``"per_device"`` (from ``Compiled.cost_analysis()``).
    A figure is ``None`` when not reported; ``reason`` (whole record) or
    ``absent_reasons`` (per field) say why.

    Attributes:
      scope: ``"whole_program"`` or ``"per_device"``.
      source: the JAX API the figures come from.
      flops: floating-point operations (FLOPs), or None.
      transcendentals: transcendental operations (count), or None.
      bytes_accessed: bytes read plus written by all instructions, or None.
      output_bytes_accessed: bytes written to instructions' outputs: XLA's ``bytes accessedout{}``
        (which already holds its tuple elements ``out{0}``, ``out{1}``, ...), or None.
      arithmetic_intensity_flops_per_byte: ``flops / bytes_accessed`` when both are
        present and bytes > 0, else None.
      operand_slots: per-operand-slot bytes, sorted by (slot, shape index), output last.
      extra: every further key with its unit, sorted by key.
      reason: why nothing was reported (None when the backend reported a dict).
      absent_reasons: ``(field, reason)`` for each of flops / transcendentals /
        bytes_accessed that is None although the backend reported other keys, and for each
        seconds key XLA reported as negative (its "unknown": not a figure).
      suspects: figures that look wrong (see :func:`normalise_cost`).
    """

    scope: str
    source: str
    flops: float | None
    transcendentals: float | None
    bytes_accessed: float | None
    output_bytes_accessed: float | None
    arithmetic_intensity_flops_per_byte: float | None
    operand_slots: tuple[OperandSlotBytes, ...]
    extra: tuple[ExtraMetric, ...]
    reason: str | None
    absent_reasons: tuple[tuple[str, str], ...] = ()
    suspects: tuple[Suspect, ...] = ()

    @property
    def reported(self) -> bool:
        """True when the backend reported a cost dict (possibly with absent keys)."""
        return self.reason is None

    def operand_slot_bytes(self) -> dict[int, float]:
        """Operand slot ``N`` -> bytes accessed through it (summed over shape indices).

        Not an entry-parameter mapping (see the module docstring). Output excluded.
        """
        out: dict[int, float] = {}
        for s in self.operand_slots:
            if s.slot is not None:
                out[s.slot] = out.get(s.slot, 0.0) + s.bytes
        return dict(sorted(out.items()))

    def extra_by_key(self) -> dict[str, ExtraMetric]:
        """The extra metrics as a key-sorted dict."""
        return {m.key: m for m in self.extra}


def has_dot_or_convolution(program_text: str) -> bool:
    """Whether HLO or StableHLO text contains a dot product or convolution.

    A plain text scan for ``dot(`` / ``convolution(`` (HLO) and ``stablehlo.dot_general`` /
    ``stablehlo.dot`` / ``stablehlo.convolution`` (StableHLO). Prefer the lowered text
    (``Lowered.as_text()``): a compiled CPU module may have turned dots into custom calls.
    """
    return _DOT_OR_CONV.search(program_text) is not None


def _unit_for(key: str) -> str:
    k = key.lower()
    if "seconds" in k:
        return "seconds"
    if k.startswith("utilization"):
        return "count"
    if "bytes" in k:
        return "bytes"
    if "flops" in k:
        return "FLOPs"
    return "unknown"


def _not_reported(scope: str, source: str, reason: str) -> CostRecord:
    return CostRecord(scope=scope, source=source, flops=None, transcendentals=None,
                      bytes_accessed=None, output_bytes_accessed=None,
                      arithmetic_intensity_flops_per_byte=None, operand_slots=(), extra=(),
                      reason=reason)


def _parse_index(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(",") if p.strip())


def normalise_cost(raw: Any, *, scope: str, source: str | None = None,
                   has_dot_or_conv: bool | None = None, program_text: str | None = None) -> CostRecord:
    """Turn one raw ``cost_analysis()`` result into a :class:`CostRecord`.

    Args:
      raw: what ``Lowered.cost_analysis()`` / ``Compiled.cost_analysis()`` returned: a
        ``dict[str, float]``, a list of such dicts (older jax: one per program; the first
        is used, a suspect is added when they differ), ``None`` or ``{}``.
      scope: ``"whole_program"`` or ``"per_device"`` (:data:`SCOPE_WHOLE_PROGRAM`,
        :data:`SCOPE_PER_DEVICE`).
      source: the API name to record; defaults to the one matching ``scope``.
      has_dot_or_conv: whether the program has dot products / convolutions (for the
        "0 FLOPs" sanity check); derived from ``program_text`` when that is given.
      program_text: HLO or StableHLO text of the program (optional).

    A negative *seconds* figure is XLA's "unknown" (``optimal_seconds: -1.0`` in
    ``Lowered.cost_analysis()`` on CPU when ``out_shardings`` is given): it is left out of ``extra``
    and named in ``absent_reasons``, neither data nor a suspect.

    Sanity flags (``suspects``): a negative FLOP / transcendental / byte figure (seen: a
    1-byte-short operand slot in ``Lowered.cost_analysis()`` on CPU when ``out_shardings`` is given); NaN or infinite values; 0 or absent FLOPs in a program with dots or
    convolutions; ``bytes accessed`` absent while other keys are reported; total bytes
    accessed smaller than the bytes written to outputs or than any single operand slot
    (the total is the sum of those parts). Bytes accessed smaller than the argument bytes
    is deliberately *not* flagged: a program may read only a slice of an argument.

    Never raises for odd backend output; a non-numeric value becomes a suspect.

    Raises:
      ValueError: ``scope`` is not one of the two scopes (a programming error).
    """
    if scope not in _SOURCE:
        raise ValueError(f"scope must be one of {sorted(_SOURCE)}, got {scope!r}")
    src = source or _SOURCE[scope]
    if has_dot_or_conv is None and program_text is not None:
        has_dot_or_conv = has_dot_or_convolution(program_text)

    suspects: list[Suspect] = []
    if raw is None:
        return _not_reported(scope, src, f"{src} returned None: the backend reports no cost analysis")
    if isinstance(raw, (list, tuple)):
        dicts = [d for d in raw if d]
        if not dicts:
            return _not_reported(scope, src, f"{src} returned an empty list: no cost analysis")
        if any(d != dicts[0] for d in dicts[1:]):
            suspects.append(Suspect("cost_analysis", f"{len(dicts)} per-program dicts that differ; "
                                                     "the first one is used"))
        raw = dicts[0]
    if not isinstance(raw, Mapping):
        return _not_reported(scope, src, f"{src} returned a {type(raw).__name__}, not a mapping")
    if not raw:
        return _not_reported(scope, src, f"{src} returned an empty dict: the backend reports no cost analysis")

    values: dict[str, float] = {}
    for key in sorted(raw):
        v = raw[key]
        try:
            values[str(key)] = float(v)
        except (TypeError, ValueError):
            suspects.append(Suspect(str(key), f"non-numeric value {v!r}; ignored"))

    for key, v in values.items():
        if math.isnan(v) or math.isinf(v):
            suspects.append(Suspect(key, f"value is {v}"))

    flops = values.get("flops")
    transcendentals = values.get("transcendentals")
    bytes_accessed = values.get("bytes accessed")
    absent: list[tuple[str, str]] = []
    for field, val in (("flops", flops), ("transcendentals", transcendentals),
                       ("bytes_accessed", bytes_accessed)):
        if val is None:
            absent.append((field, _ABSENT_REASON))

    if flops is not None and flops < 0:
        suspects.append(Suspect("flops", f"negative FLOP count {flops:g} (XLA uses -1 for 'unknown')"))
    if transcendentals is not None and transcendentals < 0:
        suspects.append(Suspect("transcendentals", f"negative count {transcendentals:g}"))
    if has_dot_or_conv and (flops is None or flops == 0):
        suspects.append(Suspect("flops", "0 or absent FLOPs for a program that contains dot "
                                         "products or convolutions"))
    if bytes_accessed is None:
        suspects.append(Suspect("bytes_accessed", "'bytes accessed' absent although other keys are "
                                                  "reported; every program with inputs or outputs "
                                                  "accesses bytes"))
    elif bytes_accessed < 0:
        suspects.append(Suspect("bytes_accessed", f"negative byte count {bytes_accessed:g}"))

    slots, extra, output_bytes = _parts(values, bytes_accessed, suspects, absent)

    intensity = None
    if flops is not None and bytes_accessed is not None and bytes_accessed > 0 and flops >= 0:
        intensity = flops / bytes_accessed

    return CostRecord(scope=scope, source=src, flops=flops, transcendentals=transcendentals,
                      bytes_accessed=bytes_accessed, output_bytes_accessed=output_bytes,
                      arithmetic_intensity_flops_per_byte=intensity, operand_slots=tuple(slots),
                      extra=tuple(extra), reason=None, absent_reasons=tuple(absent),
                      suspects=tuple(suspects))


def _parts(values: dict[str, float], bytes_accessed: float | None, suspects: list[Suspect],
           absent: list[tuple[str, str]]) -> tuple[list[OperandSlotBytes], list[ExtraMetric], float | None]:
    """The figures of a cost dict beside the three headline ones: ``(operand slots sorted, extra
    metrics, bytes written to outputs or None)``; a negative figure is a suspect, an unknown (-1)
    seconds figure an absent one, and a total smaller than one of its parts a suspect."""
    slots: list[OperandSlotBytes] = []
    extra: list[ExtraMetric] = []
    for key, v in values.items():
        if key in ("flops", "transcendentals", "bytes accessed"):
            continue
        m = _OPERAND_KEY.match(key)
        if m:
            slot = None if m.group(1) == "out" else int(m.group(1))
            slots.append(OperandSlotBytes(slot=slot, shape_index=_parse_index(m.group(2)), bytes=v))
            if v < 0:
                suspects.append(Suspect(key, f"negative byte count {v:g}"))
        else:
            unit = _unit_for(key)
            if unit == "seconds" and v < 0:
                # XLA's -1 means "unknown" (CPU's optimal_seconds; a whole program of several parts
                # sums them: -2): not a figure, and nothing wrong with the others
                absent.append((key, UNKNOWN_SECONDS_REASON))
                continue
            extra.append(ExtraMetric(key=key, value=v, unit=unit))
            if v < 0 and unit in ("bytes", "FLOPs"):
                suspects.append(Suspect(key, f"negative {unit} figure {v:g} (XLA uses -1 for 'unknown')"))
    slots.sort(key=lambda s: (s.slot is None, s.slot if s.slot is not None else 0, s.shape_index))

    output_bytes = _output_bytes(slots)
    if bytes_accessed is not None and bytes_accessed >= 0:
        if output_bytes is not None and output_bytes > bytes_accessed:
            suspects.append(Suspect("bytes_accessed", f"total {bytes_accessed:g} B is smaller than the "
                                                      f"bytes written to outputs ({output_bytes:g} B)"))
        for s in slots:
            if s.slot is not None and s.bytes > bytes_accessed:
                suspects.append(Suspect("bytes_accessed", f"total {bytes_accessed:g} B is smaller than "
                                                          f"operand slot {s.slot} alone ({s.bytes:g} B)"))

    return slots, extra, output_bytes


def _output_bytes(slots: list[OperandSlotBytes]) -> float | None:
    """Bytes written to outputs: XLA's own ``bytes accessedout{}``, or None without ``out`` keys.

    ``out{}`` is already the whole figure: HloCostAnalysis sets it for every instruction, and for
    an instruction with a tuple output (a multi-output fusion) it is the sum of that tuple's
    elements, which it also reports as ``out{0}``, ``out{1}``, ... (summed over the module, like every
    key). Adding the elements to ``out{}`` counts those outputs twice. Only where XLA left ``out{}``
    out (it omits a zero counter) are the top-level elements summed instead.
    """
    out = [s for s in slots if s.slot is None]
    if not out:
        return None
    whole = [s.bytes for s in out if s.shape_index == ()]
    if whole:
        return whole[0]
    return sum(s.bytes for s in out if len(s.shape_index) == 1)


def _result_cost(result: BackendResult | None, scope: str, *, program_text: str | None,
                 has_dot_or_conv: bool | None = None) -> CostRecord:
    """A backend's ``cost_analysis()`` result normalised in ``scope``; an exception it raised (or no
    result at all) becomes a not-reported record with the reason."""
    if result is None:
        return _not_reported(scope, _SOURCE[scope], "the function was not compiled")
    if result.error is not None:
        return _not_reported(scope, _SOURCE[scope], f"cost_analysis() raised {result.error}")
    return normalise_cost(result.values, scope=scope, has_dot_or_conv=has_dot_or_conv, program_text=program_text)


def whole_program_cost(result: BackendResult | None, *, program_text: str | None = None) -> CostRecord:
    """Whole-program cost from ``Lowered.cost_analysis()`` (as :mod:`stagetool.staging.gather` read it).

    Figures are for the unpartitioned program (all devices together). The 0-FLOPs check scans
    ``program_text`` (the lowered StableHLO) for dots/convolutions. An exception the backend's
    ``cost_analysis()`` raised becomes a not-reported record with the error text as reason.
    """
    return _result_cost(result, SCOPE_WHOLE_PROGRAM, program_text=program_text)


def per_device_cost(result: BackendResult | None, *, has_dot_or_conv: bool | None = None,
                    program_text: str | None = None) -> CostRecord:
    """Per-device cost from ``Compiled.cost_analysis()`` (as :mod:`stagetool.staging.gather` read it).

    Figures are for one device's partitioned, optimised module. Pass ``has_dot_or_conv`` (from the
    lowered text: CPU may rewrite dots to custom calls) for the 0-FLOPs check; when None,
    ``program_text`` (the compiled text) is scanned. Backend exceptions become a not-reported record.
    """
    return _result_cost(result, SCOPE_PER_DEVICE, program_text=program_text if has_dot_or_conv is None else None,
                        has_dot_or_conv=has_dot_or_conv)


# --------------------------------------------------------------------------- shard_map scope

_MESH_DECL = re.compile(r"sdy\.mesh\s+@(\w+)\s*=\s*<\[([^\]]*)\]")
_MESH_AXIS = re.compile(r'"([^"]+)"\s*=\s*(\d+)')
_MANUAL = re.compile(r"sdy\.manual_computation\(.*?manual_axes=\{([^}]*)\}")
_STRUCTURAL = ("sdy.manual_computation", "return", "stablehlo.constant", "stablehlo.reshape", "sdy.return",
               "func.return", "stablehlo.bitcast_convert", "stablehlo.tuple", "stablehlo.get_tuple_element",
               "sdy.sharding_constraint")


@dataclasses.dataclass(frozen=True)
class ManualScope:
    """What ``Lowered.cost_analysis()`` counts when the program uses ``shard_map``: it costs a manual
    computation's body once, as one shard sees it.

    Attributes:
      kind: ``"none"`` (no manual computation), ``"entire"`` (the program is one manual computation
        over all devices: the lowered figures are one shard's) or ``"partial"`` (manual parts are
        one shard's, the rest is the whole program's).
      shards: devices the manual axes span (the product of their sizes), or None.
      axes: the manual mesh axes.
    """

    kind: str
    shards: int | None = None
    axes: tuple[str, ...] = ()


def manual_scope(stablehlo_text: str | None) -> ManualScope:
    """Find ``sdy.manual_computation`` ops in the lowered StableHLO (Shardy) and say what the
    lowered cost's scope is (:class:`ManualScope`)."""
    if not stablehlo_text or "sdy.manual_computation" not in stablehlo_text:
        return ManualScope("none")
    sizes: dict[str, int] = {}
    m = _MESH_DECL.search(stablehlo_text)
    if m:
        sizes = {a: int(n) for a, n in _MESH_AXIS.findall(m.group(2))}
    axes: list[str] = []
    for mm in _MANUAL.finditer(stablehlo_text):
        for a in re.findall(r'"([^"]+)"', mm.group(1)):
            if a not in axes:
                axes.append(a)
    shards = 1
    for a in axes:
        shards *= sizes.get(a, 1)
    every = sizes and all(a in axes or n == 1 for a, n in sizes.items())
    # the entry function's own ops (4-space indent inside @main) other than the manual computation
    main = stablehlo_text.split("func.func public @main", 1)[-1]
    top_ops = []
    for line in main.splitlines()[1:]:
        if line.startswith("  }"):
            break
        if line.startswith("    ") and not line.startswith("     "):
            op = re.sub(r"^\s*(%[\w#:, %]+=\s*)?", "", line).split("(")[0].split(" ")[0].strip('"')
            top_ops.append(op)
    entire = bool(every) and all(op.startswith(_STRUCTURAL) or op in ("", "}") for op in top_ops)
    return ManualScope("entire" if entire else "partial", shards, tuple(axes))


def scaled_to_shards(record: CostRecord, shards: int) -> CostRecord:
    """A whole-program record of one shard's figures multiplied by the shards (FLOPs,
    transcendentals, bytes): for a program that is one ``shard_map`` over all devices."""
    def k(v: float | None) -> float | None:
        return None if v is None else v * shards

    return dataclasses.replace(
        record, flops=k(record.flops), transcendentals=k(record.transcendentals),
        bytes_accessed=k(record.bytes_accessed), output_bytes_accessed=k(record.output_bytes_accessed),
        source=f"{record.source} × {shards} shards (the program is one shard_map over all devices; XLA "
               "costs one shard)")
