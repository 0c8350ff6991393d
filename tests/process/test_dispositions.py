"""stagetool.process.dispositions in this process, without JAX: the private table staged code gets,
what is undone on leaving, and what is left to others (a thread that is not staging, the caller's
own timer). Handlers used here are SIGUSR1's and SIGALRM's, set back by each test."""

from __future__ import annotations

import signal
import threading
from signal import setitimer as bound_setitimer, signal as bound_signal

import pytest

from stagetool.process.dispositions import caller_signals


@pytest.fixture
def usr1():
    before = (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGALRM))
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGUSR1, before[0])
    signal.signal(signal.SIGALRM, before[1])


def mine(signum, frame):
    pass


def test_staged_calls_go_to_a_table_and_the_notes_name_their_lines(usr1):
    notes: list[str] = []
    caller = signal.getsignal(signal.SIGUSR1)
    with caller_signals(notes):
        assert signal.signal(signal.SIGUSR1, mine) is caller  # the one before, as signal.signal answers
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.setitimer(signal.ITIMER_REAL, 30.0) == (0.0, 0.0)
        left, interval = signal.getitimer(signal.ITIMER_REAL)
        assert 29.0 < left <= 30.0 and interval == 0.0
        assert signal.alarm(9) == 30  # the staged table's alarm, rounded up as alarm() rounds
        with pytest.raises(OSError):
            signal.signal(signal.SIGKILL, mine)
        with pytest.raises(ValueError):
            signal.signal(999, mine)
    assert signal.getsignal(signal.SIGUSR1) is caller
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    line = mine.__code__.co_firstlineno
    assert notes[0] == (f"a SIGUSR1 handler set at {__file__}:{line} was not installed: stagetool keeps the caller's "
                        "signal handlers while it stages")
    assert notes[1].startswith(f"an alarm (signal.alarm(9)) armed at {__file__}:") and len(notes) == 2, notes
    assert signal.signal is signal.__dict__["signal"] and signal.signal.__module__ in ("_signal", "signal")


def test_what_reaches_the_process_is_undone_and_the_callers_timer_set_back(usr1):
    signal.signal(signal.SIGALRM, mine)  # the caller's own alarm, 20 s away
    signal.setitimer(signal.ITIMER_REAL, 20.0)
    notes: list[str] = []
    with caller_signals(notes):
        bound_signal(signal.SIGUSR1, mine)  # bound before: reaches the process
        bound_setitimer(signal.ITIMER_REAL, 0)  # cancels the caller's alarm
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    assert 18.0 < left <= 20.0
    assert any(n.startswith("a SIGUSR1 handler (set at ") and n.endswith("the caller's is restored") for n in notes)
    assert any("the caller's ITIMER_REAL timer was changed while staging" in n for n in notes)


def test_a_thread_that_is_not_staging_reaches_the_process_and_one_the_staging_started_does_not(usr1):
    ready, done = threading.Event(), threading.Event()
    seen = {}

    def outsider():
        ready.wait(10)
        seen["outsider"] = signal.setitimer(signal.ITIMER_REAL, 40.0)  # the real timer
        done.set()

    t = threading.Thread(target=outsider)
    t.start()
    signal.signal(signal.SIGALRM, mine)
    with caller_signals() as _, caller_signals():  # nested: the table lasts until the outermost leaves
        ready.set()
        done.wait(10)
        inner = threading.Thread(target=lambda: seen.setdefault("inner", signal.alarm(7)))
        inner.start()
        inner.join()
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 6.0  # the table's 7 s, not the outsider's 40
    t.join()
    assert seen == {"outsider": (0.0, 0.0), "inner": 0}
    assert 38.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 40.0  # the outsider's timer stays: it is not ours


def test_a_handler_put_back_and_an_alarm_cancelled_are_no_news(usr1):
    """The timeout guard (arm, work, cancel) and a handler set and restored leave no note."""
    notes: list[str] = []
    with caller_signals(notes):
        old = signal.signal(signal.SIGUSR1, mine)
        signal.alarm(5)
        signal.alarm(0)
        signal.signal(signal.SIGUSR1, old)
        signal.setitimer(signal.ITIMER_REAL, 0.001)  # due at once: it would have fired while staging
        threading.Event().wait(0.01)
    assert len(notes) == 1 and notes[0].startswith("ITIMER_REAL timer (0.001 s) armed at "), notes
