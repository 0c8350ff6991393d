"""The CI gate's commands: snapshot (the baseline), check (recompute and compare with it) and diff
(two snapshots, or one spec on two meshes) (docs/ci-gate.md)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from stagetool.cli.app import app, joined
from stagetool.cli.options import (ChipOpt, DebugOpt, FormatOpt, FunctionOpt, IsolateOpt, JobsOpt, JunitOpt, OutputOpt,
                                   PlatformOpt, SpecOpt, Staging, TimeoutOpt, ToleranceOpt, outputs,
                                   staging_command)
from stagetool.cli.output import (color, errors, escape, is_primary, plural, report_failures, staging_status, stderr,
                                  width, write_file, write_text)
from stagetool.core.errors import ExitCode, UsageError
from stagetool.report import Format

if TYPE_CHECKING:
    from stagetool.gate.compare import Comparison
    from stagetool.gate.run import SnapshotRun
    from stagetool.pipeline import Options


def _gate_output(cmp: Comparison, format: Format, output: Optional[Path], junit_xml: Optional[Path],
                 snapshots: tuple[dict, dict] | None = None) -> None:
    """Write the change table (stdout or -o), JUnit XML, and the GitHub step summary when set.
    ``snapshots`` (before, after) let the HTML page draw the layouts and memory that changed."""
    from stagetool.core.text import sanitized
    from stagetool.gate import render as render_changes
    from stagetool.report.render_text import FIT_WIDTH

    cmp = sanitized(cmp)  # names from specs, baselines and user code: control characters escaped
    # a file or a pipe: every cell whole (a leaf path is never folded mid-word), as report writes them
    fit = output is not None or not sys.stdout.isatty()
    text = render_changes.render(cmp, format, color=color(output) and format == Format.text,
                                 width=FIT_WIDTH if fit else width(), snapshots=snapshots)
    write_text(text, output, say=False)
    if junit_xml is not None:
        write_file(junit_xml, render_changes.junit_xml(cmp), "--junit-xml")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        try:
            with open(summary, "a", encoding="utf-8") as fh:
                fh.write(render_changes.render_markdown(cmp) + "\n")
        except OSError as e:
            stderr().print(f"[yellow]warning:[/] GITHUB_STEP_SUMMARY {escape(summary)}: {escape(str(e))}")


def _take_snapshot(opts: Options) -> SnapshotRun:
    """:func:`stagetool.pipeline.take_snapshot` with the status line: the SnapshotRun."""
    from stagetool.pipeline import take_snapshot

    with staging_status() as on_stage:
        return take_snapshot(opts, on_stage=on_stage)


def _functions_dropped(path: Path, snapshot: dict) -> list[str]:
    """Functions an existing snapshot file holds that the new one does not (it replaces the file whole)."""
    import json

    from stagetool.process.fileio import is_special

    if is_special(path):  # a device, FIFO or /dev/stdout: written in place, never read first
        return []
    try:
        before = json.loads(path.read_text(encoding="utf-8"))["functions"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return sorted(set(before) - set(snapshot["functions"])) if isinstance(before, dict) else []


@app.command()
@staging_command
def snapshot(staging: Staging, output: Annotated[Path, typer.Option("--output", "-o", help="The snapshot file (written atomically).")]
             = Path("stagetool.lock.json"),
             peak: Annotated[bool, typer.Option(
                 "--peak/--no-peak", help="Also record each function's memory over time (XLA's dump with the one "
                                          "compile), which 'check --format html' draws against the current one.")]
             = False,
             chip: ChipOpt = None,
             isolate: IsolateOpt = False, timeout: TimeoutOpt = None, jobs: JobsOpt = 1, debug: DebugOpt = False) -> None:
    """Record shardings, memory, cost and collectives of every function: the baseline for 'check'."""
    from stagetool.gate.snapshot import write_snapshot

    with errors(debug):
        run = _take_snapshot(joined(staging.options(jobs=jobs, isolate=isolate, timeout_s=timeout, peak=peak, chip=chip,
                                                    outputs=outputs(output=output))))
        if run.failed:
            report_failures(run.failed)
            stderr().print(f"[red]{plural(len(run.failed), 'function')} failed to stage; {escape(str(output))} "
                           "not written[/]")
            raise typer.Exit(int(ExitCode.JAX))
        if not is_primary():
            return
        dropped = _functions_dropped(output, run.snapshot)
        write_snapshot(output, run.snapshot)
        stderr().print(f"[dim]wrote {escape(str(output))} ({plural(len(run.snapshot['functions']), 'function')})[/]")
        if dropped:
            stderr().print(f"[yellow]notice:[/] {escape(str(output))} held {escape(', '.join(dropped))}, which this "
                           "snapshot does not; to refresh one function of a baseline, use 'check --update -f NAME'")


def _update_baseline(baseline: Path, before: Optional[dict], run: SnapshotRun, restricted: bool) -> None:
    """``check --update``: rewrite the baseline with what ``run`` found (a restricted run: only the
    functions it staged, the others kept); exit 3, not updating, when a function failed."""
    from stagetool.gate.compare import environment_notices
    from stagetool.gate.snapshot import load_snapshot, write_snapshot
    from stagetool.process.fileio import is_special, locked

    if run.failed:
        stderr().print(f"[red]not updating {escape(str(baseline))}: a function failed[/]")
        raise typer.Exit(int(ExitCode.JAX))
    with locked(baseline):
        # read-modify-write under an exclusive lock: a concurrent 'check --update -f other' that
        # landed since this run read the baseline is kept, not overwritten
        current = before
        if restricted and baseline.exists() and not is_special(baseline):
            current = load_snapshot(baseline)
        new = run.snapshot
        if restricted and current is not None:
            # a restricted run updates only what it staged; the baseline's other functions stay
            new = {**run.snapshot, "functions": {**current["functions"], **run.snapshot["functions"]}}
            differs = environment_notices(current, new)
            if differs:
                raise UsageError(f"not updating {baseline}: it comes from another environment ("
                                 + "; ".join(differs) + "), and a partial update would mix the two",
                                 hint="update every function: drop --function / the TARGET")
        write_snapshot(baseline, new)
    kept = len(new["functions"]) - len(run.snapshot["functions"])
    others = "1 other kept as it was" if kept == 1 else f"{kept} others kept as they were"
    stderr().print(f"[dim]updated {escape(str(baseline))} ({plural(len(run.snapshot['functions']), 'function')}"
                   + (f"; {others}" if kept else "") + ")[/]")


@app.command()
@staging_command
def check(staging: Staging, baseline: Annotated[Path, typer.Option("--baseline", "-b", help="The snapshot to compare with.")]
          = Path("stagetool.lock.json"),
          tolerance: ToleranceOpt = None,
          update: Annotated[bool, typer.Option("--update", help="Rewrite the baseline with what is found now "
                                                                 "and exit 0 (unless a function fails).")] = False,
          format: FormatOpt = Format.text, output: OutputOpt = None, junit_xml: JunitOpt = None,
          peak: Annotated[Optional[bool], typer.Option(
              "--peak/--no-peak", help="Record each function's memory over time (XLA's dump with the one compile); "
                                       "default: with --format html, which draws it beside the baseline's.",
              show_default=False)] = None, chip: ChipOpt = None,
          isolate: IsolateOpt = False, timeout: TimeoutOpt = None, jobs: JobsOpt = 1, debug: DebugOpt = False) -> None:
    """CI gate: recompute and compare with the baseline. Exit 0 clean, 1 regression, 2 bad input, 3 JAX failure."""
    from stagetool.core.tolerances import effective_tolerances, parse_tolerance_options
    from stagetool.gate.compare import compare
    from stagetool.gate.snapshot import load_snapshot

    with errors(debug):
        cli_tols = parse_tolerance_options(tolerance or [])
        before = None
        if not (update and not baseline.exists()):
            before = load_snapshot(baseline)
        # a run restricted on purpose compares (and --update rewrites) only what it staged; a full run
        # also catches baseline functions that are no longer in the spec (a regression)
        restricted = staging.target is not None or staging.function is not None
        run = _take_snapshot(joined(staging.options(
            jobs=jobs, isolate=isolate, timeout_s=timeout, peak=format == Format.html if peak is None else peak,
            chip=chip, outputs=outputs(output=output, junit_xml=junit_xml, baseline=baseline if update else None))))
        report_failures(run.failed)
        if not is_primary():
            return
        if before is not None:
            cmp = compare(before, run.snapshot, failed=run.failed, before_label=str(baseline), after_label="now",
                          only=run.functions if restricted else None, order=run.functions,
                          tolerances_for=lambda name: effective_tolerances(name, spec_check=run.spec_check,
                                                                           cli=cli_tols))
            _gate_output(cmp, format, output, junit_xml, (before, run.snapshot))
            code = cmp.exit_code()
        else:
            code = ExitCode.JAX if run.failed else ExitCode.OK
        if update:
            _update_baseline(baseline, before, run, restricted)
            code = ExitCode.OK
        raise typer.Exit(int(code))


def _diff_live(staging: Staging, meshes: tuple[str, str], format: Format, **more: Any) -> tuple[SnapshotRun, SnapshotRun]:
    """``diff --mesh-a A --mesh-b B``: the spec's two SnapshotRuns, on A and on B."""
    # the HTML page draws both meshes' memory over time: take the peak dump for it
    runs = [_take_snapshot(dataclasses.replace(staging, mesh=m).options(peak=format == Format.html, **more))
            for m in meshes]
    report_failures({**runs[0].failed, **runs[1].failed})
    return runs[0], runs[1]


