"""Vision programs of the step-time suite in plain JAX (NHWC, bf16): a ViT-B/16 train step and its
inference, ConvNeXt blocks (depthwise 7 x 7 convolutions, LayerNorm, MLP) train step and forward, a small
latent-diffusion UNet (convolutions, GroupNorm, self-attention at the lowest resolution, strided and
transposed convolutions) train step and sampling step, a grouped-convolution (ResNeXt-style) forward and
a strided / transposed convolution pair."""
import jax
import jax.numpy as jnp

_DN = ("NHWC", "HWIO", "NHWC")


def _conv(x, w, stride=1, groups=1, padding="SAME"):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=_DN,
                                        feature_group_count=groups)


def _ln(x, g):
    x32 = x.astype(jnp.float32)
    m = x32.mean(-1, keepdims=True)
    v = jnp.mean((x32 - m) ** 2, -1, keepdims=True)
    return ((x32 - m) * jax.lax.rsqrt(v + 1e-6) * (1 + g.astype(jnp.float32))).astype(x.dtype)


def _sgd(params, grads):
    return jax.tree.map(lambda p, g: p - (1e-3 * g).astype(p.dtype), params, grads)


def _xent(logits, labels):
    logits = logits.astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), (labels % logits.shape[-1])[:, None], -1))


# ---------------------------------------------------------------------------------------------- ViT-B/16
VIT_D, VIT_H, VIT_F, VIT_L, VIT_P, VIT_CLASSES = 768, 12, 3072, 12, 16, 1000


def vit_init(key):
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    L, D, F = VIT_L, VIT_D, VIT_F
    return {"patch": z(VIT_P * VIT_P * 3, D), "pos": z(197, D), "cls": z(D), "head": z(D, VIT_CLASSES),
            "norm": z(D),
            "layers": {"wqkv": z(L, D, 3 * D), "wo": z(L, D, D), "w1": z(L, D, F), "w2": z(L, F, D),
                       "n1": z(L, D), "n2": z(L, D)}}


