"""The caller chain of a thin helper's line, shared by the collectives table and the step time's
longest instructions: ``layers.py:12 ← model.py:88`` rather than the helper's line alone.

A *thin helper* is a user line that the function's instructions reach from two or more different
user lines (a one-line ``einsum`` wrapper every projection calls): its line alone does not say which
part of the model an instruction belongs to, so the lines it was called from are shown after it,
outward, up to the first that is not itself a helper (the model's line).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from stagetool.core.paths import is_library_file
from stagetool.hlo.parser import SourceFrame


def user_frames(chain: Iterable[SourceFrame], library: tuple[str, ...]) -> tuple[str, ...]:
    """``file:line`` of every frame of a source chain (innermost first) in the user's code: not a
    library's (:func:`stagetool.core.paths.is_library_file` over ``library``, the folders of
    :func:`~stagetool.core.paths.library_dirs`)."""
    return tuple(f"{frame.file}:{frame.line}" for frame in chain if not is_library_file(frame.file, library))


def user_source(chain: Sequence[SourceFrame], library: tuple[str, ...] | None = None) -> str | None:
    """``file:line`` a row names for an instruction of source chain ``chain`` (innermost first): its
    innermost frame in the user's code (:func:`user_frames`: the model's line that called Flax's
    ``nnx.Linear``, not ``linear.py``'s), else its innermost frame; None for no chain. ``library``:
    :func:`~stagetool.core.paths.library_dirs` (looked up when not given)."""
    if not chain:
        return None
    if library is None:
        from stagetool.core.paths import library_dirs

        library = library_dirs()
    mine = user_frames(chain, library)
    return mine[0] if mine else f"{chain[0].file}:{chain[0].line}"


def helper_callers(sources: Sequence[str | None], chains: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """For each ``(source, chain)`` (a row's ``file:line`` and its user frames, innermost first), the
    lines its source was called from when the source is a thin helper (see the module docstring),
    outward up to the first that is not a helper; () otherwise. Helpers are found over all ``chains``."""
    callers: dict[str, set[str]] = {}
    for chain in chains:
        for inner, outer in zip(chain, chain[1:]):
            callers.setdefault(inner, set()).add(outer)
    helpers = {line for line, outs in callers.items() if len(outs) >= 2}
    out = []
    for source, chain in zip(sources, chains):
        if not chain or source != chain[0] or chain[0] not in helpers:
            out.append(())
            continue
        via = []
        for line in chain[1:]:
            via.append(line)
            if line not in helpers:
                break
        out.append(tuple(via))
    return out
