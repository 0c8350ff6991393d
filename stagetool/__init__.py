"""stagetool: what will XLA do with my JAX function on this mesh?

The Python API (the same report the CLI renders)::

    from stagetool import Options, Section, analyze

    report = analyze(Options(target="examples/mlp.py:train_step", mesh="2x4"), [Section.SHARDINGS, Section.COST])

The live function, in a notebook or a test (the same report, shown as HTML in Jupyter)::

    report = stagetool.inspect(train_step, params, batch, mesh=mesh, topology="v5e:2x4")
    report.memory, report.collectives, report.why(leaf="wq")

Names are imported lazily, so ``import stagetool`` (and ``stagetool --help``) do not import JAX.
"""

from __future__ import annotations

from typing import Any

from stagetool._version import __version__

_EXPORTS = {
    "Options": "stagetool.plan.options",
    "Section": "stagetool.plan.options",
    "REPORT_SECTIONS": "stagetool.plan.options",
    "analyze": "stagetool.pipeline",
    "staged_functions": "stagetool.pipeline",
    "devices_report": "stagetool.pipeline",
    "inspect": "stagetool.live",
    "assert_no_collective": "stagetool.live.asserts",
    "assert_peak_under": "stagetool.live.asserts",
    "assert_sharding": "stagetool.live.asserts",
    "load_spec": "stagetool.spec.parse",
    "Report": "stagetool.report.model",
    "FunctionReport": "stagetool.report.model",
    "LeafReport": "stagetool.report.model",
    "Format": "stagetool.report",
    "render": "stagetool.report",
    "StagetoolError": "stagetool.core.errors",
    "UsageError": "stagetool.core.errors",
    "SpecError": "stagetool.core.errors",
    "TargetError": "stagetool.core.errors",
    "StagingError": "stagetool.core.errors",
    "BaselineError": "stagetool.core.errors",
    "ExitCode": "stagetool.core.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stagetool' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
