"""``stagetool.inspect(..., isolate=True)``: stage in a worker process of its own
(:mod:`stagetool.process.workers`, as ``--isolate``), so that user code that exits or aborts its
process, or a JAX/XLA crash, ends the worker and comes back as a :class:`StagingError`.

The worker is spawned (a fresh interpreter): the function goes by reference (its module and
qualified name, imported there) and the arguments are pickled with every array and
``ShapeDtypeStruct`` replaced by an :class:`AbstractArray` (shape, dtype, PartitionSpec and its
mesh's axes), which the worker turns back into a ``ShapeDtypeStruct`` on an ``AbstractMesh``: no
array data crosses, and no device object (which does not pickle).
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
from typing import Any, Callable

from stagetool.core.errors import StagingError, UsageError


@dataclasses.dataclass(frozen=True)
class AbstractArray:
    """An array argument as a worker rebuilds it: global ``shape``, ``dtype`` name, ``dims`` (the
    PartitionSpec's entries, None when it carries no ``NamedSharding``) and ``mesh_axes`` (that
    sharding's mesh, ``(name, size)`` pairs), ``device_ids`` (that mesh's device ids in its order, kept
    only when the arguments sit on several meshes of the same devices: a second mesh is staged with
    its own sharding, :meth:`stagetool.inputs.avals._Builder.on_own_mesh`, so its devices must cross)."""

    shape: tuple[int, ...]
    dtype: str
    dims: tuple | None = None
    mesh_axes: tuple[tuple[str, int], ...] = ()
    device_ids: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class FunctionRef:
    """A function named by module and qualified name, imported in the worker."""

    module: str
    qualname: str


def inspect_isolated(fn: Callable[..., Any], args: tuple, kwargs: dict, options: Any, *,
                     timeout_s: float | None = None):
    """:func:`stagetool.live.inspect_here` in a spawned worker; its report, or its failure raised.

    Raises:
      UsageError: the function or the arguments cannot be handed to a worker (not importable by
        name, or not picklable once arrays are abstract), before anything starts.
      SpecError, StagingError: as :func:`stagetool.inspect` (re-raised from the worker);
        StagingError too when the worker died (``os._exit``, a signal, an abort) or ran past
        ``timeout_s`` (default :data:`stagetool.gate.run.DEFAULT_TIMEOUT_S`).
    """
    from stagetool.gate.run import DEFAULT_TIMEOUT_S
    from stagetool.process.workers import raise_first_error, run_in_workers

    keep_devices = _several_meshes((args, kwargs))
    payload = (_reference(fn), _abstract(args, keep_devices), _abstract(kwargs, keep_devices), options,
               session_setup())
    try:
        pickle.dumps(payload)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the same answer
        raise UsageError(f"stagetool.inspect(isolate=True): the arguments of {options.name} cannot be handed to a "
                         f"worker process: {e}", hint="pass arrays, ShapeDtypeStructs and plain pytrees of them, "
                                                      "or stage in this process (isolate=False)") from None
    outcomes = run_in_workers(_task, [options.name], jobs=1, common=payload, isolate=True,
                              timeout_s=timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    raise_first_error(outcomes)
    (outcome,) = outcomes
    if outcome.died is not None:
        hint = None
        if "before it started" in outcome.died:
            hint = ("the worker is spawned and imports your main module: a script must call "
                    "stagetool.inspect(..., isolate=True) under `if __name__ == \"__main__\":`")
        raise StagingError(f"{options.name}: {outcome.died}", stage="compile", function=options.name, hint=hint)
    return outcome.value


def _reference(fn: Any) -> Any:
    """``fn`` as the worker gets it: a :class:`FunctionRef` when importing its module finds this
    very object under its qualified name, else ``fn`` itself (if it pickles).

    Raises:
      UsageError: neither (a function defined in a notebook cell or inside another function).
    """
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if module and qualname and module != "__main__" and "<locals>" not in qualname:
        try:
            found: Any = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
            if found is fn:
                return FunctionRef(module, qualname)
        except Exception:  # noqa: BLE001 - not importable: try pickling it below
            pass
    try:
        pickle.dumps(fn)
    except Exception:  # noqa: BLE001
        raise UsageError(f"stagetool.inspect(isolate=True): {qualname or fn!r} cannot be imported by a worker process "
                         f"(module {module!r})", hint="define the function at the top level of a module the worker "
                                                      "can import (not in a notebook cell or inside a function), "
                                                      "or stage in this process (isolate=False)") from None
    return fn


def _several_meshes(tree: Any) -> bool:
    """Whether ``tree``'s leaves sit on two or more concrete meshes of one set of devices."""
    import jax
    from jax.sharding import Mesh

    seen: list = []
    for x in jax.tree_util.tree_leaves(tree):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if isinstance(mesh, Mesh) and not mesh.empty and not any(mesh == m for m in seen):
            seen.append(mesh)
    return any(set(a.devices.flat) == set(b.devices.flat) for i, a in enumerate(seen) for b in seen[i + 1:])


