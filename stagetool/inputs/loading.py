"""One function made ready to stage, in the staged device world: its target loaded, its own jit's
mesh checked, its abstract inputs built and its out_shardings fitted."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from stagetool.core.errors import TargetError
from stagetool.core.mesh import MeshSpec
from stagetool.inputs.records import AbstractInputs
from stagetool.inputs.target import Target
from stagetool.spec.model import FunctionSpec


def load_and_build(fspec: FunctionSpec, setup: Any, mesh_spec: MeshSpec, *, avals: str = "global",
                   target: Target | None = None) -> tuple[Target, AbstractInputs, FunctionSpec, Any]:
    """``(target, inputs, fitted spec, setup)`` of one function: ``setup`` is the one given, or the same
    devices in the order of the mesh the module builds itself where that is another order
    (:func:`stagetool.inputs.own_mesh.adopt_code_order`); the function is staged on it.

    The user's code builds its mesh on the staged devices: the target module is imported and its
    inits and ``{call:}``s run inside :func:`stagetool.devices.world.staged_world`. A ``jax.jit``
    target's own shardings on another mesh are re-laid on the staged one or refused
    (:func:`stagetool.inputs.own_mesh.relay_own_jit`), as are the meshes an init's or ``{ref:}``
    object's shardings name (:func:`stagetool.inputs.own_mesh.check_seen`); a jit stagetool does not
    unwrap is named (:func:`stagetool.inputs.own_jit.hidden_jit_note`). Those sentences lead
    ``inputs.notes``. ``target``: one already loaded (:func:`stagetool.inspect`'s live function;
    its meshes, on the caller's devices, are then re-laid by axis name, never refused).

    Raises:
      TargetError: the target cannot be loaded (naming the spec's line).
      UsageError: a mesh the code names that cannot be staged faithfully (exit 2).
      SpecError, StagingError: as :func:`stagetool.inputs.avals.build_inputs` and
        :func:`stagetool.inputs.out_shardings.fit_out_shardings`.
    """
    from stagetool.devices.world import left_out_settings, staged_world
    from stagetool.inputs.avals import build_inputs
    from stagetool.inputs.frameworks.dispatch import framework_notes
    from stagetool.inputs.out_shardings import fit_out_shardings
    from stagetool.inputs.own_jit import hidden_jit_note
    from stagetool.inputs.own_mesh import adopt_code_order, check_seen, relay_own_jit
    from stagetool.inputs.seen_meshes import collecting
    from stagetool.inputs.target import load_target

    live = target is not None  # handed over from Python: its meshes are on the caller's own devices
    with staged_world(setup):
        if target is None:
            try:
                target = load_target(fspec.target, base_dir=fspec.base_dir)
            except TargetError as e:  # name the spec's line that asked for it
                raise TargetError(f"{fspec.where('target')}: functions.{fspec.name}.target: {e.message}",
                                  hint=computed_at_import_hint(e.message, setup) or e.hint) from None
        hidden = hidden_jit_note(target.fn, fspec.target)
        ordered: tuple[str, ...] = ()
        if not live:
            setup, ordered = adopt_code_order(target, fspec, setup, axis_types_given=mesh_spec.axis_types_given)
            kinds = {str(t).rpartition(".")[2] for t in (getattr(setup.mesh, "axis_types", None) or ())}
            if kinds == {"Explicit"} and mesh_spec.axis_types != "explicit":  # the code's own (own_mesh)
                mesh_spec = dataclasses.replace(mesh_spec, axis_types="explicit")
        target, notes = relay_own_jit(target, fspec, setup, live=live)
        notes = ordered + notes
        notes += (hidden,) if hidden else ()
        code_context = _code_context()
        with collecting() as seen:
            inputs = build_inputs(fspec, target.fn, setup, mesh_spec, avals=avals)
        inputs = dataclasses.replace(inputs, context=context_of(
            mesh_spec, fspec, setup.mesh, inputs, code_context=code_context or _logical_axes(target.module_file)))
        notes += check_seen(seen, fspec, setup, live=live)
        notes += left_out_settings(setup)
        notes += framework_notes()
        if notes:
            inputs = dataclasses.replace(inputs, notes=(*notes, *inputs.notes))
        if inputs.fn is not None:  # a pure function around the target (non-array leaves, in-place NNX updates)
            target = dataclasses.replace(target, fn=inputs.fn)
        fitted = fit_out_shardings(fspec, target.fn, inputs, setup.mesh)
    return target, inputs, fitted, setup


def _code_context() -> bool:
    """Whether a context mesh is set where the target was loaded: the code set one at import
    (``jax.set_mesh(mesh)`` at module level, as bonsai's sharding test does) or the caller of
    :func:`stagetool.inspect` runs under one."""
    import jax

    try:
        return not jax.sharding.get_abstract_mesh().empty
    except AttributeError:  # pragma: no cover - a JAX without get_abstract_mesh
        return False


#: Flax linen's logical-axis API: its constraints apply only under a context mesh (a no-op under none),
#: so code that calls it runs under one, as MaxText enters its mesh and rules together.
_LOGICAL_AXES = re.compile(r"\b(with_logical_constraint|with_logical_partitioning|LogicallyPartitioned|"
                           r"logical_axis_rules|logical_to_mesh_sharding)\b")


_MAX_USER_MODULES = 256
"""How many of the user's modules :func:`_logical_axes` reads, following imports (a bound, not a limit met)."""


def _logical_axes(module_file: str | None) -> bool:
    """Whether the target's module, or a module of the user's it imports (directly or through others:
    a model's layers in ``models.py`` beside ``train.py``), calls Flax linen's logical-axis API
    (:data:`_LOGICAL_AXES`). Imports are followed to the modules loading the target imported
    (``sys.modules``), and only into the user's files (not a library's, not stagetool's)."""
    if module_file is None:
        return False
    seen: set[str] = set()
    todo = [str(Path(module_file).resolve())]
    while todo and len(seen) < _MAX_USER_MODULES:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.add(path)
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        if _LOGICAL_AXES.search(text) is not None:
            return True
        todo += [f for f in _imported_user_files(path, text) if f not in seen]
    return False


def _imported_user_files(path: str, text: str) -> list[str]:
    """The files of the user's own modules that the module at ``path`` (source ``text``) imports, as
    already imported (``sys.modules``): ``import pkg.layers``, ``from pkg import layers``, ``from
    .layers import block``; library modules (:func:`stagetool.core.paths.is_library_file`) and
    stagetool's own are left out."""
    import ast
    import sys

    from stagetool.core.paths import is_library_file, library_dirs

    try:
        tree = ast.parse(text, filename=path)
    except (SyntaxError, ValueError):
        return []
    package: str | None = None
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if package is None:  # the importing module's package (its own module by its file name first)
                    name = Path(path).name
                    package = next((getattr(m, "__package__", None) or "" for m in list(sys.modules.values())
                                    if Path(str(getattr(m, "__file__", None) or "")).name == name
                                    and _file_of(m) == path), "")
                parts = package.split(".") if package else []
                parts = parts[:len(parts) - node.level + 1] if node.level > 1 else parts
                base = ".".join([*parts, *([base] if base else [])])
            names += [base] + [f"{base}.{a.name}" if base else a.name for a in node.names]
    own = str(Path(__file__).resolve().parents[1]) + "/"
    library = library_dirs()
    out = []
    for name in dict.fromkeys(n for n in names if n):
        f = _file_of(sys.modules.get(name))
        if f and f.endswith(".py") and not f.startswith(own) and not is_library_file(f, library):
            out.append(f)
    return out


def _file_of(module: object) -> str | None:
    """A module's source file, resolved, or None (a built-in, a namespace package, not a module)."""
    f = getattr(module, "__file__", None)
    return str(Path(f).resolve()) if isinstance(f, str) else None


def context_of(mesh_spec: MeshSpec, fspec: FunctionSpec, mesh: Any, inputs: AbstractInputs, *,
               code_context: bool = False) -> bool | None:
    """The mesh context a function is traced under (:attr:`AbstractInputs.context`): the spec's
    ``mesh.context`` (``--context-mesh``/``--no-context-mesh``) where given; else True (the staged mesh,
    ``jax.set_mesh``) where the code runs under one: it set one itself (``code_context``: set at
    import, or the target's module calls Flax linen's logical-axis API, :data:`_LOGICAL_AXES`), its mesh
    axes are Explicit (code written for them runs under ``jax.set_mesh``), it has logical axis rules
    (MaxText-style code enters its mesh and its rules together), or it is a haliax ``named_jit``
    (Levanter runs its steps under the mesh and the axis mapping); else None: no context mesh, as
    code that sets none runs, unless the trace cannot do without one
    (:func:`stagetool.staging.stages.stage`)."""
    if mesh_spec.context is not None:
        return mesh_spec.context
    kinds = {str(t).rpartition(".")[2] for t in (getattr(mesh, "axis_types", None) or ())}
    haliax = type(inputs.program).__name__ == "HaliaxProgram" or getattr(inputs.jit, "kind", None) == "haliax.named_jit"
    if code_context or "Explicit" in kinds or fspec.logical_axis_rules is not None or haliax:
        return True
    return None


#: What JAX says when code computes on a compile-only device (a ``--topology``'s devices run nothing):
#: an eager op dispatched to them (jaxlib 0.7-0.12: its executable has no ``local_devices``).
_COMPUTED_ON_COMPILE_ONLY = ("'Executable' object has no attribute 'local_devices'",
                             "compile-only", "CompileOnlyPyClient", "cannot execute")


def computed_at_import_hint(message: str, setup: Any) -> str | None:
    """The hint for a module whose import computed on the compile-only devices of a ``--topology``
    (a model built at import: bonsai's ``jax.set_mesh(mesh); model = Qwen3(...)``): those devices
    compile but never run, so code run at import cannot build arrays there; what to write instead.
    None for any other failure, or where the devices are real."""
    if getattr(setup, "topology", None) is None or not any(m in message for m in _COMPUTED_ON_COMPILE_ONLY):
        return None
    return (f"the module computes at import (it builds arrays: a model, its state) on the devices of --topology "
            f"{setup.topology}, which are compile-only: they compile programs but run none. Build those values in "
            "a function and give it to the spec as an init ({init: model.py:make_model}: evaluated abstractly, "
            "nothing computed), or keep the import free of computation and stage on this machine's devices "
            "(--mesh) to pass the built objects ({ref: model.py:model})")
