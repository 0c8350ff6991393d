"""haliax (Levanter's named arrays), as Levanter writes it (imported only when the user's objects are haliax's).

- haliax is built on Equinox: Python numbers are static (``named_jit`` and ``eqx.filter_eval_shape``
  split with ``eqx.is_array``), not traced.
- ``hax.named_jit`` targets (Levanter's train step, ``named_jit(axis_resources=..., donate_args=(True,))``)
  are staged as haliax's own program (:class:`HaliaxProgram`): the ``jax.jit`` that
  ``named_jit(...).lower(...)`` lowers, on the arguments split as haliax splits them, with its
  donation, its static non-array leaves and the in/out shardings its axis mappings give.

Every read of haliax's internals is here and marked ``# private-api:`` (pinned by
``tests/inputs/test_haliax.py``): the ``named_jit`` object's fields (``_fn``, ``_dynamic_fun``,
``_static_fun``, ``_axis_resources``, ``_in_axis_resources``, ``_out_axis_resources``,
``_donate_args``, ``_donate_kwargs``, ``_pjit_args``) and ``haliax.partitioning._named_pjit_cache``
(the ``jax.jit`` it builds). ``named_jit(...).lower`` itself is public but takes concrete arrays only
(a ``ShapeDtypeStruct`` is not an array to ``eqx.is_array``: it would be static), so stagetool runs
the steps of haliax's ``_NamedJitWrapper._call`` on the abstract leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax

from stagetool.core.errors import UsageError
from stagetool.inputs.frameworks.equinox import placeholder_call
from stagetool.inputs.frameworks.jit import JitSettings

#: hook: Python numbers are static, not traced (see stagetool.inputs.frameworks)
STATIC_SCALARS = True

KIND = "haliax.named_jit"

#: the fields of haliax's ``_NamedJitWrapper`` read here (haliax 1.4; pinned by a test)
_FIELDS = ("_fn", "_dynamic_fun", "_static_fun", "_axis_resources", "_in_axis_resources", "_out_axis_resources",
           "_donate_args", "_donate_kwargs", "_pjit_args")


def is_named_jit(fn: Any) -> bool:
    """A ``hax.named_jit`` object (haliax's ``_NamedJitWrapper``, known by module and class name)."""
    return type(fn).__module__ == "haliax.partitioning" and type(fn).__name__ == "_NamedJitWrapper"


@dataclasses.dataclass(frozen=True)
class NamedJit:
    """What ``hax.named_jit(fn, axis_resources, in_axis_resources=..., out_axis_resources=...,
    donate_args=..., donate_kwargs=..., **pjit_args)`` was made with (haliax's split of ``fn`` into
    its arrays, ``dynamic_fun``, and the rest, ``static_fun``, included)."""

    fn: Callable[..., Any]
    dynamic_fun: Any
    static_fun: Any
    axis_resources: Any
    in_axis_resources: Any
    out_axis_resources: Any
    donate_args: Any
    donate_kwargs: Any
    pjit_args: dict


def read(w: Any) -> NamedJit:
    """The fields of a ``named_jit`` object (see :func:`is_named_jit`), the one place they are read."""
    return NamedJit(  # private-api: haliax's _NamedJitWrapper fields (no public accessor), read here only
        w._fn, w._dynamic_fun, w._static_fun,  # private-api: its function, and the function's arrays / rest
        w._axis_resources, w._in_axis_resources, w._out_axis_resources,  # private-api: its axis mappings
        w._donate_args, w._donate_kwargs, dict(w._pjit_args))  # private-api: its donation and jit arguments


def _donate_flags(donate_args: Any, n_args: int) -> tuple:
    """Per positional argument, its ``donate_args`` entry (a bool or a pytree of them), as
    ``_NamedJitWrapper._call`` expands it: one bool for all, a tuple padded with False."""
    if donate_args is None:
        return (False,) * n_args
    if isinstance(donate_args, bool):
        return (donate_args,) * n_args
    flags = tuple(donate_args)
    return flags + (False,) * (n_args - len(flags))


def jit_settings(fn: Any, n_args: int) -> JitSettings | None:
    """A ``named_jit`` object's settings (None for another object): the positions and keyword names
    its ``donate_args``/``donate_kwargs`` donate (wholly or in part: a pytree of bools donates the
    leaves it marks; :class:`HaliaxProgram` marks each leaf), its jit's ``keep_unused``;
    ``readable=False`` where its fields are not the ones read here (another haliax)."""
    if not is_named_jit(fn):
        return None
    if not all(hasattr(fn, f) for f in _FIELDS):
        return JitSettings(KIND, None, False, wrapper=fn)
    nj = read(fn)
    flags = _donate_flags(nj.donate_args, n_args)
    nums = tuple(i for i, d in enumerate(flags) if any(x is not False for x in jax.tree_util.tree_leaves(d)))
    names = tuple(k for k, d in (nj.donate_kwargs or {}).items() if d is not False)
    return JitSettings(KIND, None, True, donate_argnums=nums, donate_argnames=names,
                       keep_unused=bool(nj.pjit_args.get("keep_unused", False)), wrapper=fn)


def with_donation(settings: JitSettings, n_args: int, donate_argnums: tuple[int, ...],
                  donate_argnames: tuple[str, ...]) -> JitSettings:
    """A ``named_jit`` target with the spec's donation: the function underneath given to
    ``hax.named_jit`` once more with the same axis mappings and jit arguments and
    ``donate_args``/``donate_kwargs`` for the merged positions and names (never a jit around the wrapper)."""
    import haliax as hax

    nj = read(settings.wrapper)
    again = hax.named_jit(nj.fn, nj.axis_resources, in_axis_resources=nj.in_axis_resources,
                          out_axis_resources=nj.out_axis_resources,
                          donate_args=tuple(i in donate_argnums for i in range(n_args)),
                          donate_kwargs={k: True for k in donate_argnames} or None, **nj.pjit_args)
    return jit_settings(again, n_args) or settings


class HaliaxProgram:
    """What a ``named_jit`` target compiles when run: haliax's ``jax.jit(fun_wrapped, donate_argnums=0,
    static_argnums=2, in_shardings=..., out_shardings=...)`` on ``(donated, kept, static)``.

    ``named_jit`` splits ``(function, (args, kwargs))`` with ``eqx.is_array`` (arrays dynamic,
    everything else — Python numbers, static fields, functions — static, neither an input nor an
    output), the dynamic part by ``donate_args``/``donate_kwargs`` into donated and kept; under its
    ``axis_resources`` mapping it gives the outputs the shardings of ``out_axis_resources`` (default
    ``axis_resources``) and, with ``in_axis_resources``, the inputs theirs; the jit returns
    ``(array outputs, Static(the rest))``. :func:`haliax_program` does the same on the abstract
    leaves, with the staged mesh.

    Attributes:
      wrapper: the ``named_jit`` object.
      jitted: the ``jax.jit`` haliax builds for this call (with its in/out shardings).
      args: ``(donated, kept)`` with the abstract leaves; ``kwargs``: {}.
      static: haliax's static part (the jit's static argument).
      axis_resources: the mapping active while tracing (as ``named_jit`` traces), or None.
      donated_ids: ``id`` of each abstract leaf that is donated.
      rules: logical axis rules held active while tracing (a context manager factory), or None.
      notes: sentences for the report (a ``named_jit`` with no axis mapping to stage with).
    """

    def __init__(self, wrapper: Any, jitted: Any, args: tuple, static: Any, axis_resources: Any, rules: Any = None):
        self.wrapper = wrapper
        self.jitted = jitted
        self.args = args
        self.kwargs: dict = {}
        self.static = static
        self.axis_resources = axis_resources
        self.rules = rules
        self.donated_ids = {id(x) for x in jax.tree_util.tree_leaves(args[0])}
        self.notes: tuple[str, ...] = ()
        self._stagetool_wraps = read(wrapper).fn  # the function under named_jit: errors point at the user's step

    def trace(self, donated: Any, kept: Any) -> Any:
        """haliax's jit traced as ``named_jit(...).lower`` lowers it (under its axis mapping);
        returns the ``jax.stages.Traced``."""
        with _mapping(self.axis_resources), (self.rules() if self.rules else contextlib.nullcontext()):
            return self.jitted.trace(donated, kept, self.static)

    def output_paths(self, out_info: Any, keypath: Callable[[tuple], str]) -> list[str]:
        """``out/...`` for the function's array outputs (haliax's ``Static`` part has no leaves)."""
        return ["out" + keypath(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(out_info[0])[0]]


#: the haliax releases whose named_jit internals this module reads (pyproject's ``haliax`` extra)
SUPPORTED = "marin-haliax 0.2 (Levanter's haliax) and haliax >= 1.4.dev453"

#: the parameters of ``haliax.partitioning.infer_resource_partitions`` this module needs
_INFER_PARAMETERS = ("mesh",)


def _infer_shardings(tree: Any, mapping: Any, mesh: Any) -> Any:
    """haliax's public ``infer_resource_partitions(tree, mapping, mesh=mesh)`` as ``named_jit`` calls it
    for this release: haliax 1.4 with ``preserve_existing_shardings=False`` (what its ``_call``
    passes), marin-haliax 0.2 without (it has no such parameter: a leaf no mapping names keeps the
    sharding it carries, as its ``_call`` leaves it)."""
    import inspect

    from haliax.partitioning import infer_resource_partitions

    try:
        params = inspect.signature(infer_resource_partitions).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin or C function
        params = {}
    extra = {"preserve_existing_shardings": False} if "preserve_existing_shardings" in params else {}
    return infer_resource_partitions(tree, mapping, mesh=mesh, **extra)


def haliax_release() -> str:
    """``haliax 1.4.dev453`` / ``marin-haliax 0.2.20``: the distribution that provides ``haliax``."""
    from importlib import metadata

    for dist in metadata.packages_distributions().get("haliax", []) or ["haliax"]:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "haliax (version unknown)"


def check_supported(fn: Any) -> None:
    """Refuse (exit 2, before any trace) a haliax whose ``named_jit`` is not built the way this module
    rebuilds it: ``infer_resource_partitions`` without the ``mesh`` parameter it passes, or no
    ``_named_pjit_cache``. Never a ``TypeError`` from deep inside staging.

    Raises:
      UsageError: naming the installed release, what it lacks, the releases read, and the way out.
    """
    import inspect

    from haliax import partitioning

    try:
        params = inspect.signature(partitioning.infer_resource_partitions).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin or C function
        params = {}
    lacking = [f"infer_resource_partitions({p}=...)" for p in _INFER_PARAMETERS if p not in params]
    if not callable(getattr(partitioning, "_named_pjit_cache", None)):  # private-api: named_jit's jit builder
        lacking.append("haliax.partitioning._named_pjit_cache")
    if lacking:
        # private-api: named_jit keeps the step as __wrapped__ (functools.wraps), read for its name alone
        name = getattr(getattr(fn, "__wrapped__", None), "__qualname__", None) or "the step"
        raise UsageError(
            f"{name} is a named_jit of {haliax_release()}, whose named_jit stagetool cannot rebuild: it lacks "
            f"{', '.join(lacking)}; stagetool stages named_jit steps of {SUPPORTED}",
            hint="install a supported haliax (pip install 'marin-haliax>=0.2', Levanter's), or stage the function "
                 "under named_jit (its __wrapped__) with the spec's donate and out_shardings")


def _mapping(axis_resources: Any) -> Any:
    import haliax as hax

    return hax.axis_mapping(axis_resources) if axis_resources is not None else contextlib.nullcontext()


def _haliax_jit(nj: NamedJit, call: tuple[tuple, dict], dynamic: tuple, mesh: Any, rules: Any) -> tuple[Any, Any]:
    """``(jax.jit, axis mapping)``: the jit ``_NamedJitWrapper._call`` builds for ``call`` and the
    mapping it traces under. Its output shapes come from ``eqx.filter_eval_shape`` under the staged
    mesh; the shardings from haliax's public ``infer_resource_partitions`` given that mesh
    (:func:`_infer_shardings`; haliax
    would find it in the mesh context, but its ``is_in_jit`` runs an op eagerly, which compile-only
    devices cannot: so it runs here, outside ``jax.set_mesh``)."""
    import equinox as eqx
    import haliax as hax
    from haliax.partitioning import _named_pjit_cache  # private-api: the jax.jit named_jit builds (cached)

    # as _NamedJitWrapper._call: the mapping given, else the thread's; outputs by out_axis_resources
    axis_resources = nj.axis_resources
    if axis_resources is None:
        axis_resources = hax.partitioning.current_thread_local_mapping()
    out_axis_resources = nj.out_axis_resources if nj.out_axis_resources is not None else axis_resources
    args, kwargs = call
    with _mapping(axis_resources), (rules() if rules else contextlib.nullcontext()):
        with jax.set_mesh(mesh):
            output_shape = eqx.filter_eval_shape(nj.fn, *args, **kwargs)
        pjit_args = dict(nj.pjit_args)
        if nj.in_axis_resources is not None:
            pjit_args["in_shardings"] = _infer_shardings(dynamic, nj.in_axis_resources, mesh)
        if out_axis_resources is not None:
            pjit_args["out_shardings"] = _infer_shardings(output_shape, out_axis_resources, mesh)
        return _named_pjit_cache(nj.fn, **pjit_args), axis_resources


def haliax_program(settings: JitSettings, args: tuple, kwargs: dict, mesh: Any, rules: Any = None
                   ) -> HaliaxProgram | None:
    """The :class:`HaliaxProgram` of a ``named_jit`` target called with ``(args, kwargs)``
    (``ShapeDtypeStruct`` leaves and static values) on ``mesh`` (the staged ``jax.sharding.Mesh``),
    or None where haliax's internals are not the ones read here (another haliax), the function
    closes over arrays (inputs the spec does not name), or an argument holds a ``jax.Ref``.

    Raises:
      UsageError: a haliax release whose named_jit is not built as this module rebuilds it
        (:func:`check_supported`, exit 2).
      whatever haliax raises splitting the call (a ``donate_args`` that does not fit the arguments) or
      tracing the function for its output shapes.
    """
    import equinox as eqx
    from haliax.tree_util import hashable_partition

    if settings.kind != KIND or not settings.readable:
        return None
    check_supported(settings.wrapper)
    nj = read(settings.wrapper)
    if jax.tree_util.tree_leaves(nj.dynamic_fun):  # the function closes over arrays: inputs the spec does not name
        return None
    called = placeholder_call(args, kwargs)
    if called is None:
        return None
    a, k, back = called
    # As _NamedJitWrapper._call: arrays dynamic, the rest static; then donated / kept by donate_args
    dynamic_argspec, static_argspec = hashable_partition((a, k), eqx.is_array)
    dynamic_argspec = jax.tree_util.tree_map(lambda x: back.get(id(x), x), dynamic_argspec)
    if len(jax.tree_util.tree_leaves(dynamic_argspec)) != len(back):
        return None  # haliax kept an abstract leaf static: not a split this module knows
    dynamic = (nj.dynamic_fun, dynamic_argspec)
    if nj.donate_args is not None or nj.donate_kwargs is not None:
        dargs = _donate_flags(nj.donate_args, len(args))
        if len(dargs) != len(args):
            raise ValueError(f"Expected {len(args)} donate_args, got {len(dargs)}")
        dkwargs = nj.donate_kwargs or {name: False for name in kwargs}
        dkwargs = {name: dkwargs.get(name, False) for name in kwargs}
        donated, kept = eqx.partition(dynamic, (False, (dargs, dkwargs)))
    else:
        donated, kept = jax.tree_util.tree_map(lambda _: None, dynamic), dynamic
    static = (nj.static_fun, static_argspec)
    jitted, axis_resources = _haliax_jit(nj, (tuple(args), dict(kwargs)), (donated, kept), mesh, rules)
    program = HaliaxProgram(settings.wrapper, jitted, (donated, kept), static, axis_resources, rules)
    if axis_resources is None:
        program.notes = (f"{getattr(nj.fn, '__qualname__', 'the step')} is a named_jit without axis_resources: haliax "
                         "takes the mapping active where it is called (hax.axis_mapping), and none is active while "
                         "stagetool stages it, so the program has none (outputs the compiler's choice, hax.shard "
                         "inside a no-op); give named_jit its axis_resources to stage the mapping it runs with",)
    return program
