"""The YAML spec: a function's abstract inputs, its mesh, and how to stage it.

The spec is parsed from YAML with PyYAML's safe composer, so that every node keeps its file, line
and column. Validation collects *every* problem before raising one :class:`~stagetool.core.errors.SpecError`
whose lines read ``file:line:col: functions.train_step.args[1].tokens: what is wrong``.

This module knows nothing of JAX: it turns text into plain frozen records (:class:`Spec`,
:class:`FunctionSpec`, :class:`LeafSpec`, ...). ``stagetool.inputs`` turns those into
``jax.ShapeDtypeStruct``s on a mesh.

The format is documented in docs/spec.md; a compact example::

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

from pathlib import Path
from typing import Any

import yaml

from stagetool.core.errors import SpecError
from stagetool.core.mesh import MeshSpec, axis_name_problem, device_count_problem
from stagetool.core.sharding import Sharding
from stagetool.spec.model import CheckSpec, FunctionSpec, InitSpec, LeafSpec, Loc, OutRulesSpec, Spec
from stagetool.spec.values import ValueParser
from stagetool.spec.yaml_nodes import (Issues, SpecLimit, anchor_keys, check_keys, child, close_match, compose_bounded,
                                        duplicate_keys, keys_of, merge_keys, plain)

SPEC_VERSION = 1

MAX_SPEC_BYTES = 64 * 2**20
"""A spec larger than this (64 MiB) is refused unread."""


class _Parser(ValueParser):
    """The spec's sections: the mesh and each function (the values in them: :class:`ValueParser`)."""

    def mesh(self, node: yaml.Node | None) -> MeshSpec:
        """``mesh: {axes: {name: size, ...}, axis_types: auto | explicit, context: true | false}`` (no
        axes when absent; axis types and context as the code has them when not given)."""
        if node is None:
            return MeshSpec((), axis_types_given=False)
        if not isinstance(node, yaml.MappingNode):
            self.issues.add(node, "mesh", "mesh must be a mapping with 'axes' (e.g. {axes: {data: 2, model: 4}})")
            return MeshSpec((), axis_types_given=False)
        check_keys(self.issues, node, "mesh", {"axes", "axis_types", "context"})
        axes_node = child(node, "axes")
        axes: list[tuple[str, int]] = []
        if axes_node is None:
            self.issues.add(node, "mesh", "mesh needs 'axes', e.g. {data: 2, model: 4}")
        elif not isinstance(axes_node, yaml.MappingNode):
            self.issues.add(axes_node, "mesh.axes", "axes must be an ordered mapping of axis name to size, e.g. {data: 2, model: 4}")
        else:
            for k, v in axes_node.value:
                size = plain(v)
                name = plain(k)
                problem = axis_name_problem(name)
                if problem:
                    self.issues.add(k, "mesh.axes", problem)
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
        types_node = child(node, "axis_types")
        types = "auto"
        if types_node is not None:
            types = str(plain(types_node))
            if types not in ("auto", "explicit"):
                self.issues.add(types_node, "mesh.axis_types", f"axis_types must be 'auto' or 'explicit', not {types!r}")
                types = "auto"
        context_node = child(node, "context")
        context = None
        if context_node is not None:
            context = plain(context_node)
            if not isinstance(context, bool):
                self.issues.add(context_node, "mesh.context",
                                f"context must be true (trace under jax.set_mesh of the staged mesh) or false (under "
                                f"no context mesh), not {context!r}; leave it out to stage as the code runs")
                context = None
        return MeshSpec(tuple(axes), types, self.issues.loc(node), axis_types_given=types_node is not None,
                        context=context)

    def function(self, name: str, node: yaml.Node, key_node: yaml.Node) -> FunctionSpec | None:
        """One entry of ``functions``, or None after recording the problem."""
        path = f"functions.{name}"
        if isinstance(node, yaml.ScalarNode) and isinstance(plain(node), str):
            target = plain(node)  # `name: model.py:fn` with no inputs
            return FunctionSpec(name, target, (), {}, {}, (), None, self.issues.loc(key_node), self.base_dir)
        if not isinstance(node, yaml.MappingNode):
            self.issues.add(node, path, "a function must be a mapping with at least 'target'")
            return None
        check_keys(self.issues, node, path, {"target", "args", "kwargs", "static", "donate", "out_shardings",
                                              "logical_axis_rules", "tokens_per_step"})
        tnode = child(node, "target")
        target = plain(tnode) if tnode is not None else None
        if not isinstance(target, str) or ":" not in target:
            self.issues.add(tnode or node, f"{path}.target",
                            "target must be 'path/to/file.py:func', 'package.module:func' or 'module:obj.attr'")
            target = ""
        args = self.args_list(child(node, "args"), f"{path}.args")
        kwargs = self.kwargs_map(child(node, "kwargs"), f"{path}.kwargs")
        static: dict = {}
        snode = child(node, "static")
        if snode is not None:
            if not isinstance(snode, yaml.MappingNode):
                self.issues.add(snode, f"{path}.static", "static must be a mapping of argument name to value")
            else:
                for k, v in snode.value:
                    static[str(k.value)] = self.plain_value(v, f"{path}.static.{k.value}")
        donate: list = []
        dnode = child(node, "donate")
        if dnode is not None:
            values = plain(dnode)
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
        onode = child(node, "out_shardings")
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
        lnode = child(node, "logical_axis_rules")
        logical = self.logical_rules(lnode, path) if lnode is not None else self.logical_axis_rules
        if lnode is None and self.logical_axis_rules_loc is not None:
            locs.setdefault("logical_axis_rules", self.logical_axis_rules_loc)
        elif lnode is not None:
            locs["logical_axis_rules"] = self.issues.loc(lnode)
        tokens = None
        knode = child(node, "tokens_per_step")
        if knode is not None:
            tokens = plain(knode)
            if isinstance(tokens, str) and tokens.strip().isdigit():
                tokens = int(tokens.strip())  # a ${variable} substituted as text
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
                self.issues.add(knode, f"{path}.tokens_per_step", f"tokens_per_step must be a positive whole number "
                                f"(the tokens one step processes, all devices together), not {tokens!r}")
                tokens = None
        return FunctionSpec(name, target, tuple(args), kwargs, static, tuple(donate), out_shardings,
                            self.issues.loc(key_node), self.base_dir, locs, logical, tokens)


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
    except SpecLimit as e:
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
    duplicate_keys(issues, root)
    merge_keys(issues, root)
    check_keys(issues, root, "", {"version", "mesh", "platform", "topology", "gpu_target_config", "slices",
                                   "avals", "functions", "chips", "check", "logical_axis_rules"} | anchor_keys(root))
    if child(root, "logical_axis_rules") is not None:
        parser.logical_axis_rules = parser.logical_rules(child(root, "logical_axis_rules"), "")
        parser.logical_axis_rules_loc = issues.loc(child(root, "logical_axis_rules"))
    vnode = child(root, "version")
    if vnode is not None and plain(vnode) != SPEC_VERSION:
        issues.add(vnode, "version", f"unsupported spec version {plain(vnode)!r}; this stagetool reads version {SPEC_VERSION}")
    before_mesh = len(issues.items)
    mesh = parser.mesh(child(root, "mesh"))
    # No axes because the mesh has a problem of its own, or is missing while a top-level key is a
    # misspelt 'mesh' ('mseh:'): the shardings are not checked against axes nobody wrote down (each
    # would be one more "the mesh has no axes" after the one error that matters).
    mesh_unknown = not mesh.names and (
        len(issues.items) > before_mesh
        or (child(root, "mesh") is None and any(isinstance(k, str) and k != "mesh" and close_match(k, {"mesh"})
                                               for _, k in keys_of(root))))
    platform = None
    pnode = child(root, "platform")
    if pnode is not None:
        platform = plain(pnode)
        if platform not in ("cpu", "gpu", "tpu"):
            issues.add(pnode, "platform", f"platform must be cpu, gpu or tpu, not {platform!r}")
    topology = None
    tnode = child(root, "topology")
    if tnode is not None:
        topology = str(plain(tnode))
    gpu_config = None
    gnode = child(root, "gpu_target_config")
    if gnode is not None:
        value = plain(gnode)
        if not isinstance(value, str) or not value.strip():
            issues.add(gnode, "gpu_target_config", "gpu_target_config must be a GpuTargetConfigProto file (relative "
                                                   f"to the spec's folder), not {value!r}")
        else:
            gpu_config = value if Path(value).is_absolute() else str((base_dir or Path.cwd()) / value)
    slices = None
    snode = child(root, "slices")
    if snode is not None:
        value = plain(snode)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            issues.add(snode, "slices", f"slices must be a whole number of TPU slices ≥ 1, not {value!r}")
        else:
            slices = value
    avals = "global"
    anode = child(root, "avals")
    if anode is not None:
        avals = str(plain(anode))
        if avals not in ("global", "local"):
            issues.add(anode, "avals", f"avals must be 'global' or 'local', not {avals!r}")
    functions: dict[str, FunctionSpec] = {}
    fnode = child(root, "functions")
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
    cnode = child(root, "chips")
    if cnode is not None:
        if not isinstance(cnode, yaml.MappingNode):
            issues.add(cnode, "chips", "chips must be a mapping of chip name to its figures")
        else:
            chips = plain(cnode)
            _check_chips(issues, cnode)
    if not mesh_unknown:
        _validate_axes(parser, mesh, functions)
    check = _check_section(issues, child(root, "check"), functions)
    issues.raise_if_any()
    locs = {key: issues.loc(node) for key, node in (("platform", pnode), ("topology", tnode), ("slices", snode),
                                                    ("gpu_target_config", gnode)) if node is not None}
    return Spec(path, mesh, platform, topology, avals, functions, chips, check, locs, slices, gpu_config)


