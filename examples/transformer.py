"""A small decoder-only transformer train step in plain JAX: embeddings, causal multi-head attention,
an MLP, RMSNorm, layers stacked under ``jax.lax.scan``, cross-entropy, and an Adam update.

    stagetool shardings examples/transformer.py:train_step --mesh 2x4
    stagetool compile   examples/transformer.py:train_step

The spec beside this file (transformer.stagetool.yaml) builds the parameters and the optimizer
state through ``jax.eval_shape`` of :func:`init_params` / :func:`init_opt_state`, shards the
attention and MLP weights Megatron-style over ``model``, the batch over ``data``, and donates both
the parameters and the optimizer state.

Parameter tree (``L`` layers, ``D`` = d_model, ``F`` = d_ff, ``V`` = vocab, ``S`` = max_seq)::

    {"embed": [V, D], "pos_embed": [S, D], "final_norm": [D],
     "layers": {"wq", "wk", "wv": [L, D, D], "wo": [L, D, D],
                "w_up": [L, D, F], "w_down": [L, F, D], "norm1", "norm2": [L, D]}}

Optimizer state: ``{"m": <params tree>, "v": <params tree>, "step": i32[]}``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

ADAM_B1 = 0.9
ADAM_B2 = 0.95
ADAM_EPS = 1e-8


def init_params(key, vocab: int, d_model: int, n_layers: int, d_ff: int, max_seq: int):
    """The parameter tree (see the module docstring); every weight is f32."""
    ks = jax.random.split(key, 8)

    def normal(k, shape, fan_in):
        return jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(fan_in)

    L, D, F = n_layers, d_model, d_ff
    return {
        "embed": normal(ks[0], (vocab, D), D),
        "pos_embed": normal(ks[1], (max_seq, D), D),
        "final_norm": jnp.ones((D,), jnp.float32),
        "layers": {
            "wq": normal(ks[2], (L, D, D), D),
            "wk": normal(ks[3], (L, D, D), D),
            "wv": normal(ks[4], (L, D, D), D),
            "wo": normal(ks[5], (L, D, D), D),
            "w_up": normal(ks[6], (L, D, F), D),
            "w_down": normal(ks[7], (L, F, D), F),
            "norm1": jnp.ones((L, D), jnp.float32),
            "norm2": jnp.ones((L, D), jnp.float32),
        },
    }


def init_opt_state(key, vocab: int, d_model: int, n_layers: int, d_ff: int, max_seq: int):
    """Adam state for the parameters of :func:`init_params` with the same sizes:
    ``{"m": zeros like params, "v": zeros like params, "step": i32[]}``.

    It takes the sizes rather than the parameter tree because a spec's ``init_args`` are plain values,
    leaves and keys; under ``jax.eval_shape`` calling :func:`init_params` here computes nothing.
    """
    params = init_params(key, vocab, d_model, n_layers, d_ff, max_seq)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"m": zeros, "v": jax.tree.map(jnp.zeros_like, params), "step": jnp.zeros((), jnp.int32)}


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def attention(x, layer, n_heads: int):
    """Causal multi-head self-attention; x: [B, S, D]."""
    B, S, D = x.shape
    dh = D // n_heads

    def heads(w):
        return (x @ w).reshape(B, S, n_heads, dh)

    q, k, v = heads(layer["wq"]), heads(layer["wk"]), heads(layer["wv"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(dh))
    causal = jnp.tril(jnp.ones((S, S), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, D)
    return out @ layer["wo"]


def block(x, layer, n_heads: int):
    x = x + attention(rms_norm(x, layer["norm1"]), layer, n_heads)
    h = jax.nn.gelu(rms_norm(x, layer["norm2"]) @ layer["w_up"])
    x = x + h @ layer["w_down"]
    # A bare PartitionSpec: its run sets a mesh; stagetool traces it under the staged mesh (jax.set_mesh).
    return jax.lax.with_sharding_constraint(x, P("data", None, None))


def forward(params, tokens, n_heads: int):
    """Logits [B, S, V] for tokens [B, S] (embedding tied to the output projection)."""
    S = tokens.shape[1]
    x = params["embed"][tokens] + params["pos_embed"][:S]

    def step(x, layer):
        return block(x, layer, n_heads), None

    x, _ = jax.lax.scan(step, x, params["layers"])
    x = rms_norm(x, params["final_norm"])
    return x @ params["embed"].T


def loss_fn(params, batch, n_heads: int):
    """Mean next-token cross-entropy of ``batch["targets"]`` given ``batch["tokens"]``."""
    logits = forward(params, batch["tokens"], n_heads)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def train_step(params, opt_state, batch, *, n_heads: int = 4, lr: float = 3e-4):
    """One Adam step; returns ``(new params, new opt_state, loss)``.

    ``batch`` is ``{"tokens": i32[B, S], "targets": i32[B, S]}``; ``n_heads`` must be static.
    """
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, n_heads)
    step = opt_state["step"] + 1
    m = jax.tree.map(lambda m, g: ADAM_B1 * m + (1 - ADAM_B1) * g, opt_state["m"], grads)
    v = jax.tree.map(lambda v, g: ADAM_B2 * v + (1 - ADAM_B2) * g * g, opt_state["v"], grads)
    t = step.astype(jnp.float32)
    c1 = 1 - ADAM_B1 ** t
    c2 = 1 - ADAM_B2 ** t
    params = jax.tree.map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + ADAM_EPS), params, m, v)
    return params, {"m": m, "v": v, "step": step}, loss
