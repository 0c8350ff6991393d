"""``cost --measure`` / ``report --measure``: run a staged step for real on the attached devices, on
random arrays of the spec's shapes, dtypes and shardings, and time it (MEASURED, wall clock).

Inputs: floating leaves ``normal(0, 1) × 0.02`` in their dtype; integer leaves uniform in
``[0, int_high)`` (so that ids index real rows); booleans random; PRNG keys from a seed. Donated inputs
are copied before each step, outside the timing. Each step is one call of the compiled executable
ended by ``block_until_ready``; the figure is the median over ``steps`` after ``warmup`` untimed steps.
"""

from __future__ import annotations

import time
from typing import Any

from stagetool.measure.timing import Timing, summarize


def concrete_inputs(tree: Any, seed: int, int_high: int = 1024, *, random_integers: bool = True) -> Any:
    """Arrays on the devices for the abstract leaves (``jax.ShapeDtypeStruct``) of ``tree``: random
    values of each leaf's dtype, put with its sharding; other leaves kept as they are.

    Floats are normal × 0.02 in the leaf's dtype, keys split from ``seed`` (leaf ``i`` draws from
    ``seed + i``), integers uniform in ``[0, int_high)`` and booleans fair coins; with
    ``random_integers=False`` integer and boolean leaves are zeros (``bench/bench_step_time.py``'s
    inputs, with which its kept results were measured)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, jax.ShapeDtypeStruct):
            key = jax.random.key(seed + i)
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                a = jax.random.split(key, x.shape) if x.shape else key
            elif jnp.issubdtype(x.dtype, jnp.floating):
                a = (jax.random.normal(key, x.shape, jnp.float32) * 0.02).astype(x.dtype)
            elif not random_integers:
                a = jnp.zeros(x.shape, x.dtype)
            elif jnp.issubdtype(x.dtype, jnp.integer):
                hi = min(int_high, int(jnp.iinfo(x.dtype).max))
                a = jax.random.randint(key, x.shape, 0, hi, jnp.int32).astype(x.dtype)
            elif x.dtype == jnp.bool_:
                a = jax.random.bernoulli(key, 0.5, x.shape)
            else:
                a = jnp.zeros(x.shape, x.dtype)
            sharding = getattr(x, "sharding", None)
            x = jax.device_put(a, sharding) if sharding is not None else a
        out.append(x)
    return jax.tree.unflatten(treedef, out)


class StepRunner:
    """One staged function made runnable: its compiled executable and concrete inputs.

    Args:
      staged: :class:`stagetool.staging.stages.Staged` (compiled for the attached devices).
      inputs: its :class:`stagetool.inputs.records.AbstractInputs`.
      int_high: integer inputs are drawn from ``[0, int_high)``.
    """

    def __init__(self, staged: Any, inputs: Any, *, int_high: int = 1024):
        import jax

        self._jax = jax
        self.args = concrete_inputs(inputs.args, 0, int_high)
        statics = {k: v for k, v in inputs.kwargs.items() if k in inputs.static_argnames}
        self.kwargs = {k: v for k, v in concrete_inputs(inputs.kwargs, 1000, int_high).items()
                       if k not in inputs.static_argnames}
        self.call = staged.compiled
        self._fallback = lambda *a, **k: staged.jitted(*a, **k, **statics)

    def fresh(self) -> tuple[tuple, dict]:
        """Copies of the inputs (donated buffers are consumed by a step), ready on the device."""
        copy = lambda t: self._jax.tree.map(lambda x: x.copy() if isinstance(x, self._jax.Array) else x, t)
        a, k = copy(self.args), copy(self.kwargs)
        self._jax.block_until_ready((a, k))
        return a, k

    def step(self, a: tuple, k: dict) -> Any:
        """One step on inputs ``a``, ``k``, blocked on."""
        try:
            return self._jax.block_until_ready(self.call(*a, **k))
        except TypeError:  # a Compiled that wants the static arguments too: the jitted function
            self.call = self._fallback
            return self._jax.block_until_ready(self.call(*a, **k))

    def time(self, *, steps: int = 10, warmup: int = 2) -> Timing:
        """Median seconds of one step (inputs copied before each, outside the timing)."""
        for _ in range(max(warmup, 1)):
            self.step(*self.fresh())
        samples = []
        for _ in range(steps):
            a, k = self.fresh()
            t0 = time.perf_counter()
            self.step(a, k)
            samples.append(time.perf_counter() - t0)
        return summarize(samples, inner=1, warmup=max(warmup, 1))

    def time_pipelined(self, steps: int = 10) -> float:
        """Seconds per step of ``steps`` calls issued back to back (inputs copied beforehand) and blocked
        on once: the host's dispatch overlaps the device's work, as in a training loop."""
        fresh = [self.fresh() for _ in range(steps)]
        self.step(*self.fresh())
        t0 = time.perf_counter()
        out = None
        for a, k in fresh:
            out = self.call(*a, **k)
        self._jax.block_until_ready(out)
        return (time.perf_counter() - t0) / steps

    def profile(self, steps: int = 3) -> tuple[dict[str, tuple[float, int]], str | None, float | None]:
        """Per-instruction device seconds per step, why they are missing, and the device seconds of one
        step (:func:`stagetool.measure.trace.profile_steps`)."""
        from stagetool.measure.trace import profile_steps

        fresh = [self.fresh() for _ in range(steps)]
        it = iter(fresh)
        return profile_steps(lambda: self.step(*next(it)), steps)


CPU_NOTE = ("measured on the CPU backend (simulated devices share this host's cores): a true figure for this "
            "CPU, meaningless for an accelerator's estimate; run it where the accelerator is attached")


def measure_report(options: Any, report: Any, *, steps: int = 10, warmup: int = 2, top: int = 10,
                   int_high: int = 1024) -> Any:
    """The ``report`` with each staged function's :class:`stagetool.report.model.MeasuredSection`: its step
    run for real on the attached devices (``options`` staged again, for the devices JAX's default backend
    attaches) and, from the profiler, its top instructions beside the estimate's.

    Args:
      options: the :class:`stagetool.plan.options.Options` the report was made with (not compile-only).
      report: the :class:`stagetool.report.model.Report` (its cost section gives the estimate).
      steps / warmup: timed and untimed steps; top: instructions kept.
      int_high: integer inputs are drawn from ``[0, int_high)``.

    Returns:
      A new report; functions that failed to stage are unchanged.
    """
    import dataclasses

    import jax

    from stagetool.pipeline import staged_functions
    from stagetool.report.model import MeasuredInstruction, MeasuredSection

    devices = jax.devices()
    device = f"{len(devices)} × {devices[0].device_kind}"
    platform = devices[0].platform
    wanted = {f.name for f in report.functions if f.error is None}
    measured: dict[str, MeasuredSection] = {}
    by_name = {f.name: f for f in report.functions}
    for fspec, inputs, staged in staged_functions(options):
        if fspec.name not in wanted:
            continue
        runner = StepRunner(staged, inputs, int_high=int_high)
        t = runner.time(steps=steps, warmup=warmup)
        ops, why, device_s = runner.profile(min(3, steps))
        cost = by_name[fspec.name].cost
        est = cost.step_time if cost is not None else None
        est_top = {i.name: i.total_seconds for i in est.top} if est is not None else {}
        floors = {u.name for u in est.uncounted} if est is not None else set()  # timed at a floor: at least
        ranked = sorted(ops.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]
        notes = [f"inputs: random values of the spec's shapes, dtypes and shardings (floats normal × 0.02, "
                 f"integers in [0, {int_high})); donated inputs copied before each step, outside the timing"]
        if platform == "cpu":
            notes.append(CPU_NOTE)
        estimated = est.schedule_seconds if est is not None else None
        basis = device_s if device_s else t.median_seconds
        measured[fspec.name] = MeasuredSection(
            device=device, platform=platform, median_seconds=t.median_seconds, min_seconds=t.min_seconds,
            max_seconds=t.max_seconds, spread=t.spread, steps=t.samples, warmup=t.warmup,
            device_seconds=device_s,
            estimated_seconds=estimated, estimate_chip=est.chip if est is not None else None,
            error=None if estimated is None or basis <= 0 else (estimated - basis) / basis,
            instructions=tuple(MeasuredInstruction(name, s, n, est_top.get(name), name in floors)
                               for name, (s, n) in ranked),
            instructions_reason=why, notes=tuple(notes), estimate_lower_bound=bool(est and est.lower_bound))
    return dataclasses.replace(report, functions=tuple(
        dataclasses.replace(f, measured=measured[f.name]) if f.name in measured else f for f in report.functions))
