"""Why each collective is there: the op it belongs to, its operands' shardings, and where each
mesh axis of those shardings came from.

Input: the collectives of the compiled module (:mod:`stagetool.hlo.collectives`), Shardy's
propagation rerun with sharding origins (:class:`stagetool.facts.Propagation`) and the
input/output leaves (:class:`~stagetool.analysis.shardings.LeafReport`: path, spec line, where the
declared sharding came from). Output: one :class:`CollectiveCause` per collective, or one sentence
saying why there is none for the whole function.

How a collective is tied to the program before partitioning: XLA keeps each op's metadata
(``op_name``, source line) on the instructions the partitioner makes for it, so a collective is
matched to the propagated ops of the same innermost source line whose JAX op name ends the same way
(``.../dot_general``). Within that op, Shardy's factor rule (``([i, k], [k, j])->([i, j])
reduction={k}``) says which dimensions of which operands are the same loop: a mesh axis that shards a
reduction factor makes partial results (an all-reduce or reduce-scatter); one that shards a factor in
one tensor and not in another makes a gather (or, moved to another factor, an all-to-all). The op's
users and its operands' producers are looked at too, since a resharding between two ops carries the
metadata of either.

Faithful or silent: :func:`unfaithful_reason` compares the propagation's final entry shardings with
the compiled program's (``Compiled.input_shardings`` / ``output_shardings``, as the leaves carry
them); where they differ no cause is given.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagetool.core.location import no_column as _no_column
from stagetool.core.location import source_name as _short

if TYPE_CHECKING:
    from stagetool.hlo.collectives import Collective
    from stagetool.analysis.shardings import LeafReport
    from stagetool.facts import Operand, Propagation, PropagatedOp, ShardingRule, ValueSharding
    from stagetool.hlo.parser import SourceFrame

__all__ = ["AxisOrigin", "CollectiveCause", "ConstraintFact", "ShardingOrigins", "TensorAt", "cause_of",
           "sharding_origins", "unfaithful_reason"]


@dataclasses.dataclass(frozen=True)
class AxisOrigin:
    """Where one mesh axis of a value's sharding came from.

    Attributes:
      axis: the mesh axis.
      kind: ``input`` (an input leaf's declared sharding), ``output`` (an output's declared
        sharding), ``constraint`` (a sharding constraint in the user's code), ``reshape`` (a reshape
        in the user's code that split a dimension sharded over the axis, past which Shardy names no
        origin; ``leaf`` then says where its operand's sharding came from) or ``unknown``.
      leaf: the input or output leaf's key path (``params/layers/wo``), else None.
      source: for an input or output, the spec line that set its sharding (``file:line:col``); for a
        constraint, the user's source line (``file:line``); None when not known.
      how: for an input, where its declared sharding came from (``spec``, ``rule``, ``model``, ``init``,
        ``object``, ``target``, ``unknown``,
        ``compiler``), else None.
    """

    axis: str
    kind: str
    leaf: str | None = None
    source: str | None = None
    how: str | None = None

    def describe(self) -> str:
        """``params/layers/wo (rule at spec.yaml:14)``, ``the constraint at model.py:6``."""
        if self.kind == "constraint":
            return f"the sharding constraint at {_short(self.source)}" if self.source else "a sharding constraint"
        if self.kind == "reshape":
            return (f"the reshape at {_short(self.source) or 'an unknown line'}, which splits a dimension sharded over "
                    f"`{self.axis}` into two" + (f" (its sharding from {self.leaf})" if self.leaf else ""))
        if self.kind in ("input", "output"):
            what = {"rule": "rule", "spec": "spec", "model": "model annotation", "init": "init", "object": "ref",
                    "target": "target's " + ("out_shardings" if self.kind == "output" else "in_shardings"),
                    "compiler": "auto"}.get(self.how or "")
            line = _short(_no_column(self.source))
            where = f"{what} at {line}" if what and line else (what or line or "")
            out = "output " if self.kind == "output" else ""
            return f"{out}{self.leaf}" + (f" ({where})" if where else "")
        return "an origin Shardy did not name"

    @property
    def key(self) -> tuple[str, str, str]:
        """``(kind, leaf or source, axis)``: what two origins have in common when they are the same cause."""
        return (self.kind, self.leaf or self.source or "", self.axis)

    @property
    def label(self) -> str:
        """What the CI gate records and matches edits against: ``input params/layers/wo``,
        ``constraint model.py:8`` (the file name and line), ``output out/loss``."""
        if self.kind in ("constraint", "reshape"):
            return f"{self.kind} {_short(self.source)}"
        return f"{self.kind} {self.leaf or _short(self.source) or '?'}"


@dataclasses.dataclass(frozen=True)
class TensorAt:
    """One operand or result of the op a collective belongs to.

    Attributes:
      name: the input leaf it is (``params/layers/wo``), or the op that made it and its line
        (``tanh at model.py:5``), or ``result``.
      sharding: its sharding at the op as JAX prints a PartitionSpec (``P('data', None)``).
      origins: where each mesh axis of that sharding came from (the collective's axes first).
    """

    name: str
    sharding: str
    origins: tuple[AxisOrigin, ...] = ()


@dataclasses.dataclass(frozen=True)
class CollectiveCause:
    """Why one collective is in the compiled program.

    Attributes:
      op: the op it belongs to (``dot_general``, ``sharding_constraint``).
      line: the user's source line of that op (``file:line``), or None.
      operands / result: the op's operands and result at that op, with their shardings' origins.
      reason: one sentence: which factor the collective's mesh axes shard where, and what that forces
        (``contraction over `model`: params/layers/wo is sharded on it ..., h is not → partial sums
        all-reduced``).
      origins: the distinct origins of the collective's mesh axes on the tensors the reason names:
        the edits that would remove it.
    """

    op: str
    line: str | None
    operands: tuple[TensorAt, ...]
    result: TensorAt | None
    reason: str
    origins: tuple[AxisOrigin, ...] = ()


# ---- faithfulness


def unfaithful_reason(prop: Propagation, inputs: Sequence[LeafReport], outputs: Sequence[LeafReport]) -> str | None:
    """Why the rerun propagation is not the compiled program's, or None when every entry argument's
    and result's final sharding equals the compiled one (``Compiled.input_shardings`` /
    ``output_shardings`` as the leaves carry them; unused inputs are not entry arguments).

    Shardings are compared as JAX's ``Sharding.is_equivalent_to`` does: a dimension that no mesh axis
    splits is the same whether it is written or not, so trailing unsplit dimensions are dropped on
    both sides (a typed PRNG key ``key<fry>[]`` is a ``u32[2]`` in the lowered module: Shardy's
    ``P(None)`` there and the compiled ``P()`` of the key are the same sharding), and a mesh axis of
    size 1 splits nothing, so it is dropped on both sides too (Shardy's propagation leaves it out:
    the compiled ``P('x', None)`` over ``x=1`` is its ``P(None, None)``). The message names the leaf
    and both shardings; it does not guess why they differ."""
    unit = frozenset(name for name, size in prop.mesh_axes if size == 1)
    used = sorted((x for x in inputs if x.parameter is not None), key=lambda x: x.parameter)
    if len(used) != len(prop.inputs):
        return (f"the lowered module has {len(prop.inputs)} arguments but the compiled program {len(used)}; "
                "the explanation is unavailable for this function")
    for leaf in used:
        differs = _differs("input", leaf, prop.inputs[leaf.parameter], unit)
        if differs:
            return differs
    if len(outputs) < len(prop.outputs) and not any(x.ref_write_back for x in outputs):
        # a function given jax.Refs returns each Ref's new value too (stagetool.staging.ref_outputs)
        return (f"the lowered module has {len(prop.outputs) - len(outputs)} results more than the function's "
                f"{len(outputs)} output leaves: a function given jax.Ref arguments also returns each Ref's new "
                "value (a Ref write-back), and this JAX did not give their compiled shardings, so why each "
                "collective is there is unavailable for this function")
    if len(outputs) != len(prop.outputs):
        return (f"the lowered module has {len(prop.outputs)} results but the report {len(outputs)} output leaves; "
                "the explanation is unavailable for this function")
    for leaf, got_s in zip(outputs, prop.outputs):
        differs = _differs("output", leaf, got_s, unit)
        if differs:
            return differs
    return None


def _differs(which: str, leaf: LeafReport, got_s: ValueSharding | None,
             unit: frozenset[str] = frozenset()) -> str | None:
    """None when the propagation's final sharding of one entry argument or result is the compiled one
    (``unit``: the mesh axes of size 1, which split nothing and are ignored), else the sentence saying
    what differs."""
    got = _dims(got_s, len(leaf.shape))
    if leaf.compiled is not None and leaf.compiled.kind == "other" and leaf.compiled.dims:
        # an argument on its own mesh of the staged devices (jax.jit takes it so): Shardy's rerun
        # gives its PartitionSpec over that mesh, which is what it is compiled with
        own = tuple(() if d is None else (d,) if isinstance(d, str) else tuple(d) for d in leaf.compiled.dims)
        if _trim(got) == _trim(own):
            return None
        return (f"Shardy's propagation rerun here gives {which} {leaf.path} {_fmt(got)}, the compiled program "
                f"{leaf.compiled}: the rerun is not the propagation the compile used, so the explanation is "
                "unavailable for this function")
    if leaf.compiled is None or leaf.compiled.kind != "spec":
        return (f"the compiled program's sharding of {which} {leaf.path} is "
                f"{leaf.compiled if leaf.compiled is not None else 'not known'}, not a PartitionSpec "
                f"over the mesh, so it cannot be matched with Shardy's propagation rerun here ({_fmt(got)}): "
                "the explanation is unavailable for this function")
    want = _compiled_dims(leaf.compiled, len(leaf.shape))
    if _trim(_without(got, unit)) == _trim(_without(want, unit)):
        return None
    return (f"Shardy's propagation rerun here gives {which} {leaf.path} {_fmt(got)}, the compiled program "
            f"{leaf.compiled}: the rerun is not the propagation the compile used, so the explanation is "
            "unavailable for this function")


def _trim(dims: tuple[tuple[str, ...], ...]) -> tuple[tuple[str, ...], ...]:
    """Trailing dimensions no mesh axis splits dropped (``P('data', None)`` and ``P('data')`` are one
    sharding, as ``Sharding.is_equivalent_to`` says)."""
    out = list(dims)
    while out and not out[-1]:
        out.pop()
    return tuple(out)


def _without(dims: tuple[tuple[str, ...], ...], unit: frozenset[str]) -> tuple[tuple[str, ...], ...]:
    """``dims`` with the mesh axes in ``unit`` (those of size 1) left out of every dimension."""
    return tuple(tuple(a for a in d if a not in unit) for d in dims)


def _dims(s: ValueSharding | None, rank: int) -> tuple[tuple[str, ...], ...]:
    if s is None:
        return ((),) * rank
    dims = tuple(tuple(a for a in d) for d in s.dims)
    return dims + ((),) * (rank - len(dims))


def _compiled_dims(s, rank: int) -> tuple[tuple[str, ...], ...]:
    out = []
    for d in s.padded(rank).dims:
        out.append(() if d is None else (d,) if isinstance(d, str) else tuple(d))
    return tuple(out)


def _fmt(dims: tuple[tuple[str, ...], ...]) -> str:
    from stagetool.core.sharding import format_dims

    return format_dims(tuple(None if not d else d[0] if len(d) == 1 else d for d in dims))


# ---- matching a collective to the ops it belongs to


def _base_axis(axis: str) -> str:
    """``model[minor 2 of 4]`` (analysis.collectives' sub-axis name) → ``model``."""
    return axis.split("[")[0]


def _op_tail(op_name: str | None) -> str | None:
    """The op of JAX's op name: its last segment, wrappers unwrapped
    (``jvp()/while/body/closed_call/dot_general`` → ``dot_general``; ``jvp(jit(relu))`` → ``relu``)."""
    if not op_name:
        return None
    seg = op_name.rsplit("/", 1)[-1]
    while seg.count(")") > seg.count("("):
        seg = seg[:-1]
    for _ in range(16):
        m = re.fullmatch(r"[\w\-]+\((.+)\)", seg)
        if m is None:
            break
        seg = m.group(1)
    return seg.removesuffix("()") or None


def candidates(c: Collective, prop: Propagation) -> list[PropagatedOp]:
    """The propagated ops a collective's metadata names: the same innermost source line (file and line)
    and the same op name ending; by line alone when no op name matches. Of those, the ops whose
    callers are the collective's too (its ``source_chain``, as far as both go) when any are: a helper
    that every layer calls (``einsum`` at ``model.py:263``, called from the attention's line and the
    MLP's) holds one op per call on the same innermost line."""
    if c.source is None:
        return []
    # by file name and line: a compile answered from the facts cache may carry another folder's path
    file, line = Path(c.source.file).name, c.source.line
    # XLA merges the metadata of fused ops as "(a/gather:b/reduce_sum)": any of them may be the op
    tails = {_op_tail(part) for part in (c.op_name or "").split(":")} - {None}
    same_line = [op for op in prop.ops if op.frames and op.frames[0].line == line
                 and Path(op.frames[0].file).name == file and op.name != "func.return"]
    named = [op for op in same_line if _op_tail(op.op_name) in tails]
    found = named or same_line
    chain = _places(c.source_chain)
    if len(chain) > 1:
        called = [op for op in found if _same_callers(_places(op.frames), chain)]
        if called:
            return called
    return found


def _places(frames: Sequence[SourceFrame]) -> tuple[tuple[str, int], ...]:
    """``(file name, line)`` of each frame, innermost first."""
    return tuple((Path(f.file).name, f.line) for f in frames)


def _same_callers(op: tuple[tuple[str, int], ...], chain: tuple[tuple[str, int], ...]) -> bool:
    """Whether an op's frames and a collective's chain agree as far as both go (beyond the innermost)."""
    n = min(len(op), len(chain))
    return n > 1 and op[:n] == chain[:n]


# ---- the reason


def _factor_axes(op: PropagatedOp, axis: str) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """``(operand hits, result hits)``: ``(factor, tensor index, dim)`` for every dimension of the
    op's operands / results sharded over ``axis``."""
    rule = op.rule
    ops_hits, res_hits = [], []
    for which, tensors, shardings in (("o", rule.operands, [o.sharding for o in op.operands]),
                                      ("r", rule.results, list(op.results))):
        for t, factors in enumerate(tensors):
            s = shardings[t] if t < len(shardings) else None
            if s is None:
                continue
            for d, f in enumerate(factors):
                if d < len(s.dims) and any(_base_axis(a.split(":")[0]) == axis for a in s.dims[d]):
                    (ops_hits if which == "o" else res_hits).append((f, t, d))
    return ops_hits, res_hits


def _tensor_has_factor(tensors: tuple[tuple[str, ...], ...], t: int, f: str) -> int | None:
    if t >= len(tensors):
        return None
    for d, g in enumerate(tensors[t]):
        if g == f:
            return d
    return None


@dataclasses.dataclass
class _Ctx:
    prop: Propagation
    inputs: dict[int, LeafReport]
    outputs: Sequence[LeafReport]
    #: a collective's cause names a parameter, not the optimizer moment Shardy picked of the two
    #: (:func:`copied_leaves`); an entry's own origins (:func:`sharding_origins`) keep Shardy's: an
    #: updated moment's sharding does come from the moment given
    originals_first: bool = False

    @functools.cached_property
    def unboxed(self) -> dict[int, LeafReport]:
        """:func:`unboxed_constraints` of this propagation."""
        return unboxed_constraints(self)

    def line(self, op: PropagatedOp) -> str | None:
        """Where ``op`` is written: a sharding constraint's call site (:func:`constraint_line`, past
        the helpers its program's constraints share), any other op's :func:`_line`."""
        return constraint_line(op, shared_constraint_lines(self.prop)) if op.origin_name else _line(op)

    @functools.cached_property
    def originals(self) -> dict[int, int]:
        """:func:`copied_leaves` of this function's used inputs (none unless ``originals_first``)."""
        if not self.originals_first:
            return {}
        cached = _COPIED.get(id(self.prop))
        if cached is not None and cached[0]() is self.prop and cached[1] == self.inputs:
            return cached[2]
        found = copied_leaves(self.inputs)
        _COPIED.clear()  # one propagation at a time: every collective of a function asks about the same one
        _COPIED[id(self.prop)] = (weakref.ref(self.prop), self.inputs, found)
        return found


_COPIED: dict[int, tuple] = {}


def copied_leaves(inputs: dict[int, LeafReport]) -> dict[int, int]:
    """``{entry parameter: entry parameter}``: each input leaf that is a copy of another argument's leaf
    (an optimizer moment of a parameter: ``optimizer/opt_state/0/mu/blocks/1/norm2/bias/value`` of
    ``model/blocks/1/norm2/bias/value``, ``opt_state/m/embed`` of ``params/embed``) → that leaf.

    A prefix of key paths (``optimizer/opt_state/0/mu``) mirrors an argument (``model``) when every used
    input leaf under it has a leaf of that argument at the same remaining path and of the same shape; a
    leaf under a mirroring prefix is a copy of its counterpart when both are compiled with the same
    sharding. Shardy names one origin per mesh axis, and of a parameter and its moments, which carry
    the same sharding into the same ops, it may name the moment: the cause names the leaf whose
    annotation the user wrote instead (:func:`_origin`). A leaf mirrored in several arguments maps to
    the first by path; a leaf under no mirroring prefix is not in the map."""
    by_path = {leaf.path: n for n, leaf in inputs.items()}
    keys = {n: tuple(leaf.path.split("/")) for n, leaf in inputs.items()}
    roots = sorted({k[0] for k in keys.values()})
    mirrors: dict[tuple[tuple[str, ...], str], bool] = {}

    def mirrored(prefix: tuple[str, ...], root: str) -> bool:
        if (prefix, root) not in mirrors:
            mirrors[prefix, root] = all(
                (m := by_path.get("/".join((root, *k[len(prefix):])))) is not None
                and inputs[m].shape == inputs[n].shape
                for n, k in keys.items() if len(k) > len(prefix) and k[:len(prefix)] == prefix)
        return mirrors[prefix, root]

    out: dict[int, int] = {}
    for n, k in sorted(keys.items(), key=lambda x: inputs[x[0]].path):
        found = None
        for root in roots:
            if root == k[0]:
                continue
            for i in range(1, len(k)):
                m = by_path.get("/".join((root, *k[i:])))
                if m is not None and _same_compiled(inputs[n], inputs[m]) and mirrored(k[:i], root):
                    found = m
                    break
            if found is not None:
                break
        if found is not None:
            out[n] = found
    return out


def _same_compiled(a: LeafReport, b: LeafReport) -> bool:
    """Two input leaves of one shape compiled with the same sharding (a PartitionSpec over the mesh, or
    the same sharding of another kind)."""
    if a.shape != b.shape or a.compiled is None or b.compiled is None:
        return False
    if a.compiled.kind == "spec" and b.compiled.kind == "spec":
        rank = len(a.shape)
        return _trim(_compiled_dims(a.compiled, rank)) == _trim(_compiled_dims(b.compiled, rank))
    return a.compiled == b.compiled


def _is_flax_unbox(op: PropagatedOp) -> bool:
    """Whether a sharding constraint is the one Flax Linen applies when it unboxes a partitioned
    parameter (``LogicallyPartitioned.unbox`` / ``Partitioned.unbox``, from ``nn.with_partitioning`` or
    ``nn.with_logical_partitioning``): a frame of that method in a Flax file."""
    return op.name == "sdy.sharding_constraint" and any(
        (f.function or "").endswith("Partitioned.unbox") and "flax" in Path(f.file).parts for f in op.frames)


def unboxed_constraints(ctx: _Ctx) -> dict[int, LeafReport]:
    """``{constraint op index: input leaf}`` for the sharding constraints that re-apply an input
    parameter's own model annotation: Flax's unboxing constraint (:func:`_is_flax_unbox`) on a value
    that is that input (or a view of it), asking for exactly the leaf's declared sharding, the leaf's
    declared sharding coming from the model's annotations (``sharding_source == "model"``). The same
    constraint transposed in the backward pass of a grad (same frames, same op name after the
    transforms, same sharding) is the same annotation. Any other constraint is not in the map: it is
    reported as a constraint at its line."""
    cached = _UNBOXED.get(id(ctx.prop))
    if cached is not None and cached[0]() is ctx.prop and cached[1] == ctx.inputs:
        return cached[2]

    def key(op: PropagatedOp) -> tuple:
        frames = tuple((f.file, f.line, f.column) for f in op.frames)
        return frames, _untransposed(op.op_name or ""), _trim(_dims(op.results[0], 0))

    flax = [op for op in ctx.prop.ops if op.origin_name and op.results and _is_flax_unbox(op)]
    forward: dict[tuple, LeafReport | None] = {}
    for op in flax:
        n = _source_input(ctx, op.operands[0]) if op.operands else None
        leaf = ctx.inputs.get(n) if n is not None else None
        if leaf is None or leaf.sharding_source != "model" or leaf.declared is None or leaf.declared.kind != "spec":
            continue
        rank = len(leaf.shape)
        same = _trim(_dims(op.results[0], rank)) == _trim(_compiled_dims(leaf.declared, rank))
        k = key(op)
        # two parameters behind one key (the same line and module path) would be a guess: neither
        forward[k] = leaf if same and (k not in forward or forward[k] is leaf) else None
    found = {op.index: forward[key(op)] for op in flax if forward.get(key(op)) is not None}
    _UNBOXED.clear()  # one propagation at a time: every collective of a function asks about the same one
    _UNBOXED[id(ctx.prop)] = (weakref.ref(ctx.prop), ctx.inputs, found)
    return found


_UNBOXED: dict[int, tuple] = {}


def _untransposed(op_name: str) -> str:
    """JAX's op name without ``transpose(...)`` wrappers: the backward pass of a grad names an op as
    ``jit(f)/transpose(jvp(M))/dense/sharding_constraint``, its forward ``jit(f)/jvp(M)/dense/...``."""
    segs = []
    for seg in op_name.replace("transpose(", "").split("/"):
        while seg.count(")") > seg.count("("):
            seg = seg[:-1]
        segs.append(seg)
    return "/".join(segs)


def _origin(ctx: _Ctx, axis: str, origin: str | None, own_input: int | None, own_constraint: PropagatedOp | None) -> AxisOrigin:
    """An origin string (``input: 3``, ``constraint_0``, ``self``) as an :class:`AxisOrigin`."""
    if origin == "self":
        if own_input is not None:
            origin = f"input: {own_input}"
        elif own_constraint is not None:
            return _constraint_origin(ctx, axis, own_constraint)
    if origin is None:
        return AxisOrigin(axis, "unknown")
    m = re.fullmatch(r"(input|output): (\d+)", origin)
    if m:
        n = int(m.group(2))
        if m.group(1) == "input":
            if n != own_input:  # Shardy's pick of a moment that copies a parameter's sharding: the parameter
                n = ctx.originals.get(n, n)
            leaf = ctx.inputs.get(n)
            if leaf is None:
                return AxisOrigin(axis, "input", leaf=f"argument {n}")
            return AxisOrigin(axis, "input", leaf.path, leaf.source, leaf.sharding_source)
        leaf = ctx.outputs[n] if n < len(ctx.outputs) else None
        if leaf is None:
            return AxisOrigin(axis, "output", leaf=f"result {n}")
        return AxisOrigin(axis, "output", leaf.path, leaf.source, leaf.sharding_source)
    constraint = ctx.prop.constraint(origin)
    if constraint is not None:
        return _constraint_origin(ctx, axis, constraint)
    return AxisOrigin(axis, "unknown", source=origin)


def _constraint_origin(ctx: _Ctx, axis: str, constraint: PropagatedOp) -> AxisOrigin:
    """A constraint's axis: the input parameter's own annotation when the constraint is Flax re-applying
    it (:func:`unboxed_constraints`), else the constraint at its line."""
    leaf = ctx.unboxed.get(constraint.index)
    if leaf is not None:
        return AxisOrigin(axis, "input", leaf.path, leaf.source, leaf.sharding_source)
    return AxisOrigin(axis, "constraint", source=ctx.line(constraint))


def _line(op: PropagatedOp) -> str | None:
    """The op's line in the user's code: its innermost frame outside the libraries (JAX, Flax, optax,
    Equinox, the standard library, site-packages, stagetool), else its innermost frame."""
    if not op.frames:
        return None
    for f in op.frames:
        if not _is_library(f.file):
            return f"{f.file}:{f.line}"
    return f"{op.frames[0].file}:{op.frames[0].line}"


def _user_places(op: PropagatedOp) -> list[tuple[str, int]]:
    """``(file, line)`` of each of the op's frames in the user's code (outside the libraries), innermost first."""
    return [(f.file, f.line) for f in op.frames if not _is_library(f.file)]


def shared_constraint_lines(prop: Propagation) -> frozenset[tuple[str, int]]:
    """The user lines through which the program's sharding constraints are reached from two or more
    different call chains (the places :func:`constraint_line` may walk past): ``(file, line)`` pairs where, over every constraint whose user frames pass
    through that line, the frames outside it (the rest of the chain, outward) are not all the same.

    Such a line — a helper every model file calls (MaxText's ``maybe_shard_with_logical``, a wrapper
    around ``jax.lax.with_sharding_constraint`` of the user's own project), or a layer that calls it
    (``DenseGeneral``) — names no one constraint; the line outside it does (:func:`constraint_line`).
    A helper with one call site (a loop calling it from one line) is not shared: its line and its
    caller's name the same constraints. Computed once per propagation."""
    cached = _SHARED.get(id(prop))
    if cached is not None and cached[0]() is prop:
        return cached[1]
    outward: dict[tuple[str, int], set[tuple]] = {}
    for op in prop.ops:
        if not op.origin_name:
            continue
        places = _user_places(op)
        for i, place in enumerate(places):
            outward.setdefault(place, set()).add(tuple(places[i + 1:]))
    found = frozenset(place for place, rests in outward.items() if len(rests) >= 2)
    _SHARED.clear()  # one propagation at a time, as _UNBOXED
    _SHARED[id(prop)] = (weakref.ref(prop), found)
    return found


_SHARED: dict[int, tuple] = {}


def constraint_line(op: PropagatedOp, shared: frozenset[tuple[str, int]]) -> str | None:
    """A sharding constraint's origin line: its innermost frame in the user's code (library frames —
    JAX, Flax's ``nn.with_logical_constraint``, Equinox — are walked past, so a library's wrapper
    names its caller), then outward past every thin wrapper to the first line that is not one: the
    call site that is this constraint's own. A line is a thin wrapper when it is shared
    (``shared``, :func:`shared_constraint_lines`: several call chains reach it) and the call on it
    passes on a parameter of its function beyond the first argument (:func:`forwards_parameter`:
    ``with_sharding_constraint(x, P(*axes))``, ``maybe_shard(y, self.out_axes)``: the sharding is its
    caller's). A shared line that writes its own sharding (``P("data", None)``) is the origin: that is
    where the constraint is written. The outermost user frame where every one is a thin wrapper;
    :func:`_line` where the op has no user frame."""
    return constraint_place(op, shared)[0]


def constraint_place(op: PropagatedOp, shared: frozenset[tuple[str, int]]) -> tuple[str | None, tuple[str, ...]]:
    """``(origin line, the thin wrappers walked past)``: :func:`constraint_line`, and the
    ``file:line`` of each wrapper line it walked past, innermost first (``()`` when none)."""
    places = _user_places(op)
    if not places:
        return _line(op), ()
    for i, place in enumerate(places[:-1]):
        if place not in shared or not forwards_parameter(*place):
            return f"{place[0]}:{place[1]}", tuple(f"{f}:{n}" for f, n in places[:i])
    return f"{places[-1][0]}:{places[-1][1]}", tuple(f"{f}:{n}" for f, n in places[:-1])


@functools.lru_cache(maxsize=4096)
def forwards_parameter(file: str, line: int) -> bool:
    """Whether a call on ``line`` of ``file`` passes, as an argument after its first (the array), a
    value built from a parameter of the function that holds the line (``self`` included; or from a
    local assigned from one, ``spec = P(*axes)``): the sharding it applies comes from that
    function's caller. False where the file cannot be read or
    parsed, or the line is in no function."""
    import ast

    tree = _parsed(file)
    if tree is None:
        return False
    holder = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) \
                and node.lineno <= line <= (node.end_lineno or node.lineno):
            if holder is None or node.lineno >= holder.lineno:
                holder = node  # the innermost
    if holder is None:
        return False
    a = holder.args
    params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, *((a.vararg,) if a.vararg else ()),
                              *((a.kwarg,) if a.kwarg else ()))}

    def uses(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in params for n in ast.walk(node))

    # a local built from a parameter is the parameter passed on (``spec = P(*axes)``; ``return f(x, spec)``)
    assigns = [n for n in ast.walk(holder) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               and n.value is not None]
    for _ in range(len(assigns)):
        grown = False
        for n in assigns:
            if uses(n.value):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    for name in ast.walk(t):
                        if isinstance(name, ast.Name) and name.id not in params:
                            params.add(name.id)
                            grown = True
        if not grown:
            break
    for node in ast.walk(holder):
        if isinstance(node, ast.Call) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if any(uses(arg) for arg in (*node.args[1:], *(k.value for k in node.keywords))):
                return True
    return False


