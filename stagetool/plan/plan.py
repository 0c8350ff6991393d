"""Options → :class:`Plan`: every option and spec value resolved and checked once
(:func:`make_plan`), before any JAX work. The target is parsed here, once, into its typed value
(:mod:`stagetool.plan.target`); the ``--explain`` and ``why`` selectors are compiled here
(:mod:`stagetool.plan.selectors`). Nothing after the plan reads :class:`~stagetool.plan.options.Options`.
No JAX here."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Iterator, Mapping

from stagetool.core.chips import CHIPS, Chip, RunChip, get_chip, merge_chips
from stagetool.core.errors import ExitCode, StagetoolError, UsageError
from stagetool.core.mesh import MeshSpec, parse_mesh_option
from stagetool.core.paths import ReportRoot, report_root
from stagetool.plan.options import Options
from stagetool.plan.selectors import LeafPattern, WhyQuery
from stagetool.plan.target import COMPILE_ONLY, DeviceTarget, GpuTarget
from stagetool.spec.discovery import resolve_spec, split_target
from stagetool.spec.model import FunctionSpec, Spec
from stagetool.spec.variables import load_spec_with

__all__ = ["Plan", "Problems", "make_plan", "plan_slices", "run_chip"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every option and spec value, resolved and checked once by :func:`make_plan` before any JAX
    work; nothing after it reads :class:`~stagetool.plan.options.Options`.

    Attributes:
      spec: the validated spec; functions: the ones to run, in spec order.
      mesh: the effective mesh (``--mesh`` over the spec's).
      target: what the run compiles for (``--platform``/``--topology``/``--gpu-target-config`` over
        the spec's), parsed once (:func:`stagetool.plan.target.parse_target`).
      avals: ``global`` or ``local`` spec shapes; processes: simulated processes (``--processes``).
      job_processes: processes of the ``jax.distributed`` job, or None.
      dialect: ``stablehlo`` or ``hlo`` for the lowered text.
      chips: the chip table (built-in merged with the spec's ``chips:``); chip: ``--chip``'s entry,
        one input of the run's chip (:func:`run_chip`, which every figure reads; not read alone).
      device_memory_bytes: ``--device-memory`` in bytes per device, or None (then the device, the
        topology or the run's chip says; see :func:`stagetool.pipeline.device_capacity_of`).
      peak, top: the peak dump and how many rows to list.
      explain: the ``--explain`` patterns, compiled (checked against the leaves once the inputs are built).
      cache_dir: the facts cache folder, or None.
      jobs: worker processes at a time (>= 1); timeout_s: seconds per function in a worker, or
        None; isolate: each function in a worker of its own.
      slices: TPU slices joined over DCN (``--slices``, the spec's ``slices``), 1 for one.
      why: ``stagetool why``'s question, checked (:class:`stagetool.plan.selectors.WhyQuery`), or None.
      report_root: the folder every user path in the report is written relative to — the spec
        file's folder (:func:`stagetool.core.paths.report_root`) — and that the facts cache keys
        source locations from; None (a plan built by hand): paths as JAX gives them.
      target_from: where the compile-only target was named (``--topology``, the spec's
        ``file:line:col``, ``pyproject.toml [tool.stagetool]``), or None for none named.
      named_as: the name as written there when the mesh sized it (``v5e`` for ``v5e:2x4``), else None.
      against: ``--against``'s compile-only target, parsed and checked once (sized by the mesh), or None.
    """

    spec: Spec
    functions: tuple[FunctionSpec, ...]
    mesh: MeshSpec
    target: DeviceTarget
    avals: str
    processes: int | None = None
    job_processes: int | None = None
    dialect: str = "stablehlo"
    chips: Mapping[str, Chip] = dataclasses.field(default_factory=lambda: dict(CHIPS))
    chip: Chip | None = None
    device_memory_bytes: int | None = None
    peak: bool = False
    top: int = 10
    explain: tuple[LeafPattern, ...] = ()
    cache_dir: Path | None = None
    jobs: int = 1
    timeout_s: float | None = None
    isolate: bool = False
    slices: int = 1
    why: WhyQuery | None = None
    report_root: ReportRoot | None = None
    target_from: str | None = None
    named_as: str | None = None
    against: DeviceTarget | None = None


