"""A roll-up per module: FLOPs, bytes, collectives and memory at the peak, by module path and phase.

PyTorch's ``CommDebugMode`` and ``FSDPMemTracker`` attribute collectives and memory to each module,
and Flax's ``nnx.tabulate`` once counted FLOPs per module. This module does the same over one
device's compiled module (JAX-free, from :class:`stagetool.facts.StagedFunction`):

**Module path** of an HLO instruction, from what JAX recorded in its metadata:

* the scopes of its ``op_name`` (JAX's name stack): ``jax.named_scope`` and Flax Linen's module
  names (Linen runs each module method under a named scope: ``jit(step)/jvp(MLP)/up/dot_general``
  → ``MLP/up``). Transform wrappers are unwrapped (``jvp(X)``, ``transpose(jvp(X))``), nested
  ``jit(...)`` boundaries, loop and call markers (``while``, ``body``, ``closed_call``, ``cond``,
  ``branch_N_fun``), remat markers (``checkpoint``, ``rematted_computation``) and ``jnp.einsum``
  specs are not scopes; the primitive (the last part) is not either, nor Equinox's own class scopes
  (``eqx.nn.Linear``: its source frames name the field instead). A remat recomputation restates
  the whole stack under its ``transpose(...)`` (``transpose(jvp(S))/M/jvp(S)/M/checkpoint/down``):
  a scope equal to the path's first one starts the path again (``S/M/down``).
* when the op name holds no scope (Flax NNX and Equinox write none), its source frames: each frame
  of a method of a class (``LM.__call__``, ``Embed.attend``) in the user's code or in
  ``flax/nnx/nn`` / ``equinox/nn`` is one level. The outermost level is its class name; a deeper
  level is the attribute its caller's line calls it through (``self.mlp(x)`` → ``mlp``,
  ``jax.vmap(self.embed)(x)`` → ``embed``; read from the source file at the frame's line and column),
  or its class name when the source cannot be read.
  NNX's ``LM`` calling ``self.mlp`` calling ``self.up`` gives ``LM/mlp/up``.

An instruction with neither is "(outside every module)". A collective XLA combined from several
(``prefix/(a:b)``) goes to the deepest module holding all of them, in the first one's phase.

**Phase**, from the op name (JAX 0.10 writes ``jvp(...)`` on the forward pass of a differentiated
function and ``transpose(jvp(...))`` on its backward pass): ``recompute`` when a part is
``rematted_computation`` (what ``jax.checkpoint``'s transpose recomputes from the saved residuals,
counted apart; the ``checkpoint`` part alone only marks the remat boundary, forward and backward);
``backward`` when a part starts with ``transpose(``; ``forward`` when a part starts with ``jvp(``; otherwise ``update`` in a program that differentiates (the optimizer update and
whatever else runs outside the gradient) or ``forward`` in one that does not; ``arguments`` for the
entry parameters (their buffers at the peak); ``compiler-inserted`` for an instruction without an
op name (copies XLA added to change a layout, async ``copy-start``/``copy-done`` prefetches of
arguments into another memory space); ``difference`` for the :data:`RESIDUAL` row.

**Figures** (all per device, one execution of the program; ``while`` bodies counted once, as XLA
counts them, except the time):

* FLOPs, transcendentals and bytes accessed are **derived** from the compiled module's shapes with
  XLA's HloCostAnalysis rules (:mod:`stagetool.hlo.loops`): FLOPs are attributed to the
  instruction that does them (inside a fusion, each fused instruction by its own op name), bytes to
  the top-level instruction that reads and writes them (a fusion's to the fusion's op name). Where
  the derived total differs from XLA's (``Compiled.cost_analysis()``), the difference is its own row
  (:data:`RESIDUAL`), so that the rows always add up to XLA's figure.
* collectives: :func:`stagetool.hlo.collectives.find_collectives`' records (XLA's compiled
  program), summed by kind and mesh axes per group (:class:`~stagetool.hlo.collectives.CollectiveTotals`).
* bytes live at the peak: the device-memory buffers XLA's buffer assignment holds at the memory
  timeline's peak (:func:`stagetool.analysis.peak.peak_report`), by the instruction that defines
  each; an argument's buffer (phase ``arguments``; a donated one's too, which XLA names after the output
  reusing it) by its leaf's key path, to the module path whose tail
  it holds (``optimizer/opt_state/0/mu/mlp/up/kernel`` → ``LM/mlp/up``: a weight and its optimizer
  state go to their module, as ``FSDPMemTracker`` counts them); their sum is the peak's device bytes.
* time, with a chip: an **estimate**, the step-time model's seconds of each scheduled instruction
  (:mod:`stagetool.analysis.step_time`, loops × trip counts), by the instruction's group, added up
  serially (their sum is the estimate's serial figure: nothing overlapped).
"""

