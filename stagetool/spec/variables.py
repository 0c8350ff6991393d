"""``${name}`` placeholders in a spec, filled from ``--set name=value`` (``stagetool sweep``).

A spec may leave any scalar open — a shape (``'f32[${batch},512] @ [data, null]'``), a static
value (``remat: ${remat}``), an init argument, a mesh size, the topology — and a sweep fills it.
Substitution happens on the YAML *text*, before it is parsed, so the parser sees an ordinary spec
and every error still names the file and line where it was written (a column after a placeholder
on the same line moves by the length difference). Placeholders inside comments are left alone.

Values are YAML scalars: ``batch=8`` is the integer 8 and ``remat=dots`` the string ``dots`` once
the spec is parsed, exactly as if they had been typed into the file.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from stagetool.core.errors import UsageError

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""``${name}``: a name is a Python identifier."""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNSAFE = set("'\"#[]{},\n\r\t")
"""Characters a value may not hold: they would change the YAML's structure around the placeholder."""


@dataclasses.dataclass(frozen=True)
class Placeholder:
    """One ``${name}`` in a spec's text.

    Attributes:
      name: the variable's name.
      line: 1-based line of the placeholder.
      col: 1-based column of its ``$``.
    """

    name: str
    line: int
    col: int


def _comment_start(line: str) -> int:
    """Index where a ``#`` comment starts in one YAML line (outside quotes), or ``len(line)``."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"" and (i == 0 or line[i - 1] in " \t[{,:-"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return i
    return len(line)


def find_placeholders(text: str) -> tuple[Placeholder, ...]:
    """Every ``${name}`` of the spec text outside comments, in text order."""
    found = []
    for n, line in enumerate(text.splitlines(), start=1):
        code = line[:_comment_start(line)]
        found.extend(Placeholder(m.group(1), n, m.start() + 1) for m in PLACEHOLDER.finditer(code))
    return tuple(found)


def parse_value(name: str, text: str) -> Any:
    """The YAML scalar ``text`` stands for (``8`` → 8, ``dots`` → ``'dots'``, ``true`` → True).

    Raises:
      UsageError: ``text`` is empty, holds a character that would change the YAML around the
        placeholder, or is not a scalar.
    """
    t = text.strip()
    bad = sorted(set(t) & _UNSAFE)
    if not t or bad:
        why = "is empty" if not t else "holds " + " ".join(repr(c) for c in bad)
        raise UsageError(f"--set {name}={text}: the value {why}",
                         hint="give plain YAML scalars separated by commas: --set batch=8,16,32 --set remat=full,dots")
    try:
        value = yaml.safe_load(t)
    except yaml.YAMLError:
        value = None
    if value is None or isinstance(value, (list, dict)):
        raise UsageError(f"--set {name}={text}: {t!r} is not a YAML scalar (a number, a word, true/false)")
    return value


def parse_set_options(options: list[str] | tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """``["batch=8,16", "remat=full"]`` → ``{"batch": ("8", "16"), "remat": ("full",)}`` (the value texts,
    in the order given; each checked with :func:`parse_value`).

    Raises:
      UsageError: not ``name=v1,v2``, a bad name, a name given twice, a repeated value, a bad value.
    """
    out: dict[str, tuple[str, ...]] = {}
    for option in options:
        name, eq, values = option.partition("=")
        name = name.strip()
        if not eq or not _NAME.match(name):
            raise UsageError(f"--set {option!r} is not NAME=VALUE[,VALUE...] with NAME an identifier",
                             hint="e.g. --set batch=8,16,32")
        if name in out:
            raise UsageError(f"--set {name} is given twice; give all its values in one --set {name}=v1,v2")
        texts = tuple(v.strip() for v in values.split(","))
        for t in texts:
            parse_value(name, t)
        if len(set(texts)) != len(texts):
            raise UsageError(f"--set {option!r} repeats a value; give each value once")
        out[name] = texts
    return out


def substitute(text: str, values: Mapping[str, str], *, file: str = "<spec>") -> str:
    """Fill every placeholder of ``text`` from ``values`` (name → value text); comments kept as written.

    Raises:
      UsageError: a placeholder with no value, naming each ``file:line`` and the ``--set`` to pass.
    """
    missing = [p for p in find_placeholders(text) if p.name not in values]
    if missing:
        names = sorted({p.name for p in missing})
        where = ", ".join(f"{file}:{p.line}:{p.col} ${{{p.name}}}" for p in missing)
        raise UsageError(f"the spec leaves {', '.join(names)} open ({where})",
                         hint="fill it with stagetool sweep ... " + " ".join(f"--set {n}=VALUE" for n in names))
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        cut = _comment_start(line)
        lines[i] = PLACEHOLDER.sub(lambda m: str(values[m.group(1)]).strip(), line[:cut]) + line[cut:]
    return "".join(lines)


def check_names(text: str, names: list[str] | tuple[str, ...], *, file: str = "<spec>") -> None:
    """Every ``--set`` name must be a placeholder of the spec.

    Raises:
      UsageError: naming the unused ``--set`` and the placeholders the spec has.
    """
    used = sorted({p.name for p in find_placeholders(text)})
    unused = [n for n in names if n not in used]
    if unused:
        import difflib

        close = [c for n in unused for c in difflib.get_close_matches(n, used, n=1)]
        raise UsageError(f"--set {', '.join(unused)}: {file} has no ${{{unused[0]}}}; its placeholders are "
                         + (", ".join(used) if used else "none"),
                         hint=(f"did you mean {', '.join(close)}? " if close else "")
                         + "write ${name} in the spec where the value goes")


def load_spec_with(path: str | Path, values: Mapping[str, str] | None = None):
    """:func:`stagetool.spec.parse.load_spec`, with the spec's placeholders filled from ``values``.

    Without placeholders and values this is ``load_spec(path)``.

    Raises:
      UsageError: a placeholder without a value, or a value for a name the spec does not use.
      SpecError: the filled spec is invalid.
    """
    from stagetool.spec.parse import load_spec, parse_spec, read_spec_text

    p = Path(path)
    text = read_spec_text(p)
    values = dict(values or {})
    if not values and not find_placeholders(text):
        return load_spec(p)
    check_names(text, list(values), file=str(p))
    return parse_spec(substitute(text, values, file=str(p)), file=str(p), base_dir=p.resolve().parent, path=p)
