"""``stagetool devices``: the platform, devices and versions, or the attached GPU's target config."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from stagetool.cli.app import app
from stagetool.cli.options import DebugOpt, FormatOpt, OutputOpt, Staging, staging_command
from stagetool.cli.output import emit, errors, note_untested_jax, write_text
from stagetool.report import Format


@app.command()
@staging_command(only=("mesh", "platform", "topology", "gpu_target_config", "slices"),
                 help={"mesh": "Lay a mesh over the devices, e.g. data=2,model=4."})
def devices(staging: Staging,
            target_config: Annotated[bool, typer.Option(
                "--target-config", help="Print (or -o FILE) the attached GPU's GpuTargetConfigProto, for "
                                        "--gpu-target-config on a machine without it.")] = False,
            format: FormatOpt = Format.text, output: OutputOpt = None, debug: DebugOpt = False) -> None:
    """The platform, device kind and count, processes, and jax/jaxlib versions."""
    with errors(debug):
        if target_config:
            from stagetool.devices.gpu_capture import capture_target_config

            write_text(capture_target_config(), output)
            return
        from stagetool.pipeline import devices_report

        note_untested_jax()
        emit(devices_report(mesh=staging.mesh, platform=staging.platform, topology=staging.topology,
                            gpu_target_config=staging.gpu_target_config, slices=staging.slices), format, output)
