"""The report model and its renderers: one pure model, one renderer per output format."""

from __future__ import annotations

import enum
from typing import Any, Callable


class Format(str, enum.Enum):
    """Output formats of every command."""

    text = "text"
    """Rich tables and highlighted module text on a terminal; plain text when piped or NO_COLOR."""
    json = "json"
    """The versioned JSON document (docs/json-schema.md)."""
    markdown = "markdown"
    """GitHub-flavoured Markdown tables."""
    html = "html"
    """One self-contained HTML page with pictures (device grids, memory, collectives, cost); no network."""


def renderer(fmt: Format) -> Callable[..., str]:
    """The ``render(doc, *, color, width) -> str`` function of a format (imports only that renderer)."""
    import importlib

    module = importlib.import_module(f"stagetool.report.render_{Format(fmt).value}")
    return module.render


def render(doc: Any, fmt: Format, *, color: bool = False, width: int = 120, fit: bool = False) -> str:
    """Render a :class:`~stagetool.report.model.Report` or ``DevicesReport`` in ``fmt``; ``fit``: text
    for a pipe or a file, every table cell whole (see ``render_text.render``)."""
    if Format(fmt) == Format.text:
        return renderer(fmt)(doc, color=color, width=width, fit=fit)
    return renderer(fmt)(doc, color=color, width=width)
