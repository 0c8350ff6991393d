"""The run, as its data flow: a :class:`~stagetool.plan.plan.Plan` (made by
:func:`stagetool.plan.plan.make_plan` from :class:`~stagetool.plan.options.Options`, before any JAX
work) → devices + mesh (:func:`provision_devices`) → abstract inputs (:func:`prepare_inputs`) →
stages and analysis (:func:`stage_and_analyse`) → report (:func:`assemble_report`).

One direction, no back-and-forth; nothing here reads :class:`Options`. :func:`analyze` is the
Python API behind every command; it returns a :class:`stagetool.report.model.Report` that
renderers present. ``Options``, ``Section`` and ``make_plan`` are importable from here too.

What every run uses (the plan, its target, the errors, the report's records) is imported at the top;
a room a run may not need (a section's analysis, the facts cache, workers, a gate's snapshot, the
staging machinery that imports JAX) is imported in the function that uses it, so a command imports
only what it uses (issue 50: each module imported is compiled from source on a run without bytecode).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from stagetool._version import __version__
from stagetool.analysis.against import AgainstSection, compare, marked_collectives
from stagetool.analysis.causes import with_custom_rules
from stagetool.analysis.memory import unknown_sharding, unknown_sharding_note
from stagetool.analysis.sections import collectives_section, cost_section, memory_section, out_of_memory_section
from stagetool.analysis.shardings import REFUSED_INPUTS_NOTE, declared_input_leaves, input_leaves, output_leaves
from stagetool.core.errors import OutOfMemoryError, SpecError, StagingError, UsageError
from stagetool.core.mesh import MeshSpec, parse_mesh_option
from stagetool.core.paths import ReportRoot, rewrite_strings
from stagetool.hlo.collectives import MeshAxes
from stagetool.plan.options import REPORT_SECTIONS, Options, Section
from stagetool.plan.plan import Plan, Problems, make_plan, run_chip
from stagetool.plan.selectors import LeafPattern, unmatched_leaf_patterns
from stagetool.plan.target import (COMPILE_ONLY, Attached, CpuMesh, DeviceTarget, GpuTarget, TpuTarget, check_target,
                                   parse_target)
from stagetool.report.model import (DeviceInfo, DevicesReport, FunctionReport, MeshReport, ModuleText, Report,
                                    StageTimes)
from stagetool.spec.model import FunctionSpec

if TYPE_CHECKING:
    from stagetool.gate.run import SnapshotRun
    from stagetool.inputs.avals import AbstractInputs
    from stagetool.devices.provision import DeviceSetup
    from stagetool.staging.stages import Staged
    from stagetool.inputs.target import Target
    from stagetool.core.chips import Chip
    from stagetool.facts import StagedFunction
    from stagetool.staging.cache import FactsCache

__all__ = ["REPORT_SECTIONS", "Options", "Plan", "Section", "analyze", "analyze_against", "analyze_plan",
           "assemble_report",
           "devices_report", "make_plan", "prepare_inputs", "provision_devices", "snapshot_plan", "stage_and_analyse",
           "staged_functions", "take_snapshot"]

def analyze(options: Options, sections: Iterable[Section] = (Section.SHARDINGS,), *,
            command: str = "analyze", on_stage: Callable[[str, str], None] | None = None):
    """Stage every function of the plan and analyse it: the Python API behind every command.

    Args:
      options: what to stage and where (resolved once by :func:`make_plan`).
      sections: what the report should hold; compiling is skipped when only
        :attr:`Section.LOWERED_TEXT` is asked for.
      command: recorded in the report.
      on_stage: called with ``(function name, stage)`` as each stage starts (for a status line).

    Returns:
      A :class:`stagetool.report.model.Report`.

    Raises:
      UsageError, SpecError, TargetError: bad options, spec or target (exit code 2), before any trace.
      StagingError: JAX failed to trace, lower or compile (exit code 3).
    """
    plan = make_plan(options)  # every option checked, the target parsed once, before any JAX work
    if plan.against is None:
        return analyze_plan(plan, sections, command=command, on_stage=on_stage)
    return analyze_against(plan, sections, command=command, on_stage=on_stage)


_COMPARED = frozenset({Section.COLLECTIVES, Section.COST, Section.MEMORY})
"""What ``--against`` compares (:mod:`stagetool.analysis.against`), computed on both sides whatever the command shows."""


def analyze_against(plan: Plan, sections: Iterable[Section], *, command: str = "analyze",
                    on_stage: Callable[[str, str], None] | None = None) -> Report:
    """:func:`analyze_plan` and, for ``--against TARGET``, the same functions staged for the plan's
    :attr:`~stagetool.plan.plan.Plan.against` target too (one more compile each), every difference
    marked (:func:`stagetool.analysis.against.compare`): each function's ``against`` section, and its
    collective rows marked where the target's compile differs (:func:`against_function`). The report
    holds the sections asked for; the ones compared are computed on both sides."""
    asked = frozenset(sections)
    wanted = asked | _COMPARED
    here = analyze_plan(plan, wanted, command=command, on_stage=on_stage)
    target = plan.against
    there_plan = dataclasses.replace(plan, target=target, against=None, target_from="--against", named_as=None,
                                     chip=None, slices=1, processes=None)
    there = analyze_plan(there_plan, wanted, command=command, on_stage=on_stage)
    by_name = {f.name: f for f in there.functions}
    functions = [f if f.error is not None else against_function(f, by_name.get(f.name), target, asked)
                 for f in here.functions]
    return here.holding(*functions)


def against_function(f: FunctionReport, other: FunctionReport | str | None, target: DeviceTarget,
                     asked: Iterable[Section]) -> FunctionReport:
    """``f`` (staged here, with its collectives, cost and memory) with its ``against`` section: every
    difference from ``other``, the same function staged for ``target`` (or the error that stopped it:
    its text, None for not staged), its collective rows marked where the target's compile differs,
    and only the ``asked`` sections of the two kept."""
    asked = frozenset(asked)
    compiler = "XLA:GPU" if isinstance(target, GpuTarget) else "XLA:TPU"
    here_compiler = f.mesh.topology and ("XLA:GPU" if f.mesh.platform == "gpu" else "XLA:TPU") or \
        {"cpu": "XLA:CPU", "tpu": "XLA:TPU", "gpu": "XLA:GPU"}.get(f.mesh.platform, f.mesh.platform)
    if not isinstance(other, FunctionReport) or other.error is not None:
        error = other if isinstance(other, str) else other.error if other is not None else "not staged"
        section = AgainstSection(target.name, compiler, here_compiler, error=error)
    else:
        section = compare(target.name, compiler, here_compiler, here_collectives=f.collectives,
                          there_collectives=other.collectives, here_cost=f.cost, there_cost=other.cost,
                          here_memory=f.memory, there_memory=other.memory)
    collectives = marked_collectives(f.collectives, section) if f.collectives is not None else None
    return dataclasses.replace(
        f, against=section,
        collectives=collectives if Section.COLLECTIVES in asked or Section.WHY in asked else None,
        cost=f.cost if Section.COST in asked else None,
        memory=f.memory if Section.MEMORY in asked else None)


def analyze_plan(plan: Plan, sections: Iterable[Section], *, command: str = "analyze",
                 on_stage: Callable[[str, str], None] | None = None,
                 prepared: dict[str, Prepared] | None = None) -> Report:
    """:func:`analyze` for a plan already made, as its data flow: plan → provision devices → build
    inputs → stage → analyse → report.

    Every function's inputs, out_shardings and ``--explain`` patterns are checked before anything is
    lowered (one error with all the problems of all functions); a function that then fails to trace,
    lower or compile is a :class:`FunctionReport` with ``error`` set, and the others still run.
    """
    wanted = frozenset(sections)
    setup = provision_devices(plan)
    if prepared is None:
        prepared = prepare_inputs(plan, setup)
    return assemble_report(command, stage_and_analyse(plan, setup, prepared, wanted, on_stage))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One function made ready to stage: the spec (out_shardings fitted to the outputs), the loaded
    target and the abstract inputs, or the error that stopped it (an ``init`` that failed); ``setup``:
    the devices it is staged on where they are not the plan's (the same devices in the order of the
    mesh the module builds itself, :func:`stagetool.inputs.own_mesh.adopt_code_order`), else None."""

    fspec: FunctionSpec
    target: Target | None = None
    inputs: AbstractInputs | None = None
    error: StagingError | None = None
    setup: DeviceSetup | None = None


