"""``--explain`` patterns: which input leaves a pattern names. Light on purpose (no numpy, no JAX):
the plan compiles the patterns before anything is staged, and checks them against the input leaves'
key paths before anything is lowered."""

from __future__ import annotations

import dataclasses
import re


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
    from stagetool.core.errors import UsageError

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
    close matches."""
    import difflib

    problems = []
    for p in patterns:
        if not any(p.names(path) for path in paths):
            close = difflib.get_close_matches(p.text, paths, n=3, cutoff=0.4)
            problems.append(f"--explain {p.text!r} names no input leaf"
                            + (f"; close matches: {', '.join(close)}" if close else ""))
    return problems
