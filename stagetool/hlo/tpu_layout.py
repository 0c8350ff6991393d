"""Bytes a TPU array really occupies: tile padding of tiled XLA layouts.

TPU buffers carry *tiled* layouts, printed in HLO text as
``bf16[1024,4096]{1,0:T(8,128)(2,1)}`` and exposed by JAX as
``jax.stages.Compiled.input_formats`` / ``output_formats`` (``Format.layout`` is a
``jax.experimental.layout.Layout`` with ``major_to_minor``, ``tiling`` and
``sub_byte_element_size_in_bits``). A small array is padded up to whole tiles, so an
``f32[3,5]`` parameter on v5e takes 2048 bytes, not 60.

The rule (XLA "Tiled layout", https://openxla.org/xla/tiled_layout):

1. Put the dimensions in physical order, major to minor (the HLO ``{...}`` list is
   minor-to-major; ``Layout.major_to_minor`` is already major-to-minor).
2. Apply the tiles in order. A tile ``(t_1..t_k)`` acts on the ``k`` minor-most dimensions
   of the current shape (missing major dimensions count as size 1): each such dimension
   ``d_i`` becomes ``ceil(d_i / t_i)`` and the tile's own dimensions ``t_1..t_k`` are
   appended as new minor dimensions. The second tile (``(2,1)`` for bf16, ``(4,1)`` for
   8-bit types) therefore acts on the first tile's dimensions and pads them in turn.
3. Bytes = product of the final dimensions × element bits (``E(n)`` when given, for sub-byte
   types, else the dtype's width) / 8, rounded up.

Checked against ``compiled.memory_analysis().argument_size_in_bytes`` from libtpu 0.0.52
(jax 0.10.2) for f32, bf16, s8, pred, s4, f8, s16 on v4 and v5e, scalars
(``f32[]{:T(128)}`` = 512 bytes) and transposed layouts (``bf16[2,3,130]{2,0,1:T(2,128)(2,1)}``
= 3072 bytes); see tests/devices/test_topology.py.

Everything here is pure (strings and tuples in, integers out) except
:func:`shard_bytes`, which reads attributes of a JAX ``Format``/``Layout``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from stagetool.core.dtypes import TABLE, storage_bits

__all__ = [
    "HLO_DTYPE_BITS",
    "HloArrayLayout",
    "LeafBytes",
    "shard_bytes",
    "hlo_shape_bytes",
    "logical_bytes",
    "padded_bytes",
    "parse_hlo_shape",
]

HLO_DTYPE_BITS: dict[str, int] = {d.hlo: d.bits for d in TABLE}
"""Storage width in bits of each HLO element type (``pred`` is stored as one byte): the one table
of :mod:`stagetool.core.dtypes`."""

_SHAPE_RE = re.compile(r"^\s*([a-z][a-z0-9]*)\[([0-9,\s]*)\](?:\{([^{}]*)\})?\s*$")
_ATTR_RE = re.compile(r"([A-Z#]*)\(([^()]*)\)")


@dataclasses.dataclass(frozen=True)
class HloArrayLayout:
    """One array shape with its layout, as printed in HLO text.

    Attributes:
      dtype: HLO element type, e.g. ``"bf16"``.
      dims: logical dimension sizes (elements), e.g. ``(1024, 4096)``.
      minor_to_major: the layout's dimension order, minor first, e.g. ``(1, 0)``; ``None``
        when the text had no ``{...}`` layout.
      tiles: the tiles in order, e.g. ``((8, 128), (2, 1))``; empty when untiled.
      element_bits: ``E(n)`` when present (sub-byte types), else None.
      memory_space: ``S(n)`` when present, else None.
    """

    dtype: str
    dims: tuple[int, ...]
    minor_to_major: tuple[int, ...] | None = None
    tiles: tuple[tuple[int, ...], ...] = ()
    element_bits: int | None = None
    memory_space: int | None = None

    @property
    def bits_per_element(self) -> int:
        """Storage width in bits: ``E(n)`` if given, else the dtype's width."""
        if self.element_bits:
            return self.element_bits
        return HLO_DTYPE_BITS[self.dtype]

    @property
    def major_to_minor(self) -> tuple[int, ...]:
        """Dimension indices, major first (row-major when the text had no layout)."""
        if self.minor_to_major is None:
            return tuple(range(len(self.dims)))
        return tuple(reversed(self.minor_to_major))


@dataclasses.dataclass(frozen=True)
class LeafBytes:
    """Logical vs tile-padded size of one array (one shard, one device).

    Attributes:
      logical_bytes: elements × element width, what the shape alone implies.
      padded_bytes: bytes the tiled layout occupies on the device.
    """

    logical_bytes: int
    padded_bytes: int

    @property
    def padding_bytes(self) -> int:
        """``padded_bytes - logical_bytes`` (bytes lost to tile padding)."""
        return self.padded_bytes - self.logical_bytes


