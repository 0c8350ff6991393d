"""Tolerances of the CI gate: how much a metric may grow before ``stagetool check`` fails.

Shared vocabulary: the spec's ``check:`` section, ``--tolerance`` options and the gate read them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from stagetool.core.errors import UsageError
from stagetool.core.units import parse_size


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How much a metric may grow before it is a regression.

    Attributes:
      fraction: allowed relative growth (``0.01`` for ``1%``), or None.
      absolute: allowed growth in the metric's unit (bytes, FLOPs, count), or None.
      text: as written (``"2%"``, ``"64KiB"``).

    Growth ``after - before`` is a regression when it exceeds both allowances
    (``max(fraction * before, absolute)``); a missing allowance counts as 0.
    """

    fraction: float | None = None
    absolute: float | None = None
    text: str = "0%"

    def allows(self, before: float, after: float) -> bool:
        """Whether growing from ``before`` to ``after`` stays within the tolerance."""
        growth = after - before
        if growth <= 0:
            return True
        limit = max((self.fraction or 0.0) * abs(before), self.absolute or 0.0)
        return growth <= limit


#: Tolerance names and what they govern.
TOLERANCE_KEYS = {
    "memory": "memory per device: argument, output, temp, peak and host peak bytes (alias bytes: shrinking)",
    "flops": "FLOPs and transcendentals per device",
    "bytes_accessed": "bytes accessed per device",
    "collective_bytes": "bytes per device moved by the collectives of one kind × mesh axes",
    "collective_count": "number of collectives of one kind × mesh axes",
    "step_time": "the step-time estimate per device (its schedule figure, seconds; an estimate)",
}

#: The documented defaults.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "memory": Tolerance(0.01, None, "1%"),
    "flops": Tolerance(0.01, None, "1%"),
    "bytes_accessed": Tolerance(0.01, None, "1%"),
    "collective_bytes": Tolerance(0.0, None, "0%"),
    "collective_count": Tolerance(0.0, None, "0"),
    "step_time": Tolerance(0.05, None, "5%"),
}

#: Minimum relative tolerance for memory and cost when the environments differ.
ENV_MISMATCH_FLOOR = 0.10

_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")


def parse_tolerance(value: Any) -> Tolerance:
    """Parse ``"2%"`` (relative growth), ``"64KiB"`` / ``"1.5GB"`` (absolute bytes) or a plain number
    (absolute, in the metric's unit).

    Raises:
      UsageError: anything else, or a negative value.
    """
    if isinstance(value, bool):
        raise UsageError(f"invalid tolerance {value!r}", hint="write e.g. 2% or 64KiB")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise UsageError(f"invalid tolerance {value!r}: must be a finite number >= 0")
        return Tolerance(None, float(value), str(value))
    text = str(value).strip()
    m = _PERCENT.match(text)
    if m:
        return Tolerance(float(m.group(1)) / 100.0, None, text.replace(" ", ""))
    try:
        return Tolerance(None, float(parse_size(text)), text)
    except UsageError:
        raise UsageError(f"invalid tolerance {text!r}: expected a percentage (2%) or an amount (64KiB, 1000)",
                         hint="e.g. --tolerance memory=2% --tolerance collective_bytes=64KiB") from None


def parse_tolerance_options(items: Iterable[str]) -> dict[str, Tolerance]:
    """Parse ``--tolerance NAME=VALUE`` options (later ones win).

    Raises:
      UsageError: no ``=``, an unknown name (listing the known ones), or a bad value.
    """
    out: dict[str, Tolerance] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise UsageError(f"--tolerance {item!r}: expected NAME=VALUE, e.g. memory=2%")
        out[check_tolerance_name(name, f"--tolerance {item!r}")] = parse_tolerance(value)
    return out


def check_tolerance_name(name: str, where: str) -> str:
    """Return ``name`` if it is a tolerance name; else raise :class:`UsageError` listing them."""
    if name not in TOLERANCE_KEYS:
        import difflib

        close = difflib.get_close_matches(name, list(TOLERANCE_KEYS), n=1)
        raise UsageError(f"{where}: unknown tolerance {name!r}; expected one of {', '.join(TOLERANCE_KEYS)}"
                         + (f" (did you mean {close[0]!r}?)" if close else ""))
    return name


def effective_tolerances(function: str, *, spec_check: Any = None,
                         cli: Mapping[str, Tolerance] | None = None) -> dict[str, Tolerance]:
    """Tolerances for one function: defaults, then the spec's ``check.tolerances``, then its
    ``check.functions.<name>.tolerances``, then ``--tolerance`` options (the last one wins).
    ``spec_check``: the spec's :class:`stagetool.spec.model.CheckSpec` (``tolerances`` and
    ``functions``), or None."""
    out = dict(DEFAULT_TOLERANCES)
    if spec_check is not None:
        out.update(spec_check.tolerances)
        out.update(spec_check.functions.get(function, {}))
    out.update(cli or {})
    return out
