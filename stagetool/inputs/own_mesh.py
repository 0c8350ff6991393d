"""The mesh a target's own shardings name, checked against the staged mesh: never a mixed program.

A ``jax.jit(step, in_shardings=..., out_shardings=...)`` whose ``NamedSharding``s sit on the module's
own mesh runs on that mesh. When stagetool stages for another one (a ``--mesh`` of another shape, a
sweep row, a topology whose devices the module did not see), staging it as it is would give a
program no mesh runs (inputs on one mesh, the jit's shardings on another: inserted
collective-permutes, lost donation). So, per target:

- the same mesh as the staged one (same devices in the same order, same axes): nothing to do;
- devices outside the staged ones (the mesh was built before stagetool could give the code the
  staged devices, or from hard-coded devices): a :class:`UsageError` (exit 2) naming the mesh, where
  the module holds it, and the fix;
- the staged devices under another shape or order, every axis its shardings name being an axis of
  the staged mesh: the shardings are re-laid on the staged mesh by axis name, the function under the
  jit jitted again with them (and all its other settings: donation, static arguments, compiler
  options), and a note says so;
- an axis the staged mesh lacks: a :class:`UsageError` naming both meshes.

Before those checks, a mesh the module builds itself with the staged axes and sizes on the staged
devices in another order (``jax.devices()`` by id, where stagetool's TPU mesh walks the torus)
becomes the staged mesh (:func:`adopt_code_order`): JAX compiles one device order per program, and
that order is the code's. :func:`equivalent_spec` spells a layout on another mesh of the same devices
over the staged mesh's axes (the live API's arguments).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from stagetool.core.errors import UsageError
from stagetool.devices.world import describe_mesh
from stagetool.inputs.frameworks.jit import JitSettings, is_jax_jit, pjit_settings
from stagetool.inputs.target import Target
from stagetool.spec.model import FunctionSpec


def _named(tree: Any) -> list:
    """The ``NamedSharding``s of a jit's in/out_shardings tree (an ``nnx.StateSharding``'s per filter too)."""
    import jax
    from jax.sharding import NamedSharding

    from stagetool.inputs.frameworks.dispatch import is_state_sharding

    if tree is None:
        return []
    out: list = []
    for s in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding) or is_state_sharding(x)):
        if is_state_sharding(s):
            out += [x for x in getattr(s, "shardings", ()) if isinstance(x, NamedSharding)]
        elif isinstance(s, NamedSharding):
            out.append(s)
    return out


def own_meshes(settings: JitSettings) -> list:
    """The distinct ``jax.sharding.Mesh``es the jit's ``in_shardings``/``out_shardings`` name, in order."""
    out: list = []
    for s in _named(settings.in_shardings) + _named(settings.out_shardings):
        if not any(s.mesh is m or s.mesh == m for m in out):
            out.append(s.mesh)
    return out


def _module_of(module_file: str | None) -> Any:
    """The imported module whose file is ``module_file``, or None."""
    import sys

    if module_file is None:
        return None
    resolved = Path(module_file).resolve()
    modules = [m for m in list(sys.modules.values()) if isinstance(getattr(m, "__file__", None), str)]
    # stagetool imports a target by its resolved path: that module's __file__ is the path itself, and
    # comparing strings first spares resolving every loaded module's file (thousands in a notebook)
    named = {module_file, str(resolved)}
    return next((m for m in modules if m.__file__ in named), None) or \
        next((m for m in modules if Path(m.__file__).resolve() == resolved), None)


