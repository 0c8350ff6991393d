"""The target's own jit, in one place: what it says, what the staging takes from it, and the one
stagetool cannot unwrap, named.

- **What it says** (:func:`jit_settings`): the settings of a ``jax.jit``, ``nnx.jit``,
  ``eqx.filter_jit`` or ``hax.named_jit`` object. A target that is already jitted decides its own
  static arguments, donation, in/out shardings and compiler options; stagetool stages it with
  exactly those (merged with the spec's, see :func:`stagetool.staging.stages.jit_function`). A
  ``jax.jit`` object's settings are read by :mod:`stagetool.inputs.frameworks.jit` (the one adapter
  that reads jaxlib's jit object); a framework's own wrapper (``nnx.jit``, ``eqx.filter_jit``) by
  that framework's module (its ``jit_settings``), which also stages it as its own program where the
  spec adds nothing (:class:`stagetool.inputs.frameworks.nnx.NnxProgram`,
  :class:`stagetool.inputs.frameworks.equinox.EqxProgram`,
  :class:`stagetool.inputs.frameworks.haliax.HaliaxProgram`).
- **Applied to the abstract inputs** (:func:`take_in_shardings`, :func:`own_program`): its
  ``in_shardings`` taken by the leaves, its own program where the spec adds nothing, the Flax NNX
  Variables its arguments share made one again, and the ``out_shardings`` an ``nnx.jit`` gives.
- **Hidden** (:func:`hidden_jit_note`): any other callable holding a ``jax.jit`` — another
  library's own wrapper, a ``functools.partial`` or a callable object around a jit — is staged
  nested inside stagetool's own jit, where JAX inlines the inner jit: its donation, in/out
  shardings and static arguments are not the program's. Such a jit is found (on the callable's
  attributes, its ``__wrapped__``/``func``, its closure, to a small depth) and said in a note:
  never a silent drop of its donation.
"""


from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from stagetool.core.paths import is_library_file
from stagetool.core.sharding import Sharding
from stagetool.inputs.frameworks import Pytree, adapters, library_of
from stagetool.inputs.frameworks.dispatch import is_state_sharding
from stagetool.inputs.frameworks.jit import JitSettings, is_jax_jit, pjit_settings
from stagetool.inputs.leaves import same_dims
from stagetool.inputs.records import InputLeaf
from stagetool.spec.model import FunctionSpec

if TYPE_CHECKING:  # imported only for Flax, Equinox and haliax targets
    from stagetool.inputs.frameworks.equinox import EqxProgram
    from stagetool.inputs.frameworks.haliax import HaliaxProgram
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
                 rules: tuple | None, donated: tuple[set, set], mesh: Any = None
                 ) -> NnxProgram | EqxProgram | HaliaxProgram | None:
    """The target's own program when the spec adds nothing its wrapper cannot take, else None
    (staged nested, merged with the spec). ``mesh``: the staged mesh (a ``named_jit``'s shardings are on it).

    - ``eqx.filter_jit`` (:func:`stagetool.inputs.frameworks.equinox.eqx_program`): no ``out_shardings``,
      no ``donate`` beyond Equinox's own.
    - ``nnx.jit`` (:func:`stagetool.inputs.frameworks.nnx.nnx_program`): no ``out_shardings``,
      ``static`` values only for the wrapper's ``static_argnames``, every argument leaf an array (a
      graph node's Variables included), and a ``donate`` of the spec's own (``donated``: the merged
      positions and names) only where the step can be jitted once with it
      (:func:`stagetool.inputs.frameworks.nnx.nnx_with_donation`).
    - ``hax.named_jit`` (:func:`stagetool.inputs.frameworks.haliax.haliax_program`): no
      ``out_shardings`` (its axis mappings give them); a ``donate`` of the spec's own is given to
      ``named_jit`` with the function underneath (:func:`stagetool.inputs.frameworks.haliax.with_donation`).
    """
    import jax

    if own.kind not in ("nnx.jit", "eqx.filter_jit", "haliax.named_jit") or fspec.out_shardings is not None:
        return None
    context = (lambda: _rules_context(rules)) if rules is not None else None
    if own.kind == "haliax.named_jit":
        from stagetool.inputs.frameworks import haliax

        if fspec.donate and not own.donates:
            own = haliax.with_donation(own, len(args), tuple(sorted(donated[0])), tuple(sorted(donated[1])))
        return haliax.haliax_program(own, args, {**kwargs, **static}, mesh, context)
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


