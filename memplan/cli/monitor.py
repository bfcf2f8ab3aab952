"""``memplan monitor-summary``: reduce every rank's ``MemoryMonitor`` JSONL to the worst rank."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from memplan.cli.options import Json
from memplan.errors import MemplanError
from memplan.report.versioned import dumps

Paths = Annotated[list[Path], typer.Argument(
    help="Directories holding memory_rank<R>.jsonl files, or the files themselves.")]
PlotPath = Annotated[Path | None, typer.Option(
    "--plot", help="Also draw memory and headroom per step, one line per rank, to this .png "
    "or .svg file (needs matplotlib).")]
TensorBoardDir = Annotated[Path | None, typer.Option(
    "--tensorboard", help="Also write every record's numbers as TensorBoard scalars "
    "(memplan/<key>, in bytes) to this folder, one run per rank (memplan_rank<R>); needs "
    "tensorboard.")]
WandbProject = Annotated[str | None, typer.Option(
    "--wandb", help="Also log every record's numbers to Weights & Biases, one run per rank "
    "(memplan_rank<R>) in this project; WANDB_MODE=offline keeps them local for `wandb sync`. "
    "Needs wandb.")]


def monitor_summary(paths: Paths, plot: PlotPath = None, tensorboard: TensorBoardDir = None,
                    wandb: WandbProject = None, json_out: Json = False) -> None:
    """Summarise the per-step records a MemoryMonitor wrote on every rank.

    Per rank: largest peak, reserved and fragmentation, smallest headroom, allocation retries,
    OOMs, median step time and warnings; the worst rank is the one with the largest peak. Then
    each rank's memory trend per series (allocated, tensors, resident set): the Theil-Sen
    slope over the run, the growth, the floor of each third and whether the monitor's leak
    rule holds.

    Examples:

      memplan monitor-summary runs/mem

      memplan monitor-summary runs/mem/memory_rank3.jsonl --json

      memplan monitor-summary runs/mem --plot memory.png

      memplan monitor-summary runs/mem --tensorboard runs/tb

      memplan monitor-summary runs/mem --wandb my-project
    """
    if plot is not None:
        from memplan.report.plot import check_path

        check_path(plot)
    sink = None
    if tensorboard is not None:
        from memplan.monitor.sinks import TensorBoardSink

        sink = TensorBoardSink(tensorboard, "--tensorboard")
    wandb_module = None
    if wandb is not None:
        from memplan.monitor.sinks import need

        _check_project(wandb)
        wandb_module = need("wandb", "--wandb")
    from memplan.cli import warn
    from memplan.diagnose.monitored import read_monitor

    # the reader `diagnose --monitor` uses: every record checked, what a killed job left
    # (a cut last line) skipped and reported, so both commands accept the same files
    monitored = read_monitor([str(p) for p in paths], what="monitor-summary")
    result = {**monitored.summary, "partial": list(monitored.partial)}
    for note in monitored.partial:
        warn(note)
    if plot is not None:
        from memplan.report.plot_monitor import plot_monitor

        drawn = plot_monitor({k: list(v) for k, v in monitored.records.items()}, plot)
        result["plot"] = None if drawn is None else str(drawn)
    if wandb_module is not None:  # first: a run W&B refuses (not logged in) leaves no files
        result["wandb"] = _replay_wandb(wandb_module, str(wandb), monitored.records)
    if sink is not None:
        result["tensorboard"] = _replay(sink, monitored.records)
    if json_out:
        typer.echo(dumps("monitor-summary", result))
        return
    from rich.console import Console

    from memplan.report.monitor import render_monitor_summary

    Console().print(render_monitor_summary(result))
    typer.echo(f"worst rank: {result['worst_rank']} (by {result['worst_by']}; marked *)")
    if plot is not None:
        typer.echo(f"wrote {result['plot']}")
    for folder in result.get("tensorboard", ()):
        typer.echo(f"wrote TensorBoard scalars to {folder}")
    for run in result.get("wandb", ()):
        typer.echo(f"logged rank {run['rank']} to W&B run {run['project']}/{run['id']} "
                   f"({run['dir']})")


def _replay(sink: Any, records: dict[int, Any]) -> list[str]:
    """Each rank's records as TensorBoard scalars (a stopped monitor's last record, which has no
    counters, left out); the run folders written."""
    from memplan.monitor.sinks import scalars

    out = []
    for rank, recs in records.items():
        for rec in recs:
            if "monitor_stopped" not in rec:
                sink.write(rank, rec["step"], scalars(rec), rec["time"])
        sink.close()
        out.append(str(sink.run_dir(rank)))
    return out


# W&B's own limit on a project name: 128 characters, none of these (wandb_settings.py,
# Settings.validate_project)
_PROJECT_CHARS = frozenset("/\\#?%:")


def _check_project(project: str) -> None:
    bad = sorted(set(project) & _PROJECT_CHARS)
    if not project.strip() or len(project) > 128 or bad or not project.isprintable():
        raise MemplanError(f"--wandb must name a W&B project (1 to 128 printable characters, "
                           f"none of / \\ # ? % :), not {project[:40]!r}"
                           f"{'...' if len(project) > 40 else ''} ({len(project)} characters)")


def _replay_wandb(wandb: Any, project: str, records: dict[int, Any]) -> list[dict[str, Any]]:
    """Each rank's records logged to a W&B run of its own (memplan_rank<R>), finished."""
    from memplan.monitor.sinks import WandbSink, scalars

    out = []
    for rank, recs in records.items():
        try:
            run = wandb.init(project=project, name=f"memplan_rank{rank}", group="memplan",
                             job_type="memory-monitor",  # memplan says what it logged
                             settings=wandb.Settings(console="off", silent=True,
                                                     disable_git=True))
        except Exception as err:  # not logged in, no network, a setting W&B refuses
            raise MemplanError(f"--wandb {project}: W&B could not start a run: "
                               f"{' '.join(str(err).split())}") from err
        try:
            sink = WandbSink(run, "--wandb")
            for rec in recs:
                if "monitor_stopped" not in rec:
                    sink.write(rank, rec["step"], scalars(rec), rec["time"])
        finally:
            run.finish()
        out.append({"rank": rank, "project": project, "id": str(run.id), "dir": str(run.dir)})
    return out
