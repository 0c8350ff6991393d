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


# ---- Variables shared between arguments (nnx.jit splits all its arguments as one graph)


def variable_keys(tree: Any) -> list:
    """Per leaf of ``tree`` (``jax.tree_util.tree_leaves`` order), ``id`` of the ``nnx.Variable`` that
    holds it, or None (a leaf in no Variable, or in one with more than one leaf). Two leaves with the
    same key are one Variable reached from two places (an optimizer holding the model's own Params);
    ``jax.tree_util`` flattens it once per place, ``nnx.jit`` once in all (the caller keeps ``tree``
    alive while the keys are used)."""
    import jax

    keys: list = []
    for item in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if isinstance(item, nnx.Variable):
            n = len(jax.tree_util.tree_leaves(item))
            keys += [id(item) if n == 1 else None] * n
        else:
            keys.append(None)
    return keys


def shared_with_inputs(inputs: Any, output: Any, position: dict[int, int]) -> list:
    """Per leaf of ``output`` (an ``init``'s result traced with ``inputs``), which Variable it is in
    terms the caller can match after the trace: ``("arg", p)`` for an input Variable whose leaf is the
    traced input at flat position ``p`` (``position``: ``id(tracer)`` → p), ``("local", i)`` for a
    Variable found more than once in ``output`` (``i``: its first leaf's index), else None."""
    import jax

    origin: dict[int, int] = {}
    for item in jax.tree_util.tree_leaves(inputs, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if isinstance(item, nnx.Variable):
            leaves = jax.tree_util.tree_leaves(item)
            if len(leaves) == 1 and id(leaves[0]) in position:
                origin.setdefault(id(item), position[id(leaves[0])])
    keys = variable_keys(output)
    first: dict[int, int] = {}
    for i, k in enumerate(keys):
        if k is not None:
            first.setdefault(k, i)
    counts: dict[int, int] = {}
    for k in keys:
        if k is not None:
            counts[k] = counts.get(k, 0) + 1
    return [None if k is None else ("arg", origin[k]) if k in origin
            else ("local", first[k]) if counts[k] > 1 else None for k in keys]


def share_variables(tree: Any, keys: list) -> tuple[Any, list[int]]:
    """``tree`` rebuilt with the Variables whose leaves have the same key (``keys``: one per leaf of
    ``tree``, ``jax.tree_util.tree_leaves`` order; None for none) made one object, the first found, as
    the real objects are; and the leaf positions whose Variable was replaced (their leaves are no
    longer in the tree). A Variable is replaced only by one of the same type, shape and dtype.

    The tree is rebuilt with ``jax.tree_util`` (Modules and ``nnx.Pytree``s unflatten with the Variable
    objects they are given), so graph nodes other than Variables are not shared: ``nnx.jit`` splits
    the state of the Variables, which is what it compiles."""
    import jax

    items, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    first: dict[Any, Any] = {}
    out: list = []
    dropped: list[int] = []
    pos = 0
    for item in items:
        leaves = jax.tree_util.tree_leaves(item) if isinstance(item, nnx.Variable) else [item]
        key = keys[pos] if len(leaves) == 1 else None
        if isinstance(item, nnx.Variable) and key is not None:
            kept = first.setdefault(key, item)
            if kept is not item and type(kept) is type(item) and _same_aval(jax.tree_util.tree_leaves(kept)[0], leaves[0]):
                dropped.append(pos)
                item = kept
        out.append(item)
        pos += len(leaves)
    return jax.tree_util.tree_unflatten(treedef, out), dropped


def _same_aval(a: Any, b: Any) -> bool:
    return getattr(a, "shape", None) == getattr(b, "shape", None) and getattr(a, "dtype", None) == getattr(b, "dtype", None)
