"""What a run is asked: :class:`Options` (the CLI's common options, the Python API's argument) and
the :class:`Section` s a report holds. :func:`stagetool.plan.plan.make_plan` turns them into a
:class:`~stagetool.plan.plan.Plan`; nothing after it reads :class:`Options`."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

from stagetool.spec.model import LeafSharding


class Section(str, enum.Enum):
    """What a report holds. Each section costs what its analysis needs and no more."""

    LOWERED_TEXT = "lowered_text"
    """The lowered module's text (StableHLO, or HLO with ``dialect="hlo"``); does not compile."""
    COMPILED_TEXT = "compiled_text"
    """The compiled (optimized, SPMD-partitioned) HLO module."""
    SHARDINGS = "shardings"
    COST = "cost"
    MEMORY = "memory"
    COLLECTIVES = "collectives"
    WHY = "why"
    """``stagetool why``'s answer (needs the plan's question): the collectives and their causes are
    computed for it, and only the answer is reported."""
    MODULES = "modules"
    """The roll-up per module path and phase (:mod:`stagetool.analysis.modules`)."""


REPORT_SECTIONS = (Section.SHARDINGS, Section.COLLECTIVES, Section.COST, Section.MEMORY)
"""What ``stagetool report`` holds."""


@dataclasses.dataclass(frozen=True)
class Options:
    """What to stage and where; mirrors the CLI's common options.

    Attributes:
      target: ``file.py:func`` / ``pkg.mod:func``, or None for every function of the spec.
      spec: the spec file, or None to search for it (see :func:`stagetool.spec.spec_candidates`).
      mesh: ``2x4`` or ``data=2,model=4``, overriding the spec's mesh sizes.
      context_mesh: trace under the staged mesh as the context mesh (True), under none (False), or
        as the code runs (None: the spec's ``mesh.context``, else :func:`stagetool.inputs.loading.context_of`).
      platform: ``cpu`` | ``gpu`` | ``tpu``.
      topology: a compile-only TPU topology (``v5e:2x4``) or GPU target (``h100:8``, ``h100:2x8``).
      gpu_target_config: a ``GpuTargetConfigProto`` text file for a GPU target (``--gpu-target-config``).
      slices: stage this many slices of the TPU topology joined over DCN (``--slices``), overriding
        the spec's ``slices``; the mesh's first axis spans them.
      function: run only the spec function(s) of this name (a name or a tuple of names).
      local_avals: take spec shapes as host-local (``avals: local``).
      processes: simulate this many processes (hosts) for local avals.
      dialect: ``stablehlo`` or ``hlo`` for the lowered module's text.
      chip: a chip of the roofline table (``stagetool.core.chips``) for a step-time estimate.
      device_memory: per-device memory capacity such as ``16GiB``, overriding what the device reports.
      peak: find the buffers live at the memory peak (the same compile, with XLA's dump written to a temporary folder).
      top: how many largest inputs / peak buffers to list.
      explain: input leaves (key paths, or their last parts) whose collectives to trace.
      job_processes: processes of the multi-process job (``jax.distributed``) this process is one
        of; each provisions its share of CPU devices. None for a single process.
      cache_dir: the facts cache folder (:mod:`stagetool.staging.cache`): a function whose key
        matches an entry is not compiled. None (the API's default): no cache.
      jobs: stage this many functions at once, each worker a process of its own that starts JAX
        once (:mod:`stagetool.process.workers`); the report is the same as a serial run's, in spec order.
      variables: ``(name, value text)`` pairs filling the spec's ``${name}`` placeholders
        (:mod:`stagetool.spec.variables`; ``stagetool sweep --set``).
      timeout_s: seconds each function may take in a worker (``--timeout``); None: no limit.
      isolate: stage each function in a worker process of its own (``--isolate``).
      outputs: ``(option, path)`` of each file the command will write (``--output``, ``--junit-xml``,
        ``--baseline`` with ``--update``), checked by :func:`~stagetool.plan.plan.make_plan` before anything is staged.
      why: ``stagetool why``'s question as ``(--leaf, --line, --collective)``, one of them given.
      against: ``--against TARGET``: a compile-only target (``v5e:2x4``, ``h100:8``; a name alone,
        ``v5e``, sized by the mesh) to stage the same program for too, marking every difference.
      target_named_by: how the caller names ``topology``/``platform`` in messages and the report
        (``topology=`` for :func:`stagetool.inspect`), or None for the CLI's flags.
      leaf_shardings: input leaves whose sharding replaces the spec's in every selected function
        (:class:`stagetool.spec.model.LeafSharding`; a sweep configuration's, from ``stagetool fit
        --what-if``); a path no leaf has is exit 2 before any compile.
    """

    target: str | None = None
    spec: Path | None = None
    mesh: str | None = None
    context_mesh: bool | None = None
    platform: str | None = None
    topology: str | None = None
    gpu_target_config: str | None = None
    slices: int | None = None
    function: str | tuple[str, ...] | None = None
    local_avals: bool = False
    processes: int | None = None
    dialect: str = "stablehlo"
    chip: str | None = None
    device_memory: str | None = None
    peak: bool = False
    top: int = 10
    explain: tuple[str, ...] = ()
    job_processes: int | None = None
    cache_dir: Path | None = None
    jobs: int = 1
    variables: tuple[tuple[str, str], ...] = ()
    timeout_s: float | None = None
    isolate: bool = False
    outputs: tuple[tuple[str, Path], ...] = ()
    why: tuple[str | None, str | None, int | None] | None = None
    leaf_shardings: tuple[LeafSharding, ...] = ()
    target_named_by: str | None = None
    against: str | None = None

