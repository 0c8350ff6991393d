"""A GPT-2-small-sized decoder in float32 (12 layers, d_model 768, 12 heads, vocab 50257, learned
positions, GELU MLP, LayerNorm), a plain SGD train step: what XLA:TPU runs at default precision
(f32 matmuls as bf16 passes), for the step-time suite."""
import jax
import jax.numpy as jnp

D, H, L, V, S = 768, 12, 12, 50257, 1024


def init_params(key, d=D, layers=L, v=V, s=S):
    z = lambda *sh: jnp.zeros(sh, jnp.float32)
    return {"wte": z(v, d), "wpe": z(s, d), "lnf": {"g": z(d), "b": z(d)},
            "layers": {"ln1": {"g": z(layers, d), "b": z(layers, d)}, "ln2": {"g": z(layers, d), "b": z(layers, d)},
                       "qkv": z(layers, d, 3 * d), "qkv_b": z(layers, 3 * d), "proj": z(layers, d, d),
                       "proj_b": z(layers, d), "fc": z(layers, d, 4 * d), "fc_b": z(layers, 4 * d),
                       "out": z(layers, 4 * d, d), "out_b": z(layers, d)}}


def _ln(x, p):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * (1 + p["g"]) + p["b"]


def _block(x, p):
    b, s, d = x.shape
    q, k, v = jnp.split(_ln(x, p["ln1"]) @ p["qkv"] + p["qkv_b"], 3, -1)
    heads = lambda t: t.reshape(b, s, H, d // H)
    a = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True).reshape(b, s, d)
    x = x + a @ p["proj"] + p["proj_b"]
    return x + jax.nn.gelu(_ln(x, p["ln2"]) @ p["fc"] + p["fc_b"]) @ p["out"] + p["out_b"]


def loss(params, tokens):
    inp, tgt = tokens[:, :-1] % V, tokens[:, 1:] % V
    x = params["wte"][inp] + params["wpe"][: inp.shape[1]]
    x, _ = jax.lax.scan(lambda h, p: (_block(h, p), None), x, params["layers"])
    logits = _ln(x, params["lnf"]) @ params["wte"].T
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], -1))


def train_step(params, tokens):
    """tokens i32[b, s+1]; returns the updated params (donated) and the loss."""
    l, g = jax.value_and_grad(loss)(params, tokens)
    return jax.tree.map(lambda p, g: p - 1e-4 * g, params, g), l
