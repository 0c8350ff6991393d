"""The third round of held-back programs of the step-time suite (issue 46): twelve programs of kinds that none
of kinds.yaml, heldback_kinds.yaml and heldback2_kinds.yaml names, written after rounds 1 and 2 went to fixing
the model, so that they can say whether it holds on programs nobody fitted it to. Raw JAX with optax, as users
write train steps (heldback3.stagetool.yaml names their shapes, heldback3_kinds.yaml their kinds). Nobody
changing the model should read these programs or their measured results before their table lands; the table
(table.py --heldback3) reports them as their own group.

Train steps: a Swin transformer (shifted windows by jnp.roll, window partition, relative-position bias; AdamW),
an MLP-Mixer (token-mixing MLPs over the transposed patches; clipped AdamW on a cosine schedule), a WaveNet
(gated dilated causal 1-D convolutions, mu-law softmax; Adam), a Conformer encoder (macaron FFNs, attention,
a depthwise 1-D convolution module with batch statistics; AdamW with warm-up), a VQ-VAE (codebook argmin,
straight-through gradient, commitment loss, transposed-convolution decoder; Adam), a PointNet classifier
(input and feature transform nets, max over points, batch norm; Adam, f32 throughout), a RetNet-style LM
(chunked retention: decayed attention within a chunk, a recurrent state carried across chunks by lax.scan),
a mixture-of-depths LM (top-k token routing, gather, scatter-add back), a GPT-style LM trained by Adafactor
(f32 master weights, unrolled layers), knowledge distillation (a frozen ViT-B teacher and a small ViT student,
temperature KL), a DeepLab-style segmenter (dilated convolutions, ASPP with image pooling, bilinear upsampling,
per-pixel loss; SGD with Nesterov momentum). Kernel-like: point-cloud alignment by entropic optimal transport
(log-domain Sinkhorn iterations in lax.fori_loop, the gradient through the plan)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

F32, BF16 = jnp.float32, jnp.bfloat16


def _randn(key, shape, scale=0.02, dtype=F32):
    return (scale * jax.random.normal(key, shape, F32)).astype(dtype)


def _params(key, shapes: dict, dtype=F32):
    """A nested dict of N(0, 0.02) arrays (f32 unless ``dtype``); a name ending in ``_g`` (a norm's gain) is
    ones and one ending in ``_b`` (a bias) is zeros."""
    out = {}
    for i, (name, s) in enumerate(sorted(shapes.items())):
        k = jax.random.fold_in(key, i)
        if isinstance(s, dict):
            out[name] = _params(k, s, dtype)
        elif name.endswith("_g"):
            out[name] = jnp.ones(s, dtype)
        elif name.endswith("_b"):
            out[name] = jnp.zeros(s, dtype)
        else:
            out[name] = _randn(k, s, dtype=dtype)
    return out


def _bf(tree):
    """The tree cast to bf16 for the forward pass (f32 master weights, bf16 compute)."""
    return jax.tree.map(lambda a: a.astype(BF16), tree)


def _layernorm(x, g, b, eps=1e-5):
    x32 = x.astype(F32)
    mu = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mu).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + eps) * g.astype(F32) + b.astype(F32)).astype(x.dtype)


def _ce(logits, labels, classes):
    logp = jax.nn.log_softmax(logits.astype(F32), -1)
    return -jnp.take_along_axis(logp, (labels % classes)[..., None], -1).mean()


def _attention(q, k, v, heads, bias=None, causal=False):
    """q [b, n, d], k and v [b, m, d] -> [b, n, d]; ``bias`` is added to the [b, heads, n, m] scores."""
    b, n, d = q.shape
    m = k.shape[1]
    hd = d // heads
    q = q.reshape(b, n, heads, hd)
    k = k.reshape(b, m, heads, hd)
    v = v.reshape(b, m, heads, hd)
    s = jnp.einsum("bnhd,bmhd->bhnm", q, k).astype(F32) * (1.0 / math.sqrt(hd))
    if bias is not None:
        s = s + bias
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((n, m), bool)), s, -1e9)
    p = jax.nn.softmax(s, -1).astype(v.dtype)
    return jnp.einsum("bhnm,bmhd->bnhd", p, v).reshape(b, n, d)


def _apply(opt, state, loss_fn, *args):
    """One optimizer step: state {"params", "opt"}; returns (loss, new state)."""
    loss, g = jax.value_and_grad(loss_fn)(state["params"], *args)
    updates, opt_state = opt.update(g, state["opt"], state["params"])
    return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}


def _state(opt, params):
    return {"params": params, "opt": opt.init(params)}


# ------------------------------------------------------------------------------------------------------ Swin
SWIN_OPT = optax.adamw(1e-3, weight_decay=0.05)


def swin_init(key, dims=(96, 192, 384), depth=2, window=7, patch=4, classes=1000):
    shapes = {"embed": (patch * patch * 3, dims[0]), "embed_b": (dims[0],), "embed_ln_g": (dims[0],),
              "embed_ln_b": (dims[0],), "head_ln_g": (dims[-1],), "head_ln_b": (dims[-1],),
              "head": (dims[-1], classes), "head_b": (classes,)}
    for s, d in enumerate(dims):
        heads = d // 32
        for i in range(depth):
            shapes[f"s{s}b{i}"] = {"ln1_g": (d,), "ln1_b": (d,), "qkv": (d, 3 * d), "qkv_b": (3 * d,),
                                   "proj": (d, d), "proj_b": (d,), "rel": ((2 * window - 1) ** 2, heads),
                                   "ln2_g": (d,), "ln2_b": (d,), "fc1": (d, 4 * d), "fc1_b": (4 * d,),
                                   "fc2": (4 * d, d), "fc2_b": (d,)}
        if s + 1 < len(dims):
            shapes[f"merge{s}"] = {"ln_g": (4 * d,), "ln_b": (4 * d,), "w": (4 * d, dims[s + 1])}
    return _state(SWIN_OPT, _params(key, shapes))


def _rel_index(ws):
    """[ws*ws, ws*ws] indices into the (2ws-1)^2 relative-position table."""
    c = np.stack(np.meshgrid(np.arange(ws), np.arange(ws), indexing="ij")).reshape(2, -1)
    r = (c[:, :, None] - c[:, None, :]).transpose(1, 2, 0) + (ws - 1)
    return r[..., 0] * (2 * ws - 1) + r[..., 1]


def _shift_mask(h, w, ws, shift):
    """[windows, ws*ws, ws*ws] additive mask keeping attention within the regions a cyclic shift joined."""
    region = np.zeros((h, w), np.int32)
    cuts = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
    for i, a in enumerate(cuts):
        for j, b in enumerate(cuts):
            region[a, b] = 3 * i + j
    win = region.reshape(h // ws, ws, w // ws, ws).transpose(0, 2, 1, 3).reshape(-1, ws * ws)
    return np.where(win[:, :, None] == win[:, None, :], 0.0, -100.0).astype(np.float32)


def _swin_block(x, p, heads, ws, shift):
    b, h, w, c = x.shape
    y = _layernorm(x, p["ln1_g"], p["ln1_b"])
    if shift:
        y = jnp.roll(y, (-shift, -shift), (1, 2))
    y = y.reshape(b, h // ws, ws, w // ws, ws, c).transpose(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
    q, k, v = jnp.split(y @ p["qkv"] + p["qkv_b"], 3, -1)
    bias = p["rel"][_rel_index(ws)].transpose(2, 0, 1).astype(F32)[None]            # [1, heads, n, n]
    nw = (h // ws) * (w // ws)
    if shift:
        bias = (bias + jnp.asarray(_shift_mask(h, w, ws, shift))[:, None]).reshape(1, nw, heads, ws * ws, ws * ws)
        bias = jnp.broadcast_to(bias, (b, nw, heads, ws * ws, ws * ws)).reshape(b * nw, heads, ws * ws, ws * ws)
    y = _attention(q, k, v, heads, bias) @ p["proj"] + p["proj_b"]
    y = y.reshape(b, h // ws, w // ws, ws, ws, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
    if shift:
        y = jnp.roll(y, (shift, shift), (1, 2))
    x = x + y
    z = _layernorm(x, p["ln2_g"], p["ln2_b"])
    return x + jax.nn.gelu(z @ p["fc1"] + p["fc1_b"]) @ p["fc2"] + p["fc2_b"]


def swin_train_step(state, images, labels):
    """One Swin-T-style train step (three stages, 96/192/384 channels, 2 blocks each, 7 x 7 windows, every
    second block shifted by jnp.roll with its region mask), images bf16[b, 224, 224, 3], labels i32[b];
    f32 master weights, bf16 compute; AdamW."""
    def loss(p, images, labels):
        p = _bf(p)
        b, hh, ww, _ = images.shape
        ps = 4
        x = images.reshape(b, hh // ps, ps, ww // ps, ps, 3).transpose(0, 1, 3, 2, 4, 5)
        x = x.reshape(b, hh // ps, ww // ps, ps * ps * 3) @ p["embed"] + p["embed_b"]
        x = _layernorm(x, p["embed_ln_g"], p["embed_ln_b"])
        s = 0
        while f"s{s}b0" in p:
            c = x.shape[-1]
            i = 0
            while f"s{s}b{i}" in p:
                x = _swin_block(x, p[f"s{s}b{i}"], c // 32, 7, 3 if i % 2 else 0)
                i += 1
            if f"merge{s}" in p:
                m = p[f"merge{s}"]
                x = jnp.concatenate([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
                x = _layernorm(x, m["ln_g"], m["ln_b"]) @ m["w"]
            s += 1
        x = _layernorm(x.mean((1, 2)), p["head_ln_g"], p["head_ln_b"])
        return _ce(x @ p["head"] + p["head_b"], labels, p["head"].shape[1])
    return _apply(SWIN_OPT, state, loss, images, labels)


# ------------------------------------------------------------------------------------------------ MLP-Mixer
MIXER_OPT = optax.chain(optax.clip_by_global_norm(1.0),
                        optax.adamw(optax.cosine_decay_schedule(1e-3, 10000), weight_decay=0.1))


def mixer_init(key, layers=8, d=768, tokens=196, token_mlp=384, channel_mlp=3072, patch=16, classes=1000):
    blk = {"ln1_g": (d,), "ln1_b": (d,), "t1": (tokens, token_mlp), "t1_b": (token_mlp,), "t2": (token_mlp, tokens),
           "t2_b": (tokens,), "ln2_g": (d,), "ln2_b": (d,), "c1": (d, channel_mlp), "c1_b": (channel_mlp,),
           "c2": (channel_mlp, d), "c2_b": (d,)}
    shapes = {"stem": (patch * patch * 3, d), "stem_b": (d,), "ln_g": (d,), "ln_b": (d,), "head": (d, classes),
              "head_b": (classes,), **{f"layer{i:02d}": blk for i in range(layers)}}
    return _state(MIXER_OPT, _params(key, shapes))


def mixer_train_step(state, images, labels):
    """One MLP-Mixer-B/16-style train step (8 layers, d 768, token MLP 384, channel MLP 3072), images
    bf16[b, 224, 224, 3], labels i32[b]; token mixing as a matmul over the transposed patch axis; clipped AdamW
    on a cosine schedule."""
    def loss(p, images, labels):
        p = _bf(p)
        b, hh, ww, _ = images.shape
        ps = 16
        x = images.reshape(b, hh // ps, ps, ww // ps, ps, 3).transpose(0, 1, 3, 2, 4, 5)
        x = x.reshape(b, (hh // ps) * (ww // ps), ps * ps * 3) @ p["stem"] + p["stem_b"]
        for name in sorted(k for k in p if k.startswith("layer")):
            w = p[name]
            y = _layernorm(x, w["ln1_g"], w["ln1_b"]).swapaxes(1, 2)                 # [b, d, tokens]
            y = jax.nn.gelu(y @ w["t1"] + w["t1_b"]) @ w["t2"] + w["t2_b"]
            x = x + y.swapaxes(1, 2)
            y = _layernorm(x, w["ln2_g"], w["ln2_b"])
            x = x + jax.nn.gelu(y @ w["c1"] + w["c1_b"]) @ w["c2"] + w["c2_b"]
        x = _layernorm(x, p["ln_g"], p["ln_b"]).mean(1)
        return _ce(x @ p["head"] + p["head_b"], labels, p["head"].shape[1])
    return _apply(MIXER_OPT, state, loss, images, labels)


# --------------------------------------------------------------------------------------------------- WaveNet
WAVENET_OPT = optax.adam(3e-4)


def wavenet_init(key, stacks=2, layers=10, res=128, skip=256, q=256):
    shapes = {"embed": (q, res), "out1": (skip, skip), "out1_b": (skip,), "out2": (skip, q), "out2_b": (q,)}
    for i in range(stacks * layers):
        shapes[f"l{i:02d}"] = {"dil": (2, res, 2 * res), "dil_b": (2 * res,), "res": (res, res), "res_b": (res,),
                               "skip": (res, skip), "skip_b": (skip,)}
    return _state(WAVENET_OPT, _params(key, shapes))


def wavenet_train_step(state, audio):
    """One WaveNet train step: audio i32[b, T] mu-law sample ids (taken modulo 256), each sample predicted from
    the ones before it; 2 stacks of 10 gated causal convolutions of kernel 2 dilated 1, 2, ..., 512 (left
    padding), residual 128 and skip 256 channels, a 256-way softmax; Adam."""
    def loss(p, audio):
        p = _bf(p)
        q = p["embed"].shape[0]
        ids = audio % q
        x = p["embed"][ids[:, :-1]]                                                   # [b, T-1, res]
        res = x.shape[-1]
        skips = 0.0
        for i, name in enumerate(sorted(k for k in p if k.startswith("l"))):
            w = p[name]
            d = 2 ** (i % 10)
            h = jax.lax.conv_general_dilated(x, w["dil"], (1,), [(d, 0)], rhs_dilation=(d,),
                                             dimension_numbers=("NWC", "WIO", "NWC")) + w["dil_b"]
            h = jnp.tanh(h[..., :res]) * jax.nn.sigmoid(h[..., res:])
            skips = skips + (h @ w["skip"] + w["skip_b"])
            x = x + h @ w["res"] + w["res_b"]
        y = jax.nn.relu(jax.nn.relu(skips) @ p["out1"] + p["out1_b"]) @ p["out2"] + p["out2_b"]
        return _ce(y, ids[:, 1:], q)
    return _apply(WAVENET_OPT, state, loss, audio)


# ------------------------------------------------------------------------------------------------- Conformer
CONFORMER_OPT = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 1000, 100000), weight_decay=1e-2)


def conformer_init(key, blocks=8, d=256, heads=4, kernel=31, mel=80, sub=144, classes=512):
    ffn = {"ln_g": (d,), "ln_b": (d,), "w1": (d, 4 * d), "w1_b": (4 * d,), "w2": (4 * d, d), "w2_b": (d,)}
    blk = {"ff1": ffn, "ff2": ffn, "att_ln_g": (d,), "att_ln_b": (d,), "qkv": (d, 3 * d), "qkv_b": (3 * d,),
           "o": (d, d), "o_b": (d,), "conv_ln_g": (d,), "conv_ln_b": (d,), "pw1": (d, 2 * d), "pw1_b": (2 * d,),
           "dw": (kernel, 1, d), "dw_b": (d,), "bn_g": (d,), "bn_b": (d,), "pw2": (d, d), "pw2_b": (d,),
           "out_ln_g": (d,), "out_ln_b": (d,)}
    shapes = {"sub1": (3, 3, 1, sub), "sub1_b": (sub,), "sub2": (3, 3, sub, sub), "sub2_b": (sub,),
              "proj": ((mel // 4) * sub, d), "proj_b": (d,), "head": (d, classes), "head_b": (classes,),
              **{f"block{i}": blk for i in range(blocks)}}
    del heads
    return _state(CONFORMER_OPT, _params(key, shapes))


def _ffn(x, w):
    y = _layernorm(x, w["ln_g"], w["ln_b"])
    return jax.nn.silu(y @ w["w1"] + w["w1_b"]) @ w["w2"] + w["w2_b"]


def conformer_train_step(state, features, labels):
    """One Conformer encoder train step: features bf16[b, T, 80] (log-mel), labels i32[b, T/4] (one per frame
    after the 4x convolutional subsampling, taken modulo 512); 8 blocks of d 256: half-step FFN, 4-head
    self-attention, a convolution module (pointwise + GLU, depthwise 1-D convolution of kernel 31, batch norm on
    the batch's statistics, swish, pointwise), half-step FFN, LayerNorm; AdamW with warm-up."""
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(p, features, labels):
        p = _bf(p)
        x = features[..., None]
        x = jax.nn.relu(jax.lax.conv_general_dilated(x, p["sub1"], (2, 2), "SAME", dimension_numbers=dn) + p["sub1_b"])
        x = jax.nn.relu(jax.lax.conv_general_dilated(x, p["sub2"], (2, 2), "SAME", dimension_numbers=dn) + p["sub2_b"])
        b, t = x.shape[:2]
        x = x.reshape(b, t, -1) @ p["proj"] + p["proj_b"]
        d = x.shape[-1]
        for name in sorted(k for k in p if k.startswith("block")):
            w = p[name]
            x = x + 0.5 * _ffn(x, w["ff1"])
            y = _layernorm(x, w["att_ln_g"], w["att_ln_b"])
            q, k, v = jnp.split(y @ w["qkv"] + w["qkv_b"], 3, -1)
            x = x + _attention(q, k, v, 4) @ w["o"] + w["o_b"]
            y = _layernorm(x, w["conv_ln_g"], w["conv_ln_b"]) @ w["pw1"] + w["pw1_b"]
            y = y[..., :d] * jax.nn.sigmoid(y[..., d:])
            y = jax.lax.conv_general_dilated(y, w["dw"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
                                             feature_group_count=d) + w["dw_b"]
            y32 = y.astype(F32)
            mu, var = y32.mean((0, 1)), y32.var((0, 1))
            y = ((y32 - mu) * jax.lax.rsqrt(var + 1e-5) * w["bn_g"] + w["bn_b"]).astype(BF16)
            x = x + jax.nn.silu(y) @ w["pw2"] + w["pw2_b"]
            x = x + 0.5 * _ffn(x, w["ff2"])
            x = _layernorm(x, w["out_ln_g"], w["out_ln_b"])
        return _ce(x @ p["head"] + p["head_b"], labels[:, :t], p["head"].shape[1])
    return _apply(CONFORMER_OPT, state, loss, features, labels)


# ---------------------------------------------------------------------------------------------------- VQ-VAE
VQ_OPT = optax.adam(2e-4)
_DN = ("NHWC", "HWIO", "NHWC")


def vqvae_init(key, ch=128, dim=64, codes=1024):
    shapes = {"e1": (4, 4, 3, ch // 2), "e1_b": (ch // 2,), "e2": (4, 4, ch // 2, ch), "e2_b": (ch,),
              "e_pre": (1, 1, ch, dim), "e_pre_b": (dim,), "codebook": (codes, dim),
              "d_in": (3, 3, dim, ch), "d_in_b": (ch,), "d1": (4, 4, ch, ch // 2), "d1_b": (ch // 2,),
              "d2": (4, 4, ch // 2, 3), "d2_b": (3,)}
    for side in ("e", "d"):
        for i in range(2):
            shapes[f"{side}res{i}"] = {"a": (3, 3, ch, ch // 2), "a_b": (ch // 2,), "c": (1, 1, ch // 2, ch),
                                       "c_b": (ch,)}
    p = _params(key, shapes)
    p["codebook"] = jax.random.uniform(jax.random.fold_in(key, 7), (codes, dim), F32, -1 / codes, 1 / codes)
    return _state(VQ_OPT, p)


def _conv(x, w, stride=1, padding="SAME"):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=_DN)


def _resblock(x, w):
    h = _conv(jax.nn.relu(x), w["a"]) + w["a_b"]
    return x + _conv(jax.nn.relu(h), w["c"]) + w["c_b"]


def vqvae_train_step(state, images):
    """One VQ-VAE train step: images bf16[b, 128, 128, 3]; an encoder of two 4 x 4 stride-2 convolutions and two
    residual blocks to 32 x 32 latents of 64, each latent replaced by its nearest of 1024 codes (squared distance
    by matmul, argmin), the straight-through estimator, codebook and commitment (0.25) losses; a decoder of two
    residual blocks and two 4 x 4 stride-2 transposed convolutions; mean-squared reconstruction; Adam."""
    def loss(p, images):
        cb = p["codebook"]
        p = _bf(p)
        x = jax.nn.relu(_conv(images, p["e1"], 2) + p["e1_b"])
        x = _conv(x, p["e2"], 2) + p["e2_b"]
        for i in range(2):
            x = _resblock(x, p[f"eres{i}"])
        z = (_conv(jax.nn.relu(x), p["e_pre"]) + p["e_pre_b"]).astype(F32)         # [b, h, w, dim]
        flat = z.reshape(-1, z.shape[-1])
        dist = (jnp.sum(flat * flat, -1, keepdims=True) - 2 * flat @ cb.T + jnp.sum(cb * cb, -1)[None])
        idx = jnp.argmin(dist, -1)
        q = cb[idx].reshape(z.shape)
        vq_loss = jnp.mean(jnp.square(jax.lax.stop_gradient(z) - q)) + 0.25 * jnp.mean(
            jnp.square(z - jax.lax.stop_gradient(q)))
        zq = (z + jax.lax.stop_gradient(q - z)).astype(BF16)
        y = _conv(zq, p["d_in"]) + p["d_in_b"]
        for i in range(2):
            y = _resblock(y, p[f"dres{i}"])
        y = jax.nn.relu(y)
        y = jax.nn.relu(jax.lax.conv_transpose(y, p["d1"], (2, 2), "SAME", dimension_numbers=_DN) + p["d1_b"])
        y = jax.lax.conv_transpose(y, p["d2"], (2, 2), "SAME", dimension_numbers=_DN) + p["d2_b"]
        return jnp.mean(jnp.square(y.astype(F32) - images.astype(F32))) + vq_loss
    return _apply(VQ_OPT, state, loss, images)


# -------------------------------------------------------------------------------------------------- PointNet
POINTNET_OPT = optax.adam(1e-3)


def pointnet_init(key, classes=40):
    def tnet(k):
        return {"c1": (k, 64), "c2": (64, 128), "c3": (128, 1024), "f1": (1024, 512), "f2": (512, 256),
                "f3": (256, k * k), **{f"bn{i}_g": (n,) for i, n in enumerate((64, 128, 1024, 512, 256))},
                **{f"bn{i}_b": (n,) for i, n in enumerate((64, 128, 1024, 512, 256))}}
    widths = (64, 64, 64, 128, 1024)
    shapes = {"t3": tnet(3), "t64": tnet(64), "m1": (3, 64), "m2": (64, 64), "m3": (64, 64), "m4": (64, 128),
              "m5": (128, 1024), "f1": (1024, 512), "f2": (512, 256), "f3": (256, classes), "f3_b": (classes,),
              **{f"bn{i}_g": (n,) for i, n in enumerate((*widths, 512, 256))},
              **{f"bn{i}_b": (n,) for i, n in enumerate((*widths, 512, 256))}}
    return _state(POINTNET_OPT, _params(key, shapes))


def _bn(x, g, b):
    axes = tuple(range(x.ndim - 1))
    mu, var = x.mean(axes), x.var(axes)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b


def _tnet(x, w):
    k = w["c1"].shape[0]
    h = x
    for i, c in enumerate(("c1", "c2", "c3")):
        h = jax.nn.relu(_bn(h @ w[c], w[f"bn{i}_g"], w[f"bn{i}_b"]))
    h = h.max(1)                                                                       # [b, 1024]
    for i, f in enumerate(("f1", "f2"), 3):
        h = jax.nn.relu(_bn(h @ w[f], w[f"bn{i}_g"], w[f"bn{i}_b"]))
    return (h @ w["f3"]).reshape(-1, k, k) + jnp.eye(k, dtype=h.dtype)


def pointnet_train_step(state, points, labels):
    """One PointNet classification train step, f32 throughout: points f32[b, N, 3], labels i32[b] (taken modulo
    40); an input transform net (3 x 3) and a feature transform net (64 x 64) applied by batched matmuls, shared
    per-point MLPs 64-64-64-128-1024 with batch norm over batch and points, max over the points, an MLP head;
    the feature transform's orthogonality penalty; Adam."""
    def loss(p, points, labels):
        x = points @ _tnet(points, p["t3"])
        for i, m in enumerate(("m1", "m2")):
            x = jax.nn.relu(_bn(x @ p[m], p[f"bn{i}_g"], p[f"bn{i}_b"]))
        t = _tnet(x, p["t64"])
        x = x @ t
        for i, m in enumerate(("m3", "m4", "m5"), 2):
            x = jax.nn.relu(_bn(x @ p[m], p[f"bn{i}_g"], p[f"bn{i}_b"]))
        x = x.max(1)
        for i, f in enumerate(("f1", "f2"), 5):
            x = jax.nn.relu(_bn(x @ p[f], p[f"bn{i}_g"], p[f"bn{i}_b"]))
        reg = jnp.mean(jnp.sum(jnp.square(t @ t.swapaxes(1, 2) - jnp.eye(t.shape[1])), (1, 2)))
        return _ce(x @ p["f3"] + p["f3_b"], labels, p["f3"].shape[1]) + 1e-3 * reg
    return _apply(POINTNET_OPT, state, loss, points, labels)


# ---------------------------------------------------------------------------------------- RetNet (chunked)
RETNET_OPT = optax.adamw(6e-4, b2=0.98, weight_decay=0.05)


def retnet_init(key, layers=4, d=768, heads=6, vocab=16000):
    lay = {"ln1_g": (layers, d), "ln1_b": (layers, d), "q": (layers, d, d), "k": (layers, d, d), "v": (layers, d, d),
           "g": (layers, d, d), "o": (layers, d, d), "gn_g": (layers, d), "gn_b": (layers, d),
           "ln2_g": (layers, d), "ln2_b": (layers, d), "w1": (layers, d, 4 * d), "w2": (layers, 4 * d, d)}
    del heads
    return _state(RETNET_OPT, _params(key, {"emb": (vocab, d), "layers": lay, "ln_g": (d,), "ln_b": (d,)}))


def _retention(q, k, v, heads, chunk):
    """Chunked retention: q, k, v [b, L, d] -> [b, L, d]. Per head a decay gamma; within a chunk the decayed
    causal product (q k^T * D) v, across chunks a state [hd, hd] carried by lax.scan."""
    b, length, d = q.shape
    hd = d // heads
    n = length // chunk
    gamma = 1.0 - 2.0 ** (-5.0 - jnp.arange(heads, dtype=F32))                        # [h]
    lg = jnp.log(gamma)
    pos = jnp.arange(chunk, dtype=F32)
    decay = jnp.exp(lg[:, None, None] * (pos[:, None] - pos[None, :]))                 # [h, c, c]
    decay = jnp.where(pos[:, None] >= pos[None, :], decay, 0.0)
    q_in = jnp.exp(lg[:, None] * (pos[None, :] + 1))                                   # [h, c] decay from state
    k_out = jnp.exp(lg[:, None] * (chunk - 1 - pos[None, :]))                         # [h, c] decay into state
    whole = jnp.exp(lg * chunk)                                                         # [h]

    def split(t):  # [n, b, h, c, hd]
        return t.reshape(b, n, chunk, heads, hd).transpose(1, 0, 3, 2, 4)
    qs, ks, vs = split(q * (1.0 / math.sqrt(hd))), split(k), split(v)

    def step(s, qkv):
        qc, kc, vc = qkv
        inner = jnp.einsum("bhcd,bhed->bhce", qc, kc).astype(F32) * decay
        o = jnp.einsum("bhce,bhed->bhcd", inner.astype(vc.dtype), vc).astype(F32)
        o = o + jnp.einsum("bhcd,bhde->bhce", qc.astype(F32), s) * q_in[None, :, :, None]
        s = s * whole[None, :, None, None] + jnp.einsum("bhcd,bhce->bhde", (kc.astype(F32) * k_out[None, :, :, None]),
                                                        vc.astype(F32))
        return s, o
    _, out = jax.lax.scan(step, jnp.zeros((b, heads, hd, hd), F32), (qs, ks, vs))
    return out.transpose(1, 0, 3, 2, 4).reshape(b, length, heads, hd)


def retnet_train_step(state, tokens):
    """One RetNet-style LM train step: tokens i32[b, L] (ids modulo the vocabulary), next-token loss; 4 layers
    (under lax.scan) of d 768 with 6 retention heads computed chunk by chunk (chunks of 128, the state carried by
    an inner lax.scan), group norm per head and a swish gate, a GELU FFN; embedding tied to the output; AdamW."""
    heads, chunk = 6, 128

    def loss(p, tokens):
        p = _bf(p)
        vocab, d = p["emb"].shape
        ids = tokens % vocab
        x = p["emb"][ids[:, :-1]]
        x = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))                                       # L a multiple of chunk

        def layer(x, w):
            y = _layernorm(x, w["ln1_g"], w["ln1_b"])
            r = _retention(y @ w["q"], y @ w["k"], y @ w["v"], heads, chunk)          # [b, L, h, hd] f32
            mu = r.mean(-1, keepdims=True)
            r = (r - mu) * jax.lax.rsqrt(r.var(-1, keepdims=True) + 1e-5)
            r = r.reshape(x.shape).astype(BF16) * w["gn_g"] + w["gn_b"]
            x = x + (jax.nn.silu(y @ w["g"]) * r) @ w["o"]
            y = _layernorm(x, w["ln2_g"], w["ln2_b"])
            return x + jax.nn.gelu(y @ w["w1"]) @ w["w2"], None
        x, _ = jax.lax.scan(layer, x, p["layers"])
        x = _layernorm(x[:, :-1], p["ln_g"], p["ln_b"])
        return _ce(x @ p["emb"].T, ids[:, 1:], vocab)
    return _apply(RETNET_OPT, state, loss, tokens)


# --------------------------------------------------------------------------------------- mixture of depths
MOD_OPT = optax.adamw(3e-4, weight_decay=0.1)


def mod_init(key, layers=8, d=1024, heads=16, vocab=32000, ctx=1024):
    blk = {"ln1_g": (d,), "ln1_b": (d,), "qkv": (d, 3 * d), "o": (d, d), "ln2_g": (d,), "ln2_b": (d,),
           "w1": (d, 4 * d), "w2": (4 * d, d), "router": (d,)}
    del heads
    shapes = {"emb": (vocab, d), "pos": (ctx, d), "ln_g": (d,), "ln_b": (d,), "out": (d, vocab),
              **{f"layer{i}": blk for i in range(layers)}}
    return _state(MOD_OPT, _params(key, shapes))


def _gpt_block(x, w, heads, mask_pos=None):
    y = _layernorm(x, w["ln1_g"], w["ln1_b"])
    q, k, v = jnp.split(y @ w["qkv"], 3, -1)
    if mask_pos is None:
        a = _attention(q, k, v, heads, causal=True)
    else:  # routed tokens keep causality by their original positions
        bias = jnp.where(mask_pos[:, :, None] >= mask_pos[:, None, :], 0.0, -1e9)[:, None]
        a = _attention(q, k, v, heads, bias)
    x = x + a @ w["o"]
    y = _layernorm(x, w["ln2_g"], w["ln2_b"])
    return x + jax.nn.gelu(y @ w["w1"]) @ w["w2"]


def mod_train_step(state, tokens):
    """One mixture-of-depths LM train step: tokens i32[b, L]; 8 GPT blocks of d 1024 (16 heads), every second
    one routed: a router scores each token, the top 12.5% of each sequence (lax.top_k, kept in order) are
    gathered, go through the block (causal by their positions), and their change, scaled by the router's
    sigmoid, is scatter-added back; the rest skip it; AdamW."""
    heads = 16

    def loss(p, tokens):
        p = _bf(p)
        vocab = p["emb"].shape[0]
        ids = tokens % vocab
        b, length = ids.shape
        x = p["emb"][ids[:, :-1]] + p["pos"][: length - 1]
        cap = (length - 1) // 8
        rows = jnp.arange(b)[:, None]
        for i, name in enumerate(sorted(k for k in p if k.startswith("layer"))):
            w = p[name]
            if i % 2 == 0:
                x = _gpt_block(x, w, heads)
                continue
            score = (x @ w["router"]).astype(F32)                                     # [b, L]
            _, idx = jax.lax.top_k(score, cap)
            idx = jnp.sort(idx, -1)
            xs = x[rows, idx]                                                          # [b, cap, d]
            delta = _gpt_block(xs, w, heads, mask_pos=idx) - xs
            gate = jax.nn.sigmoid(jnp.take_along_axis(score, idx, -1))[..., None].astype(BF16)
            x = x.at[rows, idx].add(delta * gate)
        x = _layernorm(x, p["ln_g"], p["ln_b"])
        return _ce(x @ p["out"], ids[:, 1:], vocab)
    return _apply(MOD_OPT, state, loss, tokens)


# ---------------------------------------------------------------------------------------- Adafactor-trained LM
ADAFACTOR_OPT = optax.adafactor(learning_rate=1e-2)


def adafactor_lm_init(key, layers=6, d=1024, vocab=32000, ctx=1024):
    shapes = {"emb": (vocab, d), "pos": (ctx, d), "ln_g": (d,), "ln_b": (d,), "out": (d, vocab),
              **{f"layer{i}": {"ln1_g": (d,), "ln1_b": (d,), "qkv": (d, 3 * d), "o": (d, d), "ln2_g": (d,),
                               "ln2_b": (d,), "w1": (d, 4 * d), "w2": (4 * d, d)} for i in range(layers)}}
    return _state(ADAFACTOR_OPT, _params(key, shapes))


def adafactor_lm_train_step(state, tokens):
    """One GPT-style LM train step under optax.adafactor (factored second moments of every matrix, update
    clipping, relative step size): tokens i32[b, L]; 6 pre-LN causal blocks of d 1024 (16 heads), unrolled
    in Python, f32 master weights cast to bf16 for compute, an untied 32000-way output."""
    def loss(p, tokens):
        p = _bf(p)
        vocab = p["emb"].shape[0]
        ids = tokens % vocab
        x = p["emb"][ids[:, :-1]] + p["pos"][: ids.shape[1] - 1]
        for name in sorted(k for k in p if k.startswith("layer")):
            x = _gpt_block(x, p[name], 16)
        x = _layernorm(x, p["ln_g"], p["ln_b"])
        return _ce(x @ p["out"], ids[:, 1:], vocab)
    return _apply(ADAFACTOR_OPT, state, loss, tokens)


# -------------------------------------------------------------------------------------- knowledge distillation
DISTILL_OPT = optax.adamw(5e-4, weight_decay=0.05)


def _vit_shapes(layers, d, classes=1000, patch=16, tokens=197):
    lay = {"ln1_g": (layers, d), "ln1_b": (layers, d), "qkv": (layers, d, 3 * d), "qkv_b": (layers, 3 * d),
           "o": (layers, d, d), "o_b": (layers, d), "ln2_g": (layers, d), "ln2_b": (layers, d),
           "w1": (layers, d, 4 * d), "w1_b": (layers, 4 * d), "w2": (layers, 4 * d, d), "w2_b": (layers, d)}
    return {"patch": (patch * patch * 3, d), "patch_b": (d,), "cls": (d,), "pos": (tokens, d), "layers": lay,
            "ln_g": (d,), "ln_b": (d,), "head": (d, classes), "head_b": (classes,)}


def teacher_init(key, layers=12, d=768, tokens=197):
    """The frozen teacher: ViT-B/16 weights in bf16 (no optimizer state)."""
    return _params(key, _vit_shapes(layers, d, tokens=tokens), BF16)


def student_init(key, layers=6, d=384, tokens=197):
    return _state(DISTILL_OPT, _params(key, _vit_shapes(layers, d, tokens=tokens)))


def _vit(p, images, heads):
    b, hh, ww, _ = images.shape
    ps = 16
    x = images.reshape(b, hh // ps, ps, ww // ps, ps, 3).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(b, -1, ps * ps * 3) @ p["patch"] + p["patch_b"]
    x = jnp.concatenate([jnp.broadcast_to(p["cls"], (b, 1, x.shape[-1])), x], 1) + p["pos"]

    def layer(x, w):
        y = _layernorm(x, w["ln1_g"], w["ln1_b"])
        q, k, v = jnp.split(y @ w["qkv"] + w["qkv_b"], 3, -1)
        x = x + _attention(q, k, v, heads) @ w["o"] + w["o_b"]
        y = _layernorm(x, w["ln2_g"], w["ln2_b"])
        return x + jax.nn.gelu(y @ w["w1"] + w["w1_b"]) @ w["w2"] + w["w2_b"], None
    x, _ = jax.lax.scan(layer, x, p["layers"])
    return _layernorm(x[:, 0], p["ln_g"], p["ln_b"]) @ p["head"] + p["head_b"]


def distill_train_step(student, teacher, images, labels):
    """One knowledge-distillation step: a frozen ViT-B/16 teacher (bf16, forward only) and a 6-layer d-384 ViT
    student (f32 master weights, bf16 compute) on images bf16[b, 224, 224, 3], labels i32[b]; loss 0.5 x the
    student's cross-entropy + 0.5 x T^2 x KL(teacher || student) at temperature T = 4; AdamW on the student."""
    t_logits = jax.lax.stop_gradient(_vit(teacher, images, 12)).astype(F32)
    temp = 4.0

    def loss(p, images, labels):
        s_logits = _vit(_bf(p), images, 6).astype(F32)
        t_logp = jax.nn.log_softmax(t_logits / temp, -1)
        s_logp = jax.nn.log_softmax(s_logits / temp, -1)
        kl = jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), -1).mean()
        return 0.5 * _ce(s_logits, labels, s_logits.shape[-1]) + 0.5 * temp * temp * kl
    return _apply(DISTILL_OPT, student, loss, images, labels)


# --------------------------------------------------------------------------------------- Sinkhorn transport
def sinkhorn_align(source, target, iterations=50, eps=0.05, lr=0.1):
    """One step of aligning point clouds by entropic optimal transport: source and target f32[b, n, d]; the
    squared-distance cost (by matmul), ``iterations`` log-domain Sinkhorn updates of the dual potentials in
    lax.fori_loop (uniform marginals, no gradient through them), the plan exp((f + g - C) / eps), the transport
    cost <P, C> and its gradient with respect to the source (through C at the fixed plan, by jax.grad); returns
    (cost f32[b], the moved source)."""
    b, n, _ = source.shape
    m = target.shape[1]
    log_a, log_b = -math.log(n), -math.log(m)

    def cost(x):
        return (jnp.sum(x * x, -1)[:, :, None] + jnp.sum(target * target, -1)[:, None, :]
                - 2 * jnp.einsum("bnd,bmd->bnm", x, target))

    c = jax.lax.stop_gradient(cost(source))

    def body(_, fg):
        f, g = fg
        f = eps * log_a - eps * jax.nn.logsumexp((g[:, None, :] - c) / eps, -1)
        g = eps * log_b - eps * jax.nn.logsumexp((f[:, :, None] - c) / eps, 1)
        return f, g
    f, g = jax.lax.fori_loop(0, iterations, body, (jnp.zeros((b, n), F32), jnp.zeros((b, m), F32)))
    plan = jnp.exp((f[:, :, None] + g[:, None, :] - c) / eps)

    def transport(x):
        per = jnp.sum(plan * cost(x), (1, 2))
        return per.sum(), per
    (_, per), grad = jax.value_and_grad(transport, has_aux=True)(source)
    return per, source - lr * grad * n


# ------------------------------------------------------------------------------------------- DeepLab / ASPP
ASPP_OPT = optax.sgd(optax.polynomial_schedule(0.01, 0.0, 0.9, 30000), momentum=0.9, nesterov=True)


def aspp_init(key, classes=21):
    shapes = {"c1": (3, 3, 3, 32), "c2": (3, 3, 32, 64), "c3": (3, 3, 64, 128), "c4": (3, 3, 128, 256),
              "c5": (3, 3, 256, 256), "a0": (1, 1, 256, 256), "a6": (3, 3, 256, 256), "a12": (3, 3, 256, 256),
              "a18": (3, 3, 256, 256), "pool": (256, 256), "fuse": (1, 1, 5 * 256, 256), "cls": (1, 1, 256, classes),
              "cls_b": (classes,), **{f"{n}_b": (c,) for n, c in (("c1", 32), ("c2", 64), ("c3", 128), ("c4", 256),
                                                                   ("c5", 256), ("a0", 256), ("a6", 256),
                                                                   ("a12", 256), ("a18", 256), ("pool", 256),
                                                                   ("fuse", 256))}}
    return _state(ASPP_OPT, _params(key, shapes))


def aspp_train_step(state, images, labels):
    """One DeepLab-v3-style segmentation train step: images bf16[b, H, W, 3], labels i32[b, H, W] (taken modulo
    21); a backbone of three stride-2 3 x 3 convolutions and two 3 x 3 convolutions dilated by 2 (output stride
    8), ASPP (1 x 1, 3 x 3 dilated 6, 12 and 18, image pooling), a 1 x 1 fusion and classifier, bilinear x8
    upsampling (jax.image.resize), per-pixel cross-entropy; SGD with Nesterov momentum on a poly schedule."""
    def conv(x, w, bias, stride=1, dilation=1):
        k = w.shape[0]
        pad = dilation * (k // 2)
        y = jax.lax.conv_general_dilated(x, w, (stride, stride), [(pad, pad), (pad, pad)], rhs_dilation=(dilation,) * 2,
                                         dimension_numbers=_DN)
        return jax.nn.relu(y + bias)

    def loss(p, images, labels):
        p = _bf(p)
        b, hh, ww, _ = images.shape
        x = conv(images, p["c1"], p["c1_b"], 2)
        x = conv(x, p["c2"], p["c2_b"], 2)
        x = conv(x, p["c3"], p["c3_b"], 2)
        x = conv(x, p["c4"], p["c4_b"], 1, 2)
        x = conv(x, p["c5"], p["c5_b"], 1, 2)
        branches = [conv(x, p["a0"], p["a0_b"])] + [conv(x, p[f"a{r}"], p[f"a{r}_b"], 1, r) for r in (6, 12, 18)]
        pooled = jax.nn.relu(x.mean((1, 2)) @ p["pool"] + p["pool_b"])
        branches.append(jnp.broadcast_to(pooled[:, None, None], branches[0].shape))
        y = conv(jnp.concatenate(branches, -1), p["fuse"], p["fuse_b"])
        y = jax.lax.conv_general_dilated(y, p["cls"], (1, 1), "SAME", dimension_numbers=_DN) + p["cls_b"]
        y = jax.image.resize(y.astype(F32), (b, hh, ww, y.shape[-1]), "bilinear")
        return _ce(y, labels, y.shape[-1])
    return _apply(ASPP_OPT, state, loss, images, labels)
