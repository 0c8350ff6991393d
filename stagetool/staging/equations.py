"""The equations of a traced program, nested ones included, each with the user's line: read by the
checks staging makes on the jaxpr before lowering (:mod:`stagetool.staging.gather`'s uneven
constraints and host transfers, :mod:`stagetool.staging.foreign_mesh`'s meshes)."""

from __future__ import annotations

from typing import Any, Callable, Iterator


def equations(traced: Any, user_files: list[str]) -> Iterator[tuple[Any, Callable[[Any], str]]]:
    """Every equation of the traced program (``Traced.jaxpr``, nested jaxprs included: jit, scan,
    cond, custom_vjp, shard_map bodies; 64 levels at most) in program order, each with
    ``where(eqn)``: the ``file:line`` of its user frame (the innermost in ``user_files``, else the
    innermost outside the libraries), or "an unknown line". Nothing when the traced program has no
    jaxpr. Sub-jaxprs are found by their ``eqns`` (a ``Jaxpr``, a ``ClosedJaxpr``'s), which every
    supported JAX has (``jax.extend.core.jaxprs_in_params`` is not in 0.7.2)."""
    from pathlib import Path

    from stagetool.core.paths import library_dirs

    try:
        root = traced.jaxpr.jaxpr
    except Exception:  # noqa: BLE001 - a fact we may lack
        return
    user = {str(Path(f).resolve()) for f in user_files}
    library = library_dirs()

    def where(eqn: Any) -> str:
        tb = getattr(eqn.source_info, "traceback", None)
        frames = list(getattr(tb, "frames", None) or ())
        pick = next((f for f in frames if str(Path(f.file_name).resolve()) in user), None) or next(
            (f for f in frames if not any(str(Path(f.file_name).resolve()).startswith(d) for d in library)), None)
        return f"{pick.file_name}:{pick.line_num}" if pick else "an unknown line"

    def walk(jaxpr: Any, depth: int) -> Iterator[tuple[Any, Callable[[Any], str]]]:
        if depth > 64:
            return
        for eqn in jaxpr.eqns:
            yield eqn, where
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner, depth + 1)

    yield from walk(root, 0)


def custom_partitioning_rules(traced: Any, user_files: list[str]) -> tuple[tuple[str, str, str], ...]:
    """The ``custom_partitioning`` calls of a traced program: ``(call line, rule, rule line)`` each,
    ``file:line`` as :func:`equations` writes them, the rule being the ``partition`` callable given to
    ``def_partition`` (its ``__qualname__``) and its line its definition's. Read from the equations'
    ``partition`` parameter; a call whose rule has no code object (a ``functools.partial``) names the
    callable's repr and no line."""
    import inspect

    out = []
    for eqn, where in equations(traced, user_files):
        if getattr(eqn.primitive, "name", "") != "custom_partitioning":
            continue
        rule = eqn.params.get("partition")
        if rule is None:
            continue
        inner = inspect.unwrap(getattr(rule, "func", rule))
        code = getattr(inner, "__code__", None)
        name = getattr(inner, "__qualname__", None) or repr(rule)
        line = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "an unknown line"
        out.append((where(eqn), name, line))
    return tuple(dict.fromkeys(out))
