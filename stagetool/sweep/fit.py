"""``stagetool fit``: the largest batch that fits, per setting of the other knobs, and what-if
changes on an out-of-memory — each answer a real compile on the target (issue 32).

The spec names its batch as a ``${batch}``-style placeholder (``--batch NAME``); the other knobs are
the sweep's axes (``--set name=a,b``, ``--mesh``, ``--topology``). Each setting of the knobs is
searched by :func:`stagetool.analysis.fit.search_largest` (galloping, then bisecting), each compile
one sweep configuration staged in a process of its own (:func:`stagetool.sweep.run.run_isolated`,
through the facts cache when one is given), ``--jobs`` compiles at a time (settings at once, and
several batches of a setting per round when there are fewer settings than jobs). Everything the
user can get wrong is checked by :func:`stagetool.sweep.driver.plan_sweep` before any compile.

Fails closed: a setting whose search could not decide (a compile failed for another reason than
memory, timed out, or the cap on compiles was reached), no batch fitting in any setting, or a knob
whose values compile the same program makes the document's ``decided`` false (the CLI exits 1). A
setting where not even ``--multiple`` fits, beside others that do, is a row of its own (``none fits``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from stagetool.analysis.fit import (
    DOES_NOT_FIT,
    FITS,
    UNDECIDED,
    CompileCap,
    LeafShardingChange,
    Probe,
    ReplicatedInput,
    Search,
    same_program,
    search_largest,
    shard_largest_replicated,
)
from stagetool.core import codec
from stagetool.core.errors import UsageError
from stagetool.plan.options import Options
from stagetool.sweep.driver import (
    SweepOptions,
    SweepPlan,
    payload,
    plan_sweep,
    timeout_s,
)
from stagetool.sweep.grid import Config, config_id

FIT_SCHEMA_VERSION = 1
"""1: the first fit document (``kind: fit``)."""

Runner = Callable[[dict, "float | None"], dict]
"""Stages one sweep payload and returns its row (default :func:`stagetool.sweep.run.run_isolated`)."""


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """What to search and how; mirrors ``stagetool fit``'s options.

    Attributes:
      options: what every compile stages, as for any command (:class:`~stagetool.plan.options.Options`:
        target, spec, function, platform, slices, GPU target config, chip, device memory, the facts
        cache folder, the files ``-o`` writes, ...); a setting's mesh, topology and knob values replace
        its ``mesh``, ``topology`` and ``variables`` (:class:`~stagetool.sweep.driver.SweepOptions`).
      mesh, topology: as for ``stagetool sweep`` (lists: each value a setting, a knob).
      set: ``NAME=V1,V2`` knobs other than the batch (each value a setting to search).
      batch: the name of the spec's batch placeholder (``${batch}``).
      multiple: every batch compiled is a multiple of this (the data axes' size, so the batch divides).
      start: the first batch compiled (default ``multiple``).
      max_batch: no batch above this is compiled.
      max_compiles: the cap on compiles of the whole command; reaching it leaves the searches still
        running undecided.
      tokens_per_example: tokens in one example (the sequence length), for tokens per second at the
        largest batch from the step-time estimate (None: not shown).
      jobs: compiles at a time, a process each: settings searched at once and, with fewer settings
        than jobs, ``jobs // settings`` batches of one setting per round (:func:`search_largest`'s width).
      timeout: seconds one compile's process may run (None: no limit); past it, that setting is undecided.
    """

    options: Options = Options()
    topology: str | None = None
    mesh: str | None = None
    set: tuple[str, ...] = ()
    batch: str = "batch"
    multiple: int = 1
    start: int | None = None
    max_batch: int = 4096
    max_compiles: int = 64
    tokens_per_example: int | None = None
    jobs: int = 1
    timeout: float | None = None


def _check(options: FitOptions) -> None:
    if options.multiple < 1:
        raise UsageError(f"--multiple {options.multiple}: give a positive batch multiple (the data axes' size)")
    if options.max_batch < options.multiple:
        raise UsageError(f"--max-batch {options.max_batch} is below --multiple {options.multiple}")
    if options.start is not None and not options.multiple <= options.start <= options.max_batch:
        raise UsageError(f"--start {options.start}: give a batch between --multiple {options.multiple} and "
                         f"--max-batch {options.max_batch}")
    if options.max_compiles < 1:
        raise UsageError(f"--max-compiles {options.max_compiles}: give at least 1")
    from stagetool.spec.variables import parse_set_options

    if options.batch in parse_set_options(list(options.set)):
        raise UsageError(f"--set {options.batch}=...: {options.batch} is the batch the search finds (--batch "
                         f"{options.batch})", hint="leave it out of --set; --start, --multiple and --max-batch "
                                                  "bound it")


def plan_fit(options: FitOptions, batch_values: tuple[int, ...]) -> SweepPlan:
    """The sweep plan of the knobs with the batch placeholder filled by ``batch_values`` (checked with
    the first), every option checked before any compile.

    Raises:
      UsageError / SpecError / TargetError: a bad option, spec or target (exit 2).
    """
    _check(options)
    batch = f"{options.batch}=" + ",".join(str(b) for b in batch_values)
    return plan_sweep(SweepOptions(options.options, mesh=options.mesh, set=(*options.set, batch),
                                   topology=options.topology, jobs=options.jobs, timeout=options.timeout))


def with_batch(config: Config, name: str, batch: int) -> Config:
    """``config`` with the batch placeholder ``name`` set to ``batch`` (its id made anew)."""
    var = tuple((n, str(batch) if n == name else v) for n, v in config.variables)
    return dataclasses.replace(config, id=config_id(config.mesh, config.topology, var), variables=var)


def _replicated(row: dict) -> dict:
    """A row's replicated input leaves and mesh as :class:`Probe` fields."""
    leaves = codec.decode(tuple[ReplicatedInput, ...], row.get("replicated_inputs") or [], "replicated_inputs")
    return {"replicated_inputs": leaves, "mesh_axes": tuple((a, n) for a, n in row.get("mesh") or ())}


def probe_of_row(batch: int, row: dict) -> Probe:
    """A sweep row as one probe of the search: fits (staged, peak within the capacity), does not
    fit (XLA refused it for memory, or its peak is over the capacity), else undecided with why."""
    peak, cap = row["peak_bytes_per_device"], row["capacity_bytes_per_device"]
    program = row.get("program_sha256")
    if row["status"] == "does not fit":
        return Probe(batch, DOES_NOT_FIT, peak, cap, program=program, **_replicated(row))
    if row["status"] == "error":
        err = row["error"]
        return Probe(batch, UNDECIDED, reason=f"batch {batch}: {err['stage']}: {err['message']}")
    if row["fits"] is None:
        return Probe(batch, UNDECIDED, peak, cap, reason=f"batch {batch}: the capacity is unknown, so whether it fits "
                                                         "is not known: give --device-memory 16GiB or --chip NAME",
                     program=program)
    st = row.get("step_time")
    step = (st["chip"], st["overlapped_seconds"], st["schedule_seconds"], st["serial_seconds"]) if st else None
    return Probe(batch, FITS if row["fits"] else DOES_NOT_FIT, peak, cap, program=program, step_time=step,
                 step_time_lower_bound=bool(st and st.get("lower_bound")), **_replicated(row))


class _Compiles:
    """The command's compile counter and its cap (thread-safe)."""

    def __init__(self, cap: int):
        self.cap, self.count = cap, 0
        self._lock = threading.Lock()

    def take(self) -> None:
        with self._lock:
            if self.count >= self.cap:
                raise CompileCap(f"the cap of {self.cap} compiles (--max-compiles) was reached before this search "
                                 "decided; raise --max-compiles, narrow --max-batch or give fewer knob values")
            self.count += 1


def _runner(plan: SweepPlan, options: FitOptions, runner: Runner | None, compiles: _Compiles,
            on_probe: Callable[[dict, Probe], None] | None) -> Callable[..., Probe]:
    if runner is None:
        from stagetool.sweep.run import run_isolated as runner
    limit = timeout_s(options.timeout)
    common = {**plan.common, "program_digest": True}  # the facts cache travels in the options

    def run(config: Config, batch: int, leaf_shardings: tuple[LeafShardingChange, ...] = ()) -> Probe:
        compiles.take()
        p = payload(plan, with_batch(config, options.batch, batch))
        if leaf_shardings:  # those input leaves' PartitionSpecs replaced (run_config: Options.leaf_shardings)
            p["leaf_shardings"] = [[c.leaf.path, list(c.dims)] for c in leaf_shardings]
        row = runner({**p, "common": common}, limit)
        probe = probe_of_row(batch, row)
        if on_probe is not None:
            from stagetool.core.sharding import format_dims

            shards = {c.leaf.path: format_dims(c.dims) for c in leaf_shardings}
            on_probe({**config.values(), **shards}, probe)
        return probe

    return run


def _knob_values(config: Config, name: str) -> dict:
    return {k: v for k, v in config.values().items() if k != name}


def run_fit(options: FitOptions, *, runner: Runner | None = None,
            on_probe: Callable[[dict, Probe], None] | None = None) -> dict:
    """Search the largest batch that fits per setting of the knobs and return the fit document
    (:func:`fit_document`).

    ``runner(payload, timeout_s) -> row`` stages one configuration (default: a process of its own);
    ``on_probe(knob values, probe)`` is called after each compile (for progress).

    Raises:
      UsageError / SpecError / TargetError: a bad option, spec or target, before any compile.
    """
    import concurrent.futures

    start = options.start or options.multiple
    plan = plan_fit(options, (start,))
    compiles = _Compiles(options.max_compiles)
    run = _runner(plan, options, runner, compiles, on_probe)

    # --jobs processes in all: settings at once, and within each the batches of a round when there
    # are fewer settings than jobs
    width = max(1, options.jobs // max(len(plan.configs), 1))

    def one(config: Config) -> Search:
        def probe(b: int) -> Probe:
            return run(config, b)

        def many(batches: list[int]) -> list[Probe]:
            def guarded(b: int) -> Probe:
                try:
                    return probe(b)
                except CompileCap as e:
                    return Probe(b, UNDECIDED, reason=str(e))

            if len(batches) == 1:
                return [guarded(batches[0])]
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(batches)) as inner:
                return list(inner.map(guarded, batches))

        return search_largest(probe, start=start, multiple=options.multiple, max_batch=options.max_batch,
                              width=width, probe_many=many)

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(options.jobs, max(len(plan.configs), 1))) as pool:
        searches = list(pool.map(one, plan.configs))
    return fit_document(plan, options, list(zip(plan.configs, searches)), compiles.count)


