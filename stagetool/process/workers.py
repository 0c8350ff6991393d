"""Worker processes: run one task per item in spawned processes, results in the items' order.

``--jobs N`` stages N functions at once, each worker a fresh Python process (``spawn``: no state
inherited from the parent's JAX) that starts JAX once and then takes items until none are left.
``--isolate`` uses the same workers with one item per process, so an item that kills its process
(an XLA ``LLVM ERROR``, ``os.abort()``) is recorded as failed with the signal and the last lines it
wrote to stderr, and the others run. An item that runs past ``timeout_s`` has its process killed
and is recorded as failed the same way.

Each worker runs in a session of its own and is registered with :mod:`stagetool.process.cleanup`:
a signal that ends the run kills the workers and whatever they started. Each has a private
temporary folder (``stagetool-worker-*``, its ``TMPDIR``: its compile's dumps, and with
``--isolate`` the file its stderr goes to), removed when the worker ends however it ends.

A task is a module-level function ``fn(common, item)`` (pickled by reference); what it returns
must pickle. An exception it raises comes back and is raised again in the parent (stagetool's
errors keep their class and attributes); the parent raises the first one in item order, after
every item has run. No JAX here: the task imports what it needs.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import os
import sys
from typing import Any, Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one item gave: ``value``; or ``died``, how its process ended before answering; or ``error``,
    the exception the task raised (re-raised by :func:`raise_first_error`)."""

    value: Any = None
    died: str | None = None
    error: BaseException | None = None


START_S = 60.0
"""The least time a worker is given to start (import JAX, say "ready") when there is a timeout."""


@dataclasses.dataclass
class _Worker:
    process: Any
    token: int  # its registration with stagetool.process.cleanup
    folder: str  # its private temporary folder (its TMPDIR)
    folder_token: int  # that folder's registration with stagetool.process.cleanup
    stderr: str | None  # the file its stderr goes to (isolate; inside folder), else None: the parent's stderr
    index: int | None = None  # the item it is on
    deadline: float | None = None  # time.monotonic() by which that item must be done
    started: bool = False  # it said "ready": it got through its start


