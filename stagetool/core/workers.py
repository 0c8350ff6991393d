"""Worker processes: run one task per item in spawned processes, results in the items' order.

``--jobs N`` stages N functions at once, each worker a fresh Python process (``spawn``: no state
inherited from the parent's JAX) that starts JAX once and then takes items until none are left.
``--isolate`` uses the same workers with one item per process, so an item that kills its process
(an XLA ``LLVM ERROR``, ``os.abort()``) is recorded as failed with the signal and the others run.

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


def run_in_workers(fn: Callable[[Any, Any], Any], items: Sequence[Any], *, jobs: int, common: Any = None,
                   isolate: bool = False) -> list[Outcome]:
    """``fn(common, item)`` for every item in at most ``jobs`` worker processes; one :class:`Outcome` per item.

    With ``isolate`` every item gets a process of its own. A worker that dies is replaced, and the
    item it was on is recorded with how it died (``the process died with SIGABRT``).
    """
    import multiprocessing
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("spawn")
    pending = collections.deque(range(len(items)))
    outcomes: list[Outcome | None] = [None] * len(items)
    active: dict[Any, list] = {}  # parent end of the pipe → [process, index of the item it is on]

    def spawn() -> None:
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_worker, args=(fn, common, child), daemon=True)
        process.start()
        child.close()
        active[parent] = [process, None]

    def retire(conn: Any) -> None:
        process, _ = active.pop(conn)
        try:
            conn.send(None)
        except OSError:
            pass
        conn.close()
        process.join()

    for _ in range(min(max(1, jobs), len(items))):
        spawn()
    while active:
        for conn in wait(list(active)):
            process, index = active[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                conn.close()
                process.join()
                del active[conn]
                if index is not None:
                    outcomes[index] = Outcome(died=_death(process.exitcode))
                if pending and len(active) < jobs:
                    spawn()
                continue
            if message[0] == "done":
                _, ok, value = message
                outcomes[index] = Outcome(value=value) if ok else Outcome(error=_rebuild(value))
                active[conn][1] = None
                if isolate:
                    retire(conn)
                    if pending:
                        spawn()
                    continue
            if pending:  # "ready", or "done" with more to do
                index = pending.popleft()
                active[conn][1] = index
                conn.send((index, items[index]))
            else:
                retire(conn)
    return [o if o is not None else Outcome(died="the worker never answered") for o in outcomes]


def raise_first_error(outcomes: Sequence[Outcome]) -> None:
    """Raise the first item's exception, in item order, if any item raised one."""
    for o in outcomes:
        if o.error is not None:
            raise o.error


def _death(exitcode: int | None) -> str:
    import signal

    if exitcode is not None and exitcode < 0:
        try:
            return f"the process died with {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"the process died with signal {-exitcode}"
    return f"the process exited with code {exitcode} before answering"


def _worker(fn: Callable[[Any, Any], Any], common: Any, conn: Any) -> None:
    """A worker's loop: say ready, then run each item sent until ``None``."""
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
    return type(e).__module__, type(e).__qualname__, args, state


def _rebuild(spec: tuple) -> BaseException:
    module, name, args, state = spec
    try:
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(name)
        e = cls.__new__(cls)
        BaseException.__init__(e, *args)
        e.__dict__.update(state)
        return e
    except Exception:  # noqa: BLE001 - an exception class the parent cannot import
        return RuntimeError(f"{name}: {args[0] if args else ''}")
