"""Output handling of every command: the payload to stdout or ``-o FILE`` (atomically, through
:mod:`stagetool.process.fileio`), messages on stderr, errors mapped to exit codes
(:class:`stagetool.core.errors.ExitCode`) from the exception tree, and a closed stdout."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import typer

from stagetool.core.errors import ExitCode, StagetoolError, StagingError, UsageError
from stagetool.report import Format

if TYPE_CHECKING:
    from stagetool.report.model import DevicesReport, Report

_DEBUG = [False]
"""Whether the running command has ``--debug`` (a failed function's traceback is then shown)."""
_MARKUP_TAG = None
UNTESTED_NOTED = [False]
"""Whether this command has said that the installed JAX is outside the tested range."""


# ---- stderr -----------------------------------------------------------------------------------


def stderr():
    """Rich's console on stderr when it is a terminal; else a plain writer of the same markup
    (importing Rich costs more than the rest of a short command's own work)."""
    if not sys.stderr.isatty():
        return PlainConsole()
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


class PlainConsole:
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


def escape(text: str) -> str:
    """Text for a Rich markup string: control characters shown as escapes, markup escaped."""
    from stagetool.core.text import markup_safe

    return markup_safe(text)


def plural(n: int, noun: str) -> str:
    """``1 function``, ``2 functions``."""
    return f"{n} {noun}{'s' if n != 1 else ''}"


def note_untested_jax() -> None:
    """One line on stderr, once per command, when the installed jax/jaxlib is outside the tested range
    (:func:`stagetool.core.compat.untested_notice`; read from the distributions, JAX not imported)."""
    if UNTESTED_NOTED[0]:
        return
    UNTESTED_NOTED[0] = True
    from stagetool.core import compat

    versions = compat.installed_versions()
    line = compat.untested_notice(*versions) if versions else None
    if line:
        stderr().print(f"[yellow]{escape(line)}[/]")


@contextlib.contextmanager
def staging_status() -> Iterator[Optional[Callable[[str, str], None]]]:
    """While the pipeline runs: a status line on stderr naming the stage in progress (only when stderr
    is a terminal; the ``on_stage`` callback it yields, else None), and the user's ``print`` on stderr,
    so that stdout carries only the payload (``stagetool lower f.py:f > f.mlir``, ``--format json | jq``)."""
    note_untested_jax()
    if not sys.stderr.isatty():
        with contextlib.redirect_stdout(sys.stderr):
            yield None
        return
    with stderr().status("starting JAX…") as status, contextlib.redirect_stdout(sys.stderr):
        def update(function: str, stage: str) -> None:
            status.update(f"{function}: {stage}…")

        yield update


def report_failures(failed: dict[str, str]) -> None:
    """One ``error:`` line on stderr per function that failed (name → message)."""
    err = stderr()
    for name, message in failed.items():
        text = message if message.startswith(f"{name}: ") else f"{name}: {message}"
        err.print(f"[bold red]error:[/] {escape(text)}")


# ---- errors → exit codes ----------------------------------------------------------------------


def _failed(debug: bool, code: int, *lines: str) -> typer.Exit:
    """The traceback (``--debug``) and ``lines`` on stderr; the exit that ends the command."""
    err = stderr()
    if debug:
        import traceback

        traceback.print_exc()
    for line in lines:
        err.print(line)
    return typer.Exit(int(code))


def _stagetool_error(e: StagetoolError) -> list[str]:
    """The lines of a :class:`StagetoolError`: its message, the user's frame, the hint."""
    frame = e.user_frame if isinstance(e, StagingError) else None
    return ([f"[bold red]error:[/] {escape(e.message)}"] + ([f"  at {escape(frame)}"] if frame else [])
            + ([f"  [dim]hint:[/] {escape(e.hint)}"] if e.hint else []))


@contextlib.contextmanager
def errors(debug: bool) -> Iterator[None]:
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
        stdout_closed()
        raise typer.Exit(int(ExitCode.USAGE)) from None
    except SystemExit as e:  # user code called sys.exit(): its failure, never the command's verdict
        raise _failed(debug, ExitCode.JAX, f"[bold red]error:[/] user code raised SystemExit({escape(repr(e.code))}) "
                      "while it was imported, called or traced; the run did not finish") from None
    except StagetoolError as e:
        raise _failed(debug, e.exit_code, *_stagetool_error(e)) from None
    except Exception as e:  # noqa: BLE001 - the last line of defence: no traceback without --debug
        from stagetool.core.errors import known_failure, missing_dependency

        own = str(Path(__file__).resolve().parents[1])
        known = missing_dependency(e, own) or known_failure(e, library=(own,))
        if known is not None:  # the user's or the machine's (memory, a backend, a callback): not a bug
            raise _failed(debug, known.exit_code, *_stagetool_error(known)) from None
        first = (str(e).strip().splitlines() or [""])[0]
        hint = [] if debug else ["  [dim]hint:[/] rerun with --debug for the traceback, and report it if it is not "
                                 "your code's"]
        raise _failed(debug, ExitCode.JAX, f"[bold red]error:[/] unexpected {type(e).__name__}: {escape(first)}",
                      *hint) from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - a BaseException subclass from user code: never exit 1 ("regression")
        first = (str(e).strip().splitlines() or [""])[0]
        raise _failed(debug, ExitCode.JAX, f"[bold red]error:[/] user code raised {escape(type(e).__name__)} (a "
                      f"BaseException{': ' + escape(first) if first else ''}) while it was imported, called or "
                      "traced; the run did not finish") from None


# ---- stdout and -o ----------------------------------------------------------------------------


def _stdout_to_devnull() -> None:
    """Point file descriptor 1 at ``/dev/null`` (best effort), so that the interpreter's own flush of
    stdout at exit does not fail again after stdout failed once."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def stdout_closed() -> None:
    """stdout's reader went away (``stagetool ... | head``): say so once, and keep the interpreter
    from failing again when it flushes stdout at exit."""
    _stdout_to_devnull()
    try:
        stderr().print("[bold red]error:[/] stdout was closed before the output was written (broken pipe)")
    except OSError:
        pass


def write_stdout(text: str) -> None:
    """The payload to stdout. A stdout that cannot take it (``> /dev/full``: ENOSPC, EIO) is one
    message and exit 2; stdout is then pointed at ``/dev/null`` so that the interpreter's own flush
    at exit does not fail again ("Exception ignored ...", exit 120). A closed pipe is
    :func:`stdout_closed`'s (raised on as ``BrokenPipeError``)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        _stdout_to_devnull()
        raise UsageError(f"cannot write to stdout: {e.strerror or e}",
                         hint="write to a file with -o FILE, or free space where stdout goes") from None


def cannot_write(option: str, path: Path, e: OSError) -> UsageError:
    """The exit-2 error of a file a command could not write (``--output FILE: cannot write: ...``)."""
    return UsageError(f"{option} {path}: cannot write: {e.strerror or e}")


def write_file(path: Path, text: str, option: str = "--output") -> None:
    """``text`` to ``path``, atomically (a failed write leaves no half-written file): exit 2 if it cannot."""
    from stagetool.process.fileio import write_atomic

    try:
        write_atomic(path, text)
    except OSError as e:
        raise cannot_write(option, path, e) from None


def write_text(text: str, output: Optional[Path], *, say: bool = True) -> None:
    """Text to ``output`` (atomically; with ``say``, ``wrote FILE`` on stderr) or stdout."""
    if output is None:
        return write_stdout(text)
    write_file(output, text)
    if say:
        stderr().print(f"[dim]wrote {escape(str(output))}[/]")


def color(output: Optional[Path]) -> bool:
    """Whether to colour the text: it goes to a terminal and NO_COLOR is not set."""
    return output is None and sys.stdout.isatty() and "NO_COLOR" not in os.environ


def width() -> int:
    """Columns of the text: the terminal's; piped, $COLUMNS or 160 (wide enough that no column is cut)."""
    if sys.stdout.isatty():
        import shutil

        return shutil.get_terminal_size((120, 40)).columns
    try:
        return int(os.environ.get("COLUMNS", "160"))
    except ValueError:
        return 160


def is_primary() -> bool:
    """False in every process of a multi-process job but process 0 (the one that prints and writes)."""
    if "jax" not in sys.modules:
        return True
    import jax

    return not jax.distributed.is_initialized() or jax.process_index() == 0


def emit(doc: Report | DevicesReport, fmt: Format, output: Optional[Path], *, pager: bool = False) -> None:
    """Render ``doc`` (a :class:`stagetool.report.model.Report` or ``DevicesReport``) and write it to
    ``output`` (atomically) or stdout: only the payload goes there. Exit 3 when a function failed."""
    from stagetool.report import render

    if not is_primary():
        return
    from stagetool.report.model import Report

    functions = doc.functions if isinstance(doc, Report) else ()
    if functions and all(f.error for f in functions):
        _exit_if_failed(doc)  # nothing staged: the errors alone, on stderr; stdout stays empty
    if fmt != Format.json:  # names from specs and user code, control characters escaped (JSON escapes its own)
        from stagetool.core.text import sanitized

        doc = sanitized(doc)
    svgs: dict[str, str] = {}
    if fmt == Format.markdown and output is not None and isinstance(doc, Report) and doc.command == "report":
        from stagetool.report.render_markdown import render_with_figures

        text, svgs = render_with_figures(doc, f"{output.stem}-files")
    else:
        text = render(doc, fmt, color=color(output) and fmt == Format.text, width=width(),
                      fit=output is not None or not sys.stdout.isatty())  # a file or a pipe: every cell whole
    if output is not None and svgs:
        from stagetool.process.fileio import write_atomic

        try:
            for name, svg in svgs.items():
                folder = output.parent / f"{output.stem}-files"
                folder.mkdir(exist_ok=True)
                write_atomic(folder / name, svg)
        except OSError as e:
            raise cannot_write("--output", output, e) from None
    if output is None and pager and sys.stdout.isatty():
        import pydoc

        pydoc.pager(text)
    else:
        write_text(text, output)
    if isinstance(doc, Report):
        say_how_to_name_hardware(doc)
    _exit_if_failed(doc)


HINT_MARKER = "named-hardware-hint"
"""The file in the user cache folder whose presence says the one-line hint has been given."""


def say_how_to_name_hardware(doc: Report) -> None:
    """The first run that answers with simulated CPU devices while libtpu or JAX's CUDA plugin is
    installed (and no hardware is named) says in one line on stderr how to name it once; the later
    runs do not (a marker file in the user cache folder, ``$STAGETOOL_CACHE_DIR`` when set)."""
    if doc.answer is None or doc.answer.devices != "simulated":
        return
    from stagetool.plan.target import installed_compile_only

    installed = installed_compile_only()
    if installed is None:
        return
    folder = os.environ.get("STAGETOOL_CACHE_DIR")
    if not folder:
        try:
            import platformdirs

            folder = platformdirs.user_cache_dir("stagetool")
        except Exception:
            return
    marker = Path(folder) / HINT_MARKER
    if marker.exists():
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("the hint on naming the hardware once was given\n", encoding="utf-8")
    except OSError:
        pass
    kind = "v5e" if installed.startswith("libtpu") else "h100"
    stderr().print(f"[yellow]hint:[/] {escape(installed)} installed: name the hardware once (topology: {kind} in "
                   f"the spec, or \\[tool.stagetool] topology = \"{kind}\" in pyproject.toml) and every command "
                   "answers for it, compile-only; this hint is shown once")


def _exit_if_failed(doc: Report | DevicesReport) -> None:
    """After the others are rendered: each function that failed to stage on stderr, and exit 3."""
    from stagetool.report.model import Report

    failed = [f for f in (doc.functions if isinstance(doc, Report) else ()) if f.error]
    if failed and _DEBUG[0]:
        for f in failed:
            if f.error_traceback:
                sys.stderr.write(f.error_traceback)
    if failed:
        report_failures({f.name: f.error for f in failed})
        raise typer.Exit(int(ExitCode.JAX))
