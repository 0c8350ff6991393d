"""``--gpu-target-config``: the file read as the protobuf XLA reads, before XLA sees it.

XLA:GPU parses a GPU target config as protobuf text of ``stream_executor.GpuTargetConfigProto``
(``xla/stream_executor/device_description.proto``: a ``GpuDeviceInfoProto`` of SM count, memory,
bandwidth, clock ..., the platform name, the cuDNN version, the device's description). stagetool
reads the same text with protobuf's own text-format parser against a description of those messages
(:func:`_file_descriptor`: the fields of jaxlib 0.10's proto, names, numbers and types), so that a
value is what XLA will read — a ``# device_memory_size: 999`` comment is a comment, a field given
twice or out of range is refused, as XLA's parser refuses it. Fields this description does not know
(``autotune_results``, fields of newer XLA releases) are skipped here and left to XLA's parser.

Then what stagetool or XLA divides or sizes by must be positive (``threads_per_warp: 0`` ends the
compile with SIGFPE inside XLA), and ``device_memory_size`` — the capacity stagetool reports and
gates on — must be given: no figure is taken from another GPU's table.

The file is read as a regular file of at most :data:`MAX_CONFIG_BYTES` (a FIFO or ``/dev/zero`` is
refused without reading). Needs the ``protobuf`` package (a dependency of stagetool).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from stagetool.core.errors import UsageError

__all__ = ["MAX_CONFIG_BYTES", "POSITIVE_FIELDS", "TargetConfig", "parse_target_config", "read_target_config_file"]

MAX_CONFIG_BYTES = 4 * 2**20
"""The largest ``--gpu-target-config`` file read (a config is about 1 KB; autotuning results make it larger)."""

POSITIVE_FIELDS = (
    "threads_per_block_limit", "threads_per_warp", "shared_memory_per_block", "shared_memory_per_core",
    "threads_per_core_limit", "core_count", "fpus_per_core", "block_dim_limit_x", "block_dim_limit_y",
    "block_dim_limit_z", "memory_bandwidth", "l2_cache_size", "clock_rate_ghz", "device_memory_size",
    "shared_memory_per_block_optin", "registers_per_core_limit", "registers_per_block_limit",
)
"""``gpu_device_info`` fields that must be given and above 0: XLA divides by them or sizes with them
(``threads_per_warp``, ``core_count``, ``clock_rate_ghz``, ...), and ``device_memory_size`` is the
capacity of a device. Every one is written by stagetool's own configs and by ``devices --target-config``."""

_HINT = ("fix the file (protobuf text of stream_executor.GpuTargetConfigProto); capture one on a GPU machine with "
         "'stagetool devices --target-config -o FILE', or use a built-in GPU: --topology h100:8")

_INT32, _INT64, _FLOAT, _STRING, _BOOL, _MESSAGE, _ENUM = 5, 3, 2, 9, 8, 11, 14  # FieldDescriptorProto.Type


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """What stagetool reads from a ``GpuTargetConfigProto`` text (checked by :func:`parse_target_config`).

    Attributes:
      text: the text, as XLA will be given it.
      device_description: ``device_description_str`` (what ``device.device_kind`` will say), as written.
      memory_bytes: ``gpu_device_info.device_memory_size``: one device's memory in bytes (> 0).
    """

    text: str
    device_description: str
    memory_bytes: int


def _file_descriptor() -> Any:
    """The messages of XLA's ``device_description.proto`` that stagetool checks, as a ``FileDescriptorProto``
    (proto2 syntax so that a field left out can be told from a 0; the text format is the same)."""
    from google.protobuf import descriptor_pb2

    fdp = descriptor_pb2.FileDescriptorProto(name="stagetool/gpu_target_config.proto", package="stream_executor",
                                             syntax="proto2")

    def message(name: str, fields: list[tuple[str, int, int, str | None]]) -> None:
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=1)  # LABEL_OPTIONAL
            if type_name:
                f.type_name = f".stream_executor.{type_name}"

    cc = fdp.message_type.add(name="CudaComputeCapabilityProto")
    for fname, number in (("major", 1), ("minor", 2)):
        cc.field.add(name=fname, number=number, type=_INT32, label=1)
    ext = cc.enum_type.add(name="FeatureExtension")
    for i, v in enumerate(("UNSPECIFIED", "NONE", "ACCELERATED_FEATURES", "FAMILY_COMPATIBLE_FEATURES")):
        ext.value.add(name=v, number=i)
    cc.field.add(name="feature_extension", number=3, type=_ENUM, label=1,
                 type_name=".stream_executor.CudaComputeCapabilityProto.FeatureExtension")
    message("RocmComputeCapabilityProto", [("gcn_arch_name", 1, _STRING, None)])
    message("DeviceInterconnectInfoProto", [("active_links", 1, _INT32, None), ("cluster_uuid", 2, _STRING, None),
                                            ("clique_id", 3, _STRING, None)])
    ints32 = {"threads_per_block_limit": 1, "threads_per_warp": 2, "shared_memory_per_block": 3,
              "shared_memory_per_core": 4, "threads_per_core_limit": 5, "core_count": 6,
              "shared_memory_per_block_optin": 15, "numa_node": 36}
    ints64 = {"fpus_per_core": 7, "block_dim_limit_x": 8, "block_dim_limit_y": 9, "block_dim_limit_z": 10,
              "memory_bandwidth": 11, "l2_cache_size": 12, "device_memory_size": 14, "registers_per_core_limit": 18,
              "registers_per_block_limit": 19, "thread_dim_limit_x": 37, "thread_dim_limit_y": 38,
              "thread_dim_limit_z": 39, "device_address_bits": 40, "pcie_bandwidth": 41}
    strings = {"device_vendor": 30, "platform_version": 31, "pci_bus_id": 32, "name": 34, "model_str": 35,
               "driver_version": 23, "kernel_mode_driver_version": 24, "runtime_version": 25,
               "compile_time_toolkit_version": 26, "dnn_version": 27, "cub_version": 28}
    message("GpuDeviceInfoProto",
            [(k, n, _INT32, None) for k, n in ints32.items()] + [(k, n, _INT64, None) for k, n in ints64.items()]
            + [(k, n, _STRING, None) for k, n in strings.items()]
            + [("clock_rate_ghz", 13, _FLOAT, None), ("ecc_enabled", 42, _BOOL, None),
               ("cuda_compute_capability", 16, _MESSAGE, "CudaComputeCapabilityProto"),
               ("rocm_compute_capability", 17, _MESSAGE, "RocmComputeCapabilityProto"),
               ("device_interconnect_info", 29, _MESSAGE, "DeviceInterconnectInfoProto")])
    version = [("major", 1, _INT32, None), ("minor", 2, _INT32, None), ("patch", 3, _INT32, None)]
    message("DnnVersionInfoProto", version)
    message("RuntimeVersionProto", version)
    message("GpuTargetConfigProto", [("gpu_device_info", 1, _MESSAGE, "GpuDeviceInfoProto"),
                                     ("platform_name", 4, _STRING, None),
                                     ("dnn_version_info", 5, _MESSAGE, "DnnVersionInfoProto"),
                                     ("runtime_version", 8, _MESSAGE, "RuntimeVersionProto"),
                                     ("device_description_str", 7, _STRING, None)])
    return fdp


