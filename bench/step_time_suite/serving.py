"""Serving and loss programs of the step-time suite in plain JAX: a paged-attention decode (page-table
gathers, the new token's key and value written in place into the donated page pool), a weight-only int8
decode, an int8 x int8 MLP, and a 128k-vocabulary cross-entropy with its gradient."""
import jax
import jax.numpy as jnp

H, HD = 8, 128          # heads, head dim
PAGE = 16               # tokens per page


def paged_init(key, layers, pages, d=1024, f=2816, v=32000):
    """Weights of a small decoder and its page pool: k/v bf16[layers, pages, PAGE, H, HD] (donated)."""
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    params = {"embed": z(v, d), "head": z(d, v),
              "layers": {"wqkv": z(layers, d, 3 * d), "wo": z(layers, d, d), "w1": z(layers, d, f),
                         "w2": z(layers, f, d)}}
    return params


def paged_pool(key, layers, pages):
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    return {"k": z(layers, pages, PAGE, H, HD), "v": z(layers, pages, PAGE, H, HD)}


def paged_decode(params, pool, page_table, token, length):
    """One decode step for b sequences over a paged KV cache: page_table i32[b, pages_per_seq] (ids taken
    modulo the pool's pages), token i32[b], length i32[] (the position written, modulo the sequence's
    capacity). Each layer writes the new key/value into its page slot of the pool in place (the pool,
    carried through the layers' scan, is donated) and gathers the sequences' pages to attend over.
    Returns the next tokens and the pool."""
    b, pps = page_table.shape
    pages = pool["k"].shape[1]
    page_table = page_table % pages
    pos = length % (pps * PAGE)
    x = params["embed"][token % params["embed"].shape[0]]                      # [b, d]
    d = x.shape[-1]
    slot_page = page_table[:, pos // PAGE]                                     # [b]
    valid = jnp.arange(pps * PAGE) <= pos

    def layer(carry, p):
        x, kpool, vpool, l = carry
        q, k, v = jnp.split((x @ p["wqkv"]).reshape(b, 3 * H, HD), 3, 1)      # [b, H, HD] each
        kpool = kpool.at[l, slot_page, pos % PAGE].set(k)                      # in-place write of one row
        vpool = vpool.at[l, slot_page, pos % PAGE].set(v)
        ks = kpool[l, page_table].reshape(b, pps * PAGE, H, HD)                # page gathers
        vs = vpool[l, page_table].reshape(b, pps * PAGE, H, HD)
        s = jnp.einsum("bhd,bkhd->bhk", q, ks).astype(jnp.float32) * HD ** -0.5
        s = jnp.where(valid, s, -1e30)
        a = jnp.einsum("bhk,bkhd->bhd", jax.nn.softmax(s).astype(vs.dtype), vs).reshape(b, d)
        x = x + a @ p["wo"]
        x = x + jax.nn.silu(x @ p["w1"]) @ p["w2"]
        return (x, kpool, vpool, l + 1), None

    (x, k, v, _), _ = jax.lax.scan(layer, (x, pool["k"], pool["v"], 0), params["layers"])
    return jnp.argmax((x @ params["head"]).astype(jnp.float32), -1).astype(jnp.int32), {"k": k, "v": v}


def int8_init(key, layers=16, d=4096, f=11008, v=32000):
    """Weight-only int8 decoder weights (s8) with per-column bf16 scales."""
    z8 = lambda *s: jnp.zeros(s, jnp.int8)
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    return {"embed": z(v, d), "head": z8(d, v), "head_s": z(v),
            "layers": {"wqkv": z8(layers, d, 3 * d), "wo": z8(layers, d, d), "w1": z8(layers, d, f),
                       "w2": z8(layers, f, d), "s_qkv": z(layers, 3 * d), "s_o": z(layers, d),
                       "s_1": z(layers, f), "s_2": z(layers, d)}}


def int8_weight_decode(params, token):
    """A weight-only int8 decode at batch b (no attention cache: the weights dominate): token i32[b]; each
    s8 weight is converted to bf16 inside the matmul's fusion and its column scale applied after."""
    x = params["embed"][token % params["embed"].shape[0]]

    def mm(x, w, s):
        return (x @ w.astype(jnp.bfloat16)) * s

    def layer(x, p):
        h = mm(x, p["wqkv"], p["s_qkv"])[:, : x.shape[-1]]
        x = x + mm(h, p["wo"], p["s_o"])
        return x + mm(jax.nn.silu(mm(x, p["w1"], p["s_1"])), p["w2"], p["s_2"]), None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return jnp.argmax(mm(x, params["head"], params["head_s"]).astype(jnp.float32), -1)


def int8_mlp(x, w1, w2):
    """An int8 x int8 MLP (s8 activations and weights, s32 accumulate, requantised between): x s8[8192, 4096],
    w1 s8[4096, 16384], w2 s8[16384, 4096]."""
    h = jax.lax.dot(x, w1, preferred_element_type=jnp.int32)
    h = jnp.clip(jax.nn.relu(h) >> 8, 0, 127).astype(jnp.int8)
    return jax.lax.dot(h, w2, preferred_element_type=jnp.int32)


def cross_entropy_128k(hidden, w, labels):
    """The LM head and loss over a 128256 vocabulary, and their gradients: hidden bf16[8192, 2048],
    w bf16[2048, 128256], labels i32[8192] (modulo the vocabulary): 2 x 3 x 8192 x 2048 x 128256 FLOPs."""
    def loss(h, w):
        logits = (h @ w).astype(jnp.float32)
        lab = labels % logits.shape[-1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), lab[:, None], -1))
    return jax.value_and_grad(loss, argnums=(0, 1))(hidden, w)


def cross_entropy_128k_chunked(hidden, w, labels):
    """The same loss computed over 8 chunks of tokens under lax.map (each chunk's logits f32[1024, 128256]),
    forward only, as a memory-saving serve-time scorer does."""
    hs = hidden.reshape(8, -1, hidden.shape[-1])
    ls = labels.reshape(8, -1)

    def chunk(args):
        h, lab = args
        logits = (h @ w).astype(jnp.float32)
        return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), (lab % logits.shape[-1])[:, None], -1))
    return jnp.sum(jax.lax.map(chunk, (hs, ls))) / hidden.shape[0]
