"""Flax NNX and Linen, as their guides write them (imported only when the user's objects are Flax's).

- Sharding metadata: an NNX ``Variable``'s ``out_sharding`` (``nnx.with_partitioning``,
  ``sharding=`` on ``nnx.Param``), a Linen ``nn.Partitioned`` / ``nn.LogicallyPartitioned`` box's
  ``names``; logical names go through the logical axis rules.
- In-place NNX steps: the objects an ``nnx.jit`` step updates (a model, an ``nnx.Optimizer``) are
  returned as outputs of the staged program, as ``nnx.jit`` itself returns them; the step itself
  (``nnx.jit`` wrapper and all) is called inside the trace.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

from flax import nnx
from flax.core import meta

from stagetool.core.sharding import spec_dims


def is_box(x: Any) -> bool:
    """An NNX ``Variable`` or a Linen ``AxisMetadata`` box (``Partitioned``, ``LogicallyPartitioned``)."""
    return isinstance(x, (nnx.Variable, meta.AxisMetadata))


def box_dims(box: Any, rules: Any) -> tuple | None:
    """The PartitionSpec dims a box names, logical names resolved through ``rules`` (or the rules of
    the box / of Flax's active context); None when the box carries no sharding."""
    import flax.linen as nn

    if isinstance(box, nnx.Variable):
        md = box.get_metadata() if hasattr(box, "get_metadata") else {}
        names = md.get("out_sharding") or md.get("sharding") or md.get("sharding_names")
        if names is None:
            return None
        box_rules = md.get("sharding_rules")
        logical = rules or box_rules
        if logical:
            return spec_dims(nn.logical_to_mesh_axes(tuple(names), logical))
        return spec_dims(tuple(names))
    names = getattr(box, "names", None)
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
    """Linen's ``nn.logical_axis_rules(rules)`` (which NNX's logical sharding reads too)."""
    import flax.linen as nn

    with nn.logical_axis_rules(tuple(tuple(r) for r in rules)):
        yield


def has_graph_nodes(tree: Any) -> bool:
    """Whether ``tree`` holds an NNX graph node (a Module, an Optimizer, a Variable, ``nnx.Rngs``)
    whose state a step can update in place."""
    import jax

    found = []

    def visit(x: Any) -> bool:
        if isinstance(x, (nnx.Module, nnx.Variable)) or (hasattr(nnx, "Pytree") and isinstance(x, nnx.Pytree)):
            found.append(x)
            return True
        return False

    jax.tree_util.tree_leaves(tree, is_leaf=visit)
    return bool(found)


def _is_graph_node(x: Any) -> bool:
    return isinstance(x, (nnx.Module, nnx.Variable)) or (hasattr(nnx, "Pytree") and isinstance(x, nnx.Pytree))


def _nnx_path(keypath: tuple) -> tuple:
    """A JAX key path inside a graph node as NNX writes a Variable's path (``('up', 'kernel')``)."""
    out = []
    for k in keypath:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
        else:
            out.append(str(k))
    return tuple(out)


def state_sharding_leaves(prefix: Any, tree: Any) -> list:
    """Per array leaf of ``tree`` (``jax.tree_util.tree_leaves`` order), the sharding an
    ``nnx.StateSharding`` gives it as ``nnx.jit`` splits its argument: each graph node's Variables
    matched by their path inside that node (``prefix.map_prefix(path, variable)``: the first filter
    that matches); None for a leaf that is in no Variable."""
    import jax

    out: list = []
    for node in jax.tree_util.tree_leaves(tree, is_leaf=_is_graph_node):
        if not _is_graph_node(node):
            out.append(None)
            continue
        for kp, v in jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
            if isinstance(v, nnx.Variable):
                out.extend([prefix.map_prefix(_nnx_path(kp), v)] * len(jax.tree_util.tree_leaves(v)))
            else:
                out.append(None)
    return out


def updated_state_shardings(prefix: Any, obj: Any) -> Any:
    """The out_shardings of :func:`updated_state` ``(obj)`` that ``nnx.jit`` gives an updated argument:
    its ``in_shardings`` entry again (``nnx.jit``'s inner jit has ``out_shardings`` = its
    ``in_shardings`` for the arguments' state). A sharding or None stands for the whole state; an
    ``nnx.StateSharding`` is resolved per Variable (a tree of shardings shaped as the state)."""
    import jax

    if not (hasattr(prefix, "map_prefix") and (type(prefix).__module__ or "").startswith("flax")):
        return prefix

    def per_node(x: Any) -> Any:
        if not _is_graph_node(x):
            return None
        return jax.tree_util.tree_map_with_path(lambda kp, v: prefix.map_prefix(_nnx_path(kp), v), nnx.state(x),
                                                is_leaf=lambda v: isinstance(v, nnx.Variable))

    return jax.tree_util.tree_map(per_node, obj, is_leaf=_is_graph_node)


def updated_state(obj: Any) -> Any:
    """The state of an argument after the step ran: ``nnx.state`` of every graph node in it."""
    import jax

    def state(x: Any) -> Any:
        if isinstance(x, (nnx.Module, nnx.Variable)) or (hasattr(nnx, "Pytree") and isinstance(x, nnx.Pytree)):
            return nnx.state(x)
        return x

    return jax.tree_util.tree_map(state, obj, is_leaf=lambda x: isinstance(x, (nnx.Module, nnx.Variable))
                                  or (hasattr(nnx, "Pytree") and isinstance(x, nnx.Pytree)))


def with_rngs(cls: type, args: list, kwargs: dict) -> dict:
    """``kwargs`` with ``rngs=nnx.Rngs(0)`` when ``cls`` is an NNX Module whose constructor takes
    ``rngs`` and the spec does not give it."""
    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)) or "rngs" in kwargs:
        return kwargs
    try:
        params = list(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return kwargs
    if "rngs" in params and params.index("rngs") - 1 >= len(args):
        return {**kwargs, "rngs": nnx.Rngs(0)}
    return kwargs
