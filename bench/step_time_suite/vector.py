"""Single-kernel programs of the step-time suite of classes beyond matmuls and plain element-wise work:
FFTs, random bits (threefry), integer and bit ops, sorts, cumulative ops, row gathers of several widths,
in-place updates of donated buffers, batched small matmuls and data-dependent while loops."""
import jax
import jax.numpy as jnp


def fft2d(x):
    """A 2-D FFT over complex64[b, 1024, 1024] and back (jnp.fft.fft2, ifft2): the spectrum filtered."""
    y = jnp.fft.fft2(x)
    return jnp.fft.ifft2(y * 0.5)


def rfft_rows(x):
    """A real FFT along the rows of f32[8192, 8192], magnitudes kept: f32[8192, 4097]."""
    return jnp.abs(jnp.fft.rfft(x, axis=-1))


def dropout(x, key):
    """Threefry dropout (rate 0.1) over bf16[32, 2048, 4096]: the mask's random bits, a compare, a select."""
    keep = jax.random.bernoulli(key, 0.9, x.shape)
    return jnp.where(keep, x / 0.9, 0).astype(x.dtype)


def random_normal(key):
    """jax.random.normal f32[8192, 8192] from a threefry key: 64 M draws (bits, then the inverse erf)."""
    return jax.random.normal(key, (8192, 8192), jnp.float32)


def bit_hash(x):
    """An integer hash over u32[64 M] (xorshift-multiply, 3 rounds) and a population count: integer
    vector work, no floats."""
    for _ in range(3):
        x = x ^ (x >> 16)
        x = x * jnp.uint32(0x45D9F3B)
    return x ^ jax.lax.population_count(x)


def sort_rows(x):
    """jnp.sort along the rows of f32[4096, 4096]."""
    return jnp.sort(x, axis=-1)


def argsort_flat(x):
    """jnp.argsort of f32[4 M]: one long sort carrying the indices."""
    return jnp.argsort(x)


def cumsum_rows(x):
    """jnp.cumsum along the rows of f32[8192, 8192]."""
    return jnp.cumsum(x, axis=-1)


def cummax_cols(x):
    """lax.cummax down the columns of f32[8192, 8192]."""
    return jax.lax.cummax(x, axis=0)


def gather_narrow(table, ids):
    """Rows of 64 bf16 (128 B) gathered from a table bf16[1 M, 64] by ids i32[1 M] (modulo the rows)."""
    return table[ids % table.shape[0]]


def gather_pages(pool, table):
    """Pages of bf16[16, 8, 128] (32 KiB) gathered from a pool bf16[4096, 16, 8, 128] by a page table
    i32[64, 64] (modulo the pages): 128 MiB read."""
    return pool[table % pool.shape[0]]


def kv_cache_update(cache, new, pos):
    """A KV cache bf16[32, 8192, 8, 128] (512 MiB, donated) with 16 new positions of every sequence written
    in place at pos (modulo the room left): only the 1 MiB slice moves."""
    pos = pos % (cache.shape[1] - new.shape[1])
    return jax.lax.dynamic_update_slice_in_dim(cache, new, pos, axis=1)


def scatter_rows_set(table, ids, rows):
    """rows bf16[65536, 256] written (set, not added) into a donated table bf16[1 M, 256] at ids (modulo the
    rows): only the rows move."""
    return table.at[ids % table.shape[0]].set(rows)


def batched_matmul_64(a, b):
    """8192 independent products of 64 x 64 bf16 matrices (a, b bf16[8192, 64, 64])."""
    return jnp.einsum("bij,bjk->bik", a, b)


def batched_matmul_128_f32(a, b):
    """2048 independent products of 128 x 128 f32 matrices at default precision (a, b f32[2048, 128, 128]),
    chained three times."""
    for _ in range(3):
        a = jnp.einsum("bij,bjk->bik", a, b)
    return a


def newton_sqrt(a):
    """A data-dependent while loop: Newton's square root of |a| + 1 over f32[4096, 4096] until every
    element is within 1e-6 (at most 50 steps)."""
    a = jnp.abs(a) + 1.0

    def cond(s):
        x, i = s
        return (jnp.max(jnp.abs(x * x - a)) > 1e-6) & (i < 50)

    def body(s):
        x, i = s
        return 0.5 * (x + a / x), i + 1
    return jax.lax.while_loop(cond, body, (a, 0))


def power_iteration(m, v):
    """A data-dependent while loop of matmuls: power iteration of bf16[4096, 4096] from v f32[4096] until
    the eigenvalue estimate moves less than 1e-3 (at most 30 steps)."""
    m = m.astype(jnp.float32) + jnp.eye(m.shape[0], dtype=jnp.float32)

    def cond(s):
        _, lam, prev, i = s
        return (jnp.abs(lam - prev) > 1e-3 * jnp.abs(lam)) & (i < 30)

    def body(s):
        v, lam, _, i = s
        w = m @ v
        return w / jnp.linalg.norm(w), jnp.dot(v, w), lam, i + 1
    return jax.lax.while_loop(cond, body, (v, jnp.float32(1.0), jnp.float32(0.0), 0))
