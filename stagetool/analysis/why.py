"""``stagetool why``'s answer: one function's leaves, collectives and sharding origins read for the
one question asked (a leaf, a source line, a collective; the question itself is checked when the
plan is made). Pure, no JAX.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from stagetool.analysis.causes import AxisOrigin
from stagetool.plan.selectors import WhyQuery
from stagetool.core.location import no_column, source_name

if TYPE_CHECKING:
    from stagetool.analysis.sections import CollectiveItem, CollectivesSection
    from stagetool.analysis.shardings import LeafReport

#: ``why --leaf``: where an input's declared sharding comes from, by its ``sharding_source`` (the words
#: the shardings table notes: ``from rule``, ``from init``, ``from the object``, ``sharding unknown``).
_DECLARED_BY = {"rule": "a rule", "spec": "the spec", "model": "the model's annotation", "init": "from the init",
                "object": "from the object", "target": "the target's in_shardings",
                "unknown": "nothing gives one: replicated", "compiler": "auto: the partitioner chooses"}


@dataclasses.dataclass(frozen=True)
class WhyAnswer:
    """``stagetool why``'s answer for one function.

    Attributes:
      question: ``leaf params/layers/wo``, ``line model.py:8``, ``collective 2``.
      found: what the question names, one line each (a leaf with its declared and compiled sharding;
        a constraint at the line; the collective).
      origins: where the sharding of what it names came from (for a collective: its operands' origins).
      reason: for a collective, why it is there (its cause's reason), else None.
      collectives: the collectives it leads to or belongs to, as ``(number, "kind over axes at line",
        reason)``.
      outputs: output leaves whose compiled sharding follows it.
      unavailable: why there is no answer (the explanation is unavailable for this function, or the
        question names nothing in it), else None. A leaf's ``found`` lines (its shardings, which need
        no explanation) are given even then.
      names_nothing: the question names nothing in this function (no such collective, leaf or
        line): with ``unavailable`` saying so, and ``close`` the nearest names it has.
      close: for ``names_nothing``, up to three of the function's own collective numbers, leaf
        paths or ``file:line`` places nearest to the question.
    """

    question: str
    found: tuple[str, ...] = ()
    origins: tuple[AxisOrigin, ...] = ()
    reason: str | None = None
    collectives: tuple[tuple[int, str, str], ...] = ()
    outputs: tuple[str, ...] = ()
    unavailable: str | None = None
    names_nothing: bool = False
    close: tuple[str, ...] = ()


def _same_file(where: str, wanted: str) -> bool:
    """Whether a report's file (``model.py``, ``src/model.py``, an absolute path) is the file a
    ``--line`` names: by name when the question gives a bare name, else by its whole path (an
    absolute question) or the end of it (``src/model.py``)."""
    if "/" not in wanted:
        return Path(where).name == wanted
    a, b = Path(os.path.normpath(where)), Path(os.path.normpath(wanted))
    if b.is_absolute():
        return (a if a.is_absolute() else Path.cwd() / a) == b
    return len(a.parts) >= len(b.parts) and a.parts[-len(b.parts):] == b.parts


def _close(wanted: str, names: Sequence[str]) -> tuple[str, ...]:
    import difflib

    unique = list(dict.fromkeys(names))
    return tuple(difflib.get_close_matches(wanted, unique, n=3, cutoff=0.4) or unique[:3])


def _collective_line(i: int, item: CollectiveItem) -> tuple[int, str, str]:
    c = item.collective
    axes = " × ".join(c.mesh_axes) if c.mesh_axes else "no mesh axis" if c.mesh_axes is None else "one device"
    at = f" at {source_name(item.source)}" if item.source else ""
    return (i, f"{c.kind} over {axes}{at}", item.cause.reason if item.cause else "")


def _leaf_lines(query: WhyQuery, inputs: Sequence[LeafReport], outputs: Sequence[LeafReport]) -> tuple[str, ...]:
    """One line per input and output leaf the question names: its declared sharding and where it came
    from, its compiled sharding (an argument on its own mesh of the staged devices: its PartitionSpec
    over that mesh, and which mesh, as the sharding's text names it)."""
    found = []
    for x in inputs:
        if query.leaf.names(x.path):
            how = _DECLARED_BY.get(x.sharding_source or "", "not given: replicated")
            where = f" at {source_name(no_column(x.source))}" if x.source and x.sharding_source != "compiler" else ""
            found.append(f"input {x.path}: declared {x.declared} ({how}{where}); compiled "
                         f"{x.compiled if x.compiled is not None else 'unused (pruned)'}")
    found += [f"output {x.path}: compiled {x.compiled}" for x in outputs if query.leaf.names(x.path)]
    return tuple(found)


def answer_why(query: WhyQuery, inputs: Sequence[LeafReport], outputs: Sequence[LeafReport],
               section: CollectivesSection | None) -> WhyAnswer:
    """Answer ``stagetool why`` from one function's leaves and collectives section (its items' causes
    and :class:`ShardingOrigins`); pure, no JAX.

    * a leaf: its declared sharding and where it came from (the spec line, rule or model annotation),
      its compiled sharding (for an ``auto`` leaf, what the partitioner followed), and downstream: the
      collectives whose causes name it and the outputs whose sharding follows it;
    * a line: the sharding constraints written there (and what they cause), and the collectives that
      belong to ops of that line;
    * a collective (by number): its op, line, reason and the origins of its operands' shardings.
    """
    question = f"{query.kind} {query.text}"
    if section is None:
        return WhyAnswer(question, unavailable="no collectives section")
    if section.causes_unavailable:
        if query.kind == "leaf":  # the leaf's own shardings need no propagation: said, then why the rest is not
            named = [x for x in (*inputs, *outputs) if query.leaf.names(x.path)]
            if named:
                return WhyAnswer(question, _leaf_lines(query, inputs, outputs),
                                 unavailable="what it causes and where its sharding goes: "
                                             + section.causes_unavailable)
        return WhyAnswer(question, unavailable=section.causes_unavailable)
    items = list(section.items)
    origins = section.origins
    numbered = list(enumerate(items, start=1))
    if query.kind == "collective":
        if query.number > len(items):
            return WhyAnswer(question, unavailable=f"the program has {len(items)} collective(s); there is no "
                                                   f"collective {query.number}", names_nothing=True,
                             close=tuple(str(n) for n in range(1, len(items) + 1))[-3:])
        item = items[query.number - 1]
        cause = item.cause
        found = [_collective_line(query.number, item)[1]]
        if cause is None:
            return WhyAnswer(question, tuple(found), unavailable="its metadata names no op of the program")
        found.append(f"op {cause.op} at {source_name(cause.line)}" if cause.line else f"op {cause.op}")
        found += [f"operand {t.name}: {t.sharding}" for t in cause.operands]
        if cause.result is not None:
            found.append(f"result: {cause.result.sharding}")
        seen, all_origins = set(), []
        for t in (*cause.operands, *((cause.result,) if cause.result else ())):
            for o in t.origins:
                if (o.key, o.label) not in seen:
                    seen.add((o.key, o.label))
                    all_origins.append(o)
        return WhyAnswer(question, tuple(found), tuple(all_origins), cause.reason)
    if query.kind == "leaf":
        chosen = [(i, x) for i, x in enumerate(inputs) if query.leaf.names(x.path)]
        outs = [(i, x) for i, x in enumerate(outputs) if query.leaf.names(x.path)]
        if not chosen and not outs:
            return WhyAnswer(question, unavailable=f"no input or output leaf is named {query.text!r}", names_nothing=True,
                             close=_close(query.text, [x.path for x in (*inputs, *outputs)]))
        found, leaf_origins = list(_leaf_lines(query, inputs, outputs)), []
        labels = {f"input {x.path}" for _, x in chosen}
        for i, x in chosen:
            if origins is not None and i < len(origins.inputs) and x.sharding_source == "compiler":
                leaf_origins += [o for o in origins.inputs[i] if o.label != f"input {x.path}"]
        for i, x in outs:
            if origins is not None and i < len(origins.outputs):
                leaf_origins += list(origins.outputs[i])
        caused = tuple(_collective_line(n, it) for n, it in numbered
                       if it.cause is not None and labels & {o.label for o in it.cause.origins})
        follow = tuple(outputs[i].path for i in range(len(outputs))
                       if origins is not None and i < len(origins.outputs)
                       and labels & {o.label for o in origins.outputs[i]})
        return WhyAnswer(question, tuple(found), tuple(leaf_origins), None, caused, follow)
    # a source line
    here = lambda line: line is not None and ":" in line and _same_file(line.rsplit(":", 1)[0], query.file) \
        and line.rsplit(":", 1)[1] == str(query.line)  # noqa: E731
    found, labels = [], set()
    for c in (origins.constraints if origins is not None else ()):
        through = [v for v in c.via or () if here(v)]  # a thin wrapper it was reached through (causes.constraint_place)
        if here(c.line) or through:
            text = f"sharding constraint {c.sharding} at {source_name(c.line)}" + (
                f" (through {', '.join(source_name(v) for v in c.via)})" if c.via else "")
            if text not in found:
                found.append(text)
            labels.add(f"constraint {source_name(c.line)}")
    belong = [(n, it) for n, it in numbered
              if here(it.source) or (it.cause is not None and here(it.cause.line))]
    caused = [(n, it) for n, it in numbered if it.cause is not None and labels & {o.label for o in it.cause.origins}]
    listed = {n for n, _ in belong}
    rows = tuple(_collective_line(n, it) for n, it in belong + [x for x in caused if x[0] not in listed])
    follow = tuple(outputs[i].path for i in range(len(outputs))
                   if origins is not None and i < len(origins.outputs) and labels & {o.label for o in origins.outputs[i]})
    if not found and not rows:
        places = [c.line for c in (origins.constraints if origins is not None else ()) if c.line]
        places += [p for _, it in numbered for p in (it.source, it.cause.line if it.cause else None) if p]
        return WhyAnswer(question, unavailable=f"nothing at {query.file}:{query.line}: no sharding constraint is "
                                               "written there and no collective belongs to it", names_nothing=True,
                         close=_close(f"{query.file}:{query.line}", [source_name(p) for p in places]))
    return WhyAnswer(question, tuple(found), (), None, rows, follow)