def where_held(mesh: Any, module_file: str | None, module: Any = None) -> str | None:
    """``file:line`` (with the line's text) where the target's module assigns the name holding
    ``mesh`` (a module global, or an attribute of one: ``cfg.mesh``), or None when not found."""
    import sys

    if module_file is None:
        return None
    if module is None:
        module = _module_of(module_file)
    names: list[str] = []
    for name, obj in vars(module).items() if module is not None else ():
        if obj is mesh:
            names.append(name)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            try:
                attrs = vars(obj)
            except TypeError:
                continue
            names += [attr for attr, v in attrs.items() if v is mesh]
    try:
        lines = Path(module_file).read_text().splitlines()
    except OSError:
        return None
    for name in names:
        # `name = ...`, `self.name = ...`, `a, name, b = ...`, `name: Mesh = ...`
        other = r"[\w.*]+\s*,\s*"
        pattern = re.compile(rf"^\s*\(?({other})*(self\.)?{re.escape(name)}\s*(,\s*[\w.*]+\s*)*\)?\s*(:[^=]*)?=[^=]")
        for i, line in enumerate(lines, 1):
            if pattern.match(line):
                return f"{module_file}:{i}\n    {line.strip()}"
    return None


def _module_meshes(module: Any) -> list:
    """The concrete meshes a module holds in its globals, or one attribute down (``cfg.mesh``)."""
    from jax.sharding import Mesh

    out: list = []
    for obj in list(vars(module).values()) if module is not None else ():
        found = [obj] if isinstance(obj, Mesh) else []
        if not found and hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
            try:
                found = [v for v in vars(obj).values() if isinstance(v, Mesh)]
            except TypeError:
                found = []
        out += [m for m in found if not m.empty and not any(m is o for o in out)]
    return out


def adopt_code_order(target: Target, fspec: FunctionSpec, setup: Any, *,
                     axis_types_given: bool = True) -> tuple[Any, tuple[str, ...]]:
    """``(setup, notes)``: the staged devices in the order of the code's own mesh, where the code built
    the staged mesh itself — the same axis names and sizes on the staged devices — in another device
    order (``Mesh(np.array(jax.devices()), ("data",))`` lists TPU chips by id, [0, 1, 2, 3] on a
    v5e:2x2, where stagetool's mesh follows the torus, [0, 1, 3, 2]). That mesh is the one the code
    runs on: staged on it, the program is raw JAX's for the code (JAX refuses a jit that mixes both
    orders). ``setup`` as it is, and (), when the code's meshes (its jit's shardings, its module's
    globals) hold no such mesh, or hold two orders of it.

    Where the spec does not give the axis types (``axis_types_given`` false), that mesh's axis types
    are taken too (bonsai's ``jax.make_mesh(..., axis_types=(Explicit, Explicit))``): the code is
    written for them, and a note says so.
    """
    import dataclasses

    import numpy as np
    from jax.sharding import Mesh

    staged = setup.mesh
    candidates: list = []
    fn = target.fn
    if is_jax_jit(fn):
        own = pjit_settings(fn, "jax.jit")
        if own.readable:
            candidates += own_meshes(own)
    module = _module_of(target.module_file)
    candidates += _module_meshes(module)
    same = [m for m in candidates
            if tuple(m.axis_names) == tuple(staged.axis_names) and m.devices.shape == staged.devices.shape
            and set(m.devices.flat) == set(staged.devices.flat)]
    kinds = {_axis_kinds(m) for m in same}
    notes: tuple[str, ...] = ()
    if not axis_types_given and len(kinds) == 1 and kinds != {_axis_kinds(staged)} and kinds <= {"Explicit", "Auto"}:
        # the code's own axis types, where the spec gives none
        setup, notes = _typed(setup, staged, same[0].axis_types, target, fspec, module, same[0])
        staged = setup.mesh
    laid = [m for m in same if list(m.devices.flat) != list(staged.devices.flat)]
    orders = {tuple(d.id for d in m.devices.flat) for m in laid}
    if len(orders) != 1:
        return setup, notes
    code = laid[0]
    mesh = Mesh(np.asarray(code.devices), tuple(staged.axis_names), axis_types=getattr(staged, "axis_types", None))
    where_in = {d: i for i, d in enumerate(setup.devices)}
    order = [where_in[d] for d in mesh.devices.flat]

    def permuted(per_device: tuple) -> tuple:
        return tuple(per_device[i] for i in order) if len(per_device) == len(order) else per_device

    adopted = dataclasses.replace(setup, mesh=mesh, devices=tuple(mesh.devices.flat),
                                  process_of_device=permuted(setup.process_of_device),
                                  slice_of_device=permuted(setup.slice_of_device))
    held = where_held(code, target.module_file, module)
    note = (f"{fspec.target}'s module builds the staged mesh ({describe_mesh(staged)}) itself, with its devices in "
            f"another order (ids {[d.id for d in code.devices.flat]}, where stagetool's mesh has "
            f"{[d.id for d in staged.devices.flat]}): staged on the module's order, the one its code runs on"
            + (f" ({held.splitlines()[0]})" if held else ""))
    return adopted, (*notes, note)