def provision_devices(plan: Plan) -> DeviceSetup:
    """The devices and ``jax.sharding.Mesh`` of the plan (made once per process and kept), with the
    run's chip decided on them, once (:func:`stagetool.plan.plan.run_chip`: ``--chip``, the
    compile-only target's, the attached device's), in ``setup.chip``: what every figure reads.

    Raises:
      UsageError: a bad platform or topology (naming the spec's line when the spec chose it), or
        too few devices.
    """
    from stagetool.devices.provision import provision
    from stagetool.process import gc_pause

    key = (plan.mesh, plan.target, plan.processes, plan.job_processes, plan.slices)
    if key not in _SETUP_CACHE:
        try:
            _SETUP_CACHE[key] = provision(plan.mesh, plan.target, processes=plan.processes,
                                          job_processes=plan.job_processes, slices=plan.slices)
        except UsageError as e:
            # a platform or topology the spec chose (not the command line): name the spec's line
            target = plan.target
            effective = {"platform": target.platform if isinstance(target, (CpuMesh, Attached)) else None,
                         "topology": target.name if isinstance(target, COMPILE_ONLY) else None}
            for name, chosen in (("platform", plan.spec.platform), ("topology", plan.spec.topology)):
                loc = plan.spec.locs.get(name)
                if chosen is not None and chosen == effective[name] and loc is not None \
                        and e.message.startswith(f"--{name} "):
                    raise UsageError(f"{loc}: {name}: " + e.message[len(name) + 3:], hint=e.hint) from None
            raise
        gc_pause.resume()  # start-up is over: JAX is imported and its backend started
    setup = _SETUP_CACHE[key]
    chip = run_chip(plan, setup.platform, setup.device_kind)
    if setup.chip != chip:  # another plan's chip on the same devices (a sweep, inspect): this one's
        setup = _SETUP_CACHE[key] = dataclasses.replace(setup, chip=chip)
    return setup


_SETUP_CACHE: dict[tuple, Any] = {}


def prepare_inputs(plan: Plan, setup: DeviceSetup, targets: Mapping[str, Target] | None = None
                   ) -> dict[str, Prepared]:
    """Load every function's target, build its abstract inputs, check its out_shardings and the
    ``--explain`` patterns against its input leaves, before anything is lowered. ``targets``: by
    function name, a target already loaded (:func:`stagetool.inspect`'s live function), not imported.

    Raises:
      SpecError: every spec problem of every function, at once (with the ``--explain`` problems, a
        UsageError holding all of them).
      UsageError, TargetError: a bad option or target.
    """
    from stagetool.inputs.loading import load_and_build
    from stagetool.process.dispositions import caller_signals

    out: dict[str, Prepared] = {}
    issues: list[str] = []
    hints: list[str] = []  # each SpecError's own hint (how to fix it), said once each
    unmatched: list[str] = []
    for fspec in plan.functions:
        try:
            # the target loaded, its inputs built, in the staged device world (inputs.loading)
            signal_notes: list[str] = []
            with caller_signals(signal_notes):  # the target's import, init and {call: ...}s
                target, inputs, fitted, own_setup = load_and_build(fspec, setup, plan.mesh, avals=plan.avals,
                                                                   target=(targets or {}).get(fspec.name))
            if signal_notes:
                inputs = dataclasses.replace(inputs, notes=(*inputs.notes, *signal_notes))
        except SpecError as e:
            issues.extend(e.issues)
            hints += [e.hint] if e.hint else []
            continue
        except StagingError as e:
            out[fspec.name] = Prepared(fspec, error=e)
            continue
        unmatched += [f"{m} of {fspec.name}" if ";" not in m else m.replace(";", f" of {fspec.name};", 1)
                      for m in unmatched_leaf_patterns(plan.explain, [x.path for x in inputs.leaves])]
        if plan.why is not None and plan.why.kind == "leaf":
            unmatched += _why_leaf_unmatched(plan.why.leaf, fitted, target, inputs, own_setup)
        out[fspec.name] = Prepared(fitted, target, inputs, setup=own_setup if own_setup is not setup else None)
    problems = Problems()
    if issues:
        problems.errors.append(SpecError(issues, hint="; ".join(dict.fromkeys(hints)) or None))
    if unmatched:
        problems.errors.append(UsageError("; ".join(unmatched), hint="give a leaf path as 'stagetool shardings' "
                                                                     "lists it, its last part, or a regular expression"))
    problems.raise_all()
    return out


