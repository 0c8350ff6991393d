"""Work computed whole on every device of a mesh axis: the answer to "why is this not faster on 8 devices?".

The SPMD partitioner may make an operand whole (an all-gather over a mesh axis) and then compute an
op on it, so that every device of the axis does the same work: ``vmap(fft)`` over a batch sharded
on ``data`` all-gathers the batch and each device transforms all of it; a ``ragged_dot`` whose expert
weights are gathered does the whole dot on each device.

This module finds such instructions in one device's compiled module by a replication analysis of
its entry computation (and the bodies of its ``while`` loops): for each value, the mesh axes over
which every device holds the same value.

* an entry parameter is the same across the axes its ``sharding`` does not split (its tile
  assignment read against the mesh); a constant or ``iota`` across every axis; ``partition-id`` and
  ``replica-id`` across none;
* an ``all-gather`` or ``all-reduce`` makes its result the same across the axes its groups span (on
  top of its operand's); ``reduce-scatter``, ``all-to-all`` and ``collective-permute`` make it differ
  across them;
* any other instruction is the same across the axes all its operands are (a fusion that reads
  ``partition-id`` inside differs across every axis).

An instruction computed the same across axes ``A`` (devices ``n`` = the product of their sizes)
although data it depends on was split over ``A`` (a parameter sharded over an axis of ``A``, or a
gather over it) does ``n``-fold redundant work. It is listed (:class:`ReplicatedWork`) when its
FLOPs per device (XLA's HloCostAnalysis rules, :func:`stagetool.hlo.loops.instruction_cost`)
are at least :data:`MIN_FLOPS` and :data:`MIN_SHARE` of the device's total.
"""

from __future__ import annotations

import dataclasses
import math
import re

from stagetool.hlo.collectives import Collective, MeshAxes, _iota_ids, frames_by_op_name
from stagetool.hlo.parser import HloComputation, HloInstruction, HloModule

MIN_FLOPS = 1_000_000
"""Smallest per-device FLOPs of an instruction listed as replicated work (one execution)."""
MIN_SHARE = 0.01
"""Smallest share of the device's counted FLOPs an instruction must have to be listed."""

_GATHERING = frozenset({"all-gather", "all-reduce", "all-gather-start", "all-reduce-start"})
_SPLITTING = frozenset({"reduce-scatter", "all-to-all", "collective-permute", "collective-permute-start"})
_DIFFERENT = frozenset({"partition-id", "replica-id", "rng", "rng-bit-generator", "rng-get-and-update-state"})
_SAME = frozenset({"constant", "iota"})
_DEVICES = re.compile(r"devices=\[([\d,]+)\](\S*)")


@dataclasses.dataclass(frozen=True)
class ReplicatedWork:
    """One instruction every device of some mesh axes computes whole, from data that was split over them.

    Attributes:
      instruction: the HLO instruction's name (one device's compiled module).
      opcode: its opcode (``fft``, ``dot``, ``fusion``...).
      axes: the mesh axes over which every device computes the same result, mesh order.
      devices: the devices doing the same work (the product of those axes' sizes).
      flops: FLOPs per step on one device: one execution's × ``executions`` (XLA's HloCostAnalysis
        rules, a Pallas kernel's ``cost_estimate``; a derived figure).
      share: ``flops`` over the device's FLOPs per step (the loop-aware count; 0..1).
      made_whole_by: the collective that made its input whole over ``axes`` (``all-gather.3``), or None
        when the input came in replicated over them while other inputs were split.
      made_whole_source: ``file:line`` of that collective, or None.
      op_name: JAX's op name, or None.
      source: ``file:line`` of the user's code, or None.
      executions: runs per step: 1, or the trip counts of the loops around it multiplied (an
        unknown trip count counts once).
      flops_per_execution: FLOPs of one run on one device.
    """

    instruction: str
    opcode: str
    axes: tuple[str, ...]
    devices: int
    flops: float
    share: float
    made_whole_by: str | None
    made_whole_source: str | None
    op_name: str | None
    source: str | None
    executions: int = 1
    flops_per_execution: float | None = None


