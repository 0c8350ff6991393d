"""Loop-aware cost: XLA counts a ``while`` body once; this estimates each body × its trip count.

XLA's ``HloCostAnalysis`` (behind ``Compiled.cost_analysis()``) visits every computation reachable
from the entry once, so a ``lax.scan`` over L layers is counted as one layer. The **loop-aware
estimate** adds what XLA left out, per loop: ``(trip count - 1) × the body's cost``, nested loops
multiplied through. The body's cost is counted here from the compiled module's shapes, with XLA's
own rules (``xla/service/hlo_cost_analysis.cc``):

* ``dot``: 2 × output elements × the product of the contracting dimensions;
* ``convolution``: 2 × output elements × (kernel elements ÷ output features);
* element-wise arithmetic: 1 FLOP per output element; ``exp log tanh sqrt rsqrt logistic erf
  power sin cos tan expm1 log1p cbrt atan2``: 1 transcendental per output element instead;
* ``reduce``/``reduce-window``: (input elements - output elements) × the reducer's FLOPs
  (reduce-window: output elements × window elements × the reducer's);
* fusions and calls: their computation's instructions; layout, slicing and data movement: 0.

Bytes accessed of a body: operand bytes + result bytes of each top-level instruction of the body
(fusions count as one: what they read and write), except that a slice reads only what it keeps and
an in-place ``dynamic-update-slice`` touches only its update (also where a fusion's parameter is only
sliced or updated in place: a ``scan`` reading layer i of a stacked weight). Bytes compose less
exactly than FLOPs (the unrolled program fuses across layers, the loop re-reads its carry): on the
tests' programs the estimate is 1.1-1.8× the unrolled program's figure, against 3-6× when each
sliced stack is counted whole. FLOPs agree with the unrolled program within 0.1%.

Only the *difference* (loops beyond their first iteration) comes from this count; the rest is XLA's
figure. It is an estimate: labelled so everywhere it is shown. Unknown trip counts count once
(as XLA does) and are named in ``reason``.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from stagetool.hlo.parser import ArrayShape, HloComputation, HloInstruction, HloModule, array_leaves
from stagetool.hlo.tpu_layout import hlo_shape_bytes

TRANSCENDENTAL = frozenset({"exponential", "exp", "log", "tanh", "sqrt", "rsqrt", "logistic", "erf", "power",
                            "sine", "cosine", "tan", "exponential-minus-one", "log-plus-one", "cbrt", "atan2"})
ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare", "select",
    "and", "or", "xor", "not", "clamp", "remainder", "sign", "floor", "ceil", "round-nearest-afz",
    "round-nearest-even", "shift-left", "shift-right-arithmetic", "shift-right-logical", "is-finite",
    "convert", "popcnt", "count-leading-zeros", "real", "imag", "complex", "stochastic-convert",
    "reduce-precision",
})
_SLICES = frozenset({"dynamic-slice", "slice", "gather"})
_CALLS = frozenset({"fusion", "call", "async-start", "custom-call", "map"})
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
                   "partition-id", "replica-id", "iota"})

METHOD = ("XLA's figure + Σ over while loops of (trip count − 1) × the body's cost counted from the compiled "
          "module's shapes (dot, convolution, element-wise, reduce) with XLA's HloCostAnalysis rules")


@dataclasses.dataclass(frozen=True)
class Counted:
    """FLOPs, transcendentals and bytes accessed of a computation, counted from the module."""

    flops: float = 0.0
    transcendentals: float = 0.0
    bytes_accessed: float = 0.0

    def __add__(self, other: "Counted") -> "Counted":
        return Counted(self.flops + other.flops, self.transcendentals + other.transcendentals,
                       self.bytes_accessed + other.bytes_accessed)

    def __mul__(self, k: float) -> "Counted":
        return Counted(self.flops * k, self.transcendentals * k, self.bytes_accessed * k)


@dataclasses.dataclass(frozen=True)
class LoopAwareCost:
    """The loop-aware estimate of one device's cost (a **derived estimate**, not XLA's figure).

    Attributes:
      flops / transcendentals / bytes_accessed: XLA's per-device figure plus, per ``while`` loop,
        (trip count − 1) × its body's counted cost; None when XLA reported no figure.
      extra_flops: what the loops' further iterations add to XLA's FLOPs (0 without loops).
      loops: ``(while instruction, trip count or None, body FLOPs per iteration)`` in text order.
      method: how it is computed.
      source: ``"derived estimate"``.
      reason: what makes it less than exact (unknown trip counts), or None.
      apart: loops kept out of the estimate (counted once, as XLA does), same form as ``loops``:
        XLA:CPU's rolled random-number loops (:func:`stagetool.analysis.cpu_artefacts.rng_loops`).
      apart_extra_flops: what those loops' further iterations would add (FLOPs), shown apart.
    """

    flops: float | None
    transcendentals: float | None
    bytes_accessed: float | None
    extra_flops: float
    loops: tuple[tuple[str, int | None, float], ...] = ()
    method: str = METHOD
    source: str = "derived estimate"
    reason: str | None = None
    apart: tuple[tuple[str, int | None, float], ...] = ()
    apart_extra_flops: float = 0.0


def _elements(shape) -> int:
    return sum(a.element_count for a in array_leaves(shape))


@functools.lru_cache(maxsize=1 << 14)
def _array_bytes(a: ArrayShape) -> int | None:
    """Bytes of one array as the backend's cost analysis sizes it: with a tiled layout (TPU,
    ``{1,0:T(8,128)}``) the padded bytes of its tiles (:mod:`stagetool.hlo.tpu_layout`: XLA:TPU
    counts an ``f32[3,5]`` on v5e as 2,048 B), else the logical bytes (:attr:`ArrayShape.byte_size`)."""
    logical = a.byte_size
    if logical is None or not a.layout or "T(" not in a.layout:
        return logical
    try:
        return hlo_shape_bytes(f"{a.dtype}[{','.join(map(str, a.dims))}]{{{a.layout}}}").padded_bytes
    except (ValueError, KeyError):  # a layout the tile rule does not read: the logical size
        return logical


def _shape_bytes(shape) -> int | None:
    """:func:`_array_bytes` summed over a shape's arrays; None when the shape is None or a leaf's
    size is unknown."""
    if shape is None:
        return None
    if isinstance(shape, ArrayShape):
        return _array_bytes(shape)
    total = 0
    for a in array_leaves(shape):
        b = _array_bytes(a)
        if b is None:
            return None
        total += b
    return total


def _on_chip_shape_bytes(shape) -> int | None:
    """:func:`_shape_bytes` of a shape's arrays in XLA:TPU's on-chip vector memory (layout ``S(1)``: VMEM)
    alone; 0 for a shape with none."""
    if shape is None:
        return None
    return sum(_array_bytes(a) or 0 for a in array_leaves(shape) if a.layout and "S(1)" in a.layout)


def tiled_shape_bytes(shape) -> int | None:
    """Bytes of a shape's arrays as the backend lays them out: a tiled TPU layout's padded bytes, else the
    logical bytes; None when the shape is None or a leaf's size is unknown (the cost counters' sizes)."""
    return _shape_bytes(shape)


def _first_leaf(shape):
    """A tuple shape's element ``{0}`` (an async copy's destination), the shape itself otherwise."""
    leaves = array_leaves(shape)
    return leaves[0] if leaves and not isinstance(shape, ArrayShape) else shape


def _operand_shape(comp: HloComputation, name: str):
    ins = comp.instruction(name)
    return ins.shape if ins is not None else None


def _ints(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text or ""))


def _dot_flops(comp: HloComputation, ins: HloInstruction) -> float:
    lhs = _operand_shape(comp, ins.operands[0]) if ins.operands else None
    if not isinstance(lhs, ArrayShape):
        return 0.0
    k = 1
    for d in _ints(ins.attributes.get("lhs_contracting_dims")):
        if d < len(lhs.dims):
            k *= lhs.dims[d]
    return 2.0 * _elements(ins.shape) * k


def _window(text: str | None) -> dict[str, list[str]]:
    """``{size=8 stride=7 lhs_dilate=8 pad=0_1x2_2}`` → ``{"size": ["8"], "stride": ["7"], ...}``."""
    out: dict[str, list[str]] = {}
    for key, value in re.findall(r"(\w+)=([\w\-]+)", text or ""):
        out[key] = value.split("x")
    return out


def _valid_positions(kernel: int, output: int, inp: int, stride: int, pad_low: int, lhs_dilate: int,
                     rhs_dilate: int) -> int:
    """How many (output, kernel) index pairs of one spatial dimension read a real (not padded, not
    dilation-hole) input element: XLA's count in ``HloCostAnalysis::GetConvolutionFlops``."""
    import numpy as np

    out_idx = np.arange(output, dtype=np.int64)
    total = 0
    for k in range(kernel):
        undilated = out_idx * stride - pad_low + k * rhs_dilate
        ok = (undilated % lhs_dilate == 0) if lhs_dilate > 1 else np.ones_like(undilated, dtype=bool)
        idx = undilated // lhs_dilate if lhs_dilate > 1 else undilated
        total += int(np.count_nonzero(ok & (idx >= 0) & (idx < inp)))
    return total