def named_jit_nested_note(fspec: FunctionSpec, own: JitSettings, args: tuple, kwargs: dict, ref_sharded: bool) -> str:
    """What a ``hax.named_jit`` target staged nested (not as its own program) takes and does not:
    the reason it is nested, its donation (merged into stagetool's jit, whole arguments), its
    shardings (inside the nested jit only) and its static outputs."""
    import jax

    if fspec.out_shardings is not None:
        why = "the spec gives out_shardings, which named_jit's own program cannot take"
    elif not own.readable:
        why = "this haliax's named_jit object does not have the fields stagetool reads"
    elif ref_sharded or any(isinstance(x, jax.ref.AbstractRef) for x in jax.tree_util.tree_leaves((args, kwargs))):
        why = "an argument holds a jax.Ref"
    else:
        why = "the function closes over arrays (inputs the spec does not name)"
    donation = (f"its donation is taken as stagetool's jit's (donate_argnums={own.donate_argnums}"
                + (f", donate_argnames={own.donate_argnames}" if own.donate_argnames else "")
                + ") for whole arguments, where donate_args marking single leaves would donate fewer"
                if own.donates else "it donates nothing")
    return (f"{fspec.target} is a haliax named_jit staged nested inside stagetool's own jit because {why}: "
            f"{donation}; its axis_resources shardings hold inside the nested jit but the program's outputs are "
            "sharded as the spec or the compiler says, and Python numbers it returns are outputs here (named_jit "
            "keeps them static)")


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


# ---- what it says



def options_text(settings: JitSettings | None) -> tuple[tuple[str, str], ...]:
    """``(name, value text)`` of the jit's ``compiler_options``, sorted by name (for the report,
    snapshots and the facts cache key)."""
    if settings is None:
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in settings.compiler_options.items()))


def jit_settings(fn: Any, n_args: int = 0) -> JitSettings:
    """What ``fn``'s own jit says (see :class:`~stagetool.inputs.frameworks.jit.JitSettings`);
    ``n_args`` positional arguments are given (for Equinox's ``donate="all"``, which names no
    positions). A plain function's settings are all empty."""
    for framework in adapters(library_of(fn)):
        settings = framework.jit_settings(fn, n_args) if hasattr(framework, "jit_settings") else None
        if settings is not None:
            return settings
    return pjit_settings(fn, "jax.jit") if is_jax_jit(fn) else JitSettings()


