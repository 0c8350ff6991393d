"""The grid of a sweep: ``--mesh``, ``--set`` and ``--topology`` → an ordered list of configurations.

The grid is the product of its axes in a fixed order — topology (outermost), mesh, then the
``--set`` variables in the order given, each in the order of its values — so that every way of
running it (one process, ``--jobs N``, Ray, ``--shard I/N``) numbers the same configuration the
same way. A configuration's id is made of its values (``mesh=2x4,batch=16``), so an output
folder written by one run is understood by the next (``--resume``) even when the grid grows.

Pure: no JAX is imported here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import re
from typing import Any

from stagetool.core.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of a sweep.

    Attributes:
      index: its position in the whole grid (0-based; the order rows are reported in).
      id: stable name made of its values, also its file name in ``--output-dir`` (``<id>.json``).
      mesh: ``--mesh`` for this run (``2x4``), or None for the spec's own mesh.
      topology: ``--topology`` for this run, or None for the spec's.
      variables: ``(name, value text)`` filling the spec's placeholders, in ``--set`` order.
    """

    index: int
    id: str
    mesh: str | None
    topology: str | None
    variables: tuple[tuple[str, str], ...]

    def values(self) -> dict[str, Any]:
        """The axes' values for display and JSON: ``{"topology": ..., "mesh": ..., "batch": 16}``
        (a variable as the YAML scalar it stands for; axes that are not swept are left out)."""
        from stagetool.spec.variables import parse_value

        out: dict[str, Any] = {}
        if self.topology is not None:
            out["topology"] = self.topology
        if self.mesh is not None:
            out["mesh"] = self.mesh
        for name, text in self.variables:
            out[name] = parse_value(name, text)
        return out


@dataclasses.dataclass(frozen=True)
class Grid:
    """The axes of a sweep and its configurations in grid order.

    Attributes:
      axes: ``(axis name, values)`` in grid order (``topology``, ``mesh``, then variables); only
        the axes that were given.
      configs: every configuration, ``configs[i].index == i``.
    """

    axes: tuple[tuple[str, tuple[str, ...]], ...]
    configs: tuple[Config, ...]


MAX_GRID_SIZE = 10_000
"""Configurations one sweep may have: each is a process and a compile (seconds to minutes), so a
larger grid is a typo (``--mesh all --devices 1000000``) rather than a plan; exit 2 names the axes."""