def _why_leaf_unmatched(pattern: LeafPattern, fspec: FunctionSpec, target: Target, inputs: AbstractInputs,
                        setup: DeviceSetup) -> list[str]:
    """``why --leaf``'s problem with one function, before any compile: the pattern names none of its
    input leaves and none of its output leaves (``out/...``, an NNX argument's state, Equinox's
    ``marker``: known from a trace, done only when no input matches). [] when it names one, or when the
    trace fails (staging then reports that failure)."""
    from stagetool.staging.gather import output_names
    from stagetool.staging.stages import jit_function, trace_only

    paths = [x.path for x in inputs.leaves]
    if any(pattern.names(p) for p in paths):
        return []
    try:
        traced = trace_only(jit_function(target, fspec, inputs, setup.mesh), inputs, setup.mesh, name=fspec.name,
                            user_files=[target.module_file] if target.module_file else [])
    except StagingError:
        return []
    return [m.replace("--explain", "--leaf", 1).replace(" names no input leaf",
                                                        f" names no input or output leaf of {fspec.name}", 1)
            for m in unmatched_leaf_patterns((pattern,), paths + output_names(traced, inputs))]


def stage_and_analyse(plan: Plan, setup: DeviceSetup, prepared: dict[str, Prepared], wanted: frozenset[Section],
                      on_stage: Callable[[str, str], None] | None = None) -> tuple[FunctionReport, ...]:
    """Stage and analyse every function of the plan: one
    :class:`~stagetool.report.model.FunctionReport` each, in spec order. With ``plan.jobs`` > 1,
    in worker processes (:mod:`stagetool.process.workers`), each handed the plan.

    Raises:
      StagingError: a worker died (with ``--jobs``).
    """
    if plan.jobs > 1 and len(plan.functions) > 1:
        from stagetool.process.workers import raise_first_error, run_in_workers

        outcomes = run_in_workers(_report_task, [f.name for f in plan.functions], jobs=plan.jobs,
                                  common=(plan, wanted))
        raise_first_error(outcomes)
        died = [(f.name, o.died) for f, o in zip(plan.functions, outcomes) if o.died]
        if died:

            name, how = died[0]
            raise StagingError(f"{name}: {how}", stage="compile", function=name)
        return tuple(o.value for o in outcomes)  # each made relative to the root in its worker
    return tuple(relative_report(plan.report_root, _function_report(plan, setup, prepared[f.name], wanted, on_stage))
                 for f in plan.functions)


def relative_report(root: ReportRoot | None, report: FunctionReport) -> FunctionReport:
    """``report`` with every user path in it relative to the report root
    (:meth:`~stagetool.core.paths.ReportRoot.relative`): source lines, ``via`` chains, frames, spec
    locations, notes, causes, the error's user frame. Left as they are: the module text of
    ``lower``/``compile`` (JAX's and XLA's own text) and the ``--debug`` traceback. Every renderer,
    snapshot and sweep row is made from this, so they all read the same from any working directory
    or checkout."""
    if root is None:
        return report

    return rewrite_strings(report, root.relative, skip=frozenset({"module", "error_traceback"}))


def assemble_report(command: str, functions: tuple[FunctionReport, ...]) -> Report:
    """The :class:`~stagetool.report.model.Report` of the function reports, with versions and the
    compile configuration."""
    from stagetool.staging.config import compile_config

    return Report(command, _version(), *_jax_versions(), functions, config=compile_config())


def _one(plan: Plan, name: str) -> Plan:
    """The plan restricted to the function ``name``, staged in this process."""
    (fspec,) = [f for f in plan.functions if f.name == name]
    return dataclasses.replace(plan, functions=(fspec,), jobs=1)


def _report_task(common: tuple[Plan, frozenset[Section]], name: str) -> FunctionReport:
    """A worker's task for ``--jobs``: the :class:`~stagetool.report.model.FunctionReport` of one function."""
    plan, wanted = common
    return analyze_plan(_one(plan, name), wanted).functions[0]


def _snapshot_task(common: tuple[Plan], name: str) -> tuple[dict | None, str | None]:
    """A worker's task for ``snapshot``/``check`` with ``--jobs`` or ``--isolate``: ``(snapshot part, None)``,
    or ``(None, error)`` when the function fails to stage."""
    from stagetool.gate.run import spec_label
    from stagetool.gate.snapshot import snapshot_from_report

    (plan,) = common
    report = analyze_plan(_one(plan, name), _snapshot_sections(), command="snapshot")
    if report.functions[0].error is not None:
        return None, report.functions[0].error
    return snapshot_from_report(report, spec=spec_label(plan.spec.path)), None


def staged_functions(options: Options, *, until: str = "compile", on_stage: Callable[[str, str], None] | None = None
                     ) -> Iterator[tuple[FunctionSpec, AbstractInputs, Staged]]:
    """Yield ``(function spec, abstract inputs, Staged)`` for each function: for callers that want the
    JAX stage objects themselves (notebooks, tests)."""
    plan = make_plan(options)
    setup = provision_devices(plan)
    prepared = prepare_inputs(plan, setup)
    for fspec in plan.functions:
        fitted, inputs, staged, _ = _stage(prepared[fspec.name], setup, until, on_stage)
        yield fitted, inputs, staged


