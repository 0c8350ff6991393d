"""Gap 5: code that calls Flax Linen's logical-axis API (``nn.with_logical_constraint``) is traced under
the staged mesh, where those constraints apply (under no context mesh they are silently no-ops). The
call was looked for in the target's own file only: a step in ``train.py`` whose layers live in
``layers.py`` of the same package was traced under none, its two constraints dropped. Now the user's
imports are followed (absolute and relative, through other modules of the user's), never into a
library's."""

from __future__ import annotations

import importlib
import sys
from collections import Counter

import pytest
from helpers import raw_collective_kinds, write

LAYERS = '''
    import flax.linen as nn

    RULES = (("batch", "data"), ("mlp", "model"))


    def block(w1, w2, x):
        h = nn.with_logical_constraint(x @ w1, ("batch", "mlp"), rules=RULES)
        return nn.with_logical_constraint(h @ w2, ("batch", None), rules=RULES)
    '''

TRAIN = {  # the step, importing the layers as people write it
    "absolute": "import jax.numpy as jnp\n\nfrom lpkg.layers import block\n",
    "relative": "import jax.numpy as jnp\n\nfrom .layers import block\n",
    "through a module": "import jax.numpy as jnp\n\nfrom lpkg.model import block\n",
}
STEP = "\n\ndef step(w1, w2, x):\n    return jnp.sum(block(w1, w2, x))\n"

SPEC = '''
    version: 1
    mesh:
      axes: {data: 2, model: 4}
    functions:
      step:
        target: train.py:step
        args: ['f32[256,512] @ [model, data]', 'f32[512,256] @ [data, model]', 'f32[64,256] @ [model, null]']
    '''


@pytest.fixture
def package(tmp_path, monkeypatch):
    pytest.importorskip("flax.linen")
    write(tmp_path, "lpkg/__init__.py", "")
    write(tmp_path, "lpkg/layers.py", LAYERS)
    write(tmp_path, "lpkg/model.py", "from lpkg.layers import block  # noqa: F401\n")
    write(tmp_path, "lpkg/train.stagetool.yaml", SPEC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m == "lpkg" or m.startswith("lpkg.") or m == "train"]:
        del sys.modules[name]


def _raw_under_mesh():
    """Raw JAX: the step jitted under the mesh (as code calling the logical-axis API runs it)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    layers = importlib.import_module("lpkg.layers")
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:8])
    specs = [P("model", "data"), P("data", "model"), P("model", None)]
    shapes = [(256, 512), (512, 256), (64, 256)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p)) for s, p in zip(shapes, specs)]
    with jax.set_mesh(mesh):
        return jax.jit(lambda w1, w2, x: jnp.sum(layers.block(w1, w2, x))).trace(*args).lower().compile()


@pytest.mark.parametrize("how", list(TRAIN))
def test_a_models_logical_constraints_in_an_imported_module_apply(run_cli, package, how):
    write(package, "lpkg/train.py", TRAIN[how] + STEP)
    fn = run_cli("collectives", "lpkg/train.py:step", "--no-cache", "--format", "json", check=0).json()["functions"][0]
    # both constraints of layers.py applied (was []: the trace ran under no context mesh)
    assert [c["line"] for c in fn["collectives"]["origins"]["constraints"]] == ["layers.py:7", "layers.py:8"]
    got = Counter(c["collective"]["kind"] for c in fn["collectives"]["items"])
    assert got == raw_collective_kinds(_raw_under_mesh())


def test_a_library_import_is_not_followed(tmp_path):
    """Flax's own modules call the API; importing flax alone is not a reason to trace under the mesh."""
    from stagetool.inputs.loading import _imported_user_files, _logical_axes

    pytest.importorskip("flax.linen")
    f = write(tmp_path, "plain.py", "import flax.linen as nn\nfrom flax.linen import partitioning\n\n\n"
                                    "def step(x):\n    return nn.relu(x)\n")
    assert _imported_user_files(str(f), f.read_text()) == [] and not _logical_axes(str(f))