def unchanged_knobs(plan: SweepPlan, searches: list[tuple[Config, Search]], batch: str) -> list[str]:
    """One sentence per knob value that compiled the same program as another value of that knob
    (the other knobs alike) at every batch both compiled: the function does not read it."""
    found = []
    for name, values in plan.grid.axes:
        if name == batch or len(values) < 2:
            continue
        groups: dict[str, list[tuple[Config, Search]]] = {}
        for c, s in searches:
            rest = {k: v for k, v in c.values().items() if k not in (name, batch)}
            groups.setdefault(repr(sorted(rest.items(), key=lambda kv: kv[0])), []).append((c, s))
        for group in groups.values():
            for i, (ca, sa) in enumerate(group):
                for cb, sb in group[i + 1:]:
                    if same_program(sa, sb):
                        va, vb = ca.values()[name], cb.values()[name]
                        found.append(f"knob {name}: {name}={va} and {name}={vb} compile the same program (the "
                                     f"same lowered StableHLO at every batch both compiled): the function does not "
                                     f"read {name}, or reads it where it changes nothing")
    return found


def _speed(at: Probe | None, batch: int | None, tokens_per_example: int | None) -> dict:
    """The step-time estimate at the largest batch (seconds per step, low/schedule/high, on its chip)
    and, with ``tokens_per_example``, tokens per second at the schedule figure (high to low from the
    range): estimates, from the compile's cost section."""
    if at is None or at.step_time is None:
        return {"step_time": None, "tokens_per_second": None}
    chip, low, mid, high = at.step_time
    step = {"chip": chip, "overlapped_seconds": low, "schedule_seconds": mid, "serial_seconds": high,
            "label": "estimate", "lower_bound": at.step_time_lower_bound}
    tps = None
    if tokens_per_example and batch and mid > 0:
        tokens = batch * tokens_per_example
        # a step that takes at least its figure gives at most these tokens per second
        tps = {"schedule": tokens / mid, "high": tokens / low if low > 0 else None, "low": tokens / high,
               "label": "estimate", "upper_bound": at.step_time_lower_bound}
    return {"step_time": step, "tokens_per_second": tps}


