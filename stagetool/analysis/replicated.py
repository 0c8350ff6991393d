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

from stagetool.hlo.collectives import Collective, MeshAxes, _iota_ids, program_frames
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
      flops: FLOPs of one execution on one device (XLA's HloCostAnalysis rules; a derived figure).
      share: ``flops`` over the device's counted FLOPs (0..1).
      made_whole_by: the collective that made its input whole over ``axes`` (``all-gather.3``), or None
        when the input came in replicated over them while other inputs were split.
      made_whole_source: ``file:line`` of that collective, or None.
      op_name: JAX's op name, or None.
      source: ``file:line`` of the user's code, or None.
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


class _Analysis:
    def __init__(self, module: HloModule, mesh: MeshAxes, collectives: tuple[Collective, ...]):
        self.module, self.mesh = module, mesh
        self.every = frozenset(n for n, s in zip(mesh.names, mesh.sizes) if s > 1)
        self.coll = {(c.computation, c.name): c for c in collectives}
        self.same: dict[tuple[str, str], frozenset[str]] = {}   # axes over which the value is the same
        self.split: dict[tuple[str, str], frozenset[str]] = {}  # axes its inputs were split over upstream
        self.whole_by: dict[tuple[str, str], dict[str, str]] = {}  # axis -> collective that made it whole

    def _reads_partition_id(self, ins: HloInstruction, depth: int = 0) -> bool:
        for name in ins.called_computations:
            comp = self.module.computation(name.lstrip("%"))
            if comp is None or depth > 8:
                continue
            for i in comp.instructions:
                if i.opcode in _DIFFERENT or self._reads_partition_id(i, depth + 1):
                    return True
        return False

    def run(self, comp: HloComputation, params: dict[int, tuple[frozenset, frozenset, dict]] | None) -> None:
        for ins in comp.instructions:
            key = (comp.name, ins.name)
            ops = [(comp.name, o) for o in ins.operands]
            same = frozenset.intersection(*(self.same.get(k, frozenset()) for k in ops)) if ops else self.every
            split = frozenset().union(*(self.split.get(k, frozenset()) for k in ops)) if ops else frozenset()
            whole: dict[str, str] = {}
            for k in ops:
                whole.update(self.whole_by.get(k, {}))
            op = ins.opcode
            if op == "parameter":
                number = ins.parameter_number
                if params is None:  # the entry computation: the argument's sharding
                    same = sharding_replicated_axes(ins.attributes.get("sharding"), self.mesh)
                    split = self.every - same
                else:
                    same, split, whole = params.get(number, (frozenset(), frozenset(), {}))
            elif op in _SAME:
                same = self.every
            elif op in _DIFFERENT:
                same = frozenset()
            elif op in _GATHERING or op in _SPLITTING:
                c = self.coll.get(key)
                axes = frozenset(c.mesh_axes or ()) if c is not None else frozenset()
                if op in _GATHERING and c is not None and c.mesh_axes is not None:
                    same = same | axes
                    whole.update({a: ins.name for a in axes})
                else:
                    same = same - axes if c is not None and c.mesh_axes is not None else frozenset()
            elif op == "while":
                body = self.module.computation(ins.attributes.get("body", "").lstrip("%"))
                if body is not None:
                    carried = (same, split, whole)
                    for _ in range(2):  # what the loop carries: its init, then init ∩ the body's result
                        self.run(body, {0: carried})
                        root = body.root
                        rk = (body.name, root.name) if root else None
                        carried = (carried[0] & self.same.get(rk, frozenset()),
                                   carried[1] | self.split.get(rk, frozenset()), carried[2])
                    same, split = carried[0], carried[1]
            elif ins.called_computations and self._reads_partition_id(ins):
                same = frozenset()
            self.same[key], self.split[key], self.whole_by[key] = same, split, whole


def _source(module: HloModule, ins: HloInstruction | None, comp: HloComputation | None = None) -> str | None:
    """``file:line`` of the user's code for ``ins``; for an instruction the compiler made without
    metadata (a fusion XLA:CPU formed), that of the nearest operand with one (breadth first, 3 deep)."""
    seen: set[str] = set()
    level = [ins] if ins is not None else []
    for _ in range(4):
        nxt = []
        for i in level:
            chain = program_frames(module.source_stack(i))
            if chain:
                return f"{chain[0].file}:{chain[0].line}"
            if comp is not None:
                for o in i.operands:
                    found = comp.instruction(o)
                    if found is not None and o not in seen:
                        seen.add(o)
                        nxt.append(found)
        level = nxt
    return None


def replicated_work(module: HloModule, mesh: MeshAxes, collectives: tuple[Collective, ...],
                    total_flops: float | None = None) -> tuple[ReplicatedWork, ...]:
    """The instructions of one device's compiled ``module`` that every device of some mesh axes
    computes whole from data split over those axes, heaviest first (ties by name).

    Args:
      module: the compiled, partitioned module (one device's program).
      mesh: the user's mesh.
      collectives: ``find_collectives(module, mesh)``: their mesh axes.
      total_flops: the device's FLOPs to take shares of; default: counted from the module.

    Listed: at least :data:`MIN_FLOPS` FLOPs and :data:`MIN_SHARE` of ``total_flops``.
    """
    from stagetool.hlo.loops import counted_cost, instruction_cost

    if module.entry is None or not any(s > 1 for s in mesh.sizes):
        return ()
    total = total_flops if total_flops and total_flops > 0 else counted_cost(module).flops
    if total <= 0:
        return ()
    a = _Analysis(module, mesh, collectives)
    a.run(module.entry, None)
    out = []
    for (comp_name, name), same in a.same.items():
        axes = same & a.split.get((comp_name, name), frozenset())
        if not axes:
            continue
        comp = module.computation(comp_name)
        ins = comp.instruction(name) if comp else None
        if ins is None or ins.opcode in ("while", "call", "conditional") or ins.opcode in _GATHERING:
            continue
        flops = instruction_cost(module, comp, ins).flops
        if flops < MIN_FLOPS or flops < MIN_SHARE * total:
            continue
        ordered = tuple(n for n in mesh.names if n in axes)
        devices = math.prod(s for n, s in zip(mesh.names, mesh.sizes) if n in axes)
        by = sorted({a.whole_by[(comp_name, name)][x] for x in ordered if x in a.whole_by[(comp_name, name)]})
        made = by[0] if by else None
        made_ins = comp.instruction(made) if made and comp else None
        if made and made_ins is None:
            made_ins = next((c.instruction(made) for c in module.computations if c.instruction(made)), None)
        md = ins.metadata
        out.append(ReplicatedWork(name, ins.opcode, ordered, devices, flops, flops / total, made,
                                  _source(module, made_ins), md.op_name if md else None, _source(module, ins, comp)))
    out.sort(key=lambda r: (-r.flops, r.instruction))
    return tuple(out)
