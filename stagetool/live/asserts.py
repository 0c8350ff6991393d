"""Assertions for tests over a :class:`stagetool.report.model.Report` (``stagetool.inspect``, the
pytest fixture): each raises ``AssertionError`` saying what was found and where, or returns None.
Pure: no JAX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagetool.report.model import FunctionReport, Report


def _function(report: Report, function: str | None) -> FunctionReport:
    return report.function(function)


def assert_no_collective(report: Report, kind: str = "all-gather", axis: str | None = None, *,
                         function: str | None = None) -> None:
    """No collective of ``kind`` (``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all``,
    ``collective-permute``, ...) runs over mesh axis ``axis`` (any axis when None) in the compiled
    program (XLA's collectives, :attr:`CollectivesSection.items`).

    Raises:
      AssertionError: naming each such collective, its mesh axes, bytes per device and source line.
    """
    f = _function(report, function)
    if f.collectives is None:
        raise AssertionError(f"{f.name}: the report has no collectives section")
    found = [c for c in f.collectives.items if c.collective.kind == kind
             and (axis is None or axis in (c.collective.mesh_axes or ()))]
    if found:
        rows = "\n".join(f"  {c.collective.kind} over {', '.join(c.collective.mesh_axes or ()) or '?'}: "
                         f"{c.collective.bytes_per_device} B per device at {c.source or 'an unknown line'}"
                         for c in found)
        raise AssertionError(f"{f.name}: {len(found)} {kind}" + (f" over {axis!r}" if axis else "")
                             + f" in the compiled program:\n{rows}")


def assert_peak_under(report: Report, limit: int | str, *, function: str | None = None) -> None:
    """The per-device peak (:attr:`MemoryRecord.peak_bytes`: XLA's ``memory_analysis()``) is under
    ``limit`` bytes (an int, or a size such as ``"16GiB"``).

    Raises:
      AssertionError: with the peak, the limit and how the peak is made up.
    """
    from stagetool.core.units import format_bytes, parse_size

    f = _function(report, function)
    limit_bytes = parse_size(limit)
    if f.memory is None:
        raise AssertionError(f"{f.name}: the report has no memory section")
    r = f.memory.record
    if r.peak_bytes is None or r.peak_bytes >= limit_bytes:
        raise AssertionError(f"{f.name}: peak {format_bytes(r.peak_bytes) if r.peak_bytes is not None else 'unknown'} "
                             f"per device is not under {format_bytes(limit_bytes)} ({r.peak_source}: arguments "
                             f"{r.argument_bytes} B, outputs {r.output_bytes} B, aliased {r.alias_bytes} B, "
                             f"temporaries {r.temp_bytes} B)")


def assert_sharding(report: Report, leaf: str, spec: Any, *, function: str | None = None) -> None:
    """The compiled sharding of every input or output leaf that ``leaf`` names (a key path, its last
    part, or a regular expression, as ``--explain`` takes it) is ``spec``: a ``PartitionSpec`` or
    its text (``"P('data', None)"``, ``P(None, 'model')``).

    Raises:
      AssertionError: no leaf named, or each leaf whose compiled sharding differs (with its declared
        sharding and where that came from).
    """
    from stagetool.plan.selectors import leaf_patterns

    f = _function(report, function)
    (pattern,) = leaf_patterns((leaf,))
    leaves = [x for x in (*(f.inputs or ()), *(f.outputs or ())) if pattern.names(x.path)]
    if not leaves:
        names = ", ".join(x.path for x in (*(f.inputs or ()), *(f.outputs or ())))
        raise AssertionError(f"{f.name}: {leaf!r} names no leaf; the leaves are {names}")
    want = _spec_text(spec)
    wrong = [x for x in leaves if _spec_text(x.compiled) != want]
    if wrong:
        rows = "\n".join(f"  {x.path}: compiled {x.compiled}, declared {x.declared} (from {x.sharding_source or 'default'}"
                         + (f" at {x.source}" if x.source else "") + ")" for x in wrong)
        raise AssertionError(f"{f.name}: the compiled sharding is not {want}:\n{rows}")


def _spec_text(spec: Any) -> str:
    """A sharding as JAX prints a PartitionSpec, trailing unsharded dimensions dropped (``P('data')``
    and ``P('data', None)`` are one sharding)."""
    text = str(spec).replace('"', "'").replace(" ", "")
    if text.startswith("PartitionSpec("):
        text = "P(" + text[len("PartitionSpec("):]
    while text.endswith(",None)"):
        text = text[: -len(",None)")] + ")"
    return "P()" if text == "P(None)" else text
