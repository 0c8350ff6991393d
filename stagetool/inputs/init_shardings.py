"""The shardings an ``init`` gives its results when it runs, read from the jaxpr of its trace.

``jax.eval_shape`` (and ``Traced.out_info``) do not report the ``out_shardings`` of a nested
``jax.jit`` — the standard MaxText-style init, ``jax.jit(init_fn, out_shardings=...)(key)`` — nor
a ``jax.device_put`` or ``jax.lax.with_sharding_constraint`` on the results (in JAX's explicit
sharding mode the result types even say ``P(None, ...)`` for a jit's sharded outputs). Public JAX has
no call that answers "what sharding will this output have" short of compiling; the jaxpr of the
trace (``jax.jit(init).trace(...).jaxpr``, public) does say it, in the parameters of the equation
that produces each output. This module is the one place that reads those parameters.

Followed from each output variable back to the equation that produced it (verified on
jax/jaxlib 0.10.2 against running the init for real on simulated CPU devices,
``tests/inputs/test_init_shardings.py``):

- ``jit`` (``pjit`` before JAX 0.7): the equation's ``out_shardings[i]`` when it is a
  ``NamedSharding``; otherwise (unspecified) the ``i``-th output of its inner jaxpr, recursively
  (``nnx.jit`` and ``eqx.filter_jit`` are ``jax.jit`` underneath);
- ``sharding_constraint``: ``sharding``; ``device_put``: ``devices[i]``; ``reshard``: ``dst_sharding``;
- ``shard_map``: ``out_specs[i]`` (a PartitionSpec over the mesh);
- call-like wrappers (``closed_call``, ``remat``/``checkpoint``, ``custom_jvp_call``,
  ``custom_vjp_call``): the matching output of the inner jaxpr;
- ``convert_element_type`` and ``copy``: their operand (a dtype cast keeps the layout when run);
- a whole-Ref read (``get`` with no index, ``ref[...]``) of a ``new_ref`` (``jax.new_ref(x)``): ``x``'s
  (writes to the Ref in between are not followed);
- anything else (an op on unsharded values, an input passed through, a constant): unknown (None).
"""

from __future__ import annotations

from typing import Any

from stagetool.core.sharding import spec_dims
from stagetool.inputs.seen_meshes import note_sharding

_CALLS = ("closed_call", "core_call", "remat", "checkpoint", "remat2", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "custom_lin")
_SAME_LAYOUT = ("convert_element_type", "copy", "copy_p")
_NEW_REF = ("new_ref", "mutable_array")  # jax.new_ref's primitive (named mutable_array before JAX 0.8)
_MAX_DEPTH = 64


def produced_dims(closed_jaxpr: Any) -> list[tuple | None]:
    """Per output of ``closed_jaxpr`` (a ``jax.stages.Traced.jaxpr``), the PartitionSpec dims the
    program gives it when run (see the module docstring), or None where the jaxpr does not say.

    Dims are :func:`stagetool.core.sharding.spec_dims` of the sharding's ``spec`` (mesh axis names,
    one entry per array dimension, trailing ``None``s kept as JAX gives them).
    """
    return [dims for dims, _ in produced(closed_jaxpr)]


def produced(closed_jaxpr: Any) -> list[tuple[tuple | None, Any]]:
    """Per output of ``closed_jaxpr``, ``(dims, eqn)``: the dims of :func:`produced_dims` and the
    equation that gives them (a ``sharding_constraint``, ``device_put``, ``jit``..., whose traceback
    names the line of the user's code that wrote the sharding), or ``(None, None)``."""
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    producers: dict[int, dict] = {}
    out = []
    for v in jaxpr.outvars:
        where: list = []
        dims = _origin(jaxpr, v, producers, 0, None, where)
        out.append((dims, where[-1] if dims is not None and where else None))
    return out