@functools.lru_cache(maxsize=256)
def _parsed(file: str):
    import ast

    try:
        return ast.parse(Path(file).read_text())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


@functools.lru_cache(maxsize=4096)
def _is_library(file: str) -> bool:
    from stagetool.core.paths import is_library_file

    return is_library_file(file)


_VIEWS = frozenset({"stablehlo.reshape", "stablehlo.transpose", "stablehlo.convert", "stablehlo.dynamic_slice",
                    "stablehlo.slice", "stablehlo.broadcast_in_dim", "stablehlo.copy", "sdy.data_flow_edge",
                    "sdy.sharding_constraint", "sdy.reshard", "stablehlo.optimization_barrier"})


def _source_input(ctx: _Ctx, o: Operand) -> int | None:
    """The entry argument an operand is a view of (sliced, reshaped, transposed, converted), or None."""
    return _view_of_input(ctx.prop, o)


def _view_of_input(prop: Propagation, o: Operand, depth: int = 0) -> int | None:
    """:func:`_source_input` over the propagation alone."""
    if o.input is not None:
        return o.input
    if o.producer is None or depth > 32:
        return None
    p = prop.ops[o.producer]
    sliced = p.name == "sdy.named_computation" and any(k in (_op_tail(p.op_name) or "")
                                                        for k in ("index_in_dim", "slice", "reshape"))
    if (p.name in _VIEWS or sliced) and p.operands:  # a nested jit of lax.dynamic_index_in_dim is a slice
        return _view_of_input(prop, p.operands[0], depth + 1)
    return None


