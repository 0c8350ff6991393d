"""What one kernel of a compiled module takes on a chip, and what bounds it: the step-time model's unit.

A *kernel* is one top-level instruction of a scheduled computation (a fusion, a lone op, a custom
call). Each is put in one class, read from the compiled module (the fusion's own instructions), and
timed with the chip's figures for that class (:class:`stagetool.core.chips.Chip`: a calibrated
profile's measured rates where the chip has one, its peaks otherwise):

=================  ====================================================================================
class              time (per execution, one device)
=================  ====================================================================================
matmul <precision>  compute: Σ padded FLOPs ÷ the chip's matmul rate for the precision XLA compiled
                    (``bf16``; ``f32`` at DEFAULT precision, which XLA:TPU runs as one bf16 pass;
                    ``f32_high``; ``f32_highest``; ``int8``; ``fp8``), each of M, K, N padded up to the
                    matrix unit's tile (a decode's batch of 32 runs as 128 rows on a 128 × 128 MXU);
                    memory: bytes ÷ the HBM copy rate
convolution         as a matmul, its K the input features × the window
element-wise        memory: bytes ÷ the element-wise rate; compute: transcendentals ÷ their rate
reduction           memory: bytes ÷ the reduction rate; compute: transcendentals ÷ their rate
gather / scatter    2 × the gathered rows' bytes (read, written) ÷ the gather rate; 3 × the updates'
                    bytes (the update read, its row read and written) ÷ the scatter rate
copy / layout       bytes ÷ the HBM copy rate (copies, transposes, fusions that only move data,
                    XLA:TPU's helper custom calls)
Pallas kernel       its ``cost_estimate`` (FLOPs ÷ the bf16 rate, bytes ÷ the HBM copy rate), where
                    its ``pallas_call`` was given one: a floor too (the kernel's efficiency is its own)
uncounted           a Pallas kernel without ``cost_estimate``, top-k, sort, any other custom call:
                    no model; timed at a floor (its operand and result bytes ÷ the HBM peak) and
                    marked, so that the step time is "at least" its figure
=================  ====================================================================================

Each kernel adds the chip's fixed ``kernel_overhead_seconds`` (TPU; not for scalar work of a few bytes, a
loop counter, which the TPU's scalar unit runs) or ``kernel_launch_seconds`` (GPU).
What bounds it is the largest of compute, memory bandwidth and that fixed cost (``latency``).
Bytes are what the kernel reads and writes (:func:`stagetool.hlo.loops.instruction_cost`: operands
and result at their tiled sizes; a slice reads what it keeps). No JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re

from stagetool.analysis.uncounted import custom_call_kind, is_trivial_custom_call, pallas_cost_estimate
from stagetool.core.chips import Chip
from stagetool.hlo.loops import instruction_cost
from stagetool.hlo.parser import ArrayShape, HloComputation, HloInstruction, HloModule, array_leaves, shape_bytes

__all__ = ["COMPUTE", "FROM_FLOOR", "FROM_KERNEL", "FROM_MODEL", "LATENCY", "MEMORY", "KernelTime",
           "kernel_time", "matmul_class", "padded_matmul_flops"]

COMPUTE, MEMORY, LATENCY = "compute", "memory bandwidth", "latency"

FROM_MODEL = "model"
"""The figure is the model's: the class's rate on the chip (a calibrated profile's or a peak)."""
FROM_KERNEL = "kernel cost_estimate"
"""The figure is a Pallas kernel author's ``cost_estimate`` at the chip's rates."""
FROM_FLOOR = "floor: work not counted"
"""No model for the work: the figure is a floor (its bytes at the HBM peak); the step time is a lower bound."""

_MOVES = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy", "transpose", "reshape",
                    "broadcast", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "iota",
                    "reverse", "bitcast-convert", "copy-start", "copy-done"})
