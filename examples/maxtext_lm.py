"""A Llama-style decoder train step written the MaxText way, in plain JAX: the parameters are made by
``jax.jit(init_fn, out_shardings=...)``, their shardings coming from the model's own logical-axis
table, so the spec needs no ``rules:`` — stagetool reads the shardings the init gives its results.

    stagetool report examples/maxtext_lm.py:train_step

As the user's own job runs it::

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        params = init(jax.random.key(0))          # sharded as LOGICAL_AXES says
        params, loss = train_step(params, batch)

Shapes (``L`` layers, ``D`` = d_model, ``H`` heads of ``K``, ``F`` = d_ff, ``V`` = vocab)::

    {"embed": [V, D], "final_norm": [D], "unembed": [D, V],
     "layers": {"wq": [L, D, H, K], "wk", "wv": [L, D, H, K], "wo": [L, H, K, D],
                "w_gate", "w_up": [L, D, F], "w_down": [L, F, D], "attn_norm", "mlp_norm": [L, D]}}
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

VOCAB, D_MODEL, N_LAYERS, N_HEADS, HEAD_DIM, D_FF = 1024, 256, 2, 4, 64, 1024
LEARNING_RATE = 1e-3

#: logical axis → mesh axis (MaxText's ``logical_axis_rules``): weights sharded FSDP-style over
#: ``data`` on the embedding dimension and tensor-parallel over ``model`` on heads / MLP / vocab.
LOGICAL_TO_MESH = {"vocab": "model", "embed": "data", "heads": "model", "kv": None, "mlp": "model",
                   "layers": None, "norm": None}

#: each parameter's logical axes
LOGICAL_AXES = {
    "embed": ("vocab", "embed"),
    "final_norm": ("norm",),
    "unembed": ("embed", "vocab"),
    "layers": {
        "wq": ("layers", "embed", "heads", "kv"), "wk": ("layers", "embed", "heads", "kv"),
        "wv": ("layers", "embed", "heads", "kv"), "wo": ("layers", "heads", "kv", "embed"),
        "w_gate": ("layers", "embed", "mlp"), "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
        "attn_norm": ("layers", "norm"), "mlp_norm": ("layers", "norm"),
    },
}


def param_specs() -> dict:
    """The PartitionSpec of every parameter: :data:`LOGICAL_AXES` through :data:`LOGICAL_TO_MESH`."""
    return jax.tree.map(lambda names: P(*(LOGICAL_TO_MESH[n] for n in names)), LOGICAL_AXES,
                        is_leaf=lambda x: isinstance(x, tuple))


def init_fn(key):
    """The parameters (f32), unsharded: see the module docstring for the shapes."""
    ks = iter(jax.random.split(key, 16))
    L, D, H, K, F, V = N_LAYERS, D_MODEL, N_HEADS, HEAD_DIM, D_FF, VOCAB

    def normal(shape, fan_in):
        return jax.random.normal(next(ks), shape, jnp.float32) / jnp.sqrt(fan_in)

    return {
        "embed": normal((V, D), D),
        "final_norm": jnp.ones((D,), jnp.float32),
        "unembed": normal((D, V), D),
        "layers": {
            "wq": normal((L, D, H, K), D), "wk": normal((L, D, H, K), D), "wv": normal((L, D, H, K), D),
            "wo": normal((L, H, K, D), H * K),
            "w_gate": normal((L, D, F), D), "w_up": normal((L, D, F), D), "w_down": normal((L, F, D), F),
            "attn_norm": jnp.ones((L, D), jnp.float32), "mlp_norm": jnp.ones((L, D), jnp.float32),
        },
    }


def init(key):
    """The parameters, sharded as :func:`param_specs` says: ``jax.jit(init_fn, out_shardings=...)``
    (under the job's mesh, ``jax.set_mesh``), as MaxText builds its state."""
    return jax.jit(init_fn, out_shardings=param_specs())(key)


def einsum(spec, *operands):
    """The one helper every matmul of the model goes through (as many codebases have)."""
    return jnp.einsum(spec, *operands, preferred_element_type=jnp.float32)


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def attention(x, layer):
    """Causal multi-head self-attention; x: [B, S, D]."""
    q = einsum("bsd,dhk->bshk", x, layer["wq"])
    k = einsum("bsd,dhk->bshk", x, layer["wk"])
    v = einsum("bsd,dhk->bshk", x, layer["wv"])
    scores = einsum("bshk,bthk->bhst", q, k) / jnp.sqrt(q.shape[-1])
    S = x.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((S, S), bool)), scores, -1e9)
    out = einsum("bhst,bthk->bshk", jax.nn.softmax(scores, axis=-1), v)
    return einsum("bshk,hkd->bsd", out, layer["wo"])


def mlp(x, layer):
    gate = jax.nn.silu(einsum("bsd,df->bsf", x, layer["w_gate"]))
    return einsum("bsf,fd->bsd", gate * einsum("bsd,df->bsf", x, layer["w_up"]), layer["w_down"])


def forward(params, tokens):
    """Logits [B, S, V] of a token batch [B, S]."""
    x = params["embed"][tokens]

    def block(x, layer):
        x = x + attention(rms_norm(x, layer["attn_norm"]), layer)
        return x + mlp(rms_norm(x, layer["mlp_norm"]), layer), None

    x, _ = jax.lax.scan(block, x, params["layers"])
    return einsum("bsd,dv->bsv", rms_norm(x, params["final_norm"]), params["unembed"])


def loss_fn(params, tokens, targets):
    logits = forward(params, tokens)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@functools.partial(jax.jit, donate_argnums=(0,))
def train_step(params, batch):
    """One SGD step: ``(new params, loss)``; the parameters are donated."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch["tokens"], batch["targets"])
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, loss
