"""What differs between the JAX releases stagetool supports, in one place.

Supported: jax/jaxlib **0.7.1 through 0.12.x** (``pyproject.toml`` has no upper bound; a newer
release runs, and the CLI prints :func:`untested_notice` once per command). Tested by
``tests/matrix.py``: 0.10.2 on Python 3.11 (the whole suite), 0.7.2 on Python 3.11 and 0.12.0.1 on
Python 3.12 (JAX 0.11 dropped Python 3.11). Every difference found between those releases is a
constant or a function here, each with a test in ``tests/staging/test_compat.py``:

* **live ranges**: jaxlib ≤ 0.9.2 writes XLA's ``HloLiveRange`` section at the end of
  ``*-buffer-assignment.txt``; later jaxlibs write it to its own ``*-live-range.txt``
  (:func:`read_live_range`);
* **removed configuration**: 0.11 removed ``jax_exec_time_optimization_effort`` and
  ``jax_memory_fitting_effort`` (:data:`REMOVED_CONFIG`, :func:`absent_by_version`): an option
  one JAX does not have is not a difference in ``check``;
* **memory fields**: 0.11's ``CompiledMemoryStats`` adds ``peak_unpadded_heap_bytes``,
  ``total_allocation_bytes`` and ``indefinite_allocations`` (:data:`MEMORY_FIELDS_SINCE_0_11`),
  shown where present;
* **op names**: the scope of a ``scan``/remat body reads ``eval_jaxpr`` in 0.12 where 0.7–0.11
  write ``closed_call`` (:func:`normalise_op_name`: one spelling for display and matching);
* **MLIR bindings**: jaxlib 0.7 and 0.8's ``Value.maybe_downcast()`` returns a plain ``Value``
  where later ones return ``OpResult`` / ``BlockArgument`` (:func:`stagetool.staging.shardy.mlir_value`, for
  :mod:`stagetool.staging.shardy`);
* **PartitionSpec printing**: JAX < 0.9 prints ``PartitionSpec('data', None)``, later ones
  ``P('data', None)``; stagetool prints its own ``P(...)`` form from the spec's entries
  (:func:`partition_spec_text`) and never JAX's ``repr``.

Verified by staging the same functions on jax/jaxlib 0.7.2, 0.10.2 and 0.12.0.1 (CPU). Nothing here
imports JAX at import time (``--help`` stays JAX-free).
"""

from __future__ import annotations

import os
import re
from typing import Any

from stagetool.core.sharding import format_dims

TESTED_OLDEST = (0, 7, 1)
"""The oldest jax/jaxlib release stagetool supports (``pyproject.toml``'s lower bound)."""

TESTED_NEWEST_MINOR = (0, 12)
"""The newest tested release series: every 0.12.x is in range, 0.13 is not."""

TESTED_RANGE_TEXT = "0.7.1 to 0.12.x"

def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numeric components of a version string: ``"0.12.0.1"`` → ``(0, 12, 0, 1)``,
    ``"0.13.0.dev20261101"`` → ``(0, 13, 0)``, ``"0.7.2rc1"`` → ``(0, 7, 2)``; ``()`` for none."""
    out: list[int] = []
    for part in str(text).split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(out)


def in_tested_range(version: str) -> bool:
    """Whether a jax/jaxlib version is in :data:`TESTED_OLDEST` .. :data:`TESTED_NEWEST_MINOR` (any
    patch of the newest series)."""
    v = version_tuple(version)
    return bool(v) and TESTED_OLDEST <= v and v[:2] <= TESTED_NEWEST_MINOR


def untested_notice(jax_version: str, jaxlib_version: str) -> str | None:
    """One line saying that this jax/jaxlib is outside the tested range, or None inside it."""
    if in_tested_range(jax_version) and in_tested_range(jaxlib_version):
        return None
    return (f"stagetool: jax {jax_version} / jaxlib {jaxlib_version} is untested (tested: {TESTED_RANGE_TEXT}); "
            "it runs, but check figures and names against a tested release before trusting a gate")


def installed_versions() -> tuple[str, str] | None:
    """``(jax, jaxlib)`` versions of the installed distributions (``importlib.metadata``: JAX itself is
    not imported), or None when either is not installed as a distribution."""
    from importlib import metadata

    try:
        return metadata.version("jax"), metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return None


# -- live ranges -------------------------------------------------------------------------------

LIVE_RANGE_SUFFIX = "-live-range.txt"
"""jaxlib ≥ 0.10: XLA's ``HloLiveRange`` in a file of its own per module."""

BUFFER_ASSIGNMENT_SUFFIX = "-buffer-assignment.txt"
"""jaxlib ≤ 0.9.2: the same ``HloLiveRange`` section closes the buffer-assignment dump."""

LIVE_RANGE_HEAD = "HloLiveRange"


def _module_files(folder: str, module_text: str, suffix: str) -> list[str]:
    """The dump's files ending in ``suffix``, those of the compiled module's name (its ``HloModule``
    line) when any, sorted (the last is the module's last dump)."""
    m = re.match(r"HloModule\s+([^\s,]+)", module_text)
    files = sorted(f for f in os.listdir(folder) if f.endswith(suffix))
    if m:
        files = [f for f in files if f".{m.group(1)}." in f] or files
    return files


