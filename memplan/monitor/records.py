"""``MemoryMonitor``'s records read back: every rank's JSONL, reduced to one summary per rank.

torch-free. ``summarize`` gives per rank the largest peak, reserved and fragmentation, the
smallest headroom, retries and OOMs, the median step time, warnings, each memory series'
trend over the run (``run_trend``, the monitor's leak rule) and the steps it warned of a leak;
and the worst rank. ``memplan monitor-summary`` and ``diagnose --monitor`` read through it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.inputs import MONITOR_BYTES, checked, read_text, too_long_number
from memplan.monitor.trend import Trend, trend
from memplan.monitor.window import LEAK_BYTES, LEAK_SERIES


def read_records(paths: list[str | Path]) -> list[dict[str, Any]]:
    """Every record of the given JSONL files or directories (``memory_rank*.jsonl`` in them)."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("memory_rank*.jsonl")) if p.is_dir() else [p]
    out = []
    for f in files:
        text = read_text(f, "monitor records", MONITOR_BYTES)
        for num, line in enumerate(text.splitlines(), 1):
            if line.strip():
                out.append(_record(line, f, num))
    return out


def _record(line: str, f: Path, num: int) -> Any:
    """One JSONL line as data, or one line naming the file and line that is not JSON."""
    try:
        return checked(json.loads(line), f"{f} line {num}", "monitor records")
    except MemplanError:
        raise
    except json.JSONDecodeError as err:
        raise MemplanError(f"monitor records: {f} line {num} is not JSON ({err.msg}, column "
                           f"{err.colno})") from None
    except RecursionError:
        raise MemplanError(f"monitor records: {f} line {num} nests too deep") from None
    except ValueError:  # an integer over Python's digit limit
        raise too_long_number(f"{f} line {num}", "monitor records") from None


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return (v[n // 2] + v[(n - 1) // 2]) / 2 if n else 0.0


# the most points a whole run's trend is judged on: longer runs are cut into this many blocks
# and each block's floor (least bytes) is a point, as the monitor's coarser windows do
RUN_TREND_POINTS = 90


def run_trend(series: str, recs: list[dict[str, Any]],
              min_growth_bytes: int = LEAK_BYTES) -> Trend | None:
    """The trend of ``series`` over a rank's run (``memplan.monitor.trend``), on block floors when
    the run is longer than ``RUN_TREND_POINTS`` steps: over the whole run, or, when that is no
    leak, over the longest of its last half, quarter and eighth that is (a leak that began
    late in the run raises the floor in its own thirds only)."""
    rows = [(r["step"], r[series]) for r in recs if type(r.get(series)) is int]
    whole = _trend_of(series, rows, min_growth_bytes)
    if whole is None or whole.leak:
        return whole
    for part in (2, 4, 8):
        late = _trend_of(series, rows[len(rows) - len(rows) // part:], min_growth_bytes)
        if late is not None and late.leak:
            return late
    return whole


def _trend_of(series: str, rows: list[tuple[int, int]], min_growth_bytes: int) -> Trend | None:
    size = max(1, math.ceil(len(rows) / RUN_TREND_POINTS))
    blocks = [rows[i:i + size] for i in range(0, len(rows), size)]
    points = [(b[-1][0], min(v for _, v in b)) for b in blocks]
    return trend(series, [s for s, _ in points], [v for _, v in points], min_growth_bytes)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank: the largest peak, reserved and fragmentation, the smallest headroom, retries
    and OOMs (cumulative counters: the last value), median step time, warnings, the trend of
    each memory series over the run (``run_trend``) and the steps with a leak warning; and the
    worst rank, the one with the largest allocated peak (else tensor peak, else resident set;
    the slowest median step when no bytes were read)."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_rank.setdefault(int(r["rank"]), []).append(r)
    ranks = {}
    for rank, recs in sorted(by_rank.items()):
        recs.sort(key=lambda r: r["step"])
        row: dict[str, Any] = {"num_steps": len(recs),
                               "median_step_time_s": _median([r["step_time_s"] for r in recs]),
                               "num_warnings": sum(len(r.get("warnings", [])) for r in recs)}
        for key in ("peak_bytes", "reserved_bytes", "fragmentation_bytes",
                    "inactive_split_bytes", "rss_bytes", "tensor_bytes", "tensor_peak_bytes"):
            vals = [r[key] for r in recs if key in r]
            if vals:
                row[f"max_{key}"] = max(vals)
        rooms = [r["headroom_bytes"] for r in recs if "headroom_bytes" in r]
        if rooms:
            row["min_headroom_bytes"] = min(rooms)
        for key in ("alloc_retries", "num_ooms"):
            if key in recs[-1]:
                row[key] = recs[-1][key]
        trends = {s: t.as_dict() for s in LEAK_SERIES if (t := run_trend(s, recs)) is not None}
        if trends:
            row["trend"] = trends
        warned = [r["step"] for r in recs
                  if any("possible leak" in w for w in r.get("warnings", []))]
        if warned:
            row["leak_warnings"] = {"num_steps": len(warned), "first_step": warned[0]}
        ranks[rank] = row
    if not ranks:
        return {"ranks": {}, "worst_rank": None}
    # the largest allocated peak, else tensor peak, else resident set every rank recorded
    key = next((k for k in ("max_peak_bytes", "max_tensor_peak_bytes", "max_rss_bytes")
                if all(k in r for r in ranks.values())), "median_step_time_s")
    worst = max(ranks, key=lambda k: ranks[k][key])
    return {"ranks": ranks, "worst_rank": worst, "worst_by": key, "worst": ranks[worst]}


__all__ = ["RUN_TREND_POINTS", "read_records", "run_trend", "summarize"]
