"""The names the documents' Python examples take as the reader's own (``train_step``, ``params``,
``batch``, ``mesh``; ``step``, ``x``, ``w``, ``Config``; ``stagetool`` imported): the bundled MLP (examples/mlp.py) with
its parameters and batch on an 8-device CPU mesh ``data=2, model=4``, and a step whose static
config holds a mesh. tests/test_docs.py runs a ```python block of README.md or a page with these
defined first when it uses one of them (docs/contributing.md, "Examples are tested")."""

import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import stagetool  # noqa: E402, F401  (a block that continues the page's previous one uses it)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from mlp import init_params, train_step  # noqa: E402, F401

mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))  # JAX's automatic sharding mode
_LAYOUT = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
params = {k: jax.device_put(v, NamedSharding(mesh, _LAYOUT[k]))
          for k, v in init_params(jax.random.key(0), 64, 256, 16).items()}
batch = {"x": jax.device_put(jnp.zeros((32, 64), jnp.float32), NamedSharding(mesh, P("data", None))),
         "y": jax.device_put(jnp.zeros((32,), jnp.int32), NamedSharding(mesh, P("data")))}


@dataclasses.dataclass(frozen=True)
class Config:
    """A static config that holds the code's own mesh (python-api.md, "Meshes")."""

    mesh: jax.sharding.Mesh


def step(x, w, cfg):
    return jax.lax.with_sharding_constraint(x @ w, NamedSharding(cfg.mesh, P("fsdp", None)))


_fsdp = jax.make_mesh((2, 4), ("replica", "fsdp"))  # the arguments' mesh: inspect stages over it
x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(_fsdp, P("fsdp", None)))
w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(_fsdp, P()))