def _divisors(n: int) -> list[int]:
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def factorisations(n: int, k: int) -> tuple[tuple[int, ...], ...]:
    """Every way to write ``n`` as an ordered product of ``k`` positive factors, in lexicographic
    order of the factors: ``factorisations(8, 2) == ((1, 8), (2, 4), (4, 2), (8, 1))``.
    (Divisors are found up to the square root: ``n`` is at most :data:`stagetool.core.mesh.MAX_DEVICES`
    where a sweep calls it, but this stays fast for any ``n``.)"""
    if n < 1 or k < 1:
        return ()
    if k == 1:
        return ((n,),)
    out = []
    for d in _divisors(n):
        out.extend((d, *rest) for rest in factorisations(n // d, k - 1))
    return tuple(out)


def _split(option: str, text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(","))
    if not text.strip() or any(not v for v in values):
        raise UsageError(f"{option} {text!r}: give a comma-separated list without empty items")
    if len(set(values)) != len(values):
        raise UsageError(f"{option} {text!r} repeats a value; give each once")
    return values


def mesh_values(text: str | None, axis_names: tuple[str, ...], device_count: int | None) -> tuple[str, ...] | None:
    """``--mesh``: ``1x8,2x4`` as given, or ``all``: every factorisation of ``device_count`` over the
    spec's axes (``1x8,2x4,4x2,8x1``); None when the option is absent.

    Raises:
      UsageError: ``all`` without mesh axes or a device count, or an empty item.
    """
    if text is None:
        return None
    if text.strip().lower() == "all":
        if not axis_names:
            raise UsageError("--mesh all needs the spec's mesh axes, and the spec has no mesh",
                             hint="add 'mesh: {axes: {data: 2, model: 4}}' to the spec")
        if not device_count:
            raise UsageError("--mesh all needs a device count", hint="pass --devices N")
        from stagetool.core.mesh import MAX_DEVICES

        if device_count > MAX_DEVICES:
            raise UsageError(f"--mesh all over {device_count} devices: a mesh has at most {MAX_DEVICES} devices",
                             hint="pass a smaller --devices N")
        return tuple("x".join(map(str, f)) for f in factorisations(device_count, len(axis_names)))
    return _split("--mesh", text)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+,-]", "_", text)


def _exact(mesh: str | None, topology: str | None, variables: tuple[tuple[str, str], ...]) -> str:
    parts = ([("topology", topology)] if topology is not None else []) + \
            ([("mesh", mesh)] if mesh is not None else []) + list(variables)
    return ",".join(f"{k}={v}" for k, v in parts) or "spec"


def config_id(mesh: str | None, topology: str | None, variables: tuple[tuple[str, str], ...], *,
              unique: bool = False) -> str:
    """``topology=v5e_2x4,mesh=2x4,batch=16``: the values, readable and safe as a file name (characters
    other than letters, digits and ``._=+,-`` become ``_``). With ``unique``, a short hash of the exact
    values is added (:func:`build_grid` asks for it only when two configurations would share an id)."""
    exact = _exact(mesh, topology, variables)
    slug = _slug(exact)
    return slug + "-" + hashlib.sha1(exact.encode()).hexdigest()[:8] if unique else slug


def build_grid(*, meshes: tuple[str, ...] | None, topologies: tuple[str, ...] | None,
               variables: dict[str, tuple[str, ...]]) -> Grid:
    """The product of the axes in grid order (topology, mesh, then variables as given).

    A sweep with no axes is one configuration: the spec as written.
    """
    axes: list[tuple[str, tuple[Any, ...]]] = []
    if topologies:
        axes.append(("topology", topologies))
    if meshes:
        axes.append(("mesh", meshes))
    axes.extend(variables.items())
    for reserved in ("mesh", "topology"):
        if reserved in variables:
            raise UsageError(f"--set {reserved}=...: '{reserved}' is the name of the --{reserved} axis",
                             hint=f"rename the spec's ${{{reserved}}} placeholder, or use --{reserved}")
    size = math.prod(len(values) for _, values in axes)
    if size > MAX_GRID_SIZE:
        raise UsageError(f"the sweep's grid has {size} configurations ("
                         + " x ".join(f"{len(v)} {name}" for name, v in axes) + f"), more than {MAX_GRID_SIZE}",
                         hint="sweep fewer values (each configuration is a process and a compile), or split the "
                              "sweep into several commands")
    configs = []
    for i, combo in enumerate(itertools.product(*(values for _, values in axes))):
        chosen = dict(zip((name for name, _ in axes), combo))
        mesh = chosen.pop("mesh", None) if meshes else None
        topology = chosen.pop("topology", None) if topologies else None
        var = tuple((name, chosen[name]) for name in variables)
        configs.append(Config(i, config_id(mesh, topology, var), mesh, topology, var))
    seen: dict[str, int] = {}
    for c in configs:
        seen[c.id] = seen.get(c.id, 0) + 1
    configs = [c if seen[c.id] == 1 else dataclasses.replace(c, id=config_id(c.mesh, c.topology, c.variables,
                                                                                unique=True))
               for c in configs]
    return Grid(tuple((n, tuple(v)) for n, v in axes), tuple(configs))


def grid_of_axes(axes: list) -> Grid:
    """The grid a sweep document's ``axes`` (``[[name, [value, ...]], ...]``, as :func:`build_grid`
    made them) describe: what ``sweep merge`` checks shards' rows against.

    Raises:
      UsageError: axes out of order, repeated, or with repeated values; a grid over the size cap.
    """
    names = [name for name, _ in axes]
    if len(set(names)) != len(names):
        raise UsageError(f"an axis is repeated ({', '.join(names)})")
    topologies = meshes = None
    rest = list(axes)
    if rest and rest[0][0] == "topology":
        topologies = tuple(rest.pop(0)[1])
    if rest and rest[0][0] == "mesh":
        meshes = tuple(rest.pop(0)[1])
    variables = {name: tuple(values) for name, values in rest}
    for name, values in [("topology", topologies or ()), ("mesh", meshes or ()), *variables.items()]:
        if len(set(values)) != len(values):
            raise UsageError(f"axis {name} repeats a value")
    return build_grid(meshes=meshes, topologies=topologies, variables=variables)


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``--shard I/N`` → ``(I, N)`` with ``1 <= I <= N``; None when absent.

    Raises:
      UsageError: not ``I/N`` with ``1 <= I <= N``.
    """
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]{1,9})\s*/\s*([0-9]{1,9})\s*", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise UsageError(f"--shard {text[:40]!r} is not I/N with 1 <= I <= N (at most 9 digits each)",
                         hint="e.g. --shard 1/4 ... --shard 4/4, one per CI job or Slurm array task")
    return int(m.group(1)), int(m.group(2))


def shard_of(configs: tuple[Config, ...], shard: tuple[int, int] | None) -> tuple[Config, ...]:
    """Shard ``I/N`` of the grid: the configurations whose index is ``I-1`` modulo ``N`` (round robin,
    so that each shard gets a mix of the grid's axes); all of them when ``shard`` is None."""
    if shard is None:
        return configs
    i, n = shard
    return tuple(c for c in configs if c.index % n == i - 1)