def _stage(prep: Prepared, setup: DeviceSetup, until: str,
           on_stage: Callable[[str, str], None] | None, *,
           dump: bool = False) -> tuple[FunctionSpec, AbstractInputs, Staged, list[str]]:
    """Jit and stage one prepared function (see :func:`prepare_inputs`).

    Returns the function spec (its out_shardings fitted to the output tree), the abstract inputs,
    the :class:`~stagetool.staging.stages.Staged` stages and the user's source files.

    Raises:
      StagingError: the function's ``init`` failed, or JAX failed to trace, lower or compile it.
    """
    from stagetool.process.dispositions import caller_signals
    from stagetool.staging.stages import jit_function, stage

    if prep.error is not None:
        raise prep.error
    setup = prep.setup or setup
    fspec, target, inputs = prep.fspec, prep.target, prep.inputs
    jitted = jit_function(target, fspec, inputs, setup.mesh)
    user_files = [target.module_file] if target.module_file else []
    signal_notes: list[str] = []
    with caller_signals(signal_notes):  # the trace runs the user's code: the caller's signals stay
        staged = stage(jitted, inputs, setup.mesh, name=fspec.name, user_files=user_files, until=until, dump=dump,
                       on_stage=(lambda s: on_stage(fspec.name, s)) if on_stage else None)
    if signal_notes:
        inputs = dataclasses.replace(inputs, notes=(*inputs.notes, *signal_notes))
    return fspec, inputs, staged, user_files


def _function_report(plan: Plan, setup: DeviceSetup, prep: Prepared, wanted: frozenset[Section],
                     on_stage: Callable[[str, str], None] | None) -> FunctionReport:
    """Stage one prepared function and build its report: staging hands analysis one
    :class:`~stagetool.facts.StagedFunction`; the analysis never sees a JAX object.
    A :class:`StagingError` becomes the report's ``error`` (its sections are None)."""
    from stagetool.staging.gather import gather

    fspec = prep.fspec
    setup = prep.setup or setup
    needs_compile = bool(wanted - {Section.LOWERED_TEXT})
    dump = plan.peak and bool(wanted & {Section.MEMORY, Section.MODULES})
    cache = None
    # a multi-process job compiles in every process together: one process answering from its cache
    # while another compiles could leave the other waiting, so such jobs do not use the facts cache.
    # Simulated processes (--processes) and a compile-only topology's hosts are all this one process.
    simulated = plan.processes is not None or setup.topology is not None
    real_processes = 1 if simulated else setup.process_count
    if needs_compile and plan.cache_dir is not None and real_processes == 1:
        from stagetool.staging.cache import FactsCache

        cache = FactsCache.open(plan.cache_dir)  # None (and one warning) for a folder others can write
    dialect = plan.dialect if Section.LOWERED_TEXT in wanted else None
    explain = bool(wanted & _EXPLAINED)
    compiles_here = needs_compile and cache is None  # no facts cache: this staging compiles
    try:
        fspec, inputs, staged, user_files = _stage(prep, setup, "compile" if compiles_here and not explain
                                                   else "lower", on_stage, dump=dump)
        cached = False
        if cache is None:
            explained = None
            if compiles_here and explain:  # (explaining needs the compile)
                staged, explained = _compile_explained(staged, setup, fspec, user_files, dump, on_stage)
            facts = gather(staged, inputs, name=fspec.name, target=fspec.target, mesh=setup.mesh,
                           declared_outputs=fspec.out_shardings, lowered_dialect=dialect, peak=staged.dump,
                           user_files=user_files)
            if explained is not None:
                facts = dataclasses.replace(facts, propagation=explained[0], propagation_error=explained[1])
        else:
            facts, cached = _facts_through_cache(cache, staged, inputs, fspec, setup, user_files, dialect, dump,
                                                 on_stage, explain=explain, root=plan.report_root,
                                                 raw_text=Section.COMPILED_TEXT in wanted)
    except StagingError as e:
        return failure_report(plan, setup, prep, wanted, e, fspec=fspec)
    report = _report_of(facts, plan, fspec, setup, wanted, user_files, inputs, cached=cached)
    if report.collectives is not None and report.collectives.items:
        from stagetool.staging.equations import custom_partitioning_rules

        rules = custom_partitioning_rules(staged.traced, user_files)
        if rules:  # a gather a custom_partitioning rule asked for names the rule's line
            report = dataclasses.replace(report, collectives=with_custom_rules(report.collectives, rules))
    return report


def failure_report(plan: Plan, setup: DeviceSetup, prep: Prepared, wanted: frozenset[Section], e: Exception,
                   fspec: FunctionSpec | None = None) -> FunctionReport:
    """The report of one function whose staging raised ``e`` (a :class:`StagingError`): an
    out-of-memory verdict with its memory section, else the error and its traceback. Made from
    the one failure, without staging again."""

    fspec = fspec or prep.fspec
    if isinstance(e, OutOfMemoryError):
        if Section.MEMORY not in wanted:
            return _failed(plan, fspec, setup, e)
        capacity, source = _capacity(plan, setup)
        memory = out_of_memory_section(e, prep.inputs.leaves, dict(plan.mesh.axes), capacity_bytes=capacity,
                                       capacity_source=source, top=plan.top)
        rest = sorted(s.value for s in wanted - {Section.MEMORY, Section.LOWERED_TEXT})
        inputs = None
        if Section.SHARDINGS in wanted:  # the inputs as declared: the jit's in_shardings, which it would keep
            inputs = declared_input_leaves(tuple(prep.inputs.leaves), dict(plan.mesh.axes),
                                           explicit=_axis_types(plan, setup) == "explicit")
            rest = [r for r in rest if r != Section.SHARDINGS.value]
        notes = (f"the compile ran out of memory: {e.xla_message}"
                 + (f"; {', '.join(rest)} need a compiled program and are not shown" if rest else ""),
                 *((REFUSED_INPUTS_NOTE,) if inputs is not None else ()))
        return FunctionReport(fspec.name, fspec.target, _mesh_report(plan, setup), StageTimes(None, None, None),
                              inputs=inputs, memory=memory, notes=notes)
    return _failed(plan, fspec, setup, e)


