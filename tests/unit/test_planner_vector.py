"""The search over many jobs at once: the largest micro-batch equals a brute force over
``estimate`` for every layout and recompute policy of small spaces (dense and MoE, pipelines
with virtual stages, ZeRO 0-3, full recompute of k of L layers, sequence parallelism on and
off); the step times of many candidates in one vectorised pass, or one by one on plain
numbers, equal ``step_time``, and a plan timed either way is the same; more memory never fits
less."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

import memplan
from memplan.errors import MemplanError
from memplan.model.estimate import estimate, most_loaded, optimizer_floor_bytes
from memplan.overheads import default_overheads
from memplan.parallel import validate
from memplan.planning import search
from memplan.planning.batch_sizes import micro_batch_sizes
from memplan.planning.planner import (
    RECOMPUTE_ORDER,
    SP_OFF_DOMINATED,
    _policies,
    layouts,
    plan,
)
from memplan.planning.search import Job, Search
from memplan.planning.timing import (Columns, recomputed_share, stage_balance, step_flops,
                                     step_time, step_times, step_times_rows)
from memplan.spec import ModelSpec, MoESpec

GPU = memplan.load_gpu("h100")
TINY = memplan.load_model("tiny")
# 8 layers: pipelines of 2, 4 and 8 stages, 2 and 4 virtual stages, k of L recompute
DEEP = ModelSpec.model_validate({**TINY.model_dump(), "name": "tiny-8l", "num_layers": 8})
MOE = ModelSpec.model_validate({**TINY.model_dump(), "name": "tiny-moe-4l", "num_layers": 4,
                                "moe": MoESpec(num_experts=4, top_k=2,
                                               expert_ffn_hidden_size=96).model_dump()})

# (spec, gpus, workload fields): each a space of a few hundred layouts and policies
SPACES = {
    "dense-pp-vpp": (DEEP, 8, {"seq_len": 512, "global_batch_size": 64}),
    "dense-cp-fp32-grads": (DEEP, 16, {"seq_len": 8192, "global_batch_size": 32,
                                       "precision": "bf16-fp32-grads"}),
    "moe-eager": (MOE, 8, {"seq_len": 256, "global_batch_size": 32, "attention": "eager"}),
}


def _jobs(spec: ModelSpec, gpus: int, fields: dict) -> list[Job]:
    """Every valid layout of the space with every recompute policy, searched from size 1."""
    wl = memplan.make_workload(spec, **fields)
    out = []
    for par in layouts(spec, gpus, wl.seq_len, max_tp=8, fixed={}, rejected=Counter()):
        try:
            validate(spec, par, wl)
        except MemplanError:
            continue  # a layout estimate refuses (the planner rejects it too)
        if wl.global_batch_size % par.dp:
            continue
        for policy, layers in _policies(list(RECOMPUTE_ORDER), spec.num_layers // par.pp):
            job_wl = wl.model_copy(update={"recompute": policy, "recompute_layers": layers})
            out.append(Job(par, job_wl, micro_batch_sizes(par, wl.global_batch_size)))
    return out


@pytest.fixture(scope="module", params=sorted(SPACES))
def space(request: pytest.FixtureRequest) -> SimpleNamespace:
    """A space's jobs and the peak of every (job, size) from ``estimate``."""
    spec, gpus, fields = SPACES[request.param]
    jobs = _jobs(spec, gpus, fields)
    peaks = [[estimate(spec, GPU, j.par, j.wl.model_copy(update={"micro_batch_size": b}))
              .peak_bytes for b in j.sizes] for j in jobs]
    return SimpleNamespace(name=request.param, spec=spec, jobs=jobs, peaks=peaks)


def _brute_force(space: SimpleNamespace, budget: int, above: list[int] | None = None) -> list[int]:
    """The largest size above ``above`` whose estimate fits, per job (0: none)."""
    above = above or [0] * len(space.jobs)
    return [max((b for b, p in zip(j.sizes, peaks) if p <= budget and b > a), default=0)
            for j, peaks, a in zip(space.jobs, space.peaks, above)]


def _budgets(space: SimpleNamespace) -> list[int]:
    """Budgets between the smallest and largest peaks, so answers spread over the sizes."""
    every = np.array([p for peaks in space.peaks for p in peaks])
    return [int(np.quantile(every, q)) for q in (0.05, 0.3, 0.6, 0.9)]