def in_sharding_dims(settings: JitSettings, args: tuple) -> list[tuple | None]:
    """Per array leaf of the positional ``args`` (``jax.tree_util.tree_leaves`` order), the
    PartitionSpec dims the target's ``in_shardings`` give it, or None (not given, or a sharding
    that is not a ``NamedSharding``/``PartitionSpec``).

    ``in_shardings`` is a tree prefix of ``args`` (one entry per positional argument, a single
    sharding standing for a whole subtree), as ``jax.jit`` reads it.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from stagetool.core.sharding import spec_dims

    n = len(jax.tree_util.tree_leaves(args))
    if settings.in_shardings is None:
        return [None] * n
    shardings = settings.in_shardings
    if not isinstance(shardings, (tuple, list)):
        shardings = (shardings,) * len(args)  # one sharding for every argument
    out: list[tuple | None] = []
    for i, arg in enumerate(args):
        count = len(jax.tree_util.tree_leaves(arg))
        prefix = shardings[i] if i < len(shardings) else None
        is_leaf = lambda x: x is None or isinstance(x, (NamedSharding, PartitionSpec)) or is_state_sharding(x)  # noqa: E731
        if prefix is None or isinstance(prefix, (NamedSharding, PartitionSpec)) or is_state_sharding(prefix):
            per = _broadcast(prefix, arg)
        else:
            per = []
            try:
                jax.tree_util.tree_map(lambda s, sub: per.extend(_broadcast(s, sub)), prefix, arg, is_leaf=is_leaf)
            except (ValueError, TypeError):
                per = [None] * count
        for s in per:
            spec = s.spec if isinstance(s, NamedSharding) else s
            out.append(spec_dims(spec) if isinstance(spec, PartitionSpec) else None)
    return out


def _broadcast(prefix: Any, sub: Pytree) -> list:
    """One sharding per array leaf of ``sub`` from one prefix entry: a sharding (or None) stands for
    the whole subtree; an ``nnx.StateSharding`` gives each Variable of each graph node its own."""
    import jax

    if is_state_sharding(prefix):
        from stagetool.inputs.frameworks import nnx

        return nnx.state_sharding_leaves(prefix, sub)
    return [prefix] * len(jax.tree_util.tree_leaves(sub))


# ---- a jit stagetool cannot unwrap, named


_DEPTH = 3


def _inner_jit(obj: Any, depth: int, seen: set[int]) -> Any:
    """The first ``jax.stages.Wrapped`` reachable from ``obj`` (not ``obj`` itself), or None."""
    import jax

    if depth > _DEPTH or id(obj) in seen:
        return None
    seen.add(id(obj))
    children: list[Any] = []
    for name in ("__wrapped__", "func", "__func__", "fn", "fun", "f"):
        child = getattr(obj, name, None) if not isinstance(obj, type) else None
        if child is not None and callable(child):
            children.append(child)
    closure = getattr(obj, "__closure__", None) or ()
    for cell in closure:
        try:
            children.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    if not isinstance(obj, type) and not callable(getattr(obj, "__code__", None)):
        try:
            children += [v for v in vars(obj).values() if callable(v)]
        except TypeError:
            pass
    for child in children:
        if isinstance(child, jax.stages.Wrapped):
            return child
    for child in children:
        found = _inner_jit(child, depth + 1, seen)
        if found is not None:
            return found
    return None


def _is_wrapper(fn: Any) -> bool:
    """A callable that is not the user's own plain function: an object with ``__call__``, a
    ``functools.partial``, or a function defined in a library (a decorator's wrapper)."""
    import types

    if isinstance(fn, types.FunctionType):
        return hasattr(fn, "__wrapped__") or is_library_file(fn.__code__.co_filename)
    return not isinstance(fn, (types.BuiltinFunctionType, type))


def hidden_jit_note(fn: Any, target_text: str) -> str | None:
    """A note when ``fn`` (the loaded target) holds a ``jax.jit`` stagetool does not unwrap, or is a
    ``jax.jit`` whose settings this JAX does not let it read; None otherwise."""
    import jax

    if is_jax_jit(fn):
        if pjit_settings(fn, "jax.jit").readable:
            return None
        return (f"{target_text} is a jax.jit whose settings this JAX does not let stagetool read: it is staged "
                "nested inside stagetool's own jit, and its donation, in/out shardings and static arguments are "
                "not taken (give them in the spec: donate, out_shardings, static)")
    if isinstance(fn, jax.stages.Wrapped) or library_of(fn) is not None or not _is_wrapper(fn):
        return None  # nnx.jit / eqx.filter_jit (read by their adapters), or the user's own function
    inner = _inner_jit(fn, 0, set())
    if inner is None:
        return None
    settings = pjit_settings(inner, "jax.jit")
    dropped = []
    if settings.readable:
        if settings.donates:
            # jax.jit fills the names from the positions and back: one of them says it
            dropped.append(f"donation (donate_argnums={settings.donate_argnums})" if settings.donate_argnums
                           else f"donation (donate_argnames={settings.donate_argnames})")
        if settings.in_shardings is not None or settings.out_shardings is not None:
            dropped.append("in/out shardings")
        if settings.static_argnums or settings.static_argnames:
            dropped.append("static arguments")
    what = ", ".join(dropped) if dropped else "donation, in/out shardings and static arguments, if any"
    return (f"{target_text} is a {type(fn).__name__} wrapping a jax.jit that stagetool does not unwrap: it is staged "
            f"nested inside stagetool's own jit, where JAX inlines the inner jit, so its settings are not taken: "
            f"{what}; the figures are those of a program without them (give them in the spec — donate, "
            "out_shardings, static — or name the jax.jit itself as the target)")
