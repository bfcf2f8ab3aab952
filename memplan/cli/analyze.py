"""``memplan analyze-trace``: communication, overlap and stragglers from profiler traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from memplan.cli.options import Json
from memplan.measure.stragglers import STRAGGLER_PCT
from memplan.report.versioned import dumps

Paths = Annotated[list[Path], typer.Argument(
    help="One chrome trace per rank (.json or .json.gz from torch.profiler), or a folder of "
    "them (as Holistic Trace Analysis takes).")]
StragglerPct = Annotated[float, typer.Option(
    "--straggler-pct", min=0.0, max=100.0,
    help="Name a rank a straggler when, in at least three profiled steps of four, the other "
    "ranks' exposed wait in collectives exceeds its own by this percentage of the step.")]


PlotPath = Annotated[Path | None, typer.Option(
    "--plot", help="Also draw each rank's compute, exposed communication and idle over time, "
    "stragglers marked, to this .png or .svg file (needs matplotlib).")]


def analyze_trace(paths: Paths, straggler_pct: StragglerPct = STRAGGLER_PCT,
                  plot: PlotPath = None, json_out: Json = False) -> None:
    """Communication time by collective, its overlap with compute, exposed communication per
    step, and stragglers across ranks. Offline: torch is not needed.

    Time inside the profiled steps (ProfilerStep#N) splits into compute, exposed
    communication, exposed copies and idle, each a union of intervals (overlaps counted once).
    Across ranks: each rank's exposed wait (the waiting part of its collectives, concurrent
    calls counted once, less the time it computed) and the ranks the others waited for.

    Examples:

      memplan analyze-trace traces/rank0.json traces/rank1.json

      memplan analyze-trace run/*.pt.trace.json.gz --json

      memplan analyze-trace run/traces/

      memplan analyze-trace traces/rank*.json.gz --plot traces.png
    """
    from memplan.measure.profiler_traces import analyze_traces, load_all

    if plot is not None:  # the plot's name is checked before the traces are read
        from memplan.report.plot import check_path

        check_path(plot)
    traces = load_all(paths)
    result = analyze_traces(traces, straggler_pct)
    if plot is not None:
        from memplan.report.plot_trace import plot_traces

        drawn = plot_traces(traces, plot, across=result.get("across_ranks"))
        result["plot"] = None if drawn is None else str(drawn)
    from memplan.cli import warn

    for note in result["partial"]:
        warn(note)

    if json_out:
        typer.echo(dumps("analyze-trace", result))
        return
    _print(result)


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}"


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    split = Table(title="time in profiled steps, ms (union of intervals)",
                  caption="comm*, copy*: exposed (not under compute); ovl: overlapped")
    for col in ("rank", "steps", "window", "compute", "comm*", "copy*", "idle", "comm",
                "ovl %"):
        split.add_column(col, justify="right")
    colls = Table(title="communication by collective, ms")
    for col in ("rank", "collective", "calls", "time", "exposed"):
        colls.add_column(col, justify="left" if col == "collective" else "right")
    steps = Table(title="exposed communication per step, ms")
    for col in ("rank", "step", "duration", "compute", "comm", "exposed comm"):
        steps.add_column(col, justify="right")
    for r in result["ranks"]:
        s = r["split_us"]
        frac = r["overlap_fraction"]
        split.add_row(f"{r['rank']} {r['device']}", str(r["num_steps"]), _ms(r["window_us"]),
                      _ms(s["compute"]), _ms(s["exposed_comm"]), _ms(s["exposed_copies"]),
                      _ms(s["idle"]), _ms(r["comm_us"]),
                      "" if frac is None else f"{100 * frac:.1f}")
        for name, c in r["collectives"].items():
            colls.add_row(str(r["rank"]), name, str(c["count"]), _ms(c["time_us"]),
                          _ms(c["exposed_us"]))
        for st in r["steps"]:
            steps.add_row(str(r["rank"]), str(st["step"]), _ms(st["duration_us"]),
                          _ms(st["compute_us"]), _ms(st["comm_us"]), _ms(st["exposed_comm_us"]))
    console.print(split)
    console.print(colls)
    console.print(steps)
    across = result.get("across_ranks")
    if across is None:
        return
    waits = ", ".join(f"rank {k}: {_ms(v)} ms ({across['exposed_wait_pct'][k]:.1f}%)"
                      for k, v in across["exposed_wait_us"].items())
    console.print(f"exposed wait in {across['matched_collective_calls']} matched collective "
                  f"calls (waiting not hidden under compute): {waits}")
    late, steps = across["late_steps"], across["num_steps"]
    for rank in across["stragglers"]:
        console.print(f"[bold yellow]straggler:[/] rank {rank}: the other ranks waited for it "
                      f"over {across['threshold_pct']:g}% of the step in {late[rank]} of "
                      f"{steps} steps (median {across['late_pct_median'][rank]:.1f}%)")
    if not across["stragglers"]:
        worst = across["waited_for_rank"]
        console.print(f"no straggler: no rank was waited for over {across['threshold_pct']:g}% "
                      "of the step in three steps of four"
                      + ("" if worst is None else
                         f" (most: rank {worst}, in {late[worst]} of {steps} steps)"))
