"""Stage a function through ``jax.jit``: trace → lower → compile, each timed.

Like ``jax.stages`` itself, each step returns the next and a caller may stop at any stage:
``lower`` never compiles. The function is traced, lowered and compiled under the mesh context its
code runs under (``AbstractInputs.context``, :func:`_trace`): the staged mesh (``jax.set_mesh``) where
the code sets one, has Explicit axes or logical axis rules, or cannot trace without one (bare
``PartitionSpec``s in sharding constraints work as in the user's job); else none, so a library that
adds constraints only under a context mesh (Flax linen's ``Partitioned.unbox()``) stages as the code
runs. Code that runs a ``shard_map`` on another mesh of the same devices (big_vision's
``shard_map(mesh=Mesh(devices.flatten(), ("data",)))`` beside its 2-D state mesh), which JAX refuses
under a context mesh of another shape, is staged as raw JAX compiles it: with no context mesh but the
one the code itself sets (:attr:`Staged.no_context`).
"""

from __future__ import annotations

import dataclasses
import re
import time
import warnings
from typing import Any, Callable

from stagetool.core.mesh import CONTEXT_NEEDED, CONTEXT_ONLY_HINT, axis_types_hint, axis_types_needed
from stagetool.core.errors import (USER_CODE_ERRORS, OutOfMemoryError, SpecError, StagingError, UsageError,
                                   describe_exception)
from stagetool.core.sharding import Sharding
from stagetool.facts import PeakDump, StageTimings
from stagetool.hlo.buffers import BufferAssignment
from stagetool.inputs.records import AbstractInputs
from stagetool.inputs.target import Target, user_frame
from stagetool.spec.model import FunctionSpec
from stagetool.staging.foreign_mesh import check_traced


@dataclasses.dataclass
class Staged:
    """A function staged up to some point.

    Attributes:
      traced: ``jax.stages.Traced``.
      lowered: ``jax.stages.Lowered``.
      compiled: ``jax.stages.Compiled``, or None when staging stopped at ``lower``.
      timings: seconds per stage.
      jitted: the ``jax.jit``-wrapped function that was staged.
      warnings: what JAX warned while staging (e.g. "Some donated buffers were not usable"),
        deduplicated, in order: facts for the report rather than noise on stderr.
      dump: with ``dump=True``, the live-range dump XLA wrote while compiling.
      compile_warnings: the warnings of the compile stage alone (also in ``warnings``).
      no_context: True where no mesh was made ambient while tracing, lowering and compiling (else the
        staged mesh is, ``jax.set_mesh``): the code sets none and traces without one, or it names
        another mesh of the staged devices in a ``shard_map`` (JAX refuses a context mesh other than a
        ``shard_map``'s own); staged under the context the code itself sets, as raw JAX compiles it.
    """

    traced: Any
    lowered: Any
    compiled: Any | None
    timings: StageTimings
    jitted: Any
    warnings: tuple[str, ...] = ()
    dump: PeakDump | None = None
    compile_warnings: tuple[str, ...] = ()
    no_context: bool = False


def jit_function(target: Target, fspec: FunctionSpec, inputs: AbstractInputs, mesh: Any) -> Any:
    """``jax.jit`` the target with the spec's static, donated and out-sharding options, merged with
    the target's own jit's (``inputs.jit``, :mod:`stagetool.inputs.own_jit`).

    - A ``jax.jit`` target the spec adds nothing to is used as it is. Otherwise the function under
      it is jitted once with its own settings (static arguments, donation, out_shardings,
      ``compiler_options``, ``keep_unused``) plus the spec's — never nested, so its donation and
      options hold. Its ``in_shardings`` are on the abstract arguments already (:func:`build_inputs`).
    - An ``nnx.jit`` / ``eqx.filter_jit`` target the spec adds nothing to is its own program
      (``inputs.program``): the wrapper's inner jit on the arguments as the wrapper splits them, so
      its in/out shardings, donation, static arguments, parameter order (and Equinox's marker
      output) are the ones that run.
    - Other ``nnx.jit`` / ``eqx.filter_jit`` targets run nested inside stagetool's jit (so NNX's in-place
      semantics and Equinox's filtering are theirs); their donation was merged into the inputs'.
      An ``nnx.jit``'s ``in_shardings`` are on the abstract arguments already, and the outer jit
      gets the ``out_shardings`` its inner jit has (``inputs.out_shardings``), so the program's
      boundary is the one ``nnx.jit`` compiles.

    Raises:
      SpecError: ``jax.jit`` rejects the options (static or donated names the function does not
        take), at the location of the spec key concerned; never a raw JAX exception.
    """
    import jax

    fn = target.fn
    own = inputs.jit
    if inputs.program is not None:  # an nnx.jit target as its own program (frameworks.nnx.NnxProgram)
        return inputs.program
    out_shardings = _out_shardings(fspec.out_shardings, mesh)
    if own is not None and own.kind == "jax.jit" and own.fun is None:  # unreadable: as before, nested
        own = None
    if isinstance(fn, jax.stages.Wrapped) and inputs.fn is None and not fspec.donate \
            and fspec.out_shardings is None and inputs.in_shardings is None:
        return fn
    if own is not None and own.kind == "jax.jit" and not inputs.wrapped and fspec.out_shardings is None \
            and inputs.in_shardings is None \
            and set(inputs.donate_argnums) == set(own.donate_argnums) \
            and set(inputs.donate_argnames) == set(own.donate_argnames) \
            and set(inputs.static_argnames) <= set(own.static_argnames):
        return own.wrapper  # the spec adds nothing: the target's own jit stages itself
    options: dict[str, Any] = {}
    if own is not None and own.kind == "jax.jit":
        if not inputs.wrapped:  # the function itself, called as the target is
            options.update(static_argnums=tuple(i for i in own.static_argnums if i < len(inputs.args)),
                           static_argnames=own.static_argnames)
        if own.out_shardings is not None:
            options["out_shardings"] = own.out_shardings
        if own.compiler_options:
            options["compiler_options"] = own.compiler_options
        if own.keep_unused:
            options["keep_unused"] = True
    if own is not None and own.kind == "nnx.jit" and inputs.out_shardings is not None:
        options["out_shardings"] = inputs.out_shardings  # as nnx.jit's inner jit returns them
    if inputs.static_argnames:
        options["static_argnames"] = tuple(dict.fromkeys((*options.get("static_argnames", ()),
                                                          *inputs.static_argnames)))
    if inputs.donate_argnums:
        options["donate_argnums"] = inputs.donate_argnums
    if inputs.donate_argnames:
        options["donate_argnames"] = inputs.donate_argnames
    if fspec.out_shardings is not None:
        options["out_shardings"] = _fill(out_shardings, options.get("out_shardings"))
    if inputs.in_shardings is not None:  # Refs under auto axes: their shardings (inputs.leaves.as_abstract_ref)
        options["in_shardings"] = inputs.in_shardings
    base = inputs.fn or fn
    try:
        return jax.jit(base, **options)
    except Exception as e:  # jax.jit checks its options against the signature: a spec mistake
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        key = next((k for k, words in (("static", ("static_arg",)), ("donate", ("donate_arg",)),
                                        ("out_shardings", ("out_shardings",))) if any(w in text for w in words)), None)
        loc = fspec.where(key) if key else fspec.loc
        raise SpecError([f"{loc}: functions.{fspec.name}" + (f".{key}" if key else "")
                         + f": jax.jit does not accept the spec's options for {fspec.target}: {text}"],
                        hint="name only parameters the function takes in static and donate") from None


