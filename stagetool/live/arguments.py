"""The caller's arguments as the spec's values, laid on the staged mesh: each argument a
:class:`~stagetool.spec.model.ValueSpec` (:func:`spec_value`; NumPy arrays as ``ShapeDtypeStruct``s),
``out_shardings``' PartitionSpecs as :class:`~stagetool.core.sharding.Sharding`s
(:func:`spec_out_shardings`), the meshes the arguments carry (:func:`meshes`), an argument on another
mesh of the same devices spelled over the staged one (:func:`on_one_mesh`), and a mesh inside a
static value or config re-laid by axis name (:func:`relaid_static`, :func:`relaid_arguments`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from stagetool.core.location import Loc
from stagetool.core.mesh import MeshSpec
from stagetool.live.target import underlying


def spec_value(x: Any, loc: Loc | None) -> Any:
    """One argument as the spec holds it: Python numbers and None as they are (traced as a spec's
    numbers are), anything else a :class:`ValueSpec` (NumPy arrays as ``ShapeDtypeStruct``s, since a
    ``{ref:}`` object's arrays are JAX arrays)."""
    from stagetool.spec.model import ValueSpec

    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return ValueSpec(_numpy_as_structs(x), loc or Loc("<inspect>", 0, 0))


def _numpy_as_structs(x: Any) -> Any:
    import jax
    import numpy as np

    leaves = jax.tree_util.tree_leaves(x)
    if not any(isinstance(v, (np.ndarray, np.generic)) for v in leaves):
        return x  # the object itself (NNX Variables keep their identity)
    return jax.tree_util.tree_map(
        lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) if isinstance(v, (np.ndarray, np.generic))
        else v, x)


def spec_out_shardings(tree: Any) -> Any:
    """``out_shardings`` as the spec holds them: each ``PartitionSpec`` a :class:`Sharding`."""
    if tree is None:
        return None
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from stagetool.core.sharding import Sharding, spec_dims

    def one(s: Any) -> Any:
        if isinstance(s, NamedSharding):
            s = s.spec
        if isinstance(s, PartitionSpec):
            return Sharding("spec", spec_dims(s))
        return s

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda s: isinstance(s, (PartitionSpec, NamedSharding)))


def meshes(tree: Any, abstract: bool = False) -> list:
    """The concrete meshes the leaves' ``NamedSharding``s name, in order, each once; with ``abstract``,
    the ``jax.sharding.AbstractMesh``es instead (``ShapeDtypeStruct``s sharded over a mesh with no
    devices: its axis names, sizes and types)."""
    import jax
    from jax.sharding import AbstractMesh, Mesh

    out: list = []
    for leaf in jax.tree_util.tree_leaves(tree):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if isinstance(mesh, AbstractMesh if abstract else Mesh) and not mesh.empty and not any(mesh == m for m in out):
            out.append(mesh)
    return out


def on_one_mesh(fn: Any, args: tuple, kwargs: dict, mesh_spec: MeshSpec, notes: list[str]) -> tuple[tuple, dict]:
    """The arguments with each array or ``ShapeDtypeStruct`` on another mesh of the same devices (a
    batch on a 1-D ``("devices",)`` mesh beside a 2-D state mesh, as ``jax.jit`` takes them) given the
    equivalent ``PartitionSpec`` on the mesh staged over (the first argument mesh with the staged
    axis names), one note per argument; an argument no spec over that mesh lays alike, as it is."""
    import jax
    from jax.sharding import NamedSharding

    from stagetool.inputs.own_mesh import equivalent_spec

    names = tuple(mesh_spec.names)
    ref = next((m for m in meshes((args, kwargs)) if tuple(m.axis_names) == names), None)
    if ref is None:
        return args, kwargs
    try:
        params = list(__import__("inspect").signature(underlying(fn)).parameters)
    except (TypeError, ValueError):
        params = []
    from stagetool.devices.world import describe_mesh

    def moved(x: Any, what: str, depth: int = 0) -> Any:
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            s = getattr(x, "sharding", None)
            if not isinstance(s, NamedSharding) or s.mesh == ref or s.mesh.empty:
                return x
            spec = equivalent_spec(s, ref, len(x.shape))
            if spec is None:
                return x
            notes.append(f"{what} is laid on another mesh of the same devices ({describe_mesh(s.mesh)}, "
                         f"{s.spec}); staged as the same layout on the mesh ({describe_mesh(ref)}): {spec}, as "
                         "jax.jit takes it")
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(ref, spec, memory_kind=s.memory_kind))
        if depth < 4 and type(x) in (list, tuple):
            return type(x)(moved(v, f"{what}[{i}]", depth + 1) for i, v in enumerate(x))
        if depth < 4 and type(x) is dict:
            return {k: moved(v, f"{what}[{k!r}]", depth + 1) for k, v in x.items()}
        return x

    args = tuple(moved(a, f"argument {params[i] if i < len(params) else i}") for i, a in enumerate(args))
    kwargs = {k: moved(v, f"argument {k}") for k, v in kwargs.items()}
    return args, kwargs


