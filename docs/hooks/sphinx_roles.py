"""An MkDocs hook: the docstrings' Sphinx roles (``:class:`Report```, ``:func:`inspect```) render as
plain code in the API reference, as mkdocstrings leaves the role's name in front of the code."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    """The page's HTML with every ``:role:`` before a ``<code>`` span removed."""
    return _ROLE.sub("", html)
