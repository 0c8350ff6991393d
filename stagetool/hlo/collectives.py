"""Collectives of a compiled (partitioned) HLO module, named in the user's mesh axes.

Input: an :class:`~stagetool.hlo.parser.HloModule` parsed from ``compiled.as_text()`` and a
:class:`MeshAxes` (the user's mesh axis names and sizes, in order). Output: one frozen
:class:`Collective` per collective instruction, a :class:`CollectiveSummary`, and the answer to
"which collectives move data that comes from entry parameter N"
(:func:`collectives_from_parameter`).

The parser keeps ``replica_groups`` and ``source_target_pairs`` as the text XLA printed; their
meaning lives here: :func:`expand_replica_groups` turns each printed form (explicit, iota,
transposed iota, mesh) into device groups, and :class:`MeshAxes` / ``_AxisMatcher`` name the
mesh axes (or sub-axes) that make those groups. Both are device-id array arithmetic in numpy
(``arange(n).reshape(dims).transpose(perm).reshape(groups)``; ``moveaxis`` of the mesh array).

Conventions, each checked by the tests on JAX 0.10.2:

* Device ids in replica groups are partition ids (JAX's SPMD programs have one replica and set
  ``use_global_device_ids``), and partition id *i* is the device at position *i* of
  ``mesh.devices.flat`` — also when the mesh was built from a permuted device list.
* ``bytes_per_device`` is the size of the per-device **result** buffer of the collective, in
  bytes: for an all-gather the gathered (full) array, for a reduce-scatter the scattered shard,
  for an all-reduce / all-to-all / collective-permute the array each device ends up with. A
  variadic collective (tuple result) counts the sum of its arrays. For an async pair
  (``all-gather-start`` / ``-done``) the pair counts once, under the start's name, with the
  done's result (the real result, not the start's bookkeeping tuple).
* ``executions`` is how many times the instruction runs per program execution: 1 in the entry,
  multiplied by the trip count of every enclosing ``while`` — XLA's ``known_trip_count`` from the
  loop's backend config (CPU, GPU) or, where none is printed (TPU), the count of a literal
  counted loop ``for (i = a; i < n; i += s)`` read from the condition, body and initial tuple;
  None (unknown) when an enclosing loop fits neither, inside a ``conditional`` branch, or in a
  computation not reached from the entry.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from stagetool.hlo.parser import (
    CALL_ATTRIBUTES,
    ArrayShape,
    HloComputation,
    HloInstruction,
    HloModule,
    SourceFrame,
    TupleShape,
    array_leaves,
    backend_config_json,
    parse_int_list,
    paused_gc,
    shape_bytes,
)
from stagetool.core.compat import normalise_op_name

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "CollectiveSummary",
    "CollectiveTotals",
    "MeshAxes",
    "collectives_from_parameter",
    "expand_replica_groups",
    "find_collectives",
    "parse_source_target_pairs",
    "summarize",
]

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
"""Opcodes counted as collectives; each may also appear as ``<kind>-start`` / ``<kind>-done``."""

_KINDS = frozenset(COLLECTIVE_KINDS)
_START = {k + "-start": k for k in COLLECTIVE_KINDS}
_DONE = {k + "-done": k for k in COLLECTIVE_KINDS}
_MAX_PERMUTED_AXES = 5  # beyond this many mesh axes, only subsets in mesh order are tried


# --------------------------------------------------------------------------------------------
# Mesh axes


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The user's mesh: axis names and sizes in mesh order (``("data", "model")``, ``(2, 4)``).

    Device position *p* (row-major over ``sizes``) is ``mesh.devices.flat[p]``; HLO partition
    ids are these positions.

    Raises:
      ValueError: when names and sizes differ in length, a name repeats or a size is < 1.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.sizes):
            raise ValueError(f"mesh axes {self.names} and sizes {self.sizes} differ in length")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh axis names repeat: {self.names}")
        if any(s < 1 for s in self.sizes):
            raise ValueError(f"mesh axis sizes must be >= 1: {self.sizes}")

    @classmethod
    def from_mesh(cls, mesh: object) -> MeshAxes:
        """From a ``jax.sharding.Mesh`` or ``AbstractMesh`` (anything with ``axis_names`` and
        ``axis_sizes`` or ``devices.shape``)."""
        names = tuple(str(n) for n in mesh.axis_names)  # type: ignore[attr-defined]
        sizes = getattr(mesh, "axis_sizes", None)
        if sizes is None:
            sizes = mesh.devices.shape  # type: ignore[attr-defined]
        return cls(names, tuple(int(s) for s in sizes))

    @property
    def num_devices(self) -> int:
        """Product of the axis sizes."""
        return math.prod(self.sizes)

    def groups(self, axes: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Device groups (positions) of a collective over ``axes``: devices that differ only in
        those axes, each group ordered by ``axes`` (first axis major), groups in row-major order
        of the remaining axes.

        Raises:
          ValueError: for an axis that is not in the mesh or named twice.
        """
        idx = []
        for a in axes:
            if a not in self.names or self.names.index(a) in idx:
                raise ValueError(f"axis {a!r} is not a (distinct) mesh axis of {self.names}")
            idx.append(self.names.index(a))
        return _mesh_groups(self.sizes, tuple(idx))


def _mesh_group_array(sizes: tuple[int, ...], grouped: tuple[int, ...]) -> np.ndarray:
    """Device positions of a row-major mesh of ``sizes``, one row per group over the ``grouped``
    axes: the grouped axes moved last (in the order given), the others kept in mesh order."""
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    moved = np.moveaxis(ids, grouped, range(ids.ndim - len(grouped), ids.ndim))
    return moved.reshape(-1, math.prod(sizes[i] for i in grouped))


