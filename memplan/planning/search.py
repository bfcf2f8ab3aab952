"""The largest micro-batch that fits, for many layouts and recompute policies at once.

A job is one layout with one recompute policy; its sizes are the micro-batch sizes that divide
its per-replica batch. Its peak grows with the micro-batch as long as the micro-batch count
changes nothing but the activations' size: ``memory.batch_regime`` names what the count
changes (micro-batches in flight per stage, gradients before the first backward), and sizes of
one regime form a run in which the peak never decreases. Across runs nothing is assumed.

What is known about every (job, size) lives in numpy arrays: fits, does not fit, or unknown,
with the exact peak (a lower bound when it does not fit: an evaluation stops at the first
stage over the budget). Each round predicts every unknown peak from a line through the
layout's optimizer floor (``memory.optimizer_floor_bytes``, its peak at every size) and the
job's last evaluation, probes one size per unresolved job (the largest still open that the
line says fits, else the smallest still open) and evaluates the probes exactly with
``memory.most_loaded``, the code ``estimate`` runs. A wrong prediction costs another round.

A size is ruled out when it or a smaller size of its run does not fit; a job is resolved when
its largest size not ruled out fits. That size was evaluated and fits, and the next larger one
was evaluated and does not (ruled out by itself: a smaller one would rule out the answer), so
the answer is what a brute force over ``estimate`` returns, given the monotone runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

import numpy as np

from memplan.model.estimate import RankPeak, batch_regime, most_loaded, optimizer_floor_bytes
from memplan.model.memo import stage_parts
from memplan.model.pipeline import Schedule
from memplan.overheads import Overheads
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec
from memplan.workload import Workload

UNKNOWN, FITS, OVER = 0, 1, -1


@dataclass(frozen=True)
class Job:
    """One layout and recompute policy (``wl`` with the global batch size; its micro-batch is
    set per size), searched over ``sizes`` (ascending) larger than ``above``."""

    par: ParallelConfig
    wl: Workload
    sizes: tuple[int, ...]
    above: int = 0


@dataclass(frozen=True)
class Found:
    """Per job: the largest fitting micro-batch (0: none), with the most loaded rank's
    peak_bytes and parameters at that size."""

    mbs: np.ndarray
    peak_bytes: np.ndarray
    num_params: np.ndarray
    slope: np.ndarray  # bytes per sample each job's last evaluation implies
    evaluated: int  # exact evaluations
    searched: int  # (job, size) candidates the search covered
    misses: list[tuple[int, int, int]]  # per job its smallest size that does not fit:
    #                                     (a lower bound of its peak_bytes, job, size)


class Search:
    """What one search knows about its jobs; ``run`` searches until every job is resolved."""

    def __init__(self, spec: ModelSpec, jobs: list[Job], budget_bytes: int, ovh: Overheads, *,
                 slopes: np.ndarray | None = None, classes: list | None = None,
                 schedule: Schedule = Schedule.ONE_F_ONE_B, known: dict | None = None) -> None:
        """``slopes``: each job's guess of its bytes per sample (from a cheaper recompute
        policy of its layout); ``classes``: jobs of one class share their activations (they
        differ in states only), so all but one wait for that one's slope; ``known``: the
        evaluations of earlier searches with this budget, by (layout, workload, size), read
        and added to (a search again reads those it repeats)."""
        self.spec, self.jobs, self.budget, self.ovh = spec, jobs, budget_bytes, ovh
        self.known = {} if known is None else known
        self.schedule = schedule
        width = max((len(j.sizes) for j in jobs), default=0)
        self.size = np.zeros((len(jobs), width), dtype=np.int64)
        self.run_id = np.zeros((len(jobs), width), dtype=np.int64)
        for i, job in enumerate(jobs):
            self.size[i, :len(job.sizes)] = job.sizes
            self.run_id[i, :len(job.sizes)] = _run_ids(job.par.pp, job.par.vpp,
                                                       job.wl.global_batch_size // job.par.dp,
                                                       job.sizes, schedule)
        above = np.array([j.above for j in jobs], dtype=np.int64).reshape(-1, 1)
        self.open = (self.size > 0) & (self.size > above)
        self.status = np.full(self.size.shape, UNKNOWN, dtype=np.int8)
        self.peak = np.zeros(self.size.shape, dtype=np.int64)
        self.params = np.zeros(self.size.shape, dtype=np.int64)
        self.floor = np.array([optimizer_floor_bytes(spec, j.par, j.wl, ovh) for j in jobs],
                              dtype=np.int64)
        self.slope = np.zeros(len(jobs)) if slopes is None else np.array(slopes, dtype=float)
        self.lead = _leads(self.floor, classes)
        self.waiting = self.lead != np.arange(len(jobs))
        self.parts: list = [None] * len(jobs)  # each job's stage_parts, once evaluated
        self.evaluated = 0
        # A floor above the budget rules out every size without a walk through the layers.
        over = self.floor > budget_bytes
        self.status[over] = OVER
        self.peak[over] = self.floor[over, None]

    def run(self) -> Found:
        while True:
            probes = self._probes()
            # a waiting job starts once its class's lead is resolved, from the lead's slope
            start = self.waiting & (probes[self.lead] < 0)
            if start.any():
                self.slope[start] = self.slope[self.lead[start]]
                self.waiting &= ~start
                probes = self._probes()
            todo = np.flatnonzero((probes >= 0) & ~self.waiting)
            if not len(todo):
                break
            for i in todo:
                self._evaluate(int(i), int(probes[i]))
        return self._found()

    def _known(self) -> tuple[np.ndarray, np.ndarray]:
        """(ruled out, sure to fit) per (job, size): a size is ruled out when it or a smaller
        size of its run does not fit, sure when it or a larger size of its run fits."""
        runs, cols = self.run_id, self.size.shape[1]
        over_run = np.where(self.open & (self.status == OVER), runs, -1)
        ruled_out = np.maximum.accumulate(over_run, axis=1) == runs
        fit_run = np.where(self.open & (self.status == FITS), runs, cols + 1)
        sure = np.minimum.accumulate(fit_run[:, ::-1], axis=1)[:, ::-1] == runs
        return ruled_out, sure

    def _probes(self) -> np.ndarray:
        """The size index to evaluate next for each job; -1 when the job is resolved."""
        ruled_out, sure = self._known()
        cols = np.arange(self.size.shape[1])
        possible = self.open & ~ruled_out
        top = np.where(possible, cols, -1).max(axis=1, initial=-1)
        rows = np.arange(len(self.jobs))
        done = (top < 0) | sure[rows, np.maximum(top, 0)]
        # The bracket inside the run of the largest possible size: above its largest size sure
        # to fit (or below the run's first size), up to that largest possible size.
        in_run = self.open & (self.run_id == self.run_id[rows, np.maximum(top, 0)][:, None])
        first = np.where(in_run, cols, cols.size).min(axis=1, initial=cols.size)
        low = np.maximum(np.where(in_run & sure, cols, -1).max(axis=1, initial=-1), first - 1)
        predicted = self.floor[:, None] + self.slope[:, None] * self.size <= self.budget
        bracket = in_run & (cols > low[:, None]) & (cols <= top[:, None])
        guess = np.where(bracket & predicted, cols, -1).max(axis=1, initial=-1)
        return np.where(done, -1, np.where(guess >= 0, guess, low + 1))

    def _evaluate(self, i: int, col: int) -> None:
        job, b = self.jobs[i], int(self.size[i, col])
        worst = self.known.get((job.par, job.wl, b))
        if worst is None:
            if self.parts[i] is None:
                self.parts[i] = stage_parts(self.spec, job.par, job.wl)
            worst = evaluate(self.spec, job.par, job.wl, b, self.ovh, schedule=self.schedule,
                             limit_bytes=self.budget, parts=self.parts[i])
            self.known[job.par, job.wl, b] = worst
            self.evaluated += worst.walked  # (a floor over the budget is no exact evaluation)
        self.status[i, col] = FITS if worst.peak_bytes <= self.budget else OVER
        self.peak[i, col], self.params[i, col] = worst.peak_bytes, worst.num_params
        # the line through the floor and this point predicts the job's other sizes
        self.slope[i] = (worst.peak_bytes - self.floor[i]) / b

    def _found(self) -> Found:
        cols = np.arange(self.size.shape[1])
        fits = self.open & (self.status == FITS)
        best = np.where(fits, cols, -1).max(axis=1, initial=-1)
        rows, at = np.arange(len(self.jobs)), np.maximum(best, 0)
        has = best >= 0
        # each job's smallest size that does not fit: its closest miss
        over = self.open & (self.status == OVER)
        first_over = np.where(over, cols, cols.size).min(axis=1, initial=cols.size)
        misses = [(int(self.peak[i, c]), int(i), int(self.size[i, c]))
                  for i, c in enumerate(first_over) if c < cols.size]
        return Found(mbs=np.where(has, self.size[rows, at], 0),
                     peak_bytes=np.where(has, self.peak[rows, at], 0),
                     num_params=np.where(has, self.params[rows, at], 0), slope=self.slope,
                     evaluated=self.evaluated, searched=int(self.open.sum()), misses=misses)


def evaluate(spec: ModelSpec, par: ParallelConfig, wl: Workload, mbs: int, ovh: Overheads, *,
             schedule: Schedule = Schedule.ONE_F_ONE_B,
             limit_bytes: int | None = None, parts: tuple | None = None) -> RankPeak:
    """``memory.most_loaded`` of ``wl`` (which holds the global batch size) at ``mbs``."""
    m = wl.global_batch_size // (mbs * par.dp)
    return most_loaded(spec, par, _with_mbs(wl, mbs), m, ovh, schedule=schedule,
                       limit_bytes=limit_bytes, parts=parts)


@lru_cache(maxsize=4096)
def _with_mbs(wl: Workload, mbs: int) -> Workload:
    return wl.model_copy(update={"micro_batch_size": mbs})


@lru_cache(maxsize=4096)
def _run_ids(pp: int, vpp: int, per_replica: int, sizes: tuple[int, ...],
             schedule: Schedule) -> tuple[int, ...]:
    """Run index of each size: consecutive sizes with the same batch regime share one."""
    par = ParallelConfig(pp=pp, vpp=vpp)
    regimes = [batch_regime(par, per_replica // b, schedule) for b in sizes]
    return tuple(int(r) for r in np.cumsum([0] + [a != b for a, b in pairwise(regimes)]))


def _leads(floor: np.ndarray, classes: list | None) -> np.ndarray:
    """Each job's class lead: the member with the lowest floor, the likeliest to fit."""
    if classes is None:
        return np.arange(len(floor))
    ids: dict = {}
    cls = np.array([ids.setdefault(c, len(ids)) for c in classes], dtype=np.int64)
    lead = np.full(len(ids), -1, dtype=np.int64)
    for i in np.lexsort((floor, cls)):  # lowest floor first within each class
        if lead[cls[i]] < 0:
            lead[cls[i]] = i
    return lead[cls]
