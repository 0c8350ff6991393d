"""What a target's own jit says: the settings of a ``jax.jit``, ``nnx.jit`` or ``eqx.filter_jit`` object.

A target that is already jitted decides its own static arguments, donation, in/out shardings and
compiler options; stagetool stages it with exactly those (merged with the spec's, see
:func:`stagetool.staging.stages.jit_function`). jaxlib's jit object (``PjitFunction``) has no
public accessor for the options it was made with; they are read here, in one place, from its
``_jit_info`` (a ``PjitInfo`` named tuple: verified on jax/jaxlib 0.10.2, and
``tests/inputs/test_jit_wrapper.py`` pins every field read). Where that attribute is missing
(another JAX), :func:`jit_settings` says so (``readable=False``) and stagetool stages the wrapper
as it is, nested, as before.

- ``jax.jit``: every setting, from ``_jit_info``; ``__wrapped__`` (set by ``functools.wraps``) is
  the function underneath.
- ``nnx.jit`` (``flax.nnx``'s ``JitWrapped``): donation and static arguments of its inner
  ``jax.jit`` (``.jitted_fn``, whose positions are the step's own); ``in_shardings`` /
  ``out_shardings`` as the wrapper keeps them (its public attributes of those names; an
  ``nnx.StateSharding`` is resolved per Variable by :mod:`stagetool.inputs.frameworks.flax`). The
  step keeps NNX's in-place semantics, so it is called as it is.
- ``eqx.filter_jit``: ``donate_first`` / ``donate_rest`` (``donate="all"``, ``"all-except-first"``);
  staged as Equinox's own executable where possible (:class:`EqxProgram`, which reads Equinox's
  private split and jit: see there).

An ``nnx.jit`` target that the spec adds nothing to is staged as its own program
(:class:`NnxProgram`): the wrapper's inner ``jax.jit`` (``.jitted_fn``) on the arguments split as
``nnx.jit`` splits them, traced under the wrapper's ``nnx.update_context`` — exactly what
``nnx.jit(...).trace`` does, so the parameters' order (one group per ``nnx.StateSharding`` filter),
the in/out shardings and the updated state it returns are NNX's. The split is Flax's private
``JitWrapped._get_pure_args_kwargs`` (there is no public one that keeps the leaves, which stagetool
needs to name them); it is read here only, and ``tests/inputs/test_jit_wrapper.py`` pins it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class JitSettings:
    """A jitted target's own settings (all empty for a plain function).

    Attributes:
      kind: ``"jax.jit"``, ``"nnx.jit"``, ``"eqx.filter_jit"``, or None (not jitted).
      fun: for ``jax.jit``, the function underneath (re-jitted with the merged settings); else None.
      readable: whether the settings could be read (False: a jit object of a JAX whose internals
        differ; staged as it is, nested).
      static_argnums / static_argnames: static arguments.
      donate_argnums / donate_argnames: donated arguments (Equinox: every argument, or every one
        but the first, as positions up to ``n_args``).
      in_shardings: the user's ``in_shardings`` as given (a tree prefix of the positional
        arguments), or None when not given.
      out_shardings: the user's ``out_shardings``, or None when not given.
      compiler_options: ``compiler_options=`` of the jit, as a dict (empty when none).
      keep_unused: ``keep_unused=`` of the jit.
      wrapper: the jitted object itself (staged as it is when the spec adds nothing).
    """

    kind: str | None = None
    fun: Callable[..., Any] | None = None
    readable: bool = True
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()
    in_shardings: Any = None
    out_shardings: Any = None
    compiler_options: dict = dataclasses.field(default_factory=dict)
    keep_unused: bool = False
    wrapper: Any = None

    @property
    def donates(self) -> bool:
        return bool(self.donate_argnums or self.donate_argnames)


def _pjit_settings(fn: Any, kind: str) -> JitSettings:
    """The settings of a ``jax.jit`` object, from its ``_jit_info`` (see the module docstring)."""
    import jax

    info = getattr(fn, "_jit_info", None)
    fields = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames", "compiler_options_kvs",
              "in_shardings_treedef", "in_shardings_leaves", "out_shardings_treedef", "out_shardings_leaves",
              "user_specified_in_shardings", "keep_unused")
    if info is None or not all(hasattr(info, f) for f in fields):
        return JitSettings(kind, None, readable=False, wrapper=fn)

    def tree(treedef: Any, leaves: tuple) -> Any:
        if all(_unspecified(x) for x in leaves):
            return None
        return jax.tree_util.tree_unflatten(treedef, [None if _unspecified(x) else x for x in leaves])

    return JitSettings(
        kind, getattr(fn, "__wrapped__", None), True,
        tuple(info.static_argnums), tuple(info.static_argnames),
        tuple(info.donate_argnums), tuple(info.donate_argnames),
        tree(info.in_shardings_treedef, info.in_shardings_leaves) if info.user_specified_in_shardings else None,
        tree(info.out_shardings_treedef, info.out_shardings_leaves),
        dict(info.compiler_options_kvs or ()), bool(info.keep_unused), fn)


def _unspecified(x: Any) -> bool:
    """JAX's ``UNSPECIFIED`` marker (a private class: recognised by its name)."""
    return type(x).__name__ == "UnspecifiedValue"