def relaid_static(static: Mapping[str, Any], staged: Any) -> tuple[dict, list[str]]:
    """``(static values, notes)``: each static value holding a ``jax.sharding.Mesh`` with the staged
    mesh's axis names that is not the staged mesh (a jax-llm-examples ``Config(mesh=...)`` of the
    caller's CPU mesh, staged with ``topology="v5e:2x4"``) with that mesh replaced by the staged
    one — re-laid by axis name, as the CLI's ``{mesh: staged}`` gives the code the staged mesh — in
    a frozen dataclass, a NamedTuple, a dict, list or tuple (four levels deep); one note per value.
    Values with no such mesh are the same objects."""
    out: dict = {}
    notes: list[str] = []
    from stagetool.devices.world import describe_mesh

    for name, value in static.items():
        found: list = []
        new = _replace_mesh(value, staged, found, 0)
        out[name] = new
        if found:
            notes.append(f"static={name!r} holds the mesh {describe_mesh(found[0])}; it is re-laid by axis name on "
                         f"the staged mesh ({describe_mesh(staged)}), as the same code with its mesh built for these "
                         "devices runs")
    return out, notes


def relaid_arguments(fspec: Any, staged: Any, fn: Any = None) -> tuple[Any, list[str]]:
    """``(fspec, notes)``: each argument that ``jax.jit`` takes as static although it is passed as an
    argument — a value with no array leaves, as a config class registered with
    ``jax.tree_util.register_static`` is (jax-llm-examples: ``step(x, cfg)``) — given the staged mesh
    in place of a mesh it holds with the staged axis names, as :func:`relaid_static` does for
    ``static=``; one note per argument. ``fspec`` (a :class:`~stagetool.spec.model.FunctionSpec` of
    :class:`~stagetool.spec.model.ValueSpec` arguments; ``fn``, the function, names them) is returned
    as it is when none holds one."""
    import jax

    from stagetool.devices.world import describe_mesh
    from stagetool.spec.model import ValueSpec

    try:
        params = list(__import__("inspect").signature(underlying(fn)).parameters)
    except (TypeError, ValueError):
        params = []
    notes: list[str] = []

    def relaid(value: Any, what: str) -> Any:
        if not isinstance(value, ValueSpec) or jax.tree_util.tree_leaves(value.value):
            return value  # arrays (or leaves jax.jit traces): staged as they are, each on the mesh
        found: list = []
        new = _replace_mesh(value.value, staged, found, 0)
        if not found:
            return value
        notes.append(f"{what} holds the mesh {describe_mesh(found[0])} and is static to jax.jit (no array leaves: "
                     f"jax.tree_util.register_static); it is re-laid by axis name on the staged mesh "
                     f"({describe_mesh(staged)}), as the same code with its mesh built for these devices runs")
        return dataclasses.replace(value, value=new)

    args = tuple(relaid(a, f"argument {params[i] if i < len(params) else i}") for i, a in enumerate(fspec.args))
    kwargs = {k: relaid(v, f"argument {k}") for k, v in fspec.kwargs.items()}
    if not notes:
        return fspec, notes
    return dataclasses.replace(fspec, args=args, kwargs=kwargs), notes


def _replace_mesh(value: Any, staged: Any, found: list, depth: int) -> Any:
    from jax.sharding import Mesh

    if isinstance(value, Mesh):
        if value != staged and not value.empty and tuple(value.axis_names) == tuple(staged.axis_names):
            found.append(value)
            return staged
        return value
    if depth >= 4:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if not f.init:
                continue
            old = getattr(value, f.name)
            new = _replace_mesh(old, staged, found, depth + 1)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, tuple) and hasattr(value, "_replace") and hasattr(value, "_fields"):
        changes = {}
        for k in value._fields:
            old = getattr(value, k)
            new = _replace_mesh(old, staged, found, depth + 1)
            if new is not old:
                changes[k] = new
        return value._replace(**changes) if changes else value
    if type(value) in (list, tuple):
        items = [_replace_mesh(v, staged, found, depth + 1) for v in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value)) else value
    if type(value) is dict:
        items = {k: _replace_mesh(v, staged, found, depth + 1) for k, v in value.items()}
        return items if any(items[k] is not value[k] for k in value) else value
    return value
