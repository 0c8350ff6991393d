"""Keras 3 on the JAX backend (imported only when the user's code has imported ``keras``): the
names of a model's state leaves.

A Keras JAX train step takes its state as plain lists of arrays, as Keras' own guides build it
(``[v.value for v in model.trainable_variables]``, ``optimizer.variables``, ...), so nothing in the
tree says which variable a leaf is: it would be named by position (``state/0/9``). Each of those
arrays is the very ``jax.Array`` a ``keras.Variable`` holds, so :func:`leaf_names` finds, by
identity, the variable whose value a leaf is, among the variables of the Keras objects (layers and
models, optimizers, metrics, variables) that the user's modules hold, and names the leaf by the
variable's own ``variable.path`` (``hidden/kernel``, ``adam/hidden_kernel_momentum``).

:func:`notes` says where the active ``ModelParallel``'s ``LayoutMap`` lays out nothing: a key that
no variable path and no layer output path matches whole, as Keras matches them (``re.fullmatch``:
``'d1/kernel'`` does not match ``sequential/d1/kernel``), leaves those variables replicated with no
word from Keras.

Public Keras is read (``keras.Variable.path``/``.value``, ``.variables`` of layers, optimizers and
metrics, ``Layer.path``/``.layers``, ``keras.distribution.distribution()``), and one private field:
``ModelParallel._layout_map`` (no public accessor; marked ``private-api``).
"""

from __future__ import annotations

import sys
from typing import Any

import keras

from stagetool.inputs.frameworks import Pytree

_HOLDERS = (keras.layers.Layer, keras.optimizers.Optimizer, keras.metrics.Metric)


def _variables(obj: Any) -> list:
    if isinstance(obj, keras.Variable):
        return [obj]
    if isinstance(obj, _HOLDERS):
        try:
            return list(obj.variables)
        except Exception:  # an object half built: it names nothing  # noqa: BLE001
            return []
    return []


def _user_modules() -> list:
    from stagetool.core.paths import is_library_file

    return [m for m in list(sys.modules.values())
            if isinstance(getattr(m, "__file__", None), str) and not is_library_file(m.__file__)]


def variable_paths() -> dict[int, tuple[str, Any]]:
    """``id(array) → (variable.path, array)`` for the current value of every Keras variable held by a
    user module (not a library's): by a module global, an item of a global list/tuple/dict, or an
    attribute of a global object (a trainer holding its model), each Keras object with all of its
    variables (a model's layers', an optimizer's slots; a compiled model's optimizer and metrics,
    which ``model.fit``'s state holds)."""
    found: dict[int, tuple[str, Any]] = {}
    for obj in _held_objects():
        for v in _variables(obj):
            try:
                value = v.value
            except Exception:  # an uninitialised variable has no array yet  # noqa: BLE001
                continue
            found.setdefault(id(value), (v.path, value))
    return found


def _held_objects() -> list:
    """The Keras objects (layers and models, optimizers, metrics, variables) the user's modules hold:
    by a module global, an item of a global list/tuple/dict, or an attribute of a global object; and
    a compiled model's optimizer and metrics (``model.optimizer``, ``model.metrics``)."""
    held: list = []
    seen: set[int] = set()

    def take(obj: Any) -> None:
        if id(obj) not in seen and isinstance(obj, (keras.Variable, *_HOLDERS)):
            seen.add(id(obj))
            held.append(obj)
            if isinstance(obj, keras.Model):  # model.compile(...)'s optimizer and metrics: model.fit's state
                take(getattr(obj, "optimizer", None))
                for m in getattr(obj, "metrics", None) or []:
                    take(m)

    for module in _user_modules():
        for obj in list(vars(module).values()):
            if isinstance(obj, (list, tuple)):
                for x in obj:
                    take(x)
            elif isinstance(obj, dict):
                for x in list(obj.values()):
                    take(x)
            elif isinstance(obj, (keras.Variable, *_HOLDERS)):
                take(obj)
            elif not isinstance(obj, type) and type(obj).__module__ not in ("builtins",) and hasattr(obj, "__dict__"):
                try:
                    attrs = list(vars(obj).values())
                except TypeError:
                    continue
                for x in attrs:
                    take(x)
    return held


def _paths_laid_out() -> list[str]:
    """The paths a ``LayoutMap`` key is matched against: every variable's path and every layer's
    output path (``sequential/d2/output``) of the Keras objects the user's modules hold."""
    paths: list[str] = []
    todo = _held_objects()
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        paths += [str(v.path) for v in _variables(obj)]
        if isinstance(obj, keras.layers.Layer):
            paths.append(f"{obj.path}/output")
            todo += list(getattr(obj, "layers", None) or [])
    return list(dict.fromkeys(paths))


def notes() -> tuple[str, ...]:
    """One note per key of the active ``keras.distribution.ModelParallel``'s ``LayoutMap`` that lays
    out nothing: it matches, whole (Keras' ``re.fullmatch``), no variable path and no layer output path
    of the Keras objects the user's modules hold, so what it names is left as Keras lays it without
    one (variables replicated). The note names the key, the paths it was likely meant for (those it
    matches at their end) and the key that would match them. () without such a distribution."""
    import re

    dist = keras.distribution.distribution()
    layout_map = getattr(dist, "_layout_map", None)  # private-api: ModelParallel's LayoutMap, no accessor
    if not isinstance(layout_map, keras.distribution.LayoutMap):
        return ()
    paths = _paths_laid_out()
    if not paths:
        return ()

    def matches(key: str, path: str) -> bool:
        try:
            return key == path or re.fullmatch(key, path) is not None
        except re.error:
            return False

    out = []
    for key in list(layout_map):
        if any(matches(key, p) for p in paths):
            continue
        meant = [p for p in paths if matches(f".*{key}", p)]
        hint = (f"; it matches {', '.join(meant[:3])}{' and more' if len(meant) > 3 else ''} at the end: "
                f"write '.*{key}' or the whole path") if meant else ""
        out.append(f"the Keras LayoutMap key '{key}' lays out nothing: Keras matches a key against the whole "
                   f"variable or layer output path (re.fullmatch), and no path of the model matches it, so what it "
                   f"names keeps Keras' default layout (variables replicated){hint}")
    return tuple(out)


def leaf_names(tree: Pytree) -> list[str | None]:
    """Per leaf of ``tree`` (``jax.tree_util.tree_leaves`` order), the ``variable.path`` of the Keras
    variable whose current value that leaf is (the same array object), or None."""
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    if not any(isinstance(x, jax.Array) for x in leaves):
        return [None] * len(leaves)
    paths = variable_paths()
    return [paths[id(x)][0] if isinstance(x, jax.Array) and id(x) in paths else None for x in leaves]
