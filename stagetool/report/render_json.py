"""The JSON renderer: the report model as a versioned JSON document (see docs/json-schema.md)."""

from __future__ import annotations

from stagetool.report.model import DevicesReport, Report, document_to_json


def render(doc: Report | DevicesReport, *, color: bool = False, width: int = 120) -> str:
    """JSON text with ``schema_version`` and ``kind`` first; ``color`` and ``width`` are ignored."""
    del color, width
    return document_to_json(doc)
