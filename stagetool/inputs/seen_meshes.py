"""The meshes the shardings read from user code name (an ``init``'s, a ``{ref:}`` object's arrays').

Those shardings are taken by axis name (their PartitionSpec dims) and laid on the staged mesh;
:func:`collecting` gathers the meshes they named, so a mesh other than the staged one is said in a
note, or refused where its devices are not the staged ones (:func:`stagetool.inputs.own_mesh.check_seen`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_STACK: list[list] = []


def note_sharding(sharding: Any, what: str) -> None:
    """Record the mesh of a ``NamedSharding`` read for ``what`` (``"init"``, ``"object"``), if collecting."""
    if not _STACK:
        return
    from jax.sharding import Mesh

    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, Mesh):  # an AbstractMesh names no devices
        _STACK[-1].append((what, mesh))


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    """A list filled with ``(what, mesh)`` for every mesh read while inside."""
    seen: list = []
    _STACK.append(seen)
    try:
        yield seen
    finally:
        _STACK.pop()
