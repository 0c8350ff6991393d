"""The report root: the one folder that every user path in a report is written relative to.

A report names files: the source line of a collective and its ``via`` chain, a peak buffer's line,
a leaf's spec line (``file:line:col``), a failure's user frame. JAX hands them over as the absolute
paths the user's modules were imported from (stagetool imports a target file by its resolved path),
and spec locations as the spec path the run was given. Written as they come, the same command prints
other paths from another working directory or another checkout of the same project, and the facts
cache could never hit from another checkout (its key holds the ops' source locations).

:class:`ReportRoot` fixes that in one place. The root is the spec file's folder — the folder its
``target:`` paths are relative to (:func:`report_root`; a spec with no file: the folder of its first
``file.py`` target, else the working directory). Around it is **the project**
(:func:`find_project`): the nearest folder at or above the root that holds ``.git``,
``pyproject.toml``, ``setup.py`` or ``setup.cfg`` — never the filesystem root or the home folder
(a marker there is not a project; then there is none). :meth:`ReportRoot.relative` writes every
path in the project relative to the spec's folder: ``/home/me/proj/models/mlp.py:27`` →
``mlp.py:27`` for a spec in ``models/``, ``layers/attn.py:41`` for a file in a subfolder,
``../src/model.py:27`` for a spec in ``configs/`` beside ``src/``. A path outside the project (or
outside the spec's folder when there is no project) stays absolute, and so does every path in a
Python environment even inside the project — the running interpreter's prefixes (a ``.venv/`` in
the project) and any path through a ``site-packages``/``dist-packages`` folder — so library frames
can still be opened (stagetool's own frames, :func:`caller_folders`, are never rewritten). The
pipeline applies it to each function's report (:func:`relative_report`),
so the text, Markdown, HTML and JSON renderers, snapshots, ``check``/``diff`` and sweeps read the
same paths, the same from any working directory or checkout.

The facts cache keys and stores with :meth:`ReportRoot.portable` — every path in the project (its
environments included: a checkout's own ``.venv`` is at the same place in the other checkout) written
from :data:`ROOT_TOKEN`, which stands for the project's folder (the spec's folder when there is no
project) — and reads back with :meth:`ReportRoot.local`, so an entry made in one checkout is a hit
in another and reads as that checkout's own compile would. The spec folder's place in the project
(:attr:`ReportRoot.position`) is part of the key too.

What counts as a path in the root or the project is textual: one of their folders (resolved, or as
an absolute path through a link) followed by ``/``, or the spec file as the run was given it, each
only where a path can start (not inside another path or word: ``/x/<root>/`` is left alone).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

ROOT_TOKEN = "<stagetool-root>"
"""How a cache entry writes the project's folder (the spec's folder when there is no project): a
text no path or XLA name contains."""

PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")
"""What makes a folder a project's top (:func:`find_project`): any of these in it (``.git`` a folder,
or a file in a git worktree or submodule)."""

#: characters that may not stand right before a path start (they would make it part of another path or word)
_NOT_BEFORE = r"(?<![\w.~/@+\-])"
#: a root XLA and MLIR print verbatim inside quoted strings: anything else is escaped somewhere, and a
#: root with such characters is not rewritten for the cache (its entries stay with their checkout)
_PLAIN = re.compile(r"[A-Za-z0-9_./+@~,=\- ]+")
#: the rest of a path after a matched folder (up to a quote, a space or a bracket)
_REST = re.compile(r"[^\s\"'()<>,;|]*")
#: a path through an installed-packages folder: a library, whatever environment it is in
_INSTALLED = re.compile(r"(?:^|/)(?:site|dist)-packages/")


@dataclasses.dataclass(frozen=True)
class ReportRoot:
    """The folder report paths are relative to, the project around it, and the spellings that name them.

    Attributes:
      folder: the root (the spec's folder), absolute and resolved (``/home/me/proj/configs``), without
        a trailing ``/``.
      aliases: the root's other absolute spellings (through a symbolic link), without ``/`` at the end.
      spec: the spec file as the run was given it when that is a relative path (``configs/m.stagetool.yaml``:
        spec locations, ``file:line:col``, are written with it), else None.
      project: the project's folder (:func:`find_project`), absolute and resolved: ``folder`` or one of
        its ancestors; None when there is none (then only paths below ``folder`` are rewritten).
      project_aliases: the project folder's other absolute spellings (through a symbolic link).
      environments: folders of Python installs and environments inside the project or root (the
        running interpreter's prefixes and site folders, resolved and as spelled): paths below them
        stay absolute in reports (the cache's portable form still writes them from the token).
      foreign: folders inside the project that are not the user's and whose paths the facts-cache key
        does not hold (:func:`caller_folders`: stagetool's package in a checkout of stagetool, typer in
        a project-local virtualenv): never rewritten, not even for the cache.

    Raises:
      ValueError: ``project`` is neither ``folder`` nor one of its ancestors.
    """

    folder: str
    aliases: tuple[str, ...] = ()
    spec: str | None = None
    project: str | None = None
    project_aliases: tuple[str, ...] = ()
    environments: tuple[str, ...] = ()
    foreign: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        folder = Path(self.folder)
        base = Path(self.project) if self.project else folder
        if base != folder and base not in folder.parents:
            raise ValueError(f"the project {self.project} does not hold the report root {self.folder}")
        position = folder.relative_to(base).as_posix()
        position = "" if position == "." else position + "/"
        # each folder spelling + "/" -> (its display, relative to the spec's folder; its portable form)
        table: dict[str, tuple[str, str]] = {}
        for spelling in (self.folder, *self.aliases):
            table.setdefault(spelling.rstrip("/") + "/", ("", ROOT_TOKEN + "/" + position))
        depth = len(folder.relative_to(base).parts)
        for up, ancestor in enumerate([p for p in folder.parents if p == base or base in p.parents], 1):
            inside = ancestor.relative_to(base).as_posix()
            table.setdefault(str(ancestor).rstrip("/") + "/",
                             ("../" * up, ROOT_TOKEN + "/" + ("" if inside == "." else inside + "/")))
        for spelling in self.project_aliases:
            table.setdefault(spelling.rstrip("/") + "/", ("../" * depth, ROOT_TOKEN + "/"))
        table.pop("/", None)  # the filesystem root is never a report root's spelling
        parts = [re.escape(p) for p in sorted(table, key=len, reverse=True)]
        if self.spec:
            parts.append(re.escape(self.spec) + r"(?=[:\"')\s]|$)")
        pattern = re.compile(_NOT_BEFORE + "(?:" + "|".join(parts) + ")") if parts else None
        spec_name = Path(self.spec).name if self.spec else ""
        object.__setattr__(self, "_pattern", pattern)
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_needles", tuple(table) + ((self.spec,) if self.spec else ()))
        object.__setattr__(self, "_spec_forms", (spec_name, ROOT_TOKEN + "/" + position + spec_name))
        object.__setattr__(self, "_environments", tuple(e.rstrip("/") + "/" for e in self.environments))
        object.__setattr__(self, "_foreign", tuple(e.rstrip("/") + "/" for e in self.foreign))
        object.__setattr__(self, "_position", position.rstrip("/") or ".")

    @property
    def base(self) -> str:
        """The folder :data:`ROOT_TOKEN` stands for: the project's, else the root's."""
        return self.project or self.folder

    @property
    def position(self) -> str:
        """The root's place in the project, ``/``-separated (``configs``; ``.`` when it is the project's
        top or there is no project): a facts-cache key part."""
        return self._position

    def _installed(self, text: str, start: int, end: int) -> bool:
        """Whether the path matched at ``text[start:end]`` is in a Python install or environment."""
        if any(text.startswith(e, start) for e in self._environments):
            return True
        return bool(_INSTALLED.search(_REST.match(text, end).group(0)))

    def _sub(self, text: str, portable: bool) -> str:
        if not text or self._pattern is None or not any(n in text for n in self._needles):
            return text  # the common case, and a compiled module of tens of MB: one substring search each

        table, spec_forms, foreign = self._table, self._spec_forms, self._foreign
        foreign = tuple(f for f in foreign if f in text)
        # paths in an environment are kept in reports: looked at only when the text can hold one
        installed = not portable and ("-packages/" in text or any(e in text for e in self._environments))

        def replace(m: re.Match) -> str:
            found = m.group(0)
            forms = table.get(found) or spec_forms
            if foreign and any(text.startswith(f, m.start()) for f in foreign):
                return found
            if portable:
                return forms[1]
            return found if installed and self._installed(text, m.start(), m.end()) else forms[0]

        return self._pattern.sub(replace, text)

    def relative(self, text: str) -> str:
        """``text`` with every path in the project (no project: below the root) written relative to the
        root (``mlp.py:27``, ``../src/m.py:27``), except paths in a Python install or environment;
        other text unchanged."""
        return self._sub(text, False)

    @property
    def plain(self) -> bool:
        """Whether the root's and the project's spellings are printed verbatim by XLA and MLIR (no
        quote, backslash, non-ASCII...): only then can :meth:`portable` find every one of them in a
        compiled text."""
        return all(_PLAIN.fullmatch(p) for p in (*self._table, *([self.spec] if self.spec else [])))

    def portable(self, text: str) -> str:
        """``text`` with every path in the project (no project: below the root) written from
        :data:`ROOT_TOKEN` (``<stagetool-root>/src/m.py``; the given spec path too), environments
        included: the same in every checkout of the project and however the spec was named (the
        facts cache's key and entries)."""
        return self._sub(text, True)

    def local(self, text: str) -> str:
        """The inverse of :meth:`portable` for this run: :data:`ROOT_TOKEN` written back as this
        project's folder (absolute: a spec location comes back as an absolute path, which
        :meth:`relative` shortens like the given one)."""
        if not text or ROOT_TOKEN not in text:
            return text
        return text.replace(ROOT_TOKEN + "/", self.base + "/")


def _home() -> Path | None:
    try:
        return Path.home().resolve()
    except (RuntimeError, KeyError, OSError):
        return None


def find_project(folder: str | Path) -> Path | None:
    """The project ``folder`` is in: the nearest of ``folder`` and its ancestors that holds one of
    :data:`PROJECT_MARKERS`, or None. The search stops below the home folder and the filesystem root
    (a dotfiles ``~/.git`` or a ``/setup.py`` makes no project).

    Args:
      folder: an absolute, resolved folder (the report root).
    """
    home = _home()
    for candidate in (Path(folder), *Path(folder).parents):
        if candidate == home or candidate.parent == candidate:
            return None
        if any(os.path.lexists(candidate / m) for m in PROJECT_MARKERS):
            return candidate
    return None


def python_environments(within: str | Path) -> tuple[str, ...]:
    """The running Python's install and environment folders strictly below ``within`` (its
    prefixes — a virtualenv's folder —, standard library and site folders), resolved and as
    spelled, sorted: what :class:`ReportRoot` keeps absolute inside a project."""
    import site
    import sysconfig

    found = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    paths = sysconfig.get_paths()
    found.update(paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths)
    try:
        found.update(site.getsitepackages())
        if site.ENABLE_USER_SITE:
            found.add(site.getusersitepackages())
    except AttributeError:  # an embedded or old-style site module
        pass
    within = Path(within)
    out = set()
    for f in found:
        if not f:
            continue
        for spelling in (Path(os.path.abspath(f)), Path(f).resolve()):
            if within in spelling.parents:
                out.add(str(spelling))
    return tuple(sorted(out))


def caller_folders() -> tuple[str, ...]:
    """Folders of the code that calls the user's function: stagetool's package, and its CLI's typer
    and click (resolved). Their frames are not the program's: the facts-cache key leaves them out
    (``staging.cache.source_locations``) and :class:`ReportRoot` never rewrites them."""
    import importlib.util

    dirs = [str(Path(__file__).resolve().parents[1])]
    for name in ("typer", "click"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin:
            dirs.append(str(Path(spec.origin).resolve().parent))
    return tuple(dirs)


def report_root(spec_path: str | Path | None, targets: Iterable[str] = (), cwd: str | Path | None = None
                ) -> ReportRoot:
    """The :class:`ReportRoot` of a run: the spec file's folder, in its project (:func:`find_project`).

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
    aliases = tuple(sorted(str(p) for p in {folder_abs, Path(os.path.abspath(folder_abs))} if str(p) != str(resolved)))
    project = find_project(resolved)
    project_aliases: set[str] = set()
    if project is not None and project != resolved:
        for alias in aliases:  # the project's spelling through the same link, if the link is below it
            for parent in Path(alias).parents:
                if str(parent) != str(project) and parent.resolve() == project:
                    project_aliases.add(str(parent))
    within = project or resolved
    environments = python_environments(within)
    foreign = tuple(f for f in caller_folders() if within in Path(f).parents)
    return ReportRoot(str(resolved), aliases, spec_given, str(project) if project else None,
                      tuple(sorted(project_aliases)), environments, foreign)


def rewrite_strings(value: Any, fn, *, skip: frozenset[str] = frozenset()) -> Any:
    """``value`` with ``fn`` applied to every string in it but the record fields named in ``skip``
    (:func:`stagetool.core.codec.map_strings`; the same object where nothing changed)."""
    from stagetool.core.codec import map_strings

    return map_strings(value, fn, skip=skip)


_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "equinox", "chex", "orbax", "typer", "click", "rich")

def library_dirs() -> tuple[str, ...]:
    """Folders whose frames are never the user's: stagetool, JAX, Flax, optax, Equinox, Typer, the
    standard library, site-packages (also where a library is installed elsewhere, e.g. editable).

    Resolved once per set of those libraries imported (a program that imports Flax later gets its
    folder then): a caller that asks once per frame or per module (thousands in a notebook that
    imported Keras) pays for the dictionary lookup only."""
    loaded = tuple((name, getattr(sys.modules.get(name), "__file__", None)) for name in _LIBRARIES)
    return _library_dirs(loaded)


@functools.lru_cache(maxsize=8)
def _library_dirs(loaded: tuple[tuple[str, str | None], ...]) -> tuple[str, ...]:
    import sysconfig

    dirs = {str(Path(__file__).resolve().parents[1]) + "/"}
    installed = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = installed.get(key)
        if p:
            dirs.add(str(Path(p).resolve()) + "/")
    for _, file in loaded:
        if isinstance(file, str):
            dirs.add(str(Path(file).resolve().parent) + "/")
    return tuple(sorted(dirs))


def is_library_file(filename: str, library: tuple[str, ...] | None = None) -> bool:
    """Whether a source file belongs to a library (see :func:`library_dirs`) rather than the user.

    ``<frozen ...>``/``<string>`` pseudo-files count as library code; a relative path (as HLO
    metadata may record it) is resolved against the working directory. ``library``: the folders of
    :func:`library_dirs` when the caller already holds them (a loop over many frames), else read here.
    """
    if not filename or filename.startswith("<"):
        return True
    resolved = str(Path(filename).resolve())
    dirs = library_dirs() if library is None else library
    return any(resolved.startswith(d) for d in dirs) or "/site-packages/" in resolved \
        or "/dist-packages/" in resolved
