"""One exception tree for everything stagetool reports to a user.

Library code raises these; only the CLI catches them and turns them into exit codes
(:class:`ExitCode`). Each error carries a message that says where the problem is, what was
wrong and how to fix it.
"""

from __future__ import annotations

import enum


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