class Problems:
    """Usage errors collected while a plan is made (or its inputs checked), raised together (one
    message, exit 2)."""

    def __init__(self) -> None:
        self.errors: list[StagetoolError] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except StagetoolError as e:
            if e.exit_code != ExitCode.USAGE:
                raise
            self.errors.append(e)

    def raise_all(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            lines = [f"  - {e.message}" + (f" (hint: {e.hint})" if e.hint else "") for e in self.errors]
            raise UsageError(f"{len(self.errors)} problems, nothing was staged:\n" + "\n".join(lines))


def make_plan(options: Options, *, spec: Spec | None = None) -> Plan:
    """Resolve every option and spec value into a :class:`Plan`, before any JAX work.

    ``spec``: a spec built in Python (:func:`stagetool.inspect`: the live function and objects), used
    instead of a spec file (``options.spec`` and ``options.target`` are then not read).

    Checks the spec, TARGET, ``--function``, ``--mesh``, ``--platform``/``--topology`` (parsed once
    into the plan's target), ``--processes``, ``--dialect``, ``--chip`` (against the built-in table
    and the spec's ``chips:``), ``--device-memory`` (a size above 0), ``--explain`` (regular
    expressions), ``--jobs`` (>= 1), ``--timeout`` (> 0), the cache folder and every output file
    (its folder exists, is a folder and takes a new file).

    Raises:
      UsageError: every problem with the options at once (one message when there are several).
      SpecError: the spec is invalid (alone, or within the one UsageError with the option problems).
    """
    problems = Problems()
    device_memory, explain, question = _check_options(options, problems)
    given, spec_path, spec = spec, None, None
    with problems.check():
        if given is not None:
            spec, spec_path = given, given.path
        else:
            spec_path = resolve_spec(options.spec, options.target)
            if options.target:
                split_target(options.target)  # a malformed TARGET is the first thing to say
            spec = load_spec_with(spec_path, dict(options.variables))
    if spec is None:
        problems.raise_all()
    functions = _select_functions(options, spec, spec_path, problems)
    if options.leaf_shardings:  # a sweep configuration's leaf shardings (stagetool fit --what-if)
        functions = [dataclasses.replace(f, leaf_shardings=tuple(options.leaf_shardings)) for f in functions]
    mesh = spec.mesh
    with problems.check():
        if options.mesh:
            try:
                mesh = parse_mesh_option(options.mesh, spec.mesh)
            except ValueError as e:
                raise UsageError(str(e)) from None
    if options.context_mesh is not None:
        mesh = dataclasses.replace(mesh, context=options.context_mesh)
    with problems.check():
        if options.topology is not None and not options.topology.strip():
            raise UsageError("--topology '': an empty topology name (an unset variable in --topology \"$TOPO\"?)",
                             hint="give a topology such as v5e:2x4 or h100:8, or leave --topology out to stage on "
                                  "this machine's devices")
    target = slices = None
    named: _Named | None = None
    with problems.check():
        named = _named_target(spec, options, spec_path)
        target = _parse_target(spec, options, named, mesh)
    if target is not None:
        with problems.check():
            slices = _check_slices(spec, options, target, mesh)
    against = None
    if options.against is not None:
        with problems.check():
            against = _against_target(options.against, mesh)
    avals = "local" if options.local_avals else spec.avals
    with problems.check():
        if options.processes is not None and avals != "local":
            raise UsageError(f"--processes {options.processes} simulates hosts for local avals, but the shapes are "
                             "global", hint="add --local-avals (or 'avals: local' in the spec)")
    chips, chip = _chips(spec, options, target, problems)
    problems.raise_all()
    return Plan(spec, tuple(functions), mesh, target, avals, processes=options.processes,
                job_processes=options.job_processes, dialect=options.dialect,
                chips=chips, chip=chip, device_memory_bytes=device_memory, peak=options.peak, top=options.top,
                explain=explain, cache_dir=options.cache_dir, jobs=options.jobs,
                timeout_s=options.timeout_s,
                isolate=options.isolate, slices=slices or 1, why=question,
                report_root=report_root(spec.path, [f.target for f in spec.functions.values()]),
                target_from=named.where if named and isinstance(target, COMPILE_ONLY) else None,
                named_as=named.topology if named and named.topology and ":" not in named.topology else None,
                against=against)


def _check_options(options: Options, problems: Problems) -> tuple[int | None, tuple[LeafPattern, ...],
                                                                   WhyQuery | None]:
    """The options that need no spec: ``--device-memory`` (in bytes), ``--explain`` and ``why``
    (compiled), ``--dialect``, ``--jobs``, ``--timeout``, the cache folder and the output files.
    Problems go to ``problems``; returns ``(device memory bytes, explain patterns, why question)``."""
    from stagetool.core.units import parse_size
    from stagetool.plan.selectors import leaf_patterns, why_query
    from stagetool.process.fileio import write_problem

    device_memory = question = None
    explain: tuple[LeafPattern, ...] = ()
    if options.device_memory is not None:
        with problems.check():
            try:
                device_memory = parse_size(options.device_memory)
            except UsageError as e:
                from stagetool.core.text import clipped

                given = options.device_memory if len(options.device_memory) <= 40 else clipped(options.device_memory)
                raise UsageError(f"--device-memory {given}: {e.message}", hint=e.hint) from None
            if device_memory <= 0:
                raise UsageError(f"--device-memory {options.device_memory}: the memory of a device must be more "
                                 "than 0 bytes", hint="write e.g. 16GiB")
    with problems.check():
        explain = leaf_patterns(tuple(options.explain))
    if options.why is not None:
        with problems.check():
            question = why_query(*options.why)
    with problems.check():
        if options.dialect not in ("stablehlo", "hlo"):
            raise UsageError(f"--dialect {options.dialect!r} must be 'stablehlo' or 'hlo'")
    with problems.check():
        if options.jobs < 1:
            raise UsageError(f"--jobs {options.jobs}: give at least 1", hint="--jobs 1 stages in this process")
    with problems.check():
        from stagetool.core.units import timeout_seconds

        timeout_seconds(options.timeout_s)  # above 0, at most a week; inf and nan refused alike
    with problems.check():
        if options.cache_dir is not None and options.cache_dir.exists() and not options.cache_dir.is_dir():
            raise UsageError(f"--cache-dir {options.cache_dir}: not a folder",
                             hint="give a folder, or --no-cache to compile without the cache")
        if options.cache_dir is not None:
            why = _cache_dir_problem(options.cache_dir)
            if why:
                raise UsageError(f"--cache-dir {options.cache_dir}: cannot write: {why}",
                                 hint="give a folder you can write, or --no-cache to compile without the cache")
    for option, path in options.outputs:
        with problems.check():
            why = write_problem(path)
            if why:
                raise UsageError(f"{option} {path}: cannot write: {why}", hint="give a file in a folder you can write")
    return device_memory, explain, question


def _cache_dir_problem(folder: Path) -> str | None:
    """Why the facts cache could not write under ``folder`` (made on first use), or None: a file is
    created and removed in the folder, or in its nearest existing parent when it does not exist yet."""
    from stagetool.process.fileio import write_problem

    probe = Path(folder)
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a folder"
    return write_problem(probe / "probe")


def _select_functions(options: Options, spec: Spec, spec_path: Path, problems: Problems) -> list[FunctionSpec]:
    """The spec's functions TARGET and ``--function`` select, in spec order."""
    functions = list(spec.functions.values())
    with problems.check():
        if options.target:
            functions = [f for f in functions if _same_target(options.target, f)]
            if not functions:
                absolute = Path(options.target.rpartition(":")[0]).is_absolute()
                described = ", ".join(f"{f.name} ({_target_from_here(f, absolute=absolute)})"
                                      for f in spec.functions.values()) or "none"
                raise UsageError(f"the spec {spec_path} does not describe {options.target}; it has: {described}",
                                 hint="add the function under 'functions:' or pass the right --spec (a TARGET's "
                                      "file is relative to the working directory, a spec target's to the spec's "
                                      "folder; the targets are listed as you would write them here)")
    with problems.check():
        if options.function:
            wanted = (options.function,) if isinstance(options.function, str) else tuple(options.function)
            for name in wanted:
                if name not in spec.functions:
                    raise UsageError(f"--function {name!r} is not in {spec_path}; it has: " + ", ".join(spec.functions))
            functions = [f for f in functions if f.name in wanted]
    with problems.check():
        if not functions and not problems.errors:
            raise UsageError(f"the spec {spec_path} has no functions to run")
    return functions


@dataclasses.dataclass(frozen=True)
class _Named:
    """The hardware a run compiles for, as named in one place: ``where`` (``--topology``, the spec's
    ``file:line:col``, ``pyproject.toml [tool.stagetool]``), the name and config as written there,
    and the spec key whose line an error names (None for the command line and pyproject.toml)."""

    where: str
    topology: str | None
    gpu_target_config: str | None
    platform: str | None = None
    spec_key: str | None = None


def _named_target(spec: Spec, options: Options, spec_path: Path | None) -> _Named | None:
    """Where the run's hardware is named, the first of: the command line (``--topology``,
    ``--platform``, ``--gpu-target-config``: an explicit option wins), the spec (``topology:``,
    ``platform:``, ``gpu_target_config:``), the project's ``pyproject.toml`` ``[tool.stagetool]``
    (:mod:`stagetool.spec.project`, found from the spec's folder). None: nothing named.

    Raises:
      UsageError: an unreadable ``[tool.stagetool]``.
    """
    by = options.target_named_by
    if options.topology is not None:
        return _Named(by or "--topology", options.topology, options.gpu_target_config or spec.gpu_target_config,
                      options.platform)
    if options.platform is not None:
        return _Named(by or "--platform", None, None, options.platform)
    if options.gpu_target_config is not None:
        # the spec's GPU topology with the command line's config; alone it still needs a topology
        return _Named(by or "--gpu-target-config", spec.topology, options.gpu_target_config)
    if spec.topology is not None or spec.platform is not None or spec.gpu_target_config is not None:
        key = "topology" if spec.topology is not None else "gpu_target_config" \
            if spec.gpu_target_config is not None else "platform"
        loc = spec.locs.get(key)
        return _Named(str(loc) if loc is not None else "the spec", spec.topology, spec.gpu_target_config,
                      spec.platform, spec_key=key)
    from stagetool.spec.project import project_settings

    folder = Path(spec_path).resolve().parent if spec_path is not None else None
    settings = project_settings(folder)
    if settings is None or (settings.topology is None and settings.gpu_target_config is None):
        return None
    return _Named(settings.where, settings.topology or "gpu", settings.gpu_target_config)


def _parse_target(spec: Spec, options: Options, named: _Named | None, mesh: MeshSpec) -> DeviceTarget:
    """The run's target, from where it is named (:func:`_named_target`), parsed once
    (:func:`stagetool.plan.target.parse_target`; a name without a shape, ``v5e``, sized by the mesh:
    :func:`stagetool.plan.target.sized_name`) and checked before JAX starts (its kind, config file
    and library, :func:`stagetool.plan.target.check_target`); exit 2 otherwise, naming the spec's
    line or the ``pyproject.toml`` where the spec or the project named it."""
    from stagetool.plan.target import check_target, parse_target, sized_name

    if named is None:
        return parse_target(None)
    try:
        topology = named.topology
        if topology is not None:
            topology = sized_name(topology, mesh.sizes, slices=plan_slices(spec, options))
        target = parse_target(topology, platform=named.platform, gpu_target_config=named.gpu_target_config)
        target = check_target(target)  # a GPU config file read into it, once
    except UsageError as e:
        if named.spec_key is not None:
            raise UsageError(f"{named.where}: {named.spec_key}: {e.message}", hint=e.hint) from None
        if named.where.endswith("[tool.stagetool]"):
            raise UsageError(f"{named.where}: topology = {named.topology!r}: {e.message}", hint=e.hint) from None
        raise
    return target


def _against_target(name: str, mesh: MeshSpec) -> DeviceTarget:
    """``--against NAME``: a compile-only target (a name alone sized by the mesh), checked before JAX starts.

    Raises:
      UsageError: an empty or bad name, a target that is not compile-only, its library not installed.
    """
    from stagetool.plan.target import check_target, parse_target, sized_name

    if not name.strip():
        raise UsageError("--against '': an empty target name", hint="give a compile-only target such as v5e:2x4 or h100:8")
    try:
        target = check_target(parse_target(sized_name(name.strip(), mesh.sizes)))
    except UsageError as e:
        raise UsageError(f"--against {name}: {e.message}", hint=e.hint) from None
    if not isinstance(target, COMPILE_ONLY):
        raise UsageError(f"--against {name}: not a compile-only target", hint="e.g. --against v5e:2x4 or --against h100:8")
    if target.device_count != max(mesh.device_count, 1):
        raise UsageError(f"--against {name}: {target.name} has {target.device_count} devices, but the mesh {mesh} has "
                         f"{max(mesh.device_count, 1)}", hint="a compile-only target is used whole: give the hardware "
                         "alone (--against v5e, --against h100) and the mesh sizes it")
    return target


def plan_slices(spec: Spec, options: Options) -> int:
    """The slices a run stages: ``--slices``, else the spec's ``slices``, else 1."""
    return options.slices or spec.slices or 1


def _check_slices(spec: Spec, options: Options, target: DeviceTarget, mesh: MeshSpec) -> int:
    """``--slices N`` / ``slices: N`` before JAX starts: a whole number, a TPU topology, and a mesh
    whose first axis is a multiple of N and whose size is N × the topology's devices (exit 2).
    Returns N."""
    n = plan_slices(spec, options)
    given = "--slices" if options.slices else f"{spec.locs.get('slices', 'the spec')}: slices"
    if options.slices is not None and options.slices < 1:
        raise UsageError(f"--slices {options.slices}: the number of TPU slices must be at least 1")
    if n == 1:
        return 1
    if not isinstance(target, COMPILE_ONLY) or isinstance(target, GpuTarget):
        raise UsageError(f"{given} {n}: slices are TPU slices joined over DCN, and need a TPU topology",
                         hint=f"add --topology, e.g. --topology v5e:2x4 --slices {n}")
    per_slice = target.device_count
    if mesh.axes:
        first, size = mesh.axes[0]
        if size % n:
            raise UsageError(f"{given} {n}: the mesh's first axis {first}={size} spans the slices, so its size must "
                             f"be a multiple of {n}", hint=f"e.g. --mesh {first}={n * max(size // n, 1)},...")
        if mesh.device_count != n * per_slice:
            raise UsageError(f"the mesh {mesh} has {mesh.device_count} devices, but {n} slices of {target.name} have "
                             f"{n * per_slice}", hint="a compile-only topology is used whole: make the mesh's sizes "
                                                      "multiply to the slices' device count")
    return n


def _chips(spec: Spec, options: Options, target: DeviceTarget | None,
           problems: Problems) -> tuple[dict[str, Chip], Chip | None]:
    """The chip table (built-in merged with the spec's ``chips:``) and ``--chip``'s entry, checked
    against a compile-only target (:func:`stagetool.plan.target.check_chip_for_target`)."""
    chips: dict[str, Chip] = dict(CHIPS)
    chip = None
    with problems.check():
        if spec.chips:
            chips = merge_chips(spec.chips)
        if options.chip:
            try:
                chip = get_chip(options.chip, chips)
            except UsageError as e:
                raise UsageError(f"--chip {options.chip}: {e.message}", hint=e.hint) from None
    with problems.check():
        if options.chip and isinstance(target, COMPILE_ONLY) and chip is not None:
            from stagetool.plan.target import check_chip_for_target

            # a chip the spec's chips: defines is the user's own figures; the built-in ones are checked
            if chip == CHIPS.get(chip.name):
                check_chip_for_target(options.chip, target)
    return chips, chip


def _target_from_here(fspec: FunctionSpec, *, absolute: bool = False) -> str:
    """The spec's target as a command-line TARGET names it from the working directory: a relative
    ``file.py`` target (relative to the spec's folder) rewritten relative to the working directory
    (its absolute path where ``absolute``: the TARGET was given so); other forms as written."""
    import os

    try:
        mod, attr = split_target(fspec.target)
    except Exception:
        return fspec.target
    if not mod.endswith(".py") or Path(mod).is_absolute():
        return fspec.target
    if absolute:
        return f"{os.path.normpath(os.path.abspath(fspec.base_dir / mod))}:{attr}"
    try:
        return f"{os.path.relpath(fspec.base_dir / mod)}:{attr}"
    except ValueError:  # another drive (Windows)
        return f"{fspec.base_dir / mod}:{attr}"


def _same_target(target: str, fspec: FunctionSpec) -> bool:
    """Whether the command-line TARGET names the same callable as the spec's target."""
    try:
        a_mod, a_attr = split_target(target)
        b_mod, b_attr = split_target(fspec.target)
    except Exception:
        return False
    if a_attr != b_attr:
        return False
    if a_mod.endswith(".py") and b_mod.endswith(".py"):
        return Path(a_mod).resolve() == (fspec.base_dir / b_mod).resolve()
    return a_mod == b_mod


def run_chip(plan: Plan, platform: str, device_kind: str) -> RunChip | None:
    """The one decision of which chip the run's figures are for (the roofline, the step-time
    estimate, the modules roll-up, the memory capacity all read it): ``--chip``; else the chip a
    compile-only target compiles for (``v5e:2x4`` → ``tpu-v5e``, ``h100:8`` → ``h100-sxm``); else
    the attached accelerator's, from its ``device_kind`` (``TPU v5 lite`` → ``tpu-v5e``); else None
    (the CPU mesh without ``--chip``, a device or target the chip table does not know). The figures
    are the plan's chip table's: the spec's ``chips:`` entry of that name, where it has one, over the
    built-in one.

    Args:
      plan: the plan (its ``--chip`` entry, target and chip table).
      platform, device_kind: of the devices the run stages on (:class:`~stagetool.devices.provision.DeviceSetup`).
    """
    from stagetool.core.chips import chip_for_device_kind

    spec_names = {str(n).strip().lower() for n in (plan.spec.chips or {})}
    if plan.chip is not None:
        return RunChip(plan.chip, "--chip", plan.chip.name in spec_names)
    name = source = None
    if isinstance(plan.target, COMPILE_ONLY):
        name, source = plan.target.roofline_chip, f"topology {plan.target.name}"
    if name is None and platform != "cpu":  # an attached accelerator (or a target the table names by its kind)
        name, source = chip_for_device_kind(device_kind), f"device {device_kind}"
    if name is None or name not in plan.chips:
        return None
    return RunChip(plan.chips[name], source, name in spec_names)
