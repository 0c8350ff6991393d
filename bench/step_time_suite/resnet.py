"""A small ResNet (bottleneck-free basic blocks, NHWC, bf16, batch-norm replaced by a per-channel scale
so the step is pure convolutions and element-wise work) train step, for the step-time suite."""
import jax
import jax.numpy as jnp

STAGES = ((64, 2), (128, 2), (256, 2), (512, 2))   # (channels, blocks); stride 2 entering stages 2-4
CLASSES = 1000


def init_params(key):
    z = lambda *s: jnp.zeros(s, jnp.bfloat16)
    params = {"stem": z(7, 7, 3, 64), "head": z(512, CLASSES), "blocks": []}
    cin = 64
    for c, n in STAGES:
        for i in range(n):
            blk = {"w1": z(3, 3, cin, c), "w2": z(3, 3, c, c), "s1": z(c), "s2": z(c)}
            if cin != c:
                blk["proj"] = z(1, 1, cin, c)
            params["blocks"].append(blk)
            cin = c
    return params


def _conv(x, w, stride=1):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def forward(params, images):
    x = jax.nn.relu(_conv(images, params["stem"], 2))
    x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    for blk in params["blocks"]:
        stride = 2 if "proj" in blk and blk["proj"].shape[2] != 64 else 1
        h = jax.nn.relu(_conv(x, blk["w1"], stride) * (1 + blk["s1"]))
        h = _conv(h, blk["w2"]) * (1 + blk["s2"])
        skip = _conv(x, blk["proj"], stride) if "proj" in blk else x
        x = jax.nn.relu(h + skip)
    return x.mean((1, 2)) @ params["head"]


def train_step(params, images, labels):
    """images bf16[b, 224, 224, 3], labels i32[b] (taken modulo the classes)."""
    def loss(p):
        logits = forward(p, images).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), (labels % CLASSES)[:, None], -1))

    l, g = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - (1e-3 * g).astype(p.dtype), params, g), l
