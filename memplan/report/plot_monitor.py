"""A plot of ``MemoryMonitor`` runs: memory and headroom per step, one line per rank.

Top: each rank's memory per step: the step's allocated peak on CUDA (``peak_bytes``), else its
tensor peak under the tracker, else its resident set; allocated at step end dashed where there
is a peak; the device capacity as a line when the memory reaches a quarter of it (else its
size is in the title: a host's memory dwarfs one process). Bottom: each rank's headroom per step (what the
monitor derives on CUDA, the host memory or cgroup limit left on CPU). A red cross marks the
first step of each run of steps with a leak warning, with the step named; a black one a step
where the monitor stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memplan.report.plot import figure
from memplan.report.sizes import axis_unit, format_gib

# the series drawn on top, the first a rank's records hold
MEMORY_SERIES = (("peak_bytes", "allocated peak"), ("tensor_peak_bytes", "tensor peak"),
                 ("rss_bytes", "resident set"))


def _series(recs: list[dict[str, Any]]) -> tuple[str, str] | None:
    for key, label in MEMORY_SERIES:
        if any(key in r for r in recs):
            return key, label
    return None


def plot_monitor(records: dict[int, list[dict[str, Any]]], path: Path) -> Path:
    """Write ``path`` (PNG or SVG) for each rank's records (``{rank: [record, ...]}``)."""
    every = [r for recs in records.values() for r in recs]
    top = max([r.get(k, 0) for r in every for k, _ in MEMORY_SERIES]
              + [r.get("headroom_bytes", 0) for r in every] + [1])
    unit, label = axis_unit(top)
    # the headroom panel only where a record has headroom (a capacity was known): else the
    # memory panel takes the whole figure
    has_room = any("headroom_bytes" in r for r in every)
    with figure(path, figsize=(12, 6.5 if has_room else 4.5)) as fig:
        if has_room:
            mem, room = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
        else:
            mem, room = fig.subplots(1, 1), None
        colours = [f"C{k % 10}" for k in range(len(records))]
        shown: set[str] = set()
        for colour, (rank, recs) in zip(colours, sorted(records.items()), strict=True):
            recs = sorted(recs, key=lambda r: r["step"])
            found = _series(recs)
            if found is not None:
                _memory(mem, rank, recs, found, colour, unit, shown)
            rooms = [(r["step"], r["headroom_bytes"] / unit) for r in recs if "headroom_bytes" in r]
            if rooms and room is not None:
                room.plot(*zip(*rooms, strict=True), color=colour, lw=1.2, label=f"rank {rank}")
            _crosses(mem, recs, found, unit, shown)
        caps = {r["capacity_bytes"] for r in every if "capacity_bytes" in r}
        drawn = max([r.get(k, 0) for r in every for k, _ in MEMORY_SERIES] + [0])
        cap = caps.pop() if len(caps) == 1 else None
        if cap is not None and drawn >= cap / 4:
            mem.axhline(cap / unit, color="black", ls="--", lw=1, label="capacity")
        mem.set_ylabel(label)
        mem.set_ylim(0, None)
        if room is not None:
            room.set_ylabel(f"headroom ({label})")
            room.set_ylim(0, None)
        (room if room is not None else mem).set_xlabel("training step")
        title = (f"memory monitor: {len(records)} rank{'s' if len(records) > 1 else ''}, "
                 f"{max((len(v) for v in records.values()), default=0)} steps")
        if cap is not None and drawn < cap / 4:
            title += f" (capacity {format_gib(cap)}, off the scale)"
        mem.set_title(title, fontsize=10)
        for ax in (mem, room):  # records without headroom draw nothing there to name
            if ax is not None and ax.get_legend_handles_labels()[0]:
                ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                          frameon=False)
    return path


def _memory(ax: Any, rank: int, recs: list[dict[str, Any]], found: tuple[str, str],
            colour: str, unit: int, shown: set[str]) -> None:
    key, what = found
    pts = [(r["step"], r[key] / unit) for r in recs if key in r]
    ax.plot(*zip(*pts, strict=True), color=colour, lw=1.4, label=f"rank {rank}: {what}")
    if key == "peak_bytes":
        ends = [(r["step"], r["allocated_bytes"] / unit) for r in recs if "allocated_bytes" in r]
        if ends:
            ax.plot(*zip(*ends, strict=True), color=colour, lw=1, ls="--")
            if "end" not in shown:  # one legend entry for every rank's dashed line
                ax.plot([], [], color="#555555", lw=1, ls="--", label="allocated at step end")
            shown.add("end")


def _crosses(ax: Any, recs: list[dict[str, Any]], found: tuple[str, str] | None, unit: int,
             shown: set[str]) -> None:
    key = found[0] if found is not None else None
    leaking, named = False, False
    for r in recs:
        y = r.get(key, 0) / unit if key else 0
        leak = any("possible leak" in w for w in r.get("warnings", []))
        if leak and not leaking:
            ax.plot([r["step"]], [y], marker="x", color="#c00000", ms=8, mew=2, ls="none",
                    label="leak warned from this step" if "leak" not in shown else None)
            if not named:  # the first warning of the rank is named; later runs only marked
                ax.annotate(f"leak warned: rank {r['rank']}, step {r['step']}", (r["step"], y),
                            xytext=(0, 10), textcoords="offset points", ha="center",
                            fontsize=7, color="#c00000")
                named = True
            shown.add("leak")
        leaking = leak
        if "monitor_stopped" in r:
            ax.plot([r["step"]], [y], marker="X", color="black", ms=8, ls="none",
                    label="monitor stopped" if "stop" not in shown else None)
            shown.add("stop")


__all__ = ["plot_monitor"]
