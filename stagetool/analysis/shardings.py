"""Per-leaf shardings: what the spec declared and what the compiled program uses.

Compiled shardings come from ``jax.stages.Compiled.input_shardings`` / ``output_shardings``; shard
shapes from ``Sharding.shard_shape``; bytes from elements × ``dtype.itemsize``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from stagetool.core.sharding import Sharding, format_dims
from stagetool.lowering.avals import AbstractInputs, keypath_str


@dataclasses.dataclass(frozen=True)
class LeafReport:
    """The sharding of one input or output leaf.

    Attributes:
      path: key path, ``params/layers/wq`` (inputs start with the argument name, outputs with ``out``).
      shape: global shape.
      dtype: numpy dtype name or PRNG key dtype.
      declared: the sharding the spec asks for, as JAX prints a PartitionSpec (``P('data', None)``),
        or ``auto`` (the partitioner chooses) or ``unspecified`` (outputs without out_shardings).
      compiled: the sharding the compiled program uses (``compiled.input_shardings`` /
        ``output_shardings``), in the same form; None for an input the compiler pruned as unused.
      chosen_by_partitioner: the compiled sharding was the SPMD partitioner's choice (``auto`` or
        unspecified in the spec).
      shard_shape: the per-device shard's shape (``sharding.shard_shape(shape)``); None if unused.
      bytes_global: bytes of the whole array: elements × dtype size.
      bytes_per_device: bytes of one device's shard: shard elements × dtype size; None if unused.
      unused: the compiler pruned this input (the function does not use it).
      donated: donation was requested for this input.
      local_shape: under ``avals: local``, the host-local shape the spec gave; else None.
      source: ``file:line:col`` of the spec node that set the shape or sharding, or None.
      parameter: the entry computation parameter number of this input in the compiled module;
        None for outputs and unused inputs.
      padded_bytes_per_device: bytes of one device's shard in its tiled device layout (TPU
        ``T(8,128)`` tiles pad the minor dimensions), from ``compiled.input_formats`` /
        ``output_formats``; None where the layout has no tiling (CPU) or is unknown.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    declared: str
    compiled: str | None
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


def sharding_text(sharding: Any, rank: int) -> str:
    """A ``jax.sharding.Sharding`` as JAX prints a PartitionSpec, padded with None to ``rank``.

    ``NamedSharding`` → ``P('data', None)``; a single-device sharding → ``P()`` padded (replicated);
    any other sharding → its ``repr``.
    """
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        dims = [d if (d is None or isinstance(d, str)) else tuple(d) for d in tuple(spec)]
        dims += [None] * (rank - len(dims))
        return format_dims(tuple(dims))
    if type(sharding).__name__ == "SingleDeviceSharding":
        return format_dims((None,) * rank)
    return repr(sharding)


def declared_text(declared: Sharding, rank: int) -> str:
    """The spec's sharding in the same form as :func:`sharding_text` (``auto``/``unspecified`` as is)."""
    if declared.kind != "spec":
        return declared.kind
    return format_dims(tuple(declared.dims) + (None,) * (rank - len(declared.dims)))


def _itemsize(dtype: Any) -> int:
    return int(getattr(dtype, "itemsize", 0) or 0)


def _formats(formats: Any, n: int) -> list[Any]:
    """Flat ``jax.stages.Compiled.input_formats``/``output_formats`` (None where unavailable)."""
    import jax

    try:
        flat = jax.tree_util.tree_leaves(formats, is_leaf=lambda x: x is None or hasattr(x, "layout"))
    except Exception:  # noqa: BLE001 - layouts are optional facts
        return [None] * n
    return flat if len(flat) == n else [None] * n


def _padded(shard: tuple[int, ...] | None, dtype: Any, fmt: Any) -> int | None:
    """Tiled bytes of a shard when its layout is tiled (TPU), else None."""
    layout = getattr(fmt, "layout", None)
    if shard is None or layout is None or not getattr(layout, "tiling", None):
        return None
    from stagetool.lowering.tpu_layout import shard_bytes

    return shard_bytes(shard, dtype, layout).padded_bytes


