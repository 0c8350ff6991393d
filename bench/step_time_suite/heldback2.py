"""The second round of held-back programs of the step-time suite (issue 46): twelve programs of kinds that
neither kinds.yaml nor heldback_kinds.yaml names, written after round 1's results went to fixing the model,
so that they can say whether it holds on programs nobody fitted it to. Plain JAX, one function each
(heldback2.stagetool.yaml names their shapes, heldback2_kinds.yaml their kinds). Nobody changing the model
should read these programs or their measured results before their table lands; the table
(table.py --heldback2) reports them as their own group.

Train steps: a BERT-base masked-LM step (post-LN encoder under lax.scan, the loss on the masked positions
only, tied decoder), a convolutional VAE (reparameterisation, KL), a DCGAN generator and discriminator
update (conv_transpose), a Perceiver (latent cross-attention over 16k inputs, then latent self-attention),
a DiT-B/2 block stack with adaLN-Zero conditioning, a CTC loss in log space under lax.scan, a DLRM-style
recommender (embedding bags gathered from one stacked table, pairwise feature interaction), a NeRF-style
MLP with volume rendering (cumulative transmittance), a PPO update (GAE by a reverse lax.scan, clipped
surrogate). Serve steps: a beam-search decode step (top-k over beams x vocabulary, the KV cache reordered
by beam), an RK4 integration of a neural ODE in lax.fori_loop. Kernels: a k-means assignment and update
(distances by matmul, argmin, segment sums)."""
import math

import jax
import jax.numpy as jnp

F32, BF16 = jnp.float32, jnp.bfloat16


def _normal(key, *shape, scale=0.02, dtype=BF16):
    return (scale * jax.random.normal(key, shape, F32)).astype(dtype)


def _init(key, shapes: dict, dtype=BF16):
    """A dict of N(0, 0.02) arrays (bf16 unless ``dtype``), one per name (nested dicts allowed)."""
    out = {}
    for i, (name, s) in enumerate(sorted(shapes.items())):
        k = jax.random.fold_in(key, i)
        out[name] = _init(k, s, dtype) if isinstance(s, dict) else _normal(k, *s, dtype=dtype)
    return out


def _sgd(params, grads, lr=1e-3):
    return jax.tree.map(lambda p, g: p - (lr * g).astype(p.dtype), params, grads)


def _xent(logits, labels):
    logits = logits.astype(F32)
    labels = labels % logits.shape[-1]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))


def _ln(x, w, b, eps=1e-6):
    x32 = x.astype(F32)
    m = jnp.mean(x32, -1, keepdims=True)
    v = jnp.mean(jnp.square(x32 - m), -1, keepdims=True)
    return ((x32 - m) * jax.lax.rsqrt(v + eps) * (1 + w.astype(F32)) + b.astype(F32)).astype(x.dtype)


def _ln0(x, eps=1e-6):
    """LayerNorm without its own scale and shift (adaLN supplies them)."""
    x32 = x.astype(F32)
    m = jnp.mean(x32, -1, keepdims=True)
    v = jnp.mean(jnp.square(x32 - m), -1, keepdims=True)
    return ((x32 - m) * jax.lax.rsqrt(v + eps)).astype(x.dtype)


