"""The class-coverage audit (issue 46): small JAX programs of what people write (pooling and its gradient,
dilated and 1-D convolutions, linear algebra, argmax/argsort/top-k, transcendental chains, integer division,
loops with tiny bodies, associative_scan, cond/switch, pads and transposes, complex arithmetic, small products at
HIGHEST, reductions over either axis, segment_max, ...), compiled here for the compile-only ``v5e:1x1`` topology
and timed by the step-time model with the bundled tpu-v5e profile: per program, each kernel class, where its
figure comes from (``model`` at a class rate, or ``floor: work not counted``), its executions and its time.
Which profile key times each class is in bench/results/step_time_suite/class_coverage.md.

Usage: python bench/step_time_suite/class_coverage.py [PROGRAM ...]   (all programs by default; about 1 min)
"""
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import jax, jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
from stagetool.devices import tpu_topology as topology
from stagetool.plan.target import parse_target
from stagetool.analysis.step_time import step_time
from stagetool.core.chips import CHIPS
from stagetool.facts import Interconnect
from stagetool.hlo.collectives import while_loops
from stagetool.hlo.parser import parse_hlo_module

V5E = CHIPS["tpu-v5e"]

mesh = topology.topology_mesh(topology.tpu_topology(parse_target("v5e:1x1")).devices, (1,), ("x",))
def S(shape, dt=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))

def est(f, *args):
    c = jax.jit(f).lower(*args).compile()
    m = parse_hlo_module(c.as_text())
    return step_time(m, V5E, Interconnect("tpu", (), ()), (), dict(while_loops(m)), top=1 << 30), c

P_ = {}
def prog(name):
    def d(fn):
        P_[name] = fn; return fn
    return d