def test_spaces_cover_what_the_search_must_handle(space: SimpleNamespace) -> None:
    pars = [j.par for j in space.jobs]
    assert len(space.jobs) > 100
    assert {int(p.zero) for p in pars} == {0, 1, 2, 3}
    assert any(p.sequence_parallel for p in pars) and any(p.tp > 1 and not p.sequence_parallel
                                                          for p in pars)
    assert any(j.wl.recompute_layers for j in space.jobs)  # full recompute of k of L
    if space.spec is DEEP:
        assert any(p.vpp > 1 for p in pars) and any(p.pp == 8 for p in pars)
    if space.spec is MOE:
        assert any(p.ep > 1 for p in pars)


def test_largest_fitting_mbs_equals_brute_force(space: SimpleNamespace) -> None:
    ovh = default_overheads(GPU)
    answers = Counter()
    for budget in _budgets(space):
        found = Search(space.spec, space.jobs, budget, ovh).run()
        expected = _brute_force(space, budget)
        assert list(found.mbs) == expected, (space.name, budget)
        for k, b in enumerate(expected):
            largest = space.jobs[k].sizes[-1]
            answers["none" if not b else "largest" if b == largest else "inner"] += 1
            if b:  # the peak the search reports is the estimate's
                assert found.peak_bytes[k] == space.peaks[k][space.jobs[k].sizes.index(b)]
        assert found.evaluated < found.searched  # it did not evaluate everything
    assert min(answers.values()) > 20, answers  # no fit, the largest size, and between


def test_search_above_a_cheaper_policy_equals_brute_force(space: SimpleNamespace) -> None:
    """Only sizes larger than ``above`` count (a costlier recompute must beat a cheaper one)."""
    budget = _budgets(space)[2]
    rng = random.Random(0)
    above = [rng.choice((0, *j.sizes)) for j in space.jobs]
    jobs = [Job(j.par, j.wl, j.sizes, a) for j, a in zip(space.jobs, above)]
    found = Search(space.spec, jobs, budget, default_overheads(GPU)).run()
    assert list(found.mbs) == _brute_force(space, budget, above)


def test_more_memory_never_fits_a_smaller_micro_batch(space: SimpleNamespace) -> None:
    ovh = default_overheads(GPU)
    last = [0] * len(space.jobs)
    for budget in sorted(_budgets(space)):
        mbs = Search(space.spec, space.jobs, budget, ovh).run().mbs
        assert all(b >= a for a, b in zip(last, mbs))
        last = mbs
    assert any(last)


def test_most_loaded_is_the_estimates_worst_stage(space: SimpleNamespace) -> None:
    ovh = default_overheads(GPU)
    for j in space.jobs[::7]:
        for b in j.sizes:
            wl = j.wl.model_copy(update={"micro_batch_size": b})
            est = estimate(space.spec, GPU, j.par, wl)
            worst = most_loaded(space.spec, j.par, wl, est.num_microbatches, ovh)
            assert (worst.stage, worst.peak_bytes, worst.num_params) == (
                est.worst.stage, est.worst.peak_bytes, est.worst.num_params)
            # stopping at a limit: over it exactly when the estimate is
            limit = est.peak_bytes - 1
            early = most_loaded(space.spec, j.par, wl, est.num_microbatches, ovh,
                                limit_bytes=limit)
            assert early.peak_bytes > limit
            assert most_loaded(space.spec, j.par, wl, est.num_microbatches, ovh,
                               limit_bytes=est.peak_bytes).peak_bytes == est.peak_bytes
            assert optimizer_floor_bytes(space.spec, j.par, wl, ovh) <= est.peak_bytes


