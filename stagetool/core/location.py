"""Where something is written: a file, line and column (of a spec node, a baseline entry)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Loc:
    """Where a spec node stands: file, 1-based line and column."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"
