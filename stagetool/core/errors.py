"""One exception tree for everything stagetool reports to a user.

Library code raises these; only the CLI catches them and turns them into exit codes
(:class:`ExitCode`). Each error carries a message that says where the problem is, what was
wrong and how to fix it.
"""

from __future__ import annotations

import enum
import re


class ExitCode(enum.IntEnum):
    """The fixed exit codes of the ``stagetool`` command."""

    OK = 0
    """Success."""
    FINDINGS = 1
    """The command ran and found what it checks for: a regression, a program that does not fit."""
    USAGE = 2
    """A bad option, spec, target or baseline file."""
    JAX = 3
    """JAX or XLA failed to trace, lower or compile the user's function."""
    HUNG_UP = 129
    """Ended by SIGHUP (the terminal closed): 128 + the signal number; handled as SIGTERM is."""
    INTERRUPTED = 130
    """Interrupted by SIGINT (Ctrl-C): 128 + the signal number, as shells report it."""
    TERMINATED = 143
    """Ended by SIGTERM: 128 + the signal number."""


#: What user code (a target module, ``init``, ``{call: ...}``, the traced function) may raise that is
#: that code's failure: every ``Exception`` and ``SystemExit`` (a module that calls ``sys.exit()``
#: must not end a CI gate with exit 0). ``KeyboardInterrupt`` is left to the signal handling.
USER_CODE_ERRORS: tuple[type[BaseException], ...] = (Exception, SystemExit)


def describe_exception(e: BaseException) -> str:
    """``Type: message`` of an exception from user code; ``SystemExit(0)`` reads as what it is."""
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r}) raised (the code called sys.exit or raised SystemExit)"
    return f"{type(e).__name__}: {e}"


class StagetoolError(Exception):
    """Base of every error stagetool reports to a user.

    Attributes:
      exit_code: the process exit code the CLI uses for this error.
      hint: an optional sentence on how to fix it, printed after the message.
    """

    exit_code: ExitCode = ExitCode.USAGE

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class UsageError(StagetoolError):
    """A command-line option or argument is wrong (exit code 2)."""


class TargetError(StagetoolError):
    """The target ``file.py:func`` / ``pkg.mod:obj.attr`` cannot be found or loaded (exit code 2)."""


class SpecError(StagetoolError):
    """The YAML spec is invalid (exit code 2).

    ``issues`` holds every problem found, each already formatted as
    ``file:line:col: key.path: what is wrong``, so that one run reports all of them.
    """

    def __init__(self, issues: list[str], *, hint: str | None = None):
        self.issues = list(issues)
        head = "invalid spec" if len(issues) != 1 else issues[0]
        message = head if len(issues) == 1 else head + ":\n" + "\n".join(f"  {i}" for i in issues)
        super().__init__(message, hint=hint)


class BaselineError(StagetoolError):
    """A baseline snapshot is missing, malformed or of another schema version (exit code 2)."""


class StagingError(StagetoolError):
    """JAX or XLA failed to trace, lower or compile the function (exit code 3).

    Attributes:
      stage: ``"trace"``, ``"lower"`` or ``"compile"``.
      function: the spec's name of the function.
      user_frame: ``"file.py:LINE in func"`` of the innermost frame in the user's own code, or None.
      detail: JAX's or XLA's message unfiltered (with the frames of stagetool and its CLI that the
        message leaves out), for ``--debug``; None when the message is already whole.
    """

    exit_code = ExitCode.JAX

    def __init__(self, message: str, *, stage: str, function: str, user_frame: str | None = None,
                 hint: str | None = None, detail: str | None = None):
        super().__init__(message, hint=hint)
        self.stage = stage
        self.function = function
        self.user_frame = user_frame
        self.detail = detail


class OutOfMemoryError(StagingError):
    """XLA's compile stopped because the program does not fit in device memory (``RESOURCE_EXHAUSTED``
    "ran out of memory"): an answer, not a crash. ``memory``/``report`` show it as a "does not fit"
    verdict; where it escapes it is exit code 3 like any compile failure.

    Attributes:
      needed_bytes: what XLA said the program needs per device, or None when its message has no figure.
      available_bytes: what XLA said is available per device, or None.
      memory_space: the memory XLA named (``HBM``), or None.
      what: what XLA said it was sizing (``HLO temporaries``), or None.
      xla_message: XLA's message, without JAX's exception prefix.
      refused_dump: the :class:`~stagetool.facts.PeakDump` XLA wrote before refusing (a compile with
        XLA's dump: what is live at the peak of the program it refused), or None.
    """

    def __init__(self, message: str, *, stage: str, function: str, user_frame: str | None = None,
                 needed_bytes: int | None = None, available_bytes: int | None = None,
                 memory_space: str | None = None, what: str | None = None, xla_message: str = "",
                 refused_dump: object | None = None):
        super().__init__(message, stage=stage, function=function, user_frame=user_frame)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.memory_space = memory_space
        self.what = what
        self.xla_message = xla_message
        self.refused_dump = refused_dump


_BACKEND = re.compile(r"Unable to initialize backend '([^']+)'")
_CALLBACK = re.compile(r"(?:Cpu|Gpu|Tpu)?Callback error|error calling callback|callback (?:failed|raised)", re.I)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|out of memory", re.IGNORECASE)