def _fill(spec: Any, own: Any) -> Any:
    """The spec's out_shardings, with the updated-state entries it leaves to the compiler (None)
    taken from the target's own (``nnx.jit``: an updated argument's ``in_shardings``)."""
    if isinstance(spec, dict) and isinstance(own, dict):
        return {k: own.get(k) if v is None else v for k, v in spec.items()}
    return spec


def _out_shardings(tree: Any, mesh: Any) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def one(s: Any) -> Any:
        if isinstance(s, Sharding):
            if s.kind == "spec":
                return NamedSharding(mesh, PartitionSpec(*s.dims))
            return None  # auto / unspecified: the compiler chooses
        return s

    # Any pytree of shardings (a list, a dict, an nnx.State from `like:`), None for the compiler's choice.
    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, Sharding) or x is None)


def stage(jitted: Any, inputs: AbstractInputs, mesh: Any, *, name: str, user_files: list[str],
          until: str = "compile", compiler_options: dict | None = None, dump: bool = False,
          on_stage: Callable[[str], None] | None = None) -> Staged:
    """Trace, lower and (unless ``until="lower"``) compile.

    Args:
      jitted: a ``jax.jit``-wrapped callable.
      inputs: abstract inputs from :func:`stagetool.inputs.avals.build_inputs`.
      mesh: the staged ``jax.sharding.Mesh``, the context mesh while tracing, lowering and compiling
        where ``inputs.context`` says so (:func:`_trace`).
      name: the function's name, for error messages.
      user_files: the user's source files, to find the user's frame in a traceback.
      until: ``"lower"`` or ``"compile"``.
      compiler_options: passed to ``Lowered.compile``.
      dump: compile with XLA's dump into a temporary folder (``xla_dump_to``) and keep the
        buffer live-range file's text (:attr:`Staged.dump`), so the peak buffers come from the
        one compile; the folder is removed on every exit path.
      on_stage: called with ``"trace"``, ``"lower"``, ``"compile"`` as each stage starts.

    Raises:
      StagingError: JAX/XLA failed in a stage (exit code 3), with JAX's message and the user's frame.
      UsageError: the traced code names a mesh other than ``mesh`` (exit 2,
        :func:`stagetool.staging.foreign_mesh.check_traced`).
    """
    timings: dict[str, float] = {}
    warned: list[str] = []
    traced, context = _trace(jitted, inputs, mesh, name, user_files, timings, warned, on_stage)
    check_traced(traced, mesh, name=name, user_files=user_files)  # a mesh of the code's own: exit 2
    lowered = _run("lower", traced.lower, mesh, name, user_files, jitted, timings, warned, on_stage,
                   ambient=context is not None)
    staged = Staged(traced, lowered, None, StageTimings(timings.get("trace"), timings.get("lower")), jitted,
                    tuple(warned), no_context=context is None and mesh is not None)
    if until == "compile":
        staged = compile_staged(staged, mesh, name=name, user_files=user_files, compiler_options=compiler_options,
                                dump=dump, on_stage=on_stage)
    return staged


