"""The YAML spec: a function's abstract inputs, its mesh, and how to stage it.

The spec is parsed from YAML with PyYAML's safe composer, so that every node keeps its file, line
and column. Validation collects *every* problem before raising one :class:`~stagetool.core.errors.SpecError`
whose lines read ``file:line:col: functions.train_step.args[1].tokens: what is wrong``.

This module knows nothing of JAX: it turns text into plain frozen records (:class:`Spec`,
:class:`FunctionSpec`, :class:`LeafSpec`, ...). ``stagetool.inputs`` turns those into
``jax.ShapeDtypeStruct``s on a mesh.

The format is documented in README.md ("The spec"); a compact example::

    version: 1
    mesh: {axes: {data: 2, model: 4}}
    functions:
      train_step:
        target: model.py:train_step
        args:
          - init: model.py:init_params
            init_args: [key(0)]
            rules:
              - ['.*/w$', [null, model]]
              - ['.*', replicated]
          - {tokens: 'i32[64,1024] @ [data, null]'}
        static: {train: true}
        donate: [0]
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from stagetool.core.dtypes import DTYPES, KEY_DTYPES
from stagetool.core.errors import SpecError
from stagetool.core.mesh import MeshSpec, axis_name_problem, device_count_problem
from stagetool.core.sharding import AUTO, REPLICATED, UNSPECIFIED, Sharding
from stagetool.spec.model import (
    ArgSpec,
    CallSpec,
    CheckSpec,
    FunctionSpec,
    InitSpec,
    KeySpec,
    LeafSpec,
    LikeSpec,
    Loc,
    OutRulesSpec,
    RefSpec,
    Rule,
    Spec,
)

SPEC_VERSION = 1

_LEAF_RE = re.compile(r"^\s*(?P<dtype>[A-Za-z][\w<>]*)\s*\[(?P<dims>[^\]]*)\]\s*(?:@\s*(?P<sharding>.+?))?\s*$")
_KEY_CALL_RE = re.compile(r"^\s*key\(\s*(-?\d+)\s*\)\s*$")

#: Limits that keep a hostile spec from hanging or crashing the loader (README: "The spec").
MAX_DEPTH = 64
"""How deeply collections may nest in a spec (real specs nest fewer than 15 levels)."""
MAX_ALIASES = 1_000
"""How many ``*alias`` references a spec may hold."""
MAX_EXPANDED_NODES = 200_000
"""How many nodes the spec may have with every alias expanded (an alias "bomb" has billions)."""
MAX_DIMENSION = 2**32
"""The largest size of one dimension of a leaf."""
MAX_ELEMENTS = 2**57
"""The most elements one leaf may have: XLA computes a buffer's bytes in int64, and a leaf of
2**61 f32 elements aborts the compiler; 2**57 leaves room for 16-byte complex types."""


class _SpecLimit(Exception):
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
                raise _SpecLimit(self.peek_event().start_mark,
                                 f"more than {MAX_ALIASES} aliases (*name); a spec needs a handful")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _SpecLimit(self.peek_event().start_mark, f"nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


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
                raise _SpecLimit(root, f"with its aliases expanded, the spec has more than {MAX_EXPANDED_NODES} "
                                       "nodes (an alias bomb?)")
            continue
        seen = state.get(key)
        if seen == 2:
            continue
        if seen == 1:
            raise _SpecLimit(node, "an alias refers to a node that contains it (a recursive alias)")
        state[key] = 1
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node))


def compose_bounded(text: str) -> yaml.Node | None:
    """``yaml.compose`` with :data:`MAX_DEPTH`, :data:`MAX_ALIASES` and :data:`MAX_EXPANDED_NODES`.

    Raises:
      yaml.YAMLError: not YAML.
      _SpecLimit: a limit is exceeded (with the mark where).
    """
    loader = _BoundedLoader(text)
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    if root is not None:
        _check_graph(root)
    return root


# ----------------------------------------------------------------------------------------------
# Parsing


class _Issues:
    """Collects every problem with its location; raises one SpecError at the end."""

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


def _plain(node: yaml.Node) -> Any:
    """Any node as a plain Python value (lists, dicts, scalars), safely constructed."""
    if isinstance(node, yaml.ScalarNode) and node.tag == "!tuple":
        return ()
    if isinstance(node, yaml.SequenceNode):
        items = [_plain(n) for n in node.value]
        return tuple(items) if node.tag == "!tuple" else items
    if isinstance(node, yaml.MappingNode):
        return {_hashable(_plain(k)): _plain(v) for k, v in node.value}
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


def _merge_keys(issues: _Issues, root: yaml.Node) -> None:
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
        own_keys = {_hashable(_plain(k)) for k, _ in own}
        merged: list = []
        merged_keys: set = set()
        for k, v in merges:
            sources = v.value if isinstance(v, yaml.SequenceNode) else [v]
            for src in sources:
                if not isinstance(src, yaml.MappingNode):
                    issues.add(src, "", "a merge key '<<' takes a mapping (an alias such as *base) or a list of them")
                    continue
                for sk, sv in src.value:
                    key = _hashable(_plain(sk))
                    if key in own_keys or key in merged_keys:
                        continue
                    merged_keys.add(key)
                    merged.append((sk, sv))
        node.value = merged + own


def _duplicate_keys(issues: _Issues, node: yaml.Node, path: str = "") -> None:
    """Record every mapping key written twice, anywhere in the spec.

    YAML keeps only the last of two equal keys, silently: a mesh ``{data: 2, data: 4}`` would
    have one axis, a second function of the same name would replace the first.
    """
    if isinstance(node, yaml.SequenceNode):
        for i, n in enumerate(node.value):
            _duplicate_keys(issues, n, f"{path}[{i}]")
    elif isinstance(node, yaml.MappingNode):
        first: dict[Any, yaml.Node] = {}
        for k, v in node.value:
            try:
                key = _plain(k)
                hash(key)
            except TypeError:
                key = id(k)  # a list or mapping as a key: never equal to another
            if key in first:
                m = first[key].start_mark
                issues.add(k, path, f"duplicate key {k.value!r} (first written at line {m.line + 1}, column "
                                    f"{m.column + 1}); YAML would keep only the last one: remove or rename one")
            else:
                first[key] = k
            _duplicate_keys(issues, v, f"{path}.{k.value}" if path else str(k.value))


def _get(node: yaml.MappingNode, key: str) -> yaml.Node | None:
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return v
    return None


def _keys(node: yaml.MappingNode) -> list[tuple[yaml.Node, str]]:
    return [(k, str(k.value)) for k, _ in node.value]


def _anchor_keys(root: yaml.MappingNode) -> set[str]:
    """Top-level keys beginning with ``x-``: places for YAML anchors (``x-base: &base {...}``, merged
    with ``<<: *base``), ignored otherwise (as docker-compose's extension fields)."""
    return {key for _, key in _keys(root) if isinstance(key, str) and key.startswith("x-")}


def _check_keys(issues: _Issues, node: yaml.MappingNode, path: str, allowed: set[str]) -> None:
    for knode, key in _keys(node):
        if key not in allowed:
            close = _close(key, allowed)
            issues.add(knode, path, f"unknown key {key!r}; expected one of {', '.join(sorted(allowed))}"
                       + (f" (did you mean {close!r}?)" if close else ""))


def _close(word: str, choices) -> str | None:
    import difflib

    m = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return m[0] if m else None


def parse_sharding(value: Any) -> Sharding:
    """Parse a sharding written as a YAML value.

    Accepts ``auto``, ``replicated`` (or ``[]``), and lists like ``[data, null]`` or
    ``[[data, fsdp], model]``.

    Raises:
      ValueError: with a message saying what is accepted.
    """
    if value is None:
        return UNSPECIFIED
    if isinstance(value, str):
        v = value.strip()
        if v == "auto":
            return AUTO
        if v == "replicated":
            return REPLICATED
        if v.startswith("["):
            try:
                parsed = compose_bounded(v)
                value = _plain(parsed) if parsed is not None else None
            except (yaml.YAMLError, _SpecLimit) as e:
                raise ValueError(f"sharding {value!r} is not a list like [data, null]: "
                                 f"{getattr(e, 'problem', None) or getattr(e, 'message', None) or e}") from None
            if not isinstance(value, list):
                raise ValueError(f"sharding {v!r} is not a list like [data, null]")
            return parse_sharding(value)
        raise ValueError(f"sharding {value!r} is not 'auto', 'replicated' or a list like [data, null]")
    if isinstance(value, (list, tuple)):
        dims: list = []
        for d in value:
            if d is None or (isinstance(d, str) and d in ("null", "None")):
                dims.append(None)
            elif isinstance(d, str):
                dims.append(d)
            elif isinstance(d, (list, tuple)) and d and all(isinstance(a, str) for a in d):
                dims.append(tuple(d) if len(d) > 1 else d[0])
            else:
                raise ValueError(f"sharding entry {d!r} must be a mesh axis name, null, or a list of axis names")
        return Sharding("spec", tuple(dims))
    raise ValueError(f"sharding {value!r} is not 'auto', 'replicated' or a list like [data, null]")


def parse_leaf(text: str, loc: Loc) -> LeafSpec:
    """Parse a compact leaf ``dtype[d0,d1,...] @ sharding`` (``f32[]`` is a scalar).

    Raises:
      ValueError: naming what is wrong and the accepted form.
    """
    m = _LEAF_RE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a leaf; write dtype[d0,d1,...] with an optional '@ sharding', "
                         "e.g. 'bf16[64,1024] @ [data, null]'")
    dtype = _dtype(m["dtype"])
    dims_text = m["dims"].strip()
    try:
        shape = tuple(int(d) for d in dims_text.split(",")) if dims_text else ()
    except ValueError:
        raise ValueError(f"shape [{dims_text}] must be a list of non-negative integers") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"shape [{dims_text}] must be a list of non-negative integers")
    problem = shape_problem(shape)
    if problem:
        raise ValueError(problem)
    sharding = parse_sharding(m["sharding"]) if m["sharding"] else UNSPECIFIED
    return LeafSpec(shape, dtype, sharding, loc)


