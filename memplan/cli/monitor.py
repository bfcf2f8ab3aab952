"""``memplan monitor-summary``: reduce every rank's ``MemoryMonitor`` JSONL to the worst rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from memplan.cli.options import Json
from memplan.errors import MemplanError

Paths = Annotated[list[Path], typer.Argument(
    help="Directories holding memory_rank<R>.jsonl files, or the files themselves.")]


def monitor_summary(paths: Paths, json_out: Json = False) -> None:
    """Summarise the per-step records a MemoryMonitor wrote on every rank.

    Per rank: largest peak, reserved and fragmentation, smallest headroom, allocation retries,
    OOMs, median step time and warnings; the worst rank is the one with the largest peak.

    Examples:

      memplan monitor-summary runs/mem

      memplan monitor-summary runs/mem/memory_rank3.jsonl --json
    """
    from memplan.monitor import read_records, summarize

    for p in paths:
        if not p.exists():
            raise MemplanError(f"{p}: no such file or directory")
    try:
        records = read_records(list(paths))
    except (OSError, ValueError, KeyError) as err:
        raise MemplanError(f"not a memory monitor record file ({err})") from err
    if not records:
        raise MemplanError("no memory monitor records (memory_rank*.jsonl) found")
    result = summarize(records)
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    from rich.console import Console

    from memplan.report.monitor import render_monitor_summary

    Console().print(render_monitor_summary(result))
    typer.echo(f"worst rank: {result['worst_rank']} (by {result['worst_by']}; marked *)")
