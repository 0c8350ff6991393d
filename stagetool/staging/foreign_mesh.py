"""A mesh named inside the traced program that is not the staged one: never a silent mixed program.

A step whose body names the module's own mesh — ``jax.lax.with_sharding_constraint(x,
NamedSharding(MESH, ...))``, ``eqx.filter_shard(x, NamedSharding(MESH, ...))``, a nested
``jax.jit``/``nnx.jit`` with shardings on it, ``shard_map(mesh=MESH)`` — runs on that mesh. Two
kinds are told apart (:func:`conflicts`):

- the module's copy of the staged mesh at a fixed shape: the staged mesh's axis names at other
  sizes (the module built ``fsdp=4 × tensor=2`` at import; stagetool stages ``--mesh
  fsdp=2,tensor=4``, a sweep row). JAX accepts the program whenever the device order agrees, and
  compiles one whose inputs are laid on the staged mesh and whose constraints on the other:
  collective-permutes no run of that code at the staged shape has. The traced program is read for
  such a mesh before it is lowered (:func:`check_traced`), and staging stops with exit 2 naming both
  meshes and the user's line; as does a mesh on devices that are not the staged ones;
- another mesh of the staged devices with axes of its own (big_vision's ``shard_map(mesh=
  Mesh(devices.flatten(), ("data",)))`` beside its 2-D ``(replica, fsdp)`` state mesh): a real run
  builds that program, so it is staged as raw JAX compiles it, and a note names the mesh
  (:func:`other_meshes`).

The shardings a target's own jit gives at its boundary are not read here: they are re-laid by axis
name before tracing (:func:`stagetool.inputs.own_mesh.relay_own_jit`).
"""

from __future__ import annotations

from typing import Any, Iterator

from stagetool.core.errors import UsageError
from stagetool.inputs.target import eqn_user_line as user_line


