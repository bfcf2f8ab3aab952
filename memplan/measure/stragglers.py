"""Stragglers across ranks: who waited in collectives, for whom, and how much of it was exposed.

torch-free; reads ``memplan.measure.trace_files.RankTrace`` and each rank's analysed window
(the union of its profiled steps, ``memplan.measure.profiler_traces.window``); times in
microseconds.

Waiting. A collective cannot finish before its last rank arrives, so a rank that arrives early
waits. The i-th call of each collective is matched on every rank; on the rank that arrived
last the call lasts only its transfer, so a call's duration on a rank minus its shortest
duration on any rank is the time that rank waited, and it waited at the start of the call:
the waiting interval is ``[start, start + duration - shortest]``. This needs no clock shared
between ranks (traces of different hosts have none).

Exposed waiting. DDP's gradient buckets and FSDP's prefetches run several collectives at once,
and most of their waiting is hidden under the backward pass that keeps computing. A rank's
exposed wait is therefore the union of its waiting intervals (concurrent calls counted once)
less its compute, within the analysed steps: the time the rank stood still for another.

Who is late. In each profiled step (``ProfilerStep#N``, matched by number on every rank), a
rank's lateness is how much less exposed wait it had than the median of the other ranks, as a
share of the step: the ranks that arrive last wait least. A rank is a straggler when its
lateness is above ``threshold_pct`` in at least three steps of four (``STRAGGLER_SHARE``; the
median and the lower quartile of its lateness over steps are reported beside it). Equal ranks
on a busy machine take turns being late, as the scheduler holds one process back and then the
other, so none of them is late in most steps; a rank that is slower for a reason is late in
every step. The default, 10% of the step, sits well above the lateness equal ranks have in most
steps and well below a lagging one's, as measured with ``benchmarks/gloo_trace.py`` on a 2-core
machine running other work: with no lag, a lower quartile of at most 0.9% in 18 of 19 runs of 3
or 8 steps (8 of them beside a process spinning on a core), while a single step's lateness went
up to 32%; in the 19th the machine held one rank back in every step (40%, and the aligned
clocks agreed: it was a straggler). A 40 ms lag in ~100 ms steps: 23-28%.
tests/traced/test_stragglers.py checks each verdict against the aligned-clock truth of its run.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from memplan.errors import MemplanError
from memplan.measure.intervals import Interval, intersect, length, subtract, union

if TYPE_CHECKING:
    from memplan.measure.trace_files import RankTrace

# Lateness, as a share of the step, above which a rank is named a straggler, and the share of
# steps it must hold in (the docstring says why); the quantile of lateness reported beside.
STRAGGLER_PCT = 10.0
STRAGGLER_SHARE = 0.75
STRAGGLER_QUANTILE = 0.25


def waiting_intervals(traces: list[RankTrace]) -> tuple[dict[int, list[Interval]], int]:
    """Per rank, the waiting part of each matched collective call (not merged), and the number
    of calls matched per rank."""
    waits: dict[int, list[Interval]] = {rt.rank: [] for rt in traces}
    matched = 0
    for coll in sorted({k for rt in traces for k, _, _ in rt.comm}):
        calls = {rt.rank: sorted((lo, hi) for k, lo, hi in rt.comm if k == coll)
                 for rt in traces}
        n = min(len(v) for v in calls.values())
        matched += n
        for i in range(n):
            shortest = min(v[i][1] - v[i][0] for v in calls.values())
            for rank, v in calls.items():
                lo, hi = v[i]
                if hi - lo > shortest:
                    waits[rank].append((lo, lo + (hi - lo - shortest)))
    return waits, matched


def _steps(traces: list[RankTrace]) -> list[int]:
    """Step numbers profiled on every rank (empty when a trace has no ProfilerStep ranges)."""
    common = set.intersection(*({n for n, _, _ in rt.steps} for rt in traces))
    return sorted(common)


def stragglers(traces: list[RankTrace], windows: dict[int, list[Interval]],
               threshold_pct: float = STRAGGLER_PCT) -> dict[str, Any]:
    """Across ranks: waiting and exposed waiting per rank, per step, and the stragglers.
    ``windows``: each rank's analysed time (``memplan.measure.profiler_traces.window``)."""
    if isinstance(threshold_pct, bool) or not isinstance(threshold_pct, int | float) \
            or not 0 <= threshold_pct < 100:
        raise MemplanError(f"straggler threshold ({threshold_pct!r}) must be a percentage of "
                           "the step from 0 to under 100")
    waits, matched = waiting_intervals(traces)
    exposed: dict[int, list[Interval]] = {}
    summary: dict[str, dict[int, float]] = {"waiting_us": {}, "exposed_wait_us": {},
                                            "window_us": {}, "compute_us": {}}
    for rt in traces:
        w = windows[rt.rank]
        compute = intersect(rt.compute, w)
        mine = intersect(union(waits[rt.rank]), w)
        exposed[rt.rank] = subtract(mine, compute)
        summary["waiting_us"][rt.rank] = length(mine)
        summary["exposed_wait_us"][rt.rank] = length(exposed[rt.rank])
        summary["window_us"][rt.rank] = length(w)
        summary["compute_us"][rt.rank] = length(compute)
    per_step = _per_step(traces, windows, exposed)
    late = {rt.rank: _quantile([s["late_pct"][rt.rank] for s in per_step], 0.5)
            for rt in traces}
    mostly = {rt.rank: _quantile([s["late_pct"][rt.rank] for s in per_step], STRAGGLER_QUANTILE)
              for rt in traces}
    late_steps = {rt.rank: sum(s["late_pct"][rt.rank] > threshold_pct for s in per_step)
                  for rt in traces}
    named = [r for r in sorted(late_steps) if matched and per_step
             and late_steps[r] >= STRAGGLER_SHARE * len(per_step)]
    waited_for = max(late, key=lambda r: (late[r], -summary["exposed_wait_us"][r])) \
        if matched else None
    out: dict[str, Any] = {
        "matched_collective_calls": matched, **summary,
        "exposed_wait_pct": {r: 100.0 * v / summary["window_us"][r] if summary["window_us"][r]
                             else 0.0 for r, v in summary["exposed_wait_us"].items()},
        "late_pct_median": late, "late_pct_lower_quartile": mostly,
        "late_steps": late_steps, "num_steps": len(per_step),
        "waited_for_rank": waited_for, "threshold_pct": threshold_pct,
        "stragglers": named, "steps": per_step,
        "rule": (f"a straggler waited {threshold_pct:g}% of the step less than the median of "
                 "the other ranks in at least three profiled steps of four"),
    }
    out["victims_exposed_wait_us"] = {r: v for r, v in summary["exposed_wait_us"].items()
                                      if named and r not in named}
    return out


