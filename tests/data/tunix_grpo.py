"""google/tunix's GRPO policy update (RL post-training of a Llama-3-shaped NNX model), reproduced as a
user would hold it in one file.

From https://github.com/google/tunix at c7d8950f12a9c55a976bf2e1a0d8b447d71c20b3 (Apache-2.0):
models/llama3/model.py (ShardingConfig.get_default_sharding, Einsum, Embedder, RMSNorm, RoPE, GQA
Attention without a cache, the gated MLP, the decoder; `shard()` constrains activations on the
legacy `with mesh:` mesh, and not on CPU), rl/common.py (process_ids, selective_log_softmax,
compute_per_token_logps, aggregate_loss's "sequence-mean-token-mean"), rl/algo_core.py
(grpo_loss_fn, its "grpo" path with the KL penalty of beta != 0) and sft/peft_trainer.py
(`_train_step` at gradient_accumulation_steps 1: nnx.value_and_grad of the loss, the gradient
divided by the loss's denominator, optimizer.update; jitted as `nnx.jit(train_step,
donate_argnames=("optimizer",))`). The mesh is tunix's examples' `jax.make_mesh((fsdp, tp),
("fsdp", "tp"), axis_types=Auto)`, the model sharded as tunix's dummy_model_creator does (its
Params' `sharding` annotations). Left out: the GradientAccumulator argument (unused at depth 1),
metrics, LoRA, packing. Sizes are small.
"""
import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.interpreters import pxla
from jax.sharding import PartitionSpec as P

K_MASK = -2.3819763e38


@dataclasses.dataclass(slots=True, frozen=True)
class ShardingConfig:
    emb_vd: tuple
    q_weight_dnh: tuple
    kv_weight_dnh: tuple
    o_weight_nhd: tuple
    ffw_weight_df: tuple
    ffw_weight_fd: tuple
    rms_norm_weight: tuple
    act_btd: tuple
    act_btf: tuple
    act_btnh: tuple

    @staticmethod
    def get_default_sharding():
        fsdp = 'fsdp'
        return ShardingConfig(emb_vd=('tp', fsdp), q_weight_dnh=(fsdp, 'tp', None), kv_weight_dnh=(fsdp, 'tp', None),
                              o_weight_nhd=('tp', None, fsdp), ffw_weight_df=(fsdp, 'tp'), ffw_weight_fd=('tp', fsdp),
                              rms_norm_weight=('tp',), act_btd=('fsdp', None, 'tp'), act_btf=('fsdp', None, 'tp'),
                              act_btnh=('fsdp', None, 'tp', None))


@dataclasses.dataclass(slots=True, frozen=True)
class ModelConfig:
    num_layers: int = 1
    vocab_size: int = 512
    embed_dim: int = 128
    hidden_dim: int = 256
    num_heads: int = 4
    head_dim: int = 32
    num_kv_heads: int = 2
    rope_theta: int = 500_000
    norm_eps: float = 1e-5
    shd_config: ShardingConfig = ShardingConfig.get_default_sharding()


def shard(x, s):
    mesh = pxla.thread_resources.env.physical_mesh
    if mesh.empty or jax.devices()[0].platform == 'cpu':
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, P(*s)))


class Einsum(nnx.Module):
    def __init__(self, einsum_str, shape, *, rngs, sharding):
        self.einsum_str = einsum_str
        self.shape = shape
        self.w = nnx.Param(nnx.initializers.normal()(rngs.params(), shape), sharding=sharding)

    def __call__(self, x):
        return jnp.einsum(self.einsum_str, x, self.w.value)


class Embedder(nnx.Module):
    def __init__(self, vocab_size, embed_dim, *, rngs, shd_config):
        self.input_embedding = nnx.Param(nnx.initializers.normal()(rngs.params(), (vocab_size, embed_dim)),
                                         sharding=shd_config.emb_vd)
        self.shd_config = shd_config

    def encode(self, x):
        return shard(self.input_embedding[(x,)], self.shd_config.act_btd)

    def decode(self, x):
        return jnp.dot(x, self.input_embedding.value.T)