def _producer_map(jaxpr: Any, cache: dict[int, dict]) -> dict:
    found = cache.get(id(jaxpr))
    if found is None:
        found = {}
        for eqn in jaxpr.eqns:
            for i, out in enumerate(eqn.outvars):
                found[id(out)] = (eqn, i)
        cache[id(jaxpr)] = found
    return found


def _inner(params: dict) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = params.get(key)
        if inner is not None:
            return getattr(inner, "jaxpr", inner)
    return None


def _dims_of(sharding: Any) -> tuple | None:
    """Dims of a ``NamedSharding`` (or a bare ``PartitionSpec``); None for anything else, and for a
    spec with an unconstrained entry (``P.UNCONSTRAINED``: the partitioner chooses that dimension,
    as ``nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})`` constrains a stacked layer axis)."""
    from jax.sharding import NamedSharding, PartitionSpec

    if isinstance(sharding, NamedSharding):
        note_sharding(sharding, "init")
        sharding = sharding.spec
    if not isinstance(sharding, PartitionSpec):
        return None
    if any(d is not None and not isinstance(d, (str, tuple, list)) for d in sharding):
        return None
    return spec_dims(sharding)


def _origin(jaxpr: Any, var: Any, cache: dict[int, dict], depth: int, outer: tuple | None,
            where: list | None = None) -> tuple | None:
    """``outer``: ``(jaxpr, eqn, outer)`` of the call equation whose inner jaxpr ``jaxpr`` is, so an
    input passed through an inner jit is followed out to what the caller gave it; ``where``, a list,
    gets each equation that gave dims (the last one is the answer's)."""
    where = [] if where is None else where

    def at(dims: tuple | None, eqn: Any) -> tuple | None:
        if dims is not None:
            where.append(eqn)
        return dims

    if depth > _MAX_DEPTH or type(var).__name__ == "Literal":
        return None
    found = _producer_map(jaxpr, cache).get(id(var))
    if found is None:  # an input of this jaxpr (or a constant): whatever the caller gave it
        if outer is not None:
            outer_jaxpr, call, further = outer
            invars = list(jaxpr.invars)
            if var in invars and len(invars) == len(call.invars):
                return _origin(outer_jaxpr, call.invars[invars.index(var)], cache, depth + 1, further, where)
        return None
    eqn, i = found
    name = eqn.primitive.name
    params = eqn.params
    if name in ("jit", "pjit"):
        shardings = params.get("out_shardings") or ()
        dims = _dims_of(shardings[i]) if i < len(shardings) else None
        if dims is not None:
            return at(dims, eqn)
        inner = _inner(params)
        return (_origin(inner, inner.outvars[i], cache, depth + 1, (jaxpr, eqn, outer), where)
                if inner is not None else None)
    if name == "sharding_constraint":
        return at(_dims_of(params.get("sharding")), eqn)
    if name == "device_put":
        devices = params.get("devices") or ()
        return at(_dims_of(devices[i]) if i < len(devices) else None, eqn)
    if name == "reshard":
        return at(_dims_of(params.get("dst_sharding")), eqn)
    if name == "shard_map":
        specs = params.get("out_specs") or ()
        return at(_dims_of(specs[i]) if i < len(specs) else None, eqn)
    if name in _CALLS:
        inner = _inner(params)
        if inner is not None and len(inner.outvars) == len(eqn.outvars):
            return _origin(inner, inner.outvars[i], cache, depth + 1, (jaxpr, eqn, outer), where)
        return None
    if name in _SAME_LAYOUT and len(eqn.invars) == 1:
        return _origin(jaxpr, eqn.invars[0], cache, depth + 1, outer, where)
    if name == "get" and len(eqn.invars) == 1:  # `ref[...]`, the whole Ref read: what the Ref was made from
        return _origin(jaxpr, eqn.invars[0], cache, depth + 1, outer, where)
    if name in _NEW_REF and len(eqn.invars) == 1:  # jax.new_ref(x): the Ref holds x's buffer, as laid out
        return _origin(jaxpr, eqn.invars[0], cache, depth + 1, outer, where)
    return None