def _mesh_groups(sizes: tuple[int, ...], grouped: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return _as_groups(_mesh_group_array(sizes, grouped))


def _as_groups(rows: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """A 2-D array of device ids as a tuple of groups of Python ints."""
    return tuple(map(tuple, rows.tolist()))


def _sub_axis_meshes(mesh: MeshAxes) -> list[MeshAxes]:
    """The meshes with one axis split into a major and a minor part (every proper divisor)."""
    out = []
    for i, (name, n) in enumerate(zip(mesh.names, mesh.sizes, strict=True)):
        for d in range(2, n):
            if n % d:
                continue
            names = (*mesh.names[:i], f"{name}[major {n // d} of {n}]", f"{name}[minor {d} of {n}]",
                     *mesh.names[i + 1:])
            out.append(MeshAxes(names, (*mesh.sizes[:i], n // d, d, *mesh.sizes[i + 1:])))
    return out


class _AxisMatcher:
    """Looks up which mesh axes (if any) produce a given set of device groups."""

    def __init__(self, mesh: MeshAxes):
        self.mesh = mesh
        n = len(mesh.names)
        self.subsets: list[tuple[int, ...]] = [c for k in range(1, n + 1) for c in itertools.combinations(range(n), k)]
        self.ordered: dict[frozenset, tuple[str, ...]] = {}
        self.unordered: dict[frozenset, tuple[str, ...]] = {}
        for sub in self.subsets:
            names = tuple(mesh.names[i] for i in sub)
            groups = _mesh_groups(mesh.sizes, sub)
            self.unordered.setdefault(frozenset(frozenset(g) for g in groups), names)
            perms = itertools.permutations(sub) if n <= _MAX_PERMUTED_AXES else (sub,)
            for perm in perms:
                g = groups if perm == sub else _mesh_groups(mesh.sizes, perm)
                self.ordered.setdefault(frozenset(g), tuple(mesh.names[i] for i in perm))
        self._group_of: dict[tuple[int, ...], np.ndarray] = {}
        self._refined: list[_AxisMatcher] | None = None

    def match_groups(self, groups: tuple[tuple[int, ...], ...]) -> tuple[str, ...] | None:
        """The mesh axes whose device groups these are, or None.

        Whole axes first; then sub-axes: an axis of size n splits into a major part of n/d and a
        minor part of d (row-major order is kept), named ``model[minor 2 of 4]`` and
        ``model[major 2 of 4]`` — what XLA prints as ``{'axis':(2)2}`` when a collective runs
        over part of an axis.
        """
        hit = self._match_whole(groups)
        if hit is not None or not groups:
            return hit
        if self._refined is None:
            self._refined = [_AxisMatcher(m) for m in _sub_axis_meshes(self.mesh)]
        for refined in self._refined:
            hit = refined._match_whole(groups)
            if hit is not None:
                return hit
        return None

    def _match_whole(self, groups: tuple[tuple[int, ...], ...]) -> tuple[str, ...] | None:
        if not groups:
            return None
        if all(len(g) == 1 for g in groups):
            return ()
        hit = self.ordered.get(frozenset(groups))
        if hit is not None:
            return hit
        return self.unordered.get(frozenset(frozenset(g) for g in groups))

    def match_pairs(self, pairs: tuple[tuple[int, int], ...]) -> tuple[str, ...] | None:
        moving = [(s, t) for s, t in pairs if s != t]
        n = self.mesh.num_devices
        if any(not (0 <= s < n and 0 <= t < n) for s, t in pairs):
            return None
        if not moving:
            return ()
        src, dst = np.array(moving).T
        for sub in self.subsets:
            gid = self._group_of.get(sub)
            if gid is None:  # device position -> index of its group over `sub`
                rows = _mesh_group_array(self.mesh.sizes, sub)
                gid = np.empty(n, dtype=np.intp)
                gid[rows] = np.arange(len(rows))[:, None]
                self._group_of[sub] = gid
            if np.array_equal(gid[src], gid[dst]):
                return tuple(self.mesh.names[i] for i in sub)
        return None


# --------------------------------------------------------------------------------------------
# Replica groups: what the printed forms mean, as device-id arrays

_INT_RE = re.compile(r"-?\d+")
_GROUP_RE = re.compile(r"\{([^{}]*)\}")
_IOTA_RE = re.compile(r"\[([\d,\s]*)\]\s*<=\s*\[([\d,\s]*)\](?:\s*T\(([\d,\s]*)\))?")
_DEVICE_IDS_RE = re.compile(r"\[([\d,\s]*)\](?:\s*T\(([\d,\s]*)\))?$")
_MESH_RE = re.compile(r"mesh\[([^\]]*)\]\s*(?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}\s*$")
_MESH_AXIS_RE = re.compile(r"'?([^'=]+?)'?\s*=\s*(\d+)")  # 'axis_0'=2
_AXIS_REF_RE = re.compile(r"'?([^':]+?)'?(?::\((\d+)\)(\d+))?$")


def _ints(s: str) -> list[int]:
    return [int(v) for v in _INT_RE.findall(s)]


def _explicit_groups(raw: str) -> tuple[tuple[int, ...], ...] | None:
    """``{{0,4},{1,5}}`` -> ((0, 4), (1, 5)); ``{}`` -> (); None when not braced."""
    s = raw.strip()
    if not (s.startswith("{") and s.endswith("}")):
        return None
    inner = s[1:-1].strip()
    if not inner:
        return ()
    return tuple(tuple(_ints(g)) for g in _GROUP_RE.findall(inner))


def _iota_ids(dims: list[int], perm: list[int] | None) -> np.ndarray:
    """``iota(prod(dims)).reshape(dims).transpose(perm)``, flattened row-major."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


@functools.lru_cache(maxsize=1 << 12)
def expand_replica_groups(raw: str | None, num_devices: int | None = None) -> tuple[tuple[int, ...], ...] | None:
    """Expand a ``replica_groups=`` value (raw, as the parser keeps it) to the device groups it
    denotes.

    Accepted forms (as XLA prints them):

    * explicit: ``{{0,4},{1,5}}``; ``{}`` means one group of all ``num_devices`` devices (None if
      ``num_devices`` is not given);
    * iota: ``[G,S]<=[N]`` and ``[G,S]<=[d0,d1,...]T(p0,p1,...)``: iota over the reshape dims,
      transposed by the permutation, read row-major into G groups of S;
    * mesh: ``mesh['a'=2,'b'=4] {'a'}``, with an optional ``, device_ids=(...)`` (an iota
      ``[d..]T(p..)`` or a list of ids) and sub-axes ``'a':(pre)size``: the devices of the mesh
      array that differ only along the named axes, in the named order.

    Ids are those of the module: with ``use_global_device_ids`` and one replica (JAX's SPMD
    programs) they are partition ids, i.e. positions in the user's ``mesh.devices.flat``.
    Returns None when the text is none of these forms. Results are cached.
    """
    if raw is None:
        return None
    s = raw.strip()
    try:
        if s.startswith("{"):
            groups = _explicit_groups(s)
            if groups == () and num_devices is not None:
                return (tuple(range(num_devices)),)
            return groups if groups else None
        if s.startswith("["):
            m = _IOTA_RE.fullmatch(s)
            if m is None:
                return None
            shape, dims = _ints(m.group(1)), _ints(m.group(2))
            if len(shape) != 2 or math.prod(shape) != math.prod(dims):
                return None
            return _as_groups(_iota_ids(dims, _ints(m.group(3)) if m.group(3) else None).reshape(shape))
        if s.startswith("mesh["):
            return _mesh_form_groups(s)
    except (ValueError, IndexError, ZeroDivisionError):  # numpy's AxisError is a ValueError
        return None
    return None


def _mesh_form_groups(s: str) -> tuple[tuple[int, ...], ...] | None:
    m = _MESH_RE.fullmatch(s)
    if m is None:
        return None
    axes = []
    for part in m.group(1).split(","):
        am = _MESH_AXIS_RE.fullmatch(part.strip())
        if am is None:
            return None
        axes.append((am.group(1).strip(), int(am.group(2))))
    if not axes:
        return None
    names = [a for a, _ in axes]
    sizes = [n for _, n in axes]
    total = math.prod(sizes)
    ids_text = (m.group(2) or "").strip()
    if not ids_text:
        device_ids = np.arange(total)
    elif dm := _DEVICE_IDS_RE.fullmatch(ids_text):
        dims = _ints(dm.group(1))
        if math.prod(dims) != total:
            return None
        device_ids = _iota_ids(dims, _ints(dm.group(2)) if dm.group(2) else None)
    else:
        device_ids = np.array(_ints(ids_text), dtype=np.int64)
    if device_ids.size != total:
        return None
    # Each grouped axis ref: (mesh dim, pre_size, size); a full axis is (dim, 1, full size).
    refs: list[tuple[int, int, int]] = []
    for part in [p.strip() for p in m.group(3).split(",") if p.strip()]:
        am = _AXIS_REF_RE.fullmatch(part)
        if am is None or am.group(1).strip() not in names:
            return None
        dim = names.index(am.group(1).strip())
        if am.group(2) is not None:
            refs.append((dim, int(am.group(2)), int(am.group(3))))
        else:
            refs.append((dim, 1, sizes[dim]))
    # Split every mesh dim into factors (major first) so that each ref is exactly one factor.
    factor_sizes: list[int] = []
    ref_factor: dict[int, int] = {}
    for dim, full in enumerate(sizes):
        on_dim = sorted((pre, size, k) for k, (d, pre, size) in enumerate(refs) if d == dim)
        covered = 1
        for pre, size, k in on_dim:
            if pre % covered:
                return None
            if pre != covered:
                factor_sizes.append(pre // covered)
                covered = pre
            ref_factor[k] = len(factor_sizes)
            factor_sizes.append(size)
            covered *= size
        if full % covered:
            return None
        if covered != full or not on_dim:
            factor_sizes.append(full // covered)
    grouped = [ref_factor[k] for k in range(len(refs))]
    rest = [f for f in range(len(factor_sizes)) if f not in grouped]
    group_size = math.prod(factor_sizes[f] for f in grouped)
    # The device-id array viewed with the factors, the grouped ones moved last, read row-major.
    return _as_groups(device_ids.reshape(factor_sizes).transpose(rest + grouped).reshape(-1, group_size))


def parse_source_target_pairs(raw: str | None) -> tuple[tuple[int, int], ...] | None:
    """A raw ``source_target_pairs=`` value ``{{0,1},{1,2}}`` -> ((0, 1), (1, 2)); None when absent
    or malformed."""
    if raw is None:
        return None
    groups = _explicit_groups(raw)
    if groups is None or any(len(g) != 2 for g in groups):
        return None
    return tuple((g[0], g[1]) for g in groups)


# --------------------------------------------------------------------------------------------
# Records


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled program (an async start/done pair counts once).

    Attributes:
      kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``,
        ``ragged-all-to-all``, ``collective-permute`` or ``collective-broadcast`` (the sync name,
        also for async pairs).
      name: HLO instruction name (of the ``-start`` for an async pair).
      computation: name of the computation holding it.
      fusion: name of the ``fusion`` instruction whose fused computation holds it, or None. A
        TPU ``all-reduce-scatter`` fusion (all-reduce + slice) is reported as one
        ``reduce-scatter`` whose result is the fusion's.
      is_async: True for a ``-start``/``-done`` pair or a collective inside an ``async-start``
        wrapper computation.
      done_name: the matching ``-done`` instruction's name, or None.
      result_types: per-device result arrays as ``dtype[dims]`` (layouts dropped), several for a
        variadic collective.
      bytes_per_device: bytes of the per-device result buffer(s) (see the module docstring);
        None when a dtype or shape is unknown.
      operand_bytes_per_device: bytes of the operands each device sends in, or None.
      replica_groups_text: the raw ``replica_groups`` value, or None.
      replica_groups: the device groups (partition ids = positions in ``mesh.devices.flat``),
        expanded from any printed form, or None when absent/unparsed.
      group_size: devices per group (equal-size groups), or None.
      source_target_pairs: ``(source, target)`` pairs of a collective-permute, else None.
      mesh_axes: the user's mesh axes the groups (or permute pairs) run over, e.g. ``("data",)``;
        ``()`` when every group has one device; None when no axis set matches (groups kept).
        For a permute: the smallest axis set whose groups hold every moving pair.
      dimensions: the ``dimensions=`` attribute (gather/scatter/all-to-all dims), or None.
      reduction: opcode of the reducer's root (``add``, ``maximum``...) for reducing
        collectives, else None.
      channel_id: the ``channel_id`` attribute, or None.
      executions: times it runs per program execution (see module docstring), None if unknown.
      in_loop: True when inside a ``while`` body (at any depth).
      in_conditional: True when inside a ``conditional`` branch (at any depth).
      op_name: JAX's op name path from the metadata (the calling fusion's or wrapper's when the
        collective has none), one spelling whatever the release
        (:func:`stagetool.core.compat.normalise_op_name`), or None.
      source: innermost source frame (the user's op line), or None when not recorded.
      source_chain: the frames of the traced code, innermost first (callers follow), up to the
        first frame in stagetool's own package: how stagetool was called (a command, a worker
        process, the Python API) is not part of the program (:func:`program_frames`).
      merged: ``(computation, name)`` of the other instructions counted in this record: TPU
        splits an async collective over start / continuation / done fusions that share its
        ``channel_id``; empty elsewhere.
      network: on a multi-slice TPU job (``--slices``), ``"ici"`` for a collective within a slice,
        ``"dcn"`` for a transfer between slices (XLA's megascale ``send``, whose ``kind`` is its
        transfer type, e.g. ``all-reduce``); None for one slice.
      nearest: when the collective (and its calling fusion or wrapper) has no source line of its own
        (one XLA inserted without metadata, or with only its own instruction name), the HLO name of
        the nearest instruction of the same computation that has one, by operand/user hops (operands
        first): ``op_name``, ``source`` and ``source_chain`` are then that instruction's. None when
        the collective has its own, or when no instruction within :data:`NEAREST_HOPS` has one.
    """

    kind: str
    name: str
    computation: str
    fusion: str | None
    is_async: bool
    done_name: str | None
    result_types: tuple[str, ...]
    bytes_per_device: int | None
    operand_bytes_per_device: int | None
    replica_groups_text: str | None
    replica_groups: tuple[tuple[int, ...], ...] | None
    group_size: int | None
    source_target_pairs: tuple[tuple[int, int], ...] | None
    mesh_axes: tuple[str, ...] | None
    dimensions: tuple[int, ...] | None
    reduction: str | None
    channel_id: int | None
    executions: int | None
    in_loop: bool
    in_conditional: bool
    op_name: str | None
    source: SourceFrame | None
    source_chain: tuple[SourceFrame, ...]
    merged: tuple[tuple[str, str], ...] = ()
    network: str | None = None
    # left out of the snapshot's records and the report's JSON while None
    nearest: str | None = dataclasses.field(default=None, metadata={"omit": True, "json_omit_none": True})

    @property
    def executed_bytes_per_device(self) -> int | None:
        """``bytes_per_device × executions``; None when either is unknown."""
        if self.bytes_per_device is None or self.executions is None:
            return None
        return self.bytes_per_device * self.executions



@dataclasses.dataclass(frozen=True)
class CollectiveTotals:
    """Totals over a set of collectives.

    Attributes:
      kind: the collective kind of this row, or None for a row over all kinds.
      mesh_axes: the mesh axes of this row; in ``by_mesh_axes`` / ``by_kind_and_mesh_axes``
        rows None means "matched no mesh axes"; in ``total`` / ``by_kind`` rows it is None.
      count: number of collective instructions (an async pair is one).
      bytes_per_device: sum of their ``bytes_per_device``, one execution each.
      unknown_size_count: how many had unknown bytes (left out of the byte sums).
      executions: sum of the known ``executions``.
      executed_bytes_per_device: sum of ``bytes_per_device × executions`` over those whose
        executions and bytes are known: bytes each device receives per program execution.
      unknown_executions_count: how many had unknown executions (left out of the two sums
        above; their bytes still count in ``bytes_per_device``).
      network: in ``by_kind_and_mesh_axes`` rows of a multi-slice job, ``"ici"`` or ``"dcn"``; else None.
    """

    kind: str | None
    mesh_axes: tuple[str, ...] | None
    count: int
    bytes_per_device: int
    unknown_size_count: int
    executions: int
    executed_bytes_per_device: int
    unknown_executions_count: int
    network: str | None = None



@dataclasses.dataclass(frozen=True)
class CollectiveSummary:
    """Totals by kind, by mesh axes and by both (and network, on a multi-slice job); rows sorted
    by kind name, then mesh axes (unmatched last), then network.

    ``dcn_bytes_per_step``: on a multi-slice job, the bytes each device sends between slices per
    program execution (Σ of the DCN transfers' ``bytes_per_device × executions``; 0 when none);
    None for one slice."""

    total: CollectiveTotals
    by_kind: tuple[CollectiveTotals, ...]
    by_mesh_axes: tuple[CollectiveTotals, ...]
    by_kind_and_mesh_axes: tuple[CollectiveTotals, ...]
    dcn_bytes_per_step: int | None = None



# --------------------------------------------------------------------------------------------
# Execution counts


@dataclasses.dataclass
class _Context:
    executions: int | None
    in_loop: bool
    in_conditional: bool
    is_async: bool


_REDUCER_ATTR = "to_apply"
_EXECUTED_CALL_ATTRIBUTES = tuple(a for a in CALL_ATTRIBUTES if a != _REDUCER_ATTR)
_NON_EXECUTING = frozenset({"async-update", "async-done"})


def _call_edges(ins: HloInstruction) -> Iterable[tuple[str, str]]:
    """(attribute, callee) pairs of an instruction, reducers (``to_apply``) excluded."""
    if not ins.called_computations or ins.opcode in _NON_EXECUTING:
        return ()
    out = []
    for attr in _EXECUTED_CALL_ATTRIBUTES:
        raw = ins.attributes.get(attr)
        if raw:
            for name in _callee_names(raw):
                out.append((attr, name))
    return out


def _callee_names(raw: str) -> list[str]:
    return [p.strip().lstrip("%") for p in raw.strip().strip("{}").split(",") if p.strip()]


def _trip_count(module: HloModule, caller: HloComputation, ins: HloInstruction) -> int | None:
    """Trip count of a ``while``: XLA's ``known_trip_count`` when the backend config states it
    (CPU, GPU), else :func:`_derived_trip_count` (TPU prints no backend config on loops)."""
    cfg = backend_config_json(ins)
    n = ((cfg or {}).get("known_trip_count") or {}).get("n")
    if n is not None:
        try:
            return int(n)
        except (TypeError, ValueError):
            return None
    return _derived_trip_count(module, caller, ins)


_PASS_THROUGH = frozenset({"copy", "bitcast"})


def _resolve(comp: HloComputation, name: str) -> HloInstruction | None:
    """The instruction ``name`` names, looking through copies and bitcasts."""
    return comp.behind(name, _PASS_THROUGH, 64)


def _const_int(ins: HloInstruction | None) -> int | None:
    if ins is None or ins.opcode != "constant" or not isinstance(ins.shape, ArrayShape) or ins.shape.dims:
        return None
    text = ins.operand_text.strip()
    return int(text) if text.lstrip("-").isdigit() else None


def _binary(module: HloModule, comp: HloComputation, ins: HloInstruction | None, opcode: str):
    """``(lhs, rhs, instruction)`` of a binary ``opcode`` instruction, also when it is the root
    of a fusion of two parameters (``wrapped_add``, ``wrapped_compare``); else None."""
    if ins is None:
        return None
    if ins.opcode == opcode and len(ins.operands) == 2:
        return _resolve(comp, ins.operands[0]), _resolve(comp, ins.operands[1]), ins
    if ins.opcode == "fusion" and len(ins.called_computations) == 1:
        fused = module.computation(ins.called_computations[0])
        root = fused.root if fused else None
        if root is None or root.opcode != opcode or len(root.operands) != 2:
            return None
        sides = []
        for name in root.operands:
            k = fused.instruction(name).parameter_number if fused.instruction(name) else None
            if k is None or k >= len(ins.operands):
                return None
            sides.append(_resolve(comp, ins.operands[k]))
        return sides[0], sides[1], root
    return None


def _loop_index(comp: HloComputation, ins: HloInstruction | None) -> int | None:
    """Tuple index i when ``ins`` is ``get-tuple-element(parameter(0)), index=i``."""
    if ins is None or ins.opcode != "get-tuple-element" or not ins.operands:
        return None
    src = _resolve(comp, ins.operands[0])
    if src is None or src.parameter_number != 0:
        return None
    idx = parse_int_list(ins.attributes.get("index"))
    return idx[0] if idx else None


_MIRROR = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE"}


def _derived_trip_count(module: HloModule, caller: HloComputation, ins: HloInstruction) -> int | None:
    """Trip count of the counted-loop pattern ``for (i = a; i < n; i += s)``, or None.

    Derived only when every piece is a literal: the condition's root compares element *i* of the
    loop state with a constant (``LT``, ``LE`` or ``NE``, either side), the body's root tuple
    sets element *i* to itself plus a positive constant, and the ``while`` operand is a tuple
    whose element *i* is a constant (copies, bitcasts and single-op fusions looked through).
    """
    body = module.computation(ins.attributes.get("body", "").lstrip("%"))
    cond = module.computation(ins.attributes.get("condition", "").lstrip("%"))
    if body is None or cond is None or not ins.operands:
        return None
    cmp = _binary(module, cond, cond.root, "compare")
    if cmp is None:
        return None
    lhs, rhs, cmp_ins = cmp
    direction = cmp_ins.attributes.get("direction", "")
    if _loop_index(cond, lhs) is None:
        lhs, rhs, direction = rhs, lhs, _MIRROR.get(direction, "")
    i, limit = _loop_index(cond, lhs), _const_int(rhs)
    if i is None or limit is None or direction not in ("LT", "LE", "NE"):
        return None
    root = body.root
    if root is None or root.opcode != "tuple" or i >= len(root.operands):
        return None
    add = _binary(module, body, _resolve(body, root.operands[i]), "add")
    if add is None:
        return None
    a, b, _ = add
    if _loop_index(body, a) != i:
        a, b = b, a
    step = _const_int(b)
    if _loop_index(body, a) != i or step is None or step <= 0:
        return None
    init_tuple = _resolve(caller, ins.operands[0])
    if init_tuple is None or init_tuple.opcode != "tuple" or i >= len(init_tuple.operands):
        return None
    start = _const_int(_resolve(caller, init_tuple.operands[i]))
    if start is None:
        return None
    if direction == "LT":
        return max(0, -(-(limit - start) // step))
    if direction == "LE":
        return max(0, (limit - start) // step + 1)
    return (limit - start) // step if limit >= start and (limit - start) % step == 0 else None


def _callers(module: HloModule) -> dict[str, list[tuple[HloComputation, HloInstruction, str]]]:
    """callee name -> [(calling computation, calling instruction, attribute)], reducers excluded."""
    callers: dict[str, list[tuple[HloComputation, HloInstruction, str]]] = {}
    for comp in module.computations:
        for ins in comp.instructions:
            for attr, callee in _call_edges(ins):
                callers.setdefault(callee, []).append((comp, ins, attr))
    return callers


def _contexts(module: HloModule, callers) -> dict[str, _Context]:
    """Execution context of every computation reached from the entry."""
    memo: dict[str, _Context | None] = {}

    def ctx(name: str, stack: frozenset) -> _Context | None:
        if name in memo:
            return memo[name]
        if name == module.entry_name:
            memo[name] = _Context(1, False, False, False)
            return memo[name]
        if name in stack:
            return None
        total: int | None = 0
        found = False
        in_loop = in_cond = is_async = False
        for caller, ins, attr in callers.get(name, ()):
            c = ctx(caller.name, stack | {name})
            if c is None:
                continue
            found = True
            in_loop |= c.in_loop
            in_cond |= c.in_conditional
            factor: int | None = 1
            if ins.opcode == "while":
                in_loop = True
                trips = _trip_count(module, caller, ins)
                factor = None if trips is None else (trips + 1 if attr == "condition" else trips)
            elif ins.opcode == "conditional":
                in_cond = True
                factor = None
            elif ins.opcode == "async-start":
                is_async = True
            is_async |= c.is_async and ins.opcode != "while"
            if total is not None:
                total = None if (c.executions is None or factor is None) else total + c.executions * factor
        result = _Context(total, in_loop, in_cond, is_async) if found else None
        memo[name] = result
        return result

    out = {}
    for comp in module.computations:
        c = ctx(comp.name, frozenset())
        if c is not None:
            out[comp.name] = c
    return out


# --------------------------------------------------------------------------------------------
# Finding collectives


def _async_result_shape(start: HloInstruction):
    """The real result inside an async ``-start``'s tuple when no ``-done`` is found."""
    if start.opcode == "all-reduce-start" or not isinstance(start.shape, TupleShape):
        return start.shape
    return start.shape.elements[1] if len(start.shape.elements) > 1 else None


def _reduction(module: HloModule, ins: HloInstruction) -> str | None:
    raw = ins.attributes.get(_REDUCER_ATTR)
    if not raw:
        return None
    names = _callee_names(raw)
    comp = module.computation(names[0]) if names else None
    root = comp.root if comp else None
    return root.opcode if root else None


def find_collectives(module: HloModule, mesh: MeshAxes | None = None, *, slices: int = 1) -> tuple[Collective, ...]:
    """Every collective of ``module`` in text order (computation by computation), async pairs
    once, including those inside fusions, while bodies, conditionals, calls and async wrappers.

    Args:
      module: the parsed compiled module (``parse_hlo_module(compiled.as_text())``).
      mesh: the user's mesh; without it ``mesh_axes`` is None everywhere.
      slices: TPU slices of a multi-slice job (``--slices``). XLA then compiles one slice's program
        (``num_partitions`` = the slice's devices): replica groups are matched against the slice's
        part of the mesh (first axis ÷ ``slices``), and XLA's DCN transfers (``send`` with
        ``_xla_megascale_transfer_type``) are collectives of their own with ``network="dcn"`` over
        the first mesh axis.

    Returns:
      A tuple of :class:`Collective` records; never raises on odd content (unknown values are
      None).
    """
    with paused_gc():
        if slices <= 1:
            return _find(module, mesh)
        per_slice = None if mesh is None else MeshAxes(mesh.names, (max(mesh.sizes[0] // slices, 1), *mesh.sizes[1:]))
        found = _find(module, per_slice, dcn_axes=(mesh.names[0],) if mesh is not None and mesh.names else None)
        return tuple(c if c.network == "dcn" else dataclasses.replace(c, network="ici") for c in found)


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Za-z_]+)"')


def _find(module: HloModule, mesh: MeshAxes | None, dcn_axes: tuple[str, ...] | None = None) -> tuple[Collective, ...]:
    callers = _callers(module)
    contexts = _contexts(module, callers)
    num_devices = module.num_partitions
    if num_devices is not None and module.replica_count:
        num_devices *= module.replica_count
    matcher = _AxisMatcher(mesh) if mesh is not None else None
    out: list[Collective] = []
    for comp in module.computations:
        ctx = contexts.get(comp.name)
        sites = callers.get(comp.name, ())
        caller = sites[0][1] if len(sites) == 1 else None
        caller_comp = sites[0][0] if len(sites) == 1 else None
        dones = {}
        for ins in comp.instructions:
            if ins.opcode in _DONE and ins.operands:
                dones[ins.operands[0]] = ins
        for ins in comp.instructions:
            op = ins.opcode
            if op == "send" and dcn_axes is not None:
                m = _MEGASCALE.search(ins.attributes.get("frontend_attributes", ""))
                if m and ins.operands:  # a transfer between slices over DCN: what this device sends
                    kind = m.group(1).lower().replace("_", "-")
                    data = comp.instruction(ins.operands[0])
                    rec = _record(module, comp, ins, kind, None, data.shape if data is not None else None, ctx,
                                  num_devices, None, caller, None)
                    out.append(dataclasses.replace(rec, mesh_axes=dcn_axes, network="dcn", is_async=True,
                                                   replica_groups=None, group_size=None))
                continue
            if op in _KINDS:
                kind, done = op, None
                result_shape = ins.shape
            elif op in _START:
                kind, done = _START[op], dones.get(ins.name)
                result_shape = done.shape if done is not None else _async_result_shape(ins)
            else:
                continue
            fusion = caller if caller is not None and caller.opcode == "fusion" else None
            if kind == "all-reduce" and fusion is not None and _is_all_reduce_scatter(comp, fusion):
                kind, result_shape = "reduce-scatter", fusion.shape
            out.append(_record(module, comp, ins, kind, done, result_shape, ctx, num_devices, matcher, caller, fusion,
                               caller_comp))
    return _merge_split_collectives(out)


def _merge_split_collectives(found: list[Collective]) -> tuple[Collective, ...]:
    """Count once a collective that TPU splits over several fusions.

    XLA's TPU backend lowers an async collective to a start fusion, continuation fusions (each
    overlapping some compute) and a done fusion, each holding a copy of the collective with the
    same ``channel_id``. Elsewhere a channel id names one collective. Copies inside fusions with
    the same kind and channel id become one record (the first in text order) listing the others
    in ``merged``.
    """
    first: dict[tuple[str, int], int] = {}
    extra: dict[int, list[tuple[str, str]]] = {}
    keep: list[int] = []
    for k, c in enumerate(found):
        key = (c.kind, c.channel_id)
        if c.fusion is None or c.channel_id is None:
            keep.append(k)
        elif key in first:
            extra.setdefault(first[key], []).append((c.computation, c.name))
        else:
            first[key] = k
            keep.append(k)
    return tuple(
        dataclasses.replace(found[k], merged=tuple(extra[k]), is_async=True) if k in extra else found[k] for k in keep
    )


def _is_all_reduce_scatter(fused: HloComputation, fusion: HloInstruction) -> bool:
    """TPU's reduce-scatter: an ``all-reduce`` plus a slice inside an ``all-reduce-scatter``
    fusion (its emitter is named ``...AllReduceScatter...`` in the backend config)."""
    return fused.name.startswith("all-reduce-scatter") or "AllReduceScatter" in fusion.attributes.get(
        "backend_config", ""
    )


NEAREST_HOPS = 8
"""How many operand/user hops :func:`_nearest_described` looks for an instruction with a source line."""


def _nearest_described(module: HloModule, comp: HloComputation,
                       start: HloInstruction) -> tuple[HloInstruction, tuple] | None:
    """The instruction of ``comp`` nearest to ``start`` (breadth-first over operands, then users, up to
    :data:`NEAREST_HOPS` hops; ties in operand order, then text order) whose metadata has a source line
    of the program, and that line's frames; None when none has."""
    users: dict[str, list[str]] = {}
    for x in comp.instructions:
        for o in x.operands:
            users.setdefault(o, []).append(x.name)
    seen, level = {start.name}, [start.name]
    for _ in range(NEAREST_HOPS):
        nxt = []
        for side in ("operands", "users"):
            for name in level:
                x = comp.instruction(name)
                for n in (x.operands if side == "operands" else users.get(name, ())) if x is not None else ():
                    if n not in seen:
                        seen.add(n)
                        nxt.append(n)
        for name in nxt:
            x = comp.instruction(name)
            chain = program_frames(module.source_stack(x)) if x is not None and x.metadata else ()
            if chain:
                return x, chain
        if not nxt:
            return None
        level = nxt
    return None


def _record(
    module, comp: HloComputation, ins, kind, done, result_shape, ctx, num_devices, matcher, caller, fusion,
    caller_comp: HloComputation | None = None,
) -> Collective:
    arrays = array_leaves(result_shape)
    operand_bytes: int | None = 0
    for name in ins.operands:
        o = comp.instruction(name)
        b = shape_bytes(o.shape) if o is not None else None
        operand_bytes = None if (b is None or operand_bytes is None) else operand_bytes + b
    if not ins.operands:
        operand_bytes = None
    rg_text = ins.attributes.get("replica_groups")
    groups = expand_replica_groups(rg_text, num_devices) if rg_text is not None else None
    if groups is None and rg_text is None and kind != "collective-permute" and num_devices:
        groups = (tuple(range(num_devices)),)  # no replica_groups: all devices
    sizes = {len(g) for g in groups} if groups else set()
    pairs = parse_source_target_pairs(ins.attributes.get("source_target_pairs"))
    axes = None
    if matcher is not None:
        if pairs is not None:
            axes = matcher.match_pairs(pairs)
        elif groups is not None:
            axes = matcher.match_groups(groups)
    # A collective inside a fusion or wrapper often has no metadata: take its caller's.
    described = ins if (ins.metadata or caller is None) else caller
    chain = program_frames(module.source_stack(described))
    own_op_name = described.metadata.op_name if described.metadata else None  # what XLA named it (jaxlib 0.12: "w")
    nearest = None
    if not chain:  # inserted by XLA without a line of the program's: borrow the nearest instruction's
        where, start = (caller_comp, caller) if described is caller and caller_comp is not None else (comp, ins)
        found = _nearest_described(module, where, start)
        if found is None and where is not comp:
            found = _nearest_described(module, comp, ins)
        if found is not None:
            described, chain = found
            nearest = described.name
    ch = ins.attributes.get("channel_id", "")
    return Collective(
        kind=kind,
        name=ins.name,
        computation=comp.name,
        fusion=fusion.name if fusion is not None else None,
        is_async=done is not None or ins.opcode in _START or bool(ctx and ctx.is_async),
        done_name=done.name if done is not None else None,
        result_types=tuple(a.type_text() for a in arrays),
        bytes_per_device=shape_bytes(result_shape),
        operand_bytes_per_device=operand_bytes,
        replica_groups_text=rg_text,
        replica_groups=groups,
        group_size=sizes.pop() if len(sizes) == 1 else None,
        source_target_pairs=pairs,
        mesh_axes=axes,
        dimensions=parse_int_list(ins.attributes.get("dimensions")),
        reduction=_reduction(module, ins),
        channel_id=int(ch) if ch.isdigit() else None,
        executions=ctx.executions if ctx else None,
        in_loop=bool(ctx and ctx.in_loop),
        in_conditional=bool(ctx and ctx.in_conditional),
        op_name=normalise_op_name(own_op_name or (described.metadata.op_name if described.metadata else None)),
        source=chain[0] if chain else None,
        source_chain=chain,
        nearest=nearest,
    )


# --------------------------------------------------------------------------------------------
# Summary


def _totals(kind, axes, items: Sequence[Collective]) -> CollectiveTotals:
    size = sum(c.bytes_per_device for c in items if c.bytes_per_device is not None)
    known = [c for c in items if c.executions is not None]
    return CollectiveTotals(
        kind=kind,
        mesh_axes=axes,
        count=len(items),
        bytes_per_device=size,
        unknown_size_count=sum(1 for c in items if c.bytes_per_device is None),
        executions=sum(c.executions for c in known),  # type: ignore[misc]
        executed_bytes_per_device=sum(
            c.executed_bytes_per_device for c in known if c.executed_bytes_per_device is not None
        ),
        unknown_executions_count=len(items) - len(known),
    )


def _axes_key(axes: tuple[str, ...] | None) -> tuple:
    return (1, ()) if axes is None else (0, axes)


def summarize(collectives: Iterable[Collective]) -> CollectiveSummary:
    """Count and bytes per device of ``collectives`` (one execution, and × known executions),
    in total, by kind, by mesh axes and by (kind, mesh axes, network); on a multi-slice job (any
    collective has a ``network``) also the bytes over DCN per step."""
    items = list(collectives)
    by_kind: dict[str, list[Collective]] = {}
    by_axes: dict = {}
    by_both: dict = {}
    for c in items:
        by_kind.setdefault(c.kind, []).append(c)
        by_axes.setdefault(c.mesh_axes, []).append(c)
        by_both.setdefault((c.kind, c.mesh_axes, c.network), []).append(c)
    multislice = any(c.network is not None for c in items)
    dcn = sum(c.executed_bytes_per_device or 0 for c in items if c.network == "dcn") if multislice else None
    return CollectiveSummary(
        total=_totals(None, None, items),
        by_kind=tuple(_totals(k, None, by_kind[k]) for k in sorted(by_kind)),
        by_mesh_axes=tuple(_totals(None, a, by_axes[a]) for a in sorted(by_axes, key=_axes_key)),
        by_kind_and_mesh_axes=tuple(
            dataclasses.replace(_totals(k, a, by_both[(k, a, n)]), network=n)
            for k, a, n in sorted(by_both, key=lambda kan: (kan[0], _axes_key(kan[1]), kan[2] or ""))
        ),
        dcn_bytes_per_step=dcn,
    )


# --------------------------------------------------------------------------------------------
# Which collectives carry data from an entry parameter

_Taint = object  # True (whole value) or frozenset of top-level tuple indices


def _merge(a, b):
    if not a:
        return b or None
    if not b:
        return a
    if a is True or b is True:
        return True
    return a | b


_VALUE_OPS = frozenset(
    {
        "copy", "bitcast", "convert", "bitcast-convert", "reshape", "transpose", "broadcast",
        "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "reverse", "gather",
        "reduce-precision", "optimization-barrier", "copy-start", "copy-done", "async-start",
        "async-update", "async-done", "domain", "add-dependency",
    }
)  # fmt: skip
"""Opcodes whose result carries their operands' values, rearranged or re-typed, not combined."""


_CONTRACTIONS = frozenset({"dot", "convolution"})


def feeding_parameters(module: HloModule, collectives: Sequence[Collective]) -> dict[tuple[str, str], frozenset[int]]:
    """Per collective (``(computation, name)``), the entry parameter numbers its operands are computed
    from: what ties a collective to the op it belongs to when several ops share one source line and
    op name (``dense(x, w)`` called for ``wq``, ``wk`` and ``wv``).

    Data flow is followed backward from the collective's operands through every op, into the
    callers of fusions and called computations (a called computation's ``parameter(i)`` is its
    caller's operand ``i``; only where the computation has one caller), and through at most one
    contraction (a ``dot``/``convolution``, or a fusion holding one): a partial result's
    all-reduce reaches the dot's operands, not the layers before them. A parameter of the entry
    computation ends a path. An empty set where nothing is found.
    """
    callers = _callers(module)
    contracts: dict[str, bool] = {}

    def contracting(ins: HloInstruction) -> bool:
        if ins.opcode in _CONTRACTIONS:
            return True
        if ins.opcode != "fusion":
            return False
        for name in ins.called_computations:
            if name not in contracts:
                fused = module.computation(name)
                contracts[name] = fused is not None and any(i.opcode in _CONTRACTIONS for i in fused.instructions)
            if contracts[name]:
                return True
        return False

    out: dict[tuple[str, str], frozenset[int]] = {}
    for c in collectives:
        comp = module.computation(c.computation)
        ins = comp.instruction(c.name) if comp is not None else None
        if ins is None:
            out[(c.computation, c.name)] = frozenset()
            continue
        found: set[int] = set()
        seen: set[tuple[str, str, int]] = set()
        stack = [(comp, name, 0) for name in ins.operands]
        while stack and len(seen) < 20_000:
            at, name, passed = stack.pop()
            if (at.name, name, passed) in seen:
                continue
            seen.add((at.name, name, passed))
            x = at.instruction(name)
            if x is None:
                continue
            if x.opcode == "parameter":
                num = x.parameter_number
                sites = callers.get(at.name, ())
                if at.name == module.entry_name and num is not None:
                    found.add(num)
                elif num is not None and len(sites) == 1 and num < len(sites[0][1].operands):
                    stack.append((sites[0][0], sites[0][1].operands[num], passed))
                continue
            if contracting(x):
                if passed:
                    continue
                passed = 1
            stack.extend((at, o, passed) for o in x.operands)
        out[(c.computation, c.name)] = frozenset(found)
    return out


def collectives_from_parameter(
    module: HloModule,
    collectives: Sequence[Collective],
    parameter_number: int,
    *,
    through_compute: bool = False,
) -> tuple[Collective, ...]:
    """The collectives among ``collectives`` that carry entry parameter ``parameter_number`` —
    the answer to "why is ``wq`` gathered?".

    Data flow is followed forward from ``parameter(N)`` of the entry into and out of fusions,
    calls, async wrappers, conditional branches and while loops (loop state tracked per tuple
    element, iterated to a fixpoint); tuple / get-tuple-element are followed element-wise.
    Control dependencies (a loop's condition, a branch index) are not data flow.

    With ``through_compute=False`` (default) the flow passes only through ops that keep the
    parameter's values — layout, dtype and shape changes, slicing, concatenation, tuple, loop
    and call plumbing, and collectives themselves (:data:`_VALUE_OPS`) — so the answer is the
    collectives that move the parameter itself (FSDP gathers of ``wq``), not every collective
    downstream of it. With ``through_compute=True`` it passes through every op: all collectives
    whose operands depend on the parameter at all (in a train step, usually most of them). Map a JAX argument to its parameter number with
    :meth:`HloModule.entry_parameters` (``metadata.op_name`` is the argument's key path);
    unused arguments have no parameter.

    Returns:
      The matching records in the order of ``collectives``; () when the parameter does not
      exist.
    """
    entry = module.entry
    if entry is None:
        return ()
    hits: set[tuple[str, str]] = set()
    memo: dict = {}

    def analyze(comp: HloComputation, params: tuple, depth: int):
        key = (comp.name, params)
        if key in memo:
            return memo[key]
        memo[key] = None  # recursion guard
        pmap = dict(params)
        taint: dict[str, object] = {}
        for ins in comp.instructions:
            op = ins.opcode
            ops = [taint.get(o) for o in ins.operands]
            t = None
            if op == "parameter":
                t = pmap.get(ins.parameter_number)
            elif op == "get-tuple-element":
                src = ops[0] if ops else None
                idx = parse_int_list(ins.attributes.get("index"))
                if src is True or (src and idx and idx[0] in src):
                    t = True
            elif op == "tuple":
                parts = frozenset(k for k, v in enumerate(ops) if v)
                t = parts or None
            elif op == "while" and depth < 64:
                t = ops[0] if ops else None
                body = module.computation(ins.attributes.get("body", "").lstrip("%"))
                cond = module.computation(ins.attributes.get("condition", "").lstrip("%"))
                for _ in range(1000):
                    if body is None or not t:
                        break
                    root = analyze(body, ((0, t),), depth + 1)
                    new = _merge(t, root)
                    if new == t:
                        break
                    t = new
                if cond is not None and t:
                    analyze(cond, ((0, t),), depth + 1)
            elif op == "conditional" and depth < 64:
                branches = _callee_names(
                    ins.attributes.get("branch_computations")
                    or ",".join(
                        filter(None, (ins.attributes.get("true_computation"), ins.attributes.get("false_computation")))
                    )
                )
                for k, bname in enumerate(branches):
                    b = module.computation(bname)
                    arg = ops[k + 1] if k + 1 < len(ops) else None
                    if b is not None and arg:
                        t = _merge(t, analyze(b, ((0, arg),), depth + 1))
            else:
                callees = [c for a, c in _call_edges(ins) if a in ("calls", "called_computations")]
                root_t = None
                if callees and depth < 64 and any(ops):
                    for cname in callees:
                        callee = module.computation(cname)
                        if callee is None:
                            continue
                        args = tuple((k, v) for k, v in enumerate(ops) if v)
                        root_t = _merge(root_t, analyze(callee, args, depth + 1))
                if any(ops):
                    if op in ("fusion", "call") and callees:
                        t = root_t
                    elif through_compute or op in _VALUE_OPS or op in _KINDS or op in _START or op in _DONE:
                        t = True
                if (op in _KINDS or op in _START) and any(ops):
                    hits.add((comp.name, ins.name))
            if t:
                taint[ins.name] = t
        root = comp.root
        result = taint.get(root.name) if root is not None else None
        memo[key] = result
        return result

    if not any(p.parameter_number == parameter_number for p in entry.parameters()):
        return ()
    analyze(entry, ((parameter_number, True),), 0)
    return tuple(c for c in collectives if (c.computation, c.name) in hits or any(piece in hits for piece in c.merged))


def while_loops(module: HloModule) -> tuple[tuple[str, int | None], ...]:
    """Every ``while`` instruction of the module with its trip count (None when unknown), in text order.

    Cost analysis counts a loop body once whatever its trip count; callers use this to say so.
    """
    return tuple((ins.name, _trip_count(module, comp, ins))
                 for comp in module.computations for ins in comp.instructions if ins.opcode == "while")


_STAGETOOL_DIR = str(Path(__file__).resolve().parents[1]) + "/"


def frames_by_op_name(module: HloModule, ins: HloInstruction) -> tuple[SourceFrame, ...]:
    """The program frames of ``ins`` (:func:`program_frames` of its own source); where XLA kept its
    op name but not its source (XLA:TPU's ``…/ragged_dot_general/ragged-dot-none`` kernel), those of
    another instruction JAX gave the same op, or the op it was made from (the op name with trailing
    components dropped, never below two: ``jit(f)/ragged_dot_general``); () when none has one."""
    own = program_frames(module.source_stack(ins))
    md = ins.metadata
    if own or md is None or not md.op_name:
        return own
    index = module._op_frames  # op name -> frames, filled once per module
    if not index:
        for comp in module.computations:
            for other in comp.instructions:
                omd = other.metadata
                if omd is not None and omd.op_name and omd.stack_frame_id is not None and omd.op_name not in index:
                    chain = program_frames(module.source_stack(other))
                    if chain:
                        index[omd.op_name] = chain
    parts = md.op_name.split("/")
    for n in range(len(parts), 1, -1):
        found = index.get("/".join(parts[:n]))
        if found:
            return found
    return ()


def program_frames(chain: Sequence[SourceFrame]) -> tuple[SourceFrame, ...]:
    """A source chain (innermost first) cut at the first frame in stagetool's own package: the frames
    after it are the call path into stagetool, which differs between a serial run, a ``--jobs``
    worker and the run that filled the facts cache, while the program does not."""
    out = []
    for frame in chain:
        if frame.file.startswith(_STAGETOOL_DIR):
            break
        out.append(frame)
    return tuple(out)
