"""The dtypes stagetool knows: spec spellings, numpy names, HLO names and bits per element.

One table (:data:`DTYPES`) for the spec parser, the byte counts and the renderers.
"""

from __future__ import annotations

# HLO short dtype names, and the numpy names users also write.
DTYPES: dict[str, str] = {
    "pred": "bool", "bool": "bool",
    "s8": "int8", "i8": "int8", "int8": "int8",
    "s16": "int16", "i16": "int16", "int16": "int16",
    "s32": "int32", "i32": "int32", "int32": "int32",
    "s64": "int64", "i64": "int64", "int64": "int64",
    "u8": "uint8", "uint8": "uint8",
    "u16": "uint16", "uint16": "uint16",
    "u32": "uint32", "uint32": "uint32",
    "u64": "uint64", "uint64": "uint64",
    "f16": "float16", "float16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "f32": "float32", "float32": "float32",
    "f64": "float64", "float64": "float64",
    "f8e4m3fn": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2", "float8_e5m2": "float8_e5m2",
    "c64": "complex64", "complex64": "complex64",
    "c128": "complex128", "complex128": "complex128",
}
KEY_DTYPES = ("key<fry>", "key<rbg>", "key<unsafe_rbg>", "key<threefry2x32>")

