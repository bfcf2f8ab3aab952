"""The leak windows of ``MemoryMonitor``: each memory series at three time scales, bounded.

torch-free. Scale 1 holds the last ``window`` steps; scales 8 and 64 hold the floors (least
bytes) of the last ``window`` blocks of 8 and 64 steps, so together they span 30, 240 and
1,920 steps with the default window in 3 x 30 points per series. A block's floor drops what
rises and falls inside the block (a sawtooth shorter than the block), and a slow leak that
adds too little in 30 steps to reach the threshold adds enough over 240 or 1,920.

A scale is judged (``memplan.monitor.trend.trend``) once it holds half its window, each time a point
is added; the floors are checked first, as they are cheap and a leak needs both to rise.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from memplan.monitor.trend import MIN_STEPS, Trend, floors, trend
from memplan.units import MiB

# The defaults of MemoryMonitor's leak rule: 30 steps tolerate a sawtooth of period up to 24
# steps (tests/unit/test_monitor_rules.py); 64 MiB over the window is under any leak that
# threatens a job and above the step-to-step noise of a process's resident set.
LEAK_WINDOW = 30
LEAK_BYTES = 64 * MiB

# The series a leak is looked for in: the CUDA allocator's, the tracker's tensors, the
# process's resident set.
LEAK_SERIES = ("allocated_bytes", "tensor_bytes", "rss_bytes")
SCALES = (1, 8, 64)


class _Scale:
    """The last ``window`` points of one series, each the floor of ``block`` steps."""

    def __init__(self, block: int, window: int) -> None:
        self.block = block
        self.points: deque[tuple[int, int]] = deque(maxlen=window)
        self.low: int | None = None
        self.count = 0

    def add(self, step: int, value: int) -> bool:
        """Add one step; True when it completed a block (a new point)."""
        self.low = value if self.low is None else min(self.low, value)
        self.count += 1
        if self.count < self.block:
            return False
        self.points.append((step, self.low))
        self.low, self.count = None, 0
        return True


class LeakWindows:
    """Every series' scales; ``add`` judges those a record completes."""

    def __init__(self, window: int, min_growth_bytes: int) -> None:
        self.window, self.min_growth_bytes = window, min_growth_bytes
        self._scales: dict[str, list[_Scale]] = {}
        self._latest: dict[str, Trend] = {}

    def add(self, rec: dict[str, Any]) -> list[Trend]:
        """The leaks found at this record: at most one per series (its finest scale)."""
        found = []
        for series in LEAK_SERIES:
            value = rec.get(series)
            if type(value) is not int:
                continue
            scales = self._scales.setdefault(
                series, [_Scale(b, self.window) for b in SCALES])
            for scale in scales:
                if not scale.add(rec["step"], value):
                    continue
                t = self._judge(series, scale)
                if t is not None and t.leak:
                    found.append(t)
                    break
        return found

    def _judge(self, series: str, scale: _Scale) -> Trend | None:
        if len(scale.points) < max(MIN_STEPS, self.window // 2):
            return None
        values = [v for _, v in scale.points]
        low = floors(values)
        # not a leak unless both later floors rose by a sixth of the threshold: skip the slope,
        # except now and then at scale 1 to keep the latest trend current
        rises_enough = min(low[1] - low[0], low[2] - low[1]) * 6 >= self.min_growth_bytes
        fresh = scale.block == 1 and (series not in self._latest
                                      or scale.points[-1][0] - self._latest[series].last_step
                                      >= self.window)
        if not rises_enough and not fresh:
            return None
        t = trend(series, [s for s, _ in scale.points], values, self.min_growth_bytes)
        if t is not None and scale.block == 1:
            self._latest[series] = t
        return t

    def latest(self) -> dict[str, Trend]:
        """The latest trend judged at scale 1 of each series."""
        return dict(self._latest)


__all__ = ["LEAK_BYTES", "LEAK_SERIES", "LEAK_WINDOW", "SCALES", "LeakWindows"]
