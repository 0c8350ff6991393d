"""The spec's ``out_shardings`` checked against the function's traced outputs and fitted to their
pytree (a prefix of it: one sharding per subtree, lists as the output's tuples or lists).
"""

from __future__ import annotations

from typing import Any, Callable

from stagetool.core.dtypes import hlo_name
from stagetool.core.errors import USER_CODE_ERRORS, SpecError
from stagetool.core.sharding import Sharding
from stagetool.inputs.frameworks import Pytree
from stagetool.inputs.leaves import apply_rules, check_fits, keypath_str
from stagetool.inputs.records import AbstractInputs
from stagetool.spec.model import FunctionSpec


def check_out_shardings(fspec: FunctionSpec, out_info: Pytree, axis_size: dict[str, int] | None = None,
                        inputs: AbstractInputs | None = None) -> Any:
    """Check the spec's ``out_shardings`` against the traced output tree; return it in the output's shape.

    ``out_shardings`` is a prefix of the output pytree: a sharding (or ``auto``) stands for a whole
    subtree; a list stands for a tuple or list of as many outputs; a mapping for a dict with the
    same keys. Because YAML has only one kind of list, a spec list matches a tuple or a list output
    and the returned tree uses the output's type (``jax.jit`` requires the exact type).

    Args:
      fspec: the function's spec (``out_shardings`` not None).
      out_info: ``jax.stages.Traced.out_info`` of a trace *without* out_shardings (a pytree of
        ``ShapeDtypeStruct``-like leaves).

    Returns:
      ``fspec.out_shardings`` with each list as the output's tuple or list: pass it to
      :func:`stagetool.staging.stages.jit_function` via ``dataclasses.replace(fspec, out_shardings=...)``.

    Raises:
      SpecError: at the out_shardings location, naming the key path where the structures part and
        describing both (the spec's, and the function's outputs).
    """
    if fspec.out_shardings is None:
        return None
    problems: list[str] = []

    def fits(spec: Sharding, out: Pytree, path: str) -> None:
        """Every output leaf under ``out`` must be divisible by ``spec`` (with the leaf's path)."""
        if axis_size is None:
            return
        import jax

        for key_path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
            if not _is_struct(leaf):
                continue
            where = path + jax.tree_util.keystr(key_path)
            why = check_fits(tuple(leaf.shape), spec, axis_size)
            if why:
                dims = ",".join(str(d) for d in leaf.shape)
                problems.append(f"at {where or 'the output'} ({hlo_name(str(leaf.dtype))}[{dims}]): {why}")

    import jax

    from stagetool.spec.model import LikeSpec, OutRulesSpec

    def conform(spec: Any, out: Pytree, path: str) -> Any:
        if spec is None or isinstance(spec, Sharding):
            if isinstance(spec, Sharding):
                fits(spec, out, path)
            return spec
        at = f"at {path}: " if path else ""
        if isinstance(spec, LikeSpec):
            return like(spec, out, at)
        if isinstance(spec, OutRulesSpec):
            flat, treedef = jax.tree_util.tree_flatten_with_path(out)
            chosen = []
            for kp, value in flat:
                leaf_path = "out" + (f"/{path}" if path else "") + keypath_str(kp)
                found = apply_rules(spec.rules, leaf_path, value, fspec)
                if found is None:
                    problems.append(f"{at}no rule matches output leaf {leaf_path!r}; add a rule such as ['.*', replicated]")
                    return spec
                chosen.append(found[0])
            return jax.tree_util.tree_unflatten(treedef, chosen)
        if isinstance(spec, (list, tuple)):
            if type(out) in (list, tuple) and len(out) == len(spec):
                return type(out)(conform(sv, ov, f"{path}[{i}]") for i, (sv, ov) in enumerate(zip(spec, out)))
            problems.append(f"{at}the spec gives a list of {len(spec)} shardings, but the function returns "
                            f"{_describe_tree(out)}")
            return spec
        if isinstance(spec, dict):
            if isinstance(out, dict) and set(map(str, out)) == set(spec):
                return {k: conform(spec[str(k)], v, f"{path}.{k}" if path else str(k)) for k, v in out.items()}
            problems.append(f"{at}the spec gives a mapping with keys {', '.join(sorted(spec))}, but the function "
                            f"returns {_describe_tree(out)}")
            return spec
        return spec

    def like(spec: Any, out: Pytree, at: str) -> Any:
        leaves = [x for x in (inputs.leaves if inputs else []) if x.arg == spec.arg]
        flat, treedef = jax.tree_util.tree_flatten(out)
        if not leaves or len(leaves) != len(flat) or any(tuple(x.shape) != tuple(o.shape) for x, o in zip(leaves, flat)):
            problems.append(f"{at}like: {spec.arg!r} names an argument with {len(leaves)} array leaves, but this "
                            f"output subtree has {len(flat)}" + (" of other shapes" if len(leaves) == len(flat) else "")
                            + f" ({_describe_tree(out)})")
            return spec
        return jax.tree_util.tree_unflatten(treedef, [None if x.declared.kind == "auto" else x.declared for x in leaves])

    declared = fspec.out_shardings
    if inputs is not None and inputs.state_outputs:
        # The staged function returns {"out": the target's output, name: updated state, ...}; the spec's
        # out_shardings are the target's, and the updated state is left to the compiler (as nnx.jit
        # does), unless the spec names the updated arguments as keys beside "out".
        names = {"out", *inputs.state_outputs}
        if isinstance(declared, dict) and set(declared) <= names and set(declared) & set(inputs.state_outputs):
            # {out: ..., model: {like: 0}}: the updated state pinned too (keys the spec omits: the compiler's)
            declared = {k: declared.get(k) for k in ("out", *inputs.state_outputs)}
        else:
            declared = {"out": declared, **{name: None for name in inputs.state_outputs}}
    out = conform(declared, out_info, "")
    if problems:
        loc = fspec.where("out_shardings")
        raise SpecError([f"{loc}: functions.{fspec.name}.out_shardings: " + "; ".join(problems)
                         + f" (out_shardings: {_describe_tree(fspec.out_shardings)})"],
                        hint="give one sharding per output, in a list for a tuple or list of outputs and in "
                             "a mapping for a dict; a single sharding or 'auto' covers a whole subtree")
    return out


