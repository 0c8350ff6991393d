"""What a target's own jit says: the settings of a ``jax.jit``, ``nnx.jit`` or ``eqx.filter_jit`` object.

A target that is already jitted decides its own static arguments, donation, in/out shardings and
compiler options; stagetool stages it with exactly those (merged with the spec's, see
:func:`stagetool.lowering.stages.jit_function`). jaxlib's jit object (``PjitFunction``) has no
public accessor for the options it was made with; they are read here, in one place, from its
``_jit_info`` (a ``PjitInfo`` named tuple: verified on jax/jaxlib 0.10.2, and
``tests/lowering/test_jit_wrapper.py`` pins every field read). Where that attribute is missing
(another JAX), :func:`jit_settings` says so (``readable=False``) and stagetool stages the wrapper
as it is, nested, as before.

- ``jax.jit``: every setting, from ``_jit_info``; ``__wrapped__`` (set by ``functools.wraps``) is
  the function underneath.
- ``nnx.jit`` (``flax.nnx``'s ``JitWrapped``): donation and static arguments of its inner
  ``jax.jit`` (``.jitted_fn``, whose positions are the step's own); the step keeps NNX's in-place
  semantics, so it is called as it is.
- ``eqx.filter_jit``: ``donate_first`` / ``donate_rest`` (``donate="all"``, ``"all-except-first"``).
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
        return dataclasses.replace(inner, fun=None, in_shardings=None, out_shardings=None, wrapper=fn)
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
        is_leaf = lambda x: x is None or isinstance(x, (NamedSharding, PartitionSpec))  # noqa: E731
        if prefix is None or isinstance(prefix, (NamedSharding, PartitionSpec)):
            per = [prefix] * count
        else:
            per = []
            try:
                jax.tree_util.tree_map(lambda s, sub: per.extend([s] * len(jax.tree_util.tree_leaves(sub))),
                                       prefix, arg, is_leaf=is_leaf)
            except (ValueError, TypeError):
                per = [None] * count
        for s in per:
            spec = s.spec if isinstance(s, NamedSharding) else s
            out.append(spec_dims(spec) if isinstance(spec, PartitionSpec) else None)
    return out
