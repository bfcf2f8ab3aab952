"""The largest micro-batch that fits, for many layouts and recompute policies at once.

A job is one layout with one recompute policy; its sizes are the micro-batch sizes that divide
its per-replica batch. Its peak grows with the micro-batch as long as the micro-batch count
changes nothing but the activations' size: ``memory.batch_regime`` names what the count
changes (micro-batches in flight per stage, gradients before the first backward), and sizes of
one regime form a run in which the peak never decreases. Across runs nothing is assumed.

What is known about every (job, size) is kept per job: fits, does not fit, or unknown, with
the exact peak (a lower bound when it does not fit: an evaluation stops at the first
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
from itertools import accumulate, pairwise

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

    mbs: list[int]
    peak_bytes: list[int]
    num_params: list[int]
    slope: list[float]  # bytes per sample each job's last evaluation implies
    evaluated: int  # exact evaluations
    searched: int  # (job, size) candidates the search covered
    misses: list[tuple[int, int, int]]  # per job its smallest size that does not fit:
    #                                     (a lower bound of its peak_bytes, job, size)


class _State:
    """What the search knows about one job: per size (its open ones, those above ``above``)
    the status, the exact peak (a lower bound when over) and the parameters."""

    __slots__ = ("sizes", "runs", "open", "status", "peak", "params", "floor", "slope")

    def __init__(self, job: Job, runs: tuple[int, ...], floor: int, slope: float,
                 over: bool) -> None:
        self.sizes, self.runs, self.floor, self.slope = job.sizes, runs, floor, slope
        self.open = [b > job.above for b in job.sizes]
        n = len(job.sizes)
        # a floor above the budget rules out every size without a walk through the layers
        self.status = [OVER if over else UNKNOWN] * n
        self.peak = [floor if over else 0] * n
        self.params = [0] * n

    def probe(self, budget: int) -> int:
        """The size index to evaluate next; -1 when the job is resolved. A size is ruled out
        when it or a smaller size of its run does not fit, sure to fit when it or a larger
        size of its run fits."""
        runs, is_open, status = self.runs, self.open, self.status
        n = len(self.sizes)
        ruled, run_over = [False] * n, None  # the run of the last size seen over
        for c in range(n):
            if is_open[c] and status[c] == OVER:
                run_over = runs[c]
            ruled[c] = run_over == runs[c]
        top = next((c for c in range(n - 1, -1, -1) if is_open[c] and not ruled[c]), -1)
        if top < 0:
            return -1
        run = runs[top]
        # sure: a size fits at or above it in its run (sizes past ``top``'s run do not count)
        sure, fits_at = [False] * n, None
        for c in range(n - 1, -1, -1):
            if is_open[c] and status[c] == FITS:
                fits_at = runs[c]
            sure[c] = fits_at == runs[c]
        if sure[top]:
            return -1
        # The bracket inside the run of the largest possible size: above its largest size
        # sure to fit (or below the run's first size), up to that largest possible size.
        in_run = [is_open[c] and runs[c] == run for c in range(n)]
        first = next((c for c in range(n) if in_run[c]), n)
        low = max(next((c for c in range(n - 1, -1, -1) if in_run[c] and sure[c]), -1),
                  first - 1)
        floor, slope, sizes = self.floor, self.slope, self.sizes
        guess = next((c for c in range(top, low, -1)
                      if in_run[c] and floor + slope * sizes[c] <= budget), -1)
        return guess if guess >= 0 else low + 1


class Search:
    """What one search knows about its jobs; ``run`` searches until every job is resolved."""

    def __init__(self, spec: ModelSpec, jobs: list[Job], budget_bytes: int, ovh: Overheads, *,
                 slopes: list[float] | None = None, classes: list | None = None,
                 schedule: Schedule = Schedule.ONE_F_ONE_B, known: dict | None = None) -> None:
        """``slopes``: each job's guess of its bytes per sample (from a cheaper recompute
        policy of its layout); ``classes``: jobs of one class share their activations (they
        differ in states only), so all but one wait for that one's slope; ``known``: the
        evaluations of earlier searches with this budget, by (layout, workload, size), read
        and added to (a search again reads those it repeats)."""
        self.spec, self.jobs, self.budget, self.ovh = spec, jobs, budget_bytes, ovh
        self.known = {} if known is None else known
        self.schedule = schedule
        floors = [optimizer_floor_bytes(spec, j.par, j.wl, ovh) for j in jobs]
        slopes = [0.0] * len(jobs) if slopes is None else [float(s) for s in slopes]
        self.states = [
            _State(job, _run_ids(job.par.pp, job.par.vpp, job.wl.global_batch_size // job.par.dp,
                                 job.sizes, schedule), floor, slope, floor > budget_bytes)
            for job, floor, slope in zip(jobs, floors, slopes)]
        self.lead = _leads(floors, classes)
        self.waiting = [lead != i for i, lead in enumerate(self.lead)]
        self.parts: list = [None] * len(jobs)  # each job's stage_parts, once evaluated
        self.evaluated = 0

    def run(self) -> Found:
        states, budget, lead, waiting = self.states, self.budget, self.lead, self.waiting
        probes = [s.probe(budget) for s in states]
        while True:
            # a waiting job starts once its class's lead is resolved, from the lead's slope
            for i, s in enumerate(states):
                if waiting[i] and probes[lead[i]] < 0:
                    s.slope, waiting[i] = states[lead[i]].slope, False
                    probes[i] = s.probe(budget)
            todo = [i for i, p in enumerate(probes) if p >= 0 and not waiting[i]]
            if not todo:
                break
            for i in todo:  # each job's state is its own: its probe changes with it alone
                self._evaluate(i, probes[i])
            for i in todo:
                probes[i] = states[i].probe(budget)
        return self._found()

    def _evaluate(self, i: int, col: int) -> None:
        job, s = self.jobs[i], self.states[i]
        b = s.sizes[col]
        worst = self.known.get((job.par, job.wl, b))
        if worst is None:
            if self.parts[i] is None:
                self.parts[i] = stage_parts(self.spec, job.par, job.wl)
            worst = evaluate(self.spec, job.par, job.wl, b, self.ovh, schedule=self.schedule,
                             limit_bytes=self.budget, parts=self.parts[i])
            self.known[job.par, job.wl, b] = worst
            self.evaluated += worst.walked  # (a floor over the budget is no exact evaluation)
        s.status[col] = FITS if worst.peak_bytes <= self.budget else OVER
        s.peak[col], s.params[col] = worst.peak_bytes, worst.num_params
        # the line through the floor and this point predicts the job's other sizes
        s.slope = (worst.peak_bytes - s.floor) / b

    def _found(self) -> Found:
        mbs, peaks, params, misses = [], [], [], []
        searched = 0
        for i, s in enumerate(self.states):
            best = over = -1
            for c, is_open in enumerate(s.open):
                if not is_open:
                    continue
                searched += 1
                if s.status[c] == FITS:
                    best = c
                elif s.status[c] == OVER and over < 0:
                    over = c  # the job's smallest size that does not fit: its closest miss
            mbs.append(s.sizes[best] if best >= 0 else 0)
            peaks.append(s.peak[best] if best >= 0 else 0)
            params.append(s.params[best] if best >= 0 else 0)
            if over >= 0:
                misses.append((s.peak[over], i, s.sizes[over]))
        return Found(mbs=mbs, peak_bytes=peaks, num_params=params,
                     slope=[s.slope for s in self.states], evaluated=self.evaluated,
                     searched=searched, misses=misses)


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
    return tuple(accumulate((a != b for a, b in pairwise(regimes)), initial=0))


def _leads(floor: list[int], classes: list | None) -> list[int]:
    """Each job's class lead: the member with the lowest floor, the likeliest to fit (the
    first of equals)."""
    if classes is None:
        return list(range(len(floor)))
    lead: dict = {}
    for i, c in enumerate(classes):
        j = lead.get(c)
        if j is None or floor[i] < floor[j]:
            lead[c] = i
    return [lead[c] for c in classes]
