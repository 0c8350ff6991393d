"""Each staging option is declared once (issue 50): every command that stages takes the same
:class:`stagetool.cli.options.Staging` parameters (its flags, types and defaults, read from the Typer
app itself), and a sweep or fit hands each configuration the run's :class:`~stagetool.plan.options.Options`
whole, so a new option reaches every row without a word in the sweep's code."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import typer.main
from helpers import EXAMPLES

from stagetool.cli import app
from stagetool.cli.options import Staging
from stagetool.core import codec
from stagetool.plan.options import Options
from stagetool.sweep import SweepOptions, plan_sweep
from stagetool.sweep.driver import payload
from stagetool.sweep.fit import FitOptions, plan_fit

STAGING_COMMANDS = {"lower", "compile", "shardings", "collectives", "why", "cost", "memory", "modules", "report",
                    "snapshot", "check", "sweep", "fit"}
"""The commands that stage a function (``sweep`` and ``fit`` leave some out: below)."""

NOT_TAKEN = {"sweep": {"cache_dir", "no_cache", "against"}, "fit": {"against"}}
"""A sweep compiles every configuration afresh: its rows time the compile (``--rank-by compile``); a
sweep row and a fit probe hold one target's figures, so neither stages ``--against`` a second target."""

DEVICES_ONLY = {"mesh", "platform", "topology", "gpu_target_config", "slices"}
"""What ``stagetool devices`` takes of them: no function is staged, so no target, spec or cache."""


def _declared() -> dict[str, typing.Any]:
    """Each Staging field's Typer declaration (its OptionInfo / ArgumentInfo), by field name."""
    hints = typing.get_type_hints(Staging, include_extras=True)
    return {f.name: typing.get_args(hints[f.name])[1] for f in dataclasses.fields(Staging)}


def _flags(info: typing.Any) -> list[str]:
    """The flags of a Typer declaration (``typer.Option("--spec", "-s")``: its first one is kept as
    its ``default`` in the ``Annotated`` form)."""
    # a boolean pair ("--context-mesh/--no-context-mesh"): click's opts hold the first, secondary_opts the second
    return [d.split("/")[0] for d in (info.default, *(info.param_decls or ())) if isinstance(d, str) and d.startswith("-")]


def _params(command: str) -> dict[str, typing.Any]:
    group = typer.main.get_command(app)
    return {p.name: p for p in group.commands[command].params}


@pytest.mark.parametrize("command", sorted(STAGING_COMMANDS | {"devices"}))
def test_every_staging_command_takes_the_staging_options_as_declared_once(command):
    declared = _declared()
    expected = (DEVICES_ONLY if command == "devices" else set(declared) - NOT_TAKEN.get(command, set()))
    params = _params(command)
    defaults = {f.name: f.default for f in dataclasses.fields(Staging)}
    assert expected <= set(params), f"{command} lacks {sorted(expected - set(params))}"
    for name in sorted(expected):
        info, p = declared[name], params[name]
        assert sorted(p.opts) == sorted(_flags(info) or [name]), (command, name, p.opts)
        assert p.default == defaults[name], (command, name, p.default)
    # the staging options come first, in Staging's order (as --help lists them)
    order = [n for n in params if n in expected]
    assert order == [f.name for f in dataclasses.fields(Staging) if f.name in expected]


def test_a_sweep_configuration_stages_the_run_options_whole(monkeypatch, tmp_path):
    """Every Options field travels to each configuration (the payload's options decode to the run's,
    the grid's mesh/topology/variables and the paths made absolute aside); fit hands its the same way."""
    monkeypatch.chdir(EXAMPLES)
    given = Options(target="transformer.py:train_step", spec=Path("transformer_sweep.stagetool.yaml"),
                    chip="tpu-v5e", device_memory="1GiB", top=3, peak=True, dialect="hlo", explain=("embed",),
                    local_avals=True, cache_dir=tmp_path / "cache")
    plan = plan_sweep(SweepOptions(given, mesh="2x4,4x2", set=("batch=8,16",)))
    sent = payload(plan, plan.configs[1])["common"]["options"]
    assert set(sent) == {f.name for f in dataclasses.fields(Options)}  # all of them: none picked by name
    expected = dataclasses.replace(given, spec=(EXAMPLES / "transformer_sweep.stagetool.yaml").resolve(),
                                   function="train_step")
    assert codec.decode(Options, sent) == expected
    fitted = plan_fit(FitOptions(given, mesh="2x4,4x2"), (8, 16))
    assert codec.decode(Options, fitted.common["options"]) == expected
