"""The commands that stage functions and print one view of them: lower, compile, shardings,
collectives, why, cost, memory and report (docs/commands.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

from stagetool.cli.app import app, joined
from stagetool.cli.options import (ChipOpt, DebugOpt, DeviceMemoryOpt, FailIfOverOpt, FormatOpt, JobsOpt, MeasureOpt,
                                   MeasureStepsOpt, OutputOpt, PagerOpt, PeakOpt, ReportPeakOpt, Staging, TopOpt,
                                   measured_steps, outputs, staging_command)
from stagetool.cli.output import emit, errors, staging_status, stderr
from stagetool.core.errors import ExitCode, UsageError
from stagetool.report import Format

if TYPE_CHECKING:
    from stagetool.report.model import Report


def _stage_and_emit(command: str, staging: Staging, fmt: Format, output: Optional[Path], *, pager: bool = False,
                    fail_if_over: bool = False, check: Callable[[Report], None] | None = None, modules: bool = False,
                    measure: int | None = None, **more: Any) -> None:
    """Stage with the shared options (and ``more`` :class:`stagetool.pipeline.Options` fields), print
    ``command``'s sections (its own; the report's all), and with ``--fail-if-over`` the verdict.
    ``check(report)``, when given, may refuse the report before it is printed (a ``UsageError``).
    ``measure`` (``--measure``: that many steps) runs each function for real on the attached devices
    (:func:`stagetool.measure.step.measure_report`); a usage error on a compile-only target, before staging."""
    from stagetool.pipeline import REPORT_SECTIONS, Section, analyze

    sections = (list(REPORT_SECTIONS) + ([Section.MODULES] if modules else []) if command == "report"
                else [Section({"lower": "lowered_text", "compile": "compiled_text"}.get(command, command))])
    if staging.against is not None and command in ("lower", "compile"):
        raise UsageError(f"--against {staging.against}: '{command}' prints one module; --against compares the "
                         "collectives, temporaries, FLOPs and replicated work of two compiles",
                         hint=f"run 'stagetool report ... --against {staging.against}', or '{command} --topology "
                              f"{staging.against}' for the target's module")
    options = joined(staging.options(**more, outputs=outputs(output=output)))
    if measure is not None:
        _measurable(options)
    with staging_status() as on_stage:
        report = analyze(options, sections, command=command, on_stage=on_stage)
        if measure is not None:
            from stagetool.measure.step import measure_report

            report = measure_report(options, report, steps=measure)
    if check is not None:
        check(report)
    emit(report, fmt, output, pager=pager)
    if fail_if_over:
        _fail_if_over(report)


def _measurable(options: Any) -> None:
    """``--measure`` runs the step: refuse a compile-only target (``--topology``, ``--gpu-target-config``),
    which has no devices to run on, before anything is staged.

    Raises:
      UsageError: the target is compile-only.
    """
    target = options.topology or options.gpu_target_config
    if target:
        flag = "--topology" if options.topology else "--gpu-target-config"
        raise UsageError(f"--measure runs the step on the attached devices, and {flag} {target} is a compile-only "
                         "target (nothing to run it on)",
                         hint=f"drop {flag} on a machine with the accelerator attached, or drop --measure")


def _fail_if_over(report: Report) -> None:
    """``--fail-if-over``: exit 1 when any function's peak is over the device memory; exit 2 when it
    cannot be decided (the device memory, or the backend's figures, unknown)."""
    functions = [f for f in report.functions if f.memory is not None]
    suspect = [f"{f.name}: {f.memory.verdict.reason}" for f in functions
               if f.memory.verdict.fits is None and f.memory.record.peak_suspects]
    if suspect:
        raise UsageError("--fail-if-over: verdict unknown: " + "; ".join(suspect),
                         hint="the backend's memory figures cannot decide; compile for the target itself "
                              "(--topology NAME) or check the figures with stagetool memory --format json")
    unknown = [f.name for f in functions if f.memory.verdict.fits is None]
    if unknown:
        raise UsageError(f"--fail-if-over needs the device memory, which is unknown for {', '.join(unknown)}",
                         hint="give --device-memory 16GiB, --chip NAME or --topology NAME")
    over = [f.name for f in functions if f.memory.verdict.fits is False]
    if over:
        stderr().print(f"[bold red]does not fit:[/] {', '.join(over)}")
        raise typer.Exit(int(ExitCode.FINDINGS))


@app.command()
@staging_command
def lower(staging: Staging, dialect: Annotated[str, typer.Option("--dialect", help="stablehlo or hlo.")] = "stablehlo",
          format: FormatOpt = Format.text, output: OutputOpt = None, pager: PagerOpt = False,
          debug: DebugOpt = False) -> None:
    """Print the lowered module (StableHLO, with the shardings as written). Does not compile."""
    with errors(debug):
        _stage_and_emit("lower", staging, format, output, pager=pager, dialect=dialect)


@app.command("compile")
@staging_command
def compile_(staging: Staging, format: FormatOpt = Format.text, output: OutputOpt = None,
             pager: PagerOpt = False, debug: DebugOpt = False) -> None:
    """Print the compiled module: optimized HLO after the SPMD partitioner, per device."""
    with errors(debug):
        _stage_and_emit("compile", staging, format, output, pager=pager)


@app.command()
@staging_command
def shardings(staging: Staging, format: FormatOpt = Format.text, output: OutputOpt = None,
              debug: DebugOpt = False) -> None:
    """For every input and output leaf: the sharding declared, the one compiled, and bytes per device."""
    with errors(debug):
        _stage_and_emit("shardings", staging, format, output)


@app.command()
@staging_command
def collectives(staging: Staging, explain: Annotated[Optional[list[str]], typer.Option(
                    "--explain", "-e", help="An input leaf (its path, or the last part: wq) whose collectives "
                                            "to trace: why is it gathered? Repeatable.", show_default=False)] = None,
                format: FormatOpt = Format.text, output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """Every collective the SPMD partitioner inserted: kind, mesh axes, bytes, runs, and your source line."""
    with errors(debug):
        _stage_and_emit("collectives", staging, format, output, explain=tuple(explain or ()))


@app.command()
@staging_command
def why(staging: Staging,
        leaf: Annotated[Optional[str], typer.Option("--leaf", help="An input or output leaf (its path, its last "
                                                   "part: wq, or a regular expression over them).")] = None,
        line: Annotated[Optional[str], typer.Option("--line", help="A source line, FILE:LINE (model.py:8).")] = None,
        collective: Annotated[Optional[int], typer.Option("--collective", help="A collective, by its number in "
                                                          "'stagetool collectives' (1, 2, ...).")] = None,
        format: FormatOpt = Format.text, output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """Where a leaf's, a line's or a collective's sharding came from, and what it causes downstream."""
    with errors(debug):
        _stage_and_emit("why", staging, format, output, why=(leaf, line, collective), check=_why_names_something)


def _why_names_something(report: Report) -> None:
    """``why``: a question that names nothing in any function staged (``--collective 99999``, a
    ``--line`` of a file the program does not come from) is a usage error, with the closest names,
    never an empty answer with exit 0.

    Raises:
      UsageError: every answered function says the question names nothing in it.
    """
    answers = [(f.name, f.why) for f in report.functions if f.error is None and f.why is not None]
    if not answers or not all(w.names_nothing for _, w in answers):
        return
    lines = [f"{name}: {w.unavailable}" + (f"; close: {', '.join(w.close)}" if w.close else "") for name, w in answers]
    raise UsageError(f"why {answers[0][1].question}: names nothing in "
                     + ("the function staged" if len(answers) == 1 else f"the {len(answers)} functions staged")
                     + ": " + "; ".join(lines),
                     hint="collectives are numbered as 'stagetool collectives' lists them; a --line names FILE:LINE "
                          "of the program's source (a bare file name matches it in any folder)")


@app.command()
@staging_command
def cost(staging: Staging, chip: ChipOpt = None, measure: MeasureOpt = False, measure_steps: MeasureStepsOpt = None,
         format: FormatOpt = Format.text, output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """FLOPs, transcendentals and bytes accessed: per device (compiled) and whole program (lowered);
    with --measure, the step run for real on the attached accelerator beside the estimate."""
    with errors(debug):
        _stage_and_emit("cost", staging, format, output, chip=chip, measure=measured_steps(measure, measure_steps))


@app.command()
@staging_command
def memory(staging: Staging, device_memory: DeviceMemoryOpt = None, chip: ChipOpt = None,
           fail_if_over: FailIfOverOpt = False, peak: PeakOpt = True, top: TopOpt = 10,
           format: FormatOpt = Format.text, output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """Per-device memory: arguments, outputs, donated, temporaries, peak, and what is live at the peak."""
    with errors(debug):
        _stage_and_emit("memory", staging, format, output, fail_if_over=fail_if_over, device_memory=device_memory,
                        chip=chip, peak=peak, top=top)


@app.command()
@staging_command
def modules(staging: Staging, chip: ChipOpt = None, peak: PeakOpt = True, format: FormatOpt = Format.text,
            output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """Per module path (NNX/Linen modules, Equinox fields, jax.named_scope) and phase (forward, backward,
    remat recompute, update): FLOPs, bytes accessed, collectives, bytes live at the peak and, with a
    chip, estimated time."""
    with errors(debug):
        _stage_and_emit("modules", staging, format, output, peak=peak, chip=chip)


@app.command()
@staging_command
def report(staging: Staging, chip: ChipOpt = None, device_memory: DeviceMemoryOpt = None,
           fail_if_over: FailIfOverOpt = False, peak: ReportPeakOpt = None, top: TopOpt = 10, jobs: JobsOpt = 1,
           modules: Annotated[Optional[bool], typer.Option(
               "--modules/--no-modules", help="Add the roll-up per module ('stagetool modules'). Default: on for "
                                              "--format html (a collapsible tree), off otherwise.",
               show_default=False)] = None,
           measure: MeasureOpt = False, measure_steps: MeasureStepsOpt = None,
           format: FormatOpt = Format.text, output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """One screen: mesh, stage timings, shardings, collectives, cost and memory (with --measure, the step
    run for real on the attached accelerator beside the estimate)."""
    if peak is None:  # the HTML page draws the memory timeline: it costs no second compile
        peak = format is Format.html
    if modules is None:  # the HTML page folds it into a tree; the other formats keep their one screen
        modules = format is Format.html
    with errors(debug):
        _stage_and_emit("report", staging, format, output, fail_if_over=fail_if_over, device_memory=device_memory,
                        chip=chip, peak=peak, top=top, jobs=jobs, modules=modules,
                        measure=measured_steps(measure, measure_steps))
