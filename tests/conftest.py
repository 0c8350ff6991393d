"""Test setup: a simulated 8-device CPU mesh, set before any JAX backend starts."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# CLI and import-isolation fixtures shared by the foundation tests (defined in tests/helpers.py).
from helpers import isolated_imports, mlp_copy, run_cli  # noqa: E402, F401

# No test writes to the user's cache folder: the facts cache is off unless a test turns it on
# (with --cache-dir or Options.cache_dir), and any default would be a session temporary folder.
import tempfile  # noqa: E402

os.environ["STAGETOOL_NO_CACHE"] = "1"
os.environ.setdefault("STAGETOOL_CACHE_DIR", tempfile.mkdtemp(prefix="stagetool-test-cache-"))
