"""What a target's own jit says: the settings of a ``jax.jit``, ``nnx.jit``, ``eqx.filter_jit`` or ``hax.named_jit`` object.

A target that is already jitted decides its own static arguments, donation, in/out shardings and
compiler options; stagetool stages it with exactly those (merged with the spec's, see
:func:`stagetool.staging.stages.jit_function`). A ``jax.jit`` object's settings are read by
:mod:`stagetool.inputs.frameworks.jit`; a framework's own wrapper (``nnx.jit``, ``eqx.filter_jit``)
by that framework's module (its ``jit_settings``), which also stages it as its own program where
the spec adds nothing (:class:`stagetool.inputs.frameworks.nnx.NnxProgram`,
:class:`stagetool.inputs.frameworks.equinox.EqxProgram`,
:class:`stagetool.inputs.frameworks.haliax.HaliaxProgram`).
"""

from __future__ import annotations

from typing import Any

from stagetool.inputs.frameworks import Pytree, adapters, library_of
from stagetool.inputs.frameworks.dispatch import is_state_sharding
from stagetool.inputs.frameworks.jit import JitSettings, is_jax_jit, pjit_settings


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