_EXPLAINED = frozenset({Section.COLLECTIVES, Section.WHY})
"""The sections that say why each collective is there (issue 22), from Shardy's origins."""


def _with_propagation(facts: StagedFunction, staged: Staged, platform: str) -> StagedFunction:
    """``facts`` with Shardy's propagation rerun with sharding origins (or why there is none); a top-k
    gets XLA's factor rule except on TPU (:func:`stagetool.staging.shardy.propagate`)."""
    from stagetool.staging.shardy import propagate_lowered

    propagation, why_not = propagate_lowered(staged.lowered, top_k_rule=platform != "tpu")
    return dataclasses.replace(facts, propagation=propagation, propagation_error=why_not)


def _compile_explained(staged: Staged, setup: DeviceSetup, fspec: FunctionSpec, user_files: list[str], dump: bool,
                       on_stage: Callable[[str, str], None] | None) -> tuple[Staged, tuple[Any, str | None]]:
    """Compile a function staged up to ``lower`` while Shardy's propagation behind the causes is rerun
    beside the compile (:func:`stagetool.staging.shardy.propagate_beside`; a top-k gets XLA's factor
    rule except on TPU); ``(compiled Staged, (propagation, why not))``. The rerun's thread is joined
    however the compile ends.

    Raises:
      StagingError: XLA failed to compile.
    """
    from stagetool.staging.shardy import propagate_beside
    from stagetool.staging.stages import compile_staged

    wait = propagate_beside(staged.lowered, top_k_rule=setup.platform != "tpu")
    try:
        staged = compile_staged(staged, setup.mesh, name=fspec.name, user_files=user_files, dump=dump,
                                on_stage=(lambda s: on_stage(fspec.name, s)) if on_stage else None)
    finally:
        explained = wait()
    return staged, explained


def _facts_through_cache(cache: FactsCache | None, staged: Staged, inputs: AbstractInputs, fspec: FunctionSpec,
                         setup: DeviceSetup, user_files: list[str], dialect: str | None, dump: bool,
                         on_stage: Callable[[str, str], None] | None, *, explain: bool,
                         root: ReportRoot | None = None, raw_text: bool = False) -> tuple[StagedFunction, bool]:
    """The facts of a function staged up to ``lower``: from the facts cache when its key has a valid
    entry (no compile), else compiled, gathered and stored. Returns ``(StagedFunction, cached)``.

    With ``explain``, the facts hold Shardy's propagation too: from the entry, or computed here and
    stored with it (an entry written without it is rewritten once, its peak dump kept). Paths below
    the report ``root`` enter the key and the entry relative to it and come back as this run's
    (:mod:`stagetool.core.paths`): an entry another checkout of the project wrote is a hit here.
    ``raw_text`` (the compiled text is shown as it is): the frames above stagetool's call are in the
    key too (:func:`stagetool.staging.cache.cache_key`)."""
    from stagetool.staging.cache import cache_key
    from stagetool.staging.gather import gather
    from stagetool.staging.stages import compile_staged, merge_warnings

    key = cache_key(staged.lowered, setup, inputs, declared_outputs=fspec.out_shardings, root=root, raw_text=raw_text)
    hit = cache.load(key, peak=dump, root=root)
    if hit is not None:
        base = gather(staged, inputs, name=fspec.name, target=fspec.target, mesh=setup.mesh,
                      declared_outputs=fspec.out_shardings, lowered_dialect=dialect, user_files=user_files)
        stablehlo = base.lowered_text if dialect == "stablehlo" else staged.lowered.as_text()
        facts = dataclasses.replace(base, stablehlo_text=stablehlo, **hit.fields,
                                    warnings=merge_warnings(staged.warnings, hit.compile_warnings))
        if explain and facts.propagation is None and facts.propagation_error is None:
            facts = _with_propagation(facts, staged, setup.platform)
            whole = hit if dump else cache.load(key, peak=True, root=root)  # keep the entry's peak dump, if any
            peak = whole.fields["peak"] if whole is not None else None
            cache.store(key, dataclasses.replace(facts, peak=peak), hit.compile_warnings, root=root)
        return facts, True
    explained = None
    if explain:
        staged, explained = _compile_explained(staged, setup, fspec, user_files, dump, on_stage)
    else:
        staged = compile_staged(staged, setup.mesh, name=fspec.name, user_files=user_files, dump=dump,
                                on_stage=(lambda s: on_stage(fspec.name, s)) if on_stage else None)
    facts: StagedFunction = gather(staged, inputs, name=fspec.name, target=fspec.target, mesh=setup.mesh,
                                   declared_outputs=fspec.out_shardings, lowered_dialect=dialect, peak=staged.dump,
                                   user_files=user_files)
    if explained is not None:
        facts = dataclasses.replace(facts, propagation=explained[0], propagation_error=explained[1])
    cache.store(key, facts, staged.compile_warnings, root=root)
    return facts, False


def _failed(plan: Plan, fspec: FunctionSpec, setup: DeviceSetup, e: StagingError) -> FunctionReport:

    import traceback

    message = e.message + (f" (at {e.user_frame})" if e.user_frame else "") + (f"\n  hint: {e.hint}" if e.hint else "")
    trace = "".join(traceback.format_exception(e))
    if e.detail:  # --debug: JAX's or XLA's message as it came, every frame in it
        trace += f"\nthe message unfiltered:\n{e.detail}\n"
    return FunctionReport(fspec.name, fspec.target, _mesh_report(plan, setup), StageTimes(None, None, None),
                          error=message, error_traceback=trace)


def _mesh_report(plan: Plan, setup: DeviceSetup) -> MeshReport:

    return MeshReport(plan.mesh.axes, _axis_types(plan, setup), setup.platform, setup.device_kind,
                      len(setup.devices), setup.process_count, setup.topology, setup.slices,
                      target_from=plan.target_from if setup.topology else None,
                      named_as=plan.named_as if setup.topology else None)


