"""What a run leaves behind if it is cut short: temporary files and folders, child processes.

Code that creates a temporary path or starts a child registers it here for as long as it exists.
``finally`` blocks remove them on the ordinary exit paths; when a signal ends the run while the
staging thread is inside XLA (where no Python ``finally`` can run), the CLI's signal handling calls
:func:`run_all` from the main thread before the process exits. Nothing here imports JAX.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from typing import Any, Iterator

_LOCK = threading.Lock()
_PATHS: dict[int, str] = {}
_CHILDREN: dict[int, Any] = {}
_CALLBACKS: dict[int, Any] = {}
_NEXT = [0]
_ENDING = [False]  # run_all has begun: the run is ending, nothing new may start
_STARTING = threading.Lock()  # held while a child is started and registered (starting_child)
STARTING_WAIT_S = 5.0
"""Seconds :func:`run_all` waits for a child being started to be registered (then killed) before it
goes on without it."""


class Ending(BaseException):
    """Raised in a thread that registers a path or child after a signal began ending the run
    (:func:`run_all`): the path was removed or the child killed at once, and the thread must stop
    (a ``BaseException``, so that no ``except Exception`` goes on with the next item)."""


def register_path(path: str | os.PathLike) -> int:
    """Remember a temporary file or folder to remove if the run is cut short; returns a token.

    Raises:
      Ending: the run is ending (:func:`run_all` has begun); ``path`` has been removed.
    """
    with _LOCK:
        if not _ENDING[0]:
            _NEXT[0] += 1
            _PATHS[_NEXT[0]] = os.fspath(path)
            return _NEXT[0]
    _remove(os.fspath(path))
    raise Ending()


def register_child(proc: Any) -> int:
    """Remember a child process started in a session of its own: a ``subprocess.Popen`` started with
    ``start_new_session=True``, or a ``multiprocessing.Process`` that calls ``os.setsid()`` first.

    Raises:
      Ending: the run is ending (:func:`run_all` has begun); ``proc`` has been killed.
    """
    with _LOCK:
        if not _ENDING[0]:
            _NEXT[0] += 1
            _CHILDREN[_NEXT[0]] = proc
            return _NEXT[0]
    kill_child(proc)
    raise Ending()


@contextlib.contextmanager
def starting_child() -> Iterator[None]:
    """Hold while a child process is started and registered (``process.start()`` then
    :func:`register_child`): a signal that ends the run meanwhile waits for the registration (up to
    :data:`STARTING_WAIT_S`), which then kills the child, before the run's last line is written.
    Without it a spawned ``multiprocessing`` child whose parent ended while handing it its start
    (the pickled process object, written after the child is running) read a cut-short pipe and
    printed ``EOFError: Ran out of input`` after the run's last line, on the stderr it inherits.

    Raises:
      Ending: the run is ending; start nothing.
    """
    with _STARTING:
        if _ENDING[0]:
            raise Ending()
        yield


def make_temp_dir(prefix: str) -> tuple[str, int]:
    """A new private temporary folder (``tempfile.mkdtemp``) and its registration token, made and
    registered as one step: a signal that ends the run cannot fall between the two.

    Raises:
      Ending: the run is ending; nothing was made.
    """
    import tempfile

    with _LOCK:
        if _ENDING[0]:
            raise Ending()
        folder = tempfile.mkdtemp(prefix=prefix)
        _NEXT[0] += 1
        _PATHS[_NEXT[0]] = folder
        return folder, _NEXT[0]


def register_callback(fn: Any) -> int:
    """Remember something to undo first if the run is cut short (e.g. put back file descriptor 2
    that a compile's log capture redirected, so the signal's message is seen); returns a token."""
    with _LOCK:
        _NEXT[0] += 1
        _CALLBACKS[_NEXT[0]] = fn
        return _NEXT[0]


def forget(token: int) -> None:
    """The path is gone or the child has ended: nothing to do for it any more."""
    with _LOCK:
        _PATHS.pop(token, None)
        _CHILDREN.pop(token, None)
        _CALLBACKS.pop(token, None)


@contextlib.contextmanager
def temporary_path(path: str | os.PathLike) -> Iterator[str]:
    """Register ``path`` while the block runs, and remove it (file or folder) when the block ends.

    Raises:
      Ending: the run is ending (``path`` removed at once, the block not run)."""
    token = register_path(path)
    try:
        yield os.fspath(path)
    finally:
        _remove(os.fspath(path))
        forget(token)


def kill_child(proc: Any) -> None:
    """Kill a child's whole process group (it was started in its own session), then reap it.

    ``proc`` is a ``subprocess.Popen`` or a ``multiprocessing.Process``. The group is killed even
    when the child itself has already ended: what it started (a compiler subprocess, a grandchild
    that ignored its parent's end) is still in that group. (A group id is not reused while the
    group has a member, so this never reaches another process.)
    """
    if proc.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    popen = hasattr(proc, "poll")
    if (proc.poll() if popen else proc.exitcode) is not None:
        return
    with contextlib.suppress(OSError):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(timeout=5) if popen else proc.join(5)


PARENT_PID_ENV = "STAGETOOL_PARENT_PID"
"""The environment variable through which a child started with :func:`child_environment` learns its
parent's pid (to check that the parent is still alive once the parent-death signal is set)."""


def die_with_parent(parent_pid: int | None) -> None:
    """Have the kernel kill this process (SIGKILL) when its parent ends — on Linux, through
    ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing. Called first thing in a child process: a worker
    whose parent was killed with SIGKILL (no handler runs) must not go on compiling for half an hour.

    ``parent_pid`` is the pid the parent had when it started this process: if the parent is already
    gone (this process was reparented before the signal was set), this process exits at once.
    """
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent ended before the signal was in place


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass


def run_all() -> None:
    """Run every registered callback, kill every registered child and remove every registered path
    (a signal ends the run); a child being started (:func:`starting_child`) is waited for and killed
    too. From then on the run is ending: a path or child registered later (by
    a thread still running) is removed or killed at once (:class:`Ending`)."""
    with _LOCK:
        _ENDING[0] = True
        callbacks = list(_CALLBACKS.values())
        children = list(_CHILDREN.values())
        paths = list(_PATHS.values())
        _CALLBACKS.clear()
        _CHILDREN.clear()
        _PATHS.clear()
    if _STARTING.acquire(timeout=STARTING_WAIT_S):  # a child being started is registered, so killed
        _STARTING.release()
    for fn in callbacks:
        with contextlib.suppress(Exception):
            fn()
    for proc in children:
        kill_child(proc)
    for path in reversed(paths):
        _remove(path)
