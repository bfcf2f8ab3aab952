"""``memplan monitor-summary``: every rank's MemoryMonitor records as one table (GiB)."""

from __future__ import annotations

from typing import Any

from memplan.report.sizes import gib


def render_monitor_summary(result: dict[str, Any]) -> Any:
    """One row per rank of ``memplan.monitor.summarize``'s result (sizes in GiB, step time in
    s); the worst rank marked *."""
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
    return table
