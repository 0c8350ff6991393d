"""The mesh as stagetool names it: ordered ``(axis name, size)`` pairs and the axis type.

One value from the spec, ``--mesh`` and the report; rendered in one way (:meth:`MeshSpec.__str__`).
Knows nothing of JAX: ``stagetool.devices.provision`` turns it into a ``jax.sharding.Mesh``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

from stagetool.core.location import Loc
from stagetool.core.text import clipped


def format_mesh(axes: Iterable[tuple[str, int]] | Iterable[list], *, empty: str = "none") -> str:
    """The one way a mesh is printed: ``data=2 × model=4`` (``empty`` for a mesh without axes)."""
    text = " × ".join(f"{name}={size}" for name, size in axes)
    return text or empty


#: The most devices a mesh may have (``--mesh`` and the spec): far above any slice built, far below
#: what makes XLA's device assignment run out of memory or overflow.
MAX_DEVICES = 2**16

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def axis_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a mesh axis name, or None: an ASCII identifier (what XLA accepts;
    a non-ASCII name aborts the compiler)."""
    if not isinstance(name, str) or not _AXIS_NAME.match(name):
        return (f"mesh axis name {name!r} must be an ASCII identifier (letters, digits and '_', not starting "
                "with a digit), e.g. data or model")
    return None


