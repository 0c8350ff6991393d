"""The values a spec's functions are made of, parsed into records (:class:`ValueParser`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from stagetool.core.patterns import backtracking_risk
from stagetool.core.sharding import UNSPECIFIED
from stagetool.spec.leaves import KEY_CALL_RE, dtype_name, parse_leaf, parse_sharding, shape_problem
from stagetool.spec.model import (STAGED_FORMS, ArgSpec, CallSpec, InitSpec, KeySpec, LeafSpec, LikeSpec, Loc, OutRulesSpec,
                                  RefSpec, Rule, StagedSpec)
from stagetool.spec.yaml_nodes import Issues, check_keys, child, keys_of, plain, short


class ValueParser:
    """The spec's values as records: argument pytrees (compact leaves, ``{shape:, dtype:}``,
    ``key(N)``), ``{init:}`` / ``{call:}`` / ``{ref:}`` / ``{arg:}`` nodes, sharding rules,
    logical axis rules and ``out_shardings`` trees; every problem recorded in :attr:`issues` at
    its node (nothing raised here).

    Attributes:
      issues: the problems found (see :class:`~stagetool.spec.yaml_nodes.Issues`).
      base_dir: the folder the spec's relative targets are found from.
      out_locs: per ``out_shardings`` key path, where that sharding is written.
      logical_axis_rules / logical_axis_rules_loc: the top-level ``logical_axis_rules`` (what
        :meth:`logical_rules` gives) and where, for functions that do not give their own.
    """

    def __init__(self, file: str, base_dir: Path):
        self.issues = Issues(file)
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
            value = plain(node)
            if isinstance(value, str):
                km = KEY_CALL_RE.match(value)
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
        keys = {k for _, k in keys_of(node)}
        if self.is_staged(node):
            return self.staged(node, path)
        if "init" in keys:
            return self.init(node, path)
        if "call" in keys:
            return self.call(node, path)
        if "ref" in keys:
            return self.ref(node, path)
        if "arg" in keys and (plain_strings or self.is_arg_ref(node)):
            return self.arg_ref(node, path)
        if {"shape", "dtype"} <= keys:
            return self.expanded_leaf(node, path)
        out = {}
        for k, v in node.value:
            out[str(plain(k))] = self.tree(v, f"{path}.{k.value}" if path else str(k.value),
                                            plain_strings=plain_strings)
        return out

    def plain_value(self, node: yaml.Node, path: str) -> Any:
        """A plain Python value (an argument of ``call``, a static value): strings stay strings;
        ``{call: ...}`` nests; ``{arg: N}`` is the value built for argument ``N``."""
        if isinstance(node, yaml.MappingNode):
            if self.is_staged(node):
                return self.staged(node, path)
            if self.is_arg_ref(node):
                return self.arg_ref(node, path)
            if child(node, "call") is not None:
                return self.call(node, path)
            if child(node, "ref") is not None:
                return self.ref(node, path)
            return {plain(k): self.plain_value(v, f"{path}.{k.value}") for k, v in node.value}
        if isinstance(node, yaml.SequenceNode):
            items = [self.plain_value(n, f"{path}[{i}]") for i, n in enumerate(node.value)]
            return tuple(items) if node.tag == "!tuple" else items
        return plain(node)

    @staticmethod
    def is_arg_ref(node: yaml.MappingNode) -> bool:
        """A one-key mapping ``{arg: N}`` / ``{arg: name}`` (N an integer, name a Python identifier):
        a mapping ``{arg: 'f32[4]'}`` stays a pytree of leaves."""
        if not (len(node.value) == 1 and isinstance(node.value[0][0], yaml.ScalarNode)
                and node.value[0][0].value == "arg" and isinstance(node.value[0][1], yaml.ScalarNode)):
            return False
        value = plain(node.value[0][1])
        return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value.isidentifier())

    @staticmethod
    def is_staged(node: yaml.MappingNode) -> bool:
        """A one-key mapping ``{mesh: staged | abstract}`` or ``{devices: ...}`` (:class:`StagedSpec`); a
        mapping ``{mesh: 'f32[4]'}`` stays a pytree of leaves."""
        return (len(node.value) == 1 and isinstance(node.value[0][0], yaml.ScalarNode)
                and node.value[0][0].value in STAGED_FORMS and isinstance(node.value[0][1], yaml.ScalarNode)
                and node.value[0][1].value in ("staged", "abstract"))

    def staged(self, node: yaml.MappingNode, path: str) -> StagedSpec | None:
        """``{mesh: staged | abstract}`` / ``{devices: staged}``, or None after recording the problem."""
        key, value = str(node.value[0][0].value), plain(node.value[0][1])
        if value not in STAGED_FORMS[key]:
            forms = " or ".join(f"{{{key}: {f}}}" for f in STAGED_FORMS[key])
            self.issues.add(node.value[0][1], f"{path}.{key}", f"{{{key}: {value!r}}} is not a form stagetool knows: "
                            f"write {forms} (the {key} stagetool stages on)")
            return None
        return StagedSpec(key, str(value), self.issues.loc(node))

    def expanded_leaf(self, node: yaml.MappingNode, path: str) -> LeafSpec | None:
        """``{shape: [...], dtype: ..., sharding: ...}``: a leaf written out, or None after recording the problem."""
        loc = self.issues.loc(node)
        before = len(self.issues.items)
        check_keys(self.issues, node, path, {"shape", "dtype", "sharding"})
        ok = len(self.issues.items) == before
        shape_node, dtype_node, sh_node = child(node, "shape"), child(node, "dtype"), child(node, "sharding")
        shape = plain(shape_node)
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            self.issues.add(shape_node, f"{path}.shape", f"shape must be a list of non-negative integers, not {shape!r}")
            ok = False
        elif shape_problem(shape):
            self.issues.add(shape_node, f"{path}.shape", shape_problem(shape))
            ok = False
        try:
            dtype = dtype_name(str(plain(dtype_node)))
        except ValueError as e:
            self.issues.add(dtype_node, f"{path}.dtype", str(e))
            ok = False
        sharding = UNSPECIFIED
        if sh_node is not None:
            try:
                sharding = parse_sharding(plain(sh_node))
            except ValueError as e:
                self.issues.add(sh_node, f"{path}.sharding", str(e))
                ok = False
        return LeafSpec(tuple(shape), dtype, sharding, loc) if ok else None

    def target_of(self, node: yaml.MappingNode, key: str, path: str) -> str | None:
        """The ``file.py:name`` / ``pkg.mod:name`` under ``key``, or None after recording the problem."""
        target = plain(child(node, key))
        if not isinstance(target, str) or ":" not in target:
            self.issues.add(child(node, key), f"{path}.{key}",
                            f"{key} must name a callable as 'file.py:name' or 'pkg.mod:name', not {target!r}")
            return None
        return target

    def call(self, node: yaml.MappingNode, path: str) -> CallSpec | None:
        """``{call: file.py:fn, args: [...], kwargs: {...}}`` with plain values, or None after recording the problem."""
        check_keys(self.issues, node, path, {"call", "args", "kwargs"})
        target = self.target_of(node, "call", path)
        if target is None:
            return None
        args: list = []
        anode = child(node, "args")
        if anode is not None:
            if not isinstance(anode, yaml.SequenceNode):
                self.issues.add(anode, f"{path}.args", "must be a list (one entry per positional argument)")
            else:
                args = [self.plain_value(n, f"{path}.args[{i}]") for i, n in enumerate(anode.value)]
        kwargs: dict = {}
        knode = child(node, "kwargs")
        if knode is not None:
            if not isinstance(knode, yaml.MappingNode):
                self.issues.add(knode, f"{path}.kwargs", "must be a mapping of argument name to value")
            else:
                kwargs = {str(k.value): self.plain_value(v, f"{path}.kwargs.{k.value}") for k, v in knode.value}
        return CallSpec(target, tuple(args), kwargs, self.issues.loc(node))

    def arg_ref(self, node: yaml.MappingNode, path: str) -> ArgSpec | None:
        """``{arg: N}`` / ``{arg: name}``: another argument's built value, wherever a value is (init_args,
        a ``{call:}``'s own args/kwargs, a static value, an argument)."""
        check_keys(self.issues, node, path, {"arg"})
        arg = plain(child(node, "arg"))
        if isinstance(arg, bool) or not isinstance(arg, (int, str)) or (isinstance(arg, int) and arg < 0):
            self.issues.add(child(node, "arg"), path, f"arg names another argument of the function by position "
                            f"(0, 1, ...) or by name, not {arg!r}")
            return None
        return ArgSpec(arg, self.issues.loc(node))

    def ref(self, node: yaml.MappingNode, path: str) -> RefSpec | None:
        """``{ref: file.py:obj, rules: [...]}``: an object whose arrays are the inputs (sharded by the
        rules where given), or None after recording the problem."""
        check_keys(self.issues, node, path, {"ref", "rules"})
        target = self.target_of(node, "ref", path)
        rules_node = child(node, "rules")
        rules = self.rules(rules_node, path)
        return RefSpec(target, self.issues.loc(node), tuple(rules), has_rules=rules_node is not None) \
            if target is not None else None

    def init(self, node: yaml.MappingNode, path: str) -> InitSpec | None:
        """``{init: file.py:fn, init_args:, init_kwargs:, rules:}``, or None after recording the problem."""
        check_keys(self.issues, node, path, {"init", "init_args", "init_kwargs", "rules"})
        target = self.target_of(node, "init", path)
        if target is None:
            return None
        args = self.args_list(child(node, "init_args"), f"{path}.init_args", plain_strings=True)
        kwargs = self.kwargs_map(child(node, "init_kwargs"), f"{path}.init_kwargs", plain_strings=True)
        rules_node = child(node, "rules")
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
            return self.call(node, key) if child(node, "call") is not None else self._bad_rules(node, key)
        if isinstance(node, yaml.SequenceNode):
            pairs = []
            for i, item in enumerate(node.value):
                value = plain(item)
                if not (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str)
                        and (value[1] is None or isinstance(value[1], str)
                             or (isinstance(value[1], (list, tuple)) and all(isinstance(a, str) for a in value[1])))):
                    self.issues.add(item, f"{key}[{i}]", f"a logical axis rule is [logical name, mesh axis], e.g. "
                                    f"[embed, model] or [batch, [data, fsdp]] or [heads, null], not {value!r}")
                    continue
                axis = tuple(value[1]) if isinstance(value[1], (list, tuple)) else value[1]
                pairs.append((value[0], axis))
            return tuple(pairs)
        value = plain(node)
        if isinstance(value, str) and ":" in value:
            return value
        return self._bad_rules(node, key)

    def _bad_rules(self, node: yaml.Node, key: str) -> None:
        self.issues.add(node, key, "logical_axis_rules is 'model.py:NAME' (rules, a function returning them, or an "
                        "object with a logical_axis_rules attribute), {call: model.py:fn, args: [...]}, or a list "
                        f"of [logical name, mesh axis] pairs, not {plain(node)!r}")
        return None

    def rules(self, rules_node: yaml.Node | None, path: str) -> list[Rule]:
        """``[regex, sharding]`` pairs and ``{call: file.py:fn}`` callables, in order."""
        rules: list[Rule] = []
        if isinstance(rules_node, yaml.MappingNode) and child(rules_node, "call") is not None:
            # rules: {call: model.py:fsdp_spec}: one callable deciding every leaf
            check_keys(self.issues, rules_node, f"{path}.rules", {"call"})
            target = self.target_of(rules_node, "call", f"{path}.rules")
            return [Rule(None, None, self.issues.loc(rules_node), call=target)] if target is not None else []
        if rules_node is not None:
            if not isinstance(rules_node, yaml.SequenceNode):
                self.issues.add(rules_node, f"{path}.rules", "rules must be a list of [regex, sharding] pairs, "
                                "or a callable {call: model.py:spec_of} (path, ShapeDtypeStruct) -> PartitionSpec | None")
            else:
                for i, rn in enumerate(rules_node.value):
                    rules += self._one_rule(rn, f"{path}.rules[{i}]")
        return rules

    def _one_rule(self, rn: yaml.Node, rpath: str) -> list[Rule]:
        """One entry of ``rules``: ``[regex, sharding]`` or ``{call: ...}``; [] after recording the problem."""
        if isinstance(rn, yaml.MappingNode) and child(rn, "call") is not None:
            check_keys(self.issues, rn, rpath, {"call"})
            target = self.target_of(rn, "call", rpath)
            return [Rule(None, None, self.issues.loc(rn), call=target)] if target is not None else []
        if not (isinstance(rn, yaml.SequenceNode) and len(rn.value) == 2):
            self.issues.add(rn, rpath, "a rule is a pair [regex, sharding], e.g. ['.*/wq$', [null, model]], "
                            "or a callable {call: model.py:spec_of} (path, ShapeDtypeStruct) -> PartitionSpec | None")
            return []
        pat_text = plain(rn.value[0])
        risk = backtracking_risk(str(pat_text))
        if risk is not None:
            self.issues.add(rn.value[0], rpath, f"regular expression {short(str(pat_text))}: {risk}; write a flatter "
                            "pattern ('.*' in place of the repeated group), or give a callable rule "
                            "{call: model.py:spec_of}")
            return []
        try:
            pattern = re.compile(str(pat_text))
        except re.error as e:
            self.issues.add(rn.value[0], rpath, f"bad regular expression {pat_text!r}: {e}")
            return []
        except (RecursionError, OverflowError, MemoryError):  # 1,000 nested groups: Python's compiler recurses
            self.issues.add(rn.value[0], rpath, f"regular expression {short(str(pat_text))} is nested too "
                            "deeply or is too large to compile; write a flatter pattern")
            return []
        try:
            sharding = parse_sharding(plain(rn.value[1]))
        except ValueError as e:
            self.issues.add(rn.value[1], rpath, str(e))
            return []
        return [Rule(pattern, sharding, self.issues.loc(rn))]

    def args_list(self, node: yaml.Node | None, path: str, *, plain_strings: bool = False) -> list:
        """A list of argument pytrees (``args``, ``init_args``; see :meth:`tree`)."""
        if node is None:
            return []
        if not isinstance(node, yaml.SequenceNode):
            self.issues.add(node, path, "must be a list (one entry per positional argument)")
            return []
        return [self.tree(n, f"{path}[{i}]", plain_strings=plain_strings) for i, n in enumerate(node.value)]

    def kwargs_map(self, node: yaml.Node | None, path: str, *, plain_strings: bool = False) -> dict:
        """A mapping of argument name to pytree (``kwargs``, ``init_kwargs``; see :meth:`tree`)."""
        if node is None:
            return {}
        if not isinstance(node, yaml.MappingNode):
            self.issues.add(node, path, "must be a mapping of argument name to value")
            return {}
        return {str(k.value): self.tree(v, f"{path}.{k.value}", plain_strings=plain_strings) for k, v in node.value}

    def out_tree(self, node: yaml.Node, path: str) -> Any:
        """An ``out_shardings`` tree: a sharding (None for ``auto``), a tuple of trees, a mapping,
        ``{like: arg}`` or ``{rules: [...]}``; None after recording the problem."""
        self.out_locs[path] = self.issues.loc(node)
        value = plain(node)
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
                    plain(n) in ("auto", "replicated") for n in node.value):
                try:
                    return parse_sharding(value)
                except ValueError as e:
                    self.issues.add(node, path, str(e))
                    return None
            return tuple(self.out_tree(n, f"{path}[{i}]") for i, n in enumerate(node.value))
        if isinstance(node, yaml.MappingNode):
            keys = [str(k.value) for k, _ in node.value]
            if keys == ["like"]:
                arg = plain(child(node, "like"))
                if isinstance(arg, bool) or not isinstance(arg, (int, str)):
                    self.issues.add(node, path, f"like names a positional argument (an index) or a keyword argument "
                                    f"(a name), not {arg!r}")
                    return None
                return LikeSpec(arg, self.issues.loc(node))
            if keys == ["rules"]:
                return OutRulesSpec(tuple(self.rules(child(node, "rules"), path)), self.issues.loc(node))
            return {str(k.value): self.out_tree(v, f"{path}.{k.value}") for k, v in node.value}
        self.issues.add(node, path, f"{value!r} is not a sharding")
        return None
