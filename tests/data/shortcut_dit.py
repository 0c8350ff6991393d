"""kvfrans/shortcut-models' train step (a DiT trained by flow matching with self-consistency
"shortcut" targets), reproduced as a user would hold it in one file.

From https://github.com/kvfrans/shortcut-models at 601004348667094e1b71f30942199759412d4432 (MIT,
Copyright (c) 2024 Kevin Frans): model.py (DiT), math_utils.py (pos. embedding), targets_shortcut.py,
utils/train_state.py (TrainStateEma), utils/sharding.py (create_sharding) and train.py's main() (the
optimizer, `init`, `jax.jit(init, out_shardings=...)` and the `update` step with its out_shardings
and `with_sharding_constraint`s). Changes, each forced: main()'s body is `build(devices, ...)`
(its flags are a config object; `create_sharding` takes the devices main() would get from
`jax.devices()`); einops' `rearrange` is written as the reshape it is (einops is not installed);
`xavier_uniform_pytorchlike` uses the public `jnp.dtype` for `jax._src.dtypes` (jax 0.10 has no
`jax._src.core.as_named_shape`); the per-call `print`s are dropped; the sizes are train.py's defaults
(hidden 64, patch 8, 2 heads; batch 32 of 32x32x4 Stable-VAE latents) but one DiT block, not 2.
"""
import math
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec


# ---- math_utils.py ----
def get_1d_sincos_pos_embed_from_grid(embed_dim, pos):
    omega = jnp.arange(embed_dim // 2, dtype=jnp.float32)
    omega /= embed_dim / 2.
    omega = 1. / 10000**omega
    pos = pos.reshape(-1)
    out = jnp.einsum('m,d->md', pos, omega)
    return jnp.concatenate([jnp.sin(out), jnp.cos(out)], axis=1)


def get_2d_sincos_pos_embed(rng, embed_dim, length):
    grid_size = int(length ** 0.5)
    grid_h = jnp.arange(grid_size, dtype=jnp.float32)
    grid_w = jnp.arange(grid_size, dtype=jnp.float32)
    grid = jnp.stack(jnp.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])
    emb_h = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[0])
    emb_w = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[1])
    return jnp.expand_dims(jnp.concatenate([emb_h, emb_w], axis=1), 0)


# ---- model.py ----
def xavier_uniform_pytorchlike():
    def init(key, shape, dtype):
        dtype = jnp.dtype(dtype)
        if len(shape) == 2:
            fan_in, fan_out = shape[0], shape[1]
        elif len(shape) == 4:
            fan_in, fan_out = shape[0] * shape[1] * shape[2], shape[3]
        else:
            raise ValueError(f"Invalid shape {shape}")
        scale = jnp.sqrt(3 * (2 / (fan_in + fan_out)))
        return jax.random.uniform(key, shape, dtype, -1) * scale
    return init


class TrainConfig:
    def __init__(self, dtype):
        self.dtype = dtype

    def kern_init(self, name='default', zero=False):
        if zero or 'bias' in name:
            return nn.initializers.constant(0)
        return xavier_uniform_pytorchlike()

    def default_config(self):
        return {'kernel_init': self.kern_init(), 'bias_init': self.kern_init('bias', zero=True), 'dtype': self.dtype}


class TimestepEmbedder(nn.Module):
    hidden_size: int
    tc: TrainConfig
    frequency_embedding_size: int = 256

    @nn.compact
    def __call__(self, t):
        x = self.timestep_embedding(t)
        x = nn.Dense(self.hidden_size, kernel_init=nn.initializers.normal(0.02),
                     bias_init=self.tc.kern_init('time_bias'), dtype=self.tc.dtype)(x)
        x = nn.silu(x)
        x = nn.Dense(self.hidden_size, kernel_init=nn.initializers.normal(0.02),
                     bias_init=self.tc.kern_init('time_bias'))(x)
        return x

    def timestep_embedding(self, t, max_period=10000):
        t = jax.lax.convert_element_type(t, jnp.float32)
        half = self.frequency_embedding_size // 2
        freqs = jnp.exp(-math.log(max_period) * jnp.arange(start=0, stop=half, dtype=jnp.float32) / half)
        args = t[:, None] * freqs[None]
        return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1).astype(self.tc.dtype)