from __future__ import annotations

import dataclasses
import linecache
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from stagetool.hlo.collectives import Collective, CollectiveTotals, summarize
from stagetool.hlo.loops import Counted, _Counter
from stagetool.hlo.parser import (
    HloComputation,
    HloInstruction,
    HloModule,
    SourceFrame,
    array_leaves,
)

if TYPE_CHECKING:
    from stagetool.hlo.collectives import MeshAxes
    from stagetool.analysis.peak import PeakReport
    from stagetool.analysis.step_time import StepTimeEstimate
    from stagetool.core.chips import Chip
    from stagetool.facts import Interconnect, StagedFunction

OUTSIDE = "(outside every module)"
"""The path of instructions with no module scope and no module frame."""
RESIDUAL = "(XLA's total beyond the derived count)"
"""The path of the row holding XLA's figure minus the derived sum (FLOPs and bytes)."""
INSERTED = "compiler-inserted"
"""The phase of an instruction without an op name: XLA added it (a layout copy, an async prefetch
``copy-start``/``copy-done``), no line of the user's code asked for it."""
DIFFERENCE = "difference"
"""The phase of the :data:`RESIDUAL` row (XLA's figure minus the derived count): no phase of the program."""
PHASES = ("forward", "backward", "recompute", "update", "arguments", INSERTED, DIFFERENCE)
"""Phases in display order."""

_MARKERS = frozenset({"while", "body", "cond", "closed_call", "checkpoint", "rematted_computation", "remat",
                      "scan", "core_call", "custom_jvp_call", "custom_vjp_call", "pjit", "shard_map"})
_BRANCH = re.compile(r"branch_\d+_fun$")
_WRAPPED = re.compile(r"^([A-Za-z_]\w*)\((.*)\)$", re.DOTALL)
_METHOD = re.compile(r"^([A-Za-z_]\w*)\.([A-Za-z_]\w*)$")
_LIBRARY_MODULES = ("/flax/nnx/nn/", "/equinox/nn/")
_INSTALLED = ("/site-packages/", "/dist-packages/", "/lib/python3")
_ATTRIBUTE = re.compile(r"self\.([A-Za-z_]\w*(?:\[-?\d+\]|\.[A-Za-z_]\w*)*)")
_TRANSFORMED = re.compile(r"[\w.]+\(\s*self\.([A-Za-z_]\w*(?:\[-?\d+\]|\.[A-Za-z_]\w*)*)\s*[,)]")
_CONTAINERS = frozenset({"fusion", "call", "map", "async-start"})