def input_leaves(inputs: AbstractInputs, compiled: Any) -> tuple[LeafReport, ...]:
    """One :class:`LeafReport` per input leaf, in JAX's flattening order.

    An input whose compiled sharding is None was pruned by the compiler (the function does not use
    it): it is reported as unused, with no compiled sharding and no parameter number. The others
    are numbered in order as the compiled module's entry parameters. ``donated`` is true when the
    spec donates the leaf or ``compiled.args_info`` says JAX donates it (a target jitted with its own
    ``donate_argnums``).
    """
    import jax

    flat = jax.tree_util.tree_leaves(compiled.input_shardings, is_leaf=lambda x: x is None)
    if len(flat) != len(inputs.leaves):
        raise AssertionError(f"{len(flat)} compiled input shardings for {len(inputs.leaves)} input leaves")
    structs = [x for x in jax.tree_util.tree_leaves((inputs.args, {k: v for k, v in inputs.kwargs.items()
                                                                   if k not in inputs.static_argnames}))]
    # Donation as JAX will apply it (``Compiled.args_info``): a target that is already jitted with its
    # own donate_argnums donates although the spec says nothing.
    infos = jax.tree_util.tree_leaves(getattr(compiled, "args_info", None),
                                      is_leaf=lambda x: hasattr(x, "donated"))
    if len(infos) != len(inputs.leaves):
        infos = [None] * len(inputs.leaves)
    out = []
    parameter = 0
    formats = _formats(compiled.input_formats, len(flat))
    for leaf, sharding, struct, info, fmt in zip(inputs.leaves, flat, structs, infos, formats, strict=True):
        donated = leaf.donated or bool(getattr(info, "donated", False))
        rank = len(leaf.shape)
        size = _itemsize(struct.dtype)
        total = math.prod(leaf.shape) * size
        if sharding is None:
            out.append(LeafReport(leaf.path, leaf.shape, leaf.dtype, declared_text(leaf.declared, rank), None,
                                  leaf.declared.kind == "auto", None, total, None, unused=True,
                                  donated=donated, local_shape=leaf.local_shape, source=leaf.source))
            continue
        shard = tuple(sharding.shard_shape(leaf.shape))
        out.append(LeafReport(leaf.path, leaf.shape, leaf.dtype, declared_text(leaf.declared, rank),
                              sharding_text(sharding, rank), leaf.declared.kind == "auto", shard, total,
                              math.prod(shard) * size, donated=donated, local_shape=leaf.local_shape,
                              source=leaf.source, parameter=parameter,
                              padded_bytes_per_device=_padded(shard, struct.dtype, fmt)))
        parameter += 1
    return tuple(out)


def output_leaves(traced: Any, compiled: Any, declared_tree: Any) -> tuple[LeafReport, ...]:
    """One :class:`LeafReport` per output leaf (paths start with ``out``).

    ``declared_tree`` is the spec's ``out_shardings`` (None: every output is the compiler's choice).
    """
    import jax

    with_paths, _ = jax.tree_util.tree_flatten_with_path(traced.out_info)
    shardings = jax.tree_util.tree_leaves(compiled.output_shardings, is_leaf=lambda x: x is None)
    declared = _declared_outputs(declared_tree, len(with_paths), traced.out_info)
    formats = _formats(compiled.output_formats, len(shardings))
    out = []
    for (kp, info), sharding, decl, fmt in zip(with_paths, shardings, declared, formats, strict=True):
        shape = tuple(info.shape)
        rank = len(shape)
        size = _itemsize(info.dtype)
        shard = tuple(sharding.shard_shape(shape)) if sharding is not None else None
        out.append(LeafReport("out" + keypath_str(kp), shape, str(info.dtype),
                              declared_text(decl, rank) if decl is not None else "unspecified",
                              sharding_text(sharding, rank) if sharding is not None else None,
                              decl is None or decl.kind in ("auto", "unspecified"), shard,
                              math.prod(shape) * size, math.prod(shard) * size if shard is not None else None,
                              padded_bytes_per_device=_padded(shard, info.dtype, fmt)))
    return tuple(out)


def _declared_outputs(tree: Any, n: int, out_info: Any) -> list[Sharding | None]:
    """The spec's out_shardings broadcast over the output leaves (a single sharding covers all)."""
    import jax

    if tree is None:
        return [None] * n
    if isinstance(tree, Sharding):
        return [tree] * n
    try:
        # A prefix tree: each declared sharding covers the subtree of the output at its position.
        return jax.tree_util.tree_leaves(
            jax.tree_util.tree_map(lambda s, sub: [s] * len(jax.tree_util.tree_leaves(sub)), tree, out_info,
                                   is_leaf=lambda x: isinstance(x, Sharding) or x is None))
    except Exception:
        return [None] * n