def _setting(config: Config, search: Search, batch: str, tokens_per_example: int | None = None) -> dict:
    at = search.at(search.largest)
    peak = at.peak_bytes if at is not None else None
    cap = at.capacity_bytes if at is not None else None
    refused = search.at(search.smallest_refused)
    return {"id": config_id(config.mesh, config.topology, tuple(kv for kv in config.variables if kv[0] != batch)),
            "values": _knob_values(config, batch), "status": search.status, "reason": search.reason,
            "largest_batch": search.largest, "peak_bytes_per_device": peak, "capacity_bytes_per_device": cap,
            "headroom_bytes": cap - peak if peak is not None and cap is not None else None,
            "smallest_refused_batch": search.smallest_refused,
            "refused_peak_bytes_per_device": refused.peak_bytes if refused is not None else None,
            **_speed(at, search.largest, tokens_per_example),
            "compiles": len([p for p in search.probes if p.reason is None or "--max-compiles" not in p.reason]),
            "probes": [{"batch": p.batch, "outcome": p.outcome, "peak_bytes_per_device": p.peak_bytes,
                        **({"reason": p.reason} if p.reason else {})} for p in search.probes]}


def set_line(values: dict, batch_name: str, batch: int) -> str:
    """The ``--set``/``--mesh``/``--topology`` options that stage one setting: ``--set batch=48 --set remat=dots``."""
    from stagetool.sweep.render import _value

    parts = [f"--set {batch_name}={batch}"]
    for k, v in values.items():
        parts.append(f"--{k} {_value(v)}" if k in ("mesh", "topology") else f"--set {k}={_value(v)}")
    return " ".join(parts)