_MATMULS = frozenset({"dot", "convolution"})
_SCALAR_BYTES = 64
"""A kernel reading and writing at most this many bytes is scalar work (a loop counter): no fixed cost on TPU."""
_CYCLES_UNKNOWN = 1 << 40
"""XLA:TPU writes 6,148,914,691,236,517,205 (0x5555555555555555) cycles for a fusion it cannot estimate (a causal
attention's score fusion); a figure this large (over 10 minutes at 1 GHz) is no figure."""
_CYCLES = re.compile(r'"estimated_cycles":"?(\d+)')


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """The model's time of one kernel (a top-level instruction), per execution, one device: an ESTIMATE.

    Attributes:
      kind: its class: ``matmul bf16`` (the precision class), ``element-wise``, ``reduction``,
        ``gather``, ``scatter``, ``copy``, an XLA:TPU helper's description, ``Pallas kernel (Mosaic TPU)``,
        ``top-k``, ``sort``, ``custom call FOO``.
      seconds: the whole time (seconds): ``max(compute, memory) + overhead``.
      compute_seconds / memory_seconds / overhead_seconds: its parts (seconds).
      bound: ``compute``, ``memory bandwidth`` or ``latency`` (the largest part).
      figure: where the figure comes from: :data:`FROM_MODEL`, :data:`FROM_KERNEL` or :data:`FROM_FLOOR`.
      flops / bytes_accessed: per execution (FLOPs with XLA's rules; bytes read and written).
      xla_seconds: XLA:TPU's ``estimated_cycles`` ÷ the clock where the module carries a positive one,
        shown beside the model's figure, else None. Measured on the lent v5e it is further off than the
        model for every class (matmuls +2% to +130%, reductions 2-3x, copies 2x), so it is not used.
      uncounted: True when its figure is only a floor: no model covers its work (:data:`FROM_FLOOR`), or a
        Pallas kernel timed from its ``cost_estimate`` at the chip's full rates (:data:`FROM_KERNEL`: the
        kernel's own efficiency is unknown); the step time is then a lower bound.
    """

    kind: str
    seconds: float
    compute_seconds: float
    memory_seconds: float
    overhead_seconds: float
    bound: str
    figure: str
    flops: float
    bytes_accessed: float
    xla_seconds: float | None = None
    uncounted: bool = False


def _target(ins: HloInstruction) -> str:
    return (ins.attributes.get("custom_call_target") or "?").strip('"')


def _dims(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text or ""))


def _shape(comp: HloComputation, name: str):
    i = comp.instruction(name)
    return i.shape if i is not None else None


def _pad(n: int, tile: int) -> int:
    return int(math.ceil(n / tile) * tile) if n > 0 and tile > 0 else n


def matmul_class(comp: HloComputation, ins: HloInstruction) -> str:
    """The matmul class of a ``dot``/``convolution``: the left operand's element type and the precision
    XLA compiled (``operand_precision``): ``int8``, ``fp8``, ``bf16``, ``f32`` (DEFAULT), ``f32_high``,
    ``f32_highest``."""
    lhs = _shape(comp, ins.operands[0]) if ins.operands else None
    dtype = lhs.dtype if isinstance(lhs, ArrayShape) else "bf16"
    if dtype in ("s8", "u8", "s4", "u4"):
        return "int8"
    if dtype.startswith("f8"):
        return "fp8"
    if dtype in ("f32", "f64", "c64", "c128"):
        prec = (ins.attributes.get("operand_precision") or ins.attributes.get("precision_config") or "").lower()
        return "f32_highest" if "highest" in prec else "f32_high" if "high" in prec else "f32"
    return "bf16"


def padded_matmul_flops(comp: HloComputation, ins: HloInstruction, tile: tuple[int, int] | None,
                        flops: float) -> float:
    """FLOPs of a ``dot``/``convolution`` with M (the rows streamed), K (contracted) and N (the result's
    columns) each padded up to the matrix unit's tile: ``tile[0]`` for M, ``tile[1]`` for K and N.
    ``flops`` is its unpadded count (XLA's rule); returned unchanged without a tile or readable dims."""
    if not tile or flops <= 0 or len(ins.operands) < 2:
        return flops
    lhs, rhs = _shape(comp, ins.operands[0]), _shape(comp, ins.operands[1])
    out = array_leaves(ins.shape)
    if not (isinstance(lhs, ArrayShape) and isinstance(rhs, ArrayShape) and out):
        return flops
    if ins.opcode == "dot":
        lc, lb = _dims(ins.attributes.get("lhs_contracting_dims")), _dims(ins.attributes.get("lhs_batch_dims"))
        rc, rb = _dims(ins.attributes.get("rhs_contracting_dims")), _dims(ins.attributes.get("rhs_batch_dims"))
        m = math.prod(d for i, d in enumerate(lhs.dims) if i not in lc and i not in lb)
        k = math.prod(lhs.dims[i] for i in lc if i < len(lhs.dims))
        n = math.prod(d for i, d in enumerate(rhs.dims) if i not in rc and i not in rb)
    else:
        labels = re.match(r"^([^_]+)_([^-]+)->(.+)$", ins.attributes.get("dim_labels", ""))
        if not labels:
            return flops
        lhs_l, rhs_l, out_l = labels.groups()
        if len(rhs_l) != len(rhs.dims) or len(out_l) != len(out[0].dims):
            return flops
        try:
            n = out[0].dims[out_l.index("f")]
            k = math.prod(rhs.dims[i] for i, c in enumerate(rhs_l) if c != "o")  # input features x window
        except ValueError:
            return flops
        m = math.prod(d for i, d in enumerate(out[0].dims) if out_l[i] != "f")
    if m <= 0 or k <= 0 or n <= 0:
        return flops
    factor = (_pad(m, tile[0]) / m) * (_pad(k, tile[1]) / k) * (_pad(n, tile[1]) / n)
    return flops * factor


