"""The spec's YAML as nodes: composed with bounds (a hostile spec cannot hang or crash the loader),
problems collected at each node's file:line:col, merge keys applied, duplicate keys refused, and
the small reads every section of the spec makes (a key's node, a node as a plain value).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from stagetool.core.errors import SpecError
from stagetool.spec.model import Loc

#: Limits that keep a hostile spec from hanging or crashing the loader (docs/spec.md).
MAX_DEPTH = 64
"""How deeply collections may nest in a spec (real specs nest fewer than 15 levels)."""
MAX_ALIASES = 1_000
"""How many ``*alias`` references a spec may hold."""
MAX_EXPANDED_NODES = 200_000
"""How many nodes the spec may have with every alias expanded (an alias "bomb" has billions)."""


class SpecLimit(Exception):
    """A limit of the loader exceeded; ``mark``: where in the text (a PyYAML mark), or None."""

    def __init__(self, node_or_mark: Any, message: str):
        super().__init__(message)
        self.mark = getattr(node_or_mark, "start_mark", node_or_mark)
        self.message = message


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe composer with a nesting depth and alias count bound (checked while composing)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise SpecLimit(self.peek_event().start_mark,
                                 f"more than {MAX_ALIASES} aliases (*name); a spec needs a handful")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise SpecLimit(self.peek_event().start_mark, f"nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_SURROGATE = re.compile("[\ud800-\udfff]")


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for kv in node.value for x in kv]
    return []


def _check_graph(root: yaml.Node) -> None:
    """Reject a node graph that refers to itself (a recursive alias) or that expands, aliases
    followed, to more than :data:`MAX_EXPANDED_NODES` nodes. Iterative: no recursion to exhaust."""
    size: dict[int, int] = {}
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            size[key] = min(1 + sum(size[id(c)] for c in _children(node)), MAX_EXPANDED_NODES + 1)
            state[key] = 2
            if size[key] > MAX_EXPANDED_NODES:
                raise SpecLimit(root, f"with its aliases expanded, the spec has more than {MAX_EXPANDED_NODES} "
                                       "nodes (an alias bomb?)")
            continue
        seen = state.get(key)
        if seen == 2:
            continue
        if seen == 1:
            raise SpecLimit(node, "an alias refers to a node that contains it (a recursive alias)")
        if isinstance(node, yaml.ScalarNode) and isinstance(node.value, str) and _SURROGATE.search(node.value):
            c = _SURROGATE.search(node.value).group()
            raise SpecLimit(node, f"a lone surrogate (\\u{ord(c):04x}) is not a character, and no name or file "
                                  "can hold one; write the character itself")
        state[key] = 1
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node))


def compose_bounded(text: str) -> yaml.Node | None:
    """``yaml.compose`` with :data:`MAX_DEPTH`, :data:`MAX_ALIASES` and :data:`MAX_EXPANDED_NODES`.

    Raises:
      yaml.YAMLError: not YAML.
      SpecLimit: a limit is exceeded (with the mark where).
    """
    loader = _BoundedLoader(text)
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    if root is not None:
        _check_graph(root)
    return root


class Issues:
    """Collects every problem with its location (``file:line:col: key.path: message``); raises one
    SpecError at the end, the problems in file order and one per YAML node."""

    def __init__(self, file: str):
        self.file = file
        self.items: list[str] = []

    def loc(self, node: yaml.Node | None) -> Loc:
        if node is None:
            return Loc(self.file, 1, 1)
        m = node.start_mark
        return Loc(self.file, m.line + 1, m.column + 1)

    def add(self, node: yaml.Node | None, path: str, message: str) -> None:
        where = f"{self.loc(node)}: " + (f"{path}: " if path else "")
        self.items.append(where + message)

    def raise_if_any(self, hint: str | None = None) -> None:
        if self.items:
            def position(item: str) -> tuple[int, int]:
                m = re.match(r"^.*?:(\d+):(\d+): ", item)
                return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

            raise SpecError(sorted(_merge_aliased(self.items), key=position), hint=hint)


_ITEM = re.compile(r"^(?P<loc>.*?:\d+:\d+): (?P<path>[^\s:]+): (?P<message>.*)$", re.S)


def _merge_aliased(items: list[str]) -> list[str]:
    """One problem per YAML node: a node reached through an alias (``rules: *rules``) under several
    paths gives the same message at the same file:line:col; it is kept once, naming the other paths."""
    out: list[str] = []
    first: dict[tuple[str, str], int] = {}
    also: dict[int, list[str]] = {}
    for item in items:
        m = _ITEM.match(item)
        if m is None:
            if item not in out:
                out.append(item)
            continue
        key = (m["loc"], m["message"])
        if key in first:
            if m["path"] not in also[first[key]]:
                also[first[key]].append(m["path"])
            continue
        first[key] = len(out)
        also[len(out)] = [m["path"]]
        out.append(item)
    for i, paths in also.items():
        if len(paths) > 1:
            m = _ITEM.match(out[i])
            out[i] = (f"{m['loc']}: {paths[0]} (also {', '.join(paths[1:])}, the same node through a YAML alias): "
                      f"{m['message']}")
    return out


_CONSTRUCTOR = yaml.SafeLoader("")


def plain(node: yaml.Node) -> Any:
    """Any node as a plain Python value (lists, dicts, scalars), safely constructed."""
    if isinstance(node, yaml.ScalarNode) and node.tag == "!tuple":
        return ()
    if isinstance(node, yaml.SequenceNode):
        items = [plain(n) for n in node.value]
        return tuple(items) if node.tag == "!tuple" else items
    if isinstance(node, yaml.MappingNode):
        return {_hashable(plain(k)): plain(v) for k, v in node.value}
    try:
        return _CONSTRUCTOR.construct_object(node, deep=True)
    except yaml.YAMLError:
        return node.value  # an unknown tag: keep the text, validation will name it


def _hashable(key: Any) -> Any:
    """A mapping key as Python can hold it: a list or mapping used as a YAML key becomes its text."""
    try:
        hash(key)
        return key
    except TypeError:
        return str(key)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def merge_keys(issues: Issues, root: yaml.Node) -> None:
    """Apply YAML merge keys (``<<: *base``, ``<<: [*a, *b]``) in place, as YAML 1.1 defines them:
    the merged mappings' pairs come first, a key written in the mapping itself overrides them, and
    of several merged mappings the first that has a key wins. Merged pairs keep their own file
    positions, so a problem in them is reported where it is written.
    """
    seen: set[int] = set()
    stack = [root]
    order: list[yaml.MappingNode] = []
    while stack:  # children first, so that a merged mapping is itself already merged
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            order.append(node)
            stack.extend(v for _, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    for node in reversed(order):
        merges = [(k, v) for k, v in node.value if k.tag == _MERGE_TAG or (isinstance(k, yaml.ScalarNode)
                                                                            and k.value == "<<" and k.style is None)]
        if not merges:
            continue
        own = [(k, v) for k, v in node.value if (k, v) not in merges]
        own_keys = {_hashable(plain(k)) for k, _ in own}
        merged: list = []
        merged_keys: set = set()
        for k, v in merges:
            sources = v.value if isinstance(v, yaml.SequenceNode) else [v]
            for src in sources:
                if not isinstance(src, yaml.MappingNode):
                    issues.add(src, "", "a merge key '<<' takes a mapping (an alias such as *base) or a list of them")
                    continue
                for sk, sv in src.value:
                    key = _hashable(plain(sk))
                    if key in own_keys or key in merged_keys:
                        continue
                    merged_keys.add(key)
                    merged.append((sk, sv))
        node.value = merged + own


def duplicate_keys(issues: Issues, node: yaml.Node, path: str = "") -> None:
    """Record every mapping key written twice, anywhere in the spec.

    YAML keeps only the last of two equal keys, silently: a mesh ``{data: 2, data: 4}`` would
    have one axis, a second function of the same name would replace the first.
    """
    if isinstance(node, yaml.SequenceNode):
        for i, n in enumerate(node.value):
            duplicate_keys(issues, n, f"{path}[{i}]")
    elif isinstance(node, yaml.MappingNode):
        first: dict[Any, yaml.Node] = {}
        for k, v in node.value:
            try:
                key = plain(k)
                hash(key)
            except TypeError:
                key = id(k)  # a list or mapping as a key: never equal to another
            if key in first:
                m = first[key].start_mark
                issues.add(k, path, f"duplicate key {k.value!r} (first written at line {m.line + 1}, column "
                                    f"{m.column + 1}); YAML would keep only the last one: remove or rename one")
            else:
                first[key] = k
            duplicate_keys(issues, v, f"{path}.{k.value}" if path else str(k.value))


def child(node: yaml.MappingNode, key: str) -> yaml.Node | None:
    """The value node of ``key`` in a mapping node, or None."""
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return v
    return None


def keys_of(node: yaml.MappingNode) -> list[tuple[yaml.Node, str]]:
    """``(key node, key text)`` of a mapping node, in order."""
    return [(k, str(k.value)) for k, _ in node.value]


def anchor_keys(root: yaml.MappingNode) -> set[str]:
    """Top-level keys beginning with ``x-``: places for YAML anchors (``x-base: &base {...}``, merged
    with ``<<: *base``), ignored otherwise (as docker-compose's extension fields)."""
    return {key for _, key in keys_of(root) if isinstance(key, str) and key.startswith("x-")}


def check_keys(issues: Issues, node: yaml.MappingNode, path: str, allowed: set[str]) -> None:
    """Record every key of ``node`` not in ``allowed``, with the closest allowed one."""
    for knode, key in keys_of(node):
        if key not in allowed:
            close = close_match(key, allowed)
            issues.add(knode, path, f"unknown key {key!r}; expected one of {', '.join(sorted(allowed))}"
                       + (f" (did you mean {close!r}?)" if close else ""))


def close_match(word: str, choices) -> str | None:
    """The one of ``choices`` closest to ``word`` (difflib, cutoff 0.6), or None."""
    import difflib

    m = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return m[0] if m else None


def short(text: str, n: int = 60) -> str:
    """``repr(text)``, cut to ``n`` characters with an ellipsis (a hostile pattern can be megabytes)."""
    r = repr(text)
    return r if len(r) <= n else r[:n] + "…"
