"""The reserved check's replays run ahead in worker processes: changes no number, only time.

``plan``'s reserved check (``memplan.planning.planner._fit_reserved``) replays candidates one
at a time, fastest first, until enough fit; each replay (``memplan.model.reserved``) is pure
Python and takes tens to hundreds of milliseconds, most of a plan. The next candidates in
that order are known before the current one is read, so worker processes forked from the
plan's process replay them ahead while it waits: the check reads the same figures, in the
same order, as it would have made them itself (a worker runs the same function on a copy of
the process), and a configuration counts as replayed when the check first reads it, as
before. Replays made ahead that the check never reads are dropped with the workers at the
plan's end.

Workers are forked (``os.fork`` semantics: the search's caches come along), so this runs only
where a fork is safe and cheap: Linux, no other thread in the process (a fork copies one
thread and any lock another held), more than one usable CPU. ``MEMPLAN_JOBS`` sets the
number of processes replaying (1: none ahead, every replay in the plan's own process).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Hashable
from typing import Any

from memplan.errors import MemplanError

# at most this many workers: a stage replay holds a few hundred MiB at its largest
# (Mamba layers' working sets), and a plan reads about one replay per candidate it shows
MAX_JOBS = 8


def jobs() -> int:
    """Processes that may replay at once: ``MEMPLAN_JOBS`` where set, else the usable CPUs
    (at most ``MAX_JOBS``); 1 where workers cannot be forked safely."""
    raw = os.environ.get("MEMPLAN_JOBS", "").strip()
    if raw:
        try:
            wanted = int(raw)
        except ValueError:
            raise MemplanError(f"MEMPLAN_JOBS must be a whole number of processes, got "
                               f"{raw!r}") from None
        if wanted < 1:
            raise MemplanError(f"MEMPLAN_JOBS must be at least 1, got {wanted}")
    else:
        wanted = min(MAX_JOBS, len(os.sched_getaffinity(0))
                     if hasattr(os, "sched_getaffinity") else 1)
    if wanted <= 1 or not sys.platform.startswith("linux") or threading.active_count() > 1:
        return 1
    import multiprocessing

    if multiprocessing.current_process().daemon:  # (a pool's worker may have no children)
        return 1
    return wanted


class Ahead:
    """Replays made ahead by worker processes, read in the plan's order (``take``). ``run``
    is the replay (a module-level function: the workers call it by name on their copy)."""

    def __init__(self, run: Callable[..., Any], workers: int) -> None:
        self.run, self.workers = run, workers
        self._pool: Any = None
        self._pending: dict[Hashable, Any] = {}

    def submit(self, keys: list[tuple]) -> None:
        """Start replaying ``keys`` (``run``'s arguments) not already under way, while fewer
        than twice as many as there are workers are unfinished."""
        if self.workers <= 1:
            return
        for key in keys:
            if sum(not f.done() for f in self._pending.values()) >= 2 * self.workers:
                break
            if key in self._pending:
                continue
            if self._pool is None:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                try:
                    self._pool = ProcessPoolExecutor(
                        self.workers, mp_context=multiprocessing.get_context("fork"))
                    self._pending[key] = self._pool.submit(self.run, *key)
                except OSError:  # no process could be started (a limit): none ahead
                    self._stop()
                    return
                continue
            self._pending[key] = self._pool.submit(self.run, *key)

    def take(self, key: tuple) -> Any | None:
        """``run(*key)`` as a worker made it, or None where none was started or the worker
        is gone (the caller replays it itself: a worker the system stopped, out of memory,
        takes the others with it, and none is started again); an error in the replay is
        raised here, as the caller's own replay would have raised it."""
        from concurrent.futures.process import BrokenProcessPool

        got = self._pending.pop(key, None)
        if got is None:
            return None
        try:
            return got.result()
        except BrokenProcessPool:
            self._stop()
            return None

    def _stop(self) -> None:
        self.close()
        self.workers = 1

    def close(self) -> None:
        """The workers stopped, whatever they were replaying."""
        pool, self._pool = self._pool, None
        self._pending.clear()
        if pool is None:
            return
        # (``shutdown`` lets a worker finish the replay it is in: they are stopped instead)
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
