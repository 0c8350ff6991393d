"""``atexit`` handlers while a function is staged in the caller's own process (``stagetool.inspect``,
the pytest fixture): the caller's, before and after.

Code run while staging (the function, a module imported then, an ``init`` or ``{call: ...}``) that
calls ``atexit.register`` through the ``atexit`` module (``atexit.register(os._exit, 0)``, the
``@atexit.register`` decorator, ``from atexit import register`` done while staging) registers nothing
in the process: the handler is kept in a private list, returned as ``atexit.register`` returns it,
and dropped when the staging ends, with a note naming it and the line that registered it. Without
this, such a handler outlives the staging and runs when the caller's interpreter ends: a pytest
session whose tests failed exits 0, a script's own exit status is replaced. ``atexit.unregister``
from staged code removes only what the staged code registered (never a handler of the caller's).
Threads the staged code started get the same private list for as long as they run.

A handler registered through ``atexit.register`` bound before the staging (or from C) reaches the
process; its count is checked (``atexit._ncallbacks``, the one count the module gives, marked
``private-api``) and a note says so. Forked children get the real functions back. The CLI needs
none of this: its run ends with ``os._exit`` (:mod:`stagetool.process.supervise`). Nothing here
imports JAX.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import weakref
from typing import Any, Callable, Iterator

from stagetool.process.staging_scope import StagingScope

_REAL_REGISTER = atexit.register
_REAL_UNREGISTER = atexit.unregister
_LATE: weakref.WeakSet = weakref.WeakSet()  # threads started while staging, still running after it
_KEPT: list[tuple[Callable[..., Any], str]] = []  # (handler, file:line) registered by staged code


def _in_child() -> None:
    """After a fork, in the child: the real functions, nothing staged."""
    global _LATE
    _KEPT.clear()
    _LATE = weakref.WeakSet()
    _unpatch()


_SCOPE = StagingScope(_in_child)
_LOCK = _SCOPE.lock


def _count() -> int | None:
    """How many handlers the process's ``atexit`` holds, when the interpreter says (private-api:
    ``atexit._ncallbacks``, CPython's only count of them; None elsewhere)."""
    fn = getattr(atexit, "_ncallbacks", None)
    return fn() if callable(fn) else None


def _virtual() -> bool:
    """Whether the calling thread's registrations go to the private list: a staging thread, one
    started since the staging began, or one a staging left running."""
    return threading.current_thread() in _LATE or _SCOPE.covers()


def _name(fn: Any) -> str:
    """``os._exit``, ``model.cleanup``: the handler as a reader knows it."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    module = {"posix": "os", "nt": "os", "builtins": ""}.get(getattr(fn, "__module__", None) or "",
                                                           getattr(fn, "__module__", None) or "")
    return f"{module}.{name}" if module else name


def _register(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Callable[..., Any]:
    if not _virtual():
        _unpatch_if_idle()
        return _REAL_REGISTER(func, *args, **kwargs)
    if not callable(func):
        raise TypeError("the first argument must be callable")
    frame = sys._getframe(1)
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    with _LOCK:
        _KEPT.append((func, where))
    return func


def _unregister(func: Callable[..., Any], /) -> None:
    if not _virtual():
        _unpatch_if_idle()
        return _REAL_UNREGISTER(func)
    with _LOCK:
        _KEPT[:] = [(f, w) for f, w in _KEPT if f != func]
    return None


def _patch() -> None:
    atexit.register = _register  # type: ignore[assignment]
    atexit.unregister = _unregister  # type: ignore[assignment]


def _unpatch() -> None:
    if atexit.register is _register:  # left as it is when something else replaced it meanwhile
        atexit.register = _REAL_REGISTER
    if atexit.unregister is _unregister:
        atexit.unregister = _REAL_UNREGISTER


def _unpatch_if_idle() -> None:
    with _LOCK:
        if not _SCOPE.active() and not any(t.is_alive() for t in list(_LATE)):
            _KEPT.clear()
            _unpatch()


@contextlib.contextmanager
def caller_atexit(found: list[str] | None = None) -> Iterator[None]:
    """Stage within: see the module's account. ``found`` (when given) gets one note per handler the
    staged code registered (``"an atexit handler (os._exit) registered at model.py:4 was dropped;
    ..."``), on leaving, however the block ends. Nests, and works from several threads at once."""
    with _LOCK:
        _SCOPE.enter()
        count = _count()
        _patch()
    try:
        yield
    finally:
        notes: list[str] = []
        with _LOCK:
            started = _SCOPE.leave()
            if started is not None:  # the last staging: its threads still running stay covered
                _LATE.update(started)
                for func, where in _KEPT:
                    notes.append(f"an atexit handler ({_name(func)}) registered at {where} was dropped: stagetool "
                                 "keeps the caller's exit handlers as they were while it stages")
                _KEPT.clear()
                after = _count()
                if count is not None and after is not None and after > count:
                    notes.append(f"{after - count} atexit handler(s) registered while staging, through an "
                                 "atexit.register bound before it, will run when this process ends")
                _unpatch_if_idle()
        if found is not None:
            found.extend(notes)