def shape_problem(shape: tuple[int, ...] | list[int]) -> str | None:
    """Why XLA could not take this shape (a dimension or element count too large), or None."""
    if len(shape) > MAX_DEPTH:
        return f"shape has {len(shape)} dimensions; at most {MAX_DEPTH}"
    n = 1
    for d in shape:
        if d > MAX_DIMENSION:
            return f"dimension size {d} is larger than {MAX_DIMENSION} (2**32), the largest stagetool accepts"
        n *= d
    if n > MAX_ELEMENTS:
        return (f"shape {list(shape)} has {n} elements, more than {MAX_ELEMENTS} (2**57), "
                "the most stagetool accepts for one leaf")
    return None


def _dtype(name: str) -> str:
    n = name.strip()
    low = n.lower()  # F32, BF16, Float32: names are case-insensitive
    if low in DTYPES:
        return DTYPES[low]
    if low in ("key", "key<fry>"):
        return "key<fry>"
    if low in KEY_DTYPES:
        return low
    close = _close(low, list(DTYPES) + ["key<fry>"])
    raise ValueError(f"unknown dtype {n!r}" + (f" (did you mean {close!r}?)" if close else "")
                     + "; use HLO short names (f32 bf16 i32 u32 pred ...), numpy names, or key<fry>")