def options_text(settings: JitSettings | None) -> tuple[tuple[str, str], ...]:
    """``(name, value text)`` of the jit's ``compiler_options``, sorted by name (for the report,
    snapshots and the facts cache key)."""
    if settings is None:
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in settings.compiler_options.items()))


def is_jax_jit(fn: Any) -> bool:
    """A ``jax.jit`` object (``jax.stages.Wrapped``) that is not Flax's or Equinox's wrapper."""
    import jax

    return isinstance(fn, jax.stages.Wrapped) and not (type(fn).__module__ or "").startswith(("flax", "equinox"))


def jit_settings(fn: Any, n_args: int = 0) -> JitSettings:
    """What ``fn``'s own jit says (see :class:`JitSettings`); ``n_args`` positional arguments are
    given (for Equinox's ``donate="all"``, which names no positions)."""
    module = type(fn).__module__ or ""
    if module.startswith("flax") and hasattr(fn, "jitted_fn"):
        inner = _pjit_settings(fn.jitted_fn, "nnx.jit")
        # The inner jit's shardings are over NNX's split graph state; the wrapper keeps the user's
        # (in_shardings with a None put in at each static position, so they line up with the args).
        return dataclasses.replace(inner, fun=None, in_shardings=getattr(fn, "in_shardings", None),
                                   out_shardings=getattr(fn, "out_shardings", None), wrapper=fn)
    if module.startswith("equinox") and hasattr(fn, "donate_first") and hasattr(fn, "donate_rest"):
        nums = tuple(i for i in range(n_args) if (fn.donate_first if i == 0 else fn.donate_rest))
        return JitSettings("eqx.filter_jit", None, True, donate_argnums=nums, wrapper=fn)
    if is_jax_jit(fn):
        return _pjit_settings(fn, "jax.jit")
    return JitSettings()


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
        is_leaf = lambda x: x is None or isinstance(x, (NamedSharding, PartitionSpec)) or is_flax_prefix(x)  # noqa: E731
        if prefix is None or isinstance(prefix, (NamedSharding, PartitionSpec)) or is_flax_prefix(prefix):
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


def is_flax_prefix(x: Any) -> bool:
    """An ``nnx.StateSharding`` (a sharding per Variable filter; recognised by module and method)."""
    return (type(x).__module__ or "").startswith("flax") and hasattr(x, "map_prefix")