def _abstract(tree: Any, keep_devices: bool = False) -> Any:
    """Every array or ``ShapeDtypeStruct`` leaf of ``tree`` as an :class:`AbstractArray` (with its
    mesh's device ids where ``keep_devices``)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    def one(x: Any) -> Any:
        if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
            return x
        sharding = getattr(x, "sharding", None)
        spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
        dims = axes = ids = None
        if spec is not None and mesh is not None:
            from stagetool.core.sharding import spec_dims

            dims, axes = spec_dims(spec), tuple((str(k), int(v)) for k, v in mesh.shape.items())
            if keep_devices and isinstance(mesh, Mesh):
                ids = tuple(int(d.id) for d in mesh.devices.flat)
        return AbstractArray(tuple(np.shape(x)), np.dtype(x.dtype).name, dims, axes or (), ids)

    return jax.tree_util.tree_map(one, tree)


def _concrete(tree: Any) -> Any:
    """The worker's side of :func:`_abstract`: ``ShapeDtypeStruct``s, each sharded over an
    ``AbstractMesh`` of its own mesh's axes (laid over the run's mesh by axis name), or over its own
    mesh of this process's devices where its device ids came and every one is here."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

    by_id = {d.id: d for d in jax.devices()}

    def one(x: Any) -> Any:
        if not isinstance(x, AbstractArray):
            return x
        sharding = None
        if x.dims is not None:
            mesh = AbstractMesh(tuple(s for _, s in x.mesh_axes), tuple(n for n, _ in x.mesh_axes))
            if x.device_ids is not None and all(i in by_id for i in x.device_ids):
                mesh = Mesh(np.array([by_id[i] for i in x.device_ids]).reshape(tuple(s for _, s in x.mesh_axes)),
                            tuple(n for n, _ in x.mesh_axes))
            sharding = NamedSharding(mesh, PartitionSpec(*x.dims))
        return jax.ShapeDtypeStruct(x.shape, jnp.dtype(x.dtype), sharding=sharding)

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, AbstractArray))


#: The JAX settings a caller's session (its conftest.py, a notebook's first cell) makes before any
#: device starts, which a spawned worker must make too before it imports the user's module: how
#: many CPU devices to simulate and which platforms to start, and what changes every trace.
SESSION_CONFIG = ("jax_platforms", "jax_num_cpu_devices", "jax_enable_x64", "jax_default_prng_impl",
                  "jax_threefry_partitionable", "jax_default_matmul_precision", "jax_use_shardy_partitioner")


def session_setup() -> dict[str, Any]:
    """The caller's :data:`SESSION_CONFIG` values (``jax.config``). The environment (``XLA_FLAGS``,
    ``JAX_PLATFORMS``) the spawned worker inherits as it is."""
    import jax

    out: dict[str, Any] = {}
    for name in SESSION_CONFIG:
        try:
            out[name] = getattr(jax.config, name)
        except AttributeError:  # not in this JAX release
            continue
    return out


def _apply_session_setup(setup: dict[str, Any]) -> None:
    """In the worker, before the user's module is imported: the caller's settings.

    Raises:
      StagingError: a setting the worker cannot make (saying which, and why).
    """
    import jax

    for name, value in setup.items():
        try:
            if getattr(jax.config, name) != value:
                jax.config.update(name, value)
        except Exception as e:  # noqa: BLE001 - the worker says which setting it could not carry over
            raise StagingError(f"the isolated worker cannot set {name}={value!r} as the caller's session did: {e}",
                               stage="trace", function="?",
                               hint="stage in this process (isolate=False)") from None


def _task(common: tuple, name: str) -> Any:
    """The worker's task: the caller's device setup made, the function imported, the arguments
    rebuilt, staged in-process there."""
    from stagetool.live import inspect_here

    fn, args, kwargs, options, setup = common
    _apply_session_setup(setup)
    if isinstance(fn, FunctionRef):
        from stagetool.process.dispositions import caller_signals

        imported: list[str] = []
        try:
            with caller_signals(imported):  # the module's import, staged like the function
                found: Any = importlib.import_module(fn.module)
            for part in fn.qualname.split("."):
                found = getattr(found, part)
        except Exception as e:  # noqa: BLE001 - the user's module failed to import there
            raise StagingError(
                f"{options.name}: the isolated worker could not import {fn.module}.{fn.qualname}: "
                f"{type(e).__name__}: {e}", stage="trace", function=options.name,
                hint="the worker sets up JAX as this session did (" + ", ".join(f"{k}={v!r}" for k, v in setup.items())
                + "), but runs no conftest.py or other setup code: a module that needs more at import "
                  "must do it itself, or stage in this process (isolate=False)") from None
        fn = found
        if imported:
            options = dataclasses.replace(options, notes=(*options.notes, *imported))
    return inspect_here(fn, _concrete(args), _concrete(kwargs), options)
