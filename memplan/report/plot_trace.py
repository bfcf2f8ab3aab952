"""A plot of profiler traces: per rank, compute, exposed communication and idle over time.

One row per rank, on each rank's own time since its first profiled step (milliseconds; the
ranks of different hosts share no clock). Within the analysed steps the time splits as in
``memplan.measure.profiler_traces.analyze``: compute; exposed communication (not under
compute), of which the exposed wait (``memplan.measure.stragglers``: waiting for a later rank) is
hatched; exposed copies; idle (the white). Step boundaries are ticks; stragglers are named in red
with their lateness, and each rank's exposed wait is written at the end of its row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memplan.measure.intervals import Interval, intersect, subtract, union
from memplan.measure.profiler_traces import window
from memplan.measure.stragglers import waiting_intervals
from memplan.measure.trace_files import RankTrace
from memplan.report.plot import figure

COLOURS = {"compute": "#4c72b0", "exposed communication": "#dd8452",
           "exposed copies": "#8172b3"}
WAIT = "#c44e52"


def _rows(rt: RankTrace, waits: list[Interval]) -> dict[str, list[Interval]]:
    w = window(rt)
    c = intersect(rt.compute, w)
    m = intersect([(lo, hi) for _, lo, hi in rt.comm], w)
    return {"compute": c, "exposed communication": subtract(m, c),
            "exposed copies": subtract(intersect(rt.copies, w), c + m),
            "exposed wait": subtract(intersect(union(waits), w), c)}


def plot_traces(traces: list[RankTrace], path: Path, *,
                across: dict[str, Any] | None = None) -> Path:
    """Write ``path`` (PNG or SVG); ``across``:
    ``memplan.measure.stragglers.stragglers`` of the same traces (stragglers and waits named)."""
    waits, _ = waiting_intervals(traces) if len(traces) > 1 else ({}, 0)
    named = set((across or {}).get("stragglers", []))
    order = sorted(traces, key=lambda rt: rt.rank)
    with figure(path, figsize=(12, 1.1 + 0.55 * len(order))) as fig:
        ax = fig.add_subplot()
        labels, end = [], 0.0
        for row, rt in enumerate(order):
            w = window(rt)
            if not w:
                continue
            t0 = w[0][0]
            parts = _rows(rt, waits.get(rt.rank, []))
            for kind, colour in COLOURS.items():
                ax.broken_barh([((lo - t0) / 1000, (hi - lo) / 1000) for lo, hi in parts[kind]],
                               (row - 0.38, 0.76), color=colour, lw=0,
                               label=kind if row == 0 else None)
            ax.broken_barh([((lo - t0) / 1000, (hi - lo) / 1000)
                            for lo, hi in parts["exposed wait"]], (row - 0.38, 0.76),
                           facecolor="none", edgecolor=WAIT, hatch="////", lw=0,
                           label="of which waiting for a later rank" if row == 0 else None)
            for _, lo, _hi in rt.steps:
                ax.plot([(lo - t0) / 1000] * 2, [row - 0.48, row + 0.48], color="black", lw=0.8)
            end = max(end, (w[-1][1] - t0) / 1000)
            labels.append(_label(rt, across, named))
        _finish(ax, fig, order, labels, end, across)
    return path


def _label(rt: RankTrace, across: dict[str, Any] | None, named: set[int]) -> str:
    if rt.rank in named and across is not None:
        late = across["late_pct_median"][rt.rank]
        return f"rank {rt.rank}: straggler\n(late {late:.0f}% of the step)"
    return f"rank {rt.rank}"


def _finish(ax: Any, fig: Any, order: list[RankTrace], labels: list[str], end: float,
            across: dict[str, Any] | None) -> None:
    ax.set_yticks(range(len(order)), labels)
    named = set((across or {}).get("stragglers", []))
    for tick, rt in zip(ax.get_yticklabels(), order, strict=False):
        if rt.rank in named:
            tick.set_color("#c00000")
            tick.set_fontweight("bold")
    if across is not None:
        for row, rt in enumerate(order):
            wait = across["exposed_wait_us"].get(rt.rank, 0.0) / 1000
            pct = across["exposed_wait_pct"].get(rt.rank, 0.0)
            ax.text(end * 1.01, row, f"exposed wait\n{wait:.1f} ms ({pct:.0f}%)", va="center",
                    fontsize=7)
    ax.set_xlim(0, end * 1.12 if across is not None else end)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlabel("time since the rank's first profiled step (ms); ticks: step starts; "
                  "white: idle")
    device = order[0].device if order else "cpu"
    title = f"{len(order)} ranks, {'GPU' if device == 'gpu' else 'CPU (gloo)'} traces"
    if across is not None:
        title += (": no straggler" if not named else
                  f": straggler{'s' if len(named) > 1 else ''} "
                  f"{', '.join(f'rank {r}' for r in sorted(named))}")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


__all__ = ["plot_traces"]
