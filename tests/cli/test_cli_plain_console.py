"""Piped stderr is written without importing Rich (issue 11.4): the plain writer must print what
Rich's own console prints for the same markup, and the escape must be Rich's."""

from __future__ import annotations

import io
import sys

import pytest
from rich.console import Console
from rich.markup import escape

from stagetool.cli import output

CASES = ["plain", "a [b] c", "x[bold]y", "path\\[dim]", "end\\", "[data, null] @ P('x')", "f[64,2] [/] [red]r[/]",
         "\\[not]", "C:\\dir\\", "[[nested]]", "[#fff]", "[@click]"]


@pytest.mark.parametrize("text", CASES)
def test_escape_is_richs(text):
    assert output.escape(text) == escape(text)


@pytest.mark.parametrize("text", CASES)
def test_plain_console_prints_what_rich_prints(text, monkeypatch):
    # stagetool's messages: fixed markup around escaped text (raw text is never printed as markup)
    for markup in (f"[dim]wrote {output.escape(text)}[/]", f"[bold red]error:[/] {escape(text)}",
                   f"[yellow]notice:[/] {output.escape(text)} held [dim]x[/]"):
        expected = io.StringIO()
        Console(file=expected, highlight=False, soft_wrap=True, force_terminal=False).print(markup)
        got = io.StringIO()
        monkeypatch.setattr(sys, "stderr", got)
        output.PlainConsole().print(markup)
        monkeypatch.undo()
        assert got.getvalue() == expected.getvalue(), markup