def sharding_replicated_axes(sharding: str | None, mesh: MeshAxes) -> frozenset[str]:
    """The mesh axes over which an HLO ``sharding={...}`` value gives every device the same data.

    ``{replicated}`` (or no sharding) is every axis; ``{maximal device=N}`` none; a tiled
    ``devices=[t0,..](<=[dims](T(perm))| explicit ids) [last_tile_dim_replicate | last_tile_dims={...}]``
    is read against the mesh (partition ids are positions in the mesh's device order): axis ``A`` is
    replicated when moving along ``A`` never changes the tile a device holds. A tuple sharding is
    the intersection of its parts. Unknown forms give the empty set (nothing claimed).
    """
    every = frozenset(n for n, s in zip(mesh.names, mesh.sizes) if s > 1)
    if not sharding or sharding.strip("{} ") == "replicated":
        return every
    text = sharding.strip()
    if text.startswith("{{"):
        parts = re.findall(r"\{([^{}]*)\}", text[1:-1])
        out = every
        for p in parts:
            out &= sharding_replicated_axes("{" + p + "}", mesh)
        return out
    if "maximal" in text or "manual" in text.split("last_tile_dims")[0]:
        return frozenset()
    m = _DEVICES.search(text)
    if m is None:
        return frozenset()
    tile = [int(v) for v in m.group(1).split(",")]
    n = math.prod(tile)
    if n != math.prod(mesh.sizes):
        return frozenset()
    rest = m.group(2)
    iota = re.match(r"<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if iota:
        ids = [int(v) for v in _iota_ids([int(v) for v in iota.group(1).split(",")],
                                         [int(v) for v in iota.group(2).split(",")] if iota.group(2) else None)]
    else:
        after = text[m.end(1) + 1:]
        ids = [int(v) for v in re.findall(r"\d+", after.split("last_tile")[0].split("metadata")[0])][:n]
        if len(ids) != n:
            return frozenset()
    data_dims = len(tile)
    if "last_tile_dim_replicate" in text:
        data_dims -= 1
    elif "last_tile_dims" in text:
        data_dims -= text.split("last_tile_dims", 1)[1].split("}", 1)[0].count(",") + 1
    # tile coordinate (data dims only) of every device
    coord: dict[int, tuple[int, ...]] = {}
    for pos, device in enumerate(ids):
        c, rem = [], pos
        for size in reversed(tile):
            c.append(rem % size)
            rem //= size
        coord[device] = tuple(reversed(c))[:data_dims]
    out = set()
    strides = [math.prod(mesh.sizes[i + 1:]) for i in range(len(mesh.sizes))]
    for axis, size, stride in zip(mesh.names, mesh.sizes, strides):
        if size > 1 and all(coord.get(d) == coord.get(d - ((d // stride) % size) * stride) for d in range(n)):
            out.add(axis)
    return frozenset(out)


_State = tuple  # (same axes, split axes, {axis: collective that made it whole})


def _meet(states: list[_State], every: frozenset[str]) -> _State:
    """The state of a value computed from ``states``: the same where all are, split where any was."""
    if not states:
        return every, frozenset(), {}
    whole: dict[str, str] = {}
    for st in states:
        whole.update(st[2])
    return (frozenset.intersection(*(st[0] for st in states)), frozenset().union(*(st[1] for st in states)), whole)


class _Analysis:
    """Per value: the axes over which every device holds the same data, the axes data it came from
    was split over, and which collective made it whole. Tuples (a ``while`` loop's state) are
    followed element by element, so a sharded element carried beside replicated ones (XLA:TPU's loop
    state holding a layer stack's shard) does not make the others differ. ``runs[computation]``: how
    many times a computation runs per step (loop bodies × their trip counts; an unknown trip count
    counts once)."""

    def __init__(self, module: HloModule, mesh: MeshAxes, collectives: tuple[Collective, ...],
                 trips: dict[str, int | None] | None = None):
        self.module, self.mesh = module, mesh
        self.every = frozenset(n for n, s in zip(mesh.names, mesh.sizes) if s > 1)
        self.coll = {(c.computation, c.name): c for c in collectives}
        # fused computations that hold (part of) a collective: XLA:TPU's async collective fusions
        self.fused = {comp: c for c in collectives if c.fusion is not None
                      for comp in (c.computation, *(m[0] for m in c.merged))}
        self.trips = trips or {}
        self.state: dict[tuple[str, str], _State] = {}
        self.elems: dict[tuple[str, str], list[_State]] = {}  # a tuple-valued instruction's elements
        self.runs: dict[str, int] = {}

    @property
    def same(self) -> dict[tuple[str, str], frozenset[str]]:
        return {k: v[0] for k, v in self.state.items()}

    def _reads_partition_id(self, ins: HloInstruction, depth: int = 0) -> bool:
        for name in ins.called_computations:
            comp = self.module.computation(name.lstrip("%"))
            if comp is None or depth > 8:
                continue
            for i in comp.instructions:
                if i.opcode in _DIFFERENT or self._reads_partition_id(i, depth + 1):
                    return True
        return False

    def _fused_gather(self, ins: HloInstruction) -> Collective | None:
        c = self.fused.get(ins.called_computations[0].lstrip("%"))
        return c if c is not None and c.kind in ("all-gather", "all-reduce") and c.mesh_axes is not None else None

    def _whole(self, key: tuple[str, str]) -> _State:
        elems = self.elems.get(key)
        return _meet(elems, self.every) if elems else self.state.get(key, (frozenset(), frozenset(), {}))

    def run(self, comp: HloComputation, param: list[_State] | _State | None, runs: int = 1) -> None:
        self.runs[comp.name] = max(self.runs.get(comp.name, 0), runs)
        for ins in comp.instructions:
            key = (comp.name, ins.name)
            ops = [(comp.name, o) for o in ins.operands]
            same, split, whole = _meet([self._whole(k) for k in ops], self.every)
            op = ins.opcode
            elems: list[_State] | None = None
            if op == "parameter":
                if param is None:  # the entry computation: the argument's sharding
                    same = sharding_replicated_axes(ins.attributes.get("sharding"), self.mesh)
                    split, whole = self.every - same, {}
                elif isinstance(param, list):
                    elems = list(param)
                    same, split, whole = _meet(elems, self.every)
                else:
                    same, split, whole = param
            elif op == "tuple":
                elems = [self._whole(k) for k in ops]
            elif op == "get-tuple-element" and ops and ops[0] in self.elems:
                index = ins.attributes.get("index", "")
                parts = self.elems[ops[0]]
                if index.isdigit() and int(index) < len(parts):
                    same, split, whole = parts[int(index)]
            elif op in _SAME:
                same = self.every
            elif op in _DIFFERENT:
                same = frozenset()
            elif op in _GATHERING or op in _SPLITTING:
                c = self.coll.get(key)
                axes = frozenset(c.mesh_axes or ()) if c is not None else frozenset()
                if op in _GATHERING and c is not None and c.mesh_axes is not None:
                    same = same | axes
                    whole = {**whole, **{a: ins.name for a in axes}}
                else:
                    same = same - axes if c is not None and c.mesh_axes is not None else frozenset()
            elif op == "while":
                body = self.module.computation(ins.attributes.get("body", "").lstrip("%"))
                if body is not None:
                    trips = self.trips.get(ins.name)
                    init = self.elems.get(ops[0]) if ops else None
                    carried: list[_State] | _State = list(init) if init else (same, split, whole)
                    for _ in range(2):  # what the loop carries: its init, then init ∩ the body's result
                        self.run(body, carried, runs * (trips or 1))
                        root = body.root
                        rk = (body.name, root.name) if root else None
                        out = self.elems.get(rk) if rk else None
                        if isinstance(carried, list) and out and len(out) == len(carried):
                            carried = [(c[0] & o[0], c[1] | o[1], {**c[2], **o[2]}) for c, o in zip(carried, out)]
                        else:
                            got = self._whole(rk) if rk else (frozenset(), frozenset(), {})
                            flat = _meet(carried, self.every) if isinstance(carried, list) else carried
                            carried = (flat[0] & got[0], flat[1] | got[1], {**flat[2], **got[2]})
                    if isinstance(carried, list):
                        elems = carried
                        same, split, whole = _meet(carried, self.every)
                    else:
                        same, split, whole = carried
            elif op == "fusion" and ins.called_computations and self._fused_gather(ins) is not None:
                c = self._fused_gather(ins)  # a start, continuation or done fusion of an async all-gather
                axes = frozenset(c.mesh_axes or ())
                same, whole = same | axes, {**whole, **{a: c.name for a in axes}}
            elif ins.called_computations and self._reads_partition_id(ins):
                same = frozenset()
            self.state[key] = (same, split, whole)
            if elems is not None:
                self.elems[key] = elems


def _source(module: HloModule, ins: HloInstruction | None, comp: HloComputation | None = None) -> str | None:
    """``file:line`` of the user's code for ``ins``: the innermost frame of its source chain outside the
    libraries (the model's line that called Flax's ``nnx.Linear``, not ``linear.py``'s), else its own
    innermost frame; for an instruction the compiler made without metadata (a fusion XLA:CPU formed),
    that of the nearest operand with one (breadth first, 3 deep)."""
    from stagetool.analysis.callers import user_source

    seen: set[str] = set()
    level = [ins] if ins is not None else []
    for _ in range(4):
        nxt = []
        for i in level:
            chain = frames_by_op_name(module, i)
            if chain:
                return user_source(chain)
            if comp is not None:
                for o in i.operands:
                    found = comp.instruction(o)
                    if found is not None and o not in seen:
                        seen.add(o)
                        nxt.append(found)
        level = nxt
    return None


def replicated_work(module: HloModule, mesh: MeshAxes, collectives: tuple[Collective, ...],
                    total_flops: float | None = None,
                    trips: dict[str, int | None] | None = None) -> tuple[ReplicatedWork, ...]:
    """The instructions of one device's compiled ``module`` that every device of some mesh axes
    computes whole from data split over those axes, heaviest per step first (ties by name).

    Args:
      module: the compiled, partitioned module (one device's program).
      mesh: the user's mesh.
      collectives: ``find_collectives(module, mesh)``: their mesh axes.
      total_flops: the device's FLOPs per step to take shares of (the loop-aware figure: every loop
        body × its trip count); default: counted from the module so.
      trips: ``{while name: trip count}`` (:func:`stagetool.hlo.collectives.while_loops`): an
        instruction in a loop body runs that many times per step; default: read from the module.

    Listed: at least :data:`MIN_FLOPS` FLOPs per step and :data:`MIN_SHARE` of ``total_flops``.
    """
    from stagetool.hlo.collectives import while_loops
    from stagetool.hlo.loops import counted_cost_per_step, instruction_cost

    if module.entry is None or not any(s > 1 for s in mesh.sizes):
        return ()
    trips = dict(while_loops(module)) if trips is None else trips
    total = total_flops if total_flops and total_flops > 0 else counted_cost_per_step(module, trips).flops
    if total <= 0:
        return ()
    a = _Analysis(module, mesh, collectives, trips)
    a.run(module.entry, None)
    out = []
    for (comp_name, name), (same, split, whole_by) in a.state.items():
        axes = same & split
        if not axes:
            continue
        comp = module.computation(comp_name)
        ins = comp.instruction(name) if comp else None
        if ins is None or ins.opcode in ("while", "call", "conditional", "tuple", "get-tuple-element",
                                         "parameter") or ins.opcode in _GATHERING:
            continue
        runs = a.runs.get(comp_name, 1)
        once = instruction_cost(module, comp, ins).flops
        flops = once * runs
        if flops < MIN_FLOPS or flops < MIN_SHARE * total:
            continue
        ordered = tuple(n for n in mesh.names if n in axes)
        devices = math.prod(s for n, s in zip(mesh.names, mesh.sizes) if n in axes)
        by = sorted({whole_by[x] for x in ordered if x in whole_by})
        made = by[0] if by else None
        made_ins = comp.instruction(made) if made and comp else None
        if made and made_ins is None:
            made_ins = next((c.instruction(made) for c in module.computations if c.instruction(made)), None)
        md = ins.metadata
        out.append(ReplicatedWork(name, ins.opcode, ordered, devices, flops, min(flops / total, 1.0), made,
                                  _source(module, made_ins), md.op_name if md else None, _source(module, ins, comp),
                                  runs, once))
    out.sort(key=lambda r: (-r.flops, r.instruction))
    return tuple(out)
