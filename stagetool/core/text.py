"""Text from specs, baselines and user code made safe for a terminal.

Names come from files stagetool did not write (a spec's function and axis names, a baseline's
keys, an exception message from user code). Printed raw, an escape sequence in one of them could
rewrite the terminal; printed through Rich, ``[bold]`` in one of them would be taken as markup.
"""

from __future__ import annotations

import re

# C0 controls except tab and newline, DEL, C1 controls, and the Unicode line/paragraph separators and
# bidirectional overrides that reorder what a reader sees.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape_char(m: re.Match) -> str:
    c = m.group(0)
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, *, newlines: bool = True) -> str:
    """``str(text)`` with control characters shown as escapes (ESC as ``\\x1b``).

    Tabs are kept; newlines too unless ``newlines`` is False (a name on one line).
    """
    s = _CONTROL.sub(_escape_char, str(text))
    if not newlines:
        s = s.replace("\n", "\\n").replace("\t", "\\t")
    return s


def markup_safe(text: object) -> str:
    """:func:`printable` and Rich's markup escape: for text interpolated into a Rich markup string."""
    from rich.markup import escape

    return escape(printable(text))