def trace_only(jitted: Any, inputs: AbstractInputs, mesh: Any, *, name: str, user_files: list[str]) -> Any:
    """The ``jax.stages.Traced`` of ``jitted`` on the abstract inputs (mesh ambient), as :func:`stage`
    traces it, without lowering: for what is known only after a trace (the output tree).

    Raises:
      StagingError: JAX failed to trace (exit code 3).
    """
    traced, _ = _trace(jitted, inputs, mesh, name, user_files, {}, [], None)
    check_traced(traced, mesh, name=name, user_files=user_files)
    return traced


class _ContextRefused(Exception):
    """JAX refused the staged mesh as the context of a ``shard_map`` on another mesh (tracing only)."""

    def __init__(self, error: UsageError) -> None:
        super().__init__(error.message)
        self.error = error


#: JAX's words when a ``shard_map``'s own mesh is not the context mesh (its shard_map checks, JAX 0.7-0.12).
_SHARD_MAP_CONTEXT = "should match the mesh passed to shard_map"


def _trace(jitted: Any, inputs: AbstractInputs, mesh: Any, name: str, user_files: list[str],
           timings: dict[str, float], warned: list[str], on_stage: Callable[[str], None] | None
           ) -> tuple[Any, Any]:
    """``(traced, the context mesh it was traced under, or None)``, under the context the code runs
    under (``inputs.context``, :func:`stagetool.inputs.loading.context_of`):

    - None (the code sets no mesh): under no context mesh, as raw JAX traces such code (Flax linen's
      ``Partitioned.unbox()`` adds no constraint there); where JAX refuses that for want of one (a bare
      ``PartitionSpec`` in a constraint, ``reshard``), the code's run must set one: under the staged mesh.
    - True (the code sets one, or the user asked): under the staged mesh; where JAX refuses it because
      the code runs a ``shard_map`` on a mesh of its own, under none (as raw JAX compiles the code when
      its caller sets none). A failure under it that a trace under none does not have says so.
    - False (the user asked for none): under none.

    Raises:
      UsageError: the code's ``shard_map`` mesh cannot be staged (exit 2).
      StagingError: JAX failed to trace (exit 3).
    """
    def trace() -> Any:
        return jitted.trace(*inputs.args, **inputs.kwargs)

    context = inputs.context if mesh is not None else False
    if context is None:
        try:
            return _run("trace", trace, mesh, name, user_files, jitted, timings, warned, on_stage, ambient=False,
                        context_needed=True), None
        except _ContextNeeded as needed:
            try:
                return _run("trace", trace, mesh, name, user_files, jitted, timings, warned, None), mesh
            except StagingError as e:
                e.message += (f"\n  (traced under the staged mesh as the context mesh, jax.set_mesh: without one the "
                              f"code fails first with: {needed.first})")
                raise
    if context is False:
        try:
            return _run("trace", trace, mesh, name, user_files, jitted, timings, warned, on_stage, ambient=False,
                        context_needed=mesh is not None), None
        except _ContextNeeded as needed:
            raise StagingError(f"{name}: trace failed: {needed.first}", stage="trace", function=name,
                               user_frame=needed.frame,
                               hint="the code needs a context mesh and the run asked for none (--no-context-mesh, "
                                    "the spec's mesh.context: false): leave that out, or pass --context-mesh") from None
    try:
        return _run("trace", trace, mesh, name, user_files, jitted, timings, warned, on_stage,
                    context_refusal=True), mesh
    except _ContextRefused as refused:
        try:
            return _run("trace", trace, mesh, name, user_files, jitted, timings, warned, None, ambient=False), None
        except (StagingError, UsageError):
            raise refused.error from None
    except StagingError as e:
        try:  # does it fail only under the context mesh stagetool set?
            _run("trace", trace, mesh, name, user_files, jitted, {}, [], None, ambient=False)
        except (StagingError, UsageError):
            raise e from None
        e.hint = "; ".join(filter(None, (e.hint, CONTEXT_ONLY_HINT)))
        raise


class _ContextNeeded(Exception):
    """JAX refused a trace under no context mesh because the code needs one (tracing only)."""

    def __init__(self, first: str, frame: str | None) -> None:
        super().__init__(first)
        self.first = first
        self.frame = frame



def compile_staged(staged: Staged, mesh: Any, *, name: str, user_files: list[str],
                   compiler_options: dict | None = None, dump: bool = False,
                   on_stage: Callable[[str], None] | None = None) -> Staged:
    """Compile a function :func:`stage` stopped at ``lower``: the same :class:`Staged` with
    ``compiled`` (and ``dump``) set, the compile timed and its warnings kept apart in
    :attr:`Staged.compile_warnings` (a cached compile replays them).

    Raises:
      StagingError: XLA failed to compile (exit code 3).
    """
    timings: dict[str, float] = {}
    warned: list[str] = []
    logged: list[str] = []
    lowered = staged.lowered
    ambient = not staged.no_context  # the context it was traced under
    if dump:
        compiled, dumped = _run("compile", lambda: with_xla_log(lambda: compile_with_dump(lowered, compiler_options),
                                                                logged),
                                mesh, name, user_files, staged.jitted, timings, warned, on_stage, ambient=ambient)
    else:
        dumped = None
        compiled = _run("compile", lambda: with_xla_log(lambda: lowered.compile(compiler_options) if compiler_options
                                                        else lowered.compile(), logged),
                        mesh, name, user_files, staged.jitted, timings, warned, on_stage, ambient=ambient)
    warned = list(merge_warnings(tuple(warned), logged))
    return dataclasses.replace(staged, compiled=compiled, dump=dumped,
                               timings=dataclasses.replace(staged.timings, compile_s=timings.get("compile")),
                               warnings=merge_warnings(staged.warnings, warned),
                               compile_warnings=tuple(warned))