def _name_operand(ctx: _Ctx, o: Operand) -> str:
    if o.input is not None and o.input in ctx.inputs:
        return ctx.inputs[o.input].path
    viewed = _source_input(ctx, o)
    if viewed is not None and viewed in ctx.inputs:
        return ctx.inputs[viewed].path
    if o.producer is not None:
        p = ctx.prop.ops[o.producer]
        for _ in range(32):  # a data-flow edge is Shardy's bookkeeping: name what it carries
            if p.name != "sdy.data_flow_edge" or not p.operands or p.operands[0].producer is None:
                break
            p = ctx.prop.ops[p.operands[0].producer]
        short = p.name.split(".", 1)[-1]
        if short == "named_computation":  # a nested jax.jit: its name (relu, log_softmax)
            short = _op_tail(p.op_name) or "a nested jit"
        if short == "sharding_constraint":
            return f"the constrained value at {_short(ctx.line(p))}"
        # an op made wholly inside a library (a constant of stagetool's or JAX's own wrapper) has no line of the
        # user's to name
        user = any(not _is_library(f.file) for f in p.frames)
        return f"{short} at {_short(_line(p))}" if user else short
    return "a value"


def _tensor(ctx: _Ctx, name: str, s: ValueSharding | None, axes: Sequence[str], own_input: int | None,
            own_constraint: PropagatedOp | None, producer: int | None = None) -> TensorAt:
    dims = s.dims if s is not None else ()
    text = _fmt(tuple(tuple(_base_axis(a.split(":")[0]) for a in d) for d in dims)) if s is not None else "replicated"
    seen = []
    if s is not None:
        present = sorted(s.axes(), key=lambda a: (a not in axes, a))
        for a in present:
            found = _origin(ctx, a, s.origin(a), own_input, own_constraint)
            if found.kind == "unknown" and found.source is None and producer is not None:
                found = _reshape_origin(ctx, producer, a) or found
            seen.append(found)
    return TensorAt(name, text, tuple(seen))


