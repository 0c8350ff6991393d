"""What a function staged in the caller's own process (``stagetool.inspect``, the pytest fixture)
may do to that process, contained while it is staged, alike in process and in an isolated worker.

* ``os._exit(n)`` from any thread while a function is staged raises ``SystemExit`` instead of
  ending the process with ``n`` unseen (``os._exit(0)`` would end a test session or a notebook
  kernel with success). Called by the staging thread, it is the function's failure; called by
  another thread, the staging ends with a :class:`StagingError` that says so.
* A thread the staged function started and left running stays contained after the staging: its
  ``os._exit`` ends that thread only (a line on stderr says so). Every other thread's ``os._exit``
  is the real one again as soon as the staging ends.
* A process forked with ``os.fork`` while a function is staged, or by a contained thread, ends at
  once with exit code 0, in the child (``os.register_at_fork``): it never runs the caller's code on,
  and a parent that waits for it is not held. A fork-based ``multiprocessing`` child (a ``Process``,
  a ``Pool``'s workers) runs its target and ends with ``os._exit``, as without stagetool. No
  refusal reaches a child: its ``os._exit`` is the real one.

* Signal handlers and interval timers set while staging never reach the process, and what reaches
  it anyway is undone: :mod:`stagetool.process.dispositions`. ``atexit`` handlers registered while
  staging are dropped when it ends (``atexit.register(os._exit, 0)`` would end the caller's process
  with 0 whatever it was going to say): :mod:`stagetool.process.exit_handlers`.

C code that exits the process is not covered (``isolate=True`` is). Nothing here imports JAX.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from typing import Iterator

from stagetool.core.errors import StagingError
from stagetool.process.dispositions import caller_signals
from stagetool.process.exit_handlers import caller_atexit

_REAL_EXIT = os._exit
_LOCK = threading.RLock()
_STAGING: list[str] = []  # the functions being staged now (nested or from several threads)
_CONTAINED: weakref.WeakSet = weakref.WeakSet()  # threads a staged function started and left running
_REFUSED: list[tuple[str, int]] = []  # (thread name, code) of os._exit calls refused during the staging
_HOOKED = [False]


def _refusing_exit(code: int = 0) -> None:
    """``os._exit`` while a staging is under way or in a contained thread: ``SystemExit``."""
    thread = threading.current_thread()
    with _LOCK:
        contained = thread in _CONTAINED  # left running by an earlier staging: not this one's doing
        staging = bool(_STAGING) and not contained
        if staging:
            _REFUSED.append((thread.name, code))
    if not staging and not contained:
        _REAL_EXIT(code)
    if contained:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"stagetool: thread {thread.name!r}, started by a function stagetool staged, called "
                             f"os._exit({code}) after the staging; stagetool refused it and the thread ended\n")
    raise SystemExit(f"os._exit({code}) was called while stagetool staged the function; "
                     "stagetool refused to end the process")


def _in_child() -> None:
    """After a fork, in the child: a child of a staging (or of a contained thread) ends at once;
    any other gets the real ``os._exit`` back."""
    global _CONTAINED
    forked_in_staging = bool(_STAGING) or threading.current_thread() in _CONTAINED
    if forked_in_staging and not _forked_by_multiprocessing():
        with contextlib.suppress(OSError):
            os.write(2, b"stagetool: a process forked while stagetool staged a function ends at once\n")
        _REAL_EXIT(0)
    _STAGING.clear()
    _REFUSED.clear()
    _CONTAINED = weakref.WeakSet()
    if os._exit is _refusing_exit:
        os._exit = _REAL_EXIT


def _forked_by_multiprocessing() -> bool:
    """Whether this fork is ``multiprocessing``'s (``popen_fork``), whose child runs its target and
    ends itself with ``os._exit``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "multiprocessing.popen_fork":
            return True
        frame = frame.f_back
    return False


def _restore_if_idle() -> None:
    """The real ``os._exit`` back once nothing is staged and no contained thread runs (left as it
    is when something else replaced it meanwhile)."""
    with _LOCK:
        if not _STAGING and not any(t.is_alive() for t in list(_CONTAINED)) and os._exit is _refusing_exit:
            os._exit = _REAL_EXIT


@contextlib.contextmanager
def contained(name: str) -> Iterator[list[str]]:
    """Stage function ``name`` within: see the module's account, and
    :func:`stagetool.process.dispositions.caller_signals` (the caller's signal handlers and timers
    kept) and :func:`stagetool.process.exit_handlers.caller_atexit` (its exit handlers kept). Yields
    a list that, once the block is left, holds one note per signal handler, timer, mask or atexit
    handler the staged code set (none of which is left in place).

    Raises:
      StagingError: (on leaving, when nothing else was raised) a thread other than the staging one
        called ``os._exit`` while the function was staged.
    """
    with _LOCK:
        if not _HOOKED[0] and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_in_child)
            _HOOKED[0] = True
        if not _STAGING:
            _REFUSED.clear()
        _STAGING.append(name)
        before = set(threading.enumerate())
        if os._exit is not _refusing_exit:
            os._exit = _refusing_exit  # type: ignore[assignment]
    me = threading.current_thread().name
    failed = True
    notes: list[str] = []
    try:
        with caller_signals(notes), caller_atexit(notes):
            yield notes
        failed = False
    finally:
        with _LOCK:
            _STAGING.remove(name)
            for t in threading.enumerate():
                if t not in before and t.is_alive():
                    _CONTAINED.add(t)
            others = [(t, c) for t, c in _REFUSED if t != me]
            if not _STAGING:
                _REFUSED.clear()
        _restore_if_idle()
    if others and not failed:
        thread, code = others[0]
        raise StagingError(f"{name}: thread {thread!r} called os._exit({code}) while stagetool staged the function; "
                           "stagetool refused to end the process", stage="trace", function=name)
