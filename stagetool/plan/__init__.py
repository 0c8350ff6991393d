"""Options → Plan, before any JAX work: what a run is asked (:mod:`~stagetool.plan.options`), what
it compiles for, parsed once into a typed value (:mod:`~stagetool.plan.target`), the ``--explain``
and ``why`` selectors (:mod:`~stagetool.plan.selectors`), and the checked
:class:`~stagetool.plan.plan.Plan` (:mod:`~stagetool.plan.plan`) every later stage reads. No JAX
here; nothing is imported by the package itself (the analysis imports the selectors alone)."""