def _broadcast(prefix: Any, sub: Any) -> list:
    """One sharding per array leaf of ``sub`` from one prefix entry: a sharding (or None) stands for
    the whole subtree; an ``nnx.StateSharding`` gives each Variable of each graph node its own."""
    import jax

    if is_flax_prefix(prefix):
        from stagetool.inputs.frameworks import flax as flax_support

        return flax_support.state_sharding_leaves(prefix, sub)
    return [prefix] * len(jax.tree_util.tree_leaves(sub))


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
        self._stagetool_wraps = getattr(wrapper, "fun", wrapper)  # errors point at the user's step

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``jitted_fn.trace`` under the wrapper's update context (as ``nnx.jit(...).trace`` runs it);
        returns the ``jax.stages.Traced``."""
        import contextlib

        from flax import nnx

        with nnx.update_context(self.wrapper), (self.rules() if self.rules else contextlib.nullcontext()):
            return self.wrapper.jitted_fn.trace(*args, **kwargs)

    def output_paths(self, out_info: Any, keypath: Callable[[tuple], str]) -> list[str]:
        """Per output leaf (``jax.tree_util`` order), its path as stagetool names it. The jit returns
        ``(arguments' state, keyword arguments' state, output)``; an argument's state is split as its
        input was (same graph, same filters, same order), so its leaves take their inputs' paths
        (:attr:`input_paths`: ``(per positional argument a list, per keyword a list)``); where the step
        changed a graph's structure (other counts), and for the output, ``name/...`` and ``out/...``
        by key path (``keypath``: a key path as ``/a/b`` text)."""
        import jax

        by_arg, by_key = self.input_paths
        paths: list[str] = []
        for i, sub in enumerate(out_info[0]):
            paths += _named(sub, by_arg[i] if i < len(by_arg) else None,
                            self.names[i] if i < len(self.names) else str(i), keypath)
        for k in sorted(out_info[1] or {}):
            paths += _named(out_info[1][k], by_key.get(k), str(k), keypath)
        paths += ["out" + keypath(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(out_info[2])[0]]
        return paths


def _named(sub: Any, inputs: list[str] | None, name: str, keypath: Callable[[tuple], str]) -> list[str]:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(sub)[0]
    if inputs is not None and len(inputs) == len(flat):
        return list(inputs)
    return [name + keypath(kp) for kp, _ in flat]


class EqxProgram:
    """What an ``eqx.filter_jit`` target compiles when run: Equinox's own inner ``jax.jit`` on the
    arguments as Equinox splits them.

    ``eqx.filter_jit`` binds the call to the signature, splits it with ``eqx.is_array`` into
    ``(dynamic to donate, dynamic not donated, static)`` (its private ``equinox._jit._preprocess``)
    and calls a ``jax.jit(fun_wrapped, donate_argnums=0, static_argnums=2)`` it keeps as the
    wrapper's ``_cached``; ``fun_wrapped`` returns ``(marker, array outputs, Static(the rest))``,
    where ``marker`` is a scalar ``int32`` Equinox blocks on. ``eqx.filter_jit(f).lower(...)`` is
    public but takes concrete arrays only (a ``ShapeDtypeStruct`` is not an array to
    ``eqx.is_array``, so it would be static), so stagetool runs Equinox's own split on one
    placeholder NumPy scalar per abstract leaf and puts the abstract leaves back in their places.

    Attributes:
      wrapper: the ``eqx.filter_jit`` object.
      args: ``(dynamic to donate, dynamic not donated)`` with the abstract leaves; ``kwargs``: {}.
      static: Equinox's static part (passed as the jit's static argument).
      rules: logical axis rules held active while tracing (a context manager factory), or None.
    """

    def __init__(self, wrapper: Any, args: tuple, static: Any, rules: Any = None):
        self.wrapper = wrapper
        self.args = args
        self.kwargs: dict = {}
        self.static = static
        self.rules = rules
        self._stagetool_wraps = getattr(wrapper, "__wrapped__", wrapper)  # errors point at the user's step

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """Equinox's jit traced as ``eqx.filter_jit`` calls it; returns the ``jax.stages.Traced``."""
        import contextlib

        with self.rules() if self.rules else contextlib.nullcontext():
            return self.wrapper._cached.trace(*args, self.static, **kwargs)

    def output_paths(self, out_info: Any, keypath: Callable[[tuple], str]) -> list[str]:
        """``marker`` for Equinox's scalar, ``out/...`` for the function's array outputs."""
        import jax

        marker = ["marker"] * len(jax.tree_util.tree_leaves(out_info[0]))
        return marker + ["out" + keypath(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(out_info[1])[0]]


#: what :func:`eqx_program` reads from an ``eqx.filter_jit`` object (Equinox 0.13; pinned by a test)
_EQX_FIELDS = ("_signature", "_dynamic_fun", "_static_fun", "_cached", "donate_first", "donate_rest")


def eqx_program(settings: JitSettings, args: tuple, kwargs: dict, rules: Any = None) -> EqxProgram | None:
    """The :class:`EqxProgram` of an ``eqx.filter_jit`` target called with ``(args, kwargs)``
    (``ShapeDtypeStruct`` leaves and static values), or None where Equinox's internals are not the
    ones read here (another Equinox), the function closes over arrays (its own inputs, which the
    spec does not name), or an argument holds a ``jax.Ref``.

    Raises:
      whatever Equinox raises binding the call to the function's signature.
    """
    import jax
    import numpy as np

    wrapper = settings.wrapper
    if settings.kind != "eqx.filter_jit" or not all(hasattr(wrapper, f) for f in _EQX_FIELDS):
        return None
    try:
        from equinox._jit import _preprocess
    except ImportError:
        return None
    if jax.tree_util.tree_leaves(wrapper._dynamic_fun):
        return None
    flat, treedef = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
    if any(isinstance(x, jax.ref.AbstractRef) for x in flat):
        return None
    back: dict[int, Any] = {}

    def placeholder(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        p = np.zeros((), np.float32)  # an array to eqx.is_array; stands for x (by identity) only
        back[id(p)] = x
        return p

    a, k = jax.tree_util.tree_unflatten(treedef, [placeholder(x) for x in flat])
    info = (wrapper._signature, wrapper._dynamic_fun, wrapper._static_fun, wrapper.donate_first, wrapper.donate_rest)
    donate, keep, static = _preprocess(info, a, k, return_static=True)
    restore = lambda tree: jax.tree_util.tree_map(lambda x: back.get(id(x), x), tree)  # noqa: E731
    donate, keep = restore(donate), restore(keep)
    if len(jax.tree_util.tree_leaves((donate, keep))) != len(back):
        return None  # Equinox kept an abstract leaf static: not a split this module knows
    return EqxProgram(wrapper, (donate, keep), static, rules)


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
    from flax import nnx

    with nnx.update_context(wrapper):
        pure_args, pure_kwargs = wrapper._get_pure_args_kwargs(tuple(args), dict(kwargs))
    return NnxProgram(wrapper, tuple(pure_args), dict(pure_kwargs), names, rules)


def nnx_jit_settings(fn: Callable[..., Any], static_argnames: tuple[str, ...] = ()) -> JitSettings:
    """The settings of ``nnx.jit(fn, static_argnames=...)``: a plain step over Flax NNX objects staged
    as ``nnx.jit`` runs it (used where its arguments share Variables, which only ``nnx.jit``'s one-graph
    split keeps as one; see :func:`stagetool.inputs.avals.share_arguments`). No donation: a spec
    ``donate`` is merged as for any ``nnx.jit`` target."""
    from flax import nnx

    return jit_settings(nnx.jit(fn, static_argnames=tuple(static_argnames) or None))


def nnx_with_donation(settings: JitSettings, donate_argnums: tuple[int, ...], donate_argnames: tuple[str, ...]
                      ) -> JitSettings | None:
    """An ``nnx.jit`` target's settings with the spec's donation merged in: the step underneath
    (``.fun``) jitted once more by ``nnx.jit`` with its own shardings and ``keep_unused`` and the
    merged donation (never a jit around the wrapper). None where that cannot be done faithfully: the
    wrapper has static arguments (its ``in_shardings`` attribute then holds Nones put in for them),
    or its inner jit pins a device or backend or inlines (read from ``_jit_info``, as above)."""
    wrapper = settings.wrapper
    info = getattr(getattr(wrapper, "jitted_fn", None), "_jit_info", None)
    if settings.kind != "nnx.jit" or info is None or settings.static_argnums or settings.static_argnames:
        return None
    if getattr(info, "device", None) is not None or getattr(info, "backend", None) is not None \
            or getattr(info, "inline", False) or not hasattr(wrapper, "fun"):
        return None
    from flax import nnx

    again = nnx.jit(wrapper.fun, in_shardings=settings.in_shardings, out_shardings=settings.out_shardings,
                    donate_argnums=tuple(donate_argnums) or None, donate_argnames=tuple(donate_argnames) or None,
                    keep_unused=settings.keep_unused)
    return dataclasses.replace(settings, donate_argnums=tuple(donate_argnums), donate_argnames=tuple(donate_argnames),
                               wrapper=again)
