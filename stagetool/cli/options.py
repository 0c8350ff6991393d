"""The options the commands share, declared once: Typer's ``Annotated`` parameter types (their flags
and help texts), and :class:`Staging`, the options of every staging command as one value
(:func:`staging_command` gives a command them)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from stagetool.report import Format

Target = Annotated[Optional[str], typer.Argument(
    help="path/to/file.py:func, package.module:func or module:obj.attr; omit to run every function of the spec.",
    show_default=False)]
SpecOpt = Annotated[Optional[Path], typer.Option(
    "--spec", "-s", help="The YAML spec. Default: <module>.stagetool.yaml beside the file, then ./stagetool.yaml.",
    show_default=False)]
MeshOpt = Annotated[Optional[str], typer.Option(
    "--mesh", "-m", help="Mesh sizes, overriding the spec: 2x4 (in the spec's axis order) or data=2,model=4.",
    show_default=False)]
ContextMeshOpt = Annotated[Optional[bool], typer.Option(
    "--context-mesh/--no-context-mesh",
    help="Trace under the staged mesh as the context mesh (jax.set_mesh), or under none, overriding the spec's "
         "mesh.context. Default: as the code runs: none unless the code sets one (at import), its mesh axes are "
         "Explicit, it has logical axis rules, or it cannot trace without one (a bare PartitionSpec).",
    show_default=False)]
PlatformOpt = Annotated[Optional[str], typer.Option(
    "--platform", help="Backend: cpu, gpu or tpu. Default: the spec's, else JAX's default.", show_default=False)]
TopologyOpt = Annotated[Optional[str], typer.Option(
    "--topology", help="Compile for hardware that is not here: a TPU topology, e.g. v5e:2x4 (needs libtpu), or "
                       "GPUs, e.g. h100:8 (one host of 8), h100:2x8 (needs the gpu-aot extra).",
    show_default=False)]
AgainstOpt = Annotated[Optional[str], typer.Option(
    "--against", help="Stage the same program for a compile-only target too (v5e:2x4, h100:8; v5e alone is sized by "
                      "the mesh) and mark every collective, temporary, FLOP and replicated-work row that differs "
                      "(one more compile).", show_default=False)]
SlicesOpt = Annotated[Optional[int], typer.Option(
    "--slices", help="Stage N slices of the TPU --topology joined over DCN (multi-slice); the mesh's first axis "
                     "spans them.", show_default=False)]
GpuTargetConfigOpt = Annotated[Optional[str], typer.Option(
    "--gpu-target-config", help="A GpuTargetConfigProto text file (from 'stagetool devices --target-config') "
                                "for a GPU topology: --topology gpu:8 --gpu-target-config h100.txtpb.",
    show_default=False)]
FunctionOpt = Annotated[Optional[list[str]], typer.Option(
    "--function", "-f", help="Run only this function of the spec (repeat for several).", show_default=False)]
LocalAvalsOpt = Annotated[bool, typer.Option(
    "--local-avals", help="Spec shapes are host-local (as one process sees them), like 'avals: local'.")]
ProcessesOpt = Annotated[Optional[int], typer.Option(
    "--processes", help="Simulate N processes laid over the devices in order (for local avals).",
    show_default=False, min=1)]
CacheDirOpt = Annotated[Optional[str], typer.Option(  # str: Path('') would be '.', and '' is an error
    "--cache-dir", help="The facts cache: a function whose lowered module, compile options, devices and versions "
                        "match an entry is not compiled again. Default: $STAGETOOL_CACHE_DIR, else the user cache "
                        "folder.", show_default=False)]
NoCacheOpt = Annotated[bool, typer.Option(
    "--no-cache", help="Compile every function; read and write no cache (also STAGETOOL_NO_CACHE=1).")]

ChipOpt = Annotated[Optional[str], typer.Option(
    "--chip", help="Estimate a step-time lower bound (roofline) on this chip: tpu-v5e, h100-sxm, ... "
                   "(docs/cost-memory.md; extend the table with 'chips:' in the spec).", show_default=False)]
MeasureOpt = Annotated[bool, typer.Option(
    "--measure", help="Also run the step for real on the attached accelerator (random inputs of the spec's shapes, "
                      "median of --measure-steps after warm-up) and print measured vs estimated, with the top "
                      "instructions' device times from JAX's profiler. Not with a compile-only --topology.")]
MeasureStepsOpt = Annotated[Optional[int], typer.Option(
    "--measure-steps", min=1, max=10000, help="Timed steps of --measure (their median is printed). [default: 10]",
    show_default=False)]


def measured_steps(measure: bool, steps: Optional[int]) -> Optional[int]:
    """The steps ``--measure`` times (``--measure-steps``, else 10), or None without ``--measure``.

    Raises:
      UsageError: ``--measure-steps`` without ``--measure`` (nothing would run: it was silently ignored).
    """
    if steps is not None and not measure:
        from stagetool.core.errors import UsageError

        raise UsageError(f"--measure-steps {steps}: the steps --measure times, and --measure is not given: nothing "
                         "would run", hint=f"add --measure (--measure --measure-steps {steps}), or drop --measure-steps")
    return (10 if steps is None else steps) if measure else None
DeviceMemoryOpt = Annotated[Optional[str], typer.Option(
    "--device-memory", help="Memory per device, e.g. 16GiB or 80GB, instead of what the device reports.",
    show_default=False)]
FailIfOverOpt = Annotated[bool, typer.Option(
    "--fail-if-over", help="Exit 1 when the peak does not fit in the device memory.")]
PEAK_HELP = ("List the buffers live at the peak and the memory timeline. No second compile: the same compile "
             "writes XLA's dump to a temporary folder, which stagetool reads (within the run-to-run noise of the "
             "compile time on the transformer example).")
PeakOpt = Annotated[bool, typer.Option("--peak/--no-peak", help=PEAK_HELP)]
ReportPeakOpt = Annotated[Optional[bool], typer.Option(
    "--peak/--no-peak", help=PEAK_HELP + " Default: on for --format html (its memory timeline), off otherwise.",
    show_default=False)]
TopOpt = Annotated[int, typer.Option("--top", help="How many largest inputs and peak buffers to list.", min=1)]
JobsOpt = Annotated[int, typer.Option(
    "--jobs", "-j", help="Stage up to N functions at once, each in a worker process of its own (one JAX start per "
                         "worker); the output is the same as with 1.")]

IsolateOpt = Annotated[bool, typer.Option(
    "--isolate", help="Stage each function in a worker process of its own (--jobs N: N at a time), so one "
                      "that aborts its process (an XLA 'LLVM ERROR') is reported as failed and the others "
                      "still run. Costs ~1.5 s per function.")]
ToleranceOpt = Annotated[Optional[list[str]], typer.Option(
    "--tolerance", "-t", help="NAME=VALUE, repeatable: allowed growth before a regression, e.g. memory=2%, "
                              "flops=5%, collective_bytes=64KiB. Names: memory, flops, bytes_accessed, "
                              "collective_bytes, collective_count. Defaults: 1%, 1%, 1%, 0%, 0.",
    show_default=False)]
TimeoutOpt = Annotated[Optional[float], typer.Option(
    "--timeout", help="Seconds each function may take: functions are staged in worker processes (as with "
                      "--isolate or --jobs), and one still running after this long has its process killed and "
                      "is reported as failed. Default with --isolate: 1800.", show_default=False, min=0.001)]
JunitOpt = Annotated[Optional[Path], typer.Option(
    "--junit-xml", help="Also write JUnit XML (one testcase per function) to FILE.", show_default=False)]

FormatOpt = Annotated[Format, typer.Option(
    "--format", help="text: tables on a terminal (plain when piped); json: the versioned document; "
                     "markdown: tables for a pull request (report -o FILE.md also writes its pictures as "
                     "SVG files into FILE-files/); html: one self-contained page with pictures.")]
OutputOpt = Annotated[Optional[Path], typer.Option(
    "--output", "-o", help="Write to FILE (atomically) instead of stdout.", show_default=False)]
PagerOpt = Annotated[bool, typer.Option("--pager", help="Page long module text on a terminal.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")]


def outputs(**paths: Optional[Path]) -> tuple[tuple[str, Path], ...]:
    """``(--option, path)`` of the files a command will write, for the plan to check before staging."""
    return tuple(("--" + name.replace("_", "-"), path) for name, path in paths.items() if path is not None)


@dataclasses.dataclass(frozen=True)
class Staging:
    """The options every staging command shares, declared once: each field's type is its Typer
    parameter, and the fields are in the order ``--help`` lists them (:func:`staging_command`)."""

    target: Target = None
    spec: SpecOpt = None
    mesh: MeshOpt = None
    context_mesh: ContextMeshOpt = None
    platform: PlatformOpt = None
    topology: TopologyOpt = None
    function: FunctionOpt = None
    local_avals: LocalAvalsOpt = False
    processes: ProcessesOpt = None
    cache_dir: CacheDirOpt = None
    no_cache: NoCacheOpt = False
    gpu_target_config: GpuTargetConfigOpt = None
    slices: SlicesOpt = None
    against: AgainstOpt = None

    def options(self, **more: Any) -> Any:
        """The :class:`stagetool.pipeline.Options` these stand for, with ``more`` fields set (over
        these: a command that has no facts cache passes ``cache_dir=None``)."""
        from stagetool.pipeline import Options

        # each field of the same name as an Options field is that field (a new option: no word here)
        names = {f.name for f in dataclasses.fields(Options)}
        fields: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in names}
        fields["function"] = tuple(self.function) if self.function else None  # Typer gives a list
        if "cache_dir" not in more:
            from stagetool.staging.cache import resolve_cache_dir

            fields["cache_dir"] = resolve_cache_dir(self.cache_dir, no_cache=self.no_cache)
        return Options(**{**fields, **more})


def staging_command(fn: Any = None, *, without: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
                    help: dict[str, str] | None = None) -> Any:
    """Give a command the shared staging options: Typer sees :class:`Staging`'s fields as the
    command's first parameters, and the command receives them as one ``staging: Staging`` argument.

    Used bare (``@staging_command``) for every field; ``without`` leaves some out and ``only`` keeps
    just those (the command's ``Staging`` then holds their defaults), ``help`` gives a field the
    command's own help text (``sweep``'s ``--mesh`` takes a list of meshes) while its flag, type and
    default stay the ones declared here.
    """
    if fn is None:
        return lambda f: staging_command(f, without=without, only=only, help=help)
    import functools
    import inspect

    names = {f.name for f in dataclasses.fields(Staging)}
    unknown = (set(without) | set(only or ()) | set(help or {})) - names
    if unknown:
        raise TypeError(f"staging_command: Staging has no {', '.join(sorted(unknown))}")
    shared = [p for p in _shared() if p.name not in without and (only is None or p.name in only)]
    if help:
        shared = [p.replace(annotation=_with_help(p.annotation, help[p.name])) if p.name in help else p
                  for p in shared]
    signature = inspect.signature(fn, eval_str=True)

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        return fn(staging=Staging(**{p.name: kwargs.pop(p.name) for p in shared}), **kwargs)

    parameters = shared + [p for p in signature.parameters.values() if p.name != "staging"]
    command.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    return command


_SHARED: list[Any] = []
"""Staging's fields as the parameters Typer reads (``inspect.Parameter``; made on first use)."""


def _shared() -> list[Any]:
    """:class:`Staging`'s fields as ``inspect.Parameter`` s, in its order (made once)."""
    import inspect

    if not _SHARED:
        hints = typing.get_type_hints(Staging, include_extras=True)
        _SHARED.extend(inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.default,
                                         annotation=hints[f.name]) for f in dataclasses.fields(Staging))
    return _SHARED


def _with_help(annotation: Any, text: str) -> Any:
    """``Annotated[T, typer.Option(...)]`` with its help text replaced (a copy: the shared one is kept)."""
    import copy

    base, *meta = typing.get_args(annotation)
    info = copy.copy(next(m for m in meta if isinstance(m, typer.models.ParameterInfo)))
    info.help = text
    return Annotated[base, info]