def _check_chips(issues: Issues, node: yaml.MappingNode) -> None:
    """Validate ``chips:`` entries with :func:`stagetool.core.chips.merge_chips`, each problem
    placed at the node it is about (the field's value, an unknown field's key, or the chip's name)."""
    from stagetool.core.chips import merge_chips

    seen: dict[str, str] = {}
    for knode, vnode in node.value:
        name = plain(knode)
        key = name.strip().lower() if isinstance(name, str) else name
        if key in seen:  # TPU-V5E beside tpu-v5e: one chip, and the last would win
            issues.add(knode, f"chips.{name}", f"the same chip as {seen[key]!r} (chip names are read in lower case); "
                                               "give its figures once")
            continue
        if isinstance(key, str):
            seen[key] = name
        try:
            merge_chips({name: plain(vnode)})
        except SpecError as e:
            prefix = f"chips.{name}"
            for issue in e.issues:
                rest = issue[len(prefix):] if issue.startswith(prefix) else ": " + issue
                where, at = prefix, knode
                if rest.startswith("."):
                    field, _, rest = rest[1:].partition(":")
                    rest = ":" + rest
                    where = f"{prefix}.{field}"
                    at = _chip_field_node(vnode, field) or at
                issues.add(at, where, rest[1:].strip())


def _chip_field_node(vnode: yaml.Node, field: str) -> yaml.Node | None:
    """The node of ``field`` (``peak_flops_per_second_bf16``, ``profile.measured_on``) in a chip entry:
    its value for a known field, else its key; None where the entry has no such key."""
    at = None
    node = vnode
    for part in field.split("."):
        if not isinstance(node, yaml.MappingNode):
            break
        found = next(((fk, fv) for fk, fv in node.value if fk.value == part), None)
        if found is None:
            break
        fk, fv = found
        at = fv if fv is not None and (part in _chip_fields() or node is not vnode) else fk
        node = fv
    return at