def out_of_memory(e: BaseException, *, who: str = "this run", inputs_bytes: float | None = None,
                  hint: str | None = None) -> UsageError | None:
    """The runtime's out-of-memory failure as one line, or None where ``e`` is none: the host's
    ``MemoryError``, or XLA's ``RESOURCE_EXHAUSTED`` at run time (``Out of memory allocating ...``,
    ``Error allocating device buffer: ...``). XLA's refusal at compile time is an
    :class:`OutOfMemoryError` instead (the pipeline's "does not fit").

    The line says who ran out (``who``: ``--measure: decode`` for a function measured, else this
    run), of which memory (host, or device memory on the attached device), what its inputs take
    (``inputs_bytes``, in GiB, when given) and the runtime's own first line (at most 300 characters):
    ``--measure: decode ran out of device memory on the attached device (its inputs take 8.20 GiB):
    RESOURCE_EXHAUSTED: Error allocating device buffer: ...``.
    """
    if not isinstance(e, MemoryError) and not _OUT_OF_MEMORY.search(str(e)):
        return None
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    memory = "host memory" if isinstance(e, MemoryError) else "device memory on the attached device"
    need = f" (its inputs take {inputs_bytes / 2**30:.2f} GiB)" if inputs_bytes else ""
    return UsageError(f"{who} ran out of {memory}{need}: {first[:300]}", hint=hint)


def known_failure(e: BaseException, *, library: tuple[str, ...] = ()) -> StagetoolError | None:
    """The user's or the machine's failure that escaped as a raw exception, as stagetool says it (one
    line naming the cause), or None where ``e`` is none of these (a stagetool bug: "unexpected").

    * ``MemoryError``, and XLA's ``RESOURCE_EXHAUSTED`` at run time (``--measure``): the machine's
      memory, exit 2 (:func:`out_of_memory`).
    * JAX's ``Unable to initialize backend 'tpu'`` (``JAX_PLATFORMS=tpu`` where there is no TPU):
      the environment, exit 2.
    * A host callback (``jax.pure_callback``, ``io_callback``, ``jax.debug.callback``) that raised
      while the step ran: the user's code failing inside JAX, exit 3 with its exception and its
      innermost frame outside ``library`` (folders of installed packages).

    Args:
      e: the exception that escaped.
      library: folder prefixes whose frames are not the user's (site-packages, stagetool).
    """
    text = str(e)
    first = (text.strip().splitlines() or [""])[0]
    oom = out_of_memory(e, hint="free memory (fewer --jobs, other processes), or stage a smaller program "
                                "(--measure runs the step on this machine's devices for real)")
    if oom is not None:
        return oom
    m = _BACKEND.search(first)
    if m:
        import os

        env = os.environ.get("JAX_PLATFORMS")
        given = f" (JAX_PLATFORMS={env})" if env else ""
        return UsageError(f"JAX could not start its '{m.group(1)}' backend{given}: {first[m.end():].strip(' :')}",
                          hint="run where that device is attached, or unset JAX_PLATFORMS (or set it to a backend "
                               "this machine has, e.g. cpu)")
    if _CALLBACK.search(text):
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        raised = next((ln for ln in reversed(lines) if re.match(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b", ln)),
                      lines[-1] if lines else first)
        frames = [f for f in _FRAME.findall(text) if not f[0].startswith(library) and "/site-packages/" not in f[0]]
        frame = f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else None
        return StagingError(f"a host callback raised while the step ran: {raised}", stage="run", function="",
                            user_frame=frame)
    return None


def missing_dependency(e: BaseException, own: str) -> UsageError | None:
    """A module stagetool or an installed library needs that is missing (``typer`` importing
    ``annotated_doc``), as one usage error naming it, who needs it and how to install it; None where
    ``e`` is no ``ImportError`` or the import that failed was the user's own code's.

    Args:
      e: the exception that escaped.
      own: stagetool's package folder (imports from its files, or from installed packages, are
        stagetool's dependencies).
    """
    import traceback

    if not isinstance(e, ImportError):
        return None
    frames = traceback.extract_tb(e.__traceback__)
    name = getattr(e, "name", None) or ""
    top = name.split(".")[0]
    importers = [f for f in frames if not (top and f"/{top}/" in f.filename or f.filename.endswith(f"/{top}.py"))
                 and not f.filename.startswith("<frozen")]
    if not importers:
        return None
    where = importers[-1].filename
    library = ("/site-packages/", "/dist-packages/")
    if not (where.startswith(own) or any(s in where for s in library)):
        return None
    by = "stagetool"
    for marker in library:
        if marker in where:
            by = where.split(marker, 1)[1].split("/", 1)[0].removesuffix(".py")
    what = f"'{name}'" if name else str(e)
    pip = (top or "the package").replace("_", "-")
    return UsageError(f"a dependency of stagetool is missing: {by} needs the module {what}, which cannot be imported "
                      f"({type(e).__name__}: {e})",
                      hint=f"install it (pip install {pip}), or reinstall stagetool with its dependencies "
                           "(pip install --force-reinstall stagetool)")
