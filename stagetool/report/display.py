"""How a report shows where it is displayed: Jupyter/Colab (``_repr_mimebundle_``: one output, the
HTML page with the text report as its ``text/plain``), Markdown front ends (``_repr_markdown_``), a
terminal or a log (``str``).

The text is rendered by Rich into a string, never onto Rich's own Jupyter display (a Rich ``Console``
in a kernel sends each line it prints to the notebook as an output of its own: the text renderers
pass ``force_jupyter=False``).

The HTML is the self-contained page of :mod:`stagetool.report.render_html` (inline SVG and CSS, no
script, no network), put in a sandboxed ``<iframe srcdoc>`` so that the page's stylesheet cannot
restyle the notebook around it (the ``sandbox`` attribute, given no permission, also keeps any
script from running). Never imports JAX, nor the report model (the documents are duck-typed), so
the model's methods can call it.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any

FRAME_HEIGHT_PX = 720
"""The notebook frame's height; the page scrolls inside it and the frame can be resized."""


def page(doc: Any) -> str:
    """The whole HTML page of a report (``stagetool report --format html``'s text)."""
    from stagetool.report import Format, render

    return render(doc, Format.html)


def notebook_html(doc: Any) -> str:
    """The page of ``doc`` in a sandboxed frame, for ``_repr_html_``."""
    return (f'<iframe class="stagetool-report" sandbox="" title="stagetool report" '
            f'style="width:100%;height:{FRAME_HEIGHT_PX}px;border:1px solid #ccc;resize:vertical" '
            f'srcdoc="{html.escape(page(doc), quote=True)}"></iframe>')


def mimebundle(html_page: Any, plain: Any, include: Any = None, exclude: Any = None) -> dict[str, str]:
    """What a notebook shows for a report: one output, ``{"text/html": html_page(), "text/plain":
    plain()}`` (IPython's ``_repr_mimebundle_``; ``include``/``exclude`` as IPython gives them: MIME
    types to keep or leave out, each form rendered only when kept)."""
    bundle: dict[str, str] = {}
    for mime, render_one in (("text/html", html_page), ("text/plain", plain)):
        if (include and mime not in include) or (exclude and mime in exclude):
            continue
        bundle[mime] = render_one()
    return bundle


def markdown(doc: Any) -> str:
    """The Markdown report (``--format markdown``)."""
    from stagetool.report import Format, render

    return render(doc, Format.markdown)


def text(doc: Any) -> str:
    """Plain text as ``stagetool report`` prints into a pipe (no colour, every cell whole)."""
    from stagetool.report import Format, render

    return render(doc, Format.text, color=False, fit=True)


_SECTIONS = ("module", "inputs", "outputs", "cost", "memory", "collectives", "why", "modules")


def only(doc: Any, function: Any, keep: tuple[str, ...], **replaced: Any) -> Any:
    """``doc`` holding ``function`` alone with only the sections ``keep`` (the others None), and
    ``replaced`` fields set on it (``why=`` an answer): what a section shows on its own."""
    cut = {s: None for s in _SECTIONS if s not in keep}
    return doc.holding(dataclasses.replace(function, **{**cut, **replaced}))


class Shown:
    """A section of a report (its memory, collectives, cost, shardings, or an answer of ``why``) that
    displays on its own: in a notebook as the HTML report holding only that section, as Markdown or
    text elsewhere. Every attribute of the section is read through it (``report.memory.record``);
    ``value`` is the section record itself.

    Attributes:
      value: the section (:class:`stagetool.analysis.sections.MemorySection`, ``CollectivesSection``,
        ``CostSection``, the input and output ``LeafReport`` tuples, a ``WhyAnswer``), or None when
        the function has none (it failed to stage; see the report's ``error``).
      doc: the report that holds only this section (what is rendered).
    """

    def __init__(self, value: Any, doc: Any) -> None:
        self.value = value
        self.doc = doc

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.value, name)

    def __repr__(self) -> str:
        return f"Shown({self.value!r})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython's text form (a terminal, a notebook's ``text/plain``): the section's text report."""
        printer.text("Shown(...)" if cycle else text(self.doc))

    def __str__(self) -> str:
        return text(self.doc)

    def _repr_html_(self) -> str:
        return notebook_html(self.doc)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        """One notebook output: the section's HTML page, its text report as ``text/plain``."""
        return mimebundle(self._repr_html_, self.__str__, include, exclude)

    def _repr_markdown_(self) -> str:
        return markdown(self.doc)