def device_count_problem(sizes: "list[int] | tuple[int, ...]") -> str | None:
    """Why a mesh of these axis sizes is too large, or None."""
    n = 1
    for s in sizes:
        n *= s
        if n > MAX_DEVICES:
            return (f"a mesh of {'x'.join(str(s) for s in sizes)} has more than {MAX_DEVICES} devices, "
                    f"the most stagetool lays a mesh over")
    return None


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A named mesh: ordered ``(axis name, size)`` pairs and the axis type (``auto`` | ``explicit``).

    ``axis_types_given``: the spec (or the caller) said the axis types; when not, a mesh the code
    builds itself on the staged axes gives them. ``context``: whether the staged mesh is the context
    mesh (``jax.set_mesh``) while the function is traced: True, False, or None (as the code runs:
    :func:`stagetool.inputs.loading.context_of`)."""

    axes: tuple[tuple[str, int], ...]
    axis_types: str = "auto"
    loc: Loc | None = dataclasses.field(default=None, compare=False)
    axis_types_given: bool = True
    context: bool | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def device_count(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def __str__(self) -> str:
        return format_mesh(self.axes, empty="(no mesh)")



def parse_mesh_option(text: str, spec_mesh: MeshSpec) -> MeshSpec:
    """Apply ``--mesh``: ``2x4`` (sizes in the spec's axis order) or ``data=2,model=4``.

    Raises:
      ValueError: with a message naming what is wrong.
    """
    t = text.strip()
    if "=" in t:
        axes: list[tuple[str, int]] = []
        for part in t.split(","):
            name, _, size = part.partition("=")
            name = name.strip()
            if not (size.strip().isascii() and size.strip().isdigit()) or int(size[-12:]) < 1:
                raise ValueError(f"--mesh {clipped(text)}: {clipped(part)} is not 'axis=size' with a positive size")
            if len(size.strip()) > 9:  # int() of thousands of digits is refused by Python itself
                raise ValueError(f"--mesh {clipped(text)}: a mesh has at most {MAX_DEVICES} devices")
            problem = axis_name_problem(name)
            if problem:
                raise ValueError(f"--mesh {text!r}: {problem}")
            if name in (n for n, _ in axes):
                raise ValueError(f"--mesh {text!r} names axis {name!r} twice; give each axis once")
            axes.append((name, int(size)))
        if spec_mesh.axes and [n for n, _ in axes] != list(spec_mesh.names):
            unknown = [n for n, _ in axes if n not in spec_mesh.names]
            if unknown or len(axes) != len(spec_mesh.axes):
                raise ValueError(f"--mesh {text!r} names axes {', '.join(n for n, _ in axes)}, but the spec's mesh has "
                                 f"{', '.join(spec_mesh.names)}; give every axis of the spec once")
            order = {n: i for i, n in enumerate(spec_mesh.names)}
            axes.sort(key=lambda a: order[a[0]])
        problem = device_count_problem([s for _, s in axes])
        if problem:
            raise ValueError(f"--mesh {text!r}: {problem}")
        return dataclasses.replace(spec_mesh, axes=tuple(axes))
    parts = [p.strip() for p in t.lower().split("x")]
    if not parts or not all(p.isascii() and p.isdigit() and int(p[-12:]) > 0 for p in parts):
        raise ValueError(f"--mesh {clipped(text)} is not sizes like 2x4 or names like data=2,model=4")
    if any(len(p) > 9 for p in parts):
        raise ValueError(f"--mesh {clipped(text)}: a mesh has at most {MAX_DEVICES} devices")
    sizes = [int(p) for p in parts]
    problem = device_count_problem(sizes)
    if problem:
        raise ValueError(f"--mesh {text!r}: {problem}")
    if not spec_mesh.axes:
        raise ValueError(f"--mesh {text!r} gives sizes, but there is no spec mesh to name the axes; "
                         "write --mesh data=2,model=4")
    if len(sizes) != len(spec_mesh.axes):
        # the same devices over the spec's one axis, or the spec's own sizes as the example of the form
        like = [math.prod(sizes)] if len(spec_mesh.axes) == 1 else [s for _, s in spec_mesh.axes]
        n = len(spec_mesh.axes)
        raise ValueError(f"--mesh {text!r} has {len(sizes)} sizes, but the spec's mesh has {n} "
                         f"ax{'is' if n == 1 else 'es'} ({', '.join(spec_mesh.names)}): give one size per axis, in "
                         f"that order (--mesh {'x'.join(map(str, like))}, or --mesh "
                         f"{','.join(f'{a}={s}' for a, s in zip(spec_mesh.names, like))}); a mesh of other axes needs the "
                         "spec's mesh: changed, and the shardings that name its axes")
    return dataclasses.replace(spec_mesh, axes=tuple(zip(spec_mesh.names, sizes)))



#: JAX's words when code written for one kind of mesh axes runs on the other: ``(pattern, the axis type
#: the code needs)``. An Explicit-axes API (``reshard``, ``out_sharding=P(...)`` of ``.at[].get``,
#: ``einsum``, ``jnp.zeros``) on Auto axes; ``with_sharding_constraint`` on Explicit axes (where it
#: refuses Explicit axes in its spec, or acts as an assert that fails).
_AXIS_TYPE_ERRORS = (
    (re.compile(r"PartitionSpec passed to \S+ cannot contain axis names that are of type Auto"), "explicit"),
    (re.compile(r"passed to with_sharding_constraint can only refer to Auto axes"), "auto"),
    (re.compile(r"with_sharding_constraint` acts as an assert when all axes of mesh are of type `Explicit`"),
     "auto"),
)


def axis_types_needed(text: str) -> str | None:
    """The axis type (``"explicit"`` or ``"auto"``) the code needs when ``text`` is JAX's refusal of an
    API on the other kind of mesh axes; None when it is another error."""
    for pattern, needed in _AXIS_TYPE_ERRORS:
        if pattern.search(text):
            return needed
    return None


def axis_types_hint(needed: str) -> str:
    """The hint for code that needs ``needed`` (``"explicit"`` | ``"auto"``) mesh axes: the spec key to write."""
    if needed == "explicit":
        return ("this code is written for a mesh with Explicit axes (jax.sharding.AxisType.Explicit, as "
                "jax.make_mesh makes by default): stage it on one with the spec's 'axis_types: explicit' under "
                "'mesh:' (mesh: {axes: {...}, axis_types: explicit}); where the module builds that mesh itself "
                "with the staged axes, leave axis_types out and its axis types are taken")
    return ("this code is written for a mesh with Auto axes (with_sharding_constraint lets the partitioner "
            "decide): stage it with the spec's 'axis_types: auto' under 'mesh:' (the default), or use "
            "jax.sharding.reshard for Explicit axes")


#: JAX's words when code needs a context mesh and none is set (a bare PartitionSpec in
#: with_sharding_constraint, reshard, out_sharding=P(...); JAX 0.7-0.12).
CONTEXT_NEEDED = ("requires a non-empty mesh in context", "not under a mesh context",
                  "enter into a mesh context", "context mesh cannot be empty", "requires a mesh context",
                  "is not found in mesh: ()")

CONTEXT_ONLY_HINT = (
    "this fails only under the staged mesh as the context mesh (jax.set_mesh), which stagetool sets where "
    "the code runs under one (it sets one, its mesh axes are Explicit, it has logical axis rules) or "
    "--context-mesh (the spec's mesh.context: true) asks for it; raw JAX traces it under none: if the "
    "code's run sets no mesh, stage it with --no-context-mesh (the spec's mesh.context: false)")
"""The hint for a trace or ``init`` that fails under the context mesh stagetool set and not under none
(Flax linen's ``Partitioned.unbox()`` constraining a ``DenseGeneral`` kernel built flat)."""
