"""The held-back programs of the step-time suite (issue 46): fourteen programs of kinds that kinds.yaml does
not name, written after the step-time model was tuned and measured once, so that they can say whether it
holds on programs nobody fitted it to. Plain JAX, one function each (heldback.stagetool.yaml names their
shapes, heldback_kinds.yaml their kinds). Nobody changing the model should read the measured results of
these programs; the table (table.py --heldback) reports them apart from the suite's two halves.

Train steps: a Mamba-style selective state-space layer (lax.associative_scan), an LSTM over time
(lax.scan), a graph convolutional network (gathers over edges, jax.ops.segment_sum), an AdamW update of a
GPT-2-small-shaped parameter tree (optimizer only), a C3D-style video network (3-D convolutions), a
T5-style encoder-decoder (cross-attention), a top-1 mixture of experts by grouped GEMM (lax.ragged_dot),
a CLIP-style contrastive loss (a 16384 x 16384 similarity matrix). Serve steps: image resizing for a
model's input (jax.image.resize, bilinear up and Lanczos down), a speculative-decoding verify step.
Kernels: max and average pooling with their gradients, batched Cholesky factorisations and triangular
solves (a Gaussian-process likelihood), a weighted histogram (scatter-add with collisions), a chain of
layout ops (space-to-depth, pad, concatenate, transpose)."""
import jax
import jax.numpy as jnp


def _normal(key, *shape, scale=0.02, dtype=jnp.bfloat16):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _init(key, shapes: dict):
    """A dict of bf16 N(0, 0.02) arrays, one per name (nested dicts allowed)."""
    out = {}
    for i, (name, s) in enumerate(sorted(shapes.items())):
        k = jax.random.fold_in(key, i)
        out[name] = _init(k, s) if isinstance(s, dict) else _normal(k, *s)
    return out


def _sgd(params, grads, lr=1e-3):
    return jax.tree.map(lambda p, g: p - (lr * g).astype(p.dtype), params, grads)


def _xent(logits, labels):
    logits = logits.astype(jnp.float32)
    labels = labels % logits.shape[-1]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))


def _rms(x, w):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * (1 + w.astype(jnp.float32))
            ).astype(x.dtype)


# --------------------------------------------------------------------------- selective state space (Mamba)
def ssm_init(key, d=512, expand=2, n=16, conv=4):
    di, r = expand * d, d // 16
    p = _init(key, {"w_in": (d, 2 * di), "w_bc": (di, 2 * n), "w_dt1": (di, r), "w_dt2": (r, di),
                    "conv": (conv, di), "w_out": (di, d), "norm": (d,)})
    p["a_log"] = jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.float32), (di, n)))
    p["d"] = jnp.ones((di,), jnp.float32)
    return p


