"""``--recompute auto``: the save set with the least recompute that fits the budget.

Each item a layer can keep (``memplan.model.sac_ops.Item``) costs its bytes while kept and
its FLOPs when rerun; a save set costs the sum of both. Keeping the most FLOPs within a
number of bytes is a 0/1 knapsack. Its Pareto frontier (no other subset keeps more FLOPs in
no more bytes; the optimum for any byte budget is on it) is built exactly, item by item
(``_exact``), unless it grows past ``MAX_FRONTIER`` sets; then the frontier is the greedy
chain (items by FLOPs per byte, each set the one before it plus the next item), whose sets
are optimal at their own bytes (a fractional knapsack's optimum there is integral): at a
budget between two of them the chosen one reruns at most the next item's FLOPs more than the
optimum (``Choice.gap_flops``).

A stage's peak grows with a set's bytes and its layer's forward peak together, not with its
bytes alone (``choose``), so the frontier, ordered by bytes, is searched for the last set
that fits (the ``fits`` the caller gives: an estimate's peak against its budget), each probe
one estimate: a set that does not fit rules out the later sets whose forward peak is no
lower; where the forward peaks rise with the bytes this is a bisection. Only the items a policy can
name are searched (``POLICY_OPS``: the projections, the attention kernel, the activation,
the gated product, and an upcast RMSNorm's casts, rsqrt and output, an upcast-fp32 one's casts
and rsqrt or rsqrt and x * rstd: ``memplan.model.sac_ops._norm_ops``; other norm tensors come
from ops that differ by implementation, ``NORM`` items, refused when a save list keeps them:
``sac_ops.kept_refusal``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

from memplan.model.sac_ops import NORM, Item

# the exact frontier's largest size before the greedy chain stands in (a dense layer's 17
# items make a few hundred: their bytes take few distinct values)
MAX_FRONTIER = 4096
POLICY_OPS = frozenset({"matmul", "sdpa", "act", "mul", "copy", "rsqrt"})


class Choice(NamedTuple):
    """A save set on the frontier: item names, bytes kept per layer, FLOPs per token rerun
    per layer (this rank), and at most how many more FLOPs per token it reruns than the
    optimum at its budget (0.0 where the frontier is exact)."""

    kept: tuple[str, ...]
    kept_bytes: int
    rerun_flops: float
    gap_flops: float = 0.0


def searchable(items: tuple[Item, ...]) -> tuple[Item, ...]:
    return tuple(i for i in items if i.op in POLICY_OPS and i.op != NORM)


@lru_cache(maxsize=256)
def frontier(items: tuple[Item, ...]) -> tuple[Choice, ...]:
    """The Pareto frontier of save sets over ``searchable(items)``, fewest bytes first: exact
    (``_exact``) unless it grows past ``MAX_FRONTIER`` sets, then the greedy chain."""
    pool = searchable(items)
    total = sum(i.flops_per_token for i in pool)
    exact = _exact(pool)
    if exact is None:
        return _greedy_chain(pool, total)
    return tuple(Choice(tuple(pool[i].name for i in idx), size, total - kept)
                 for size, kept, idx in exact)


def _exact(pool: tuple[Item, ...]) -> list[tuple[int, float, tuple[int, ...]]] | None:
    """Every save set no other beats (more FLOPs kept in no more bytes), as (bytes, FLOPs
    kept, item indices), fewest bytes first; None past ``MAX_FRONTIER`` sets. Built item by
    item (Nemhauser and Ullmann, Operations Research 17(3), 1969): a set on the frontier of
    the first n + 1 items is one on the frontier of the first n, with or without item n + 1,
    so pruning the dominated after each item loses no optimum. Of sets alike in bytes and
    FLOPs the one with fewer items, then the earliest items, is kept."""
    front: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    for n, item in enumerate(pool):
        grown = front + [(size + item.size_bytes, kept + item.flops_per_token, idx + (n,))
                         for size, kept, idx in front]
        grown.sort(key=lambda x: (x[0], -x[1], len(x[2]), x[2]))
        front, best = [], -1.0
        for entry in grown:
            if entry[1] > best:
                best = entry[1]
                front.append(entry)
        if len(front) > MAX_FRONTIER:
            return None
    return front


def _greedy_chain(pool: tuple[Item, ...], total: float) -> tuple[Choice, ...]:
    order = sorted(pool, key=lambda i: -i.flops_per_token / max(i.size_bytes, 1))
    out = [Choice((), 0, total, order[0].flops_per_token if order else 0.0)]
    for n in range(1, len(order) + 1):
        chosen = order[:n]
        gap = order[n].flops_per_token if n < len(order) else 0.0
        out.append(Choice(tuple(i.name for i in chosen), sum(i.size_bytes for i in chosen),
                          total - sum(i.flops_per_token for i in chosen), gap))
    return tuple(out)


def choose(sets: tuple[Choice, ...], fits: Callable[[tuple[str, ...]], bool | int],
           known: int = 0, forward: tuple[int, ...] | None = None
           ) -> tuple[Choice | None, int]:
    """The set of ``sets`` (fewest bytes first) with the most bytes that ``fits``, and how
    many times ``fits`` was asked; None when not even the empty set fits. ``known``: the
    index of a set known to fit (a larger micro-batch's choice). The largest set is asked
    first: where it fits, one question answers.

    ``forward``: each set's layer forward peak (``memplan.model.layer.ops_forward_peaks``;
    for a model of dense and MoE layers a tuple per set, each kind's bytes and forward peak,
    and a set is ruled out only by one it is no lower than in every one of them).
    A stage's peak rises with a set's bytes and its forward peak together, not with its
    bytes alone: a set of fewer bytes made early in the layer can hold more at the forward's
    peak than one of more bytes made late. A layer kind under op-level checkpointing differs
    by its set only in its saved bytes and its forward peak (``memplan.model.layer.
    ops_kind``), and every moment of a stage's walk adds each layer's saved bytes and
    forward peak with a nonnegative count (tests/unit/test_save_set_order.py checks it over
    many configurations). So a set that does not fit rules out only the later sets whose
    forward peak is no lower, and the search goes on among the rest. Without ``forward``,
    every later set is ruled out (sets taken to rise in both).

    ``fits`` may return the budget less the peak (an int, fitting when >= 0) instead of a
    bool: the next set asked is then where the line through the nearest set that fits and
    the nearest above it that does not meets the budget (the peak is close to linear in the
    kept bytes), a bisection step following any such guess that did not halve the sets still
    open. Which sets are asked changes, not the answer."""
    asked = 0
    slack: dict[int, int] = {}

    def ok(i: int) -> bool:
        nonlocal asked
        asked += 1
        answer = fits(sets[i].kept)
        if type(answer) is bool:
            return answer
        slack[i] = answer
        return answer >= 0

    if not sets:
        return None, asked
    if len(sets) > 1 and ok(len(sets) - 1):
        return sets[-1], asked
    if known == 0 and not ok(0):  # the empty set: fewest bytes, the lowest forward peak
        return None, asked
    lo, hi = known, len(sets) - 1  # a set that fits; the nearest above it known not to
    if forward is None:  # (every later set ruled out by one that does not fit)
        forward = (0,) * len(sets)
    # the sets still open: not known to fit, not ruled out by one that does not (the largest
    # was asked: no set before it keeps as many bytes)
    open_ = list(range(known + 1, hi))
    guess = True
    while open_:
        mid = open_[len(open_) // 2]
        if guess and lo in slack and hi in slack:
            mid = _secant(sets, open_, lo, hi, slack)
        before = len(open_)
        if ok(mid):
            lo = mid
            open_ = [i for i in open_ if i > mid]
        else:  # what ``mid`` rules out (a plan asks this of every set of every probe)
            hi = min(hi, mid) if mid > lo else hi
            size, peak = sets[mid].kept_bytes, forward[mid]
            if type(peak) is tuple:  # per kind: ruled out where no lower in any
                open_ = [i for i in open_ if i != mid and (
                    i < mid or any(a < b for a, b in zip(forward[i], peak)))]
            else:
                open_ = [i for i in open_ if i != mid and (
                    i < mid or sets[i].kept_bytes < size or forward[i] < peak)]
        guess = 2 * len(open_) <= before
    return sets[lo], asked


def _secant(sets: tuple[Choice, ...], open_: list[int], lo: int, hi: int,
            slack: dict[int, int]) -> int:
    """The open set of most bytes at or below where the line through ``lo`` (fits, by
    ``slack[lo]`` bytes) and ``hi`` (over by ``-slack[hi]``) meets the budget; the first
    open set if none is."""
    b_lo, b_hi = sets[lo].kept_bytes, sets[hi].kept_bytes
    target = b_lo + (b_hi - b_lo) * slack[lo] / (slack[lo] - slack[hi])
    best = open_[0]
    for i in open_:
        if sets[i].kept_bytes > target:
            break
        best = i
    return best


def choose_per_stage(sets: tuple[Choice, ...],
                     peaks: Callable[[tuple[str, ...]], tuple[int, ...]], budget: int,
                     known: int = 0, forward: tuple[int, ...] | None = None
                     ) -> tuple[list[Choice | None], int]:
    """``choose`` for each pipeline stage: a stage's memory is its own (the first stages
    hold more micro-batches in flight, so they keep less), so each stage takes the set of
    ``sets`` with the most bytes whose peak on that stage (``peaks``: every stage's
    peak_bytes with one set on every stage) is within ``budget``. The stages' bisections
    share their probes; returns the choices and how many sets were probed."""
    seen: dict[tuple[str, ...], tuple[int, ...]] = {}

    def at(kept: tuple[str, ...]) -> tuple[int, ...]:
        if kept not in seen:
            seen[kept] = peaks(kept)
        return seen[kept]

    first = at(sets[-1].kept) if sets else ()
    out = [choose(sets, lambda kept, i=i: budget - at(kept)[i], known, forward)[0]
           for i in range(len(first))]
    return out, len(seen)