class _Parser:
    def __init__(self, file: str, base_dir: Path):
        self.issues = _Issues(file)
        self.base_dir = base_dir
        self.out_locs: dict[str, Loc] = {}  # out_shardings key path -> where that sharding is written
        self.logical_axis_rules: Any = None  # the top-level logical_axis_rules (see logical_rules)
        self.logical_axis_rules_loc: Loc | None = None

    # A pytree of leaves ------------------------------------------------------------------------
    def tree(self, node: yaml.Node, path: str, *, plain_strings: bool = False) -> Any:
        """A pytree whose string leaves are array leaves (``f32[4] @ [data]``) or ``key(N)``.

        With ``plain_strings`` (``init_args``/``init_kwargs``), a string with no ``[`` that is not
        ``key(N)`` is kept as a plain Python string (``act: tanh``).
        """
        loc = self.issues.loc(node)
        if isinstance(node, yaml.ScalarNode):
            value = _plain(node)
            if isinstance(value, str):
                km = _KEY_CALL_RE.match(value)
                if km:
                    return KeySpec(int(km.group(1)), loc)
                if plain_strings and "[" not in value:
                    return value
                try:
                    return parse_leaf(value, loc)
                except ValueError as e:
                    self.issues.add(node, path, str(e))
                    return None
            return value  # numbers, booleans and null pass through as Python values
        if isinstance(node, yaml.SequenceNode):
            items = [self.tree(n, f"{path}[{i}]", plain_strings=plain_strings) for i, n in enumerate(node.value)]
            return tuple(items) if node.tag == "!tuple" else items
        assert isinstance(node, yaml.MappingNode)
        keys = {k for _, k in _keys(node)}
        if "init" in keys:
            return self.init(node, path)
        if "call" in keys:
            return self.call(node, path)
        if "ref" in keys:
            return self.ref(node, path)
        if "arg" in keys and plain_strings:
            return self.arg_ref(node, path)
        if {"shape", "dtype"} <= keys:
            return self.expanded_leaf(node, path)
        out = {}
        for k, v in node.value:
            out[str(_plain(k))] = self.tree(v, f"{path}.{k.value}" if path else str(k.value),
                                            plain_strings=plain_strings)
        return out

    def plain_value(self, node: yaml.Node, path: str) -> Any:
        """A plain Python value (an argument of ``call``): strings stay strings; ``{call: ...}`` nests."""
        if isinstance(node, yaml.MappingNode):
            if _get(node, "call") is not None:
                return self.call(node, path)
            if _get(node, "ref") is not None:
                return self.ref(node, path)
            return {_plain(k): self.plain_value(v, f"{path}.{k.value}") for k, v in node.value}
        if isinstance(node, yaml.SequenceNode):
            items = [self.plain_value(n, f"{path}[{i}]") for i, n in enumerate(node.value)]
            return tuple(items) if node.tag == "!tuple" else items
        return _plain(node)

    def expanded_leaf(self, node: yaml.MappingNode, path: str) -> LeafSpec | None:
        loc = self.issues.loc(node)
        before = len(self.issues.items)
        _check_keys(self.issues, node, path, {"shape", "dtype", "sharding"})
        ok = len(self.issues.items) == before
        shape_node, dtype_node, sh_node = _get(node, "shape"), _get(node, "dtype"), _get(node, "sharding")
        shape = _plain(shape_node)
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            self.issues.add(shape_node, f"{path}.shape", f"shape must be a list of non-negative integers, not {shape!r}")
            ok = False
        elif shape_problem(shape):
            self.issues.add(shape_node, f"{path}.shape", shape_problem(shape))
            ok = False
        try:
            dtype = _dtype(str(_plain(dtype_node)))
        except ValueError as e:
            self.issues.add(dtype_node, f"{path}.dtype", str(e))
            ok = False
        sharding = UNSPECIFIED
        if sh_node is not None:
            try:
                sharding = parse_sharding(_plain(sh_node))
            except ValueError as e:
                self.issues.add(sh_node, f"{path}.sharding", str(e))
                ok = False
        return LeafSpec(tuple(shape), dtype, sharding, loc) if ok else None

    def target_of(self, node: yaml.MappingNode, key: str, path: str) -> str | None:
        """The ``file.py:name`` / ``pkg.mod:name`` under ``key``, or None after recording the problem."""
        target = _plain(_get(node, key))
        if not isinstance(target, str) or ":" not in target:
            self.issues.add(_get(node, key), f"{path}.{key}",
                            f"{key} must name a callable as 'file.py:name' or 'pkg.mod:name', not {target!r}")
            return None
        return target

    def call(self, node: yaml.MappingNode, path: str) -> CallSpec | None:
        _check_keys(self.issues, node, path, {"call", "args", "kwargs"})
        target = self.target_of(node, "call", path)
        if target is None:
            return None
        args: list = []
        anode = _get(node, "args")
        if anode is not None:
            if not isinstance(anode, yaml.SequenceNode):
                self.issues.add(anode, f"{path}.args", "must be a list (one entry per positional argument)")
            else:
                args = [self.plain_value(n, f"{path}.args[{i}]") for i, n in enumerate(anode.value)]
        kwargs: dict = {}
        knode = _get(node, "kwargs")
        if knode is not None:
            if not isinstance(knode, yaml.MappingNode):
                self.issues.add(knode, f"{path}.kwargs", "must be a mapping of argument name to value")
            else:
                kwargs = {str(k.value): self.plain_value(v, f"{path}.kwargs.{k.value}") for k, v in knode.value}
        return CallSpec(target, tuple(args), kwargs, self.issues.loc(node))

    def arg_ref(self, node: yaml.MappingNode, path: str) -> ArgSpec | None:
        """``{arg: N}`` / ``{arg: name}`` in init_args/init_kwargs: another argument's built value."""
        _check_keys(self.issues, node, path, {"arg"})
        arg = _plain(_get(node, "arg"))
        if isinstance(arg, bool) or not isinstance(arg, (int, str)) or (isinstance(arg, int) and arg < 0):
            self.issues.add(_get(node, "arg"), path, f"arg names another argument of the function by position "
                            f"(0, 1, ...) or by name, not {arg!r}")
            return None
        return ArgSpec(arg, self.issues.loc(node))

    def ref(self, node: yaml.MappingNode, path: str) -> RefSpec | None:
        _check_keys(self.issues, node, path, {"ref"})
        target = self.target_of(node, "ref", path)
        return RefSpec(target, self.issues.loc(node)) if target is not None else None

    def init(self, node: yaml.MappingNode, path: str) -> InitSpec | None:
        _check_keys(self.issues, node, path, {"init", "init_args", "init_kwargs", "rules"})
        target = self.target_of(node, "init", path)
        if target is None:
            return None
        args = self.args_list(_get(node, "init_args"), f"{path}.init_args", plain_strings=True)
        kwargs = self.kwargs_map(_get(node, "init_kwargs"), f"{path}.init_kwargs", plain_strings=True)
        rules_node = _get(node, "rules")
        rules = self.rules(rules_node, path)
        return InitSpec(target, tuple(args), kwargs, tuple(rules), self.issues.loc(node), path,
                        has_rules=rules_node is not None)

    def logical_rules(self, node: yaml.Node, path: str) -> Any:
        """``logical_axis_rules``: ``model.py:NAME`` (a list of rules, a callable returning one, or an
        object with a ``logical_axis_rules`` attribute, e.g. a ``get_config()`` result), a
        ``{call: ...}`` mapping, or an inline list of ``[logical name, mesh axis | null | [axes]]``
        pairs (a tuple of pairs). None after recording the problem."""
        key = f"{path}.logical_axis_rules" if path else "logical_axis_rules"
        if isinstance(node, yaml.MappingNode):
            return self.call(node, key) if _get(node, "call") is not None else self._bad_rules(node, key)
        if isinstance(node, yaml.SequenceNode):
            pairs = []
            for i, item in enumerate(node.value):
                value = _plain(item)
                if not (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str)
                        and (value[1] is None or isinstance(value[1], str)
                             or (isinstance(value[1], (list, tuple)) and all(isinstance(a, str) for a in value[1])))):
                    self.issues.add(item, f"{key}[{i}]", f"a logical axis rule is [logical name, mesh axis], e.g. "
                                    f"[embed, model] or [batch, [data, fsdp]] or [heads, null], not {value!r}")
                    continue
                axis = tuple(value[1]) if isinstance(value[1], (list, tuple)) else value[1]
                pairs.append((value[0], axis))
            return tuple(pairs)
        value = _plain(node)
        if isinstance(value, str) and ":" in value:
            return value
        return self._bad_rules(node, key)

    def _bad_rules(self, node: yaml.Node, key: str) -> None:
        self.issues.add(node, key, "logical_axis_rules is 'model.py:NAME' (rules, a function returning them, or an "
                        "object with a logical_axis_rules attribute), {call: model.py:fn, args: [...]}, or a list "
                        f"of [logical name, mesh axis] pairs, not {_plain(node)!r}")
        return None

    def rules(self, rules_node: yaml.Node | None, path: str) -> list[Rule]:
        """``[regex, sharding]`` pairs and ``{call: file.py:fn}`` callables, in order."""
        rules: list[Rule] = []
        if isinstance(rules_node, yaml.MappingNode) and _get(rules_node, "call") is not None:
            # rules: {call: model.py:fsdp_spec}: one callable deciding every leaf
            _check_keys(self.issues, rules_node, f"{path}.rules", {"call"})
            target = self.target_of(rules_node, "call", f"{path}.rules")
            return [Rule(None, None, self.issues.loc(rules_node), call=target)] if target is not None else []
        if rules_node is not None:
            if not isinstance(rules_node, yaml.SequenceNode):
                self.issues.add(rules_node, f"{path}.rules", "rules must be a list of [regex, sharding] pairs, "
                                "or a callable {call: model.py:spec_of} (path, ShapeDtypeStruct) -> PartitionSpec | None")
            else:
                for i, rn in enumerate(rules_node.value):
                    rpath = f"{path}.rules[{i}]"
                    if isinstance(rn, yaml.MappingNode) and _get(rn, "call") is not None:
                        _check_keys(self.issues, rn, rpath, {"call"})
                        target = self.target_of(rn, "call", rpath)
                        if target is not None:
                            rules.append(Rule(None, None, self.issues.loc(rn), call=target))
                        continue
                    if not (isinstance(rn, yaml.SequenceNode) and len(rn.value) == 2):
                        self.issues.add(rn, rpath, "a rule is a pair [regex, sharding], e.g. ['.*/wq$', [null, model]], "
                                        "or a callable {call: model.py:spec_of} (path, ShapeDtypeStruct) -> PartitionSpec | None")
                        continue
                    pat_text = _plain(rn.value[0])
                    try:
                        pattern = re.compile(str(pat_text))
                    except re.error as e:
                        self.issues.add(rn.value[0], rpath, f"bad regular expression {pat_text!r}: {e}")
                        continue
                    except (RecursionError, OverflowError, MemoryError):  # 1,000 nested groups: Python's compiler recurses
                        self.issues.add(rn.value[0], rpath, f"regular expression {_short(str(pat_text))} is nested too "
                                        "deeply or is too large to compile; write a flatter pattern")
                        continue
                    try:
                        sharding = parse_sharding(_plain(rn.value[1]))
                    except ValueError as e:
                        self.issues.add(rn.value[1], rpath, str(e))
                        continue
                    rules.append(Rule(pattern, sharding, self.issues.loc(rn)))
        return rules

    def args_list(self, node: yaml.Node | None, path: str, *, plain_strings: bool = False) -> list:
        if node is None:
            return []
        if not isinstance(node, yaml.SequenceNode):
            self.issues.add(node, path, "must be a list (one entry per positional argument)")
            return []
        if not plain_strings:
            self._no_null_arguments([(n, f"{path}[{i}]") for i, n in enumerate(node.value)])
        return [self.tree(n, f"{path}[{i}]", plain_strings=plain_strings) for i, n in enumerate(node.value)]

    def _no_null_arguments(self, items: list) -> None:
        # A whole argument that is null has no leaves for jit to shard (inside a pytree, null is fine).
        for n, p in items:
            if isinstance(n, yaml.ScalarNode) and _plain(n) is None:
                self.issues.add(n, p, "null is not an input: give a leaf such as 'f32[4]', or leave the "
                                      "parameter out so that its default applies")

    def kwargs_map(self, node: yaml.Node | None, path: str, *, plain_strings: bool = False) -> dict:
        if node is None:
            return {}
        if not isinstance(node, yaml.MappingNode):
            self.issues.add(node, path, "must be a mapping of argument name to value")
            return {}
        if not plain_strings:
            self._no_null_arguments([(v, f"{path}.{k.value}") for k, v in node.value])
        return {str(k.value): self.tree(v, f"{path}.{k.value}", plain_strings=plain_strings) for k, v in node.value}

    # Top level ---------------------------------------------------------------------------------
    def mesh(self, node: yaml.Node | None) -> MeshSpec:
        if node is None:
            return MeshSpec(())
        if not isinstance(node, yaml.MappingNode):
            self.issues.add(node, "mesh", "mesh must be a mapping with 'axes' (e.g. {axes: {data: 2, model: 4}})")
            return MeshSpec(())
        _check_keys(self.issues, node, "mesh", {"axes", "axis_types"})
        axes_node = _get(node, "axes")
        axes: list[tuple[str, int]] = []
        if axes_node is None:
            self.issues.add(node, "mesh", "mesh needs 'axes', e.g. {data: 2, model: 4}")
        elif not isinstance(axes_node, yaml.MappingNode):
            self.issues.add(axes_node, "mesh.axes", "axes must be an ordered mapping of axis name to size, e.g. {data: 2, model: 4}")
        else:
            for k, v in axes_node.value:
                size = _plain(v)
                name = _plain(k)
                problem = axis_name_problem(name)
                if problem:
                    self.issues.add(k, f"mesh.axes", problem)
                    continue
                if isinstance(size, str) and size.strip().isdigit() and int(size) > 0:
                    # a quoted number is a YAML string: '${n}' filled by --set n=8 reads '8'
                    self.issues.add(v, f"mesh.axes.{k.value}",
                                    f"axis size must be a positive integer, not the string {size!r}: it is quoted; "
                                    f"write it unquoted ({k.value}: {size.strip()}; a placeholder too: "
                                    f"{{{k.value}: ${{NAME}}}}, not {{{k.value}: '${{NAME}}'}})")
                    continue
                if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                    self.issues.add(v, f"mesh.axes.{k.value}", f"axis size must be a positive integer, not {size!r}")
                    continue
                axes.append((str(k.value), size))
            problem = device_count_problem([s for _, s in axes])
            if problem:
                self.issues.add(axes_node, "mesh.axes", problem)
                axes = []
        types_node = _get(node, "axis_types")
        types = "auto"
        if types_node is not None:
            types = str(_plain(types_node))
            if types not in ("auto", "explicit"):
                self.issues.add(types_node, "mesh.axis_types", f"axis_types must be 'auto' or 'explicit', not {types!r}")
                types = "auto"
        return MeshSpec(tuple(axes), types, self.issues.loc(node))

    def function(self, name: str, node: yaml.Node, key_node: yaml.Node) -> FunctionSpec | None:
        path = f"functions.{name}"
        if isinstance(node, yaml.ScalarNode) and isinstance(_plain(node), str):
            target = _plain(node)  # `name: model.py:fn` with no inputs
            return FunctionSpec(name, target, (), {}, {}, (), None, self.issues.loc(key_node), self.base_dir)
        if not isinstance(node, yaml.MappingNode):
            self.issues.add(node, path, "a function must be a mapping with at least 'target'")
            return None
        _check_keys(self.issues, node, path, {"target", "args", "kwargs", "static", "donate", "out_shardings",
                                              "logical_axis_rules"})
        tnode = _get(node, "target")
        target = _plain(tnode) if tnode is not None else None
        if not isinstance(target, str) or ":" not in target:
            self.issues.add(tnode or node, f"{path}.target",
                            "target must be 'path/to/file.py:func', 'package.module:func' or 'module:obj.attr'")
            target = ""
        args = self.args_list(_get(node, "args"), f"{path}.args")
        kwargs = self.kwargs_map(_get(node, "kwargs"), f"{path}.kwargs")
        static: dict = {}
        snode = _get(node, "static")
        if snode is not None:
            if not isinstance(snode, yaml.MappingNode):
                self.issues.add(snode, f"{path}.static", "static must be a mapping of argument name to value")
            else:
                for k, v in snode.value:
                    static[str(k.value)] = self.plain_value(v, f"{path}.static.{k.value}")
        donate: list = []
        dnode = _get(node, "donate")
        if dnode is not None:
            values = _plain(dnode)
            if not isinstance(values, list):
                values = [values]
            for d in values:
                if isinstance(d, bool) or not isinstance(d, (int, str)):
                    self.issues.add(dnode, f"{path}.donate", f"donate entries are argument indices or names, not {d!r}")
                elif isinstance(d, int) and not 0 <= d < len(args):
                    self.issues.add(dnode, f"{path}.donate",
                                    f"donate index {d} is out of range: the function has {len(args)} positional args")
                elif isinstance(d, str) and d not in kwargs:
                    self.issues.add(dnode, f"{path}.donate", f"donate names {d!r}, which is not one of kwargs"
                                    + (f" ({', '.join(kwargs)})" if kwargs else ""))
                else:
                    donate.append(d)
        out_shardings = None
        onode = _get(node, "out_shardings")
        if onode is not None:
            out_shardings = self.out_tree(onode, f"{path}.out_shardings")
        locs: dict[str, Loc] = {}
        for k, v in node.value:
            key = str(k.value)
            locs[key] = self.issues.loc(k)
            if key in ("kwargs", "static") and isinstance(v, yaml.MappingNode):
                for kk, _ in v.value:
                    locs[f"{key}.{kk.value}"] = self.issues.loc(kk)
            if key == "args" and isinstance(v, yaml.SequenceNode):
                for i, n in enumerate(v.value):
                    locs[f"args[{i}]"] = self.issues.loc(n)
        lnode = _get(node, "logical_axis_rules")
        logical = self.logical_rules(lnode, path) if lnode is not None else self.logical_axis_rules
        if lnode is None and self.logical_axis_rules_loc is not None:
            locs.setdefault("logical_axis_rules", self.logical_axis_rules_loc)
        elif lnode is not None:
            locs["logical_axis_rules"] = self.issues.loc(lnode)
        return FunctionSpec(name, target, tuple(args), kwargs, static, tuple(donate), out_shardings,
                            self.issues.loc(key_node), self.base_dir, locs, logical)

    def out_tree(self, node: yaml.Node, path: str) -> Any:
        self.out_locs[path] = self.issues.loc(node)
        value = _plain(node)
        if value is None or isinstance(value, str):
            if value in (None, "auto"):
                return None
            try:
                return parse_sharding(value)
            except ValueError as e:
                self.issues.add(node, path, str(e))
                return None
        if isinstance(node, yaml.SequenceNode):
            # A list of axis names / nulls is one sharding; a list of shardings is a tuple of outputs.
            if all(isinstance(n, yaml.ScalarNode) for n in node.value) and not any(
                    _plain(n) in ("auto", "replicated") for n in node.value):
                try:
                    return parse_sharding(value)
                except ValueError as e:
                    self.issues.add(node, path, str(e))
                    return None
            return tuple(self.out_tree(n, f"{path}[{i}]") for i, n in enumerate(node.value))
        if isinstance(node, yaml.MappingNode):
            keys = [str(k.value) for k, _ in node.value]
            if keys == ["like"]:
                arg = _plain(_get(node, "like"))
                if isinstance(arg, bool) or not isinstance(arg, (int, str)):
                    self.issues.add(node, path, f"like names a positional argument (an index) or a keyword argument "
                                    f"(a name), not {arg!r}")
                    return None
                return LikeSpec(arg, self.issues.loc(node))
            if keys == ["rules"]:
                return OutRulesSpec(tuple(self.rules(_get(node, "rules"), path)), self.issues.loc(node))
            return {str(k.value): self.out_tree(v, f"{path}.{k.value}") for k, v in node.value}
        self.issues.add(node, path, f"{value!r} is not a sharding")
        return None


