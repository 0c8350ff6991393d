"""Shardy's sharding propagation, rerun with its debug options to say where each sharding came from.

JAX exposes no API for *why* a value is sharded the way it is; Shardy (the partitioner behind
``jax_use_shardy_partitioner``) can record it. This module is the one place that reaches for it,
through jaxlib's MLIR Python bindings (``jaxlib.mlir``; the context comes from JAX's public
``jax.interpreters.mlir.make_ir_context``):

1. parse ``Lowered.as_text(debug_info=True)`` (StableHLO with ``sdy`` shardings and each op's
   source location);
2. turn every ``func.call`` of a nested ``jax.jit`` into an ``sdy.named_computation`` holding a copy
   of the callee (what XLA's import does before it propagates; the bindings register no inliner), and
   drop the callees no call uses;
   give every ``chlo.top_k`` the factor rule XLA:CPU and GPU partition it by (its last dimension
   needs replication, the others are batch: :func:`_top_k_rules`), which the bindings' Shardy lacks;
3. run ``sdy-import-pipeline`` and ``sdy-user-priority-propagate{debug-sharding-origins=true}``,
   then ``sdy-populate-op-sharding-rules`` (each op's factor mapping: which operand and result
   dimensions are the same loop, which are reductions);
4. read back, for every op, its operands' and results' shardings (mesh axes per dimension), for
   each mesh axis the origin Shardy recorded (``input: N``, ``output: N``, ``constraint_K``,
   ``self``), its factor rule and its location; and the final shardings of the entry's arguments
   and results.

The records hold no MLIR object. Whether this propagation is the one the compile ran is *not*
decided here: :func:`stagetool.analysis.causes` compares :attr:`Propagation.inputs` /
:attr:`Propagation.outputs` with ``Compiled.input_shardings`` / ``output_shardings`` and says the
explanation is unavailable where they differ.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable

from stagetool.hlo.parser import SourceFrame
from stagetool.facts import Operand, PropagatedOp, Propagation, ShardingRule, ValueSharding

__all__ = ["ShardyUnavailable", "mlir_value", "propagate", "propagate_lowered"]


# -- jaxlib's MLIR bindings (from jaxlib 0.7 to 0.12; tests/staging/test_compat.py) --------

def mlir_value(value: Any) -> Any:
    """An MLIR ``Value`` as its concrete class, ``ir.OpResult`` or ``ir.BlockArgument``, whatever the
    bindings: jaxlib ≥ 0.9's ``maybe_downcast()`` returns it; 0.7 and 0.8 return a plain ``Value``,
    which is cast after ``OpResult.isinstance`` / ``BlockArgument.isinstance`` (static methods those
    releases have). Anything else is returned as ``maybe_downcast()`` gives it."""
    from jaxlib.mlir import ir

    value = value.maybe_downcast()
    if isinstance(value, (ir.OpResult, ir.BlockArgument)):
        return value
    for cls in (ir.OpResult, ir.BlockArgument):
        check = getattr(cls, "isinstance", None)
        if check is not None and check(value):
            return cls(value)
    return value


_PROPAGATE = ("builtin.module(symbol-dce, sdy-import-pipeline, "
              "sdy-user-priority-propagate{debug-sharding-origins=true}, "
              "func.func(sdy-populate-op-sharding-rules))")
_MAX_CALL_DEPTH = 64


class ShardyUnavailable(Exception):
    """The module cannot be propagated here (no Shardy shardings, a pass that failed); the message says why."""


def propagate(lowered_text: str, *, top_k_rule: bool = True) -> Propagation:
    """Rerun Shardy's propagation with sharding origins on a lowered module (see the module docstring).

    Args:
      lowered_text: ``Lowered.as_text(debug_info=True)`` (StableHLO with ``sdy`` attributes).
      top_k_rule: give ``chlo.top_k`` XLA's factor rule (:func:`_top_k_rules`); False for TPU, whose
        compile partitions a top-k its own way (candidates per shard, results replicated), as this
        Shardy without a rule does.

    Raises:
      ShardyUnavailable: the module carries no Shardy mesh (GSPMD lowering, or no mesh at all), or
        jaxlib's parser or a pass refused it (the first line of MLIR's message).
    """
    if "sdy.mesh" not in lowered_text:
        raise ShardyUnavailable("the lowered module has no Shardy mesh (GSPMD partitioner, or no mesh)")
    from jax.interpreters.mlir import make_ir_context
    from jaxlib.mlir import ir, passmanager

    with make_ir_context():
        try:
            module = ir.Module.parse(lowered_text)
            _calls_to_named_computations(module)
            _own_rules(module, top_k_rule)
            passmanager.PassManager.parse(_PROPAGATE).run(module.operation)
            _own_rules(module, top_k_rule)  # propagation drops them, and sdy-populate-op-sharding-rules has none
        except Exception as e:  # noqa: BLE001 - MLIR raises MLIRError / ValueError with its diagnostics
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ShardyUnavailable(f"Shardy's propagation could not be rerun: {first[:300]}") from None
        return _read(module)


def propagate_lowered(lowered, *, top_k_rule: bool = True) -> tuple[Propagation | None, str | None]:
    """:func:`propagate` on a ``jax.stages.Lowered``: ``(propagation, None)``, or ``(None, why not)``
    (no Shardy lowering; the rerun failed). Never raises for a module it cannot explain."""
    text, why_not = _printed(lowered)
    return (None, why_not) if text is None else _propagated(text, top_k_rule)


def propagate_beside(lowered, *, top_k_rule: bool = True) -> Callable[[], tuple[Propagation | None, str | None]]:
    """:func:`propagate_lowered` started in a thread of its own, for the caller to compile meanwhile;
    returns the function that waits for it and gives what :func:`propagate_lowered` gives.

    XLA's compile runs without Python's interpreter lock, so on a machine with a second core the rerun
    costs no wall time (about 0.2 s of the transformer example's report). The module is printed here,
    in the caller's thread, before the compile starts; the thread parses that text into an MLIR
    context of its own and touches nothing of JAX's. What the thread raises would be lost with it: it
    becomes the reason there are no causes."""
    import threading

    text, why_not = _printed(lowered)
    if text is None:
        return lambda: (None, why_not)
    result: list[tuple[Propagation | None, str | None]] = []

    def run() -> None:
        try:
            result.append(_propagated(text, top_k_rule))
        except Exception as e:  # noqa: BLE001 - reported as the reason there are no causes
            result.append((None, f"Shardy's propagation could not be rerun: {type(e).__name__}: {e}"))

    thread = threading.Thread(target=run, name="stagetool-propagation", daemon=True)
    thread.start()

    def wait() -> tuple[Propagation | None, str | None]:
        thread.join()
        return result[0] if result else (None, "Shardy's propagation did not finish")

    return wait


def _printed(lowered) -> tuple[str | None, str | None]:
    """``(Lowered.as_text(debug_info=True), None)``, or ``(None, why not)``."""
    try:
        return lowered.as_text(debug_info=True), None
    except Exception as e:  # noqa: BLE001 - a lowering JAX cannot print is one we cannot explain
        return None, f"the lowered module could not be printed: {e}"


def _propagated(text: str, top_k_rule: bool) -> tuple[Propagation | None, str | None]:
    try:
        return propagate(text, top_k_rule=top_k_rule), None
    except ShardyUnavailable as e:
        return None, str(e)


# ---- func.call -> sdy.named_computation


def _funcs(module) -> dict[str, object]:
    from jaxlib.mlir import ir

    out = {}
    for op in module.body.operations:
        if op.operation.name == "func.func":
            out[ir.StringAttr(op.attributes["sym_name"]).value] = op
    return out


def _ops_in(op) -> list:
    """Every op nested in ``op``'s regions, outer before inner, in block order."""
    out = []
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                out.append(inner.operation)
                out.extend(_ops_in(inner.operation))
    return out


def _calls_to_named_computations(module) -> None:
    """Replace every ``func.call`` reachable from ``main`` by an ``sdy.named_computation`` holding a
    copy of the callee's body, repeatedly (calls inside callees), as XLA's Shardy import does."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import sdy

    funcs = _funcs(module)
    main = funcs.get("main")
    if main is None:
        raise ShardyUnavailable("the lowered module has no main function")
    for _ in range(_MAX_CALL_DEPTH):
        calls = [op for op in _ops_in(main.operation) if op.name == "func.call"]
        if not calls:
            return
        for call in calls:
            callee_name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
            callee = funcs.get(callee_name)
            if callee is None or not callee.regions[0].blocks:
                raise ShardyUnavailable(f"a call to {callee_name!r}, which the module does not define")
            copy = callee.operation.clone(ip=ir.InsertionPoint(module.body))
            body = copy.regions[0].blocks[0]
            with ir.InsertionPoint(call), call.location:
                named = sdy.NamedComputationOp([r.type for r in call.results], callee_name, list(call.operands))
            block = named.regions[0].blocks.append(*[a.type for a in body.arguments],
                                                   arg_locs=[call.location] * len(body.arguments))
            for old, new in zip(body.arguments, block.arguments):
                old.replace_all_uses_with(new)
            ops = [o.operation for o in body.operations]
            for o in ops[:-1]:
                block.append(o)
            ret = ops[-1]
            with ir.InsertionPoint(block), ret.location:
                sdy.ReturnOp(list(ret.operands))
            ret.erase()
            copy.erase()
            for old, new in zip(call.results, named.results):
                old.replace_all_uses_with(new)
            call.erase()
    raise ShardyUnavailable(f"calls nested deeper than {_MAX_CALL_DEPTH} levels (a recursive call?)")


def _top_k_rules(module) -> None:
    """Give each ``chlo.top_k`` without one the factor rule ``([i, j])->([i, k], [i, k]) {i=B, j=V,
    k=K} need_replication={j, k}``: the leading dimensions are batch (the same loop in the operand
    and both results), the last is needed whole. Without it this Shardy propagates nothing through a
    top-k and its results come out replicated where the compile (which rewrites ``chlo.top_k`` before
    it propagates) keeps the batch sharding; :func:`stagetool.analysis.causes.unfaithful_reason`
    still checks the rerun against the compiled shardings."""
    from jaxlib.mlir import ir

    letters = "ijklmnopqrstuvwxyz"  # Shardy names factors i, j, k, ... in order
    for op in _ops_in(module.operation):
        if op.name != "chlo.top_k" or "sdy.sharding_rule" in op.attributes:
            continue
        t, r = ir.RankedTensorType(op.operands[0].type), ir.RankedTensorType(op.results[0].type)
        n = t.rank
        if n < 1 or n + 1 > len(letters) or r.rank != n:
            continue
        batch, whole, k = list(letters[:n - 1]), letters[n - 1], letters[n]
        sizes = [f"{f}={d}" for f, d in zip(batch, t.shape[:-1])] + [f"{whole}={t.shape[-1]}", f"{k}={r.shape[-1]}"]
        result = "[" + ", ".join(batch + [k]) + "]"
        rule = (f"#sdy.op_sharding_rule<([{', '.join(batch + [whole])}])->({result}, {result}) "
                f"{{{', '.join(sizes)}}} need_replication={{{whole}, {k}}}>")
        op.attributes["sdy.sharding_rule"] = ir.Attribute.parse(rule)


_RAGGED_DEFAULT = ("lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [1], "
                   "lhs_ragged_dimensions = [0], rhs_group_dimensions = [0]")


def _own_rules(module, top_k: bool) -> None:
    """The factor rules this Shardy lacks and XLA's has: ``chlo.top_k`` (:func:`_top_k_rules`, when
    ``top_k``) and :func:`_ragged_dot_rules`."""
    if top_k:
        _top_k_rules(module)
    _ragged_dot_rules(module)


def _ragged_dot_rules(module) -> None:
    """Give each ``chlo.ragged_dot`` of ``lax.ragged_dot``'s form (``x[m, k] · w[g, k, n]`` grouped by
    ``group_sizes[g]``: ragged rows, one weight per group) the rule ``([i, j], [k, j, l], [k])->([i, l])
    reduction={j} need_replication={i, k}``: the rows and the groups are needed whole (a group is a
    range of rows that ``group_sizes`` places anywhere), the contraction is summed. Other dimension
    numbers get none."""
    from jaxlib.mlir import ir

    for op in _ops_in(module.operation):
        if op.name != "chlo.ragged_dot" or "sdy.sharding_rule" in op.attributes or len(op.operands) != 3:
            continue
        if _RAGGED_DEFAULT not in str(_get(op.attributes, "ragged_dot_dimension_numbers")):
            continue
        x, w = ir.RankedTensorType(op.operands[0].type), ir.RankedTensorType(op.operands[1].type)
        if x.rank != 2 or w.rank != 3:
            continue
        rule = (f"#sdy.op_sharding_rule<([i, j], [k, j, l], [k])->([i, l]) {{i={x.shape[0]}, j={x.shape[1]}, "
                f"k={w.shape[0]}, l={w.shape[2]}}} reduction={{j}} need_replication={{i, k}}>")
        op.attributes["sdy.sharding_rule"] = ir.Attribute.parse(rule)


# ---- reading the propagated module back


def _sharding(attr, origins) -> ValueSharding | None:
    """A ``#sdy.sharding`` attribute (and its origins dict) as a record; None without one."""
    from jaxlib.mlir.dialects import sdy

    if attr is None:
        return None
    s = sdy.TensorShardingAttr(attr)
    dims = []
    for d in s.dimension_shardings:
        axes = []
        for a in sdy.DimensionShardingAttr(d).axes:
            ref = sdy.AxisRefAttr(a)
            sub = ref.sub_axis_info
            axes.append(ref.name if sub is None else f"{ref.name}:({sdy.SubAxisInfoAttr(sub).pre_size})"
                                                      f"{sdy.SubAxisInfoAttr(sub).size}")
        dims.append(tuple(axes))
    return ValueSharding(tuple(dims), _origins(origins))


