"""Plan a sweep (check every option once, build the grid), run what is left of it, and assemble the
document.

Everything a user can get wrong — the spec, the TARGET, ``--set`` names and values, mesh sizes,
``--shard`` — is checked here, before any worker starts, and is one error (exit 2) rather than a
row per configuration. The driver does not import JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from stagetool.core.errors import UsageError
from stagetool.plan.options import Options
from stagetool.sweep.grid import Config, Grid, build_grid, mesh_values, parse_shard, shard_of
from stagetool.sweep.rows import SWEEP_SCHEMA_VERSION, RankBy, document


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """What to sweep and how; mirrors ``stagetool sweep``'s options.

    Attributes:
      options: what every configuration stages, as for any command (:class:`~stagetool.plan.options.Options`:
        target, spec, function, platform, slices, GPU target config, chip, device memory, the files
        ``-o`` writes, ...), checked once by :func:`~stagetool.plan.plan.make_plan` and handed to each
        configuration whole; a configuration's mesh, topology and ``--set`` values replace its
        ``mesh``, ``topology`` and ``variables`` (leave those unset here).
      mesh: ``1x8,2x4`` or ``all``; None keeps the spec's mesh.
      set: ``NAME=V1,V2`` strings filling the spec's ``${NAME}`` placeholders.
      topology: ``v5e:2x4,v5e:4x4``; None keeps the spec's.
      devices: the device count ``--mesh all`` factorises (default: the topology's, else the spec
        mesh's size).
      rank_by: what picks the best configuration that fits.
      executor: ``local`` or ``ray``; jobs: worker processes at a time for ``local``.
      shard: ``I/N``: run only that share of the grid.
      output_dir: write each finished row there (``<id>.json``, atomically).
      resume: skip configurations whose row is already in ``output_dir``.
      timeout: seconds each configuration's process may run (None: no limit); one still running
        then is killed and is an error row.
    """

    options: Options = Options()
    mesh: str | None = None
    set: tuple[str, ...] = ()
    topology: str | None = None
    devices: int | None = None
    rank_by: RankBy = RankBy.step
    executor: str = "local"
    jobs: int = 1
    shard: str | None = None
    output_dir: Path | None = None
    resume: bool = False
    timeout: float | None = None


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """A checked sweep: the document's header, the grid, this run's share of it, and the payloads."""

    header: dict
    grid: Grid
    configs: tuple[Config, ...]
    common: dict
    fingerprint_base: str


def _stagetool_root() -> str:
    # the folder holding the stagetool package (stagetool/sweep/driver.py: two up); not via
    # ``import stagetool``, whose TYPE_CHECKING imports name every layer (the layers contract)
    return str(Path(__file__).resolve().parents[2])


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def plan_sweep(options: SweepOptions) -> SweepPlan:
    """Check the options against the spec and build the grid.

    Raises:
      UsageError / SpecError / TargetError: a bad option, spec or target (exit 2).
    """
    from stagetool.core import codec
    from stagetool.core.mesh import parse_mesh_option
    from stagetool.plan.plan import make_plan
    from stagetool.plan.target import COMPILE_ONLY, check_chip_for_target, parse_target
    from stagetool.spec.discovery import resolve_spec
    from stagetool.spec.parse import read_spec_text
    from stagetool.spec.variables import check_names, parse_set_options

    if options.jobs < 1:
        raise UsageError(f"--jobs {options.jobs}: give at least 1")
    timeout_s(options.timeout)
    if options.resume and options.output_dir is None:
        raise UsageError("--resume reads the rows of an earlier run from --output-dir; give --output-dir DIR")
    if options.executor == "ray" and options.jobs != 1:
        raise UsageError("--jobs is for --executor local; with Ray, the cluster's CPUs set the parallelism")
    shard = parse_shard(options.shard)
    given = options.options
    spec_path = resolve_spec(given.spec, given.target)
    text = read_spec_text(spec_path)
    variables = parse_set_options(list(options.set))
    check_names(text, list(variables), file=str(spec_path))
    if given.gpu_target_config is not None:  # read as XLA reads it, once, before any configuration runs
        from stagetool.plan.target import read_target_config

        read_target_config(given.gpu_target_config)
    topologies = targets = None
    if options.topology is not None:
        from stagetool.sweep.grid import _split

        topologies = _split("--topology", options.topology)
        # each swept target parsed once here: a malformed name is one error now, not one per row
        targets = [parse_target(t, gpu_target_config=given.gpu_target_config) for t in topologies]
        if given.chip:  # one --chip over several targets: each must be that chip's (else exit 2 now)
            for t in targets:
                check_chip_for_target(given.chip, t, sweep=True)
    first = tuple((name, values[0]) for name, values in variables.items())
    # every option (the spec, the TARGET, --function, the placeholders with their first values, --chip,
    # --device-memory, -o, ...) checked once, all at once, as make_plan checks any command's
    plan = make_plan(dataclasses.replace(given, spec=spec_path, variables=first,
                                         topology=topologies[0] if topologies else given.topology))
    if len(plan.functions) != 1:
        raise UsageError(f"a sweep compares configurations of one function, and {spec_path} selects "
                         f"{len(plan.functions)}: " + ", ".join(f.name for f in plan.functions),
                         hint="name it with TARGET or --function NAME")
    fspec = plan.functions[0]
    device_count = options.devices
    if device_count is None and options.mesh is not None and options.mesh.strip().lower() == "all":
        counts = {t.device_count * plan.slices for t in (targets or [plan.target]) if isinstance(t, COMPILE_ONLY)}
        if len(counts) > 1:
            raise UsageError(f"--mesh all with topologies of different sizes ({options.topology})",
                             hint="run one sweep per topology size, or list the meshes: --mesh 2x8,4x4")
        device_count = counts.pop() if counts else plan.mesh.device_count
    meshes = mesh_values(options.mesh, plan.spec.mesh.names, device_count)
    for m in meshes or ():
        try:
            parse_mesh_option(m, plan.spec.mesh)
        except ValueError as e:
            raise UsageError(str(e)) from None
    grid = build_grid(meshes=meshes, topologies=topologies, variables=variables)
    # what each configuration stages: the options whole (a new option reaches every row without a word
    # here), its paths absolute (a configuration's process may run elsewhere), its grid values its own
    absolute = (lambda p: None if p is None else str(Path(p).resolve()))
    each = dataclasses.replace(given, spec=Path(spec_path).resolve(), function=fspec.name, variables=(),
                               mesh=None, topology=None, outputs=(),
                               gpu_target_config=absolute(given.gpu_target_config),
                               cache_dir=Path(absolute(given.cache_dir)) if given.cache_dir else None)
    common = {"options": codec.encode(each)}
    header = {
        "schema_version": SWEEP_SCHEMA_VERSION, "kind": "sweep",
        "stagetool_version": _stagetool_version(), "jax_version": _dist_version("jax"),
        "jaxlib_version": _dist_version("jaxlib"),
        # as the spec writes them (relative to its folder, the report root): the same document from any
        # working directory or checkout, so shards run in different places merge
        "target": fspec.target, "function": fspec.name, "spec": Path(spec_path).name,
        "spec_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "axes": [[name, list(values)] for name, values in grid.axes],
        "options": {"platform": given.platform, "chip": given.chip, "device_memory": given.device_memory},
        "grid_size": len(grid.configs), "shard": f"{shard[0]}/{shard[1]}" if shard else None,
    }
    base = json.dumps({"common": common, "spec_text": hashlib.sha256(text.encode()).hexdigest(),
                       "stagetool": _stagetool_version()}, sort_keys=True)
    return SweepPlan(header, grid, shard_of(grid.configs, shard), common, base)


def timeout_s(value: float | None) -> float | None:
    """``--timeout`` in seconds: None for none (:func:`stagetool.core.units.timeout_seconds`).

    Raises:
      UsageError: not a number of seconds above 0 and at most a week (0, negative, NaN, inf, 1e308).
    """
    from stagetool.core.units import timeout_seconds

    return timeout_seconds(value)


def _stagetool_version() -> str:
    from stagetool._version import __version__

    return __version__


def fingerprint(plan: SweepPlan, config: Config) -> str:
    """What a row in ``--output-dir`` must match to be reused by ``--resume``: the options, the spec's
    text, the stagetool version and the configuration's values (not its index: a row found again
    in a larger grid is the same configuration, and takes its index there)."""
    data = plan.fingerprint_base + json.dumps([config.mesh, config.topology, list(config.variables)])
    return hashlib.sha256(data.encode()).hexdigest()


def payload(plan: SweepPlan, config: Config) -> dict:
    """What a worker needs to stage ``config`` (see :mod:`stagetool.sweep.run`)."""
    return {"config": {"index": config.index, "id": config.id, "mesh": config.mesh, "topology": config.topology,
                       "variables": [list(v) for v in config.variables]},
            "common": plan.common, "cwd": os.getcwd(), "pythonpath": _stagetool_root()}


def read_finished(plan: SweepPlan, output_dir: Path) -> dict[str, dict]:
    """Rows of this sweep already in ``output_dir`` (a file whose fingerprint does not match, or that
    does not parse, is not a finished row and is run again)."""
    from stagetool.process.fileio import FileProblem, read_regular_text
    from stagetool.sweep.rows import row_problem

    done = {}
    for c in plan.configs:
        path = output_dir / f"{c.id}.json"
        try:
            saved = json.loads(read_regular_text(path, max_bytes=MAX_ROW_FILE_BYTES))
        except (OSError, ValueError, RecursionError, FileProblem):
            continue
        if not (isinstance(saved, dict) and set(saved) == {"fingerprint", "row"}
                and saved["fingerprint"] == fingerprint(plan, c)):
            continue
        row = saved["row"]
        if row_problem(row) is not None or row["id"] != c.id or row["values"] != c.values():
            continue  # a row of another configuration, or mistyped: run it again
        done[c.id] = {**row, "index": c.index}
    return done


MAX_ROW_FILE_BYTES = 16 * 2**20
"""A row file larger than this is not one stagetool wrote (a row is a few KiB): it is run again."""


def _check_row_paths(out_dir: Path, configs: list[Config]) -> None:
    """Refuse, before anything runs, a row's path in ``--output-dir`` that holds something a row
    cannot replace: a FIFO (writing it would wait for a reader for ever), a device, a socket, a folder.

    Raises:
      UsageError: naming the paths.
    """
    import stat as stat_

    bad = []
    for c in configs:
        path = out_dir / f"{c.id}.json"
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat_.S_ISREG(st.st_mode):
            kind = "a folder" if stat_.S_ISDIR(st.st_mode) else "a FIFO" if stat_.S_ISFIFO(st.st_mode) \
                else "not a regular file"
            bad.append(f"{path} is {kind}")
    if bad:
        raise UsageError(f"--output-dir {out_dir}: " + "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5
                         else "") + ": a row cannot be written there",
                         hint="remove them (the sweep writes one regular file <id>.json per configuration)")


def run_sweep(options: SweepOptions, *, on_row: Callable[[dict, int, int], None] | None = None,
              on_resume: Callable[[list[str]], None] | None = None) -> dict:
    """Plan, run the configurations not yet finished, and return the sweep document.

    ``on_row(row, finished, total)`` is called as each configuration finishes (for progress);
    ``on_resume(ids)`` once with the ids ``--resume`` takes from ``--output-dir``.

    Raises:
      UsageError / SpecError / TargetError: a bad option, spec or target, before anything runs.
    """
    from stagetool.process.fileio import write_atomic
    from stagetool.sweep import executors

    plan = plan_sweep(options)
    out_dir = options.output_dir
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--output-dir {out_dir}: cannot create: {e.strerror or e}") from None
    rows: dict[str, dict] = read_finished(plan, out_dir) if options.resume and out_dir is not None else {}
    todo = [c for c in plan.configs if c.id not in rows]
    if out_dir is not None:
        _check_row_paths(out_dir, todo)
    if rows and on_resume is not None:
        on_resume([c.id for c in plan.configs if c.id in rows])
    by_id = {c.id: c for c in plan.configs}
    total = len(plan.configs)

    def finished(row: dict) -> None:
        rows[row["id"]] = row
        if out_dir is not None:
            c = by_id[row["id"]]
            write_atomic(out_dir / f"{c.id}.json",
                         json.dumps({"fingerprint": fingerprint(plan, c), "row": row}, indent=1) + "\n")
        if on_row is not None:
            on_row(row, len(rows), total)

    payloads = [payload(plan, c) for c in todo]
    if options.executor == executors.Executor.ray.value:
        if payloads:
            executors.run_ray(payloads, on_row=finished, timeout_s=timeout_s(options.timeout))
    else:
        executors.run_local(payloads, jobs=options.jobs, on_row=finished, timeout_s=timeout_s(options.timeout))
    return document(plan.header, rows.values(), options.rank_by)
