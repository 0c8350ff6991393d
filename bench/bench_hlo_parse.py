"""Benchmark: parse a large compiled HLO module and find its collectives.

Builds a transformer train step whose layers are unrolled in Python (not scanned), so that the
compiled, partitioned HLO text is tens of MB, on 8 simulated CPU devices with a 2x4
(data, model) mesh: batch over ``data``, attention heads and MLP hidden over ``model``, weights
also sharded over ``data`` (FSDP-style), so XLA:CPU emits thousands of all-gathers and
all-reduces. Then it times :func:`stagetool.hlo.parser.parse_hlo_module`,
:func:`stagetool.hlo.collectives.find_collectives` and ``summarize`` on the module of
``--layers`` layers and on one of half as many, and prints MB/s, lines/s and the time ratio
full/half (about the text-size ratio when the work is linear).

Compiling takes most of the run: about 40 s for 96 layers (11 MB of text) and 220 s for 192
layers (23 MB) on one CPU core; ``--cache DIR`` keeps the module texts and reuses them.

Measured (2-core VM shared with other jobs, best of 5): 192 layers, 22.6 MB, 205k lines,
151k instructions, 3847 collectives: parse 1.9 s (12 MB/s, 110k lines/s), find_collectives
0.19 s, summarize 5 ms; full/half: text 2.01x, parse 2.13x, find_collectives 1.98x.

Usage: python bench/bench_hlo_parse.py [--layers 192] [--repeat 3] [--cache DIR]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.hlo import collectives
from stagetool.hlo import parser as hlo

D_MODEL, HEADS, D_HEAD, D_FF, SEQ, BATCH, VOCAB = 256, 8, 32, 1024, 64, 16, 512


def _layer_specs():
    return {
        "wq": P("data", "model"),
        "wk": P("data", "model"),
        "wv": P("data", "model"),
        "wo": P("model", "data"),
        "w1": P("data", "model"),
        "w2": P("model", "data"),
        "ln": P(),
    }


def _layer_shapes():
    hd = HEADS * D_HEAD
    return {
        "wq": (D_MODEL, hd),
        "wk": (D_MODEL, hd),
        "wv": (D_MODEL, hd),
        "wo": (hd, D_MODEL),
        "w1": (D_MODEL, D_FF),
        "w2": (D_FF, D_MODEL),
        "ln": (D_MODEL,),
    }


def _block(p, x):
    b, s, _ = x.shape
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * p["ln"]
    q = (h @ p["wq"]).reshape(b, s, HEADS, D_HEAD)
    k = (h @ p["wk"]).reshape(b, s, HEADS, D_HEAD)
    v = (h @ p["wv"]).reshape(b, s, HEADS, D_HEAD)
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / D_HEAD**0.5, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, HEADS * D_HEAD)
    x = x + o @ p["wo"]
    return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def _train_step(params, tokens, targets):
    def loss(ps):
        x = ps["embed"][tokens]
        for layer in ps["layers"]:  # unrolled on purpose: one copy of the block per layer
            x = _block(layer, x)
        logits = x @ ps["embed"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))

    g = jax.grad(loss)(params)
    return jax.tree.map(lambda a, b: a - 1e-3 * b, params, g)


def build_module_text(layers: int) -> str:
    """Compile the unrolled train step with ``layers`` layers; return ``compiled.as_text()``."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def s(shape, spec, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    specs, shapes = _layer_specs(), _layer_shapes()
    layer = {k: s(shapes[k], specs[k]) for k in shapes}
    params = {"embed": s((VOCAB, D_MODEL), P(None, "model")), "layers": [dict(layer) for _ in range(layers)]}
    tokens = s((BATCH, SEQ), P("data"), jnp.int32)
    return jax.jit(_train_step).lower(params, tokens, tokens).compile().as_text()


def measure(texts: dict[int, str], repeat: int) -> dict[int, dict]:
    """Time parse / find_collectives / summarize on every text, sizes interleaved per round so
    that machine noise hits all sizes alike; keep the best time of ``repeat`` rounds."""
    mesh = collectives.MeshAxes(("data", "model"), (2, 4))
    best = {n: {"t_parse": float("inf"), "t_find": float("inf"), "t_summary": float("inf")} for n in texts}
    for _ in range(repeat):
        for n, text in texts.items():
            t0 = time.perf_counter()
            module = hlo.parse_hlo_module(text)
            t1 = time.perf_counter()
            found = collectives.find_collectives(module, mesh)
            t2 = time.perf_counter()
            summary = collectives.summarize(found)
            t3 = time.perf_counter()
            r = best[n]
            r["t_parse"] = min(r["t_parse"], t1 - t0)
            r["t_find"] = min(r["t_find"], t2 - t1)
            r["t_summary"] = min(r["t_summary"], t3 - t2)
            r.update(
                mb=len(text.encode()) / 1e6,
                lines=text.count("\n") + 1,
                instructions=sum(len(c.instructions) for c in module.computations),
                unparsed=len(module.unparsed_lines),
                collectives=len(found),
                summary=summary,
            )
            del module, found
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache", type=pathlib.Path, default=None, help="keep/reuse the module texts here")
    args = ap.parse_args()

    texts = {}
    for n in (args.layers // 2, args.layers):
        t0 = time.perf_counter()
        cached = args.cache / f"train_step_{n}_layers.hlo" if args.cache else None
        if cached is not None and cached.exists():
            texts[n], how = cached.read_text(), "read from cache"
        else:
            texts[n], how = build_module_text(n), "compiled"
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(texts[n])
        print(f"{n:4d} layers: {how} in {time.perf_counter() - t0:.1f} s", flush=True)

    results = measure(texts, args.repeat)
    for n, r in results.items():
        print(
            f"{n:4d} layers: {r['mb']:7.2f} MB, {r['lines']:8d} lines, {r['instructions']:8d} instructions, "
            f"{r['collectives']:5d} collectives, {r['unparsed']} unparsed lines"
        )
        print(
            f"     parse {r['t_parse']:.3f} s = {r['mb'] / r['t_parse']:.1f} MB/s, "
            f"{r['lines'] / r['t_parse'] / 1e3:.0f}k lines/s; find_collectives {r['t_find']:.3f} s; "
            f"summarize {r['t_summary'] * 1e3:.1f} ms"
        )
    half, full = results[args.layers // 2], results[args.layers]
    print(
        f"full/half: text {full['mb'] / half['mb']:.2f}x, parse time {full['t_parse'] / half['t_parse']:.2f}x, "
        f"find_collectives time {full['t_find'] / half['t_find']:.2f}x"
    )
    for row in full["summary"].by_kind_and_mesh_axes:
        print(
            f"  {row.kind:20s} {row.mesh_axes!s:22s} count {row.count:5d}  {row.bytes_per_device / 1e6:9.2f} MB/device"
        )


if __name__ == "__main__":
    main()