def _origins(attr) -> tuple[tuple[str, str], ...]:
    from jaxlib.mlir import ir

    if attr is None:
        return ()
    d = ir.DictAttr(attr)
    out = []
    for i in range(len(d)):
        named = d[i]
        out.append((named.name, ir.StringAttr(named.attr).value))
    return tuple(sorted(out))


def _get(attrs, name: str):
    return attrs[name] if name in attrs else None


def _result_shardings(op) -> tuple[ValueSharding | None, ...]:
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import sdy

    n = len(op.results)
    attrs = op.attributes
    origins = _get(attrs, "sdy.sharding_origins")
    if op.name in ("sdy.sharding_constraint", "sdy.data_flow_edge", "sdy.reshard"):
        return (_sharding(_get(attrs, "sharding"), origins),)
    per_value = _get(attrs, "sdy.sharding")
    if per_value is None:
        return (None,) * n
    shardings = list(sdy.TensorShardingPerValueAttr(per_value).shardings)
    try:
        origin_list = list(ir.ArrayAttr(origins)) if origins is not None else []
    except ValueError:  # one dict for a single result
        origin_list = [origins]
    return tuple(_sharding(shardings[i] if i < len(shardings) else None,
                           origin_list[i] if i < len(origin_list) else None) for i in range(n))


