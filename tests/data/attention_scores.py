"""Attention whose largest buffer is known analytically: the scores ``f32[B, H, T, T]`` (per device
``B / data × H × T × T × 4`` bytes), made on the line marked ``# scores`` (issue 32's test program).

``remat`` (a static argument, ``none`` or ``chunked``) is the knob a fit search may turn: ``chunked``
computes the scores one half of the queries at a time, so at most half of them are live at once.
"""

import jax.numpy as jnp


def attention(q, k, v, remat="none"):
    if remat == "chunked":
        half = q.shape[2] // 2
        return jnp.concatenate([attention(q[:, :, :half], k, v), attention(q[:, :, half:], k, v)], axis=2)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k)  # scores
    s = jnp.exp(s - jnp.max(s, -1, keepdims=True))
    return jnp.einsum("bhqk,bhkd->bhqd", s, v)
