"""Start only the JAX backends a run uses.

JAX starts every backend it finds on the first ``jax.devices()``: with libtpu installed that is a
TPU probe (0.1-0.3 s, even with no TPU attached), with JAX's CUDA plugin installed and no GPU a
"Jax plugin configuration error ... Unable to load CUDA" traceback on stderr. A compile-only TPU
or GPU target (its devices come from ``jax.experimental.topologies``, beside the CPU backend) and a
simulated CPU mesh need neither: :func:`limit_platforms` sets ``jax_platforms`` to ``cpu`` for them
before any backend starts (JAX's public config, the same as ``JAX_PLATFORMS=cpu``).

With platform left to JAX (no ``--platform``), whether an accelerator is attached is read from the
device files its driver creates (``/dev/accel*``, ``/dev/vfio/<n>`` for TPUs, ``/dev/nvidia<n>``
for NVIDIA GPUs, ``/dev/kfd`` for AMD GPUs): none → CPU only; any, or a JAX plugin other than
NVIDIA's installed (Metal and others make no such file) → every backend, as JAX would.
A ``JAX_PLATFORMS`` the user set is never overridden.

Importing jax with the CUDA plugin installed loads its CUDA stubs, which print
``cudart_stub.cc ... Could not find cuda drivers`` on file descriptor 2 (C++; no environment
variable silences it). :func:`import_jax` captures fd 2 during that import and passes on anything
that is not that notice.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from typing import Any

from stagetool.plan.target import Attached, DeviceTarget, cuda_plugin_available

__all__ = ["accelerator_attached", "import_jax", "limit_platforms", "other_plugins", "platforms_for",
           "start_backends"]

_NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
                    r"|I\d{4} [^\]]*cudart_stub\.cc:\d+\] Could not find cuda drivers.*)$")


def accelerator_attached() -> bool:
    """Whether a TPU or GPU driver's device file exists (``/dev/accel*``, ``/dev/vfio/<n>``,
    ``/dev/nvidia<n>``, ``/dev/kfd``). A cheap look, no backend started."""
    patterns = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
    return any(glob.glob(p) for p in patterns)


_KNOWN_PLUGINS = frozenset({"xla_cuda12", "xla_cuda13"})
"""JAX plugins whose devices show as device files (NVIDIA); any other plugin (Metal, ...) may not."""


def other_plugins() -> tuple[str, ...]:
    """JAX PJRT plugins installed besides NVIDIA's (``jax_plugins.*``), found without importing them."""
    import importlib.util
    import pkgutil

    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        return ()
    if spec is None or not spec.submodule_search_locations:
        return ()
    return tuple(sorted(m.name for m in pkgutil.iter_modules(list(spec.submodule_search_locations))
                        if m.name not in _KNOWN_PLUGINS))


def platforms_for(target: DeviceTarget) -> str | None:
    """The ``jax_platforms`` value a run needs, or None to leave JAX's default (every backend).

    ``"cpu"`` for a compile-only target (TPU or GPU), simulated CPU devices (``--platform cpu``), or
    no ``--platform`` when :func:`accelerator_attached` is false; None otherwise (``--platform
    gpu|tpu`` or an attached accelerator), and None whenever the user set ``JAX_PLATFORMS``.
    """
    if os.environ.get("JAX_PLATFORMS", "").strip():
        return None
    if not isinstance(target, Attached):
        return "cpu"
    if target.platform is None and not accelerator_attached() and not other_plugins():
        return "cpu"
    return None


def import_jax() -> Any:
    """``import jax``, the first time with fd 2 captured when JAX's CUDA plugin is installed (its
    CUDA stubs print a notice there); any other text written meanwhile is passed on to stderr."""
    if "jax" in sys.modules:
        return sys.modules["jax"]
    if not cuda_plugin_available():
        import jax

        return jax
    from stagetool.devices.tpu_topology import captured_stderr_fd

    with captured_stderr_fd() as noise:
        import jax
    rest = [ln for ln in "".join(noise).splitlines() if ln.strip() and not _NOISE.match(ln)]
    if rest:
        sys.stderr.write("\n".join(rest) + "\n")
    return jax


def start_backends() -> None:
    """Start JAX's backends now (``jax.devices()``) with fd 2 captured: JAX's plugin discovery loads
    the CUDA plugin's libraries when the first backend starts, even with ``jax_platforms=cpu``, and
    they print the cudart notice. Other text is passed on to stderr. For compile-only targets, whose
    CPU backend needs no device count (a simulated mesh sets ``jax_num_cpu_devices`` first)."""
    jax = import_jax()
    from stagetool.devices.tpu_topology import captured_stderr_fd

    if not cuda_plugin_available():
        return
    with captured_stderr_fd() as noise:
        try:
            jax.devices()
        except RuntimeError:
            pass  # said again, with its message, where the devices are asked for
    rest = [ln for ln in "".join(noise).splitlines() if ln.strip() and not _NOISE.match(ln)]
    if rest:
        sys.stderr.write("\n".join(rest) + "\n")


def limit_platforms(target: DeviceTarget) -> str | None:
    """Before any backend starts, set ``jax_platforms`` to what :func:`platforms_for` says.

    Returns the value set, or None when JAX's default is kept. A no-op once a backend runs (a
    notebook, a test session): JAX then keeps the backends it started.
    """
    value = platforms_for(target)
    jax = import_jax()
    if value is not None:
        try:
            jax.config.update("jax_platforms", value)
        except Exception:  # noqa: BLE001 - a backend already started: keep what runs
            return None
    return value
