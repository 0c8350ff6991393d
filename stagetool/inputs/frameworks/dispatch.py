"""Plain JAX programs staged as they run, and the one place that asks the frameworks (Flax NNX,
Flax Linen, Equinox: :data:`stagetool.inputs.frameworks.FRAMEWORKS`) for what differs.

Nothing here imports a framework: its module is imported only when the user's own objects are of
its types (``type(x).__module__``), so stagetool runs without them.

- :func:`trace_any`: ``jax.eval_shape`` of an ``init`` whose output holds non-array leaves
  too (an Equinox module's activation function, a string), split as ``eqx.filter_eval_shape``
  does: arrays become ``ShapeDtypeStruct``s (dtype, ``weak_type`` and sharding as JAX gives them),
  everything else is kept as it is.
- :func:`model_shardings`: per leaf of an ``init``'s output, the sharding the model itself gives
  (the frameworks' ``is_box`` / ``box_dims``: Flax NNX variable metadata, Linen ``Partitioned`` /
  ``LogicallyPartitioned`` boxes through logical axis rules).
- :func:`prepare_call`: the function that is handed to ``jax.jit``. Where the arguments hold
  non-array leaves (static under ``jax.jit``'s eyes), objects that the step updates in place (the
  frameworks' ``has_state``: Flax NNX), or logical axis rules must be active while tracing, the
  target is wrapped in a pure function of the array leaves whose outputs include the updated
  state, so that nothing the step does is dropped from the staged program.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import ModuleType
from typing import Any, Callable, Iterator

from stagetool.core.sharding import spec_dims
from stagetool.inputs.frameworks import LEAF_NAMERS, Pytree, adapters, library_of, module_library


def _hooks(tree: Pytree, hook: str) -> list[ModuleType]:
    """The framework modules that provide ``hook``, for the frameworks whose objects are in ``tree``."""
    libraries = dict.fromkeys(library_of(x) for x in _tree_objects(tree))
    return [m for lib in libraries if lib for m in adapters(lib) if hasattr(m, hook)]


def _tree_objects(tree: Pytree) -> Iterator[Any]:
    """Every node of a pytree (containers and leaves), without importing any framework."""
    import jax

    seen: list[Any] = []

    def visit(x: Any) -> bool:
        seen.append(x)
        return False

    jax.tree_util.tree_leaves(tree, is_leaf=visit)
    return iter(seen)


def uses(tree: Pytree, library: str) -> bool:
    """Whether some node of ``tree`` is an object of ``library`` (``"flax"``, ``"equinox"``)."""
    return any(library_of(x) == library for x in _tree_objects(tree))


def leaf_names(tree: Pytree) -> list[str | None]:
    """Per leaf of ``tree`` (``jax.tree_util.tree_leaves`` order), the name a framework gives a plain
    array leaf (Keras: the ``variable.path`` of the variable whose value it is), or None. Only a
    framework the user's code has already imported (in ``sys.modules``) is asked, so none is imported
    here; without one every entry is None."""
    import sys

    import jax

    names: list[str | None] = [None] * len(jax.tree_util.tree_leaves(tree))
    for library in LEAF_NAMERS:
        if library not in sys.modules:
            continue
        for m in adapters(library):
            names = [a or b for a, b in zip(names, m.leaf_names(tree), strict=True)]
    return names


def framework_notes() -> tuple[str, ...]:
    """What a framework the user's code has imported (in ``sys.modules``) says about how the program
    is set up, for the report's notes (Keras: a ``LayoutMap`` key that lays out nothing); none is
    imported here."""
    import sys

    notes: tuple[str, ...] = ()
    for library in LEAF_NAMERS:
        if library not in sys.modules:
            continue
        for m in adapters(library):
            notes += tuple(getattr(m, "notes", lambda: ())())
    return notes


def is_array_like(x: Any, *, python_scalars: bool = True) -> bool:
    """A value ``jax.jit`` traces: a JAX or NumPy array (or a tracer), a ``ShapeDtypeStruct``, and
    with ``python_scalars`` a Python number (JAX traces those weakly typed; Equinox keeps them static)."""
    import jax
    import numpy as np

    if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        return True
    return python_scalars and isinstance(x, (bool, int, float, complex))


def is_ref(x: Any) -> bool:
    """A ``jax.Ref`` (or a traced one): its type is a ``jax.ref.AbstractRef``."""
    import jax

    try:
        return isinstance(jax.typeof(x), jax.ref.AbstractRef)
    except (TypeError, AttributeError):
        return False


def trace_any(call: Callable[..., Any], *dyn: Any, python_scalars: bool = True, lines: list | None = None
              ) -> tuple[Any, list[tuple | None], list[bool]]:
    """``jax.eval_shape(call, *dyn)`` for any output pytree, through ``jax.jit(call).trace(*dyn)`` (one
    trace, nothing computed): array leaves as ``ShapeDtypeStruct``s (dtype, ``weak_type``, sharding
    as JAX gives them), other leaves as they are (with ``python_scalars`` false, Python numbers too,
    as ``eqx.filter_eval_shape``); and per leaf of the result (``jax.tree_util.tree_leaves`` order) the PartitionSpec dims the
    program gives it when it runs — a nested ``jax.jit``'s ``out_shardings``, a ``device_put`` or
    sharding constraint on it (:func:`stagetool.inputs.init_shardings.produced_dims`) — or None
    (not an array, or the program does not say), and per leaf whether it is a ``jax.Ref`` (its
    value's struct stands for it: a jitted function takes the Ref as an abstract ref). ``lines``, a
    list, is filled with one entry per leaf: the ``file:line`` of the user's code that wrote the
    sharding the program gives it (the equation's innermost user frame: a model's module line, not
    Flax's or Equinox's), or None.

    Raises:
      whatever the user's ``call`` raises while traced.
    """
    import jax

    from stagetool.inputs.init_shardings import produced

    static: list[Any] = []

    def arrays_only(*a: Any) -> Any:
        out = call(*a)
        flat, treedef = jax.tree_util.tree_flatten(out)
        scalars = python_scalars and not _hooks(out, "STATIC_SCALARS")  # Equinox keeps Python numbers static
        refs = [is_ref(x) for x in flat]
        keep = [r or is_array_like(x, python_scalars=scalars) for r, x in zip(refs, flat)]
        static.append((treedef, keep, [None if k else x for k, x in zip(keep, flat)], refs,
                       [None if r else _existing_dims(x) for k, r, x in zip(keep, refs, flat) if k]))
        return [x[...] if r else x for k, r, x in zip(keep, refs, flat) if k]  # a Ref: its value

    traced = jax.jit(arrays_only).trace(*dyn)
    shapes = traced.out_info
    found = produced(traced.jaxpr)
    dims = [d for d, _ in found]
    treedef, keep, rest, refs, existing = static[0]
    if lines is not None:
        from stagetool.inputs.target import eqn_user_line

        at = iter([None if eqn is None or own is not None else _line_only(eqn_user_line(eqn))
                   for (_, eqn), own in zip(found, existing, strict=True)])
        lines[:] = [next(at) if k else None for k in keep]
    # An output that is an array which already exists (Keras' state: ``[v.value for v in ...]``): the
    # call hands that very array back, so its sharding is the array's own (the trace sees a constant).
    dims = [own if own is not None else d for d, own in zip(dims, existing, strict=True)]
    it, dit = iter(shapes), iter(dims)
    tree = jax.tree_util.tree_unflatten(treedef, [next(it) if k else x for k, x in zip(keep, rest)])
    return tree, [next(dit) if k else None for k in keep], refs


def _line_only(line: str | None) -> str | None:
    """``file:line`` of ``file:line in function``."""
    return line.split(" in ", 1)[0] if line else None


def _existing_dims(x: Any) -> tuple | None:
    """The PartitionSpec dims of a concrete ``jax.Array`` with a ``NamedSharding`` (its mesh noted for
    the mesh checks, :func:`struct_dims`; a host array standing for one put on compile-only devices:
    the sharding it was put with, :func:`stagetool.devices.world.placed_sharding`), or None for
    anything else (a tracer: the program's)."""
    import jax

    from stagetool.devices.world import placed_sharding

    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    placed = placed_sharding(x)
    return struct_dims(x if placed is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed))


def call_init(fn: Callable[..., Any], args: list, kwargs: dict) -> Any:
    """Call an ``init`` target; a framework's class gets the arguments its constructor needs and the
    spec does not give (the frameworks' ``init_kwargs``: a Flax NNX Module's ``rngs=nnx.Rngs(0)``,
    built inside the trace, so no key is computed)."""
    if isinstance(fn, type):
        for m in adapters(library_of_class(fn)):
            kwargs = m.init_kwargs(fn, args, kwargs) if hasattr(m, "init_kwargs") else kwargs
    return fn(*args, **kwargs)


def init_signature(fn: Any) -> Any:
    """What to check an ``init``'s arguments against: ``fn``, or for a framework's class what its
    constructor takes (the frameworks' ``init_signature``: a Flax NNX Module's, ``rngs`` optional)."""
    hooks = [m for m in adapters(module_library(type(fn).__module__)) if hasattr(m, "init_signature")]
    return hooks[0].init_signature(fn) if isinstance(fn, type) and hooks else fn


def library_of_class(cls: type) -> str | None:
    """The framework a class derives from one of the classes of (checked by module), or None."""
    return next((module_library(b.__module__) for b in getattr(cls, "__mro__", ())
                 if module_library(b.__module__) is not None), None)


@contextlib.contextmanager
def logical_rules(rules: Any) -> Iterator[None]:
    """Flax's logical axis rules active (``nn.logical_axis_rules``), or nothing when ``rules`` is None."""
    if rules is None:
        yield
        return
    from stagetool.inputs.frameworks import linen

    with linen.logical_axis_rules(rules):
        yield


def model_shardings(tree: Pytree, rules: Any) -> list[tuple | str | None]:
    """Per leaf of ``tree`` (``jax.tree_util.tree_leaves`` order), the PartitionSpec dims the model's
    own annotations give (the frameworks' boxes: Flax NNX variable metadata, Linen partitioning
    boxes), None where there are none, or a sentence saying why an annotation cannot be resolved
    (logical names, no rules). ``rules``: ``(logical name, mesh axes)`` pairs, or None."""
    import jax

    boxes = _hooks(tree, "box_dims")

    def box_of(x: Any) -> ModuleType | None:
        return next((m for m in boxes if m.is_box(x)), None)

    out: list[tuple | str | None] = []
    for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: box_of(x) is not None):
        framework = box_of(x)
        if framework is None:
            out.append(None)
            continue
        try:
            dims: tuple | str | None = framework.box_dims(x, rules)
        except ValueError as e:
            dims = str(e)
        out.extend([dims] * len(jax.tree_util.tree_leaves(x)))
    return out


