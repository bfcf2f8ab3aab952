"""``memplan analyze-trace``: communication, overlap and stragglers from profiler traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from memplan.cli.options import ESTIMATE, Job, Json, uses
from memplan.measure.stragglers import STRAGGLER_PCT
from memplan.report.versioned import dumps

Paths = Annotated[list[Path] | None, typer.Argument(
    help="One chrome trace per rank (.json or .json.gz from torch.profiler), or a folder of "
    "them (as Holistic Trace Analysis takes): every trace file in it.")]
Snapshot = Annotated[Path | None, typer.Option(
    "--snapshot", help="A torch.cuda.memory._dump_snapshot pickle recorded with "
    "_record_memory_history: its memory timeline by phase (needs --trust-pickle).")]
TrustPickle = Annotated[bool, typer.Option(
    "--trust-pickle", help="Load --snapshot: a pickle can run code, so only for your own file.")]
StragglerPct = Annotated[float, typer.Option(
    "--straggler-pct", min=0.0, max=100.0,
    help="Name a rank a straggler when, in at least three profiled steps of four, the other "
    "ranks' exposed wait in collectives exceeds its own by this percentage of the step.")]


PlotPath = Annotated[Path | None, typer.Option(
    "--plot", help="Also draw each rank's compute, exposed communication and idle over time, "
    "stragglers marked, to this .png or .svg file (needs matplotlib).")]


@uses(*ESTIMATE, model=None)
def analyze_trace(job: Job, paths: Paths = None, straggler_pct: StragglerPct = STRAGGLER_PCT,
                  plot: PlotPath = None, snapshot: Snapshot = None,
                  trust_pickle: TrustPickle = False, json_out: Json = False) -> None:
    """Communication time by collective, its overlap with compute, exposed communication per
    step, and stragglers across ranks; memory over time by phase from traces made with
    profile_memory=True and from a memory snapshot. Offline: torch is not needed.

    Memory: each memory instant event of a trace (allocated and reserved bytes after it) is given
    its step (ProfilerStep#N) and phase (forward until the first autograd operator, backward
    to the last, the optimizer step inside "Optimizer.step#...", else other); a snapshot's
    allocator trace is phased by the frames of each action. With --model (and the layout
    options of `memplan estimate`) each phase's measured peak is shown beside the estimate's
    tensor bytes for it.

    Time inside the profiled steps (ProfilerStep#N) splits into compute, exposed
    communication, exposed copies and idle, each a union of intervals (overlaps counted once).
    Across ranks: each rank's exposed wait (the waiting part of its collectives, concurrent
    calls counted once, less the time it computed) and the ranks the others waited for.

    Examples:

      memplan analyze-trace traces/rank0.json traces/rank1.json

      memplan analyze-trace run/*.pt.trace.json.gz --json

      memplan analyze-trace run/traces/

      memplan analyze-trace traces/rank*.json.gz --plot traces.png

      memplan analyze-trace prof/ -m llama-2-7b -n 8 --zero 1

      memplan analyze-trace --snapshot snap.pickle --trust-pickle -m llama-2-7b -n 8
    """
    from memplan.errors import MemplanError
    from memplan.measure.profiler_traces import analyze_traces, load_all, trace_paths

    if not paths and snapshot is None:
        raise MemplanError("analyze-trace: no paths given: give trace files, a folder of them, "
                            "or --snapshot")
    if plot is not None:  # the plot's name is checked before the traces are read
        from memplan.report.plot import check_path

        check_path(plot)
    data = None
    if snapshot is not None:  # refused before any work without --trust-pickle
        from memplan.diagnose.snapshot import load_snapshot

        data = load_snapshot(str(snapshot), trust_pickle=trust_pickle)
    files = trace_paths(list(paths)) if paths else []
    traces = load_all(files) if files else []
    result = analyze_traces(traces, straggler_pct) if traces else {
        "unit": "microseconds (chrome trace ts/dur)", "ranks": [], "partial": []}
    memory = _memory(job, files, data, str(snapshot))
    if memory:
        result["memory"] = memory
    if plot is not None and traces:
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


def _memory(job: Job, files: list[Path], snapshot: Any, where: str) -> list[dict[str, Any]]:
    """The memory timelines of the traces with "[memory]" events and of the snapshot, as
    JSON, each beside the estimate when a model is given."""
    from memplan.measure.memory_timeline import (
        profiler_timelines,
        snapshot_timelines,
        timeline_json,
    )

    timelines = [tl for p in files for tl in profiler_timelines(str(p))]
    if snapshot is not None:
        timelines += snapshot_timelines(snapshot, where)
    est = None
    if timelines and job.model is not None:
        from memplan.api import estimate

        est = estimate(job.model, **job.kwargs())
    return [timeline_json(tl, est) for tl in timelines]


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}"


def _print_memory(console: Any, memory: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from memplan.report.sizes import size

    for tl in memory:
        versus = {(r["step"], r["phase"]): r for r in tl.get("versus_estimate", [])}
        table = Table(title=f"memory by phase, {tl['device']}: {tl['path']}",
                      caption="; ".join([tl["source"], *tl["notes"]]))
        for col in ("step", "phase", "events", "peak allocated", "peak reserved",
                    *(("estimate (tensors)", "diff") if "versus_estimate" in tl else ())):
            table.add_column(col, justify="left" if col == "phase" else "right")
        for r in tl["phases"]:
            row = [str(r["step"]), r["phase"], str(r["events"]),
                   size(r["peak_allocated_bytes"]),
                   "" if r["peak_reserved_bytes"] is None else
                   size(r["peak_reserved_bytes"])]
            if "versus_estimate" in tl:
                v = versus.get((r["step"], r["phase"]))
                row += ["", ""] if v is None else [size(v["estimated_bytes"]),
                                                   size(v["diff_bytes"])]
            table.add_row(*row)
        console.print(table)


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if result.get("memory"):
        _print_memory(console, result["memory"])
    if not result["ranks"]:
        return
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
