"""A complexity bound on the regular expressions a spec or an option gives (rules, ``--explain``).

Python's ``re`` backtracks, and a pattern with a repeated group that itself repeats — ``(.*a){20}$``,
``(\\w+)*$`` — can take exponential time on a name it does not match; the matcher holds the
interpreter lock all that time, so not even a signal handler runs. Such patterns are refused before
they are used (:func:`backtracking_risk`): a group repeated more than once (``*``, ``+``, ``{n,}``,
``{n,m}`` with m > 1) may not contain an unbounded repeat (``*``, ``+``, ``{n,}``) or a repeat of
its own, or alternatives that can match the same text (``(a|ab)*``). A flat pattern
(``.*/(wq|wk|wv)$``, ``layers_\\d+/.*``, ``(wq|wk)+``) is never refused. Back-references
are refused too (matching with them is NP-hard). A reading of the pattern's text, cautious rather
than complete; a run stuck all the same is still ended by a signal (the supervisor kills it,
:data:`stagetool.process.supervise.ESCALATE_S` after the signal).
"""

from __future__ import annotations

__all__ = ["backtracking_risk"]


def _quantifier(pattern: str, i: int) -> tuple[int, bool, bool]:
    """The quantifier at ``pattern[i:]``: (its length, whether it repeats more than once, whether it is unbounded)."""
    if i >= len(pattern):
        return 0, False, False
    c = pattern[i]
    n = 0
    if c in "*+":
        n, repeats, unbounded = 1, True, True
    elif c == "?":
        n, repeats, unbounded = 1, False, False
    elif c == "{":
        j = pattern.find("}", i)
        body = pattern[i + 1:j] if j > 0 else ""
        lo, comma, hi = body.partition(",")
        if j < 0 or not (lo.strip().isdigit() or (comma and not lo.strip())) or (hi.strip() and not hi.strip().isdigit()):
            return 0, False, False  # a literal '{'
        n = j - i + 1
        unbounded = bool(comma) and not hi.strip()
        top = None if unbounded else int(hi if comma else lo)
        repeats = unbounded or (top is not None and top > 1)
    else:
        return 0, False, False
    if i + n < len(pattern) and pattern[i + n] in "?+":  # lazy or possessive: same repeat
        n += 1
    return n, repeats, unbounded


_WIDE = (".", "\\w", "\\W", "\\s", "\\S", "\\d", "\\D", "[", "(")


def _alternatives(body: str) -> list[str]:
    """A group's body split at its own ``|`` (not those inside classes, escapes or inner groups);
    a ``?:``/``?P<name>`` prefix dropped."""
    if body.startswith("?:"):
        body = body[2:]
    elif body.startswith("?P<") and ">" in body:
        body = body[body.index(">") + 1:]
    parts, depth, i, last = [], 0, 0, 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            j = i + 1
            if j < len(body) and body[j] == "^":
                j += 1
            if j < len(body) and body[j] == "]":
                j += 1
            while j < len(body) and body[j] != "]":
                j += 2 if body[j] == "\\" else 1
            i = j + 1
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(body[last:i])
            last = i + 1
        i += 1
    return parts + [body[last:]]


def _overlapping(body: str) -> bool:
    """Whether a group's alternatives may match the same text (so that a repeat of the group can
    split a name in exponentially many ways): two equal, one a prefix of another, one empty, or one
    that starts with a class, a wildcard or a group. A cautious reading of the text: ``(wq|wk)`` is
    fine, ``(a|ab)``, ``(.|a)`` and ``(\\w|\\d)`` are not."""
    alts = _alternatives(body)
    if len(alts) < 2:
        return False
    if any(not a or a.startswith(_WIDE) for a in alts):
        return True
    return any(i != j and b.startswith(a) for i, a in enumerate(alts) for j, b in enumerate(alts))


def backtracking_risk(pattern: str) -> str | None:
    """Why ``pattern`` may take exponential time to match, or None: a repeated group that holds a
    quantifier (``?`` included) or alternatives that may match the same text, at any depth; a
    back-reference. A scan of the pattern's text: character classes and escapes are skipped whole;
    it does not compile anything."""
    # per open group: (whether it holds a quantifier, whether it holds overlapping alternatives)
    stack: list[list[bool]] = [[False, False]]
    starts: list[int] = []
    i = 0
    n = len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 < n and (pattern[i + 1] in "123456789" or pattern[i + 1:i + 3] == "g<"):
                return f"the back-reference at {i} can take exponential time"
            i += 2
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
        elif c == "(":
            if pattern.startswith("(?P=", i):
                return f"the back-reference at {i} can take exponential time"
            stack.append([False, False])
            starts.append(i)
            i += 1
            continue
        elif c == ")":
            quantified, overlapping = stack.pop() if len(stack) > 1 else (False, False)
            start = starts.pop() if starts else 0
            overlapping = overlapping or _overlapping(pattern[start + 1:i])
            length, repeats, _unbounded = _quantifier(pattern, i + 1)
            group = pattern[start:i + 1 + length]
            if repeats and quantified:
                return (f"the group {group[:60]!r} repeats and holds a quantifier of its own: on a name it does not "
                        "match it can take exponential time (catastrophic backtracking)")
            if repeats and overlapping:
                return (f"the group {group[:60]!r} repeats and holds alternatives that can match the same text: on a "
                        "name it does not match it can take exponential time (catastrophic backtracking)")
            stack[-1][0] = stack[-1][0] or quantified or length > 0
            stack[-1][1] = stack[-1][1] or overlapping
            i += 1 + length
            continue
        else:
            i += 1
        length, _repeats, _unbounded = _quantifier(pattern, i)
        if length:
            stack[-1][0] = True
            i += length
    return None