def _inner(module: HloModule, ins: HloInstruction) -> list[tuple[HloComputation, HloInstruction]]:
    """Every instruction a kernel runs: itself, or those of the computations it calls (fusions nested)."""
    out: list[tuple[HloComputation, HloInstruction]] = []
    stack = list(ins.called_computations)
    seen: set[str] = set()
    while stack:
        name = stack.pop().lstrip("%")
        comp = module.computation(name)
        if comp is None or name in seen:
            continue
        seen.add(name)
        for i in comp.instructions:
            out.append((comp, i))
            if i.opcode in ("fusion", "call"):
                stack.extend(i.called_computations)
    return out


def _through(fused: HloComputation, name: str) -> HloInstruction | None:
    """The instruction ``name`` names, looked through bitcasts and copies of one operand."""
    i = fused.instruction(name)
    while i is not None and i.opcode in ("bitcast", "copy") and i.operands:
        i = fused.instruction(i.operands[0])
    return i


def _in_place_bytes(module: HloModule, comp: HloComputation, ins: HloInstruction, moved: float) -> float:
    """A fusion's bytes with each result that is a ``dynamic-update-slice`` into a parameter (looked
    through bitcasts, in a tuple result too) counted as its update, read and written, and that parameter
    not read whole: XLA updates such a buffer in place (a scan writing layer i of a stacked gradient)."""
    fused = module.computation(ins.called_computations[0].lstrip("%")) if ins.called_computations else None
    root = fused.root if fused is not None else None
    if root is None:
        return moved
    leaves = [fused.instruction(o) for o in root.operands] if root.opcode == "tuple" else [root]
    saved = 0.0
    for leaf in leaves:
        dus = _through(fused, leaf.name) if leaf is not None else None
        if dus is None or dus.opcode != "dynamic-update-slice" or len(dus.operands) < 2:
            continue
        base = _through(fused, dus.operands[0])
        if base is None or base.opcode != "parameter":
            continue
        users = [u for u in fused.instructions if base.name in u.operands]
        zeroed = bool(users) and all(u.opcode == "dynamic-update-slice" and u.operands[0] == base.name for u in users)
        if zeroed and leaf is root and root.opcode == "dynamic-update-slice":
            continue  # counted in place already (stagetool.hlo.loops)
        update = float(shape_bytes(_shape(fused, dus.operands[1])) or 0)
        counted = (0.0 if zeroed else float(shape_bytes(base.shape) or 0)) + float(shape_bytes(leaf.shape) or 0)
        saved += counted - update  # the buffer read (unless already not) and written whole -> the update written
    return moved - saved if 0 < saved < moved else moved


def _window_sizes(ins: HloInstruction) -> tuple[int, ...]:
    m = re.search(r"size=([\dx]+)", ins.attributes.get("window") or "")
    return tuple(int(x) for x in m.group(1).split("x")) if m else ()


def xla_cycles(ins: HloInstruction) -> int | None:
    """XLA:TPU's ``estimated_cycles`` of an instruction's backend config, or None (absent or not positive)."""
    raw = ins.attributes.get("backend_config")
    m = _CYCLES.search(raw) if raw and "estimated_cycles" in raw else None
    n = int(m.group(1)) if m else 0
    return n if 0 < n < _CYCLES_UNKNOWN else None


def _rate(*rates: float | None) -> float | None:
    for r in rates:
        if r:
            return r
    return None