def _typed(setup: Any, staged: Any, types: tuple, target: Target, fspec: FunctionSpec, module: Any,
           code: Any) -> tuple[Any, tuple[str, ...]]:
    """``(setup with the staged mesh given the code's axis types, the note saying so)``."""
    import dataclasses

    from jax.sharding import Mesh

    mesh = Mesh(staged.devices, tuple(staged.axis_names), axis_types=tuple(types))
    held = where_held(code, target.module_file, module)
    kind = _axis_kinds(code)
    note = (f"{fspec.target}'s module builds the staged mesh ({describe_mesh(staged)}) with {kind} axes"
            + (f" ({held.splitlines()[0]})" if held else "")
            + f" and the spec gives no mesh.axis_types: staged with {kind} axes, as the code runs")
    return dataclasses.replace(setup, mesh=mesh), (note,)


def relay_own_jit(target: Target, fspec: FunctionSpec, setup: Any, *,
                  live: bool = False) -> tuple[Target, tuple[str, ...]]:
    """``target`` with its own ``jax.jit`` or ``nnx.jit`` shardings on the staged mesh (``setup.mesh``; an
    ``nnx.jit`` jitted again by ``nnx.jit``, :func:`stagetool.inputs.frameworks.nnx.relaid_wrapper`), and the
    notes that say so; the target as it is when they are already there or it has none. ``live``:
    the function was handed over from Python (:func:`stagetool.inspect`), whose meshes can only be
    on the caller's own devices: a mesh on other devices is re-laid by axis name, not refused.

    Raises:
      UsageError: the shardings name devices that are not the staged ones (not ``live``), or a mesh
        axis the staged mesh does not have (exit 2, before any compile).
    """
    import jax
    from jax.sharding import NamedSharding

    fn = target.fn
    if is_jax_jit(fn):
        own = pjit_settings(fn, "jax.jit")
        if not own.readable or own.fun is None:
            return target, ()
    else:
        from stagetool.inputs.own_jit import jit_settings

        own = jit_settings(fn)
        if own.kind != "nnx.jit":  # eqx.filter_jit has no shardings of its own (its body's: foreign_mesh)
            return target, ()
    staged = setup.mesh
    meshes = [m for m in own_meshes(own) if m != staged]
    if not meshes:
        return target, ()
    devices = set(setup.devices)
    where = f"{fspec.where('target')}: functions.{fspec.name}"
    for m in meshes:
        held = where_held(m, target.module_file)
        at = f"\n  the mesh is held at {held}" if held else ""
        if not live and not set(m.devices.flat) <= devices:
            raise UsageError(
                f"{where}: {fspec.target}'s own {own.kind} shardings name a mesh of {describe_mesh(m)}, but stagetool "
                f"stages for {describe_mesh(staged)}: the mesh was built before stagetool could give the code the "
                f"staged devices (imported earlier, or built from devices named outright){at}",
                hint="build the mesh where stagetool imports it, from jax.devices(), jax.make_mesh(...) or "
                     "mesh_utils.create_device_mesh(...) (not jax.devices('cpu') or a fixed device list); or take "
                     "the staged mesh from the spec: {call: model.py:make_config, kwargs: {mesh: {mesh: staged}}}")
        missing = sorted({a for s in _named(own.in_shardings) + _named(own.out_shardings) if s.mesh == m
                          for a in _spec_axes(s.spec)} - set(staged.axis_names))
        if missing:
            raise UsageError(
                f"{where}: {fspec.target}'s own {own.kind} shardings name mesh axis {missing[0]!r} of its mesh "
                f"({describe_mesh(m)}), which the staged mesh ({describe_mesh(staged)}) does not have: staging it "
                f"would mix two meshes in one program{at}",
                hint="stage on a mesh with the same axis names (--mesh " + ",".join(
                    f"{n}={s}" for n, s in zip(m.axis_names, m.devices.shape)) + "), or build the module's mesh "
                "from the spec's ({mesh: staged})")

    def relay(s: Any) -> Any:
        if isinstance(s, NamedSharding) and s.mesh != staged:
            return NamedSharding(staged, s.spec, memory_kind=s.memory_kind)
        return s

    def tree(t: Any) -> Any:
        return None if t is None else jax.tree_util.tree_map(relay, t, is_leaf=lambda x: isinstance(x, NamedSharding))

    notes = tuple(f"{fspec.target}'s own {own.kind} shardings name the module's mesh ({describe_mesh(m)}); they are "
                  f"re-laid by axis name on the staged mesh ({describe_mesh(staged)}), as the same code with its "
                  "mesh built for these devices runs" for m in meshes)
    import dataclasses

    if own.kind == "nnx.jit":
        from stagetool.inputs.frameworks.nnx import relaid_wrapper

        again = relaid_wrapper(own, relay)
        if again is None:
            raise UsageError(
                f"{where}: {fspec.target}'s own nnx.jit shardings name a mesh of {describe_mesh(meshes[0])}, not the "
                f"staged one ({describe_mesh(staged)}), and the wrapper cannot be jitted again with them re-laid "
                "(a device, backend or inline of its own): staging it would mix two meshes in one program",
                hint="stage with the module's own axis sizes (--mesh " + ",".join(
                    f"{n}={s}" for n, s in meshes[0].shape.items()) + "), or build the module's mesh from the spec's "
                "({mesh: staged})")
        return dataclasses.replace(target, fn=again), notes
    options: dict[str, Any] = {"static_argnums": own.static_argnums, "static_argnames": own.static_argnames,
                               "donate_argnums": own.donate_argnums, "donate_argnames": own.donate_argnames,
                               "keep_unused": own.keep_unused}
    if own.in_shardings is not None:
        options["in_shardings"] = tree(own.in_shardings)
    if own.out_shardings is not None:
        options["out_shardings"] = tree(own.out_shardings)
    if own.compiler_options:
        options["compiler_options"] = own.compiler_options
    relaid = jax.jit(own.fun, **options)
    return dataclasses.replace(target, fn=relaid), notes


