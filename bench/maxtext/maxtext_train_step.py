"""MaxText's own train step for stagetool, built the way MaxText's ``train_compile.py`` builds it,
but on ``jax.devices()`` (as MaxText's ``train.py`` does) instead of ``get_topology_desc``.

Not part of stagetool or its CI: it needs MaxText importable (``PYTHONPATH=<maxtext>/src``) and its
dependencies (see bench/results/maxtext_train_compile.md). Under ``stagetool ... --topology v5e:2x4``
this module is imported while ``jax.devices()`` answers the compile-only TPU devices, so MaxText's
config, mesh, abstract state and jitted step are all built on them, unmodified.

Environment:
  MAXTEXT_SRC        MaxText's checkout (its ``src/maxtext/configs/base.yml`` is the base config)
  MAXTEXT_OVERRIDES  the ``key=value`` overrides given to ``train_compile.py``, space-separated

Module attributes the spec names: ``CONFIG`` (MaxText's config; its ``logical_axis_rules`` are the
rules active while tracing, as ``train_compile.jit_and_compile`` sets them), ``train_step`` (the
``jax.jit`` with MaxText's in/out shardings, static and donated arguments), ``STATE`` and ``BATCH``
(``train_compile.get_shaped_inputs``' abstract state and batch, ``ShapeDtypeStruct``s with shardings).
"""

from __future__ import annotations

import os

import jax
from jax.sharding import AxisType, Mesh

from maxtext.common.common_types import ShardMode
from maxtext.configs import pyconfig
from maxtext.trainers.pre_train import train, train_compile
from maxtext.utils import max_utils, maxtext_utils, sharding

# what train_compile.main sets before anything else (its LIBTPU_INIT_ARGS flag is given in the
# environment of the stagetool command: libtpu reads it when the compile-only client starts)
jax.config.update("jax_default_prng_impl", "unsafe_rbg")

_BASE = os.path.join(os.environ["MAXTEXT_SRC"], "src", "maxtext", "configs", "base.yml")
CONFIG = pyconfig.initialize(["maxtext_train_step", _BASE, *os.environ.get("MAXTEXT_OVERRIDES", "").split()])

# train_compile.get_topology_mesh, with jax.devices() for the topology's devices
jax.config.update("jax_remove_size_one_mesh_axis_from_type", CONFIG.remove_size_one_mesh_axis_from_type)
MESH = Mesh(maxtext_utils.create_device_mesh(CONFIG, jax.devices()), CONFIG.mesh_axes,
            axis_types=((AxisType.Explicit if CONFIG.shard_mode == ShardMode.EXPLICIT else AxisType.Auto),)
            * len(CONFIG.mesh_axes))

# train_compile.main from here on: MaxText's own functions, in its order
_args, _kwargs, _state_shardings, _, _model = train_compile.get_shaped_inputs(MESH, CONFIG)
_params_shardings, _state_shardings = sharding.maybe_update_params_sharding_with_opt(CONFIG, _state_shardings)
_input_state_shardings = sharding.build_zero1_input_state_mesh_shardings(CONFIG, _state_shardings, _params_shardings)
_data_sharding = sharding.get_input_data_sharding(CONFIG, MESH)
_fn, _in, _out, _static, _donate = maxtext_utils.get_functional_train_with_signature(
    train.train_step, _data_sharding, _input_state_shardings, _model, CONFIG, _params_shardings)
_options = max_utils.parse_libtpu_flags_to_dict(CONFIG.compile_xla_flags)

train_step = jax.jit(_fn, in_shardings=_in, out_shardings=_out, static_argnums=_static, donate_argnums=_donate,
                     **({"compiler_options": _options} if _options else {}))
STATE, BATCH = _args[0], _args[1]
assert len(_args) == 2 and not _kwargs, "pure_nnx: train_compile stages (state, batch)"