def _conv_flops(comp: HloComputation, ins: HloInstruction) -> float:
    """2 × (input features ÷ feature groups) × output features × (batch ÷ batch groups) × the product
    over spatial dimensions of the valid (output, kernel) position pairs, as XLA counts a convolution
    (padding and lhs/rhs dilation holes excluded: TPU compiles batched matmuls into such windows)."""
    lhs = _operand_shape(comp, ins.operands[0]) if ins.operands else None
    rhs = _operand_shape(comp, ins.operands[1]) if len(ins.operands) > 1 else None
    results = array_leaves(ins.shape)
    return _window_flops(ins, lhs, rhs, results[0] if results else None)


CUBLAS_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
"""``custom_call_target`` prefixes of XLA:GPU's cuBLAS/cuBLASLt GEMM calls (``$f8`` variants included)."""
CUDNN_CONV_PREFIX = "__cudnn$conv"
"""``custom_call_target`` prefix of XLA:GPU's cuDNN convolution calls (``convForward``,
``convBiasActivationForward``, ``convBackwardInput``, ``convBackwardFilter``, ``convForwardGraph``)."""


def custom_call_target(ins: HloInstruction) -> str:
    """The ``custom_call_target`` of a custom call, unquoted (``""`` for any other instruction)."""
    return (ins.attributes.get("custom_call_target") or "").strip('"') if ins.opcode == "custom-call" else ""