def _ssm_forward(p, x):
    b, length, _ = x.shape
    n = p["a_log"].shape[1]
    h = _rms(x, p["norm"])
    u, z = jnp.split(h @ p["w_in"], 2, -1)                                   # [b, L, di] each
    k = p["conv"].shape[0]                                                     # causal depthwise conv1d
    up = jnp.pad(u, ((0, 0), (k - 1, 0), (0, 0)))
    u = jax.nn.silu(sum(up[:, i:i + length] * p["conv"][i] for i in range(k)))
    bc = (u @ p["w_bc"]).astype(jnp.float32)
    bm, cm = bc[..., :n], bc[..., n:]                                          # [b, L, n]
    dt = jax.nn.softplus((u @ p["w_dt1"] @ p["w_dt2"]).astype(jnp.float32))  # [b, L, di]
    a = -jnp.exp(p["a_log"])                                                   # [di, n]
    da = jnp.exp(dt[..., None] * a)                                            # [b, L, di, n]
    dbu = (dt * u.astype(jnp.float32))[..., None] * bm[:, :, None, :]

    def combine(l, r):
        return l[0] * r[0], r[0] * l[1] + r[1]
    _, hs = jax.lax.associative_scan(combine, (da, dbu), axis=1)               # h_t = da_t h_{t-1} + dbu_t
    y = jnp.einsum("bldn,bln->bld", hs, cm) + p["d"] * u.astype(jnp.float32)
    y = (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
    return x + y @ p["w_out"]


def ssm_train_step(params, x, target):
    """One train step of a Mamba-style selective state-space layer: x, target bf16[b, L, d]; the scan over
    the sequence is lax.associative_scan over the f32 state [b, L, 2d, 16]. Mean-squared error, SGD."""
    loss, g = jax.value_and_grad(lambda p: jnp.mean((_ssm_forward(p, x) - target).astype(jnp.float32) ** 2))(params)
    return loss, _sgd(params, g)


# ------------------------------------------------------------------------------------------------- LSTM
def lstm_init(key, i=512, h=1024, classes=1000):
    return _init(key, {"wx": (i, 4 * h), "wh": (h, 4 * h), "b": (4 * h,), "out": (h, classes)})


def lstm_train_step(params, xs, labels):
    """One train step of an LSTM classifier over time: xs bf16[T, b, i] (the input projection hoisted out of
    the loop), the recurrence under lax.scan over T, the last hidden state classified; labels i32[b]."""
    def loss(p):
        t, b, _ = xs.shape
        hdim = p["wh"].shape[0]
        gx = (xs.reshape(t * b, -1) @ p["wx"] + p["b"]).reshape(t, b, -1)

        def step(carry, g):
            h, c = carry
            g = (g + h @ p["wh"]).astype(jnp.float32)
            i, f, o, u = jnp.split(g, 4, -1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(u)
            h = (jax.nn.sigmoid(o) * jnp.tanh(c)).astype(xs.dtype)
            return (h, c), None
        (h, _), _ = jax.lax.scan(step, (jnp.zeros((b, hdim), xs.dtype), jnp.zeros((b, hdim), jnp.float32)), gx)
        return _xent(h @ p["out"], labels)
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# ------------------------------------------------------------------------------------ graph convolution
def gnn_init(key, f=128, hidden=128, classes=64):
    return _init(key, {"w1": (f, hidden), "w2": (hidden, hidden), "w3": (hidden, classes)})


def gnn_graph(key, nodes, edges):
    """A random graph: {"src", "dst"} i32[edges] in [0, nodes)."""
    ks, kd = jax.random.split(key)
    return {"src": jax.random.randint(ks, (edges,), 0, nodes, jnp.int32),
            "dst": jax.random.randint(kd, (edges,), 0, nodes, jnp.int32)}


def gnn_train_step(params, graph, x, labels):
    """One train step of a three-layer graph convolutional network over a graph of x.shape[0] nodes:
    x bf16[nodes, f]; each layer gathers the transformed features of every edge's source and sums them
    into its destination (jax.ops.segment_sum, f32), normalised by the in-degree; labels i32[nodes]."""
    src, dst = graph["src"], graph["dst"]
    n = x.shape[0]
    deg = jax.ops.segment_sum(jnp.ones(dst.shape, jnp.float32), dst, n)
    inv = (1.0 / jnp.maximum(deg, 1.0))[:, None]

    def loss(p):
        h = x
        for name in ("w1", "w2", "w3"):
            m = (h @ p[name]).astype(jnp.float32)
            h = jax.ops.segment_sum(m[src], dst, n) * inv + m
            h = (jax.nn.relu(h) if name != "w3" else h).astype(x.dtype)
        return _xent(h, labels)
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# --------------------------------------------------------------------------------------- AdamW update
def _gpt2_shapes(layers=12, d=768, v=50304, ctx=1024):
    shapes = {"wte": (v, d), "wpe": (ctx, d), "ln_f": (d,), "ln_f_b": (d,)}
    for i in range(layers):
        shapes[f"h{i:02d}"] = {"ln1": (d,), "ln1_b": (d,), "qkv": (d, 3 * d), "qkv_b": (3 * d,), "proj": (d, d),
                               "proj_b": (d,), "ln2": (d,), "ln2_b": (d,), "fc": (d, 4 * d), "fc_b": (4 * d,),
                               "fc2": (4 * d, d), "fc2_b": (d,)}
    return shapes


def _f32_tree(key, shapes):
    return jax.tree.map(lambda a: a.astype(jnp.float32), _init(key, shapes))


def adamw_state(key):
    """GPT-2-small-shaped f32 parameters (124 M in 148 tensors) with AdamW's two moments."""
    p = _f32_tree(key, _gpt2_shapes())
    return {"params": p, "m": jax.tree.map(jnp.zeros_like, p), "v": jax.tree.map(jnp.zeros_like, p)}


def adamw_grads(key):
    """Gradients of the same shapes (f32)."""
    return _f32_tree(key, _gpt2_shapes())


def adamw_update(state, grads, step):
    """An optimizer-only step: the gradients clipped to global norm 1, then AdamW (weight decay on the
    matrices only) over every tensor of the state (donated); step i32[] is the step count."""
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, 1.0 / (norm + 1e-6))
    t = (step % 100000 + 1).astype(jnp.float32)
    b1, b2, lr, wd = 0.9, 0.95, 3e-4, 0.1

    def upd(p, g, m, v):
        g = g * scale
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1 ** t)) / (jnp.sqrt(v / (1 - b2 ** t)) + 1e-8)
        if p.ndim >= 2:
            u = u + wd * p
        return p - lr * u, m, v
    out = jax.tree.map(upd, state["params"], grads, state["m"], state["v"])
    istuple = lambda x: isinstance(x, tuple)
    pick = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=istuple)
    return {"params": pick(0), "m": pick(1), "v": pick(2)}


