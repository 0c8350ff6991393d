"""The report: plain, frozen, JSON-serialisable records of what stagetool found.

Nothing here imports JAX or Rich. The records of each section come from ``stagetool.analysis``
(:class:`LeafReport`, :class:`CostSection`, :class:`MemorySection`, :class:`CollectivesSection`);
this module composes them into one document per command; renderers (``text``, ``json``,
``markdown``) present them. A section that was not computed is None, and renderers skip it.

The JSON form (:func:`to_json`) is versioned by :data:`SCHEMA_VERSION` and documented in docs/json-schema.md.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import TYPE_CHECKING, Any

from stagetool.analysis.against import AgainstSection
from stagetool.analysis.figures import Figures
from stagetool.analysis.shardings import LeafReport
from stagetool.core.sharding import Sharding

if TYPE_CHECKING:  # the modules roll-up and why's answer: imported by the runs that make them
    from stagetool.analysis.modules import ModulesSection
    from stagetool.analysis.sections import CollectivesSection, CostSection, MemorySection
    from stagetool.analysis.why import WhyAnswer
    from stagetool.report.display import Shown

SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class MeshReport:
    """The mesh a function was staged on.

    Attributes:
      axes: ``(name, size)`` pairs in mesh order.
      axis_types: ``auto`` or ``explicit``.
      platform: ``cpu`` | ``gpu`` | ``tpu``.
      device_kind: e.g. ``cpu``, ``NVIDIA H100 80GB HBM3``, ``TPU v5 lite``.
      device_count: devices in the mesh.
      process_count: processes (hosts) the mesh spans (simulated with ``--processes``).
      topology: compile-only TPU topology or GPU target name, or None.
      slices: TPU slices joined over DCN (``--slices``); 1 for one slice (and every other backend).
      target_from: where the compile-only target was named (``--topology``, the spec's
        ``file:line:col``, ``pyproject.toml [tool.stagetool]``), or None.
      named_as: the hardware as named there when the mesh sized it (``v5e`` for ``v5e:2x4``), or None.
    """

    axes: tuple[tuple[str, int], ...]
    axis_types: str
    platform: str
    device_kind: str
    device_count: int
    process_count: int
    topology: str | None = None
    slices: int = 1
    target_from: str | None = None
    named_as: str | None = None

    def target_line(self) -> str | None:
        """``v5e:2x4, compile-only, v5e named in pyproject.toml [tool.stagetool]`` (renderers' header), or None."""
        if not self.topology:
            return None
        named = (f", {self.named_as + ' ' if self.named_as else ''}named "
                 f"{'by' if (self.target_from or '').startswith('-') or (self.target_from or '').endswith('=') else 'in'}"
                 f" {self.target_from}" if self.target_from else "")
        return f"{self.topology}, compile-only{named}"


@dataclasses.dataclass(frozen=True)
class Answer:
    """Whose decisions a report's figures are: the one line at the top of every report (JSON ``answer``).

    Attributes:
      compiler: ``XLA:CPU``, ``XLA:TPU`` or ``XLA:GPU``.
      devices: ``simulated`` (CPU devices standing in for a mesh), ``compile-only`` (a TPU topology or
        GPU target, no hardware) or ``attached``.
      target: the compile-only target (``v5e:2x4``), or None.
      named_in: where that target was named (:attr:`MeshReport.target_from`), or None.
      statement: the line itself.
    """

    compiler: str
    devices: str
    target: str | None
    named_in: str | None
    statement: str


def answer_of(functions: tuple[FunctionReport, ...]) -> Answer | None:
    """The :class:`Answer` of a report's functions (their first's mesh: a run stages all on one), or None."""
    if not functions:
        return None
    m = functions[0].mesh
    compiler = {"cpu": "XLA:CPU", "tpu": "XLA:TPU", "gpu": "XLA:GPU"}.get(m.platform, m.platform)
    if m.topology:
        return Answer(compiler, "compile-only", m.topology, m.target_from,
                      f"{compiler}'s decisions for {m.target_line()}.")
    if m.platform != "cpu":
        return Answer(compiler, "attached", None, None,
                      f"{compiler}'s decisions on {m.device_count} attached {m.device_kind} device(s).")
    example = _against_example(m)
    kind = example.split(":")[0]
    statement = (f"XLA:CPU's decisions on {m.device_count} simulated CPU device{'s' if m.device_count != 1 else ''}, "
                 "not an accelerator's: shardings and which collectives run over which mesh axes are the SPMD "
                 "partitioner's on any backend; bytes, FLOPs, temporaries and loop placement are XLA:CPU's. "
                 f"--against {example} marks every difference from that compile; "
                 f"topology: {kind} in the spec (or [tool.stagetool] topology = \"{kind}\" in pyproject.toml) "
                 "names the hardware once, and every command answers for it, compile-only.")
    return Answer(compiler, "simulated", None, None, statement)


def _against_example(m: MeshReport) -> str:
    """A compile-only target the CPU mesh is a slice of (``v5e:2x4`` for ``--mesh 2x4``), for the statement."""
    from stagetool.core.errors import UsageError
    from stagetool.plan.target import sized_name

    sizes = tuple(s for _, s in m.axes)
    for kind in ("v5e", "h100"):
        try:
            return sized_name(kind, sizes)
        except UsageError:
            continue
    return "v5e:2x4"


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Wall-clock seconds of trace, lower and compile (None: the stage did not run)."""

    trace_s: float | None
    lower_s: float | None
    compile_s: float | None


@dataclasses.dataclass(frozen=True)
class ModuleText:
    """A module's text: ``stablehlo`` or ``hlo`` from the lowered stage, or the compiled ``hlo``."""

    stage: str
    dialect: str
    text: str


@dataclasses.dataclass(frozen=True)
class MeasuredInstruction:
    """One HLO instruction's MEASURED device time (JAX's profiler), beside stagetool's estimate of it.

    Attributes:
      name: the HLO instruction (``fusion.12``), as the compiled module names it.
      measured_seconds: device seconds per step, summed over its executions (the profiler's events).
      executions: events per step (loop trip counts included).
      estimated_seconds: stagetool's estimate of it over the step (seconds), or None where it is not among
        the estimate's top instructions.
      estimate_lower_bound: the estimate of it is a floor (work no model covers: it takes at least it).
    """

    name: str
    measured_seconds: float
    executions: int
    estimated_seconds: float | None = None
    estimate_lower_bound: bool = False


@dataclasses.dataclass(frozen=True)
class MeasuredSection:
    """``--measure``: the step run for real on the attached devices, beside the estimate.

    Attributes:
      device: ``1 × TPU v5 lite`` (count × ``device_kind``).
      platform: ``tpu``, ``gpu`` or ``cpu``.
      median_seconds / min_seconds / max_seconds: wall seconds of one step (MEASURED: ``block_until_ready``
        after each call; inputs random, of the spec's shapes, dtypes and shardings).
      spread: ``(max - min) / median``.
      steps / warmup: timed steps (the median is over them) and untimed steps before them.
      device_seconds: the device's own time of one step (the profiler's ``XLA Modules`` events; no host
        dispatch or synchronisation), or None where the trace has none (the CPU backend).
      estimated_seconds: stagetool's step-time estimate for this device (the schedule figure), or None.
      estimate_chip: the chip the estimate is for, or None.
      error: ``(estimated - measured) / measured``, measured being ``device_seconds`` where known (the
        estimate is of device time), else the wall-clock median; or None. Where the estimate is a lower bound
        (``estimate_lower_bound``) so is the error: the estimate's error is at least it.
      estimate_lower_bound: the estimate is a lower bound ("at least": work no model covers).
      instructions: the instructions taking the most measured device time, longest first.
      instructions_reason: why ``instructions`` is empty (no profiler trace), or None.
      notes: what the measurement assumes (the inputs drawn, the backend).
      label: always ``"measured"``.
    """

    device: str
    platform: str
    median_seconds: float
    min_seconds: float
    max_seconds: float
    spread: float
    steps: int
    warmup: int
    device_seconds: float | None
    estimated_seconds: float | None
    estimate_chip: str | None
    error: float | None
    instructions: tuple[MeasuredInstruction, ...] = ()
    instructions_reason: str | None = None
    notes: tuple[str, ...] = ()
    label: str = "measured"
    estimate_lower_bound: bool = False


@dataclasses.dataclass(frozen=True)
class FunctionReport:
    """Everything found about one function; a section is None when it was not asked for.

    Attributes:
      name: the function's name in the spec.
      target: ``file.py:func`` as written.
      mesh: the mesh.
      timings: stage timings in seconds.
      module: module text (``lower`` / ``compile`` commands).
      inputs / outputs: per-leaf shardings (``shardings``).
      cost: cost analysis (per device and whole program), see ``stagetool.analysis.cost``.
      memory: memory analysis (per device), see ``stagetool.analysis.memory``.
      collectives: collectives, see ``stagetool.hlo.collectives``.
      why: ``stagetool why``'s answer (:class:`stagetool.analysis.why.WhyAnswer`), or None.
      modules: the roll-up per module path and phase (:mod:`stagetool.analysis.modules`), or None.
      measured: ``--measure``'s step run for real (:class:`MeasuredSection`), or None.
      against: ``--against TARGET``: every difference from the target's compile
        (:class:`stagetool.analysis.against.AgainstSection`), or None (absent from the JSON then).
      notes: short remarks for the reader (e.g. what was simulated).
      error: why the function could not be staged (JAX's message and the user's frame), or None;
        when set, every section is None and the command exits 3 after reporting the others.
      error_traceback: the Python traceback of that failure, for ``--debug`` (not in the JSON).
      cached: the compiled facts came from stagetool's facts cache (the function was traced and
        lowered, not compiled; ``timings.compile_s`` is None).
      compiler_options: ``(name, value text)`` of the target's own jit's ``compiler_options``
        (``jax.jit(f, compiler_options=...)``), sorted by name; () when it has none.
      figures: the function's :class:`~stagetool.analysis.figures.Figures`, derived once from
        ``cost``, ``memory`` and ``collectives`` when the report is made (not an argument; not in the
        JSON, whose sections hold the same numbers): what the report's tables print, the snapshot
        stores and a sweep row holds.
    """

    name: str
    target: str
    mesh: MeshReport
    timings: StageTimes
    module: ModuleText | None = None
    inputs: tuple[LeafReport, ...] | None = None
    outputs: tuple[LeafReport, ...] | None = None
    cost: CostSection | None = None
    memory: MemorySection | None = None
    collectives: CollectivesSection | None = None
    why: WhyAnswer | None = None
    # in the JSON only when computed: reports without it read as before (the goldens, schema version 1)
    modules: ModulesSection | None = dataclasses.field(default=None, metadata={"json_omit_none": True})
    # ``--measure`` only (an attached accelerator): the step run for real beside the estimate
    measured: MeasuredSection | None = dataclasses.field(default=None, metadata={"json_omit_none": True})
    notes: tuple[str, ...] = ()
    error: str | None = None
    error_traceback: str | None = dataclasses.field(default=None, compare=False, metadata={"json_skip": True})
    cached: bool = False
    compiler_options: tuple[tuple[str, str], ...] = ()
    against: AgainstSection | None = dataclasses.field(default=None, metadata={"json_omit_none": True})
    figures: Figures = dataclasses.field(init=False, compare=False, repr=False, metadata={"json_skip": True})

    def __post_init__(self) -> None:
        object.__setattr__(self, "figures", Figures.of(self.cost, self.memory, self.collectives))


@dataclasses.dataclass(frozen=True)
class Report:
    """The whole report: one entry per function staged.

    Attributes:
      command: the stagetool command that made it (``shardings``, ``report``, ...).
      stagetool_version / jax_version / jaxlib_version: versions that produced it.
      functions: in spec order.
      config: ``(name, value)`` of the configuration that changes the compiled program
        (``jax_threefry_partitionable``, ``jax_default_matmul_precision``, ``XLA_FLAGS`` ...; see
        :mod:`stagetool.staging.config`).
    """

    command: str
    stagetool_version: str
    jax_version: str
    jaxlib_version: str
    functions: tuple[FunctionReport, ...]
    config: tuple[tuple[str, str], ...] = ()
    answer: Answer | None = None
    """Whose decisions the figures are (:func:`answer_of` the functions, when not given)."""

    def __post_init__(self) -> None:
        if self.answer is None:
            object.__setattr__(self, "answer", answer_of(self.functions))

    # ---- one function's sections, shown where they are displayed (stagetool.inspect, notebooks)

    def function(self, name: str | None = None) -> FunctionReport:
        """The function ``name``, or the one function of a report that holds one.

        Raises:
          KeyError: no function of that name, or no name given and the report holds several.
        """
        if name is None and len(self.functions) == 1:
            return self.functions[0]
        found = [f for f in self.functions if f.name == name]
        if not found:
            raise KeyError(f"the report holds {', '.join(f.name for f in self.functions) or 'no function'}; "
                           + ("name one" if name is None else f"not {name!r}"))
        return found[0]

    def holding(self, *functions: FunctionReport) -> Report:
        """A plain :class:`Report` of ``functions`` with this one's command, versions and config."""
        return Report(self.command, self.stagetool_version, self.jax_version, self.jaxlib_version, tuple(functions),
                      self.config)

    def _function_with(self, fields: tuple[str, ...]) -> FunctionReport:
        """The one function, holding at least the sections ``fields`` (a live report analyses only those)."""
        del fields
        return self.function()

    def _section(self, *fields: str) -> Shown:
        from stagetool.report.display import Shown, only

        f = self._function_with(fields)
        value = getattr(f, fields[0]) if len(fields) == 1 else tuple(getattr(f, x) for x in fields)
        return Shown(value, only(self, f, fields))

    @property
    def shardings(self) -> Shown:
        """``(inputs, outputs)``: each leaf's declared and compiled sharding (tuples of
        :class:`LeafReport`), displayed as the report's layouts."""
        return self._section("inputs", "outputs")

    @property
    def memory(self) -> Shown:
        """Per-device memory (:class:`~stagetool.analysis.sections.MemorySection`: XLA's
        ``memory_analysis()`` figures in bytes per device), displayed alone."""
        return self._section("memory")

    @property
    def collectives(self) -> Shown:
        """The compiled program's collectives (:class:`~stagetool.analysis.sections.CollectivesSection`),
        displayed alone."""
        return self._section("collectives")

    @property
    def cost(self) -> Shown:
        """XLA's cost analysis (:class:`~stagetool.analysis.sections.CostSection`: FLOPs and bytes per
        device and for the whole program, a roofline estimate with a chip), displayed alone."""
        return self._section("cost")

    @property
    def modules(self) -> Shown:
        """The roll-up per module path and phase (:class:`~stagetool.analysis.modules.ModulesSection`:
        FLOPs, bytes, collectives and bytes live at the peak, per device), displayed alone."""
        return self._section("modules")

    def why(self, leaf: str | None = None, *, line: str | None = None, collective: int | None = None) -> Shown:
        """``stagetool why``'s answer from this report's leaves and collectives (no staging again):
        one of ``leaf`` (a key path as the shardings list it, its last part, or a regular
        expression), ``line`` (``file.py:LINE``) or ``collective`` (its number, 1-based).

        Returns the :class:`~stagetool.analysis.why.WhyAnswer`, displayed alone.

        Raises:
          UsageError: none or several questions given, or a bad pattern.
        """
        from stagetool.analysis.why import answer_why
        from stagetool.plan.selectors import why_query
        from stagetool.report.display import Shown, only

        f = self._function_with(("inputs", "outputs", "collectives"))
        answer = answer_why(why_query(leaf, line, collective), f.inputs or (), f.outputs or (), f.collectives)
        return Shown(answer, only(self, f, (), why=answer))

    def __str__(self) -> str:
        from stagetool.report.display import text

        return text(self)

    def _repr_html_(self) -> str:
        from stagetool.report.display import notebook_html

        return notebook_html(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython's text form (a terminal, a notebook's ``text/plain``): the text report."""
        printer.text("Report(...)" if cycle else str(self))

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        """One notebook output: the HTML page (:meth:`_repr_html_`), the text report as its ``text/plain``."""
        from stagetool.report.display import mimebundle

        return mimebundle(self._repr_html_, self.__str__, include, exclude)

    def _repr_markdown_(self) -> str:
        from stagetool.report.display import markdown

        return markdown(self)


def to_jsonable(obj: Any) -> Any:
    """Turn records into JSON values: dataclasses to objects (field order kept), shardings to JAX's
    PartitionSpec text, tuples to lists, enums to their values, non-finite floats to None."""
    if isinstance(obj, Sharding):
        return str(obj)  # as JAX prints a PartitionSpec: the one text form, at the edge
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not f.metadata.get("json_skip")
                and not (f.metadata.get("json_omit_none") and getattr(obj, f.name) is None)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One device: JAX's id, process index, kind, and TPU coordinates where the device has them."""

    id: int
    process_index: int
    device_kind: str
    coords: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class DevicesReport:
    """What ``stagetool devices`` shows.

    Attributes:
      platform: the backend's platform (``cpu``, ``gpu``, ``tpu``).
      device_kind: the first device's kind.
      device_count: devices the backend (or topology) has.
      process_count: processes (hosts) they span.
      jax_version / jaxlib_version / stagetool_version: versions.
      topology: compile-only TPU topology name, or None.
      devices: every device.
      mesh: with ``--mesh``, the mesh's axes and the device ids in mesh order (row-major).
      memory_bytes_per_device: the device's reported memory capacity in bytes
        (``device.memory_stats()['bytes_limit']``), or None when it reports none (CPU).
    """

    platform: str
    device_kind: str
    device_count: int
    process_count: int
    jax_version: str
    jaxlib_version: str
    stagetool_version: str
    topology: str | None
    devices: tuple[DeviceInfo, ...]
    mesh: tuple[tuple[str, int], ...] | None = None
    mesh_device_ids: tuple[int, ...] | None = None
    memory_bytes_per_device: int | None = None


def document_to_json(doc: Report | DevicesReport) -> str:
    """JSON text for a :class:`Report` or :class:`DevicesReport` (with ``schema_version``)."""
    body = {"schema_version": SCHEMA_VERSION, "kind": "devices" if isinstance(doc, DevicesReport) else "report",
            **to_jsonable(doc)}
    return json.dumps(body, indent=2, ensure_ascii=False) + "\n"
