"""``memplan monitor-summary``: every rank's MemoryMonitor records as one table (GiB)."""

from __future__ import annotations

from typing import Any

from memplan.report.sizes import gib, in_gib, size


def render_monitor_summary(result: dict[str, Any]) -> Any:
    """One row per rank of ``memplan.monitor.summarize``'s result (sizes in GiB, step time in
    s), the worst rank marked *; then each rank's memory trend per series, when it has one."""
    from rich.console import Group
    from rich.table import Table

    table = Table(title="memory monitor: per rank (GiB; step time in s)")
    cols = ("rank", "steps", "peak", "reserved", "frag.", "headroom", "retries", "OOMs",
            "step s", "warnings")
    for col in cols:
        table.add_column(col, justify="right")
    for rank, r in result["ranks"].items():
        def size(key: str, row: dict = r) -> str:
            return gib(row[key]) if key in row else ""
        table.add_row(f"{rank}{' *' if rank == result['worst_rank'] else ''}",
                      str(r["num_steps"]), size("max_peak_bytes"), size("max_reserved_bytes"),
                      size("max_fragmentation_bytes"), size("min_headroom_bytes"),
                      str(r.get("alloc_retries", "")), str(r.get("num_ooms", "")),
                      f"{r['median_step_time_s']:.4f}", str(r["num_warnings"]))
    trends = render_trends(result)
    return table if trends is None else Group(table, trends)


def render_trends(result: dict[str, Any]) -> Any:
    """Per rank and series: the run's robust trend (``memplan.monitor.trend``) in GiB, or None."""
    from rich.table import Table

    from memplan.monitor.window import LEAK_BYTES

    rows = [(rank, series, t) for rank, r in result["ranks"].items()
            for series, t in r.get("trend", {}).items()]
    if not rows:
        return None
    table = Table(title="memory trend per rank (Theil-Sen over the run; GiB)",
                  caption=f"leak: growth of {size(LEAK_BYTES)} or more with the floor rising "
                  "in each third of the run")
    for col in ("rank", "series", "steps", "GiB / 1k steps", "growth", "floors", "leak"):
        table.add_column(col, justify="left" if col == "series" else "right")
    for rank, series, t in rows:
        table.add_row(str(rank), series.removesuffix("_bytes"),
                      f"{t['first_step']}-{t['last_step']}",
                      f"{in_gib(round(1000 * t['slope_bytes_per_step'])):+.3f}",
                      f"{'+' if t['growth_bytes'] >= 0 else ''}{gib(t['growth_bytes'])}",
                      " ".join(gib(f) for f in t["floor_bytes"]),
                      "[bold red]yes[/]" if t["leak"] else "no")
    return table
