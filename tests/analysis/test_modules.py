"""The roll-up per module (issue 33, item 7): FLOPs, bytes, collectives and bytes live at the peak by
module path and phase. The rows add up to XLA's ``Compiled.cost_analysis()`` of the same function
(compiled here with raw JAX), with the derived count within 0.01% of it, and a layer's dot FLOPs are
the analytic 2·M·N·K: on a ``jax.named_scope`` + ``jax.checkpoint`` step, on the Flax NNX example
(module paths from source frames) and on the plain-JAX transformer example (every row outside a module)."""

from __future__ import annotations

import re
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from helpers import EXAMPLES, write
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stagetool.analysis.modules import (
    OUTSIDE,
    RESIDUAL,
    combined_members,
    frame_path,
    phase_of,
    scope_path,
)
from stagetool.hlo.parser import SourceFrame

MODEL = """\
import jax
import jax.numpy as jnp


def layer(x, w):
    with jax.named_scope("proj"):
        return jnp.tanh(x @ w)


def loss(w1, w2, x):
    with jax.named_scope("block"):
        h = layer(x, w1)
        with jax.named_scope("head"):
            y = jax.checkpoint(lambda h: jnp.sin(h @ w2))(h)
    return (y ** 2).sum()


def step(w1, w2, x):
    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2, x)
    return w1 - 0.1 * g1, w2 - 0.1 * g2
"""
SPEC = """\
version: 1
mesh: {axes: {data: 8}}
functions:
  step:
    target: m.py:step
    args: ['f32[256,512]', 'f32[512,128]', 'f32[512,256] @ [data, null]']
"""
COLLECTIVE_RE = re.compile(r"=\s*\S.*?\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def rows_of(doc: dict) -> dict[tuple[str, str], dict]:
    return {(r["path"], r["phase"]): r for r in doc["functions"][0]["modules"]["rows"]}


def assert_adds_up(modules: dict, xla_flops: float, xla_bytes: float) -> None:
    """The rows sum to XLA's figures, and the derived count alone is within 0.01% of them."""
    rows = modules["rows"]
    assert sum(r["flops"] for r in rows) == pytest.approx(xla_flops, rel=1e-12)
    assert sum(r["bytes_accessed"] for r in rows) == pytest.approx(xla_bytes, rel=1e-12)
    assert modules["xla_flops"] == xla_flops
    assert abs(modules["derived_flops"] - xla_flops) <= 1e-4 * xla_flops
    residual = [r for r in rows if r["path"] == RESIDUAL]
    assert sum(r["flops"] for r in residual) == pytest.approx(xla_flops - modules["derived_flops"])


def collective_counts(hlo_text: str) -> Counter:
    return Counter(m.group(1) for line in hlo_text.splitlines() for m in [COLLECTIVE_RE.search(line)] if m)


# ---- op names and frames, as JAX 0.10 writes them --------------------------------------------------


def test_paths_and_phases_from_jax_op_names():
    # Flax Linen under jax.grad with nn.remat, inside jax.named_scope("my_scope") (jax 0.10.2's own text)
    fwd = "jit(step)/jvp(my_scope)/MLP/up/dot_general"
    bwd = "jit(step)/transpose(jvp(my_scope))/MLP/up/transpose"
    remat_bwd = "jit(step)/transpose(jvp(my_scope))/MLP/jvp(my_scope)/MLP/checkpoint/down/dot_general"
    recompute = "jit(step)/transpose(jvp(my_scope))/jvp(my_scope)/checkpoint/rematted_computation/cos"
    update = "jit(step)/sub"
    assert scope_path(fwd) == scope_path(bwd)[:2] + ("up",) == ("my_scope", "MLP", "up")
    assert scope_path(remat_bwd) == ("my_scope", "MLP", "down")
    assert scope_path(recompute) == ("my_scope",)
    assert scope_path(update) == ()
    assert scope_path("jit(f)/jvp(jit(_take))/gather") == ()  # jnp's own jits are no module
    assert scope_path("jit(f)/jvp(a)/x/mul;jit(f)/jvp(b)/mul") == ("a", "x")  # a fused pair: its first name
    assert scope_path("jit(f)/jvp()/while/body/closed_call/bhqk,bkhd->bqhd/dot_general") == ()
    combined = "jit(s)/(transpose(jvp(LM))/MLP_0/Dense_0/dot_general:transpose(jvp(LM))/MLP_0/Dense_1/dot_general)"
    assert combined_members(combined) == ["jit(s)/transpose(jvp(LM))/MLP_0/Dense_0/dot_general",
                                          "jit(s)/transpose(jvp(LM))/MLP_0/Dense_1/dot_general"]
    assert [phase_of(n, differentiated=True) for n in (fwd, bwd, remat_bwd, recompute, update, None)] == \
        ["forward", "backward", "backward", "recompute", "update", "compiler-inserted"]
    assert phase_of(update, differentiated=False) == "forward"  # no gradient: all of it is the forward pass


def test_nnx_paths_from_source_frames(tmp_path):
    src = write(tmp_path, "model.py", "class LM:\n    def __call__(self, x):\n        return self.mlp(self.norm(x))\n\n"
                                      "class MLP:\n    def __call__(self, x):\n        return self.down(self.up(x))\n")
    lib = "/venv/lib/python3.11/site-packages/flax/nnx/nn/linear.py"
    frames = (SourceFrame(lib, 422, "Linear.__call__", 8),
              SourceFrame(str(src), 7, "MLP.__call__", 25),       # self.up( starts at column 25 (0-based)
              SourceFrame(str(src), 3, "LM.__call__", 15),        # self.mlp( at 15
              SourceFrame(str(src), 10, "train_step.<locals>.loss_fn", 4),
              SourceFrame("/venv/lib/python3.11/site-packages/flax/nnx/transforms/autodiff.py", 1, "GradFn.__call__", 0))
    assert frame_path(frames) == ("LM", "mlp", "up")
    missing = tuple(SourceFrame("/gone.py", f.line, f.function, f.column) if f.file == str(src) else f for f in frames)
    assert frame_path(missing) == ("LM", "MLP", "Linear")  # source not readable: class names


def test_arguments_go_to_the_module_their_key_path_names():
    from stagetool.analysis.modules import _argument_module

    paths = [("LM",), ("LM", "mlp"), ("LM", "mlp", "up"), ("LM", "embed")]
    assert _argument_module("optimizer/opt_state/0/mu/mlp/up/kernel", paths) == "LM/mlp/up"
    assert _argument_module("model/embed/embedding", paths) == "LM/embed"
    assert _argument_module("batch/tokens", paths) is None


# ---- through the CLI, against raw JAX ----------------------------------------------------------------


def test_named_scopes_remat_and_collectives_against_jax(run_cli, tmp_path):
    write(tmp_path, "m.py", MODEL)
    spec = write(tmp_path, "m.stagetool.yaml", SPEC)
    doc = run_cli("modules", "--spec", str(spec), "--chip", "tpu-v5e", "--format", "json", check=0).json()
    modules = doc["functions"][0]["modules"]
    rows = rows_of(doc)

    namespace: dict = {}
    exec(compile(MODEL, "m.py", "exec"), namespace)  # noqa: S102 - the test's own model
    mesh = jax.make_mesh((8,), ("data",))
    repl, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data", None))
    compiled = jax.jit(namespace["step"], in_shardings=(repl, repl, data)).lower(
        jax.ShapeDtypeStruct((256, 512), jnp.float32), jax.ShapeDtypeStruct((512, 128), jnp.float32),
        jax.ShapeDtypeStruct((512, 256), jnp.float32)).compile()
    xla = compiled.cost_analysis()
    assert_adds_up(modules, xla["flops"], xla["bytes accessed"])

    m = 512 // 8  # rows of x per device
    assert rows[("block/proj", "forward")]["dot_flops"] == 2 * m * 256 * 512       # x @ w1
    assert rows[("block/proj", "backward")]["dot_flops"] == 2 * m * 256 * 512      # d(w1) only: x is no variable
    assert rows[("block/head", "recompute")]["dot_flops"] == 2 * m * 512 * 128     # jax.checkpoint recomputes h @ w2
    assert rows[("block/head", "backward")]["dot_flops"] == 2 * (2 * m * 512 * 128)  # d(w2) and d(h)
    assert {p for p, _ in rows} == {"block", "block/head", "block/proj", OUTSIDE} | ({RESIDUAL} & {p for p, _ in rows})
    counted = Counter()
    for r in modules["rows"]:
        for t in r["collectives"]:
            counted[t["kind"]] += t["count"]
    assert counted == collective_counts(compiled.as_text())
    grads = [t for r in modules["rows"] if r["phase"] == "backward" for t in r["collectives"] if t["kind"] == "all-reduce"]
    assert sum(t["bytes_per_device"] for t in grads) == (256 * 512 + 512 * 128) * 4  # dW1 and dW2 summed over data
    peak = doc["functions"][0]["modules"]["peak_bytes"]
    assert peak == sum(r["peak_bytes"] for r in modules["rows"])
    # w1, w2 and this device's rows of x, named w1, w2, x: no module's name in their key paths
    assert rows[(OUTSIDE, "arguments")]["peak_bytes"] == (256 * 512 + 512 * 128 + m * 256) * 4

    # the time estimate on a v5e: the rows add up to the step's serial figure, and a dot takes at least its
    # FLOPs at the chip's published bf16 peak (197 TFLOP/s)
    assert modules["chip"] == "tpu-v5e"
    assert sum(r["seconds"] for r in modules["rows"]) == pytest.approx(modules["serial_seconds"], rel=1e-9)
    assert rows[("block/proj", "forward")]["seconds"] >= 2 * m * 256 * 512 / 197e12

    md = run_cli("modules", "--spec", str(spec), "--format", "markdown", check=0).stdout
    assert "### Per module" in md and "| block/head | recompute | 8.39 MFLOP |" in md
    html = run_cli("report", "--spec", str(spec), "--format", "html", check=0).stdout
    trees = 4 + any(p == RESIDUAL for p, _ in rows)  # block, block/head, block/proj, outside (and the residual)
    assert html.count('<details class="module">') == trees
    assert "<code>head</code>" in html
    assert '"modules"' not in run_cli("report", "--spec", str(spec), "--format", "json", check=0).stdout


@pytest.mark.slow
def test_nnx_example_rolls_up_by_module(run_cli_shared, isolated_imports):
    pytest.importorskip("flax")
    import optax
    from flax import nnx
    from jax.sharding import AxisType

    doc = run_cli_shared("modules", str(EXAMPLES / "nnx_lm.py:train_step"), "--format", "json", check=0).json()
    modules = doc["functions"][0]["modules"]
    rows = rows_of(doc)
    sys.path.insert(0, str(EXAMPLES))
    import nnx_lm

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    with jax.set_mesh(mesh):
        model = nnx_lm.LM(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        data = NamedSharding(mesh, P("data", None))
        batch = {"tokens": jax.device_put(jnp.zeros((16, 32), jnp.int32), data),
                 "targets": jax.device_put(jnp.zeros((16, 32), jnp.int32), data)}
        compiled = nnx.jit(nnx_lm.train_step.fun, donate_argnums=(0, 1)).lower(model, optimizer, batch).compile()
    xla = compiled.cost_analysis()
    assert_adds_up(modules, xla["flops"], xla["bytes accessed"])
    assert modules["path_sources"] == ["source frames"]
    # the model's attributes, as its own __call__ lines name them
    assert {"LM/embed", "LM/norm", "LM/mlp", "LM/mlp/up", "LM/mlp/down"} <= {p for p, _ in rows}
    tokens = 16 * 32 // 2        # the batch is split over data=2
    up = 2 * tokens * 64 * (256 // 4)  # nnx.Linear(64, 256), its kernel's columns split over model=4
    assert rows[("LM/mlp/up", "forward")]["dot_flops"] == rows[("LM/mlp/up", "forward")]["flops"] == up
    assert rows[("LM/mlp/up", "backward")]["dot_flops"] == 2 * up  # d(kernel) and d(x)
    assert {ph for _, ph in rows} >= {"forward", "backward", "update", "arguments"}
    # at the peak: the kernel and its two Adam moments, [64, 256/4] f32 each, by their key paths
    assert rows[("LM/mlp/up", "arguments")]["peak_bytes"] == 3 * 64 * (256 // 4) * 4


@pytest.mark.slow
def test_transformer_example_is_outside_every_module(run_cli_shared):
    from test_examples import transformer_stages

    doc = run_cli_shared("modules", "examples/transformer.py:train_step", "--mesh", "2x4", "--no-peak",
                         "--format", "json", check=0).json()
    modules = doc["functions"][0]["modules"]
    _, _, _, compiled = transformer_stages()
    xla = compiled.cost_analysis()
    assert_adds_up(modules, xla["flops"], xla["bytes accessed"])
    assert {r["path"] for r in modules["rows"]} <= {OUTSIDE, RESIDUAL}  # plain functions: no module to name
    phases = {r["phase"]: r["flops"] for r in modules["rows"] if r["path"] == OUTSIDE}
    assert set(phases) >= {"forward", "backward", "update"}
    assert phases["backward"] > phases["forward"] > phases["update"] > 0
    assert modules["peak_bytes"] is None and "no-peak" in modules["peak_reason"]
