"""Per-leaf shardings: what the spec declared and what the compiled program uses.

From the leaf facts staging read (:class:`~stagetool.facts.LeafFacts`: compiled shardings
from ``Compiled.input_shardings`` / ``output_shardings``, shard shapes from
``jax.sharding.Sharding.shard_shape``); bytes as XLA stores the dtype (:mod:`stagetool.core.dtypes`).
"""

from __future__ import annotations

import dataclasses

from stagetool.core.dtypes import array_bytes
from stagetool.core.sharding import Sharding
from stagetool.facts import LeafFacts


@dataclasses.dataclass(frozen=True)
class LeafReport:
    """The sharding of one input or output leaf.

    Attributes:
      path: key path, ``params/layers/wq`` (inputs start with the argument name, outputs with ``out``).
      shape: global shape.
      dtype: numpy dtype name or PRNG key dtype.
      declared: the sharding the spec asks for: mesh axes per dimension (padded to the rank), or
        kind ``auto`` (the partitioner chooses) or ``unspecified`` (outputs without out_shardings).
        Printed (and written to JSON) as JAX prints a PartitionSpec, ``P('data', None)``.
      compiled: the sharding the compiled program uses (``Compiled.input_shardings`` /
        ``output_shardings``) as mesh axes per dimension; None for an input the compiler pruned.
      chosen_by: who decided a sharding the spec left open: ``"the SPMD partitioner"``, or on a
        mesh with explicit axes ``"JAX's sharding types"``; None when the spec declared it.
      chosen_by_partitioner: the compiled sharding was the SPMD partitioner's choice (``auto`` or
        unspecified in the spec).
      shard_shape: the per-device shard's shape (``sharding.shard_shape(shape)``); None if unused.
      bytes_global: bytes of the whole array as XLA stores it: elements × storage bits / 8
        (sub-byte dtypes packed; :func:`stagetool.core.dtypes.array_bytes`).
      bytes_per_device: bytes of one device's shard, likewise; None if unused.
      unused: the compiler pruned this input (the function does not use it).
      donated: donation was requested for this input.
      local_shape: under ``avals: local``, the host-local shape the spec gave; else None.
      source: ``file:line:col`` of the spec node that set the shape or sharding, or None.
      parameter: the entry computation parameter number of this input in the compiled module;
        None for outputs and unused inputs.
      padded_bytes_per_device: bytes of one device's shard in its tiled device layout (TPU
        ``T(8,128)`` tiles pad the minor dimensions), from ``compiled.input_formats`` /
        ``output_formats``; None where the layout has no tiling (CPU) or is unknown.
      sharding_source: where the sharding comes from: ``"spec"`` (written in the spec, or an
        output's ``out_shardings``), ``"rule"`` (an ``init``'s rules), ``"init"`` (what the ``init``
        gives the leaf when run: a nested jit's out_shardings, a device_put, a sharding constraint),
        ``"model"`` (the model's own annotations), ``"object"`` (a ``{ref:}`` leaf: the sharding
        the object's array carries), ``"unknown"`` (nothing says: staged replicated),
        ``"compiler"`` (the partitioner chose it:
        ``auto``, or an output without out_shardings), or None (an input replicated by default).
      ref_write_back: an output that is the new value of a ``jax.Ref`` argument the function writes
        in place (named by the Ref's input path; its buffer is the Ref's, aliased).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    declared: Sharding
    compiled: Sharding | None
    chosen_by_partitioner: bool
    shard_shape: tuple[int, ...] | None
    bytes_global: int
    bytes_per_device: int | None
    unused: bool = False
    donated: bool = False
    local_shape: tuple[int, ...] | None = None
    source: str | None = None
    parameter: int | None = None
    padded_bytes_per_device: int | None = None
    chosen_by: str | None = None
    sharding_source: str | None = None
    ref_write_back: bool = False


def _bytes(shape: tuple[int, ...], dtype: str) -> int:
    n = array_bytes(shape, dtype)
    if n is None:
        raise ValueError(f"no storage size known for dtype {dtype!r}")
    return n


def leaf_report(facts: LeafFacts, *, output: bool = False, explicit: bool = False) -> LeafReport:
    """The :class:`LeafReport` of one leaf: shardings padded to the rank, bytes per device.

    ``chosen_by_partitioner``: an input declared ``auto``; an output declared ``auto`` or left
    ``unspecified`` — unless the mesh's axes are ``explicit``: then JAX's sharding-in-types rules
    decided it while tracing, not the SPMD partitioner (``chosen_by`` says which).
    """
    rank = len(facts.shape)
    undeclared = facts.declared.kind in (("auto", "unspecified") if output else ("auto",))
    chosen = undeclared and not explicit
    per_device = _bytes(facts.shard_shape, facts.dtype) if facts.shard_shape is not None else None
    return LeafReport(facts.path, facts.shape, facts.dtype, facts.declared.padded(rank), facts.compiled, chosen,
                      facts.shard_shape, _bytes(facts.shape, facts.dtype), per_device,
                      unused=not output and facts.compiled is None, donated=facts.donated,
                      local_shape=facts.local_shape, source=facts.source, parameter=facts.parameter,
                      padded_bytes_per_device=facts.padded_bytes_per_device,
                      chosen_by=("JAX's sharding types" if explicit else "the SPMD partitioner") if undeclared else None,
                      sharding_source=facts.sharding_source, ref_write_back=facts.ref_write_back)


def input_leaves(facts: tuple[LeafFacts, ...], *, explicit: bool = False) -> tuple[LeafReport, ...]:
    """The input leaves' reports, in JAX's flattening order (``explicit``: the mesh's axes are explicit)."""
    return tuple(leaf_report(f, explicit=explicit) for f in facts)


def output_leaves(facts: tuple[LeafFacts, ...], *, explicit: bool = False) -> tuple[LeafReport, ...]:
    """The output leaves' reports (paths start with ``out``)."""
    return tuple(leaf_report(f, output=True, explicit=explicit) for f in facts)


REFUSED_INPUTS_NOTE = ("the inputs' shardings are the declared ones (the jit's in_shardings, which the compile "
                       "keeps): XLA refused the compile, so there is no compiled program to read them from")
"""The note beside the input leaves of a compile XLA refused (:func:`declared_input_leaves`)."""


def declared_input_leaves(leaves: tuple, axis_size: dict[str, int], *,
                          explicit: bool = False) -> tuple[LeafReport, ...]:
    """The input leaves of a compile XLA refused (out of memory), from their declared shardings:
    ``leaves`` are :class:`stagetool.inputs.records.InputLeaf` (``path``, ``shape``, ``dtype``,
    ``declared``, ``donated``, ``source``, ``sharding_source``). A leaf declared with a PartitionSpec
    (or replicated) is compiled with it, so that is its ``compiled``; an ``auto`` leaf's choice is
    unknown (kind ``other``, no shard shape or bytes per device). Bytes per device: the shard
    shape's (each sharded dimension divided by its axes' sizes, rounded up), as XLA stores the dtype."""
    out = []
    for x in leaves:
        rank = len(x.shape)
        if x.declared.kind == "auto":
            compiled, shard = Sharding("other", text="unknown: the compile was refused"), None
        else:
            compiled = x.declared.padded(rank) if x.declared.kind == "spec" else Sharding("spec", (None,) * rank)
            shard = list(x.shape)
            for i, d in enumerate(compiled.dims[:rank]):
                for a in () if d is None else ((d,) if isinstance(d, str) else d):
                    shard[i] = -(-shard[i] // axis_size.get(a, 1))
            shard = tuple(shard)
        out.append(leaf_report(LeafFacts(x.path, tuple(x.shape), x.dtype, x.declared, compiled, shard,
                                         donated=x.donated, source=x.source, sharding_source=x.sharding_source),
                               explicit=explicit))
    return tuple(out)
