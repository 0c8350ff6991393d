"""A new user's trial on RL post-training (issue 40, item 6): google/tunix's GRPO policy update of
a Llama-3-shaped Flax NNX model, reproduced in tests/data/tunix_grpo.py as tunix holds it (the
model's Params annotated with tunix's default sharding on an `(fsdp, tp)` mesh, the GRPO loss with
its KL penalty, peft_trainer's step jitted as `nnx.jit(train_step, donate_argnames=("optimizer",))`).
Every figure stagetool reports equals raw JAX's compile of the same code on the same devices."""

from __future__ import annotations

import warnings

import jax
import pytest
from helpers import report_as_raw_jax_compiles_it
from jax.sharding import NamedSharding, PartitionSpec as P

# the code as published calls APIs its JAX/Flax/optax now deprecate (pxla.thread_resources, Param(sharding=),
# optax.global_norm): stagetool notes such a warning, and this suite's -W error would fail both sides on it
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _raw_compile(raw, devices):
    """tunix's step compiled by raw JAX for ``devices``: the model and optimizer abstract, each
    Variable laid out as `nnx.get_named_sharding` gives it (tunix's dummy_model_creator), the batch
    over fsdp."""
    from flax import nnx

    mesh = raw.make_mesh(devices)
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the code's pxla.thread_resources, .value
        model = nnx.eval_shape(raw.create_model)
        optimizer = nnx.eval_shape(lambda: raw.create_optimizer(raw.create_model()))
        for obj in (model, optimizer):
            state = nnx.state(obj)
            nnx.update(obj, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                         state, nnx.get_named_sharding(state, mesh)))
        example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P("fsdp"))),
                               jax.eval_shape(raw.make_example))
        return raw.jit_train_step.trace(model, optimizer, example).lower().compile()


@pytest.mark.parametrize("topology", [None, "v5e:2x4"])
def test_tunix_grpo_step_stages_as_raw_jax_compiles_it(run_cli, tmp_path, monkeypatch, topology):
    monkeypatch.chdir(tmp_path)
    fn, _ = report_as_raw_jax_compiles_it(run_cli, tmp_path, "tunix_grpo", "jit_train_step", topology, _raw_compile)
    leaves = {leaf["path"]: leaf for leaf in fn["inputs"]}
    # tunix's annotations: q (fsdp, tp, None), the MLP's up-projection (fsdp, tp), the batch over fsdp
    assert leaves["model/layers/0/attn/q_proj/w/value"]["compiled"] == "P('fsdp', 'tp', None)"
    assert leaves["train_example/completion_ids"]["compiled"] == "P('fsdp', None)"
    # nnx.jit donates the optimizer (its Adam moments and step), not the model it updates
    donated = {p for p, leaf in leaves.items() if leaf["donated"]}
    assert donated and all(p.startswith("optimizer/") for p in donated)
    assert leaves["train_example/prompt_mask"]["unused"]  # process_ids recomputes it from the ids


VALUE_ACCESS = """\
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((4, 8)))


model = Linear()


def step(model, x):
    return x @ model.w.value  # tunix's Einsum reads its weight this way
"""


def test_a_warning_while_staging_is_noted_whole(run_cli, tmp_path, monkeypatch):
    """tunix's `self.w.value` makes Flax warn "'.value' access is now deprecated. For Variable[Array]
    instances use:" and, on the following lines, what to use: the note stopped at "use:"."""
    from helpers import write

    write(tmp_path, "lin.py", VALUE_ACCESS)
    write(tmp_path, "lin.stagetool.yaml", """\
        version: 1
        functions:
          step: {target: lin.py:step, args: [{ref: lin.py:model}, 'f32[2,4]']}
        """)
    monkeypatch.chdir(tmp_path)
    (fn,) = run_cli("cost", "lin.py:step", "--format", "json", check=0).json()["functions"]
    (note,) = [n for n in fn["notes"] if "'.value' access is now deprecated" in n]
    assert note.endswith("For Variable[Array] instances use: variable[...] For other Variable types use: "
                         "variable.get_value()"), note


EINSUM_MODULES = """\
import jax.numpy as jnp
from flax import nnx


class Einsum(nnx.Module):
    def __init__(self, shape, *, rngs):
        self.w = nnx.Param(nnx.initializers.normal()(rngs.params(), shape))


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = Einsum((16, 2, 8), rngs=rngs)
        self.o_proj = Einsum((2, 8, 16), rngs=rngs)


model = Attention(nnx.Rngs(0))


def step(model, x):
    q = jnp.einsum("BTD,DNH->BTNH", x, model.q_proj.w[...])
    return jnp.einsum("BTNH,NHD->BTD", q, model.o_proj.w[...])
"""


def test_why_a_module_name_says_the_pattern_that_names_its_leaves(run_cli, tmp_path, monkeypatch):
    """A tunix user asks `why --leaf q_proj` (the module, as the model code names it): its leaf is
    `model/q_proj/w/value`, so the answer was only 'names no input or output leaf' with no close
    match, though the hint promises a regular expression will do."""
    from helpers import write

    write(tmp_path, "att.py", EINSUM_MODULES)
    write(tmp_path, "att.stagetool.yaml", """\
        version: 1
        functions:
          step: {target: att.py:step, args: [{ref: att.py:model}, 'f32[2,4,16]']}
        """)
    monkeypatch.chdir(tmp_path)
    err = " ".join(run_cli("why", "att.py:step", "--leaf", "q_proj", check=2).stderr.split())
    assert ("--leaf 'q_proj' names no input or output leaf of step; it is a module (a subtree): 'q_proj/.*' names "
            "its 1 leaf (model/q_proj/w/value)") in err
    out = run_cli("why", "att.py:step", "--leaf", "q_proj/.*", check=0).stdout
    assert "input model/q_proj/w/value" in out and "o_proj" not in out