def is_library_matmul(ins: HloInstruction) -> bool:
    """Whether ``ins`` is a cuBLAS/cuBLASLt GEMM or a cuDNN convolution custom call (XLA:GPU)."""
    target = custom_call_target(ins)
    return target.startswith(CUBLAS_GEMM_TARGETS) or target.startswith(CUDNN_CONV_PREFIX)


def _cudnn_conv_flops(comp: HloComputation, ins: HloInstruction) -> float:
    """FLOPs of a cuDNN convolution custom call: those of the forward convolution its ``window``,
    ``dim_labels`` and ``feature_group_count`` describe (XLA:GPU keeps the forward convolution's
    attributes on all three kinds), with the roles of the operands and the result by kind:
    forward: (input, filter) → output; ``convBackwardInput``: (output gradient, filter) → input
    gradient; ``convBackwardFilter``: (input, output gradient) → filter gradient. The result's first
    leaf is the array (the second is cuDNN's scratch)."""
    target = custom_call_target(ins)
    a = _operand_shape(comp, ins.operands[0]) if ins.operands else None
    b = _operand_shape(comp, ins.operands[1]) if len(ins.operands) > 1 else None
    results = array_leaves(ins.shape)
    r = results[0] if results else None
    if target.endswith("BackwardInput"):
        return _window_flops(ins, r, b, a)
    if target.endswith("BackwardFilter"):
        return _window_flops(ins, a, r, b)
    return _window_flops(ins, a, b, r)


