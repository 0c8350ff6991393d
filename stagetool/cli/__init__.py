"""The ``stagetool`` command: a Typer layer over :mod:`stagetool.pipeline`.

- :mod:`~stagetool.cli.entry`: :func:`main`, the entry point (signals, the click command one run needs);
- :mod:`~stagetool.cli.app`: :data:`app` and its root command (``--version``, a multi-process run's options);
- :mod:`~stagetool.cli.options`: the options the commands share, declared once;
- :mod:`~stagetool.cli.commands`: the commands, by family (stage, devices, gate, sweep);
- :mod:`~stagetool.cli.output`: stdout or ``-o`` (atomically), stderr, errors → exit codes
  (:class:`stagetool.core.errors.ExitCode`), a closed pipe.

Importing it does not import JAX, so ``--help`` stays fast (``--version`` is answered before it is
imported: :mod:`stagetool.__main__`).
"""

from __future__ import annotations

from stagetool.cli import commands  # noqa: F401 - registers the commands on app, in --help's order
from stagetool.cli.app import app
from stagetool.cli.entry import main

__all__ = ["app", "main"]