def _axis_types(plan: Plan, setup: DeviceSetup) -> str:
    """``explicit`` or ``auto``: the staged mesh's (the code's own where the spec gives none,
    :func:`stagetool.inputs.own_mesh.adopt_code_order`), else the plan's."""
    kinds = {str(t).rpartition(".")[2] for t in (getattr(setup.mesh, "axis_types", None) or ())}
    return "explicit" if kinds == {"Explicit"} else "auto" if kinds == {"Auto"} else plan.mesh.axis_types


def _spec_to_name(plan: Plan, fspec: FunctionSpec) -> str | None:
    """The spec's path when ``stagetool CMD TARGET``, run in the spec's folder (where every path of a
    report is written from), would not find it: ``--spec`` named a file other than
    ``<module>.stagetool.yaml`` beside the target or ``stagetool.yaml``. None when it would find it,
    or for a spec without a file. The path is rewritten relative to the report root with the rest."""
    if plan.spec.path is None:
        return None
    spec = Path(plan.spec.path).resolve()
    module = fspec.target.rpartition(":")[0]
    tried = []
    if module.endswith(".py"):
        m = Path(module)
        tried.append((m if m.is_absolute() else spec.parent / m).with_name(m.stem + ".stagetool.yaml"))
    tried.append(spec.parent / "stagetool.yaml")
    first = next((p for p in tried if p.is_file()), None)
    if first is not None and first.resolve() == spec:
        return None
    return str(spec)


def _mesh_override(plan: Plan) -> str | None:
    """``--mesh`` as ``name=size,...`` when the run's mesh is not the spec's (a ``--mesh`` override),
    else None."""
    if plan.mesh.axes == plan.spec.mesh.axes:
        return None
    return ",".join(f"{n}={s}" for n, s in plan.mesh.axes)


def _report_of(facts: StagedFunction, plan: Plan, fspec: FunctionSpec, setup: DeviceSetup, wanted: frozenset[Section],
               user_files: list[str], inputs: AbstractInputs, *, cached: bool = False) -> FunctionReport:
    """The :class:`~stagetool.report.model.FunctionReport` of one staged function's facts."""

    needs_compile = bool(wanted - {Section.LOWERED_TEXT})
    mesh = _mesh_report(plan, setup)
    t = facts.timings
    fields: dict[str, Any] = {}
    if Section.LOWERED_TEXT in wanted:
        fields["module"] = ModuleText("lowered", facts.lowered_dialect, facts.lowered_text)
    if Section.COMPILED_TEXT in wanted:
        fields["module"] = ModuleText("compiled", "hlo", facts.compiled_text)
    leaves = None
    if wanted & {Section.SHARDINGS, Section.MEMORY, Section.COLLECTIVES, Section.WHY}:
        explicit = _axis_types(plan, setup) == "explicit"
        leaves = (input_leaves(facts.inputs, explicit=explicit), output_leaves(facts.outputs, explicit=explicit))
    if Section.SHARDINGS in wanted:
        fields["inputs"], fields["outputs"] = leaves
    cpu = setup.platform == "cpu" and needs_compile
    narrow: frozenset[str] = frozenset()
    narrow_values: frozenset[str] = frozenset()
    if cpu:
        from stagetool.analysis.cpu_artefacts import narrow_dot_types, narrow_value_types

        narrow = narrow_dot_types(facts.stablehlo_text)
        narrow_values = narrow_value_types(facts.stablehlo_text)  # any 16-bit value XLA:CPU may widen
    if Section.COST in wanted:
        from stagetool.devices.provision import interconnect_of

        chip = setup.chip.chip if setup.chip is not None else None
        fields["cost"] = cost_section(facts, len(setup.devices), setup.chip, _roofline_dtype(inputs, chip),
                                      cpu=cpu, interconnect=interconnect_of(setup),
                                      mesh=MeshAxes(plan.mesh.names, plan.mesh.sizes), tokens_per_step=fspec.tokens_per_step)
    if Section.MEMORY in wanted:
        capacity, source = _capacity(plan, setup)
        fields["memory"] = memory_section(facts, *leaves, capacity_bytes=capacity, capacity_source=source,
                                          top=plan.top, device_count=len(setup.devices))
    if wanted & {Section.COLLECTIVES, Section.WHY}:
        section = collectives_section(facts.module, MeshAxes(plan.mesh.names, plan.mesh.sizes), leaves[0], user_files,
                                      plan.explain, slices=setup.slices, outputs=leaves[1],
                                      propagation=facts.propagation, propagation_error=facts.propagation_error,
                                      cpu_upcast=narrow, cpu_promoted=narrow_values, cpu=cpu,
                                      cpu_grouped=facts.grouped_matmuls if cpu else ())
        if Section.COLLECTIVES in wanted:
            fields["collectives"] = section
        if Section.WHY in wanted and plan.why is not None:
            from stagetool.analysis.why import answer_why

            fields["why"] = answer_why(plan.why, leaves[0], leaves[1], section)
    if Section.MODULES in wanted:
        from stagetool.analysis.modules import modules_section

        from stagetool.devices.provision import interconnect_of

        fields["modules"] = modules_section(facts, MeshAxes(plan.mesh.names, plan.mesh.sizes), slices=setup.slices,
                                            chip=setup.chip.chip if setup.chip is not None else None,
                                            interconnect=interconnect_of(setup))
    unknown = unknown_sharding(leaves[0], len(setup.devices)) if leaves is not None else None
    notes = [unknown_sharding_note(unknown, fields["memory"].record.peak_bytes if "memory" in fields else None)
             ] if unknown is not None else []
    notes += [f"warning while staging: {w}" for w in facts.warnings]
    notes += list(facts.uneven_constraints)
    notes += list(facts.mesh_notes)
    notes += list(inputs.notes)
    if cpu:  # XLA:CPU's artefacts, each note ending with the command that gives the accelerator's answer
        from stagetool.analysis.cpu_artefacts import accelerator_command, command_for, cpu_notes

        command = accelerator_command(command_for(wanted), fspec.target, len(setup.devices),
                                      mesh_axes=len(plan.mesh.names), spec=_spec_to_name(plan, fspec),
                                      function=fspec.name, mesh=_mesh_override(plan))
        notes += cpu_notes(command=command, host=facts.host_transfers, narrow=narrow,
                           collectives=fields.get("collectives"), cost=fields.get("cost"))
    if setup.target_config_sha256 is not None:
        notes.append(f"compile-only GPU target {setup.topology} ({setup.device_kind}, config from "
                     f"{setup.target_config_source}): no GPU was there to time kernels, so XLA chose GEMM and fusion "
                     "kernels by its heuristics, without autotuning; on the GPU autotuning may choose others "
                     "(temporaries and timings can differ)")
    if isinstance(plan.target, TpuTarget):
        from stagetool.devices.tpu_topology import host_override_note

        hosts = host_override_note(plan.target, setup.process_count)
        if hosts:
            notes.append(hosts)
    if plan.avals == "local":
        notes.append(f"shapes in the spec are host-local; global shapes computed for {setup.process_count} "
                     f"process(es)" + (" (simulated with --processes)" if plan.processes else ""))
    from stagetool.inputs.own_jit import options_text

    return FunctionReport(fspec.name, fspec.target, mesh, StageTimes(t.trace_s, t.lower_s, t.compile_s),
                          notes=tuple(notes), cached=cached, compiler_options=options_text(inputs.jit), **fields)