_XLA_LOG_LINE = re.compile(r"^(?P<level>[WE])\d{4} [\d:.]+\s+\d+ (?P<where>[\w./-]+:\d+)\] (?P<message>.*)$")


def with_xla_log(fn: Callable[[], Any], logged: list[str]) -> Any:
    """``fn()`` (a compile) with XLA's own log lines on file descriptor 2 (absl: ``W1201 15:01:34.7
    26628 file.cc:3132] message``: warnings and errors, e.g. "Involuntary full rematerialization")
    collected into ``logged`` as ``XLA warning (file.cc:3132): message`` (no time or thread id, so
    runs compare equal); every other byte written to fd 2 meanwhile is written back to stderr.

    They are compile facts: the facts cache stores them with the entry and a hit shows them as a
    miss does (:attr:`Staged.compile_warnings`).
    """
    import os
    import sys
    import tempfile

    from stagetool.process import cleanup

    try:
        sys.stderr.flush()
    except (AttributeError, ValueError):  # pragma: no cover - closed or replaced stderr
        pass
    saved = os.dup(2)
    tmp = tempfile.TemporaryFile(mode="w+b")
    os.dup2(tmp.fileno(), 2)
    restored = [False]

    def restore() -> str:
        """fd 2 back as it was; the text captured so far."""
        if not restored[0]:
            restored[0] = True
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode("utf-8", "replace")

    def on_signal() -> None:  # a signal ends the run mid-compile: its message and XLA's log are seen
        text = restore()
        if text:
            os.write(2, text.encode("utf-8", "replace"))

    token = cleanup.register_callback(on_signal)
    failed = True
    try:
        out = fn()
        failed = False
        return out
    finally:
        cleanup.forget(token)
        text = restore()
        tmp.close()
        found, rest = _split_xla_log(text)
        logged.extend(found)
        back = text if failed else rest  # a failed compile: XLA's log as it was written
        if back:
            try:
                sys.stderr.write(back)
                sys.stderr.flush()
            except (AttributeError, ValueError):  # pragma: no cover - closed stderr
                pass


def _split_xla_log(text: str) -> tuple[list[str], str]:
    """``(warnings, the rest)`` of text XLA wrote to fd 2 (see :func:`with_xla_log`)."""
    found: list[str] = []
    rest: list[str] = []
    for line in text.splitlines(keepends=True):
        m = _XLA_LOG_LINE.match(line.rstrip("\n"))
        if m:
            kind = "warning" if m.group("level") == "W" else "error"
            item = f"XLA {kind} ({m.group('where').rsplit('/', 1)[-1]}): {m.group('message').strip()}"
            if item not in found:
                found.append(item)
        else:
            rest.append(line)
    return found, "".join(rest)


def merge_warnings(first: tuple[str, ...], more: Any) -> tuple[str, ...]:
    """``first`` then the warnings of ``more`` not already in it, in order."""
    out = list(first)
    for w in more:
        if w not in out:
            out.append(w)
    return tuple(out)


def _run(stage_name: str, fn: Callable[[], Any], mesh: Any, name: str, user_files: list[str], jitted: Any,
         timings: dict[str, float], warned: list[str], on_stage: Callable[[str], None] | None, *,
         context_refusal: bool = False, ambient: bool = True, context_needed: bool = False) -> Any:
    """Run one stage with the mesh ambient (``ambient`` false, or no ``mesh``: no context mesh but the
    code's own; ``mesh`` is still the staged one the messages name), timed, its warnings collected;
    JAX's errors → StagingError. ``context_refusal``: JAX's refusal of the context mesh for a
    ``shard_map`` of the code's raises :class:`_ContextRefused` (:func:`_trace` retries);
    ``context_needed``: JAX's refusal of no context mesh raises :class:`_ContextNeeded`."""
    import contextlib

    import jax

    if on_stage:
        on_stage(stage_name)
    start = time.perf_counter()
    try:
        with (jax.set_mesh(mesh) if mesh is not None and ambient else contextlib.nullcontext()), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    except USER_CODE_ERRORS as e:  # SystemExit from the traced code is its failure too
        if context_needed and any(m in str(e) for m in CONTEXT_NEEDED):
            first = str(e).strip().splitlines()[0]
            raise _ContextNeeded(f"{type(e).__name__}: {first}", user_frame(e, user_files)) from None
        if stage_name in ("trace", "lower") and any(m in str(e) for m in _MESH_MISMATCH):
            error = _mesh_mismatch(e, stage_name, name, user_files, mesh, jitted)
            if context_refusal and _SHARD_MAP_CONTEXT in str(e):
                raise _ContextRefused(error) from None
            raise error from None
        if stage_name in ("trace", "lower") and axis_types_needed(str(e)) is not None:
            raise _axis_type_mismatch(e, stage_name, name, user_files, mesh) from None
        raise _staging_error(e, stage_name, name, user_files, jitted) from None
    timings[stage_name] = time.perf_counter() - start
    for w in caught:  # the whole message on one line: Flax's ends its first line at "instances use:"
        text = " ".join(str(w.message).split())
        if text not in warned:
            warned.append(text)
    return out


