"""Configuration sweeps: which mesh, batch or remat policy fits, and which is fastest.

``grid`` turns ``--mesh``/``--set``/``--topology`` into configurations with stable ids; ``run``
stages one configuration in a process of its own and makes its row; ``executors`` run the rows
here (``--jobs N``) or on Ray; ``rows`` holds the row record, the ranking and ``merge``; ``render``
the table, JSON, Markdown and CSV; ``driver`` plans and runs a sweep. This package may import
:mod:`stagetool.pipeline` and below, never the CLI.
"""

from stagetool.sweep.driver import SweepOptions, plan_sweep, run_sweep
from stagetool.sweep.rows import RankBy, merge, without_timings

__all__ = ["RankBy", "SweepOptions", "merge", "plan_sweep", "run_sweep", "without_timings"]
