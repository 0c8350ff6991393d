"""``stagetool calibrate``: micro-benchmarks of the attached accelerator → a chip profile (YAML) that
the spec's ``chips:`` (and so ``--chip NAME``) loads (docs/step-time.md)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from stagetool.cli.app import app
from stagetool.cli.options import DebugOpt, OutputOpt
from stagetool.cli.output import errors, escape, note_untested_jax, stderr, write_text
from stagetool.core.errors import UsageError


@app.command()
def calibrate(name: Annotated[Optional[str], typer.Option(
                  "--name", help="The profile's chip name (default: the chip table's name for the attached "
                                 "device kind, e.g. tpu-v5e).", show_default=False)] = None,
              repeats: Annotated[int, typer.Option("--repeats", min=3, max=1000,
                                                   help="Timed samples per benchmark (their median is kept).")] = 10,
              warmup: Annotated[int, typer.Option("--warmup", min=1, max=100,
                                                  help="Untimed calls before the samples.")] = 2,
              format: Annotated[str, typer.Option(
                  "--format", "-f", help="yaml (the profile: a chips: entry) or json (every benchmark's timing).")
                  ] = "yaml",
              output: OutputOpt = None, debug: DebugOpt = False,
              cpu_for_tests: Annotated[bool, typer.Option("--cpu-for-tests", hidden=True)] = False) -> None:
    """Measure the attached accelerator (matmul per dtype and precision, HBM copy, element-wise, reduction,
    transcendentals, gather/scatter, per-kernel cost; collectives with several devices) and write its chip
    profile: put the printed chips: entry in a spec (or -o FILE and copy it), then --chip NAME uses it."""
    with errors(debug):
        fmt = format.strip().lower()
        if fmt not in ("yaml", "json"):
            raise UsageError(f"--format {fmt}: calibrate writes yaml (the chip profile) or json",
                             hint="--format yaml or --format json")
        from stagetool.measure.calibrate import check_profile_name, profile_name_for

        if name is not None:  # before any benchmark (two minutes on a TPU): what the loader would refuse
            check_profile_name(name)
        if output is not None:
            from stagetool.process.fileio import write_problem

            problem = write_problem(output)
            if problem:
                raise UsageError(f"--output {output}: cannot write: {problem}",
                                 hint="give a file in a folder that exists and that you can write")
        note_untested_jax()
        from stagetool.measure.timing import attached_accelerator, require_accelerator

        if cpu_for_tests:  # the logic on the CPU backend, tiny sizes (figures meaningless)
            platform, kind, n = attached_accelerator()
        else:
            platform, kind, n = require_accelerator("stagetool calibrate")
        chip = profile_name_for(name, kind)
        from stagetool.measure.calibrate import calibrate as run, profile_yaml

        err = stderr()
        err.print(f"[dim]calibrating {n} × {escape(kind)} ({escape(platform)}) as {escape(chip)}: "
                  f"{repeats} samples per benchmark…[/]")

        def progress(r) -> None:
            value = (f"{r.rate * 1e6:.4g} µs" if r.unit == "second" else f"{r.rate:.4e} {r.unit}/s")
            err.print(f"  {r.name:<20} {value:>22}   [dim]{escape(r.shape)}, median "
                      f"{r.timing.median_seconds * 1e3:.4g} ms, spread {r.timing.spread * 100:.1f}%[/]")

        command = "stagetool " + shlex.join(sys.argv[1:] if sys.argv and Path(sys.argv[0]).name.startswith(
            "stagetool") else ["calibrate"] + (["-o", str(output)] if output else []))
        cal = run(chip=chip, command=command, size="tiny" if cpu_for_tests else "full", repeats=repeats,
                  warmup=warmup, on_result=progress)
        if fmt == "json":
            import json

            text = json.dumps(cal.to_json(), indent=2, sort_keys=True) + "\n"
        else:
            text = profile_yaml(cal)
        write_text(text, output)