class LabelEmbedder(nn.Module):
    num_classes: int
    hidden_size: int
    tc: TrainConfig

    @nn.compact
    def __call__(self, labels):
        return nn.Embed(self.num_classes + 1, self.hidden_size, embedding_init=nn.initializers.normal(0.02),
                        dtype=self.tc.dtype)(labels)


class PatchEmbed(nn.Module):
    patch_size: int
    hidden_size: int
    tc: TrainConfig
    bias: bool = True

    @nn.compact
    def __call__(self, x):
        B, H, W, C = x.shape
        patch_tuple = (self.patch_size, self.patch_size)
        x = nn.Conv(self.hidden_size, patch_tuple, patch_tuple, use_bias=self.bias, padding="VALID",
                    kernel_init=self.tc.kern_init('patch'), bias_init=self.tc.kern_init('patch_bias', zero=True),
                    dtype=self.tc.dtype)(x)
        return x.reshape(B, -1, self.hidden_size)  # rearrange(x, 'b h w c -> b (h w) c')


class MlpBlock(nn.Module):
    mlp_dim: int
    tc: TrainConfig
    out_dim: Optional[int] = None
    dropout_rate: float = None
    train: bool = False

    @nn.compact
    def __call__(self, inputs):
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(features=self.mlp_dim, **self.tc.default_config())(inputs)
        x = nn.gelu(x)
        x = nn.Dropout(rate=self.dropout_rate, deterministic=(not self.train))(x)
        output = nn.Dense(features=actual_out_dim, **self.tc.default_config())(x)
        return nn.Dropout(rate=self.dropout_rate, deterministic=(not self.train))(output)


def modulate(x, shift, scale):
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    hidden_size: int
    num_heads: int
    tc: TrainConfig
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    train: bool = False

    @nn.compact
    def __call__(self, x, c):
        c = nn.silu(c)
        c = nn.Dense(6 * self.hidden_size, **self.tc.default_config())(c)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(c, 6, axis=-1)
        x_norm = nn.LayerNorm(use_bias=False, use_scale=False, dtype=self.tc.dtype)(x)
        x_modulated = modulate(x_norm, shift_msa, scale_msa)
        channels_per_head = self.hidden_size // self.num_heads
        k = nn.Dense(self.hidden_size, **self.tc.default_config())(x_modulated)
        q = nn.Dense(self.hidden_size, **self.tc.default_config())(x_modulated)
        v = nn.Dense(self.hidden_size, **self.tc.default_config())(x_modulated)
        k = jnp.reshape(k, (k.shape[0], k.shape[1], self.num_heads, channels_per_head))
        q = jnp.reshape(q, (q.shape[0], q.shape[1], self.num_heads, channels_per_head))
        v = jnp.reshape(v, (v.shape[0], v.shape[1], self.num_heads, channels_per_head))
        q = q / q.shape[3]
        w = jnp.einsum('bqhc,bkhc->bhqk', q, k)
        w = w.astype(jnp.float32)
        w = nn.softmax(w, axis=-1)
        y = jnp.einsum('bhqk,bkhc->bqhc', w, v)
        y = jnp.reshape(y, x.shape)
        attn_x = nn.Dense(self.hidden_size, **self.tc.default_config())(y)
        x = x + (gate_msa[:, None] * attn_x)
        x_norm2 = nn.LayerNorm(use_bias=False, use_scale=False, dtype=self.tc.dtype)(x)
        x_modulated2 = modulate(x_norm2, shift_mlp, scale_mlp)
        mlp_x = MlpBlock(mlp_dim=int(self.hidden_size * self.mlp_ratio), tc=self.tc,
                         dropout_rate=self.dropout, train=self.train)(x_modulated2)
        return x + (gate_mlp[:, None] * mlp_x)


