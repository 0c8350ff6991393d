"""A MaxText-style train step of our own (issue 30, item 7), staged through the CLI for the
compile-only ``--topology v5e:2x4`` (and the simulated CPU mesh), with every memory figure equal to
raw JAX compiling the same code for the same devices.

It has what MaxText's ``train_compile.py`` step has and ``tests/inputs/test_own_mesh.py``'s smaller
MaxText-style models do not: a config object whose mesh comes from ``jax.devices()`` at import via
``create_device_mesh``; parameters named by logical axes, mapped to mesh axes by the config's
``logical_axis_rules`` (given to the spec as ``logical_axis_rules: mts.py:CONFIG``, active while
tracing as MaxText's ``nn_partitioning.axis_rules`` is); an init jitted with ``out_shardings`` on that
mesh; Flax NNX state (model and ``nnx.Optimizer`` under adamw) passed as one ``nnx.State``; layers
stacked and run by ``lax.scan`` under ``jax.checkpoint`` with a names policy; the step jitted with
in/out shardings, donation and (on TPU) ``compiler_options``. The raw side calls the module's own
``build(devices, config)`` with stagetool's compile-only devices, under the mesh and the rules.
A ``--mesh`` of another shape re-lays the code's shardings by axis name and equals raw JAX with the
config's parallelism at that shape.
bench/results/maxtext_train_compile.md has the same comparison on MaxText's own step.
"""

from __future__ import annotations

import re

import jax
import pytest
from helpers import raw_module, write

from stagetool.devices import tpu_topology
from stagetool.plan.target import parse_target

pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

MODEL = '''"""A MaxText-style train step (our own, in MaxText's manner): a config builds the mesh from
jax.devices() at import; parameters carry logical axis names mapped to mesh axes by the config's
rules; the init is jitted with out_shardings on that mesh; the model is Flax NNX with layers stacked
and run by lax.scan under remat; the step is jitted with in/out shardings, donation and compiler
options, over the nnx.State of model and optimizer."""
import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
import flax.linen as nn
from flax.linen import partitioning as nn_partitioning
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import mesh_utils
from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 512
    emb: int = 128
    mlp: int = 256
    layers: int = 3
    batch: int = 16
    seq: int = 64
    mesh_axes: tuple = ("data", "fsdp", "tensor")
    ici_parallelism: tuple = (1, 4, 2)
    logical_axis_rules: tuple = (("activation_batch", ("data", "fsdp")), ("activation_embed", "tensor"),
                                 ("activation_mlp", "tensor"), ("activation_vocab", "tensor"),
                                 ("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"), ("layers", None))
    compiler_options: tuple = ()


def create_device_mesh(config, devices):
    """The mesh from the devices and the config's parallelism, as MaxText's create_device_mesh."""
    return Mesh(mesh_utils.create_device_mesh(config.ici_parallelism, devices), config.mesh_axes)


def constrain(x, names):
    return nn_partitioning.with_sharding_constraint(x, names)


class Decoder(nnx.Module):
    def __init__(self, cfg, rngs):
        init = nnx.initializers.normal(0.02)
        p = lambda shape, names: nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names)  # noqa: E731
        self.embed = p((cfg.vocab, cfg.emb), ("vocab", "embed"))
        self.wi = p((cfg.layers, cfg.emb, cfg.mlp), ("layers", "embed", "mlp"))
        self.wo = p((cfg.layers, cfg.mlp, cfg.emb), ("layers", "mlp", "embed"))
        self.norm = nnx.Param(jnp.ones((cfg.layers, cfg.emb)), out_sharding=("layers", "embed"))
        self.unembed = p((cfg.emb, cfg.vocab), ("embed", "vocab"))

    def __call__(self, tokens):
        x = constrain(self.embed[...].astype(jnp.bfloat16)[tokens], ("activation_batch", None, "activation_embed"))

        def layer(x, w):
            h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(x.dtype)
            h = checkpoint_name(jnp.einsum("bse,em->bsm", h * w["norm"].astype(x.dtype), w["wi"].astype(x.dtype)), "mlpwi")
            h = constrain(jax.nn.gelu(h), ("activation_batch", None, "activation_mlp"))
            y = jnp.einsum("bsm,me->bse", h, w["wo"].astype(x.dtype))
            return constrain(x + y, ("activation_batch", None, "activation_embed")), None

        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names("mlpwi"), prevent_cse=False)
        x, _ = jax.lax.scan(layer, x, {"wi": self.wi[...], "wo": self.wo[...], "norm": self.norm[...]})
        return constrain(x @ self.unembed[...].astype(x.dtype), ("activation_batch", None, "activation_vocab"))


class TrainState(nnx.Module):
    def __init__(self, cfg, rngs):
        self.model = Decoder(cfg, rngs)
        self.optimizer = nnx.Optimizer(self.model, optax.adamw(1e-3), wrt=nnx.Param)


def build(devices, config=None):
    """Everything from the devices: mesh, the init and the step jitted on it, and the abstract inputs."""
    cfg = config or Config()
    mesh = create_device_mesh(cfg, devices)
    rules = cfg.logical_axis_rules
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(rules):
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: TrainState(cfg, nnx.Rngs(0))))
    shardings = nn.logical_to_mesh_sharding(nnx.get_partition_spec(abstract), mesh, rules)
    batch_sharding = nn.logical_to_mesh_sharding(
        jax.sharding.PartitionSpec("activation_batch", None), mesh, rules)
    batch_shardings = {"inputs": batch_sharding, "targets": batch_sharding}

    def _init():
        return nnx.state(TrainState(cfg, nnx.Rngs(0)))

    def _step(state, batch):
        ts = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(batch["inputs"]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(ts.model)
        ts.optimizer.update(ts.model, grads)
        return nnx.state(ts), {"loss": loss}

    init = jax.jit(_init, out_shardings=shardings)
    options = dict(cfg.compiler_options)
    step = jax.jit(_step, in_shardings=(shardings, batch_shardings),
                   out_shardings=(shardings, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())),
                   donate_argnums=(0,), **({"compiler_options": options} if options else {}))
    structs = (jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings),
               {k: jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32, sharding=s) for k, s in batch_shardings.items()})
    return mesh, init, step, structs


TPU_OPTIONS = (("xla_tpu_enable_latency_hiding_scheduler", "false"),)


def config_for(devices):
    """The config as the code makes it: compiler options (MaxText's compile_xla_flags) on TPU only."""
    return Config(compiler_options=TPU_OPTIONS if devices[0].platform == "tpu" else ())


CONFIG = config_for(jax.devices())
MESH, init_state, train_step, _ = build(jax.devices(), CONFIG)
'''

