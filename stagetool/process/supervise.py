"""Fail closed on every way out: a command's exit code is the code it reported, and nothing it started outlives it.

User code runs inside stagetool (a target's import, ``init``, ``{call: ...}``, tracing). Python
exceptions from it are caught (``SystemExit`` and other ``BaseException`` subclasses included), but
``os._exit(0)`` ends the process at once — no ``finally``, no ``atexit`` — and a CI gate would read its
0 as "no regression". So the console script (:func:`stagetool.__main__.main`) forks once, before
anything heavy is imported (about a millisecond): the child runs the command and, as its last act,
reports the exit code it chose on a pipe (:func:`report`; the signal path reports too), flushes
its streams and ends with ``os._exit(code)``: no ``atexit`` handler or non-daemon thread of user
code runs after the code is decided. The parent only waits, and leaves with the *reported* code:

- no report (``os._exit`` before the end, the interpreter died): exit 3 with one line, or
  128 + the signal that killed the child;
- a report, but the child's status disagrees (a thread of user code called ``os._exit(0)`` between
  the report and the end), or more than one report: exit 3 with one line.

A report is one line ``<nonce> <code>`` on a pipe whose write end only the child holds (not
inherited by anything it starts), and the nonce is drawn afresh for every run: code that writes
``0`` to every descriptor it finds, or closes them all, leaves a report that does not match
(exit 3), never a pass. (Code in the same process that sets out to forge a report can always do
so; this guards against accidents, not against that.)

On Linux the parent is the *child subreaper* of the run (``prctl(PR_SET_CHILD_SUBREAPER)``): a
process the command's code started and left behind — a daemon that double-forked away at import,
holding the run's stdout so that a CI step reading it never ends — is reparented to the parent
instead of init. Once the child has ended, the parent ends those (SIGKILL, after :data:`_SETTLE_S`
for the run's own helpers to leave) and names them on stderr; the exit code stays the reported one.

The parent forwards SIGINT, SIGTERM and SIGHUP sent to it alone (``kill PID``, a CI runner's
cancel, a closed terminal) to the child, which does its own cleanup and prints the last line; a
child that has not ended :data:`ESCALATE_S` seconds later (stuck in C code that holds the GIL, so
that its handler never runs: a catastrophic regular expression) is killed, and the parent prints
the last line itself. The child gets the kernel's parent-death signal, so it never outlives a
parent killed with SIGKILL.
Nothing here imports more than the standard library; platforms without ``fork`` run the command
unsupervised.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

_REPORT: list[tuple[int, str] | None] = [None]  # (write end of the report pipe, this run's nonce) in the child

ENV = "STAGETOOL_UNSUPERVISED"
"""Set to 1 to run the command in the process itself (a debugger, a profiler)."""

ESCALATE_S = 10.0
"""Seconds the child is given to end after a forwarded SIGINT/SIGTERM/SIGHUP (its own cleanup
takes well under one) before it is killed with SIGKILL: a signal always ends the run. The
environment variable ``STAGETOOL_ESCALATE_S`` sets another (a CI runner that kills its job a few
seconds after cancelling it: GitHub Actions sends SIGINT, then SIGTERM 7.5 s later, SIGKILL 2.5 s
after that); a value that is not a positive number of seconds below one day is ignored
(:func:`escalate_seconds`)."""

ESCALATE_ENV = "STAGETOOL_ESCALATE_S"


def escalate_seconds() -> float:
    """:data:`ESCALATE_S`, or ``$STAGETOOL_ESCALATE_S`` where it is a number of seconds in (0, 86400)."""
    try:
        value = float(os.environ.get(ESCALATE_ENV, ESCALATE_S))
    except ValueError:
        return ESCALATE_S
    return value if 0 < value < 86400 else ESCALATE_S


_SETTLE_S = 1.0
"""Seconds the parent waits for the run's own helpers (multiprocessing's resource tracker) to end by
themselves once the child has ended, before it treats what is left as left behind."""


def wanted(args: list[str]) -> bool:
    """Whether to supervise a command line: on POSIX, unless it only asks for help or the version, or
    ``STAGETOOL_UNSUPERVISED=1``, or this process is already a supervised child."""
    if not hasattr(os, "fork") or _REPORT[0] is not None:
        return False
    if os.environ.get(ENV, "") not in ("", "0"):
        return False
    return not (not args or args[0] in ("--help", "-h", "--version") or args[-1] in ("--help", "-h"))


def report(code: int) -> None:
    """Tell the supervising parent that the command finished with ``code`` (no-op when unsupervised).

    Only the first call reports; the pipe is closed after it."""
    held = _REPORT[0]
    if held is None:
        return
    _REPORT[0] = None
    fd, nonce = held
    try:
        os.write(fd, f"{nonce} {int(code)}\n".encode("ascii"))
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass


def finish(code: int) -> None:
    """In a supervised child: report ``code``, flush the standard streams and end the process with it
    (``os._exit``: no ``atexit`` handler or thread of user code runs after the code is decided).
    Returns (doing nothing) when the process is not a supervised child."""
    if _REPORT[0] is None:
        return
    report(code)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say there
            pass
    os._exit(int(code) & 0xFF)


def finish_unreported() -> None:
    """Flush the standard streams and end the process without a report (the parent exits 3)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(70)


