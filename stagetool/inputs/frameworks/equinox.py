"""Equinox, as its guides write it (imported only when the user's objects are Equinox's).

- Python numbers are static to Equinox (``eqx.filter_jit``, ``eqx.filter_eval_shape``), not traced.
- ``eqx.filter_jit`` targets: ``donate_first`` / ``donate_rest`` (``donate="all"``,
  ``"all-except-first"``); staged as Equinox's own executable where possible (:class:`EqxProgram`,
  which reads Equinox's private split and jit: see there).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax

from stagetool.inputs.frameworks.jit import JitSettings

#: hook: Python numbers are static, not traced (see stagetool.inputs.frameworks)
STATIC_SCALARS = True


def jit_settings(fn: Any, n_args: int) -> JitSettings | None:
    """An ``eqx.filter_jit`` object's donation (positions up to ``n_args``), or None for another object."""
    if not (hasattr(fn, "donate_first") and hasattr(fn, "donate_rest")):
        return None
    nums = tuple(i for i in range(n_args) if (fn.donate_first if i == 0 else fn.donate_rest))
    return JitSettings("eqx.filter_jit", None, True, donate_argnums=nums, wrapper=fn)


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
        # private-api: the function under filter_jit (functools.wraps); errors point at the user's step
        self._stagetool_wraps = getattr(wrapper, "__wrapped__", wrapper)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """Equinox's jit traced as ``eqx.filter_jit`` calls it; returns the ``jax.stages.Traced``."""
        with self.rules() if self.rules else contextlib.nullcontext():
            return self.wrapper._cached.trace(*args, self.static, **kwargs)  # private-api: filter_jit's inner jax.jit

    def output_paths(self, out_info: Any, keypath: Callable[[tuple], str]) -> list[str]:
        """``marker`` for Equinox's scalar, ``out/...`` for the function's array outputs."""
        marker = ["marker"] * len(jax.tree_util.tree_leaves(out_info[0]))
        return marker + ["out" + keypath(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(out_info[1])[0]]


def placeholder_call(args: tuple, kwargs: dict) -> tuple[tuple, dict, dict[int, Any]] | None:
    """``(args, kwargs)`` with each ``ShapeDtypeStruct`` leaf replaced by a 0-d NumPy array, which
    ``eqx.is_array`` takes for an array (so Equinox's and haliax's splits put it with the dynamic
    arguments) and which stands for the leaf by identity: the third item maps ``id(placeholder)`` to
    the ``ShapeDtypeStruct``. None where a leaf is an abstract ``jax.Ref``, which neither split takes."""
    import numpy as np

    flat, treedef = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
    if any(isinstance(x, jax.ref.AbstractRef) for x in flat):
        return None
    back: dict[int, Any] = {}

    def placeholder(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        p = np.zeros((), np.float32)
        back[id(p)] = x
        return p

    a, k = jax.tree_util.tree_unflatten(treedef, [placeholder(x) for x in flat])
    return a, k, back


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

    wrapper = settings.wrapper
    if settings.kind != "eqx.filter_jit" or not all(hasattr(wrapper, f) for f in _EQX_FIELDS):
        return None
    try:
        from equinox._jit import _preprocess  # private-api: Equinox's split into donated, kept, static
    except ImportError:
        return None
    if jax.tree_util.tree_leaves(wrapper._dynamic_fun):  # private-api: the arrays the function closes over
        return None
    called = placeholder_call(args, kwargs)
    if called is None:
        return None
    a, k, back = called
    # private-api: filter_jit's _signature, _dynamic_fun, _static_fun, as _preprocess takes them
    info = (wrapper._signature, wrapper._dynamic_fun, wrapper._static_fun, wrapper.donate_first, wrapper.donate_rest)
    donate, keep, static = _preprocess(info, a, k, return_static=True)
    restore = lambda tree: jax.tree_util.tree_map(lambda x: back.get(id(x), x), tree)  # noqa: E731
    donate, keep = restore(donate), restore(keep)
    if len(jax.tree_util.tree_leaves((donate, keep))) != len(back):
        return None  # Equinox kept an abstract leaf static: not a split this module knows
    return EqxProgram(wrapper, (donate, keep), static, rules)
