"""Stable, human formatting of numbers: bytes, FLOPs, seconds, shapes.

Every renderer formats through these, so that the same value always prints the same way.
"""

from __future__ import annotations

import re
from decimal import ROUND_FLOOR, Decimal, InvalidOperation

from stagetool.core.dtypes import hlo_name
from stagetool.core.errors import UsageError


def short_dtype(dtype: str) -> str:
    """HLO's short name of a numpy dtype name: ``float32`` → ``f32``, ``int32`` → ``s32``."""
    return hlo_name(dtype)


def shape_str(dtype: str, shape: tuple[int, ...] | list[int] | None) -> str:
    """``f32[512,1024]``; ``f32[]`` for a scalar; ``—`` for no shape."""
    if shape is None:
        return "—"
    return f"{short_dtype(dtype)}[{','.join(str(d) for d in shape)}]"


def dims_str(shape: tuple[int, ...] | list[int] | None) -> str:
    """``[512,256]``, or ``—`` for None."""
    if shape is None:
        return "—"
    return "[" + ",".join(str(d) for d in shape) + "]"


def format_bytes(n: int | float | None) -> str:
    """Bytes with binary units, three significant figures: ``512 B``, ``1.50 KiB``, ``3.00 GiB``; ``n/a`` for None."""
    if n is None:
        return "n/a"
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{_sig3(value)} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(n: int | float | None, unit: str = "") -> str:
    """A large count with SI prefixes, three significant figures: ``1.23 GFLOP``; ``n/a`` for None."""
    if n is None:
        return "n/a"
    value = float(n)
    for prefix in ("", "K", "M", "G", "T", "P", "E"):
        if abs(value) < 1000 or prefix == "E":
            text = f"{int(value)}" if prefix == "" and value == int(value) else _sig3(value)
            return f"{text} {prefix}{unit}".rstrip()
        value /= 1000
    raise AssertionError("unreachable")


def format_seconds(s: float | None) -> str:
    """Seconds with a fitting unit: ``812 µs``, ``12.3 ms``, ``1.25 s``; ``n/a`` for None."""
    if s is None:
        return "n/a"
    if s < 1e-3:
        return f"{_sig3(s * 1e6)} µs"
    if s < 1:
        return f"{_sig3(s * 1e3)} ms"
    return f"{_sig3(s)} s"


def format_percent(fraction: float | None) -> str:
    """``12.5%`` (one decimal); ``n/a`` for None."""
    return "n/a" if fraction is None else f"{fraction * 100:.1f}%"


def format_change(change: float | None, before: float | None = None, after: float | None = None) -> str:
    """A relative change as ``check`` / ``diff`` print it in every format: signed (``+0.5%``, ``-12.5%``,
    ``0.0%``), two significant digits below 0.05% (``+0.012%``), ``+<0.001%`` below that; ``new`` for a
    figure that was 0 and is not (no ratio), else ``""`` when there is none. ``change`` is
    ``after / before - 1``."""
    if change is None:
        return "new" if before == 0 and after else ""
    pct = change * 100
    if pct != 0 and abs(pct) < 0.001:
        return ("+" if pct > 0 else "-") + "<0.001%"
    if pct != 0 and abs(pct) < 0.05:
        return f"{pct:+.2g}%"
    return ("+" if change > 0 else "") + format_percent(change)


def _sig3(v: float) -> str:
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def short_path(path: str | None) -> str:
    """``path`` for display, ``—`` for none. Report paths are already relative to the report root
    (the spec's folder; :mod:`stagetool.core.paths`), so this no longer depends on the working
    directory: the same report prints the same paths wherever it is run from."""
    return path if path else "—"


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a human size into bytes.

    ``KiB/MiB/GiB/TiB/PiB`` are binary (1 GiB = 2**30 bytes); ``KB/MB/GB/TB/PB`` are decimal
    (1 GB = 10**9 bytes), as in IEC 80000-13. Units are case-insensitive (``16gib`` works);
    ``B`` or no unit means bytes. Fractions are allowed and rounded down to whole bytes
    (``1.5GB`` = 1_500_000_000). An int is returned unchanged.

    Raises:
      UsageError: not a non-negative number followed by a known unit.
    """
    if isinstance(text, bool):
        raise UsageError(f"invalid size {text!r}", hint="write e.g. 16GiB, 512MB or 1.5GB")
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"invalid size {text}: negative", hint="sizes are >= 0 bytes")
        return text
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise UsageError(
            f"invalid size {text!r}: expected a number with an optional unit",
            hint="units: B, KB, MB, GB, TB, PB (powers of 1000) or KiB, MiB, GiB, TiB, PiB "
                 "(powers of 1024), e.g. 16GiB, 512MB, 1.5GB")
    if len(m.group(1)) > 40:  # no size has 40 digits; Decimal would take thousands, float() would not
        raise UsageError(f"invalid size: larger than {MAX_SIZE_BYTES} bytes (8 EiB)", hint="write e.g. 16GiB, 512MB or 1.5GB")
    try:
        value = Decimal(m.group(1)) * _UNITS[unit]
    except InvalidOperation:  # pragma: no cover - regex guarantees a number
        raise UsageError(f"invalid size {text!r}") from None
    if value > MAX_SIZE_BYTES:
        raise UsageError(f"invalid size {text!r}: larger than {MAX_SIZE_BYTES} bytes (8 EiB)",
                         hint="write e.g. 16GiB, 512MB or 1.5GB")
    return int(value.to_integral_value(rounding=ROUND_FLOOR))


MAX_SIZE_BYTES = 2**63
"""The largest size :func:`parse_size` takes (8 EiB): past it, byte counts no longer fit XLA's int64."""


MAX_TIMEOUT_S = 7 * 24 * 3600
"""The longest ``--timeout`` in seconds (a week): a longer one is no limit a run could reach, and the
clocks and waits it is added to overflow near 1e308."""


def timeout_seconds(value: float | None, option: str = "--timeout") -> float | None:
    """A ``--timeout`` in seconds, checked: None when none is given.

    ``inf`` and ``nan`` are refused alike (leave the option out for no limit), as is anything not
    above 0 or above :data:`MAX_TIMEOUT_S`.

    Raises:
      UsageError: naming ``option`` and the accepted range.
    """
    import math

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise UsageError(f"{option} {value}: give a number of seconds above 0 and at most {MAX_TIMEOUT_S} (a week)",
                         hint=f"leave {option} out for no limit")
    return float(value)
