"""The target's own jit applied to its abstract inputs: its ``in_shardings`` taken by the leaves,
its own program where the spec adds nothing (``nnx.jit``, ``eqx.filter_jit``), the Flax NNX
Variables its arguments share made one again, and the ``out_shardings`` an ``nnx.jit`` gives.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from stagetool.core.sharding import Sharding
from stagetool.inputs.frameworks.jit import JitSettings
from stagetool.inputs.leaves import same_dims
from stagetool.inputs.records import InputLeaf
from stagetool.spec.model import FunctionSpec

if TYPE_CHECKING:  # imported only for Flax and Equinox targets
    from stagetool.inputs.frameworks.equinox import EqxProgram
    from stagetool.inputs.frameworks.nnx import NnxProgram


#: Who gave a leaf the sharding that a target's in_shardings contradict, and how to drop it.
_WHO_SHARDS = {
    "spec": ("the spec shards it", "drop the spec's '@ ...' (the target's in_shardings apply)"),
    "rule": ("the spec's rules shard it", "drop the rule (the target's in_shardings apply)"),
    "init": ("the init gives it", "build it as the target's in_shardings say (a jit that runs it with "
             "other shardings fails)"),
    "model": ("the model's annotations shard it", "annotate the model as the target's in_shardings say "
              "(a jit that runs it with other shardings fails)"),
}


def take_in_shardings(args: tuple, own: JitSettings, by_id: dict[int, InputLeaf], mesh: Any, fspec: FunctionSpec, issues: list[str],
                       ref_shardings: dict | None = None, explicit: bool = False) -> tuple:
    """The positional ``args`` with each array leaf sharded as the target's own ``in_shardings``
    say: a leaf the spec writes without ``@`` takes it (``sharding_source: "target"``); one whose
    ``@`` differs is an issue naming both. A ``jax.Ref`` leaf stays a Ref: under explicit axes the
    sharding goes in its type, under auto axes in ``ref_shardings`` (see :func:`as_abstract_ref`)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from stagetool.inputs.jit_wrapper import in_sharding_dims

    dims = iter(in_sharding_dims(own, args))

    def one(x: Any) -> Any:
        d = next(dims)
        leaf = by_id.get(id(x))
        if d is None or leaf is None:
            return x
        wanted = Sharding("spec", d)
        if isinstance(x, jax.ref.AbstractRef) and leaf.sharding_source in (None, "unknown"):
            inner = x.inner_aval
            typed = NamedSharding(mesh.abstract_mesh, PartitionSpec(*d)) if explicit else None
            ref = jax.ref.AbstractRef(jax.core.ShapedArray(inner.shape, inner.dtype, weak_type=inner.weak_type,
                                                           sharding=typed))
            by_id.pop(id(x), None)
            by_id[id(ref)] = dataclasses.replace(leaf, declared=wanted, sharding_source="target")
            if ref_shardings is not None:
                ref_shardings.pop(id(x), None)
                if not explicit:
                    ref_shardings[id(ref)] = NamedSharding(mesh, PartitionSpec(*d))
            return ref
        if leaf.sharding_source in (None, "unknown"):
            struct = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec(*d)),
                                          weak_type=getattr(x, "weak_type", False))
            by_id[id(struct)] = dataclasses.replace(leaf, declared=wanted, sharding_source="target")
            return struct
        if leaf.declared.kind == "spec" and not same_dims(leaf.declared.dims, d):
            who, fix = _WHO_SHARDS.get(leaf.sharding_source, _WHO_SHARDS["spec"])
            issues.append(f"{leaf.source or fspec.where('args')}: {leaf.path}: {who} {leaf.declared}, but "
                          f"{fspec.target}'s own {own.kind}(in_shardings=...) gives {wanted}; {fix} "
                          "or make them agree")
        return x

    return jax.tree_util.tree_map(one, args)


def own_program(fspec: FunctionSpec, own: JitSettings, args: tuple, kwargs: dict, static: dict, names: list[str],
                 rules: tuple | None, donated: tuple[set, set]) -> NnxProgram | EqxProgram | None:
    """The target's own program when the spec adds nothing its wrapper cannot take, else None
    (staged nested, merged with the spec).

    - ``eqx.filter_jit`` (:func:`stagetool.inputs.frameworks.equinox.eqx_program`): no ``out_shardings``,
      no ``donate`` beyond Equinox's own.
    - ``nnx.jit`` (:func:`stagetool.inputs.frameworks.nnx.nnx_program`): no ``out_shardings``,
      ``static`` values only for the wrapper's ``static_argnames``, every argument leaf an array (a
      graph node's Variables included), and a ``donate`` of the spec's own (``donated``: the merged
      positions and names) only where the step can be jitted once with it
      (:func:`stagetool.inputs.frameworks.nnx.nnx_with_donation`).
    """
    import jax

    if own.kind not in ("nnx.jit", "eqx.filter_jit") or fspec.out_shardings is not None:
        return None
    context = (lambda: _rules_context(rules)) if rules is not None else None
    if own.kind == "eqx.filter_jit":
        if fspec.donate and not own.donates:
            return None
        from stagetool.inputs.frameworks.equinox import eqx_program

        return eqx_program(own, args, {**kwargs, **static}, context)
    if not set(static) <= set(own.static_argnames):
        return None
    if fspec.donate and not own.donates:  # the spec's donation: the step jitted once with it (never nested)
        from stagetool.inputs.frameworks.nnx import nnx_with_donation

        own = nnx_with_donation(own, tuple(sorted(donated[0])), tuple(sorted(donated[1])))
        if own is None:
            return None
    if not all(isinstance(x, (jax.ShapeDtypeStruct, jax.ref.AbstractRef)) for x in jax.tree_util.tree_leaves((args, kwargs))):
        return None
    from stagetool.inputs.frameworks.nnx import nnx_program

    return nnx_program(own, args, {**kwargs, **static}, names, context)


def _rules_context(rules: Any) -> Any:
    from stagetool.inputs.frameworks.dispatch import logical_rules

    return logical_rules(rules)


def has_shared(keys: list) -> bool:
    """Whether two leaves have the same key (one Variable reached from two places)."""
    named = [k for k in keys if k is not None]
    return len(set(named)) != len(named)


def shared_note(args: tuple, kwargs: dict, keys: list, by_id: dict[int, InputLeaf]) -> str:
    """What a nested staging does with Variables the arguments share (see :func:`stagetool.inputs.frameworks.nnx.share_arguments`)."""
    import jax

    leaves = jax.tree_util.tree_leaves((args, kwargs))
    first: dict[Any, str] = {}
    pairs: list[tuple[str, str]] = []
    for x, k in zip(leaves, keys):
        path = by_id[id(x)].path if id(x) in by_id else "?"
        if k is None:
            continue
        if k in first:
            pairs.append((first[k], path))
        else:
            first[k] = path
    example = f"{pairs[0][1]} is {pairs[0][0]}" if pairs else ""
    return (f"the arguments share Flax NNX Variables ({example}; {len(pairs)} in all): nnx.jit splits them as one "
            "input and one output each, but this step is staged nested (the spec gives what nnx.jit's own program "
            "cannot take: out_shardings, static values it does not declare, or arguments that are not arrays), "
            "where each place is an input and an output of its own: argument and output bytes count them once per "
            "place, and the update of one place does not reach the other")