def _meshes_in(value: Any, depth: int = 0) -> Iterator[Any]:
    """The concrete ``jax.sharding.Mesh``es a primitive's parameter names (a ``NamedSharding``'s, a
    ``Mesh`` itself, inside tuples, lists and dicts); an ``AbstractMesh`` or an empty ``Mesh`` names no
    devices and is not one."""
    from jax.sharding import Mesh, NamedSharding

    if depth > 4:
        return
    if isinstance(value, Mesh):
        if not value.empty:  # an empty Mesh (a primitive's default under no context mesh) names no devices
            yield value
    elif isinstance(value, NamedSharding):
        if isinstance(value.mesh, Mesh) and not value.mesh.empty:
            yield value.mesh
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _meshes_in(v, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _meshes_in(v, depth + 1)


def differs(mesh: Any, staged: Any) -> bool:
    """Whether ``mesh`` is another mesh than ``staged``: other axis names or sizes, in order, leaving
    out axes of size 1 (a ``replica=1`` axis lays no device differently), or devices that are not the
    staged ones. The same axes on the staged devices in another order is not (JAX's own check
    refuses an order that disagrees), nor are other axis types (the layout is the same)."""
    if mesh is staged or mesh == staged:
        return False

    def laid(m: Any) -> list:
        return [(n, s) for n, s in m.shape.items() if s != 1]

    return laid(mesh) != laid(staged) or not set(mesh.devices.flat) <= set(staged.devices.flat)


def conflicts(mesh: Any, staged: Any) -> bool:
    """Whether ``mesh``, named inside the traced program, makes a program no run of the code at the
    staged mesh builds: it is on devices that are not the staged ones, or it :func:`differs` from
    ``staged`` with the same axis names (all of them, or those of size > 1) at other sizes: the
    module's copy of the staged mesh built at a fixed shape (``fsdp=4 × tensor=2`` where ``--mesh``
    stages ``fsdp=8 × tensor=1``). Another mesh of the staged devices with axes of its own
    (a flattened ``("data",)`` mesh beside a 2-D state mesh) does not: a real run has both."""
    if not differs(mesh, staged):
        return False
    if not set(mesh.devices.flat) <= set(staged.devices.flat):
        return True

    def laid(m: Any) -> set:
        return {n for n, s in m.shape.items() if s != 1}

    return laid(mesh) == laid(staged) or set(mesh.axis_names) == set(staged.axis_names)


def check_traced(traced: Any, staged: Any, *, name: str, user_files: list[str]) -> None:
    """Refuse a traced program that names a mesh other than ``staged`` (see the module docstring).

    Args:
      traced: the ``jax.stages.Traced`` of the staged function.
      staged: the ``jax.sharding.Mesh`` stagetool stages on.
      name: the function's name, for the message.
      user_files: the user's source files, to find the user's line.

    Raises:
      UsageError: exit 2, naming both meshes, the primitive and the user's line.
    """
    from stagetool.devices.world import describe_mesh

    from stagetool.staging.equations import equations

    if staged is None:
        return
    for eqn, _ in equations(traced, user_files):
        for value in eqn.params.values():
            for mesh in _meshes_in(value):
                if not conflicts(mesh, staged):
                    continue
                line = user_line(eqn, user_files)
                elsewhere = not set(mesh.devices.flat) <= set(staged.devices.flat)
                why = ("its devices are not the staged ones" if elsewhere
                       else "it has the staged mesh's axes at other sizes: the code built it at a fixed shape, which "
                            "does not follow the staged one")
                spec_mesh = "build the code's mesh from the spec's ({call: model.py:make_config, kwargs: {mesh: {mesh: staged}}})"
                # other devices: the module built its mesh before stagetool could give it the staged ones (a
                # live function's module, jax.devices('cpu')); the sizes are no cure where they already agree
                hint = ("a mesh the module builds at import from jax.devices() or jax.make_mesh(...) is built on the "
                        "staged devices when stagetool imports the module itself: stage it by its file "
                        "(stagetool report module.py:step with a spec), not from a process that has already built it "
                        "on its own devices (stagetool.inspect, a notebook), and not from jax.devices('cpu') or a "
                        "fixed device list; or write a PartitionSpec in the constraint (it takes the mesh stagetool "
                        "sets, jax.set_mesh), or " + spec_mesh) if elsewhere else (
                        "name the mesh the step runs on, not a fixed one: write a PartitionSpec in the constraint "
                        "(it takes the mesh stagetool sets, jax.set_mesh), or " + spec_mesh + "; or stage with the "
                        "module's own axis sizes (--mesh " + ",".join(f"{n}={s}" for n, s in mesh.shape.items()) + ")")
                raise UsageError(
                    f"{name}: the traced code names a mesh of its own ({describe_mesh(mesh)}) in "
                    f"{eqn.primitive.name}, but stagetool stages on {describe_mesh(staged)} and {why}: staging it "
                    "would mix two meshes in one program, which no run of the code at the staged mesh has"
                    + (f"\n  at {line}" if line else ""),
                    hint=hint)


def other_meshes(traced: Any, staged: Any, *, user_files: list[str]) -> tuple[str, ...]:
    """One note per mesh the traced program names that is another mesh of the staged devices (not
    the staged mesh, not one :func:`conflicts` refuses): what names it, the user's line, and that it is
    staged as raw JAX compiles it. () when there is none."""
    from stagetool.devices.world import describe_mesh
    from stagetool.staging.equations import equations

    if staged is None:
        return ()
    seen: list = []
    notes: list[str] = []
    for eqn, _ in equations(traced, user_files):
        for value in eqn.params.values():
            for mesh in _meshes_in(value):
                if not differs(mesh, staged) or conflicts(mesh, staged) or any(mesh == m for m in seen):
                    continue
                seen.append(mesh)
                line = user_line(eqn, user_files)
                notes.append(f"the code's {eqn.primitive.name}" + (f" at {line}" if line else "")
                             + f" names another mesh of the staged devices ({describe_mesh(mesh)}) beside the staged "
                             f"one ({describe_mesh(staged)}); the program is staged as raw JAX compiles the code "
                             "with both" + (" (a shard_map's mesh must be the context mesh, so none is set but the "
                                            "code's own)" if eqn.primitive.name == "shard_map" else ""))
    return tuple(notes)
