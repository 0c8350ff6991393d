"""The dtypes stagetool knows: spec spellings, numpy names, HLO names and storage bits.

One table (:data:`TABLE`) for the spec parser, byte counts, tiled layouts and the renderers. It
lists every array dtype of JAX 0.7 to 0.12 (``jax.dtypes`` / ``ml_dtypes``), sub-byte ones included;
``tests/core/test_dtypes.py`` holds it against JAX's own ``jnp.dtype(name)`` and ``jnp.iinfo``/
``finfo`` bit widths. Importing this module imports nothing else (no JAX, no numpy).

Storage bits are what XLA stores per element: sub-byte types are packed (two ``s4`` per byte),
``pred`` takes a whole byte.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class DType:
    """One array dtype.

    Attributes:
      name: numpy's (and JAX's) name, ``bfloat16``, ``int4``.
      hlo: XLA's element type name, ``bf16``, ``s4``.
      bits: storage bits per element as XLA stores it.
      aliases: other spellings the spec accepts (``i32`` for ``s32``).
    """

    name: str
    hlo: str
    bits: int
    aliases: tuple[str, ...] = ()


TABLE: tuple[DType, ...] = (
    DType("bool", "pred", 8),
    DType("int1", "pred", 8),  # JAX lowers int1/uint1 to pred: one byte per element
    DType("uint1", "pred", 8),
    DType("int2", "s2", 2, ("i2",)),
    DType("uint2", "u2", 2),
    DType("int4", "s4", 4, ("i4",)),
    DType("uint4", "u4", 4),
    DType("int8", "s8", 8, ("i8",)),
    DType("uint8", "u8", 8),
    DType("int16", "s16", 16, ("i16",)),
    DType("uint16", "u16", 16),
    DType("int32", "s32", 32, ("i32",)),
    DType("uint32", "u32", 32),
    DType("int64", "s64", 64, ("i64",)),
    DType("uint64", "u64", 64),
    DType("float4_e2m1fn", "f4e2m1fn", 4),
    # jax 0.12+ (ml_dtypes): not packed, one byte per element (memory_analysis: f6e2m3fn[1024,1024] is 1 MiB)
    DType("float6_e2m3fn", "f6e2m3fn", 8),
    DType("float6_e3m2fn", "f6e3m2fn", 8),
    DType("float8_e3m4", "f8e3m4", 8),
    DType("float8_e4m3", "f8e4m3", 8),
    DType("float8_e4m3fn", "f8e4m3fn", 8),
    DType("float8_e4m3fnuz", "f8e4m3fnuz", 8),
    DType("float8_e4m3b11fnuz", "f8e4m3b11fnuz", 8),
    DType("float8_e5m2", "f8e5m2", 8),
    DType("float8_e5m2fnuz", "f8e5m2fnuz", 8),
    DType("float8_e8m0fnu", "f8e8m0fnu", 8),
    DType("float16", "f16", 16),
    DType("bfloat16", "bf16", 16),
    DType("float32", "f32", 32),
    DType("float64", "f64", 64),
    DType("complex64", "c64", 64),
    DType("complex128", "c128", 128),
)

BY_NAME: dict[str, DType] = {d.name: d for d in TABLE}
"""numpy name → :class:`DType`."""

BY_HLO: dict[str, DType] = {}
for _d in TABLE:
    BY_HLO.setdefault(_d.hlo, _d)  # pred is bool
"""HLO element type → :class:`DType`."""

DTYPES: dict[str, str] = {spelling: d.name for d in reversed(TABLE) for spelling in (d.hlo, d.name, *d.aliases)}
"""Every spelling the spec accepts → numpy name (``s4``, ``i4`` and ``int4`` → ``int4``)."""

KEY_DTYPES = ("key<fry>", "key<rbg>", "key<urbg>", "key<unsafe_rbg>", "key<threefry2x32>")
"""Typed PRNG key dtypes as the spec writes them (``key<urbg>`` is JAX's name of ``unsafe_rbg``'s,
MaxText's default; ``key<unsafe_rbg>`` the same)."""

KEY_BITS = {"key<fry>": 64, "key<threefry2x32>": 64, "key<rbg>": 128, "key<urbg>": 128, "key<unsafe_rbg>": 128}
"""Storage bits of one typed PRNG key (its ``uint32`` key data: 2 words threefry, 4 rbg)."""


def hlo_name(dtype: str) -> str:
    """XLA's short name of a numpy dtype name: ``float32`` → ``f32``, ``int4`` → ``s4``; other
    names (PRNG key dtypes) as they are."""
    d = BY_NAME.get(dtype)
    return d.hlo if d is not None else dtype


def storage_bits(dtype: str) -> int | None:
    """Bits XLA stores per element of a numpy dtype name or HLO name; None when unknown."""
    d = BY_NAME.get(dtype) or BY_HLO.get(dtype)
    if d is not None:
        return d.bits
    return KEY_BITS.get(dtype)


def array_bytes(shape: Iterable[int], dtype: str) -> int | None:
    """Bytes of an array as XLA stores it: ``ceil(elements × bits / 8)`` (sub-byte types packed);
    None for an unknown dtype."""
    bits = storage_bits(dtype)
    if bits is None:
        return None
    return (math.prod(shape) * bits + 7) // 8
