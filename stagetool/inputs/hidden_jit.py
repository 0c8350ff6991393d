"""A ``jax.jit`` that stagetool does not unwrap, named: never a silent drop of its donation.

stagetool reads the settings of ``jax.jit``, ``nnx.jit``, ``eqx.filter_jit`` and haliax ``named_jit``
targets (:mod:`stagetool.inputs.jit_wrapper`). Any other callable holding a ``jax.jit`` — another
library's own wrapper, a ``functools.partial`` or a callable object around a jit — is
staged nested inside stagetool's own jit, where JAX inlines the inner jit: its donation, in/out
shardings and static arguments are not the program's. :func:`hidden_jit_note` finds such a jit
(on the callable's attributes, its ``__wrapped__``/``func``, its closure, to a small depth) and
says so in a note.
"""

from __future__ import annotations

from typing import Any

from stagetool.core.paths import is_library_file

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

    from stagetool.inputs.frameworks import library_of
    from stagetool.inputs.frameworks.jit import is_jax_jit, pjit_settings

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