def _roofline_dtype(inputs: AbstractInputs, chip: Chip | None) -> str:
    """Which peak FLOP/s the roofline uses: ``bf16`` when any input is 16-bit floating point, else
    ``f32`` — unless the chip publishes no f32 peak (TPUs: their default matmul precision runs f32
    matmuls as bf16 passes on the MXU), then ``bf16``."""
    dtypes = {x.dtype for x in inputs.leaves}
    if dtypes & {"bfloat16", "float16"}:
        return "bf16"
    return "f32" if chip is None or chip.peak_flops_per_second_f32 else "bf16"


def _capacity(plan: Plan, setup: DeviceSetup) -> tuple[int | None, str | None]:
    """Per-device memory capacity in bytes and where it comes from.

    In order: ``--device-memory``; a topology's HBM per device; the device's
    ``memory_stats()['bytes_limit']``; the HBM capacity of the run's chip (``setup.chip``, the one
    the roofline and the step time read); else unknown.
    """
    from stagetool.devices.provision import device_capacity

    if plan.device_memory_bytes is not None:
        return plan.device_memory_bytes, "--device-memory"
    if setup.capacity_bytes:
        return setup.capacity_bytes, setup.capacity_source
    cap = device_capacity(setup.devices[0])
    if cap.bytes_limit:
        return cap.bytes_limit, cap.source
    run = setup.chip
    if run is not None and run.chip.hbm_capacity_bytes:
        return int(run.chip.hbm_capacity_bytes), f"chip table ({run.name}, {run.describe()})"
    return None, None


def _config_dict() -> dict[str, str]:
    from stagetool.staging.config import compile_config

    return dict(compile_config())


def _version() -> str:

    return __version__


def _jax_versions() -> tuple[str, str]:
    import jax
    import jaxlib

    return jax.__version__, jaxlib.__version__


def devices_report(*, mesh: str | None = None, platform: str | None = None, topology: str | None = None,
                   gpu_target_config: str | None = None, slices: int | None = None):
    """What ``stagetool devices`` shows: a :class:`stagetool.report.model.DevicesReport`.

    With ``mesh`` (``data=2,model=4``), CPU devices are provisioned for it and the mesh's device
    order is included.

    Raises:
      UsageError: a bad ``--mesh``, platform or topology (``--gpu-target-config`` without one), or
        too few devices.
    """
    from stagetool.devices.provision import provision

    if topology is not None and not topology.strip():
        raise UsageError("--topology '': an empty topology name (an unset variable in --topology \"$TOPO\"?)",
                         hint="give a topology such as v5e:2x4 or h100:8, or leave --topology out")
    target = parse_target(topology, platform=platform, gpu_target_config=gpu_target_config)  # the one parse
    target = check_target(target)  # a GPU typo, a bad config (read into it, once), the library it needs
    mesh_spec = MeshSpec(())
    if mesh:
        try:
            mesh_spec = parse_mesh_option(mesh, MeshSpec(()))
        except ValueError as e:
            raise UsageError(str(e)) from None
    layout = mesh_spec
    if isinstance(target, COMPILE_ONLY) and not mesh_spec.axes:
        layout = MeshSpec((("devices", target.device_count * (slices or 1)),))  # all, in one axis
    if slices is not None and slices < 1:
        raise UsageError(f"--slices {slices}: the number of TPU slices must be at least 1")
    setup = provision(layout, target, slices=slices)
    if topology is None:
        import jax

        all_devices = jax.devices(setup.platform)
    else:
        all_devices = sorted(setup.devices, key=lambda d: d.id)
    infos = tuple(DeviceInfo(int(d.id), int(getattr(d, "process_index", 0)), str(getattr(d, "device_kind", "")),
                             tuple(int(c) for c in d.coords) if getattr(d, "coords", None) is not None else None)
                  for d in all_devices)
    memory = setup.capacity_bytes
    if memory is None:
        from stagetool.devices.provision import device_capacity

        memory = device_capacity(all_devices[0]).bytes_limit
    jax_v, jaxlib_v = _jax_versions()
    return DevicesReport(
        platform=setup.platform, device_kind=setup.device_kind, device_count=len(infos),
        process_count=len({i.process_index for i in infos}), jax_version=jax_v, jaxlib_version=jaxlib_v,
        stagetool_version=_version(), topology=topology, devices=infos,
        mesh=mesh_spec.axes or None,
        mesh_device_ids=tuple(int(d.id) for d in setup.devices) if mesh_spec.axes else None,
        memory_bytes_per_device=memory)


# ---- the CI gate's runs


SNAPSHOT_SECTIONS = ("shardings", "cost", "memory", "collectives")


def _snapshot_sections() -> list[Section]:
    return [s for s in Section if s.value in SNAPSHOT_SECTIONS]


