"""The ``stagetool`` command's entry point (the console script and ``python -m stagetool``).

``stagetool --version`` is answered here without importing Typer, Rich or JAX; everything else
goes to :func:`stagetool.cli.main`.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); the exit code.

    The command runs in a forked child whose exit code is believed only if it reports finishing
    (:mod:`stagetool.process.supervise`: ``os._exit(0)`` in user code is exit 3, not a pass). The cyclic
    garbage collector is paused through start-up and resumed once the devices are up
    (:mod:`stagetool.process.gc_pause`).
    """
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        from stagetool._version import __version__

        sys.stdout.write(f"stagetool {__version__}\n")
        return 0
    from stagetool.process import supervise

    if supervise.wanted(args):
        return supervise.run(lambda: _command(argv))
    return _command(argv)


def _command(argv: list[str] | None) -> int:
    from stagetool.process import gc_pause

    gc_pause.pause()
    try:
        from stagetool.cli import main as cli_main

        return cli_main(argv)
    finally:
        gc_pause.before_exit()


if __name__ == "__main__":  # not when a worker process (multiprocessing's spawn) imports it as __mp_main__
    sys.exit(main())
