"""``--recompute auto``: the save set with the least recompute that fits the budget.

Each item a layer can keep (``memplan.model.sac_ops.Item``) costs its bytes while kept and
its FLOPs when rerun; a save set costs the sum of both. Keeping the most FLOPs within a
number of bytes is a 0/1 knapsack. Up to ``EXACT_ITEMS`` items every subset is enumerated
and the Pareto frontier kept (no other subset keeps more FLOPs in no more bytes): the
optimum for any byte budget is on it. Beyond that the frontier is the greedy chain (items
by FLOPs per byte, each set the one before it plus the next item), whose sets are optimal
at their own bytes (a fractional knapsack's optimum there is integral): at a budget between
two of them the chosen one reruns at most the next item's FLOPs more than the optimum
(``Choice.gap_flops``).

A layer's peak grows with what it keeps, so the frontier, ordered by bytes, is searched by
bisection for the last set that fits (the ``fits`` the caller gives: an estimate's peak
against its budget), each probe one estimate; the choice is then checked, and if a later
moment makes it overshoot the sets before it are tried in order. Only the items a policy can
name are searched (``POLICY_OPS``: the projections, the attention kernel, the activation and
the gated product; a norm's saved tensors come from ops that differ by implementation).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from itertools import combinations
from typing import NamedTuple

from memplan.model.sac_ops import NORM, Item

# subsets enumerated exactly up to this many items (2^16 = 65536 sets, once per layer kind)
EXACT_ITEMS = 16
POLICY_OPS = frozenset({"matmul", "sdpa", "act", "mul"})


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
    """The Pareto frontier of save sets over ``searchable(items)``, fewest bytes first."""
    pool = searchable(items)
    total = sum(i.flops_per_token for i in pool)
    if len(pool) > EXACT_ITEMS:
        return _greedy_chain(pool, total)
    sets = [(sum(i.size_bytes for i in s), sum(i.flops_per_token for i in s), s)
            for n in range(len(pool) + 1) for s in combinations(pool, n)]
    sets.sort(key=lambda x: (x[0], -x[1], len(x[2])))
    out: list[Choice] = []
    best = -1.0
    for size, kept, chosen in sets:
        if kept > best:
            best = kept
            out.append(Choice(tuple(i.name for i in chosen), size, total - kept))
    return tuple(out)


def _greedy_chain(pool: tuple[Item, ...], total: float) -> tuple[Choice, ...]:
    order = sorted(pool, key=lambda i: -i.flops_per_token / max(i.size_bytes, 1))
    out = [Choice((), 0, total, order[0].flops_per_token if order else 0.0)]
    for n in range(1, len(order) + 1):
        chosen = order[:n]
        gap = order[n].flops_per_token if n < len(order) else 0.0
        out.append(Choice(tuple(i.name for i in chosen), sum(i.size_bytes for i in chosen),
                          total - sum(i.flops_per_token for i in chosen), gap))
    return tuple(out)


def choose(sets: tuple[Choice, ...], fits: Callable[[tuple[str, ...]], bool],
           known: int = 0) -> tuple[Choice | None, int]:
    """The set of ``sets`` (fewest bytes first) with the most bytes that ``fits``, and how
    many times ``fits`` was asked; None when not even the empty set fits. ``known``: the
    index of a set known to fit (a larger micro-batch's choice). The largest set is asked
    first: where it fits, one question answers."""
    asked = 0

    def ok(i: int) -> bool:
        nonlocal asked
        asked += 1
        return fits(sets[i].kept)

    if not sets:
        return None, asked
    if len(sets) > 1 and ok(len(sets) - 1):
        return sets[-1], asked
    if known == 0 and not ok(0):
        return None, asked
    lo, hi = known, len(sets) - 2  # sets[lo] fits, the last does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return sets[lo], asked