_CLASS: list[Any] = []


def _message_class() -> Any:
    if not _CLASS:
        from google.protobuf import descriptor_pool, message_factory

        pool = descriptor_pool.DescriptorPool()
        pool.Add(_file_descriptor())
        _CLASS.append(message_factory.GetMessageClass(pool.FindMessageTypeByName("stream_executor.GpuTargetConfigProto")))
    return _CLASS[0]


def parse_target_config(text: str, source: str) -> TargetConfig:
    """Read ``text`` as XLA will (protobuf text of ``GpuTargetConfigProto``) and check what stagetool
    and XLA rely on; ``source`` names it in errors (the file's path).

    Raises:
      UsageError: not protobuf text of that message (the parser's line:column), a field of
        :data:`POSITIVE_FIELDS` missing, 0, negative or not finite, or no ``gpu_device_info``.
    """
    try:
        from google.protobuf import text_format
    except ImportError:
        raise UsageError(f"--gpu-target-config {source}: reading it needs the protobuf package, which is not "
                         "installed", hint="pip install protobuf (a dependency of stagetool)") from None
    msg = _message_class()()
    try:
        text_format.Parse(text, msg, allow_unknown_field=True)
    except text_format.ParseError as e:
        where = f":{e.GetLine()}:{e.GetColumn()}" if e.GetLine() else ""
        detail = str(e).split(" : ", 1)[-1] if " : " in str(e) else str(e)
        raise UsageError(f"--gpu-target-config {source}{where}: not a GpuTargetConfigProto in text form: {detail}",
                         hint=_HINT) from None
    except (ValueError, RecursionError) as e:  # protobuf's own limits (nesting)
        raise UsageError(f"--gpu-target-config {source}: not a GpuTargetConfigProto in text form: {e}",
                         hint=_HINT) from None
    if not msg.HasField("gpu_device_info"):
        raise UsageError(f"--gpu-target-config {source}: not a GpuTargetConfigProto in text form (no gpu_device_info)",
                         hint=_HINT)
    info = msg.gpu_device_info
    bad = []
    for name in POSITIVE_FIELDS:
        if not info.HasField(name):
            bad.append(f"{name} is missing")
            continue
        value = getattr(info, name)
        if not (value > 0 and math.isfinite(value)):
            bad.append(f"{name}: {value:g} is not above 0" if isinstance(value, float) else f"{name}: {value} is not above 0")
    if bad:
        raise UsageError(f"--gpu-target-config {source}: gpu_device_info " + "; ".join(bad)
                         + " (XLA divides or sizes by these; device_memory_size is each device's memory in bytes)",
                         hint=_HINT)
    return TargetConfig(text=text, device_description=msg.device_description_str,
                        memory_bytes=int(info.device_memory_size))


def read_target_config_file(path: str | Path) -> TargetConfig:
    """Read and check a ``--gpu-target-config`` file (:func:`parse_target_config`): a regular file
    (followed through links) of at most :data:`MAX_CONFIG_BYTES`, UTF-8.

    Raises:
      UsageError: it cannot be read, is a FIFO, device or folder, is too large, is not UTF-8, or
        is not a valid config.
    """
    from stagetool.process.fileio import FileProblem, read_regular_bytes

    try:
        raw = read_regular_bytes(path, max_bytes=MAX_CONFIG_BYTES)
    except FileProblem as e:
        raise UsageError(f"--gpu-target-config {path}: {e}", hint="give a GpuTargetConfigProto text file") from None
    except OSError as e:
        raise UsageError(f"--gpu-target-config {path}: cannot read it ({e.strerror or type(e).__name__})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--gpu-target-config {path}: byte {e.start} is not UTF-8") from None
    return parse_target_config(text, str(path))