@dataclasses.dataclass(frozen=True)
class ModuleRow:
    """One (module path, phase) group's figures, per device, one execution of the program.

    Attributes:
      path: ``LM/mlp/up``, :data:`OUTSIDE` or :data:`RESIDUAL`.
      phase: one of :data:`PHASES`.
      flops / transcendentals / bytes_accessed: derived from the compiled module with XLA's rules
        (the :data:`RESIDUAL` row: XLA's figure minus the derived sum).
      instructions: HLO instructions attributed to the group (fused ones included).
      dot_flops: the part of ``flops`` done by ``dot`` and ``convolution`` instructions (the matmul
        work: 2 × output elements × the contracted size).
      collectives: the group's collectives by kind and mesh axes (``count``, ``bytes_per_device`` of
        one execution each, ``executed_bytes_per_device``).
      peak_bytes: device-memory bytes the group's instructions hold at the memory peak; None when the
        peak buffers are not known (no dump asked for).
      seconds: an ESTIMATE, seconds per step on the section's chip: the step-time model's time of the
        group's scheduled instructions (:mod:`stagetool.analysis.step_time`: compute, memory and
        collective time, loops × their trip counts), added up serially; None without a chip.
    """

    path: str
    phase: str
    flops: float
    transcendentals: float
    bytes_accessed: float
    instructions: int
    dot_flops: float = 0.0
    collectives: tuple[CollectiveTotals, ...] = ()
    peak_bytes: int | None = None
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class ModuleNode:
    """A node of the module tree: its own rows (one per phase) and its children's, summed.

    Attributes:
      path / name: the full path and its last part.
      flops / bytes_accessed / collective_bytes / peak_bytes / seconds: the node's rows and every
        descendant's, summed (``collective_bytes``: one execution each; ``peak_bytes`` and the
        estimated ``seconds`` None when unknown).
      rows: the node's own rows, phase order.
      children: child nodes, by name.
    """

    path: str
    name: str
    flops: float
    bytes_accessed: float
    collective_bytes: int
    peak_bytes: int | None
    rows: tuple[ModuleRow, ...]
    children: tuple[ModuleNode, ...]
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class ModulesSection:
    """The roll-up of one function (see the module docstring).

    Attributes:
      rows: one per (path, phase), paths sorted (:data:`OUTSIDE`, then :data:`RESIDUAL` last), phases
        in :data:`PHASES` order.
      xla_flops / xla_bytes_accessed: ``Compiled.cost_analysis()``'s per-device figures (XLA's), or None.
      derived_flops / derived_bytes_accessed: the derived count over the whole module.
      peak_bytes: device bytes live at the peak (the sum of the rows' ``peak_bytes``), or None.
      peak_reason: why the peak column is empty (None when it is not).
      path_sources: how paths were found: ``op_name scopes`` and/or ``source frames``.
      notes: sentences for the reader.
      chip: the chip the rows' ``seconds`` are estimated on, or None.
      serial_seconds: the step-time estimate's serial figure on that chip (nothing overlapped), which
        the rows' ``seconds`` add up to; None without a chip.
    """

    rows: tuple[ModuleRow, ...]
    xla_flops: float | None
    xla_bytes_accessed: float | None
    derived_flops: float
    derived_bytes_accessed: float
    peak_bytes: int | None = None
    peak_reason: str | None = None
    path_sources: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    chip: str | None = None
    serial_seconds: float | None = None

    def tree(self) -> tuple[ModuleNode, ...]:
        """The rows as a tree of :class:`ModuleNode` (roots sorted as the rows are)."""
        return module_tree(self.rows)


# ----------------------------------------------------------------------------- op names


