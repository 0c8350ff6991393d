"""The caller's function as the plan's loaded target: its name in the report (:func:`function_label`,
:func:`target_text`), the Python function under jit wrappers (:func:`underlying`), a fresh function
object to stage (:func:`loaded_target`), and a ``jax.stages.Traced`` turned into a function and its
arguments (:func:`from_stages`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagetool.core.errors import UsageError


def function_label(fn: Any, name: Any = None) -> str:
    """The function's name in the report: ``name``, else its ``__name__`` (under jit wrappers).

    Raises:
      UsageError: ``name`` is not a non-empty string.
    """
    if name is not None:
        if not isinstance(name, str) or not name.strip():
            raise UsageError(f"stagetool.inspect: name={name!r} must be a non-empty string")
        return name
    return (getattr(fn, "__name__", None) or getattr(getattr(fn, "fun", None), "__name__", None)
            or getattr(fn, "fun_name", None) or "fn")  # fun_name: a jax.stages.Traced


def underlying(fn: Any) -> Any:
    """The Python function under jit wrappers (for its file and name)."""
    seen = 0
    while seen < 8:
        inner = getattr(fn, "__wrapped__", None) or getattr(fn, "fun", None)
        if inner is None or inner is fn:
            return fn
        fn, seen = inner, seen + 1
    return fn


def target_text(fn: Any, label: str) -> str:
    """How the report names the function: ``file.py:qualname`` for a function in a file (relative
    to the working directory when below it), ``module:qualname`` otherwise (a notebook cell)."""
    if getattr(fn, "stagetool_target", None):
        return fn.stagetool_target
    base = underlying(fn)
    qualname = getattr(base, "__qualname__", label)
    code = getattr(base, "__code__", None)
    file = code.co_filename if code is not None else None
    if file and Path(file).is_file():
        path = Path(file).resolve()
        try:
            path = path.relative_to(Path.cwd().resolve())
        except ValueError:
            pass
        return f"{path}:{qualname}"
    return f"{getattr(base, '__module__', None) or '__main__'}:{qualname}"


def loaded_target(fn: Any, target: str) -> Any:
    """``fn`` as the plan's loaded :class:`~stagetool.inputs.target.Target` named ``target``
    (``file.py:qualname``, :func:`target_text`), staged as a fresh function object (:func:`_fresh`)."""
    from stagetool.inputs.target import Target

    code = getattr(underlying(fn), "__code__", None)
    return Target(target, _fresh(fn), code.co_filename if code is not None else None, target.rpartition(":")[2])


def _fresh(fn: Any) -> Any:
    """A plain Python function as a new function object over the same code, globals, closure and
    defaults: JAX's caches key traces, lowerings and compiles on the function object, and the dump
    compile's options (its own ``xla_dump_to`` folder) differ every call, so staging the caller's
    own object kept one executable per call in ``jax.jit``'s compile cache for as long as the
    function lived (about 0.2 MB a call, measured with ``bench/bench_hostile.py``'s memory case).
    The copy dies with the report, and JAX's entries with it. Anything else (a ``jax.jit``
    wrapper, a bound method, a callable object) is staged as it is."""
    import types

    if type(fn) is not types.FunctionType:
        return fn
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    copy.__annotations__ = fn.__annotations__
    copy.__dict__.update(fn.__dict__)
    return copy


def from_stages(fn: Any, args: tuple, kwargs: dict, options: dict) -> tuple[Any, tuple, dict, dict]:
    """A ``jax.stages.Traced`` as a function and arguments the pipeline stages: its jaxpr as the
    function (``jax.extend.core.jaxpr_as_fun``: the same equations, with their source lines), its
    ``args_info`` as ``ShapeDtypeStruct``s with the shardings and donation its compile gives them
    (``Compiled.input_shardings``: one compile of the Traced, since a Traced does not say them).
    Anything else is returned as it is.

    Raises:
      UsageError: a ``Lowered`` or ``Compiled`` (no program left to stage on another mesh), or
        arguments given beside a Traced.
    """
    import jax

    if isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled)):
        kind = type(fn).__name__
        raise UsageError(f"stagetool.inspect: a jax.stages.{kind} holds a module lowered for its devices, not a "
                         "program stagetool can stage on a mesh or topology",
                         hint="pass the Traced (jax.jit(f).trace(*args)), or the function and its arguments")
    if not isinstance(fn, jax.stages.Traced):
        return fn, args, kwargs, options
    if args or kwargs:
        raise UsageError("stagetool.inspect: a jax.stages.Traced holds its arguments; give no others",
                         hint="inspect(jax.jit(f).trace(*args)), or inspect(f, *args)")
    from jax.extend.core import jaxpr_as_fun

    traced = fn
    infos, tree = jax.tree_util.tree_flatten(traced.args_info)
    shardings = tree.flatten_up_to(_pair(traced.lower().compile().input_shardings))
    structs = [jax.ShapeDtypeStruct(tuple(i.shape), i.dtype, sharding=s) for i, s in zip(infos, shardings)]
    args, kwargs = jax.tree_util.tree_unflatten(tree, structs)
    donated_args, donated_kwargs = jax.tree_util.tree_unflatten(tree, [i.donated for i in infos])
    donate = [i for i, a in enumerate(donated_args) if any(jax.tree_util.tree_leaves(a))]
    donate += [k for k, v in donated_kwargs.items() if any(jax.tree_util.tree_leaves(v))]
    body, out_tree = jaxpr_as_fun(traced.jaxpr), traced.out_tree

    def program(*a: Any, **k: Any) -> Any:
        return jax.tree_util.tree_unflatten(out_tree, body(*jax.tree_util.tree_leaves((a, k))))

    program.__name__ = program.__qualname__ = traced.fun_name
    program.stagetool_target = f"<jax.stages.Traced>:{traced.fun_name}"  # type: ignore[attr-defined]
    return program, tuple(args), dict(kwargs), {**options, "donate": tuple(donate)}


def _pair(tree: Any) -> Any:
    """``(args, kwargs)`` as the stages give it, the args a tuple."""
    return (tuple(tree[0]), tree[1]) if isinstance(tree, (tuple, list)) and len(tree) == 2 else tree