def _dims_over(s: ValueSharding | None, axis: str) -> int:
    """How many dimensions of a value ``axis`` (or a sub-axis of it) shards."""
    return sum(1 for d in (s.dims if s is not None else ()) if any(a.split(":")[0] == axis for a in d))


def _reshape_origin(ctx: _Ctx, producer: int, axis: str) -> AxisOrigin | None:
    """Where Shardy names no origin for ``axis`` of a value: the ``reshape`` that split a dimension
    sharded over ``axis`` into two (``x.reshape(4, 16, 256)`` of a batch of 64 over 8 devices: the
    axis becomes a sub-axis on each part, and Shardy records no origin past it), found by walking the
    value's producers (at most 32) while they are sharded over the axis, with the origin of the
    reshape's own operand (an input's spec line) as ``leaf``; None when there is no such reshape."""
    index: int | None = producer
    for _ in range(32):
        if index is None:
            return None
        op = ctx.prop.ops[index]
        result = op.results[0] if op.results else None
        if _dims_over(result, axis) == 0:
            return None
        if op.name == "stablehlo.reshape" and op.operands and _dims_over(result, axis) >= 2 \
                and _dims_over(op.operands[0].sharding, axis) == 1:
            o = op.operands[0]
            inner = _origin(ctx, axis, o.sharding.origin(axis) if o.sharding is not None else None, o.input, None)
            if inner.kind == "unknown" and o.producer is not None:
                inner = _reshape_origin(ctx, o.producer, axis) or inner
            return AxisOrigin(axis, "reshape", leaf=inner.describe() if inner.kind != "unknown" else None,
                              source=_line(op))
        index = op.operands[0].producer if op.operands else None
    return None