_LOC_NAME_RE = re.compile(r'^loc\("((?:[^"\\]|\\.)*)"\(')
_FRAME_RE = re.compile(r'"((?:[^"\\]|\\.)*)"\("((?:[^"\\]|\\.)*)":(\d+):(\d+)')


_STAGETOOL_DIR = str(Path(__file__).resolve().parents[1]) + "/"


def parse_location(text: str) -> tuple[str | None, tuple[SourceFrame, ...]]:
    """``loc("jit(f)/dot_general"(callsite("f"("m.py":8:17 to :23) at ...)))`` → the op name and the
    frames, innermost first (MLIR prints a call site's callee before its caller), up to the first
    frame of stagetool: the ones from there on are how stagetool was called (the CLI, a script calling
    the Python API), not the program, and the facts cache does not key on them (an op stagetool's own
    wrapper made keeps its innermost frame)."""
    m = _LOC_NAME_RE.match(text)
    name = m.group(1) if m else None
    every = [SourceFrame(f, int(line), fn, int(col)) for fn, f, line, col in _FRAME_RE.findall(text)]
    cut = next((i for i, f in enumerate(every) if f.file.startswith(_STAGETOOL_DIR)), len(every))
    return name, tuple(every[:cut] or every[:1])  # an op of stagetool's own wrapper: its innermost frame


