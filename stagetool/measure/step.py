"""``cost --measure`` / ``report --measure``: run a staged step for real on the attached devices, on
random arrays of the spec's shapes, dtypes and shardings, and time it (MEASURED, wall clock).

Inputs: floating leaves ``normal(0, 1) × 0.02`` in their dtype; integer leaves uniform in
``[0, int_high)`` (so that ids index real rows); booleans random; PRNG keys from a seed. Donated inputs
are made anew (same seed) before each step, outside the timing, after the previous step's outputs are
dropped: one set of inputs and one step's outputs alive at a time. Each step is one call of the compiled executable
ended by ``block_until_ready``; the figure is the median over ``steps`` after ``warmup`` untimed steps.
"""

from __future__ import annotations

import time
from typing import Any

from stagetool.measure.timing import Timing, summarize


LARGE_LEAF_BYTES = 1 << 30
"""A floating leaf larger than this (a KV cache or page pool of several GiB) is filled with 0.02 rather than
drawn: a draw makes f32 normals and their random bits first, several times the leaf's size on the device,
and would not fit where the leaf itself does."""


def _nbytes(x: Any) -> int:
    import numpy as np

    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def concrete_inputs(tree: Any, seed: int, int_high: int = 1024, *, random_integers: bool = True) -> Any:
    """Arrays on the devices for the abstract leaves (``jax.ShapeDtypeStruct``) of ``tree``: random
    values of each leaf's dtype, put with its sharding; other leaves kept as they are.

    Floats are normal × 0.02 in the leaf's dtype (a floating leaf over :data:`LARGE_LEAF_BYTES`: 0.02), keys split from ``seed`` (leaf ``i`` draws from
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
            elif jnp.issubdtype(x.dtype, jnp.floating) and _nbytes(x) > LARGE_LEAF_BYTES:
                a = jnp.full(x.shape, 0.02, x.dtype)  # drawing it would take several times its size
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


def _leaf_bytes(tree: Any) -> int:
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is None or dtype is None:
            continue
        try:
            size = np.dtype(dtype).itemsize
        except TypeError:  # a PRNG key type
            size = 8
        total += int(np.prod(shape, dtype=np.int64)) * size
    return total


class StepRunner:
    """One staged function made runnable: its compiled executable and concrete inputs.

    Inputs that the step does not donate are made once and reused by every step (a step does not change
    them). Donated inputs are consumed by a step, so each step gets its own: made again from the same
    seed (the same values) just before the step, outside the timing, after the previous step's outputs
    are dropped, so that at most one set of them and one step's outputs are alive at a time and a program
    that fits the device once can be measured (a paged decode whose donated page pool is half the chip).

    Args:
      staged: :class:`stagetool.staging.stages.Staged` (compiled for the attached devices).
      inputs: its :class:`stagetool.inputs.records.AbstractInputs`.
      int_high: integer inputs are drawn from ``[0, int_high)``.
    """

    def __init__(self, staged: Any, inputs: Any, *, int_high: int = 1024):
        import jax

        self._jax = jax
        self._int_high = int_high
        donated_args = set(inputs.donate_argnums)
        donated_kw = set(inputs.donate_argnames)
        self._abstract_args = inputs.args
        self._donated_args = tuple(i for i in range(len(inputs.args)) if i in donated_args)
        self._donated_kw = tuple(k for k in inputs.kwargs if k in donated_kw and k not in inputs.static_argnames)
        statics = {k: v for k, v in inputs.kwargs.items() if k in inputs.static_argnames}
        self._abstract_kwargs = {k: v for k, v in inputs.kwargs.items() if k not in inputs.static_argnames}
        # the inputs nobody donates, made once; donated ones are made per step (fresh())
        self.args = tuple(None if i in self._donated_args else concrete_inputs(a, 0 + self._offset(i), int_high)
                          for i, a in enumerate(inputs.args))
        self.kwargs = {k: (None if k in self._donated_kw else concrete_inputs(v, 1000 + self._offset(k), int_high))
                       for k, v in self._abstract_kwargs.items()}
        self.donated_bytes = _leaf_bytes([inputs.args[i] for i in self._donated_args]) + _leaf_bytes(
            [self._abstract_kwargs[k] for k in self._donated_kw])
        self.call = staged.compiled
        self._fallback = lambda *a, **k: staged.jitted(*a, **k, **statics)

    def _offset(self, where: int | str) -> int:
        """The seed offset of argument ``where``: its first leaf's index in the flattened inputs, so that
        each leaf draws from the seed it drew from when all inputs were made at once."""
        flat = self._jax.tree.leaves
        if isinstance(where, int):
            return sum(len(flat(a)) for a in self._abstract_args[:where])
        keys = list(self._abstract_kwargs)
        return sum(len(flat(self._abstract_kwargs[k])) for k in keys[:keys.index(where)])

    def fresh(self) -> tuple[tuple, dict]:
        """The inputs of one step, ready on the device: the shared ones, and the donated ones made anew
        (a step consumes them)."""
        a = tuple(concrete_inputs(self._abstract_args[i], self._offset(i), self._int_high)
                  if i in self._donated_args else x for i, x in enumerate(self.args))
        k = {n: (concrete_inputs(self._abstract_kwargs[n], 1000 + self._offset(n), self._int_high)
                 if n in self._donated_kw else v) for n, v in self.kwargs.items()}
        self._jax.block_until_ready((a, k))
        return a, k

    def step(self, a: tuple, k: dict) -> None:
        """One step on inputs ``a``, ``k``, blocked on; its outputs are dropped (nothing kept alive)."""
        try:
            out = self.call(*a, **k)
        except TypeError:  # a Compiled that wants the static arguments too: the jitted function
            self.call = self._fallback
            out = self.call(*a, **k)
        self._jax.block_until_ready(out)
        del out

    def time(self, *, steps: int = 10, warmup: int = 2) -> Timing:
        """Median seconds of one step (donated inputs made before each, outside the timing)."""
        for _ in range(max(warmup, 1)):
            self.step(*self.fresh())
        samples = []
        for _ in range(steps):
            a, k = self.fresh()
            t0 = time.perf_counter()
            self.step(a, k)
            samples.append(time.perf_counter() - t0)
            del a, k
        return summarize(samples, inner=1, warmup=max(warmup, 1))

    def _sets_that_fit(self, wanted: int) -> int:
        """How many sets of donated inputs can be alive at once, at most ``wanted``: all of them when
        nothing is donated, else as many as half the device's free memory holds (all where the backend
        gives no memory figures: the CPU)."""
        if not self.donated_bytes:
            return wanted
        try:
            stats = self._jax.devices()[0].memory_stats() or {}
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0) if stats.get("bytes_limit") else 0
        except Exception:  # noqa: BLE001 - a backend without memory stats
            free = 0
        return max(1, min(wanted, int(0.5 * free // self.donated_bytes))) if free > 0 else wanted

    def time_pipelined(self, steps: int = 10) -> float | None:
        """Seconds per step of ``steps`` calls issued back to back (inputs made beforehand) and blocked on
        once: the host's dispatch overlaps the device's work, as in a training loop. Where the donated
        inputs of that many steps do not fit in half the device's free memory, as many steps as do (at
        least 2); None where not even 2 fit."""
        self.step(*self.fresh())
        n = self._sets_that_fit(steps)
        if n < 2:
            return None
        fresh = [self.fresh() for _ in range(n)]
        t0 = time.perf_counter()
        out = None
        for a, k in fresh:
            out = self.call(*a, **k)
        self._jax.block_until_ready(out)
        seconds = (time.perf_counter() - t0) / n
        del out, fresh
        return seconds

    def profile(self, steps: int = 3) -> tuple[dict[str, tuple[float, int]], str | None, float | None]:
        """Per-instruction device seconds per step, why they are missing, and the device seconds of one
        step (:func:`stagetool.measure.trace.profile_steps`). The donated inputs of the profiled steps are
        made beforehand where they fit together; otherwise each step is profiled alone and the figures
        averaged (no input is made inside a trace)."""
        from stagetool.measure.trace import profile_steps

        if self._sets_that_fit(steps) >= steps:
            fresh = [self.fresh() for _ in range(steps)]
            it = iter(fresh)
            return profile_steps(lambda: self.step(*next(it)), steps)
        ops: dict[str, list[float]] = {}
        device, why = [], None
        for _ in range(steps):
            one = [self.fresh()]
            o, why, d = profile_steps(lambda: self.step(*one.pop()), 1)
            for name, (s, n) in o.items():
                acc = ops.setdefault(name, [0.0, 0])
                acc[0] += s / steps
                acc[1] += n
            if d is not None:
                device.append(d)
        return ({k: (v[0], round(v[1] / steps)) for k, v in sorted(ops.items())}, None if ops else why,
                sum(device) / len(device) if device else None)


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
        try:
            runner = StepRunner(staged, inputs, int_high=int_high)
            t = runner.time(steps=steps, warmup=warmup)
            ops, why, device_s = runner.profile(min(3, steps))
        except Exception as e:
            from stagetool.core.errors import out_of_memory

            oom = out_of_memory(e, who=f"--measure: {fspec.name}",
                                inputs_bytes=_leaf_bytes((inputs.args, inputs.kwargs)),
                                hint="the step and one set of its inputs must fit the device together: measure a "
                                     "smaller batch or sequence (--set), or on a device with more memory")
            if oom is None:
                raise
            runner = None  # free what it holds before the message
            raise oom from None
        cost = by_name[fspec.name].cost
        est = cost.step_time if cost is not None else None
        est_top = {i.name: i.total_seconds for i in est.top} if est is not None else {}
        floors = {u.name for u in est.uncounted} if est is not None else set()  # timed at a floor: at least
        ranked = sorted(ops.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]
        notes = [f"inputs: random values of the spec's shapes, dtypes and shardings (floats normal × 0.02, "
                 f"integers in [0, {int_high})); donated inputs made anew before each step, outside the timing, "
                 "with no earlier step's inputs or outputs alive"]
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
