"""Write ``tpu_v5e_2x4_train_step.hlo.gz``: a real compiled TPU module for the parser tests.

Needs ``libtpu`` (the ``jax[tpu]`` extra; no TPU: it compiles for a compile-only v5e 2x4
topology). Run from the repository root:

    python tests/hlo/data/make_tpu_fixture.py

The program is a train step over a (data=2, model=4) mesh with weights sharded FSDP-style over
``data`` and tensor-parallel over ``model``: a ``lax.scan`` over layers whose weights are
gathered inside the loop (TPU prints no ``known_trip_count``: the trip count must be derived),
then one attention + MLP block whose weight gathers TPU runs asynchronously (split over start /
continuation / done fusions sharing a channel id) and whose gradients it reduce-scatters
(``all-reduce-scatter`` fusions).
"""

from __future__ import annotations

import gzip
import pathlib

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

OUT = pathlib.Path(__file__).with_name("tpu_v5e_2x4_train_step.hlo.gz")
LAYERS, D, HEADS, D_HEAD, D_FF, SEQ, BATCH = 3, 256, 8, 32, 1024, 64, 16


def main() -> None:
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4")
    mesh = topologies.make_mesh(topo, (2, 4), ("data", "model"))
    full = NamedSharding(mesh, P())

    def s(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    def block(p, x):
        b, t, _ = x.shape
        q = (x @ p["wq"]).reshape(b, t, HEADS, D_HEAD)
        k = (x @ p["wk"]).reshape(b, t, HEADS, D_HEAD)
        v = (x @ p["wv"]).reshape(b, t, HEADS, D_HEAD)
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / D_HEAD**0.5, axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, HEADS * D_HEAD) @ p["wo"]
        return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]

    def loss(p, x):
        def layer(h, w):
            w = jax.lax.with_sharding_constraint(w, full)
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(layer, x, p["ws"])
        return jnp.mean(block(p, h).astype(jnp.float32) ** 2)

    def step(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b.astype(a.dtype), p, g)

    hd = HEADS * D_HEAD
    params = {
        "ws": s((LAYERS, D, D), P(None, "data", None)),
        "wq": s((D, hd), P("data", "model")),
        "wk": s((D, hd), P("data", "model")),
        "wv": s((D, hd), P("data", "model")),
        "wo": s((hd, D), P("model", "data")),
        "w1": s((D, D_FF), P("data", "model")),
        "w2": s((D_FF, D), P("model", "data")),
    }
    text = jax.jit(step).lower(params, s((BATCH, SEQ, D), P("data"))).compile().as_text()
    OUT.write_bytes(gzip.compress(text.encode(), mtime=0))
    print(f"wrote {OUT} ({len(text)} characters)")


if __name__ == "__main__":
    main()
