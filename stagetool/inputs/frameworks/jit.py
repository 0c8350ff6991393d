"""A ``jax.jit`` object's own settings: what stagetool stages a jitted target with.

jaxlib's jit object (``PjitFunction``) has no public accessor for the options it was made with;
they are read here, in one place, from its ``_jit_info`` (a ``PjitInfo`` named tuple: verified on
jax/jaxlib 0.10.2, and ``tests/inputs/test_jit_wrapper.py`` pins every field read). Where that
attribute is missing (another JAX), :func:`pjit_settings` says so (``readable=False``) and stagetool
stages the wrapper as it is, nested. ``__wrapped__`` (set by ``functools.wraps``) is the function
underneath.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from stagetool.inputs.frameworks import library_of


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
        arguments: shardings, ``PartitionSpec``s, None), or None when not given.
      out_shardings: the user's ``out_shardings`` (a tree prefix of the output), or None when not given.
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


#: the fields of ``_jit_info`` read by :func:`pjit_settings` (pinned by a test)
_PJIT_FIELDS = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames", "compiler_options_kvs",
                "in_shardings_treedef", "in_shardings_leaves", "out_shardings_treedef", "out_shardings_leaves",
                "user_specified_in_shardings", "keep_unused")


def pjit_settings(fn: Any, kind: str) -> JitSettings:
    """The settings of a ``jax.jit`` object (``kind``: what to call it), from its ``_jit_info``."""
    import jax

    info = getattr(fn, "_jit_info", None)  # private-api: jaxlib's PjitInfo, the jit's own options
    if info is None or not all(hasattr(info, f) for f in _PJIT_FIELDS):
        return JitSettings(kind, None, readable=False, wrapper=fn)

    def tree(treedef: Any, leaves: tuple) -> Any:
        if all(_unspecified(x) for x in leaves):
            return None
        return jax.tree_util.tree_unflatten(treedef, [None if _unspecified(x) else x for x in leaves])

    return JitSettings(
        kind, getattr(fn, "__wrapped__", None), True,  # private-api: functools.wraps' function underneath
        tuple(info.static_argnums), tuple(info.static_argnames),
        tuple(info.donate_argnums), tuple(info.donate_argnames),
        tree(info.in_shardings_treedef, info.in_shardings_leaves) if info.user_specified_in_shardings else None,
        tree(info.out_shardings_treedef, info.out_shardings_leaves),
        dict(info.compiler_options_kvs or ()), bool(info.keep_unused), fn)


def _unspecified(x: Any) -> bool:
    """JAX's ``UNSPECIFIED`` marker."""
    return type(x).__name__ == "UnspecifiedValue"  # private-api: JAX's marker class, known by its name


def is_jax_jit(fn: Any) -> bool:
    """A ``jax.jit`` object (``jax.stages.Wrapped``) that is not a framework's own wrapper."""
    import jax

    return isinstance(fn, jax.stages.Wrapped) and library_of(fn) is None