@app.command()
def diff(a: Annotated[Optional[Path], typer.Argument(help="Snapshot A (before).", show_default=False)] = None,
         b: Annotated[Optional[Path], typer.Argument(help="Snapshot B (after).", show_default=False)] = None,
         spec: SpecOpt = None, function: FunctionOpt = None,
         mesh_a: Annotated[Optional[str], typer.Option(
             "--mesh-a", help="Live mode: stage the spec on this mesh (before)...", show_default=False)] = None,
         mesh_b: Annotated[Optional[str], typer.Option(
             "--mesh-b", help="...and on this one (after), then compare.", show_default=False)] = None,
         platform: PlatformOpt = None, tolerance: ToleranceOpt = None,
         fail_on_regression: Annotated[bool, typer.Option(
             "--fail-on-regression", help="Exit 1 when B regresses against A (default: exit 0).")] = False,
         format: FormatOpt = Format.text, output: OutputOpt = None, junit_xml: JunitOpt = None,
         isolate: IsolateOpt = False, timeout: TimeoutOpt = None, debug: DebugOpt = False) -> None:
    """Compare two snapshots (diff A.json B.json), or one spec on two meshes (diff --spec S --mesh-a 2x4 --mesh-b 4x2)."""
    from stagetool.core.tolerances import effective_tolerances, parse_tolerance_options
    from stagetool.gate.compare import compare
    from stagetool.gate.snapshot import load_snapshot

    with errors(debug):
        cli_tols = parse_tolerance_options(tolerance or [])
        live = mesh_a is not None or mesh_b is not None
        if live:
            if a is not None or b is not None:
                raise UsageError("give either two snapshot files or --mesh-a/--mesh-b, not both")
            if mesh_a is None or mesh_b is None:
                raise UsageError("live diff needs both --mesh-a and --mesh-b", hint="e.g. --mesh-a 2x4 --mesh-b 4x2")
            run_a, run_b = _diff_live(Staging(spec=spec, function=function, platform=platform), (mesh_a, mesh_b),
                                      format, isolate=isolate, timeout_s=timeout,
                                      outputs=outputs(output=output, junit_xml=junit_xml))
            before, after, failed = run_a.snapshot, run_b.snapshot, {**run_a.failed, **run_b.failed}
            labels, spec_check = (f"mesh {mesh_a}", f"mesh {mesh_b}"), run_b.spec_check
        else:
            if a is None or b is None:
                raise UsageError("diff needs two snapshot files A.json B.json, or --spec with --mesh-a and --mesh-b")
            before, after, failed = load_snapshot(a), load_snapshot(b), {}
            labels, spec_check = (str(a), str(b)), None
        cmp = compare(before, after, failed=failed, title="stagetool diff", before_label=labels[0],
                      after_label=labels[1], same_mesh_expected=not live,
                      tolerances_for=lambda name: effective_tolerances(name, spec_check=spec_check, cli=cli_tols))
        _gate_output(cmp, format, output, junit_xml, (before, after))
        raise typer.Exit(int(cmp.exit_code(fail_on_regression=fail_on_regression)))
