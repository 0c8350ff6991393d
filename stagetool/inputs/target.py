"""Load the user's function from ``path/to/file.py:func``, ``package.module:func`` or ``module:obj.attr``.

A file target is imported the way pytest's default ("prepend") import mode imports a test file:
the first folder above the file that is not a package goes to the front of ``sys.path``, and the
file is imported under its dotted name from there, so that the file's sibling modules (and its
package, if it is in one) import as they do in the user's own scripts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from stagetool.core.errors import USER_CODE_ERRORS, TargetError, describe_exception
from stagetool.core.paths import is_library_file
from stagetool.spec.discovery import split_target


@dataclasses.dataclass(frozen=True)
class Target:
    """A loaded target.

    Attributes:
      text: the target as the user wrote it.
      fn: the callable (possibly already ``jax.jit``-wrapped).
      module_file: the file of the module that defines it, or None (used to find the user's frame
        in tracebacks).
      qualname: ``obj.attr`` part.
    """

    text: str
    fn: Callable[..., Any]
    module_file: str | None
    qualname: str


def load_target(text: str, *, base_dir: Path | None = None, need_callable: bool = True) -> Target:
    """Import the module of ``text`` and return the named attribute.

    Args:
      text: ``path/to/file.py:func``, ``package.module:func`` or ``module:obj.attr``.
      base_dir: the folder a relative file path resolves against (the spec's folder); the working
        directory when None.
      need_callable: refuse an attribute that is not callable (a ``{ref: ...}`` or a rules object
        may be any value).

    Raises:
      TargetError: the file, module or attribute does not exist (with close matches), the module
        fails to import (with the exception and the user's frame), or the attribute is not callable.
    """
    module_part, attr = split_target(text)
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        module = _import_file(text, module_part, base_dir)
    else:
        module = _import_module(text, module_part, base_dir)
    obj: Any = module
    walked: list[str] = []
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3, cutoff=0.5)
            where = ".".join([module.__name__, *walked])
            raise TargetError(
                f"target {text!r}: {where} has no attribute {part!r}"
                + (f"; close matches: {', '.join(close)}" if close else ""),
                hint=None if close else f"callables there: {', '.join(sorted(n for n in names if callable(getattr(obj, n, None)))[:12])}")
        obj = getattr(obj, part)
        walked.append(part)
    if need_callable and not callable(obj):
        raise TargetError(f"target {text!r} is a {type(obj).__name__}, not a callable")
    return Target(text, obj, getattr(module, "__file__", None), attr)


def _import_file(text: str, module_part: str, base_dir: Path | None) -> Any:
    path = Path(module_part)
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        folder = path.parent
        candidates = sorted(p.name for p in folder.glob("*.py")) if folder.is_dir() else []
        close = difflib.get_close_matches(path.name, candidates, n=3, cutoff=0.5)
        raise TargetError(
            f"target {text!r}: file {path} not found"
            + (f"; close matches in {folder}: {', '.join(close)}" if close else ""),
            hint=None if folder.is_dir() else f"the folder {folder} does not exist either")
    # Like pytest's prepend import mode: the first ancestor that is not a package is the root.
    root = path.parent
    parts = [path.stem]
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    name = ".".join(parts)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != path:
        # A different module of the same name is already imported (e.g. two examples named model.py).
        del sys.modules[name]
    return _import(text, name, user_file=str(path))


def _import_module(text: str, name: str, base_dir: Path | None = None) -> Any:
    """Import a ``package.module`` target with the working directory on ``sys.path``, as ``python -m``
    does. Not found there, but found in ``base_dir`` (the spec's folder): the hint says to run from
    that folder or put it on ``PYTHONPATH`` (a module target is not resolved against the spec)."""
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does
    try:
        return _import(text, name, user_file=None)
    except TargetError as e:
        top = name.partition(".")[0]
        beside = None
        if base_dir is not None and "no module named" in e.message:
            folder = Path(base_dir).resolve()
            if (folder / top).is_dir() or (folder / f"{top}.py").is_file():
                beside = folder
        if beside is None or Path(cwd).resolve() == beside:
            raise
        raise TargetError(e.message, hint=f"{top} is in the spec's folder {beside}, but a module target "
                                           f"imports from the working directory, as python -m does: run "
                                           f"stagetool from {beside}, or with it on PYTHONPATH") from None


def _import(text: str, name: str, user_file: str | None) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            parent, _, leaf = e.name.rpartition(".")
            import pkgutil

            try:
                package = importlib.import_module(parent) if parent else None
                paths = package.__path__ if package is not None else None
            except Exception:
                package, paths = None, None
            names = [m.name for m in pkgutil.iter_modules(paths)]
            close = difflib.get_close_matches(leaf, names, n=3, cutoff=0.6)
            hint = "a file target needs its path and .py, e.g. examples/mlp.py:train_step"
            if package is not None and hasattr(package, leaf):  # flax.nnx.metrics: an attribute of flax.nnx
                rest = ".".join(filter(None, (name[len(e.name) + 1:], split_target(text)[1])))
                hint = (f"{leaf} is an attribute of the module {parent}, not a module of its own: name it "
                        f"{parent}:{leaf}" + (f".{rest}" if rest else ""))
            raise TargetError(f"target {text!r}: no module named {e.name!r}"
                              + (f"; close matches: {', '.join(close)}" if close else ""), hint=hint) from None
        raise TargetError(f"target {text!r}: importing {name} failed: {e}" + _frame_note(e, user_file)) from None
    except USER_CODE_ERRORS as e:  # SystemExit too: a module that exits is a module that failed
        raise TargetError(f"target {text!r}: importing {name} failed: {describe_exception(e)}"
                          + _frame_note(e, user_file), hint=_relative_import_hint(e, text, user_file)) from None


def _relative_import_hint(exc: BaseException, text: str, user_file: str | None) -> str | None:
    """For a file target whose module (or one it imports) uses relative imports outside a package
    (a folder without ``__init__.py``): the module form to name it by and the folder to run from.

    The package root is the folder as many levels above the failing file as its deepest relative
    import reaches (``from ..common import x``: two); None for any other error.
    """
    import ast

    if not (isinstance(exc, ImportError) and "relative import" in str(exc) and user_file):
        return None
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith(".py")]
    failing = Path(frames[-1].filename).resolve() if frames else Path(user_file).resolve()
    try:
        tree = ast.parse(failing.read_text())
        level = max([n.level for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + [1])
    except (OSError, SyntaxError, ValueError):
        level = 1
    if level >= len(failing.parents):
        return None
    root = failing.parents[level]
    target = Path(user_file).resolve()
    try:
        module = ".".join(target.relative_to(root).with_suffix("").parts)
    except ValueError:
        return None
    attr = split_target(text)[1]
    return (f"{failing.name} imports relative to its package (from {'.' * level} imports), and a file target in a folder "
            f"without __init__.py is imported as a top-level module: name it in the module form, {module}:{attr} "
            f"(on the command line, or as the spec's target with --spec), "
            f"and run stagetool from {root} (or with {root} on PYTHONPATH); or add an __init__.py to its folders")


def _frame_note(exc: BaseException, user_file: str | None) -> str:
    frame = user_frame(exc, [user_file] if user_file else [])
    return f"\n  at {frame}" if frame else ""


def user_frame(exc: BaseException, user_files: list[str]) -> str | None:
    """The innermost traceback frame of ``exc`` in the user's code, as ``file:line in func``.

    The user's code is any file outside the libraries (:func:`is_library_file`: JAX, Flax, optax,
    Equinox, the standard library, site-packages, stagetool itself), wherever it lies: a helper in
    another folder than the target's is the user's too. Where every frame is a library's,
    the innermost frame in ``user_files`` (a target installed in site-packages) is taken.
    """
    tb = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    own = str(Path(__file__).resolve().parents[1]) + "/"
    tb = [fr for fr in tb if fr.filename.startswith("<") or not str(Path(fr.filename).resolve()).startswith(own)]
    chosen = None
    for fr in tb:
        if not fr.filename.startswith("<") and not is_library_file(fr.filename):
            chosen = fr
    if chosen is None:
        resolved = {str(Path(f).resolve()) for f in user_files if f}
        for fr in tb:
            if str(Path(fr.filename).resolve()) in resolved:
                chosen = fr
    if chosen is None:
        return None
    return f"{chosen.filename}:{chosen.lineno} in {chosen.name}" + (f"\n    {chosen.line}" if chosen.line else "")




def eqn_user_line(eqn: Any, user_files: list[str] | tuple[str, ...] = ()) -> str | None:
    """``file:line in function`` of the innermost frame of a jaxpr equation's traceback in the user's
    code (a file in ``user_files``, else any file outside the libraries and stagetool), or None: the
    line of a model's module that wrote a sharding (``nnx.with_partitioning``, an Equinox layer's
    ``with_sharding_constraint``), not the library frame that applied it."""
    own = str(Path(__file__).resolve().parents[1]) + "/"
    # private-api: a JaxprEqn's source_info.traceback (jaxlib's Traceback; frames innermost first)
    tb = getattr(getattr(eqn, "source_info", None), "traceback", None)
    frames = list(getattr(tb, "frames", None) or ())
    users = {str(Path(f).resolve()) for f in user_files}
    kept = [f for f in frames if not f.file_name.startswith(own) and not f.file_name.startswith("<")]
    for pick in (lambda f: str(Path(f.file_name).resolve()) in users, lambda f: not is_library_file(f.file_name)):
        for f in kept:
            if pick(f):
                return f"{f.file_name}:{f.line_num} in {f.function_name}"
    return None
