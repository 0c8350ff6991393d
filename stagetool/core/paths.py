"""The report root: the one folder that every user path in a report is written relative to.

A report names files: the source line of a collective and its ``via`` chain, a peak buffer's line,
a leaf's spec line (``file:line:col``), a failure's user frame. JAX hands them over as the absolute
paths the user's modules were imported from (stagetool imports a target file by its resolved path),
and spec locations as the spec path the run was given. Written as they come, the same command prints
other paths from another working directory or another checkout of the same project, and the facts
cache could never hit from another checkout (its key holds the ops' source locations).

:class:`ReportRoot` fixes that in one place. The root is the spec file's folder — the folder its
``target:`` paths are relative to (:func:`report_root`; a spec with no file: the folder of its first
``file.py`` target, else the working directory). :meth:`ReportRoot.relative` writes every path
below the root relative to it (``/home/me/proj/models/mlp.py:27`` → ``mlp.py:27`` for a spec in
``models/``, ``layers/attn.py:41`` for a file in a subfolder); a path outside it (site-packages, a
library, a model beside but not below the spec) stays absolute, so it can still be opened. The
pipeline applies it to each function's report (:func:`relative_report`), so the text, Markdown,
HTML and JSON renderers, snapshots, ``check``/``diff`` and sweeps read the same paths, the same
from any working directory. The facts cache keys and stores with :meth:`ReportRoot.portable` (the
root written as :data:`ROOT_TOKEN`) and reads back with :meth:`ReportRoot.local`, so an entry made
in one checkout is a hit in another and reads as that checkout's own compile would.

What counts as a path below the root is textual: the root folder (resolved, or as an absolute path
through a link) followed by ``/``, or the spec file as the run was given it, each only where a path
can start (not inside another path or word: ``/x/<root>/`` is left alone).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Iterable

ROOT_TOKEN = "<stagetool-root>"
"""How a cache entry writes the report root (a text no path or XLA name contains)."""

#: characters that may not stand right before a path start (they would make it part of another path or word)
_NOT_BEFORE = r"(?<![\w.~/@+\-])"
#: a root XLA and MLIR print verbatim inside quoted strings: anything else is escaped somewhere, and a
#: root with such characters is not rewritten for the cache (its entries stay with their checkout)
_PLAIN = re.compile(r"[A-Za-z0-9_./+@~,=\- ]+")


@dataclasses.dataclass(frozen=True)
class ReportRoot:
    """The folder report paths are relative to, and the spellings that name it.

    Attributes:
      folder: the root, absolute and resolved (``/home/me/proj/models``), without a trailing ``/``.
      aliases: the root's other absolute spellings (through a symbolic link), without ``/`` at the end.
      spec: the spec file as the run was given it when that is a relative path (``models/mlp.stagetool.yaml``:
        spec locations, ``file:line:col``, are written with it), else None.
    """

    folder: str
    aliases: tuple[str, ...] = ()
    spec: str | None = None

    def __post_init__(self) -> None:
        prefixes = sorted({p.rstrip("/") for p in (self.folder, *self.aliases) if p and p != "/"}, key=len,
                          reverse=True)
        parts = [re.escape(p) + "/" for p in prefixes]
        if self.spec:
            parts.append(re.escape(self.spec) + r"(?=[:\"')\s]|$)")
        pattern = re.compile(_NOT_BEFORE + "(?:" + "|".join(parts) + ")") if parts else None
        object.__setattr__(self, "_pattern", pattern)
        object.__setattr__(self, "_needles", tuple(p + "/" for p in prefixes) + ((self.spec,) if self.spec else ()))
        object.__setattr__(self, "_spec_name", Path(self.spec).name if self.spec else "")

    def _sub(self, text: str, below: str) -> str:
        if not text or self._pattern is None or not any(n in text for n in self._needles):
            return text  # the common case, and a compiled module of tens of MB: one substring search each
        return self._pattern.sub(lambda m: below if m.group(0).endswith("/") else below + self._spec_name, text)

    def relative(self, text: str) -> str:
        """``text`` with every path below the root written relative to it; other text unchanged."""
        return self._sub(text, "")

    @property
    def plain(self) -> bool:
        """Whether the root's spellings are printed verbatim by XLA and MLIR (no quote, backslash,
        non-ASCII...): only then can :meth:`portable` find every one of them in a compiled text."""
        return all(_PLAIN.fullmatch(p) for p in (self.folder, *self.aliases, *([self.spec] if self.spec else [])))

    def portable(self, text: str) -> str:
        """``text`` with every path below the root written from :data:`ROOT_TOKEN` (``<stagetool-root>/mlp.py``;
        the given spec path too): the same in every checkout of the project and however the spec was
        named (the facts cache's key and entries)."""
        return self._sub(text, ROOT_TOKEN + "/")

    def local(self, text: str) -> str:
        """The inverse of :meth:`portable` for this run: :data:`ROOT_TOKEN` written back as this root
        (absolute: a spec location comes back as an absolute path, which :meth:`relative` shortens
        like the given one)."""
        if not text or ROOT_TOKEN not in text:
            return text
        return text.replace(ROOT_TOKEN + "/", self.folder + "/")


def report_root(spec_path: str | Path | None, targets: Iterable[str] = (), cwd: str | Path | None = None
                ) -> ReportRoot:
    """The :class:`ReportRoot` of a run: the spec file's folder.

    Args:
      spec_path: the spec file as the run was given it (``--spec``, or the one found), or None for a
        spec that has no file (built in Python).
      targets: the functions' targets, used only without a spec file: the folder of the first
        ``file.py`` target (relative ones against ``cwd``), else ``cwd``.
      cwd: the working directory (default: the process's).
    """
    cwd = Path(cwd) if cwd is not None else Path.cwd()
    spec_given = None
    if spec_path is not None:
        given = Path(spec_path)
        absolute = given if given.is_absolute() else cwd / given
        if not given.is_absolute():
            spec_given = str(given)  # as a spec location writes it (``load_spec``: ``str(Path(path))``)
        folder_abs = Path(os.path.normpath(absolute)).parent
    else:
        folder_abs = cwd
        for t in targets:
            module = t.rpartition(":")[0]
            if module.endswith(".py"):
                p = Path(module)
                folder_abs = Path(os.path.normpath(p if p.is_absolute() else cwd / p)).parent
                break
    resolved = folder_abs.resolve()
    aliases = tuple(str(p) for p in {folder_abs, Path(os.path.abspath(folder_abs))} if str(p) != str(resolved))
    return ReportRoot(str(resolved), tuple(sorted(aliases)), spec_given)


def rewrite_strings(value: Any, fn, *, skip: frozenset[str] = frozenset()) -> Any:
    """``value`` with ``fn`` applied to every string in it: in frozen dataclasses (rebuilt with
    :func:`dataclasses.replace`; fields named in ``skip`` left as they are), tuples, lists and dict
    values. Other values are returned as they are (the same object when nothing changed)."""
    if isinstance(value, str):
        new = fn(value)
        return value if new == value else new
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if f.name in skip or not f.init:
                continue
            old = getattr(value, f.name)
            new = rewrite_strings(old, fn, skip=skip)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, (tuple, list)):
        items = [rewrite_strings(v, fn, skip=skip) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        out = {k: rewrite_strings(v, fn, skip=skip) for k, v in value.items()}
        return value if all(out[k] is value[k] for k in value) else out
    return value
