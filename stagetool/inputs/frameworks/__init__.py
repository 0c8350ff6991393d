"""The frameworks people write models with, one module each, imported only when the user's own
objects are of that library's types (``type(x).__module__``), so that stagetool runs without them.

- :mod:`.dispatch`: plain JAX, and the one place that asks the frameworks below (through
  :data:`FRAMEWORKS`): ``eval_shape`` of any ``init``, the model's own shardings, the function
  handed to ``jax.jit``.
- :mod:`.jit`: a ``jax.jit`` object's own settings (:class:`~.jit.JitSettings`).
- :mod:`.nnx`: Flax NNX (Variables' sharding metadata, in-place steps, ``nnx.jit`` programs).
- :mod:`.linen`: Flax Linen (partitioning boxes, logical axis rules).
- :mod:`.equinox`: Equinox (``eqx.filter_jit`` programs; Python numbers static).
- :mod:`.haliax`: haliax, Levanter's named arrays (``hax.named_jit`` programs; Python numbers static).
- :mod:`.keras`: Keras 3 on the JAX backend (state leaves named by their ``keras.Variable``'s path).

Adding a framework is one module here and one line in :data:`FRAMEWORKS`. A module provides the
hooks that apply to it (each optional): ``is_box(x)`` / ``box_dims(box, rules)`` (the model's own
sharding annotations), ``init_kwargs(cls, args, kwargs)`` / ``init_signature(cls)`` (an ``init``
that is a class), ``has_state(tree)`` / ``updated_state(obj)`` (steps that update their arguments in
place), ``jit_settings(fn, n_args)`` (the library's jit wrapper), ``STATIC_SCALARS`` (Python numbers
are static, not traced), ``leaf_names(tree)`` (names for plain array leaves, asked only of a library
the user's code has already imported: Keras' state lists), ``notes()`` (what the library's own
setup leaves undone, asked likewise: a Keras ``LayoutMap`` key that lays out nothing).

Every read of another library's private attribute is marked ``# private-api:`` so that
``grep -rn "private-api:" stagetool`` finds them all; each is pinned by ``tests/inputs/test_jit_wrapper.py``:

- :mod:`.jit`: a ``jax.jit`` object's ``_jit_info`` (jaxlib's ``PjitInfo``: static and donated
  arguments, in/out shardings, compiler options, ``keep_unused``; no public accessor), its
  ``__wrapped__`` (the function underneath), JAX's private ``UnspecifiedValue`` (by class name).
- :mod:`.nnx`: ``JitWrapped._get_pure_args_kwargs`` (the split of the arguments ``nnx.jit`` hands
  its inner jit, leaves kept), ``.jitted_fn`` / ``.fun`` (the inner ``jax.jit`` and the step), and
  the inner jit's ``_jit_info`` (device, backend, inline).
- :mod:`.equinox`: ``equinox._jit._preprocess`` (Equinox's split into donated, kept and static
  parts) and the ``eqx.filter_jit`` object's ``_signature``, ``_dynamic_fun``, ``_static_fun`` and
  ``_cached`` (its inner ``jax.jit``).
- :mod:`.keras`: ``ModelParallel._layout_map`` (its ``LayoutMap``, for the note on a key that
  lays out nothing); pinned by ``tests/inputs/test_keras.py``.
- :mod:`.haliax`: the ``hax.named_jit`` object's fields (its function, mappings, donation, jit
  arguments) and ``haliax.partitioning._named_pjit_cache`` (the ``jax.jit`` it builds); pinned by
  ``tests/inputs/test_haliax.py``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

Pytree = Any
"""A JAX pytree: nested tuples, lists, dicts, ``None`` and registered nodes (Flax modules and
Variables, Equinox modules, NamedTuples) whose leaves are arrays, ``ShapeDtypeStruct``s, abstract
refs or static Python values (functions, strings, numbers). ``Any`` to a type checker: JAX has no
static type for it."""

#: The frameworks, by the top-level package of their objects' types: the modules of this package
#: that stage their programs (asked in this order).
FRAMEWORKS: dict[str, tuple[str, ...]] = {
    "flax": ("nnx", "linen"),
    "equinox": ("equinox",),
    "haliax": ("haliax",),
    "keras": ("keras",),
}

#: The frameworks (keys of :data:`FRAMEWORKS`) whose modules give ``leaf_names(tree)``: names for plain
#: array leaves, asked only where the user's code has imported the library (``sys.modules``).
LEAF_NAMERS: tuple[str, ...] = ("keras",)


def adapters(library: str | None) -> list[ModuleType]:
    """The modules of ``library`` (a key of :data:`FRAMEWORKS`; [] for None or another), imported."""
    return [importlib.import_module(f"{__name__}.{m}") for m in FRAMEWORKS.get(library or "", ())]


def library_of(x: object) -> str | None:
    """The framework whose type ``x`` is (a key of :data:`FRAMEWORKS`, without importing it), or None."""
    return module_library(type(x).__module__)


def module_library(module: str | None) -> str | None:
    """The framework a module named ``module`` belongs to (``flax.nnx.module`` → ``"flax"``), or None."""
    top = (module or "").split(".")[0]
    return top if top in FRAMEWORKS else None