class FinalLayer(nn.Module):
    patch_size: int
    out_channels: int
    hidden_size: int
    tc: TrainConfig

    @nn.compact
    def __call__(self, x, c):
        c = nn.silu(c)
        c = nn.Dense(2 * self.hidden_size, kernel_init=self.tc.kern_init(zero=True),
                     bias_init=self.tc.kern_init('bias', zero=True), dtype=self.tc.dtype)(c)
        shift, scale = jnp.split(c, 2, axis=-1)
        x = nn.LayerNorm(use_bias=False, use_scale=False, dtype=self.tc.dtype)(x)
        x = modulate(x, shift, scale)
        return nn.Dense(self.patch_size * self.patch_size * self.out_channels,
                        kernel_init=self.tc.kern_init('final', zero=True),
                        bias_init=self.tc.kern_init('final_bias', zero=True), dtype=self.tc.dtype)(x)


class DiT(nn.Module):
    patch_size: int
    hidden_size: int
    depth: int
    num_heads: int
    mlp_ratio: float
    out_channels: int
    class_dropout_prob: float
    num_classes: int
    ignore_dt: bool = False
    dropout: float = 0.0
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x, t, dt, y, train=False, return_activations=False):
        activations = {}
        batch_size, input_size = x.shape[0], x.shape[1]
        num_patches = (input_size // self.patch_size) ** 2
        num_patches_side = input_size // self.patch_size
        tc = TrainConfig(dtype=self.dtype)
        if self.ignore_dt:
            dt = jnp.zeros_like(t)
        pos_embed = get_2d_sincos_pos_embed(None, self.hidden_size, num_patches)
        x = PatchEmbed(self.patch_size, self.hidden_size, tc=tc)(x)
        activations['patch_embed'] = x
        x = x + pos_embed
        x = x.astype(self.dtype)
        te = TimestepEmbedder(self.hidden_size, tc=tc)(t)
        dte = TimestepEmbedder(self.hidden_size, tc=tc)(dt)
        ye = LabelEmbedder(self.num_classes, self.hidden_size, tc=tc)(y)
        c = te + ye + dte
        activations.update(pos_embed=pos_embed, time_embed=te, dt_embed=dte, label_embed=ye, conditioning=c)
        for i in range(self.depth):
            x = DiTBlock(self.hidden_size, self.num_heads, tc, self.mlp_ratio, self.dropout, train)(x, c)
            activations[f'dit_block_{i}'] = x
        x = FinalLayer(self.patch_size, self.out_channels, self.hidden_size, tc)(x, c)
        activations['final_layer'] = x
        x = jnp.reshape(x, (batch_size, num_patches_side, num_patches_side,
                            self.patch_size, self.patch_size, self.out_channels))
        x = jnp.einsum('bhwpqc->bhpwqc', x)
        x = x.reshape(batch_size, input_size, input_size, self.out_channels)  # rearrange 'B H P W Q C -> B (H P) (W Q) C'
        t_discrete = jnp.floor(t * 256).astype(jnp.int32)
        logvars = nn.Embed(256, 1, embedding_init=nn.initializers.constant(0))(t_discrete) * 100
        if return_activations:
            return x, logvars, activations
        return x


# ---- utils/train_state.py ----
nonpytree_field = partial(flax.struct.field, pytree_node=False)


class TrainStateEma(flax.struct.PyTreeNode):
    rng: Any
    step: int
    apply_fn: Callable = nonpytree_field()
    model_def: Any = nonpytree_field()
    params: Any
    params_ema: Any
    tx: Any = nonpytree_field()
    opt_state: Any

    @classmethod
    def create(cls, model_def, params, rng, tx=None, opt_state=None, **kwargs):
        if tx is not None and opt_state is None:
            opt_state = tx.init(params)
        return cls(rng=rng, step=1, apply_fn=model_def.apply, model_def=model_def, params=params,
                   params_ema=params, tx=tx, opt_state=opt_state, **kwargs)

    def __call__(self, *args, params=None, method=None, **kwargs):
        if params is None:
            params = self.params
        return self.apply_fn({"params": params}, *args, method=method, **kwargs)

    def call_model(self, *args, params=None, method=None, **kwargs):
        return self.__call__(*args, params=params, method=method, **kwargs)

    def call_model_ema(self, *args, params=None, method=None, **kwargs):
        return self.__call__(*args, params=self.params_ema, method=method, **kwargs)

    def update_ema(self, tau):
        new_params_ema = jax.tree.map(lambda p, tp: p * (1 - tau) + tp * tau, self.params, self.params_ema)
        return self.replace(params_ema=new_params_ema)


# ---- utils/sharding.py ----
def create_sharding(shard_type, train_state_shape=None, devices=None):
    n = len(devices)
    device_mesh = mesh_utils.create_device_mesh((n,), devices)
    mesh = Mesh(devices=device_mesh, axis_names=('devices'))
    data_sharding = NamedSharding(mesh, PartitionSpec('devices'))
    no_shard = NamedSharding(mesh, PartitionSpec())
    if shard_type == 'dp':
        train_state_sharding = no_shard
    elif shard_type == 'fsdp':
        def shard_parameter(param):
            shape = param.shape
            all_nones = (None,) * param.ndim
            min_size_to_shard_mb = 4
            if np.prod(shape) * param.dtype.itemsize <= min_size_to_shard_mb * (2 ** 20):
                return all_nones
            idx = np.argsort(shape)[::-1]
            for i in idx:
                if shape[i] % n == 0:
                    return all_nones[:i] + ('devices',) + all_nones[i + 1:]
            raise ValueError(f"Could not shard parameter of shape {shape}")
        train_state_sharding = jax.tree_util.tree_map(
            lambda spec: NamedSharding(mesh, PartitionSpec(*shard_parameter(spec))),
            flax.linen.unbox(train_state_shape))
    return mesh, data_sharding, train_state_sharding, no_shard


# ---- targets_shortcut.py (the bootstrap_cfg=0 path train.py's defaults take) ----
def get_targets(FLAGS, key, train_state, images, labels, force_t=-1, force_dt=-1):
    label_key, time_key, noise_key = jax.random.split(key, 3)
    info = {}
    bootstrap_batchsize = FLAGS.batch_size // FLAGS.model['bootstrap_every']
    log2_sections = np.log2(FLAGS.model['denoise_timesteps']).astype(np.int32)
    dt_base = jnp.repeat(log2_sections - 1 - jnp.arange(log2_sections), bootstrap_batchsize // log2_sections)
    dt_base = jnp.concatenate([dt_base, jnp.zeros(bootstrap_batchsize - dt_base.shape[0],)])
    force_dt_vec = jnp.ones(bootstrap_batchsize, dtype=jnp.float32) * force_dt
    dt_base = jnp.where(force_dt_vec != -1, force_dt_vec, dt_base)
    dt = 1 / (2 ** (dt_base))
    dt_base_bootstrap = dt_base + 1
    dt_bootstrap = dt / 2
    dt_sections = jnp.power(2, dt_base)
    t = jax.random.randint(time_key, (bootstrap_batchsize,), minval=0, maxval=dt_sections).astype(jnp.float32)
    t = t / dt_sections
    force_t_vec = jnp.ones(bootstrap_batchsize, dtype=jnp.float32) * force_t
    t = jnp.where(force_t_vec != -1, force_t_vec, t)
    t_full = t[:, None, None, None]
    x_1 = images[:bootstrap_batchsize]
    x_0 = jax.random.normal(noise_key, x_1.shape)
    x_t = (1 - (1 - 1e-5) * t_full) * x_0 + t_full * x_1
    bst_labels = labels[:bootstrap_batchsize]
    call_model_fn = train_state.call_model if FLAGS.model['bootstrap_ema'] == 0 else train_state.call_model_ema
    v_b1 = call_model_fn(x_t, t, dt_base_bootstrap, bst_labels, train=False)
    t2 = t + dt_bootstrap
    x_t2 = jnp.clip(x_t + dt_bootstrap[:, None, None, None] * v_b1, -4, 4)
    v_b2 = call_model_fn(x_t2, t2, dt_base_bootstrap, bst_labels, train=False)
    v_target = jnp.clip((v_b1 + v_b2) / 2, -4, 4)
    bst_v, bst_dt, bst_t, bst_xt, bst_l = v_target, dt_base, t, x_t, bst_labels

    labels_dropout = jax.random.bernoulli(label_key, FLAGS.model['class_dropout_prob'], (labels.shape[0],))
    labels_dropped = jnp.where(labels_dropout, FLAGS.model['num_classes'], labels)
    info['dropped_ratio'] = jnp.mean(labels_dropped == FLAGS.model['num_classes'])
    t = jax.random.randint(time_key, (images.shape[0],), minval=0,
                           maxval=FLAGS.model['denoise_timesteps']).astype(jnp.float32)
    t /= FLAGS.model['denoise_timesteps']
    force_t_vec = jnp.ones(images.shape[0], dtype=jnp.float32) * force_t
    t = jnp.where(force_t_vec != -1, force_t_vec, t)
    t_full = t[:, None, None, None]
    x_0 = jax.random.normal(noise_key, images.shape)
    x_1 = images
    x_t = (1 - (1 - 1e-5) * t_full) * x_0 + t_full * x_1
    v_t = x_1 - (1 - 1e-5) * x_0
    dt_flow = np.log2(FLAGS.model['denoise_timesteps']).astype(jnp.int32)
    dt_base = jnp.ones(images.shape[0], dtype=jnp.int32) * dt_flow
    bst_size = FLAGS.batch_size // FLAGS.model['bootstrap_every']
    bst_size_data = FLAGS.batch_size - bst_size
    x_t = jnp.concatenate([bst_xt, x_t[:bst_size_data]], axis=0)
    t = jnp.concatenate([bst_t, t[:bst_size_data]], axis=0)
    dt_base = jnp.concatenate([bst_dt, dt_base[:bst_size_data]], axis=0)
    v_t = jnp.concatenate([bst_v, v_t[:bst_size_data]], axis=0)
    labels_dropped = jnp.concatenate([bst_l, labels_dropped[:bst_size_data]], axis=0)
    info['bootstrap_ratio'] = jnp.mean(dt_base != dt_flow)
    info['v_magnitude_bootstrap'] = jnp.sqrt(jnp.mean(jnp.square(bst_v)))
    info['v_magnitude_b1'] = jnp.sqrt(jnp.mean(jnp.square(v_b1)))
    info['v_magnitude_b2'] = jnp.sqrt(jnp.mean(jnp.square(v_b2)))
    return x_t, v_t, t, dt_base, labels_dropped, info


# ---- train.py main(), up to the train loop ----
def default_flags(**model):
    """train.py's flag defaults (batch_size 32, its model_config), the latent shape of imagenet256."""
    cfg = dict(lr=0.0001, beta1=0.9, beta2=0.999, weight_decay=0.1, dropout=0.0, hidden_size=64, patch_size=8,
               depth=2, num_heads=2, mlp_ratio=1, class_dropout_prob=0.1, num_classes=1000, denoise_timesteps=128,
               cfg_scale=4.0, target_update_rate=0.999, sharding='dp', bootstrap_every=8, bootstrap_ema=1,
               train_type='shortcut', image_size=32, image_channels=4)
    cfg.update(model)
    return SimpleNamespace(batch_size=32, model=cfg)


def build(devices, FLAGS=None):
    """main()'s model, optimizer, shardings, jitted init and jitted update, for ``devices``."""
    FLAGS = FLAGS or default_flags()
    example_obs_shape = (1, FLAGS.model['image_size'], FLAGS.model['image_size'], FLAGS.model['image_channels'])
    model_def = DiT(patch_size=FLAGS.model['patch_size'], hidden_size=FLAGS.model['hidden_size'],
                    depth=FLAGS.model['depth'], num_heads=FLAGS.model['num_heads'],
                    mlp_ratio=FLAGS.model['mlp_ratio'], out_channels=example_obs_shape[-1],
                    class_dropout_prob=FLAGS.model['class_dropout_prob'], num_classes=FLAGS.model['num_classes'],
                    dropout=FLAGS.model['dropout'], ignore_dt=False)
    lr_schedule = lambda x: FLAGS.model['lr']
    adam = optax.adamw(learning_rate=lr_schedule, b1=FLAGS.model['beta1'], b2=FLAGS.model['beta2'],
                       weight_decay=FLAGS.model['weight_decay'])
    tx = optax.chain(adam)

    def init(rng):
        param_key, dropout_key, dropout2_key = jax.random.split(rng, 3)
        example_t = jnp.zeros((1,))
        example_dt = jnp.zeros((1,))
        example_label = jnp.zeros((1,), dtype=jnp.int32)
        example_obs = jnp.zeros(example_obs_shape)
        model_rngs = {'params': param_key, 'label_dropout': dropout_key, 'dropout': dropout2_key}
        params = model_def.init(model_rngs, example_obs, example_t, example_dt, example_label)['params']
        opt_state = tx.init(params)
        return TrainStateEma.create(model_def, params, rng=rng, tx=tx, opt_state=opt_state)

    rng = jax.random.PRNGKey(10)
    train_state_shape = jax.eval_shape(init, rng)
    mesh, data_sharding, train_state_sharding, no_shard = create_sharding(
        FLAGS.model['sharding'], train_state_shape, devices)
    init_train_state = jax.jit(init, out_shardings=train_state_sharding)

    @partial(jax.jit, out_shardings=(train_state_sharding, no_shard))
    def update(train_state, train_state_teacher, images, labels, force_t=-1, force_dt=-1):
        new_rng, targets_key, dropout_key, perm_key = jax.random.split(train_state.rng, 4)
        info = {}
        id_perm = jax.random.permutation(perm_key, images.shape[0])
        images = images[id_perm]
        labels = labels[id_perm]
        images = jax.lax.with_sharding_constraint(images, data_sharding)
        labels = jax.lax.with_sharding_constraint(labels, data_sharding)
        x_t, v_t, t, dt_base, labels, info = get_targets(FLAGS, targets_key, train_state, images, labels,
                                                         force_t, force_dt)

        def loss_fn(grad_params):
            v_prime, logvars, activations = train_state.call_model(
                x_t, t, dt_base, labels, train=True, rngs={'dropout': dropout_key}, params=grad_params,
                return_activations=True)
            mse_v = jnp.mean((v_prime - v_t) ** 2, axis=(1, 2, 3))
            loss = jnp.mean(mse_v)
            info = {'loss': loss, 'v_magnitude_prime': jnp.sqrt(jnp.mean(jnp.square(v_prime))),
                    **{'activations/' + k: jnp.sqrt(jnp.mean(jnp.square(v))) for k, v in activations.items()}}
            bootstrap_size = FLAGS.batch_size // FLAGS.model['bootstrap_every']
            info['loss_flow'] = jnp.mean(mse_v[bootstrap_size:])
            info['loss_bootstrap'] = jnp.mean(mse_v[:bootstrap_size])
            return loss, info

        grads, new_info = jax.grad(loss_fn, has_aux=True)(train_state.params)
        info = {**info, **new_info}
        updates, new_opt_state = train_state.tx.update(grads, train_state.opt_state, train_state.params)
        new_params = optax.apply_updates(train_state.params, updates)
        info['grad_norm'] = optax.global_norm(grads)
        info['update_norm'] = optax.global_norm(updates)
        info['param_norm'] = optax.global_norm(new_params)
        info['lr'] = lr_schedule(train_state.step)
        train_state = train_state.replace(rng=new_rng, step=train_state.step + 1, params=new_params,
                                          opt_state=new_opt_state)
        train_state = train_state.update_ema(FLAGS.model['target_update_rate'])
        return train_state, info

    batch = (jax.ShapeDtypeStruct((FLAGS.batch_size, *example_obs_shape[1:]), jnp.float32, sharding=data_sharding),
             jax.ShapeDtypeStruct((FLAGS.batch_size,), jnp.int32, sharding=data_sharding))
    return SimpleNamespace(mesh=mesh, init=init_train_state, update=update, rng=rng, batch=batch,
                           data_sharding=data_sharding)


# train.py's sizes but one DiT block, to keep tests/programs/test_diffusion_step.py fast
FLAGS = default_flags(depth=1)
_run = build(jax.devices(), FLAGS)
mesh, init_train_state, update = _run.mesh, _run.init, _run.update
