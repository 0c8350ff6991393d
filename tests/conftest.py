"""Test setup: a simulated 8-device CPU mesh, set before any JAX backend starts."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# CLI and import-isolation fixtures shared by the foundation tests (defined in tests/helpers.py).
from helpers import isolated_imports, mlp_copy, run_cli  # noqa: E402, F401
