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
import os
import sys
import threading
import weakref
from typing import Any, Callable, Iterator

_REAL_REGISTER = atexit.register
_REAL_UNREGISTER = atexit.unregister
_LOCK = threading.RLock()
_STAGING: dict[threading.Thread, int] = {}  # the threads staging now, with their depth
_OUTSIDE: set[threading.Thread] = set()  # threads alive when the staging began that are not staging
_LATE: weakref.WeakSet = weakref.WeakSet()  # threads started while staging, still running after it
_KEPT: list[tuple[Callable[..., Any], str]] = []  # (handler, file:line) registered by staged code
_HOOKED = [False]


def _count() -> int | None:
    """How many handlers the process's ``atexit`` holds, when the interpreter says (private-api:
    ``atexit._ncallbacks``, CPython's only count of them; None elsewhere)."""
    fn = getattr(atexit, "_ncallbacks", None)
    return fn() if callable(fn) else None


def _virtual() -> bool:
    """Whether the calling thread's registrations go to the private list: a staging thread, one
    started since the staging began, or one a staging left running."""
    t = threading.current_thread()
    if t in _LATE:
        return True
    return bool(_STAGING) and (t in _STAGING or t not in _OUTSIDE)


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
        if not _STAGING and not any(t.is_alive() for t in list(_LATE)):
            _KEPT.clear()
            _unpatch()


def _in_child() -> None:
    """After a fork, in the child: the real functions, nothing staged."""
    global _LATE
    _STAGING.clear()
    _OUTSIDE.clear()
    _KEPT.clear()
    _LATE = weakref.WeakSet()
    _unpatch()


@contextlib.contextmanager
def caller_atexit(found: list[str] | None = None) -> Iterator[None]:
    """Stage within: see the module's account. ``found`` (when given) gets one note per handler the
    staged code registered (``"an atexit handler (os._exit) registered at model.py:4 was dropped;
    ..."``), on leaving, however the block ends. Nests, and works from several threads at once."""
    me = threading.current_thread()
    with _LOCK:
        outermost = not _STAGING
        if outermost:
            if not _HOOKED[0] and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_in_child)
                _HOOKED[0] = True
            _OUTSIDE.clear()
            _OUTSIDE.update(threading.enumerate())
        _OUTSIDE.discard(me)
        _STAGING[me] = _STAGING.get(me, 0) + 1
        count = _count()
        _patch()
    try:
        yield
    finally:
        notes: list[str] = []
        with _LOCK:
            _STAGING[me] -= 1
            if not _STAGING[me]:
                del _STAGING[me]
            if not _STAGING:
                for t in threading.enumerate():
                    if t not in _OUTSIDE and t is not me and t.is_alive():
                        _LATE.add(t)
                for func, where in _KEPT:
                    notes.append(f"an atexit handler ({_name(func)}) registered at {where} was dropped: stagetool "
                                 "keeps the caller's exit handlers as they were while it stages")
                _KEPT.clear()
                _OUTSIDE.clear()
                after = _count()
                if count is not None and after is not None and after > count:
                    notes.append(f"{after - count} atexit handler(s) registered while staging, through an "
                                 "atexit.register bound before it, will run when this process ends")
                _unpatch_if_idle()
        if found is not None:
            found.extend(notes)