def best_setting(fitting: list[dict]) -> tuple[dict, str]:
    """The best of the settings that fit, and by what: the most examples per second at the largest
    batch (``largest_batch / step_time.schedule_seconds``, an estimate) when every one has a step-time
    estimate on one chip, else the largest batch; ties: the most headroom, then grid order. A step time
    that is a lower bound gives at most its examples per second: such a setting never ranks above one
    whose figure is complete (as ``sweep --rank-by step_time``)."""
    chips = {st["step_time"]["chip"] if st["step_time"] else None for st in fitting}
    if None not in chips and len(chips) == 1:
        return max(fitting, key=lambda st: (not st["step_time"].get("lower_bound"),
                                            st["largest_batch"] / st["step_time"]["schedule_seconds"],
                                            st["headroom_bytes"] or 0)), "examples per second (estimate)"
    return max(fitting, key=lambda st: (st["largest_batch"], st["headroom_bytes"] or 0)), "largest batch"


def fit_document(plan: SweepPlan, options: FitOptions, searches: list[tuple[Config, Search]], compiles: int) -> dict:
    """The fit document: the header, one entry per knob setting (largest batch, its peak, capacity,
    headroom, the smallest batch refused, every compile), the best setting and its ``--set`` line,
    the problems that leave it undecided, and the compile count."""
    settings = [_setting(c, s, options.batch, options.tokens_per_example) for c, s in searches]
    fitting = [st for st in settings if st["largest_batch"] is not None]
    problems = [f"{_label(st['values'])}: {st['reason'] or st['status']}" for st in settings
                if st["status"] == UNDECIDED]
    if not fitting and not problems:
        problems.append(f"every batch compiled was refused, down to {options.batch}={options.multiple}, in every "
                        "setting: nothing fits (a smaller --multiple, another knob value or a larger mesh may)")
    problems += unchanged_knobs(plan, searches, options.batch)
    best = None
    if fitting:
        top, by = best_setting(fitting)
        best = {"id": top["id"], "values": top["values"], "batch": top["largest_batch"], "by": by,
                "set_line": set_line(top["values"], options.batch, top["largest_batch"])}
    header = {k: plan.header[k] for k in ("stagetool_version", "jax_version", "jaxlib_version", "target", "function",
                                          "spec", "spec_sha256", "options")}
    axes = [[name, list(values)] for name, values in plan.grid.axes if name != options.batch]
    return {"schema_version": FIT_SCHEMA_VERSION, "kind": "fit", **header, "axes": axes,
            "batch": {"name": options.batch, "multiple": options.multiple, "start": options.start or options.multiple,
                      "max": options.max_batch},
            "max_compiles": options.max_compiles, "compiles": compiles, "settings": settings, "best": best,
            "problems": problems, "decided": not problems}


