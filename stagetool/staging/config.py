"""Configuration that changes the compiled program, read from ``jax.config`` (public attributes).

Two runs of one spec can compile different programs when these differ: the PRNG's partitioning
(``jax_threefry_partitionable`` changes which collectives a sharded ``random`` call needs), the
default matmul precision (bf16 passes vs f32 on TPU), 64-bit mode (dtypes), the PRNG
implementation, the partitioner (Shardy or GSPMD), dtype promotion, XLA's optimisation efforts,
and ``XLA_FLAGS`` / ``LIBTPU_INIT_ARGS``. The report header and snapshots carry them, so that
``diff``/``check`` say when they changed.
"""

from __future__ import annotations

import os

CONFIG_NAMES = (
    "jax_threefry_partitionable",
    "jax_default_matmul_precision",
    "jax_enable_x64",
    "jax_default_prng_impl",
    "jax_use_shardy_partitioner",
    "jax_numpy_dtype_promotion",
    "jax_exec_time_optimization_effort",
    "jax_memory_fitting_effort",
)
"""``jax.config`` options that change what is compiled."""

ENV_NAMES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
"""Environment variables that change what XLA compiles (shown when set)."""

_OWN_FLAGS = ("--xla_force_host_platform_device_count",)
"""Flags stagetool may set itself to simulate devices: not the user's configuration."""


def _text(value: object) -> str:
    v = getattr(value, "value", value)  # enums (NumpyDtypePromotion.STANDARD) by their value
    return "None" if v is None else str(v)


def compile_config() -> tuple[tuple[str, str], ...]:
    """``(name, value)`` of every option of :data:`CONFIG_NAMES` this JAX has, then the environment
    variables of :data:`ENV_NAMES` that are set (without stagetool's own device-count flag)."""
    import jax

    out = []
    for name in CONFIG_NAMES:
        try:
            value = getattr(jax.config, name)
        except AttributeError:
            continue
        out.append((name, _text(value)))
    for name in ENV_NAMES:
        raw = os.environ.get(name, "")
        flags = " ".join(f for f in raw.split() if not f.startswith(_OWN_FLAGS))
        if flags:
            out.append((name, flags))
    return tuple(out)
