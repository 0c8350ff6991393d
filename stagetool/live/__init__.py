"""The live function: :func:`inspect` stages a function the caller holds, on the arguments it holds.

The live objects are the plan's inputs: the function is the plan's loaded target, each argument a
:class:`stagetool.spec.model.ValueSpec` (staged as a ``{ref:}`` object is: arrays become
``jax.ShapeDtypeStruct``s with the shardings they carry, Flax NNX/Linen and Equinox objects as
they are), and the pipeline (:func:`stagetool.pipeline.make_plan` → devices → inputs → stage →
report) runs as it does for a spec file, so the report is the CLI's ``report``.

This module is the call itself (:func:`inspect` → :func:`run_inspect` → :func:`inspect_here`, one
compile, failures raised); the rest, one concept a module:

* :mod:`~stagetool.live.options`: the options checked and resolved before any trace
  (:class:`InspectOptions`), and messages worded as :func:`inspect` takes them;
* :mod:`~stagetool.live.target`: the function as the plan's target (its name, a ``Traced``);
* :mod:`~stagetool.live.arguments`: the arguments as the spec's values, on the staged mesh;
* :mod:`~stagetool.live.report`: :class:`~stagetool.live.report.LiveReport`, each section analysed
  when first read; :mod:`~stagetool.live.isolated`: ``isolate=True``'s worker;
  :mod:`~stagetool.live.asserts` and :mod:`~stagetool.live.pytest_plugin`: tests.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from stagetool.core.errors import StagingError, UsageError
from stagetool.core.location import Loc
from stagetool.live.arguments import on_one_mesh, relaid_arguments, relaid_static, spec_out_shardings, spec_value
from stagetool.live.options import InspectOptions, api_names, api_words, caller_loc, context_words, resolve_options
from stagetool.live.target import from_stages, function_label, loaded_target

if TYPE_CHECKING:
    from stagetool.report.model import Report

__all__ = ["SECTIONS", "InspectOptions", "api_words", "exit_refused", "function_label", "inspect", "inspect_here",
           "raise_failure", "run_inspect"]

#: What :func:`inspect` computes from its one compile (``stagetool report``'s sections).
SECTIONS = ("shardings", "collectives", "cost", "memory")


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
    return run_inspect(fn, args, kwargs, loc=caller_loc(sys._getframe(1)), isolate=isolate, timeout_s=timeout_s,
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
    fn, args, kwargs, options = from_stages(fn, args, kwargs, options)
    resolved = resolve_options(fn, args, kwargs, loc=loc, **options)
    kwargs = {k: v for k, v in kwargs.items() if k not in resolved.static}
    notes: list[str] = []
    args, kwargs = on_one_mesh(fn, args, kwargs, resolved.mesh, notes)  # before an isolated run drops the meshes
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

    target = loaded_target(fn, options.target)
    notes = list(options.notes)
    fspec = FunctionSpec(options.name, options.target, tuple(spec_value(a, options.loc) for a in args),
                         {k: spec_value(v, options.loc) for k, v in kwargs.items()}, dict(options.static),
                         tuple(options.donate), spec_out_shardings(options.out_shardings), options.loc, Path.cwd())
    spec = Spec(None, options.mesh, options.platform, options.topology, "global", {options.name: fspec})
    with api_names():
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
    with exit_refused(options.name) as signal_notes, api_names():
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


def exit_refused(name: str = "fn") -> Any:
    """Stage ``name`` within: ``os._exit`` from any thread is refused, forks end at once in the child
    (:func:`stagetool.process.containment.contained`; see docs/python-api.md, "How far the Python
    API protects the caller")."""
    from stagetool.process.containment import contained

    return contained(name)


def raise_failure(report: Report) -> None:
    """Fail closed: a report whose function failed to stage is raised as a :class:`StagingError`."""
    for f in report.functions:
        if f.error is not None:
            error = context_words(f.error)  # its hint in inspect's words
            raise StagingError(error if error.startswith(f"{f.name}:") else f"{f.name}: {error}",
                               stage="compile", function=f.name)
