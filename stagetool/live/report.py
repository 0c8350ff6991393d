"""The report :func:`stagetool.inspect` returns: a :class:`stagetool.report.model.Report` whose
sections are analysed from the one compile when first asked for.

``report.memory`` analyses the memory alone; ``report.collectives`` (and ``why``) reruns Shardy's
propagation for the collectives' causes the first time; ``report.functions`` (what every renderer,
``_repr_html_`` and JSON read) analyses every section of ``stagetool report``. Each answer is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stagetool.report.model import FunctionReport, Report

if TYPE_CHECKING:
    from stagetool.pipeline import StagedOnce

#: The report's sections by the FunctionReport fields that hold them.
_SECTION_OF = {"inputs": "shardings", "outputs": "shardings", "memory": "memory", "collectives": "collectives",
               "cost": "cost", "modules": "modules"}


class LiveReport(Report):
    """A :class:`Report` of one function staged once (:class:`stagetool.pipeline.StagedOnce`), its
    sections analysed on request. It holds JAX's stages, so it stays in this process: pickled, it is
    the plain :class:`Report` of every section."""

    def __init__(self, once: StagedOnce, base: Report, sections: tuple[str, ...]) -> None:  # noqa: D107
        for name in ("command", "stagetool_version", "jax_version", "jaxlib_version", "config"):
            object.__setattr__(self, name, getattr(base, name))
        object.__setattr__(self, "_once", once)
        object.__setattr__(self, "_all", tuple(sections))
        object.__setattr__(self, "_partial", {})

    @property
    def functions(self) -> tuple[FunctionReport, ...]:  # type: ignore[override]
        """The function with every section of ``stagetool report`` (analysed on first read)."""
        return (self._analysed(self._all),)

    def _analysed(self, sections: tuple[str, ...]) -> FunctionReport:
        from stagetool.pipeline import Section

        key, every = tuple(sorted(set(sections))), tuple(sorted(set(self._all)))
        if key != every and set(key) <= set(every) and every in self._partial:
            return self._partial[every]  # everything asked for is analysed already
        if key not in self._partial:
            self._partial[key] = self._once.report(Section(s) for s in key)
        return self._partial[key]

    def _function_with(self, fields: tuple[str, ...]) -> FunctionReport:
        return self._analysed(tuple(_SECTION_OF[f] for f in fields))

    def _repr_html_(self) -> str:
        """The notebook's HTML: the page ``stagetool report --format html`` writes, the per-module
        tree (``report.modules``) folded in as there."""
        from stagetool.report.display import notebook_html

        page = Report(self.command, self.stagetool_version, self.jax_version, self.jaxlib_version,
                      (self._analysed((*self._all, "modules")),), self.config)
        return notebook_html(page)

    def __reduce__(self) -> Any:
        return Report, (self.command, self.stagetool_version, self.jax_version, self.jaxlib_version, self.functions,
                        self.config)