def _label(values: dict) -> str:
    from stagetool.sweep.render import _value

    return ",".join(f"{k}={_value(v)}" for k, v in values.items()) or "the spec's setting"


WHAT_IF_SCHEMA_VERSION = 1
"""1: the first what-if document (``kind: what-if``)."""


def _dims_yaml(dims: tuple) -> str:
    """A PartitionSpec as the spec writes it: ``[null, fsdp]``."""
    return "[" + ", ".join("null" if d is None else d if isinstance(d, str) else "[" + ", ".join(d) + "]"
                           for d in dims) + "]"


def leaf_change_text(change: LeafShardingChange) -> tuple[str, str]:
    """``(change, spec line)`` of sharding one replicated leaf: what the change is (the leaf's path,
    shape, bytes per device, the mesh axis and dimension) and what the user writes in the spec for
    it — the leaf's own text where the spec writes the leaf (``'f32[8192,8192] @ [fsdp, null]'``
    at its line), else a rule ahead of the argument's others (``['^state/w$', [fsdp, null]]``)."""
    import re

    from stagetool.core.sharding import format_dims
    from stagetool.core.units import format_bytes, shape_str

    leaf = change.leaf
    what = (f"shard {leaf.path} over mesh axis {change.axis} ({change.axis_size} devices) on dimension "
            f"{change.dimension}: {shape_str(leaf.dtype, leaf.shape)} replicated, {format_bytes(leaf.bytes_per_device)}"
            f" per device → {format_dims(change.dims)}, {format_bytes(leaf.bytes_per_device - change.saved_bytes)}")
    where = f" ({leaf.source})" if leaf.source else ""
    if leaf.sharding_source in (None, "spec"):
        line = f"'{shape_str(leaf.dtype, leaf.shape)} @ {_dims_yaml(change.dims)}'{where}"
    else:
        line = f"rules: ['^{re.escape(leaf.path)}$', {_dims_yaml(change.dims)}] ahead of the others{where}"
    return what, line


def _tried(what: str, line: str, p: Probe) -> dict:
    return {"change": what, "set_line": line, "outcome": p.outcome, "peak_bytes_per_device": p.peak_bytes,
            "capacity_bytes_per_device": p.capacity_bytes,
            "headroom_bytes": (p.capacity_bytes - p.peak_bytes
                               if p.peak_bytes is not None and p.capacity_bytes is not None else None),
            "reason": p.reason}