def is_state_sharding(x: Any) -> bool:
    """A sharding per Variable filter (an ``nnx.StateSharding``: recognised by module and method)."""
    return library_of(x) == "flax" and hasattr(x, "map_prefix")


def struct_dims(struct: Any) -> tuple | None:
    """The PartitionSpec dims of a ``ShapeDtypeStruct``'s own sharding (an ``init`` that already
    shards, Flax's eager sharding), or None when it has no named sharding."""
    sharding = getattr(struct, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return None
    from stagetool.inputs.seen_meshes import note_sharding

    note_sharding(sharding, "struct")
    return spec_dims(spec)


# ---- the function handed to jax.jit


@dataclasses.dataclass
class PreparedCall:
    """What ``jax.jit`` stages: ``fn(*args, **kwargs)``.

    Attributes:
      fn: the target, or a pure function of the array leaves wrapping it.
      args / kwargs: abstract arguments for ``fn`` (kwargs hold the static keyword values too).
      donate_argnums / donate_argnames: donation in ``fn``'s terms.
      state_outputs: names of the arguments whose updated state ``fn`` returns beside the target's
        own output (``{"out": ..., name: state, ...}``), in order; () when ``fn`` returns the
        target's output as it is.
      leaf_args: per array leaf, the top-level argument it belongs to (index or keyword name).
    """

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    donate_argnums: tuple[int, ...]
    donate_argnames: tuple[str, ...]
    state_outputs: tuple[str, ...] = ()
    leaf_args: tuple = ()


def leaf_arguments(args: tuple, kwargs: dict) -> list[Any]:
    """Per leaf of ``(args, kwargs)`` in JAX's flattening order, its top-level argument (index or name)."""
    import jax

    out = []
    for kp, _ in jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        top = kp[1]
        out.append(top.idx if hasattr(top, "idx") else top.key)
    return out


def prepare_call(fn: Callable[..., Any], args: tuple, kwargs: dict, static_kwargs: dict, *,
                 names: list[str], donate_argnums: tuple[int, ...], donate_argnames: tuple[str, ...],
                 rules: Any = None, where: str = "", in_place: bool = True, by_leaf: bool = False) -> PreparedCall:
    """The function and arguments to hand to ``jax.jit`` (see the module docstring).

    Args:
      fn: the loaded target (possibly ``jax.jit``-, ``nnx.jit``- or ``eqx.filter_jit``-wrapped).
      args / kwargs: the abstract arguments (``ShapeDtypeStruct`` leaves and anything else).
      static_kwargs: the spec's ``static`` values.
      names: names of the positional arguments (for the updated-state outputs).
      donate_argnums / donate_argnames: donated arguments, in the target's terms.
      rules: the logical axis rules object to hold active while tracing, or None.
      where: the spec location, for messages.
      in_place: whether the target has NNX's in-place semantics (a plain function or ``nnx.jit``:
        the updated graph nodes become outputs); False for a ``jax.jit`` target, which returns
        only what it returns (its in-place updates are lost when run, so they are not staged).
      by_leaf: always wrap, so that the jit's arguments are the flat array leaves (for
        ``in_shardings`` given per leaf).

    A ``jax.ref.AbstractRef`` leaf (a ``jax.Ref`` an ``init`` returned) is an input like an array's
    ``ShapeDtypeStruct``: ``jax.jit`` traces it as the abstract ref raw JAX lowers a Ref argument as.
    """
    import jax

    kwargs = dict(kwargs)
    flat, treedef = jax.tree_util.tree_flatten((tuple(args), kwargs))
    mask = [isinstance(x, (jax.ShapeDtypeStruct, jax.ref.AbstractRef)) for x in flat]
    tops = leaf_arguments(tuple(args), kwargs)
    # arguments a step updates in place (Flax NNX graph nodes): each with the framework that says so
    stateful: list[tuple[int | str, ModuleType]] = []
    if in_place:
        frameworks = _hooks((tuple(args), kwargs), "has_state")
        for key, arg in [*enumerate(args), *kwargs.items()]:
            claimed = next((m for m in frameworks if m.has_state(arg)), None)
            stateful += [(key, claimed)] if claimed is not None else []
    # The target itself is called, nnx.jit / eqx.filter_jit wrappers included (a nested jit that
    # JAX inlines): their own shardings apply, and nnx.jit updates the objects in place as it runs.
    inner = fn
    if all(mask) and not stateful and rules is None and not by_leaf:
        return PreparedCall(fn, tuple(args), {**kwargs, **static_kwargs}, donate_argnums, donate_argnames,
                            leaf_args=tuple(tops))
    statics = [None if m else x for m, x in zip(mask, flat)]
    state_names = tuple(names[s] if isinstance(s, int) else s for s, _ in stateful)

    def staged(*dynamic: Any, **static_kw: Any) -> Any:
        it = iter(dynamic)
        a, k = jax.tree_util.tree_unflatten(treedef, [next(it) if m else s for m, s in zip(mask, statics)])
        with logical_rules(rules):
            out = _arrays_only(inner(*a, **k, **static_kw))
        if not stateful:
            return out
        result = {"out": out}
        for (s, framework), name in zip(stateful, state_names):
            result[name] = framework.updated_state(a[s] if isinstance(s, int) else k[s])
        return result

    staged.__name__ = getattr(inner, "__name__", None) or getattr(fn, "__name__", "staged")
    staged.__qualname__ = staged.__name__
    staged._stagetool_wraps = inner  # type: ignore[attr-defined]  # where errors point (not here)
    donated = set(donate_argnums) | set(donate_argnames)
    dyn_tops = [t for m, t in zip(mask, tops) if m]
    nums = tuple(i for i, t in enumerate(dyn_tops) if t in donated)
    dynamic = tuple(x for m, x in zip(mask, flat) if m)
    return PreparedCall(staged, dynamic, dict(static_kwargs), nums, (), state_names, tuple(dyn_tops))


def _arrays_only(out: Pytree) -> Any:
    """The output with leaves JAX cannot return (an Equinox module's functions) as None, as
    ``eqx.filter_jit`` keeps them out of the compiled program."""
    import jax

    return jax.tree_util.tree_map(lambda x: x if is_array_like(x) else None, out)
