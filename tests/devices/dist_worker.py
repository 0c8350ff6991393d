"""One process of the two-process staging test (tests/devices/test_distributed.py).

Usage: python dist_worker.py PORT NUM_PROCESSES PROCESS_ID DEVICES_PER_PROCESS

With NUM_PROCESSES 1 it skips jax.distributed and is the single-process reference. It stages
``f`` on a data=2 x model=4 mesh over all global devices from host-local inputs and prints
one JSON line (prefixed ``RESULT ``) with the global shapes and the compiled shardings.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ["JAX_PLATFORMS"] = "cpu"

t0 = time.perf_counter()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from stagetool.devices import distributed  # noqa: E402
from stagetool.core.compat import partition_spec_text  # noqa: E402  (P(...) on every jax; repr differs before 0.9)

port, nproc, pid, ndev = (int(a) for a in sys.argv[1:5])
jax.config.update("jax_num_cpu_devices", ndev)
if nproc > 1:
    assert distributed.initialize(f"127.0.0.1:{port}", nproc, pid, timeout_s=60)
t_init = time.perf_counter() - t0

mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
# Host-local inputs: what one process holds when 2 processes split the data axis.
local = {
    "x": ((8 // nproc, 16), P("data", None)),     # batch split over processes
    "w": ((16, 32), P(None, "model")),            # model axis inside each process
    "b": ((32,), P()),                            # replicated
}


def f(x, w, b):
    return jnp.tanh(x @ w + b)


ours = {k: distributed.local_to_global_shape(s, spec, mesh) for k, (s, spec) in local.items()}
jaxs = {}
for k, (s, spec) in local.items():
    arr = np.arange(np.prod(s), dtype=np.float32).reshape(s)
    jaxs[k] = tuple(multihost_utils.host_local_array_to_global_array(arr, mesh, spec).shape)

avals = [jax.ShapeDtypeStruct(ours[k], jnp.float32, sharding=NamedSharding(mesh, local[k][1])) for k in ("x", "w", "b")]
t1 = time.perf_counter()
compiled = jax.jit(f).trace(*avals).lower().compile()
t_compile = time.perf_counter() - t1
in_sh = [(partition_spec_text(s.spec), list(s.shard_shape(a.shape))) for s, a in zip(compiled.input_shardings[0], avals, strict=True)]
out = compiled.output_shardings
result = {
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
    "primary": distributed.is_primary(),
    "device_count": jax.device_count(),
    "local_device_count": jax.local_device_count(),
    "global_shapes": {k: list(v) for k, v in ours.items()},
    "jax_global_shapes": {k: list(v) for k, v in jaxs.items()},
    "input_shardings": in_sh,
    "output_sharding": [partition_spec_text(out.spec), list(out.shard_shape(compiled.out_info.shape))],
    "flops_per_device": (compiled.cost_analysis() or {}).get("flops"),
    "init_s": round(t_init, 3),
    "compile_s": round(t_compile, 3),
}
print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
if nproc > 1:
    jax.distributed.shutdown()
