"""Is memory growing? A robust trend of per-step bytes, and the leak rule built on it.

torch-free and pure; ``memplan.monitor`` applies it to the last ``window`` steps while a job
runs, ``memplan.diagnose.monitored`` to the records a job left.

The trend is the Theil-Sen slope (the median of the slopes between every pair of steps; Sen
1968, JASA 63:1379): bytes per step, unmoved by a minority of outlying steps, so a leak that
adds memory only every second or third step still has its true slope. Growth is that slope
times the steps the window spans.

A periodic sawtooth (gradient accumulation, a cache refilled and dropped, the garbage
collector) has a Theil-Sen slope too when the window holds few of its periods, and a single
step up (a buffer built once, a warm-up) moves it as well. Neither is a leak: a leak raises
the floor of the memory, again and again. So the window is cut in thirds and the leak rule
asks, besides the growth, that the floor (the least bytes) of each third be above the one
before by a sixth of that growth or more (half of what a steady leak gives): a sawtooth
whose period is under a third of the window touches the same floor in at least two thirds,
and a single step up raises it once, not twice. And the growth must be ``SPREAD_FACTOR``
times the spread of the steps around the trend line (their median absolute deviation) or
more, so noise and a sawtooth of large amplitude, which tilt a short window's line by
chance, do not pass for a leak; a staircase leak sits close to its line.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

# The fewest steps a trend is judged on: a floor per third needs two steps in each.
MIN_STEPS = 6
# How many times the spread around the line a leak's growth must be (see the docstring): a
# staircase of +60 MiB every 2nd or 3rd step spreads 15-20 MiB around its line and grows
# 600 MiB in 30 steps; a sawtooth of amplitude A spreads about A/4.
SPREAD_FACTOR = 3


@dataclass(frozen=True)
class Trend:
    """The trend of one series (e.g. ``allocated_bytes``) over steps ``first_step`` to
    ``last_step`` (``num_steps`` of them): bytes per step, growth over the span, the spread of
    the steps around the line, the floor of each third of the window, and whether the leak
    rule holds."""

    series: str
    first_step: int
    last_step: int
    num_steps: int
    slope_bytes_per_step: float
    growth_bytes: int
    spread_bytes: int
    floor_bytes: tuple[int, int, int]
    leak: bool

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["floor_bytes"] = list(self.floor_bytes)
        return out


def theil_sen(steps: Sequence[int], values: Sequence[float]) -> float:
    """The median of the pairwise slopes (value units per step); 0 with fewer than two steps."""
    slopes = [(values[j] - values[i]) / (steps[j] - steps[i])
              for i in range(len(steps)) for j in range(i + 1, len(steps))
              if steps[j] != steps[i]]
    return statistics.median(slopes) if slopes else 0.0


def floors(values: Sequence[int]) -> tuple[int, int, int]:
    """The least value in each third of ``values`` (the last third takes the remainder)."""
    n = len(values) // 3
    return min(values[:n]), min(values[n:2 * n]), min(values[2 * n:])


def trend(series: str, steps: Sequence[int], values: Sequence[int],
          min_growth_bytes: int) -> Trend | None:
    """The trend of ``values`` over ``steps``; ``leak`` when its growth reaches
    ``min_growth_bytes`` and ``SPREAD_FACTOR`` times its spread, and the floor rose in both
    later thirds by a sixth of it (see the module docstring).
    None with fewer than ``MIN_STEPS`` steps."""
    if len(values) < MIN_STEPS:
        return None
    low = floors(values)
    rises = (low[1] - low[0], low[2] - low[1])
    slope = theil_sen(steps, values)
    growth = round(slope * (steps[-1] - steps[0]))
    off = [v - slope * (s - steps[0]) for s, v in zip(steps, values, strict=True)]
    middle = statistics.median(off)
    spread = round(statistics.median(abs(r - middle) for r in off))
    leak = (growth >= min_growth_bytes and growth >= SPREAD_FACTOR * spread
            and min(rises) * 6 >= growth)
    return Trend(series, steps[0], steps[-1], len(values), slope, growth, spread, low, leak)


__all__ = ["MIN_STEPS", "SPREAD_FACTOR", "Trend", "floors", "theil_sen", "trend"]