def cause_of(c: Collective, prop: Propagation, inputs: Sequence[LeafReport],
             outputs: Sequence[LeafReport], feeding: frozenset[int] | None = None) -> CollectiveCause | None:
    """The cause of one collective (see the module docstring), or None when its metadata names no op
    of the propagated module (a collective without a source line, or one XLA made for an op that
    lowering did not emit). ``feeding``: the entry parameters its operands are computed from
    (:func:`stagetool.hlo.collectives.feeding_parameters`): of ops that explain it equally well
    (one source line, op name and callers: ``dense(x, w)`` called for ``wq``, ``wk`` and ``wv``), the
    one more of whose operands are views of those inputs is taken, not the first. A collective XLA
    inserted without metadata (``Collective.nearest``) is matched by the nearest instruction's line,
    and its reason begins ``no metadata of its own; nearest: gather at model.py:5``; a transfer
    between the slices of a multi-slice job (``network == "dcn"``) begins ``between slices over DCN``."""
    cause = _cause_of(c, prop, inputs, outputs, feeding)
    if cause is None:
        return None
    if c.nearest is not None and c.source is not None:
        # XLA inserted it without metadata: the cause is the nearest instruction's that has a line, and says so
        near = f"no metadata of its own; nearest: {_op_tail(c.op_name) or c.nearest} at {_short(f'{c.source.file}:{c.source.line}')}"
        cause = dataclasses.replace(cause, reason=f"{near}; {cause.reason}")
    if c.network == "dcn":
        axes = _axes_text([_base_axis(a) for a in c.mesh_axes or ()])
        cause = dataclasses.replace(cause, reason=f"between slices over DCN ({axes}, the mesh's first axis, spans the "
                                                  f"slices; this is the part of the collective that crosses them); "
                                                  f"{cause.reason}")
    return cause


