"""Staging: trace → lower → compile through the user's own jit, and the facts read from it.

:mod:`.stages` runs the stages (with XLA's dump when the peak is wanted), :mod:`.gather` reads the
JAX-free :mod:`stagetool.facts` records from them, :mod:`.shardy` reruns Shardy's propagation, and
:mod:`.cache` keeps the facts so that a rerun skips the compile.
"""
