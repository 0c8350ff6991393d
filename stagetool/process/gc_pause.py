"""Python's cyclic garbage collector in a stagetool process: paused through start-up, then resumed
with the start-up heap frozen.

Starting a command imports JAX, jaxlib's MLIR bindings and stagetool: a few hundred thousand
objects that live until the process exits. With the collector on, the allocations trigger
collections that walk them again and again, and the interpreter's final collection at exit walks
them once more; on a 2-core VM that was ~0.4 s of a 2.5 s ``report`` on the MLP example
(``bench/bench_overhead.py``). So the command-line entry point pauses the collector
(:func:`pause`); once the devices are up (JAX imported, its backend started) the pipeline calls
:func:`resume`, which moves every object alive at that point to the permanent generation
(:func:`gc.freeze`) and turns the collector back on: tracing and compiling then collect as usual,
without rescanning the start-up heap. The entry point freezes once more before the process exits.

Nothing here runs unless the entry point asked for it: the Python API leaves the caller's
collector alone.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Turn the cyclic collector off until :func:`resume` (the command-line entry point calls it)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """If :func:`pause` turned the collector off: freeze the objects alive now (they are never
    scanned again) and turn it back on. A no-op otherwise, and on every later call."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


def before_exit() -> None:
    """Freeze what is alive, so that the interpreter's final collection does not walk it (the
    process is about to end; nothing it holds needs collecting first)."""
    gc.freeze()