def run(command: Callable[[], int]) -> int:
    """Run ``command`` in a forked child and return the exit code to leave with (see the module docstring).

    The child never returns: it reports ``command()``'s code and ends with it (:func:`finish`). The
    parent returns the reported code when the child's status agrees, else 3 (or 128 + the signal
    that killed a child that did not report) with one line on stderr.
    """
    read_end, write_end = os.pipe()  # not inheritable: nothing the command starts holds the write end
    nonce = os.urandom(16).hex()
    parent_pid = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - flushed again, or reported, by the command
            pass
    subreaper = _become_subreaper()
    pid = os.fork()
    if pid == 0:  # the child: the command itself
        os.close(read_end)
        _REPORT[0] = (write_end, nonce)
        from stagetool.process.cleanup import die_with_parent

        die_with_parent(parent_pid)
        try:
            code = command()
        except BaseException:  # noqa: BLE001 - escaped the command's own handling: a bug, shown; no report
            import traceback

            traceback.print_exc()
            _REPORT[0] = None
            finish_unreported()
        finish(code)
    os.close(write_end)
    code = _supervise(pid, read_end, nonce)
    if subreaper:
        _end_leftovers()
    return code


def _become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux); whether it is."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _supervise(pid: int, read_end: int, nonce: str) -> int:
    ending: dict[str, int] = {}  # the first signal forwarded; whether the child was then killed
    escalate = escalate_seconds()

    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(pid, signum)
        except OSError:
            pass
        if "signal" not in ending and hasattr(signal, "setitimer"):
            ending["signal"] = signum
            signal.signal(signal.SIGALRM, kill)
            signal.setitimer(signal.ITIMER_REAL, escalate)

    def kill(signum: int, frame: object) -> None:
        ending["killed"] = 1
        try:
            os.kill(pid, signal.SIGKILL)
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
    if "signal" in ending:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if "killed" in ending:  # the child could not act on the signal (stuck in C code holding the GIL)
        name = _signal_name(ending["signal"])
        _say(f"the run did not end within {escalate:g} s of {name} (stuck in code that holds Python's "
             "interpreter lock, such as a regular expression); it was killed")
        os.close(read_end)
        words = {signal.SIGINT: "interrupted", signal.SIGHUP: "hung up"}.get(ending["signal"], "terminated")
        try:
            os.write(2, f"stagetool: {words} ({name})\n".encode())
        except OSError:
            pass
        return 128 + ending["signal"]
    os.set_blocking(read_end, False)
    said = b""
    try:
        while len(said) < 4096:
            chunk = os.read(read_end, 4096)
            if not chunk:
                break
            said += chunk
    except OSError:
        pass
    finally:
        os.close(read_end)
    return verdict(status, said, nonce)


def verdict(status: int | None, said: bytes, nonce: str) -> int:
    """The exit code for a child that ended with wait ``status`` (None: it could not be waited for)
    after writing ``said`` on the report pipe; ``nonce`` is the run's. Pure but for one line on stderr."""
    if status is None:
        return 3
    lines = said.decode("ascii", "replace").splitlines()
    reported = None
    if len(lines) == 1:
        got_nonce, _, got_code = lines[0].partition(" ")
        if got_nonce == nonce and got_code.isascii() and got_code.isdigit() and got_code == str(int(got_code)) \
                and int(got_code) <= 255:
            reported = int(got_code)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if reported is None:
            _say(f"the run died with {_signal_name(sig)} before it finished; nothing it printed is a result")
            return 128 + sig
        _say(f"the run reported exit code {reported} and then died with {_signal_name(sig)}: code it ran "
             "went on after the command had finished; nothing it printed is a result")
        return 3
    code = os.WEXITSTATUS(status)
    if reported is None:
        why = ("it wrote something else on its report pipe" if lines else
               "code it ran (the target's module, an init, the traced function) called os._exit() or the "
               "interpreter died")
        _say(f"the run ended (exit status {code}) without finishing: {why}; nothing it printed is a result")
        return 3
    if code != reported:
        _say(f"the run reported exit code {reported} but its process ended with {code}: code it ran (an atexit "
             "handler, a thread) called os._exit() after the command had finished; nothing it printed is a result")
        return 3
    return reported


def _children() -> list[int]:
    """The pids whose parent is this process (Linux ``/proc``), zombies included."""
    me = os.getpid()
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(me).encode():
            out.append(int(name))
    return out


def _reap() -> None:
    """Collect every child of this process that has ended (reparented orphans included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except (ChildProcessError, OSError):
            return
        if pid == 0:
            return


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read(400).split(b"\0")
        text = " ".join(a.decode("utf-8", "replace") for a in argv if a)
    except OSError:
        text = ""
    text = "".join(c if c.isprintable() else "?" for c in text)[:120]
    return f"pid {pid}" + (f" ({text})" if text else "")


def _end_leftovers() -> list[str]:
    """End the processes the run left behind (reparented to this subreaper): wait :data:`_SETTLE_S`
    for them to end by themselves, then SIGKILL each (a forked copy of the run would answer SIGTERM
    with the run's own signal handling); each round takes the orphans of the last. Names them on
    stderr; returns their descriptions."""
    ended: list[str] = []
    deadline = time.monotonic() + _SETTLE_S
    while True:
        _reap()
        alive = _children()
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    for _round in range(50):
        _reap()
        alive = _children()
        if not alive:
            break
        for pid in alive:
            ended.append(_describe(pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        stop = time.monotonic() + 1.0
        while time.monotonic() < stop and set(alive) & set(_children()):
            _reap()
            time.sleep(0.01)
    _reap()
    if ended:
        unique = list(dict.fromkeys(ended))
        _say(f"ended {len(unique)} process{'es' if len(unique) != 1 else ''} the run left behind "
             f"(code it ran started {'them' if len(unique) != 1 else 'it'} and did not wait): "
             + "; ".join(unique[:5]) + (f"; and {len(unique) - 5} more" if len(unique) > 5 else ""),
             level="warning")
    return ended


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _say(message: str, level: str = "error") -> None:
    try:
        os.write(2, f"stagetool: {level}: {message}\n".encode("utf-8", "backslashreplace"))
    except OSError:
        pass