def _cause_of(c: Collective, prop: Propagation, inputs: Sequence[LeafReport],
              outputs: Sequence[LeafReport], feeding: frozenset[int] | None) -> CollectiveCause | None:
    ctx = _Ctx(prop, {x.parameter: x for x in inputs if x.parameter is not None}, outputs, originals_first=True)
    found = candidates(c, prop)
    if not found:
        return None
    axes = [_base_axis(a) for a in (c.mesh_axes or ())]
    written = [op for op in found if op.name in _WRITTEN]
    if written:  # the program's own collective (lax.psum in a shard_map, ...): not the partitioner's choice
        op = written[0]
        how = "inside a manual computation (shard_map)" if op.name.startswith("stablehlo.") else "an explicit reshard"
        return _record(ctx, op, axes, f"written in the program: {op.name.split('.', 1)[-1]} at {_short(_line(op))}, "
                                      f"{how}; the partitioner did not choose it", [])
    # Several ops of one line and op name (a helper called once per weight, from one line) are told
    # apart by operand: of two of one kind that explain it equally well, the one more of whose
    # operands are views of the inputs the collective's operands are computed from (else the first)
    def fed(op: PropagatedOp) -> int:
        return sum(1 for o in op.operands if _view_of_input(prop, o) in feeding) if feeding else 0

    def kind(op: PropagatedOp) -> tuple:
        return op.name, _op_tail(op.op_name)

    best: tuple[tuple[int, int], PropagatedOp, str, list[tuple[int, str]]] | None = None
    for op in _neighbourhood(found, prop):
        scored = _reason(ctx, c, op, axes)
        if scored is not None and (best is None or scored[0] > best[0] or (
                scored[0] == best[0] and kind(op) == kind(best[1]) and fed(op) > fed(best[1]))):
            best = (scored[0], op, scored[1], scored[2])
    if best is None:
        op = max((x for x in found if kind(x) == kind(found[0])), key=fed)  # the first of the most fed
        reason = (f"no factor of this op is sharded over {_axes_text(axes)} in one tensor and not another: the "
                  "partitioner's choice of how to lay out the op (Shardy records no conflict here)")
        involved: list[tuple[int, str]] = []
    else:
        _, op, reason, involved = best
    return _record(ctx, op, axes, reason, involved)


_WRITTEN = frozenset({"stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_to_all",
                      "stablehlo.collective_permute", "stablehlo.collective_broadcast", "sdy.all_gather",
                      "sdy.all_reduce", "sdy.reduce_scatter", "sdy.all_to_all", "sdy.collective_permute"})
"""Collective ops the program itself holds before partitioning (a ``lax.psum`` inside ``shard_map``
lowers to ``stablehlo.all_reduce``; JAX's explicit sharding emits ``sdy`` collectives)."""


def _neighbourhood(found: list[PropagatedOp], prop: Propagation) -> list[PropagatedOp]:
    """The matched ops, then their users, then their operands' producers (each once, in that order)."""
    out, seen = [], set()
    for group in (found, [prop.ops[u] for op in found for u in op.users],
                  [prop.ops[o.producer] for op in found for o in op.operands if o.producer is not None]):
        for op in group:
            op = _with_top_k_rule(op)
            if op.index not in seen and op.rule is not None:
                seen.add(op.index)
                out.append(op)
    return out


def _with_top_k_rule(op: PropagatedOp) -> PropagatedOp:
    """A ``chlo.top_k`` the rerun gave no factor rule (on TPU, :func:`stagetool.staging.shardy.propagate`)
    with the one XLA's rule has, its sizes unknown: leading dimensions batch, the last needed whole."""
    if op.name != "chlo.top_k" or op.rule is not None or not op.operands or op.operands[0].sharding is None:
        return op
    from stagetool.facts import ShardingRule

    rank = len(op.operands[0].sharding.dims)
    names = [f"d{i}" for i in range(rank - 1)]
    rule = ShardingRule(((*names, "whole"),), ((*names, "k"),) * len(op.results))
    return dataclasses.replace(op, rule=rule)


def _axes_text(axes: Sequence[str]) -> str:
    return " × ".join(f"`{a}`" for a in axes) if axes else "no mesh axis"


def _reason(ctx: _Ctx, c: Collective, op: PropagatedOp,
            axes: Sequence[str]) -> tuple[tuple[int, int], str, list[tuple[int, str]]] | None:
    """``((score, axes explained), sentence, [(operand index or -1 for the result, axis)])``: for each of
    the collective's mesh axes, the conflict at this op that best fits the collective's kind, one
    sentence per conflict naming every axis it holds for (``split over `data` × `fsdp```), then the
    axes with no conflict here; None when no axis has one.

    Three conflicts are read from the op's factor rule: a reduction factor sharded over the axis
    (partial results: all-reduce, reduce-scatter), the axis sharding different factors in different
    tensors (one side is gathered, or moved: all-gather, all-to-all), a factor sharded over the axis in
    some tensors and not in others that have it (all-gather, or a local slice)."""
    rule = op.rule
    if rule is None or not axes:
        return None
    short = op.name.split(".", 1)[-1]
    names = [_name_operand(ctx, o) for o in op.operands]
    per_axis: list[tuple[str, int, str, list[tuple[int, str]]]] = []
    for axis in axes:
        found = _axis_reasons(c, op, axis, short, names)
        if found:
            score, text, involved = max(found, key=lambda x: x[0])
            per_axis.append((axis, score, text, involved))
    if not per_axis:
        return None
    # one sentence per conflict, naming every axis it holds for; then the axes with none here
    groups: dict[str, list[tuple[str, int, list[tuple[int, str]]]]] = {}
    for axis, score, text, involved in per_axis:
        groups.setdefault(text.replace(f"`{axis}`", "`<axis>`"), []).append((axis, score, involved))
    parts = [template.replace("`<axis>`", _axes_text([a for a, _, _ in members])) for template, members in groups.items()]
    covered = {a for a, _, _, _ in per_axis}
    rest = [a for a in axes if a not in covered]
    if rest:
        parts.append(f"no factor of this op is sharded over {_axes_text(rest)} in one tensor and not another "
                     "(the partitioner's choice)")
    involved = [x for _, _, _, inv in per_axis for x in inv]
    return (max(score for _, score, _, _ in per_axis), len(covered)), "; ".join(parts), involved