def split_op_name(op_name: str) -> list[str]:
    """``jit(f)/transpose(jvp(a/b))/c/dot_general`` → ``["jit(f)", "transpose(jvp(a/b))", "c",
    "dot_general"]``: split at the slashes outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(op_name):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(depth - 1, 0)
        elif ch == "/" and depth == 0:
            parts.append(op_name[start:i])
            start = i + 1
    parts.append(op_name[start:])
    return parts


def _scopes(part: str) -> list[str]:
    """The named scopes one op-name part contributes (none for markers and ``jit(...)``)."""
    m = _WRAPPED.match(part)
    if m:
        if m.group(1) == "jit":
            return []
        inner = m.group(2)
        return [s for p in split_op_name(inner) if p for s in _scopes(p)] if inner else []
    if not part or part in _MARKERS or _BRANCH.match(part) or "->" in part or "," in part or part.startswith("eqx."):
        return []
    return [part]


def _first(op_name: str) -> str:
    """The first name of an op XLA made of several and named ``a;b`` (a fusion of two ops)."""
    depth = 0
    for i, ch in enumerate(op_name):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ";" and depth == 0:
            return op_name[:i]
    return op_name


def combined_members(op_name: str) -> list[str] | None:
    """The op names of a collective XLA combined from several, ``prefix/(a:b:c)`` →
    ``["prefix/a", "prefix/b", "prefix/c"]``; None for any other op name."""
    parts = split_op_name(op_name)
    last = parts[-1]
    if not (last.startswith("(") and last.endswith(")")):
        return None
    members, depth, start = [], 0, 1
    for i, ch in enumerate(last[1:-1], start=1):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ":" and depth == 0:
            members.append(last[start:i])
            start = i + 1
    members.append(last[start:-1])
    if len(members) < 2:
        return None
    prefix = "/".join(parts[:-1])
    return [f"{prefix}/{m}" if prefix else m for m in members]


def scope_path(op_name: str | None) -> tuple[str, ...]:
    """The module path an op name's scopes give (see the module docstring); () when none. An op XLA
    made of several is placed by its first name (``a;b``) or by the merged names' shared prefix
    (a combined collective's ``prefix/(a:b)``)."""
    op_name = _first(op_name) if op_name else op_name
    if not op_name or "/" not in op_name:
        return ()
    path: list[str] = []
    for part in split_op_name(op_name)[:-1]:
        found = _scopes(part)
        if found and path and found[0] == path[0] and _WRAPPED.match(part):
            path = []  # a remat recomputation restates the stack from the root
        path.extend(found)
    return tuple(path)


def phase_of(op_name: str | None, *, differentiated: bool) -> str:
    """The phase of an op name (see the module docstring)."""
    if not op_name:
        return INSERTED
    parts = split_op_name(_first(op_name))
    if "rematted_computation" in parts:
        return "recompute"
    if any(p.startswith("transpose(") for p in parts):
        return "backward"
    if any(p.startswith("jvp(") for p in parts):
        return "forward"
    return "update" if differentiated else "forward"


def _attribute(frame: SourceFrame, method: str) -> str | None:
    """The ``self.<attr>`` a caller's line calls a module through, read from the source file at the
    frame's column (tried as 0- and 1-based); None when the file or the pattern is not there."""
    text = linecache.getline(frame.file, frame.line)
    if not text or frame.column is None:
        return None
    m = next((m for col in (frame.column, frame.column - 1) if 0 <= col < len(text)
              for pattern in (_ATTRIBUTE, _TRANSFORMED) for m in [pattern.match(text, col)] if m), None)
    if m is None:
        return None
    attr = m.group(1)
    return attr[: -len(method) - 1] if attr.endswith("." + method) else attr


def _module_frame(frame: SourceFrame) -> str | None:
    """The class name of a frame that is a module's method, else None."""
    m = _METHOD.match(frame.function or "")
    if m is None:
        return None
    file = frame.file.replace("\\", "/")
    if any(d in file for d in _LIBRARY_MODULES) or not any(d in file for d in _INSTALLED):
        return m.group(1)
    return None


def frame_path(frames: Sequence[SourceFrame]) -> tuple[str, ...]:
    """The module path a source chain (innermost first) gives (see the module docstring)."""
    path: list[str] = []
    root, root_at = None, 0
    for i in range(len(frames) - 1, -1, -1):
        cls = _module_frame(frames[i])
        if cls is None:
            continue
        if cls == root and frames[i].function == frames[root_at].function:
            path = []  # a transform's backward pass restates the stack from the root module
        if not path:
            root, root_at = cls, i
        name = None
        if path and i + 1 < len(frames):
            name = _attribute(frames[i + 1], frames[i].function.split(".")[-1])  # type: ignore[union-attr]
        path.append(name or cls)
    return tuple(path)


# ----------------------------------------------------------------------------- attribution


class _Groups:
    """Instruction → (path, phase), cached per (op name, stack frame id)."""

    def __init__(self, module: HloModule, differentiated: bool):
        self.module, self.differentiated = module, differentiated
        self.memo: dict[tuple, tuple[str, str]] = {}
        self.sources: set[str] = set()

    def key(self, ins: HloInstruction, fallback: tuple[str, str] | None = None) -> tuple[str, str]:
        md = ins.metadata
        if ins.opcode == "parameter" and fallback is None:
            return OUTSIDE, "arguments"
        if md is None or not md.op_name:
            return fallback or (OUTSIDE, INSERTED)
        k = (md.op_name, md.stack_frame_id, md.source_file, md.source_line)
        members = combined_members(md.op_name) if k not in self.memo else None
        if members:  # the deepest module holding every part; the first part's phase
            paths = [scope_path(m) for m in members]
            common = paths[0]
            for p in paths[1:]:
                n = next((i for i, (a, b) in enumerate(zip(common, p)) if a != b), min(len(common), len(p)))
                common = common[:n]
            self.memo[k] = ("/".join(common) if common else OUTSIDE,
                            phase_of(members[0], differentiated=self.differentiated))
        if k not in self.memo:
            path = scope_path(md.op_name)
            if path:
                self.sources.add("op_name scopes")
            else:
                path = frame_path(self.module.source_stack(ins))
                if path:
                    self.sources.add("source frames")
            self.memo[k] = ("/".join(path) if path else OUTSIDE, phase_of(md.op_name, differentiated=self.differentiated))
        return self.memo[k]


class _ScatterCounter(_Counter):
    """The loop counter plus XLA's rule for ``scatter``: the updates' elements × the reducer's FLOPs
    (``HloCostAnalysis::HandleScatter``), the gradient of every gather (an embedding lookup)."""

    def instruction(self, comp: HloComputation, ins: HloInstruction, *, top: bool) -> Counted:
        c = super().instruction(comp, ins, top=top)
        if ins.opcode != "scatter" or len(ins.operands) < 3:
            return c
        n = (len(ins.operands) - 1) // 2  # operands..., indices, updates...
        updates = sum(_elements(comp, u) for u in ins.operands[n + 1:])
        return Counted(c.flops + updates * self._reducer_flops(ins), c.transcendentals, c.bytes_accessed)


def _elements(comp: HloComputation, name: str) -> int:
    ins = comp.instruction(name)
    return sum(a.element_count for a in array_leaves(ins.shape)) if ins is not None else 0


class _Attributor:
    def __init__(self, module: HloModule, groups: _Groups):
        self.module, self.groups = module, groups
        self.counter = _ScatterCounter(module, {}, False)
        self.totals: dict[tuple[str, str], list[float]] = {}

    def add(self, key: tuple[str, str], c: Counted, n: int, dot: float) -> None:
        t = self.totals.setdefault(key, [0.0, 0.0, 0.0, 0, 0.0])
        t[0] += c.flops
        t[1] += c.transcendentals
        t[2] += c.bytes_accessed
        t[3] += n
        t[4] += dot

    def computation(self, comp: HloComputation | None, *, top: bool, fallback: tuple[str, str] | None) -> Counted:
        total = Counted()
        for ins in comp.instructions if comp is not None else ():
            total = total + self.instruction(comp, ins, top=top, fallback=fallback)  # type: ignore[arg-type]
        return total

    def instruction(self, comp: HloComputation, ins: HloInstruction, *, top: bool,
                    fallback: tuple[str, str] | None) -> Counted:
        """Attribute one instruction's cost (the counter's figure for it, exactly) to its groups;
        returns that figure."""
        whole = self.counter.instruction(comp, ins, top=top)
        key = self.groups.key(ins, fallback)
        inner = Counted()
        op = ins.opcode
        if op == "while":
            for attr in ("body", "condition"):
                inner = inner + self.computation(self.module.computation(ins.attributes.get(attr, "").lstrip("%")),
                                                 top=True, fallback=key)
        elif op == "conditional" and ins.called_computations:
            names = [c.lstrip("%") for c in ins.called_computations]
            costs = [self.counter.computation(n, top=True) for n in names]
            best = max(range(len(names)), key=lambda j: costs[j].flops)  # the branch the counter counts
            inner = self.computation(self.module.computation(names[best]), top=True, fallback=key)
        elif op in _CONTAINERS and ins.called_computations:
            for name in ins.called_computations:
                inner = inner + self.computation(self.module.computation(name.lstrip("%")), top=False, fallback=key)
        rest = Counted(whole.flops - inner.flops, whole.transcendentals - inner.transcendentals,
                       whole.bytes_accessed - inner.bytes_accessed)
        self.add(key, rest, 1, whole.flops if op in ("dot", "convolution") else 0.0)
        return whole


def _differentiated(module: HloModule) -> bool:
    for comp in module.computations:
        for ins in comp.instructions:
            md = ins.metadata
            if md is not None and md.op_name and "transpose(" in md.op_name:
                return True
    return False


def _collective_key(groups: _Groups, module: HloModule, c: Collective) -> tuple[str, str]:
    comp = module.computation(c.computation)
    ins = comp.instruction(c.name) if comp is not None else None
    if ins is not None and ins.metadata is not None and ins.metadata.op_name:
        return groups.key(ins)
    if c.fusion is not None:  # the calling fusion's metadata
        for parent in module.computations:
            f = parent.instruction(c.fusion)
            if f is not None:
                return groups.key(f)
    return OUTSIDE, INSERTED


def _instruction_index(module: HloModule) -> dict[str, HloInstruction]:
    out: dict[str, HloInstruction] = {}
    for comp in module.computations:
        for ins in comp.instructions:
            out.setdefault(ins.name, ins)
    return out


def _argument_module(leaf: str, paths: Sequence[tuple[str, ...]]) -> str | None:
    """The module an argument leaf belongs to, by its key path: the module path whose longest tail
    appears in a row among the leaf's keys (``optimizer/opt_state/0/mu/mlp/up/kernel`` → ``LM/mlp/up``,
    tail ``mlp/up``); ties go to the first in sorted order; None when no tail appears."""
    keys = tuple(leaf.split("/"))
    best, best_len = None, 0
    for path in sorted(paths):
        for n in range(len(path), best_len, -1):
            tail = path[-n:]
            if any(keys[i:i + n] == tail for i in range(len(keys) - n + 1)):
                best, best_len = path, n
                break
    return "/".join(best) if best is not None else None


def module_rollup(module: HloModule, *, xla_flops: float | None = None, xla_bytes_accessed: float | None = None,
                  collectives: Iterable[Collective] = (), peak: PeakReport | None = None,
                  peak_reason: str | None = None, arguments: Mapping[int, str] | None = None,
                  step: StepTimeEstimate | None = None) -> ModulesSection:
    """The roll-up of one device's compiled module (see the module docstring).

    Args:
      module: the parsed compiled (per-device) module.
      xla_flops / xla_bytes_accessed: ``Compiled.cost_analysis()``'s ``flops`` and ``bytes accessed``
        (XLA's); the rows then add up to them, the difference in a :data:`RESIDUAL` row.
      collectives: the module's collectives (:func:`stagetool.hlo.collectives.find_collectives`).
      peak: the buffers live at the peak, all of them (``peak_report(..., top=<every buffer>)``), or None.
      peak_reason: why ``peak`` is None, for the reader.
      arguments: entry parameter number → the argument leaf's key path (``model/mlp/up/kernel``):
        an argument's buffer at the peak goes to the module its key path names (phase ``arguments``),
        else to :data:`OUTSIDE`.
      step: the step-time estimate of the module with every instruction listed
        (``step_time(..., top=<all>)``), for the rows' ``seconds``; None for none.

    Returns:
      A :class:`ModulesSection`. Never raises for odd content (an instruction it cannot place is
      :data:`OUTSIDE`).
    """
    groups = _Groups(module, _differentiated(module))
    att = _Attributor(module, groups)
    derived = att.computation(module.entry, top=True, fallback=None) if module.entry is not None else Counted()
    by_key: dict[tuple[str, str], list[Collective]] = {}
    for c in collectives:
        by_key.setdefault(_collective_key(groups, module, c), []).append(c)
    peak_by_key: dict[tuple[str, str], int] = {}
    peak_total = None
    if peak is not None and peak.reason is None:
        index = _instruction_index(module)
        params = {p.name: p.parameter_number for p in module.entry_parameters()}
        paths = {tuple(k[0].split("/")) for k in att.totals if k[0] not in (OUTSIDE, RESIDUAL)}
        peak_total = 0
        for b in peak.buffers:
            if b.memory_space != "device":
                continue
            ins = index.get(b.instruction_name)
            k = groups.key(ins) if ins is not None else (OUTSIDE, INSERTED)
            # a donated argument's buffer is named after the output that reuses it: its values say
            leaf = next((arguments[params[n]] for n in [b.instruction_name, *(v.split("{")[0] for v in b.shared_with)]
                         if n in params and params[n] in (arguments or {})), None)
            if leaf is not None:
                k = (_argument_module(leaf, tuple(paths)) or OUTSIDE, "arguments")
            peak_by_key[k] = peak_by_key.get(k, 0) + b.size_bytes
            peak_total += b.size_bytes
    elif peak is not None:
        peak_reason = peak.reason
    seconds: dict[tuple[str, str], float] = {}
    for item in step.top if step is not None else ():
        comp = module.computation(item.computation)
        ins = comp.instruction(item.name) if comp is not None else None
        k = groups.key(ins) if ins is not None else (OUTSIDE, INSERTED)
        seconds[k] = seconds.get(k, 0.0) + item.total_seconds
    keys = set(att.totals) | set(by_key) | set(peak_by_key) | set(seconds)
    rows = []
    for k in keys:
        flops, trans, moved, n, dot = att.totals.get(k, [0.0, 0.0, 0.0, 0, 0.0])
        if not (flops or trans or moved or k in by_key or peak_by_key.get(k) or seconds.get(k)):
            continue
        rows.append(ModuleRow(k[0], k[1], flops, trans, moved, int(n), dot,
                              summarize(by_key[k]).by_kind_and_mesh_axes if k in by_key else (),
                              peak_by_key.get(k, 0) if peak_total is not None else None,
                              seconds.get(k, 0.0) if step is not None else None))
    residual_flops = (xla_flops - derived.flops) if xla_flops is not None else 0.0
    residual_bytes = (xla_bytes_accessed - derived.bytes_accessed) if xla_bytes_accessed is not None else 0.0
    notes = []
    if residual_flops or residual_bytes:
        rows.append(ModuleRow(RESIDUAL, DIFFERENCE, residual_flops, 0.0, residual_bytes, 0,
                              peak_bytes=0 if peak_total is not None else None,
                              seconds=0.0 if step is not None else None))
        share = ""
        if xla_bytes_accessed and residual_bytes:
            part = residual_bytes / xla_bytes_accessed
            share = f" ({part:+.1%} of XLA's)" if abs(part) >= 0.001 else " (under 0.1% of XLA's)"
        notes.append(f"the derived count differs from XLA's by {residual_flops:+,.0f} FLOPs and "
                     f"{residual_bytes:+,.0f} bytes accessed{share}: the row {RESIDUAL} holds the difference")
    rows.sort(key=_row_order)
    return ModulesSection(tuple(rows), xla_flops, xla_bytes_accessed, derived.flops, derived.bytes_accessed,
                          peak_total, peak_reason if peak_total is None else None,
                          tuple(sorted(groups.sources)), tuple(notes), step.chip if step is not None else None,
                          step.serial_seconds if step is not None else None)


def _row_order(r: ModuleRow) -> tuple:
    special = {OUTSIDE: 1, RESIDUAL: 2}.get(r.path, 0)
    return (special, r.path.split("/"), PHASES.index(r.phase) if r.phase in PHASES else len(PHASES))


def module_tree(rows: Sequence[ModuleRow]) -> tuple[ModuleNode, ...]:
    """Rows as a tree: a node per path prefix, its figures its rows' and its descendants' summed."""
    own: dict[tuple[str, ...], list[ModuleRow]] = {}
    for r in rows:
        parts = (r.path,) if r.path in (OUTSIDE, RESIDUAL) else tuple(r.path.split("/"))
        for i in range(1, len(parts) + 1):
            own.setdefault(parts[:i], [])
        own[parts].append(r)
    known_peak = any(r.peak_bytes is not None for r in rows)
    timed = any(r.seconds is not None for r in rows)

    def node(parts: tuple[str, ...]) -> ModuleNode:
        kids = sorted((p for p in own if len(p) == len(parts) + 1 and p[: len(parts)] == parts),
                      key=lambda p: p[-1])
        children = tuple(node(p) for p in kids)
        mine = own[parts]
        return ModuleNode(
            "/".join(parts), parts[-1],
            sum(r.flops for r in mine) + sum(c.flops for c in children),
            sum(r.bytes_accessed for r in mine) + sum(c.bytes_accessed for c in children),
            sum(t.bytes_per_device for r in mine for t in r.collectives) + sum(c.collective_bytes for c in children),
            (sum(r.peak_bytes or 0 for r in mine) + sum(c.peak_bytes or 0 for c in children)) if known_peak else None,
            tuple(sorted(mine, key=_row_order)), children,
            (sum(r.seconds or 0.0 for r in mine) + sum(c.seconds or 0.0 for c in children)) if timed else None)

    roots = sorted((p for p in own if len(p) == 1), key=lambda p: ({OUTSIDE: 1, RESIDUAL: 2}.get(p[0], 0), p[0]))
    return tuple(node(p) for p in roots)


def modules_section(facts: StagedFunction, mesh: MeshAxes | None, *, slices: int = 1, chip: Chip | None = None,
                    interconnect: Interconnect | None = None) -> ModulesSection | None:
    """The roll-up of one staged function's facts: its compiled module, ``Compiled.cost_analysis()``
    (XLA's totals the rows add up to), its collectives over ``mesh``, when the peak dump was taken
    the buffers live at the memory timeline's peak (the step the memory section's peak table is at),
    and with a ``chip`` and the ``interconnect`` the step-time estimate of each row.

    Returns None for a function that was not compiled.
    """
    from stagetool.hlo.collectives import find_collectives
    from stagetool.analysis.cost import per_device_cost

    module = facts.module
    if module is None:
        return None
    cost = per_device_cost(facts.per_device_cost)

    def known(v: float | None) -> float | None:
        return v if v is not None and v >= 0 else None  # XLA:CPU's -1 "unknown" is no total

    peak = None
    reason = "the peak dump was not taken (--no-peak)"
    if facts.peak is not None:
        from stagetool.analysis.memory import memory_of
        from stagetool.analysis.peak import module_index, peak_report
        from stagetool.analysis.timeline import memory_timeline

        record = memory_of(facts.memory)
        index = module_index(facts)
        _, tp = memory_timeline(facts.peak, gated_peak=record.peak_bytes, record=record, top=0, index=index)
        at = tp.schedule_position if tp is not None else None
        peak = peak_report(facts.peak, top=1 << 62, at=at, step=tp.position if at is not None else None,
                           index=index)
    arguments = {x.parameter: x.path for x in facts.inputs or () if x.parameter is not None}
    collectives = find_collectives(module, mesh, slices=slices)
    step = None
    if chip is not None and interconnect is not None:
        from stagetool.hlo.collectives import while_loops
        from stagetool.analysis.step_time import step_time

        step = step_time(module, chip, interconnect, collectives, dict(while_loops(module)), top=1 << 62)
    return module_rollup(module, xla_flops=known(cost.flops), xla_bytes_accessed=known(cost.bytes_accessed),
                         collectives=collectives, peak=peak, peak_reason=reason, arguments=arguments, step=step)
