"""The options of :func:`stagetool.inspect`, checked and resolved before any trace
(:func:`resolve_options` → :class:`InspectOptions`), and named in messages as :func:`inspect` takes
them (:func:`api_words`: ``mesh='data=8'``, never ``--mesh`` or a spec key).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Iterable, Iterator, Mapping

from stagetool.core.errors import UsageError
from stagetool.core.location import Loc
from stagetool.core.mesh import MeshSpec
from stagetool.live.arguments import meshes
from stagetool.live.target import function_label, target_text, underlying


@dataclasses.dataclass(frozen=True)
class InspectOptions:
    """The options of :func:`inspect` other than the function and its arguments (picklable: an
    isolated run hands them to its worker).

    Attributes mirror the CLI's: ``mesh`` (a :class:`MeshSpec`), ``platform``, ``topology``,
    ``slices``, ``chip``, ``device_memory`` (``16GiB``), ``peak`` (record memory over time: XLA's
    dump with the one compile), ``top``, ``explain`` (leaf patterns whose collectives to trace),
    ``name`` (the function's name in the report), ``target`` (``file.py:qualname`` as the report
    names it), ``loc`` (the caller's line, named in input errors), ``donate`` (positions or names),
    ``static`` (static keyword values by name), ``out_shardings`` (a pytree of PartitionSpecs or
    None), ``notes`` (sentences for the report about how the arguments were taken), ``against`` (a
    compile-only target to stage the same program for too, every difference marked).
    """

    mesh: MeshSpec
    platform: str | None = None
    topology: str | None = None
    slices: int | None = None
    chip: str | None = None
    device_memory: str | None = None
    peak: bool = True
    top: int = 10
    explain: tuple[str, ...] = ()
    name: str = "fn"
    target: str = "fn"
    loc: Loc | None = None
    donate: tuple[int | str, ...] = ()
    static: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    out_shardings: Any = None
    notes: tuple[str, ...] = ()
    against: str | None = None


def resolve_options(fn: Any, args: tuple, kwargs: dict, *, loc: Loc | None, mesh: Any = None, donate: Any = (),
                    static: Any = None, name: str | None = None, explain: Iterable[str] = (),
                    context_mesh: bool | None = None, **rest: Any) -> InspectOptions:
    """The options checked and resolved, before any trace.

    Raises:
      UsageError: an option of the wrong type or out of range (naming it as :func:`inspect` takes
        it); an argument leaf whose shape XLA cannot take (naming the Python parameter).
    """
    if not callable(fn):
        raise UsageError(f"stagetool.inspect: the first argument is a {type(fn).__name__}, not a function",
                         hint="pass the function (or its jax.jit wrapper), then its arguments")
    donate = _donate(donate)
    if static is None:
        static = {}
    elif not isinstance(static, Mapping):
        if isinstance(static, str):
            names = [static]
        elif isinstance(static, Iterable) and not isinstance(static, bytes):
            names = list(static)
        else:
            raise UsageError(f"stagetool.inspect: static={static!r} is not a mapping or keyword names",
                             hint="give static={name: value}, or the names of keyword arguments given")
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise UsageError(f"stagetool.inspect: static names keyword arguments by name, not {bad[0]!r}")
        missing = [n for n in names if n not in kwargs]
        if missing:
            raise UsageError(f"stagetool.inspect: static={missing[0]!r} names no keyword argument given",
                             hint="give its value as a keyword argument, or static={name: value}")
        static = {n: kwargs[n] for n in names}
    elif any(not isinstance(k, str) for k in static):
        raise UsageError(f"stagetool.inspect: static={dict(static)!r}: its keys must be keyword names (strings)")
    if isinstance(explain, str):
        explain = (explain,)
    elif not isinstance(explain, Iterable) or any(not isinstance(e, str) for e in explain):
        raise UsageError(f"stagetool.inspect: explain={explain!r} must be leaf names: a string or a list of strings")
    _check_option_types(name=name, **rest)
    if context_mesh is not None and not isinstance(context_mesh, bool):
        raise UsageError(f"stagetool.inspect: context_mesh={context_mesh!r} must be True, False or None")
    label = function_label(fn, name)
    _check_leaves(fn, args, kwargs)
    staged_mesh = dataclasses.replace(mesh_spec(mesh, args, kwargs), context=context_mesh)
    return InspectOptions(mesh=staged_mesh, name=label, target=target_text(fn, label), loc=loc,
                          donate=donate, static=dict(static), explain=tuple(explain), **rest)


def _donate(donate: Any) -> tuple[int | str, ...]:
    """``donate`` as positions and names: an int (not a bool), a str, or an iterable of them.

    Raises:
      UsageError: anything else (``donate=True`` is not argument 1).
    """
    items = (donate,) if isinstance(donate, (int, str)) else donate
    if isinstance(items, Iterable) and not isinstance(items, (bytes, Mapping)):
        items = tuple(items)
        bad = [d for d in items if isinstance(d, bool) or not isinstance(d, (int, str))
               or (isinstance(d, int) and d < 0)]
        if not bad:
            return items
        donate = bad[0]
    raise UsageError(f"stagetool.inspect: donate={donate!r} is not an argument position or keyword name",
                     hint="give donate=0, donate='params' or donate=(0, 'opt_state')")


def _check_option_types(*, name: Any = None, platform: Any = None, topology: Any = None, slices: Any = None,
                        chip: Any = None, device_memory: Any = None, peak: Any = True, top: Any = 10,
                        out_shardings: Any = None, against: Any = None) -> None:
    """Refuse an option of the wrong type, naming it (never coerced: ``top=2.5`` is not 2).

    Raises:
      UsageError: the first wrong one.
    """
    for key, value in (("platform", platform), ("topology", topology), ("chip", chip),
                       ("device_memory", device_memory), ("against", against)):
        if value is not None and (not isinstance(value, str) or not value.strip() and key != "against"):
            raise UsageError(f"stagetool.inspect: {key}={value!r} must be a non-empty string or None")
    if not isinstance(peak, bool):
        raise UsageError(f"stagetool.inspect: peak={peak!r} must be True or False")
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise UsageError(f"stagetool.inspect: top={top!r} must be a whole number of 0 or more")
    if slices is not None and (isinstance(slices, bool) or not isinstance(slices, int) or slices < 1):
        raise UsageError(f"stagetool.inspect: slices={slices!r} must be a whole number of 1 or more, or None")


def _parameter_names(fn: Any, count: int) -> list[str]:
    """The Python parameter each of ``count`` positional arguments binds to (``args[i]`` where the
    signature does not say)."""
    import inspect as pyinspect

    names = [f"args[{i}]" for i in range(count)]
    try:
        params = list(pyinspect.signature(underlying(fn)).parameters.values())
    except (TypeError, ValueError):
        return names
    i = 0
    for p in params:
        if i >= count:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names[i] = p.name
            i += 1
        elif p.kind == p.VAR_POSITIONAL:
            for j in range(i, count):
                names[j] = f"{p.name}[{j - i}]"
            break
    return names


def _check_leaves(fn: Any, args: tuple, kwargs: dict) -> None:
    """Every array-like leaf's shape is one XLA can take (the spec's limits,
    :func:`stagetool.spec.leaves.shape_problem`: at most 2**32 per dimension, 2**57 elements), checked
    before any trace: a larger one aborts XLA or overflows its byte counts.

    Raises:
      UsageError: naming the Python parameter and the leaf's key path.
    """
    import jax

    from stagetool.spec.leaves import shape_problem

    named = list(zip(_parameter_names(fn, len(args)), args)) + list(kwargs.items())
    for pname, value in named:
        try:
            leaves = jax.tree_util.tree_flatten_with_path(value)[0]
        except Exception:  # noqa: BLE001 - a value that is no pytree is passed as it is
            continue
        for path, leaf in leaves:
            shape = getattr(leaf, "shape", None)
            if not isinstance(shape, tuple) or getattr(leaf, "dtype", None) is None:
                continue
            if any(not isinstance(d, int) or d < 0 for d in shape):
                continue  # a symbolic dimension: JAX says what it takes
            problem = shape_problem(shape)
            if problem:
                where = pname + jax.tree_util.keystr(path)
                raise UsageError(f"stagetool.inspect: argument {where}: {problem}",
                                 hint="give shapes XLA can compile (each leaf at most 2**57 elements)")


def caller_loc(frame: Any) -> Loc:
    """The caller's ``file:line`` (a notebook cell's name as IPython gives it)."""
    return Loc(frame.f_code.co_filename, frame.f_lineno, 1)


def mesh_spec(mesh: Any, args: tuple, kwargs: dict) -> MeshSpec:
    """The mesh as a :class:`MeshSpec` (see :func:`inspect`'s ``mesh``).

    Raises:
      UsageError: a mesh text that does not parse, or a value that is no mesh.
    """
    if mesh is None:
        # the arguments' mesh; of several meshes of the same devices (a state mesh, a batch's 1-D
        # one), the one with the most axes: the others' layouts are spelled over it (arguments.on_one_mesh)
        found = meshes((args, kwargs)) or meshes((args, kwargs), abstract=True)
        mesh = max(found, key=lambda m: sum(1 for s in m.shape.values() if s != 1)) if found else None
        if mesh is None:
            return MeshSpec(())
    if isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, str):
        from stagetool.core.mesh import parse_mesh_option

        try:
            return parse_mesh_option(mesh, MeshSpec(()))
        except ValueError as e:
            raise UsageError(f"stagetool.inspect: mesh={mesh!r}: {e}".replace("--mesh ", "")) from None
    if isinstance(mesh, Mapping):
        from stagetool.core.mesh import axis_name_problem, device_count_problem

        bad = [(k, v) for k, v in mesh.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad or not mesh:
            k, v = bad[0] if bad else (None, None)
            raise UsageError(f"stagetool.inspect: mesh={dict(mesh)!r}: "
                             + (f"axis {k!r} of size {v!r}: " if bad else "no axes: ")
                             + "each axis needs a name and a whole size of 1 or more",
                             hint="give mesh={'data': 2, 'model': 4}")
        problem = next(filter(None, map(axis_name_problem, mesh)), None) or device_count_problem(list(mesh.values()))
        if problem:
            raise UsageError(f"stagetool.inspect: mesh={dict(mesh)!r}: {problem}")
        return MeshSpec(tuple((k, v) for k, v in mesh.items()))
    shape = getattr(mesh, "shape", None)
    if isinstance(shape, Mapping):  # a jax.sharding.Mesh or AbstractMesh
        types = {str(t).rpartition(".")[2].lower() for t in (getattr(mesh, "axis_types", None) or ())}
        return MeshSpec(tuple((str(k), int(v)) for k, v in shape.items()),
                        "explicit" if types == {"explicit"} else "auto")
    raise UsageError(f"stagetool.inspect: mesh={mesh!r} is not a mesh",
                     hint="give a jax.sharding.Mesh, 'data=2,model=4', or {'data': 2, 'model': 4}")


_OPTION_NAMES = ("platform", "topology", "slices", "chip", "device-memory", "explain", "top", "against")


#: The spec's ``{mesh: staged}`` advice, and what the Python API does instead.
_SPEC_MESH_ADVICE = re.compile(r"(?:build|take) the [\w']+ mesh from the spec(?:'s)?:? \(?\{(?:call: [^()]*?|mesh: staged)\}+\)?")


_API_MESH_ADVICE = ("pass the mesh in a config as a static argument (static={'cfg': cfg}, or a config class registered "
                    "with jax.tree_util.register_static passed as it is: its mesh is re-laid on the staged one by "
                    "axis name)")


def api_words(text: str | None) -> str | None:
    """``text`` (a message or hint written for the CLI and the spec) in :func:`inspect`'s words: its
    parameters (``mesh='data=8'``, ``topology=v5e:2x4``), never a CLI flag or a spec key."""
    if not text:
        return text
    # the value alone: "(--mesh a=4,b=2), or" -> "(mesh='a=4,b=2'), or"
    text = re.sub(r"--mesh ([^\s),;]+(?:,[^\s),;=]+=[^\s),;]+)*)", lambda m: f"mesh={m.group(1)!r}", text)
    text = context_words(text).replace("--mesh", "mesh=")
    for name in _OPTION_NAMES:
        text = text.replace(f"--{name} ", name.replace("-", "_") + "=")
    text = _SPEC_MESH_ADVICE.sub(_API_MESH_ADVICE, text)
    return text.replace("the spec's mesh.axis_types", "the mesh's axis types").replace(
        "the spec's 'axis_types: explicit' under 'mesh:' (mesh: {axes: {...}, axis_types: explicit})",
        "a mesh with Explicit axes (mesh=jax.make_mesh(...), whose axis types it takes)")


def context_words(text: str) -> str:
    """``text`` with the context-mesh flag and spec key (``--no-context-mesh``, ``mesh.context: false``)
    as :func:`inspect`'s ``context_mesh=``."""
    return text.replace("--no-context-mesh (the spec's mesh.context: false)", "context_mesh=False").replace(
        "--context-mesh (the spec's mesh.context: true)", "context_mesh=True").replace(
        "--no-context-mesh, the spec's mesh.context: false", "context_mesh=False").replace(
        "--no-context-mesh", "context_mesh=False").replace("--context-mesh", "context_mesh=True")


@contextlib.contextmanager
def api_names() -> Iterator[None]:
    """A usage error names the option as :func:`inspect` takes it (``chip=``, ``mesh=``), not as the
    CLI or the spec does."""
    try:
        yield
    except UsageError as e:
        message, hint = api_words(e.message), api_words(e.hint)
        if (message, hint) == (e.message, e.hint):
            raise
        prefix = "" if message.startswith("stagetool.inspect") else "stagetool.inspect: "
        raise UsageError(f"{prefix}{message}", hint=hint) from None