def test_the_answer_fits_and_the_next_size_was_evaluated_not_to(monkeypatch) -> None:
    """Whatever the predictions, the search stops only when its answer was evaluated and fits
    and the next larger size was evaluated and does not; sizes whose micro-batch count changes
    more than the activations (here m = 1: no gradients before the backward) are searched on
    their own. Peaks come from a table here, one per size."""
    spec, par = TINY, memplan.make_layout(1)
    wl = memplan.make_workload(spec, seq_len=64, global_batch_size=16)
    sizes = micro_batch_sizes(par, 16)  # 1, 2, 4, 8, 16: m = 16 ... 1
    budget, evaluated = 10**12, []

    def table(spec, par, wl, mbs, ovh, **_):
        evaluated.append(mbs)
        return SimpleNamespace(peak_bytes=budget + (1 if mbs not in fits else -1), num_params=7,
                               walked=True)

    monkeypatch.setattr(search, "evaluate", table)
    for fits, answer in (({1, 2, 4}, 4), ({1}, 1), (set(), 0), ({1, 2, 4, 8, 16}, 16),
                         ({1, 2, 16}, 16), ({1, 2}, 2)):
        evaluated.clear()
        found = Search(spec, [Job(par, wl, sizes)], budget, default_overheads(GPU)).run()
        assert found.mbs[0] == answer, fits
        assert answer == 0 or answer in evaluated
        nxt = [b for b in sizes if b > answer][:1]
        assert all(b in evaluated for b in nxt)
        assert found.evaluated == len(evaluated)