DUMP_OPTIONS = {"xla_dump_hlo_as_text": True, "xla_dump_hlo_as_proto": True}
"""Compiler options added next to ``xla_dump_to`` for the live-range dump.

With ``xla_dump_to`` XLA writes, per module, ``module_NNNN.<name>.<backend>_after_optimizations-
live-range.txt`` (its "Live ranges at N (peak)" section lists every buffer live at the peak);
``xla_dump_hlo_as_proto`` adds ``...after_optimizations.hlo.pb``, the ``HloProto`` with the buffer
assignment (the memory timeline's source); verified on jax/jaxlib 0.10.2 (CPU, compile-only TPU)
and on 0.7.2 and 0.12.0.1 (CPU); jaxlib ≤ 0.9.2 writes the live ranges at the end of
``...-buffer-assignment.txt`` instead (:mod:`stagetool.core.compat`). Per-pass dumps stay off."""


def compile_with_dump(lowered: Any, compiler_options: dict | None = None) -> tuple[Any, PeakDump]:
    """Compile ``lowered`` (a ``jax.stages.Lowered``) with XLA's dump into a temporary folder and
    return the executable and its :class:`~stagetool.staging.gather.PeakDump`.

    The folder is removed on every exit path; the compile's exceptions propagate.
    """
    import shutil
    import tempfile

    from stagetool.process import cleanup

    folder = tempfile.mkdtemp(prefix="stagetool-dump-")
    token = cleanup.register_path(folder)  # removed by the signal handling if the compile is cut short
    try:
        options = {**(compiler_options or {}), **DUMP_OPTIONS, "xla_dump_to": folder}
        start = time.perf_counter()
        try:
            compiled = lowered.compile(options)
        except Exception as e:  # XLA refused it (out of memory): keep what it dumped before refusing
            refused = refused_dump(folder, time.perf_counter() - start)
            if refused is not None:
                setattr(e, REFUSED_DUMP_ATTRIBUTE, refused)
            raise
        seconds = time.perf_counter() - start
        module_text = compiled.as_text() or ""
        text, reason = read_live_range(folder, module_text)
        buffers, buffers_reason = read_buffer_assignment(folder, module_text)
        return compiled, PeakDump(text, module_text, seconds, reason, buffers, buffers_reason,
                                  read_space_names(folder, module_text))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        cleanup.forget(token)


REFUSED_DUMP_ATTRIBUTE = "stagetool_refused_dump"
"""The attribute :func:`compile_with_dump` sets on the exception of a refused compile: the
:class:`~stagetool.facts.PeakDump` XLA wrote before refusing (read back by :func:`_staging_error`)."""


def refused_dump(folder: str, seconds: float | None) -> PeakDump | None:
    """The :class:`~stagetool.facts.PeakDump` of a compile XLA refused, from what it wrote into the
    ``xla_dump_to`` folder before refusing, or None when it wrote no live ranges.

    XLA:TPU (libtpu 0.10.2, checked with ``--topology v5e:2x4``) runs buffer assignment before it
    compares the total with the HBM and writes ``...after_optimizations.txt``, its ``.hlo.pb``,
    ``-live-range.txt`` and ``-memory-usage-report.txt`` for the program it then refuses: the
    buffers live at the peak of the program that does not fit, as XLA assigned them. The module
    text is the ``<prefix>.txt`` beside the live-range file."""
    import os

    from stagetool.core import compat

    found = compat.live_range_file(folder, "")
    if found is None:
        return None
    path = os.path.join(folder, found[1] + ".txt")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as fh:
        module_text = fh.read()
    text, reason = read_live_range(folder, module_text)
    if text is None:
        return None
    buffers, buffers_reason = read_buffer_assignment(folder, module_text)
    return PeakDump(text, module_text, seconds, reason, buffers, buffers_reason, read_space_names(folder, module_text))


def read_buffer_assignment(folder: str, module_text: str) -> tuple[BufferAssignment | None, str | None]:
    """``(buffer assignment of the compiled module, None)`` from the ``HloProto`` beside its
    live-range dump (``<prefix>-live-range.txt`` → ``<prefix>.hlo.pb``; ``<prefix>-buffer-assignment.txt``
    on jaxlib ≤ 0.9.2, :func:`stagetool.core.compat.live_range_file`), or ``(None, why not)``."""
    import os

    from stagetool.hlo.buffers import ProtoError, read_hlo_proto
    from stagetool.core import compat

    found = compat.live_range_file(folder, module_text)
    proto = found[1] + ".hlo.pb" if found else None
    if proto is None or not os.path.exists(os.path.join(folder, proto)):
        return None, "XLA wrote no HloProto after optimisations (xla_dump_hlo_as_proto) beside the live-range dump"
    with open(os.path.join(folder, proto), "rb") as fh:
        data = fh.read()
    try:
        return read_hlo_proto(data, traces=False), None
    except ProtoError as e:
        return None, f"XLA's {proto} could not be read: {e}"