def _gathered_operand(c: Collective, rule: ShardingRule, whole: list[tuple[int, int]]) -> tuple[int, int]:
    """Of the ``(operand, dimension)`` pairs an op needs whole, the one whose operand the collective
    moves: the operand whose global shape (its factors' sizes) has the rank and, along the other
    dimensions, the sizes of the collective's result (the tokens ``f32[1024,512]`` or the experts'
    weights ``f32[8,512,1024]`` of a ``ragged_dot``); the first where none or several fit."""
    m = re.match(r"^\w+\[([\d,]*)\]$", (c.result_types or ("",))[0])
    if m is None:
        return whole[0]
    result = tuple(int(x) for x in m.group(1).split(",") if x)
    sizes = dict(rule.sizes)
    fits = []
    for t, d in whole:
        shape = tuple(sizes.get(f) for f in rule.operands[t])
        if len(shape) == len(result) and all(a is None or a == b for i, (a, b) in enumerate(zip(shape, result))
                                             if i != d):
            fits.append((t, d))
    return fits[0] if len(fits) == 1 else whole[0]


def _axis_reasons(c: Collective, op: PropagatedOp, axis: str, short: str,
                  names: list[str]) -> list[tuple[int, str, list[tuple[int, str]]]]:
    """Every conflict at ``op`` over one mesh axis, scored by how well it fits the collective's kind."""
    rule = op.rule
    found: list[tuple[int, str, list[tuple[int, str]]]] = []
    o_hits, r_hits = _factor_axes(op, axis)
    if not o_hits and not r_hits:
        return found
    if op.name == "chlo.top_k":
        return _top_k_reasons(c, op, axis, names, o_hits, r_hits)
    if op.name == "chlo.ragged_dot" and rule.operands == (("i", "j"), ("k", "j", "l"), ("k",)):
        whole = [(t, d) for f, t, d in o_hits if (t, d) in ((0, 0), (1, 0))]
        if whole:  # the rows and the groups are needed whole (shardy._ragged_dot_rules)
            t, d = _gathered_operand(c, rule, whole)
            size = dict(rule.sizes).get(rule.operands[t][d])
            what = "its rows, which group_sizes splits into groups" if t == 0 else "its groups, one weight each"
            return [(3 if c.kind == "all-gather" else 2,
                     f"ragged_dot needs dimension {d}{f' (of {size})' if size else ''} of {names[t]} whole on each "
                     f"device ({what}), and it is split over `{axis}` → {c.kind} over `{axis}`", [(t, axis)])]
    red = [(f, t, d) for f, t, d in o_hits if f in rule.reductions]
    if red:
        sharded = sorted({t for _, t, _ in red})
        f = red[0][0]
        others = [t for t in range(len(rule.operands)) if t not in sharded
                  and _tensor_has_factor(rule.operands, t, f) is not None]
        what = "contraction" if short == "dot_general" else "reduction"
        size = dict(rule.sizes).get(f)
        text = (f"{what} over a dimension{f' of {size}' if size else ''} split over `{axis}`: "
                + " and ".join(names[t] for t in sharded) + (" is" if len(sharded) == 1 else " are")
                + " sharded on it")
        if others:
            text += ", " + ", ".join(names[t] for t in others) + " is not (sliced locally)"
        if c.kind in ("all-reduce", "reduce-scatter"):
            tail = "reduce-scattered" if c.kind == "reduce-scatter" else "all-reduced"
            found.append((3, text + f" → each device sums a part; the partial results are {tail}",
                          [(t, axis) for t in sharded]))
        else:  # the partitioner did not sum partial results: it moved the sharded operand instead
            of = f" of {' and '.join(names[t] for t in sharded)}" if c.kind == "all-gather" else ""
            found.append((1, text + f" → {c.kind}{of} over `{axis}` instead of summing a part on each device",
                          [(t, axis) for t in sharded]))
    hits = [(f, ("o", t), d) for f, t, d in o_hits] + [(f, ("r", t), d) for f, t, d in r_hits]
    factors = sorted({f for f, _, _ in hits})
    if len(factors) > 1:
        result_factors = {f for f, w, _ in hits if w[0] == "r"}
        moved = [w for f, w, _ in hits if w[0] == "o" and result_factors and f not in result_factors] or \
            [w for f, w, _ in hits if w[0] == "o" and f != factors[0]]
        kept = [w for f, w, _ in hits if w not in moved]
        if moved and kept:
            verb = "all-gather" if c.kind == "all-gather" else c.kind
            text = (f"`{axis}` shards one dimension of {', '.join(dict.fromkeys(_who(names, w) for w in kept))} "
                    f"and another of {', '.join(dict.fromkeys(_who(names, w) for w in moved))}; an op cannot split "
                    f"two dimensions over one axis → {verb} of "
                    f"{', '.join(dict.fromkeys(_who(names, w) for w in moved))} over `{axis}`")
            score = 3 if c.kind in ("all-gather", "all-to-all") else 2 if c.kind == "collective-permute" else 1
            found.append((score, text, _inv(list(dict.fromkeys(moved + kept)), axis)))
    for f in factors:
        if f in rule.reductions:
            continue
        tensors = [("o", t) for t in range(len(rule.operands))] + [("r", t) for t in range(len(rule.results))]
        having = [w for w in tensors if _tensor_has_factor(rule.operands if w[0] == "o" else rule.results,
                                                           w[1], f) is not None]
        sharded = [w for g, w, _ in hits if g == f]
        missing = [w for w in having if w not in sharded]
        if not missing:
            continue
        gathered = [w for w in sharded if w[0] == "o"] or sharded
        score = 3 if c.kind == "all-gather" else 2 if c.kind in ("all-to-all", "collective-permute") else 1
        via = "at the sharding constraint" if short == "sharding_constraint" else f"at {short}"
        found.append((score, f"{via}: {', '.join(_who(names, w) for w in sharded)} "
                             f"{'is' if len(sharded) == 1 else 'are'} sharded on `{axis}` along a dimension that "
                             f"{', '.join(_who(names, w) for w in missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not → {c.kind} of "
                             f"{', '.join(_who(names, w) for w in gathered)} over `{axis}`",
                      _inv(sharded + missing, axis)))
    return found


def _top_k_reasons(c: Collective, op: PropagatedOp, axis: str, names: list[str], o_hits: list[tuple[str, int, int]],
                   r_hits: list[tuple[str, int, int]]) -> list[tuple[int, str, list[tuple[int, str]]]]:
    """A top-k over a mesh axis: it needs its operand's last dimension whole on each device (XLA's
    rule: that factor needs replication), and none of the others (batch dimensions, the same loop in
    the operand and both results)."""
    rule = op.rule
    sizes = dict(rule.sizes)
    last = len(rule.operands[0]) - 1 if rule.operands else -1
    whole = [(f, d) for f, t, d in o_hits if t == 0 and d == last]
    what = names[0] if names else "its operand"
    if whole:
        size = sizes.get(whole[0][0])
        return [(3 if c.kind == "all-gather" else 2,
                 f"top_k needs the last dimension{f' (of {size})' if size else ''} of {what} whole on each device, "
                 f"and it is split over `{axis}` → {c.kind} over `{axis}`", [(0, axis)])]
    batch = sorted({(f, d) for f, t, d in o_hits if t == 0})
    if not batch:
        return []
    f, d = batch[0]
    size = sizes.get(f)
    kept = any(g == f for g, _, _ in r_hits)
    return [(1, f"`{axis}` splits dimension {d}{f' (of {size})' if size else ''} of {what}, a batch dimension of top_k"
                + (" (its results stay split on it)" if kept else "")
                + f": top_k needs only its last dimension whole, so nothing at it asks for this {c.kind} over "
                  f"`{axis}`; XLA's partitioning of top-k makes it anyway" + (" (redundant)" if kept else ""),
             [(0, axis)])]


