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

from typing import TYPE_CHECKING, Any

from stagetool._version import __version__

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time _EXPORTS imports each on first use
    from stagetool.core.errors import BaselineError as BaselineError
    from stagetool.core.errors import ExitCode as ExitCode
    from stagetool.core.errors import SpecError as SpecError
    from stagetool.core.errors import StagetoolError as StagetoolError
    from stagetool.core.errors import StagingError as StagingError
    from stagetool.core.errors import TargetError as TargetError
    from stagetool.core.errors import UsageError as UsageError
    from stagetool.live import inspect as inspect
    from stagetool.live.asserts import assert_no_collective as assert_no_collective
    from stagetool.live.asserts import assert_peak_under as assert_peak_under
    from stagetool.live.asserts import assert_sharding as assert_sharding
    from stagetool.live.report import LiveReport as LiveReport
    from stagetool.pipeline import analyze as analyze
    from stagetool.pipeline import devices_report as devices_report
    from stagetool.pipeline import staged_functions as staged_functions
    from stagetool.plan.options import REPORT_SECTIONS as REPORT_SECTIONS
    from stagetool.plan.options import Options as Options
    from stagetool.plan.options import Section as Section
    from stagetool.report import Format as Format
    from stagetool.report import render as render
    from stagetool.report.model import FunctionReport as FunctionReport
    from stagetool.report.model import LeafReport as LeafReport
    from stagetool.report.model import Report as Report
    from stagetool.spec.parse import load_spec as load_spec

# The public names and the modules that define them (each listed in the TYPE_CHECKING block above as
# well, and documented in docs/api-reference.md: tests/test_api.py keeps the three the same).
_EXPORTS = {
    "Options": "stagetool.plan.options",
    "Section": "stagetool.plan.options",
    "REPORT_SECTIONS": "stagetool.plan.options",
    "analyze": "stagetool.pipeline",
    "staged_functions": "stagetool.pipeline",
    "devices_report": "stagetool.pipeline",
    "inspect": "stagetool.live",
    "LiveReport": "stagetool.live.report",
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

# a literal list, as type checkers read it
__all__ = [
    "__version__",
    "Options", "Section", "REPORT_SECTIONS", "analyze", "staged_functions", "devices_report", "inspect",
    "LiveReport", "assert_no_collective", "assert_peak_under", "assert_sharding", "load_spec", "Report",
    "FunctionReport", "LeafReport", "Format", "render", "StagetoolError", "UsageError", "SpecError",
    "TargetError", "StagingError", "BaselineError", "ExitCode",
]


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
