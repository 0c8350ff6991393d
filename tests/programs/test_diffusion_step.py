"""A new user's trial on a diffusion train step (issue 40, item 6): kvfrans/shortcut-models' DiT
`update`, reproduced in tests/data/shortcut_dit.py as its train.py holds it (a 1-D `devices` mesh
from `mesh_utils.create_device_mesh`, `jax.jit(init, out_shardings=...)`, the step jitted with
`out_shardings` and constraining its batch with `with_sharding_constraint`, the teacher state
`None`). Every figure stagetool reports equals raw JAX's compile of the same code on the same
devices."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_figures_are_raw_jaxs, raw_module, report_as_raw_jax_compiles_it, write

# the code as published calls APIs its JAX/Flax/optax now deprecate (pxla.thread_resources, Param(sharding=),
# optax.global_norm): stagetool notes such a warning, and this suite's -W error would fail both sides on it
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

NONE_ARGUMENT = """\
from functools import partial
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.experimental import mesh_utils

mesh = Mesh(mesh_utils.create_device_mesh((jax.device_count(),)), axis_names=("devices"))
data_sharding = NamedSharding(mesh, PartitionSpec("devices"))
no_shard = NamedSharding(mesh, PartitionSpec())


@partial(jax.jit, out_shardings=(no_shard, no_shard))
def update(train_state, train_state_teacher, images, labels, force_t=-1, force_dt=-1):
    if train_state_teacher is not None:
        train_state = jax.tree.map(lambda a, b: (a + b) / 2, train_state, train_state_teacher)
    images = jax.lax.with_sharding_constraint(images, data_sharding)
    loss = jnp.mean((images.reshape(images.shape[0], -1) @ train_state["w"]) ** 2) + force_t * labels.mean()
    return jax.tree.map(lambda p: p - 0.1 * loss, train_state), loss
"""

NONE_SPEC = """\
version: 1
mesh: {axes: {devices: 8}}
functions:
  update:
    target: upd.py:update
    args:
      - {w: 'f32[48,16]'}
      - null                         # train_state_teacher: shortcut training has none
      - 'f32[32,4,4,3] @ [devices]'
      - 'i32[32] @ [devices]'
"""


def test_a_none_argument_is_staged_as_jax_jit_takes_it(run_cli, tmp_path, monkeypatch):
    """shortcut-models calls `update(train_state, None, images, labels)` (no teacher outside
    distillation): a spec's `null` argument was exit 2 ("null is not an input") though `jax.jit`
    takes None as the empty pytree it is."""
    path = write(tmp_path, "upd.py", NONE_ARGUMENT)
    write(tmp_path, "upd.stagetool.yaml", NONE_SPEC)
    monkeypatch.chdir(tmp_path)
    doc = run_cli("report", "upd.py:update", "--no-peak", "--format", "json", check=0).json()
    (fn,) = doc["functions"]
    assert [leaf["path"] for leaf in fn["inputs"]] == ["train_state/w", "images", "labels"]

    raw = raw_module(path, "upd")
    mesh = raw.mesh
    structs = ({"w": jax.ShapeDtypeStruct((48, 16), jnp.float32, sharding=raw.no_shard)}, None,
               jax.ShapeDtypeStruct((32, 4, 4, 3), jnp.float32, sharding=raw.data_sharding),
               jax.ShapeDtypeStruct((32,), jnp.int32, sharding=raw.data_sharding))
    assert mesh.devices.size == 8
    assert_figures_are_raw_jaxs(fn, raw.update.trace(*structs).lower().compile())


def _raw_compile(raw, devices):
    """shortcut-models' update compiled by raw JAX for ``devices``: its train state abstract (the init's
    shapes), no teacher, its batch."""
    run = raw.build(devices, raw.FLAGS)
    train_state = jax.eval_shape(run.init, jax.ShapeDtypeStruct((2,), jnp.uint32))
    with warnings.catch_warnings():  # the code's optax.global_norm is deprecated (stagetool: a note)
        warnings.simplefilter("ignore", DeprecationWarning)
        return run.update.trace(train_state, None, *run.batch).lower().compile()


@pytest.mark.slow  # XLA:CPU compiles this step in 10-50 s (twice: stagetool's, raw JAX's); v5e:2x4 is in the trial log
def test_shortcut_models_update_stages_as_raw_jax_compiles_it(run_cli, tmp_path, monkeypatch, topology=None):
    monkeypatch.chdir(tmp_path)
    fn, _ = report_as_raw_jax_compiles_it(run_cli, tmp_path, "shortcut_dit", "update", topology, _raw_compile)
    # the code's own mesh (create_device_mesh over jax.devices()) is the staged one: nothing re-laid
    assert not [n for n in fn["notes"] if "re-laid" in n or "taken by axis name" in n]
    # the batch is sharded over the code's mesh axis, the state replicated ('dp')
    leaves = {leaf["path"]: leaf for leaf in fn["inputs"]}
    assert leaves["images"]["compiled"] == "P('devices', None, None, None)" and leaves["train_state/step"]["compiled"] == "P()"