def take_snapshot(options: Options, *, isolate: bool = False, on_stage=None,
                  timeout_s: float | None = None) -> SnapshotRun:
    """Stage every function of ``options`` and snapshot it: :func:`snapshot_plan` of
    :func:`make_plan` (``isolate``/``timeout_s`` here, for the Python API, add to the options').

    Raises:
      UsageError, SpecError, TargetError: bad options, spec or target, before any trace.
    """
    if options.against is not None:
        raise UsageError(f"--against {options.against}: a snapshot records one compile; --against marks the "
                         "differences between two in a report",
                         hint="run 'stagetool report ... --against TARGET', or snapshot each target (--topology)")
    options = dataclasses.replace(options, isolate=isolate or options.isolate,
                                  timeout_s=timeout_s if timeout_s is not None else options.timeout_s)
    return snapshot_plan(make_plan(options), on_stage=on_stage)


def snapshot_plan(plan: Plan, *, on_stage=None) -> SnapshotRun:
    """Stage every function of the plan and snapshot it.

    Each function is staged on its own: one that fails to trace, lower or compile
    (:class:`stagetool.core.errors.StagingError`) is recorded in ``failed`` and the others still run.
    With ``plan.jobs`` > 1, functions are staged in that many worker processes
    (:mod:`stagetool.process.workers`); the snapshot is the same as a serial run's. With ``isolate``,
    the same workers take one function each, so that one that aborts its process (an XLA
    ``LLVM ERROR``, ``os.abort()``) is recorded too. ``plan.timeout_s`` (which also puts the functions in
    workers) bounds each function's time in its worker (with ``isolate``, default
    :data:`stagetool.gate.run.DEFAULT_TIMEOUT_S`); one that runs past it is killed and recorded as
    failed.

    Raises:
      SpecError, TargetError: a function's inputs or target, before anything is lowered.
    """
    from stagetool.gate.run import DEFAULT_TIMEOUT_S, SnapshotRun, spec_label
    from stagetool.gate.snapshot import (
        SNAPSHOT_KIND,
        SNAPSHOT_SCHEMA,
        merge_snapshots,
        snapshot_from_report,
    )

    names = tuple(f.name for f in plan.functions)
    spec_path = plan.spec.path
    parts: list[dict] = []
    failed: dict[str, str] = {}
    isolate, timeout_s = plan.isolate, plan.timeout_s
    setup = prepared = None
    if not isolate:  # every spec error before anything is lowered
        setup = provision_devices(plan)
        prepared = prepare_inputs(plan, setup)
    if isolate or timeout_s is not None or (plan.jobs > 1 and len(names) > 1):
        from stagetool.process.workers import raise_first_error, run_in_workers

        if isolate and timeout_s is None:
            timeout_s = DEFAULT_TIMEOUT_S
        outcomes = run_in_workers(_snapshot_task, names, jobs=plan.jobs, common=(plan,), isolate=isolate,
                                  timeout_s=timeout_s)
        raise_first_error(outcomes)
        for name, o in zip(names, outcomes):
            part, error = o.value if o.died is None else (None, o.died)
            if error is not None:
                failed[name] = error
            else:
                parts.append(part)
    else:
        for name in names:
            report = analyze_plan(_one(plan, name), _snapshot_sections(), command="snapshot", on_stage=on_stage,
                                  prepared=prepared)
            if report.functions[0].error is not None:
                failed[name] = report.functions[0].error  # "f: trace failed: ... (at file.py:LINE in f)"
                continue
            parts.append(snapshot_from_report(report, spec=spec_label(spec_path)))
    if parts:
        snap = merge_snapshots(parts)
    else:
        import jax
        import jaxlib


        snap = {"snapshot_schema": SNAPSHOT_SCHEMA, "kind": SNAPSHOT_KIND, "stagetool_version": __version__,
                "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__,
                "spec": spec_label(spec_path), "functions": {}, "config": _config_dict()}
    snap["spec"] = spec_label(spec_path)
    return SnapshotRun(snap, failed, names, spec_path, plan.spec.check)


# ---- one compile, its sections analysed on request (stagetool.inspect)


@dataclasses.dataclass
class StagedOnce:
    """One function traced, lowered and compiled once, whose sections are analysed when asked for
    (:func:`stagetool.inspect`): the facts of that compile, and the lowered stage kept for Shardy's
    propagation (the collectives' causes), rerun on the first request that needs it. Holds JAX
    objects: it stays in the process that staged it."""

    plan: Plan
    setup: DeviceSetup
    prep: Prepared
    facts: StagedFunction
    staged: Staged
    user_files: list[str]

    def report(self, wanted: Iterable[Section]) -> FunctionReport:
        """The :class:`~stagetool.report.model.FunctionReport` with the sections ``wanted``, from the
        one compile (as :func:`stage_and_analyse` makes it: paths relative to the report root)."""
        wanted = frozenset(wanted)
        if wanted & _EXPLAINED and self.facts.propagation is None and self.facts.propagation_error is None:
            self.facts = _with_propagation(self.facts, self.staged, self.setup.platform)
        return relative_report(self.plan.report_root, _report_of(self.facts, self.plan, self.prep.fspec, self.setup,
                                                                 wanted, self.user_files, self.prep.inputs))


def stage_once(plan: Plan, setup: DeviceSetup, prep: Prepared) -> StagedOnce:
    """Stage one prepared function (:func:`prepare_inputs`) up to its compile, once (with XLA's dump
    when ``plan.peak``), and gather its facts; no facts cache.

    Raises:
      StagingError: the function failed to trace, lower or compile (``OutOfMemoryError`` too).
    """
    from stagetool.staging.gather import gather

    setup = prep.setup or setup
    fspec, inputs, staged, user_files = _stage(prep, setup, "compile", None, dump=plan.peak)
    if inputs is not prep.inputs:  # with the notes of the staging (stagetool.process.dispositions)
        prep = dataclasses.replace(prep, inputs=inputs)
    facts = gather(staged, inputs, name=fspec.name, target=fspec.target, mesh=setup.mesh,
                   declared_outputs=fspec.out_shardings, peak=staged.dump, user_files=user_files)
    return StagedOnce(plan, setup, prep, facts, staged, user_files)
