"""The decoder shape of Llama 3 8B (tests/data/llama3_8b.py: 32 scanned layers, bf16 parameters, f32
Adam moments) with a remat knob, for ``stagetool fit`` (issue 32; README "What fits").

``remat`` (static): ``none`` keeps every layer's activations for the backward pass; ``dots`` saves
only the matmul outputs without batch dimensions (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``);
``full`` saves nothing but each layer's input (``jax.checkpoint_policies.nothing_saveable``).
"""
import jax
import jax.numpy as jnp

D, F, V, L, H, KV, HD = 4096, 14336, 128256, 32, 32, 8, 128

POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            "full": jax.checkpoint_policies.nothing_saveable}


def init_state(key):
    bf = jnp.bfloat16
    z = lambda *s: jnp.zeros(s, bf)
    layers = {"wq": z(L, D, H * HD), "wk": z(L, D, KV * HD), "wv": z(L, D, KV * HD), "wo": z(L, H * HD, D),
              "w1": z(L, D, F), "w3": z(L, D, F), "w2": z(L, F, D), "n1": z(L, D), "n2": z(L, D)}
    params = {"embed": z(V, D), "layers": layers, "norm": z(D), "head": z(D, V)}
    f32 = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), t)
    return {"params": params, "m": f32(params), "v": f32(params)}


def _rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-5).astype(x.dtype) * w


def _layer(x, p):
    b, s, _ = x.shape
    h = _rms(x, p["n1"])
    q = (h @ p["wq"]).reshape(b, s, H, HD)
    k = jnp.repeat((h @ p["wk"]).reshape(b, s, KV, HD), H // KV, axis=2)
    v = jnp.repeat((h @ p["wv"]).reshape(b, s, KV, HD), H // KV, axis=2)
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, H * HD)
    x = x + a @ p["wo"]
    h = _rms(x, p["n2"])
    return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"], None


def loss(params, tokens, remat):
    layer = _layer if remat == "none" else jax.checkpoint(_layer, policy=POLICIES[remat])
    x = params["embed"][tokens]
    x, _ = jax.lax.scan(layer, x, params["layers"])
    logits = _rms(x, params["norm"]) @ params["head"]
    return -jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])


def train_step(state, tokens, remat="none"):
    g = jax.grad(loss)(state["params"], tokens, remat)
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["m"], g)
    v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, state["v"], g)
    p = jax.tree.map(lambda p, m, v: (p - 1e-4 * m / (jnp.sqrt(v) + 1e-8)).astype(p.dtype), state["params"], m, v)
    return {"params": p, "m": m, "v": v}
