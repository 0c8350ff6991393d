"""The compact forms of the spec: a leaf ``dtype[d0,d1,...] @ sharding``, a sharding
(``auto``, ``replicated``, ``[data, null]``), a dtype name; and the sizes XLA can take.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from stagetool.core.dtypes import DTYPES, KEY_DTYPES
from stagetool.core.sharding import AUTO, REPLICATED, UNSPECIFIED, Sharding
from stagetool.spec.model import LeafSpec, Loc
from stagetool.spec.yaml_nodes import MAX_DEPTH, SpecLimit, close_match, compose_bounded, plain

_LEAF_RE = re.compile(r"^\s*(?P<dtype>[A-Za-z][\w<>]*)\s*\[(?P<dims>[^\]]*)\]\s*(?:@\s*(?P<sharding>.+?))?\s*$")
KEY_CALL_RE = re.compile(r"^\s*key\(\s*(-?\d+)\s*\)\s*$")
"""``key(N)``: a concrete PRNG key in ``init_args``."""

MAX_DIMENSION = 2**32
"""The largest size of one dimension of a leaf."""
MAX_ELEMENTS = 2**57
"""The most elements one leaf may have: XLA computes a buffer's bytes in int64, and a leaf of
2**61 f32 elements aborts the compiler; 2**57 leaves room for 16-byte complex types."""


def parse_sharding(value: Any) -> Sharding:
    """Parse a sharding written as a YAML value.

    Accepts ``auto``, ``replicated`` (or ``[]``), and lists like ``[data, null]`` or
    ``[[data, fsdp], model]``.

    Raises:
      ValueError: with a message saying what is accepted.
    """
    if value is None:
        return UNSPECIFIED
    if isinstance(value, str):
        v = value.strip()
        if v == "auto":
            return AUTO
        if v == "replicated":
            return REPLICATED
        if v.startswith("["):
            try:
                parsed = compose_bounded(v)
                value = plain(parsed) if parsed is not None else None
            except (yaml.YAMLError, SpecLimit) as e:
                raise ValueError(f"sharding {value!r} is not a list like [data, null]: "
                                 f"{getattr(e, 'problem', None) or getattr(e, 'message', None) or e}") from None
            if not isinstance(value, list):
                raise ValueError(f"sharding {v!r} is not a list like [data, null]")
            return parse_sharding(value)
        raise ValueError(f"sharding {value!r} is not 'auto', 'replicated' or a list like [data, null]")
    if isinstance(value, (list, tuple)):
        dims: list = []
        for d in value:
            if d is None or (isinstance(d, str) and d in ("null", "None")):
                dims.append(None)
            elif isinstance(d, str):
                dims.append(d)
            elif isinstance(d, (list, tuple)) and d and all(isinstance(a, str) for a in d):
                dims.append(tuple(d) if len(d) > 1 else d[0])
            else:
                raise ValueError(f"sharding entry {d!r} must be a mesh axis name, null, or a list of axis names")
        return Sharding("spec", tuple(dims))
    raise ValueError(f"sharding {value!r} is not 'auto', 'replicated' or a list like [data, null]")


def parse_leaf(text: str, loc: Loc) -> LeafSpec:
    """Parse a compact leaf ``dtype[d0,d1,...] @ sharding`` (``f32[]`` is a scalar).

    Raises:
      ValueError: naming what is wrong and the accepted form.
    """
    m = _LEAF_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a leaf; write dtype[d0,d1,...] with an optional '@ sharding', "
                         "e.g. 'bf16[64,1024] @ [data, null]'")
    dtype = dtype_name(m["dtype"])
    dims_text = m["dims"].strip()
    try:
        shape = tuple(int(d) for d in dims_text.split(",")) if dims_text else ()
    except ValueError:
        raise ValueError(f"shape [{dims_text}] must be a list of non-negative integers") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"shape [{dims_text}] must be a list of non-negative integers")
    problem = shape_problem(shape)
    if problem:
        raise ValueError(problem)
    sharding = parse_sharding(m["sharding"]) if m["sharding"] else UNSPECIFIED
    return LeafSpec(shape, dtype, sharding, loc)


def shape_problem(shape: tuple[int, ...] | list[int]) -> str | None:
    """Why XLA could not take this shape (a dimension or element count too large), or None."""
    if len(shape) > MAX_DEPTH:
        return f"shape has {len(shape)} dimensions; at most {MAX_DEPTH}"
    n = 1
    for d in shape:
        if d > MAX_DIMENSION:
            return f"dimension size {d} is larger than {MAX_DIMENSION} (2**32), the largest stagetool accepts"
        n *= d
    if n > MAX_ELEMENTS:
        return (f"shape {list(shape)} has {n} elements, more than {MAX_ELEMENTS} (2**57), "
                "the most stagetool accepts for one leaf")
    return None


def dtype_name(name: str) -> str:
    """The canonical dtype name of a spec's dtype (``F32``, ``float32`` → ``float32``; ``key`` → ``key<fry>``).

    Raises:
      ValueError: an unknown dtype, with the closest known name.
    """
    n = name.strip()
    low = n.lower()  # F32, BF16, Float32: names are case-insensitive
    if low in DTYPES:
        return DTYPES[low]
    if low in ("key", "key<fry>"):
        return "key<fry>"
    if low in KEY_DTYPES:
        return low
    close = close_match(low, list(DTYPES) + ["key<fry>"])
    raise ValueError(f"unknown dtype {n!r}" + (f" (did you mean {close!r}?)" if close else "")
                     + "; use HLO short names (f32 bf16 i32 u32 pred ...), numpy names, or key<fry>")
