"""A sharding as structure: which mesh axes shard each dimension, or that the compiler chooses.

One value for the spec's declared shardings, the compiled shardings read back from JAX, and the
report; rendered as JAX prints a ``PartitionSpec`` (``P('data', None)``) only at the edges.
"""

from __future__ import annotations

import dataclasses
from typing import Union


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A sharding as structure: the spec's, or the compiled program's read back from JAX.

    Attributes:
      kind: ``"spec"`` (a PartitionSpec over the mesh's axes), ``"auto"`` (the partitioner
        chooses), ``"unspecified"`` (no sharding given: replicated on the mesh for inputs; the
        compiler's choice for outputs), or ``"other"`` (a compiled sharding that no PartitionSpec
        over the mesh expresses; ``text`` holds JAX's description).
      dims: for ``"spec"``, one entry per array dimension: None (not sharded), a mesh axis name, or a
        tuple of axis names (several mesh axes on one dimension, major first). ``()`` is replicated.
        For ``"other"``, the PartitionSpec over the array's own mesh where it is a ``NamedSharding``
        on another mesh of the staged devices (``text`` names that mesh), else ``()``.
      text: for ``"other"``, JAX's ``repr`` of the sharding.
    """

    kind: str
    dims: tuple[Union[None, str, tuple[str, ...]], ...] = ()
    text: str | None = None

    @property
    def replicated(self) -> bool:
        """A PartitionSpec that shards no dimension."""
        return self.kind == "spec" and not self.axes

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this sharding names, in order."""
        out: list[str] = []
        for d in self.dims:
            if isinstance(d, str):
                out.append(d)
            elif isinstance(d, tuple):
                out.extend(d)
        return tuple(out)

    def padded(self, rank: int) -> "Sharding":
        """The same sharding with ``None`` appended up to ``rank`` dimensions (``auto`` as is)."""
        if self.kind != "spec" or len(self.dims) >= rank:
            return self
        return Sharding("spec", tuple(self.dims) + (None,) * (rank - len(self.dims)))

    def __str__(self) -> str:
        """As JAX prints a PartitionSpec, ``P('data', None)``; ``auto``, ``unspecified`` or JAX's text else."""
        if self.kind == "other":
            return self.text or "other"
        if self.kind != "spec":
            return self.kind
        return format_dims(self.dims)


def format_dims(dims: tuple) -> str:
    """Format PartitionSpec dims as JAX prints them: ``P('data', None)``, ``P(('data', 'fsdp'),)``."""
    parts = []
    for d in dims:
        if d is None:
            parts.append("None")
        elif isinstance(d, str):
            parts.append(repr(d))
        else:
            parts.append("(" + ", ".join(repr(a) for a in d) + ("," if len(d) == 1 else "") + ")")
    return "P(" + ", ".join(parts) + ")"


def spec_dims(spec) -> tuple:
    """A ``PartitionSpec`` (or any sequence of its entries) as ``Sharding.dims``: None / an axis name /
    a tuple of axis names per dimension (a one-axis tuple as the name), trailing Nones dropped."""
    dims: list = []
    for d in tuple(spec):
        if d is None or isinstance(d, str):
            dims.append(d)
        else:
            d = tuple(d)
            dims.append(d[0] if len(d) == 1 else (d or None))
    while dims and dims[-1] is None:
        dims.pop()
    return tuple(dims)


REPLICATED = Sharding("spec", ())
AUTO = Sharding("auto")
UNSPECIFIED = Sharding("unspecified")


