"""One function made ready to stage, in the staged device world: its target loaded, its own jit's
mesh checked, its abstract inputs built and its out_shardings fitted."""

from __future__ import annotations

import dataclasses
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
    unwrap is named (:func:`stagetool.inputs.hidden_jit.hidden_jit_note`). Those sentences lead
    ``inputs.notes``. ``target``: one already loaded (:func:`stagetool.inspect`'s live function;
    its meshes, on the caller's devices, are then re-laid by axis name, never refused).

    Raises:
      TargetError: the target cannot be loaded (naming the spec's line).
      UsageError: a mesh the code names that cannot be staged faithfully (exit 2).
      SpecError, StagingError: as :func:`stagetool.inputs.avals.build_inputs` and
        :func:`stagetool.inputs.out_shardings.fit_out_shardings`.
    """
    from stagetool.devices.world import staged_world
    from stagetool.inputs.avals import build_inputs
    from stagetool.inputs.out_shardings import fit_out_shardings
    from stagetool.inputs.hidden_jit import hidden_jit_note
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
                                  hint=e.hint) from None
        hidden = hidden_jit_note(target.fn, fspec.target)
        ordered: tuple[str, ...] = ()
        if not live:
            setup, ordered = adopt_code_order(target, fspec, setup)
        target, notes = relay_own_jit(target, fspec, setup, live=live)
        notes = ordered + notes
        notes += (hidden,) if hidden else ()
        with collecting() as seen:
            inputs = build_inputs(fspec, target.fn, setup, mesh_spec, avals=avals)
        notes += check_seen(seen, fspec, setup, live=live)
        if notes:
            inputs = dataclasses.replace(inputs, notes=(*notes, *inputs.notes))
        if inputs.fn is not None:  # a pure function around the target (non-array leaves, in-place NNX updates)
            target = dataclasses.replace(target, fn=inputs.fn)
        fitted = fit_out_shardings(fspec, target.fn, inputs, setup.mesh)
    return target, inputs, fitted, setup
