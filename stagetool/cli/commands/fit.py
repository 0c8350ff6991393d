"""``stagetool fit``: the largest batch that fits per setting of the other knobs, or with
``--what-if`` the single changes that make a setting fit — each a real compile on the target
(docs/sweeps-fit.md, "What fits"; the search is :mod:`stagetool.sweep.fit`)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stagetool.cli.app import app
from stagetool.cli.options import ChipOpt, DebugOpt, DeviceMemoryOpt, OutputOpt, Staging, outputs, staging_command
from stagetool.cli.output import color, errors, escape, note_untested_jax, stderr, width, write_text
from stagetool.core.errors import ExitCode, UsageError


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
@staging_command(without=("against",),  # a probe is one target's compile: fits or not there
                 help={"mesh": "Meshes to search, each a setting: 2x4,4x2.",
                       "topology": "Compile-only targets to search, each a setting: v5e:2x4,v5p:2x2x2."})
def fit(staging: Staging,
        set_: Annotated[Optional[list[str]], typer.Option(
            "--set", help="NAME=V1,V2,...: the other knobs (the spec's ${NAME} placeholders); each value a "
                          "setting. With --what-if, the first value is the setting as given, the next the change "
                          "to try; --set BATCH=N gives its batch.", show_default=False)] = None,
        chip: ChipOpt = None, device_memory: DeviceMemoryOpt = None,
        batch: Annotated[str, typer.Option(
            "--batch", help="The name of the spec's batch placeholder (${batch}).")] = "batch",
        multiple: Annotated[int, typer.Option(
            "--multiple", help="Compile only batches that are multiples of this (the data axes' size).",
            min=1)] = 1,
        start: Annotated[Optional[int], typer.Option(
            "--start", help="The first batch compiled (default: --multiple).", show_default=False, min=1)] = None,
        max_batch: Annotated[int, typer.Option(
            "--max-batch", help="Compile no batch above this.", min=1)] = 4096,
        max_compiles: Annotated[int, typer.Option(
            "--max-compiles", help="The cap on compiles; a search still running then is undecided (exit 1).",
            min=1)] = 64,
        tokens_per_example: Annotated[Optional[int], typer.Option(
            "--tokens-per-example", help="Tokens in one example (the sequence length): tokens per second "
                                         "from the step-time estimate.", show_default=False, min=1)] = None,
        what_if: Annotated[bool, typer.Option(
            "--what-if", help="Compile the setting as given and, when it does not fit, half the batch and each "
                              "knob's next value; list those that fit.")] = False,
        jobs: Annotated[int, typer.Option("--jobs", "-j", help="Settings searched at a time (a process each).",
                                          min=1)] = 1,
        timeout: Annotated[Optional[float], typer.Option(
            "--timeout", help="Seconds one compile may run; past it the setting is undecided (exit 1).",
            show_default=False)] = None,
        format: Annotated[str, typer.Option("--format", help="text, json, markdown or html.")] = "text",
        output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """Find the largest batch that fits the device memory per setting of the other knobs (remat
    policy, sequence length, mesh, topology), with real compiles: print the frontier and the best
    setting's --set line. Exit 1 when the search cannot decide."""
    with errors(debug):
        from stagetool.sweep.fit import FitOptions, run_fit
        from stagetool.sweep.fit import what_if as run_what_if
        from stagetool.sweep.fit_render import FitFormat, render

        try:
            fmt = FitFormat(format)
        except ValueError as e:
            raise UsageError(f"fit: {e}", hint="--format text|json|markdown|html") from None
        sets = list(set_ or ())
        given = None
        if what_if:
            mine = [s for s in sets if s.partition("=")[0].strip() == batch]
            if len(mine) != 1 or not mine[0].partition("=")[2].strip().isdigit():
                raise UsageError(f"--what-if needs the batch as given: --set {batch}=N",
                                 hint=f"e.g. --what-if --set {batch}=64 --set remat=none,full")
            given = int(mine[0].partition("=")[2])
            sets.remove(mine[0])
        # the staging options every compile shares (the facts cache among them); meshes and topologies are knobs
        shared = staging.options(chip=chip, device_memory=device_memory, outputs=outputs(output=output), mesh=None,
                                 topology=None)
        options = FitOptions(shared, topology=staging.topology, mesh=staging.mesh, set=tuple(sets), batch=batch,
                             multiple=multiple, start=start, max_batch=max_batch, max_compiles=max_compiles,
                             tokens_per_example=tokens_per_example, jobs=jobs, timeout=timeout)
        err = stderr()
        note_untested_jax()

        def progress(values: dict, probe) -> None:
            knobs = ",".join(f"{k}={v}" for k, v in values.items() if k != batch)
            err.print(f"[dim]{escape(knobs or 'as written')} {escape(batch)}={probe.batch}: {escape(probe.outcome)}[/]")

        doc = (run_what_if(options, given, on_probe=progress) if given is not None
               else run_fit(options, on_probe=progress))
        write_text(render(doc, fmt, color=color(output) and fmt == FitFormat.text, width=width()), output)
        if not doc["decided"]:
            raise typer.Exit(int(ExitCode.FINDINGS))
