"""The hardware a project names once, in ``pyproject.toml``::

    [tool.stagetool]
    topology = "v5e"                 # a TPU generation: --mesh 2x4 stages on v5e:2x4
    # topology = "h100"              # a GPU: --mesh 2x4 stages on h100:8
    # topology = "v5e:2x4"           # or a whole topology, as --topology takes it
    # gpu-target-config = "h100.txtpb"   # a GpuTargetConfigProto (with topology = "gpu")

:func:`project_settings` finds the ``pyproject.toml`` of the project a spec is in (the nearest one
above the spec's folder, not above the project's top, :func:`stagetool.core.paths.find_project`) and
reads its ``[tool.stagetool]`` table. The plan takes it below the spec's own ``topology:`` and below
every command-line option (:func:`stagetool.plan.plan.make_plan`). No JAX here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from stagetool.core.errors import UsageError

__all__ = ["ProjectSettings", "project_settings"]

KEYS = ("topology", "gpu-target-config")
"""The keys ``[tool.stagetool]`` takes (``gpu_target_config`` is read as ``gpu-target-config``)."""


@dataclasses.dataclass(frozen=True)
class ProjectSettings:
    """``[tool.stagetool]`` of a project's ``pyproject.toml``.

    Attributes:
      path: the ``pyproject.toml`` read (absolute).
      topology: the hardware named (``v5e``, ``v5e:2x4``, ``h100``, ``h100:8``, ``gpu``), or None.
      gpu_target_config: a ``GpuTargetConfigProto`` file, absolute (written relative to the
        ``pyproject.toml``'s folder), or None.
    """

    path: Path
    topology: str | None = None
    gpu_target_config: str | None = None

    @property
    def where(self) -> str:
        """How a report names it: ``pyproject.toml [tool.stagetool]`` (the file's name, its folder left out)."""
        return f"{self.path.name} [tool.stagetool]"


def project_settings(folder: str | Path | None) -> ProjectSettings | None:
    """The ``[tool.stagetool]`` table of the ``pyproject.toml`` nearest above ``folder`` (the spec's
    folder; the working directory when None), searched up to the project's top; None when there is
    no such file or table.

    Raises:
      UsageError: the file is not valid TOML, or the table holds an unknown key or a value that is
        not a non-empty string (exit 2, naming the file and the key).
    """
    from stagetool.core.paths import find_project

    start = Path(folder if folder is not None else Path.cwd()).resolve()
    top = find_project(start)
    for candidate in (start, *start.parents):
        path = candidate / "pyproject.toml"
        if path.is_file():
            return _read(path)
        if top is None or candidate == top:
            return None
    return None


def _read(path: Path) -> ProjectSettings | None:
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"{path}: cannot read [tool.stagetool]: {e}",
                         hint="fix the TOML (the project's hardware is named there)") from None
    table = data.get("tool", {}).get("stagetool") if isinstance(data.get("tool"), dict) else None
    if table is None:
        return None
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [tool.stagetool] must be a table", hint='write [tool.stagetool] topology = "v5e"')
    values: dict[str, str] = {}
    for key, value in table.items():
        name = key.replace("_", "-")
        if name not in KEYS:
            import difflib

            close = difflib.get_close_matches(name, KEYS, n=1, cutoff=0.6)
            raise UsageError(f"{path}: [tool.stagetool] has an unknown key {key!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else ""),
                             hint="it takes " + ", ".join(KEYS) + ': topology = "v5e" names the hardware once')
        if not isinstance(value, str) or not value.strip():
            raise UsageError(f"{path}: [tool.stagetool] {key} must be a non-empty string, not {value!r}",
                             hint='e.g. topology = "v5e" (a TPU generation), "v5e:2x4" or "h100"')
        values[name] = value.strip()
    config = values.get("gpu-target-config")
    if config is not None and not Path(config).is_absolute():
        config = str(path.parent / config)
    return ProjectSettings(path.resolve(), values.get("topology"), config)


def extra_for(spec: str | Path | None) -> str | None:
    """The install extra the hardware named for ``spec`` needs (``tpu``: libtpu; ``gpu-aot``: JAX's
    CUDA plugin), read from the spec's ``topology:`` else the project's ``[tool.stagetool]``; None
    when none is named. The GitHub Action installs stagetool with it (``python -m
    stagetool.spec.project SPEC``). Never raises: a spec or table it cannot read names nothing here
    (the staging command says what is wrong)."""
    import re

    topology = None
    path = Path(spec) if spec is not None else None
    try:
        if path is not None and path.is_file():
            import yaml

            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
            if isinstance(doc, dict) and doc.get("topology") is not None:
                topology = str(doc["topology"])
            elif isinstance(doc, dict) and doc.get("gpu_target_config") is not None:
                topology = "gpu"
        if topology is None:
            settings = project_settings(path.resolve().parent if path is not None else None)
            topology = settings.topology or ("gpu" if settings.gpu_target_config else None) if settings else None
    except Exception:  # noqa: BLE001 - a spec or table it cannot read: the staging command says what is wrong
        return None
    if topology is None:
        return None
    from stagetool.core.accelerators import AMBIGUOUS_GPUS, GENERIC_KIND, gpu_kinds

    kind = re.split(r"[:=]", topology, maxsplit=1)[0].strip().lower()
    return "gpu-aot" if kind in gpu_kinds() or kind == GENERIC_KIND or kind in AMBIGUOUS_GPUS else "tpu"


if __name__ == "__main__":  # python -m stagetool.spec.project [SPEC]: the extra to install, or nothing
    import sys

    print(extra_for(sys.argv[1] if len(sys.argv) > 1 else None) or "")
