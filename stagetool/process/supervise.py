"""Fail closed on every way out: a command's exit code is believed only if the command said it finished.

User code runs inside stagetool (a target's import, ``init``, ``{call: ...}``, tracing). Python
exceptions from it are caught (``SystemExit`` and other ``BaseException`` subclasses included), but
``os._exit(0)`` ends the process at once — no ``finally``, no ``atexit`` — and a CI gate would read its
0 as "no regression". So the console script (:func:`stagetool.__main__.main`) forks once, before
anything heavy is imported (about a millisecond): the child runs the command and, as its last act,
reports the exit code it chose on a pipe (:func:`report`; the signal path reports too). The parent
only waits. If the child ends without a report, the parent says so and exits 3 — whatever status
the child had — or 128 + the signal that killed it.

The parent forwards SIGINT, SIGTERM and SIGHUP sent to it alone (``kill PID``, a CI runner's
cancel) to the child, which does its own cleanup and prints the last line; the child gets the
kernel's parent-death signal, so it never outlives a parent killed with SIGKILL. Nothing here
imports more than the standard library; platforms without ``fork`` run the command unsupervised.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

_REPORT_FD: list[int | None] = [None]

ENV = "STAGETOOL_UNSUPERVISED"
"""Set to 1 to run the command in the process itself (a debugger, a profiler)."""


def wanted(args: list[str]) -> bool:
    """Whether to supervise a command line: on POSIX, unless it only asks for help or the version, or
    ``STAGETOOL_UNSUPERVISED=1``, or this process is already a supervised child."""
    if not hasattr(os, "fork") or _REPORT_FD[0] is not None:
        return False
    if os.environ.get(ENV, "") not in ("", "0"):
        return False
    return not (not args or args[0] in ("--help", "-h", "--version") or args[-1] in ("--help", "-h"))


def report(code: int) -> None:
    """Tell the supervising parent that the command finished with ``code`` (no-op when unsupervised)."""
    fd = _REPORT_FD[0]
    if fd is None:
        return
    _REPORT_FD[0] = None
    try:
        os.write(fd, f"{int(code)}\n".encode("ascii"))
        os.close(fd)
    except OSError:
        pass


def run(command: Callable[[], int]) -> int:
    """Run ``command`` in a forked child and return the exit code to leave with (see the module docstring).

    In the child this returns ``command()``'s code after reporting it; in the parent, the child's
    status when it reported, else 3 (or 128 + the signal that killed it) with one line on stderr.
    """
    read_end, write_end = os.pipe()
    parent_pid = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the command itself
        os.close(read_end)
        _REPORT_FD[0] = write_end
        from stagetool.process.cleanup import die_with_parent

        die_with_parent(parent_pid)
        code = command()
        report(code)
        return code
    os.close(write_end)
    return _supervise(pid, read_end)


def _supervise(pid: int, read_end: int) -> int:
    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup: the child ignores it too
            signal.signal(sig, forward)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:  # pragma: no cover - Python retries waitpid itself
            continue
        except ChildProcessError:
            status = None
            break
    os.set_blocking(read_end, False)
    try:
        said = os.read(read_end, 64).decode("ascii", "replace").strip()
    except OSError:
        said = ""
    finally:
        os.close(read_end)
    if status is None:
        return 3
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        _say(f"the run died with {_signal_name(sig)} before it finished; nothing it printed is a result")
        return 128 + sig
    code = os.WEXITSTATUS(status)
    if said.lstrip("-").isdigit():
        return code
    _say(f"the run ended (exit status {code}) without finishing: code it ran (the target's module, an init, "
         "the traced function) called os._exit() or the interpreter died; nothing it printed is a result")
    return 3


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _say(message: str) -> None:
    try:
        os.write(2, f"stagetool: error: {message}\n".encode())
    except OSError:
        pass
