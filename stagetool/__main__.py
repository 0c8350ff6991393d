"""The ``stagetool`` command's entry point (the console script and ``python -m stagetool``).

``stagetool --version`` is answered here without importing Typer, Rich or JAX; everything else
goes to :func:`stagetool.cli.main`.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); the exit code.

    The command runs in a forked child whose exit code is believed only if it reports finishing
    (:mod:`stagetool.process.supervise`: ``os._exit(0)`` in user code is exit 3, not a pass). The cyclic
    garbage collector is paused through start-up and resumed once the devices are up
    (:mod:`stagetool.process.gc_pause`).
    """
    args = sys.argv[1:] if argv is None else argv
    if not _standard_streams():
        return 2
    if args == ["--version"]:
        from stagetool._version import __version__

        sys.stdout.write(f"stagetool {__version__}\n")
        return 0
    from stagetool.process import supervise

    if supervise.wanted(args):
        return supervise.run(lambda: _command(argv))
    return _command(argv)


def _standard_streams() -> bool:
    """Give a missing file descriptor 0, 1 or 2 (``stagetool ... <&- 2>&-``) ``/dev/null``, so that no
    file stagetool opens later takes its number (a baseline written to "stdout"), and Python's
    ``sys.stdin``/``sys.stderr`` exist. A missing stdout is the run's error: one line on stderr (when
    that exists) and False (exit 2), since nothing printed could reach anyone."""
    import os

    missing = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            missing.append(fd)
    for fd in missing:  # ascending: each open takes the lowest free number, the missing one
        try:
            new = os.open(os.devnull, os.O_RDWR)
        except OSError:
            continue
        if new != fd:
            os.dup2(new, fd)
            os.close(new)
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        if fd in missing or getattr(sys, name) is None:
            try:
                stream = open(fd, "r" if fd == 0 else "w", buffering=1, closefd=False, encoding="utf-8",
                              errors="strict" if fd == 0 else "backslashreplace")
            except OSError:
                continue
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
    for stream in (sys.stdout, sys.stderr):  # a lone surrogate in a name from user code is written \udXXX
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass
    if 1 in missing:
        if 2 not in missing:
            os.write(2, b"stagetool: error: stdout is closed (>&-): the output could not reach anyone; "
                        b"send it to /dev/null (>/dev/null) to discard it, or to a file\n")
        return False
    return True


def _command(argv: list[str] | None) -> int:
    from stagetool.process import gc_pause

    gc_pause.pause()
    try:
        try:
            from stagetool.cli import main as cli_main
        except ImportError as e:  # no user code has run yet: one of stagetool's own dependencies
            return _missing_dependency(e)
        return cli_main(argv)
    finally:
        gc_pause.before_exit()


def _missing_dependency(e: ImportError) -> int:
    """One line (and a hint) naming the dependency of stagetool that failed to import; exit 2. Another
    import failure is re-raised (a bug of stagetool's: the traceback is shown)."""
    import os

    from stagetool.core.errors import ExitCode, missing_dependency

    said = missing_dependency(e, os.path.dirname(os.path.abspath(__file__)))
    if said is None:
        raise e
    sys.stderr.write(f"error: {said.message}\n  hint: {said.hint}\n")
    sys.stderr.flush()
    return int(ExitCode.USAGE)


if __name__ == "__main__":  # not when a worker process (multiprocessing's spawn) imports it as __mp_main__
    sys.exit(main())
