"""Text from specs, baselines and user code made safe for a terminal.

Names come from files stagetool did not write (a spec's function and axis names, a baseline's
keys, an exception message from user code). Printed raw, an escape sequence in one of them could
rewrite the terminal; printed through Rich, ``[bold]`` in one of them would be taken as markup.
"""

from __future__ import annotations

import os
import re
from typing import Any

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


# What Markdown (GitHub's) would read as syntax in text from names and messages: a backslash, code
# spans, emphasis (``_`` only where it is not inside a word: GFM ignores intraword underscores),
# links and images, table cells, strikethrough, mentions, issue references; an HTML tag or comment
# (``<`` before a letter, ``/``, ``!`` or ``?``) and an entity (``&name;``, ``&#1;``).
_MARKDOWN_SPECIAL = re.compile(r"[\\`*\[\]|~@#]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])|<(?=[A-Za-z/!?])|&(?=#?\w+;)")
_MARKDOWN_ENTITY = {"<": "&lt;", "&": "&amp;"}


def markdown_safe(text: object) -> str:
    """Text from a name or a message for GitHub-flavoured Markdown, shown as written and never read
    as Markdown or HTML: :func:`printable` on one line; ``<`` that could open a tag and ``&`` that
    could start an entity as entities; Markdown's punctuation backslash-escaped (no link, image,
    emphasis, code span or table cell break; no ``@mention`` or ``#123`` reference); and ``://`` /
    ``www.`` broken with a word joiner (U+2060) so that GitHub does not turn a URL into a link.
    Ordinary text (``train_step``, ``+<0.1%``, ``a -> b``) is left as it is."""
    s = printable(text, newlines=False)
    s = _MARKDOWN_SPECIAL.sub(lambda m: _MARKDOWN_ENTITY.get(m.group(0), "\\" + m.group(0)), s)
    return s.replace("://", ":\u2060//").replace("www.", "www\u2060.")


class MarkdownText(str):
    """Text that is already Markdown (made by :func:`markdown_code`, or by a renderer): a table cell
    holding it is not escaped again."""


def markdown_code(text: object) -> MarkdownText:
    """``text`` as one code span (shown as written, never HTML or a link): its fence one backtick
    longer than any run of backticks inside, so that a name cannot close it early; ``|`` escaped
    (GFM reads it as a cell break even in a code span); on one line, control characters escaped."""
    t = printable(text, newlines=False)
    fence = "`" * (max((len(r) for r in re.findall("`+", t)), default=0) + 1)
    pad = " " if t.startswith("`") or t.endswith("`") else ""
    return MarkdownText(f"{fence}{pad}{t}{pad}{fence}".replace("|", "\\|"))


_VIEW_SPAN = re.compile(r"(?<![\w`])`([A-Za-z_][A-Za-z0-9_]*|<axis>)`(?![\w`])")
"""A span stagetool's views make: a mesh axis name (an ASCII identifier, checked where the mesh is
read) in single backticks, not touching a word or another backtick."""


def markdown_text(text: object) -> str:
    """:func:`markdown_safe`, except that the `` `axis` `` spans stagetool's views make ("split over
    `model`") stay code spans, rebuilt with :func:`markdown_code`. Only a mesh axis name in its own
    backticks is such a span: backticks in a user's name (a leaf path ``p/b`x```) are escaped like
    any other character, so that they open no code span."""
    parts = _VIEW_SPAN.split(printable(text, newlines=False))
    return "".join(markdown_code(p) if i % 2 else markdown_safe(p) for i, p in enumerate(parts))


def markup_safe(text: object) -> str:
    """:func:`printable` and Rich's markup escape: for text interpolated into a Rich markup string."""
    from rich.markup import escape

    return escape(printable(text))


def sanitized(obj: Any) -> Any:
    """``obj`` with every string in it, dict keys too, made :func:`printable`
    (:func:`stagetool.core.codec.map_strings`: records, lists, tuples and dicts are copied where
    something changed; other values are returned as they are).

    For a document about to be rendered for a terminal or a pull request (text, Markdown, JUnit):
    names from specs, baselines and user code reach every renderer already escaped.
    """
    from stagetool.core.codec import map_strings

    return map_strings(obj, printable, keys=True)


def file_tail(path: str | os.PathLike, lines: int, *, window: int = 16384) -> list[str]:
    """The last ``lines`` non-empty lines of the file at ``path`` (a child process's stderr), each
    :func:`printable` on one line and stripped on the right; only the last ``window`` bytes are read.
    ``[]`` when the file cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - window))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [printable(ln.rstrip(), newlines=False) for ln in text.splitlines() if ln.strip()][-lines:]


def clipped(text: str, n: int = 40) -> str:
    """``repr(text)``, cut to ``n`` characters with the whole length said: an option or name of
    thousands of characters (a count of 5,000 digits) is not echoed whole in a message."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"… ({len(text)} characters)"
