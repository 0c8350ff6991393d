"""What a run compiles for, parsed once from ``--platform``, ``--topology`` and
``--gpu-target-config`` (:func:`parse_target`) into one typed, frozen value the plan holds:

- :class:`TpuTarget`: a compile-only TPU topology, ``v5e:2x4`` (any kind of
  :data:`stagetool.core.accelerators.TPU_CHIPS`, or one libtpu knows by its own spelling);
- :class:`GpuTarget`: a compile-only GPU target, ``h100:8`` or ``h100:2x8`` (a kind of
  :data:`stagetool.core.accelerators.GPU_MODELS`, or ``gpu`` with ``--gpu-target-config``);
- :class:`CpuMesh`: simulated CPU devices, as many as the mesh needs (``--platform cpu``);
- :class:`Attached`: the devices JAX finds (``--platform gpu|tpu``, or JAX's default backend).

Everything after the plan (the devices, the facts cache, the report's notes, the sweep) reads the
value's fields; nothing parses the name again. :func:`check_target` says what else can be known
before JAX starts: the kind, the config file, and whether the library the target needs is installed.
No JAX here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from pathlib import Path
from typing import ClassVar, Union

from stagetool.core.accelerators import (
    AMBIGUOUS_GPUS,
    DEVICES_PER_CHIP,
    GENERIC_KIND,
    GPU_MODELS,
    TPU_CHIPS,
    TWO_D_SHAPES,
    generation_of,
    gpu_kinds,
    gpu_model,
)
from stagetool.core.chips import CHIPS
from stagetool.core.errors import UsageError
from stagetool.core.mesh import MAX_DEVICES
from stagetool.plan.gpu_target_proto import TargetConfig

__all__ = ["Attached", "CpuMesh", "DeviceTarget", "GpuTarget", "TpuTarget", "check_chip_for_target", "check_target",
           "installed_compile_only", "parse_target", "sized_name"]

PLATFORMS = ("cpu", "gpu", "tpu")

TPU_INSTALL_LINE = ("pip install -e '.[tpu]' in stagetool's checkout, as docs/targets.md says   "
                    '(or: pip install "jax[tpu]==<your jax version>")')
"""What to install for compile-only TPU topologies (shown in errors)."""

GPU_INSTALL_LINE = ("pip install -e '.[gpu-aot]' in stagetool's checkout, as docs/targets.md says   (or: pip install "
                    '"jax[cuda12-local]==<your jax version>": the CUDA plugin without NVIDIA libraries)')
"""What to install for compile-only GPU targets (shown in errors)."""

_TPU_NAME = re.compile(r"^\s*([A-Za-z0-9 _]+?)\s*[:=]\s*([0-9]+(?:x[0-9]+){0,2})\s*$", re.ASCII)
TPU_ACCEPTED = ("accepted: <kind>:<AxB> or <kind>:<AxBxC> with kind one of "
                + ", ".join(c.alias for c in TPU_CHIPS)
                + "; e.g. v5e:2x4, v5e:4x4, v5p:2x2x2, v4:2x2x1, v6e:2x4")
_GPU_NAME = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*:\s*([0-9]{1,6})(?:x([0-9]{1,6}))?\s*$", re.ASCII)
GPU_ACCEPTED = ("accepted: <gpu>:<devices per host> or <gpu>:<hosts>x<devices per host> with gpu one of "
                + ", ".join(m.alias for m in GPU_MODELS) + " (or gpu with --gpu-target-config); "
                "e.g. h100:8, h100:2x8, a100-80gb:4")


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """A compile-only TPU topology (``--topology v5e:2x4``).

    Attributes:
      name: the name as given (``"v5e:2x4"``), for messages and the report.
      kind: the kind as written (``"v5e"``, or libtpu's ``"TPU v5 lite"``); libtpu decides whether it knows it.
      dims: the chip grid, ``(2, 4)``; every dimension above 0.
    """

    name: str
    kind: str
    dims: tuple[int, ...]

    @property
    def generation(self) -> str | None:
        """The :data:`~stagetool.core.accelerators.TPU_CHIPS` alias (``"v5e"``), or None for a kind not in it."""
        return generation_of(self.kind)

    @property
    def chips(self) -> int:
        """Chips in one slice (the product of :attr:`dims`)."""
        return math.prod(self.dims)

    @property
    def device_count(self) -> int:
        """Devices of one slice from the name alone: chips × devices per chip (``v5e:4x4`` → 16, ``v4:2x2x1`` → 8)."""
        return self.chips * DEVICES_PER_CHIP.get(self.generation or self.kind.strip().lower(), 1)

    @property
    def libtpu_name(self) -> str:
        """The name ``jax.experimental.topologies.get_topology_desc`` is given (``"v5e:2x4"``)."""
        return f"{self.kind}:{'x'.join(map(str, self.dims))}"

    @property
    def roofline_chip(self) -> str | None:
        """The roofline table's chip (:data:`stagetool.core.chips.CHIPS`) it compiles for (``tpu-v5e``), or None."""
        generation = self.generation
        return f"tpu-{generation}" if generation and f"tpu-{generation}" in CHIPS else None


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A compile-only GPU target (``--topology h100:2x8``, or ``gpu:8 --gpu-target-config FILE``).

    Attributes:
      name: the name as given (``"h100:2x8"``).
      kind: the :data:`~stagetool.core.accelerators.GPU_MODELS` alias (``"h100"``; ``h100-sxm`` is
        ``h100``), or ``gpu`` (the generic kind, which needs ``config``).
      hosts: hosts (processes); devices_per_host: GPUs on each.
      config: the ``--gpu-target-config`` file (a ``GpuTargetConfigProto`` in text form), or None
        for the table's figures of ``kind``.
      config_read: that file as read and checked once, before JAX starts (:func:`check_target`):
        what XLA is given, so that a file changed after the check cannot reach the compile; None
        until then, or without ``config``.
    """

    name: str
    kind: str
    hosts: int
    devices_per_host: int
    config: str | None = None
    config_read: TargetConfig | None = None

    @property
    def device_count(self) -> int:
        """Devices from the name alone: hosts × devices per host (``h100:2x8`` → 16)."""
        return self.hosts * self.devices_per_host

    @property
    def roofline_chip(self) -> str | None:
        """The roofline table's chip it compiles for (``h100`` → ``h100-sxm``); None for a config of
        the user's or the generic kind."""
        if self.config is not None or self.kind == GENERIC_KIND:
            return None
        return gpu_model(self.kind).chip


@dataclasses.dataclass(frozen=True)
class CpuMesh:
    """Simulated CPU devices, as many as the mesh needs (``--platform cpu``)."""

    platform: ClassVar[str] = "cpu"


@dataclasses.dataclass(frozen=True)
class Attached:
    """The devices JAX finds.

    Attributes:
      platform: ``gpu`` or ``tpu`` (``--platform``), or None for JAX's default backend (an attached
        accelerator, else simulated CPU devices as for :class:`CpuMesh`).
    """

    platform: str | None = None


DeviceTarget = Union[TpuTarget, GpuTarget, CpuMesh, Attached]
"""What a run compiles for: one of the four, made by :func:`parse_target`."""

COMPILE_ONLY = (TpuTarget, GpuTarget)
"""The targets whose devices come from ``jax.experimental.topologies`` (no hardware attached)."""


def parse_target(topology: str | None, *, platform: str | None = None,
                 gpu_target_config: str | None = None) -> DeviceTarget:
    """The one parse of ``--topology`` (with ``--platform`` and ``--gpu-target-config``): its form
    and shape, from the name alone, no library loaded.

    A name whose kind is a GPU's (or any name with ``--gpu-target-config``) is a :class:`GpuTarget`;
    any other name a :class:`TpuTarget`. Without a topology: :class:`CpuMesh` for ``--platform cpu``,
    else :class:`Attached`.

    Raises:
      UsageError: an unknown ``--platform``; ``--gpu-target-config`` without a topology; a name
        without the ``kind:AxB`` (TPU) or ``gpu:N`` / ``gpu:HxN`` (GPU) form, a zero dimension, an
        unknown or ambiguous GPU, or a TPU shape its generation cannot have (``v5e:2x2x2``).
    """
    if platform is not None and platform not in PLATFORMS:
        raise UsageError(f"--platform {platform!r} is not one of {', '.join(PLATFORMS)}")
    if topology is None:
        if gpu_target_config is not None:
            raise UsageError(f"--gpu-target-config {gpu_target_config} needs a GPU topology to compile for",
                             hint="add --topology gpu:8 (one host of 8 GPUs) or gpu:2x8 (2 hosts)")
        return CpuMesh() if platform == "cpu" else Attached(platform)
    if _names_a_gpu(topology) or gpu_target_config is not None:
        return _gpu_target(topology, gpu_target_config)
    return _tpu_target(topology)


def sized_name(name: str, mesh_sizes: tuple[int, ...], *, slices: int = 1) -> str:
    """A target named by its hardware alone (``v5e``, ``h100``: no shape) sized by the mesh: the
    slice of that hardware the mesh uses whole. ``v5e`` with ``--mesh 2x4`` is ``v5e:2x4`` (a 2-D
    mesh whose sizes are a published slice shape is that shape; else the published shape with as
    many chips); ``v5p`` with 8 devices ``v5p:2x2x2``; ``h100`` with 8 devices ``h100:8``, with 16
    ``h100:2x8`` (hosts of 8). A name with a shape (``v5e:2x4``) is returned as it is.

    Args:
      name: the name as written.
      mesh_sizes: the mesh's axis sizes, in order (``()``: one device).
      slices: TPU slices the mesh spans (its devices are ``slices`` × one slice's).

    Raises:
      UsageError: no slice of that hardware has the mesh's device count (``v5e`` with 3 devices).
    """
    if ":" in name:
        return name
    kind = name.strip()
    devices = math.prod(mesh_sizes) if mesh_sizes else 1
    low = kind.lower()
    if low in gpu_kinds() or low == GENERIC_KIND or low in AMBIGUOUS_GPUS:
        if devices <= 8:
            return f"{kind}:{devices}"
        if devices % 8 == 0:
            return f"{kind}:{devices // 8}x8"
        raise UsageError(f"{kind} with a mesh of {devices} devices: GPUs come in hosts of up to 8, so {devices} "
                         "devices is no GPU target", hint=f"give a mesh of at most 8 devices or a multiple of 8, "
                                                          f"or a whole target such as --topology {kind}:2x8")
    gen = generation_of(kind)
    if gen is None:
        raise UsageError(f"hardware {kind!r} is neither a TPU generation nor a GPU (and has no shape)",
                         hint=TPU_ACCEPTED + "; or a TPU generation / GPU alone (v5e, h100), sized by the mesh")
    per_chip = DEVICES_PER_CHIP.get(gen, 1)
    per_slice, rest = divmod(devices, max(slices, 1))
    chips, odd = divmod(per_slice, per_chip)
    if rest or odd or chips < 1:
        raise UsageError(f"{kind} with a mesh of {devices} devices: a {gen} chip has {per_chip} devices, so the mesh "
                         "uses no whole slice", hint=f"give a mesh whose size is a multiple of {per_chip * slices}")
    if gen in TWO_D_SHAPES:
        shapes = [s for s in TWO_D_SHAPES[gen] if math.prod(int(d) for d in s.split("x")) == chips]
        if not shapes:
            raise UsageError(f"{kind} with a mesh of {devices} devices: no published {gen} slice has {chips} chips",
                             hint=f"{gen} slices: " + ", ".join(TWO_D_SHAPES[gen]) + "; give a mesh of that size")
        mesh_shape = "x".join(map(str, mesh_sizes)) if len(mesh_sizes) == 2 and slices == 1 else None
        return f"{kind}:{mesh_shape if mesh_shape in shapes else shapes[0]}"
    if chips & (chips - 1):
        raise UsageError(f"{kind} with a mesh of {devices} devices: {chips} chips is not a power of 2, which no "
                         f"{gen} slice has", hint="give a mesh of 4, 8, 16, ... devices, or a whole topology such as "
                                                  f"--topology {gen}:2x2x2")
    dims = [1, 1, 1]
    while math.prod(dims) < chips:
        dims[dims.index(min(dims))] *= 2
    dims.sort(reverse=chips <= 4)  # v4:2x2x1 as Google writes the small ones; 2x2x4 the larger
    return f"{kind}:{'x'.join(map(str, dims))}"


def installed_compile_only() -> str | None:
    """What is installed for compile-only targets (``libtpu is``, ``libtpu and JAX's CUDA plugin are``),
    for the line that says how to name the hardware once; None when neither is."""
    have = [what for what, present in (("libtpu", libtpu_available()), ("JAX's CUDA plugin", cuda_plugin_available()))
            if present]
    return f"{' and '.join(have)} {'is' if len(have) == 1 else 'are'}" if have else None


def _names_a_gpu(name: str) -> bool:
    kind = name.split(":", 1)[0].strip().lower() if ":" in name else None
    return kind is not None and (kind in gpu_kinds() or kind == GENERIC_KIND or kind in AMBIGUOUS_GPUS)


def _gpu_target(name: str, config: str | None) -> GpuTarget:
    m = _GPU_NAME.match(name or "")
    if not m:
        from stagetool.core.text import clipped

        raise UsageError(f"bad GPU topology name {clipped(name or '')}", hint=GPU_ACCEPTED)
    kind = m.group(1).lower()
    if kind in AMBIGUOUS_GPUS:
        why, fix = AMBIGUOUS_GPUS[kind]
        raise UsageError(f"GPU {m.group(1)!r} in topology {name!r} is ambiguous: {why}", hint=fix)
    if kind not in gpu_kinds() and kind != GENERIC_KIND:
        raise UsageError(f"unknown GPU {m.group(1)!r} in topology {name!r}", hint=GPU_ACCEPTED)
    hosts, per_host = (int(m.group(2)), int(m.group(3))) if m.group(3) else (1, int(m.group(2)))
    if hosts < 1 or per_host < 1:
        raise UsageError(f"GPU topology {name!r} has no devices", hint=GPU_ACCEPTED)
    if hosts * per_host > MAX_DEVICES:
        raise UsageError(f"GPU topology {name!r} has more than {MAX_DEVICES} devices", hint=GPU_ACCEPTED)
    return GpuTarget(name, gpu_model(kind).alias if kind != GENERIC_KIND else kind, hosts, per_host, config)


def _tpu_target(name: str) -> TpuTarget:
    m = _TPU_NAME.match(name or "")
    if not m or any(len(d) > 6 or int(d) == 0 for d in m.group(2).split("x")):
        _refuse_gpu_typo(name)  # a GPU typo says so, malformed or not
        from stagetool.core.text import clipped

        raise UsageError(f"bad TPU topology name {clipped(name or '')}", hint=TPU_ACCEPTED)
    kind, dims = m.group(1), tuple(int(d) for d in m.group(2).split("x"))
    if math.prod(dims) > MAX_DEVICES:
        raise UsageError(f"TPU topology {name!r} has more than {MAX_DEVICES} chips", hint=TPU_ACCEPTED)
    gen = generation_of(kind)
    if gen in TWO_D_SHAPES and len(dims) == 3 and dims[2] != 1:
        raise UsageError(f"TPU topology {name!r} does not exist: {gen} chips form a 2-D torus, so a {gen} topology "
                         "is AxB", hint=f"valid {gen} shapes: " + ", ".join(f"{gen}:{s}" for s in TWO_D_SHAPES[gen]))
    return TpuTarget(name, kind, dims)


def check_target(target: DeviceTarget) -> DeviceTarget:
    """Everything about a compile-only target that can be said before JAX starts, beyond its name's
    form: a GPU typo (``h10:8``) taken for a TPU kind, the generic GPU kind without a config, the
    config file, and that the library the target needs is installed. Returns the target, a GPU
    target's config file read into it (:attr:`GpuTarget.config_read`): it is not read again.

    Raises:
      UsageError: what is wrong and how to fix it (the install line for a missing library).
    """
    if isinstance(target, GpuTarget):
        if target.config is not None:
            from stagetool.plan.gpu_target_proto import read_target_config_file

            target = dataclasses.replace(target, config_read=read_target_config_file(target.config))
        elif target.kind == GENERIC_KIND:
            raise UsageError(f"topology {target.name!r}: the generic GPU kind needs --gpu-target-config FILE")
        if not cuda_plugin_available():
            raise UsageError(f"GPU topology {target.name!r} needs JAX's CUDA plugin, which is not installed",
                             hint=GPU_INSTALL_LINE)
    elif isinstance(target, TpuTarget):
        _refuse_gpu_typo(target.name)
        if not libtpu_available():
            raise UsageError(f"TPU topology {target.name!r} needs libtpu, which is not installed",
                             hint=TPU_INSTALL_LINE)
    return target


def _refuse_gpu_typo(name: str) -> None:
    """A kind that is no TPU generation but close to a GPU's (``h10:8``, ``a10080gb:8``) is a GPU typo:
    refused before libtpu is loaded, with "did you mean" and both lists. Other unknown kinds are left
    to libtpu, which knows spellings of its own; its refusal names the GPU targets too."""
    import difflib

    kind = name.split(":", 1)[0].strip() if ":" in name else ""
    if not kind or generation_of(kind) is not None:
        return
    gpus = gpu_kinds()
    close = difflib.get_close_matches(kind.lower(), gpus, n=2, cutoff=0.6)
    tpus = difflib.get_close_matches(kind.lower(), [c.alias for c in TPU_CHIPS], n=2, cutoff=0.6)
    if close and not tpus:
        raise UsageError(f"unknown topology kind {kind!r} in {name!r}: did you mean "
                         + " or ".join(f"{c}:{name.split(':', 1)[1].strip()}" for c in close) + "?",
                         hint="TPU topologies: <kind>:<AxB> with kind one of " + ", ".join(c.alias for c in TPU_CHIPS)
                         + " (e.g. v5e:2x4); GPU targets: <gpu>:<devices per host> with gpu one of "
                         + ", ".join(gpus) + " (e.g. h100:8)")


def check_chip_for_target(chip: str, target: TpuTarget | GpuTarget, *, sweep: bool = False) -> None:
    """Refuse a ``--chip`` that is not the chip a compile-only target compiles for: its roofline
    would divide one chip's program by another chip's peak figures, which is no step time of
    either. A chip of the built-in table is checked against the target's own chip
    (:attr:`TpuTarget.roofline_chip`), or, where that is unknown, against its platform (``tpu-*``
    chips are TPUs, the others GPUs); a chip only the spec's ``chips:`` names is taken as written.

    Raises:
      UsageError: the chip and the target differ (exit 2, before anything starts).
    """
    key = chip.strip().lower()
    if key not in CHIPS:
        return
    gpu = isinstance(target, GpuTarget)
    own = target.roofline_chip
    chip_is_tpu = key.startswith("tpu-")
    if own is not None and own == key:
        return
    if own is None and chip_is_tpu != gpu:
        return
    what = f"the {own} chip" if own else ("a GPU" if gpu else "a TPU")
    fix = (f"give --chip {own}, or leave --chip out: a sweep over topologies then gives each row its own target's "
           "chip" if sweep else f"give --chip {own}" if own else "give a chip of the target's kind, or no --chip")
    if sweep and own is None:
        fix = "leave --chip out (each row then uses its own target's chip where the table knows it)"
    raise UsageError(f"--chip {chip} does not match --topology {target.name}, which compiles for {what}: a roofline "
                     f"of one chip over another's compile is no step time of either", hint=fix)


def read_target_config(path: str | Path) -> str:
    """The text of a ``--gpu-target-config`` file, once it has been read as the protobuf XLA reads
    and checked (:func:`stagetool.plan.gpu_target_proto.read_target_config_file`).

    Raises:
      UsageError: the file cannot be read, is not a regular file of sensible size, or is not a
        valid ``GpuTargetConfigProto`` (a field XLA divides by, or ``device_memory_size``, missing
        or not above 0).
    """
    from stagetool.plan.gpu_target_proto import read_target_config_file

    return read_target_config_file(path).text


def libtpu_available() -> bool:
    """True when the ``libtpu`` package is importable or ``TPU_LIBRARY_PATH`` names a file."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path and os.path.isfile(path):
        return True
    return importlib.util.find_spec("libtpu") is not None


def cuda_plugin_available() -> bool:
    """True when JAX's CUDA PJRT plugin (``jax_plugins.xla_cuda12``, from ``jax-cuda12-plugin``) is importable.

    Looks for the package without importing it (importing loads CUDA stubs that print on fd 2).
    """
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except (ImportError, ValueError):
        return False