@prog("maxpool_fwd")
def _():
    x = S((32, 112, 112, 64), jnp.bfloat16)
    return (lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")), (x,)
@prog("maxpool_grad")
def _():
    x = S((32, 112, 112, 64), jnp.bfloat16)
    f = lambda x: jnp.sum(lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME").astype(jnp.float32))
    return jax.grad(f), (x,)
@prog("avgpool_fwd_grad")
def _():
    x = S((32, 56, 56, 128), jnp.float32)
    f = lambda x: jnp.sum(lax.reduce_window(x, 0., lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") ** 2)
    return jax.grad(f), (x,)
@prog("dilated_conv")
def _():
    x, w = S((16, 64, 64, 128), jnp.bfloat16), S((3, 3, 128, 128), jnp.bfloat16)
    return (lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", rhs_dilation=(2, 2),
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))), (x, w)
@prog("dilated_conv_grad")
def _():
    x, w = S((16, 64, 64, 128), jnp.bfloat16), S((3, 3, 128, 128), jnp.bfloat16)
    f = lambda x, w: jnp.sum(lax.conv_general_dilated(x, w, (1, 1), "SAME", rhs_dilation=(2, 2),
                             dimension_numbers=("NHWC", "HWIO", "NHWC")).astype(jnp.float32) ** 2)
    return jax.grad(f, (0, 1)), (x, w)
@prog("conv1d_causal")
def _():
    x, w = S((32, 2048, 256), jnp.bfloat16), S((4, 256, 256), jnp.bfloat16)
    return (lambda x, w: lax.conv_general_dilated(x, w, (1,), [(3, 0)], dimension_numbers=("NWC", "WIO", "NWC"))), (x, w)
@prog("conv1d_depthwise_grad")
def _():
    x, w = S((32, 2048, 512), jnp.bfloat16), S((4, 1, 512), jnp.bfloat16)
    f = lambda x, w: jnp.sum(lax.conv_general_dilated(x, w, (1,), [(3, 0)], dimension_numbers=("NWC", "WIO", "NWC"),
                             feature_group_count=512).astype(jnp.float32) ** 2)
    return jax.grad(f, (0, 1)), (x, w)
@prog("cholesky_solve")
def _():
    a = S((64, 64, 64))
    def f(a):
        a = a @ jnp.swapaxes(a, -1, -2) + 64 * jnp.eye(64)
        l = jnp.linalg.cholesky(a)
        return lax.linalg.triangular_solve(l, jnp.ones((64, 64, 8)), left_side=True, lower=True)
    return f, (a,)
@prog("qr")
def _():
    return jnp.linalg.qr, (S((16, 256, 256)),)
@prog("eigh")
def _():
    return (lambda a: jnp.linalg.eigh(a + jnp.swapaxes(a, -1, -2))), (S((8, 128, 128)),)
@prog("svd")
def _():
    return (lambda a: jnp.linalg.svd(a, full_matrices=False)), (S((8, 128, 128)),)
@prog("argmax_argsort_topk")
def _():
    x = S((256, 32768))
    return (lambda x: (jnp.argmax(x, -1), jnp.argsort(x[:16], -1), lax.top_k(x, 8))), (x,)
@prog("transcendental_chain")
def _():
    x = S((8192, 4096))
    return (lambda x: jax.nn.softplus(jnp.log1p(jnp.exp(lax.erf(x) * 0.5)) + jnp.sin(x))), (x,)
@prog("gelu_erf")
def _():
    x = S((8192, 4096), jnp.bfloat16)
    return (lambda x: jax.nn.gelu(x, approximate=False)), (x,)
@prog("int_divmod")
def _():
    x = S((8192, 4096), jnp.int32)
    return (lambda x: (x // 7 + x % 13, x // (x % 5 + 1))), (x,)
@prog("fori_tiny_body")
def _():
    x = S((128,))
    return (lambda x: lax.fori_loop(0, 1000, lambda i, x: jnp.sin(x) + i, x)), (x,)
@prog("scan_tiny_body")
def _():
    x, xs = S((256,)), S((1000, 256))
    return (lambda x, xs: lax.scan(lambda c, a: (jnp.tanh(c * a), c.sum()), x, xs)), (x, xs)
@prog("assoc_scan")
def _():
    a, b = S((4096, 256)), S((4096, 256))
    return (lambda a, b: lax.associative_scan(lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1]), (a, b))), (a, b)
@prog("cond_switch")
def _():
    x, i = S((4096, 1024)), S((), jnp.int32)
    return (lambda x, i: lax.switch(i, [jnp.sin, jnp.cos, lambda v: v * 2], x)), (x, i)
@prog("pad_concat_reverse_transpose")
def _():
    x = S((64, 512, 512), jnp.bfloat16)
    return (lambda x: jnp.concatenate([jnp.pad(x, ((0, 0), (1, 1), (0, 0)))[:, :512], x[:, ::-1]], 0).transpose(2, 0, 1)), (x,)
@prog("complex_arith")
def _():
    x = S((4096, 4096), jnp.complex64)
    return (lambda x: x * jnp.conj(x) + jnp.exp(1j * jnp.angle(x))), (x,)
@prog("batched_64_highest")
def _():
    a = S((4096, 64, 64))
    return (lambda a: jnp.einsum("bij,bjk->bik", a, a, precision=lax.Precision.HIGHEST)), (a,)
@prog("batched_64_f32_default")
def _():
    a = S((4096, 64, 64))
    return (lambda a: jnp.einsum("bij,bjk->bik", a, a)), (a,)
@prog("reduce_minor_major")
def _():
    x = S((8192, 8192))
    return (lambda x: (x.sum(0), x.max(1))), (x,)
@prog("segment_max")
def _():
    x, ids = S((262144, 128)), S((262144,), jnp.int32)
    return (lambda x, i: jax.ops.segment_max(x, i, 4096)), (x, ids)
@prog("vmap_small_matvec")
def _():
    a, v = S((8192, 32, 32)), S((8192, 32))
    return (lambda a, v: jnp.einsum("bij,bj->bi", a, v)), (a, v)
@prog("one_hot_embed")
def _():
    ids, t = S((8192,), jnp.int32), S((1024, 512), jnp.bfloat16)
    return (lambda i, t: jax.nn.one_hot(i, 1024, dtype=jnp.bfloat16) @ t), (ids, t)
@prog("logsumexp_bf16")
def _():
    x = S((4096, 32000), jnp.bfloat16)
    return (lambda x: jax.nn.logsumexp(x.astype(jnp.float32), -1)), (x,)
@prog("cumprod_cummax")
def _():
    x = S((4096, 4096))
    return (lambda x: (jnp.cumprod(x, 1), lax.cummax(x, 0))), (x,)
@prog("interp_resize")
def _():
    x = S((16, 128, 128, 64))
    return (lambda x: jax.image.resize(x, (16, 256, 256, 64), "bilinear")), (x,)

names = sys.argv[1:] or list(P_)
for name in names:
    f, args = P_[name]()
    try:
        e, c = est(f, *args)
    except Exception as ex:
        print(f"## {name}: FAILED {type(ex).__name__}: {str(ex)[:200]}"); continue
    by = collections.defaultdict(lambda: [0, 0.0, set()])
    for i in e.top:
        k = (i.kind, i.figure)
        by[k][0] += i.executions; by[k][1] += i.total_seconds; by[k][2].add(i.opcode)
    lb = " LOWER BOUND" if e.lower_bound else ""
    print(f"## {name}: {e.schedule_seconds*1e3:.3f} ms{lb}, {len(e.top)} kernels")
    for (kind, fig), (n, s, ops) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"   {kind:50s} {fig:24s} x{n:<6d} {s*1e3:9.4f} ms  {','.join(sorted(ops))}")
    sys.stdout.flush()
