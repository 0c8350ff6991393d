"""One array leaf: whether its sharding fits its shape, its key path and dtype, the sharding
rules that decide it, and a ``jax.Ref`` leaf as the abstract ref raw JAX traces.
"""

from __future__ import annotations

import functools
from typing import Any

from stagetool.core.sharding import Sharding
from stagetool.inputs.records import InputLeaf
from stagetool.inputs.target import load_target
from stagetool.spec.model import FunctionSpec, Rule
from stagetool.core.errors import SpecError


DIVIDE_HINT = "shard a dimension only over mesh axes whose sizes divide it"


RANK_HINT = "a sharding has at most one entry per array dimension (trailing dimensions are replicated)"


def check_fits(shape: tuple[int, ...], sharding: Sharding, axis_size: dict[str, int]) -> str | None:
    """Why ``sharding`` cannot lay out an array of ``shape``, or None when it can.

    A PartitionSpec may be shorter than the rank (trailing dimensions replicated) but not longer,
    and each dimension must be divisible by the product of the sizes of the mesh axes sharding it.
    """
    if sharding.kind != "spec":
        return None
    if len(sharding.dims) > len(shape):
        return (f"sharding {sharding} has {len(sharding.dims)} entries, but the array has rank {len(shape)} "
                f"(shape {list(shape)})" + ("; for scalars write 'replicated'" if not shape else ""))
    for i, d in enumerate(sharding.dims):
        if d is None:
            continue
        axes = (d,) if isinstance(d, str) else d
        product = 1
        for a in axes:
            product *= axis_size.get(a, 1)
        if shape[i] % product:
            return (f"dimension {i} of size {shape[i]} is not divisible by {product}, the size of mesh "
                    f"axis {' × '.join(repr(a) for a in axes)}" + (f" ({' × '.join(str(axis_size[a]) for a in axes)})" if len(axes) > 1 else ""))
    return None


def global_shape(local: tuple[int, ...], sharding: Sharding, axis_size: dict[str, int],
                  local_sizes: dict[str, int]) -> tuple[int, ...]:
    """``local × mesh(A) / local_mesh(A)`` per dimension sharded over axes A (see ``local_mesh_sizes``)."""
    if sharding.kind != "spec":
        return local
    out = list(local)
    for i, d in enumerate(sharding.dims[: len(local)]):
        if d is None:
            continue
        for a in (d,) if isinstance(d, str) else d:
            out[i] = out[i] * axis_size[a] // local_sizes[a]
    return tuple(out)


def same_dims(a: tuple, b: tuple) -> bool:
    """Whether two PartitionSpec dims say the same (trailing ``None``s do not count)."""
    def trim(d: tuple) -> tuple:
        d = tuple(d)
        while d and d[-1] is None:
            d = d[:-1]
        return d

    return trim(a) == trim(b)


def keypath_str(kp: tuple) -> str:
    """A JAX key path as ``/``-separated text with a leading ``/``: ``/layers/0/wq``."""
    out = ""
    for k in kp:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out += f"/{getattr(k, attr)}"
                break
        else:
            out += f"/{k}"
    return out


def named_path(path: str, kp: tuple, name: str | None) -> str:
    """A leaf's path: ``path`` and its key path (:func:`keypath_str`); with a ``name`` (a framework's
    name of the leaf: a Keras variable's ``hidden/kernel``), a last key that is a position in a list
    or tuple is replaced by the name (``state/0/hidden/kernel`` for ``state/0/1``)."""
    if name and kp and hasattr(kp[-1], "idx"):
        return path + keypath_str(kp[:-1]) + "/" + name
    return path + keypath_str(kp)


@functools.lru_cache(maxsize=None)
def jax_dtype(name: str) -> Any:
    import jax
    import jax.numpy as jnp

    if name.startswith("key<"):
        impl = name[4:-1]
        impl = {"fry": "threefry2x32", "threefry2x32": "threefry2x32", "rbg": "rbg", "unsafe_rbg": "unsafe_rbg",
                "urbg": "unsafe_rbg"}[impl]  # key<urbg>: JAX's name of unsafe_rbg's key dtype
        return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
    return jnp.dtype(name)


def apply_rules(rules: tuple[Rule, ...], path: str, value: Any, fspec: FunctionSpec) -> tuple[Sharding, Any] | None:
    """The first rule's sharding for a leaf: a ``[regex, sharding]`` whose regex is found in ``path``,
    or a callable rule that returns a PartitionSpec for ``(path, value)``; None when none decides."""
    from stagetool.core.sharding import spec_dims

    for rule in rules:
        if rule.call is None:
            if rule.pattern.search(path):
                return rule.sharding, rule.loc
            continue
        fn = load_target(rule.call, base_dir=fspec.base_dir).fn
        try:
            spec = fn(path, value)
        except Exception as e:
            raise SpecError([f"{rule.loc}: rule {rule.call} failed for leaf {path!r}: {type(e).__name__}: {e}"]) from None
        if spec is None:
            continue
        from jax.sharding import PartitionSpec

        if not isinstance(spec, (PartitionSpec, tuple, list)):
            raise SpecError([f"{rule.loc}: rule {rule.call} returned {spec!r} for leaf {path!r}; "
                             "return a jax.sharding.PartitionSpec, or None to let the next rule decide"])
        return Sharding("spec", spec_dims(spec)), rule.loc
    return None


def as_abstract_ref(struct: Any, by_id: dict[int, InputLeaf], explicit: bool, ref_shardings: dict | None = None) -> Any:
    """A ``jax.Ref`` leaf as the abstract ref raw JAX traces a Ref argument as:
    ``jax.ref.AbstractRef(ShapedArray(shape, dtype))``. Under an explicit-axes mesh the sharding is
    part of the type (its spec over the abstract mesh). Under auto axes a Ref's type carries none:
    ``jax.jit`` takes a concrete Ref's sharding from its value's placement, so the leaf keeps its
    sharding (spec, init, model) and it is recorded in ``ref_shardings`` (``id(ref)`` →
    ``NamedSharding`` or None) for the jit's ``in_shardings`` (:func:`build_inputs`)."""
    import jax
    from jax.sharding import NamedSharding

    sharding = getattr(struct, "sharding", None)
    if explicit and isinstance(sharding, NamedSharding):
        aval = jax.core.ShapedArray(struct.shape, struct.dtype, weak_type=struct.weak_type,
                                    sharding=NamedSharding(sharding.mesh.abstract_mesh, sharding.spec))
    else:
        aval = jax.core.ShapedArray(struct.shape, struct.dtype, weak_type=struct.weak_type)
    ref = jax.ref.AbstractRef(aval)
    leaf = by_id.pop(id(struct), None)  # the struct is dropped: its id may be reused
    if leaf is not None:
        by_id[id(ref)] = leaf
    if not explicit and ref_shardings is not None:
        ref_shardings[id(ref)] = sharding if isinstance(sharding, NamedSharding) else None
    return ref


def ref_in_shardings(args: tuple, ref_shardings: dict) -> tuple | None:
    """``in_shardings`` for ``jax.jit`` over the flat dynamic ``args`` when a Ref leaf under auto
    axes has a sharding (its type cannot carry it): per leaf its sharding (a struct's own, a Ref's
    recorded one; None: the compiler's, as for an unsharded struct); None when no Ref needs one."""
    if not any(ref_shardings.get(id(x)) is not None for x in args):
        return None
    return tuple(ref_shardings[id(x)] if id(x) in ref_shardings else getattr(x, "sharding", None) for x in args)
