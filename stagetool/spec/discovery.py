"""Finding the spec when ``--spec`` is not given, and splitting a ``module:attr`` TARGET."""

from __future__ import annotations

from pathlib import Path

from stagetool.core.errors import TargetError, UsageError


def split_target(text: str) -> tuple[str, str]:
    """Split ``module:attr`` at the last colon (so Windows-style ``C:`` drive letters survive).

    Raises:
      TargetError: when there is no ``:attr`` part.
    """
    module, sep, attr = text.rpartition(":")
    if not sep or not module or not attr:
        raise TargetError(
            f"target {text!r} must be 'path/to/file.py:func', 'package.module:func' or 'module:obj.attr'",
            hint="name the function after a colon, e.g. examples/mlp.py:train_step")
    return module, attr


def spec_candidates(target: str | None, cwd: Path | None = None) -> list[Path]:
    """The paths tried, in order, when ``--spec`` is not given.

    1. ``<module stem>.stagetool.yaml`` beside a ``file.py`` target;
    2. ``stagetool.yaml`` in the working directory.

    Raises:
      TargetError: ``target`` is not ``file.py:func`` / ``pkg.mod:func`` (checked first, so that a
        TARGET without ``:func`` is reported as such rather than as "no spec found").
    """
    cwd = cwd or Path.cwd()
    out: list[Path] = []
    if target:
        module = split_target(target)[0]
        if module.endswith(".py"):
            p = Path(module)
            out.append(p.with_name(p.stem + ".stagetool.yaml"))
    out.append(cwd / "stagetool.yaml")
    return out


def find_spec(target: str | None) -> tuple[Path | None, list[Path]]:
    """Return the first existing candidate of :func:`spec_candidates` (or None) and every path tried.

    Without a TARGET and with none of the candidates present, a single ``*.stagetool.yaml`` in the
    working directory is taken.

    Raises:
      TargetError: ``target`` has no ``:func`` part (see :func:`spec_candidates`).
      UsageError: two or more ``*.stagetool.yaml`` in the working directory make the search
        ambiguous; the message lists the paths tried and the files found, and says to pass ``--spec``.
    """
    tried = spec_candidates(target)
    for p in tried:
        if p.is_file():
            return p, tried
    if not target:
        pattern = Path.cwd() / "*.stagetool.yaml"
        found = sorted(Path.cwd().glob("*.stagetool.yaml"))
        tried.append(pattern)
        if len(found) == 1:
            return found[0], tried
        if len(found) > 1:
            from stagetool.core.errors import UsageError

            raise UsageError(
                "no single spec found; tried " + ", ".join(str(p) for p in tried)
                + f" ({len(found)} found: {', '.join(p.name for p in found)} — pass --spec)",
                hint="pass --spec FILE to choose one")
    return None, tried


def resolve_spec(spec: str | Path | None, target: str | None) -> Path:
    """The spec file to read: ``spec`` (``--spec``) when given, else the one :func:`find_spec` finds.

    Raises:
      UsageError: none was given and none is found (the message names every path tried); or the
        search is ambiguous (see :func:`find_spec`).
      TargetError: ``target`` has no ``:func`` part.
    """
    if spec is not None:
        return Path(spec)
    found, tried = find_spec(target)
    if found is None:
        raise UsageError("no spec found; tried " + ", ".join(str(p) for p in tried),
                         hint="pass --spec FILE, or write one of those files (docs/spec.md)")
    return found