def fit_out_shardings(fspec: FunctionSpec, fn: Callable[..., Any], inputs: AbstractInputs, mesh: Any) -> FunctionSpec:
    """``fspec`` with ``out_shardings`` checked and fitted to the function's outputs (see :func:`check_out_shardings`).

    Traces ``fn`` once without out_shardings (under the context staging traces it under,
    ``inputs.context``: the staged mesh first where that is True, else no context mesh first; then
    the other, unless ``inputs.context`` is False) to read
    ``Traced.out_info``; costs one extra trace, and only when the spec gives out_shardings. When
    that trace itself fails, ``fspec`` is returned unchanged, so that staging reports the failure
    as usual (exit code 3).

    Raises:
      SpecError: the out_shardings do not fit the output tree (exit code 2).
    """
    import contextlib
    import dataclasses as dc

    import jax

    if fspec.out_shardings is None:
        return fspec
    options: dict[str, Any] = {"static_argnames": inputs.static_argnames} if inputs.static_argnames else {}
    fn = inputs.fn or fn
    contexts = [mesh, None] if inputs.context else [None] if inputs.context is False else [None, mesh]
    for i, context in enumerate(contexts):
        try:  # a shard_map on another mesh of the code's refuses the staged context; a bare P needs one
            probe = fn if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn, **options)
            with jax.set_mesh(context) if context is not None else contextlib.nullcontext():
                out_info = probe.trace(*inputs.args, **inputs.kwargs).out_info
            break
        except USER_CODE_ERRORS:  # the user's function fails to trace: staging says so, with its frame
            if i == len(contexts) - 1:
                return fspec
    return dc.replace(fspec, out_shardings=check_out_shardings(fspec, out_info, dict(mesh.shape), inputs))


def _is_struct(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _describe_tree(tree: Pytree, depth: int = 0) -> str:
    """A short readable picture of a pytree: ``(f32[8], {a: f32[2,4], b: i32[]})``; shardings as ``P(...)``."""
    if depth > 3:
        return "..."
    if tree is None:
        return "auto"
    if isinstance(tree, Sharding):
        return str(tree)
    if _is_struct(tree):
        return f"{hlo_name(str(tree.dtype))}{list(tree.shape)}".replace(" ", "")
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        items = [_describe_tree(t, depth + 1) for t in tree[:8]] + (["..."] if len(tree) > 8 else [])
        kind = "a tuple" if isinstance(tree, tuple) else "a list"
        inner = ", ".join(items)
        return f"{kind} of {len(tree)} ({inner})" if depth == 0 else f"({inner})" if isinstance(tree, tuple) else f"[{inner}]"
    if isinstance(tree, dict):
        keys = sorted(tree, key=str)
        inner = ", ".join(f"{k}: {_describe_tree(tree[k], depth + 1)}" for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
        return f"a dict {{{inner}}}" if depth == 0 else f"{{{inner}}}"
    return f"a {type(tree).__name__}" if depth == 0 else type(tree).__name__