# ------------------------------------------------------------------------------------- 3-D convolutions
_DN3 = ("NDHWC", "DHWIO", "NDHWC")
C3D = ((3, 64), (64, 128), (128, 256), (256, 256), (256, 512))
C3D_POOL = ((1, 2, 2), (2, 2, 2), None, (2, 2, 2), None)


def c3d_init(key, classes=400):
    shapes = {f"c{i}": (3, 3, 3, ci, co) for i, (ci, co) in enumerate(C3D)}
    shapes["fc"] = (C3D[-1][1], classes)
    return _init(key, shapes)


def c3d_train_step(params, clips, labels):
    """One train step of a C3D-style video network: clips bf16[b, frames, h, w, 3]; five 3 x 3 x 3
    convolutions with ReLU and 3-D max pooling, global average pooling, a classifier; labels i32[b]."""
    def loss(p):
        x = clips
        for i, pool in enumerate(C3D_POOL):
            x = jax.nn.relu(jax.lax.conv_general_dilated(x, p[f"c{i}"], (1, 1, 1), "SAME", dimension_numbers=_DN3))
            if pool:
                x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, *pool, 1), (1, *pool, 1), "VALID")
        return _xent(x.astype(jnp.float32).mean((1, 2, 3)) @ p["fc"].astype(jnp.float32), labels)
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# ------------------------------------------------------------------------------------------ image resize
def resize_for_model(images):
    """Serving-side image resizing, images bf16[b, h, w, c]: bilinear upsampling to 2h x 2w and Lanczos-3
    downsampling with antialiasing to h/2 x w/2 (jax.image.resize)."""
    b, h, w, c = images.shape
    up = jax.image.resize(images, (b, 2 * h, 2 * w, c), "bilinear")
    down = jax.image.resize(images, (b, h // 2, w // 2, c), "lanczos3", antialias=True)
    return up, down


# --------------------------------------------------------------------------------------------- pooling
def pooling_grad(x):
    """3 x 3 max pooling at stride 2 and 2 x 2 average pooling over x bf16[b, h, w, c], and the gradient of
    the sum of their squares with respect to x (select-and-scatter for the max)."""
    def f(x):
        mx = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        av = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") * 0.25
        return jnp.sum(mx.astype(jnp.float32) ** 2) + jnp.sum(av.astype(jnp.float32) ** 2)
    return jax.value_and_grad(f)(x)


# ----------------------------------------------------------------------- batched Cholesky and solves
def gp_cholesky(a, y):
    """Batched Gaussian-process negative log-likelihoods: kernels K = a aᵀ / n + I from a f32[batch, n, n],
    targets y f32[batch, n, r]; K = L Lᵀ (jnp.linalg.cholesky), α = K⁻¹ y by two triangular solves;
    returns ½ yᵀα + Σ log diag L per problem, f32[batch]."""
    n = a.shape[-1]
    k = jnp.einsum("bij,bkj->bik", a, a, precision=jax.lax.Precision.HIGHEST) / n + jnp.eye(n, dtype=a.dtype)
    chol = jnp.linalg.cholesky(k)
    z = jax.lax.linalg.triangular_solve(chol, y, left_side=True, lower=True)
    alpha = jax.lax.linalg.triangular_solve(chol, z, left_side=True, lower=True, transpose_a=True)
    logdet = jnp.sum(jnp.log(jnp.diagonal(chol, axis1=-2, axis2=-1)), -1)
    return 0.5 * jnp.sum(y * alpha, (-2, -1)) + logdet


# ------------------------------------------------------------------------------------------- T5 (enc-dec)
T5_D, T5_H, T5_F, T5_LAYERS, T5_VOCAB = 512, 8, 2048, 6, 32128


def t5_init(key):
    L, D, F = T5_LAYERS, T5_D, T5_F
    return _init(key, {"embed": (T5_VOCAB, D), "enc_norm": (D,), "dec_norm": (D,),
                       "enc": {"wqkv": (L, D, 3 * D), "wo": (L, D, D), "w1": (L, D, F), "w2": (L, F, D),
                               "n1": (L, D), "n2": (L, D)},
                       "dec": {"wqkv": (L, D, 3 * D), "wo": (L, D, D), "wq_x": (L, D, D), "wkv_x": (L, D, 2 * D),
                               "wo_x": (L, D, D), "w1": (L, D, F), "w2": (L, F, D), "n1": (L, D), "n2": (L, D),
                               "n3": (L, D)}})


def _heads(x):
    b, s, _ = x.shape
    return x.reshape(b, s, T5_H, T5_D // T5_H)


def _attn(q, k, v, causal=False):
    b, s = q.shape[:2]
    return jax.nn.dot_product_attention(_heads(q), _heads(k), _heads(v), is_causal=causal).reshape(b, s, T5_D)


def _t5_loss(p, src, tgt_in, tgt_out):
    emb = p["embed"]
    x = emb[src % T5_VOCAB]

    def enc(x, w):
        q, k, v = jnp.split(_rms(x, w["n1"]) @ w["wqkv"], 3, -1)
        x = x + _attn(q, k, v) @ w["wo"]
        return x + jax.nn.relu(_rms(x, w["n2"]) @ w["w1"]) @ w["w2"], None
    mem, _ = jax.lax.scan(enc, x, p["enc"])
    mem = _rms(mem, p["enc_norm"])
    y = emb[tgt_in % T5_VOCAB]

    def dec(y, w):
        q, k, v = jnp.split(_rms(y, w["n1"]) @ w["wqkv"], 3, -1)
        y = y + _attn(q, k, v, causal=True) @ w["wo"]
        kx, vx = jnp.split(mem @ w["wkv_x"], 2, -1)                             # cross-attention
        y = y + _attn(_rms(y, w["n2"]) @ w["wq_x"], kx, vx) @ w["wo_x"]
        return y + jax.nn.relu(_rms(y, w["n3"]) @ w["w1"]) @ w["w2"], None
    y, _ = jax.lax.scan(dec, y, p["dec"])
    logits = _rms(y, p["dec_norm"]) @ emb.T                                     # tied embedding
    return _xent(logits, tgt_out)


def t5_train_step(params, src, tgt):
    """One train step of a T5-style encoder-decoder (6 + 6 layers, d 512, 8 heads, vocabulary 32128, tied
    embedding): src i32[b, S] encoded, tgt i32[b, T + 1] decoded with causal self-attention and
    cross-attention to the encoder's output (teacher forcing). SGD."""
    l, g = jax.value_and_grad(_t5_loss)(params, src, tgt[:, :-1], tgt[:, 1:])
    return l, _sgd(params, g)


# ------------------------------------------------------------------------- grouped GEMM (ragged MoE)
def ragged_moe_init(key, d=1024, f=2048, experts=16):
    return _init(key, {"router": (d, experts), "w1": (experts, d, f), "w2": (experts, f, d)})


def ragged_moe_train_step(params, x, target):
    """One train step of a top-1 mixture-of-experts MLP by grouped GEMM: tokens x bf16[t, d] routed to
    their best expert, sorted by expert, both expert matmuls as lax.ragged_dot over the groups' sizes, put
    back in order and scaled by the router's probability; mean-squared error against target, SGD."""
    def loss(p):
        probs = jax.nn.softmax((x @ p["router"]).astype(jnp.float32), -1)
        e = jnp.argmax(probs, -1).astype(jnp.int32)
        gate = jnp.max(probs, -1)
        order = jnp.argsort(e)
        sizes = jnp.bincount(e, length=p["router"].shape[1]).astype(jnp.int32)
        xs = x[order]
        h = jax.nn.gelu(jax.lax.ragged_dot(xs, p["w1"], sizes))
        ys = jax.lax.ragged_dot(h, p["w2"], sizes)
        y = jnp.zeros_like(ys).at[order].set(ys) * gate[:, None].astype(ys.dtype)
        return jnp.mean((x + y - target).astype(jnp.float32) ** 2)
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# --------------------------------------------------------------------------------- weighted histogram
def weighted_histogram(values, weights):
    """A weighted histogram into 4096 bins (jnp.bincount: a scatter-add where many updates hit the same
    bin) of values i32[n] (modulo the bins) with weights f32[n], and its normalised cumulative sum."""
    h = jnp.bincount(values % 4096, weights, length=4096)
    return h, jnp.cumsum(h) / jnp.maximum(jnp.sum(h), 1e-6)


# ------------------------------------------------------------------------------------------ layout ops
def layout_chain(x):
    """A chain of layout ops over x bf16[b, h, w, c]: space-to-depth by 2, a one-pixel pad, a concatenate
    with its mirror image, a transpose to NCHW, and depth-to-space back: a [b, 2c, h + 2, w + 2] and a
    [b, h + 2, w + 2, 2c] array."""
    b, h, w, c = x.shape
    s2d = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h // 2, w // 2, 4 * c)
    s2d = jnp.pad(s2d, ((0, 0), (1, 1), (1, 1), (0, 0)))
    cat = jnp.concatenate([s2d, s2d[:, :, ::-1]], -1)                          # [b, h/2+2, w/2+2, 8c]
    nchw = cat.transpose(0, 3, 1, 2)
    hh, ww = cat.shape[1:3]
    d2s = cat.reshape(b, hh, ww, 2, 2, 2 * c).transpose(0, 1, 3, 2, 4, 5).reshape(b, 2 * hh, 2 * ww, 2 * c)
    return nchw, d2s


# ---------------------------------------------------------------------------------- contrastive (CLIP)
def clip_init(key, di=768, dt=512, e=512):
    p = _init(key, {"w_img": (di, e), "w_txt": (dt, e)})
    p["log_scale"] = jnp.array(jnp.log(1 / 0.07), jnp.float32)
    return p


def clip_train_step(params, img, txt):
    """One train step of a CLIP-style contrastive head: image features bf16[n, 768] and text features
    bf16[n, 512] projected to 512, L2-normalised, an n x n similarity matrix (f32), the symmetric
    cross-entropy against the diagonal. SGD."""
    def loss(p):
        ei = img @ p["w_img"]
        et = txt @ p["w_txt"]
        norm = lambda e: (e.astype(jnp.float32) * jax.lax.rsqrt(jnp.sum(e.astype(jnp.float32) ** 2, -1, keepdims=True)
                                                                   + 1e-6)).astype(e.dtype)
        logits = jnp.exp(p["log_scale"]) * jnp.dot(norm(ei), norm(et).T, preferred_element_type=jnp.float32)
        diag = jnp.diagonal(logits)
        return 0.5 * (jnp.mean(jax.nn.logsumexp(logits, 1) - diag) + jnp.mean(jax.nn.logsumexp(logits, 0) - diag))
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# ----------------------------------------------------------------------- speculative decoding: verify
SV_D, SV_H, SV_HD, SV_F, SV_V = 1024, 8, 128, 2816, 32000


def spec_init(key, layers=8):
    L = layers
    return _init(key, {"embed": (SV_V, SV_D), "head": (SV_D, SV_V), "norm": (SV_D,),
                       "layers": {"wqkv": (L, SV_D, 3 * SV_D), "wo": (L, SV_D, SV_D), "w1": (L, SV_D, SV_F),
                                  "w2": (L, SV_F, SV_D), "n1": (L, SV_D), "n2": (L, SV_D)}})


def spec_cache(key, batch, length, layers=8):
    z = jnp.zeros((layers, batch, length, SV_H, SV_HD), jnp.bfloat16)
    return {"k": z, "v": z}


def spec_verify(params, cache, draft, pos):
    """The target model's verify step of speculative decoding: draft i32[b, k] (the last accepted token
    and k - 1 drafted ones) run through 8 layers at positions pos .. pos + k - 1 (pos modulo the room
    left), their keys and values written in place into the donated cache bf16[layers, b, S, 8, 128], each
    attending causally over the cache; returns the number of drafted tokens accepted per sequence (greedy
    match), the next token after them, and the cache."""
    b, k = draft.shape
    s = cache["k"].shape[2]
    pos = pos % (s - k)
    x = params["embed"][draft % SV_V]                                         # [b, k, d]
    visible = jnp.arange(s)[None, :] <= pos + jnp.arange(k)[:, None]          # [k, S]

    def layer(carry, w):
        x, kc, vc, l = carry
        q, kk, vv = jnp.split((_rms(x, w["n1"]) @ w["wqkv"]).reshape(b, k, 3 * SV_H, SV_HD), 3, 2)
        kc = jax.lax.dynamic_update_slice(kc, kk[None], (l, 0, pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, vv[None], (l, 0, pos, 0, 0))
        ks, vs = kc[l], vc[l]                                                  # [b, S, H, HD]
        sc = jnp.einsum("bqhd,bshd->bhqs", q, ks, preferred_element_type=jnp.float32) * SV_HD ** -0.5
        sc = jnp.where(visible, sc, -1e30)
        a = jnp.einsum("bhqs,bshd->bqhd", jax.nn.softmax(sc).astype(vs.dtype), vs).reshape(b, k, SV_D)
        x = x + a @ w["wo"]
        x = x + jax.nn.silu(_rms(x, w["n2"]) @ w["w1"]) @ w["w2"]
        return (x, kc, vc, l + 1), None

    (x, kc, vc, _), _ = jax.lax.scan(layer, (x, cache["k"], cache["v"], 0), params["layers"])
    target = jnp.argmax((_rms(x, params["norm"]) @ params["head"]).astype(jnp.float32), -1).astype(jnp.int32)
    match = (target[:, :-1] == draft[:, 1:] % SV_V).astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(match, -1), -1)                             # [b]
    nxt = jnp.take_along_axis(target, accepted[:, None], -1)[:, 0]
    return accepted, nxt, {"k": kc, "v": vc}