def read_space_names(folder: str, module_text: str) -> tuple[tuple[int, str], ...]:
    """The memory spaces XLA's ``<prefix>-memory-usage-report.txt`` (beside the live-range dump)
    names, ``((color, name), ...)``; () when it wrote none."""
    import os

    from stagetool.hlo.buffers import parse_memory_space_names
    from stagetool.core import compat

    found = compat.live_range_file(folder, module_text)
    path = os.path.join(folder, found[1] + "-memory-usage-report.txt") if found else None
    if path is None or not os.path.exists(path):
        return ()
    with open(path, encoding="utf-8", errors="replace") as fh:
        return parse_memory_space_names(fh.read())


def read_live_range(folder: str, module_text: str) -> tuple[str | None, str | None]:
    """``(text of the compiled module's live-range dump, None)``, or ``(None, why there is none)``;
    where jaxlib writes it depends on the release (:func:`stagetool.core.compat.read_live_range`)."""
    from stagetool.core import compat

    return compat.read_live_range(folder, module_text)


def _definition(fn: Any) -> str | None:
    """``file:line in name`` where the (unwrapped) function is defined, or None."""
    import inspect

    try:
        target = inspect.unwrap(fn)
        target = inspect.unwrap(getattr(target, "_stagetool_wraps", target))  # the user's function, not a wrapper
        _, line = inspect.getsourcelines(target)
        return f"{inspect.getsourcefile(target)}:{line} in {target.__name__} (the function being compiled)"
    except (TypeError, OSError, AttributeError):
        return None


#: JAX's words when the traced code names a mesh other than the ambient (staged) one.
_MESH_MISMATCH = ("should match the mesh passed to shard_map", "Received incompatible devices for jitted computation",
                  "should match the aval mesh", "Mesh for all inputs should be equal")


def closed_over_refs(jitted: Any) -> list[tuple[str, Any]]:
    """``(name, ref)`` of each ``jax.Ref`` the function under ``jitted`` reads from a module global
    or a closure cell (its own code and the functions defined in it): inputs of the program that are
    not among its arguments (JAX passes each after them, and writes it back in place)."""
    from stagetool.inputs.frameworks.dispatch import is_ref

    return [(n, v) for n, v in _read_values(jitted) if is_ref(v)]