def test_step_times_of_many_candidates_equal_step_time() -> None:
    rng = random.Random(1)
    for name in ("llama-2-7b", "mixtral-8x7b", "tiny"):
        spec = memplan.load_model(name)
        rows = []
        for _ in range(200):
            tp, pp, cp = rng.choice((1, 2, 8)), rng.choice((1, 2, 4)), rng.choice((1, 2))
            par = memplan.ParallelConfig(
                tp=tp, pp=pp, vpp=rng.choice((1, 2)) if pp > 1 else 1, cp=cp,
                dp=rng.choice((1, 4, 64)), ep=rng.choice((1, 2)) if spec.moe else 1,
                zero=rng.choice((0, 1, 2, 3)), sequence_parallel=rng.random() < 0.5)
            recompute = rng.choice(("none", "selective", "full", "full"))
            # full on k of each stage's layers: the FLOPs depend on the pipeline
            layers = (rng.randrange(spec.num_layers // pp + 1)
                      if recompute == "full" and rng.random() < 0.5 else None)
            wl = memplan.make_workload(spec, seq_len=1024, micro_batch_size=rng.choice((1, 2, 8)),
                                       recompute=recompute, recompute_layers=layers)
            rows.append((par, wl, rng.choice((1, 3, 16)), rng.randrange(1, 10**10)))
        gbs = 4096
        flops = [step_flops(spec, wl, gbs, pp=par.pp, vpp=par.vpp) for par, wl, _, _ in rows]
        cols = Columns.of([r[0] for r in rows], [r[1].micro_batch_size for r in rows],
                          [r[2] for r in rows], [r[3] for r in rows],
                          num_layers=spec.num_layers,
                          balance=[stage_balance(spec, wl, par.pp, par.vpp) for par, wl, _, _
                                   in rows],
                          rerun=[recomputed_share(wl, spec.num_layers, par)
                                 for par, wl, _, _ in rows])
        times = step_times(spec, GPU, rows[0][1].model_copy(update={"micro_batch_size": 1}),
                           gbs, cols, np.array([f[0] for f in flops]),
                           np.array([f[1] for f in flops]))
        plain = step_times_rows(
            spec, GPU, rows[0][1].model_copy(update={"micro_batch_size": 1}), gbs,
            [Columns.one(par, wl.micro_batch_size, m, params, num_layers=spec.num_layers,
                         balance=stage_balance(spec, wl, par.pp, par.vpp),
                         rerun=recomputed_share(wl, spec.num_layers, par))
             for par, wl, m, params in rows], flops)
        for i, (par, wl, m, params) in enumerate(rows):
            assert times.at(i) == step_time(spec, GPU, par, wl, gbs, m, params), (name, i)
            assert plain.at(i) == times.at(i), (name, i)
        assert plain.step_s == times.step_s.tolist()
        assert all(type(x) is float for x in plain.step_s)
        assert len({t.bound for t in (times.at(i) for i in range(len(rows)))}) == 3


@pytest.mark.parametrize("case", [("tiny", 8, {"top": 10}),
                                  ("tiny", 8, {"top": None, "reserved": False}),
                                  ("tiny-moe-4l", 8, {"top": 10, "seq_len": 256}),
                                  ("llama-3.1-8b", 8, {"top": 5, "recompute": ["auto"]})])
def test_a_plan_timed_one_by_one_is_the_vectorised_plan(case, monkeypatch) -> None:
    """Rows timed on plain numbers (small plans: no numpy imported) and in numpy's pass give
    the same candidates, times, counts and closest miss (each plan from empty caches)."""
    from memplan.planning import planner

    name, gpus, kw = case
    spec = MOE if name == MOE.name else memplan.load_model(name)
    out = []
    for vectorised in (False, True):
        monkeypatch.setattr(planner, "_vectorised", lambda rows, v=vectorised: v)
        planner._reserved_peak.cache_clear()
        wl = memplan.make_workload(spec, **{k: v for k, v in kw.items() if k == "seq_len"})
        result = memplan.plan(spec, gpus=gpus, **{k: v for k, v in kw.items()
                                                  if k != "seq_len"},
                              seq_len=wl.seq_len)
        out.append((result.candidates, result.rejected, result.evaluated, result.replayed,
                    result.searched, result.closest_miss, result.notes))
        assert all(type(c.time.step_s) is float for c in result.candidates)
    assert out[0] == out[1]
    assert len(out[0][0]) >= 5


def test_a_small_plan_imports_no_numpy() -> None:
    """numpy's import (about 90 ms) is left to plans that time many rows at once."""
    code = ("import sys, memplan.cli; memplan.cli.main(['plan', '--model', 'tiny', '--gpus', "
            "'8', '--json']); print('numpy' in sys.modules, file=sys.stderr)")
    env = {**os.environ, "MEMPLAN_JOBS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["candidates"]
    assert proc.stderr.strip().splitlines()[-1] == "False"


def test_candidates_are_timed_and_sized_as_estimate_says() -> None:
    """Each candidate of a plan: its micro-batch fits and the next size does not, its peak is
    the estimate's, its step time ``step_time`` of that estimate."""
    wl = memplan.make_workload(MOE, seq_len=256, global_batch_size=32)
    result = plan(MOE, GPU, 8, wl, capacity_bytes=int(1.1 * 2**30))
    assert len(result.candidates) > 20 and result.evaluated < result.searched
    budget = int(1.1 * 2**30 * 0.95)
    for c in result.candidates:
        est = c.estimate
        assert est.peak_bytes == c.peak_bytes <= budget
        sizes = micro_batch_sizes(c.layout, 32)
        bigger = [b for b in sizes if b > c.micro_batch_size]
        if bigger:
            nxt = estimate(MOE, GPU, c.layout, est.workload.model_copy(
                update={"micro_batch_size": bigger[0]}))
            assert nxt.peak_bytes > budget
        assert c.time == step_time(MOE, GPU, c.layout, est.workload, 32, est.num_microbatches,
                                   est.worst.num_params)


def test_sequence_parallelism_off_is_dominated_at_every_micro_batch() -> None:
    """What lets the planner drop sp off where sp on is possible: with it on every stage holds
    no more bytes in any phase and the step takes no longer, across layouts, recompute
    policies, attention kernels, norms, TP styles and precisions (random grid)."""
    rng = random.Random(2)
    checked = 0
    for name in ("llama-2-7b", "mixtral-8x7b", "gpt2", "tiny"):
        spec = memplan.load_model(name)
        for _ in range(40):
            tp, pp, dp = rng.choice((2, 4, 8)), rng.choice((1, 2, 4)), rng.choice((1, 2, 4))
            layout = {"tp": tp, "pp": pp, "dp": dp, "cp": rng.choice((1, 2)),
                      "vpp": rng.choice((1, 2)) if pp > 1 else 1, "zero": rng.choice((0, 1, 2, 3)),
                      "ep": rng.choice((1, 2)) if spec.moe else 1,
                      "tp_style": rng.choice(("megatron", "dtensor"))}
            mbs = rng.choice((1, 2, 4))
            work = {"seq_len": rng.choice((256, 1024)), "micro_batch_size": mbs,
                    "global_batch_size": mbs * dp * pp * rng.choice((1, 2)),
                    "recompute": rng.choice(("none", "selective", "full")),
                    "attention": rng.choice(("flash", "eager")),
                    "norm_impl": rng.choice(("upcast", "fused")),
                    "precision": rng.choice(("bf16-mixed", "bf16-fp32-grads", "fp32"))}
            gpus = tp * pp * dp * layout["cp"]
            try:
                on, off = (memplan.estimate(name, gpus=gpus, sequence_parallel=sp, **layout,
                                            **work) for sp in (True, False))
            except MemplanError:
                continue
            for a, b in zip(on.stages, off.stages):
                for step in ("steady", "first_step"):
                    for phase in ("forward", "backward", "optimizer"):
                        assert getattr(getattr(a, step), phase) <= getattr(getattr(b, step), phase)
            t_on, t_off = (step_time(spec, GPU, e.parallel, e.workload, e.global_batch_size,
                                     e.num_microbatches, e.worst.num_params) for e in (on, off))
            assert t_on.step_s <= t_off.step_s
            checked += 1
    assert checked > 100


def test_sequence_parallelism_off_is_planned_where_on_is_not_possible() -> None:
    wl = memplan.make_workload(DEEP, seq_len=512, global_batch_size=64)
    both = plan(DEEP, GPU, 8, wl, capacity_bytes=2**30, fixed={"tp": 2})
    assert both.candidates and all(c.layout.sequence_parallel for c in both.candidates)
    # every tp-2 layout with sp off was counted, once
    n_layouts = len(layouts(DEEP, 8, 512, max_tp=8, fixed={"tp": 2}, rejected=Counter()))
    assert both.rejected[SP_OFF_DOMINATED] == n_layouts // 2
    off = plan(DEEP, GPU, 8, wl, capacity_bytes=2**30, fixed={"tp": 2, "sp": False})
    assert off.candidates and not any(c.layout.sequence_parallel for c in off.candidates)
    assert SP_OFF_DOMINATED not in off.rejected
    # seq 255 is not divisible by tp 2: sp on is impossible, so off is planned
    odd = plan(TINY, GPU, 4, memplan.make_workload(TINY, seq_len=255, global_batch_size=8),
               fixed={"tp": 2, "pp": 1})
    assert odd.candidates and not any(c.layout.sequence_parallel for c in odd.candidates)


def test_a_recompute_policy_is_kept_only_when_it_fits_more() -> None:
    wl = memplan.make_workload(DEEP, seq_len=512, global_batch_size=64)
    result = plan(DEEP, GPU, 8, wl, capacity_bytes=2**29, fixed={"tp": 1, "pp": 2, "vpp": 1})
    by_layout: dict = {}
    for c in result.candidates:
        by_layout.setdefault(c.layout, []).append(c)
    order = {p: i for i, p in enumerate(_policies(list(RECOMPUTE_ORDER), 4))}
    assert any(len(cs) > 1 for cs in by_layout.values())
    for cs in by_layout.values():  # more recompute, strictly larger micro-batch
        cs.sort(key=lambda c: order[(c.recompute, c.recompute_layers)])
        assert [c.micro_batch_size for c in cs] == sorted({c.micro_batch_size for c in cs})


def test_step_times_with_float8_and_async_tp_equal_step_time() -> None:
    """The vectorised pass and the one-layout pass agree with float8's casts (per TP degree
    and sequence parallelism) and async TP's fused share (per sequence parallelism)."""
    rng = random.Random(2)
    spec = memplan.load_model("llama-2-7b")
    for float8 in ("tensorwise", "rowwise", "none"):
        wl = memplan.make_workload(spec, seq_len=2048, compile=True, async_tp=True,
                                   float8=float8)
        rows = []
        for _ in range(60):
            tp, pp = rng.choice((1, 2, 8)), rng.choice((1, 2))
            par = memplan.ParallelConfig(tp=tp, pp=pp, cp=rng.choice((1, 2)),
                                         dp=rng.choice((1, 4)), zero=rng.choice((0, 3)),
                                         sequence_parallel=rng.random() < 0.5)
            rows.append((par, wl.model_copy(update={"micro_batch_size": rng.choice((1, 4))}),
                         rng.choice((1, 8)), rng.randrange(1, 10**10)))
        flops = [step_flops(spec, w, 512, pp=par.pp) for par, w, _, _ in rows]
        cols = Columns.of([r[0] for r in rows], [r[1].micro_batch_size for r in rows],
                          [r[2] for r in rows], [r[3] for r in rows],
                          num_layers=spec.num_layers,
                          balance=[stage_balance(spec, w, par.pp) for par, w, _, _ in rows])
        times = step_times(spec, GPU, wl, 512, cols, np.array([f[0] for f in flops]),
                           np.array([f[1] for f in flops]))
        for i, (par, w, m, params) in enumerate(rows):
            one = step_time(spec, GPU, par, w, 512, m, params)
            assert times.at(i).step_s == pytest.approx(one.step_s, rel=1e-12), (float8, i)
