"""The ``stagetool`` command: a thin Typer layer over :mod:`stagetool.pipeline`.

It parses options, calls the pipeline, picks a renderer and maps errors to exit codes
(:class:`stagetool.core.errors.ExitCode`). Importing this module does not import JAX, so ``--help``
stays fast (``--version`` is answered before this module is imported: :mod:`stagetool.__main__`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import typer

from stagetool._version import __version__
from stagetool.core.errors import ExitCode, StagetoolError, UsageError
from stagetool.report import Format

app = typer.Typer(
    name="stagetool",
    help="What will XLA do with my JAX function on this mesh? Stage it (trace → lower → compile) on "
         "simulated CPU devices, attached accelerators or a compile-only TPU topology, and see the "
         "shardings, collectives, cost and memory.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# ---- options shared by the staging commands ---------------------------------------------------

Target = Annotated[Optional[str], typer.Argument(
    help="path/to/file.py:func, package.module:func or module:obj.attr; omit to run every function of the spec.",
    show_default=False)]
SpecOpt = Annotated[Optional[Path], typer.Option(
    "--spec", "-s", help="The YAML spec. Default: <module>.stagetool.yaml beside the file, then ./stagetool.yaml.",
    show_default=False)]
MeshOpt = Annotated[Optional[str], typer.Option(
    "--mesh", "-m", help="Mesh sizes, overriding the spec: 2x4 (in the spec's axis order) or data=2,model=4.",
    show_default=False)]
PlatformOpt = Annotated[Optional[str], typer.Option(
    "--platform", help="Backend: cpu, gpu or tpu. Default: the spec's, else JAX's default.", show_default=False)]
TopologyOpt = Annotated[Optional[str], typer.Option(
    "--topology", help="Compile for hardware that is not here: a TPU topology, e.g. v5e:2x4 (needs libtpu), or "
                       "GPUs, e.g. h100:8 (one host of 8), h100:2x8 (needs the gpu-aot extra).",
    show_default=False)]
SlicesOpt = Annotated[Optional[int], typer.Option(
    "--slices", help="Stage N slices of the TPU --topology joined over DCN (multi-slice); the mesh's first axis "
                     "spans them.", show_default=False)]
GpuTargetConfigOpt = Annotated[Optional[str], typer.Option(
    "--gpu-target-config", help="A GpuTargetConfigProto text file (from 'stagetool devices --target-config') "
                                "for a GPU topology: --topology gpu:8 --gpu-target-config h100.txtpb.",
    show_default=False)]
FunctionOpt = Annotated[Optional[list[str]], typer.Option(
    "--function", "-f", help="Run only this function of the spec (repeat for several).", show_default=False)]
LocalAvalsOpt = Annotated[bool, typer.Option(
    "--local-avals", help="Spec shapes are host-local (as one process sees them), like 'avals: local'.")]
ProcessesOpt = Annotated[Optional[int], typer.Option(
    "--processes", help="Simulate N processes laid over the devices in order (for local avals).",
    show_default=False, min=1)]
FormatOpt = Annotated[Format, typer.Option(
    "--format", help="text: tables on a terminal (plain when piped); json: the versioned document; "
                     "markdown: tables for a pull request (report -o FILE.md also writes its pictures as "
                     "SVG files into FILE-files/); html: one self-contained page with pictures.")]
OutputOpt = Annotated[Optional[Path], typer.Option(
    "--output", "-o", help="Write to FILE (atomically) instead of stdout.", show_default=False)]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]
CacheDirOpt = Annotated[Optional[str], typer.Option(  # str: Path('') would be '.', and '' is an error
    "--cache-dir", help="The facts cache: a function whose lowered module, compile options, devices and versions "
                        "match an entry is not compiled again. Default: $STAGETOOL_CACHE_DIR, else the user cache "
                        "folder.", show_default=False)]
NoCacheOpt = Annotated[bool, typer.Option(
    "--no-cache", help="Compile every function; read and write no cache (also STAGETOOL_NO_CACHE=1).")]
PagerOpt = Annotated[bool, typer.Option("--pager", help="Page long module text on a terminal.")]


@dataclasses.dataclass(frozen=True)
class Staging:
    """The options every staging command shares (declared once, in :data:`_STAGING_PARAMETERS`)."""

    target: Optional[str]
    spec: Optional[Path]
    mesh: Optional[str]
    platform: Optional[str]
    topology: Optional[str]
    function: Optional[list[str]]
    local_avals: bool
    processes: Optional[int]
    cache_dir: Optional[str] = None
    no_cache: bool = False
    gpu_target_config: Optional[str] = None
    slices: Optional[int] = None

    def options(self, **more: Any) -> Any:
        """The :class:`stagetool.pipeline.Options` these stand for, with ``more`` fields set."""
        from stagetool.staging.cache import resolve_cache_dir
        from stagetool.pipeline import Options

        return Options(target=self.target, spec=self.spec, mesh=self.mesh, platform=self.platform,
                       topology=self.topology, function=tuple(self.function) if self.function else None,
                       local_avals=self.local_avals, processes=self.processes,
                       gpu_target_config=self.gpu_target_config, slices=self.slices,
                       cache_dir=resolve_cache_dir(self.cache_dir, no_cache=self.no_cache), **more)


#: (name, annotation, default) of the shared staging options, in the order ``--help`` lists them.
_STAGING_PARAMETERS: tuple[tuple[str, Any, Any], ...] = (
    ("target", Target, None), ("spec", SpecOpt, None), ("mesh", MeshOpt, None), ("platform", PlatformOpt, None),
    ("topology", TopologyOpt, None), ("function", FunctionOpt, None), ("local_avals", LocalAvalsOpt, False),
    ("processes", ProcessesOpt, None), ("cache_dir", CacheDirOpt, None), ("no_cache", NoCacheOpt, False),
    ("gpu_target_config", GpuTargetConfigOpt, None), ("slices", SlicesOpt, None),
)


def staging_command(fn: Any) -> Any:
    """Give a command the shared staging options: Typer sees them as the command's first parameters,
    and the command receives them as one ``staging: Staging`` argument."""
    import functools
    import inspect

    signature = inspect.signature(fn, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "staging"]
    shared = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)
              for name, annotation, default in _STAGING_PARAMETERS]

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        staging = Staging(**{name: kwargs.pop(name) for name, _, _ in _STAGING_PARAMETERS})
        return fn(staging=staging, **kwargs)

    parameters = shared + own
    command.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    return command


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"stagetool {__version__}")
        raise typer.Exit()


#: ``--coordinator``/``--num-processes``/``--process-id`` of the root command, for jax.distributed.
_DISTRIBUTED: dict[str, Any] = {}


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True,
                                                help="Print the version and exit.")] = False,
          coordinator: Annotated[Optional[str], typer.Option(
              "--coordinator", help="Multi-process run: HOST:PORT of process 0's coordinator (jax.distributed).",
              show_default=False)] = None,
          num_processes: Annotated[Optional[int], typer.Option(
              "--num-processes", help="Multi-process run: how many processes take part.", show_default=False,
              min=1)] = None,
          process_id: Annotated[Optional[int], typer.Option(
              "--process-id", help="Multi-process run: this process's index (0 prints and writes).",
              show_default=False, min=0)] = None) -> None:
    """What will XLA do with my JAX function on this mesh?

    Launched on every host of a cluster (Slurm, Open MPI, a multi-host TPU slice), stagetool joins
    the job through jax.distributed automatically; elsewhere pass --coordinator, --num-processes
    and --process-id. Every process stages the program; only process 0 prints and writes files.
    """
    _DISTRIBUTED.update(coordinator=coordinator, num_processes=num_processes, process_id=process_id)


def _join_distributed() -> int | None:
    """Join a multi-process job when asked to (or when a cluster launcher is detected).

    Returns the number of processes given on the command line, or None.
    """
    from stagetool.devices.distributed import detect_cluster, initialize

    c, n, i = (_DISTRIBUTED.get(k) for k in ("coordinator", "num_processes", "process_id"))
    if c is None and n is None and i is None and detect_cluster() is None:
        return None
    if c is not None:
        _stderr().print(f"[dim]joining {n} processes at {_escape(c)} as process {i}…[/]")
    initialize(c, n, i)
    return n


def _is_primary() -> bool:
    """False in every process of a multi-process job but process 0."""
    if "jax" not in sys.modules:
        return True
    import jax

    return not jax.distributed.is_initialized() or jax.process_index() == 0


# ---- plumbing ---------------------------------------------------------------------------------


def _stderr():
    """Rich's console on stderr when it is a terminal; else a plain writer of the same markup
    (importing Rich costs more than the rest of a short command's own work)."""
    if not sys.stderr.isatty():
        return _PlainConsole()
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


_DEBUG = [False]
"""Whether the running command has ``--debug`` (a failed function's traceback is then shown)."""
_MARKUP_TAG = None


class _PlainConsole:
    """``print`` of Rich markup as plain text on stderr: tags dropped, escaped brackets kept, as
    Rich's own console writes it when stderr is not a terminal."""

    def print(self, markup: str = "") -> None:
        import re

        global _MARKUP_TAG
        if _MARKUP_TAG is None:
            _MARKUP_TAG = re.compile(r"((\\*)\[([a-z#/@][^[]*?)])")  # rich.markup.RE_TAGS
        out, pos = [], 0
        for m in _MARKUP_TAG.finditer(markup):
            out.append(markup[pos:m.start()])
            pos = m.end()
            backslashes = m.group(2)
            if backslashes:
                out.append("\\" * (len(backslashes) // 2))
                if len(backslashes) % 2:  # an escaped bracket: the text, not a tag
                    out.append(m.group(0)[len(backslashes):])
        out.append(markup[pos:])
        sys.stderr.write("".join(out) + "\n")
        sys.stderr.flush()


@contextlib.contextmanager
def _errors(debug: bool) -> Iterator[None]:
    """Map errors to one message on stderr and a fixed exit code.

    A :class:`StagetoolError` exits with its own code. Anything else escaped from JAX or from
    stagetool itself: one line and exit 3. ``--debug`` adds the full traceback, never another code.
    """
    _DEBUG[0] = debug
    try:
        yield
    except typer.Exit:
        raise
    except BrokenPipeError:
        _stdout_closed()
        raise typer.Exit(int(ExitCode.USAGE)) from None
    except SystemExit as e:  # user code called sys.exit(): its failure, never the command's verdict
        err = _stderr()
        if debug:
            import traceback

            traceback.print_exc()
        err.print(f"[bold red]error:[/] user code raised SystemExit({_escape(repr(e.code))}) while it was "
                  "imported, called or traced; the run did not finish")
        raise typer.Exit(int(ExitCode.JAX)) from None
    except StagetoolError as e:
        err = _stderr()
        if debug:
            import traceback

            traceback.print_exc()
        err.print(f"[bold red]error:[/] {_escape(e.message)}")
        frame = getattr(e, "user_frame", None)
        if frame:
            err.print(f"  at {_escape(frame)}")
        if e.hint:
            err.print(f"  [dim]hint:[/] {_escape(e.hint)}")
        raise typer.Exit(int(e.exit_code)) from None
    except Exception as e:  # noqa: BLE001 - the last line of defence: no traceback without --debug
        err = _stderr()
        if debug:
            import traceback

            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        err.print(f"[bold red]error:[/] unexpected {type(e).__name__}: {_escape(first)}")
        if not debug:
            err.print("  [dim]hint:[/] rerun with --debug for the traceback, and report it if it is not your code's")
        raise typer.Exit(int(ExitCode.JAX)) from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - a BaseException subclass from user code: never exit 1 ("regression")
        err = _stderr()
        if debug:
            import traceback

            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        err.print(f"[bold red]error:[/] user code raised {_escape(type(e).__name__)} (a BaseException"
                  f"{': ' + _escape(first) if first else ''}) while it was imported, called or traced; the run did "
                  "not finish")
        raise typer.Exit(int(ExitCode.JAX)) from None


@contextlib.contextmanager
def _user_stdout_to_stderr() -> Iterator[None]:
    """While the user's code is imported and traced, its ``print`` goes to stderr: stdout carries only
    the payload (``stagetool lower f.py:f > f.mlir``, ``--format json | jq``)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _escape(text: str) -> str:
    """Text for a Rich markup string: control characters shown as escapes, markup escaped."""
    from stagetool.core.text import markup_safe

    return markup_safe(text)


def _stdout_to_devnull() -> None:
    """Point file descriptor 1 at ``/dev/null`` (best effort), so that the interpreter's own flush of
    stdout at exit does not fail again after stdout failed once."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _stdout_closed() -> None:
    """stdout's reader went away (``stagetool ... | head``): say so once, and keep the interpreter
    from failing again when it flushes stdout at exit."""
    _stdout_to_devnull()
    try:
        _stderr().print("[bold red]error:[/] stdout was closed before the output was written (broken pipe)")
    except OSError:
        pass


def _write_stdout(text: str) -> None:
    """The payload to stdout. A stdout that cannot take it (``> /dev/full``: ENOSPC, EIO) is one
    message and exit 2; stdout is then pointed at ``/dev/null`` so that the interpreter's own flush
    at exit does not fail again ("Exception ignored ...", exit 120). A closed pipe is
    :func:`_stdout_closed`'s (raised on as ``BrokenPipeError``)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        _stdout_to_devnull()
        raise UsageError(f"cannot write to stdout: {e.strerror or e}",
                         hint="write to a file with -o FILE, or free space where stdout goes") from None


def _color(output: Optional[Path]) -> bool:
    return output is None and sys.stdout.isatty() and "NO_COLOR" not in os.environ


def _to_file_or_pipe(output: Optional[Path]) -> bool:
    """The text goes to a file (``-o``) or a pipe, not a terminal: its tables keep every cell whole."""
    return output is not None or not sys.stdout.isatty()


def _width() -> int:
    if sys.stdout.isatty():
        import shutil

        return shutil.get_terminal_size((120, 40)).columns
    try:
        return int(os.environ.get("COLUMNS", "160"))  # piped: wide enough that no column is cut
    except ValueError:
        return 160


def emit(doc: Any, fmt: Format, output: Optional[Path], *, pager: bool = False) -> None:
    """Render ``doc`` and write it to ``output`` (atomically) or stdout: only the payload goes there."""
    from stagetool.report import render

    if not _is_primary():
        return
    functions = getattr(doc, "functions", None)
    if functions and all(getattr(f, "error", None) for f in functions):
        _exit_if_failed(doc)  # nothing staged: the errors alone, on stderr; stdout stays empty
    color = _color(output) and fmt == Format.text
    if fmt != Format.json:  # names from specs and user code, control characters escaped (JSON escapes its own)
        from stagetool.core.text import sanitized

        doc = sanitized(doc)
    svgs: dict[str, str] = {}
    if fmt == Format.markdown and output is not None and getattr(doc, "command", None) == "report":
        from stagetool.report.render_markdown import render_with_figures

        text, svgs = render_with_figures(doc, f"{output.stem}-files")
    else:
        text = render(doc, fmt, color=color, width=_width(), fit=_to_file_or_pipe(output))
    if output is not None:
        from stagetool.process.fileio import write_atomic

        try:
            for name, svg in svgs.items():
                folder = output.parent / f"{output.stem}-files"
                folder.mkdir(exist_ok=True)
                write_atomic(folder / name, svg)
            write_atomic(output, text)
        except OSError as e:
            raise UsageError(f"--output {output}: cannot write: {e.strerror or e}") from None
        _stderr().print(f"[dim]wrote {_escape(str(output))}[/]")
    elif pager and sys.stdout.isatty():
        import pydoc

        pydoc.pager(text)
    else:
        _write_stdout(text)
    _exit_if_failed(doc)


def _write_text(text: str, output: Optional[Path]) -> None:
    """Plain text to ``output`` (atomically) or stdout."""
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    from stagetool.process.fileio import write_atomic

    try:
        write_atomic(output, text)
    except OSError as e:
        raise UsageError(f"--output {output}: cannot write: {e.strerror or e}") from None
    _stderr().print(f"[dim]wrote {_escape(str(output))}[/]")


def _exit_if_failed(doc: Any) -> None:
    """After the others are rendered: each function that failed to stage on stderr, and exit 3."""
    failed = [f for f in getattr(doc, "functions", None) or () if getattr(f, "error", None)]
    if failed and _DEBUG[0]:
        for f in failed:
            if f.error_traceback:
                sys.stderr.write(f.error_traceback)
    if failed:
        _report_failures({f.name: f.error for f in failed})
        raise typer.Exit(int(ExitCode.JAX))


_UNTESTED_NOTED = [False]
"""Whether this command has said that the installed JAX is outside the tested range."""


def _note_untested_jax() -> None:
    """One line on stderr, once per command, when the installed jax/jaxlib is outside the tested range
    (:func:`stagetool.core.compat.untested_notice`; read from the distributions, JAX not imported)."""
    if _UNTESTED_NOTED[0]:
        return
    _UNTESTED_NOTED[0] = True
    from stagetool.core import compat

    versions = compat.installed_versions()
    line = compat.untested_notice(*versions) if versions else None
    if line:
        _stderr().print(f"[yellow]{_escape(line)}[/]")


@contextlib.contextmanager
def _status() -> Iterator[Any]:
    """A status line on stderr naming the stage in progress (only when stderr is a terminal)."""
    _note_untested_jax()
    if not sys.stderr.isatty():
        yield None
        return
    with _stderr().status("starting JAX…") as status:
        def update(function: str, stage: str) -> None:
            status.update(f"{function}: {stage}…")

        yield update


def _joined(options: Any) -> Any:
    """Join a multi-process job if asked to; the options then say how many processes share the mesh."""
    job = _join_distributed()
    return dataclasses.replace(options, job_processes=job) if job else options


def _outputs(**paths: Optional[Path]) -> tuple[tuple[str, Path], ...]:
    """``(--option, path)`` of the files a command will write, for the plan to check before staging."""
    return tuple(("--" + name.replace("_", "-"), path) for name, path in paths.items() if path is not None)


def _analyze(command: str, options: Any, sections: list) -> Any:
    from stagetool.pipeline import analyze

    options = _joined(options)
    with _status() as on_stage, _user_stdout_to_stderr():
        return analyze(options, sections, command=command, on_stage=on_stage)


# ---- commands ---------------------------------------------------------------------------------


@app.command()
@staging_command
def lower(staging: Staging, dialect: Annotated[str, typer.Option("--dialect", help="stablehlo or hlo.")] = "stablehlo",
          format: FormatOpt = Format.text, output: OutputOpt = None, pager: PagerOpt = False,
          debug: DebugOpt = False) -> None:
    """Print the lowered module (StableHLO, with the shardings as written). Does not compile."""
    from stagetool.pipeline import Section

    with _errors(debug):
        opts = staging.options(dialect=dialect, outputs=_outputs(output=output))
        emit(_analyze("lower", opts, [Section.LOWERED_TEXT]), format, output, pager=pager)


@app.command("compile")
@staging_command
def compile_(staging: Staging, format: FormatOpt = Format.text, output: OutputOpt = None,
             pager: PagerOpt = False, debug: DebugOpt = False) -> None:
    """Print the compiled module: optimized HLO after the SPMD partitioner, per device."""
    from stagetool.pipeline import Section

    with _errors(debug):
        opts = staging.options(outputs=_outputs(output=output))
        emit(_analyze("compile", opts, [Section.COMPILED_TEXT]), format, output, pager=pager)


@app.command()
@staging_command
def shardings(staging: Staging, format: FormatOpt = Format.text, output: OutputOpt = None,
              debug: DebugOpt = False) -> None:
    """For every input and output leaf: the sharding declared, the one compiled, and bytes per device."""
    from stagetool.pipeline import Section

    with _errors(debug):
        opts = staging.options(outputs=_outputs(output=output))
        emit(_analyze("shardings", opts, [Section.SHARDINGS]), format, output)


ChipOpt = Annotated[Optional[str], typer.Option(
    "--chip", help="Estimate a step-time lower bound (roofline) on this chip: tpu-v5e, h100-sxm, ... "
                   "(README: 'Cost and memory'; extend the table with 'chips:' in the spec).", show_default=False)]
DeviceMemoryOpt = Annotated[Optional[str], typer.Option(
    "--device-memory", help="Memory per device, e.g. 16GiB or 80GB, instead of what the device reports.",
    show_default=False)]
FailIfOverOpt = Annotated[bool, typer.Option(
    "--fail-if-over", help="Exit 1 when the peak does not fit in the device memory.")]
JobsOpt = Annotated[int, typer.Option(
    "--jobs", "-j", help="Stage up to N functions at once, each in a worker process of its own (one JAX start per "
                         "worker); the output is the same as with 1.")]
TopOpt = Annotated[int, typer.Option("--top", help="How many largest inputs and peak buffers to list.", min=1)]


def _emit_with_verdict(command: str, options: Any, sections: list, fmt: Format, output: Optional[Path],
                       fail_if_over: bool) -> None:
    """Analyse and emit; with ``--fail-if-over``, exit 1 when any function's peak is over the device memory."""
    report = _analyze(command, options, sections)
    emit(report, fmt, output)
    suspect = [f"{f.name}: {f.memory.verdict.reason}" for f in report.functions
               if f.memory is not None and f.memory.verdict.fits is None and f.memory.record.peak_suspects]
    if fail_if_over and suspect:
        raise UsageError("--fail-if-over: verdict unknown: " + "; ".join(suspect),
                         hint="the backend's memory figures cannot decide; compile for the target itself "
                              "(--topology NAME) or check the figures with stagetool memory --format json")
    unknown = [f.name for f in report.functions if f.memory is not None and f.memory.verdict.fits is None]
    if fail_if_over and unknown:
        raise UsageError(f"--fail-if-over needs the device memory, which is unknown for {', '.join(unknown)}",
                         hint="give --device-memory 16GiB, --chip NAME or --topology NAME")
    over = [f.name for f in report.functions if f.memory is not None and f.memory.verdict.fits is False]
    if fail_if_over and over:
        _stderr().print(f"[bold red]does not fit:[/] {', '.join(over)}")
        raise typer.Exit(int(ExitCode.FINDINGS))


@app.command()
@staging_command
def collectives(staging: Staging, explain: Annotated[Optional[list[str]], typer.Option(
                    "--explain", "-e", help="An input leaf (its path, or the last part: wq) whose collectives "
                                            "to trace: why is it gathered? Repeatable.", show_default=False)] = None,
                format: FormatOpt = Format.text, output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """Every collective the SPMD partitioner inserted: kind, mesh axes, bytes, runs, and your source line."""
    from stagetool.pipeline import Section

    with _errors(debug):
        opts = staging.options(explain=tuple(explain or ()), outputs=_outputs(output=output))
        emit(_analyze("collectives", opts, [Section.COLLECTIVES]), format, output)


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
    from stagetool.pipeline import Section

    with _errors(debug):
        opts = staging.options(why=(leaf, line, collective), outputs=_outputs(output=output))
        emit(_analyze("why", opts, [Section.WHY]), format, output)


@app.command()
@staging_command
def cost(staging: Staging, chip: ChipOpt = None, format: FormatOpt = Format.text,
         output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """FLOPs, transcendentals and bytes accessed: per device (compiled) and whole program (lowered)."""
    from stagetool.pipeline import Section

    with _errors(debug):
        opts = staging.options(chip=chip, outputs=_outputs(output=output))
        emit(_analyze("cost", opts, [Section.COST]), format, output)


@app.command()
@staging_command
def memory(staging: Staging, device_memory: DeviceMemoryOpt = None, chip: ChipOpt = None,
           fail_if_over: FailIfOverOpt = False,
           peak: Annotated[bool, typer.Option("--peak/--no-peak",
                                              help="List the buffers live at the peak (one more compile).")] = True,
           top: TopOpt = 10, format: FormatOpt = Format.text, output: OutputOpt = None,
           debug: DebugOpt = False) -> None:
    """Per-device memory: arguments, outputs, donated, temporaries, peak, and what is live at the peak."""
    from stagetool.pipeline import Section

    with _errors(debug):
        opts = staging.options(device_memory=device_memory, chip=chip, peak=peak, top=top,
                               outputs=_outputs(output=output))
        _emit_with_verdict("memory", opts, [Section.MEMORY], format, output, fail_if_over)


@app.command()
@staging_command
def report(staging: Staging, chip: ChipOpt = None, device_memory: DeviceMemoryOpt = None,
           fail_if_over: FailIfOverOpt = False,
           peak: Annotated[bool, typer.Option("--peak/--no-peak",
                                              help="List the buffers live at the peak (one more compile).")] = False,
           top: TopOpt = 10, jobs: JobsOpt = 1, format: FormatOpt = Format.text, output: OutputOpt = None,
           debug: DebugOpt = False) -> None:
    """One screen: mesh, stage timings, shardings, collectives, cost and memory."""
    from stagetool.pipeline import REPORT_SECTIONS

    with _errors(debug):
        opts = staging.options(device_memory=device_memory, chip=chip, peak=peak, top=top, jobs=jobs,
                               outputs=_outputs(output=output))
        _emit_with_verdict("report", opts, list(REPORT_SECTIONS), format, output, fail_if_over)


@app.command()
def devices(mesh: Annotated[Optional[str], typer.Option(
                "--mesh", "-m", help="Lay a mesh over the devices, e.g. data=2,model=4.", show_default=False)] = None,
            platform: PlatformOpt = None, topology: TopologyOpt = None,
            gpu_target_config: GpuTargetConfigOpt = None, slices: SlicesOpt = None,
            target_config: Annotated[bool, typer.Option(
                "--target-config", help="Print (or -o FILE) the attached GPU's GpuTargetConfigProto, for "
                                        "--gpu-target-config on a machine without it.")] = False,
            format: FormatOpt = Format.text, output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """The platform, device kind and count, processes, and jax/jaxlib versions."""
    with _errors(debug):
        if target_config:
            from stagetool.devices.gpu_capture import capture_target_config

            _write_text(capture_target_config(), output)
            return
        from stagetool.pipeline import devices_report

        _note_untested_jax()

        emit(devices_report(mesh=mesh, platform=platform, topology=topology, gpu_target_config=gpu_target_config,
                            slices=slices), format, output)


# ---- CI gate: snapshot, check, diff (README: "The CI gate") ------------------------------------

IsolateOpt = Annotated[bool, typer.Option(
    "--isolate", help="Stage each function in a worker process of its own (--jobs N: N at a time), so one "
                      "that aborts its process (an XLA 'LLVM ERROR') is reported as failed and the others "
                      "still run. Costs ~1.5 s per function.")]
ToleranceOpt = Annotated[Optional[list[str]], typer.Option(
    "--tolerance", "-t", help="NAME=VALUE, repeatable: allowed growth before a regression, e.g. memory=2%, "
                              "flops=5%, collective_bytes=64KiB. Names: memory, flops, bytes_accessed, "
                              "collective_bytes, collective_count. Defaults: 1%, 1%, 1%, 0%, 0.",
    show_default=False)]
TimeoutOpt = Annotated[Optional[float], typer.Option(
    "--timeout", help="Seconds each function may take: functions are staged in worker processes (as with "
                      "--isolate or --jobs), and one still running after this long has its process killed and "
                      "is reported as failed. Default with --isolate: 1800.", show_default=False, min=0.001)]
JunitOpt = Annotated[Optional[Path], typer.Option(
    "--junit-xml", help="Also write JUnit XML (one testcase per function) to FILE.", show_default=False)]


def _gate_output(cmp: Any, format: Format, output: Optional[Path], junit_xml: Optional[Path],
                 snapshots: tuple[dict, dict] | None = None) -> None:
    """Write the change table (stdout or -o), JUnit XML, and the GitHub step summary when set.
    ``snapshots`` (before, after) let the HTML page draw the layouts and memory that changed."""
    from stagetool.process.fileio import write_atomic
    from stagetool.core.text import sanitized
    from stagetool.gate import render as render_changes

    cmp = sanitized(cmp)  # names from specs, baselines and user code: control characters escaped
    text = render_changes.render(cmp, format, color=_color(output) and format == Format.text, width=_width(),
                                 snapshots=snapshots)
    if output is not None:
        try:
            write_atomic(output, text)
        except OSError as e:
            raise UsageError(f"--output {output}: cannot write: {e.strerror or e}") from None
    else:
        _write_stdout(text)
    if junit_xml is not None:
        try:
            write_atomic(junit_xml, render_changes.junit_xml(cmp))
        except OSError as e:
            raise UsageError(f"--junit-xml {junit_xml}: cannot write: {e.strerror or e}") from None
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        try:
            with open(summary, "a", encoding="utf-8") as fh:
                fh.write(render_changes.render_markdown(cmp) + "\n")
        except OSError as e:
            _stderr().print(f"[yellow]warning:[/] GITHUB_STEP_SUMMARY {_escape(summary)}: {_escape(str(e))}")


def _report_failures(failed: dict) -> None:
    err = _stderr()
    for name, message in failed.items():
        text = message if message.startswith(f"{name}: ") else f"{name}: {message}"
        err.print(f"[bold red]error:[/] {_escape(text)}")


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
             isolate: IsolateOpt = False, timeout: TimeoutOpt = None, jobs: JobsOpt = 1, debug: DebugOpt = False) -> None:
    """Record shardings, memory, cost and collectives of every function: the baseline for 'check'."""
    from stagetool.gate.snapshot import write_snapshot
    from stagetool.pipeline import take_snapshot

    with _errors(debug):
        opts = _joined(staging.options(jobs=jobs, isolate=isolate, timeout_s=timeout, peak=peak,
                                       outputs=_outputs(output=output)))
        with _status() as on_stage, _user_stdout_to_stderr():
            run = take_snapshot(opts, on_stage=on_stage)
        if run.failed:
            _report_failures(run.failed)
            n = len(run.failed)
            _stderr().print(f"[red]{n} function{'s' if n != 1 else ''} failed to stage; {_escape(str(output))} "
                            "not written[/]")
            raise typer.Exit(int(ExitCode.JAX))
        if not _is_primary():
            return
        dropped = _functions_dropped(output, run.snapshot)
        write_snapshot(output, run.snapshot)
        n = len(run.snapshot["functions"])
        _stderr().print(f"[dim]wrote {_escape(str(output))} ({n} function{'s' if n != 1 else ''})[/]")
        if dropped:
            _stderr().print(f"[yellow]notice:[/] {_escape(str(output))} held {_escape(', '.join(dropped))}, which this snapshot "
                            "does not; to refresh one function of a baseline, use 'check --update -f NAME'")


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
              show_default=False)] = None,
          isolate: IsolateOpt = False, timeout: TimeoutOpt = None, jobs: JobsOpt = 1, debug: DebugOpt = False) -> None:
    """CI gate: recompute and compare with the baseline. Exit 0 clean, 1 regression, 2 bad input, 3 JAX failure."""
    from stagetool.core.tolerances import effective_tolerances, parse_tolerance_options
    from stagetool.gate.compare import compare, environment_notices
    from stagetool.gate.snapshot import load_snapshot, write_snapshot
    from stagetool.pipeline import take_snapshot

    with _errors(debug):
        cli_tols = parse_tolerance_options(tolerance or [])
        before = None
        if not (update and not baseline.exists()):
            before = load_snapshot(baseline)
        # a run restricted on purpose compares (and --update rewrites) only what it staged; a full run
        # also catches baseline functions that are no longer in the spec (a regression)
        restricted = staging.target is not None or staging.function is not None
        opts = _joined(staging.options(jobs=jobs, isolate=isolate, timeout_s=timeout,
                                       peak=format == Format.html if peak is None else peak,
                                       outputs=_outputs(output=output, junit_xml=junit_xml,
                                                        baseline=baseline if update else None)))
        with _status() as on_stage, _user_stdout_to_stderr():
            run = take_snapshot(opts, on_stage=on_stage)
        _report_failures(run.failed)
        if not _is_primary():
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
            if run.failed:
                _stderr().print(f"[red]not updating {_escape(str(baseline))}: a function failed[/]")
                raise typer.Exit(int(ExitCode.JAX))
            from stagetool.process.fileio import is_special, locked

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
            n, kept = len(run.snapshot["functions"]), len(new["functions"]) - len(run.snapshot["functions"])
            others = "1 other kept as it was" if kept == 1 else f"{kept} others kept as they were"
            _stderr().print(f"[dim]updated {_escape(str(baseline))} ({n} function{'s' if n != 1 else ''}"
                            + (f"; {others}" if kept else "") + ")[/]")
            code = ExitCode.OK
        raise typer.Exit(int(code))


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
    from stagetool.pipeline import take_snapshot

    with _errors(debug):
        cli_tols = parse_tolerance_options(tolerance or [])
        live = mesh_a is not None or mesh_b is not None
        if live:
            if a is not None or b is not None:
                raise UsageError("give either two snapshot files or --mesh-a/--mesh-b, not both")
            if mesh_a is None or mesh_b is None:
                raise UsageError("live diff needs both --mesh-a and --mesh-b", hint="e.g. --mesh-a 2x4 --mesh-b 4x2")
            runs = []
            for m in (mesh_a, mesh_b):
                from stagetool.staging.cache import resolve_cache_dir
                from stagetool.pipeline import Options

                # the HTML page draws both meshes' memory over time: take the peak dump for it
                opts = Options(spec=spec, mesh=m, platform=platform, function=tuple(function) if function else None,
                               cache_dir=resolve_cache_dir(), isolate=isolate, timeout_s=timeout,
                               peak=format == Format.html,
                               outputs=_outputs(output=output, junit_xml=junit_xml))
                with _status() as on_stage, _user_stdout_to_stderr():
                    runs.append(take_snapshot(opts, on_stage=on_stage))
            _report_failures({**runs[0].failed, **runs[1].failed})
            before, after, failed = runs[0].snapshot, runs[1].snapshot, {**runs[0].failed, **runs[1].failed}
            labels, spec_check = (f"mesh {mesh_a}", f"mesh {mesh_b}"), runs[1].spec_check
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


# ---- sweep (README: "Sweeps"); self-contained: its options are its own -------------------------


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def sweep(target: Target = None,
          files: Annotated[Optional[list[Path]], typer.Argument(
              help="After 'merge': the JSON documents of a sweep's shards to join.", show_default=False)] = None,
          spec: SpecOpt = None, function: FunctionOpt = None, platform: PlatformOpt = None,
          mesh: Annotated[Optional[str], typer.Option(
              "--mesh", "-m", help="Meshes to try: 1x8,2x4,4x2, or 'all' (every factorisation of the device "
                                   "count over the spec's axes).", show_default=False)] = None,
          set_: Annotated[Optional[list[str]], typer.Option(
              "--set", help="NAME=V1,V2,...: values for the spec's ${NAME} placeholders (repeatable); the grid is "
                            "the product of all axes.", show_default=False)] = None,
          topology: Annotated[Optional[str], typer.Option(
              "--topology", help="Compile-only topologies to try: v5e:2x4,v5e:4x4 or h100:8,h100:2x8.",
              show_default=False)] = None,
          slices: SlicesOpt = None, gpu_target_config: GpuTargetConfigOpt = None,
          devices: Annotated[Optional[int], typer.Option(
              "--devices", help="The device count --mesh all factorises (default: the topology's, else the "
                                "spec mesh's).", show_default=False, min=1)] = None,
          chip: ChipOpt = None, device_memory: DeviceMemoryOpt = None,
          rank_by: Annotated[str, typer.Option(
              "--rank-by", help="What picks the best configuration that fits: step (roofline step time on --chip), "
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
    with _errors(debug):
        from stagetool.sweep.render import SweepFormat, render as render_sweep
        from stagetool.sweep.rows import RankBy
        from stagetool.sweep.executors import Executor

        try:
            fmt, rank, how = SweepFormat(format), RankBy(rank_by), Executor(executor)
        except ValueError as e:
            raise UsageError(f"sweep: {e}", hint="--format text|json|markdown|csv|html; --rank-by step|peak|collectives|"
                                                  "flops|compile; --executor local|ray") from None
        if target == "merge":
            doc = _sweep_merge(files or [])
        else:
            if files:
                raise UsageError(f"sweep takes one TARGET; unexpected {' '.join(map(str, files))}",
                                 hint="to join shards: stagetool sweep merge A.json B.json")
            from stagetool.sweep import SweepOptions, run_sweep

            options = SweepOptions(target=target, spec=spec, function=tuple(function) if function else None,
                                   platform=platform, chip=chip, device_memory=device_memory, mesh=mesh,
                                   set=tuple(set_ or ()), topology=topology, slices=slices,
                                   gpu_target_config=gpu_target_config, devices=devices, rank_by=rank,
                                   executor=how.value, jobs=jobs, shard=shard, output_dir=output_dir, resume=resume,
                                   outputs=_outputs(output=output), timeout=timeout)
            err = _stderr()
            _note_untested_jax()

            def progress(row: dict, done: int, total: int) -> None:
                failure = f" ({row['status']})" if row["status"] != "ok" else ""
                from stagetool.sweep.rows import row_label

                err.print(f"[dim]{done}/{total} {_escape(row_label(row))}{_escape(failure)}[/]")

            def resumed(ids: list[str]) -> None:
                err.print(f"[dim]resumed {len(ids)} finished configuration{'s' if len(ids) != 1 else ''} "
                          f"from {_escape(str(output_dir))}[/]")

            doc = run_sweep(options, on_row=progress, on_resume=resumed)
        text = render_sweep(doc, fmt, color=_color(output) and fmt == SweepFormat.text, width=_width())
        if output is not None:
            from stagetool.process.fileio import write_atomic

            try:
                write_atomic(output, text)
            except OSError as e:
                raise UsageError(f"--output {output}: cannot write: {e.strerror or e}") from None
            _stderr().print(f"[dim]wrote {_escape(str(output))}[/]")
        else:
            _write_stdout(text)
        if any(r["status"] == "error" for r in doc["rows"]):  # a failed configuration is never a success
            raise typer.Exit(int(ExitCode.JAX))


def _sweep_merge(files: list[Path]) -> dict:
    import json

    from stagetool.sweep.rows import merge

    if not files:
        raise UsageError("sweep merge needs the JSON documents to join", hint="stagetool sweep merge a.json b.json")
    from stagetool.process.fileio import FileProblem, read_regular_text

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


MAX_SWEEP_DOCUMENT_BYTES = 256 * 2**20
"""A sweep document larger than this is not one (10,000 rows of a few KiB each)."""


#: the root command's options that take a value (``--coordinator HOST:PORT``)
_ROOT_VALUE_OPTIONS = ("--coordinator", "--num-processes", "--process-id")


def _click_command(argv: list[str]) -> Any:
    """The click command that runs ``argv``: the root group holding only the subcommand ``argv``
    names; for the root's help (``--help``, ``-h``, no arguments) the root group listing every
    subcommand by name and help text alone; else (a misspelt command, a root flag) the full group.

    Typer builds a click command from each function's signature on every run (about 35 ms for all
    twelve on a 2-core VM), and a run needs only its own; what it parses and prints is the same
    (``tests/test_cli.py`` compares the help both ways).
    """
    import copy
    import inspect

    import typer.core
    import typer.main

    if argv in ([], ["--help"], ["-h"]):
        root = copy.copy(app)
        root.registered_commands = []
        group = typer.main.get_command(root)
        for c in app.registered_commands:  # listed, never run: the help exits first
            doc = c.help if c.help is not None else inspect.getdoc(c.callback)
            group.add_command(typer.core.TyperCommand(
                name=c.name or typer.main.get_command_name(c.callback.__name__), callback=None,
                help=inspect.cleandoc(doc) if doc else doc, short_help=c.short_help, hidden=c.hidden,
                deprecated=c.deprecated))
        return group

    name, args = None, iter(argv)
    for arg in args:
        if arg in _ROOT_VALUE_OPTIONS:
            next(args, None)
        elif arg.startswith(tuple(f"{o}=" for o in _ROOT_VALUE_OPTIONS)):
            continue
        elif arg.startswith("-"):
            break  # a root flag (--help, --version) or a usage error: the whole group answers it
        else:
            name = arg
            break
    infos = [c for c in app.registered_commands
             if name is not None and (c.name or typer.main.get_command_name(c.callback.__name__)) == name]
    if len(infos) != 1:
        return typer.main.get_command(app)
    only = copy.copy(app)
    only.registered_commands = infos
    return typer.main.get_command(only)


def _run_app(argv: list[str] | None) -> int:
    """Run the Typer app; its exit code.

    Typer (click) handles its own usage errors (unknown command or option: exit 2) in standalone
    mode and ends every run with ``SystemExit``, whose code is returned here. Every command maps
    its errors through :func:`_errors`, so a ``SystemExit`` that is not an integer code stagetool
    chose cannot reach this point as a success.
    """
    _UNTESTED_NOTED[0] = False
    try:
        _click_command(sys.argv[1:] if argv is None else argv)(args=argv, prog_name="stagetool",
                                                               standalone_mode=True)
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return int(ExitCode.OK)
        if isinstance(e.code, int) and not isinstance(e.code, bool) and e.code in {int(c) for c in ExitCode}:
            return e.code
        return int(ExitCode.JAX)
    except BrokenPipeError:
        _stdout_closed()
        return int(ExitCode.USAGE)
    return int(ExitCode.OK)


class _Signalled(BaseException):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _end_on_signal(signum: int) -> None:
    """A signal ends the run: kill children, remove temporary files, one line, exit 130/143.

    The staging thread may be inside XLA's compiler, where no Python code runs until it returns;
    the process ends with ``os._exit`` so that neither that thread nor the interpreter's teardown
    (which would wait for it, or crash under it) runs on.
    """
    import signal

    from stagetool.process import cleanup, supervise

    for sig in (signal.SIGINT, signal.SIGTERM):  # ending already: a second signal (the terminal's and the
        try:                                     # supervisor's copy) must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):
            pass
    cleanup.run_all()
    code, name = ((ExitCode.INTERRUPTED, "interrupted (SIGINT)") if signum == signal.SIGINT
                  else (ExitCode.TERMINATED, "terminated (SIGTERM)"))
    for stream in (sys.stdout, sys.__stdout__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe; nothing more to say there
            pass
    try:
        os.write(2, f"stagetool: {name}\n".encode())
    except OSError:
        pass
    supervise.report(int(code))
    os._exit(int(code))


def main(argv: list[str] | None = None) -> int:
    """The console-script entry point; returns the exit code.

    The command runs in a worker thread while the main thread waits and handles SIGINT and SIGTERM:
    a signal during a compile (C++, where Python's handlers cannot run) still ends the run at once
    with exit 130/143, one line on stderr, children killed and temporary files removed
    (:func:`_end_on_signal`). A signal the caller set to be ignored (``nohup``, a background job)
    stays ignored. Called from a thread other than the main one, the command runs in that thread.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _run_app(argv)

    def handler(signum: int, frame: Any) -> None:
        raise _Signalled(signum)

    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        current = signal.getsignal(sig)
        if current is signal.SIG_IGN:
            continue
        previous[sig] = current
        signal.signal(sig, handler)
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["code"] = _run_app(argv)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            result["error"] = e

    worker = threading.Thread(target=work, name="stagetool-command", daemon=True)
    try:
        try:
            worker.start()
            while worker.is_alive():
                worker.join(0.25)
                for sig in previous:
                    # A backend's plugin may install its own handler (a C++ stack dump on SIGTERM)
                    # with sigaction when it starts: put ours back.
                    signal.signal(sig, handler)
        except _Signalled as s:
            _end_on_signal(s.signum)
        except KeyboardInterrupt:  # a handler installed by someone else (a test runner)
            _end_on_signal(signal.SIGINT)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
    if "error" in result:
        e = result["error"]
        if isinstance(e, KeyboardInterrupt) or not isinstance(e, BaseException):
            raise e
        # escaped every handler (raised outside a command's error mapping): exit 3, never 1
        try:
            sys.stderr.write(f"error: unexpected {type(e).__name__}; the run did not finish\n")
        except (OSError, ValueError):
            pass
        return int(ExitCode.JAX)
    return result["code"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
