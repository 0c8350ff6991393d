"""The Typer application and its root command: ``--version`` and the options of a multi-process
run (``--coordinator``, ``--num-processes``, ``--process-id``), with which a command joins the job
(:func:`joined`). The commands register on :data:`app` from :mod:`stagetool.cli.commands`."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Optional

import typer

from stagetool._version import __version__
from stagetool.cli.output import escape, stderr

app = typer.Typer(
    name="stagetool",
    help="What will XLA do with my JAX function on this mesh? Stage it (trace → lower → compile) on "
         "simulated CPU devices, attached accelerators or a compile-only TPU topology, and see the "
         "shardings, collectives, cost and memory.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

#: ``--coordinator``/``--num-processes``/``--process-id`` of the root command, for jax.distributed.
_DISTRIBUTED: dict[str, Any] = {}

#: the root command's options that take a value (``--coordinator HOST:PORT``)
ROOT_VALUE_OPTIONS = ("--coordinator", "--num-processes", "--process-id")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"stagetool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True,
                                                help="Print the version and exit.")] = False,
          coordinator: Annotated[Optional[str], typer.Option(
              "--coordinator", help="Multi-process run: HOST:PORT of process 0's coordinator (jax.distributed).",
              show_default=False)] = None,
          num_processes: Annotated[Optional[int], typer.Option(
              "--num-processes", help="Multi-process run: how many processes take part.", show_default=False,
              min=1)] = None,
          process_id: Annotated[Optional[int], typer.Option(
              "--process-id", help="Multi-process run: this process's index (0 prints and writes).",
              show_default=False, min=0)] = None) -> None:
    """What will XLA do with my JAX function on this mesh?

    Launched on every host of a cluster (Slurm, Open MPI, a multi-host TPU slice), stagetool joins
    the job through jax.distributed automatically; elsewhere pass --coordinator, --num-processes
    and --process-id. Every process stages the program; only process 0 prints and writes files.
    """
    _DISTRIBUTED.update(coordinator=coordinator, num_processes=num_processes, process_id=process_id)


def _join_distributed() -> int | None:
    """Join a multi-process job when asked to (or when a cluster launcher is detected).

    Returns the number of processes given on the command line, or None.
    """
    from stagetool.devices.distributed import detect_cluster, initialize

    c, n, i = (_DISTRIBUTED.get(k) for k in ("coordinator", "num_processes", "process_id"))
    if c is None and n is None and i is None and detect_cluster() is None:
        return None
    if c is not None:
        stderr().print(f"[dim]joining {n} processes at {escape(c)} as process {i}…[/]")
    initialize(c, n, i)
    return n


def joined(options: Any) -> Any:
    """Join a multi-process job if asked to; the :class:`stagetool.pipeline.Options` then say how many
    processes share the mesh."""
    job = _join_distributed()
    return dataclasses.replace(options, job_processes=job) if job else options
