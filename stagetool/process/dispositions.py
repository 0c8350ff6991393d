"""Signal dispositions and interval timers while a function is staged: the caller's, before, during
and after, alike in process (``stagetool.inspect``, the pytest fixture), in an isolated worker and in
the CLI.

Code run while staging (the function, a module imported then, an ``init`` or ``{call: ...}``) that
calls ``signal.signal``, ``signal.alarm`` or ``signal.setitimer`` through the ``signal`` module gets
a private table instead of the process's: ``signal.signal`` returns the handler it had set before (or
the process's), ``signal.getsignal`` and ``signal.getitimer`` answer from that table, an alarm it
arms never fires, and nothing reaches the process. So a SIGINT or SIGTERM arriving during the
staging does what it would do to the caller (``KeyboardInterrupt``, the CLI's own cleanup), and no
handler or alarm outlives the staging. Calls from any other thread (the CLI's main thread, which
keeps its own handlers installed) reach the process as ever. The table works from any thread, so a
module that installs a handler at import imports alike in the caller's main thread and in the CLI's
command thread (where ``signal.signal`` would raise ``ValueError``).

Code that reaches the process anyway (a ``signal.signal`` bound before the staging: ``from signal
import signal``; C code) is undone when the staging ends, however it ends: each disposition that
differs from the one before is set back (from the main thread, the only one that can change one),
an interval timer armed during the staging is cancelled (one the caller had armed, or a thread that
is not staging armed meanwhile, is set back to what is left of it), and the staging thread's signal
mask is restored. Each is named in a note (:func:`caller_signals`), with the line that set it (the
handler's ``__code__``, else the caller's line). Forked children get the real functions back.
Nothing here imports JAX.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

from stagetool.process.staging_scope import StagingScope

_REAL_SIGNAL = signal.signal
_REAL_GETSIGNAL = signal.getsignal
_REAL_ALARM = getattr(signal, "alarm", None)
_REAL_SETITIMER = getattr(signal, "setitimer", None)
_REAL_GETITIMER = getattr(signal, "getitimer", None)
_TIMERS = tuple(getattr(signal, n) for n in ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF") if hasattr(signal, n))
_TIMER_NAMES = {getattr(signal, n): n for n in ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF") if hasattr(signal, n)}

_HANDLERS: dict[int, Any] = {}  # signal number -> the handler staged code set (not installed)
_TIMER_TABLE: dict[int, tuple[float, float]] = {}  # timer -> (deadline on time.monotonic, interval)
_SET: dict[tuple[str, int], tuple[str, str]] = {}  # ("signal"|"timer", number) -> (what, file:line)
_THEIRS: dict[int, tuple[tuple[float, float], float]] = {}  # timer -> (value, when) a thread not staging set


def _in_child() -> None:
    """After a fork, in the child: the real functions, nothing staged."""
    _HANDLERS.clear()
    _TIMER_TABLE.clear()
    _SET.clear()
    _unpatch()


_SCOPE = StagingScope(_in_child)
_LOCK = _SCOPE.lock
_virtual = _SCOPE.covers  # whether the calling thread's signal calls go to the private table


def _where(handler: Any = None) -> str:
    """``file:line`` of ``handler``'s code (a function or bound method), else of the line that called
    into this module."""
    code = getattr(getattr(handler, "__func__", handler), "__code__", None)
    if code is not None:
        return f"{code.co_filename}:{code.co_firstlineno}"
    frame = sys._getframe(2)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _signal(signum: Any, handler: Any) -> Any:
    if not _virtual():
        return _REAL_SIGNAL(signum, handler)
    signum = int(signum)
    if signum not in signal.valid_signals():
        raise ValueError("signal number out of range")
    if handler not in (signal.SIG_DFL, signal.SIG_IGN) and not callable(handler):
        raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
    if signum in (getattr(signal, "SIGKILL", -1), getattr(signal, "SIGSTOP", -1)):
        raise OSError(22, "Invalid argument")
    with _LOCK:
        before = _HANDLERS[signum] if signum in _HANDLERS else _REAL_GETSIGNAL(signum)
        _HANDLERS[signum] = handler
        _SET[("signal", signum)] = (f"a {_name(signum)} handler", _where(handler))
    return before


def _getsignal(signum: Any) -> Any:
    with _LOCK:
        if _virtual() and int(signum) in _HANDLERS:
            return _HANDLERS[int(signum)]
    return _REAL_GETSIGNAL(signum)


def _left(which: int) -> tuple[float, float]:
    deadline, interval = _TIMER_TABLE.get(which, (0.0, 0.0))
    if not deadline:
        return 0.0, 0.0
    now = time.monotonic()
    if deadline <= now and interval:
        deadline += ((now - deadline) // interval + 1) * interval
    return max(deadline - now, 0.0), interval


def _setitimer(which: int, seconds: float, interval: float = 0.0) -> tuple[float, float]:
    if not _virtual():
        old = _REAL_SETITIMER(which, seconds, interval)
        if _SCOPE.active():  # another thread's own timer: what the staging's end expects, never undone
            _THEIRS[which] = ((float(seconds), float(interval)), time.monotonic())
        return old
    if which not in _TIMERS:
        raise signal.ItimerError(22, "Invalid argument")
    if seconds < 0 or interval < 0:
        raise signal.ItimerError(22, "Invalid argument")
    with _LOCK:
        old = _left(which)
        _TIMER_TABLE[which] = (time.monotonic() + seconds, float(interval)) if seconds else (0.0, 0.0)
        if seconds:
            _SET[("timer", which)] = (f"{_TIMER_NAMES[which]} timer ({seconds:g} s)", _where())
    return old


def _getitimer(which: int) -> tuple[float, float]:
    if not _virtual():
        return _REAL_GETITIMER(which)
    if which not in _TIMERS:
        raise signal.ItimerError(22, "Invalid argument")
    with _LOCK:
        return _left(which)


def _alarm(seconds: int) -> int:
    if not _virtual():
        old = _REAL_ALARM(seconds)
        if _SCOPE.active():
            _THEIRS[signal.ITIMER_REAL] = ((float(int(seconds)), 0.0), time.monotonic())
        return old
    seconds = int(seconds)
    with _LOCK:
        left, _ = _left(signal.ITIMER_REAL)
        _TIMER_TABLE[signal.ITIMER_REAL] = (time.monotonic() + seconds, 0.0) if seconds else (0.0, 0.0)
        if seconds:
            _SET[("timer", signal.ITIMER_REAL)] = (f"an alarm (signal.alarm({seconds}))", _where())
    return int(left + 0.999999) if left else 0


_PATCHES: dict[str, Callable[..., Any]] = {"signal": _signal, "getsignal": _getsignal}
if _REAL_ALARM is not None:
    _PATCHES.update(alarm=_alarm, setitimer=_setitimer, getitimer=_getitimer)
_REALS: dict[str, Any] = {n: getattr(signal, n) for n in _PATCHES}


def _patch() -> None:
    for n, f in _PATCHES.items():
        setattr(signal, n, f)


def _unpatch() -> None:
    for n, f in _REALS.items():
        if getattr(signal, n) is _PATCHES[n]:  # left as it is when something else replaced it meanwhile
            setattr(signal, n, f)


def _dispositions() -> dict[int, Any]:
    out = {}
    for s in sorted(signal.valid_signals()):
        if s in (getattr(signal, "SIGKILL", -1), getattr(signal, "SIGSTOP", -1)):
            continue
        with contextlib.suppress(ValueError, OSError):
            out[s] = _REAL_GETSIGNAL(s)
    return out


def _timers() -> dict[int, tuple[float, float]]:
    return {w: _REAL_GETITIMER(w) for w in _TIMERS} if _REAL_GETITIMER is not None else {}


def _mask() -> Any:
    if not hasattr(signal, "pthread_sigmask"):
        return None
    with contextlib.suppress(OSError, ValueError):
        return signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return None


@contextlib.contextmanager
def caller_signals(found: list[str] | None = None) -> Iterator[None]:
    """Stage within: see the module's account. ``found`` (when given) gets one note per thing the
    staged code set or left (``"a SIGTERM handler set at model.py:12 was not installed; ..."``), on
    leaving, however the block ends. Nests, and works from several threads at once."""
    me = threading.current_thread()
    with _LOCK:
        outermost = _SCOPE.enter()
        if outermost:
            _HANDLERS.clear()
            _TIMER_TABLE.clear()
            _SET.clear()
            _THEIRS.clear()
        dispositions, timers, began, mask = _dispositions(), _timers(), time.monotonic(), _mask()
        if outermost:
            _patch()
    try:
        yield
    finally:
        notes: list[str] = []
        with _LOCK:
            if _SCOPE.leave() is not None:  # the last staging
                _unpatch()
                notes += _left_by_staging()
                _HANDLERS.clear()
                _TIMER_TABLE.clear()
                _SET.clear()
        notes += _undo(dispositions, timers, began, mask, me)
        if found is not None:
            found.extend(notes)


def _left_by_staging() -> list[str]:
    """A note for each handler the staged code left set (one it put back is no news) and each timer it
    did not cancel (an alarm it cancelled, as a timeout guard does, is none), in the order first set."""
    notes = []
    for (kind, number), (what, where) in _SET.items():
        if kind == "signal":
            with contextlib.suppress(ValueError, OSError):
                if _HANDLERS.get(number) == _REAL_GETSIGNAL(number):
                    continue
            notes.append(f"{what} set at {where} was not installed: stagetool keeps the caller's signal handlers "
                         "while it stages")
        elif _TIMER_TABLE.get(number, (0.0, 0.0))[0]:  # not cancelled (due, or it would have fired meanwhile)
            notes.append(f"{what} armed at {where} was not armed: stagetool keeps the caller's timers while it stages")
    return notes


def _undo(dispositions: dict[int, Any], timers: dict[int, tuple[float, float]], began: float, mask: Any,
          me: threading.Thread) -> list[str]:
    """Set back what staged code changed in the process itself; a note for each."""
    notes: list[str] = []
    if me is threading.main_thread():  # only the main thread can set a disposition (and only it could change one)
        for s, before in dispositions.items():
            with contextlib.suppress(ValueError, OSError):
                now = _REAL_GETSIGNAL(s)
                if now is before or now == before:
                    continue
                where = _where_handler(now)
                if before is None:  # set outside Python: nothing to put back
                    notes.append(f"a {_name(s)} handler{where} was installed while staging and stays: the one before "
                                 "was not set from Python, so stagetool cannot put it back")
                    continue
                _REAL_SIGNAL(s, before)
                notes.append(f"a {_name(s)} handler{where} was installed while staging; the caller's is restored")
    started = {w: began for w in timers}
    for w, (value, when) in list(_THEIRS.items()):
        if w in timers and when >= began:  # set since this staging began by a thread that is not staging
            timers = {**timers, w: value}
            started[w] = when
    for w, (value, interval) in timers.items():
        elapsed = time.monotonic() - started[w]
        with contextlib.suppress(OSError, ValueError):
            now_value, now_interval = _REAL_GETITIMER(w)
            if not value:
                if now_value or now_interval:
                    _REAL_SETITIMER(w, 0)
                    notes.append(f"{_TIMER_NAMES[w]} timer was armed while staging (it would have fired after "
                                 "the staging); stagetool cancelled it")
                continue
            if w != getattr(signal, "ITIMER_REAL", None):
                continue  # CPU-time timers: what is left cannot be told from the wall clock
            expected = value - elapsed
            if interval and expected <= 0:
                expected = interval - (-expected % interval)
            if abs(now_value - max(expected, 0.0)) > 0.05 or now_interval != interval:
                _REAL_SETITIMER(w, max(expected, 1e-6), interval)
                notes.append(f"the caller's {_TIMER_NAMES[w]} timer was changed while staging; stagetool set it back "
                             "to what was left of it")
    if mask is not None and me is threading.current_thread():
        with contextlib.suppress(OSError, ValueError):
            now = signal.pthread_sigmask(signal.SIG_BLOCK, [])
            if now != mask:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                blocked = ", ".join(_name(s) for s in sorted(set(now) - set(mask))) or "signals"
                notes.append(f"{blocked} blocked while staging; the caller's signal mask is restored")
    return notes


def _where_handler(handler: Any) -> str:
    code = getattr(getattr(handler, "__func__", handler), "__code__", None)
    return f" (set at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
