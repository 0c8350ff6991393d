"""The one dtype table (stagetool.core.dtypes) against JAX's own dtypes."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from stagetool.core import dtypes


_SINCE_0_12 = {"float6_e2m3fn", "float6_e3m2fn"}  # jax 0.12 makes arrays of them (0.10 does not; 0.11 not checked)


@pytest.mark.parametrize("d", [
    pytest.param(d, id=d.name, marks=[pytest.mark.jax_version(">=0.12", reason="JAX 0.12 added the float6 dtypes")]
                 if d.name in _SINCE_0_12 else []) for d in dtypes.TABLE])
def test_every_dtype_is_jax_s_with_its_bit_width(d):
    dt = jnp.dtype(d.name)
    assert dt.name == d.name
    if d.hlo == "pred":
        assert d.bits == 8  # XLA stores pred (and int1/uint1, lowered to pred) in a byte
    elif d.name in _SINCE_0_12:
        # 6 bits, stored one per byte (memory_analysis: f6e2m3fn[1024,1024] arguments are 1 MiB)
        assert ml_dtypes.finfo(dt).bits == 6 and d.bits == 8
    elif d.name.startswith(("int", "uint")):
        assert d.bits == ml_dtypes.iinfo(dt).bits
    elif dt.kind == "c":
        assert d.bits == 8 * dt.itemsize
    else:
        assert d.bits == ml_dtypes.finfo(dt).bits


def _jax_makes_arrays_of(name: str) -> bool:
    try:
        jnp.zeros((2,), name)
    except Exception:  # noqa: BLE001 - JAX does not support this ml_dtypes type
        return False
    return True


def test_the_table_covers_the_dtypes_of_jax():
    """Every ml_dtypes array type JAX makes arrays of is in the table."""
    names = {n for n in dir(ml_dtypes) if isinstance(getattr(ml_dtypes, n), type)
             and issubclass(getattr(ml_dtypes, n), np.generic)}
    supported = {n for n in names if _jax_makes_arrays_of(n)}
    assert {"int4", "float8_e4m3fn", "float4_e2m1fn"} <= supported
    assert supported - set(dtypes.BY_NAME) == set()


@pytest.mark.parametrize("spelling,name", [("s4", "int4"), ("i4", "int4"), ("int4", "int4"), ("u4", "uint4"),
                                           ("s2", "int2"), ("u2", "uint2"), ("f4e2m1fn", "float4_e2m1fn"),
                                           ("f8e8m0fnu", "float8_e8m0fnu"), ("pred", "bool"), ("i32", "int32")])
def test_spellings(spelling, name):
    assert dtypes.DTYPES[spelling] == name


def test_sub_byte_arrays_are_packed():
    assert dtypes.array_bytes((1024, 1024), "int4") == 524_288
    assert dtypes.array_bytes((3,), "int4") == 2  # 12 bits round up to whole bytes
    assert dtypes.array_bytes((8,), "int2") == 2
    assert dtypes.array_bytes((16, 1024), "bfloat16") == 32_768
    assert dtypes.array_bytes((4,), "bool") == 4
    assert dtypes.array_bytes((2,), "key<fry>") == 16
    assert dtypes.array_bytes((2,), "no-such-dtype") is None
