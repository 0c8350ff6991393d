"""The JAX training cookbook's own lines in a spec, with no adapter (issue 30, item 6).

The cookbook builds ``config = Config()`` (whose constructor makes a mesh and calls
``jax.sharding.set_mesh``) outside any jit, ``train_state = jax.tree.map(jax.ref.new_ref,
init_train_state(config))`` and calls ``train_step(config, train_state, batch)``. The spec writes
the same: argument 0 ``{call: cb.py:Config}``; argument 1 ``init: jax.tree:map`` over
``{ref: jax.ref:new_ref}`` and ``{call: cb.py:init_train_state, args: [{arg: 0}]}`` (the config
argument inside a ``{call:}``'s own args). Every figure is raw JAX's: the same module's step
compiled with ``.trace(...).lower().compile()`` for the same devices on abstract refs.
"""

from __future__ import annotations

import contextlib
import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import write
from stagetool.devices import tpu_topology
from stagetool.plan.target import parse_target

COOKBOOK_STYLE = '''
"""Training-cookbook style: a Config whose construction builds and sets the mesh, the train state
initialised under jit, the step updating the state's jax.Ref leaves in place."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    axis_names: tuple = ("fsdp",)
    shape: tuple = (8,)
    devices: tuple | None = None  # the raw-JAX side of the test builds it for given devices
    d: int = 256
    h: int = 512
    lr: float = 0.1
    w_in: P = P("fsdp", None)
    w_out: P = P(None, "fsdp")
    act: P = P("fsdp", None)

    def __post_init__(self):
        mesh = jax.make_mesh(self.shape, self.axis_names, axis_types=(AxisType.Explicit,) * len(self.shape),
                             devices=self.devices)
        jax.sharding.set_mesh(mesh)


@jax.jit
def init_train_state(config):
    k1, k2 = jax.random.split(jax.random.key(0))
    init = jax.nn.initializers.he_normal()
    params = {"w_in": init(k1, (config.d, config.h), jnp.float32, config.w_in),
              "w_out": init(k2, (config.h, config.d), jnp.float32, config.w_out)}
    return {"params": params, "mu": jax.tree.map(jnp.zeros_like, params), "count": jnp.array(0)}


def loss_fn(config, params, x):
    h = jax.nn.relu(jnp.einsum("bd,dh->bh", x, params["w_in"], out_sharding=config.act))
    y = jnp.einsum("bh,hd->bd", h, params["w_out"], out_sharding=config.act)
    return jnp.mean((y - x) ** 2)


@jax.jit
def train_step(config, state, x):
    params = jax.tree.map(jax.ref.get, state["params"])
    loss, grad = jax.value_and_grad(functools.partial(loss_fn, config))(params, x)

    def update(p, m, g):
        m[...] = 0.9 * m[...] + g
        p[...] -= config.lr * m[...]

    jax.tree.map(update, state["params"], state["mu"], grad)
    state["count"][...] += 1
    return {"loss": loss}
'''

COOKBOOK_SPEC = '''
version: 1
mesh:
  axes: {fsdp: 8}
  axis_types: explicit
functions:
  train_step:
    target: cb.py:train_step
    args:
      - {call: cb.py:Config}
      # train_state = jax.tree.map(jax.ref.new_ref, init_train_state(config))
      - init: jax.tree:map
        init_args: [{ref: jax.ref:new_ref}, {call: cb.py:init_train_state, args: [{arg: 0}]}]
      - f32[64,256] @ [fsdp, null]
'''


@contextlib.contextmanager
def _global_mesh_kept():
    """The process's global mesh as it was after (the module's Config sets one)."""
    before = jax.sharding.get_mesh()
    try:
        yield
    finally:
        jax.sharding.set_mesh(before if before.devices.size else None)


def _raw_compiled(path, devices):
    """Raw JAX: the module's own Config for ``devices``, its init's shapes, the step traced on
    abstract refs of them (a Ref's type carries its sharding under explicit axes) and compiled."""
    spec = importlib.util.spec_from_file_location("_raw_cb", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with _global_mesh_kept():
        config = module.Config(devices=tuple(devices))
        mesh = jax.sharding.get_mesh()
        shapes = jax.eval_shape(module.init_train_state, config)

        def abstract_ref(s):
            # a constant (the count's jnp.array(0)) carries no sharding: replicated, as when run
            sharding = NamedSharding(mesh.abstract_mesh, s.sharding.spec if s.sharding is not None else P())
            return jax.ref.AbstractRef(jax.core.ShapedArray(s.shape, s.dtype, sharding=sharding))

        state = jax.tree.map(abstract_ref, shapes)
        x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
        return module.train_step.trace(config, state, x).lower().compile()


@pytest.mark.parametrize("topology", [None, "v5e:2x4"])
def test_cookbook_train_loop_line_stages_as_raw_jax(run_cli, tmp_path, monkeypatch, topology):
    if topology is None:
        devices = jax.devices()[:8]
    else:
        if not tpu_topology.libtpu_available():
            pytest.skip("libtpu not installed: pip install -e '.[tpu]'")
        devices = list(tpu_topology.tpu_topology(parse_target(topology)).devices)
    model = write(tmp_path, "cb.py", COOKBOOK_STYLE)
    write(tmp_path, "cb.stagetool.yaml", COOKBOOK_SPEC)
    monkeypatch.chdir(tmp_path)
    before = jax.sharding.get_mesh()
    args = ["memory", "cb.py:train_step", "--no-peak", "--format", "json"] + (["--topology", topology] if topology else [])
    f = run_cli(*args, check=0).json()["functions"][0]
    assert f.get("error") is None
    assert jax.sharding.get_mesh() is before  # the Config's set_mesh did not outlive the load

    compiled = _raw_compiled(model, devices)
    stats = compiled.memory_analysis()
    record = f["memory"]["record"]
    assert (record["argument_bytes"], record["output_bytes"], record["alias_bytes"], record["temp_bytes"],
            record["generated_code_bytes"]) == (stats.argument_size_in_bytes, stats.output_size_in_bytes,
                                                 stats.alias_size_in_bytes, stats.temp_size_in_bytes,
                                                 stats.generated_code_size_in_bytes)
    # the state's five Refs are written in place: four f32[256,512] over 8 devices, and the count
    # (4 B; a TPU buffer is padded to 512 B)
    assert record["alias_bytes"] - 4 * 256 * 512 * 4 // 8 == (4 if topology is None else 512)
    cost = run_cli(*(["cost"] + args[1:2] + ["--format", "json"] + args[5:]), check=0).json()["functions"][0]
    assert cost["cost"]["per_device"]["flops"] == compiled.cost_analysis()["flops"]
