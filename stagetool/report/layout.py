"""Which shard of a leaf each device of the mesh holds, computed from the report alone (no JAX).

A leaf's compiled sharding is a PartitionSpec text (``P('data', None)``, ``P(('data', 'fsdp'), 'model')``)
over the report's mesh (``(name, size)`` pairs, row-major). Device ``i`` is position ``i`` in
``mesh.devices.flat`` (which is also its HLO device id); its coordinate along each mesh axis comes
from ``i`` in row-major order. A dimension sharded over axes ``(a, b)`` (major first) is cut into
``size(a) × size(b)`` equal blocks, and the device's block number is its coordinates along ``a``
and ``b`` read as a mixed-radix number, ``a`` most significant: what
``NamedSharding.devices_indices_map`` gives (tests check it against JAX).
"""

from __future__ import annotations

import ast
import dataclasses
import math
from typing import Sequence

from stagetool.core.sharding import Sharding

Dims = tuple[tuple[str, ...], ...]
"""Per array dimension, the mesh axes that shard it, major first; ``()`` for a replicated dimension."""


def parse_partition_spec(text: Sharding | str | None, rank: int) -> Dims | None:
    """``P('data', None)`` → ``(('data',), ())``, padded with ``()`` to ``rank``.

    Accepts a :class:`stagetool.core.sharding.Sharding` (``LeafReport.compiled``: its ``dims`` hold
    ``None``, a name, or a tuple of names per dimension) or its printed form (``P('data', None)``,
    as a snapshot stores it). Returns None for anything that is not a PartitionSpec (an opaque sharding's ``repr``,
    ``auto``, ``unspecified``) or that has more dimensions than ``rank``.
    """
    if isinstance(text, Sharding):
        if text.kind != "spec":
            return None  # auto, unspecified, or a sharding no PartitionSpec over the mesh expresses
        raw = text.dims
    elif isinstance(text, str):
        s = text.strip()
        for head in ("PartitionSpec(", "P("):
            if s.startswith(head) and s.endswith(")"):
                body = s[len(head):-1]
                break
        else:
            return None
        try:
            raw = ast.literal_eval("(" + body + ("," if body.strip() and not body.rstrip().endswith(",") else "") + ")")
        except (ValueError, SyntaxError):
            return None
    else:
        return None
    dims: list[tuple[str, ...]] = []
    for d in raw:
        if d is None:
            dims.append(())
        elif isinstance(d, str):
            dims.append((d,))
        elif isinstance(d, (tuple, list)) and all(isinstance(a, str) for a in d):
            dims.append(tuple(d))
        else:
            return None
    if len(dims) > rank:
        return None
    return tuple(dims) + ((),) * (rank - len(dims))


@dataclasses.dataclass(frozen=True)
class DeviceShard:
    """What one device holds of a leaf.

    Attributes:
      device: position in ``mesh.devices.flat`` (the HLO device id).
      coords: the device's coordinate along each mesh axis, in mesh order.
      block: per array dimension, the block index the device holds (0 where the dimension is not
        sharded).
      ranges: per array dimension, ``(start, stop)`` of the elements the device holds.
      shard_id: a number shared by the devices that hold the same block (replicas), numbered in
        order of first appearance over the devices: the colour of a grid cell.
    """

    device: int
    coords: tuple[int, ...]
    block: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    shard_id: int


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """The device → shard assignment of one leaf on a mesh.

    Attributes:
      shape: the leaf's global shape.
      dims: per array dimension, the mesh axes that shard it (major first).
      axes: the mesh's ``(name, size)`` pairs.
      devices: one entry per device, in ``mesh.devices.flat`` order.
      shard_count: distinct blocks (1 for a replicated leaf).
      replicas: devices holding each block (mesh size / shard count).
    """

    shape: tuple[int, ...]
    dims: Dims
    axes: tuple[tuple[str, int], ...]
    devices: tuple[DeviceShard, ...]
    shard_count: int
    replicas: int

    @property
    def replicated_over(self) -> tuple[str, ...]:
        """The mesh axes no dimension uses: the leaf is copied along them."""
        used = {a for d in self.dims for a in d}
        return tuple(n for n, s in self.axes if n not in used and s > 1)


def device_coords(index: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of flat position ``index`` in a mesh of ``sizes``."""
    coords = []
    for s in reversed(sizes):
        coords.append(index % s)
        index //= s
    return tuple(reversed(coords))


def leaf_layout(shape: Sequence[int], sharding: Sharding | str | None, axes: Sequence[tuple[str, int]]) -> LeafLayout | None:
    """The device → shard assignment of a leaf, or None when it cannot be drawn.

    Args:
      shape: the leaf's global shape.
      sharding: its compiled sharding (PartitionSpec text, see :func:`parse_partition_spec`).
      axes: the mesh's ``(name, size)`` pairs in mesh order (``MeshReport.axes``).

    Returns None for an unused leaf (no compiled sharding), an opaque sharding, a PartitionSpec that
    names an axis not in the mesh, or a dimension not divisible by its axes' sizes.
    """
    shape = tuple(int(x) for x in shape)
    dims = parse_partition_spec(sharding, len(shape))
    axes = tuple((str(n), int(s)) for n, s in axes)
    if dims is None:
        return None
    size_of = dict(axes)
    if any(a not in size_of for d in dims for a in d):
        return None
    names = [n for n, _ in axes]
    sizes = [s for _, s in axes]
    counts = [math.prod(size_of[a] for a in d) for d in dims]
    if any(n % c for n, c in zip(shape, counts)):
        return None
    first: dict[tuple[int, ...], int] = {}
    devices = []
    for i in range(math.prod(sizes)):
        coords = device_coords(i, sizes)
        block = []
        for d in dims:
            b = 0
            for a in d:
                b = b * size_of[a] + coords[names.index(a)]
            block.append(b)
        block_t = tuple(block)
        ranges = tuple((b * (n // c), (b + 1) * (n // c)) for b, n, c in zip(block_t, shape, counts))
        sid = first.setdefault(block_t, len(first))
        devices.append(DeviceShard(i, coords, block_t, ranges, sid))
    shards = len(first)
    return LeafLayout(shape, dims, axes, tuple(devices), shards, len(devices) // shards if shards else 0)


def ranges_text(ranges: Sequence[tuple[int, int]]) -> str:
    """``0:8,0:128``: the ``data-shard`` form of a device's element ranges (start:stop per dimension)."""
    return ",".join(f"{a}:{b}" for a, b in ranges)