SPEC = '''
version: 1
mesh:
  axes: {data: 1, fsdp: 4, tensor: 2}
logical_axis_rules: mts.py:CONFIG
functions:
  train_step:
    target: mts.py:train_step
    args:
      - init: mts.py:init_state
      - inputs: i32[16,64]
        targets: i32[16,64]
'''


def _devices(topology):
    if topology is None:
        return jax.devices()[:8]
    if not tpu_topology.libtpu_available():
        pytest.skip("libtpu not installed: pip install -e '.[tpu]'")
    return list(tpu_topology.tpu_topology(parse_target(topology)).devices)


_RAW: dict[tuple, jax.stages.Compiled] = {}


def _raw(path, devices, rules=True, **config):
    """The module imported as plain Python, its step built on ``devices`` and compiled as the code
    would be run: under its mesh and (unless ``rules`` is false) its logical axis rules. Each
    (platform, rules, config) is compiled once in the session (every test writes the same MODEL)."""
    from flax.linen import partitioning as nn_partitioning

    key = (devices[0].platform, len(devices), rules, tuple(sorted(config.items())))
    if key not in _RAW:
        module = raw_module(path, "mts")
        cfg = module.config_for(devices)
        cfg = type(cfg)(**{**cfg.__dict__, **config})
        mesh, _, step, structs = module.build(devices, cfg)
        with jax.set_mesh(mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules if rules else ()):
            _RAW[key] = step.lower(*structs).compile()
    return _RAW[key]


def _program(text):
    """The optimized HLO's instructions as sorted (result shape, opcode) pairs: equal for one program."""
    return sorted(re.findall(r"^\s*(?:ROOT )?\S+ = (.+?) ([a-z][\w-]*)\(", text, flags=re.MULTILINE))