def live_range_file(folder: str, module_text: str) -> tuple[str, str] | None:
    """``(file name, dump prefix)`` of the file that holds the compiled module's live ranges in an
    ``xla_dump_to`` folder, or None: ``*-live-range.txt`` (jaxlib ≥ 0.10), else
    ``*-buffer-assignment.txt`` (jaxlib ≤ 0.9.2). The prefix (``module_0001.jit_f.cpu_after_optimizations``)
    names the module's other dump files (``<prefix>.hlo.pb``)."""
    for suffix in (LIVE_RANGE_SUFFIX, BUFFER_ASSIGNMENT_SUFFIX):
        files = _module_files(folder, module_text, suffix)
        if files:
            return files[-1], files[-1][: -len(suffix)]
    return None


def read_live_range(folder: str, module_text: str) -> tuple[str | None, str | None]:
    """``(live-range text of the compiled module, None)`` from an ``xla_dump_to`` folder, or
    ``(None, why there is none)``.

    The text starts at XLA's ``HloLiveRange (max N):`` line and holds ``InstructionSequence``,
    ``BufferLiveRange`` and "Live ranges at N (peak)" with the "Stack trace breakdown for peak usage";
    it is the whole ``*-live-range.txt`` (jaxlib ≥ 0.10), or the tail of ``*-buffer-assignment.txt``
    from that line on (jaxlib ≤ 0.9.2, which writes no separate file). The module is matched by the
    name in ``module_text``'s ``HloModule`` line (the last dump of that name wins).
    """
    found = live_range_file(folder, module_text)
    if found is not None:
        with open(os.path.join(folder, found[0]), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        if found[0].endswith(LIVE_RANGE_SUFFIX):
            return text, None
        at = text.find(LIVE_RANGE_HEAD)
        if at >= 0:
            return text[at:], None
    return None, ("XLA wrote no live-range dump (the executable may have come from the persistent "
                  "compilation cache, or this backend does not dump it)")


# -- configuration -----------------------------------------------------------------------------

REMOVED_CONFIG: dict[str, str] = {
    "jax_exec_time_optimization_effort": "0.11",
    "jax_memory_fitting_effort": "0.11",
}
"""``jax.config`` options a supported release no longer has: name → the release that removed it."""


def absent_by_version(name: str, before: Any, after: Any) -> str | None:
    """Why a configuration option set on one side only is not a difference, or None when it is one.

    ``before`` / ``after`` are the option's values in two snapshots (None where the snapshot does not
    have it). An option of :data:`REMOVED_CONFIG` present on one side only was removed by the JAX
    release, not changed by the user."""
    if (before is None) == (after is None) or name not in REMOVED_CONFIG:
        return None
    return f"jax {REMOVED_CONFIG[name]} removed the option"


# -- memory_analysis() -------------------------------------------------------------------------

MEMORY_FIELDS_SINCE_0_11 = ("peak_unpadded_heap_bytes", "total_allocation_bytes", "indefinite_allocations")
"""``CompiledMemoryStats`` attributes jax/jaxlib 0.11 added (bytes per device, XLA's figures); an
older jaxlib does not have them, and stagetool then leaves them out rather than showing 0."""


# -- op names ----------------------------------------------------------------------------------

OP_NAME_SPELLINGS: dict[str, str] = {"eval_jaxpr": "closed_call"}
"""Scope names in ``metadata.op_name`` that one release spells differently: 0.12's spelling → the
spelling of 0.7–0.11 (a ``scan`` or remat body: ``.../while/body/closed_call/dot_general``)."""


def normalise_op_name(op_name: str | None) -> str | None:
    """``op_name`` with every scope of :data:`OP_NAME_SPELLINGS` in one spelling, so that a report or
    snapshot made with any supported JAX names the same op the same way (None stays None)."""
    if not op_name:
        return op_name
    parts = op_name.split("/")
    return "/".join(OP_NAME_SPELLINGS.get(p, p) for p in parts)


# -- PartitionSpec -----------------------------------------------------------------------------


def partition_spec_text(spec: Any) -> str:
    """A ``jax.sharding.PartitionSpec`` as stagetool prints one, ``P('data', None)``, whatever the
    release's own ``repr`` (``PartitionSpec('data', None)`` before 0.9): entries as written, trailing
    ``None`` kept, a one-axis tuple as the axis (as JAX 0.10 itself stores it), an unconstrained entry
    as ``P.UNCONSTRAINED``."""
    parts = []
    for d in tuple(spec):
        if d is not None and not isinstance(d, (str, tuple, list)):  # PartitionSpec.UNCONSTRAINED
            parts.append("P.UNCONSTRAINED")
            continue
        if isinstance(d, (tuple, list)):
            d = tuple(d)
            d = d[0] if len(d) == 1 else (d or None)
        parts.append(format_dims((d,))[2:-1])
    return "P(" + ", ".join(parts) + ")"


__all__ = [
    "BUFFER_ASSIGNMENT_SUFFIX", "LIVE_RANGE_SUFFIX", "MEMORY_FIELDS_SINCE_0_11", "OP_NAME_SPELLINGS",
    "REMOVED_CONFIG", "TESTED_NEWEST_MINOR", "TESTED_OLDEST", "absent_by_version", "in_tested_range",
    "installed_versions", "live_range_file", "normalise_op_name", "partition_spec_text", "read_live_range",
    "untested_notice", "version_tuple",
]