def what_if(options: FitOptions, batch: int, *, runner: Runner | None = None,
            on_probe: Callable[[dict, Probe], None] | None = None) -> dict:
    """What-if on an out-of-memory: compile the setting as given (the batch ``batch``, the first
    value of every knob) and, when it does not fit, each single change a person would try first —
    half the batch (rounded down to ``options.multiple``), for every knob with more than one
    value its next value (the next remat or offload policy, the next mesh), and the largest input
    leaf the first compile holds replicated sharded over a free mesh axis
    (:func:`stagetool.analysis.fit.shard_largest_replicated`: its largest dimension that axis's
    size divides; the compile takes it as a :class:`stagetool.spec.model.LeafSharding`) — and
    return the what-if document: every change tried with its outcome and peak (a leaf's change with
    ``spec_line``, what to write in the spec; null for the others), ``fits`` listing only those that were compiled and
    fit, ``not_tried`` the change that could not be made and why. Nothing is suggested that was not
    compiled. ``decided`` is false (the CLI exits 1) when the setting as given could not be
    compiled, or does not fit and no change tried fits, or a change's compile failed otherwise.

    Raises:
      UsageError / SpecError / TargetError: a bad option, spec or target, before any compile.
    """
    import concurrent.futures

    if not options.multiple <= batch <= options.max_batch:
        raise UsageError(f"--set {options.batch}={batch}: give a batch between --multiple {options.multiple} and "
                         f"--max-batch {options.max_batch}")
    plan = plan_fit(options, (batch,))
    compiles = _Compiles(options.max_compiles)
    run = _runner(plan, options, runner, compiles, on_probe)
    knobs = [(name, values) for name, values in plan.grid.axes if name != options.batch]

    def config_with(**changed: str) -> Config:
        chosen = {name: changed.get(name, values[0]) for name, values in knobs}
        return next(c for c in plan.grid.configs
                    if c.mesh == chosen.get("mesh", c.mesh) and c.topology == chosen.get("topology", c.topology)
                    and all(dict(c.variables)[n] == v for n, v in chosen.items() if n not in ("mesh", "topology")))

    current = config_with()
    # (change, options or spec line, config, batch, leaf shardings)
    changes: list[tuple[str, str | None, Config, int, tuple[LeafShardingChange, ...]]] = []
    half = (batch // 2) // options.multiple * options.multiple
    if half >= options.multiple:
        changes.append((f"half the batch: {options.batch} {batch} → {half}", None, current, half, ()))
    for name, values in knobs:
        if len(values) > 1:
            changes.append((f"{name}: {values[0]} → {values[1]}", None, config_with(**{name: values[1]}), batch, ()))
    first = run(current, batch)
    tried: list[dict] = []
    problems: list[str] = []
    not_tried: list[str] = []
    if first.outcome == UNDECIDED:
        problems.append(first.reason or "the setting as given could not be compiled")
    elif first.outcome == DOES_NOT_FIT:
        leaf, why_not = shard_largest_replicated(first.replicated_inputs, first.mesh_axes)
        if leaf is not None:
            what, line = leaf_change_text(leaf)
            changes.append((what, line, current, batch, (leaf,)))
        else:
            not_tried.append(f"sharding the largest replicated leaf over a free mesh axis: {why_not}")

        def attempt(change: tuple[str, str | None, Config, int, tuple[LeafShardingChange, ...]]) -> dict:
            what, line, config, b, leaves = change
            try:
                p = run(config, b, leaves)
            except CompileCap as e:
                p = Probe(b, UNDECIDED, reason=str(e))
            opts = set_line(_knob_values(config, options.batch), options.batch, b)
            return {**_tried(what, opts, p), "spec_line": line}

        with concurrent.futures.ThreadPoolExecutor(max_workers=options.jobs) as pool:
            tried = list(pool.map(attempt, changes))
        if not changes:
            problems.append("no single change to try: the batch is already --multiple, no knob has a second value "
                            "and no input leaf can be sharded over a free mesh axis")
        problems += [t["reason"] for t in tried if t["outcome"] == UNDECIDED and t["reason"]]
        if changes and not any(t["outcome"] == FITS for t in tried):
            problems.append("none of the single changes tried fits: try two at once (fit searches the batch per "
                            "knob setting), or another mesh")
    values = _knob_values(current, options.batch)
    header = {k: plan.header[k] for k in ("stagetool_version", "jax_version", "jaxlib_version", "target", "function",
                                          "spec", "spec_sha256", "options")}
    return {"schema_version": WHAT_IF_SCHEMA_VERSION, "kind": "what-if", **header,
            "from": {"values": values, "batch": batch, "set_line": set_line(values, options.batch, batch),
                     "outcome": first.outcome, "peak_bytes_per_device": first.peak_bytes,
                     "capacity_bytes_per_device": first.capacity_bytes},
            "tried": tried, "fits": [t["change"] for t in tried if t["outcome"] == FITS],
            "not_tried": not_tried,
            "max_compiles": options.max_compiles, "compiles": compiles.count, "problems": problems,
            "decided": not problems}
