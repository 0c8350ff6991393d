"""The commands, by family; importing this registers them on :data:`stagetool.cli.app.app` in the
order ``stagetool --help`` lists them: stage (lower ... report), devices, gate (snapshot, check, diff), sweep, fit."""

from __future__ import annotations

from stagetool.cli.commands import stage, devices, gate, sweep, fit  # noqa: F401, I001 - the order is --help's
