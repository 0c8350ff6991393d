"""What staging hands analysis: frozen records with no JAX object inside.

Staging (:mod:`stagetool.staging`) reads everything the analysis needs from JAX's stage objects
(``jax.stages.Traced``, ``Lowered``, ``Compiled``) once and hands it on as these records: a
:class:`StagedFunction` per function (module texts, the raw ``cost_analysis()`` and
``memory_analysis()`` results as :class:`BackendResult`, per-leaf :class:`LeafFacts`, the
:class:`PeakDump` of the compile) and Shardy's rerun propagation (:class:`Propagation`).
:mod:`stagetool.analysis` works from these alone, so it never calls JAX, and the records can be
cached (:mod:`stagetool.staging.cache`) or computed in another process. An import-linter contract
(``pyproject.toml``) keeps ``jax`` and ``jaxlib`` out of this module and of ``stagetool.analysis``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from stagetool.core.sharding import Sharding
from stagetool.hlo.buffers import BufferAssignment
from stagetool.hlo.parser import SourceFrame

if TYPE_CHECKING:
    from stagetool.hlo.parser import HloModule


@dataclasses.dataclass(frozen=True)
class StageTimings:
    """Wall-clock seconds of each stage; None for a stage that did not run."""

    trace_s: float | None = None
    lower_s: float | None = None
    compile_s: float | None = None


@dataclasses.dataclass(frozen=True)
class PeakDump:
    """XLA's buffer live-range dump of the compile (``xla_dump_to``), for the peak-buffer analysis.

    Attributes:
      live_range_text: the ``*-live-range.txt`` file's text, or None when XLA wrote none.
      module_text: the optimised module the dump describes (``Compiled.as_text()``).
      compile_seconds: wall time of the compile that wrote the dump.
      reason: why there is no live-range text (None when there is).
      buffers: the buffer assignment of the same compile (which allocation and offset each HLO
        value occupies), read from the dump's ``*.hlo.pb`` by :func:`stagetool.hlo.buffers.read_hlo_proto`
        (heap-simulator events left out); None when XLA wrote none or it could not be read.
      buffers_reason: why ``buffers`` is None (None when it is set).
      space_names: ``(color, name)`` of the memory spaces XLA's ``*-memory-usage-report.txt``
        names (:func:`stagetool.hlo.buffers.parse_memory_space_names`); () when it wrote none.
    """

    live_range_text: str | None
    module_text: str
    compile_seconds: float | None
    reason: str | None = None
    buffers: BufferAssignment | None = None
    buffers_reason: str | None = None
    space_names: tuple[tuple[int, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class ValueSharding:
    """The sharding Shardy gave one value after propagation.

    Attributes:
      dims: mesh axes per dimension, major first (``(("data",), ())``); a sub-axis is written as
        Shardy prints it, ``model:(1)2``.
      origins: ``(axis, origin)`` pairs, sorted by axis: where each mesh axis of this value came
        from, as Shardy names it — ``self`` (written on this value), ``input: N`` (entry argument N
        of the lowered module), ``output: N`` (entry result N), ``constraint_K`` (the sharding
        constraint whose :attr:`PropagatedOp.origin_name` is that), or another Shardy name.
    """

    dims: tuple[tuple[str, ...], ...]
    origins: tuple[tuple[str, str], ...] = ()

    def axes(self) -> frozenset[str]:
        """Every mesh axis (sub-axes by their axis' name) this value is sharded over."""
        return frozenset(a.split(":")[0] for d in self.dims for a in d)

    def origin(self, axis: str) -> str | None:
        """Where ``axis`` of this value came from, or None when not recorded."""
        for a, o in self.origins:
            if a == axis:
                return o
        return None


@dataclasses.dataclass(frozen=True)
class ShardingRule:
    """Shardy's op sharding rule: each operand and result dimension as a factor.

    For ``dot_general`` with contracting dims ``[1] x [0]``: operands ``((i, k), (k, j))``, results
    ``((i, j),)``, reductions ``(k,)``. A factor sharded on an axis in one tensor and not in another
    is what makes the partitioner move data.

    Attributes:
      operands / results: factor names per dimension (a dimension made of several factors is the
        tuple of them joined with ``*``).
      reductions: factors summed over (contracting dims, reduced dims).
      sizes: ``(factor, size)`` pairs.
    """

    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]
    reductions: tuple[str, ...] = ()
    sizes: tuple[tuple[str, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand of an op.

    Attributes:
      sharding: its sharding (the producing value's), or None when Shardy gave it none (replicated).
      producer: index in :attr:`Propagation.ops` of the op that produced it, or None.
      input: the entry argument number it is (directly, or through a loop's or named computation's
        block argument), else None.
    """

    sharding: ValueSharding | None
    producer: int | None = None
    input: int | None = None


@dataclasses.dataclass(frozen=True)
class PropagatedOp:
    """One op of the propagated module, in walk order (producers before users within a block).

    Attributes:
      index: position in :attr:`Propagation.ops`.
      name: the MLIR op name (``stablehlo.dot_general``, ``sdy.sharding_constraint``).
      op_name: JAX's name for it from the location (``jit(f)/dot_general``), or None.
      frames: the source frames of its location, innermost first.
      operands: its operands.
      results: its results' shardings (None: no sharding, replicated).
      rule: its factor rule, or None when Shardy has none for this op.
      origin_name: for a sharding constraint, the name origins refer to it by (``constraint_0``).
      users: indices of the ops that use its results.
    """

    index: int
    name: str
    op_name: str | None
    frames: tuple[SourceFrame, ...]
    operands: tuple[Operand, ...]
    results: tuple[ValueSharding | None, ...]
    rule: ShardingRule | None = None
    origin_name: str | None = None
    users: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Propagation:
    """What Shardy's propagation, rerun with debug origins, says about one lowered module.

    Attributes:
      inputs: the entry arguments' final shardings, in the lowered module's argument order (None:
        no sharding, replicated); ``input: N`` origins index this.
      input_names: each entry argument's name from its location (JAX writes the key path,
        ``params['layers']['wq']``), or None.
      outputs: the entry results' final shardings.
      ops: every op of the entry function, nested regions included (named computations hold the
        nested ``jax.jit`` calls' bodies).
      mesh_axes: ``(name, size)`` of the module's mesh.
    """

    inputs: tuple[ValueSharding | None, ...]
    input_names: tuple[str | None, ...]
    outputs: tuple[ValueSharding | None, ...]
    ops: tuple[PropagatedOp, ...]
    mesh_axes: tuple[tuple[str, int], ...] = ()

    def constraint(self, origin: str) -> PropagatedOp | None:
        """The sharding constraint an origin such as ``constraint_0`` names, or None."""
        for op in self.ops:
            if op.origin_name == origin:
                return op
        return None


@dataclasses.dataclass(frozen=True)
class LeafFacts:
    """One input or output leaf of the staged program.

    Attributes:
      path: key path, ``params/layers/wq`` (inputs start with the argument name, outputs with ``out``).
      shape: global shape.
      dtype: numpy dtype name or PRNG key dtype (``key<fry>``).
      declared: what the spec asks for (``auto``/``unspecified`` kinds, or mesh axes per dimension).
      compiled: the compiled program's sharding as mesh axes per dimension (padded to the rank;
        kind ``other`` with JAX's text when no PartitionSpec over the mesh is equivalent), from
        ``Compiled.input_shardings`` / ``output_shardings``; None for an input the compiler pruned.
      shard_shape: one device's shard shape (``jax.sharding.Sharding.shard_shape``); None if pruned.
      donated: donation was requested (the spec, or the jit's own ``donate_argnums`` as
        ``Compiled.args_info`` reports it).
      local_shape: under ``avals: local``, the host-local shape the spec gave.
      source: ``file:line:col`` of the spec node that set the shape or sharding.
      parameter: the entry computation parameter number of an input (None for outputs and pruned inputs).
      padded_bytes_per_device: bytes of one shard in its tiled device layout (TPU), from
        ``Compiled.input_formats`` / ``output_formats``; None without tiling.
      sharding_source: where the declared sharding comes from: ``spec``, ``rule``, ``init`` (what
        the init gives the leaf when run), ``model`` (Flax metadata), ``object`` (a ``{ref:}``
        leaf: the sharding the object's array carries), ``unknown`` (nothing says:
        replicated assumed), ``compiler`` (the partitioner chooses), or None (an input replicated
        by default).
      ref_write_back: an output that is the new value of a ``jax.Ref`` argument (JAX's extra
        executable output, one per Ref argument kept, aliased to the Ref's buffer): its path, shape and
        declared sharding are the Ref input's (:mod:`stagetool.staging.ref_outputs`).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    declared: Sharding
    compiled: Sharding | None
    shard_shape: tuple[int, ...] | None
    donated: bool = False
    local_shape: tuple[int, ...] | None = None
    source: str | None = None
    parameter: int | None = None
    padded_bytes_per_device: int | None = None
    sharding_source: str | None = None
    ref_write_back: bool = False


@dataclasses.dataclass(frozen=True)
class BackendResult:
    """What a backend analysis API returned, or why there is nothing.

    Attributes:
      values: the raw result: ``cost_analysis()``'s ``{key: float}`` dict (or list of dicts), or
        ``memory_analysis()``'s fields as ``{attribute: int}``; None when the API returned None.
      error: ``"<Exception>: message"`` when the API raised, else None.
    """

    values: dict[str, int | float] | list[dict[str, int | float]] | None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """Where each device of the mesh sits, for timing its collectives (no JAX object inside).

    Attributes:
      platform: ``tpu``, ``gpu`` or ``cpu`` (the devices staged on; ``cpu`` for the CPU mesh).
      mesh_names / mesh_sizes: the user's mesh axes, in mesh order.
      device_coords: per mesh position (HLO partition id), the chip's torus coordinates
        (``jax.Device.coords`` of a TPU device); None where the devices have none (GPU, CPU).
      torus_shape: the TPU slice's chip grid (``(2, 4)`` for ``v5e:2x4``), or None.
      process_of_device: per mesh position, its host (process) index.
      slices: TPU slices joined over DCN (``--slices``); 1 otherwise.
      cores_per_chip: devices per chip (TPU v2/v3 expose two), 1 elsewhere.
    """

    platform: str
    mesh_names: tuple[str, ...]
    mesh_sizes: tuple[int, ...]
    device_coords: tuple[tuple[int, ...], ...] | None = None
    torus_shape: tuple[int, ...] | None = None
    process_of_device: tuple[int, ...] = ()
    slices: int = 1
    cores_per_chip: int = 1


@dataclasses.dataclass(frozen=True)
class StagedFunction:
    """Everything analysis reads about one staged function (see the module docstring).

    Attributes:
      name / target: the spec's function name and target.
      timings: seconds per stage.
      warnings: what JAX (or the user's code) warned while staging, deduplicated.
      host_transfers: ``file:line`` of each place the traced program moves a value to host memory
        (``device_put`` to ``pinned_host``/``unpinned_host``, a ``jax.checkpoint`` offload policy),
        in program order, each line once: what XLA:CPU ignores (:func:`host_transfers`).
      grouped_matmuls: ``file:line`` of each ``ragged_dot`` of the traced program, in program order,
        each line once: XLA:CPU runs it as dense dots over every group, with other collectives than
        XLA:TPU/GPU's grouped-matmul kernels (:func:`stagetool.staging.gather.grouped_matmuls`).
      uneven_constraints: sharding constraints on a dimension the mesh axes do not divide (XLA pads
        it and may gather), each as one sentence naming the user's line.
      mesh_notes: the other meshes of the staged devices the traced program names (a ``shard_map`` on
        a flattened mesh), one sentence each (:func:`stagetool.staging.foreign_mesh.other_meshes`);
        and the ``jax.Ref``s the function closes over, inputs that are no argument (one sentence).
      lowered_text: the lowered module in ``lowered_dialect`` (``Lowered.as_text``), when asked for.
      lowered_dialect: ``stablehlo`` or ``hlo``.
      stablehlo_text: the lowered StableHLO (``Lowered.as_text()``), for the cost checks; None when
        not read.
      compiled_text: the compiled, partitioned module (``Compiled.as_text()``); None before compile.
      whole_program_cost: ``Lowered.cost_analysis()``.
      per_device_cost: ``Compiled.cost_analysis()``.
      memory: ``Compiled.memory_analysis()``.
      inputs / outputs: per-leaf facts, in JAX's flattening order; None before compile.
      peak: the live-range dump, when the peak was asked for.
      propagation: Shardy's propagation rerun with sharding origins
        (:func:`stagetool.staging.shardy.propagate_lowered`), when collectives are explained.
      propagation_error: why there is no ``propagation`` (GSPMD lowering, a pass that failed).
    """

    name: str
    target: str
    timings: StageTimings
    warnings: tuple[str, ...] = ()
    uneven_constraints: tuple[str, ...] = ()
    mesh_notes: tuple[str, ...] = ()
    host_transfers: tuple[str, ...] = ()
    grouped_matmuls: tuple[str, ...] = ()
    lowered_text: str | None = None
    lowered_dialect: str = "stablehlo"
    stablehlo_text: str | None = None
    compiled_text: str | None = None
    whole_program_cost: BackendResult | None = None
    per_device_cost: BackendResult | None = None
    memory: BackendResult | None = None
    inputs: tuple[LeafFacts, ...] | None = None
    outputs: tuple[LeafFacts, ...] | None = None
    peak: PeakDump | None = None
    propagation: Propagation | None = None
    propagation_error: str | None = None

    @functools.cached_property
    def module(self) -> HloModule | None:
        """The compiled module parsed once (:func:`stagetool.hlo.parser.parse_hlo_module`)."""
        if self.compiled_text is None:
            return None
        from stagetool.hlo.parser import parse_hlo_module

        return parse_hlo_module(self.compiled_text)