def _per_step(traces: list[RankTrace], windows: dict[int, list[Interval]],
              exposed: dict[int, list[Interval]]) -> list[dict[str, Any]]:
    """Each step profiled on every rank (the whole window when there are no steps): every
    rank's exposed wait in it and its lateness, as a percentage of the step's median duration
    over ranks."""
    numbers = _steps(traces)
    spans: list[tuple[int | None, dict[int, list[Interval]]]]
    if numbers:
        spans = [(n, {rt.rank: [(lo, hi) for m, lo, hi in rt.steps if m == n]
                      for rt in traces}) for n in numbers]
    else:
        spans = [(None, windows)]
    out = []
    for n, span in spans:
        waited = {r: length(intersect(exposed[r], span[r])) for r in span}
        duration = statistics.median(length(v) for v in span.values())
        late = {r: statistics.median(v for k, v in waited.items() if k != r) - w
                for r, w in waited.items()}
        out.append({"step": n, "duration_us": duration, "exposed_wait_us": waited,
                    "late_pct": {r: 100.0 * v / duration if duration else 0.0
                                 for r, v in late.items()}})
    return out


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile, linear between the sorted values (numpy's default), 0 when empty."""
    v = sorted(values)
    if not v:
        return 0.0
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


__all__ = ["STRAGGLER_PCT", "STRAGGLER_QUANTILE", "STRAGGLER_SHARE", "stragglers",
           "waiting_intervals"]
