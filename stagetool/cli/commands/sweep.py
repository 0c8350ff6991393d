"""``stagetool sweep``: stage a grid of configurations and compare them, or join the JSON of a
sweep's shards (docs/sweeps-fit.md). It takes the staging options every staging command takes
(:class:`~stagetool.cli.options.Staging`; ``--mesh`` and ``--topology`` are lists here, the grid's)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from stagetool.cli.app import app
from stagetool.cli.options import ChipOpt, DebugOpt, DeviceMemoryOpt, OutputOpt, Staging, outputs, staging_command
from stagetool.cli.output import color, errors, escape, note_untested_jax, plural, stderr, width, write_text
from stagetool.core.errors import ExitCode, UsageError

if TYPE_CHECKING:
    from stagetool.sweep import SweepOptions

MAX_SWEEP_DOCUMENT_BYTES = 256 * 2**20
"""A sweep document larger than this is not one (10,000 rows of a few KiB each)."""


def _sweep_merge(files: list[Path]) -> dict:
    """``sweep merge A.json B.json ...``: the shards' documents joined into one."""
    import json

    from stagetool.process.fileio import FileProblem, read_regular_text
    from stagetool.sweep.rows import merge

    if not files:
        raise UsageError("sweep merge needs the JSON documents to join", hint="stagetool sweep merge a.json b.json")
    docs = []
    for f in files:
        try:
            docs.append(json.loads(read_regular_text(f, max_bytes=MAX_SWEEP_DOCUMENT_BYTES)))
        except FileProblem as e:
            raise UsageError(f"sweep merge: {f} {e}") from None
        except RecursionError:
            raise UsageError(f"sweep merge: {f} is nested too deeply to be a sweep document") from None
        except (OSError, ValueError) as e:
            raise UsageError(f"sweep merge: cannot read {f}: {getattr(e, 'strerror', None) or e}") from None
    return merge(docs, [str(f) for f in files])


def _run_sweep(options: SweepOptions) -> dict:
    """:func:`stagetool.sweep.run_sweep` with a progress line on stderr per finished configuration."""
    from stagetool.sweep import run_sweep
    from stagetool.sweep.rows import row_label

    err = stderr()
    note_untested_jax()

    def progress(row: dict, done: int, total: int) -> None:
        failure = f" ({row['status']})" if row["status"] != "ok" else ""
        err.print(f"[dim]{done}/{total} {escape(row_label(row))}{escape(failure)}[/]")

    def resumed(ids: list[str]) -> None:
        where = escape(str(options.output_dir))
        err.print(f"[dim]resumed {plural(len(ids), 'finished configuration')} from {where}[/]")

    return run_sweep(options, on_row=progress, on_resume=resumed)


SWEEP_MESH_HELP = ("Meshes to try: 1x8,2x4,4x2, or 'all' (every factorisation of the device count over the "
                   "spec's axes).")
SWEEP_TOPOLOGY_HELP = "Compile-only topologies to try: v5e:2x4,v5e:4x4 or h100:8,h100:2x8."


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
@staging_command(without=("cache_dir", "no_cache", "against"), help={"mesh": SWEEP_MESH_HELP, "topology": SWEEP_TOPOLOGY_HELP})
def sweep(staging: Staging,
          files: Annotated[Optional[list[Path]], typer.Argument(
              help="After 'merge': the JSON documents of a sweep's shards to join.", show_default=False)] = None,
          set_: Annotated[Optional[list[str]], typer.Option(
              "--set", help="NAME=V1,V2,...: values for the spec's ${NAME} placeholders (repeatable); the grid is "
                            "the product of all axes.", show_default=False)] = None,
          devices: Annotated[Optional[int], typer.Option(
              "--devices", help="The device count --mesh all factorises (default: the topology's, else the "
                                "spec mesh's).", show_default=False, min=1)] = None,
          chip: ChipOpt = None, device_memory: DeviceMemoryOpt = None,
          rank_by: Annotated[str, typer.Option(
              "--rank-by", help="What picks the best configuration that fits: step (roofline step time on --chip), "
                                "step_time (the step-time estimate: compute, collectives by link, overlap), "
                                "peak, collectives, flops or compile.")] = "step",
          executor: Annotated[str, typer.Option(
              "--executor", help="local: worker processes here (--jobs); ray: tasks on a running Ray cluster "
                                 "(RAY_ADDRESS).")] = "local",
          jobs: Annotated[int, typer.Option("--jobs", "-j", help="Worker processes at a time (local).", min=1)] = 1,
          shard: Annotated[Optional[str], typer.Option(
              "--shard", help="I/N: run only that share of the grid (CI matrix jobs, Slurm array tasks); join "
                              "the JSON with 'stagetool sweep merge'.", show_default=False)] = None,
          output_dir: Annotated[Optional[Path], typer.Option(
              "--output-dir", help="Write each finished configuration to DIR/<id>.json as it completes.",
              show_default=False)] = None,
          resume: Annotated[bool, typer.Option(
              "--resume", help="Skip configurations already finished in --output-dir.")] = False,
          timeout: Annotated[Optional[float], typer.Option(
              "--timeout", help="Seconds each configuration may run; one still running then is killed and is a "
                                "failed row ('inf': no limit).", show_default=False)] = None,
          format: Annotated[str, typer.Option(
              "--format", help="text, json (the input of 'sweep merge'), markdown, csv or html.")] = "text",
          output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """Stage a grid of configurations (meshes x --set values x topologies) and compare them; or
    'stagetool sweep merge A.json B.json ...' to join shards."""
    with errors(debug):
        from stagetool.sweep.executors import Executor
        from stagetool.sweep.render import SweepFormat, render as render_sweep
        from stagetool.sweep.rows import RankBy

        try:
            fmt, rank, how = SweepFormat(format), RankBy(rank_by), Executor(executor)
        except ValueError as e:
            raise UsageError(f"sweep: {e}", hint="--format text|json|markdown|csv|html; --rank-by step|step_time|peak|"
                                                  "collectives|flops|compile; --executor local|ray") from None
        target = staging.target
        if target == "merge":
            doc = _sweep_merge(files or [])
        else:
            if files:
                raise UsageError(f"sweep takes one TARGET; unexpected {' '.join(map(str, files))}",
                                 hint="to join shards: stagetool sweep merge A.json B.json")
            from stagetool.sweep import SweepOptions

            # the staging options every configuration shares; the meshes and topologies are the grid's.
            # No facts cache: each configuration compiles afresh (its row times the compile, --rank-by compile);
            # no --against: a row holds one target's figures
            options = staging.options(chip=chip, device_memory=device_memory, outputs=outputs(output=output),
                                      mesh=None, topology=None, cache_dir=None)
            doc = _run_sweep(SweepOptions(
                options, mesh=staging.mesh, set=tuple(set_ or ()), topology=staging.topology, devices=devices,
                rank_by=rank, executor=how.value, jobs=jobs, shard=shard, output_dir=output_dir, resume=resume,
                timeout=timeout))
        write_text(render_sweep(doc, fmt, color=color(output) and fmt == SweepFormat.text, width=width()), output)
        if any(r["status"] == "error" for r in doc["rows"]):  # a failed configuration is never a success
            raise typer.Exit(int(ExitCode.JAX))