def _spec_axes(spec: Any) -> list[str]:
    out: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        for a in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(a, str):
                out.append(a)
    return out


_WHAT = {"init": "the init's shardings", "struct": "the shardings its arrays carry"}


def check_seen(seen: list, fspec: FunctionSpec, setup: Any, *, live: bool = False) -> tuple[str, ...]:
    """Notes for the meshes an ``init``'s or a ``{ref:}`` object's shardings named (``seen``, from
    :func:`stagetool.inputs.seen_meshes.collecting`) that are not the staged mesh: their shardings
    were taken by axis name and laid on the staged mesh. () when every one is the staged mesh.
    ``live``: the arrays were handed over from Python (:func:`stagetool.inspect`), made on the
    caller's own devices: their PartitionSpecs are laid on the staged mesh whatever its devices.

    Raises:
      UsageError: a mesh on devices that are not the staged ones (built before stagetool could give
        the code the staged devices; not ``live``), exit 2.
    """
    staged = setup.mesh
    devices = set(setup.devices)
    notes: list[str] = []
    done: list = []
    for what, m in seen:
        if m == staged or any(m == d for d in done):
            continue
        done.append(m)
        if not live and not set(m.devices.flat) <= devices:
            raise UsageError(
                f"{fspec.where('args')}: functions.{fspec.name}.args: {_WHAT.get(what, what)} name a mesh of "
                f"{describe_mesh(m)}, but stagetool stages for {describe_mesh(staged)}: the mesh was built before "
                "stagetool could give the code the staged devices (imported earlier, or built from devices named "
                "outright)",
                hint="build the mesh where stagetool imports it, from jax.devices(), jax.make_mesh(...) or "
                     "mesh_utils.create_device_mesh(...); or take the staged mesh from the spec ({mesh: staged})")
        kinds, staged_kinds = _axis_kinds(m), _axis_kinds(staged)
        if describe_mesh(m) == describe_mesh(staged) and kinds != staged_kinds:  # the axis types alone differ
            notes.append(f"{_WHAT.get(what, what)} of functions.{fspec.name} name the staged devices and axes with "
                         f"{kinds} axes, where stagetool stages {staged_kinds} ones (the spec's mesh.axis_types): they "
                         "are taken by axis name; code written for Explicit axes (jax.sharding.reshard, "
                         "out_sharding=P(...)) needs 'axis_types: explicit' under the spec's 'mesh:'"
                         if kinds == "Explicit" else
                         f"{_WHAT.get(what, what)} of functions.{fspec.name} name the staged devices and axes with "
                         f"{kinds} axes, where stagetool stages {staged_kinds} ones (the spec's mesh.axis_types): they "
                         "are taken by axis name")
            continue
        reordered = (tuple(m.axis_names) == tuple(staged.axis_names) and m.devices.shape == staged.devices.shape
                     and set(m.devices.flat) == devices)  # e.g. Keras' DeviceMesh over list_devices(), by id
        notes.append(f"{_WHAT.get(what, what)} of functions.{fspec.name} name a mesh of {describe_mesh(m)}"
                     + (" (the staged devices in another order)" if reordered else "")
                     + f"; they are taken by axis name on the staged mesh ({describe_mesh(staged)})")
    return tuple(notes)


