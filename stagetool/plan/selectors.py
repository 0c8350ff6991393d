"""The selectors a plan compiles before anything is staged: ``--explain`` patterns
(:class:`LeafPattern`: which input leaves a pattern names) and ``stagetool why``'s one question
(:class:`WhyQuery`). Light on purpose (no numpy, no JAX): they are checked against the input
leaves' key paths before anything is lowered, and the analysis answers them
(:func:`stagetool.analysis.sections.collectives_section`, :func:`stagetool.analysis.causes.answer_why`)."""

from __future__ import annotations

import dataclasses
import re

from stagetool.core.errors import UsageError


@dataclasses.dataclass(frozen=True)
class LeafPattern:
    """One ``--explain`` pattern, compiled: a regular expression that names an input leaf when it
    matches the whole key path or a ``/``-suffix of it (``wq`` names ``params/layers/wq``,
    ``w[12]`` names ``params/w1`` and ``params/w2``), with or without the ``/value`` that ends every
    Flax NNX and Linen variable's path (``up/kernel`` names ``model/mlp/up/kernel/value``).

    Attributes:
      text: the pattern as given (for messages).
      regex: ``(?:.*/)?(?:TEXT)(?:/value)?``, matched with ``fullmatch`` against a key path.
    """

    text: str
    regex: re.Pattern

    def names(self, path: str) -> bool:
        return self.regex.fullmatch(path) is not None


def leaf_patterns(texts: tuple[str, ...]) -> tuple[LeafPattern, ...]:
    """Compile ``--explain`` patterns (see :class:`LeafPattern`).

    Raises:
      UsageError: one message for every pattern that is not a valid regular expression.
    """
    from stagetool.core.patterns import backtracking_risk

    out, bad = [], []
    for text in texts:
        risk = backtracking_risk(text)
        if risk is not None:
            bad.append(f"--explain {text[:60]!r}: {risk}; write a flatter pattern")
            continue
        try:
            re.compile(text)  # the error's position in the text as given
            out.append(LeafPattern(text, re.compile(f"(?:.*/)?(?:{text.lstrip('/')})(?:/value)?")))
        except re.error as e:
            bad.append(f"--explain {text!r} is a bad regular expression: {e}")
        except (RecursionError, OverflowError, MemoryError):  # Python's regex compiler recurses per group
            bad.append(f"--explain {text[:40]!r}…: the regular expression is nested too deeply or too large to compile")
    if bad:
        raise UsageError("; ".join(bad), hint="give a leaf path as 'stagetool shardings' lists it, its last part "
                                              "(wq), or a regular expression over them (w[12], layers/.*/wq)")
    return tuple(out)


def unmatched_leaf_patterns(patterns: tuple[LeafPattern, ...], paths: list[str]) -> list[str]:
    """A message for each pattern that names none of ``paths`` (key paths of input leaves), with
    close matches; for a module's name (``q_proj``, the leaves being ``.../q_proj/w/value``), the
    leaves under it and the pattern that names them all (``q_proj/.*``)."""
    import difflib

    problems = []
    for p in patterns:
        if not any(p.names(path) for path in paths):
            text = p.text.strip("/")
            under = list(dict.fromkeys(path for path in paths if f"/{text}/" in f"/{path}")) \
                if re.fullmatch(r"[\w./-]+", text) else []  # an NNX argument's leaf is an input and an output
            if under:
                shown = ", ".join(under[:3]) + (f" and {len(under) - 3} more" if len(under) > 3 else "")
                problems.append(f"--explain {p.text!r} names no input leaf; it is a module (a subtree): "
                                f"'{text}/.*' names its {len(under)} {'leaf' if len(under) == 1 else 'leaves'} ({shown})")
                continue
            close = difflib.get_close_matches(p.text, paths, n=3, cutoff=0.4)
            problems.append(f"--explain {p.text!r} names no input leaf"
                            + (f"; close matches: {', '.join(close)}" if close else ""))
    return problems


# ---- `stagetool why`: one leaf, one source line or one collective


@dataclasses.dataclass(frozen=True)
class WhyQuery:
    """What ``stagetool why`` is asked about, checked before anything is staged.

    Attributes:
      kind: ``leaf``, ``line`` or ``collective``.
      text: the question as given (``w2``, ``model.py:8``, ``2``).
      leaf: for a leaf, the pattern naming it (:class:`LeafPattern`).
      file / line: for a line, the file as given and the 1-based line. A bare name (``model.py``)
        matches that file in any folder; a path with a folder (``src/model.py``, ``/abs/model.py``)
        matches only a file whose path ends with it (an absolute one: that file).
      number: for a collective, its number in module order (1-based, as the "why" list numbers it).
    """

    kind: str
    text: str
    leaf: LeafPattern | None = None
    file: str | None = None
    line: int | None = None
    number: int | None = None


def why_query(leaf: str | None = None, line: str | None = None, collective: int | None = None) -> WhyQuery:
    """The one question of ``stagetool why`` (``--leaf``, ``--line`` or ``--collective``).

    Raises:
      UsageError: none or several given, a bad leaf pattern, a line that is not ``FILE:LINE``, a
        collective number below 1.
    """
    given = [(k, v) for k, v in (("--leaf", leaf), ("--line", line), ("--collective", collective)) if v is not None]
    if len(given) != 1:
        raise UsageError("stagetool why answers one question: give exactly one of --leaf, --line, --collective"
                         + (f" (got {', '.join(k for k, _ in given)})" if given else ""),
                         hint="e.g. stagetool why --leaf wq, --line model.py:8, or --collective 2")
    if leaf is not None:
        try:
            (pattern,) = leaf_patterns((leaf,))
        except UsageError as e:
            raise UsageError(e.message.replace("--explain", "--leaf"), hint=e.hint) from None
        return WhyQuery("leaf", leaf, leaf=pattern)
    if line is not None:
        m = re.fullmatch(r"(.+):(\d+)", line.strip())
        if m is None or int(m.group(2)) < 1:
            raise UsageError(f"--line {line!r}: give a source line as FILE:LINE, e.g. model.py:8",
                             hint="the file name is enough; its folder is not compared")
        return WhyQuery("line", line, file=m.group(1).strip(), line=int(m.group(2)))
    if collective < 1:
        raise UsageError(f"--collective {collective}: collectives are numbered from 1, as 'stagetool collectives' "
                         "lists them under 'why each collective is there'")
    return WhyQuery("collective", str(collective), number=collective)
