"""A plot of ``MemoryMonitor`` runs: memory and headroom per step, one line per rank.

Top: each rank's memory per step: the step's allocated peak on CUDA (``peak_bytes``), else its
tensor peak under the tracker, else its resident set; allocated at step end dashed where there
is a peak; the device capacity as a line when the memory reaches a quarter of it (else its
size is in the title: a host's memory dwarfs one process). Headroom (what the monitor derives
on CUDA, the host memory or cgroup limit left on CPU) where the records carry it
(``headroom_view``): under the capacity line, the least headroom of the ranks as a shaded band
up to it; with the capacity off the scale, a panel below with each rank's headroom on an axis
scaled to its range (a leak shows there as headroom falling); headroom the same at every
step is said in the title instead. A red cross marks the first step of each run of steps with
a leak warning, with the step named; a black one a step where the monitor stopped.
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


def headroom_view(records: dict[int, list[dict[str, Any]]]) -> str | None:
    """How the headroom is drawn: ``"band"`` under the capacity line when that line is drawn
    (one capacity, the memory reaching a quarter of it), else ``"panel"`` when it changes from
    step to step, ``"title"`` when it is the same at every step, None without headroom."""
    every = [r for recs in records.values() for r in recs]
    rooms = {r["headroom_bytes"] for r in every if "headroom_bytes" in r}
    if not rooms:
        return None
    if _capacity_line(every) is not None:
        return "band"
    return "panel" if len(rooms) > 1 else "title"


def least_headroom(records: dict[int, list[dict[str, Any]]]) -> list[tuple[int, int]]:
    """(step, the least headroom of the ranks at that step), by step: the band's lower edge
    is the capacity minus it."""
    least: dict[int, int] = {}
    for recs in records.values():
        for r in recs:
            if "headroom_bytes" in r:
                least[r["step"]] = min(least.get(r["step"], r["headroom_bytes"]),
                                       r["headroom_bytes"])
    return sorted(least.items())


def _capacity_line(every: list[dict[str, Any]]) -> int | None:
    """The capacity drawn as a line: one capacity, reached to a quarter by the memory."""
    caps = {r["capacity_bytes"] for r in every if "capacity_bytes" in r}
    drawn = max([r.get(k, 0) for r in every for k, _ in MEMORY_SERIES] + [0])
    cap = caps.pop() if len(caps) == 1 else None
    return cap if cap is not None and drawn >= cap / 4 else None


def plot_monitor(records: dict[int, list[dict[str, Any]]], path: Path) -> Path:
    """Write ``path`` (PNG or SVG) for each rank's records (``{rank: [record, ...]}``)."""
    every = [r for recs in records.values() for r in recs]
    view = headroom_view(records)
    top = max([r.get(k, 0) for r in every for k, _ in MEMORY_SERIES]
              + [r.get("headroom_bytes", 0) for r in every if view == "panel"] + [1])
    unit, label = axis_unit(top)
    with figure(path, figsize=(12, 6 if view == "panel" else 4.5)) as fig:
        if view == "panel":
            mem, room = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
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
        cap = _capacity_line(every)
        if cap is not None:
            mem.axhline(cap / unit, color="black", ls="--", lw=1, label="capacity")
            if view == "band":
                _band(mem, records, cap, unit)
        mem.set_ylabel(label)
        mem.set_ylim(0, None)
        if room is not None:
            _room_panel(room, records, unit, label)
        (room if room is not None else mem).set_xlabel("training step")
        mem.set_title(_title(records, every, view), fontsize=10)
        for ax in (mem, room):  # records without headroom draw nothing there to name
            if ax is not None and ax.get_legend_handles_labels()[0]:
                ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                          frameon=False)
    return path


def _title(records: dict[int, list[dict[str, Any]]], every: list[dict[str, Any]],
           view: str | None) -> str:
    title = (f"memory monitor: {len(records)} rank{'s' if len(records) > 1 else ''}, "
             f"{max((len(v) for v in records.values()), default=0)} steps")
    caps = {r["capacity_bytes"] for r in every if "capacity_bytes" in r}
    if len(caps) == 1 and _capacity_line(every) is None:
        title += f" (capacity {format_gib(caps.pop())}, off the scale)"
    if view == "title":
        title += f"; headroom {format_gib(least_headroom(records)[0][1])} at every step"
    return title


def _band(ax: Any, records: dict[int, list[dict[str, Any]]], cap: int, unit: int) -> None:
    """The least headroom of the ranks, shaded from the capacity down, step by step."""
    steps, rooms = zip(*least_headroom(records), strict=True)
    ax.fill_between(steps, [(cap - r) / unit for r in rooms], cap / unit, step="mid",
                    color="#55a868", alpha=0.18, lw=0, label="headroom (least of the ranks)")


def _room_panel(ax: Any, records: dict[int, list[dict[str, Any]]], unit: int,
                label: str) -> None:
    """Each rank's headroom on an axis scaled to its range, the least named where it falls."""
    step, least = min(least_headroom(records), key=lambda p: (p[1], p[0]))
    ax.set_ylabel(f"headroom ({label})")
    ax.margins(y=0.25)  # scaled to the data: a few hundred MiB of a host's GiB stay visible
    ax.annotate(f"least: {format_gib(least)} (step {step})", (step, least / unit),
                xytext=(0, -12), textcoords="offset points", ha="center", fontsize=7)


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


__all__ = ["headroom_view", "least_headroom", "plot_monitor"]
