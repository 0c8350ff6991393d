"""What the simulated CPU mesh shows that an accelerator would not: XLA:CPU's own artefacts, named
where they occur, each with the command that gives the accelerator's answer.

Found on jax/jaxlib 0.10.2 (XLA:CPU), from the compiled (per-device) module
(:class:`stagetool.hlo.parser.HloModule`) and, for host offload, the traced program:

* **16-bit dots computed in f32.** XLA:CPU rewrites a ``bf16``/``f16`` dot product as an f32 dot of
  converted operands, so a collective of its result (a gradient's all-reduce) moves f32 where a TPU
  or GPU compile moves the program's 16-bit type: the issue's ``w - 0.1 * grad(...)(w)`` with
  ``x bf16[256,1024] @ [data]`` all-reduces ``f32[1024,1024]`` (4 MiB) on CPU and ``bf16[1024,1024]``
  (2 MiB) on ``--topology v5e:2x4``. Such a collective is recognised in the compiled module by its
  operand's chain (through converts, bitcasts, copies, reshapes, transposes and fusions) reaching
  a ``dot``/``convolution`` one of whose operands is converted from a 16-bit value; XLA:CPU's
  all-reduce promotion, which leaves a reducer named ``*_promoted``, counts too. Two more shapes of
  it, found on the JAX training cookbook (all bf16, FSDP over 8 devices): XLA:CPU converts a bf16
  *parameter* to f32 before the all-gather that feeds the dot (``all-gather(fusion(convert(bf16
  param)))``, f32 on CPU, bf16 on ``v5e:2x4``), and it rounds a gradient to bf16 and widens it
  back before the all-reduce (``all-reduce(fusion(convert(convert(dot, bf16), f32)))``, one tuple
  all-reduce of all gradients). Both are an f32 value that is a 16-bit value widened by
  value-preserving ops only (converts, bitcasts, copies, reshapes, transposes, broadcasts and slices,
  inside fusions too; a scatter or dynamic-update-slice through the buffer it writes into, whose type
  its result has: a bf16 embedding's scatter-add gradient): such an operand makes its result element
  widened. A tuple collective is
  marked by the bytes of its widened elements (``widened_bytes``); an element that is f32 in the
  program (a loss) is not counted.
* **Collectives of an accumulation inside a loop.** A gradient-accumulation loop
  (``lax.fori_loop``/``scan`` over micro-batches, each adding the gradient of a data-sharded batch
  to a carried sum) keeps its all-reduce in the ``while`` body on XLA:CPU: it runs once per
  iteration (4 times for 4 micro-batches). XLA:TPU moves it out of the loop and all-reduces the sum
  once (found on ``--topology v5e:2x4``: ``all-reduce`` in the entry computation after the
  ``while``). Such an all-reduce is recognised (:func:`accumulated_in_loop`) only where moving it
  out is exact: a sum (reducer ``add``) inside a ``while`` body, whose only user is an ``add`` (or
  a fusion whose root is one) of it, possibly scaled by a constant (a mean's ``1/n``), and a
  loop-carried element of the body's parameter (``get-tuple-element(param), index=k``, unscaled and
  used by nothing else in the body), that sum being the body's result element ``k``; ``copy``,
  ``bitcast``, ``reshape`` and ``transpose`` may stand between them (they commute with an
  element-wise sum). A tuple all-reduce (``jax.value_and_grad``'s loss and gradient) counts when
  each of its elements is accumulated so.
* **All-gathers hoisted out of loops.** An all-gather JAX traced inside a loop body (the slice of
  a ``scan`` over a layer-sharded stack, of a micro-batch reshape that split a sharded axis) is
  moved before the loop by XLA:CPU (the whole array gathered once) and kept in the body by XLA:TPU
  (gathered every iteration): :func:`gathered_before_loop`.
* **Random numbers as rolled loops.** ``jax.random`` (threefry2x32) is lowered on CPU as a ``while``
  loop of 5 iterations over ``u32`` words (JAX rolls it there; TPU and GPU compiles unroll it), so
  the loop-aware FLOPs would multiply integer mixing rounds that do not run as a loop on an
  accelerator. Such a loop is recognised by its state (only integer arrays and scalars) and its
  body (``shift-left``, ``shift-right-logical`` and ``xor`` of ``u32``).
* **Host offload ignored.** ``jax.device_put(..., memory_kind="pinned_host")`` and
  ``jax.checkpoint`` offload policies put values in host memory on TPU and GPU; XLA:CPU has one
  memory, so the program's memory figures on CPU hold them as device memory (and its lowered module
  carries no placement). Lowering reads them from the traced program
  (:attr:`stagetool.facts.StagedFunction.host_transfers`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from typing import Any

from stagetool.hlo.parser import HloComputation, HloInstruction, HloModule, array_leaves

NARROW = frozenset({"bf16", "f16"})
_PASS_THROUGH = frozenset({"convert", "bitcast", "copy", "reshape", "transpose", "get-tuple-element",
                           "bitcast-convert", "broadcast", "slice", "dynamic-slice", "all-reduce", "all-gather",
                           "reduce-scatter", "all-to-all", "collective-permute"})
_FUSIONS = frozenset({"fusion", "call", "custom-call", "async-start"})
#: Ops that move or widen values without computing new ones: a 16-bit value reaching a collective
#: through these alone is still the program's 16-bit value (``dynamic-slice``: its first operand).
#: ``scatter`` and ``dynamic-update-slice`` are followed through their first operand, the buffer they
#: write into: HLO gives their result that operand's type and requires it of the updates, so a
#: buffer that was 16-bit in the program makes the result 16-bit there (a bf16 embedding's
#: scatter-add gradient, computed in f32 by XLA:CPU).
_VALUE_PRESERVING = frozenset({"convert", "bitcast", "copy", "reshape", "transpose", "broadcast", "slice",
                               "dynamic-slice", "scatter", "dynamic-update-slice"})
#: v5e slice shapes by chip count: the compile-only TPU target suggested for a mesh of that many devices.
_V5E = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


_NARROW_DOT = re.compile(r"stablehlo\.(?:dot_general|dot|convolution)\b[^\n]*?:\s*\(([^)]*)\)")


def narrow_dot_types(stablehlo_text: str | None) -> frozenset[str]:
    """The 16-bit types (``bf16``, ``f16``) of the lowered program's own dot products and
    convolutions: the operand types of ``stablehlo.dot_general``/``convolution`` (the program as the
    user wrote it, before XLA:CPU upcasts them). Empty when there are none or no text."""
    found: set[str] = set()
    for m in _NARROW_DOT.finditer(stablehlo_text or ""):
        found |= {t for t in re.findall(r"x(bf16|f16)>", m.group(1))}
    return frozenset(found)


def command_for(sections: Iterable[str]) -> str:
    """The stagetool command whose answer a note points to, from the sections a run computes:
    ``collectives``, ``cost`` or ``memory`` when only that one, else ``report``."""
    names = {s.value if isinstance(s, enum.Enum) else s for s in sections} - {"shardings", "lowered_text", "compiled_text"}
    return next(iter(names)) if len(names) == 1 and next(iter(names)) in ("collectives", "cost", "memory", "modules") \
        else "report"


def accelerator_command(command: str, target: str, device_count: int, *, mesh_axes: int,
                        spec: str | None = None, function: str | None = None, mesh: str | None = None) -> str:
    """The command that gives the accelerator's answer for the same function and mesh: the same
    ``stagetool`` command on a compile-only TPU topology with as many chips as the mesh has devices
    (``stagetool collectives up.py:step --topology v5e:2x4``). A mesh without axes gets
    ``--mesh data=1`` (a topology needs a mesh to lay over it); a device count no v5e slice has gets
    ``v5e:AxB`` with A·B = that count to fill in. ``spec`` (a spec the TARGET alone would not find
    from the working directory) makes it ``--spec SPEC --function FUNCTION`` instead of the TARGET;
    ``mesh`` (``--mesh`` as given, when it overrode the spec's mesh) is passed on."""
    import shlex

    shape = _V5E.get(device_count)
    topo = f"v5e:{shape}" if shape else f"v5e:AxB (A·B = {device_count})"
    extra = f" --mesh {shlex.quote(mesh)}" if mesh else (
        " --mesh data=1" if mesh_axes == 0 and device_count == 1 else "")
    what = (f"--spec {shlex.quote(spec)} --function {shlex.quote(function or '')}" if spec is not None
            else target)
    return f"stagetool {command} {what} --topology {topo}{extra}"


def _dtype(shape) -> str | None:
    leaves = array_leaves(shape)
    return leaves[0].dtype if len(leaves) == 1 else None


class _Walker:
    def __init__(self, module: HloModule):
        self.module = module
        self.owner = {i.name: c for c in module.computations for i in c.instructions}

    def ins(self, comp: HloComputation, name: str) -> HloInstruction | None:
        return comp.instruction(name)

    def narrow_source(self, comp: HloComputation, ins: HloInstruction, depth: int = 0) -> str | None:
        """The 16-bit type a value was converted from, if it was (through pass-through ops and fusions)."""
        if depth > 8 or ins is None:
            return None
        t = _dtype(ins.shape)
        if t in NARROW:
            return t
        if ins.opcode == "parameter" and comp is not self.module.entry:
            return None
        if ins.opcode in _PASS_THROUGH or (ins.opcode in _FUSIONS and not self._has_dot(ins)):
            for o in ins.operands:
                found = self.narrow_source(comp, self.ins(comp, o), depth + 1)
                if found:
                    return found
        return None

    def _has_dot(self, ins: HloInstruction) -> bool:
        return any(i.opcode in ("dot", "convolution") for c in ins.called_computations
                   for i in (self.module.computation(c.lstrip("%")) or HloComputation("", ())).instructions)

    def widened_dot(self, comp: HloComputation, ins: HloInstruction | None, depth: int = 0) -> str | None:
        """The 16-bit type of a dot (or convolution) behind ``ins`` whose operands XLA:CPU converted to f32."""
        if depth > 8 or ins is None:
            return None
        if ins.opcode in ("dot", "convolution"):
            for o in ins.operands:
                found = self.narrow_source(comp, self.ins(comp, o))
                if found:
                    return found
            return None
        if ins.opcode in _FUSIONS and ins.called_computations:
            inner = self.module.computation(ins.called_computations[0].lstrip("%"))
            if inner is not None and inner.root is not None and self._has_dot(ins):
                found = self.widened_dot(inner, inner.root, depth + 1)
                if found:
                    return found
                # a dot on the fusion's parameters: the fusion's operands hold the converted inputs
                if any(i.opcode in ("dot", "convolution") for i in inner.instructions):
                    for o in ins.operands:
                        found = self.narrow_source(comp, self.ins(comp, o))
                        if found:
                            return found
            return None
        if ins.opcode in _PASS_THROUGH or ins.opcode in _FUSIONS:
            for o in ins.operands:
                found = self.widened_dot(comp, self.ins(comp, o), depth + 1)
                if found:
                    return found
        return None


def widened_value(module: HloModule, comp: HloComputation, ins: HloInstruction | None,
                  depth: int = 0) -> str | None:
    """The 16-bit type (``bf16``/``f16``) of the value ``ins`` holds when ``ins`` is that value
    widened to f32 by value-preserving ops only (:data:`_VALUE_PRESERVING`, looking into fusions:
    a fused parameter continues at the fusion's operand); None otherwise (an f32 value the program
    computes, or an op that computes)."""
    if ins is None or depth > 24:
        return None
    t = _dtype(ins.shape)
    if t in NARROW:
        return t
    if t != "f32":
        return None
    if ins.opcode in _VALUE_PRESERVING and ins.operands:
        return widened_value(module, comp, comp.instruction(ins.operands[0]), depth + 1)
    if ins.opcode == "fusion" and ins.called_computations:
        inner = module.computation(ins.called_computations[0].lstrip("%"))
        if inner is None or inner.root is None:
            return None
        return _widened_in_fusion(module, comp, ins, inner, inner.root, depth + 1)
    return None


def _widened_in_fusion(module: HloModule, outer: HloComputation, fusion: HloInstruction, inner: HloComputation,
                       ins: HloInstruction | None, depth: int) -> str | None:
    if ins is None or depth > 24:
        return None
    t = _dtype(ins.shape)
    if t in NARROW:
        return t
    if ins.opcode == "parameter":
        try:
            k = int(ins.operand_text.strip())
        except ValueError:
            return None
        if t != "f32" or k >= len(fusion.operands):
            return None
        return widened_value(module, outer, outer.instruction(fusion.operands[k]), depth + 1)
    if t == "f32" and ins.opcode in _VALUE_PRESERVING and ins.operands:
        return _widened_in_fusion(module, outer, fusion, inner, inner.instruction(ins.operands[0]), depth + 1)
    return None


def widened_collectives(module: HloModule,
                        names: Iterable[tuple[str, str, str | None]]) -> dict[str, tuple[str, int | None]]:
    """``{collective name: (the program's 16-bit type, widened bytes per device)}`` for the f32
    collectives XLA:CPU widened.

    An f32 result element is widened when its operand is a 16-bit value widened by value-preserving
    ops only (:func:`widened_value`: an all-gather of a bf16 parameter converted first, a gradient
    rounded to bf16 and widened back) or a dot whose operands XLA:CPU converted from 16 bits; for
    one array, also when its operand's chain reaches such a dot through fusions (or the reducer is
    XLA:CPU's ``*_promoted``).
    The bytes are the widened elements' f32 result bytes per device (all of a one-array
    collective's; a tuple all-reduce's loss, f32 in the program, is left out); None when a size is
    unknown.

    Args:
      module: the compiled (per-device) module.
      names: ``(instruction name, computation name, reducer name or None)`` of each collective.
    """
    walker = _Walker(module)
    out: dict[str, tuple[str, int | None]] = {}
    for name, comp_name, reducer in names:
        comp = module.computation(comp_name)
        ins = comp.instruction(name) if comp is not None else None
        if ins is None:
            continue
        leaves = array_leaves(ins.shape)
        if not leaves or any(a.dtype != "f32" for a in leaves):
            continue
        operands = [comp.instruction(o) for o in ins.operands]
        if len(leaves) > 1 and len(operands) == len(leaves):  # a tuple collective: element i is operand i's
            found = [widened_value(module, comp, o)
                     or (walker.widened_dot(comp, o) if o is not None and o.opcode in ("dot", "convolution") else None)
                     for o in operands]
            kinds = sorted({f for f in found if f})
            if kinds:
                sizes = [a.byte_size for a, f in zip(leaves, found, strict=True) if f]
                out[name] = (kinds[0], None if any(b is None for b in sizes) else sum(sizes))
            continue
        kind = next((f for f in (widened_value(module, comp, o) for o in operands) if f), None)
        if kind is None:
            kind = next((f for f in (walker.widened_dot(comp, o) for o in operands) if f), None)
        if kind is None and reducer and reducer.endswith("_promoted"):
            kind = "bf16"
        if kind:
            sizes = [a.byte_size for a in leaves]
            out[name] = (kind, None if any(b is None for b in sizes) else sum(sizes))
    return out


#: Ops that rearrange a value without computing: an element-wise sum commutes with them.
_REARRANGE = frozenset({"copy", "bitcast", "reshape", "transpose"})


def _through(comp: HloComputation, name: str) -> HloInstruction | None:
    """The instruction behind ``name`` in ``comp``, past :data:`_REARRANGE` ops."""
    return comp.behind(name, _REARRANGE, 16)


def _users(comp: HloComputation, name: str) -> list[HloInstruction]:
    return [i for i in comp.instructions if name in i.operands]


def _sole_user_past_rearranging(comp: HloComputation, name: str) -> HloInstruction | None:
    """The one instruction that takes ``name``'s value (past single-user :data:`_REARRANGE` ops), or None."""
    for _ in range(16):
        users = _users(comp, name)
        if len(users) != 1:
            return None
        if users[0].opcode not in _REARRANGE:
            return users[0]
        name = users[0].name
    return None


def _scaled_param(inner: HloComputation, name: str) -> tuple[HloInstruction | None, bool]:
    """The fused parameter behind ``name`` (past :data:`_REARRANGE` ops and at most one multiply by a
    constant or a broadcast constant), and whether it was scaled; (None, False) otherwise."""
    ins = _through(inner, name)
    if ins is not None and ins.opcode == "multiply" and len(ins.operands) == 2:
        sides = [_through(inner, o) for o in ins.operands]
        const = [x is not None and (x.opcode == "constant" or (x.opcode == "broadcast" and x.operands and
                 (inner.instruction(x.operands[0]) or x).opcode == "constant")) for x in sides]
        if const.count(True) == 1:
            return sides[const.index(False)], True
        return None, False
    return ins, False


def _summands(module: HloModule, comp: HloComputation, ins: HloInstruction) -> list[tuple[str, bool]] | None:
    """The two operands (names in ``comp``) that ``ins`` adds, each with whether it is first scaled by
    a constant: an ``add``'s, or a fusion's whose fused root is an ``add`` of two of its parameters
    (past :data:`_REARRANGE` ops, one of them possibly multiplied by a constant: a mean's ``1/n``);
    else None."""
    if ins.opcode == "add" and len(ins.operands) == 2:
        return [(ins.operands[0], False), (ins.operands[1], False)]
    if ins.opcode != "fusion" or not ins.called_computations:
        return None
    inner = module.computation(ins.called_computations[0].lstrip("%"))
    root = _through(inner, inner.root.name) if inner is not None and inner.root is not None else None
    if root is None or root.opcode != "add" or len(root.operands) != 2:
        return None
    params = [_scaled_param(inner, o) for o in root.operands]
    if any(p is None or p.opcode != "parameter" for p, _ in params):
        return None
    try:
        k = [int(p.operand_text.strip()) for p, _ in params]
    except ValueError:
        return None
    if k[0] == k[1] or max(k) >= len(ins.operands):
        return None
    return [(ins.operands[k[0]], params[0][1]), (ins.operands[k[1]], params[1][1])]


def _accumulates(module: HloModule, comp: HloComputation, value: str) -> bool:
    """Whether ``value`` (in the ``while`` body ``comp``) is only added, possibly scaled by a constant,
    to a loop-carried element of the body's parameter that nothing else in the body reads, that sum
    being the body's result element of the same index."""
    user = _sole_user_past_rearranging(comp, value)
    pair = _summands(module, comp, user) if user is not None else None
    if pair is None or comp.root is None or comp.root.opcode != "tuple":
        return False
    sides = [(_through(comp, o), scaled) for o, scaled in pair]
    mine = [s is not None and s.name == value for s, _ in sides]
    if mine.count(True) != 1:
        return False
    acc, scaled = sides[mine.index(False)]
    if scaled or acc is None or acc.opcode != "get-tuple-element":
        return False  # a scaled accumulator (acc * 0.5 + g): the per-iteration sums matter
    param = comp.instruction(acc.operands[0])
    index = acc.attributes.get("index", "")
    if param is None or param.opcode != "parameter" or not index.isdigit():
        return False
    k = int(index)
    back = _through(comp, comp.root.operands[k]) if k < len(comp.root.operands) else None
    if back is None or back.name != user.name or _sole_user_past_rearranging(comp, acc.name) is not user:
        return False
    # the accumulator read again elsewhere in the body: the per-iteration sums are used
    return not any(i is not acc and i.opcode == "get-tuple-element" and i.operands == (param.name,)
                   and i.attributes.get("index") == index for i in comp.instructions)


def accumulated_in_loop(module: HloModule, names: Iterable[tuple[str, str, str | None]]) -> tuple[str, ...]:
    """Names of the all-reduces that sum, inside a ``while`` body, values added to loop-carried
    accumulators: XLA:CPU runs each once per iteration where XLA:TPU (and GPU) all-reduce the
    accumulated sums once after the loop (see the module docstring for what is recognised). A tuple
    all-reduce (a loss and a gradient) counts when every element is accumulated so.

    Args:
      module: the compiled (per-device) module.
      names: ``(instruction name, computation name, reduction opcode or None)`` of each collective
        (:attr:`stagetool.hlo.collectives.Collective.reduction`).
    """
    bodies = {i.attributes.get("body", "").lstrip("%") for c in module.computations for i in c.instructions
              if i.opcode == "while"}
    out = []
    for name, comp_name, reduction in names:
        comp = module.computation(comp_name)
        ins = comp.instruction(name) if comp is not None and comp_name in bodies else None
        if ins is None or ins.opcode != "all-reduce" or reduction != "add":
            continue
        n = len(array_leaves(ins.shape))
        if n == 1:
            values = [name]
        else:  # a tuple: each element through its get-tuple-element, each once
            users = _users(comp, name)
            values = [u.name for u in users if u.opcode == "get-tuple-element"]
            indices = sorted(u.attributes.get("index", "") for u in users)
            if len(values) != len(users) or indices != sorted(str(j) for j in range(n)):
                continue
        if values and all(_accumulates(module, comp, v) for v in values):
            out.append(name)
    return tuple(out)


HOISTED = "in the loop body on XLA:CPU; XLA:TPU/GPU hoist it"
"""The row's ``cpu_only`` text of an all-reduce :func:`accumulated_in_loop` finds."""
SUNK = "hoisted out of the loop by XLA:CPU; XLA:TPU gathers it in the loop, once per iteration"
"""The row's ``cpu_only`` text of an all-gather :func:`gathered_before_loop` finds."""


EXPANDED = ("ragged_dot as dense dots on XLA:CPU; XLA:TPU/GPU make no such collective (they gather the "
            "expert weights for a grouped-matmul kernel)")
"""The row's ``cpu_only`` text of a collective at a ``ragged_dot`` line on CPU that only its dense
expansion makes (an all-reduce of the partial products, a gather of the integer group sizes): JAX lowers a
``ragged_dot`` for XLA:CPU as dense dots over every group (the group sizes all-gathered, the
tokens masked per group, the partial products all-reduced), where XLA:TPU runs its ragged-dot
kernel and XLA:GPU its grouped GEMM on the gathered tokens and expert weights (found on
``v5e:2x4`` and ``h100:8``: tokens and weights sharded over ``data``, CPU: all-gather of the tokens
and of ``s32[8]`` group sizes and an all-reduce of ``f32[1024,1024]``; TPU and GPU: all-gathers of
the tokens and of the weights, no all-reduce)."""


def same_line(a: str, b: str) -> bool:
    """Whether two ``file:line`` places (paths absolute or not) are one line of one file."""
    from pathlib import Path

    fa, _, la = a.rpartition(":")
    fb, _, lb = b.rpartition(":")
    return la == lb and (fa == fb or Path(fa).resolve() == Path(fb).resolve())


def _loop_fed(module: HloModule, comp: HloComputation, name: str) -> HloInstruction | None:
    """The ``while`` instruction of ``comp`` that takes ``name``'s value into its loop state (past
    ``copy``/``bitcast``/``reshape``/``transpose`` and the state's ``tuple``), or None."""
    frontier, seen = [name], set()
    while frontier:
        current = frontier.pop()
        if current in seen or len(seen) > 64:
            continue
        seen.add(current)
        for user in _users(comp, current):
            if user.opcode == "while":
                return user
            if user.opcode in _REARRANGE or user.opcode == "tuple":
                frontier.append(user.name)
    return None


def gathered_before_loop(module: HloModule, collectives: Iterable[Any],
                         trips: Mapping[str, int | None]) -> dict[str, int | None]:
    """``{all-gather name: the loop's trip count}`` of the all-gathers XLA:CPU hoisted out of a loop:
    an all-gather outside every loop body whose op name JAX recorded inside one (``…/while/body/…``:
    the ``dynamic_slice`` of a ``scan`` over a sharded stack, the slice of a micro-batch reshape that
    split a sharded axis) and whose result is carried into that ``while``. XLA:CPU's loop-invariant
    code motion gathers the whole array once before the loop; XLA:TPU keeps (sinks) the all-gather
    in the loop body and runs it once per iteration (found on ``--topology v5e:2x4``, jax 0.10.2:
    a layer-sharded ``scan`` and a micro-batch ``scan``, each all-gather in the body, in bf16 where
    it feeds a DEFAULT-precision dot). The trip count is None where unknown.

    Args:
      module: the compiled (per-device) module of XLA:CPU.
      collectives: its :class:`stagetool.hlo.collectives.Collective` records.
      trips: ``{while name: trip count}`` (:func:`stagetool.hlo.collectives.while_loops`).
    """
    out: dict[str, int | None] = {}
    for c in collectives:
        if c.kind != "all-gather" or c.in_loop or c.in_conditional or "/while/body/" not in (c.op_name or ""):
            continue
        comp = module.computation(c.computation)
        if comp is None or c.fusion is not None:
            continue
        loop = _loop_fed(module, comp, c.done_name or c.name)
        if loop is not None:
            out[c.name] = trips.get(loop.name)
    return out


def rng_loops(module: HloModule) -> tuple[str, ...]:
    """Names of the ``while`` loops that are XLA:CPU's rolled random-number expansion (threefry2x32):
    a state of integer arrays and scalars only, a body that shifts and xors ``u32`` words."""
    out = []
    for comp in module.computations:
        for ins in comp.instructions:
            if ins.opcode != "while":
                continue
            leaves = array_leaves(ins.shape)
            if not leaves or any(a.dtype not in ("s32", "u32", "s64", "u64") for a in leaves):
                continue
            if not any(a.dtype == "u32" for a in leaves):
                continue
            body = ins.attributes.get("body", "").lstrip("%")
            ops = _ops_under(module, body)
            if {"shift-left", "shift-right-logical", "xor"} <= ops:
                out.append(ins.name)
    return tuple(out)


def _ops_under(module: HloModule, name: str, seen: set[str] | None = None) -> set[str]:
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    comp = module.computation(name)
    if comp is None:
        return set()
    ops = {i.opcode for i in comp.instructions}
    for i in comp.instructions:
        for c in i.called_computations:
            ops |= _ops_under(module, c.lstrip("%"), seen)
    return ops


def host_offload_note(transfers: tuple[str, ...], command: str) -> str:
    """The note for a CPU program that asks for host memory (``transfers``: where, ``file:line``)."""
    where = ", ".join(transfers[:3]) + (f" and {len(transfers) - 3} more" if len(transfers) > 3 else "")
    return (f"host offload ignored: the program moves values to pinned_host ({where}), and XLA:CPU has one "
            "memory, so it keeps them in device memory: the device peak here holds them and the host peak "
            f"is 0; the accelerator's answer: {command}")


def widened_note(widened: Mapping[str, str], bytes_here: int, command: str, *, dots: bool = True) -> str:
    """The note for the collectives whose dtype XLA:CPU widened: its 16-bit dot upcast (``dots``), or,
    in a program without 16-bit dots, its widening of 16-bit values before a collective (a bf16
    gather's all-reduce, promoted to f32)."""
    kinds = "/".join(sorted(set(widened.values())))
    n = len(widened)
    why = (f"XLA:CPU computes {kinds} dot products in f32" if dots else
           f"XLA:CPU widens the program's {kinds} values to f32 before the collective (its all-reduce promotion)")
    return (f"{n} collective{'s' if n != 1 else ''} marked 'f32 on CPU' move{'' if n != 1 else 's'} f32 only because "
            f"{why}; the program's own dtype is {kinds}, half the bytes "
            f"({bytes_here:,} B here per device); the accelerator's answer: {command}")


_NARROW_VALUE = re.compile(r"tensor<[^>]*x(bf16|f16)>|tensor<(bf16|f16)>")


def narrow_value_types(stablehlo_text: str | None) -> frozenset[str]:
    """The 16-bit float types (``bf16``, ``f16``) of any value of the lowered program (its own types,
    before XLA:CPU widens them). Empty when there are none or no text."""
    return frozenset(a or b for a, b in _NARROW_VALUE.findall(stablehlo_text or ""))


def dots_note(narrow: Iterable[str], command: str) -> str:
    """The note for a program with 16-bit dots on CPU and no collective of their results."""
    kinds = "/".join(sorted(narrow))
    return (f"XLA:CPU computes {kinds} dot products in f32: their results, temporaries and bytes accessed are "
            f"f32-sized here; the accelerator's answer: {command}")


def hoisted_note(items: list[Any], command: str) -> str:
    """The note for the all-reduces of a loop's accumulated sum that XLA:CPU leaves in the loop body
    (``items``: :class:`stagetool.analysis.sections.CollectiveItem` marked :data:`HOISTED`)."""
    here = sum((i.collective.bytes_per_device or 0) * (i.collective.executions or 1) for i in items)
    once = sum(i.collective.bytes_per_device or 0 for i in items)
    n = len(items)
    return (f"{n} all-reduce{'s' if n != 1 else ''} marked '{HOISTED}' sum{'' if n != 1 else 's'} a loop's "
            f"accumulator in the loop body: XLA:CPU runs {'them' if n != 1 else 'it'} once per iteration "
            f"({here:,} B per device per step here), XLA:TPU/GPU all-reduce the accumulated sum once after the "
            f"loop ({once:,} B); the accelerator's answer: {command}")


def sunk_note(items: list[Any], runs: Mapping[str, int | None], command: str) -> str:
    """The note for the all-gathers XLA:CPU hoisted out of a loop that XLA:TPU gathers in it
    (``items``: :class:`stagetool.analysis.sections.CollectiveItem` marked :data:`SUNK`; ``runs``:
    the loop's trip count by collective name)."""
    here = sum((i.collective.bytes_per_device or 0) * (i.collective.executions or 1) for i in items)
    n = len(items)
    counts = sorted({runs.get(i.collective.name) for i in items}, key=lambda t: (t is None, t or 0))
    per = " or ".join("?" if t is None else str(t) for t in counts)
    return (f"{n} all-gather{'s' if n != 1 else ''} marked 'hoisted out of the loop by XLA:CPU' "
            f"gather{'' if n != 1 else 's'} a value the loop body slices ({here:,} B per device per step here, "
            f"once before the loop); XLA:TPU gathers {'them' if n != 1 else 'it'} inside the loop, once per "
            f"iteration ({per} runs per step; bytes per run in the dtype XLA:TPU picks, not known from this "
            f"compile); the accelerator's answer: {command}")


def expanded_note(items: list[Any], command: str) -> str:
    """The note for the collectives of a ``ragged_dot`` on CPU (``items`` marked :data:`EXPANDED`)."""
    here = sum((i.collective.bytes_per_device or 0) * (i.collective.executions or 1) for i in items)
    lines = sorted({i.source.rsplit("/", 1)[-1] for i in items if i.source})
    return (f"{len(items)} collective{'s' if len(items) != 1 else ''} at ragged_dot ({', '.join(lines)}) "
            f"({here:,} B per device per step here) come from XLA:CPU running it as dense dots over every group; "
            "XLA:TPU and XLA:GPU make none of them: they gather the expert weights for a grouped-matmul kernel "
            f"instead (bytes not known from this compile); the accelerator's answer: {command}")


def rng_note(loops: tuple[tuple[str, int | None, float], ...], extra_flops: float, command: str) -> str:
    """The note for XLA:CPU's rolled random-number loops, kept out of the loop-aware FLOPs."""
    names = ", ".join(f"{n} ({'?' if t is None else t} trips)" for n, t, _ in loops)
    return (f"random numbers: XLA:CPU expands jax.random's threefry2x32 into rolled while loops ({names}); they "
            f"are kept out of the loop-aware FLOPs (counted once, as XLA does: {extra_flops:,.0f} more FLOPs if "
            f"each iteration counted), since TPU and GPU compiles unroll them; the accelerator's answer: {command}")


def cpu_notes(*, command: str, host: tuple[str, ...], narrow: frozenset[str], collectives: Any = None,
              cost: Any = None) -> list[str]:
    """The notes a CPU run adds about XLA:CPU's artefacts, each ending with ``command`` (the
    accelerator's answer, :func:`accelerator_command`).

    Args:
      command: the command to end each note with.
      host: where the program moves values to host memory (``StagedFunction.host_transfers``).
      narrow: the program's 16-bit dot types (:func:`narrow_dot_types`).
      collectives: the run's :class:`stagetool.analysis.sections.CollectivesSection`, or None.
      cost: the run's :class:`stagetool.analysis.sections.CostSection`, or None.
    """
    out = []
    widened = {i.collective.name: i.widened_from for i in (collectives.items if collectives else ()) if i.widened_from}
    if widened:
        moved = sum(i.widened_bytes or 0 for i in collectives.items if i.widened_from)
        out.append(widened_note(widened, moved, command, dots=bool(narrow)))
    elif narrow:
        out.append(dots_note(narrow, command))
    hoisted = [i for i in (collectives.items if collectives else ()) if i.cpu_only == HOISTED]
    if hoisted:
        out.append(hoisted_note(hoisted, command))
    expanded = [i for i in (collectives.items if collectives else ()) if i.cpu_only == EXPANDED]
    if expanded:
        out.append(expanded_note(expanded, command))
    sunk = [i for i in (collectives.items if collectives else ()) if i.cpu_only == SUNK]
    if sunk:
        out.append(sunk_note(sunk, {i.collective.name: i.accelerator_runs for i in sunk}, command))
    la = cost.loop_aware if cost else None
    if la is not None and la.apart:
        out.append(rng_note(la.apart, la.apart_extra_flops, command))
    if host:
        out.append(host_offload_note(host, command))
    return out