def parse_hlo_shape(text: str) -> HloArrayLayout:
    """Parse one HLO array shape such as ``bf16[1024,4096]{1,0:T(8,128)(2,1)S(1)}``.

    Layout attributes other than ``T``, ``E`` and ``S`` are ignored. Raises ``ValueError``
    for tuples, tokens, dynamic dimensions or text that is not an array shape, and for a
    dtype not in :data:`HLO_DTYPE_BITS`.
    """
    m = _SHAPE_RE.match(text)
    if not m:
        raise ValueError(f"not an HLO array shape: {text!r}")
    dtype, dims_text, layout_text = m.groups()
    if dtype not in HLO_DTYPE_BITS:
        raise ValueError(f"unknown HLO element type {dtype!r} in {text!r}")
    dims = tuple(int(d) for d in dims_text.split(",") if d.strip())
    if layout_text is None:
        return HloArrayLayout(dtype, dims)
    order_text, _, attrs_text = layout_text.partition(":")
    minor_to_major = tuple(int(d) for d in order_text.split(",") if d.strip())
    if sorted(minor_to_major) != list(range(len(dims))):
        raise ValueError(f"layout {{{order_text}}} is not a permutation of the {len(dims)} dims of {text!r}")
    tiles: list[tuple[int, ...]] = []
    element_bits = memory_space = None
    previous = ""
    for name, args in _ATTR_RE.findall(attrs_text):
        # Tiles print as T(8,128)(2,1): the bare "(...)" groups continue the tile list.
        name = previous if (name == "" and previous == "T") else name
        previous = name
        if name == "T":
            try:
                tiles.append(tuple(int(a) for a in args.split(",")))
            except ValueError:
                raise ValueError(f"unsupported tile T({args}) in {text!r}") from None
        elif name == "E":
            element_bits = int(args)
        elif name == "S":
            memory_space = int(args)
    return HloArrayLayout(dtype, dims, minor_to_major, tuple(tiles), element_bits, memory_space)


def _tiled_element_count(physical_dims: Sequence[int], tiles: Sequence[Sequence[int]]) -> int:
    shape = list(physical_dims)
    for tile in tiles:
        k = len(tile)
        if k > len(shape):
            shape = [1] * (k - len(shape)) + shape
        minor = shape[-k:]
        shape = shape[:-k] + [-(-d // t) for d, t in zip(minor, tile, strict=True)] + list(tile)
    return math.prod(shape)


def logical_bytes(dims: Sequence[int], bits_per_element: int) -> int:
    """Bytes of an unpadded array: ``prod(dims) * bits / 8``, rounded up."""
    return -(-math.prod(dims) * bits_per_element // 8)


def padded_bytes(dims: Sequence[int], bits_per_element: int, major_to_minor: Sequence[int],
                 tiles: Sequence[Sequence[int]]) -> int:
    """Bytes an array with a tiled layout occupies (the module docstring gives the rule).

    Args:
      dims: logical dimension sizes, in the array's own (logical) order.
      bits_per_element: storage width (``E(n)`` for sub-byte types).
      major_to_minor: physical order of the dims, major first.
      tiles: tiles in order, e.g. ``((8, 128), (2, 1))``; empty means untiled.
    """
    physical = [dims[i] for i in major_to_minor]
    return -(-_tiled_element_count(physical, tiles) * bits_per_element // 8)


def hlo_shape_bytes(text: str) -> LeafBytes:
    """Logical and padded bytes of one HLO array shape string (see :func:`parse_hlo_shape`)."""
    s = parse_hlo_shape(text)
    bits = s.bits_per_element
    return LeafBytes(logical_bytes(s.dims, bits), padded_bytes(s.dims, bits, s.major_to_minor, s.tiles))


def _dtype_bits(dtype) -> int:
    import numpy as np

    name = np.dtype(dtype).name
    bits = storage_bits(name)
    if bits is None:
        raise ValueError(f"no HLO element type for dtype {name!r}")
    return bits


def shard_bytes(shard_shape: Sequence[int], dtype, layout) -> LeafBytes:
    """Logical and padded bytes of one per-device shard from a JAX layout.

    Args:
      shard_shape: the shard's shape on one device, e.g.
        ``sharding.shard_shape(global_shape)``.
      dtype: a NumPy/JAX dtype.
      layout: ``compiled.input_formats[...][i].layout`` (a ``jax.experimental.layout.Layout``
        or anything with ``major_to_minor``, ``tiling`` and
        ``sub_byte_element_size_in_bits``). When ``major_to_minor`` is None (no concrete
        layout), row-major and untiled is assumed.
    """
    bits = getattr(layout, "sub_byte_element_size_in_bits", 0) or _dtype_bits(dtype)
    dims = tuple(shard_shape)
    order = getattr(layout, "major_to_minor", None)
    if order is None:
        order = tuple(range(len(dims)))
    tiles = tuple(tuple(t) for t in (getattr(layout, "tiling", None) or ()))
    return LeafBytes(logical_bytes(dims, bits), padded_bytes(dims, bits, order, tiles))
