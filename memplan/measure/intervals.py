"""Time intervals as sorted, disjoint ``(start, end)`` lists: union, intersection, difference.

Used to split a profiler trace's time into compute, communication, copies and idle without
counting overlapping work twice. Pure and unit-free (the caller's unit, microseconds in
chrome traces). Empty and zero-length intervals are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge overlapping or touching intervals; sorted, disjoint, non-empty."""
    out: list[Interval] = []
    for lo, hi in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """Total time covered (overlaps counted once)."""
    return sum(hi - lo for lo, hi in union(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Time covered by both ``a`` and ``b``."""
    ua, ub = union(a), union(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if hi > lo:
            out.append((lo, hi))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Time covered by ``a`` and not by ``b``."""
    out: list[Interval] = []
    ub = union(b)
    j = 0
    for lo, hi in union(a):
        while j < len(ub) and ub[j][1] <= lo:  # b intervals wholly before this one
            j += 1
        cur, k = lo, j
        while k < len(ub) and ub[k][0] < hi:
            if ub[k][0] > cur:
                out.append((cur, ub[k][0]))
            cur = max(cur, ub[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def clip(a: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    """The part of ``a`` inside ``[lo, hi]``."""
    return intersect(a, [(lo, hi)])


__all__ = ["Interval", "clip", "intersect", "length", "subtract", "union"]
