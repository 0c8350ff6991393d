"""Flax Linen, as its guides write it (imported only when the user's objects are Flax's): the
``nn.Partitioned`` / ``nn.LogicallyPartitioned`` boxes an ``init`` returns, their ``names`` mapped
onto the mesh through the logical axis rules (which NNX's logical sharding reads too).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import flax.linen as nn
from flax.core import meta

from stagetool.core.sharding import spec_dims


def is_box(x: Any) -> bool:
    """A Linen ``AxisMetadata`` box (``Partitioned``, ``LogicallyPartitioned``)."""
    return isinstance(x, meta.AxisMetadata)


def box_dims(box: meta.AxisMetadata, rules: Any) -> tuple | None:
    """The PartitionSpec dims a box names, logical names resolved through the box's own rules,
    ``rules`` (``(logical name, mesh axes)`` pairs) or Flax's active context; None when the box
    carries no names.

    Raises:
      ValueError: a ``LogicallyPartitioned`` box names logical axes and no rules map them.
    """
    names = getattr(box, "names", None)  # an AxisMetadata box need not have names
    if names is None:
        return None
    if isinstance(box, nn.LogicallyPartitioned):
        logical = getattr(box, "rules", None) or rules or nn.get_logical_axis_rules()
        if not logical and any(n is not None for n in names):
            raise ValueError(f"the model names logical axes {tuple(names)} (nn.with_logical_partitioning), "
                             "but no logical axis rules map them onto the mesh; name them in the spec: logical_axis_rules: model.py:RULES")
        return spec_dims(nn.logical_to_mesh_axes(tuple(names), logical))
    return spec_dims(tuple(names))


@contextlib.contextmanager
def logical_axis_rules(rules: Any) -> Iterator[None]:
    """Linen's ``nn.logical_axis_rules(rules)`` (``rules``: ``(logical name, mesh axes)`` pairs)."""
    with nn.logical_axis_rules(tuple(tuple(r) for r in rules)):
        yield
