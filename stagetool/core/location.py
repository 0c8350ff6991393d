"""Where something is written: a file, line and column (of a spec node, a baseline entry)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Loc:
    """Where a spec node stands: file, 1-based line and column."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


def source_name(source: str | None) -> str | None:
    """``/abs/path/model.py:6`` → ``model.py:6`` (the file name and what follows)."""
    return Path(source).name if source else source


def no_column(source: str | None) -> str | None:
    """``spec.yaml:14:9`` → ``spec.yaml:14``."""
    if source and re.search(r":\d+:\d+$", source):
        return source.rsplit(":", 1)[0]
    return source
