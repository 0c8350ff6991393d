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
group-masked        a matmul kernel XLA:TPU runs skipping the iterations a ``pred[G, T]`` mask zeroes
                    (``mask_aggregator_config``: ``lax.ragged_dot``'s weight gradient over G groups of T rows):
                    its FLOPs × min(1, 1/G + tile/T), each row multiplied once
element-wise        memory: bytes ÷ the element-wise rate; compute: transcendentals ÷ their rate
reduction           memory: bytes ÷ the reduction rate; compute: transcendentals ÷ their rate
gather / scatter    2 × the gathered rows' bytes (read, written; 1 × where the result is in VMEM) ÷ the
                    gather rate (from a table in VMEM, ``S(1)``: its HBM bytes ÷ the copy rate; a row under
                    128 B as a 128 B one); 3 × the updates' bytes (the update read, its row read and written)
                    ÷ the scatter rate, or its rows × a gathered row's time at their width (≥ 128 B) where larger
copy / layout       bytes ÷ the HBM copy rate (copies, transposes, fusions that only move data); a
                    ``copy`` XLA:TPU runs as a DMA (no vector-unit window in its backend config) at
                    twice it, reading and writing at once (measured: 134 MB in 0.103 ms against
                    0.207 ms for the same copy run on the vector unit); annotation, allocation and
                    bitcast custom calls (``Sharding``, ``AllocateBuffer``, ``ConcatBitcast``) free
Pallas kernel       its ``cost_estimate`` (FLOPs ÷ the bf16 rate, bytes ÷ the HBM copy rate), where
                    its ``pallas_call`` was given one: a floor too (the kernel's efficiency is its own)
scatter index sort  XLA:TPU sorts a scatter's indices before the scatter (a lone ``sort`` whose results
                    only reach scatters): nothing more, where the chip's scatter rate is a calibrated
                    profile's, measured with that same sort in it (its own time and fixed cost there)
cross-program       XLA:TPU's ``copy-start`` with ``cross_program_prefetch_index`` (an argument copied into
prefetch            VMEM before the kernels that read it there): its bytes read from HBM ÷ the HBM copy
                    rate (a calibrated profile's, else the HBM peak); no fixed cost (a DMA)
pooling / select-    a pooling window (a reduce-window over part of each dimension) and its gradient, a pad
and-scatter / pad   that interleaves: bytes ÷ their measured rates (``pool_window``, ``select_and_scatter``,
(interleave)        ``pad_interior``; else the reduction, element-wise and copy rates)
linear algebra,     XLA:TPU's Cholesky, triangular-block inversion, QR and eigh custom calls: batch × n³ of their
top-k               matrices ÷ their measured rates; ``TopK``: operand elements ÷ ``top_k``
element ops         an op with a measured rate of its own (``op_exponential``, ``op_erf``, ``op_divide_s32``, ...):
                    its elements ÷ that rate, not the generic vector and transcendental rates
uncounted           a Pallas kernel without ``cost_estimate``, top-k, any other sort, any other custom call:
                    no model; timed at a floor (its operand and result bytes ÷ the HBM peak) and
                    marked, so that the step time is "at least" its figure
=================  ====================================================================================

Each kernel adds the chip's fixed ``kernel_overhead_seconds`` (TPU; not for scalar work of a few bytes, a
loop counter, which the TPU's scalar unit runs) or ``kernel_launch_seconds`` (GPU).
What bounds it is the largest of compute, memory bandwidth and that fixed cost (``latency``).
Bytes are what the kernel reads from and writes to HBM: operands and result at their tiled sizes
(:func:`stagetool.hlo.loops.instruction_cost`'s rules), less arrays XLA:TPU placed in the core's vector
memory (``S(1)``), a fusion's parameter counted as what its slices keep (nested fusions too: a scan's
layer i of a stacked array) and a result updated in place as its update. No JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re

from stagetool.analysis.uncounted import custom_call_kind, is_trivial_custom_call, pallas_cost_estimate
from stagetool.core.chips import ELEMENT_OPS, Chip
from stagetool.hlo.loops import TRANSCENDENTAL, instruction_cost, tiled_shape_bytes
from stagetool.hlo.parser import ArrayShape, HloComputation, HloInstruction, HloModule, array_leaves, shape_bytes

__all__ = ["COMPUTE", "CROSS_PROGRAM_PREFETCH", "ELEMENT_OPS", "FROM_FLOOR", "FROM_KERNEL", "FROM_MODEL", "FROM_XLA",
           "LATENCY", "LINALG_CLASSES", "LINALG_KINDS", "MEMORY",
           "SCATTER_INDEX_SORT", "KernelTime", "conv_class", "is_cross_program_prefetch", "kernel_time", "matmul_class",
           "linalg_cubes", "padded_matmul_flops", "sort_stages", "vector_ops"]

COMPUTE, MEMORY, LATENCY = "compute", "memory bandwidth", "latency"

FROM_MODEL = "model"
"""The figure is the model's: the class's rate on the chip (a calibrated profile's or a peak)."""
FROM_XLA = "XLA estimated_cycles"
"""The figure is XLA:TPU's own ``estimated_cycles`` ÷ the clock, × the chip's factor for the class (``class_rates``
``xla_<class>``: measured ÷ XLA's on the validation suite's fit half), for a class where that is closer than the
model's rate (the FFT's matmul kernels on the lent v5e)."""
FROM_KERNEL = "kernel cost_estimate"
"""The figure is a Pallas kernel author's ``cost_estimate`` at the chip's rates."""
SCATTER_INDEX_SORT = "sort (a scatter's indices)"
"""The class of XLA:TPU's sort of a scatter's indices (before the scatter proper): timed as part of the
scatter, whose calibrated rate was measured with the same sort in it."""
CROSS_PROGRAM_PREFETCH = "cross-program prefetch (HBM → VMEM)"
"""The class of XLA:TPU's cross-program prefetch: an argument's copy from HBM into the core's vector memory."""
FROM_FLOOR = "floor: work not counted"
"""No model for the work: the figure is a floor (its bytes at the HBM peak); the step time is a lower bound."""

_MOVES = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy", "transpose", "reshape",
                    "broadcast", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "iota",
                    "reverse", "bitcast-convert", "copy-start", "copy-done"})
_MATMULS = frozenset({"dot", "convolution"})
_HELPERS_THAT_MOVE = frozenset({"GatherScatterIndicesBitpacked", "X64Combine", "X64SplitLow", "X64SplitHigh"})
"""Trivial custom calls that still read and write their operands, timed as copies: XLA:TPU's index packing, and
its split of 64-bit (``c64``) arrays into halves and their combination (the fit half's 2-D FFT: 0.75, 0.74 and
1.49 ms of its 25.4 on the profiler); the others (annotations, allocations, ``ConcatBitcast``) move nothing."""
_NARROW_ROW_BYTES = 128.0
"""The narrowest row width (bytes) calibrate's gathers measure: a narrower row takes as long (rows bound them)."""
_SCALAR_BYTES = 64
"""A kernel reading and writing at most this many bytes is scalar work (a loop counter): no fixed cost on TPU."""
_CYCLES_UNKNOWN = 1 << 40
"""XLA:TPU writes 6,148,914,691,236,517,205 (0x5555555555555555) cycles for a fusion it cannot estimate (a causal
attention's score fusion); a figure this large (over 10 minutes at 1 GHz) is no figure."""
_CYCLES = re.compile(r'"estimated_cycles":"?(\d+)')


