"""Measuring on the attached accelerator: the stage that RUNS programs (``stagetool calibrate``'s
micro-benchmarks, ``cost --measure``'s steps, the profiler's per-instruction times).

Everything here imports JAX and runs compiled executables on real devices; it is never imported by
the JAX-free analysis. The statistics (:mod:`stagetool.measure.timing`) and the profile writer
(:mod:`stagetool.measure.calibrate`) are tested on the CPU backend; the figures they give only mean
something on an accelerator (:func:`stagetool.measure.timing.require_accelerator`).
"""
