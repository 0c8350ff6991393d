"""A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, untied head) in plain JAX, for the step-time
suite: a scanned train step with remat and its prefill, and decode steps against a KV cache.

Shapes (the suite's spec, suite.stagetool.yaml): d_model 1024, 8 layers under ``lax.scan``, 8 heads of
128, SwiGLU 2816, vocab 16000, bf16 parameters (about 134 M).
"""
import jax
import jax.numpy as jnp

D, H, F, V, L = 1024, 8, 2816, 16000, 8


def init_params(key, d=D, f=F, v=V, layers=L):
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    return {"embed": z(v, d), "norm": z(d), "head": z(d, v),
            "layers": {"wq": z(layers, d, d), "wk": z(layers, d, d), "wv": z(layers, d, d),
                       "wo": z(layers, d, d), "w_gate": z(layers, d, f), "w_up": z(layers, d, f),
                       "w_down": z(layers, f, d), "n1": z(layers, d), "n2": z(layers, d)}}


def _rms(x, w):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype) * (1 + w)


def _rope(x, positions):
    """Rotary embedding of x [b, s, h, d] at integer positions [b, s]."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = positions[..., None, None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(ang), jnp.cos(ang)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _mlp(x, p):
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


def _layer(x, p, positions):
    b, s, d = x.shape
    h = _rms(x, p["n1"])
    heads = lambda t: t.reshape(b, s, H, d // H)
    q, k, v = _rope(heads(h @ p["wq"]), positions), _rope(heads(h @ p["wk"]), positions), heads(h @ p["wv"])
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)
    x = x + a @ p["wo"]
    return x + _mlp(_rms(x, p["n2"]), p)


def _forward(params, tokens, remat):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    layer = jax.checkpoint(_layer) if remat else _layer
    x = params["embed"][tokens % params["embed"].shape[0]]
    x, _ = jax.lax.scan(lambda h, p: (layer(h, p, positions), None), x, params["layers"])
    return _rms(x, params["norm"])


def loss(params, tokens):
    x = _forward(params, tokens[:, :-1], remat=True)
    logits = (x @ params["head"]).astype(jnp.float32)
    targets = tokens[:, 1:] % logits.shape[-1]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def train_step(params, tokens):
    """One SGD step: tokens i32[b, s+1] (ids taken modulo the vocabulary)."""
    l, g = jax.value_and_grad(loss)(params, tokens)
    return jax.tree.map(lambda p, g: p - (1e-4 * g).astype(p.dtype), params, g), l


def prefill(params, tokens):
    """The forward pass over a prompt: logits f32[b, vocab] of the last position (no remat)."""
    x = _forward(params, tokens, remat=False)
    return (x[:, -1] @ params["head"]).astype(jnp.float32)


def init_cache(key, batch, length, d=D, layers=L):
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    return {"k": z(layers, batch, length, H, d // H), "v": z(layers, batch, length, H, d // H)}


def decode_step(params, cache, token, pos):
    """One token per sequence against a KV cache: token i32[b], pos i32[] (the slot written, taken modulo
    the cache length); returns the next token (greedy) and the updated cache (donated)."""
    b = token.shape[0]
    length = cache["k"].shape[2]
    pos = pos % length
    x = params["embed"][token % params["embed"].shape[0]][:, None]          # [b, 1, d]
    positions = jnp.full((b, 1), pos)
    valid = jnp.arange(length) <= pos

    def layer(x, pc):
        p, ck, cv = pc
        d = x.shape[-1]
        h = _rms(x, p["n1"])
        heads = lambda t: t.reshape(b, 1, H, d // H)
        q = _rope(heads(h @ p["wq"]), positions)
        k = _rope(heads(h @ p["wk"]), positions)
        v = heads(h @ p["wv"])
        ck = jax.lax.dynamic_update_slice_in_dim(ck, k, pos, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(cv, v, pos, axis=1)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, ck).astype(jnp.float32) / jnp.sqrt(d // H).astype(jnp.float32)
        s = jnp.where(valid, s, -1e30)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s).astype(cv.dtype), cv).reshape(b, 1, d)
        x = x + a @ p["wo"]
        return x + _mlp(_rms(x, p["n2"]), p), (ck, cv)

    x, (k, v) = jax.lax.scan(layer, x, (params["layers"], cache["k"], cache["v"]))
    logits = (_rms(x, params["norm"])[:, 0] @ params["head"]).astype(jnp.float32)
    return jnp.argmax(logits, -1).astype(jnp.int32), {"k": k, "v": v}
