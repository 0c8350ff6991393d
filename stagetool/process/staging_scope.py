"""Which threads a staging covers: the bookkeeping shared by the modules that keep the caller's
process as it was while a function is staged in it (:mod:`stagetool.process.dispositions`: signal
handlers and timers; :mod:`stagetool.process.exit_handlers`: ``atexit``).

Each of them patches a module (``signal``, ``atexit``) while any staging is under way and sends the
calls of covered threads to a private table. A thread is covered while it stages, and so is every
thread started since the outermost staging began (the staged code's own threads); the threads that
were running then and are not staging (the CLI's main thread, the caller's other threads) are not:
their calls reach the process as ever. Stagings nest and run from several threads at once, so each
thread's depth is counted. A forked child forgets all of it (``os.register_at_fork``). Nothing here
imports JAX.
"""

from __future__ import annotations

import os
import threading
from typing import Callable


class StagingScope:
    """The threads staging now and the threads outside the staging, for one module that redirects
    calls while staging (each such module keeps its own: it nests on its own).

    ``lock`` guards the scope and the module's own tables; :meth:`enter` and :meth:`leave` are
    called with it held, :meth:`covers` may be called without it (a read of two containers).

    Args:
      after_fork_in_child: the module's own reset in a forked child (its tables emptied, the real
        functions put back), run after the scope has forgotten every staging.
    """

    def __init__(self, after_fork_in_child: Callable[[], None]):
        self.lock = threading.RLock()
        self._staging: dict[threading.Thread, int] = {}  # the threads staging now, with their depth
        self._outside: set[threading.Thread] = set()  # running when the staging began, not staging
        self._after_fork = after_fork_in_child
        self._hooked = False

    def active(self) -> bool:
        """Whether any thread is staging now."""
        return bool(self._staging)

    def covers(self, thread: threading.Thread | None = None) -> bool:
        """Whether ``thread`` (default: the calling one) is covered: a staging is under way and the
        thread is staging, or was started since the outermost staging began."""
        if not self._staging:
            return False
        t = threading.current_thread() if thread is None else thread
        return t in self._staging or t not in self._outside

    def enter(self) -> bool:
        """Count the calling thread in (with ``lock`` held); True when this is the outermost
        staging: no other was under way, so the threads running now (but this one) are taken as
        outside it, and the fork hook is set (once)."""
        me = threading.current_thread()
        outermost = not self._staging
        if outermost:
            if not self._hooked and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=self._in_child)
                self._hooked = True
            self._outside.clear()
            self._outside.update(threading.enumerate())
        self._outside.discard(me)
        self._staging[me] = self._staging.get(me, 0) + 1
        return outermost

    def leave(self) -> list[threading.Thread] | None:
        """Count the calling thread out (with ``lock`` held). When no staging is left: the threads
        started since the outermost staging began that still run (the caller's own excluded), and
        the scope forgets which threads were outside; else None."""
        me = threading.current_thread()
        self._staging[me] -= 1
        if not self._staging[me]:
            del self._staging[me]
        if self._staging:
            return None
        started = [t for t in threading.enumerate() if t not in self._outside and t is not me and t.is_alive()]
        self._outside.clear()
        return started

    def _in_child(self) -> None:
        """After a fork, in the child: nothing staged, then the module's own reset."""
        self._staging.clear()
        self._outside.clear()
        self._after_fork()