@pytest.mark.parametrize("topology", [None, "v5e:2x4"])
def test_maxtext_style_step_memory_equals_raw_jax(run_cli, tmp_path, monkeypatch, topology):
    model = write(tmp_path, "mts.py", MODEL)
    write(tmp_path, "mts.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    devices = _devices(topology)
    where = ["--topology", topology] if topology else []
    doc = run_cli("report", "mts.py:train_step", "--format", "json", *where, check=0).json()
    f = doc["functions"][0]
    assert f.get("error") is None
    assert f["mesh"]["device_count"] == 8 and f["mesh"]["platform"] == devices[0].platform
    assert not [n for n in f["notes"] if "re-laid" in n]  # the code's own mesh is the staged one

    compiled = _raw(model, devices)
    stats, record = compiled.memory_analysis(), f["memory"]["record"]
    assert (record["argument_bytes"], record["output_bytes"], record["alias_bytes"], record["temp_bytes"],
            record["generated_code_bytes"]) == (stats.argument_size_in_bytes, stats.output_size_in_bytes,
                                                 stats.alias_size_in_bytes, stats.temp_size_in_bytes,
                                                 stats.generated_code_size_in_bytes)
    assert record["alias_bytes"] > 0  # the step's donation holds
    if topology:  # XLA:TPU's own peak, and its cost analysis
        assert record["peak_bytes_reported"] == stats.peak_memory_in_bytes
        cost = compiled.cost_analysis()
        assert f["cost"]["per_device"]["flops"] == cost["flops"]
    staged = run_cli("compile", "mts.py:train_step", *where, check=0).stdout
    assert _program(staged) == _program(compiled.as_text())

    # each of the step's settings counted: traced without the rules (its activation constraints then
    # do nothing) or compiled without the compiler options, the program differs, so the equality
    # above holds only because stagetool took them
    bare = _raw(model, devices, rules=False)
    assert _program(bare.as_text()) != _program(staged)
    if topology:
        assert f["compiler_options"] == [["xla_tpu_enable_latency_hiding_scheduler", "false"]]
        plain = _raw(model, devices, compiler_options=()).memory_analysis()
        assert (plain.temp_size_in_bytes, plain.generated_code_size_in_bytes) != (
            record["temp_bytes"], record["generated_code_bytes"])
    # the leaves' shardings are the rules' (params/wi: layers → None, embed → fsdp, mlp → tensor)
    wi = next(x for x in f["inputs"] if x["path"].endswith("model/wi/value"))
    assert wi["compiled"] == "P(None, 'fsdp', 'tensor')" and wi["donated"]


@pytest.mark.parametrize("topology", [None, "v5e:2x4"])
def test_maxtext_style_step_on_another_mesh_is_faithful(run_cli, tmp_path, monkeypatch, topology):
    """--mesh of another shape than the code's (fsdp=2 × tensor=4 for its 4 × 2): the init's and the
    step's own shardings are re-laid by axis name (a note says so), and every memory figure is raw
    JAX's for the same code with its mesh built at that shape."""
    model = write(tmp_path, "mts.py", MODEL)
    write(tmp_path, "mts.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    devices = _devices(topology)
    doc = run_cli("memory", "mts.py:train_step", "--no-peak", "--format", "json", "--mesh", "data=1,fsdp=2,tensor=4",
                  *(["--topology", topology] if topology else []), check=0).json()
    f = doc["functions"][0]
    assert f.get("error") is None
    assert [n for n in f["notes"] if "re-laid by axis name" in n]
    stats, record = _raw(model, devices, ici_parallelism=(1, 2, 4)).memory_analysis(), f["memory"]["record"]
    assert (record["argument_bytes"], record["output_bytes"], record["alias_bytes"], record["temp_bytes"],
            record["generated_code_bytes"]) == (stats.argument_size_in_bytes, stats.output_size_in_bytes,
                                                 stats.alias_size_in_bytes, stats.temp_size_in_bytes,
                                                 stats.generated_code_size_in_bytes)
    at_4x2 = _raw(model, devices).memory_analysis()
    assert at_4x2.argument_size_in_bytes != stats.argument_size_in_bytes or \
        at_4x2.temp_size_in_bytes != stats.temp_size_in_bytes  # the shape changes the program