def _mha(q, k, v, heads, mask=None):
    """Multi-head attention: q [b, lq, d], k and v [b, lk, d]; softmax in f32."""
    b, lq, d = q.shape
    lk = k.shape[1]
    hd = d // heads
    q, k, v = (t.reshape(b, -1, heads, hd) for t in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(F32) / math.sqrt(hd)
    if mask is not None:
        s = jnp.where(mask, s, -1e30)
    a = jax.nn.softmax(s, -1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, lq, d)


# ------------------------------------------------------------------------------------- BERT masked LM
def bert_init(key, layers=12, d=768, ffn=3072, vocab=30522, ctx=512):
    lay = {"qkv": (layers, d, 3 * d), "qkv_b": (layers, 3 * d), "o": (layers, d, d), "o_b": (layers, d),
           "ln1": (layers, d), "ln1_b": (layers, d), "w1": (layers, d, ffn), "b1": (layers, ffn),
           "w2": (layers, ffn, d), "b2": (layers, d), "ln2": (layers, d), "ln2_b": (layers, d)}
    return _init(key, {"tok": (vocab, d), "pos": (ctx, d), "typ": (2, d), "emb_ln": (d,), "emb_ln_b": (d,),
                       "layers": lay, "head": (d, d), "head_b": (d,), "head_ln": (d,), "head_ln_b": (d,),
                       "dec_b": (vocab,)})


def bert_mlm_train_step(params, tokens, masked, labels):
    """One BERT-base masked-LM train step: tokens i32[b, L] (ids taken modulo the vocabulary), masked
    i32[b, M] positions replaced by [MASK] (103) and predicted, labels i32[b, M]. Post-LN encoder of 12
    layers under lax.scan (12 heads, GELU), the MLM head (dense, GELU, LayerNorm, decoder tied to the token
    embedding) on the M masked positions only; SGD."""
    def loss(p):
        b, length = tokens.shape
        vocab, d = p["tok"].shape
        heads = d // 64
        pos = masked % length
        rows = jnp.arange(b)[:, None]
        ids = (tokens % vocab).at[rows, pos].set(103)
        x = p["tok"][ids] + p["pos"][:length] + p["typ"][0]
        x = _ln(x, p["emb_ln"], p["emb_ln_b"], 1e-12)

        def layer(x, w):
            q, k, v = jnp.split(x @ w["qkv"] + w["qkv_b"], 3, -1)
            x = _ln(x + _mha(q, k, v, heads) @ w["o"] + w["o_b"], w["ln1"], w["ln1_b"], 1e-12)
            f = jax.nn.gelu(x @ w["w1"] + w["b1"]) @ w["w2"] + w["b2"]
            return _ln(x + f, w["ln2"], w["ln2_b"], 1e-12), None
        x, _ = jax.lax.scan(layer, x, p["layers"])
        h = x[rows, pos]                                                          # [b, M, d]
        h = _ln(jax.nn.gelu(h @ p["head"] + p["head_b"]), p["head_ln"], p["head_ln_b"], 1e-12)
        return _xent(h @ p["tok"].T + p["dec_b"], labels)
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# --------------------------------------------------------------------------------------- beam search
def beam_init(key, layers=8, d=1024, ffn=4096, vocab=32000):
    lay = {"qkv": (layers, d, 3 * d), "o": (layers, d, d), "w1": (layers, d, ffn), "w2": (layers, ffn, d),
           "n1": (layers, d), "n2": (layers, d)}
    return _init(key, {"emb": (vocab, d), "norm": (d,), "layers": lay})


def beam_cache(key, sequences, length, layers=8, heads=8, hd=128):
    """The KV cache of ``sequences`` = batch x beams sequences: {"k", "v"} bf16[layers, sequences, length,
    heads, hd], zeros."""
    del key
    z = jnp.zeros((layers, sequences, length, heads, hd), BF16)
    return {"k": z, "v": z}


def _rmsn(x, w):
    x32 = x.astype(F32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * (1 + w.astype(F32))).astype(x.dtype)


def beam_search_step(params, cache, tokens, scores, pos):
    """One beam-search decode step: tokens i32[batch, beams] (the last token of each beam), scores
    f32[batch, beams] (their log-probabilities so far), the cache (beam_cache, donated) and pos i32[] (the
    position written). Each layer writes its new key and value at pos and attends to positions <= pos; the
    next tokens are the top ``beams`` of the batch's beams x vocabulary scores, and the cache is reordered by
    the beam each came from (a gather of the whole cache). Returns (cache, next tokens, scores)."""
    batch, beams = tokens.shape
    vocab, d = params["emb"].shape
    _, s, length, heads, hd = cache["k"].shape
    x = params["emb"][tokens.reshape(s) % vocab]                                 # [S, d]
    pos = pos % length
    visible = (jnp.arange(length) <= pos)[None, None, :]

    def layer(x, wkv):
        w, kc, vc = wkv
        q, k, v = jnp.split(_rmsn(x, w["n1"]) @ w["qkv"], 3, -1)
        kc = jax.lax.dynamic_update_slice(kc, k.reshape(s, 1, heads, hd), (0, pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v.reshape(s, 1, heads, hd), (0, pos, 0, 0))
        att = jnp.einsum("shd,sthd->sht", q.reshape(s, heads, hd), kc).astype(F32) / math.sqrt(hd)
        att = jax.nn.softmax(jnp.where(visible, att, -1e30), -1).astype(x.dtype)
        o = jnp.einsum("sht,sthd->shd", att, vc).reshape(s, d)
        x = x + o @ w["o"]
        x = x + jax.nn.gelu(_rmsn(x, w["n2"]) @ w["w1"]) @ w["w2"]
        return x, (kc, vc)
    x, (kc, vc) = jax.lax.scan(layer, x, (params["layers"], cache["k"], cache["v"]))
    logp = jax.nn.log_softmax((_rmsn(x, params["norm"]) @ params["emb"].T).astype(F32), -1)
    cand = (scores[..., None] + logp.reshape(batch, beams, vocab)).reshape(batch, beams * vocab)
    top, idx = jax.lax.top_k(cand, beams)
    src = (jnp.arange(batch)[:, None] * beams + idx // vocab).reshape(s)
    return {"k": kc[:, src], "v": vc[:, src]}, (idx % vocab).astype(jnp.int32), top


# ------------------------------------------------------------------------------------------------- VAE
_DN = ("NHWC", "HWIO", "NHWC")


def _conv(x, w, stride=1):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=_DN)


def vae_init(key, chans=(64, 128, 256, 512), latent=8):
    c = (3, *chans)
    shapes = {"e0": (3, 3, 3, chans[0])}
    for i in range(1, len(chans)):
        shapes[f"e{i}"] = (3, 3, chans[i - 1], chans[i])                         # stride 2
    shapes["mu_lv"] = (1, 1, chans[-1], 2 * latent)
    shapes["d_in"] = (1, 1, latent, chans[-1])
    for i in range(len(chans) - 1, 0, -1):
        shapes[f"d{i}"] = (3, 3, chans[i], chans[i - 1])                         # after a x2 upsample
    shapes["d_out"] = (3, 3, chans[0], c[0])
    return _init(key, shapes)


def vae_train_step(params, images, seed):
    """One train step of a convolutional VAE: images bf16[b, H, W, 3]; an encoder of 3 x 3 convolutions (three
    of stride 2) to spatial latents of 8 channels (mean and log-variance by a 1 x 1 convolution), z = mean +
    exp(logvar / 2) * eps (eps drawn from seed i32[]), a decoder of nearest x2 upsampling + 3 x 3
    convolutions; loss: mean-squared reconstruction + 1e-3 x KL; SGD."""
    n = sum(1 for k in params if k.startswith("e"))
    eps_key = jax.random.key(seed)

    def loss(p):
        x = jax.nn.silu(_conv(images, p["e0"]))
        for i in range(1, n):
            x = jax.nn.silu(_conv(x, p[f"e{i}"], 2))
        mu, logvar = jnp.split(_conv(x, p["mu_lv"]).astype(F32), 2, -1)
        z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(eps_key, mu.shape, F32)
        y = jax.nn.silu(_conv(z.astype(BF16), p["d_in"]))
        for i in range(n - 1, 0, -1):
            b, h, w, c = y.shape
            y = jax.image.resize(y, (b, 2 * h, 2 * w, c), "nearest")
            y = jax.nn.silu(_conv(y, p[f"d{i}"]))
        rec = _conv(y, p["d_out"]).astype(F32)
        kl = -0.5 * jnp.mean(1 + logvar - mu * mu - jnp.exp(logvar))
        return jnp.mean(jnp.square(rec - images.astype(F32))) + 1e-3 * kl
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# ------------------------------------------------------------------------------------------------- GAN
def gan_init(key, z=128, chans=(512, 256, 128, 64)):
    g = {"fc": (z, 4 * 4 * chans[0])}
    for i in range(1, len(chans)):
        g[f"t{i}"] = (4, 4, chans[i - 1], chans[i])                              # conv_transpose, stride 2
    g["t_out"] = (4, 4, chans[-1], 3)
    dchans = (3, *chans[::-1])                                                   # 3, 64, 128, 256, 512
    d = {f"c{i}": (4, 4, dchans[i], dchans[i + 1]) for i in range(len(dchans) - 1)}
    d["fc"] = (4 * 4 * chans[0], 1)
    return {"g": _init(jax.random.fold_in(key, 0), g), "d": _init(jax.random.fold_in(key, 1), d)}


def _gen(p, z):
    c0 = p["fc"].shape[1] // 16
    x = jax.nn.relu(z @ p["fc"]).reshape(z.shape[0], 4, 4, c0)
    for i in range(1, 1 + sum(1 for k in p if k.startswith("t") and k != "t_out")):
        x = jax.nn.relu(jax.lax.conv_transpose(x, p[f"t{i}"], (2, 2), "SAME", dimension_numbers=_DN))
    return jnp.tanh(jax.lax.conv_transpose(x, p["t_out"], (2, 2), "SAME", dimension_numbers=_DN))


def _disc(p, x):
    for i in range(sum(1 for k in p if k.startswith("c"))):
        x = jax.nn.leaky_relu(_conv(x, p[f"c{i}"], 2), 0.2)
    return (x.reshape(x.shape[0], -1) @ p["fc"]).astype(F32)[:, 0]


def gan_train_step(params, real, z):
    """One DCGAN step: real bf16[b, 64, 64, 3] images, z bf16[b, 128] noise. The discriminator (4 x 4
    stride-2 convolutions, leaky ReLU) is updated on real and generated images (non-saturating logistic
    loss, the generator's output stopped), then the generator (a dense layer to 4 x 4 x 512 and stride-2
    conv_transpose layers to 64 x 64 x 3) through the updated discriminator; SGD on both."""
    fake = jax.lax.stop_gradient(_gen(params["g"], z))

    def d_loss(d):
        return jnp.mean(jax.nn.softplus(-_disc(d, real))) + jnp.mean(jax.nn.softplus(_disc(d, fake)))
    dl, dg = jax.value_and_grad(d_loss)(params["d"])
    d = _sgd(params["d"], dg)

    def g_loss(g):
        return jnp.mean(jax.nn.softplus(-_disc(d, _gen(g, z))))
    gl, gg = jax.value_and_grad(g_loss)(params["g"])
    return (dl, gl), {"g": _sgd(params["g"], gg), "d": d}


# -------------------------------------------------------------------------------------------- Perceiver
def perceiver_init(key, din=256, latents=512, d=1024, layers=6, ffn=4096, classes=1000):
    lay = {"qkv": (layers, d, 3 * d), "o": (layers, d, d), "w1": (layers, d, ffn), "w2": (layers, ffn, d),
           "n1": (layers, d), "n1b": (layers, d), "n2": (layers, d), "n2b": (layers, d)}
    return _init(key, {"latents": (latents, d), "xq": (d, d), "xk": (din, d), "xv": (din, d), "xo": (d, d),
                       "xn": (d,), "xnb": (d,), "in_n": (din,), "in_nb": (din,), "xf1": (d, ffn), "xf2": (ffn, d),
                       "layers": lay, "out_n": (d,), "out_nb": (d,), "head": (d, classes)})


def perceiver_train_step(params, inputs, labels):
    """One Perceiver train step: inputs bf16[b, N, din] (N = 16384 byte-array elements), a learned latent
    array [512, 1024] cross-attends to them once (8 heads; keys and values projected from the inputs), then
    6 latent self-attention blocks under lax.scan (pre-LN, GELU MLP), the mean latent classified; labels
    i32[b]; SGD."""
    def loss(p):
        b = inputs.shape[0]
        lat = jnp.broadcast_to(p["latents"], (b, *p["latents"].shape))
        xin = _ln(inputs, p["in_n"], p["in_nb"])
        q = _ln(lat, p["xn"], p["xnb"]) @ p["xq"]
        lat = lat + _mha(q, xin @ p["xk"], xin @ p["xv"], 8) @ p["xo"]
        lat = lat + jax.nn.gelu(lat @ p["xf1"]) @ p["xf2"]

        def block(x, w):
            q, k, v = jnp.split(_ln(x, w["n1"], w["n1b"]) @ w["qkv"], 3, -1)
            x = x + _mha(q, k, v, 8) @ w["o"]
            return x + jax.nn.gelu(_ln(x, w["n2"], w["n2b"]) @ w["w1"]) @ w["w2"], None
        lat, _ = jax.lax.scan(block, lat, p["layers"])
        return _xent(_ln(jnp.mean(lat, 1), p["out_n"], p["out_nb"]) @ p["head"], labels)
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# ------------------------------------------------------------------------------------------- DiT (adaLN)
def dit_init(key, layers=12, d=768, patch=2, cin=4, tokens=256, classes=1000, freq=256):
    lay = {"ada": (layers, d, 6 * d), "ada_b": (layers, 6 * d), "qkv": (layers, d, 3 * d), "qkv_b": (layers, 3 * d),
           "o": (layers, d, d), "o_b": (layers, d), "w1": (layers, d, 4 * d), "b1": (layers, 4 * d),
           "w2": (layers, 4 * d, d), "b2": (layers, d)}
    return _init(key, {"patch": (patch * patch * cin, d), "patch_b": (d,), "pos": (tokens, d),
                       "t1": (freq, d), "t1_b": (d,), "t2": (d, d), "t2_b": (d,), "cls": (classes + 1, d),
                       "layers": lay, "f_ada": (d, 2 * d), "f_ada_b": (2 * d,), "f_out": (d, patch * patch * cin),
                       "f_out_b": (patch * patch * cin,)})


def dit_train_step(params, latents, noise, t, y):
    """One DiT-B/2 train step: latents and noise bf16[b, 32, 32, 4], t i32[b] timesteps (modulo 1000, cosine
    schedule), y i32[b] class labels (modulo 1001, the last the null class). Patches of 2 x 2 to 256 tokens of
    768, 12 blocks under lax.scan each conditioned by adaLN-Zero (shift, scale, gate of attention and MLP from
    the timestep + class embedding), the final adaLN layer back to patches; loss: mean-squared error against
    the noise; SGD."""
    b, hgt, wid, cin = latents.shape
    pt = int(math.isqrt(params["f_out"].shape[1] // cin))
    d = params["pos"].shape[1]
    tt = (t % 1000).astype(F32)
    abar = jnp.cos((tt / 1000 + 0.008) / 1.008 * math.pi / 2) ** 2
    xt = (jnp.sqrt(abar)[:, None, None, None] * latents.astype(F32)
          + jnp.sqrt(1 - abar)[:, None, None, None] * noise.astype(F32)).astype(BF16)
    half = params["t1"].shape[0] // 2
    f = tt[:, None] * jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=F32) / half)[None]
    temb = jnp.concatenate([jnp.cos(f), jnp.sin(f)], -1).astype(BF16)

    def patchify(x):
        return x.reshape(b, hgt // pt, pt, wid // pt, pt, cin).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, pt * pt * cin)

    def loss(p):
        c = jax.nn.silu(temb @ p["t1"] + p["t1_b"]) @ p["t2"] + p["t2_b"] + p["cls"][y % p["cls"].shape[0]]
        sc = jax.nn.silu(c)                                                      # [b, d]
        x = patchify(xt) @ p["patch"] + p["patch_b"] + p["pos"]

        def block(x, w):
            m = (sc @ w["ada"] + w["ada_b"])[:, None, :]
            sh1, s1, g1, sh2, s2, g2 = jnp.split(m, 6, -1)
            q, k, v = jnp.split((_ln0(x) * (1 + s1) + sh1) @ w["qkv"] + w["qkv_b"], 3, -1)
            x = x + g1 * (_mha(q, k, v, d // 64) @ w["o"] + w["o_b"])
            h = jax.nn.gelu(((_ln0(x) * (1 + s2) + sh2) @ w["w1"]) + w["b1"], approximate=True)
            return x + g2 * (h @ w["w2"] + w["b2"]), None
        x, _ = jax.lax.scan(block, x, p["layers"])
        sh, s = jnp.split((sc @ p["f_ada"] + p["f_ada_b"])[:, None, :], 2, -1)
        out = (_ln0(x) * (1 + s) + sh) @ p["f_out"] + p["f_out_b"]
        return jnp.mean(jnp.square(out.astype(F32) - patchify(noise).astype(F32)))
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# ------------------------------------------------------------------------------------------------- CTC
def ctc_init(key, feat=160, d=512, layers=4, classes=64):
    shapes = {"w_in": (feat, d), "out": (d, classes)}
    shapes.update({f"h{i}": (d, d) for i in range(layers)})
    return _init(key, shapes)


def _ctc_nll(logp, labels):
    """CTC negative log-likelihood per sequence: logp f32[B, T, C] (blank 0), labels i32[B, L] (no blanks),
    every input and label at full length; the forward (alpha) recursion in log space under lax.scan."""
    b, _, _ = logp.shape
    n = labels.shape[1]
    ext = jnp.zeros((b, 2 * n + 1), jnp.int32).at[:, 1::2].set(labels)
    skip = jnp.concatenate([jnp.zeros((b, 2), bool), (ext[:, 2:] != 0) & (ext[:, 2:] != ext[:, :-2])], 1)
    lp = jnp.take_along_axis(logp, jnp.broadcast_to(ext[:, None, :], (b, logp.shape[1], ext.shape[1])), 2)
    neg = jnp.float32(-1e30)
    a0 = jnp.full(ext.shape, neg).at[:, :2].set(lp[:, 0, :2])

    def step(a, lpt):
        a1 = jnp.concatenate([jnp.full((b, 1), neg), a[:, :-1]], 1)
        a2 = jnp.where(skip, jnp.concatenate([jnp.full((b, 2), neg), a[:, :-2]], 1), neg)
        return jnp.logaddexp(jnp.logaddexp(a, a1), a2) + lpt, None
    a, _ = jax.lax.scan(step, a0, jnp.swapaxes(lp[:, 1:], 0, 1))
    return -jnp.logaddexp(a[:, -1], a[:, -2])


def ctc_train_step(params, features, labels):
    """One train step of a CTC acoustic model: features bf16[b, frames, 80] stacked by 2 to [b, frames / 2,
    160], an MLP encoder (4 ReLU layers of 512), 64 classes (blank 0); labels i32[b, L] (taken to 1..63);
    the mean CTC loss (the alpha recursion under lax.scan over frames / 2 steps) and its gradient; SGD."""
    b, frames, feat = features.shape
    x0 = features.reshape(b, frames // 2, 2 * feat)
    classes = params["out"].shape[1]
    lab = labels % (classes - 1) + 1

    def loss(p):
        x = jax.nn.relu(x0 @ p["w_in"])
        for i in range(sum(1 for k in p if k.startswith("h"))):
            x = jax.nn.relu(x @ p[f"h{i}"]) + x
        logp = jax.nn.log_softmax((x @ p["out"]).astype(F32), -1)
        return jnp.mean(_ctc_nll(logp, lab)) / lab.shape[1]
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# --------------------------------------------------------------------------------------------- k-means
def kmeans_step(points, centroids):
    """One Lloyd step of k-means: points f32[n, dim], centroids f32[k, dim]. Squared distances by a matmul
    (|x|^2 - 2 x c^T + |c|^2, f32[n, k]), each point's nearest centroid (argmin), the new centroids as the
    mean of their points (jax.ops.segment_sum; an empty cluster keeps its centroid) and the inertia."""
    k = centroids.shape[0]
    d2 = (jnp.sum(points * points, 1, keepdims=True) - 2 * points @ centroids.T
          + jnp.sum(centroids * centroids, 1)[None, :])
    assign = jnp.argmin(d2, 1)
    inertia = jnp.sum(jnp.min(d2, 1))
    sums = jax.ops.segment_sum(points, assign, k)
    counts = jax.ops.segment_sum(jnp.ones(points.shape[:1], F32), assign, k)
    new = jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1)[:, None], centroids)
    return new, assign, inertia


# ------------------------------------------------------------------------------- DLRM-style recommender
def dlrm_init(key, tables=26, rows=100000, dim=64, dense=13):
    pairs = (tables + 1) * tables // 2
    p = _init(key, {"bot": {"w0": (dense, 512), "w1": (512, 256), "w2": (256, dim)},
                    "top": {"w0": (pairs + dim, 1024), "w1": (1024, 1024), "w2": (1024, 512), "w3": (512, 1)}})
    p["emb"] = _normal(jax.random.fold_in(key, 99), tables * rows, dim, scale=0.01, dtype=F32)
    return p


def dlrm_train_step(params, dense, ids, clicks):
    """One train step of a DLRM-style click model: dense f32[b, 13] features through a bottom MLP to 64;
    ids i32[b, 26, bag] (taken modulo each table's rows) gathered from one stacked f32 table of 26 x rows x 64
    (table t's rows at offset t x rows) and summed per bag; the 27 vectors' pairwise dot products (upper
    triangle) with the dense vector through a top MLP to a logit; clicks i32[b] (their parity) the labels of a
    logistic loss. SGD on every parameter (the table updated whole, its gradient a scatter-add of the rows)."""
    b, tables, bag = ids.shape
    dim = params["emb"].shape[1]
    rows = params["emb"].shape[0] // tables
    flat = (ids % rows + jnp.arange(tables)[None, :, None] * rows).reshape(-1)
    iu, ju = jnp.triu_indices(tables + 1, 1)
    y = (clicks % 2).astype(F32)

    def loss(p):
        x = dense.astype(BF16)
        for i in range(3):
            x = jax.nn.relu(x @ p["bot"][f"w{i}"])
        e = p["emb"][flat].reshape(b, tables, bag, dim).sum(2)                    # embedding bags, f32
        v = jnp.concatenate([x.astype(F32)[:, None], e], 1)                      # [b, 27, dim]
        inter = jnp.einsum("bid,bjd->bij", v, v)[:, iu, ju]                      # [b, 351]
        h = jnp.concatenate([x, inter.astype(BF16)], 1)
        for i in range(3):
            h = jax.nn.relu(h @ p["top"][f"w{i}"])
        logit = (h @ p["top"]["w3"]).astype(F32)[:, 0]
        return jnp.mean(jax.nn.softplus(logit) - y * logit)
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g, lr=1e-2)


# ------------------------------------------------------------------------------------------------ NeRF
def nerf_init(key, width=256, freqs=10, dfreqs=4):
    pin, din = 3 + 6 * freqs, 3 + 6 * dfreqs
    shapes = {"l0": (pin, width), "l5": (width + pin, width), "sigma": (width, 1), "feat": (width, width),
              "rgb1": (width + din, width // 2), "rgb2": (width // 2, 3)}
    shapes.update({f"l{i}": (width, width) for i in (1, 2, 3, 4, 6, 7)})
    return _init(key, shapes)


def _posenc(x, freqs):
    f = (2.0 ** jnp.arange(freqs, dtype=F32)) * math.pi
    xf = x[..., None, :] * f[:, None]                                             # [..., freqs, 3]
    return jnp.concatenate([x, jnp.sin(xf).reshape(*x.shape[:-1], -1), jnp.cos(xf).reshape(*x.shape[:-1], -1)], -1)


def nerf_train_step(params, origins, dirs, target):
    """One NeRF train step: rays with origins, dirs and target colours f32[R, 3]; 128 samples per ray evenly
    between near 2 and far 6, positions encoded with 10 frequencies (directions 4), an 8-layer MLP of 256
    (skip into the fifth) to density and a feature, a colour head given the direction; volume rendering:
    alpha = 1 - exp(-sigma delta), transmittance = exp(-exclusive cumsum of sigma delta), weights = alpha x
    transmittance, the ray's colour their weighted sum; loss: mean-squared error; SGD."""
    samples = 128
    t = jnp.linspace(2.0, 6.0, samples, dtype=F32)
    unit = dirs / jnp.linalg.norm(dirs, axis=-1, keepdims=True)
    pts = origins[:, None, :] + unit[:, None, :] * t[None, :, None]               # [R, S, 3]
    pe = _posenc(pts, (params["l0"].shape[0] - 3) // 6).astype(BF16)
    de = jnp.broadcast_to(_posenc(unit, (params["rgb1"].shape[0] - params["feat"].shape[1] - 3) // 6)[:, None],
                          (*pts.shape[:2], params["rgb1"].shape[0] - params["feat"].shape[1])).astype(BF16)
    delta = jnp.concatenate([jnp.diff(t), jnp.full((1,), 1e10, F32)])

    def loss(p):
        h = pe
        for i in range(8):
            if i == 5:
                h = jnp.concatenate([h, pe], -1)
            h = jax.nn.relu(h @ p[f"l{i}"])
        sigma = jax.nn.relu((h @ p["sigma"]).astype(F32)[..., 0])                 # [R, S]
        c = jax.nn.relu(jnp.concatenate([h @ p["feat"], de], -1) @ p["rgb1"])
        rgb = jax.nn.sigmoid((c @ p["rgb2"]).astype(F32))                        # [R, S, 3]
        sd = sigma * delta
        trans = jnp.exp(-(jnp.cumsum(sd, -1) - sd))
        w = (1 - jnp.exp(-sd)) * trans
        return jnp.mean(jnp.square(jnp.sum(w[..., None] * rgb, 1) - target))
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)


# --------------------------------------------------------------------------------------- neural ODE, RK4
def ode_init(key, d=256, hidden=1024):
    return _init(key, {"w1": (d, hidden), "wt": (hidden,), "b1": (hidden,), "w2": (hidden, d)})


def ode_rk4(params, y0):
    """Integrate a neural ODE dy/dt = tanh(y W1 + b1 + t wt) W2 from t = 0 to 1 with 64 classical RK4 steps
    in lax.fori_loop (4 evaluations a step, bf16 matmuls, an f32 state): y0 f32[b, d] -> y(1) f32[b, d]."""
    steps = 64
    h = 1.0 / steps
    p = params

    def f(t, y):
        z = y.astype(BF16) @ p["w1"] + p["b1"] + (t * p["wt"].astype(F32)).astype(BF16)
        return (jnp.tanh(z) @ p["w2"]).astype(F32)

    def body(i, y):
        t = i.astype(F32) * h
        k1 = f(t, y)
        k2 = f(t + h / 2, y + (h / 2) * k1)
        k3 = f(t + h / 2, y + (h / 2) * k2)
        k4 = f(t + h, y + h * k3)
        return y + (h / 6) * (k1 + 2 * k2 + 2 * k3 + k4)
    return jax.lax.fori_loop(0, steps, body, y0)


# ------------------------------------------------------------------------------------------------- PPO
def ppo_init(key, obs=128, hidden=1024, actions=18):
    return _init(key, {"w0": (obs, hidden), "w1": (hidden, hidden), "pi": (hidden, actions), "v": (hidden, 1)})


def ppo_train_step(params, obs, actions, old_logp, rewards, dones, values):
    """One PPO update over a rollout of T steps x E environments: obs bf16[T, E, obs], actions i32[T, E]
    (modulo the action count), old_logp, rewards f32[T, E], dones i32[T, E] (done where divisible by 64),
    values f32[T + 1, E] (the rollout's value estimates). Advantages by GAE (gamma 0.99, lambda 0.95) in a
    reverse lax.scan over T, normalised; a shared MLP trunk (2 x 1024, tanh) with policy and value heads; the
    clipped surrogate (0.2) + 0.5 x value loss - 0.01 x entropy; SGD."""
    gamma, lam = 0.99, 0.95
    notdone = (dones % 64 != 0).astype(F32)

    def gae(carry, x):
        r, nd, v, v_next = x
        delta = r + gamma * v_next * nd - v
        adv = delta + gamma * lam * nd * carry
        return adv, adv
    _, adv = jax.lax.scan(gae, jnp.zeros_like(rewards[0]), (rewards, notdone, values[:-1], values[1:]), reverse=True)
    ret = adv + values[:-1]
    adv = (adv - jnp.mean(adv)) / (jnp.std(adv) + 1e-8)

    def loss(p):
        h = jnp.tanh(jnp.tanh(obs @ p["w0"]) @ p["w1"])
        logits = jax.nn.log_softmax((h @ p["pi"]).astype(F32), -1)
        v = (h @ p["v"]).astype(F32)[..., 0]
        logp = jnp.take_along_axis(logits, (actions % logits.shape[-1])[..., None], -1)[..., 0]
        ratio = jnp.exp(logp - old_logp)
        surr = jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv)
        entropy = -jnp.sum(jnp.exp(logits) * logits, -1)
        return -jnp.mean(surr) + 0.5 * jnp.mean(jnp.square(v - ret)) - 0.01 * jnp.mean(entropy)
    l, g = jax.value_and_grad(loss)(params)
    return l, _sgd(params, g)