def _vit_forward(params, images):
    b, hw = images.shape[0], images.shape[1] // VIT_P
    x = images.reshape(b, hw, VIT_P, hw, VIT_P, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, hw * hw, -1)
    x = x @ params["patch"]
    x = jnp.concatenate([jnp.broadcast_to(params["cls"], (b, 1, VIT_D)), x], 1) + params["pos"]

    def layer(x, p):
        h = _ln(x, p["n1"])
        q, k, v = jnp.split((h @ p["wqkv"]).reshape(b, -1, 3 * VIT_H, VIT_D // VIT_H), 3, axis=2)
        a = jax.nn.dot_product_attention(q, k, v).reshape(b, -1, VIT_D)
        x = x + a @ p["wo"]
        return x + jax.nn.gelu(_ln(x, p["n2"]) @ p["w1"]) @ p["w2"], None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return _ln(x[:, 0], params["norm"]) @ params["head"]


def vit_train_step(params, images, labels):
    """ViT-B/16 (86 M params) SGD step: images bf16[b, 224, 224, 3], labels i32[b]."""
    l, g = jax.value_and_grad(lambda p: _xent(_vit_forward(p, images), labels))(params)
    return _sgd(params, g), l


def vit_infer(params, images):
    """ViT-B/16 forward (serving): class logits f32[b, 1000]."""
    return _vit_forward(params, images).astype(jnp.float32)


# ---------------------------------------------------------------------------------------------- ConvNeXt
CNX_DIMS = ((96, 3), (192, 3), (384, 9), (768, 3))


def convnext_init(key):
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    p = {"stem": z(4, 4, 3, 96), "head": z(768, 1000), "stages": []}
    cin = 96
    for c, n in CNX_DIMS:
        st = {"down": z(2, 2, cin, c) if cin != c else None,
              "blocks": [{"dw": z(7, 7, 1, c), "n": z(c), "w1": z(c, 4 * c), "w2": z(4 * c, c)} for _ in range(n)]}
        if st["down"] is None:
            del st["down"]
        p["stages"].append(st)
        cin = c
    return p


def _convnext_forward(params, images):
    x = jax.lax.conv_general_dilated(images, params["stem"], (4, 4), "VALID", dimension_numbers=_DN)
    for st in params["stages"]:
        if "down" in st:
            x = jax.lax.conv_general_dilated(x, st["down"], (2, 2), "VALID", dimension_numbers=_DN)
        for blk in st["blocks"]:
            c = x.shape[-1]
            h = _conv(x, blk["dw"], groups=c)                    # depthwise 7 x 7
            h = jax.nn.gelu(_ln(h, blk["n"]) @ blk["w1"]) @ blk["w2"]
            x = x + h
    return x.mean((1, 2)) @ params["head"]


def convnext_train_step(params, images, labels):
    """ConvNeXt-T (28 M params; depthwise 7 x 7 blocks) SGD step: images bf16[b, 224, 224, 3]."""
    l, g = jax.value_and_grad(lambda p: _xent(_convnext_forward(p, images), labels))(params)
    return _sgd(params, g), l


def depthwise_blocks(x, dw, w1, w2, n):
    """Eight ConvNeXt blocks at one resolution, forward: x bf16[b, 56, 56, c], dw bf16[8, 7, 7, 1, c],
    w1 bf16[8, c, 4c], w2 bf16[8, 4c, c], n bf16[8, c]."""
    c = x.shape[-1]
    for i in range(dw.shape[0]):
        h = _conv(x, dw[i], groups=c)
        x = x + jax.nn.gelu(_ln(h, n[i]) @ w1[i]) @ w2[i]
    return x


# ---------------------------------------------------------------------------------------------- UNet
UNET_CH = (128, 256, 512)
UNET_GROUPS = 32


def unet_init(key):
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    p = {"in": z(3, 3, 4, 128), "out": z(3, 3, 128, 4), "t": z(256, 512), "down": [], "up": [],
         "mid": {"c1": z(3, 3, 512, 512), "c2": z(3, 3, 512, 512), "qkv": z(512, 1536), "o": z(512, 512),
                 "g": z(512)}}
    cin = 128
    for c in UNET_CH:
        p["down"].append({"c1": z(3, 3, cin, c), "c2": z(3, 3, c, c), "g1": z(cin), "g2": z(c), "t": z(512, c),
                          "skip": z(1, 1, cin, c), "ds": z(3, 3, c, c)})
        cin = c
    for c in reversed(UNET_CH):
        p["up"].append({"us": z(4, 4, cin, cin), "c1": z(3, 3, cin + c, c), "c2": z(3, 3, c, c),
                        "g1": z(cin + c), "g2": z(c), "t": z(512, c), "skip": z(1, 1, cin + c, c)})
        cin = c
    return p


def _gn(x, g):
    b, h, w, c = x.shape
    x32 = x.astype(jnp.float32).reshape(b, h, w, UNET_GROUPS, c // UNET_GROUPS)
    m = x32.mean((1, 2, 4), keepdims=True)
    v = jnp.mean((x32 - m) ** 2, (1, 2, 4), keepdims=True)
    return ((x32 - m) * jax.lax.rsqrt(v + 1e-6)).reshape(b, h, w, c).astype(x.dtype) * (1 + g)


def _resblock(x, p, temb):
    h = _conv(jax.nn.silu(_gn(x, p["g1"])), p["c1"])
    h = h + (temb @ p["t"])[:, None, None, :]
    h = _conv(jax.nn.silu(_gn(h, p["g2"])), p["c2"])
    return h + _conv(x, p["skip"])


def _unet(params, x, t):
    half = 128
    freq = jnp.exp(-jnp.log(10000.0) * jnp.arange(half) / half)
    temb = jnp.concatenate([jnp.sin(t[:, None] * freq), jnp.cos(t[:, None] * freq)], -1).astype(jnp.bfloat16)
    temb = jax.nn.silu(temb @ params["t"])
    h = _conv(x, params["in"])
    skips = []
    for p in params["down"]:
        h = _resblock(h, p, temb)
        skips.append(h)
        h = _conv(h, p["ds"], stride=2)                                   # strided downsampling
    m = params["mid"]
    h = _conv(jax.nn.silu(_gn(h, m["g"])), m["c1"])
    b, hh, ww, c = h.shape
    q, k, v = jnp.split((h.reshape(b, hh * ww, c) @ m["qkv"]).reshape(b, hh * ww, 3 * 8, c // 8), 3, 2)
    h = h + (jax.nn.dot_product_attention(q, k, v).reshape(b, hh * ww, c) @ m["o"]).reshape(b, hh, ww, c)
    h = _conv(h, m["c2"])
    for p in params["up"]:
        h = jax.lax.conv_transpose(h, p["us"], (2, 2), "SAME", dimension_numbers=_DN)   # transposed upsampling
        h = _resblock(jnp.concatenate([h, skips.pop()], -1), p, temb)
    return _conv(jax.nn.silu(h), params["out"])


def unet_train_step(params, latents, noise, t):
    """A latent-diffusion UNet (3 levels 128/256/512, GroupNorm, attention at 8 x 8) denoising SGD step:
    latents and noise bf16[b, 64, 64, 4], t f32[b]."""
    def loss(p):
        noisy = latents * 0.7 + noise * 0.7
        return jnp.mean((_unet(p, noisy, t).astype(jnp.float32) - noise.astype(jnp.float32)) ** 2)
    l, g = jax.value_and_grad(loss)(params)
    return _sgd(params, g), l


def unet_sample_step(params, latents, t):
    """One sampling step of the same UNet (serving): latents bf16[b, 64, 64, 4], t f32[b]."""
    eps = _unet(params, latents, t)
    return (latents - 0.1 * eps).astype(latents.dtype)


# ---------------------------------------------------------------------------------------------- other convs
def grouped_conv(x, w1, w2, w3):
    """A ResNeXt bottleneck (1 x 1, grouped 3 x 3 with 32 groups, 1 x 1) forward and its gradient:
    x bf16[b, 56, 56, 256], w1 bf16[1, 1, 256, 256], w2 bf16[3, 3, 8, 256], w3 bf16[1, 1, 256, 256]."""
    def f(w1, w2, w3):
        h = jax.nn.relu(_conv(x, w1))
        h = jax.nn.relu(_conv(h, w2, groups=32))
        return jnp.sum((_conv(h, w3) + x).astype(jnp.float32) ** 2)
    return jax.grad(f, argnums=(0, 1, 2))(w1, w2, w3)


def strided_transposed_conv(x, w_down, w_up):
    """A stride-2 3 x 3 convolution and a stride-2 4 x 4 transposed convolution back, forward and the
    weights' gradients: x bf16[b, 128, 128, 128], w_down bf16[3, 3, 128, 256], w_up bf16[4, 4, 256, 128]."""
    def f(wd, wu):
        h = jax.nn.relu(_conv(x, wd, stride=2))
        y = jax.lax.conv_transpose(h, wu, (2, 2), "SAME", dimension_numbers=_DN)
        return jnp.sum((y - x).astype(jnp.float32) ** 2)
    return jax.grad(f, argnums=(0, 1))(w_down, w_up)