_FACTOR_RE = re.compile(r"\[([^\]]*)\]")


def _rule(attr) -> ShardingRule | None:
    """``#sdy.op_sharding_rule<([i, k], [k, j])->([i, j]) {i=16, j=32, k=64} reduction={k}>`` as a record."""
    if attr is None:
        return None
    text = str(attr)
    m = re.search(r"<\((.*?)\)->\((.*?)\)(.*)>$", text, re.S)
    if m is None:
        return None

    def tensors(s: str) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(p.strip() for p in t.split(",") if p.strip()) for t in _FACTOR_RE.findall(s))

    rest = m.group(3)
    sizes = tuple((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", rest.split("}")[0]))
    red = re.search(r"reduction=\{([^}]*)\}", rest)
    reductions = tuple(p.strip() for p in red.group(1).split(",") if p.strip()) if red else ()
    return ShardingRule(tensors(m.group(1)), tensors(m.group(2)), reductions, sizes)


def _read(module) -> Propagation:
    from jaxlib.mlir import ir

    main = _funcs(module)["main"]
    mesh_axes: tuple[tuple[str, int], ...] = ()
    for op in module.body.operations:
        if op.operation.name == "sdy.mesh":
            from jaxlib.mlir.dialects import sdy

            mesh = sdy.MeshAttr(op.attributes["mesh"])
            mesh_axes = tuple((sdy.MeshAxisAttr(a).name, sdy.MeshAxisAttr(a).size) for a in mesh.axes)
            break
    arg_attrs = list(ir.ArrayAttr(main.attributes["arg_attrs"])) if "arg_attrs" in main.attributes else []
    res_attrs = list(ir.ArrayAttr(main.attributes["res_attrs"])) if "res_attrs" in main.attributes else []
    entry = main.regions[0].blocks[0]
    n_args = len(entry.arguments)
    inputs, names = [], []
    for i in range(n_args):
        d = ir.DictAttr(arg_attrs[i]) if i < len(arg_attrs) else None
        inputs.append(_sharding(_get(d, "sdy.sharding"), _get(d, "sdy.sharding_origins")) if d is not None else None)
        loc = str(entry.arguments[i].location)
        m = re.fullmatch(r'loc\("((?:[^"\\]|\\.)*)"\)', loc)
        names.append(m.group(1) if m else None)
    outputs = []
    for i in range(len(main.type.results)):
        d = ir.DictAttr(res_attrs[i]) if i < len(res_attrs) else None
        outputs.append(_sharding(_get(d, "sdy.sharding"), _get(d, "sdy.sharding_origins")) if d is not None else None)

    all_ops = _ops_in(main.operation)
    index = {op: i for i, op in enumerate(all_ops)}
    users: dict[int, list[int]] = {}
    results_of = [_result_shardings(op) for op in all_ops]

    def operand(value) -> Operand:
        value = mlir_value(value)
        owner = value.owner
        if isinstance(value, ir.OpResult):
            r = value
            producer = index.get(r.owner)
            sharding = results_of[producer][r.result_number] if producer is not None else None
            return Operand(sharding, producer, _input_through(producer, r.result_number))
        arg = value
        block_owner = owner.owner.operation if owner.owner is not None else None
        if block_owner is not None and block_owner == main.operation:
            return Operand(inputs[arg.arg_number], None, arg.arg_number)
        # a loop's or named computation's block argument: the value passed in
        parent = index.get(block_owner) if block_owner is not None else None
        if parent is not None and arg.arg_number < len(all_ops[parent].operands):
            outer = operand(all_ops[parent].operands[arg.arg_number])
            sharding = _block_arg_sharding(all_ops[parent], arg.arg_number, outer.sharding)
            return Operand(sharding, outer.producer, outer.input)
        return Operand(None)

    through: dict[tuple[int, int], int | None] = {}

    def _input_through(producer, number, depth=0) -> int | None:
        """The entry argument a value is, unchanged: through data-flow edges, a loop's carried value and
        a named computation's returned argument (memoised: loops and named computations nest)."""
        if producer is None or depth > 64:
            return None
        key = (producer, number)
        if key not in through:
            through[key] = _input_through_once(producer, number, depth)
        return through[key]

    def _input_through_once(producer, number, depth) -> int | None:
        op = all_ops[producer]
        if op.name == "sdy.data_flow_edge" and op.operands:
            return _value_input(op.operands[0], depth + 1)
        if op.name in ("stablehlo.while", "sdy.named_computation"):
            region = op.regions[-1] if op.name == "stablehlo.while" else op.regions[0]
            if not region.blocks:
                return None
            block = region.blocks[0]
            ret = list(block.operations)[-1]
            if number >= len(ret.operands):
                return None
            value = mlir_value(ret.operands[number])
            if isinstance(value, ir.BlockArgument) and value.owner == block and value.arg_number < len(op.operands):
                return _value_input(op.operands[value.arg_number], depth + 1)
            if op.name == "sdy.named_computation":
                return _value_input(value, depth + 1, inner=True)
        return None

    def _value_input(value, depth, inner=False) -> int | None:
        value = mlir_value(value)
        if isinstance(value, ir.OpResult):
            return _input_through(index.get(value.owner), value.result_number, depth)
        owner = value.owner.owner.operation if value.owner.owner is not None else None
        if owner is not None and owner == main.operation:
            return value.arg_number
        parent = index.get(owner) if owner is not None else None
        if parent is not None and value.arg_number < len(all_ops[parent].operands):
            return _value_input(all_ops[parent].operands[value.arg_number], depth + 1)
        return None

    operands = []
    for i, op in enumerate(all_ops):
        ops = tuple(operand(v) for v in op.operands)
        for o in ops:
            if o.producer is not None:
                users.setdefault(o.producer, []).append(i)
        operands.append(ops)
    records = []
    for i, op in enumerate(all_ops):
        name, frames = parse_location(str(op.location))
        origin = _get(op.attributes, "sdy.sharding_origin_name")
        records.append(PropagatedOp(i, op.name, name, frames, operands[i], results_of[i],
                                    _rule(_get(op.attributes, "sdy.sharding_rule")),
                                    ir.StringAttr(origin).value if origin is not None else None,
                                    tuple(sorted(set(users.get(i, ()))))))
    return Propagation(tuple(inputs), tuple(names), tuple(outputs), tuple(records), mesh_axes)


def _block_arg_sharding(parent, number: int, outer: ValueSharding | None) -> ValueSharding | None:
    """A region argument's sharding: a named computation's ``in_shardings`` entry, else the value
    passed in (a loop carries its operand's sharding through its data-flow edges)."""
    from jaxlib.mlir import ir

    if parent.name == "sdy.named_computation" and "in_shardings" in parent.attributes:
        from jaxlib.mlir.dialects import sdy

        per_value = list(sdy.TensorShardingPerValueAttr(parent.attributes["in_shardings"]).shardings)
        if number < len(per_value):
            got = _sharding(per_value[number], None)
            return dataclasses.replace(got, origins=outer.origins) if outer is not None and got else got
    del ir
    return outer
