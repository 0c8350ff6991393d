"""The live function: :func:`inspect` stages a function the caller holds, on the arguments it holds.

The live objects are the plan's inputs: the function is the plan's loaded target, each argument a
:class:`stagetool.spec.model.ValueSpec` (staged as a ``{ref:}`` object is: arrays become
``jax.ShapeDtypeStruct``s with the shardings they carry, Flax NNX/Linen and Equinox objects as
they are), and the pipeline (:func:`stagetool.pipeline.make_plan` → devices → inputs → stage →
report) runs as it does for a spec file, so the report is the CLI's ``report``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from stagetool.core.errors import StagingError, UsageError
from stagetool.core.location import Loc
from stagetool.core.mesh import MeshSpec

if TYPE_CHECKING:
    from stagetool.report.model import Report

#: What :func:`inspect` computes from its one compile (``stagetool report``'s sections).
SECTIONS = ("shardings", "collectives", "cost", "memory")


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


def inspect(fn: Callable[..., Any], *args: Any, mesh: Any = None, topology: str | None = None,
            platform: str | None = None, slices: int | None = None, donate: int | str | Iterable[int | str] = (),
            static: Mapping[str, Any] | Iterable[str] | None = None, out_shardings: Any = None,
            chip: str | None = None, device_memory: str | None = None, peak: bool = True, top: int = 10,
            explain: Iterable[str] = (), name: str | None = None, isolate: bool = False,
            timeout_s: float | None = None, context_mesh: bool | None = None, against: str | None = None,
            **kwargs: Any):
    """Stage ``fn(*args, **kwargs)`` through ``jax.jit`` on a mesh and report what XLA does with it:
    the :class:`stagetool.report.model.Report` of ``stagetool report`` (shardings, collectives,
    cost, memory; one compile), which displays as the HTML report in a notebook.

    Args:
      fn: a function, or a ``jax.jit`` / ``nnx.jit`` / ``eqx.filter_jit`` / ``hax.named_jit`` wrapper (its own static
        arguments, donation, in/out shardings and compiler options hold, as for a spec target); or
        a ``jax.stages.Traced`` (``jax.jit(f).trace(*args)``, given alone): its equations staged
        with the shardings and donation its own compile gives the arguments (one more compile).
      args, kwargs: the arguments, as the function takes them: arrays (``jax.Array``, NumPy), which
        are not computed on, only their shapes, dtypes and shardings read (a ``NamedSharding``'s
        PartitionSpec is laid over this run's mesh by axis name); ``jax.ShapeDtypeStruct``s (with a
        ``sharding=`` or not: then replicated, and the report says the sharding was unknown); Flax
        NNX modules and optimizers, Linen parameter dicts, Equinox modules; Python numbers (traced
        weakly typed, as ``jax.jit`` does) and other values (passed as they are). A keyword argument
        whose name is one of this function's options must go in through ``functools.partial``.
      mesh: a ``jax.sharding.Mesh`` (its axis names, sizes and types), ``"data=2,model=4"``, or a
        ``{name: size}`` mapping; None: the mesh of the arguments' ``NamedSharding``s (of several
        meshes of the same devices, the one with the most axes; ``ShapeDtypeStruct``s sharded over
        a ``jax.sharding.AbstractMesh``: its axes), else one device. An argument on
        another mesh of the same devices (a batch on a 1-D ``("devices",)`` mesh) is staged with the
        same layout spelled over this mesh's axes, as ``jax.jit`` takes it (a note says so); where no
        spec over this mesh lays it alike (a 4x2 mesh beside a staged 2x4 one), with its own sharding
        (its own per-device shape; the report names its mesh). An argument on other devices is a
        ``SpecError`` naming both meshes, as ``jax.jit`` refuses it.
      topology: a compile-only target (``v5e:2x4``, ``h100:8``; ``v5e:1x1`` needs no mesh): no such
        device needed.
      context_mesh: trace under the staged mesh as the context mesh (``jax.set_mesh``: True) or under
        none (False); None: as the code runs (under the staged mesh where this call runs under a
        context mesh, the axes are Explicit or the code cannot trace without one; else under none),
        as the spec's ``mesh.context``.
      platform: ``cpu`` | ``gpu`` | ``tpu``; None: JAX's default backend.
      slices: TPU slices of ``topology`` joined over DCN.
      donate: positions or keyword names of donated arguments.
      static: static keyword arguments: ``{name: value}``, or names of ``kwargs`` to treat as static.
        A static value holding a ``jax.sharding.Mesh`` with the staged mesh's axis names (a config
        with ``mesh=``) is given the staged mesh in its place (``topology=``: re-laid by axis name;
        a note says so).
      out_shardings: a pytree of ``PartitionSpec`` (or None per output) for the outputs.
      chip: a chip of the roofline table (``stagetool/core/chips.py``, or the spec's ``chips:``), for a
        step-time estimate.
      device_memory: per-device capacity such as ``16GiB``, else the device's or topology's.
      peak: record memory over time (XLA's live-range dump with the one compile); the HTML report
        draws it and lists the buffers live at the peak.
      top: how many largest inputs and peak buffers to list.
      explain: input leaves whose collectives to trace (key paths, their last part, or regexes).
      name: the function's name in the report (default: its ``__name__``).
      isolate: stage in a worker process of its own (:mod:`stagetool.process.workers`): a function
        that exits or aborts its process cannot end the caller's, and is a :class:`StagingError`.
        ``fn`` must then be importable by reference (a module-level function), the arguments
        must pickle once their arrays are replaced by shapes, dtypes and PartitionSpecs, and a
        script must call it under ``if __name__ == "__main__":`` (the worker is spawned).
      timeout_s: with ``isolate``, seconds the worker may take (default 1800).
      against: a compile-only target (``v5e:2x4``, ``h100:8``; a name alone, ``v5e``, sized by the
        mesh), as the CLI's ``--against``: the same program staged for it too (one more compile,
        no such device needed), every difference between the two compiles marked: the function's
        ``against`` section (collectives, temporaries, peak, FLOPs, replicated work; each side's
        figure) and each collective row the target compiles otherwise. The report's other sections
        stay this run's.

    Returns:
      The :class:`~stagetool.report.model.Report` (one function; a
      :class:`stagetool.live.report.LiveReport`): staged and compiled once, here; each section is
      analysed from that compile when first asked for — ``report.memory``, ``report.collectives``,
      ``report.cost``, ``report.shardings`` and ``report.why(leaf=...)`` analyse and display their
      own, ``report.functions`` (every renderer, the notebook's HTML) all of them.

    Raises:
      UsageError: a bad option (mesh, topology, chip, against, ...), before any trace (exit code 2 in
        the CLI); ``against`` not a compile-only target, or one whose device count is not the mesh's.
      SpecError: an argument's sharding does not fit its shape or names an axis the mesh lacks, a
        donated or static name the function does not take (with the caller's line).
      StagingError: JAX or XLA failed to trace, lower or compile (JAX's message and the user's
        frame), the function raised or called ``sys.exit``, or (``isolate``) its process died or
        timed out. A failure never gives a report.
    """
    return run_inspect(fn, args, kwargs, loc=_caller(sys._getframe(1)), isolate=isolate, timeout_s=timeout_s,
                       mesh=mesh, topology=topology, platform=platform, slices=slices, donate=donate, static=static,
                       out_shardings=out_shardings, chip=chip, device_memory=device_memory, peak=peak, top=top,
                       explain=explain, name=name, context_mesh=context_mesh, against=against)


def run_inspect(fn: Callable[..., Any], args: tuple, kwargs: dict, *, loc: Loc | None, isolate: bool = False,
                timeout_s: float | None = None, **options: Any):
    """:func:`inspect` with the caller's line given (``loc``: the line input errors name), for
    callers that wrap it (the pytest fixture)."""
    import math

    if not isinstance(isolate, bool):
        raise UsageError(f"stagetool.inspect: isolate={isolate!r} must be True or False")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not math.isfinite(timeout_s) or timeout_s <= 0):
        raise UsageError(f"stagetool.inspect: timeout_s={timeout_s!r} must be a positive number of seconds or None")
    fn, args, kwargs, options = _from_stages(fn, args, kwargs, options)
    resolved = _options(fn, args, kwargs, loc=loc, **options)
    kwargs = {k: v for k, v in kwargs.items() if k not in resolved.static}
    notes: list[str] = []
    args, kwargs = _on_one_mesh(fn, args, kwargs, resolved.mesh, notes)  # before an isolated run drops the meshes
    resolved = dataclasses.replace(resolved, notes=tuple(notes))
    if isolate:
        from stagetool.live.isolated import inspect_isolated

        return inspect_isolated(fn, args, kwargs, resolved, timeout_s=timeout_s)
    return inspect_here(fn, args, kwargs, resolved)


def inspect_here(fn: Callable[..., Any], args: tuple, kwargs: dict, options: InspectOptions):
    """:func:`inspect` in this process, with its options resolved (see :class:`InspectOptions`).
    While the function is staged, ``os._exit`` raises ``SystemExit`` instead of ending the process
    and a forked child ends at once (:mod:`stagetool.process.containment`), so that a function
    calling ``os._exit`` is a :class:`StagingError` and one that forks does not hold the caller."""
    from stagetool.pipeline import Options, Section, assemble_report, failure_report, make_plan, prepare_inputs, \
        provision_devices, relative_report, stage_once
    from stagetool.spec.model import FunctionSpec, Spec

    target = _target(fn, options)
    notes = list(options.notes)
    fspec = FunctionSpec(options.name, options.target, tuple(_value(a, options.loc) for a in args),
                         {k: _value(v, options.loc) for k, v in kwargs.items()}, dict(options.static),
                         tuple(options.donate), _out_shardings(options.out_shardings), options.loc, Path.cwd())
    spec = Spec(None, options.mesh, options.platform, options.topology, "global", {options.name: fspec})
    with _api_names():
        named_by = "topology=" if options.topology else "platform=" if options.platform else None
        plan = make_plan(Options(platform=options.platform, topology=options.topology, slices=options.slices,
                                 target_named_by=named_by,
                                 chip=options.chip, device_memory=options.device_memory, peak=options.peak,
                                 top=options.top, explain=tuple(options.explain), against=options.against),
                         spec=spec)
        setup = provision_devices(plan)
    static, relaid = relaid_static(options.static, setup.mesh)
    fspec, relaid_args = relaid_arguments(fspec, setup.mesh, fn)
    if relaid or relaid_args:
        notes += relaid + relaid_args
        fspec = dataclasses.replace(fspec, static=static)
        plan = dataclasses.replace(plan, functions=(fspec,))
    wanted = frozenset(Section(s) for s in SECTIONS)
    failure: StagingError | None = None
    with exit_refused(options.name) as signal_notes, _api_names():
        prepared = prepare_inputs(plan, setup, targets={options.name: target})
        prep = prepared[options.name]
        if notes and prep.inputs is not None:
            prepared = {**prepared, options.name: dataclasses.replace(
                prep, inputs=dataclasses.replace(prep.inputs, notes=(*notes, *prep.inputs.notes)))}
        try:
            once = stage_once(plan, setup, prepared[options.name])
        except StagingError as e:
            failure = e
    if failure is not None:
        # the pipeline's own account of the failure (XLA's message, an out-of-memory verdict), made
        # from this one failure: the function is never staged a second time (a second jax.jit of
        # what failed can crash the process: jax.jit(np.ndarray.sum), jax 0.10.2)
        failed = failure_report(plan, setup, prepared[options.name], wanted, failure)
        report = assemble_report("report", (relative_report(plan.report_root, failed),))
        try:
            raise_failure(report)
        except StagingError as e:
            if signal_notes:  # what the function set on its way, undone
                e.hint = "; ".join(filter(None, (e.hint, *signal_notes)))
            raise
        return report
    if signal_notes and once.prep.inputs is not None:
        once.prep = dataclasses.replace(once.prep, inputs=dataclasses.replace(
            once.prep.inputs, notes=(*once.prep.inputs.notes, *signal_notes)))
    from stagetool.live.report import LiveReport

    live = LiveReport(once, assemble_report("report", ()), SECTIONS)
    if plan.against is not None:
        _mark_against(live, fn, args, kwargs, options, plan.against)
    return live


def _mark_against(live: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, options: InspectOptions,
                  target: Any) -> None:
    """``against=``: the same function staged for the compile-only ``target`` (as ``topology=`` stages
    it: the arguments laid on its mesh by axis name), and ``live``'s function given the ``against``
    section of every difference (:func:`stagetool.pipeline.against_function`, the CLI's)."""
    from stagetool.pipeline import Section, against_function

    there_options = dataclasses.replace(options, topology=target.name, platform=None, slices=None, chip=None,
                                        explain=(), against=None, peak=options.peak)
    try:
        there: Any = inspect_here(fn, args, kwargs, there_options).functions[0]
    except StagingError as e:
        there = e.message
    marked = against_function(live._analysed(SECTIONS), there, target, (Section(s) for s in SECTIONS))
    live._partial[tuple(sorted(SECTIONS))] = marked


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
    text = _context_words(text).replace("--mesh", "mesh=")
    for name in _OPTION_NAMES:
        text = text.replace(f"--{name} ", name.replace("-", "_") + "=")
    text = _SPEC_MESH_ADVICE.sub(_API_MESH_ADVICE, text)
    return text.replace("the spec's mesh.axis_types", "the mesh's axis types").replace(
        "the spec's 'axis_types: explicit' under 'mesh:' (mesh: {axes: {...}, axis_types: explicit})",
        "a mesh with Explicit axes (mesh=jax.make_mesh(...), whose axis types it takes)")


def _context_words(text: str) -> str:
    """``text`` with the context-mesh flag and spec key (``--no-context-mesh``, ``mesh.context: false``)
    as :func:`inspect`'s ``context_mesh=``."""
    return text.replace("--no-context-mesh (the spec's mesh.context: false)", "context_mesh=False").replace(
        "--context-mesh (the spec's mesh.context: true)", "context_mesh=True").replace(
        "--no-context-mesh, the spec's mesh.context: false", "context_mesh=False").replace(
        "--no-context-mesh", "context_mesh=False").replace("--context-mesh", "context_mesh=True")


@contextlib.contextmanager
def _api_names() -> Iterator[None]:
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


def _on_one_mesh(fn: Any, args: tuple, kwargs: dict, mesh_spec: MeshSpec, notes: list[str]) -> tuple[tuple, dict]:
    """The arguments with each array or ``ShapeDtypeStruct`` on another mesh of the same devices (a
    batch on a 1-D ``("devices",)`` mesh beside a 2-D state mesh, as ``jax.jit`` takes them) given the
    equivalent ``PartitionSpec`` on the mesh staged over (the first argument mesh with the staged
    axis names), one note per argument; an argument no spec over that mesh lays alike, as it is."""
    import jax
    from jax.sharding import NamedSharding

    from stagetool.inputs.own_mesh import equivalent_spec

    names = tuple(mesh_spec.names)
    ref = next((m for m in _meshes((args, kwargs)) if tuple(m.axis_names) == names), None)
    if ref is None:
        return args, kwargs
    try:
        params = list(__import__("inspect").signature(_underlying(fn)).parameters)
    except (TypeError, ValueError):
        params = []
    from stagetool.devices.world import describe_mesh

    def moved(x: Any, what: str, depth: int = 0) -> Any:
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            s = getattr(x, "sharding", None)
            if not isinstance(s, NamedSharding) or s.mesh == ref or s.mesh.empty:
                return x
            spec = equivalent_spec(s, ref, len(x.shape))
            if spec is None:
                return x
            notes.append(f"{what} is laid on another mesh of the same devices ({describe_mesh(s.mesh)}, "
                         f"{s.spec}); staged as the same layout on the mesh ({describe_mesh(ref)}): {spec}, as "
                         "jax.jit takes it")
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(ref, spec, memory_kind=s.memory_kind))
        if depth < 4 and type(x) in (list, tuple):
            return type(x)(moved(v, f"{what}[{i}]", depth + 1) for i, v in enumerate(x))
        if depth < 4 and type(x) is dict:
            return {k: moved(v, f"{what}[{k!r}]", depth + 1) for k, v in x.items()}
        return x

    args = tuple(moved(a, f"argument {params[i] if i < len(params) else i}") for i, a in enumerate(args))
    kwargs = {k: moved(v, f"argument {k}") for k, v in kwargs.items()}
    return args, kwargs


def _meshes(tree: Any, abstract: bool = False) -> list:
    """The concrete meshes the leaves' ``NamedSharding``s name, in order, each once; with ``abstract``,
    the ``jax.sharding.AbstractMesh``es instead (``ShapeDtypeStruct``s sharded over a mesh with no
    devices: its axis names, sizes and types)."""
    import jax
    from jax.sharding import AbstractMesh, Mesh

    out: list = []
    for leaf in jax.tree_util.tree_leaves(tree):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if isinstance(mesh, AbstractMesh if abstract else Mesh) and not mesh.empty and not any(mesh == m for m in out):
            out.append(mesh)
    return out


def relaid_static(static: Mapping[str, Any], staged: Any) -> tuple[dict, list[str]]:
    """``(static values, notes)``: each static value holding a ``jax.sharding.Mesh`` with the staged
    mesh's axis names that is not the staged mesh (a jax-llm-examples ``Config(mesh=...)`` of the
    caller's CPU mesh, staged with ``topology="v5e:2x4"``) with that mesh replaced by the staged
    one — re-laid by axis name, as the CLI's ``{mesh: staged}`` gives the code the staged mesh — in
    a frozen dataclass, a NamedTuple, a dict, list or tuple (four levels deep); one note per value.
    Values with no such mesh are the same objects."""
    out: dict = {}
    notes: list[str] = []
    from stagetool.devices.world import describe_mesh

    for name, value in static.items():
        found: list = []
        new = _replace_mesh(value, staged, found, 0)
        out[name] = new
        if found:
            notes.append(f"static={name!r} holds the mesh {describe_mesh(found[0])}; it is re-laid by axis name on "
                         f"the staged mesh ({describe_mesh(staged)}), as the same code with its mesh built for these "
                         "devices runs")
    return out, notes


def relaid_arguments(fspec: Any, staged: Any, fn: Any = None) -> tuple[Any, list[str]]:
    """``(fspec, notes)``: each argument that ``jax.jit`` takes as static although it is passed as an
    argument — a value with no array leaves, as a config class registered with
    ``jax.tree_util.register_static`` is (jax-llm-examples: ``step(x, cfg)``) — given the staged mesh
    in place of a mesh it holds with the staged axis names, as :func:`relaid_static` does for
    ``static=``; one note per argument. ``fspec`` (a :class:`~stagetool.spec.model.FunctionSpec` of
    :class:`~stagetool.spec.model.ValueSpec` arguments; ``fn``, the function, names them) is returned
    as it is when none holds one."""
    import jax

    from stagetool.devices.world import describe_mesh
    from stagetool.spec.model import ValueSpec

    try:
        params = list(__import__("inspect").signature(_underlying(fn)).parameters)
    except (TypeError, ValueError):
        params = []
    notes: list[str] = []

    def relaid(value: Any, what: str) -> Any:
        if not isinstance(value, ValueSpec) or jax.tree_util.tree_leaves(value.value):
            return value  # arrays (or leaves jax.jit traces): staged as they are, each on the mesh
        found: list = []
        new = _replace_mesh(value.value, staged, found, 0)
        if not found:
            return value
        notes.append(f"{what} holds the mesh {describe_mesh(found[0])} and is static to jax.jit (no array leaves: "
                     f"jax.tree_util.register_static); it is re-laid by axis name on the staged mesh "
                     f"({describe_mesh(staged)}), as the same code with its mesh built for these devices runs")
        return dataclasses.replace(value, value=new)

    args = tuple(relaid(a, f"argument {params[i] if i < len(params) else i}") for i, a in enumerate(fspec.args))
    kwargs = {k: relaid(v, f"argument {k}") for k, v in fspec.kwargs.items()}
    if not notes:
        return fspec, notes
    return dataclasses.replace(fspec, args=args, kwargs=kwargs), notes


def _replace_mesh(value: Any, staged: Any, found: list, depth: int) -> Any:
    from jax.sharding import Mesh

    if isinstance(value, Mesh):
        if value != staged and not value.empty and tuple(value.axis_names) == tuple(staged.axis_names):
            found.append(value)
            return staged
        return value
    if depth >= 4:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if not f.init:
                continue
            old = getattr(value, f.name)
            new = _replace_mesh(old, staged, found, depth + 1)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, tuple) and hasattr(value, "_replace") and hasattr(value, "_fields"):
        changes = {}
        for k in value._fields:
            old = getattr(value, k)
            new = _replace_mesh(old, staged, found, depth + 1)
            if new is not old:
                changes[k] = new
        return value._replace(**changes) if changes else value
    if type(value) in (list, tuple):
        items = [_replace_mesh(v, staged, found, depth + 1) for v in value]
        return type(value)(items) if any(a is not b for a, b in zip(items, value)) else value
    if type(value) is dict:
        items = {k: _replace_mesh(v, staged, found, depth + 1) for k, v in value.items()}
        return items if any(items[k] is not value[k] for k in value) else value
    return value


def exit_refused(name: str = "fn") -> Any:
    """Stage ``name`` within: ``os._exit`` from any thread is refused, forks end at once in the child
    (:func:`stagetool.process.containment.contained`; see docs/python-api.md, "How far the Python
    API protects the caller")."""
    from stagetool.process.containment import contained

    return contained(name)


def _from_stages(fn: Any, args: tuple, kwargs: dict, options: dict) -> tuple[Any, tuple, dict, dict]:
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


def raise_failure(report: Report) -> None:
    """Fail closed: a report whose function failed to stage is raised as a :class:`StagingError`."""
    for f in report.functions:
        if f.error is not None:
            error = _context_words(f.error)  # its hint in inspect's words
            raise StagingError(error if error.startswith(f"{f.name}:") else f"{f.name}: {error}",
                               stage="compile", function=f.name)


def _options(fn: Any, args: tuple, kwargs: dict, *, loc: Loc | None, mesh: Any = None, donate: Any = (),
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
    staged_mesh = dataclasses.replace(_mesh_spec(mesh, args, kwargs), context=context_mesh)
    return InspectOptions(mesh=staged_mesh, name=label, target=_target_text(fn, label), loc=loc,
                          donate=donate, static=dict(static), explain=tuple(explain), **rest)


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
        params = list(pyinspect.signature(_underlying(fn)).parameters.values())
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


def _caller(frame: Any) -> Loc:
    """The caller's ``file:line`` (a notebook cell's name as IPython gives it)."""
    return Loc(frame.f_code.co_filename, frame.f_lineno, 1)


def _underlying(fn: Any) -> Any:
    """The Python function under jit wrappers (for its file and name)."""
    seen = 0
    while seen < 8:
        inner = getattr(fn, "__wrapped__", None) or getattr(fn, "fun", None)
        if inner is None or inner is fn:
            return fn
        fn, seen = inner, seen + 1
    return fn


def _target_text(fn: Any, label: str) -> str:
    """How the report names the function: ``file.py:qualname`` for a function in a file (relative
    to the working directory when below it), ``module:qualname`` otherwise (a notebook cell)."""
    if getattr(fn, "stagetool_target", None):
        return fn.stagetool_target
    base = _underlying(fn)
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


def _target(fn: Any, options: InspectOptions) -> Any:
    from stagetool.inputs.target import Target

    code = getattr(_underlying(fn), "__code__", None)
    return Target(options.target, _fresh(fn), code.co_filename if code is not None else None,
                  options.target.rpartition(":")[2])


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


def _mesh_spec(mesh: Any, args: tuple, kwargs: dict) -> MeshSpec:
    """The mesh as a :class:`MeshSpec` (see :func:`inspect`'s ``mesh``).

    Raises:
      UsageError: a mesh text that does not parse, or a value that is no mesh.
    """
    if mesh is None:
        # the arguments' mesh; of several meshes of the same devices (a state mesh, a batch's 1-D
        # one), the one with the most axes: the others' layouts are spelled over it (_on_one_mesh)
        found = _meshes((args, kwargs)) or _meshes((args, kwargs), abstract=True)
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


def _first_mesh(tree: Any) -> Any:
    """The mesh of the first leaf carrying a ``NamedSharding``, or None."""
    import jax

    for leaf in jax.tree_util.tree_leaves(tree):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None and getattr(mesh, "shape", None):
            return mesh
    return None


def _value(x: Any, loc: Loc | None) -> Any:
    """One argument as the spec holds it: Python numbers and None as they are (traced as a spec's
    numbers are), anything else a :class:`ValueSpec` (NumPy arrays as ``ShapeDtypeStruct``s, since a
    ``{ref:}`` object's arrays are JAX arrays)."""
    from stagetool.spec.model import ValueSpec

    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return ValueSpec(_numpy_as_structs(x), loc or Loc("<inspect>", 0, 0))


def _numpy_as_structs(x: Any) -> Any:
    import jax
    import numpy as np

    leaves = jax.tree_util.tree_leaves(x)
    if not any(isinstance(v, (np.ndarray, np.generic)) for v in leaves):
        return x  # the object itself (NNX Variables keep their identity)
    return jax.tree_util.tree_map(
        lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) if isinstance(v, (np.ndarray, np.generic))
        else v, x)


def _out_shardings(tree: Any) -> Any:
    """``out_shardings`` as the spec holds them: each ``PartitionSpec`` a :class:`Sharding`."""
    if tree is None:
        return None
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from stagetool.core.sharding import Sharding, spec_dims

    def one(s: Any) -> Any:
        if isinstance(s, NamedSharding):
            s = s.spec
        if isinstance(s, PartitionSpec):
            return Sharding("spec", spec_dims(s))
        return s

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda s: isinstance(s, (PartitionSpec, NamedSharding)))
