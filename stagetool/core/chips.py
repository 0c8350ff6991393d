"""Published peak figures of common accelerators (the roofline's chip table).

Every figure is the vendor's public number for **one chip** (one TPU chip; one GPU), with
its source URL in the table. Conventions:

* ``peak_flops_per_second_bf16``: dense (no structured sparsity) bf16 matrix FLOP/s. NVIDIA
  datasheets print the sparse figure for H100/H200 tensor cores; the dense one is half of it.
* ``peak_flops_per_second_f32``: non-tensor-core FP32 FLOP/s where the vendor publishes it;
  None for TPUs (Google publishes no f32 peak).
* ``hbm_bandwidth_bytes_per_second`` and ``hbm_capacity_bytes`` are read as the vendor writes
  them, with decimal units (GB = 10**9 bytes, TB/s = 10**12 bytes/s). HBM is built in binary
  sizes and the allocator reserves some of it, so the usable limit differs; prefer
  ``jax.Device.memory_stats()['bytes_limit']`` (see ``stagetool.analysis.memory``) when a real
  device is attached. The decimal reading is the smaller one, so a fits-check using it errs
  on the safe side.

These are upper bounds for an *estimate*; real programs reach a fraction of them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from stagetool.core.errors import SpecError, UsageError

_T = 10**12
_G = 10**9
_GIB = 2**30
"""FLOP/s and bandwidths are decimal (vendors' TFLOPS, GB/s); HBM capacities are binary: an HBM
stack sold as "16 GB" holds 16 GiB (``memory_stats()['bytes_limit']`` on a v5e is just under 16 GiB),
and ``stagetool.devices.tpu_topology.TPU_CHIPS`` uses the same figures."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """Peak figures of one accelerator chip.

    Attributes:
      name: table key, lower case (``"tpu-v5e"``).
      peak_flops_per_second_bf16: dense bf16 FLOP/s of one chip, or None.
      peak_flops_per_second_f32: FP32 FLOP/s of one chip, or None when not published.
      hbm_bandwidth_bytes_per_second: HBM bandwidth of one chip (bytes/s), or None.
      hbm_capacity_bytes: HBM capacity of one chip (bytes), or None.
      sources: the public pages the figures come from (``("user",)`` for user entries).
      note: how the figures were read (dense vs sparse, units).
    """

    name: str
    peak_flops_per_second_bf16: float | None
    peak_flops_per_second_f32: float | None
    hbm_bandwidth_bytes_per_second: float | None
    hbm_capacity_bytes: int | None
    sources: tuple[str, ...]
    note: str = ""


_A100_PDF = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
             "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")

CHIPS: dict[str, Chip] = {
    c.name: c for c in (
        Chip("tpu-v4", 275 * _T, None, 1200 * _G, 32 * _GIB, ("https://cloud.google.com/tpu/docs/v4",),
             "bf16 275 TFLOPs; HBM2 32 GiB, 1200 GBps per chip"),
        Chip("tpu-v5e", 197 * _T, None, 819 * _G, 16 * _GIB, ("https://cloud.google.com/tpu/docs/v5e",),
             "bf16 197 TFLOPs; HBM2 16 GB, 819 GBps per chip"),
        Chip("tpu-v5p", 459 * _T, None, 2765 * _G, 95 * _GIB, ("https://cloud.google.com/tpu/docs/v5p",),
             "bf16 459 TFLOPs; HBM2e 95 GB, 2765 GBps per chip"),
        Chip("tpu-v6e", 918 * _T, None, 1638 * _G, 32 * _GIB, ("https://cloud.google.com/tpu/docs/v6e",),
             "bf16 918 TFLOPs; HBM 32 GB, 1638 GBps per chip (Trillium)"),
        Chip("a100-40gb", 312 * _T, 19.5 * _T, 1555 * _G, 40 * _GIB, (_A100_PDF,),
             "SXM; BF16 tensor core 312 TFLOPS dense (624 sparse); FP32 19.5 TFLOPS; HBM2 1,555 GB/s"),
        Chip("a100-80gb", 312 * _T, 19.5 * _T, 2039 * _G, 80 * _GIB, (_A100_PDF,),
             "SXM; BF16 tensor core 312 TFLOPS dense (624 sparse); FP32 19.5 TFLOPS; HBM2e 2,039 GB/s"),
        Chip("h100-sxm", 989.5 * _T, 67 * _T, 3350 * _G, 80 * _GIB,
             ("https://www.nvidia.com/en-us/data-center/h100/",),
             "BF16 tensor core 1,979 TFLOPS with sparsity -> 989.5 dense; FP32 67 TFLOPS; 3.35 TB/s"),
        Chip("h200", 989.5 * _T, 67 * _T, 4800 * _G, 141 * _GIB,
             ("https://www.nvidia.com/en-us/data-center/h200/",),
             "SXM; BF16 tensor core 1,979 TFLOPS with sparsity -> 989.5 dense; FP32 67 TFLOPS; 4.8 TB/s"),
        Chip("h100-pcie", 756.5 * _T, 51 * _T, 2000 * _G, 80 * _GIB,
             ("https://www.nvidia.com/en-us/data-center/h100/",),
             "PCIe; BF16 tensor core 1,513 TFLOPS with sparsity -> 756.5 dense; FP32 51 TFLOPS; 2 TB/s"),
        Chip("b200", 2250 * _T, 75 * _T, 8000 * _G, 180 * _GIB,
             ("https://www.nvidia.com/en-us/data-center/dgx-b200/",),
             "per GPU of DGX B200 (8 GPUs): FP16/BF16 tensor core 36 PFLOPS with sparsity -> 2,250 TFLOPS "
             "dense; FP32 600 TFLOPS -> 75; 64 TB/s -> 8 TB/s; 1,440 GB -> 180 GB"),
    )
}
"""The built-in table, keyed by lower-case chip name."""

_DEVICE_KIND_HINTS = (
    ("tpu v4", "tpu-v4"), ("tpu v5 lite", "tpu-v5e"), ("tpu v5e", "tpu-v5e"), ("tpu v5p", "tpu-v5p"),
    ("tpu v5", "tpu-v5p"), ("tpu v6 lite", "tpu-v6e"), ("tpu v6e", "tpu-v6e"),
    ("a100-sxm4-40gb", "a100-40gb"), ("a100-sxm4-80gb", "a100-80gb"), ("a100 80gb", "a100-80gb"),
    ("a100", "a100-40gb"), ("h100 80gb hbm3", "h100-sxm"), ("h100 sxm", "h100-sxm"), ("h100 pcie", "h100-pcie"),
    ("h200", "h200"), ("b200", "b200"),
)

_NUMERIC_FIELDS = ("peak_flops_per_second_bf16", "peak_flops_per_second_f32",
                   "hbm_bandwidth_bytes_per_second", "hbm_capacity_bytes")
CHIP_FIELDS = (*_NUMERIC_FIELDS, "sources", "note")


def chip_for_device_kind(device_kind: str) -> str | None:
    """Table name for a ``jax.Device.device_kind`` string (``"TPU v5 lite"`` -> ``"tpu-v5e"``), or None.

    A best-effort match on known device_kind spellings; None for CPUs and unknown chips.
    """
    k = device_kind.lower()
    for hint, name in _DEVICE_KIND_HINTS:
        if hint in k:
            return name
    return None


def get_chip(name: str, table: Mapping[str, Chip] | None = None) -> Chip:
    """Look up a chip by name (case-insensitive).

    Raises:
      UsageError: unknown name; the message lists the known names.
    """
    t = CHIPS if table is None else table
    key = name.strip().lower()
    if key not in t:
        import difflib

        close = [n for n in sorted(t) if n.startswith(key + "-")] or difflib.get_close_matches(key, list(t), n=2)
        guess = f": did you mean {' or '.join(close)}?" if close else ""
        raise UsageError(f"unknown chip {name!r}{guess}", hint=f"known chips: {', '.join(sorted(t))}")
    return t[key]


_NUMERIC_TEXT = re.compile(r"^[+-]?(\d[\d_]*(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def _number(value: Any, field: str, where: str, issues: list[str]) -> float | int | None:
    """A positive finite figure from a user entry, or None after recording the problem in ``issues``.

    Numbers, and strings that spell one (``"4.0e14"``, ``"4e14"``: YAML 1.1, which PyYAML reads,
    takes ``4.0e14`` without a sign in the exponent for a string), are accepted; for
    ``hbm_capacity_bytes`` also sizes such as ``"16GiB"``.
    """
    if value is None:
        return None
    if isinstance(value, str) and _NUMERIC_TEXT.match(value.strip()):
        value = float(value.strip().replace("_", ""))
    if field == "hbm_capacity_bytes" and isinstance(value, str):
        from stagetool.core.units import parse_size
        try:
            return parse_size(value)
        except UsageError as e:
            issues.append(f"{where}.{field}: {e.message}")
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        expect = "a number or a size such as '16GiB'" if field == "hbm_capacity_bytes" else "a number"
        issues.append(f"{where}.{field}: expected {expect}, got {value!r}")
        return None
    if not math.isfinite(value) or value <= 0:
        issues.append(f"{where}.{field}: must be a positive finite number, got {value!r}")
        return None
    return int(value) if field == "hbm_capacity_bytes" else float(value)


def merge_chips(user: Mapping[str, Any], base: Mapping[str, Chip] | None = None) -> dict[str, Chip]:
    """Merge user chip entries into the table (a new dict; the built-in table is unchanged).

    Args:
      user: ``{name: {field: value, ...}}``. Fields: ``peak_flops_per_second_bf16``,
        ``peak_flops_per_second_f32``, ``hbm_bandwidth_bytes_per_second`` (positive numbers),
        ``hbm_capacity_bytes`` (a positive number or a size string like ``"16GiB"``),
        ``sources`` (a string or list of strings), ``note`` (a string). An entry for a known
        chip overrides only the fields it gives; a new chip needs at least one figure.
      base: the table to extend (default: :data:`CHIPS`).

    Returns:
      ``{name: Chip}`` sorted by name.

    Raises:
      SpecError: listing every problem, each as ``chips.<name>.<field>: what is wrong``.
    """
    table = dict(CHIPS if base is None else base)
    issues: list[str] = []
    if not isinstance(user, Mapping):
        raise SpecError([f"chips: expected a mapping of chip name to figures, got {type(user).__name__}"])
    for raw_name, entry in user.items():
        where = f"chips.{raw_name}"
        if not isinstance(raw_name, str) or not raw_name.strip():
            issues.append(f"{where}: chip name must be a non-empty string")
            continue
        name = raw_name.strip().lower()
        if not isinstance(entry, Mapping):
            issues.append(f"{where}: expected a mapping of figures, got {type(entry).__name__}")
            continue
        unknown = sorted(set(map(str, entry)) - set(CHIP_FIELDS))
        for u in unknown:
            issues.append(f"{where}.{u}: unknown field; valid fields: {', '.join(CHIP_FIELDS)}")
        values: dict[str, Any] = {}
        for f in _NUMERIC_FIELDS:
            if f in entry:
                values[f] = _number(entry[f], f, where, issues)
        if "sources" in entry:
            s = entry["sources"]
            if isinstance(s, str):
                values["sources"] = (s,)
            elif isinstance(s, (list, tuple)) and all(isinstance(x, str) for x in s):
                values["sources"] = tuple(s)
            else:
                issues.append(f"{where}.sources: expected a string or a list of strings")
        if "note" in entry:
            if isinstance(entry["note"], str):
                values["note"] = entry["note"]
            else:
                issues.append(f"{where}.note: expected a string")
        if name in table:
            table[name] = dataclasses.replace(table[name], **values)
        else:
            if not any(values.get(f) is not None for f in _NUMERIC_FIELDS):
                issues.append(f"{where}: a new chip needs at least one of {', '.join(_NUMERIC_FIELDS)}")
                continue
            table[name] = Chip(name=name, **{f: values.get(f) for f in _NUMERIC_FIELDS},
                               sources=values.get("sources", ("user",)), note=values.get("note", ""))
    if issues:
        raise SpecError(issues, hint="see stagetool.core.chips.merge_chips for the fields")
    return dict(sorted(table.items()))