def run_in_workers(fn: Callable[[Any, Any], Any], items: Sequence[Any], *, jobs: int, common: Any = None,
                   isolate: bool = False, timeout_s: float | None = None) -> list[Outcome]:
    """``fn(common, item)`` for every item in at most ``jobs`` worker processes; one :class:`Outcome` per item.

    With ``isolate`` every item gets a process of its own, whose stderr is kept apart (the last
    lines go into the message of an item whose process died). A worker that dies, or that is
    still on an item ``timeout_s`` seconds after it was handed over (then it is killed), is
    replaced, and the item is recorded with how it ended (``the process died with SIGABRT: ...``,
    ``timed out after 8 s; the process was killed``). ``timeout_s`` also bounds a worker's start
    (at least :data:`START_S`: importing JAX on a busy machine): one that has not said "ready" by
    then is killed and the next item is charged with it.
    """
    import multiprocessing
    import shutil
    import time
    from multiprocessing.connection import wait

    from stagetool.process import cleanup

    ctx = multiprocessing.get_context("spawn")
    pending = collections.deque(range(len(items)))
    outcomes: list[Outcome | None] = [None] * len(items)
    active: dict[Any, _Worker] = {}  # parent end of the pipe → its worker

    def spawn() -> None:
        folder, folder_token = cleanup.make_temp_dir("stagetool-worker-")
        stderr = None
        if isolate:
            stderr = os.path.join(folder, "stderr")
            os.close(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_worker, args=(fn, common, child, stderr, folder), daemon=True)
        with cleanup.starting_child():  # a signal meanwhile kills it once registered, never half started
            process.start()
            token = cleanup.register_child(process)
        child.close()
        active[parent] = _Worker(process, token, folder, folder_token, stderr,
                                 deadline=None if timeout_s is None else time.monotonic() + max(timeout_s, START_S))

    def end(conn: Any, *, ask: bool) -> _Worker:
        """Stop a worker: ask it to leave (it is idle), else kill it; reap it and drop its files."""
        worker = active.pop(conn)
        if ask:
            try:
                conn.send(None)
            except OSError:
                pass
            worker.process.join(30)
        cleanup.kill_child(worker.process)
        conn.close()
        cleanup.forget(worker.token)
        return worker

    def how_it_died(worker: _Worker) -> str:
        tail = _tail(worker.stderr) if worker.stderr else ""
        return process_death(worker.process.exitcode) + (f": {tail}" if tail else "")

    def drop_files(worker: _Worker) -> None:
        shutil.rmtree(worker.folder, ignore_errors=True)
        cleanup.forget(worker.folder_token)

    for _ in range(min(max(1, jobs), len(items))):
        spawn()
    try:
        while active:
            deadlines = [w.deadline for w in active.values() if w.deadline is not None]
            wait_s = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
            ready = wait(list(active), timeout=wait_s)
            now = time.monotonic()
            for conn in [c for c, w in active.items() if c not in ready and w.deadline is not None
                         and w.deadline <= now]:  # an item that ran past its deadline
                worker = end(conn, ask=False)
                if worker.index is not None:
                    outcomes[worker.index] = Outcome(died=f"timed out after {timeout_s:g} s; the process was killed")
                elif pending:  # stuck starting (before "ready"): charged to the next item, as a death is
                    outcomes[pending.popleft()] = Outcome(
                        died=f"the worker did not start within {max(timeout_s, START_S):g} s; the process was killed")
                drop_files(worker)
                if pending and len(active) < jobs:
                    spawn()
            for conn in ready:
                worker = active[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    end(conn, ask=False)
                    if worker.index is not None:
                        outcomes[worker.index] = Outcome(died=how_it_died(worker))
                    elif not worker.started and pending:
                        # it died starting (its arguments did not unpickle, the interpreter failed):
                        # the next item is charged with it, so that a start that always fails ends
                        outcomes[pending.popleft()] = Outcome(died="the worker died before it started: "
                                                                   + how_it_died(worker))
                    drop_files(worker)
                    if pending and len(active) < jobs:
                        spawn()
                    continue
                worker.started = True
                if message[0] == "done":
                    _, ok, value = message
                    outcomes[worker.index] = Outcome(value=value) if ok else Outcome(error=_rebuild(value))
                    worker.index = worker.deadline = None
                    if isolate:
                        drop_files(end(conn, ask=True))
                        if pending:
                            spawn()
                        continue
                if pending:  # "ready", or "done" with more to do
                    worker.index = pending.popleft()
                    worker.deadline = None if timeout_s is None else time.monotonic() + timeout_s
                    conn.send((worker.index, items[worker.index]))
                else:
                    drop_files(end(conn, ask=True))
    finally:  # an exception here (KeyboardInterrupt in a test runner) leaves no worker behind
        for conn in list(active):
            drop_files(end(conn, ask=False))
    return [o if o is not None else Outcome(died="the worker never answered") for o in outcomes]


def _tail(path: str, lines: int = 3) -> str:
    """The last non-empty lines a worker wrote to its stderr file, joined with `` | ``."""
    from stagetool.core.text import file_tail

    return " | ".join(ln.strip() for ln in file_tail(path, lines, window=8192))


def raise_first_error(outcomes: Sequence[Outcome]) -> None:
    """Raise the first item's exception, in item order, if any item raised one."""
    for o in outcomes:
        if o.error is not None:
            raise o.error


def process_death(exitcode: int | None) -> str:
    """How a child process ended without answering: the signal that killed it, or its exit code."""
    import signal

    if exitcode is not None and exitcode < 0:
        try:
            return f"the process died with {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"the process died with signal {-exitcode}"
    return f"the process exited with code {exitcode} before answering"


def _worker(fn: Callable[[Any, Any], Any], common: Any, conn: Any, stderr: str | None = None,
            folder: str | None = None) -> None:
    """A worker's loop: say ready, then run each item sent until ``None``. ``folder``: its temporary
    folder (``TMPDIR``), which the parent removes."""
    import tempfile

    from stagetool.process import gc_pause

    from stagetool.process.cleanup import die_with_parent

    gc_pause.pause()  # start-up: as the command line's own process (stagetool.process.gc_pause)
    import multiprocessing

    try:  # the parent's end takes this worker (daemon there); here, staged code may start processes
        multiprocessing.current_process().daemon = False
    except (AssertionError, AttributeError):
        pass
    die_with_parent(None)  # a parent killed with SIGKILL (no handler runs) takes its workers with it
    os.setsid()  # a session of its own: killing its process group kills whatever it started
    if folder is not None:
        os.environ["TMPDIR"] = tempfile.tempdir = folder
    if stderr is not None:
        fd = os.open(stderr, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 2)
        os.close(fd)
    # stdout is the parent's payload: the user's print and JAX's noise go to stderr
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    conn.send(("ready",))
    while True:
        message = conn.recv()
        if message is None:
            return
        _, item = message
        try:
            result = ("done", True, fn(common, item))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
            result = ("done", False, _transportable(e))
        try:
            conn.send(result)
        except Exception as e:  # noqa: BLE001 - a result that does not pickle
            conn.send(("done", False, _transportable(e)))


def _transportable(e: BaseException) -> tuple:
    """An exception as (module, class name, args, attributes): rebuilt in the parent without calling
    its ``__init__`` (stagetool's errors take keyword-only arguments that ``pickle`` would drop)."""
    import pickle

    state = {}
    for k, v in vars(e).items():
        try:
            pickle.dumps(v)
        except Exception:  # noqa: BLE001 - keep what pickles
            continue
        state[k] = v
    args = tuple(a if isinstance(a, (str, int, float, type(None))) else repr(a) for a in e.args)
    return type(e).__module__, type(e).__qualname__, args, state, isinstance(e, Exception)


def _rebuild(spec: tuple) -> BaseException:
    """The exception :func:`_transportable` described. A class the parent cannot import (defined in
    a function, or in a module only the worker could import) comes back as a stand-in of the same
    name, a ``BaseException`` or an ``Exception`` as the original was: user code that raised a
    ``BaseException`` is reported as such (exit 3), never as an error of stagetool's."""
    module, name, args, state, is_exception = spec
    try:
        cls = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(name)
    except Exception:  # noqa: BLE001 - an exception class the parent cannot import
        cls = type(name.rsplit(".", 1)[-1], (Exception if is_exception else BaseException,),
                   {"__module__": module, "__qualname__": name})
    e = cls.__new__(cls)
    BaseException.__init__(e, *args)
    try:
        e.__dict__.update(state)
    except (AttributeError, TypeError):
        pass
    return e
