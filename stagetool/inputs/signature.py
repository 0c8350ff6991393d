"""The call the spec describes, bound to the function before anything is traced: arguments against
``inspect.signature``, static values hashable, donation agreeing with the target's own jit, and
keyword arguments moved to positions for a jit with ``in_shardings``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from stagetool.core.errors import USER_CODE_ERRORS, SpecError, describe_exception
from stagetool.inputs.frameworks.jit import JitSettings
from stagetool.spec.model import FunctionSpec


def signature_problems(fn: Callable[..., Any], n_args: int, kwnames: list[str]) -> list[tuple[str, str]]:
    """Why ``fn`` cannot be called with ``n_args`` positional arguments and keywords ``kwnames``.

    Returns ``(where, message)`` pairs, ``where`` being ``"args"``, ``"kw:<name>"`` or ``""`` (the
    call as a whole, e.g. a missing argument); empty when the call binds, or when ``fn`` has no
    signature ``inspect.signature`` can read (then nothing is checked).
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    params = list(sig.parameters.values())
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == P.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind == P.VAR_KEYWORD for p in params)
    by_name = {p.name: p for p in params if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}
    out: list[tuple[str, str]] = []
    if n_args > len(positional) and not var_pos:
        plural = "s" if len(positional) != 1 else ""
        out.append(("args", f"takes {len(positional)} positional argument{plural}, but the spec gives {n_args}"))
    given_by_position = {p.name for p in positional[:n_args]}
    for name in kwnames:
        p = by_name.get(name)
        if p is None:
            if not var_kw:
                import difflib

                close = difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.6)
                out.append((f"kw:{name}", f"has no parameter {name!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else "")))
        elif p.kind == P.POSITIONAL_ONLY:
            out.append((f"kw:{name}", f"parameter {name!r} is positional-only; give it under 'args'"))
        elif name in given_by_position:
            out.append((f"kw:{name}", f"parameter {name!r} is given twice: by position in 'args' and by name"))
    given = given_by_position | set(kwnames)
    missing = [p.name for p in params if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
               and p.default is P.empty and p.name not in given]
    if missing:
        out.append(("", f"missing required argument{'s' if len(missing) > 1 else ''} "
                        + ", ".join(repr(m) for m in missing)))
    if not out:
        try:
            sig.bind(*range(n_args), **{k: None for k in kwnames})
        except TypeError as e:  # anything the checks above do not name
            out.append(("", str(e)))
    return out


def describe_callable(fn: Callable[..., Any]) -> str:
    """``name(signature)`` of a callable, e.g. ``mlp(params, batch, *, train=False)``."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    try:
        return f"{name}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return f"{name}(...)"


def check_signature(fspec: FunctionSpec, fn: Callable[..., Any]) -> None:
    """Bind the spec's ``args``, ``kwargs`` and ``static`` against ``inspect.signature(fn)``, before any tracing.

    Also checks that every static value is hashable, as ``jax.jit`` requires.

    Raises:
      SpecError: an extra or missing positional or keyword argument, a static name the function
        does not take, or an unhashable static value; each at the location of the spec key it is
        about (the function's entry for a missing argument), with the function's signature.
    """
    described = describe_callable(fn)
    path = f"functions.{fspec.name}"
    issues: list[str] = []
    kwnames = list(fspec.kwargs) + [k for k in fspec.static if k not in fspec.kwargs]
    for where, message in signature_problems(fn, len(fspec.args), kwnames):
        if where == "args":
            loc, key = fspec.where("args"), f"{path}.args"
        elif where.startswith("kw:"):
            name = where[3:]
            section = "static" if name in fspec.static else "kwargs"
            loc, key = fspec.locs.get(f"{section}.{name}") or fspec.where(section), f"{path}.{section}"
        else:
            loc, key = fspec.loc, path
        issues.append(f"{loc}: {key}: {described} {message}")
    for name in fspec.static:
        if name in fspec.kwargs:
            issues.append(f"{fspec.where('static.' + name)}: {path}.static: {name!r} is both in kwargs and static; "
                          "keep it in one")
    if issues:
        raise SpecError(issues, hint="make args/kwargs/static match the function's parameters")


def check_static_hashable(fspec: FunctionSpec, static: dict[str, Any]) -> None:
    """Raise SpecError for a built static value that ``jax.jit`` could not hash (a list, a dict)."""
    issues = []
    for name, value in static.items():
        try:
            hash(value)
        except USER_CODE_ERRORS as e:  # unhashable, or a __hash__ of the user's that raises
            if not isinstance(e, TypeError):
                issues.append(f"{fspec.where('static.' + name)}: functions.{fspec.name}.static.{name}: "
                              f"hashing the {type(value).__name__} failed: {describe_exception(e)}")
                continue
            issues.append(f"{fspec.where('static.' + name)}: functions.{fspec.name}.static.{name}: "
                          f"a static value must be hashable, and a {type(value).__name__} is not"
                          + ("; write a list as a tuple: !tuple [...]" if isinstance(value, list) else ""))
    if issues:
        raise SpecError(issues)


def merged_donation(fspec: FunctionSpec, fn: Callable[..., Any], own: JitSettings) -> tuple[set, set]:
    """The donated positions and names: the spec's ``donate`` and the target's own jit's donation
    (``jax.jit(donate_argnums=...)``, ``nnx.jit(donate_argnames=...)``, ``eqx.filter_jit(donate="all")``).

    One side alone is taken as it is; both the same is fine.

    Raises:
      SpecError: both donate, and not the same arguments (naming both).
    """
    spec_nums = {d for d in fspec.donate if isinstance(d, int)}
    spec_names = {d for d in fspec.donate if isinstance(d, str)}
    own_nums, own_names = set(own.donate_argnums), set(own.donate_argnames)
    if not (own_nums or own_names):
        return spec_nums, spec_names
    if not fspec.donate:
        return own_nums, own_names

    def positions(nums: set, names_: set) -> set:
        params = arg_names(fn, 64)
        return nums | {params.index(n) if n in params else n for n in names_}

    if positions(spec_nums, spec_names) != positions(own_nums, own_names):
        wrapper = ", ".join(f"{k}={sorted(v)}" for k, v in (("donate_argnums", own_nums), ("donate_argnames", own_names)) if v)
        raise SpecError([f"{fspec.where('donate')}: functions.{fspec.name}.donate: the spec donates "
                         f"{list(fspec.donate)}, but {fspec.target} is already {own.kind}({wrapper}), which donates "
                         "other arguments"], hint="make the spec's donate the same as the target's own, or drop it")
    return spec_nums | own_nums, spec_names | own_names


def bind_for_in_shardings(fspec: FunctionSpec, fn: Callable[..., Any], own: JitSettings) -> FunctionSpec:
    """For a target jitted with ``in_shardings`` (which ``jax.jit`` takes only with positional
    arguments), the spec's ``kwargs`` that name positional parameters moved to their positions.

    Raises:
      SpecError: a keyword that cannot become positional (a position before it is not given, or
        a keyword-only parameter).
    """
    if own.in_shardings is None or not fspec.kwargs:
        return fspec
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return fspec
    args, kwargs = list(fspec.args), dict(fspec.kwargs)
    locs = dict(fspec.locs)
    donate = list(fspec.donate)
    for p in params[len(args):]:
        if p.name not in kwargs:
            break
        args.append(kwargs.pop(p.name))
        i = len(args) - 1
        if f"kwargs.{p.name}" in locs:
            locs[f"args[{i}]"] = locs[f"kwargs.{p.name}"]
        donate = [i if d == p.name else d for d in donate]
    if kwargs:
        name = next(iter(kwargs))
        raise SpecError([f"{fspec.locs.get('kwargs.' + name) or fspec.where('kwargs')}: functions.{fspec.name}.kwargs: "
                         f"{fspec.target} is jitted with in_shardings, and jax.jit then takes positional arguments "
                         f"only; {name!r} cannot be given by position (every parameter before it must be given)"],
                        hint="give the arguments under 'args', in order")
    return dataclasses.replace(fspec, args=tuple(args), kwargs={}, donate=tuple(donate), locs=locs)


def arg_names(fn: Callable[..., Any], n: int) -> list[str]:
    """Names of the first ``n`` positional parameters, ``args[i]`` where unknown."""
    names = [f"args[{i}]" for i in range(n)]
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return names
    for i in range(min(n, len(params))):
        names[i] = params[i].name
    return names