# ------------------------------------------------------------------ class coverage (issue 46: classes measured)
LINALG_CLASSES: dict[str, str] = {"Cholesky": "cholesky", "InvertDiagBlocksLowerTriangular": "triangular_invert",
                                  "QrDecompositionBlock": "qr", "CompactWyHelper": "qr", "EighTpu": "eigh"}
"""XLA:TPU's linear-algebra custom calls (``custom_call_target``) → their class: ``jnp.linalg.cholesky`` (blocks of
at most 128), the diagonal blocks a ``triangular_solve`` inverts, QR's Householder block and compact-WY helper,
``eigh``."""
LINALG_KINDS: dict[str, tuple[str, ...]] = {
    "cholesky": ("custom call Cholesky",), "triangular_invert": ("custom call InvertDiagBlocksLowerTriangular",),
    "qr": ("custom call QrDecompositionBlock", "custom call CompactWyHelper"), "eigh": ("custom call EighTpu",)}
"""Each linear-algebra class's kernel kinds (as the step-time rows name them)."""


def linalg_cubes(comp: HloComputation, ins: HloInstruction) -> float:
    """The work unit of a linear-algebra custom call (:data:`LINALG_CLASSES`): its first operand's matrices
    ``[..., m, n]`` × m × n × min(m, n) (batch × n³ for square ones); 0.0 where the operand is not a matrix."""
    a = _shape(comp, ins.operands[0]) if ins.operands else None
    if not isinstance(a, ArrayShape):
        leaves = array_leaves(a) if a is not None else []
        a = leaves[0] if leaves else None
    if a is None or len(a.dims) < 2:
        return 0.0
    m, n = a.dims[-2], a.dims[-1]
    return float(math.prod(a.dims[:-2]) * m * n * min(m, n))


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
        kernel's own efficiency is unknown), or a fusion XLA:TPU's own cost model gives up on; the step time
        is then a lower bound.
      floor_reason: why the figure is only a floor (None when it is not).
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
    floor_reason: str | None = None


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


