"""Keras 3 on the JAX backend (imported only when the user's code has imported ``keras``): the
names of a model's state leaves.

A Keras JAX train step takes its state as plain lists of arrays, as Keras' own guides build it
(``[v.value for v in model.trainable_variables]``, ``optimizer.variables``, ...), so nothing in the
tree says which variable a leaf is: it would be named by position (``state/0/9``). Each of those
arrays is the very ``jax.Array`` a ``keras.Variable`` holds, so :func:`leaf_names` finds, by
identity, the variable whose value a leaf is, among the variables of the Keras objects (layers and
models, optimizers, metrics, variables) that the user's modules hold, and names the leaf by the
variable's own ``variable.path`` (``hidden/kernel``, ``adam/hidden_kernel_momentum``).

Only public Keras is read (``keras.Variable.path``/``.value``, ``.variables`` of layers, optimizers
and metrics).
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
    variables (a model's layers', an optimizer's slots)."""
    found: dict[int, tuple[str, Any]] = {}
    seen: set[int] = set()

    def take(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for v in _variables(obj):
            try:
                value = v.value
            except Exception:  # an uninitialised variable has no array yet  # noqa: BLE001
                continue
            found.setdefault(id(value), (v.path, value))

    for module in _user_modules():
        for obj in list(vars(module).values()):
            if isinstance(obj, (list, tuple)):
                for x in obj:
                    take(x)
            elif isinstance(obj, dict):
                for x in list(obj.values()):
                    take(x)
            elif _variables(obj):
                take(obj)
            elif not isinstance(obj, type) and type(obj).__module__ not in ("builtins",) and hasattr(obj, "__dict__"):
                try:
                    attrs = list(vars(obj).values())
                except TypeError:
                    continue
                for x in attrs:
                    take(x)
    return found


def leaf_names(tree: Pytree) -> list[str | None]:
    """Per leaf of ``tree`` (``jax.tree_util.tree_leaves`` order), the ``variable.path`` of the Keras
    variable whose current value that leaf is (the same array object), or None."""
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    if not any(isinstance(x, jax.Array) for x in leaves):
        return [None] * len(leaves)
    paths = variable_paths()
    return [paths[id(x)][0] if isinstance(x, jax.Array) and id(x) in paths else None for x in leaves]
