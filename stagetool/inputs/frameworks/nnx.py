"""Flax NNX, as its guides write it (imported only when the user's objects are Flax's).

- Sharding metadata: an NNX ``Variable``'s ``out_sharding`` (``nnx.with_partitioning``,
  ``sharding=`` on ``nnx.Param``); logical names go through the logical axis rules.
- In-place steps: the objects an ``nnx.jit`` step updates (a model, an ``nnx.Optimizer``) are
  returned as outputs of the staged program, as ``nnx.jit`` itself returns them; the step itself
  (``nnx.jit`` wrapper and all) is called inside the trace.
- Variables shared between arguments (an optimizer holding the model's own Params): ``nnx.jit``
  splits all its arguments as one graph, so they are one input and one output.
- ``nnx.jit`` targets: donation and static arguments of the wrapper's inner ``jax.jit``
  (``.jitted_fn``, whose positions are the step's own); ``in_shardings`` / ``out_shardings`` as the
  wrapper keeps them (an ``nnx.StateSharding`` resolved per Variable). A target the spec adds
  nothing to is staged as its own program (:class:`NnxProgram`), split by Flax's private
  ``JitWrapped._get_pure_args_kwargs`` (there is no public split that keeps the leaves, which
  stagetool needs to name them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable

import jax
from flax import nnx

from stagetool.core.sharding import spec_dims
from stagetool.inputs.frameworks import Pytree
from stagetool.inputs.frameworks.jit import JitSettings, pjit_settings


def _is_graph_node(x: Any) -> bool:
    """A Module, an Optimizer, a Variable, ``nnx.Rngs``: a node whose state a step updates in place."""
    return isinstance(x, (nnx.Module, nnx.Variable)) or (hasattr(nnx, "Pytree") and isinstance(x, nnx.Pytree))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


# ---- hooks (see stagetool.inputs.frameworks)


def is_box(x: Any) -> bool:
    """An NNX ``Variable`` (which may carry sharding metadata)."""
    return isinstance(x, nnx.Variable)


def box_dims(box: nnx.Variable, rules: Any) -> tuple | None:
    """The PartitionSpec dims a Variable's metadata names (axis names, a ``PartitionSpec``, or a
    ``NamedSharding``'s spec), logical names resolved through ``rules`` (the
    :func:`stagetool.inputs.values.resolve_logical_rules` pairs) or the Variable's own
    ``sharding_rules``; None when it carries no sharding."""
    import flax.linen as nn

    md = box.get_metadata() if hasattr(box, "get_metadata") else {}
    names = md.get("out_sharding") or md.get("sharding") or md.get("sharding_names")
    if names is None:
        return None
    if hasattr(names, "spec"):  # a NamedSharding (nnx.with_partitioning(init, NamedSharding(mesh, P(...)))): its spec
        names = names.spec
    logical = rules or md.get("sharding_rules")
    if logical:
        return spec_dims(nn.logical_to_mesh_axes(tuple(names), logical))
    return spec_dims(tuple(names))


def has_state(tree: Pytree) -> bool:
    """Whether ``tree`` holds a graph node whose state a step can update in place."""
    found = []

    def visit(x: Any) -> bool:
        if _is_graph_node(x):
            found.append(x)
            return True
        return False

    jax.tree_util.tree_leaves(tree, is_leaf=visit)
    return bool(found)


def updated_state(obj: Pytree) -> Any:
    """The state of an argument after the step ran: ``nnx.state`` of every graph node in it."""
    return jax.tree_util.tree_map(lambda x: nnx.state(x) if _is_graph_node(x) else x, obj, is_leaf=_is_graph_node)


def init_kwargs(cls: type, args: list, kwargs: dict) -> dict:
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


def init_signature(cls: type) -> Callable[..., Any]:
    """What to check ``init_args`` against: the class's ``__init__`` (NNX's metaclass hides the
    signature), with ``rngs`` optional (stagetool builds ``nnx.Rngs(0)`` in the trace)."""
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return cls
    params = [p.replace(default=None) if p.name == "rngs" and p.default is p.empty
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) else p for p in list(sig.parameters.values())[1:]]

    def init(*a: Any, **k: Any) -> None: ...

    init.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return init


def jit_settings(fn: Any, n_args: int) -> JitSettings | None:
    """An ``nnx.jit`` object's settings (its inner jit's; the wrapper's own in/out shardings, with a
    None put in at each static position so they line up with the arguments), or None for another
    object."""
    if not hasattr(fn, "jitted_fn"):
        return None
    inner = pjit_settings(fn.jitted_fn, "nnx.jit")  # private-api: JitWrapped.jitted_fn, nnx.jit's inner jax.jit
    return dataclasses.replace(inner, fun=None, in_shardings=getattr(fn, "in_shardings", None),
                               out_shardings=getattr(fn, "out_shardings", None), wrapper=fn)


# ---- nnx.StateSharding: a sharding per Variable filter


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


def state_sharding_leaves(prefix: Any, tree: Pytree) -> list:
    """Per array leaf of ``tree`` (``jax.tree_util.tree_leaves`` order), the sharding an
    ``nnx.StateSharding`` gives it as ``nnx.jit`` splits its argument: each graph node's Variables
    matched by their path inside that node (``prefix.map_prefix(path, variable)``: the first filter
    that matches); None for a leaf that is in no Variable."""
    out: list = []
    for node in jax.tree_util.tree_leaves(tree, is_leaf=_is_graph_node):
        if not _is_graph_node(node):
            out.append(None)
            continue
        for kp, v in jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_variable)[0]:
            if isinstance(v, nnx.Variable):
                out.extend([prefix.map_prefix(_nnx_path(kp), v)] * len(jax.tree_util.tree_leaves(v)))
            else:
                out.append(None)
    return out


def updated_state_shardings(prefix: Any, obj: Pytree) -> Any:
    """The out_shardings of :func:`updated_state` ``(obj)`` that ``nnx.jit`` gives an updated argument:
    its ``in_shardings`` entry again (``nnx.jit``'s inner jit has ``out_shardings`` = its
    ``in_shardings`` for the arguments' state). A sharding or None stands for the whole state; an
    ``nnx.StateSharding`` is resolved per Variable (a tree of shardings shaped as the state)."""
    if not (hasattr(prefix, "map_prefix") and (type(prefix).__module__ or "").startswith("flax")):
        return prefix

    def per_node(x: Any) -> Any:
        if not _is_graph_node(x):
            return None
        return jax.tree_util.tree_map_with_path(lambda kp, v: prefix.map_prefix(_nnx_path(kp), v), nnx.state(x),
                                                is_leaf=_is_variable)

    return jax.tree_util.tree_map(per_node, obj, is_leaf=_is_graph_node)


def out_shardings(own: JitSettings, args: tuple, names: list[str], state_outputs: tuple[str, ...]) -> Any:
    """The ``out_shardings`` an ``nnx.jit`` target's own in/out_shardings give the staged function.

    ``nnx.jit`` runs an inner ``jax.jit`` whose ``out_shardings`` are ``(in_shardings,
    out_shardings)``: the arguments' updated state comes back sharded as their ``in_shardings`` say.
    The staged function returns ``{"out": output, name: updated state, ...}`` when the step updates
    arguments in place (``state_outputs``), else the output itself; its out_shardings mirror that.
    An ``nnx.StateSharding`` entry is resolved per Variable of the argument
    (:func:`updated_state_shardings`); one for a returned graph node is not (the output's structure
    is known only after tracing): that part is left to the nested ``nnx.jit``'s own out_shardings.
    """
    from stagetool.inputs.frameworks.dispatch import is_state_sharding

    returned = jax.tree_util.tree_map(lambda s: None if is_state_sharding(s) else s, own.out_shardings,
                                      is_leaf=is_state_sharding)
    if not state_outputs:
        return returned
    entries = own.in_shardings
    out: dict[str, Any] = {"out": returned}
    for name in state_outputs:
        i = names.index(name) if name in names[:len(args)] else None
        entry = None
        if i is not None and entries is not None:
            entry = (entries[i] if i < len(entries) else None) if isinstance(entries, (tuple, list)) else entries
        out[name] = None if entry is None else updated_state_shardings(entry, args[i])
    return out


# ---- Variables shared between arguments (nnx.jit splits all its arguments as one graph)


def variable_keys(tree: Pytree) -> list:
    """Per leaf of ``tree`` (``jax.tree_util.tree_leaves`` order), ``id`` of the ``nnx.Variable`` that
    holds it, or None (a leaf in no Variable, or in one with more than one leaf). Two leaves with the
    same key are one Variable reached from two places (an optimizer holding the model's own Params);
    ``jax.tree_util`` flattens it once per place, ``nnx.jit`` once in all (the caller keeps ``tree``
    alive while the keys are used)."""
    keys: list = []
    for item in jax.tree_util.tree_leaves(tree, is_leaf=_is_variable):
        if isinstance(item, nnx.Variable):
            n = len(jax.tree_util.tree_leaves(item))
            keys += [id(item) if n == 1 else None] * n
        else:
            keys.append(None)
    return keys


def shared_with_inputs(inputs: Pytree, output: Pytree, position: dict[int, int]) -> list:
    """Per leaf of ``output`` (an ``init``'s result traced with ``inputs``), which Variable it is in
    terms the caller can match after the trace: ``("arg", p)`` for an input Variable whose leaf is the
    traced input at flat position ``p`` (``position``: ``id(tracer)`` → p), ``("local", i)`` for a
    Variable found more than once in ``output`` (``i``: its first leaf's index), else None."""
    origin: dict[int, int] = {}
    for item in jax.tree_util.tree_leaves(inputs, is_leaf=_is_variable):
        if isinstance(item, nnx.Variable):
            leaves = jax.tree_util.tree_leaves(item)
            if len(leaves) == 1 and id(leaves[0]) in position:
                origin.setdefault(id(item), position[id(leaves[0])])
    keys = variable_keys(output)
    first: dict[int, int] = {}
    counts: dict[int, int] = {}
    for i, k in enumerate(keys):
        if k is not None:
            first.setdefault(k, i)
            counts[k] = counts.get(k, 0) + 1
    return [None if k is None else ("arg", origin[k]) if k in origin
            else ("local", first[k]) if counts[k] > 1 else None for k in keys]


def share_variables(tree: Pytree, keys: list) -> tuple[Any, list[int]]:
    """``tree`` rebuilt with the Variables whose leaves have the same key (``keys``: one per leaf of
    ``tree``, ``jax.tree_util.tree_leaves`` order; None for none) made one object, the first found, as
    the real objects are; and the leaf positions whose Variable was replaced (their leaves are no
    longer in the tree). A Variable is replaced only by one of the same type, shape and dtype.

    The tree is rebuilt with ``jax.tree_util`` (Modules and ``nnx.Pytree``s unflatten with the Variable
    objects they are given), so graph nodes other than Variables are not shared: ``nnx.jit`` splits
    the state of the Variables, which is what it compiles."""
    items, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_variable)
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


def share_arguments(args: tuple, kwargs: dict, keys: list) -> tuple[tuple, dict, list]:
    """The arguments of an ``nnx.jit`` target with each Variable that the real objects reach from two
    places made one object again (``keys``: per leaf of ``(args, kwargs)``, the same key for every
    place of one Variable, see :func:`stagetool.inputs.avals.build_inputs`).

    ``nnx.jit`` splits all its arguments as one graph, so a Variable shared between arguments (Flax's
    FSDP example: an optimizer holding the model's own Params) is one input and one output, and the
    step's update lands on the model. The abstract arguments are built per argument with
    ``jax.tree_util``, which makes one Variable per place; this puts the sharing back (the first place
    keeps its leaf and name: ``model/w1/value``). Returns ``(args, kwargs, dropped)``: ``dropped`` the
    leaves of the places that were replaced (no longer in the arguments).
    """
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    if len(leaves) != len(keys):
        return args, kwargs, []
    (shared_args, shared_kwargs), dropped = share_variables((tuple(args), dict(kwargs)), keys)
    return tuple(shared_args), dict(shared_kwargs), [leaves[p] for p in dropped]


# ---- an nnx.jit target staged as its own program


class NnxProgram:
    """What an ``nnx.jit`` target compiles when run: its inner ``jax.jit`` on the split arguments.

    Attributes:
      wrapper: the ``nnx.jit`` object (flax's ``JitWrapped``).
      args / kwargs: the arguments as ``nnx.jit`` hands them to its inner jit (graph nodes split into
        ``NodeStates`` of the same abstract leaves, grouped by ``nnx.StateSharding`` filter; static
        keyword values kept).
      names: the positional arguments' names (for the output leaves' paths).
      rules: logical axis rules held active while tracing (a context manager factory), or None.
      input_paths: the input leaves' paths, ``([per positional argument], {keyword: [...]})``, set by
        :func:`stagetool.inputs.avals.build_inputs` (they name the updated state's outputs).
    """

    def __init__(self, wrapper: Any, args: tuple, kwargs: dict, names: list[str], rules: Any = None):
        self.wrapper = wrapper
        self.args = args
        self.kwargs = kwargs
        self.names = list(names)
        self.rules = rules
        self.input_paths: tuple[list[list[str]], dict[str, list[str]]] = ([], {})
        # private-api: JitWrapped.fun, the step under nnx.jit; errors point at the user's step
        self._stagetool_wraps = getattr(wrapper, "fun", wrapper)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``jitted_fn.trace`` under the wrapper's update context (as ``nnx.jit(...).trace`` runs it);
        returns the ``jax.stages.Traced``."""
        with nnx.update_context(self.wrapper), (self.rules() if self.rules else contextlib.nullcontext()):
            return self.wrapper.jitted_fn.trace(*args, **kwargs)  # private-api: nnx.jit's inner jax.jit

    def output_paths(self, out_info: Pytree, keypath: Callable[[tuple], str]) -> list[str]:
        """Per output leaf (``jax.tree_util`` order), its path as stagetool names it. The jit returns
        ``(arguments' state, keyword arguments' state, output)``; an argument's state is split as its
        input was (same graph, same filters, same order), so its leaves take their inputs' paths
        (:attr:`input_paths`: ``(per positional argument a list, per keyword a list)``); where the step
        changed a graph's structure (other counts), and for the output, ``name/...`` and ``out/...``
        by key path (``keypath``: a key path as ``/a/b`` text)."""
        by_arg, by_key = self.input_paths
        paths: list[str] = []
        for i, sub in enumerate(out_info[0]):
            paths += _named(sub, by_arg[i] if i < len(by_arg) else None,
                            self.names[i] if i < len(self.names) else str(i), keypath)
        for k in sorted(out_info[1] or {}):
            paths += _named(out_info[1][k], by_key.get(k), str(k), keypath)
        paths += ["out" + keypath(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(out_info[2])[0]]
        return paths


def _named(sub: Pytree, inputs: list[str] | None, name: str, keypath: Callable[[tuple], str]) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(sub)[0]
    if inputs is not None and len(inputs) == len(flat):
        return list(inputs)
    return [name + keypath(kp) for kp, _ in flat]


def nnx_program(settings: JitSettings, args: tuple, kwargs: dict, names: list[str], rules: Any = None
                ) -> NnxProgram | None:
    """The :class:`NnxProgram` of an ``nnx.jit`` target called with ``(args, kwargs)`` (abstract
    graph nodes and ``ShapeDtypeStruct`` leaves), or None when the wrapper is not one whose split
    stagetool can read (flax's graph-mode ``JitWrapped``; ``nnx.jit(graph=False)`` is staged nested).

    Raises:
      whatever Flax raises splitting the arguments (e.g. a Variable shared by two arguments with
      ``in_shardings``), as running the step would.
    """
    wrapper = settings.wrapper
    if settings.kind != "nnx.jit" or not (hasattr(wrapper, "_get_pure_args_kwargs") and hasattr(wrapper, "jitted_fn")):
        return None
    with nnx.update_context(wrapper):
        # private-api: JitWrapped._get_pure_args_kwargs, the split nnx.jit hands its inner jit
        pure_args, pure_kwargs = wrapper._get_pure_args_kwargs(tuple(args), dict(kwargs))
    return NnxProgram(wrapper, tuple(pure_args), dict(pure_kwargs), names, rules)


def nnx_jit_settings(fn: Callable[..., Any], static_argnames: tuple[str, ...] = ()) -> JitSettings:
    """The settings of ``nnx.jit(fn, static_argnames=...)``: a plain step over Flax NNX objects staged
    as ``nnx.jit`` runs it (used where its arguments share Variables, which only ``nnx.jit``'s one-graph
    split keeps as one; see :func:`share_arguments`). No donation: a spec ``donate`` is merged as for
    any ``nnx.jit`` target."""
    return jit_settings(nnx.jit(fn, static_argnames=tuple(static_argnames) or None), 0) or JitSettings()


def nnx_with_donation(settings: JitSettings, donate_argnums: tuple[int, ...], donate_argnames: tuple[str, ...]
                      ) -> JitSettings | None:
    """An ``nnx.jit`` target's settings with the spec's donation merged in: the step underneath
    (``.fun``) jitted once more by ``nnx.jit`` with its own shardings and ``keep_unused`` and the
    merged donation (never a jit around the wrapper). None where that cannot be done faithfully: the
    wrapper has static arguments (its ``in_shardings`` attribute then holds Nones put in for them),
    or its inner jit pins a device or backend or inlines."""
    wrapper = settings.wrapper
    # private-api: the inner jit's PjitInfo (device, backend, inline) and JitWrapped.fun, the step itself
    info = getattr(getattr(wrapper, "jitted_fn", None), "_jit_info", None)
    if settings.kind != "nnx.jit" or info is None or settings.static_argnums or settings.static_argnames:
        return None
    if getattr(info, "device", None) is not None or getattr(info, "backend", None) is not None \
            or getattr(info, "inline", False) or not hasattr(wrapper, "fun"):
        return None
    again = nnx.jit(wrapper.fun, in_shardings=settings.in_shardings, out_shardings=settings.out_shardings,
                    donate_argnums=tuple(donate_argnums) or None, donate_argnames=tuple(donate_argnames) or None,
                    keep_unused=settings.keep_unused)
    return dataclasses.replace(settings, donate_argnums=tuple(donate_argnums), donate_argnames=tuple(donate_argnames),
                               wrapper=again)


def relaid_wrapper(settings: JitSettings, relay: Callable[[Any], Any]) -> Any:
    """The ``nnx.jit`` target jitted again by ``nnx.jit`` with every sharding of its own
    ``in_shardings``/``out_shardings`` passed through ``relay`` (a ``NamedSharding`` → the same spec
    on the staged mesh; an ``nnx.StateSharding``'s per-filter shardings each), and all its other
    settings as they are (static arguments, donation, ``keep_unused``); None where that cannot be done
    faithfully (another wrapper than flax's graph-mode ``JitWrapped``, a pinned device or backend,
    ``inline``). The Nones ``nnx.jit`` puts into a tuple ``in_shardings`` at static positions are
    taken out again, as the user wrote it."""
    wrapper = settings.wrapper
    # private-api: the inner jit's PjitInfo (device, backend, inline) and JitWrapped.fun, the step itself
    info = getattr(getattr(wrapper, "jitted_fn", None), "_jit_info", None)
    if settings.kind != "nnx.jit" or info is None or not hasattr(wrapper, "fun"):
        return None
    if getattr(info, "device", None) is not None or getattr(info, "backend", None) is not None \
            or getattr(info, "inline", False):
        return None

    def one(x: Any) -> Any:
        if isinstance(x, nnx.StateSharding):
            return nnx.StateSharding(tuple(zip(x.filters, (relay(s) for s in x.shardings))))
        return relay(x)

    def tree(t: Any) -> Any:
        if t is None:
            return None
        return jax.tree_util.tree_map(one, t, is_leaf=lambda x: isinstance(x, (nnx.StateSharding, jax.sharding.Sharding)))

    in_shardings = settings.in_shardings
    if isinstance(in_shardings, (tuple, list)) and settings.static_argnums:
        kept = list(in_shardings)
        for i in sorted(settings.static_argnums, reverse=True):
            if i < len(kept) and kept[i] is None:
                del kept[i]
        in_shardings = type(in_shardings)(kept)
    return nnx.jit(wrapper.fun, in_shardings=tree(in_shardings), out_shardings=tree(settings.out_shardings),
                   static_argnums=tuple(settings.static_argnums) or None,
                   static_argnames=tuple(settings.static_argnames) or None,
                   donate_argnums=tuple(settings.donate_argnums) or None,
                   donate_argnames=tuple(settings.donate_argnames) or None, keep_unused=settings.keep_unused)