def _dot_mkn(ins: HloInstruction, lhs: ArrayShape, rhs: ArrayShape) -> tuple[int, int, int]:
    """A ``dot``'s M (the lhs's free dimensions), K (contracted) and N (the rhs's free dimensions), batch
    dimensions left out."""
    lc, lb = _dims(ins.attributes.get("lhs_contracting_dims")), _dims(ins.attributes.get("lhs_batch_dims"))
    rc, rb = _dims(ins.attributes.get("rhs_contracting_dims")), _dims(ins.attributes.get("rhs_batch_dims"))
    m = math.prod(d for i, d in enumerate(lhs.dims) if i not in lc and i not in lb)
    k = math.prod(lhs.dims[i] for i in lc if i < len(lhs.dims))
    n = math.prod(d for i, d in enumerate(rhs.dims) if i not in rc and i not in rb)
    return m, k, n


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
        m, k, n = _dot_mkn(ins, lhs, rhs)
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
        phases = _transposed_phases(ins)
        if phases > 1:  # each of the dilation's phases a whole sub-window: computed side by side as features
            m, k, n = max(m // phases, 1), max(k // phases, 1), n * phases
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


def _read(module: HloModule, fused: HloComputation, name: str, whole: float, depth: int = 0) -> float:
    """Bytes a fusion really reads of its parameter ``name`` (``whole`` bytes): what its slices keep when
    it is only sliced (also inside nested fusions: a scan's layer i of a stacked array), nothing when it is
    only updated in place, else all of it."""
    users = [u for u in fused.instructions if name in u.operands]
    if whole == 0:
        return 0.0
    if fused.root is not None and fused.root.name == name:
        return whole  # it is the computation's result: whoever reads that reads all of it (a nested fusion's
        # bitcast of its parameter read whole by the reduce-window after it)
    total = 0.0
    for u in users:
        if u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == name:
            total += float(tiled_shape_bytes(u.shape) or 0)
        elif u.opcode == "dynamic-update-slice" and u.operands[0] == name and name not in u.operands[1:]:
            continue
        elif u.opcode == "bitcast" and depth < 8:
            total += _read(module, fused, u.name, whole, depth + 1)
        elif u.opcode == "fusion" and u.called_computations and depth < 8 and _relayout(module, u, name):
            # a nested fusion that only re-tiles it (XLA:TPU's copy_fusion of a stacked int8 weight before the
            # layer's dynamic-slice): what its users read of the copy is what is read of the parameter
            total += _read(module, fused, u.name, whole, depth + 1)
        elif u.opcode == "fusion" and u.called_computations and depth < 8:
            inner = module.computation(u.called_computations[0].lstrip("%"))
            params = {p.parameter_number: p.name for p in inner.parameters()} if inner is not None else {}
            for k, o in enumerate(u.operands):
                if o == name:
                    total += _read(module, inner, params[k], whole, depth + 1) if k in params else whole
        else:
            return whole
    return min(total, whole)


def _relayout(module: HloModule, u: HloInstruction, name: str) -> bool:
    """Whether the nested fusion ``u`` only moves its one operand ``name`` element for element (its computation
    copies, bitcasts or converts it: a layout change, no reordering), so that it is read as its users read it."""
    inner = module.computation(u.called_computations[0].lstrip("%"))
    return (inner is not None and list(u.operands) == [name]
            and {i.opcode for i in inner.instructions} <= {"parameter", "copy", "bitcast", "convert"})


def _fusion_bytes(module: HloModule, comp: HloComputation, ins: HloInstruction, moved: float) -> float:
    """A fusion's bytes read and written, with each parameter counted as what the fusion reads of it
    (:func:`_read`) and each result that is a ``dynamic-update-slice`` into a parameter (through bitcasts,
    in a tuple too) as its update: XLA updates such a buffer in place. ``moved`` when not readable."""
    fused = module.computation(ins.called_computations[0].lstrip("%")) if ins.called_computations else None
    root = fused.root if fused is not None else None
    if root is None:
        return moved
    params = {p.parameter_number: p for p in fused.parameters()}
    total = 0.0
    for k, operand in enumerate(ins.operands):
        p = params.get(k)
        whole = _hbm_bytes(_shape(comp, operand))
        total += _read(module, fused, p.name, whole) if p is not None else whole
    leaves = [fused.instruction(o) for o in root.operands] if root.opcode == "tuple" else [root]
    for leaf in leaves:
        if leaf is None:
            continue
        dus = leaf
        while dus is not None and dus.opcode == "bitcast" and dus.operands:
            dus = fused.instruction(dus.operands[0])
        if dus is not None and dus.opcode == "dynamic-update-slice" and len(dus.operands) > 1:
            base = _through(fused, dus.operands[0])
            if base is not None and base.opcode == "parameter":
                total += float(tiled_shape_bytes(_shape(fused, dus.operands[1])) or 0)
                continue
        total += _hbm_bytes(leaf.shape)
    return total


def _scalars_only(comp: HloComputation, ins: HloInstruction) -> bool:
    """Whether a lone instruction reads and writes only scalars (rank 0: an index's ``remainder``, ``select``,
    ``compare``): XLA:TPU runs it on the scalar unit (its result in scalar memory, ``S(6)``), no vector kernel
    and no fixed cost, though each scalar's tiled size (512 bytes for ``s32[]{:T(128)}``) is over
    :data:`_SCALAR_BYTES`. (The profile of the suite's KV-cache update shows none of its ten such ops.)"""
    if ins.opcode in ("fusion", "call", "while", "conditional") or ins.called_computations:
        return False
    shapes = [ins.shape, *(_shape(comp, o) for o in ins.operands)]
    leaves = [a for sh in shapes if sh is not None for a in array_leaves(sh)]
    return bool(leaves) and all(not a.dims for a in leaves)


def _hbm_bytes(shape) -> float:
    """Bytes of a shape's arrays that live in HBM: an array in XLA:TPU's on-chip vector memory (layout
    ``S(1)``: VMEM, where XLA prefetched it) moves no HBM bytes."""
    if shape is None:
        return 0.0
    return float(sum(tiled_shape_bytes(a) or 0 for a in array_leaves(shape) if not (a.layout and "S(1)" in a.layout)))


def _kernel_bytes(comp: HloComputation, ins: HloInstruction, moved: float) -> float:
    """A lone instruction's HBM bytes: its operands and result less those in VMEM (``S(1)``); a slice or an
    in-place update keeps the cost counter's rule (``moved``)."""
    if ins.opcode in ("dynamic-slice", "slice", "gather", "dynamic-update-slice", "scatter", "custom-call"):
        return moved
    return _hbm_bytes(ins.shape) + sum(_hbm_bytes(_shape(comp, o)) for o in ins.operands)


def _window_field(ins: HloInstruction, field: str) -> tuple[int, ...]:
    m = re.search(field + r"=([\dx]+)", ins.attributes.get("window") or "")
    return tuple(int(x) for x in m.group(1).split("x")) if m else ()


def _window_sizes(ins: HloInstruction) -> tuple[int, ...]:
    return _window_field(ins, "size")


def _whole_phases(ins: HloInstruction, field: str) -> bool:
    """Whether a convolution's window is a multiple of its ``field`` (``stride`` or ``lhs_dilate``) on every
    dimension, and the field over 1 somewhere: each of its phases a whole sub-window (4 × 4 at stride 2), none a
    ragged one (3 × 3 at stride 2: phases of 2 × 2, 2 × 1, 1 × 2 and 1 × 1 taps)."""
    steps, size = _window_field(ins, field), _window_sizes(ins)
    return (bool(steps) and len(steps) == len(size) and math.prod(steps) > 1
            and all(w % d == 0 for w, d in zip(size, steps)))


def _transposed_phases(ins: HloInstruction) -> int:
    """The phases of a transposed convolution whose window is a multiple of its input dilation on every dimension
    (a 4 × 4 window over ``lhs_dilate=2x2``: 4 phases, each output pixel of a phase the same 2 × 2 sub-window): the
    product of the dilation, else 1. XLA:TPU computes the phases side by side, as features: a DCGAN generator's
    4 × 4 stride-2 transposed convolutions to 64 and to 3 features ran at 145-180 TFLOP/s of XLA's FLOPs on the
    v5e (held-back round 2's gan_train), which padding N = 64 or 3 to the MXU's 128 counted 2 and 42.7 × slower;
    as 4 × 64 and 4 × 3 features the padding is 1 and 10.7 × (the to-3 kernels measured 11-12 × under the rate)."""
    if any(d > 1 for d in _window_field(ins, "stride")):  # XLA:TPU's batched dots written as base-dilated
        return 1  # convolutions (a window as large as the dilation, strided by one less): no transposed one
    return math.prod(_window_field(ins, "lhs_dilate")) if _whole_phases(ins, "lhs_dilate") else 1


def conv_class(comp: HloComputation, ins: HloInstruction) -> str | None:
    """The convolution form of a ``convolution`` with a window (a ``class_rates`` key), or None for a 1 × 1
    one (a matmul): ``conv_transposed`` (input dilated), ``conv_depthwise`` / ``conv_grouped`` (feature
    groups of one / several input features; also their weight gradients, batch groups), ``conv_input_gradient``
    (the window reversed), ``conv_weight_gradient`` (a window over 7 × 7: the image itself), ``conv_dilated``
    (rhs_dilate), ``conv_strided``, ``conv_1d`` (a window over one dimension),
    ``conv_dense``."""
    if ins.opcode != "convolution":
        return None
    size = _window_sizes(ins)
    if not any(d > 1 for d in size):
        return None
    dilate = _window_field(ins, "lhs_dilate")
    windowed = [w for w in size if w > 1]
    if dilate and len(windowed) == 1 and windowed == [d for d, w in zip(dilate, size) if d > 1 and d == w]:
        # XLA:TPU's batched dot as a base-dilated convolution: its one window dimension is the batch (window =
        # lhs_dilate); a 2 x 2 transposed convolution (window 2x2, lhs_dilate 2x2) or a grouped convolution's
        # gradient (3x3 windows beside the groups') is no batched dot
        return "batched_matmul"
    groups = int(ins.attributes.get("feature_group_count") or 1)
    batch_groups = int(ins.attributes.get("batch_group_count") or 1)
    if groups > 1 or batch_groups > 1:
        rhs = _shape(comp, ins.operands[1]) if len(ins.operands) > 1 else None
        labels = re.match(r"^[^_]+_([^-]+)->", ins.attributes.get("dim_labels", ""))
        per_group = None
        if isinstance(rhs, ArrayShape) and labels and "i" in labels.group(1) and len(labels.group(1)) == len(rhs.dims):
            per_group = rhs.dims[labels.group(1).index("i")]
        return "conv_depthwise" if per_group == 1 or batch_groups > 1 else "conv_grouped"
    if any(d > 1 for d in dilate):
        return "conv_transposed"
    if any(d > 1 for d in _window_field(ins, "rhs_reversal")):
        return "conv_input_gradient"
    if math.prod(size) > 49:
        return "conv_weight_gradient"
    if any(d > 1 for d in _window_field(ins, "rhs_dilate")):
        return "conv_dilated"  # an atrous window (rhs_dilation)
    if any(d > 1 for d in _window_field(ins, "stride")):
        # a window a multiple of its stride (4 x 4 at stride 2: each phase a whole 2 x 2 sub-window) ran faster than
        # calibrate's 3 x 3 stride-2 one (held-back round 2's DCGAN discriminator: 143-176 TFLOP/s against 120)
        return "conv_strided_4x4" if _whole_phases(ins, "stride") else "conv_strided"
    if len(windowed) == 1:
        return "conv_1d"  # a window over one dimension: a convolution over a sequence
    return "conv_dense"


def _linalg_rate(chip: Chip, comp: HloComputation, ins: HloInstruction) -> float | None:
    """The measured rate (:func:`linalg_cubes` per second) of a linear-algebra custom call, None where not
    measured: the Cholesky's interpolated in log n between its measured sizes (64 and 128, XLA:TPU's block;
    clamped at the ends), the others' one rate each."""
    cls = LINALG_CLASSES.get(_target(ins))
    if cls != "cholesky":
        return chip.class_rate(cls) if cls else None
    a = _shape(comp, ins.operands[0]) if ins.operands else None
    points = [(n, r) for n, r in ((n, chip.class_rate(f"cholesky_{n}")) for n in (64, 128)) if r]
    if not points or not isinstance(a, ArrayShape) or len(a.dims) < 2:
        return points[0][1] if points else None
    return _log_interpolate(points, max(a.dims[-1], 1))


def _batched_rate(chip: Chip, cls: str) -> float | None:
    """The rate (padded FLOP/s) of batched small products of precision class ``cls``: ``class_rates``
    ``batched_matmul_<cls>`` where measured (``f32_highest``: six bf16 passes of 64 x 64 products run far faster
    than six times the bf16 products' time), else the bf16 ``batched_matmul`` rate scaled by the precision's
    matmul rate; None where neither is known."""
    own = chip.class_rate(f"batched_matmul_{cls}")
    if own:
        return own
    base, bf16, rate = chip.class_rate("batched_matmul"), chip.matmul_rate("bf16"), chip.matmul_rate(cls)
    if not base:
        return None
    return base * (rate / bf16) if rate and bf16 else base


_CONV_FALLBACK = {"conv_dilated": "conv_dense", "conv_1d": "conv_dense", "conv_strided_4x4": "conv_strided"}
"""Convolution forms a chip's profile may lack (measured since issue 46's class coverage), timed at the form
they refine where it does."""


def _trick_flops(comp: HloComputation, ins: HloInstruction, tile: tuple[int, int] | None = None) -> float:
    """FLOPs of a batched dot XLA:TPU wrote as a base-dilated convolution: 2 × result elements × the
    contracted features (the window's taps all but one land on the dilation's holes); with ``tile``, M (the
    lhs's ``b``), K (the rhs's ``i``) and N (its ``o``) each padded up to the matrix unit's tile."""
    lhs = _shape(comp, ins.operands[0]) if ins.operands else None
    rhs = _shape(comp, ins.operands[1]) if len(ins.operands) > 1 else None
    labels = re.match(r"^([^_]+)_([^-]+)->", ins.attributes.get("dim_labels", ""))
    out = array_leaves(ins.shape)
    if not (isinstance(rhs, ArrayShape) and labels and "i" in labels.group(2) and out):
        return 0.0
    ll, rl = labels.groups()
    k = rhs.dims[rl.index("i")]
    flops = 2.0 * math.prod(out[0].dims) * k
    if tile and isinstance(lhs, ArrayShape) and "b" in ll and "o" in rl and len(ll) == len(lhs.dims) \
            and len(rl) == len(rhs.dims):
        m, n = lhs.dims[ll.index("b")], rhs.dims[rl.index("o")]
        if m > 0 and k > 0 and n > 0:
            flops *= (_pad(m, tile[0]) / m) * (_pad(k, tile[1]) / k) * (_pad(n, tile[1]) / n)
    return flops


def _trick_small(comp: HloComputation, ins: HloInstruction, tile: tuple[int, int] | None) -> bool:
    """Whether a batched dot written as a base-dilated convolution has M and N within one tile: M the lhs's
    ``b`` dimension, N the rhs's ``o``."""
    lhs = _shape(comp, ins.operands[0]) if ins.operands else None
    rhs = _shape(comp, ins.operands[1]) if len(ins.operands) > 1 else None
    labels = re.match(r"^([^_]+)_([^-]+)->", ins.attributes.get("dim_labels", ""))
    if not (tile and isinstance(lhs, ArrayShape) and isinstance(rhs, ArrayShape) and labels):
        return False
    ll, rl = labels.groups()
    try:
        dims = (lhs.dims[ll.index("b")], rhs.dims[rl.index("o")])
    except (ValueError, IndexError):
        return False
    return max(dims) <= tile[0]  # M and N both within one tile: one weight tile a product


def _batched_small(comp: HloComputation, ins: HloInstruction, tile: tuple[int, int] | None) -> bool:
    """A ``dot`` with batch dimensions whose M and N both fit in one matrix-unit tile (8192 products of 64 × 64,
    2048 of 128 × 128): the MXU loads a weight tile for each product and runs it far below its padded rate
    (class ``batched_matmul``, on padded FLOPs). Attention's products (512 × 512 over a head of 64) are not:
    they run at the padded matmul rate."""
    if ins.opcode != "dot" or not tile or not _dims(ins.attributes.get("lhs_batch_dims")):
        return False
    lhs, rhs = _shape(comp, ins.operands[0]), _shape(comp, ins.operands[1]) if len(ins.operands) > 1 else None
    if not (isinstance(lhs, ArrayShape) and isinstance(rhs, ArrayShape)):
        return False
    m, _, n = _dot_mkn(ins, lhs, rhs)
    return max(m, n) <= tile[0]  # small products (64 x 64, 128 x 128), not attention's 512 x 512 over a head of 64


def _group_masked_share(comp: HloComputation, ins: HloInstruction,
                         inner: list[tuple[HloComputation, HloInstruction]], tile: tuple[int, int] | None) -> float:
    """The share of a matmul kernel's dense FLOPs it runs where XLA:TPU skips the iterations a group mask
    zeroes: ``lax.ragged_dot``'s weight gradient, compiled as a batched convolution over the G groups of
    operands selected by a ``pred[G, T]`` mask (row t belongs to group g), its backend config carrying a
    ``mask_aggregator_config`` (iterations skipped at the groups' starts). The groups split the T rows, so
    each row is multiplied once, not G times: ``min(1, 1/G + tile/T)`` (a tile of rows at each group's
    boundary run twice). 1.0 for any other kernel."""
    if "mask_aggregator_config" not in (ins.attributes.get("backend_config") or ""):
        return 1.0
    conv = next((i for _, i in inner if i.opcode == "convolution"), None)
    dilate = _window_field(conv, "lhs_dilate") if conv is not None else ()
    groups = max(dilate, default=1)
    masks = [s for s in (_shape(comp, o) for o in ins.operands)
             if isinstance(s, ArrayShape) and s.dtype == "pred" and len(s.dims) == 2 and groups in s.dims]
    if groups <= 1 or not masks:
        return 1.0
    rows = math.prod(masks[0].dims) // groups
    return min(1.0, 1.0 / groups + ((tile[1] if tile else 0) / rows if rows else 0.0))


def _sets(module: HloModule, sc: HloInstruction) -> bool:
    """Whether a scatter sets its rows (``x.at[i].set(u)``): its combiner returns its second parameter (the
    update), through bitcasts, rather than combining the two."""
    comp = module.computation((sc.attributes.get("to_apply") or "").lstrip("%"))
    root = comp.root if comp is not None else None
    while root is not None and root.opcode in ("bitcast", "copy", "convert") and root.operands:
        root = comp.instruction(root.operands[0])
    return root is not None and root.opcode == "parameter" and root.parameter_number == 1


def _scatter_rows(sc: HloInstruction, idx) -> float:
    """How many rows a scatter writes: its indices' elements less the index vector's dimension
    (``index_vector_dim``; where it equals the indices' rank, s32[65536] with ``index_vector_dim=1``, each
    element is one row's index), 0 where the indices' shape is not readable."""
    if not isinstance(idx, ArrayShape) or not idx.dims:
        return 1.0 if isinstance(idx, ArrayShape) else 0.0
    vdim = _dims(sc.attributes.get("index_vector_dim"))
    v = vdim[0] if vdim else len(idx.dims) - 1
    return float(math.prod(d for i, d in enumerate(idx.dims) if i != v))


#: the row width (bytes) from which a scatter's rows are whole windows (the gradient of a nearest upsample writes
#: 0.5-1 MiB windows at 32-128 regular ids): the widest row calibrate's gathers measure, 32 KiB pages
_WINDOW_ROW_BYTES = 32768.0
#: rows per table row from which a scatter-add is a segment sum (many rows to few): calibrate's segment sums add 32
#: (131072 into 4096), k-means' 32 ran at their rate (6.7 ns a 512 B row); held-back round 1's gnn_train added 8 per
#: node of a 16 MiB table at 13.9 ns, the general rule's 12.5 (a gathered row's), not the segment sums' 7.1
_SEGMENT_ROWS_PER_TARGET = 16
#: the row widths (bytes) of calibrate's segment-sum scatter-adds (``class_rates`` scatter_add_segment_4/_512/_2048)
_SEGMENT_ROW_BYTES = (4, 512, 2048)


def _scatter_add_form(comp: HloComputation, sc: HloInstruction, chip: Chip, rows: float,
                      upd: float) -> tuple[str, float] | None:
    """A combining scatter (a scatter-add) of a form calibrate measured, and its time (seconds), or None for the
    general rule (rows at a gathered row's time, bytes at the scatter-add rate). ``rows``: the indices' rows;
    ``upd``: the updates' bytes. In this order, each only where the chip's profile has the rate:

    - ``windows``: rows of at least 32 KiB (the gradient of ``jax.image.resize(..., "nearest")``: 32-128 ids each
      writing a 0.5-1 MiB window): the updates' bytes ÷ ``class_rates.scatter_add_upsample`` (held-back round 2's
      vae_train: six such kernels 0.72 ms measured, 5.53 ms at the scatter-add rate);
    - ``elements into VMEM``: single elements added into a table XLA:TPU keeps in VMEM (``S(1)``;
      ``take_along_axis``'s gradient): rows ÷ ``class_rates.scatter_add_scalar_vmem`` (ctc_train: 4.2 M elements
      28.0 ms measured, 51.2 ms at a 128 B gathered row's time each);
    - ``segment sum``: at least 16 rows per row of the table (ids collide: ``jax.ops.segment_sum`` into few
      segments): rows ÷ ``class_rates.scatter_add_segment_<width>``, interpolated in log row width between 4 B,
      512 B and 2 KiB (kmeans_step: 131072 rows of 512 B into 4096, 0.87-0.89 ms each measured, 1.6 ms at the row
      rule; fewer per row, as gnn_train's 8, keep the general rule)."""
    width = upd / rows
    if width >= _WINDOW_ROW_BYTES:
        rate = chip.class_rate("scatter_add_upsample")
        return ("windows", upd / rate) if rate else None
    table = _shape(comp, sc.operands[0]) if sc.operands else None
    if not isinstance(table, ArrayShape) or not table.dims:
        return None
    elem = shape_bytes(table) / max(math.prod(table.dims), 1) if shape_bytes(table) else 0.0
    if elem and width <= elem and (_hbm_bytes(table) == 0 or _hbm_bytes(sc.shape) == 0):  # (the table: a zero
        # broadcast inside the fusion, its result in VMEM)
        rate = chip.class_rate("scatter_add_scalar_vmem")
        return ("elements into VMEM", rows / rate) if rate else None
    targets = (shape_bytes(table) or 0) / width if width else 0.0
    if targets and rows >= _SEGMENT_ROWS_PER_TARGET * targets:
        points = [(w, chip.class_rate(f"scatter_add_segment_{w}")) for w in _SEGMENT_ROW_BYTES]
        rate = _log_interpolate([(w, r) for w, r in points if r], width)
        return ("segment sum", rows / rate) if rate else None
    return None


def _log_interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """The rate at ``x`` (a row width) from measured ``(width, rate)`` points: interpolated in log width and log
    rate, clamped at the ends; None without a point."""
    points = sorted(points)
    if not points or x <= 0:
        return None
    lx = math.log(x)
    if lx <= math.log(points[0][0]):
        return points[0][1]
    for (w0, r0), (w1, r1) in zip(points, points[1:]):
        if lx <= math.log(w1):
            f = (lx - math.log(w0)) / (math.log(w1) - math.log(w0))
            return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
    return points[-1][1]


def _is_fft(inner: list[tuple[HloComputation, HloInstruction]], ins: HloInstruction) -> bool:
    """XLA:TPU lowers ``jnp.fft`` to matmuls (a DFT in steps): a kernel whose op names say ``fft``."""
    names = [i.metadata.op_name for _, i in [(None, ins), *inner] if i.metadata is not None and i.metadata.op_name]
    return any(re.search(r"(^|/)(jit\()?i?r?fft", n) for n in names)


def _scan_like(comp: HloComputation, ins: HloInstruction) -> bool:
    """A ``reduce-window`` that is a prefix scan (a cumulative sum or max): its window padded below by the
    window less one on a dimension (``pad=127_0`` for a window of 128), not a softmax's row reduction."""
    m = re.search(r"pad=([\d_x-]+)", ins.attributes.get("window") or "")
    pads = [tuple(int(v) for v in p.split("_")) for p in m.group(1).split("x")] if m else []
    return any(w > 8 and len(p) == 2 and p[0] == w - 1 and p[1] == 0 for w, p in zip(_window_sizes(ins), pads))


_OP_ALIASES = {"cosine": "sine", "sqrt": "rsqrt", "exponential-minus-one": "exponential", "exp": "exponential"}
"""Element ops timed at a measured op's rate (XLA:TPU expands them alike): cosine as sine, sqrt as rsqrt, expm1 as
exp."""
_INTEGER_TYPES = ("s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64")


def _element_op_time(chip: Chip, inner: list[tuple[HloComputation, HloInstruction]]) -> tuple[float, float, float]:
    """``(seconds, elements, transcendentals)`` of a kernel's element ops that have a measured rate of their own
    (``class_rates`` ``op_*``, :data:`stagetool.core.chips.ELEMENT_OPS`): each op's result elements over its rate
    (a float op at the f32 rate, an integer one at the s32 rate), and the elements and transcendentals those ops
    count in :func:`vector_ops` and XLA's transcendental count, which the caller leaves out of the generic rates."""
    rates = {}
    for key, (opcode, dtype) in ELEMENT_OPS.items():
        r = chip.class_rate(key)
        if r:
            rates[(opcode, dtype)] = r
    if not rates:
        return 0.0, 0.0, 0.0
    seconds = elements = trans = 0.0
    for _, i in inner:
        leaves = array_leaves(i.shape)
        if not leaves:
            continue
        opcode = _OP_ALIASES.get(i.opcode, i.opcode)
        rate = rates.get((opcode, "s32" if leaves[0].dtype in _INTEGER_TYPES else "f32"))
        if not rate:
            continue
        n = sum(float(math.prod(a.dims)) for a in leaves)
        seconds += n / rate
        elements += n
        trans += n if i.opcode in TRANSCENDENTAL else 0.0
    return seconds, elements, trans


def _pooling(comp: HloComputation, ins: HloInstruction) -> bool:
    """Whether a ``reduce-window`` is a pooling window (max or average pooling): no prefix scan, and no window
    over a whole dimension (XLA:TPU's softmax row sums and maxima are such reduce-windows: reductions)."""
    size = _window_sizes(ins)
    src = _shape(comp, ins.operands[0]) if ins.operands else None
    if _scan_like(comp, ins) or not isinstance(src, ArrayShape) or len(size) != len(src.dims):
        return False
    windowed = [(w, d) for w, d in zip(size, src.dims) if w > 1]
    return bool(windowed) and all(w < d for w, d in windowed)


def _interior(ins: HloInstruction) -> bool:
    """Whether a ``pad`` has interior padding (``padding=0_0_1x...``: elements interleaved with the pad value)."""
    return any(len(p) == 3 and int(p[2]) > 0 for p in (d.split("_") for d in (ins.attributes.get("padding") or "")
                                                             .split("x")) if all(v.lstrip("-").isdigit() for v in p))


def _draws_random_bits(inner: list[tuple[HloComputation, HloInstruction]], ins: HloInstruction) -> bool:
    """Whether a kernel computes threefry random bits (``jax.random``): an op name says ``threefry``."""
    return any(i.metadata is not None and i.metadata.op_name and any(
        w in i.metadata.op_name for w in ("threefry", "random_bits", "jit(_uniform)"))
               for _, i in [(None, ins), *inner])


_NOT_VECTOR_WORK = _MOVES | {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "fusion", "call"}


def vector_ops(inner: list[tuple[HloComputation, HloInstruction]]) -> float:
    """Element-ops the vector unit runs for a kernel: each element-wise instruction's result elements, a
    reduction's (and a ``reduce-window``'s) operand elements."""
    total = 0.0
    for c, i in inner:
        if i.opcode in _NOT_VECTOR_WORK or i.opcode in _MATMULS:
            continue
        if i.opcode in ("reduce", "reduce-window"):  # each operand element once (XLA:TPU's softmax sums are
            # reduce-windows over a whole row: counting result x window made a LayerNorm + softmax 600x too slow)
            src = _shape(c, i.operands[0]) if i.operands else None
            total += float(math.prod(src.dims)) if isinstance(src, ArrayShape) else 0.0
        else:
            total += sum(float(math.prod(a.dims)) for a in array_leaves(i.shape))
    return total


def _gather_rate(chip: Chip, row_bytes: float, copy_rate: float | None) -> float | None:
    """The gather rate for rows of ``row_bytes``: interpolated (in log row bytes) between the measured
    widths (``class_rates`` gather_128, gather_512, the 2 KiB ``gather_bytes_per_second``, gather_32768 —
    at least the copy rate: pages of 32 KiB in programs ran at it), clamped at the ends."""
    base = chip.gather_bytes_per_second
    points = sorted((w, r) for w, r in ((128, chip.class_rate("gather_128")), (512, chip.class_rate("gather_512")),
                                        (2048, base), (32768, max(filter(None, (chip.class_rate("gather_32768"),
                                                                                 copy_rate)), default=None)))
                    if r)
    if len(points) < 2 or row_bytes <= 0:
        return base
    return _log_interpolate(points, row_bytes)


def sort_stages(elements: float, n: int) -> float:
    """The comparator stages of a sort of ``elements`` elements along a dimension of length ``n`` (a bitonic
    network): ``elements × ⌈log2 n⌉(⌈log2 n⌉+1)/2``; the work unit of ``class_rates`` ``sort`` (calibrate's
    benchmark counts its work with it)."""
    lg = math.ceil(math.log2(max(n, 2)))
    return float(elements) * lg * (lg + 1) / 2


def _sort_stages(comp: HloComputation, ins: HloInstruction) -> float:
    """A sort's comparator stages (:func:`sort_stages`), n the sorted dimension's length."""
    src = _shape(comp, ins.operands[0]) if ins.operands else None
    if not isinstance(src, ArrayShape) or not src.dims:
        return 0.0
    dim = _dims(ins.attributes.get("dimensions"))
    n = src.dims[dim[0]] if dim and dim[0] < len(src.dims) else src.dims[-1]
    return sort_stages(math.prod(src.dims), n)


def xla_cycles(ins: HloInstruction) -> int | None:
    """XLA:TPU's ``estimated_cycles`` of an instruction's backend config, or None (absent or not positive);
    -1 where XLA wrote its "unknown" (:data:`_CYCLES_UNKNOWN` or more)."""
    raw = ins.attributes.get("backend_config")
    m = _CYCLES.search(raw) if raw and "estimated_cycles" in raw else None
    n = int(m.group(1)) if m else 0
    return -1 if n >= _CYCLES_UNKNOWN else n if n > 0 else None


def _sorts_scatter_indices(module: HloModule, comp: HloComputation, ins: HloInstruction) -> bool:
    """Whether ``ins`` (a lone ``sort``) is XLA:TPU's sort of a scatter's indices: every use of its
    results, through ``get-tuple-element`` and fusions of element-wise work (the indices clamped), ends
    in a scatter (a fusion holding one, or a lone ``scatter``), and one does."""
    if ins.opcode != "sort":
        return False
    frontier, seen, scatters = [ins.name], set(), 0
    while frontier:
        name = frontier.pop()
        if name in seen:
            continue
        if len(seen) >= 32:
            return False  # a long chain of work after the sort: not XLA's index sort
        seen.add(name)
        users = [u for u in comp.instructions if name in u.operands]
        if not users:
            return False  # a result of the sort that leaves the computation: not only a scatter's indices
        for u in users:
            inner_ops = {i.opcode for _, i in _inner(module, u)} if u.opcode == "fusion" else {u.opcode}
            if "scatter" in inner_ops:
                scatters += 1
            elif u.opcode == "get-tuple-element" or (u.opcode == "fusion" and not inner_ops & (
                    _MATMULS | {"sort", "reduce", "reduce-window", "gather", "custom-call", "while", "call"})):
                frontier.append(u.name)
            else:
                return False
    return scatters > 0


def is_cross_program_prefetch(ins: HloInstruction) -> bool:
    """Whether ``ins`` is XLA:TPU's cross-program prefetch: a ``copy-start`` carrying
    ``cross_program_prefetch_index`` (it copies an argument from HBM into VMEM, ``S(1)``)."""
    return ins.opcode == "copy-start" and "cross_program_prefetch_index" in ins.attributes


def _rate(*rates: float | None) -> float | None:
    for r in rates:
        if r:
            return r
    return None


def kernel_time(module: HloModule, comp: HloComputation, ins: HloInstruction, chip: Chip, *,
                gpu: bool = False, cpu_program: bool = False) -> KernelTime:
    """The model's time of one top-level instruction ``ins`` of ``comp`` on ``chip`` (see the module
    docstring), per execution, one device. ``gpu``: the program runs as separate kernel launches
    (``kernel_launch_seconds`` each) rather than one TPU executable (``kernel_overhead_seconds``).
    ``cpu_program``: the module is XLA:CPU's, timed on the chip (``--chip`` on the CPU mesh): its sort is not the
    one XLA:TPU compiles and calibrate measured, so it stays a floor."""
    cost = instruction_cost(module, comp, ins)
    flops, moved, trans = cost.flops, cost.bytes_accessed, cost.transcendentals
    if ins.opcode == "fusion":
        moved = _fusion_bytes(module, comp, ins, moved)
    elif not gpu:
        moved = _kernel_bytes(comp, ins, moved)
    hbm = chip.hbm_bandwidth_bytes_per_second
    copy_rate = _rate(chip.hbm_copy_bytes_per_second, hbm)
    overhead = (chip.kernel_launch_seconds if gpu else chip.kernel_overhead_seconds) or 0.0
    if not gpu and ins.opcode != "custom-call" and (moved <= _SCALAR_BYTES or _scalars_only(comp, ins)):
        overhead = 0.0  # a loop counter's add or compare: the TPU's scalar unit, no vector kernel
    cycles = xla_cycles(ins)
    xla = cycles / chip.clock_hz if cycles and cycles > 0 and chip.clock_hz else None
    gave_up = cycles == -1  # XLA:TPU's own cost model cannot estimate this kernel: an unusual code path
    inner = _inner(module, ins) if ins.opcode in ("fusion", "call") else [(comp, ins)]
    ops = {i.opcode for _, i in inner}

    def done(kind: str, compute: float, memory: float, figure: str = FROM_MODEL, uncounted: bool = False,
             f: float = flops, b: float = moved) -> KernelTime:
        core = max(compute, memory)
        bound = LATENCY if overhead > core else COMPUTE if compute >= memory and compute > 0 else MEMORY
        why = None
        if uncounted:
            why = ("timed from its cost_estimate at the chip's full rates" if figure == FROM_KERNEL
                   else "no model covers its work")
        elif gave_up:
            uncounted, why = True, ("XLA:TPU's own cost model gives it up (estimated_cycles 'unknown'): an unusual "
                                    "code path, possibly far slower than its class's rate")
        return KernelTime(kind, core + overhead, compute, memory, overhead, bound, figure, f, b,
                          xla, uncounted, why)

    def floor(kind: str) -> KernelTime:
        return done(kind, 0.0, moved / hbm if hbm else 0.0, FROM_FLOOR, True)

    if is_cross_program_prefetch(ins):  # a DMA reading the argument from HBM: no vector kernel, no fixed cost
        overhead = 0.0
        read = _hbm_bytes(_shape(comp, ins.operands[0])) if ins.operands else 0.0
        return done(CROSS_PROGRAM_PREFETCH, 0.0, read / copy_rate if copy_rate else 0.0, f=0.0, b=read)
    if ins.opcode == "custom-call":
        target = _target(ins)
        if is_trivial_custom_call(target):  # an annotation, an allocation, a bitcast: free; else a small copy
            overhead = overhead if target in _HELPERS_THAT_MOVE else 0.0
            b = moved if target in _HELPERS_THAT_MOVE else 0.0
            return done(custom_call_kind(target), 0.0, b / copy_rate if copy_rate else 0.0, b=b)
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
        elif target in LINALG_CLASSES and not gpu and (linalg_rate := _linalg_rate(chip, comp, ins)):
            # XLA:TPU's Cholesky, triangular-block inversion, QR and eigh custom calls at the rate calibrate measured
            # for each (held-back round 1's gp_cholesky: 2048 Cholesky factorisations of 64 x 64, 14.1 ms measured,
            # a 0.165 ms floor before)
            return done(custom_call_kind(target), linalg_cubes(comp, ins) / linalg_rate,
                        moved / copy_rate if copy_rate else 0.0)
        elif target == "TopK" and not gpu and chip.class_rate("top_k"):  # lax.top_k at calibrate's rate
            src = _shape(comp, ins.operands[0]) if ins.operands else None
            n = float(math.prod(src.dims)) if isinstance(src, ArrayShape) else 0.0
            return done(custom_call_kind(target), n / chip.class_rate("top_k"), moved / copy_rate if copy_rate else 0.0)
        else:
            return floor(custom_call_kind(target))
    if "sort" in ops:
        if not gpu and chip.scatter_bytes_per_second and _sorts_scatter_indices(module, comp, ins):
            overhead = 0.0  # measured with the scatter: its time and its fixed cost are in the scatter's rate
            return done(SCATTER_INDEX_SORT, 0.0, 0.0)
        sort_rate = chip.class_rate("sort")
        srt = next((c, i) for c, i in inner if i.opcode == "sort")
        if sort_rate and not gpu and not cpu_program:
            return done("sort", _sort_stages(*srt) / sort_rate, moved / copy_rate if copy_rate else 0.0)
        return floor("sort")
    opaque = [i for _, i in inner if i.opcode == "custom-call" and i is not ins
              and not is_trivial_custom_call(_target(i))]
    if opaque:  # a fusion around a custom call no model covers
        return floor(custom_call_kind(_target(opaque[0])))
    if ops & _MATMULS or ins.opcode == "custom-call":  # (a cuBLAS call here)
        classes, model = [], 0.0
        windowed = any(i.opcode == "convolution" and any(d > 1 for d in _window_sizes(i)) for _, i in inner)
        fft = not gpu and chip.class_rate("fft") and _is_fft(inner, ins)
        forms: list[str] = []
        for c, i in inner:
            if i.opcode in _MATMULS or i.opcode == "custom-call":
                f = flops if i is ins else instruction_cost(module, c, i).flops
                cls = matmul_class(c, i)
                classes.append(cls)
                rate = chip.matmul_rate(cls)
                bf16 = chip.matmul_rate("bf16")
                form = None if gpu else conv_class(c, i)
                if form in _CONV_FALLBACK and not chip.class_rate(form):
                    form = _CONV_FALLBACK[form]  # a form not measured on this chip: the measured form it refines
                if fft:  # XLA's FLOPs of an FFT's matmuls at the FFT rate calibrate measured
                    model += f / chip.class_rate("fft")
                elif form == "batched_matmul" and rate:  # a batched dot written as a convolution
                    small = _trick_small(c, i, chip.matmul_tile)
                    if small and _batched_rate(chip, cls):
                        forms.append(form)  # padded FLOPs: one weight tile a product, however small
                        model += _trick_flops(c, i, chip.matmul_tile) / _batched_rate(chip, cls)
                    else:
                        model += _trick_flops(c, i) / rate
                elif form and chip.class_rate(form) and rate and bf16:  # measured in bf16: scaled to the precision
                    forms.append(form)
                    padded = f if form in ("conv_depthwise", "conv_grouped") else padded_matmul_flops(
                        c, i, chip.matmul_tile, f)
                    model += padded / chip.class_rate(form) * (bf16 / rate)
                elif not gpu and _batched_rate(chip, cls) and _batched_small(c, i, chip.matmul_tile):
                    forms.append("batched_matmul")
                    model += padded_matmul_flops(c, i, chip.matmul_tile, f) / _batched_rate(chip, cls)
                else:
                    model += padded_matmul_flops(c, i, chip.matmul_tile, f) / rate if rate else 0.0
        masked = _group_masked_share(comp, ins, inner, chip.matmul_tile) if not gpu else 1.0
        model *= masked  # a ragged dot's weight gradient: only each group's own rows are multiplied
        if masked < 1.0:
            forms.append("group-masked")
        prec = "+".join(sorted(set(classes)))
        if fft:
            kind = f"FFT (matmuls) {prec}"
        elif forms:
            kind = ("convolution " if windowed else "matmul ") + prec + " (" + ", ".join(sorted(set(forms))) + ")"
        else:
            kind = ("convolution " if windowed else "matmul ") + prec
        compute, figure = model, FROM_MODEL
        memory = moved / copy_rate if copy_rate else 0.0
        scale = chip.class_rate("xla_fft") if fft else None
        if scale and xla:  # the class XLA's own figure times better on the fit half: XLA's × the fit's factor
            core = max(compute, memory)
            share = (compute / core, memory / core) if core > 0 else (1.0, 0.0)
            compute, memory, figure = xla * scale * share[0], xla * scale * share[1], FROM_XLA
        return done(kind, compute, memory, figure, f=flops * masked)
    trans_rate = chip.transcendentals_per_second
    own_ops = _element_op_time(chip, inner) if not gpu else (0.0, 0.0, 0.0)  # ops at rates measured for each
    compute = max(trans - own_ops[2], 0.0) / trans_rate if trans_rate else 0.0
    compute += own_ops[0]
    if "scatter" in ops:
        sc = next(i for _, i in inner if i.opcode == "scatter")
        sc_comp = next(c for c, i in inner if i is sc)
        upd = sum(shape_bytes(_shape(sc_comp, o)) or 0 for o in sc.operands[(len(sc.operands) + 1) // 2:])
        rate = _rate(chip.scatter_bytes_per_second, hbm)  # the update read, its row read and written
        memory = 3 * upd / rate if rate else 0.0
        idx = _shape(sc_comp, sc.operands[len(sc.operands) // 2]) if len(sc.operands) > 2 else None
        rows = _scatter_rows(sc, idx)
        width = max(upd / rows, _NARROW_ROW_BYTES) if rows else 0.0
        row_rate = _gather_rate(chip, width, copy_rate) if rows and not gpu else None
        if rows and chip.scatter_bytes_per_second and row_rate:
            # a scatter is bound by its rows where they are narrow, as a gather is: each row at least the time of a
            # gathered row of its width (calibrate's gathers, row-bound below 2 KiB: 12.2 ns a 128 B row on the lent
            # v5e, 12.5 a 512 B one; a narrower row as a 128 B one). Not the 2 KiB scatter-add's 32 ns a row, which
            # is its bytes' time: held-back round 1's gnn_train scattered 512 B rows at 8.7-13.9 ns, and
            # weighted_histogram scalar updates at 8.7 ns (its bins in VMEM)
            memory = max(memory, rows * 2 * width / row_rate)
        set_rate = None if gpu else chip.class_rate("scatter_set_rows")
        if rows and set_rate and _sets(module, sc):  # a set's rows at the rate calibrate measured for them
            return done("scatter (set)", compute, max(memory, rows / set_rate), b=3.0 * upd)
        shaped = None if gpu or not rows else _scatter_add_form(sc_comp, sc, chip, rows, upd)
        if shaped is not None:
            form, seconds = shaped
            return done(f"scatter ({form})", compute, seconds, b=3.0 * upd)
        return done("scatter", compute, memory, b=3.0 * upd)
    if "gather" in ops:
        gathers = [(c, i) for c, i in inner if i.opcode == "gather"]
        rows = sum(shape_bytes(i.shape) or 0 for _, i in gathers)
        width = _dims(gathers[0][1].attributes.get("slice_sizes"))
        elem = array_leaves(gathers[0][1].shape)
        row_bytes = float(math.prod(width) * (shape_bytes(elem[0]) / max(math.prod(elem[0].dims), 1))) \
            if width and elem and math.prod(elem[0].dims) else 0.0
        rate = _rate(_gather_rate(chip, row_bytes, copy_rate) if not gpu else None, chip.gather_bytes_per_second, hbm)
        # the rows are read and written, or only read where XLA:TPU put the kernel's result in VMEM (S(1): a paged
        # decode's gathered pages, read by the attention after it from there)
        sides = 1 if not gpu and _hbm_bytes(ins.shape) == 0 and any(a.dims for a in array_leaves(ins.shape)) else 2
        table = _shape(gathers[0][0], gathers[0][1].operands[0]) if gathers[0][1].operands else None
        if not gpu and isinstance(table, ArrayShape) and table.dims and _hbm_bytes(table) == 0 and copy_rate:
            # rows gathered from a table XLA:TPU put in VMEM (S(1)): no row read from HBM, only what the kernel
            # writes there (held-back round 1's gnn_train: 262144 rows of 512 B from a 16 MiB table in VMEM,
            # 0.48 ms measured, 3.27 ms at the HBM-row gather rate)
            scalar_rate = chip.class_rate("gather_scalar_vmem")
            if scalar_rate and width and math.prod(width) == 1:
                # single elements (take_along_axis): each still a gather's step, however near the table
                # (held-back round 2's ctc_train: 4.2 M f32 from a 4 MiB table, 52.2 ms measured, 0 s by its HBM
                # bytes): the elements over calibrate's rate for them, at least the HBM bytes' time
                elements = sum(float(math.prod(a.dims)) for _, g in gathers for a in array_leaves(g.shape))
                return done("gather (elements from VMEM)", compute, max(elements / scalar_rate, moved / copy_rate))
            return done("gather from VMEM", compute, moved / copy_rate)
        rest = max(moved - sides * rows, 0.0)  # what the kernel reads and writes beside the rows
        # a row narrower than 128 B (single elements: take_along_axis) takes a 128 B row's time, read and written,
        # as a scatter's rows do, wherever its result goes: a gather is bound by its rows (calibrate's 128 B and
        # 512 B rows 12.2 and 12.5 ns each on the lent v5e, single f32 elements from a VMEM table 12.7 ns); not its
        # bytes at the 128 B rows' rate, 0.4 ns an element (held-back round 3's aspp_train: 4.19 M f32 logits
        # picked per pixel from HBM in one kernel, 63.9 ms measured, 0.80 ms by its bytes)
        narrow = not gpu and 0 < row_bytes < _NARROW_ROW_BYTES
        row_bytes_moved = 2.0 * rows / row_bytes * _NARROW_ROW_BYTES if narrow else sides * rows
        return done("gather", compute,
                    row_bytes_moved / rate + (rest / copy_rate if copy_rate else 0.0) if rate else 0.0)
    vec_rate = None if gpu else chip.class_rate("vector_ops")
    vector = max(vector_ops(inner) - own_ops[1], 0.0) / vec_rate if vec_rate else 0.0
    if "select-and-scatter" in ops:  # a pooling window's gradient: at the rate calibrate measured for it
        sas = chip.class_rate("select_and_scatter") if not gpu else None
        if sas:
            return done("select-and-scatter", compute, moved / sas)
        rate = _rate(chip.elementwise_bytes_per_second, hbm)
        return done("select-and-scatter", compute + vector, moved / rate if rate else 0.0)
    if any(i.opcode == "reduce-window" and _pooling(c, i) for c, i in inner):  # max/avg pooling's window
        pool = chip.class_rate("pool_window") if not gpu else None
        rate = pool or _rate(chip.reduction_bytes_per_second, hbm)
        return done("pooling (reduce-window)", compute + (0.0 if pool else vector), moved / rate if rate else 0.0)
    if ops & {"reduce", "reduce-window"}:
        rate = _rate(chip.reduction_bytes_per_second, hbm)
        cumulative = any(i.opcode == "reduce-window" and max(_window_sizes(i), default=1) > 8
                         and _scan_like(c, i) for c, i in inner)
        if cumulative and chip.class_rate("cumulative"):
            return done("cumulative (reduce-window)", compute + vector, moved / chip.class_rate("cumulative"))
        return done("reduction", compute + vector, moved / rate if rate else 0.0)
    if ops <= _MOVES:
        dma = ins.opcode == "copy" and not gpu and chip.is_tpu and "window_config" not in (
            ins.attributes.get("backend_config") or "")
        rate = 2 * copy_rate if dma and copy_rate else copy_rate  # a DMA reads and writes HBM at once
        if any(i.opcode == "pad" and _interior(i) for _, i in inner):  # an interleave (associative_scan's levels)
            pad = chip.class_rate("pad_interior") if not gpu else None
            return done("pad (interleave)", 0.0, moved / (pad or copy_rate) if (pad or copy_rate) else 0.0)
        return done("copy (DMA)" if dma else "copy", 0.0, moved / rate if rate else 0.0)
    rate = _rate(chip.elementwise_bytes_per_second, hbm)
    memory = moved / rate if rate else 0.0
    bits_rate = None if gpu else chip.class_rate("random_bits")
    if bits_rate and _draws_random_bits(inner, ins):
        # threefry: one random word per result element at the rate calibrate measured for jax.random.bits (the
        # fit half's dropout: the vector-op count over-counts threefry's rounds, 2.8x)
        draws = sum(float(math.prod(a.dims)) for a in array_leaves(ins.shape))
        return done("random bits (threefry)", compute + draws / bits_rate, memory)
    kind = "element-wise (vector-unit bound)" if compute + vector > memory and vector > compute else "element-wise"
    return done(kind, compute + vector, memory)
