"""Pallas programs of the step-time suite (TPU kernels: they compile for a TPU target, compile-only
included, and run on the chip): a tiled bf16 matmul with its own ``cost_estimate``, and JAX's own
Pallas flash attention (jax.experimental.pallas.ops.tpu.flash_attention)."""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BM = BN = BK = 512


def _matmul_kernel(a_ref, b_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def pallas_matmul(a, b):
    """bf16[m, k] @ bf16[k, n] in 512-blocks (f32 accumulator in VMEM); ``cost_estimate`` gives 2mnk FLOPs."""
    from jax.experimental.pallas import tpu as pltpu

    m, k = a.shape
    n = b.shape[1]
    return pl.pallas_call(
        _matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
        grid=(m // BM, n // BN, k // BK),
        in_specs=[pl.BlockSpec((BM, BK), lambda i, j, kk: (i, kk)), pl.BlockSpec((BK, BN), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((BM, BN), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((BM, BN), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=2 * m * n * k, transcendentals=0,
                                      bytes_accessed=(m * k + k * n + m * n) * a.dtype.itemsize),
    )(a, b)


def flash_attention(q, k, v):
    """JAX's Pallas flash attention (causal), q, k, v bf16[b, heads, s, d] (its pallas_call carries a cost_estimate)."""
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention as fa

    return fa(q, k, v, causal=True, sm_scale=1.0 / q.shape[-1] ** 0.5)