def _who(names: list[str], w: tuple[str, int]) -> str:
    return names[w[1]] if w[0] == "o" and w[1] < len(names) else "the result"


def _inv(ws: list[tuple[str, int]], axis: str) -> list[tuple[int, str]]:
    return [(w[1] if w[0] == "o" else -1, axis) for w in ws]


def _record(ctx: _Ctx, op: PropagatedOp, axes: Sequence[str], reason: str,
            involved: list[tuple[int, str]]) -> CollectiveCause:
    operands = []
    for o in op.operands:
        own_constraint = ctx.prop.ops[o.producer] if o.producer is not None and \
            ctx.prop.ops[o.producer].origin_name else None
        operands.append(_tensor(ctx, _name_operand(ctx, o), o.sharding, axes, o.input, own_constraint, o.producer))
    res = op.results[0] if op.results else None
    result = _tensor(ctx, "result", res, axes, None, op if op.origin_name else None) if op.results else None
    origins: list[AxisOrigin] = []
    if op.origin_name:  # the conflict is at a sharding constraint: the constraint is a cause itself
        origins += [AxisOrigin(axis, "constraint", source=ctx.line(op)) for axis in dict.fromkeys(a for _, a in involved)]
    for t, axis in involved:
        tensor = result if t < 0 else operands[t] if t < len(operands) else None
        if tensor is None:
            continue
        for o in tensor.origins:
            if o.axis == axis and o.key not in {x.key for x in origins}:
                origins.append(o)
    named = {o.axis for o in origins if o.kind != "unknown"}  # an unnamed origin beside a named one adds nothing
    origins = [o for o in origins if o.kind != "unknown" or o.axis not in named]
    return CollectiveCause(op.name.split(".", 1)[-1], ctx.line(op), tuple(operands), result, reason, tuple(origins))


# ---- where every entry sharding and constraint came from (for the gate and `stagetool why`)


@dataclasses.dataclass(frozen=True)
class ConstraintFact:
    """One sharding constraint of the program.

    Attributes:
      line: the user's source line (``file:line``), or None.
      sharding: what it asks for, as JAX prints a PartitionSpec.
      name: Shardy's name for it (``constraint_0``), which origins refer to.
      via: the thin wrappers between ``line`` and the constraint itself (``file:line``, innermost
        first: the helper of the project's own that every model file calls), walked past by
        :func:`constraint_place`; None (left out of JSON) when none.
    """

    line: str | None
    sharding: str
    name: str
    via: tuple[str, ...] | None = dataclasses.field(default=None, metadata={"omit": True, "json_omit_none": True})


@dataclasses.dataclass(frozen=True)
class ShardingOrigins:
    """Where each mesh axis of every entry argument and result came from, and the constraints.

    Attributes:
      inputs: per input leaf (in leaf order), the origins of its final sharding's axes; () for an
        unused leaf. A declared sharding's origin is the leaf itself; an ``auto`` leaf's names what
        the partitioner propagated to it.
      outputs: per output leaf, likewise.
      constraints: every sharding constraint, in program order, except those Flax applies when it
        unboxes a parameter (:func:`unboxed_constraints`: the parameter's own annotation).
    """

    inputs: tuple[tuple[AxisOrigin, ...], ...]
    outputs: tuple[tuple[AxisOrigin, ...], ...]
    constraints: tuple[ConstraintFact, ...]


def sharding_origins(prop: Propagation, inputs: Sequence[LeafReport], outputs: Sequence[LeafReport]) -> ShardingOrigins:
    """The :class:`ShardingOrigins` of a propagation whose entry shardings are the compiled ones
    (:func:`unfaithful_reason` is None)."""
    ctx = _Ctx(prop, {x.parameter: x for x in inputs if x.parameter is not None}, outputs)

    def of(s: ValueSharding | None, own_input: int | None, own_output: int | None = None) -> tuple[AxisOrigin, ...]:
        if s is None:
            return ()
        # a result's own sharding (``self``) is the one out_shardings declares for it
        return tuple(_origin(ctx, a, f"output: {own_output}" if own_output is not None and s.origin(a) == "self"
                             else s.origin(a), own_input, None) for a in sorted(s.axes()))

    ins = tuple(of(prop.inputs[x.parameter], x.parameter) if x.parameter is not None and x.parameter < len(prop.inputs)
                else () for x in inputs)
    outs = tuple(of(s, None, i) for i, s in enumerate(prop.outputs))
    constraints = []
    for op in prop.ops:
        if op.origin_name and op.results:
            if op.index in ctx.unboxed:  # a parameter's own annotation, re-applied by Flax: not a constraint of its own
                continue
            line, via = constraint_place(op, shared_constraint_lines(prop))
            constraints.append(ConstraintFact(line, _tensor(ctx, "", op.results[0], (), None, op).sharding,
                                              op.origin_name, via or None))
    return ShardingOrigins(ins, outs, tuple(constraints))


def with_custom_rules(section: Any, rules: Sequence[tuple[str, str, str]]) -> Any:
    """``section`` (a :class:`~stagetool.analysis.sections.CollectivesSection`) with the cause of each
    collective that a ``custom_partitioning`` rule asked for naming the rule: a collective at the
    line of a ``custom_partitioning`` call (``rules``: ``(call line, rule, rule line)``, from
    :func:`stagetool.staging.equations.custom_partitioning_rules`) whose cause is the op's
    ``custom_call`` and otherwise "the partitioner's choice" is the layout the rule's
    ``arg_shardings`` or result sharding asked for, and says so with the rule's line."""
    from pathlib import Path

    def key(line: str | None) -> tuple[str, str] | None:
        if not line or ":" not in line:
            return None
        file, _, rest = line.rpartition(":")
        if not rest.isdigit() and ":" in file:  # file:line:col
            file, _, rest = file.rpartition(":")
        return Path(file).name, rest

    by_line: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for call, rule, rule_line in rules:
        k = key(call)
        if k is not None:
            by_line.setdefault(k, []).append((rule, rule_line))
    if not by_line:
        return section
    items = []
    for item in section.items:
        cause = item.cause
        found = by_line.get(key(item.source)) if item.source else None
        if found and cause is not None and cause.op in ("custom_call", "custom_partitioning") \
                and "partitioner's choice" in cause.reason:
            rule, rule_line = found[0]
            axes = _axes_text([_base_axis(a) for a in (item.collective.mesh_axes or ())])
            reason = (f"the custom_partitioning rule {rule} ({_short(rule_line)}), called at {_short(item.source)}, "
                      f"asks for a layout of its operands or result without {axes} (its arg_shardings / result "
                      f"sharding), so the partitioner makes this {item.collective.kind} to give it that")
            item = dataclasses.replace(item, cause=dataclasses.replace(cause, reason=reason))
        items.append(item)
    return dataclasses.replace(section, items=tuple(items))
