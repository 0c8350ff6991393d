"""How much slower is `stagetool report` than a bare script doing the same JAX calls?

Both run as whole processes on the same function and inputs (the bundled example and its spec):
the bare script builds the inputs itself, then `jax.jit(f).trace(...).lower()`, `.compile()`,
`as_text()` of both stages, `cost_analysis()` of both and `memory_analysis()`. Each is run
`--runs` times, alternating; the medians and their ratio are printed. The goal is a ratio
≤ 1.05: stagetool's own work (spec, rendering, HLO parsing) should be small next to JAX's.

    python bench/bench_overhead.py [--runs 7] [--example mlp|transformer]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BARE = {
    "mlp": textwrap.dedent("""
        import jax, jax.numpy as jnp, sys
        jax.config.update("jax_num_cpu_devices", 8)
        sys.path.insert(0, "examples")
        from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
        import mlp
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        shapes = jax.eval_shape(lambda k: mlp.init_params(k, 512, 1024, 256), jax.random.key(0))
        specs = {"w1": P(None, "model"), "w2": P("model", None), "b1": P("model"), "b2": None}
        params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=None if specs[k] is None else NamedSharding(mesh, specs[k]))
                  for k, v in shapes.items()}
        batch = {"x": jax.ShapeDtypeStruct((128, 512), jnp.float32, sharding=NamedSharding(mesh, P("data", None))),
                 "y": jax.ShapeDtypeStruct((128,), jnp.int32, sharding=NamedSharding(mesh, P("data")))}
        with jax.set_mesh(mesh):
            lowered = jax.jit(mlp.train_step, donate_argnums=(0,)).trace(params, batch).lower()
            compiled = lowered.compile()
        print(len(lowered.as_text()), len(compiled.as_text()), lowered.cost_analysis(), compiled.cost_analysis(),
              compiled.memory_analysis())
    """),
    "transformer": textwrap.dedent("""
        import functools, re, sys
        import jax, jax.numpy as jnp
        jax.config.update("jax_num_cpu_devices", 8)
        sys.path.insert(0, "examples")
        from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
        import transformer as model
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        sizes = dict(vocab=1024, d_model=256, n_layers=2, d_ff=1024, max_seq=128)
        key = jax.random.key(0)
        def rule(path):
            if re.search(r"/layers/(wq|wk|wv|w_up)$", path): return P(None, None, "model")
            if re.search(r"/layers/(wo|w_down)$", path): return P(None, "model", None)
            if path.endswith("/embed"): return P("model", None)
            if path.endswith("/pos_embed"): return None
            return P()
        def place(tree, root):
            def one(kp, s):
                path = root + "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp)
                spec = rule(path)
                return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=None if spec is None else NamedSharding(mesh, spec))
            return jax.tree_util.tree_map_with_path(one, tree)
        params = place(jax.eval_shape(functools.partial(model.init_params, **sizes), key), "params")
        opt = place(jax.eval_shape(functools.partial(model.init_opt_state, **sizes), key), "opt_state")
        batch = {k: jax.ShapeDtypeStruct((16, 128), jnp.int32, sharding=NamedSharding(mesh, P("data", None)))
                 for k in ("tokens", "targets")}
        with jax.set_mesh(mesh):
            lowered = jax.jit(model.train_step, static_argnames=("n_heads",), donate_argnums=(0, 1)).trace(
                params, opt, batch, n_heads=4).lower()
            compiled = lowered.compile()
        print(len(lowered.as_text()), len(compiled.as_text()), lowered.cost_analysis(), compiled.cost_analysis(),
              compiled.memory_analysis())
    """),
}
STAGETOOL = {
    "mlp": [sys.executable, "-m", "stagetool", "report", "examples/mlp.py:train_step", "--format", "json",
            "-o", "/dev/null"],
    "transformer": [sys.executable, "-m", "stagetool", "report", "examples/transformer.py:train_step", "--format",
                    "json", "-o", "/dev/null"],
}


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--example", choices=sorted(BARE), default="mlp")
    args = parser.parse_args()
    bare_cmd = [sys.executable, "-c", BARE[args.example]]
    tool_cmd = STAGETOOL[args.example]
    timed(bare_cmd), timed(tool_cmd)  # warm the file cache
    bare, tool = [], []
    for _ in range(args.runs):
        bare.append(timed(bare_cmd))
        tool.append(timed(tool_cmd))
    b, t = statistics.median(bare), statistics.median(tool)
    print(f"example: {args.example}, runs: {args.runs}")
    print(f"bare script       median {b:.3f} s  (min {min(bare):.3f}, max {max(bare):.3f})")
    print(f"stagetool report  median {t:.3f} s  (min {min(tool):.3f}, max {max(tool):.3f})")
    print(f"ratio stagetool/bare: median {t / b:.3f}, min {min(tool) / min(bare):.3f}  (goal ≤ 1.05; the min "
          "is the steadier figure on a busy machine: noise only adds time)")


if __name__ == "__main__":
    main()
