"""``--against TARGET``: the same program staged for a compile-only target too (one more compile),
and every difference between the two compiles marked, from the second compile, not from rules.

:func:`compare` takes one function's sections from both stagings (this run's, usually simulated CPU
devices, and the target's) and returns an :class:`AgainstSection`: each collective (grouped by kind,
mesh axes and source line), the temporaries and the peak (and what is live at the peak by source
line, where both runs found the peak's buffers), the FLOPs per device and each replicated-work row
that exists on one side only or differs. Where a CPU rule of :mod:`stagetool.analysis.cpu_artefacts`
marked a collective (widened, hoisted, sunk, ragged_dot's dense dots), the second compile checks the
rule: :attr:`AgainstSection.rules` says whether it agrees, and where it does not, the row's rule
mark is dropped (the compile wins; :func:`marked_collectives`). Pure: no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from stagetool.analysis.sections import CollectiveItem, CollectivesSection, CostSection, MemorySection
from stagetool.core.units import format_bytes

__all__ = ["AgainstSection", "Difference", "RuleCheck", "compare", "marked_collectives"]


@dataclasses.dataclass(frozen=True)
class Difference:
    """One row that exists on one side only or differs between the two compiles.

    Attributes:
      what: ``collective``, ``temporaries``, ``peak``, ``live at the peak``, ``FLOPs`` or ``replicated work``.
      key: which one: ``all-gather over model at m.py:3`` (a collective group), ``m.py:5`` (a source
        line's buffers at the peak), ``dot at m.py:9 over data`` (replicated work), or the figure's name.
      here / there: this run's and the target's figure as shown (``2 × 32.0 MiB per step``), or None
        where the row is absent on that side.
      here_value / there_value: the number compared (bytes per device per step, FLOPs per device),
        None where absent or unknown.
      status: ``only here`` (this run's compile alone has it), ``only there`` (the target's alone),
        or ``differs``.
    """

    what: str
    key: str
    here: str | None
    there: str | None
    here_value: float | None
    there_value: float | None
    status: str


@dataclasses.dataclass(frozen=True)
class RuleCheck:
    """A CPU rule's mark on a collective row, checked against the target's compile.

    Attributes:
      key: the collective group (:attr:`Difference.key`).
      rule: the mark (``f32 on CPU: bf16 in the program``, the row's ``cpu_only`` text).
      agrees: whether the target's compile shows what the rule says it would.
      shows: what the target's compile shows there (``1 × 1.00 MiB per step``, ``none``).
    """

    key: str
    rule: str
    agrees: bool
    shows: str


@dataclasses.dataclass(frozen=True)
class AgainstSection:
    """``--against``: this run's compile beside a compile-only target's.

    Attributes:
      target: the target (``v5e:2x4``); compiler: its compiler (``XLA:TPU``); here: this run's (``XLA:CPU``).
      differences: every row on one side only or differing, collectives first, in this run's order
        then the target's.
      compared: what was compared, each with how many were equal (``collectives: 3 groups, 2 equal``).
      rules: each CPU rule mark checked against the target's compile (:class:`RuleCheck`).
      error: why the target's staging failed (its message), or None; then nothing is compared.
    """

    target: str
    compiler: str
    here: str
    differences: tuple[Difference, ...] = ()
    compared: tuple[str, ...] = ()
    rules: tuple[RuleCheck, ...] = ()
    error: str | None = None


def _line(source: str | None) -> str:
    """``m.py:3:7`` → ``m.py:3``; None → ``—``."""
    if not source:
        return "—"
    parts = source.split(":")
    if len(parts) >= 3 and parts[-1].isdigit() and parts[-2].isdigit():
        return ":".join(parts[:-1])
    return source


def collective_key(item: CollectiveItem) -> str:
    """The group a collective is compared in: kind, mesh axes, source line (``all-gather over model at m.py:3``)."""
    x = item.collective
    axes = ",".join(x.mesh_axes) if x.mesh_axes else "?"
    return f"{x.kind} over {axes} at {_line(item.source)}"


@dataclasses.dataclass
class _Group:
    count: int = 0
    bytes_each: int = 0
    bytes_step: int = 0
    unknown: bool = False
    runs: list = dataclasses.field(default_factory=list)
    types: list = dataclasses.field(default_factory=list)

    def add(self, item: CollectiveItem) -> None:
        x = item.collective
        self.count += 1
        self.runs.append(x.executions)
        self.types.extend(x.result_types)
        if x.bytes_per_device is None or x.executed_bytes_per_device is None:
            self.unknown = True
        else:
            self.bytes_each += x.bytes_per_device
            self.bytes_step += x.executed_bytes_per_device

    def shown(self) -> str:
        counts: dict[str, int] = {}
        for r in self.runs:
            counts["?" if r is None else str(r)] = counts.get("?" if r is None else str(r), 0) + 1
        runs = ", ".join(r if len(counts) == 1 or n == 1 else f"{r} ({n} of them)" for r, n in counts.items())
        runs += " each" if self.count > 1 and len(counts) == 1 else ""
        types = ", ".join(dict.fromkeys(self.types)) if len(set(self.types)) <= 2 else \
            f"{self.types[0]} +{len(set(self.types)) - 1} more"
        per_step = "?" if self.unknown else format_bytes(self.bytes_step)
        return f"{self.count} × {types}, runs {runs}: {per_step} per step"

    def same(self, other: _Group) -> bool:
        return (self.count, self.bytes_step, self.unknown, sorted(map(str, self.runs))) == \
            (other.count, other.bytes_step, other.unknown, sorted(map(str, other.runs)))


def _groups(items: Iterable[CollectiveItem]) -> dict[str, _Group]:
    out: dict[str, _Group] = {}
    for item in items:
        out.setdefault(collective_key(item), _Group()).add(item)
    return out


def _pair_moved(here: dict[str, _Group], there: dict[str, _Group]) -> dict[str, str]:
    """Groups on one side only whose kind and mesh axes match exactly one group on the other side
    only: the same collective at another source line (XLA:TPU's all-reduce of a loop's sum, hoisted
    after the loop, carries the loop's line). ``{this run's key: the target's key}``."""
    def kind_axes(key: str) -> str:
        return key.rsplit(" at ", 1)[0]

    lonely_here = [k for k in here if k not in there]
    lonely_there = [k for k in there if k not in here]
    out = {}
    for k in lonely_here:
        mine = [o for o in lonely_here if kind_axes(o) == kind_axes(k)]
        theirs = [o for o in lonely_there if kind_axes(o) == kind_axes(k)]
        if len(mine) == 1 and len(theirs) == 1:
            out[k] = theirs[0]
    return out


def _rule_of(item: CollectiveItem) -> str | None:
    if item.cpu_only:
        return item.cpu_only
    if item.widened_from:
        return f"f32 on CPU: {item.widened_from} in the program"
    return None


def _rule_agrees(item: CollectiveItem, here: _Group, there: _Group | None) -> bool:
    """Whether the target's compile shows what ``item``'s CPU rule says an accelerator does."""
    from stagetool.analysis import cpu_artefacts

    if item.cpu_only == cpu_artefacts.EXPANDED:
        # "XLA:TPU/GPU make no such collective": none of its result types at that line (the target's own
        # gather of the expert weights there, of another type, is another collective)
        return there is None or not set(item.collective.result_types) & set(there.types)
    if there is None:
        return False
    if item.cpu_only is not None:
        runs = item.accelerator_runs
        return runs is not None and all(r == runs for r in there.runs)
    if item.widened_from and not here.unknown and not there.unknown:
        return there.bytes_step < here.bytes_step  # narrower on the accelerator
    return True


def compare(target: str, compiler: str, here_compiler: str, *, here_collectives: CollectivesSection | None,
            there_collectives: CollectivesSection | None, here_cost: CostSection | None,
            there_cost: CostSection | None, here_memory: MemorySection | None,
            there_memory: MemorySection | None) -> AgainstSection:
    """Every difference between this run's sections and the target's for one function.

    Args:
      target: the target's name (``v5e:2x4``); compiler / here_compiler: ``XLA:TPU``, ``XLA:CPU``.
      here_* / there_*: the sections of this run and of the target's staging (None: not computed).

    Returns:
      The :class:`AgainstSection`; figures in bytes per device per step and FLOPs per device.
    """
    diffs: list[Difference] = []
    compared: list[str] = []
    rules: list[RuleCheck] = []
    if here_collectives is not None and there_collectives is not None:
        here, there = _groups(here_collectives.items), _groups(there_collectives.items)
        paired = _pair_moved(here, there)
        equal = 0
        for key in [*here, *(k for k in there if k not in here and k not in paired.values())]:
            a = here.get(key)
            moved = paired.get(key)
            b = there.get(moved or key)
            if a is not None and b is not None and a.same(b) and moved is None:
                equal += 1
                continue
            shown_b = b.shown() + (f" (at {moved.rsplit(' at ', 1)[1]})" if moved else "") if b else None
            diffs.append(Difference("collective", key, a.shown() if a else None, shown_b,
                                    None if a is None or a.unknown else a.bytes_step,
                                    None if b is None or b.unknown else b.bytes_step,
                                    "only here" if b is None else "only there" if a is None else "differs"))
        n = len(set(here) | set(there)) - len(paired)
        compared.append(f"collectives: {n} group{'s' if n != 1 else ''} (kind, mesh axes, source line; "
                        f"one of a kind and mesh axes on each side only is taken as moved), {equal} equal")
        seen: set[tuple[str, str]] = set()
        for item in here_collectives.items:
            rule = _rule_of(item)
            key = collective_key(item)
            if rule is None or (key, rule) in seen:
                continue
            seen.add((key, rule))
            b = there.get(paired.get(key, key))
            rules.append(RuleCheck(key, rule, _rule_agrees(item, here[key], b), b.shown() if b else "none"))
    if here_memory is not None and there_memory is not None:
        r, s = here_memory.record, there_memory.record
        for what, a, b in (("temporaries", r.temp_bytes, s.temp_bytes), ("peak", r.peak_bytes, s.peak_bytes)):
            if a is None or b is None:
                continue
            if a != b:
                diffs.append(Difference(what, f"{what} per device", *_bytes_pair(a, b), a, b, "differs"))
        compared.append("memory: temporaries and peak per device")
        if here_memory.peak is not None and there_memory.peak is not None \
                and here_memory.peak.buffers and there_memory.peak.buffers:
            a_lines, b_lines = _live_by_line(here_memory), _live_by_line(there_memory)
            equal = 0
            for line in [*a_lines, *(k for k in b_lines if k not in a_lines)]:
                a, b = a_lines.get(line), b_lines.get(line)
                if a == b:
                    equal += 1
                    continue
                shown = _bytes_pair(a, b) if a is not None and b is not None else (
                    format_bytes(a) if a is not None else None, format_bytes(b) if b is not None else None)
                diffs.append(Difference("live at the peak", line, *shown, a, b,
                                        "only here" if b is None else "only there" if a is None else "differs"))
            n = len(set(a_lines) | set(b_lines))
            compared.append(f"the peak's largest buffers by source line: {n} line{'s' if n != 1 else ''}, {equal} equal")
    if here_cost is not None and there_cost is not None:
        flops = here_cost.per_device.flops, there_cost.per_device.flops
        for what, a, b in (("FLOPs per device", *flops),
                           ("FLOPs per device per step (loop-aware)",
                            here_cost.loop_aware.flops if here_cost.loop_aware else None,
                            there_cost.loop_aware.flops if there_cost.loop_aware else None)):
            if a is None or b is None or (what != "FLOPs per device" and (a, b) == flops):
                continue
            if a != b:
                diffs.append(Difference("FLOPs", what, f"{a:,.0f}", f"{b:,.0f}", a, b, "differs"))
        compared.append("FLOPs per device")
        here_rep, there_rep = _replicated(here_cost), _replicated(there_cost)
        equal = 0
        for key in [*here_rep, *(k for k in there_rep if k not in here_rep)]:
            a, b = here_rep.get(key), there_rep.get(key)
            if a == b:
                equal += 1
                continue
            diffs.append(Difference("replicated work", key, f"{a:,.0f} FLOPs" if a is not None else None,
                                    f"{b:,.0f} FLOPs" if b is not None else None, a, b,
                                    "only here" if b is None else "only there" if a is None else "differs"))
        n = len(set(here_rep) | set(there_rep))
        compared.append(f"replicated work: {n} row{'s' if n != 1 else ''}, {equal} equal")
    return AgainstSection(target, compiler, here_compiler, tuple(diffs), tuple(compared), tuple(rules))


def _bytes_pair(a: int, b: int) -> tuple[str, str]:
    """Two byte counts as shown, exact (``4,194,560 B``) where their rounded forms would read the same."""
    x, y = format_bytes(a), format_bytes(b)
    return (x, y) if x != y else (f"{x} ({a:,} B)", f"{y} ({b:,} B)")


def _live_by_line(memory: MemorySection) -> dict[str, int]:
    """Bytes live at the peak (device memory) by the user's source line of each listed buffer."""
    out: dict[str, int] = {}
    for b in memory.peak.buffers:
        if getattr(b, "memory_space", "device") != "device":
            continue
        line = f"{b.file}:{b.line}" if b.file and b.line else "(no source line)"
        out[line] = out.get(line, 0) + b.size_bytes
    return out


def _replicated(cost: CostSection) -> dict[str, float]:
    """Replicated work's FLOPs per device per step by ``opcode at line over axes``."""
    out: dict[str, float] = {}
    for w in cost.replicated:
        key = f"{w.opcode} at {_line(w.source)} over {','.join(w.axes)}"
        out[key] = out.get(key, 0.0) + w.flops
    return out


def marked_collectives(section: CollectivesSection, against: AgainstSection) -> CollectivesSection:
    """``section`` with each row the target's compile shows otherwise marked (``against``: ``not on
    v5e:2x4``, ``v5e:2x4: 1 × bf16[..], runs 1: 512 KiB per step``), and the CPU rule marks the
    compile contradicts dropped (the compile wins; :attr:`AgainstSection.rules` keeps what they said)."""
    differing = {d.key: d for d in against.differences if d.what == "collective"}
    wrong = {(r.key, r.rule) for r in against.rules if not r.agrees}
    items = []
    for item in section.items:
        key = collective_key(item)
        d = differing.get(key)
        mark = None if d is None else (f"not on {against.target}" if d.there is None
                                       else f"{against.target}: {d.there}")
        rule = _rule_of(item)
        if rule is not None and (key, rule) in wrong:
            item = dataclasses.replace(item, cpu_only=None, widened_from=None, widened_bytes=None,
                                       accelerator_runs=None)
        items.append(dataclasses.replace(item, against=mark))
    return dataclasses.replace(section, items=tuple(items))
