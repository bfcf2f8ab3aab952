"""The cyclic garbage collector paused around a pass of the model: changes no number, only time.

A first estimate of a configuration fills the per-layout and stage-walk caches
(``memplan.model.memo``) with NamedTuples and tuples of them, and a plan's search and its
allocator replays make tens of thousands of objects that live until the pass ends. CPython's
collector untracks only exact tuples whose items are untracked (``gcmodule.c``,
``untrack_tuples`` calls ``_PyTuple_MaybeUntrack`` on ``PyTuple_CheckExact`` objects), so a
NamedTuple stays tracked for ever, and each allocation that outlives its pass counts towards
the next collection: the collections a pass triggers (full ones among them, over every
object of the process) find next to nothing to free. Measured on the first pass of
``benchmarks/bench_estimate.py``'s grid (768 new configurations, CPython 3.11): 54
collections, about 8% of the pass's CPU time (``gc.callbacks``).

Paused, not frozen: ``gc.freeze`` would move the caller's own objects to the permanent
generation too. The collector is left as it was found (a caller that disabled it keeps it
disabled), and the first collection after the pass sees what the pass left, once.
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


def with_collector_paused(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run with the collector paused (``collector_paused``); the same signature
    and docstring (``functools.wraps``)."""

    @wraps(function)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        if not gc.isenabled():  # (paused already: an outer pass, or the caller's choice)
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()

    return paused