def kernel_time(module: HloModule, comp: HloComputation, ins: HloInstruction, chip: Chip, *,
                gpu: bool = False) -> KernelTime:
    """The model's time of one top-level instruction ``ins`` of ``comp`` on ``chip`` (see the module
    docstring), per execution, one device. ``gpu``: the program runs as separate kernel launches
    (``kernel_launch_seconds`` each) rather than one TPU executable (``kernel_overhead_seconds``)."""
    cost = instruction_cost(module, comp, ins)
    flops, moved, trans = cost.flops, cost.bytes_accessed, cost.transcendentals
    if ins.opcode == "fusion":
        moved = min(moved, _in_place_bytes(module, comp, ins, moved))
    hbm = chip.hbm_bandwidth_bytes_per_second
    copy_rate = _rate(chip.hbm_copy_bytes_per_second, hbm)
    overhead = (chip.kernel_launch_seconds if gpu else chip.kernel_overhead_seconds) or 0.0
    if not gpu and moved <= _SCALAR_BYTES and ins.opcode != "custom-call":
        overhead = 0.0  # a loop counter's add or compare: the TPU's scalar unit, no vector kernel
    cycles = xla_cycles(ins)
    xla = cycles / chip.clock_hz if cycles and chip.clock_hz else None
    inner = _inner(module, ins) if ins.opcode in ("fusion", "call") else [(comp, ins)]
    ops = {i.opcode for _, i in inner}

    def done(kind: str, compute: float, memory: float, figure: str = FROM_MODEL, uncounted: bool = False,
             f: float = flops, b: float = moved) -> KernelTime:
        core = max(compute, memory)
        bound = LATENCY if overhead > core else COMPUTE if compute >= memory and compute > 0 else MEMORY
        return KernelTime(kind, core + overhead, compute, memory, overhead, bound, figure, f, b,
                          xla, uncounted)

    def floor(kind: str) -> KernelTime:
        return done(kind, 0.0, moved / hbm if hbm else 0.0, FROM_FLOOR, True)

    if ins.opcode == "custom-call":
        target = _target(ins)
        if is_trivial_custom_call(target):
            return done(custom_call_kind(target), 0.0, moved / copy_rate if copy_rate else 0.0)
        if "cublas" in target or "cudnn" in target:
            ops = {"dot"}
            inner = [(comp, ins)]
        elif target == "tpu_custom_call":
            kf, kb = pallas_cost_estimate(ins)
            if kf is None:
                return floor(custom_call_kind(target))
            rate = chip.matmul_rate("bf16")
            b = kb if kb is not None else moved
            return done(custom_call_kind(target), kf / rate if rate else 0.0, b / copy_rate if copy_rate else 0.0,
                        FROM_KERNEL, True, f=kf, b=b)
        else:
            return floor(custom_call_kind(target))
    if "sort" in ops:
        return floor("sort")
    opaque = [i for _, i in inner if i.opcode == "custom-call" and i is not ins
              and not is_trivial_custom_call(_target(i))]
    if opaque:  # a fusion around a custom call no model covers
        return floor(custom_call_kind(_target(opaque[0])))
    if ops & _MATMULS or ins.opcode == "custom-call":  # (a cuBLAS call here)
        classes, model = [], 0.0
        windowed = any(i.opcode == "convolution" and any(d > 1 for d in _window_sizes(i)) for _, i in inner)
        for c, i in inner:
            if i.opcode in _MATMULS or i.opcode == "custom-call":
                f = flops if i is ins else instruction_cost(module, c, i).flops
                cls = matmul_class(c, i)
                classes.append(cls)
                rate = chip.matmul_rate(cls)
                model += padded_matmul_flops(c, i, chip.matmul_tile, f) / rate if rate else 0.0
        kind = ("convolution " if windowed else "matmul ") + "+".join(sorted(set(classes)))
        compute, figure = model, FROM_MODEL
        return done(kind, compute, moved / copy_rate if copy_rate else 0.0, figure)
    trans_rate = chip.transcendentals_per_second
    compute = trans / trans_rate if trans_rate else 0.0
    if "scatter" in ops:
        sc = next(i for _, i in inner if i.opcode == "scatter")
        sc_comp = next(c for c, i in inner if i is sc)
        upd = sum(shape_bytes(_shape(sc_comp, o)) or 0 for o in sc.operands[(len(sc.operands) + 1) // 2:])
        rate = _rate(chip.scatter_bytes_per_second, hbm)  # the update read, its row read and written
        return done("scatter", compute, 3 * upd / rate if rate else 0.0, b=3.0 * upd)
    if "gather" in ops:
        rows = sum(shape_bytes(i.shape) or 0 for _, i in inner if i.opcode == "gather")
        rate = _rate(chip.gather_bytes_per_second, hbm)
        rest = max(moved - 2 * rows, 0.0)  # what the kernel reads and writes beside the rows (read and written)
        return done("gather", compute, 2 * rows / rate + (rest / copy_rate if copy_rate else 0.0) if rate else 0.0)
    if ops & {"reduce", "reduce-window"}:
        rate = _rate(chip.reduction_bytes_per_second, hbm)
        return done("reduction", compute, moved / rate if rate else 0.0)
    if ops <= _MOVES:
        return done("copy", 0.0, moved / copy_rate if copy_rate else 0.0)
    rate = _rate(chip.elementwise_bytes_per_second, hbm)
    return done("element-wise", compute, moved / rate if rate else 0.0)
