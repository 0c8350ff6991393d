"""``stagetool calibrate``: micro-benchmarks of the attached accelerator, and the chip profile (a
spec's ``chips:`` entry, YAML) made from them.

Each benchmark is one jitted program on arrays already on the device, timed by
:func:`stagetool.measure.timing.time_calls` (warm-up, then the median of ``repeats`` samples); its
rate is ``work / median seconds``, MEASURED on the attached chip (one device):

========================  =========================================================================
profile key               benchmark (work counted)
========================  =========================================================================
matmul_flops_per_second   square matmuls, 2·n³ FLOPs: ``bf16`` (bf16 × bf16 → f32 accumulate),
                          ``f32`` (Precision.DEFAULT, what XLA really compiles), ``f32_highest``
                          (Precision.HIGHEST), ``int8`` (s8 × s8 → s32)
hbm_copy_bytes_per_second a copy of a large f32 array: bytes read + written
elementwise_bytes_...     ``x * 1.5 + y`` over large f32 arrays (one fusion): bytes read + written
reduction_bytes_...       row sums of a large f32 matrix: bytes read
transcendentals_...       a fused chain of ``tanh`` over an f32 array: elements × chain length
gather_bytes_...          a row gather (random row ids) from a large f32 table: bytes read + written
scatter_bytes_...         a scatter-add of rows into a donated f32 table: update bytes read, table
                          rows read and written (3 × the updates' bytes)
kernel_overhead_seconds   chains of small dependent ``tanh(x @ w)`` fusions of two lengths: the
                          difference in time over the difference in kernels
collective_latency_...    (several devices only) an all-reduce of 8 floats per device
========================  =========================================================================

Shape classes beside the profile's figures (a 32-row matmul, medium squares, the host's dispatch
cost) are in the JSON and as comments of the YAML.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
from typing import Any, Callable

from stagetool.core.errors import SpecError, UsageError
from stagetool.measure.timing import Timing, time_calls

#: the array sizes of the benchmarks: ``full`` on an accelerator; ``tiny`` for tests on the CPU
SIZES: dict[str, dict[str, int]] = {
    "full": {"mm": 8192, "mm_mid": 4096, "mm_small": 1024, "mm_rows": 32, "hi": 4096, "vec": 64 * 2**20,
             "rows": 16384, "cols": 8192, "chain": 32, "table": 262144, "width": 512, "lookups": 131072,
             "kern": 256, "k_short": 64, "k_long": 512, "coll": 16 * 2**20,
             "img": 32, "hw": 56, "ch": 256, "bmm": 8192, "bmm_n": 64, "ops": 32, "fft_b": 16, "fft_n": 1024,
             "cache": 512 * 2**20, "slice": 16 * 2**20, "sort": 4096, "cum": 8192,
             "seg": 4096, "vmem_b": 32, "vmem_v": 1024, "vmem_n": 4096, "gan_b": 2048, "gan_ch": 512},
    "tiny": {"mm": 128, "mm_mid": 64, "mm_small": 32, "mm_rows": 8, "hi": 64, "vec": 4096, "rows": 64,
             "cols": 128, "chain": 4, "table": 512, "width": 16, "lookups": 256, "kern": 16, "k_short": 2,
             "k_long": 6, "coll": 1024,
             "img": 2, "hw": 8, "ch": 16, "bmm": 16, "bmm_n": 8, "ops": 4, "fft_b": 2, "fft_n": 16,
             "cache": 2**16, "slice": 2**13, "sort": 64, "cum": 64,
             "seg": 16, "vmem_b": 2, "vmem_v": 64, "vmem_n": 256, "gan_b": 4, "gan_ch": 32},
}
# the sizes of the coverage benchmarks (issue 46's kernel classes no earlier benchmark measured: element ops of
# their own cost, pooling windows, dilated and 1-D convolutions, small HIGHEST products, interleaving pads, top-k,
# loop iterations, linear-algebra custom calls)
SIZES["full"].update({"op_n": 8 * 2**20, "op_chain": 16, "pool_img": 32, "pool_hw": 112, "pool_ch": 64,
                      "conv1d_len": 4096, "bmm_hi": 4096, "pad_rows": 4096, "pad_cols": 4096, "topk_rows": 1024,
                      "topk_n": 32768, "loop": 4096, "la_64": 4096, "la_128": 512})
SIZES["tiny"].update({"op_n": 1024, "op_chain": 2, "pool_img": 2, "pool_hw": 8, "pool_ch": 8, "conv1d_len": 32,
                      "bmm_hi": 8, "pad_rows": 16, "pad_cols": 128, "topk_rows": 4, "topk_n": 256, "loop": 4,
                      "la_64": 2, "la_128": 2})
#: the matrix unit's tile the batched-matmul benchmark's FLOPs are padded to (TPU v4/v5e/v5p: 128 × 128 MXUs), as the
#: step-time model pads them (:func:`stagetool.analysis.kernel_time.padded_matmul_flops`)
_MXU_TILE = 128
#: row widths (bytes) of the gathers measured beside the 2 KiB one of ``gather_bytes_per_second``
GATHER_ROW_BYTES = (128, 512, 32768)


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    """One micro-benchmark's measurement.

    Attributes:
      name: ``matmul_bf16``, ``hbm_copy``, ...
      key: the profile key its rate feeds (``matmul_flops_per_second.bf16``), or None (a shape class
        recorded beside the profile).
      shape: what ran, as text (``bf16[8192,8192] @ bf16[8192,8192]``).
      work: the work of one call, in ``unit`` (FLOPs, bytes, elements, kernels).
      unit: ``FLOP``, ``byte``, ``element`` or ``second`` (a fixed cost: ``rate`` is then seconds).
      timing: the measured seconds per call.
      rate: ``work / (timing.median_seconds - others_seconds)`` (per second), or for unit ``second`` the fixed
        cost itself (seconds).
      others_seconds: the step-time model's time (an estimate, at the chip table's rates) of the benchmark's
        kernels outside its class (the layout copies around a cumsum, which the model times as copies beside
        the class's kernel: left in, they were counted twice), taken off the median before the rate; 0.0 where
        none or the chip table does not know the device.
    """

    name: str
    key: str | None
    shape: str
    work: float
    unit: str
    timing: Timing
    rate: float
    others_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "shape": self.shape, "work": self.work, "unit": self.unit,
                "rate": self.rate, "others_seconds": self.others_seconds, "timing": self.timing.to_json()}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What ``stagetool calibrate`` measured on the attached devices.

    Attributes:
      chip: the profile's name (``tpu-v5e``).
      device_kind / platform / devices: ``jax.devices()[0].device_kind``, its platform, how many.
      versions: ``{"jax": ..., "jaxlib": ..., "libtpu": ...}`` (None where not installed).
      date: ISO date (UTC) of the run.
      command: the command line that ran it.
      results: every benchmark, in the order run.
      notes: what was not measured and why.
    """

    chip: str
    device_kind: str
    platform: str
    devices: int
    versions: dict[str, str | None]
    date: str
    command: str
    results: tuple[BenchmarkResult, ...]
    notes: tuple[str, ...] = ()

    def figures(self) -> dict[str, Any]:
        """The profile's keys → measured values (nested for ``matmul_flops_per_second``)."""
        out: dict[str, Any] = {}
        for r in self.results:
            if r.key is None:
                continue
            head, _, sub = r.key.partition(".")
            if sub:
                out.setdefault(head, {})[sub] = r.rate
            else:
                out[head] = r.rate
        return out

    def to_json(self) -> dict[str, Any]:
        return {"chip": self.chip, "device_kind": self.device_kind, "platform": self.platform,
                "devices": self.devices, "versions": self.versions, "date": self.date, "command": self.command,
                "figures": self.figures(), "benchmarks": [r.to_json() for r in self.results],
                "notes": list(self.notes)}


def versions() -> dict[str, str | None]:
    """The installed jax, jaxlib and libtpu versions (None where a distribution is not installed)."""
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for name in ("jax", "jaxlib", "libtpu"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    if out["libtpu"] is None:
        try:
            out["libtpu"] = md.version("libtpu-nightly")
        except md.PackageNotFoundError:
            pass
    return out


def _rand(key: int, shape: tuple[int, ...], dtype: Any) -> Any:
    import jax
    import jax.numpy as jnp

    k = jax.random.key(key)
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.random.randint(k, shape, -100, 100, jnp.int32).astype(dtype)
    return jax.random.normal(k, shape, jnp.float32).astype(dtype)


def _matmul(name: str, key: str | None, m: int, k: int, n: int, dtype: str, precision: Any = None,
            out: str | None = None) -> Callable[[Callable[..., Timing]], BenchmarkResult]:
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)

    def run(timer: Callable[..., Timing]) -> BenchmarkResult:
        a, b = _rand(1, (m, k), dt), _rand(2, (k, n), dt)
        pref = jnp.dtype(out) if out else None
        f = jax.jit(lambda a, b: jax.lax.dot(a, b, precision=precision, preferred_element_type=pref))
        t = timer(lambda: f(a, b))
        flops = 2.0 * m * k * n
        p = f" precision={precision}" if precision is not None else ""
        return BenchmarkResult(name, key, f"{dt.name}[{m},{k}] @ {dt.name}[{k},{n}]{p}", flops, "FLOP", t,
                               flops / t.median_seconds)
    run.benchmark_name = name  # type: ignore[attr-defined]
    return run


def _bandwidth(name: str, key: str, build: Callable[[], tuple[Callable[[], Any], float, str]]
               ) -> Callable[[Callable[..., Timing]], BenchmarkResult]:
    def run(timer: Callable[..., Timing]) -> BenchmarkResult:
        call, work, shape = build()
        t = timer(call)
        return BenchmarkResult(name, key, shape, work, "byte" if key != "transcendentals_per_second" else "element",
                               t, work / t.median_seconds)
    run.benchmark_name = name  # type: ignore[attr-defined]
    return run


def benchmarks(sizes: dict[str, int], devices: int = 1) -> list[Callable[[Callable[..., Timing]], BenchmarkResult]]:
    """The benchmarks to run, in order (each a function of the timer that returns its result)."""
    import jax
    import jax.numpy as jnp

    s = sizes
    hi = jax.lax.Precision.HIGHEST
    out: list[Callable[[Callable[..., Timing]], BenchmarkResult]] = [
        _matmul("matmul_bf16", "matmul_flops_per_second.bf16", s["mm"], s["mm"], s["mm"], "bfloat16"),
        _matmul("matmul_f32", "matmul_flops_per_second.f32", s["mm"], s["mm"], s["mm"], "float32"),
        _matmul("matmul_f32_highest", "matmul_flops_per_second.f32_highest", s["hi"], s["hi"], s["hi"], "float32", hi),
        _matmul("matmul_int8", "matmul_flops_per_second.int8", s["mm"], s["mm"], s["mm"], "int8", out="int32"),
        _matmul("matmul_bf16_medium", None, s["mm_mid"], s["mm_mid"], s["mm_mid"], "bfloat16"),
        _matmul("matmul_bf16_small", None, s["mm_small"], s["mm_small"], s["mm_small"], "bfloat16"),
        _matmul("matmul_bf16_rows", None, s["mm_rows"], s["mm"], s["mm"], "bfloat16"),
    ]

    def copy():
        x = _rand(3, (s["vec"],), jnp.float32)
        f = jax.jit(lambda x: jnp.copy(x))
        return (lambda: f(x)), 2.0 * x.nbytes, f"copy f32[{s['vec']}]"

    def elementwise():
        x, y = _rand(4, (s["vec"],), jnp.float32), _rand(5, (s["vec"],), jnp.float32)
        f = jax.jit(lambda x, y: x * 1.5 + y)
        return (lambda: f(x, y)), 3.0 * x.nbytes, f"x * 1.5 + y over f32[{s['vec']}]"

    def reduction():
        x = _rand(6, (s["rows"], s["cols"]), jnp.float32)
        f = jax.jit(lambda x: x.sum(-1))
        return (lambda: f(x)), float(x.nbytes), f"row sums of f32[{s['rows']},{s['cols']}]"

    def transcendental():
        x = _rand(7, (s["vec"] // 2,), jnp.float32)

        def chain(x):
            for _ in range(s["chain"]):
                x = jnp.tanh(x) * 1.01
            return x
        f = jax.jit(chain)
        return (lambda: f(x)), float(s["chain"] * x.size), f"{s['chain']} chained tanh over f32[{x.size}]"

    def gather():
        table = _rand(8, (s["table"], s["width"]), jnp.float32)
        ids = jax.random.randint(jax.random.key(9), (s["lookups"],), 0, s["table"], jnp.int32)
        f = jax.jit(lambda t, i: t[i])
        return (lambda: f(table, ids)), 2.0 * s["lookups"] * s["width"] * 4, \
            f"rows f32[{s['table']},{s['width']}][i32[{s['lookups']}]]"

    def scatter():
        state = [_rand(10, (s["table"], s["width"]), jnp.float32)]
        ids = jax.random.randint(jax.random.key(11), (s["lookups"],), 0, s["table"], jnp.int32)
        upd = _rand(12, (s["lookups"], s["width"]), jnp.float32)
        f = jax.jit(lambda t, i, u: t.at[i].add(u), donate_argnums=0)

        def call():
            state[0] = f(state[0], ids, upd)
            return state[0]
        return call, 3.0 * upd.nbytes, f"f32[{s['table']},{s['width']}].at[i32[{s['lookups']}]].add (donated)"

    out += [_bandwidth("hbm_copy", "hbm_copy_bytes_per_second", copy),
            _bandwidth("elementwise", "elementwise_bytes_per_second", elementwise),
            _bandwidth("reduction", "reduction_bytes_per_second", reduction),
            _bandwidth("transcendental", "transcendentals_per_second", transcendental),
            _bandwidth("gather", "gather_bytes_per_second", gather),
            _bandwidth("scatter_add", "scatter_bytes_per_second", scatter),
            *_class_benchmarks(s), *_coverage_benchmarks(s), _kernel_overhead(s), _dispatch()]
    if devices > 1:
        out.append(_all_reduce(s, devices))
    return out


def _xla_flops(compiled: Any) -> float:
    """XLA's FLOPs of a ``jax.stages.Compiled`` (``Compiled.cost_analysis()``): the work a class rate
    measured with it is counted in, as the step-time model counts each kernel's."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return float((ca or {}).get("flops", 0.0))


def others_seconds(compiled_text: str, own: tuple[str, ...], device_kind: str) -> float:
    """The step-time model's time (seconds, an estimate) of a benchmark's kernels whose class does not start
    with one of ``own`` (``("cumulative",)``): what the compiled module runs beside the class's own kernel
    (layout copies, the broadcast that adds a cumsum's row blocks), at the chip table's figures for
    ``device_kind``. 0.0 for a device the table does not know (the CPU) or a module that does not parse."""
    from stagetool.analysis.step_time import step_time
    from stagetool.core.chips import CHIPS, chip_for_device_kind
    from stagetool.facts import Interconnect
    from stagetool.hlo.collectives import while_loops
    from stagetool.hlo.parser import parse_hlo_module

    name = chip_for_device_kind(device_kind)
    chip = CHIPS.get(name) if name else None
    if chip is None or not chip.is_tpu:
        return 0.0
    try:
        module = parse_hlo_module(compiled_text)
    except Exception:  # noqa: BLE001 - no module: nothing taken off
        return 0.0
    est = step_time(module, chip, Interconnect("tpu", (), ()), (), dict(while_loops(module)), top=1 << 30)
    return sum(i.total_seconds for i in est.top if not (i.kind or "").startswith(own))


def scatter_update_bytes(compiled_text: str) -> float:
    """The update operands' bytes of every ``scatter`` in a compiled module (fusions' included), each counted once
    per instruction: the work ``class_rates.scatter_add_upsample`` is in (the model times a scatter of whole
    windows on the same bytes). 0.0 where the module does not parse or has no scatter."""
    from stagetool.hlo.parser import parse_hlo_module, shape_bytes

    try:
        module = parse_hlo_module(compiled_text)
    except Exception:  # noqa: BLE001 - no module: no figure (the caller falls back to the gradient's bytes)
        return 0.0
    total = 0.0
    for comp in module.computations:
        for ins in comp.instructions:
            if ins.opcode == "scatter" and len(ins.operands) >= 3:
                n = len(ins.operands) // 2  # (operands..., indices, updates...)
                for name in ins.operands[n + 1:]:
                    src = comp.instruction(name)
                    total += float(shape_bytes(src.shape) or 0) if src is not None else 0.0
    return total


def _program(name: str, key: str | None, unit: str, build: Callable[[], tuple[Callable[[], Any], float, str]],
             own: tuple[str, ...] = ()) -> Callable[[Callable[..., Timing]], BenchmarkResult]:
    """A benchmark of one class: ``build()`` gives ``(call, work per call, what ran)``, and with ``own`` (the
    class's kernel kinds) a fourth item, the compiled module's text: the model's time of its other kernels
    (:func:`others_seconds`, at most 90% of the median: the v5e's cumsum spends 68% of its time in layout copies)
    is taken off the median before the rate."""
    def run(timer: Callable[..., Timing]) -> BenchmarkResult:
        call, work, shape, *text = build()
        t = timer(call)
        others = 0.0
        if own and text:
            import jax

            others = min(others_seconds(text[0], own, jax.devices()[0].device_kind), 0.9 * t.median_seconds)
        return BenchmarkResult(name, key, shape, work, unit, t, work / (t.median_seconds - others), others)
    run.benchmark_name = name  # type: ignore[attr-defined]
    return run


def _batched_products(b: int, m: int, dtype: str, precision: str | None, seeds: tuple[int, int]):
    """A benchmark build of ``b`` products of ``dtype[m, m] @ dtype[m, m]`` (``jnp.einsum``, at ``precision``, a
    ``jax.lax.Precision`` name, or the default): its work the FLOPs with M, K and N padded up to the matrix unit's tile
    (one weight tile a product, as the step-time model pads them), 2 × b × p³. The program is compiled once and
    that executable timed."""
    import jax
    import jax.numpy as jnp

    dt = {"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype]
    a, c = _rand(seeds[0], (b, m, m), dt), _rand(seeds[1], (b, m, m), dt)
    prec = getattr(jax.lax.Precision, precision) if precision else None
    compiled = jax.jit(lambda a, c: jnp.einsum("bij,bjk->bik", a, c, precision=prec)).lower(a, c).compile()
    p = -(-m // _MXU_TILE) * _MXU_TILE
    at = f" at {precision}" if precision else ""
    return (lambda: compiled(a, c)), 2.0 * b * p ** 3, (f"{b} products of {dtype}[{m},{m}] @ {dtype}[{m},{m}]{at}: "
                                                        f"FLOPs padded to the {_MXU_TILE} tile, 2 x {b} x {p}^3"), \
        compiled.as_text()


def _class_benchmarks(s: dict[str, int]) -> list[Callable[[Callable[..., Timing]], BenchmarkResult]]:
    """The kernel classes beyond matmuls and plain element-wise work (issue 46): convolutions of each form
    and their gradients, batched small matmuls, vector-unit work (integer ops, random bits), FFT, in-place
    updates of donated buffers, gathers of several row widths, sort and cumulative ops. Each rate is the
    work XLA counts (its FLOPs, or the bytes, elements or comparisons said) over the median time, less (for the
    convolutions, the batched matmul, the FFT and the cumsum) the step-time model's time of the program's
    other kernels, its layout copies (:func:`others_seconds`)."""
    import jax
    import jax.numpy as jnp

    n, hw, ch = s["img"], s["hw"], s["ch"]
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(kind: str):
        def build():
            x = _rand(20, (n, hw, hw, ch), jnp.bfloat16)
            if kind == "dense":
                w, f = _rand(21, (3, 3, ch, ch), jnp.bfloat16), lambda x, w: jax.lax.conv_general_dilated(
                    x, w, (1, 1), "SAME", dimension_numbers=dn)
            elif kind == "depthwise":
                w, f = _rand(21, (7, 7, 1, ch), jnp.bfloat16), lambda x, w: jax.lax.conv_general_dilated(
                    x, w, (1, 1), "SAME", dimension_numbers=dn, feature_group_count=ch)
            elif kind == "grouped":
                w, f = _rand(21, (3, 3, 8, ch), jnp.bfloat16), lambda x, w: jax.lax.conv_general_dilated(
                    x, w, (1, 1), "SAME", dimension_numbers=dn, feature_group_count=ch // 8)
            elif kind == "strided":
                x = _rand(20, (n, 2 * hw, 2 * hw, ch // 2), jnp.bfloat16)
                w, f = _rand(21, (3, 3, ch // 2, ch), jnp.bfloat16), lambda x, w: jax.lax.conv_general_dilated(
                    x, w, (2, 2), "SAME", dimension_numbers=dn)
            elif kind == "transposed":
                w, f = _rand(21, (4, 4, ch, ch // 2), jnp.bfloat16), lambda x, w: jax.lax.conv_transpose(
                    x, w, (2, 2), "SAME", dimension_numbers=dn)
            else:  # gradients of the dense 3 x 3 convolution
                w = _rand(21, (3, 3, ch, ch), jnp.bfloat16)
                fwd = lambda x, w: jnp.sum(jax.lax.conv_general_dilated(
                    x, w, (1, 1), "SAME", dimension_numbers=dn).astype(jnp.float32) ** 2)
                f = (lambda x, w: jax.grad(fwd, 0)(x, w)) if kind == "input_gradient" else \
                    (lambda x, w: jax.grad(fwd, 1)(x, w))
            jf = jax.jit(f)
            compiled = jf.lower(x, w).compile()
            return (lambda: jf(x, w)), _xla_flops(compiled), (f"{kind} convolution bf16{list(x.shape)} * "
                                                              f"{list(w.shape)}"), compiled.as_text()
        return _program(f"conv_{kind}", f"class_rates.conv_{kind}", "FLOP", build, own=("convolution", "matmul"))

    def batched():
        return _batched_products(s["bmm"], s["bmm_n"], "bf16", None, (22, 23))

    def int_ops():
        x = jax.random.bits(jax.random.key(24), (s["vec"] // 2,), jnp.uint32)

        rounds = max(s["ops"] // 5, 1)

        def chain(x):
            for i in range(rounds):
                x = (x ^ (x >> 13)) * jnp.uint32(0x9E3779B1 + i) + (x << 3)
            return x
        f = jax.jit(chain)
        return (lambda: f(x)), float(x.size * 5 * rounds), (
            f"{5 * rounds} chained u32 ops (shift, xor, multiply, shift, add) over u32[{x.size}]: elements x ops")

    def rng():
        k = jax.random.key(25)
        f = jax.jit(lambda k: jax.random.bits(k, (s["vec"] // 2,), jnp.uint32))
        return (lambda: f(k)), float(s["vec"] // 2), f"threefry random bits u32[{s['vec'] // 2}]"

    def fft():
        x = (_rand(26, (s["fft_b"], s["fft_n"], s["fft_n"]), jnp.float32)
             + 1j * _rand(27, (s["fft_b"], s["fft_n"], s["fft_n"]), jnp.float32)).astype(jnp.complex64)
        f = jax.jit(jnp.fft.fft2)
        compiled = f.lower(x).compile()
        return (lambda: f(x)), _xla_flops(compiled), f"fft2 of complex64[{s['fft_b']},{s['fft_n']},{s['fft_n']}]", \
            compiled.as_text()

    def dus():
        rows = s["cache"] // (4 * 1024)
        state = [_rand(28, (rows, 1024), jnp.float32)]
        upd = _rand(29, (s["slice"] // (4 * 1024), 1024), jnp.float32)
        f = jax.jit(lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u, i, 0), donate_argnums=0)

        def call():
            state[0] = f(state[0], upd, 7)
            return state[0]
        return call, 2.0 * upd.nbytes, (f"dynamic_update_slice of f32{list(upd.shape)} into a donated "
                                        f"f32{list(state[0].shape)}: the slice read and written")

    def gather(row_bytes: int):
        def build():
            width = max(row_bytes // 2, 1)
            rows = max(s["table"] * s["width"] * 4 // row_bytes // 2, 8)
            table = _rand(30, (rows, width), jnp.bfloat16)
            count = min(rows, max(s["lookups"] * s["width"] * 4 // row_bytes, 8))
            ids = jax.random.randint(jax.random.key(31), (count,), 0, rows, jnp.int32)
            f = jax.jit(lambda t, i: t[i])
            return (lambda: f(table, ids)), 2.0 * count * width * 2, f"rows bf16[{rows},{width}][i32[{count}]]"
        return _program(f"gather_{row_bytes}B", f"class_rates.gather_{row_bytes}", "byte", build)

    def scatter_set():
        # rows SET (not added) at random, unsorted ids into a donated bf16 table: XLA:TPU sorts no indices for a
        # set, and the suite's scatter of 512-byte bf16 rows ran at 81 ns a row against the 2 KiB f32 scatter-add's
        # 32 ns (issue 46): rows a second, the rate of one such row
        rows = s["table"] * 2
        state = [_rand(34, (rows, 256), jnp.bfloat16)]
        count = s["lookups"] // 2
        ids = jax.random.randint(jax.random.key(35), (count,), 0, rows, jnp.int32)
        upd = _rand(36, (count, 256), jnp.bfloat16)
        f = jax.jit(lambda t, i, u: t.at[i].set(u), donate_argnums=0)

        def call():
            state[0] = f(state[0], ids, upd)
            return state[0]
        return call, float(count), f"bf16[{rows},256].at[i32[{count}]].set (donated, 512-byte rows): rows"

    def sort():
        from stagetool.analysis.kernel_time import sort_stages

        x = _rand(32, (s["sort"], s["sort"]), jnp.float32)
        f = jax.jit(lambda x: jnp.sort(x, axis=-1))
        return (lambda: f(x)), sort_stages(x.size, s["sort"]), (
            f"jnp.sort of f32[{s['sort']},{s['sort']}] along rows: elements x log2(n)(log2(n)+1)/2 comparator stages")

    def cumulative():
        x = _rand(33, (s["cum"], s["cum"]), jnp.float32)
        f = jax.jit(lambda x: jnp.cumsum(x, axis=-1))
        return (lambda: f(x)), 2.0 * x.nbytes, (f"jnp.cumsum of f32[{s['cum']},{s['cum']}] along rows: bytes read + "
                                                f"written"), f.lower(x).compile().as_text()

    return [*(conv(k) for k in ("dense", "depthwise", "grouped", "strided", "transposed", "input_gradient",
                                "weight_gradient")),
            _program("batched_matmul", "class_rates.batched_matmul", "FLOP", batched, own=("convolution", "matmul")),
            _program("vector_int_ops", "class_rates.vector_ops", "element", int_ops),
            _program("random_bits", "class_rates.random_bits", "element", rng),
            _program("fft", "class_rates.fft", "FLOP", fft, own=("FFT",)),
            _program("dynamic_update_slice", "class_rates.dynamic_update_slice", "byte", dus),
            _program("scatter_set", "class_rates.scatter_set_rows", "element", scatter_set),
            *(gather(b) for b in GATHER_ROW_BYTES),
            _program("sort", "class_rates.sort", "element", sort),
            _program("cumulative", "class_rates.cumulative", "byte", cumulative, own=("cumulative",)),
            *_scatter_conv_benchmarks(s)]

#: row widths (bytes) of the scatter-adds measured at unique regular ids and as segment sums (held-back round 2)
SCATTER_ROW_BYTES = (4, 512, 2048)


def _scatter_conv_benchmarks(s: dict[str, int]) -> list[Callable[[Callable[..., Timing]], BenchmarkResult]]:
    """The classes held-back round 2 showed the model had no measurement for (issue 46,
    ``validation_tpu_v5e_heldback2_notes.md``), each its own program, its rate its work over the median less the
    step-time model's time of the program's other kernels (:func:`others_seconds`):

    - ``scatter_add_unique_{4,512,2048}B``: rows of 4 B / 512 B / 2 KiB (f32) added at unique, regular ids
      (every other row, ids from an iota in the program) into a donated table: rows a second;
    - ``scatter_add_segment_{4,512,2048}B``: ``jax.ops.segment_sum`` of rows at random ids into few segments
      (many rows to one target, k-means' cluster sums): rows a second;
    - ``scatter_add_upsample``: the gradient of ``jax.image.resize(..., "nearest")`` × 2 (a scatter-add of whole
      windows at regular ids, the VAE decoder's): its scatters' update bytes a second (:func:`scatter_update_bytes`);
    - ``gather_scalar_vmem`` / ``scatter_add_scalar_vmem``: ``take_along_axis`` of single f32 elements from a
      4 MiB table (which XLA:TPU can keep in VMEM) and its gradient (a scalar scatter-add): elements a second;
    - ``conv_strided_4x4`` (a key: a strided convolution whose window is a multiple of its stride, 4 × 4 stride 2
      at 16 px, 128 -> 256 features, a DCGAN discriminator's), with a shape ladder beside it (no key, in the JSON
      and the profile's comments): 4 × 4 stride-2 transposed convolutions of a DCGAN generator (4 to 32 px, 512
      to 64 features, the last to 3), a 3 × 3 stride-2 transposed one, the discriminator's first layer (from 3
      features), a 3 × 3 stride-2 one at 32 px, 3 × 3 stride-1 ones at 64 and 3 output features (128 px): XLA's
      FLOPs a second.
    """
    import jax
    import jax.numpy as jnp

    count = s["lookups"]

    def scatter_unique(row_bytes: int):
        def build():
            width = max(row_bytes // 4, 1)
            state = [_rand(40, (2 * count, width), jnp.float32)]
            upd = _rand(41, (count, width), jnp.float32)
            jf = jax.jit(lambda t, u: t.at[jnp.arange(count, dtype=jnp.int32) * 2].add(u), donate_argnums=0)
            compiled = jf.lower(state[0], upd).compile()

            def call():
                state[0] = compiled(state[0], upd)
                return state[0]
            return call, float(count), (f"f32[{2 * count},{width}].at[2 * iota(i32[{count}])].add (donated; unique, "
                                        f"regular ids; {4 * width}-byte rows): rows"), compiled.as_text()
        return _program(f"scatter_add_unique_{row_bytes}B", f"class_rates.scatter_add_unique_{row_bytes}", "element",
                        build, own=("scatter",))

    def scatter_segment(row_bytes: int):
        def build():
            width = max(row_bytes // 4, 1)
            upd = _rand(42, (count, width), jnp.float32)
            ids = jax.random.randint(jax.random.key(43), (count,), 0, s["seg"], jnp.int32)
            jf = jax.jit(lambda u, i: jax.ops.segment_sum(u, i, s["seg"]))
            compiled = jf.lower(upd, ids).compile()
            return (lambda: compiled(upd, ids)), float(count), (
                f"segment_sum of f32[{count},{width}] at random ids into {s['seg']} segments ({4 * width}-byte "
                "rows): rows"), compiled.as_text()
        return _program(f"scatter_add_segment_{row_bytes}B", f"class_rates.scatter_add_segment_{row_bytes}",
                        "element", build, own=("scatter",))

    def upsample():
        b, h, c = s["img"], s["hw"] // 2, s["ch"]
        y = _rand(44, (b, h, h, c), jnp.bfloat16)
        g = _rand(45, (b, 2 * h, 2 * h, c), jnp.bfloat16)
        jf = jax.jit(lambda y, g: jax.vjp(lambda y: jax.image.resize(y, (b, 2 * h, 2 * h, c), "nearest"), y)[1](g)[0])
        compiled = jf.lower(y, g).compile()
        text = compiled.as_text()
        work = scatter_update_bytes(text) or float(g.nbytes)
        return (lambda: compiled(y, g)), work, (
            f"the gradient of jax.image.resize(bf16[{b},{h},{h},{c}], x2, 'nearest') of bf16{list(g.shape)}: the "
            f"update bytes of its scatters ({work / g.nbytes:.3g} x the gradient's: XLA:TPU scatters the rows, "
            "then the columns)"), text

    def scalar(kind: str):
        def build():
            b, v, n = s["vmem_b"], s["vmem_v"], s["vmem_n"]
            table = _rand(46, (b, b, v), jnp.float32)
            ids = jax.random.randint(jax.random.key(47), (b, b, n), 0, v, jnp.int32)
            if kind == "gather":
                jf, args = jax.jit(lambda t, i: jnp.take_along_axis(t, i, 2)), (table, ids)
            else:
                g = _rand(48, (b, b, n), jnp.float32)
                jf = jax.jit(lambda t, i, g: jax.vjp(lambda t: jnp.take_along_axis(t, i, 2), t)[1](g)[0])
                args = (table, ids, g)
            compiled = jf.lower(*args).compile()
            what = "take_along_axis" if kind == "gather" else "the gradient of take_along_axis (a scatter-add)"
            return (lambda: compiled(*args)), float(b * b * n), (
                f"{what}: i32[{b},{b},{n}] single f32 elements of f32[{b},{b},{v}] "
                f"({b * b * v * 4 // 1024} KiB): elements"), compiled.as_text()
        name = "gather_scalar_vmem" if kind == "gather" else "scatter_add_scalar_vmem"
        return _program(name, f"class_rates.{name}", "element", build, own=(kind,))

    dn = ("NHWC", "HWIO", "NHWC")

    def conv(name: str, key: str | None, form: str, batch: int, px: int, cin: int, cout: int, window: int):
        def build():
            x = _rand(49, (batch, px, px, cin), jnp.bfloat16)
            w = _rand(50, (window, window, cin, cout), jnp.bfloat16)
            if form == "transposed":
                jf = jax.jit(lambda x, w: jax.lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=dn))
            else:
                stride = (2, 2) if form == "stride-2" else (1, 1)
                jf = jax.jit(lambda x, w: jax.lax.conv_general_dilated(x, w, stride, "SAME", dimension_numbers=dn))
            compiled = jf.lower(x, w).compile()
            what = {"transposed": "stride-2 transposed", "stride-2": "stride-2", "dense": "stride-1"}[form]
            return (lambda: compiled(x, w)), _xla_flops(compiled), (
                f"{window}x{window} {what} convolution bf16[{batch},{px},{px},{cin}] -> {cout} features: "
                "XLA's FLOPs"), compiled.as_text()
        return _program(name, key, "FLOP", build, own=("convolution", "matmul"))

    # a batch of 2048 images (not the DCGAN's 256): a call of 0.15 ms carried the program's fixed cost, 40-70 us
    # on the lent v5e (conv_strided_4x4 measured 113 TFLOP/s where its shape ran at 166 inside gan_train)
    gb, gc = s["gan_b"], s["gan_ch"]
    return [*(scatter_unique(w) for w in SCATTER_ROW_BYTES), *(scatter_segment(w) for w in SCATTER_ROW_BYTES),
            _program("scatter_add_upsample", "class_rates.scatter_add_upsample", "byte", upsample, own=("scatter",)),
            scalar("gather"), scalar("scatter"),
            conv("conv_strided_4x4", "class_rates.conv_strided_4x4", "stride-2", gb, 16, gc // 4, gc // 2, 4),
            conv("conv_transposed_4px", None, "transposed", gb, 4, gc, gc // 2, 4),
            conv("conv_transposed_8px", None, "transposed", gb, 8, gc // 2, gc // 4, 4),
            conv("conv_transposed_16px", None, "transposed", gb, 16, gc // 4, gc // 8, 4),
            conv("conv_transposed_32px_to3", None, "transposed", gb, 32, gc // 8, 3, 4),
            conv("conv_transposed_3x3_32px", None, "transposed", s["img"], 32, gc // 2, gc // 4, 3),
            conv("conv_strided_4x4_64px_from3", None, "stride-2", gb, 64, 3, gc // 8, 4),
            conv("conv_strided_3x3_32px", None, "stride-2", s["img"], 32, gc // 2, gc, 3),
            conv("conv_dense_3x3_to64", None, "dense", s["img"], s["hw"] * 16 // 7, gc // 4, gc // 8, 3),
            conv("conv_dense_3x3_to3", None, "dense", s["img"], s["hw"] * 16 // 7, gc // 8, 3, 3)]



def _linalg_work(compiled_text: str, cls: str) -> float:
    """The work of a benchmark's linear-algebra custom calls of class ``cls`` (``cholesky``, ...): each call's
    :func:`stagetool.analysis.kernel_time.linalg_cubes`, summed over the compiled module (the benchmarks' sizes
    compile to no loop around them)."""
    from stagetool.analysis.kernel_time import LINALG_CLASSES, linalg_cubes
    from stagetool.hlo.parser import parse_hlo_module

    module = parse_hlo_module(compiled_text)
    return sum(linalg_cubes(c, i) for c in module.computations for i in c.instructions
               if i.opcode == "custom-call" and LINALG_CLASSES.get((i.attributes.get("custom_call_target") or "")
                                                                    .strip('"')) == cls)


def _coverage_benchmarks(s: dict[str, int]) -> list[Callable[[Callable[..., Timing]], BenchmarkResult]]:
    """Issue 46's kernel classes that no other benchmark measures, each timed from its own measurement (the
    class coverage audit, bench/results/step_time_suite/class_coverage.md): element ops whose cost is their own
    (:data:`stagetool.core.chips.ELEMENT_OPS`: exp, log, erf, sine, rsqrt, power, f32 and s32 divide,
    s32 remainder; each chained ``op_chain`` times over ``op_n`` elements), max pooling's window and its gradient
    (select-and-scatter), a dilated and a 1-D convolution, 64 x 64 products at ``Precision.HIGHEST``, a pad that
    interleaves (interior padding: ``lax.associative_scan``'s levels), column sums (a reduction over the major
    axis), ``lax.top_k``, a ``fori_loop``'s iteration and XLA:TPU's linear-algebra custom calls (Cholesky at 64
    and 128, the triangular solve's diagonal-block inversion, QR, eigh). As in :func:`_class_benchmarks`, the
    model's time of each program's kernels outside the class is taken off the median (:func:`others_seconds`)."""
    import jax
    import jax.numpy as jnp

    from stagetool.core.chips import ELEMENT_OPS

    def element_op(name: str):
        opcode, dtype = ELEMENT_OPS[name]
        # each link: the op and at most one cheap element-wise op; a divisor read from an array (by a constant,
        # XLA would multiply and shift instead of dividing)
        chains = {"exponential": lambda x, d: jnp.exp(-x), "log": lambda x, d: jnp.log(x + 2.0),
                  "log-plus-one": lambda x, d: jnp.log1p(x), "erf": lambda x, d: jax.lax.erf(x) * 2.0,
                  "sine": lambda x, d: jnp.sin(x) * 2.0, "rsqrt": lambda x, d: jax.lax.rsqrt(x + 1.0),
                  "power": lambda x, d: x ** 1.7, "divide": lambda x, d: jax.lax.div(d, x + 3.0) if dtype == "f32"
                  else jax.lax.div(x, d) + x, "remainder": lambda x, d: jax.lax.rem(x, d) + x}
        step = chains[opcode]

        def build():
            n, k = s["op_n"], s["op_chain"]
            if dtype == "f32":
                x, d = jnp.abs(_rand(40, (n,), jnp.float32)), jnp.abs(_rand(41, (n,), jnp.float32)) + 1.0
            else:
                x = _rand(40, (n,), jnp.int32)
                d = jax.random.randint(jax.random.key(41), (n,), 1, 1000, jnp.int32)

            def chain(x, d):
                for _ in range(k):
                    x = step(x, d)
                return x
            f = jax.jit(chain)
            return (lambda: f(x, d)), float(n * k), (f"{k} chained {opcode} ({dtype}) over {dtype}[{n}], one fusion: "
                                                     "elements x ops"), f.lower(x, d).compile().as_text()
        return _program(name, f"class_rates.{name}", "element", build, own=("element-wise",))

    img, hw, ch = s["pool_img"], s["pool_hw"], s["pool_ch"]
    pool = lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")

    def pool_max():
        x = _rand(41, (img, hw, hw, ch), jnp.bfloat16)
        f = jax.jit(pool)
        y = jax.eval_shape(pool, x)
        work = float(x.nbytes + math.prod(y.shape) * 2)
        return (lambda: f(x)), work, (f"3x3 max pool, stride 2, of bf16[{img},{hw},{hw},{ch}]: bytes read + "
                                      "written"), f.lower(x).compile().as_text()

    def pool_max_gradient():
        x = _rand(41, (img, hw, hw, ch), jnp.bfloat16)
        f = jax.jit(jax.grad(lambda x: jnp.sum(pool(x).astype(jnp.float32))))
        y = jax.eval_shape(pool, x)
        work = float(2 * x.nbytes + math.prod(y.shape) * 2)  # the operand read, the pooled gradient read, the result
        return (lambda: f(x)), work, (f"the gradient of a 3x3 max pool, stride 2, of bf16[{img},{hw},{hw},{ch}] "
                                      "(select-and-scatter): operand and result bytes, the pooled gradient's"), \
            f.lower(x).compile().as_text()

    dn = ("NHWC", "HWIO", "NHWC")

    def conv_dilated():
        x, w = _rand(42, (s["img"], s["hw"], s["hw"], s["ch"]), jnp.bfloat16), \
            _rand(43, (3, 3, s["ch"], s["ch"]), jnp.bfloat16)
        jf = jax.jit(lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", rhs_dilation=(2, 2),
                                                               dimension_numbers=dn))
        compiled = jf.lower(x, w).compile()
        return (lambda: jf(x, w)), _xla_flops(compiled), (f"3x3 convolution dilated 2 of bf16{list(x.shape)} "
                                                          f"* {list(w.shape)}: XLA's FLOPs"), compiled.as_text()

    def conv_1d():
        x, w = _rand(44, (s["img"], s["conv1d_len"], 2 * s["ch"]), jnp.bfloat16), \
            _rand(45, (4, 2 * s["ch"], 2 * s["ch"]), jnp.bfloat16)
        jf = jax.jit(lambda x, w: jax.lax.conv_general_dilated(x, w, (1,), [(3, 0)],
                                                               dimension_numbers=("NWC", "WIO", "NWC")))
        compiled = jf.lower(x, w).compile()
        return (lambda: jf(x, w)), _xla_flops(compiled), (f"causal 1-D convolution, width 4, of bf16{list(x.shape)} "
                                                          f"* {list(w.shape)}: XLA's FLOPs"), compiled.as_text()

    def batched_highest():
        return _batched_products(s["bmm_hi"], s["bmm_n"], "f32", "HIGHEST", (46, 47))

    def pad_interior():
        x = _rand(48, (s["pad_rows"], s["pad_cols"]), jnp.float32)
        f = jax.jit(lambda x: jax.lax.pad(x, 0.0, ((0, 0, 1), (0, 0, 0))))
        return (lambda: f(x)), float(x.nbytes + (2 * s["pad_rows"] - 1) * s["pad_cols"] * 4), (
            f"lax.pad of f32[{s['pad_rows']},{s['pad_cols']}] with interior padding 1 on rows (an interleave): bytes "
            "read + written"), f.lower(x).compile().as_text()

    def reduction_major():
        x = _rand(49, (s["rows"], s["cols"]), jnp.float32)
        f = jax.jit(lambda x: x.sum(0))
        return (lambda: f(x)), float(x.nbytes), f"column sums of f32[{s['rows']},{s['cols']}]: bytes read", \
            f.lower(x).compile().as_text()

    def top_k():
        x = _rand(50, (s["topk_rows"], s["topk_n"]), jnp.float32)
        f = jax.jit(lambda x: jax.lax.top_k(x, 8))
        return (lambda: f(x)), float(x.size), (f"lax.top_k(k=8) of f32[{s['topk_rows']},{s['topk_n']}]: operand "
                                               "elements"), f.lower(x).compile().as_text()

    def loop_iteration():
        x = _rand(51, (8, 128), jnp.float32)
        f = jax.jit(lambda x: jax.lax.fori_loop(0, s["loop"], lambda i, x: x * 0.999 + 1.0, x))
        return (lambda: f(x)), float(s["loop"]), (f"fori_loop of {s['loop']} iterations of x * 0.999 + 1 on "
                                                  "f32[8,128]: iterations, less the model's time of its kernels"), \
            f.lower(x).compile().as_text()

    def linalg(cls: str, n: int, batch: int):
        def build():
            a = _rand(52, (batch, n, n), jnp.float32)
            spd = a @ jnp.swapaxes(a, -1, -2) / n + jnp.eye(n, dtype=jnp.float32)
            if cls == "cholesky":
                x, f = spd, jax.jit(jnp.linalg.cholesky)
            elif cls == "triangular_invert":
                x = jnp.linalg.cholesky(spd)
                rhs = _rand(53, (batch, n, 8), jnp.float32)
                f = jax.jit(lambda l: jax.lax.linalg.triangular_solve(l, rhs, left_side=True, lower=True))
            elif cls == "qr":
                x, f = a, jax.jit(jnp.linalg.qr)
            else:
                x, f = spd, jax.jit(jnp.linalg.eigh)
            text = f.lower(x).compile().as_text()
            return (lambda: f(x)), _linalg_work(text, cls), (
                f"{cls} of f32[{batch},{n},{n}]: each custom call's batch x n^3 (linalg_cubes)"), text
        from stagetool.analysis.kernel_time import LINALG_KINDS

        name = f"{cls}_{n}" if cls == "cholesky" else cls
        return _program(name, f"class_rates.{name}", "element", build, own=LINALG_KINDS[cls])

    return [*(element_op(k) for k in ELEMENT_OPS),
            _program("pool_max", "class_rates.pool_window", "byte", pool_max, own=("pooling",)),
            _program("pool_max_gradient", "class_rates.select_and_scatter", "byte", pool_max_gradient,
                     own=("select-and-scatter",)),
            _program("conv_dilated", "class_rates.conv_dilated", "FLOP", conv_dilated, own=("convolution", "matmul")),
            _program("conv_1d", "class_rates.conv_1d", "FLOP", conv_1d, own=("convolution", "matmul")),
            _program("batched_matmul_f32_highest", "class_rates.batched_matmul_f32_highest", "FLOP", batched_highest,
                     own=("convolution", "matmul")),
            _program("pad_interior", "class_rates.pad_interior", "byte", pad_interior, own=("pad",)),
            _program("reduction_major", "class_rates.reduction_major", "byte", reduction_major, own=("reduction",)),
            _program("top_k", "class_rates.top_k", "element", top_k, own=("top-k",)),
            _program("loop_iteration", "class_rates.loop_iterations", "element", loop_iteration, own=("loop",)),
            linalg("cholesky", 64, s["la_64"]), linalg("cholesky", 128, s["la_128"]),
            linalg("triangular_invert", 64, s["la_64"]), linalg("qr", 128, s["la_128"]),
            linalg("eigh", 128, s["la_128"] // 2 or 1)]

def _kernel_overhead(s: dict[str, int]) -> Callable[[Callable[..., Timing]], BenchmarkResult]:
    import jax
    import jax.numpy as jnp

    def run(timer: Callable[..., Timing]) -> BenchmarkResult:
        x = _rand(13, (s["kern"], s["kern"]), jnp.bfloat16)
        w = _rand(14, (s["kern"], s["kern"]), jnp.bfloat16) * 0.01

        def chain(n):
            def f(x, w):
                for _ in range(n):
                    x = jnp.tanh(x @ w)
                return x
            return jax.jit(f)
        short, long = chain(s["k_short"]), chain(s["k_long"])
        ts, tl = timer(lambda: short(x, w)), timer(lambda: long(x, w))
        per = max(tl.median_seconds - ts.median_seconds, 0.0) / (s["k_long"] - s["k_short"])
        lo = max(tl.min_seconds - ts.max_seconds, 0.0) / (s["k_long"] - s["k_short"])
        hi = max(tl.max_seconds - ts.min_seconds, 0.0) / (s["k_long"] - s["k_short"])
        t = Timing(per, lo, hi, (hi - lo) / per if per > 0 else 0.0, min(ts.samples, tl.samples), tl.inner, tl.warmup)
        return BenchmarkResult("kernel_overhead", "kernel_overhead_seconds",
                               f"{s['k_long']} vs {s['k_short']} chained tanh(bf16[{s['kern']},{s['kern']}] @ w) "
                               "fusions: time difference / kernel difference", 1.0, "second", t, per)
    run.benchmark_name = "kernel_overhead"  # type: ignore[attr-defined]
    return run


def _dispatch() -> Callable[[Callable[..., Timing]], BenchmarkResult]:
    import jax
    import jax.numpy as jnp

    def run(timer: Callable[..., Timing]) -> BenchmarkResult:
        x = jnp.zeros((8,), jnp.float32)
        f = jax.jit(lambda x: x + 1)
        t = timer(lambda: f(x), inner=1)
        return BenchmarkResult("dispatch", None, "f32[8] + 1, one call then block_until_ready (host round trip)",
                               1.0, "second", t, t.median_seconds)
    run.benchmark_name = "dispatch"  # type: ignore[attr-defined]
    return run


def _all_reduce(s: dict[str, int], n: int) -> Callable[[Callable[..., Timing]], BenchmarkResult]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def run(timer: Callable[..., Timing]) -> BenchmarkResult:
        mesh = Mesh(jax.devices(), ("d",))
        x = jax.device_put(jnp.ones((n * 8,), jnp.float32), NamedSharding(mesh, P("d")))
        f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        t = timer(lambda: f(x))
        return BenchmarkResult("all_reduce_latency", "collective_latency_seconds",
                               f"psum of f32[8] per device over {n} devices", 1.0, "second", t, t.median_seconds)
    run.benchmark_name = "all_reduce_latency"  # type: ignore[attr-defined]
    return run


def calibrate(*, chip: str, command: str, size: str = "full", repeats: int = 10, warmup: int = 2,
              on_result: Callable[[BenchmarkResult], None] | None = None,
              only: frozenset[str] | None = None) -> Calibration:
    """Run every benchmark on JAX's default backend.

    Args:
      chip: the profile's name.
      command: the command line, recorded in the profile.
      size: ``full`` (an accelerator) or ``tiny`` (tests on the CPU; figures meaningless).
      repeats / warmup: samples per benchmark and untimed calls before them.
      on_result: called with each result as it is measured (progress).
      only: run only the benchmarks of these names (tests), or None for all.

    Returns:
      The :class:`Calibration`.
    """
    import jax

    devices = jax.devices()
    timer = lambda call, inner=None: time_calls(call, warmup=warmup, repeats=repeats, inner=inner)
    results = []
    for bench in benchmarks(SIZES[size], len(devices)):
        if only is not None and getattr(bench, "benchmark_name", None) not in only:
            continue
        r = bench(timer)
        results.append(r)
        if on_result is not None:
            on_result(r)
    notes = () if len(devices) > 1 else ("one device: collectives not measured (the profile keeps the chip "
                                         "table's link figures)",)
    if devices[0].platform == "cpu":
        notes += ("measured on the CPU backend: the figures describe this host, not an accelerator",)
    return Calibration(chip=chip, device_kind=devices[0].device_kind, platform=devices[0].platform,
                       devices=len(devices), versions=versions(),
                       date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(), command=command,
                       results=tuple(results), notes=notes)


_PROFILE_NAME = re.compile(r"^[a-z0-9][a-z0-9._+-]{0,63}$")


def check_profile_name(name: str) -> str:
    """``--name``, as the profile's chip name (lower case, stripped): one the spec's ``chips:`` reads
    back and ``--chip NAME`` takes.

    Raises:
      UsageError: empty, longer than 64 characters, or with a character other than a-z, 0-9, ``.``,
        ``_``, ``+`` and ``-`` (a ``#`` or ``": "`` would end the name in YAML).
    """
    chip = name.strip().lower()
    if not _PROFILE_NAME.match(chip):
        raise UsageError(f"--name {name!r}: a chip name is 1 to 64 of a-z, 0-9, '.', '_', '+' and '-', starting with "
                         "a letter or digit (it becomes a key of the spec's chips: and --chip's value)",
                         hint="e.g. --name tpu-v5e or --name my-npu")
    return chip


def profile_name_for(name: str | None, device_kind: str) -> str:
    """The profile's chip name: ``--name`` (checked), else the chip table's name for the attached
    ``device_kind``.

    Raises:
      UsageError: no ``--name`` and the kind is not in the table; or ``--name`` is a table chip other
        than the attached one, or a table chip while the attached kind is in no table entry (the CPU
        backend): the loader refuses a profile measured on another device.
    """
    from stagetool.core.chips import CHIPS, chip_for_device_kind, own_chip_name

    attached = chip_for_device_kind(device_kind)
    if name is None:
        if attached is None:
            raise UsageError(f"the attached device kind {device_kind!r} is not in the chip table",
                             hint="name the profile with --name NAME")
        return attached
    chip = check_profile_name(name)
    if chip in CHIPS and attached is not None and attached != chip:
        raise UsageError(f"--name {name}: the attached device is a {device_kind} ({attached}), not a {chip}: the "
                         "spec's chips: refuses a profile measured on another chip",
                         hint=f"--name {attached}, or a name of your own (--name my-{attached})")
    if chip in CHIPS and attached is None:  # the CPU backend (--cpu-for-tests), a device the table does not know
        own = own_chip_name(device_kind)
        raise UsageError(f"--name {name}: {chip} is a chip of the table and the attached device is a {device_kind} "
                         f"(not a {chip}): its figures under {chip}'s name would time every {chip} program at this "
                         "device's rates, and the spec's chips: refuses a profile measured on another device",
                         hint=f"a name of your own (--name {own}), then --chip {own}")
    return chip


def _num(x: float) -> str:
    """A float YAML reads back as a float (``1.620e+14``; PyYAML needs the dot and the signed exponent)."""
    if not math.isfinite(x):
        raise ValueError(f"not a finite figure: {x}")
    return f"{x:.4e}"


def _quote(text: str) -> str:
    import json

    return json.dumps(text, ensure_ascii=False)


def profile_yaml(cal: Calibration) -> str:
    """The chip profile as YAML: a ``chips:`` mapping with one entry, every figure commented with the
    benchmark it comes from (shape, median and spread), and the provenance under ``profile:``.

    Load it with ``--chip NAME`` after putting the ``chips:`` entry in the spec;
    :func:`stagetool.core.chips.merge_chips` parses it. Only what that loader takes is written as a
    key: a figure it would refuse (a kernel overhead measured as 0, within the noise; a rate beyond
    what a chip can be) is written as a comment saying why, so the file always loads.
    """
    def comment(r: BenchmarkResult) -> str:
        t = r.timing
        less = (f", less {r.others_seconds * 1e3:.4g} ms the step-time model gives its other kernels"
                if r.others_seconds else "")
        return (f"  # {r.shape}: median {t.median_seconds * 1e3:.4g} ms of {t.samples}×{t.inner} calls{less}, "
                f"spread {t.spread * 100:.1f}%")

    by_key = {r.key: r for r in cal.results if r.key}
    refused = _refused_figures(cal.chip, by_key, cal)
    lines = [f"# Chip profile measured by `{cal.command}` on {cal.devices} × {cal.device_kind} ({cal.platform}),",
             f"# {cal.date}, jax {cal.versions.get('jax')}, jaxlib {cal.versions.get('jaxlib')}, "
             f"libtpu {cal.versions.get('libtpu')}. Every rate is MEASURED for one chip: work / median seconds.",
             *(f"# note: {n}" for n in cal.notes),
             "chips:", f"  {_quote(cal.chip)}:"]

    def figure(indent: str, key: str, r: BenchmarkResult) -> str:
        shown = key.rsplit(".", 1)[-1]
        if key in refused:
            return f"{indent}# {shown}: {r.rate:.4e} not written: {refused[key]}{comment(r)}"
        return f"{indent}{shown}: {_num(r.rate)}{comment(r)}"

    mm = [(k, r) for k, r in by_key.items() if k.startswith("matmul_flops_per_second.")]
    if mm:
        lines.append("    matmul_flops_per_second:" if any(k not in refused for k, _ in mm)
                     else "    # matmul_flops_per_second: (every class refused, below)")
        for key, r in mm:
            lines.append(figure("      ", key, r))
    tile = [128, 128] if cal.platform == "tpu" else None
    if tile:
        lines.append(f"    matmul_tile: {tile}  # the MXU tile of the TPU (architecture, not measured)")
    nested: dict[str, list[tuple[str, BenchmarkResult]]] = {}
    for key, r in by_key.items():
        if key.startswith("matmul_flops_per_second."):
            continue
        head, _, sub = key.partition(".")
        if sub:
            nested.setdefault(head, []).append((sub, r))
        else:
            lines.append(figure("    ", key, r))
    for head, subs in nested.items():
        lines.append(f"    {head}:" if any(f"{head}.{sub}" not in refused for sub, _ in subs)
                     else f"    # {head}: (every figure refused, below)")
        for sub, r in subs:
            lines.append(figure("      ", f"{head}.{sub}", r))
    extra = [r for r in cal.results if r.key is None]
    if extra:
        lines.append("    # shape classes and costs beside the profile (not keys of it):")
        for r in extra:
            val = f"{r.rate * 1e6:.4g} µs" if r.unit == "second" else f"{r.rate:.4e} {r.unit}/s"
            lines.append(f"    #   {r.name}: {val}; {comment(r).strip()[2:]}")
    lines += ["    profile:",
              f"      measured_on: {_quote(cal.device_kind)}",
              f"      date: {_quote(cal.date)}"]
    for name in ("jax", "jaxlib", "libtpu"):
        v = cal.versions.get(name)
        lines.append(f"      {name}: {_quote(v)}" if v else f"      # {name}: not installed")  # (the loader takes text)
    lines.append(f"      command: {_quote(cal.command)}")
    return "\n".join(lines) + "\n"


def _refused_figures(chip: str, by_key: dict[str, BenchmarkResult], cal: Calibration) -> dict[str, str]:
    """``{profile key: why}`` for each measured figure the spec's ``chips:`` loader would refuse
    (:func:`stagetool.core.chips.merge_chips`, the loader itself, asked until the rest loads)."""
    from stagetool.core.chips import merge_chips

    refused: dict[str, str] = {}
    for _ in range(len(by_key) + 1):
        entry: dict[str, Any] = {}
        for key, r in by_key.items():
            if key in refused:
                continue
            if not math.isfinite(r.rate) or r.rate <= 0:
                refused[key] = (f"measured as {r.rate:g}, within the timing's noise (spread "
                                f"{r.timing.spread * 100:.0f}%): no figure" if r.rate == 0 else "not a finite figure")
                continue
            head, _, sub = key.partition(".")
            if sub:
                entry.setdefault(head, {})[sub] = r.rate
            else:
                entry[head] = r.rate
        entry["profile"] = {"measured_on": cal.device_kind}
        try:
            merge_chips({chip: entry})
            return refused
        except SpecError as e:
            found = False
            for issue in e.issues:
                field = issue.split(":", 1)[0].removeprefix(f"chips.{chip}.")
                key = next((k for k in by_key if k not in refused and (k == field or k.startswith(field + "."))), None)
                if key is not None:
                    refused[key] = issue.split(": ", 1)[1] if ": " in issue else issue
                    found = True
            if not found:
                return refused
    return refused
