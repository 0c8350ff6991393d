"""A Qwen3-style decoder's prefill step written in the shape of jax-ml/bonsai's
``bonsai/models/qwen3/modeling.py`` and its sharding test, in this project's own words and shrunk.

What is kept of bonsai's shape, because it is what issue 49 found: Flax NNX modules whose weights
carry ``out_sharding`` metadata for a mesh of ``Explicit`` axes (``fsdp``, ``tp``), activations laid
with ``out_sharding=P(...)`` on the einsums and ``jax.sharding.reshard`` where a mesh is in context;
a KV cache of NNX Variables; the step a bare ``@jax.jit`` taking the model, the cache, the tokens and
a Python number ``pad_id`` (which ``jax.jit`` traces as a weakly typed ``s32[]`` argument). The
module builds its Explicit mesh at import, as the sharding test does before building the model.
"""
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P, get_abstract_mesh, reshard

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS = 128, 64, 4, 2, 16, 128, 2
BATCH, TOKENS, CACHE = 4, 16, 32

FSDP, TP = "fsdp", "tp"
WEIGHTS = dict(embed=P(TP, FSDP), head=P(FSDP, TP), q=P(FSDP, TP, None), kv=P(FSDP, TP, None),
               o=P(TP, None, FSDP), up=P(FSDP, TP), down=P(TP, FSDP), norm=P(TP))
ACTS = dict(btd=P(FSDP, None, TP), btf=P(FSDP, None, TP), btnh=P(FSDP, None, TP, None))

mesh = jax.make_mesh((4, 2), (FSDP, TP), axis_types=(AxisType.Explicit, AxisType.Explicit))


def laid(x, spec):
    """``x`` resharded to ``spec`` where a mesh is in context (bonsai's ``shard``)."""
    return reshard(x, spec) if not get_abstract_mesh().empty else x


class KVCache(nnx.Module):
    def __init__(self, batch, size, dtype=jnp.float32):
        shape = (batch, size, KV_HEADS, HEAD_DIM)
        self.k = nnx.Cache(jnp.zeros(shape, dtype, out_sharding=ACTS["btnh"]))
        self.v = nnx.Cache(jnp.zeros(shape, dtype, out_sharding=ACTS["btnh"]))
        self.index = nnx.Variable(jnp.zeros((), jnp.int32))


class Attention(nnx.Module):
    def __init__(self, rngs):
        proj = lambda eq, shape, spec: nnx.Einsum(eq, shape, kernel_metadata={"out_sharding": spec}, rngs=rngs)
        self.q = proj("BTD,DNH->BTNH", (WIDTH, HEADS, HEAD_DIM), WEIGHTS["q"])
        self.k = proj("BSD,DKH->BSKH", (WIDTH, KV_HEADS, HEAD_DIM), WEIGHTS["kv"])
        self.v = proj("BSD,DKH->BSKH", (WIDTH, KV_HEADS, HEAD_DIM), WEIGHTS["kv"])
        self.o = proj("BTNH,NHD->BTD", (HEADS, HEAD_DIM, WIDTH), WEIGHTS["o"])

    def __call__(self, x, cache, segment_ids):
        q = self.q(x, out_sharding=ACTS["btnh"])
        k = self.k(x, out_sharding=ACTS["btnh"])
        v = self.v(x, out_sharding=ACTS["btnh"])
        start = (0, cache.index[...], 0, 0)
        cache.k[...] = jax.lax.dynamic_update_slice(cache.k[...], k, start)
        cache.v[...] = jax.lax.dynamic_update_slice(cache.v[...], v, start)
        keys = jnp.repeat(cache.k[...], HEADS // KV_HEADS, axis=2, out_sharding=ACTS["btnh"])
        values = jnp.repeat(cache.v[...], HEADS // KV_HEADS, axis=2, out_sharding=ACTS["btnh"])
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, keys) * HEAD_DIM ** -0.5
        seen = jnp.arange(CACHE)[None, None, None, :] < cache.index[...] + x.shape[1]
        scores = jnp.where(seen & (segment_ids[:, None, :, None] > 0), scores, -1e9)
        mixed = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(scores, axis=-1), values)
        return self.o(laid(mixed, ACTS["btnh"]), out_sharding=ACTS["btd"])


class MLP(nnx.Module):
    def __init__(self, rngs):
        dense = lambda a, b, spec: nnx.Linear(a, b, use_bias=False, kernel_metadata={"out_sharding": spec}, rngs=rngs)
        self.gate, self.up, self.down = dense(WIDTH, HIDDEN, WEIGHTS["up"]), dense(WIDTH, HIDDEN, WEIGHTS["up"]), \
            dense(HIDDEN, WIDTH, WEIGHTS["down"])

    def __call__(self, x):
        h = nnx.silu(self.gate(x, out_sharding=ACTS["btf"])) * self.up(x, out_sharding=ACTS["btf"])
        return self.down(h, out_sharding=ACTS["btd"])


class Layer(nnx.Module):
    def __init__(self, rngs):
        norm = lambda: nnx.RMSNorm(WIDTH, scale_metadata={"out_sharding": WEIGHTS["norm"]}, rngs=rngs)
        self.norm1, self.attn, self.norm2, self.mlp = norm(), Attention(rngs), norm(), MLP(rngs)

    def __call__(self, x, cache, segment_ids):
        x = x + self.attn(self.norm1(x), cache, segment_ids)
        return x + self.mlp(self.norm2(x))


class Qwen3(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_metadata={"out_sharding": WEIGHTS["embed"]}, rngs=rngs)
        self.layers = nnx.List([Layer(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(WIDTH, scale_metadata={"out_sharding": WEIGHTS["norm"]}, rngs=rngs)
        self.head = nnx.Einsum("BTD,DV->BTV", (WIDTH, VOCAB), kernel_metadata={"out_sharding": WEIGHTS["head"]},
                               rngs=rngs)

    def __call__(self, tokens, cache, segment_ids):
        x = self.embed.embedding[...].at[tokens].get(out_sharding=ACTS["btd"])
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, layer_cache, segment_ids)
        return self.head(self.norm(x), out_sharding=ACTS["btd"])


def make_model():
    """The model on the context mesh (a function, so a compile-only topology can build it abstractly)."""
    return Qwen3(nnx.Rngs(0))


def make_cache():
    return [KVCache(BATCH, CACHE) for _ in range(LAYERS)]


@jax.jit
def forward(model, cache, tokens, pad_id):
    """Prefill: logits at each row's last real token, the cache updated."""
    segment_ids = 1 * (tokens != pad_id)
    right_pads = jnp.max(jnp.argmin(jnp.flip(tokens == pad_id, axis=1).astype(jnp.int32), axis=1))
    logits = model(tokens, cache, segment_ids)
    return logits[:, tokens.shape[-1] - right_pads - 1], cache
