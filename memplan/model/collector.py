"""The cyclic garbage collector around a pass of the model: changes no number, only time.

A first estimate of a configuration fills the per-layout and stage-walk caches
(``memplan.model.memo``) with NamedTuples and tuples of them, and a plan's search and its
allocator replays make tens of thousands of objects that live until the pass ends. CPython's
collector untracks only exact tuples whose items are untracked (3.11 ``Modules/gcmodule.c``,
``untrack_tuples`` calls ``_PyTuple_MaybeUntrack`` on ``PyTuple_CheckExact`` objects), so a
NamedTuple stays tracked for ever: every object a pass keeps counts towards the next
collection, and every full collection walks every cache entry made before (and the whole
process's objects). Counted with callgrind (CPython 3.11) over the first pass of
``benchmarks/bench_estimate.py``'s grid (768 new configurations through ``memplan.estimate``,
the catalog loaded): 1,353,442 instructions per estimate, 1,262,694 with the collector off.

Two ways, each leaving the collector as it was found:

- ``with_older_frozen`` (an estimate, a plan): the objects older than the call moved to the permanent
  generation (``gc.freeze``) for the call and back to the oldest one after (``gc.unfreeze``;
  both splice lists, whatever their length), so the collections the call triggers walk only
  what it made. Callgrind, as above: 1,291,005 per estimate (-4.6%).
  Skipped inside another such call, where the collector is off, and for good once the
  process was seen with objects someone else froze (a server's ``gc.freeze`` before it
  forks is not undone).
- ``collector_paused`` (an allocator replay): no collection at all until the block ends;
  its objects are collected at the first collection after. Pausing an estimate alone
  saves nothing (callgrind, as above: 1,359,583 per estimate): the collections it defers
  come right after it, over the same objects. A plan paused whole takes 2.4% fewer
  instructions than frozen (``memplan.plan("mixtral-8x7b", gpus=64, top=10)``, callgrind:
  3,658M paused, 3,748M frozen, 4,041M with neither and without the planner's row and
  save-set caches) but holds every replay's allocator (its blocks link both ways: only a
  collection frees them) until it ends: a peak RSS of 116 MiB against 86 MiB frozen on
  Mixtral 8x7B x 8, bf16-pure, ``recompute=["auto"]``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block, then as it was before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# with_older_frozen's state: a call of it under way (a nested one, an estimate inside a
# plan, does nothing), and whether the process was seen with objects frozen by someone else
_DEPTH = [0]
_CALLER_FREEZES = [False]


def with_older_frozen(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run with every object made before it frozen (``gc.freeze``), unfrozen
    after it returns or raises; as called inside another such call, where the collector is
    off, or once any object was seen frozen by someone else (a server that freezes before
    it forks: never undone, and never counted again, as ``gc.get_freeze_count`` walks the
    frozen objects one by one). The same signature and docstring (``functools.wraps``)."""

    @wraps(function)
    def frozen(*args: P.args, **kwargs: P.kwargs) -> R:
        if _DEPTH[0] or _CALLER_FREEZES[0] or not gc.isenabled():
            return function(*args, **kwargs)
        if gc.get_freeze_count():
            _CALLER_FREEZES[0] = True
            return function(*args, **kwargs)
        _DEPTH[0] = 1
        gc.freeze()
        try:
            return function(*args, **kwargs)
        finally:
            _DEPTH[0] = 0
            gc.unfreeze()

    return frozen