def _axis_kinds(mesh: Any) -> str:
    """``Explicit``, ``Auto``, ``Manual`` (every axis of that type) or ``mixed`` (jax.sharding.AxisType)."""
    kinds = {str(t).rpartition(".")[2] for t in (getattr(mesh, "axis_types", None) or ())}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def equivalent_spec(sharding: Any, mesh: Any, ndim: int) -> Any:
    """The ``PartitionSpec`` over ``mesh``'s axes that lays an array of rank ``ndim`` on the devices
    exactly as ``sharding`` (a ``NamedSharding`` on another mesh of the same devices: big_vision's
    batch on a 1-D ``("devices",)`` mesh beside its 2-D state mesh) does, as JAX compares them
    (``Sharding.is_equivalent_to``: the same device for every shard); None when no spec over
    ``mesh``'s axes does (another device order, a partial replication no axis product gives).
    Each dimension's candidates are the orderings of ``mesh``'s axes whose sizes multiply to that
    dimension's shard count."""
    import itertools

    from jax.sharding import NamedSharding, PartitionSpec

    if not isinstance(sharding, NamedSharding) or set(sharding.mesh.devices.flat) != set(mesh.devices.flat):
        return None
    own = dict(sharding.mesh.shape)
    spec = tuple(sharding.spec) + (None,) * (ndim - len(tuple(sharding.spec)))
    counts = []
    for entry in spec[:ndim]:
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        k = 1
        for a in axes:
            k *= int(own.get(a, 1))
        counts.append(k)
    sizes = {n: int(s) for n, s in mesh.shape.items() if s != 1}

    def orderings(k: int, free: set) -> list:
        if k == 1:
            return [None]
        out = []
        for r in range(1, len(free) + 1):
            for combo in itertools.permutations(sorted(free), r):
                p = 1
                for a in combo:
                    p *= sizes[a]
                if p == k:
                    out.append(combo[0] if len(combo) == 1 else combo)
        return out

    def search(i: int, free: set) -> Any:
        if i == len(counts):
            candidate = NamedSharding(mesh, PartitionSpec(*chosen))
            return candidate.spec if candidate.is_equivalent_to(sharding, ndim) else None
        for entry in orderings(counts[i], free):
            used = set() if entry is None else ({entry} if isinstance(entry, str) else set(entry))
            if used - free:
                continue
            chosen.append(entry)
            found = search(i + 1, free - used)
            chosen.pop()
            if found is not None:
                return found
        return None

    chosen: list = []
    return search(0, set(sizes))