def apply_rope(inputs, positions, head_dim, rope_theta=1_000_000):
    fraction = 2 * jnp.arange(0, head_dim // 2, dtype=jnp.float32) / head_dim
    timescale = rope_theta**fraction
    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
    sin, cos = jnp.sin(sinusoid_inp), jnp.cos(sinusoid_inp)
    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    out = jnp.concatenate([first_half * cos - second_half * sin, second_half * cos + first_half * sin], axis=-1)
    return out.astype(inputs.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim, *, norm_eps=1e-06, rngs, shd_config):
        self.w = nnx.Param(nnx.initializers.ones_init()(rngs.params(), dim), sharding=shd_config.rms_norm_weight)
        self.norm_eps = norm_eps

    def __call__(self, x):
        dtype = x.dtype
        rms = jnp.sqrt(jnp.mean(jnp.astype(x, jnp.float32) ** 2, axis=-1, keepdims=True) + self.norm_eps)
        return jnp.astype(self.w * x / rms, dtype)


class Attention(nnx.Module):
    def __init__(self, config, *, rngs):
        self.config = config
        self.shd_config = c = config.shd_config
        self.q_proj = Einsum('BTD,DNH->BTNH', (config.embed_dim, config.num_heads, config.head_dim), rngs=rngs,
                             sharding=c.q_weight_dnh)
        self.k_proj = Einsum('BSD,DKH->BSKH', (config.embed_dim, config.num_kv_heads, config.head_dim), rngs=rngs,
                             sharding=c.kv_weight_dnh)
        self.v_proj = Einsum('BSD,DKH->BSKH', (config.embed_dim, config.num_kv_heads, config.head_dim), rngs=rngs,
                             sharding=c.kv_weight_dnh)
        self.o_proj = Einsum('BTNH,NHD->BTD', (config.num_heads, config.head_dim, config.embed_dim), rngs=rngs,
                             sharding=c.o_weight_nhd)
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5

    def __call__(self, x, segment_pos, attn_mask):
        query_proj = shard(self.q_proj(x), self.shd_config.act_btnh)
        key_proj = shard(self.k_proj(x), self.shd_config.act_btnh)
        value_proj = shard(self.v_proj(x), self.shd_config.act_btnh)
        query_proj = apply_rope(query_proj, segment_pos, head_dim=self.head_dim)
        key_proj = apply_rope(key_proj, segment_pos, head_dim=self.head_dim)
        b, t, qh, d = query_proj.shape
        _, s, kh, _ = key_proj.shape
        query_proj = query_proj.reshape((b, t, kh, qh // kh, d))
        attn = jnp.einsum('BTHGD,BSHD->BHGTS', query_proj, key_proj) * self.scale
        attn = attn.reshape((b, qh, t, s))
        attn = jnp.where((jnp.expand_dims(attn_mask, -3)), attn, K_MASK)
        attn = jax.nn.softmax(attn.astype(jnp.float32), axis=-1).astype(key_proj.dtype)
        attn = attn.reshape((b, kh, qh // kh, t, s))
        qkv = jnp.einsum('BHGTS,BSHD->BTHGD', attn, value_proj).reshape((b, t, qh, d))
        return shard(self.o_proj(qkv), self.shd_config.act_btd)


class MLP(nnx.Module):
    def __init__(self, config, *, rngs):
        self.shd_config = c = config.shd_config
        init = nnx.initializers.zeros_init()
        self.gate_proj = nnx.Linear(config.embed_dim, config.hidden_dim, use_bias=False, rngs=rngs,
                                    kernel_init=nnx.with_partitioning(init, c.ffw_weight_df))
        self.up_proj = nnx.Linear(config.embed_dim, config.hidden_dim, use_bias=False, rngs=rngs,
                                  kernel_init=nnx.with_partitioning(init, c.ffw_weight_df))
        self.down_proj = nnx.Linear(config.hidden_dim, config.embed_dim, use_bias=False, rngs=rngs,
                                    kernel_init=nnx.with_partitioning(init, c.ffw_weight_fd))

    def __call__(self, x):
        activations = nnx.silu(self.gate_proj(x)) * self.up_proj(x)
        activations = shard(activations, self.shd_config.act_btf)
        return self.down_proj(activations)


class DecoderLayer(nnx.Module):
    def __init__(self, config, *, rngs):
        self.input_layernorm = RMSNorm(config.embed_dim, norm_eps=config.norm_eps, rngs=rngs,
                                       shd_config=config.shd_config)
        self.attn = Attention(config=config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.embed_dim, norm_eps=config.norm_eps, rngs=rngs,
                                                shd_config=config.shd_config)
        self.mlp = MLP(config=config, rngs=rngs)

    def __call__(self, x, segment_pos, attn_mask):
        attn_output = x + self.attn(self.input_layernorm(x), segment_pos, attn_mask)
        return attn_output + self.mlp(self.post_attention_layernorm(attn_output))


class Llama3(nnx.Module):
    def __init__(self, config, *, rngs):
        self.config = config
        self.embedder = Embedder(config.vocab_size, config.embed_dim, rngs=rngs, shd_config=config.shd_config)
        self.layers = nnx.List([DecoderLayer(config=config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config.embed_dim, rngs=rngs, norm_eps=config.norm_eps,
                                  shd_config=config.shd_config)
        self.lm_head = Einsum('BTD,DV->BTV', (config.embed_dim, config.vocab_size), rngs=rngs,
                              sharding=config.shd_config.emb_vd[::-1])

    def __call__(self, input_tokens, positions, cache, attention_mask):
        x = self.embedder.encode(input_tokens)
        for layer in self.layers:
            x = layer(x, positions, attention_mask)
        x = self.final_norm(x)
        return self.lm_head(x), None


# ---- rl/common.py ----
def selective_log_softmax(logits, input_ids):
    target_logits = jnp.take_along_axis(logits, input_ids[..., None], axis=-1).squeeze(-1).astype(jnp.float32)
    return target_logits - jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)


def build_positions_from_mask(input_mask):
    positions = jnp.cumsum(input_mask, axis=-1)
    return positions - (positions >= 1)


def make_causal_attn_mask(input_mask):
    seq_len = input_mask.shape[-1]
    causal_mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))
    return input_mask[..., None, :] * causal_mask[None, ...]


def process_ids(prompt_tokens, completion_tokens, pad_id, eos_id):
    prompt_completion_ids = jnp.concat([prompt_tokens, completion_tokens], axis=1)
    prompt_completion_mask = jnp.concatenate([prompt_tokens != pad_id, completion_tokens != pad_id], axis=-1)
    return (prompt_completion_ids, build_positions_from_mask(prompt_completion_mask),
            make_causal_attn_mask(prompt_completion_mask))


def compute_per_token_logps(graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id, stop_gradient=True):
    model = nnx.merge(graphdef, state)
    input_tokens, positions, attn_mask = process_ids(prompt_tokens, completion_tokens, pad_id, eos_id)
    logits, _ = model(input_tokens, positions=positions, attention_mask=attn_mask, cache=None)
    logits_to_keep = completion_tokens.shape[1]
    logits = logits[:, -logits_to_keep - 1:-1, :]
    per_token_logps = selective_log_softmax(logits, input_tokens[:, -logits_to_keep:])
    return jax.lax.stop_gradient(per_token_logps) if stop_gradient else per_token_logps


def aggregate_loss(per_token_loss, completion_mask):  # loss_agg_mode="sequence-mean-token-mean"
    seq_mask = completion_mask.sum(axis=-1)
    seq_loss = (per_token_loss * completion_mask).sum(axis=-1) / jnp.clip(seq_mask, min=1)
    return seq_loss.sum(), (seq_mask > 0).sum()


# ---- rl/algo_core.py, grpo_loss_fn's "grpo" path ----
@flax.struct.dataclass(frozen=True)
class TrainExample:
    prompt_ids: jax.Array
    prompt_mask: jax.Array
    completion_ids: jax.Array
    completion_mask: jax.Array
    advantages: jax.Array
    ref_per_token_logps: jax.Array
    old_per_token_logps: jax.Array


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    beta: float = 0.04
    epsilon: float = 0.2


def grpo_loss_fn(model, train_example, algo_config, pad_id, eos_id):
    beta, epsilon = algo_config.beta, algo_config.epsilon
    completion_mask = train_example.completion_mask
    graphdef, state = nnx.split(model)
    per_token_logps = compute_per_token_logps(graphdef, state, prompt_tokens=train_example.prompt_ids,
                                              completion_tokens=train_example.completion_ids, pad_id=pad_id,
                                              eos_id=eos_id, stop_gradient=False)
    per_token_logps = jnp.astype(per_token_logps, jnp.float32)
    advantages = jnp.astype(train_example.advantages, jnp.float32)
    old_per_token_logps = jnp.astype(train_example.old_per_token_logps, jnp.float32)
    seq_importance_ratio = jnp.clip(per_token_logps - old_per_token_logps, max=20.0, min=-20.0)
    is_ratio = jnp.exp(seq_importance_ratio)
    adv = jnp.expand_dims(advantages, 1)
    pg_loss_1 = -adv * is_ratio
    pg_loss_2 = -adv * jnp.clip(is_ratio, 1 - epsilon, 1 + epsilon)
    per_token_loss = jnp.maximum(pg_loss_1, pg_loss_2).astype(jnp.float32)
    unreduced_sum, denominator = aggregate_loss(per_token_loss, completion_mask)
    if beta != 0.0:
        ref = train_example.ref_per_token_logps
        kl = jnp.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        kl_sum, _ = aggregate_loss(kl, completion_mask)
        unreduced_sum = unreduced_sum + beta * kl_sum
    return unreduced_sum, denominator


# ---- sft/peft_trainer.py, _train_step at gradient_accumulation_steps=1 ----
ALGO = GRPOConfig()
PAD_ID, EOS_ID = 0, 1


def train_step(model, optimizer, train_example):
    def diff_fn(model, train_example):
        return grpo_loss_fn(model, train_example, ALGO, PAD_ID, EOS_ID)

    grad_fn = nnx.value_and_grad(diff_fn, argnums=0, has_aux=True)
    (loss_val, denom), grads = grad_fn(model, train_example)
    scale = jnp.where(denom > 0, 1.0 / jnp.maximum(denom, 1), 0.0).astype(jnp.float32)
    grads = jax.tree_util.tree_map(lambda x: x * scale.astype(x.dtype), grads)
    grad_norm = optax.global_norm(jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), grads))
    optimizer.update(model, grads)
    return loss_val * scale, grad_norm


jit_train_step = nnx.jit(train_step, donate_argnames=("optimizer",))


# ---- the user's setup (tunix examples: make_mesh, dummy_model_creator's sharded model) ----
def make_mesh(devices, fsdp=4, tp=2):
    return jax.make_mesh((fsdp, tp), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices)


def create_model(config=ModelConfig()):
    """The model with each Param laid out as its `sharding` annotation says (under the caller's mesh)."""
    model = Llama3(config, rngs=nnx.Rngs(params=0))
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model


def create_optimizer(model, lr=1e-6):
    return nnx.Optimizer(model, optax.adamw(lr, b1=0.9, b2=0.99, weight_decay=0.1), wrt=nnx.Param)


def make_example(batch=8, prompt_len=16, completion_len=16):
    """A TrainExample of zeros, its rows sharded over fsdp as tunix's data sharding puts them."""
    ids = lambda n: jnp.zeros((batch, n), jnp.int32)
    f32 = lambda *s: jnp.zeros(s, jnp.float32)
    ex = TrainExample(prompt_ids=ids(prompt_len), prompt_mask=ids(prompt_len), completion_ids=ids(completion_len),
                      completion_mask=ids(completion_len), advantages=f32(batch),
                      ref_per_token_logps=f32(batch, completion_len), old_per_token_logps=f32(batch, completion_len))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P("fsdp")), ex)