def kernel_cost_estimate(ins: HloInstruction) -> dict | None:
    """The ``CostEstimate`` of a Pallas TPU kernel (``tpu_custom_call``) as its ``backend_config``
    carries it (``custom_call_config.cost_estimate``: ``flops``, ``transcendentals``,
    ``bytes_accessed``; per execution, one device), or None when the kernel was given none."""
    from stagetool.hlo.parser import backend_config_json

    config = backend_config_json(ins) or {}
    call = config.get("custom_call_config")
    est = call.get("cost_estimate") if isinstance(call, dict) else None
    return est if isinstance(est, dict) and est.get("flops") is not None else None


def library_call_flops(comp: HloComputation, ins: HloInstruction) -> float | None:
    """FLOPs of one cuBLAS GEMM or cuDNN convolution custom call (per execution, one device), derived
    from its shapes with XLA's dot/convolution rules; None for any other instruction."""
    target = custom_call_target(ins)
    if target.startswith(CUBLAS_GEMM_TARGETS):
        return _gemm_custom_call_flops(comp, ins)
    if target.startswith(CUDNN_CONV_PREFIX):
        return _cudnn_conv_flops(comp, ins)
    return None


def _window_flops(ins: HloInstruction, lhs, rhs, out) -> float:
    if not (isinstance(lhs, ArrayShape) and isinstance(rhs, ArrayShape) and isinstance(out, ArrayShape)):
        return 0.0
    m = re.match(r"^([^_]+)_([^-]+)->(.+)$", ins.attributes.get("dim_labels", ""))
    if not m or not all(len(lbl) == len(shape.dims) for lbl, shape in zip(m.groups(), (lhs, rhs, out))):
        return 0.0
    lhs_l, rhs_l, out_l = m.groups()
    try:
        batch, in_features = lhs.dims[lhs_l.index("b")], lhs.dims[lhs_l.index("f")]
        out_features = out.dims[out_l.index("f")]
    except ValueError:
        return 0.0
    window = _window(ins.attributes.get("window"))
    spatial = sorted(c for c in lhs_l if c.isdigit())

    def item(key: str, i: int, default: str) -> str:
        values = window.get(key)
        return values[i] if values and i < len(values) else default

    valid = 1
    for i, d in enumerate(spatial):
        try:
            kernel, output, inp = rhs.dims[rhs_l.index(d)], out.dims[out_l.index(d)], lhs.dims[lhs_l.index(d)]
        except ValueError:
            return 0.0
        pad_low = int(item("pad", i, "0_0").split("_")[0])
        valid *= _valid_positions(kernel, output, inp, int(item("stride", i, "1")), pad_low,
                                  int(item("lhs_dilate", i, "1")), int(item("rhs_dilate", i, "1")))
    groups = int(ins.attributes.get("feature_group_count", "1") or 1)
    batch_groups = int(ins.attributes.get("batch_group_count", "1") or 1)
    return 2.0 * (in_features // max(groups, 1)) * out_features * (batch // max(batch_groups, 1)) * valid


def _fft_flops(comp: HloComputation, ins: HloInstruction) -> float:
    """FLOPs of an ``fft`` as XLA's HloCostAnalysis counts them: 8 (2 per FMA × 4 FMAs per complex
    multiply) × the product of log2 of each transform length × the elements of the complex side (the
    result for FFT, IFFT and RFFT's input side is the real operand, IRFFT's the real result)."""
    lengths = _ints(ins.attributes.get("fft_length"))
    log_factors = 1
    for n in lengths:
        log_factors *= max(n.bit_length() - 1, 0)
    kind = (ins.attributes.get("fft_type") or "FFT").upper()
    side = _operand_shape(comp, ins.operands[0]) if kind == "RFFT" and ins.operands else ins.shape
    return 8.0 * log_factors * _elements(side)


def _gemm_custom_call_flops(comp: HloComputation, ins: HloInstruction) -> float:
    """FLOPs of a cuBLAS GEMM custom call (``__cublas$gemm``, ``__cublas$lt$matmul``): 2 × the result's
    elements × the contracted size, from the ``dot_dimension_numbers`` of its backend config, as
    XLA:GPU's cost analysis counts the dot it replaces."""
    from stagetool.hlo.parser import backend_config_json

    config = backend_config_json(ins) or {}
    gemm = config.get("gemm_backend_config", config)
    dims = (gemm or {}).get("dot_dimension_numbers", {}) if isinstance(gemm, dict) else {}
    lhs = _operand_shape(comp, ins.operands[0]) if ins.operands else None
    result = array_leaves(ins.shape)
    if not isinstance(lhs, ArrayShape) or not result:
        return 0.0
    k = 1
    for d in dims.get("lhs_contracting_dimensions", []):
        if int(d) < len(lhs.dims):
            k *= lhs.dims[int(d)]
    return 2.0 * result[0].element_count * k


class _Counter:
    def __init__(self, module: HloModule, trips: dict[str, int | None], loop_aware: bool, on_chip: bool = False):
        self.module, self.trips, self.loop_aware = module, trips, loop_aware
        self.memo: dict[str, Counted] = {}
        # how an operand or result is sized: all of it, or (on_chip) only its arrays in on-chip memory
        self.size = _on_chip_shape_bytes if on_chip else _shape_bytes

    def computation(self, name: str, *, top: bool) -> Counted:
        key = f"{name}/{top}"
        if key not in self.memo:
            comp = self.module.computation(name)
            self.memo[key] = Counted() if comp is None else sum(
                (self.instruction(comp, i, top=top) for i in comp.instructions), Counted())
        return self.memo[key]

    def moved(self, comp: HloComputation, ins: HloInstruction) -> float:
        """Bytes a top-level instruction reads and writes, as XLA counts them: a slice reads only what
        it keeps, an in-place ``dynamic-update-slice`` touches only the update (also inside a fusion
        whose parameter is only sliced or updated in place); arrays by the backend's shape size
        (:func:`_shape_bytes`: a tiled TPU layout's padded bytes), and an async copy's
        ``(destination, source, context)`` tuple by the copied array, once per side (XLA:TPU counts a
        ``copy-start``/``copy-done`` pair as 4 × the array, plus 4,608 B of its own for the pair,
        measured on libtpu of jax 0.10.2; that part is not counted here)."""
        op = ins.opcode
        out = float(self.size(ins.shape) or 0)
        operands = [float(self.size(_operand_shape(comp, o)) or 0) for o in ins.operands]
        if op == "copy-start":
            out = float(self.size(_first_leaf(ins.shape)) or 0)
        elif op == "copy-done" and ins.operands:
            operands = [float(self.size(_first_leaf(_operand_shape(comp, ins.operands[0]))) or 0)]
        if op in _SLICES:
            return 2 * out
        if op == "dynamic-update-slice" and len(operands) > 1:
            return 2 * operands[1] + sum(operands[2:])
        if op == "fusion" and ins.called_computations:
            fused = self.module.computation(ins.called_computations[0].lstrip("%"))
            if fused is not None:
                params = {p.parameter_number: p.name for p in fused.parameters()}
                root = fused.root
                for i in range(len(operands)):
                    name = params.get(i)
                    users = [u for u in fused.instructions if name in u.operands] if name else []
                    if users and all(u.opcode in _SLICES and u.operands[0] == name for u in users):
                        operands[i] = sum(float(self.size(u.shape) or 0) for u in users)
                    elif users and all(u.opcode == "dynamic-update-slice" and u.operands[0] == name for u in users):
                        operands[i] = 0.0
                        upd = [float(self.size(_operand_shape(fused, u.operands[1])) or 0) for u in users]
                        if root is not None and root.opcode == "dynamic-update-slice":
                            out = sum(upd)
        return out + sum(operands)

    def _reducer_flops(self, ins: HloInstruction) -> float:
        names = [c for c in ins.called_computations]
        return sum(self.computation(c, top=False).flops for c in names) or 1.0

    def instruction(self, comp: HloComputation, ins: HloInstruction, *, top: bool) -> Counted:
        op = ins.opcode
        if op in _FREE:
            return Counted()
        moved = self.moved(comp, ins) if top else 0.0
        if op == "while":
            body, cond = (ins.attributes.get("body", ""), ins.attributes.get("condition", ""))
            n = self.trips.get(ins.name)
            k = n if (self.loop_aware and n is not None) else 1
            inner = self.computation(body.lstrip("%"), top=True) + self.computation(cond.lstrip("%"), top=True)
            return inner * k
        if op == "conditional":
            branches = [self.computation(c, top=True) for c in ins.called_computations]
            return max(branches, key=lambda c: c.flops, default=Counted())
        if op == "custom-call" and is_library_matmul(ins):
            return Counted(library_call_flops(comp, ins) or 0.0, 0.0, moved)
        if op == "custom-call" and custom_call_target(ins) == "tpu_custom_call":
            estimate = kernel_cost_estimate(ins)  # what XLA:TPU adds for a Pallas kernel: its author's figures
            return Counted(float(estimate.get("flops") or 0.0), float(estimate.get("transcendentals") or 0.0),
                           moved) if estimate else Counted(0.0, 0.0, moved)
        if op in _CALLS or op.endswith("-start") and ins.called_computations:
            inner = sum((self.computation(c, top=False) for c in ins.called_computations), Counted())
            return Counted(inner.flops, inner.transcendentals, moved if top else 0.0)
        if op == "dot":
            return Counted(_dot_flops(comp, ins), 0.0, moved)
        if op == "convolution":
            return Counted(_conv_flops(comp, ins), 0.0, moved)
        if op == "fft":
            return Counted(_fft_flops(comp, ins), 0.0, moved)
        if op in ("reduce", "all-reduce", "reduce-scatter"):
            ins_in = sum(_elements(_operand_shape(comp, o)) for o in ins.operands[: max(1, len(ins.operands) // 2)])
            out = _elements(ins.shape)
            if op != "reduce":
                return Counted(float(out), 0.0, moved)
            return Counted(max(ins_in - out, 0) * self._reducer_flops(ins), 0.0, moved)
        if op == "reduce-window":
            window = 1
            for d in _ints(re.search(r"size=([\dx]+)", ins.attributes.get("window", "") or "").group(1)
                           if re.search(r"size=([\dx]+)", ins.attributes.get("window", "") or "") else ""):
                window *= d
            return Counted(_elements(ins.shape) * window * self._reducer_flops(ins), 0.0, moved)
        if op in TRANSCENDENTAL:
            return Counted(0.0, float(_elements(ins.shape)), moved)
        if op in ELEMENTWISE:
            return Counted(float(_elements(ins.shape)), 0.0, moved)
        return Counted(0.0, 0.0, moved)


def loop_aware_cost(module: HloModule, trips: dict[str, int | None], *, flops: float | None,
                    transcendentals: float | None, bytes_accessed: float | None) -> LoopAwareCost:
    """The loop-aware estimate from XLA's per-device figures and the compiled module.

    Args:
      module: the parsed compiled (per-device) module.
      trips: trip count per ``while`` instruction name (None: unknown, counted once).
      flops / transcendentals / bytes_accessed: ``Compiled.cost_analysis()``'s figures.
    """
    entry = module.entry
    loops = []
    unknown = []
    for comp in module.computations:
        for ins in comp.instructions:
            if ins.opcode == "while":
                n = trips.get(ins.name)
                body = _Counter(module, trips, True).computation(ins.attributes.get("body", "").lstrip("%"), top=True)
                loops.append((ins.name, n, body.flops))
                if n is None:
                    unknown.append(ins.name)
    if entry is None or not loops:
        return LoopAwareCost(flops, transcendentals, bytes_accessed, 0.0, tuple(loops),
                             reason=None if entry is not None else "no entry computation in the module")
    once = _Counter(module, trips, False).computation(entry.name, top=True)
    aware = _Counter(module, trips, True).computation(entry.name, top=True)

    def plus(xla: float | None, extra: float) -> float | None:
        return None if xla is None else xla + max(extra, 0.0)

    extra = aware.flops - once.flops
    return LoopAwareCost(plus(flops, extra), plus(transcendentals, aware.transcendentals - once.transcendentals),
                         plus(bytes_accessed, aware.bytes_accessed - once.bytes_accessed), max(extra, 0.0),
                         tuple(loops),
                         reason=("trip count unknown for " + ", ".join(unknown) + ": counted once, as XLA does")
                         if unknown else None)


def on_chip_bytes(module: HloModule, trips: dict[str, int | None]) -> float:
    """Bytes of one step (every loop body × its trip count; unknown counts once) that XLA's rules count
    for arrays in XLA:TPU's on-chip vector memory (layout ``S(1)``: VMEM), which move no HBM bytes: of a
    cross-program prefetch's ``copy-start``/``copy-done`` pair of an ``N``-byte array (4 × N) 3 × N are
    on chip (its read from HBM is not), and a kernel reading the prefetched array reads VMEM. 0 for a
    module with no such array (every CPU and GPU module). The roofline's memory term leaves these bytes
    out of XLA's bytes accessed (:func:`stagetool.analysis.sections.cost_section`)."""
    entry = module.entry
    if entry is None:
        return 0.0
    return _Counter(module, trips, True, on_chip=True).computation(entry.name, top=True).bytes_accessed


def counted_cost(module: HloModule) -> Counted:
    """The module's cost counted here with every loop body once (as XLA counts): for checking the
    counter against ``Compiled.cost_analysis()`` on programs without loops."""
    entry = module.entry
    return Counted() if entry is None else _Counter(module, {}, False).computation(entry.name, top=True)


def counted_cost_per_step(module: HloModule, trips: dict[str, int | None]) -> Counted:
    """FLOPs, transcendentals and bytes of the whole module per step, every loop body × its trip
    count (``trips``: ``{while name: trip count}``; unknown counts once), with the rules above."""
    entry = module.entry
    return Counted() if entry is None else _Counter(module, trips, True).computation(entry.name, top=True)


def dot_flops_lower_bound(module: HloModule) -> float:
    """FLOPs of the module's ``dot`` and ``convolution`` instructions alone, every computation once
    (as XLA counts): a floor under any FLOP count XLA reports for the same module."""
    entry = module.entry
    if entry is None:
        return 0.0
    counter = _Counter(module, {}, False)
    seen: set[str] = set()
    total = 0.0
    stack = [entry.name]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        comp = module.computation(name)
        if comp is None:
            continue
        for ins in comp.instructions:
            if ins.opcode == "dot":
                total += _dot_flops(comp, ins)
            elif ins.opcode == "convolution":
                total += _conv_flops(comp, ins)
            elif is_library_matmul(ins):
                total += library_call_flops(comp, ins) or 0.0
            stack.extend(c.lstrip("%") for c in ins.called_computations)
    del counter
    return total


def instruction_cost(module: HloModule, comp: HloComputation, ins: HloInstruction) -> Counted:
    """FLOPs, transcendentals and bytes accessed of one top-level instruction of a scheduled
    computation (a fusion counts what it computes inside and what it reads and writes), with XLA's
    HloCostAnalysis rules as above; a ``while``/``conditional``/``call`` counts its callees (every
    loop body once). Per device, per execution."""
    return _Counter(module, {}, False).instruction(comp, ins, top=True)


def matmul_dtype(module: HloModule, comp: HloComputation, ins: HloInstruction) -> str | None:
    """The element type of the left operand of the first ``dot``/``convolution`` an instruction
    runs (itself, or inside the fusion it calls), e.g. ``bf16``; None when it runs none."""
    stack = [(comp, ins)]
    seen: set[str] = set()
    while stack:
        c, i = stack.pop()
        if i.opcode in ("dot", "convolution") or is_library_matmul(i):
            lhs = _operand_shape(c, i.operands[0]) if i.operands else None
            return lhs.dtype if isinstance(lhs, ArrayShape) else None
        for name in i.called_computations:
            name = name.lstrip("%")
            callee = module.computation(name)
            if callee is not None and name not in seen:
                seen.add(name)
                stack.extend((callee, x) for x in reversed(callee.instructions))
    return None