def _chip_fields() -> tuple[str, ...]:
    from stagetool.core.chips import CHIP_FIELDS

    return CHIP_FIELDS


def _tolerances(issues: Issues, node: yaml.Node, path: str) -> dict:
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
            close = close_match(name, TOLERANCE_KEYS)
            issues.add(knode, path, f"unknown tolerance {name!r}; expected one of {', '.join(TOLERANCE_KEYS)}"
                       + (f" (did you mean {close!r}?)" if close else ""))
            continue
        try:
            out[name] = parse_tolerance(plain(vnode))
        except UsageError as e:
            issues.add(vnode, f"{path}.{name}", e.message)
    return out


def _check_section(issues: Issues, node: yaml.Node | None, functions: dict) -> CheckSpec | None:
    """Parse ``check: {tolerances: {...}, functions: {name: {tolerances: {...}}}}``."""
    if node is None:
        return None
    if not isinstance(node, yaml.MappingNode):
        issues.add(node, "check", "check must be a mapping with 'tolerances' and/or 'functions'")
        return None
    check_keys(issues, node, "check", {"tolerances", "functions"})
    tolerances: dict = {}
    tnode = child(node, "tolerances")
    if tnode is not None:
        tolerances = _tolerances(issues, tnode, "check.tolerances")
    per_function: dict = {}
    fnode = child(node, "functions")
    if fnode is not None:
        if not isinstance(fnode, yaml.MappingNode):
            issues.add(fnode, "check.functions", "must be a mapping of function name to {tolerances: ...}")
        else:
            for knode, vnode in fnode.value:
                name = str(knode.value)
                path = f"check.functions.{name}"
                if name not in functions:
                    close = close_match(name, functions)
                    issues.add(knode, "check.functions", f"{name!r} is not a function of this spec"
                               + (f" (did you mean {close!r}?)" if close else ""))
                    continue
                if not isinstance(vnode, yaml.MappingNode):
                    issues.add(vnode, path, "must be a mapping with 'tolerances'")
                    continue
                check_keys(issues, vnode, path, {"tolerances"})
                t = child(vnode, "tolerances")
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
                close = close_match(a, names)
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
