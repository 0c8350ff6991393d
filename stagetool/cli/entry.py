"""The entry point: :func:`main` runs the command named by ``argv`` (called by
:mod:`stagetool.__main__`, the console script) in a worker thread, with SIGINT and SIGTERM ending
the run cleanly, and builds only the click command that run needs (:func:`click_command`)."""

from __future__ import annotations

import os
import sys
from typing import Any

from stagetool.cli.app import ROOT_VALUE_OPTIONS, app
from stagetool.cli.output import UNTESTED_NOTED, stdout_closed
from stagetool.core.errors import ExitCode


def click_command(argv: list[str]) -> Any:
    """The click command that runs ``argv``: the root group holding only the subcommand ``argv``
    names; for the root's help (``--help``, ``-h``, no arguments) the root group listing every
    subcommand by name and help text alone; else (a misspelt command, a root flag) the full group.

    Typer builds a click command from each function's signature on every run (about 35 ms for all
    twelve on a 2-core VM), and a run needs only its own; what it parses and prints is the same
    (``tests/cli/test_cli.py`` compares the help both ways).
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
        if arg in ROOT_VALUE_OPTIONS:
            next(args, None)
        elif arg.startswith(tuple(f"{o}=" for o in ROOT_VALUE_OPTIONS)):
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
    its errors through :func:`stagetool.cli.output.errors`, so a ``SystemExit`` that is not an integer code stagetool
    chose cannot reach this point as a success.
    """
    UNTESTED_NOTED[0] = False
    try:
        click_command(sys.argv[1:] if argv is None else argv)(args=argv, prog_name="stagetool",
                                                               standalone_mode=True)
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return int(ExitCode.OK)
        if isinstance(e.code, int) and not isinstance(e.code, bool) and e.code in {int(c) for c in ExitCode}:
            return e.code
        return int(ExitCode.JAX)
    except BrokenPipeError:
        stdout_closed()
        return int(ExitCode.USAGE)
    finally:
        from stagetool.devices.distributed import leave

        leave()  # a multi-process run: every process ends together (process 0 serves the coordinator)
    return int(ExitCode.OK)


class _Signalled(BaseException):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _signals() -> tuple[int, ...]:
    """The signals that end a run with its cleanup: SIGINT, SIGTERM and (where it exists) SIGHUP."""
    import signal

    return (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


def _end_on_signal(signum: int) -> None:
    """A signal ends the run: kill children, remove temporary files, one line, exit 130/143/129.

    The staging thread may be inside XLA's compiler, where no Python code runs until it returns;
    the process ends with ``os._exit`` so that neither that thread nor the interpreter's teardown
    (which would wait for it, or crash under it) runs on.
    """
    import signal

    from stagetool.process import cleanup, supervise

    for sig in _signals():  # ending already: a second signal (the terminal's and the
        try:                # supervisor's copy) must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):
            pass
    cleanup.run_all()
    code, name = ((ExitCode.INTERRUPTED, "interrupted (SIGINT)") if signum == signal.SIGINT
                  else (ExitCode.HUNG_UP, "hung up (SIGHUP)") if signum == getattr(signal, "SIGHUP", None)
                  else (ExitCode.TERMINATED, "terminated (SIGTERM)"))
    for stream in (sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe; nothing more to say there
            pass
    # The command's threads run on until os._exit (a sweep's thread reports the configuration its
    # killed worker was running): from here their writes to stderr go to /dev/null, so that this
    # line is the run's last.
    last = 2
    try:
        last = os.dup(2)
        sink = os.open(os.devnull, os.O_WRONLY)
        os.dup2(sink, 2)
    except OSError:
        pass
    try:
        os.write(last, f"stagetool: {name}\n".encode())
    except OSError:
        pass
    supervise.report(int(code))
    os._exit(int(code))


def main(argv: list[str] | None = None) -> int:
    """The console-script entry point; returns the exit code.

    The command runs in a worker thread while the main thread waits and handles SIGINT, SIGTERM and
    SIGHUP: a signal during a compile (C++, where Python's handlers cannot run) still ends the run at
    once with exit 130/143/129, one line on stderr, children killed and temporary files removed
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
    for sig in _signals():
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
