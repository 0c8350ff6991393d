"""The commands, by family; importing this registers them on :data:`stagetool.cli.app.app` in the
order ``stagetool --help`` lists them: stage (lower ... report), devices, calibrate, gate (snapshot, check, diff), sweep, fit."""

from __future__ import annotations

from stagetool.cli.commands import stage, devices, calibrate, gate, sweep, fit  # noqa: F401, I001 - the order is --help's