def _read_values(jitted: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of the module globals and closure cells the function under ``jitted`` reads."""
    import inspect
    import types

    fn = inspect.unwrap(getattr(jitted, "_stagetool_wraps", jitted))
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    names: list[str] = []
    todo = [code]
    while todo:
        c = todo.pop()
        names += [n for n in c.co_names if n not in names]
        todo += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    values = [(n, fn.__globals__[n]) for n in names if n in getattr(fn, "__globals__", {})]
    return values + [(n, cell.cell_contents) for n, cell in zip(code.co_freevars, fn.__closure__ or ())
                     if cell.cell_contents is not None]


def _closed_over_elsewhere(jitted: Any, mesh: Any) -> list[str]:
    """The module globals and closure cells the function under ``jitted`` reads (its own code and the
    functions defined in it) that are ``jax.Ref``s or arrays on devices the staged ``mesh`` does not
    have: ``name (f32[8,128,4,32] on device 0)``. JAX takes such a value as an input of the program
    that it cannot move ("ARG_SHARDING" in its refusal)."""
    import jax

    from stagetool.inputs.frameworks.dispatch import is_ref

    if mesh is None:
        return []
    staged = set(mesh.devices.flat)
    found = []
    for n, v in _read_values(jitted):
        try:
            if not (is_ref(v) or isinstance(v, jax.Array)):
                continue
            devices = set(v.sharding.device_set)
        except Exception:  # a deleted or abstract value: nothing to say  # noqa: BLE001
            continue
        if not devices <= staged or len(devices) < len(staged):
            ids = ", ".join(str(d.id) for d in sorted(devices, key=lambda d: d.id))
            found.append(f"{n} ({v.dtype}[{','.join(map(str, v.shape))}] on device{'s' if len(devices) != 1 else ''} "
                         f"{ids})")
    return found


def _mesh_mismatch(e: BaseException, stage_name: str, name: str, user_files: list[str], mesh: Any,
                   jitted: Any = None) -> UsageError:
    """The traced code names its own mesh (``shard_map(mesh=cfg.mesh)``, a ``NamedSharding`` on it) and
    that mesh is not the staged one: staging it would mix two meshes in one program, which no mesh runs
    — a usage error (exit 2) naming both meshes and the user's line, never a compile. Where JAX's
    refusal is of an unnamed input (``ARG_SHARDING``: a value the function closes over) and the
    function reads a module-level ``jax.Ref`` or array placed elsewhere (made at import on one device),
    the error names that value and how to stage it instead."""
    from stagetool.devices.world import describe_mesh

    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    frame = user_frame(e, user_files)
    closed = _closed_over_elsewhere(jitted, mesh) if "ARG_SHARDING" in str(e) and jitted is not None else []
    if closed:
        return UsageError(
            f"{name}: {stage_name}: the function reads {', '.join(closed)}, which {'is' if len(closed) == 1 else 'are'} "
            "not laid on the staged mesh "
            f"({describe_mesh(mesh)}): JAX takes a value the function closes over as an input it cannot move: {first}"
            + (f"\n  at {frame}" if frame else ""),
            hint="pass it to the function as an argument (the spec's {ref: module.py:NAME} stages it with the other "
                 "inputs), or create it on the mesh where the module makes it: jax.new_ref(jax.device_put(value, "
                 "NamedSharding(jax.make_mesh(...), P(...))))")
    return UsageError(f"{name}: {stage_name}: the code names a mesh of its own that is not the staged mesh "
                      f"({describe_mesh(mesh)}): {first}" + (f"\n  at {frame}" if frame else ""),
                      hint=_host_mesh_hint(str(e)) or _order_hint(str(e)) or (
                          "code that names its mesh in the step (shard_map(mesh=...), NamedSharding(mesh, ...)) runs "
                          "on that mesh alone: stage with the same axis sizes (--mesh) and axis types (the spec's "
                          "axis_types: explicit for jax.make_mesh's default), or build the code's mesh from the spec's "
                          "({call: model.py:make_config, kwargs: {mesh: {mesh: staged}}})"))


_DEVICE_IDS = re.compile(r"device ids \[([\d, ]+)\]")


def _order_hint(text: str) -> str | None:
    """The hint for JAX's refusal of two orders of the same devices in one program ("Received
    incompatible devices ... device ids [0, 1, 3, 2] ... device ids [0, 1, 2, 3]"), None otherwise."""
    ids = [tuple(int(i) for i in m.split(",")) for m in _DEVICE_IDS.findall(text)]
    if len(ids) < 2 or ids[0] == ids[1] or sorted(ids[0]) != sorted(ids[1]):
        return None
    return (f"the code lays the staged devices in two orders (ids {list(ids[0])} and {list(ids[1])}), and JAX compiles "
            "one device order per program, as a real run of the code does: build every mesh of the code from the same "
            "devices in the same order (another mesh from mesh.devices.flatten() or .reshape(...) of the first), or "
            "take the staged mesh from the spec ({mesh: staged})")


def _axis_type_mismatch(e: BaseException, stage_name: str, name: str, user_files: list[str],
                        mesh: Any) -> UsageError:
    """Code written for Explicit mesh axes (``jax.sharding.AxisType.Explicit``: ``reshard``,
    ``out_sharding=P(...)``) staged on Auto axes, or the reverse: bad input (exit 2) before any
    compile, JAX's own sentence, the user's line, and the spec key that fixes it
    (``mesh.axis_types``)."""
    from stagetool.devices.world import describe_mesh

    needed = axis_types_needed(str(e)) or "explicit"
    staged = "auto" if needed == "explicit" else "explicit"
    first = str(e).strip().splitlines()[0]
    first = first.split(" This error occurs at source:", 1)[0]  # the line is named below
    frame = user_frame(e, user_files)
    if frame is None:
        _, frame = xla_message(str(e))
    hint = axis_types_hint(needed)
    return UsageError(f"{name}: {stage_name}: the code needs {needed.capitalize()} mesh axes, and stagetool staged "
                      f"{describe_mesh(mesh)} with {staged.capitalize()} axes: {first}"
                      + (f"\n  at {frame}" if frame else ""), hint=hint)


#: a frame line of XLA's "Suspected Python Code Location" list: ``  file.py:7:8 [f]``, XLA's own annotations
#: after it kept with it (``[xla::PythonStackTrace='']`` on the last frame, then JAX's ``(at file.py:7 in f)``)
_FRAME_LINE = re.compile(r"^\s+(?P<file>\S+?):(?P<line>\d+)(?::\d+)? \[(?P<func>[^\]]*)\]"
                         r"(?:\s*\[[^\]]*\])*(?:\s*\(at [^()]*\))?\s*$")
_MAX_LINES = 60


def _own(filename: str) -> bool:
    """Whether a frame's file is stagetool's own: the frames from there on are how stagetool (and
    whatever called it: its CLI, a test runner) called the user's function."""
    from pathlib import Path

    return str(Path(filename).resolve()).startswith(str(Path(__file__).resolve().parents[1]) + "/")


def xla_message(text: str) -> tuple[str, str | None]:
    """XLA's error text as the user needs it, and the first user frame it names.

    JAX's trailing "The stack trace below excludes JAX-internal frames" note is cut; in XLA's frame
    lists (``Suspected Python Code Location:``, ``  file.py:7:8 [f]`` lines, innermost first) the
    frames of installed libraries and, from stagetool's first frame on, every frame (the call into
    stagetool: its CLI, Typer/Click, a test runner; absolute install paths) are left out with one line
    saying how many (``--debug`` shows the unfiltered text); everything else of XLA's message is kept, its
    last lines too (``Failed after spmd-partitioning``): a message over 60 lines keeps its first 50
    and last 5.

    Returns:
      ``(text, frame)``: the filtered text, and ``file:line in func`` of the first frame kept, or None.
    """
    for marker in ("\n--------------------", "\nThe stack trace below excludes JAX-internal frames"):
        if marker in text:
            text = text.split(marker, 1)[0].rstrip()
    from stagetool.core.paths import is_library_file

    kept: list[str] = []
    frame = None
    dropped = 0
    for line in text.splitlines():
        m = _FRAME_LINE.match(line)
        if m is None:
            if dropped:
                kept.append(f"  ({dropped} frame{'s' if dropped != 1 else ''} of stagetool, its CLI and installed "
                            "libraries left out; --debug shows them)")
                dropped = 0
            kept.append(line.rstrip())
        elif dropped or _own(m["file"]) or is_library_file(m["file"]):
            dropped += 1  # after stagetool's first frame, every frame is the call into stagetool
        else:
            frame = frame or f"{m['file']}:{m['line']} in {m['func']}"
            kept.append(line.rstrip())
    if dropped:
        kept.append(f"  ({dropped} frame{'s' if dropped != 1 else ''} of stagetool, its CLI and installed libraries "
                    "left out; --debug shows them)")
    while kept and not kept[-1].strip():
        kept.pop()
    if len(kept) > _MAX_LINES:
        kept = kept[:50] + [f"... ({len(kept) - 55} more lines; --debug shows everything)"] + kept[-5:]
    return "\n".join(kept), frame


def _staging_error(e: BaseException, stage_name: str, name: str, user_files: list[str], jitted: Any = None) -> StagingError:
    raw = str(e).strip()
    text, xla_frame = xla_message(raw)
    frame = user_frame(e, user_files) or xla_frame  # XLA names the op's line where no Python frame does
    if frame is None and jitted is not None:
        # XLA fails below any Python frame of the user's (a compile error): point at the function.
        frame = _definition(jitted)
    what = describe_exception(e) if isinstance(e, SystemExit) else f"{type(e).__name__}: {text}"
    message = f"{name}: {stage_name} failed: {what}"
    oom = parse_out_of_memory(text) if stage_name == "compile" else None
    if oom is not None:
        # set by compile_with_dump only on an exception it saw: absent on every other
        refused = getattr(e, REFUSED_DUMP_ATTRIBUTE, None)
        return OutOfMemoryError(message, stage=stage_name, function=name, user_frame=frame, refused_dump=refused,
                                **oom)
    return StagingError(message, stage=stage_name, function=name, user_frame=frame,
                        hint=_host_mesh_hint(text), detail=raw if raw != text else None)


_MESHES_DIFFER = re.compile(r"Received incompatible devices|should match the aval mesh")
_ON_TARGET = re.compile(r"platform[ =](tpu|gpu)\b", re.IGNORECASE)
_ON_HOST = re.compile(r"platform[ =]cpu\b", re.IGNORECASE)


def _host_mesh_hint(text: str) -> str | None:
    """The hint for JAX's refusal of two meshes, a compile-only target's devices and host CPU devices
    ("Received incompatible devices" of a sharding constraint under auto axes; "context mesh ...
    should match the aval mesh" under explicit axes): a sharding the model built at import from
    ``jax.devices()`` (beside a ``--topology`` those are the CPU backend's host devices) used inside
    the function; None otherwise."""
    if not (_MESHES_DIFFER.search(text) and _ON_TARGET.search(text) and _ON_HOST.search(text)):
        return None
    return ("a sharding made from jax.devices() at import (beside a compile-only --topology those are host CPU "
            "devices) is used inside the function: write a PartitionSpec there (it takes the mesh stagetool sets, "
            "jax.set_mesh), or build the NamedSharding from jax.sharding.get_abstract_mesh() or the mesh passed "
            "in, so it follows --topology")


_XLA_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_OOM_REQUIRED = re.compile(r"required for (?P<what>[^()]+?) \((?P<need>[\d.]+)(?P<nu>[KMGTP]?)i?B?\) exceeds "
                           r"available (?P<space>\w+) \((?P<have>[\d.]+)(?P<hu>[KMGTP]?)i?B?\)")
_OOM_USED = re.compile(r"Used (?P<need>[\d.]+)(?P<nu>[KMGTP]?)i?B? of (?P<have>[\d.]+)(?P<hu>[KMGTP]?)i?B? "
                       r"(?P<space>\w+)")


def parse_out_of_memory(text: str) -> dict | None:
    """The figures of XLA's "ran out of memory" compile error, or None when ``text`` is not one.

    Two forms are read (XLA prints sizes with binary prefixes, ``15.75G`` = 15.75 GiB, rounded to
    two decimals, so the bytes are to within 0.005 of the unit):

    * libtpu 0.10.2 (checked with ``--topology v5e:2x4``): ``RESOURCE_EXHAUSTED: Ran out of memory on
      HBM, the total memory required for HLO temporaries (18.00G) exceeds available HBM (15.75G).``
    * XLA:TPU's ``Ran out of memory in memory space hbm. Used 20.26G of 15.48G hbm.``

    Returns:
      ``{needed_bytes, available_bytes, memory_space, what, xla_message}`` (figures None when
      the message has none).
    """
    if "RESOURCE_EXHAUSTED" not in text or "out of memory" not in text.lower():
        return None
    start = text.find("RESOURCE_EXHAUSTED")
    xla = text[start:].split("\n", 1)[0].strip()
    m = _OOM_REQUIRED.search(text) or _OOM_USED.search(text)
    if m is None:
        return {"needed_bytes": None, "available_bytes": None, "memory_space": None, "what": None, "xla_message": xla}

    def size(number: str, unit: str) -> int:
        return int(round(float(number) * _XLA_UNITS[unit]))

    groups = m.groupdict()
    return {"needed_bytes": size(groups["need"], groups["nu"]), "available_bytes": size(groups["have"], groups["hu"]),
            "memory_space": groups["space"].upper(), "what": (groups.get("what") or "").strip() or None,
            "xla_message": xla}