MAX_SPEC_BYTES = 64 * 2**20
"""A spec larger than this (64 MiB) is refused unread."""


def _short(text: str, n: int = 60) -> str:
    """``repr(text)``, cut to ``n`` characters with an ellipsis (a hostile pattern can be megabytes)."""
    r = repr(text)
    return r if len(r) <= n else r[:n] + "…"


def read_spec_text(path: str | Path) -> str:
    """The spec file's text.

    Raises:
      SpecError: the file does not exist, cannot be read, is not a regular file (a FIFO, a device:
        refused without reading), is larger than :data:`MAX_SPEC_BYTES`, or is not UTF-8 (naming
        the line, column and byte).
    """
    from stagetool.process.fileio import FileProblem, read_regular_bytes

    p = Path(path)
    try:
        if p.is_dir():
            raise SpecError([f"{p}: is a folder, not a spec file"])
        data = read_regular_bytes(p, max_bytes=MAX_SPEC_BYTES)  # a FIFO or /dev/zero: refused unread
    except FileNotFoundError:
        raise SpecError([f"{p}: spec file not found"]) from None
    except FileProblem as e:
        raise SpecError([f"{p}: {e}; a spec is a regular YAML file"]) from None
    except OSError as e:
        raise SpecError([f"{p}: cannot read spec: {e.strerror or e}"]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise SpecError([f"{p}:{line}:{col}: byte {e.start} (0x{data[e.start]:02x}) is not UTF-8; "
                         "a spec is UTF-8 text"]) from None


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file.

    Raises:
      SpecError: listing every problem as ``file:line:col: key.path: message``; also for a file
        that does not exist or is not valid YAML.
    """
    p = Path(path)
    text = read_spec_text(p)
    return parse_spec(text, file=str(p), base_dir=p.resolve().parent, path=p)


def parse_spec(text: str, *, file: str = "<spec>", base_dir: Path | None = None, path: Path | None = None) -> Spec:
    """Parse and validate spec text; see :func:`load_spec`."""
    parser = _Parser(file, base_dir or Path.cwd())
    issues = parser.issues
    try:
        root = compose_bounded(text)
    except _SpecLimit as e:
        where = f"{file}:{e.mark.line + 1}:{e.mark.column + 1}" if e.mark is not None else file
        raise SpecError([f"{where}: {e.message}"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        if mark is None and getattr(e, "position", None) is not None:  # a reader error: a bad character
            text_before = text[:e.position]
            where = f"{file}:{text_before.count(chr(10)) + 1}:{e.position - (text_before.rfind(chr(10)) + 1) + 1}"
        else:
            where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else f"{file}:1:1"
        raise SpecError([f"{where}: not valid YAML: {getattr(e, 'problem', None) or getattr(e, 'reason', None) or e}"]) from None
    if root is None:
        raise SpecError([f"{file}:1:1: the spec is empty; it needs at least 'functions'"])
    if not isinstance(root, yaml.MappingNode):
        raise SpecError([f"{issues.loc(root)}: the spec must be a mapping with 'version', 'mesh' and 'functions'"])
    _duplicate_keys(issues, root)
    _merge_keys(issues, root)
    _check_keys(issues, root, "", {"version", "mesh", "platform", "topology", "slices", "avals", "functions",
                                   "chips", "check", "logical_axis_rules"} | _anchor_keys(root))
    if _get(root, "logical_axis_rules") is not None:
        parser.logical_axis_rules = parser.logical_rules(_get(root, "logical_axis_rules"), "")
        parser.logical_axis_rules_loc = issues.loc(_get(root, "logical_axis_rules"))
    vnode = _get(root, "version")
    if vnode is not None and _plain(vnode) != SPEC_VERSION:
        issues.add(vnode, "version", f"unsupported spec version {_plain(vnode)!r}; this stagetool reads version {SPEC_VERSION}")
    before_mesh = len(issues.items)
    mesh = parser.mesh(_get(root, "mesh"))
    # No axes because the mesh has a problem of its own, or is missing while a top-level key is a
    # misspelt 'mesh' ('mseh:'): the shardings are not checked against axes nobody wrote down (each
    # would be one more "the mesh has no axes" after the one error that matters).
    mesh_unknown = not mesh.names and (
        len(issues.items) > before_mesh
        or (_get(root, "mesh") is None and any(isinstance(k, str) and k != "mesh" and _close(k, {"mesh"})
                                               for _, k in _keys(root))))
    platform = None
    pnode = _get(root, "platform")
    if pnode is not None:
        platform = _plain(pnode)
        if platform not in ("cpu", "gpu", "tpu"):
            issues.add(pnode, "platform", f"platform must be cpu, gpu or tpu, not {platform!r}")
    topology = None
    tnode = _get(root, "topology")
    if tnode is not None:
        topology = str(_plain(tnode))
    slices = None
    snode = _get(root, "slices")
    if snode is not None:
        value = _plain(snode)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            issues.add(snode, "slices", f"slices must be a whole number of TPU slices ≥ 1, not {value!r}")
        else:
            slices = value
    avals = "global"
    anode = _get(root, "avals")
    if anode is not None:
        avals = str(_plain(anode))
        if avals not in ("global", "local"):
            issues.add(anode, "avals", f"avals must be 'global' or 'local', not {avals!r}")
    functions: dict[str, FunctionSpec] = {}
    fnode = _get(root, "functions")
    if fnode is None:
        issues.add(root, "", "the spec has no 'functions' mapping")
    elif not isinstance(fnode, yaml.MappingNode):
        issues.add(fnode, "functions", "functions must be a mapping of name to function")
    else:
        for k, v in fnode.value:
            fs = parser.function(str(k.value), v, k)
            if fs is not None:
                functions[fs.name] = fs
    chips: dict = {}
    cnode = _get(root, "chips")
    if cnode is not None:
        if not isinstance(cnode, yaml.MappingNode):
            issues.add(cnode, "chips", "chips must be a mapping of chip name to its figures")
        else:
            chips = _plain(cnode)
            _check_chips(issues, cnode)
    if not mesh_unknown:
        _validate_axes(parser, mesh, functions)
    check = _check_section(issues, _get(root, "check"), functions)
    issues.raise_if_any()
    locs = {key: issues.loc(node) for key, node in (("platform", pnode), ("topology", tnode), ("slices", snode))
            if node is not None}
    return Spec(path, mesh, platform, topology, avals, functions, chips, check, locs, slices)


def _check_chips(issues: _Issues, node: yaml.MappingNode) -> None:
    """Validate ``chips:`` entries with :func:`stagetool.core.chips.merge_chips`, each problem
    placed at the node it is about (the field's value, an unknown field's key, or the chip's name)."""
    from stagetool.core.chips import merge_chips

    for knode, vnode in node.value:
        name = _plain(knode)
        try:
            merge_chips({name: _plain(vnode)})
        except SpecError as e:
            prefix = f"chips.{name}"
            for issue in e.issues:
                rest = issue[len(prefix):] if issue.startswith(prefix) else ": " + issue
                where, at = prefix, knode
                if rest.startswith("."):
                    field, _, rest = rest[1:].partition(":")
                    rest = ":" + rest
                    where = f"{prefix}.{field}"
                    if isinstance(vnode, yaml.MappingNode):
                        for fk, fv in vnode.value:
                            if fk.value == field:
                                at = fv if fv is not None and field in _chip_fields() else fk
                issues.add(at, where, rest[1:].strip())


def _chip_fields() -> tuple[str, ...]:
    from stagetool.core.chips import CHIP_FIELDS

    return CHIP_FIELDS


def _tolerances(issues: _Issues, node: yaml.Node, path: str) -> dict:
    """``{name: '2%'}`` → ``{name: Tolerance}``; every bad entry is an issue."""
    from stagetool.core.errors import UsageError
    from stagetool.core.tolerances import TOLERANCE_KEYS, parse_tolerance

    out: dict = {}
    if not isinstance(node, yaml.MappingNode):
        issues.add(node, path, "must be a mapping of tolerance name to value, e.g. {memory: 2%}")
        return out
    for knode, vnode in node.value:
        name = str(knode.value)
        if name not in TOLERANCE_KEYS:
            close = _close(name, TOLERANCE_KEYS)
            issues.add(knode, path, f"unknown tolerance {name!r}; expected one of {', '.join(TOLERANCE_KEYS)}"
                       + (f" (did you mean {close!r}?)" if close else ""))
            continue
        try:
            out[name] = parse_tolerance(_plain(vnode))
        except UsageError as e:
            issues.add(vnode, f"{path}.{name}", e.message)
    return out


def _check_section(issues: _Issues, node: yaml.Node | None, functions: dict) -> CheckSpec | None:
    """Parse ``check: {tolerances: {...}, functions: {name: {tolerances: {...}}}}``."""
    if node is None:
        return None
    if not isinstance(node, yaml.MappingNode):
        issues.add(node, "check", "check must be a mapping with 'tolerances' and/or 'functions'")
        return None
    _check_keys(issues, node, "check", {"tolerances", "functions"})
    tolerances: dict = {}
    tnode = _get(node, "tolerances")
    if tnode is not None:
        tolerances = _tolerances(issues, tnode, "check.tolerances")
    per_function: dict = {}
    fnode = _get(node, "functions")
    if fnode is not None:
        if not isinstance(fnode, yaml.MappingNode):
            issues.add(fnode, "check.functions", "must be a mapping of function name to {tolerances: ...}")
        else:
            for knode, vnode in fnode.value:
                name = str(knode.value)
                path = f"check.functions.{name}"
                if name not in functions:
                    close = _close(name, functions)
                    issues.add(knode, "check.functions", f"{name!r} is not a function of this spec"
                               + (f" (did you mean {close!r}?)" if close else ""))
                    continue
                if not isinstance(vnode, yaml.MappingNode):
                    issues.add(vnode, path, "must be a mapping with 'tolerances'")
                    continue
                _check_keys(issues, vnode, path, {"tolerances"})
                t = _get(vnode, "tolerances")
                per_function[name] = _tolerances(issues, t, f"{path}.tolerances") if t is not None else {}
    return CheckSpec(tolerances, per_function)


def _validate_axes(parser: _Parser, mesh: MeshSpec, functions: dict[str, FunctionSpec]) -> None:
    """Every sharding names only mesh axes, each at most once."""
    names = set(mesh.names)

    def check(sharding: Sharding, loc: Loc, path: str) -> None:
        if sharding.kind != "spec":
            return
        axes = sharding.axes
        for a in axes:
            if a not in names:
                close = _close(a, names)
                parser.issues.items.append(
                    f"{loc}: {path}: sharding {sharding} names mesh axis {a!r}, but the mesh has "
                    + (", ".join(repr(n) for n in mesh.names) if names else "no axes")
                    + (f" (did you mean {close!r}?)" if close else ""))
        dup = sorted({a for a in axes if axes.count(a) > 1})
        if dup:
            parser.issues.items.append(f"{loc}: {path}: sharding {sharding} uses mesh axis {dup[0]!r} twice")

    def walk(tree: Any, path: str) -> None:
        if isinstance(tree, LeafSpec):
            check(tree.sharding, tree.loc, path)
        elif isinstance(tree, InitSpec):
            for i, r in enumerate(tree.rules):
                if r.sharding is not None:
                    check(r.sharding, r.loc, f"{tree.path}.rules[{i}]")
        elif isinstance(tree, (list, tuple)):
            for i, t in enumerate(tree):
                walk(t, f"{path}[{i}]")
        elif isinstance(tree, dict):
            for k, t in tree.items():
                walk(t, f"{path}.{k}")

    def walk_out(t: Any, path: str, fallback: Loc) -> None:
        if isinstance(t, Sharding):
            check(t, parser.out_locs.get(path) or fallback, path)
        elif isinstance(t, OutRulesSpec):
            for r in t.rules:
                if r.sharding is not None:
                    check(r.sharding, r.loc, path)
        elif isinstance(t, (list, tuple)):
            for i, x in enumerate(t):
                walk_out(x, f"{path}[{i}]", fallback)
        elif isinstance(t, dict):
            for k, x in t.items():
                walk_out(x, f"{path}.{k}", fallback)

    for f in functions.values():
        walk(list(f.args), f"functions.{f.name}.args")
        walk(f.kwargs, f"functions.{f.name}.kwargs")
        if f.out_shardings is not None:
            walk_out(f.out_shardings, f"functions.{f.name}.out_shardings", f.loc or Loc("<spec>", 1, 1))


