"""Running the gate's functions: the record of a snapshot run.

``stagetool.pipeline.take_snapshot`` stages the functions (with ``--isolate``, each in a worker
process of its own: :mod:`stagetool.process.workers`); here is what it returns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagetool.spec.model import CheckSpec


@dataclasses.dataclass(frozen=True)
class SnapshotRun:
    """A snapshot taken now, and the functions that failed.

    Attributes:
      snapshot: the document (functions that failed are left out).
      failed: function name → error message (a compile error, or how its process died).
      functions: every function of the plan, in spec order.
      spec_path: the spec used.
      spec_check: the spec's ``check:`` section (tolerances), or None.
    """

    snapshot: dict
    failed: dict[str, str]
    functions: tuple[str, ...]
    spec_path: Path | None
    spec_check: CheckSpec | None = None


def spec_label(spec_path: Path | None) -> str | None:
    return None if spec_path is None else Path(spec_path).name


#: Seconds one function may take in an ``--isolate`` worker by default (a generous bound for a compile).
DEFAULT_TIMEOUT_S = 1800.0
