"""Search layouts, micro-batch sizes and recompute policies that fit, ranked by step time.

For every layout (tp, pp with virtual stages, cp, ep, dp derived, ZeRO stage, sequence
parallelism on and off) and recompute policy the planner finds the largest micro-batch that fits
in ``capacity * (1 - safety)``, for all layouts at once (``search``: the answer a brute
force over ``estimate`` gives), times every feasible candidate in one vectorised pass of the
step-time model, and ranks them. Every rejected layout keeps its reason.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any

from memplan.errors import LayoutError, MemplanError
from memplan.hardware import GpuSpec
from memplan.model import te_fp8
from memplan.model.collector import with_older_frozen
from memplan.model.estimate import Estimate, estimate
from memplan.model.memo import fewest_stage_params
from memplan.overheads import Overheads, default_overheads, with_library_workspaces
from memplan.parallel import (
    INTERLEAVED_MICROBATCHES,
    ParallelConfig,
    ZeroStage,
    cp_rule,
    ep_rule,
    expert_rule,
    gbs_rule,
    gpus_rule,
    pipeline_only,
    rank_layers,
    tp_rule,
    validate,
    weighted_split,
)
from memplan.planning.ahead import Ahead, jobs
from memplan.planning.batch_sizes import MAX_MBS, divisors, micro_batch_sizes
from memplan.presets import accumulation_refused
from memplan.planning.search import Found, Job, Search, _with_mbs, evaluate
from memplan.planning.timing import (
    Columns,
    StepTime,
    StepTimes,
    recomputed_share,
    stage_balance,
    step_flops,
    step_times,
    step_times_rows,
)
from memplan.spec import ModelSpec
from memplan.workload import PipelineSplit, Recompute, Workload

DEFAULT_SAFETY = 0.05  # keep 5% of capacity free for what no model counts (stated assumption)
# Llama 2 and 3 trained with about 4M tokens per step (Touvron et al. 2023; Dubey et al. 2024)
DEFAULT_TOKENS_PER_STEP = 4 * 1024 * 1024
# Search bounds, stated: up to 4 model chunks per pipeline rank (Megatron-LM's interleaving
# gains little beyond), and context parallelism only above 8k tokens: the published runs use it
# for long sequences only (Llama 3: CP 16 at 128K and none at 8K, Dubey et al. 2024, Table 4;
# torchtitan's benchmarks from 32K), and at 8K attention is a few percent of the FLOPs, so CP's
# per-layer costs the time model does not have (kernel launches per ring step, the chunk
# reordering) weigh more than the ring it models. Give --cp to search it anyway.
MAX_VPP = 4
# ... and, beyond those, every count up to 8 chunks per rank (Llama 3 405B ran 8, Dubey et al.
# 2024, section 3.3.2) at which the layers split evenly, or evenly with the embedding and the
# loss counted as a layer each (Megatron-LM's --account-for-embedding-in-pipeline-split and
# --account-for-loss-in-pipeline-split: with one layer a chunk, the first chunk holds the
# embedding alone and the last the output layer and loss alone, Llama 3's 0,1x126,0)
MAX_SPLIT_VPP = 8
# pipeline degrees searched beyond the layers' divisors: powers of two up to 16 (the largest
# published dense runs use 16: Llama 3 405B, Dubey et al. 2024, section 3.3.2), and uneven
# splits with at least two layers on every virtual stage
MAX_PP = 16
MIN_STAGE_LAYERS = 2
LONG_SEQ = 16384
RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
# searched only when asked (``recompute=[ops]``): each layout's fit upgraded to the save set of
# least recompute that fits at its micro-batch (``_with_save_set``)
ASKED_ONLY = (Recompute.OPS,)
SP_OFF_DOMINATED = "sp off: sp on needs no more memory and no more time at any micro-batch"
SLOWER_THAN_TOP = ("slower at every micro-batch than the top {top} found, with every recompute "
                   "policy not found out of memory")
# a bound beats a time only by more than float rounding could make up
ROUNDING = 1e-9
# Rejections the planner finds before ``validate``, keyed as ``LayoutError.rule`` is (no
# numbers), with the rule text of the core's own check, so a plan counts them as one.
NO_INTERLEAVED_SPLIT = INTERLEAVED_MICROBATCHES  # for every micro-batch size (``_sizes``)


@dataclass(frozen=True)
class Candidate:
    """A feasible configuration: the largest micro-batch that fits with this recompute.

    ``estimate`` is built when first read, from ``inputs`` (a plan ranks hundreds of
    candidates and shows a few), unless one was given; ``peak_bytes`` is the search's,
    equal to that estimate's."""

    layout: ParallelConfig
    micro_batch_size: int
    recompute: Recompute
    recompute_layers: int | None  # full recompute of this many layers per stage; None: all
    given: Estimate | None
    time: StepTime
    known_peak_bytes: int | None = None
    # (spec, gpu, workload of this recompute policy and global batch, capacity bytes)
    inputs: tuple | None = field(default=None, repr=False, compare=False)
    # with recompute ops: what each layer keeps (``memplan.model.sac_ops``)
    recompute_save: tuple[str, ...] = ()
    # parameters of the most loaded rank before ZeRO sharding (the step-time model's input)
    num_params: int = field(default=0, repr=False, compare=False)

    @cached_property
    def estimate(self) -> Estimate:
        if self.given is not None:
            return self.given
        assert self.inputs is not None
        spec, gpu, wl, capacity = self.inputs
        return estimate(spec, gpu, self.layout,
                        wl.model_copy(update={"micro_batch_size": self.micro_batch_size}),
                        capacity_bytes=capacity)

    @property
    def peak_bytes(self) -> int:
        return self.estimate.peak_bytes if self.known_peak_bytes is None else self.known_peak_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.estimate.capacity_bytes if self.inputs is None else self.inputs[3]

    @property
    def workload(self) -> Workload:
        """The workload it was searched with (its micro-batch aside): a plan over several
        workloads (``merge``, DeepSpeed's reduce bucket sizes) tells them apart by it."""
        return self.estimate.workload if self.inputs is None else self.inputs[2]


@dataclass
class PlanResult:
    candidates: list[Candidate]
    rejected: Counter = field(default_factory=Counter)
    evaluated: int = 0  # exact memory evaluations of the most loaded rank
    replayed: int = 0  # configurations replayed through the caching-allocator model
    searched: int = 0  # (layout, recompute, micro-batch) candidates the search covered
    global_batch_size: int = 0
    oom_excess_bytes: int | None = None  # smallest overshoot of a configuration that did not fit
    closest_miss: Miss | None = None  # that configuration
    budget_bytes: int = 0  # what a configuration may peak at: capacity * (1 - safety)
    # what the search could not express and searched instead (``_expressible``)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Miss:
    """The configuration that came closest to fitting, and its peak."""

    layout: ParallelConfig
    micro_batch_size: int
    recompute: Recompute
    recompute_layers: int | None
    peak_bytes: int
    stage: int  # its most loaded pipeline stage


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def pipeline_splits(num_layers: int, pp: int, vpp: int,
                    rule: PipelineSplit) -> list[tuple[int, ...] | None]:
    """The layer splits searched for ``pp`` x ``vpp`` virtual stages (None: equal parts).
    torchtitan's rule gives its one split; otherwise the equal split where it divides and the
    split that counts the embedding and the head as a layer each (``weighted_split``: one
    layer fewer on the first and the last stage, as Llama 3's 405B run and torchtitan place
    them), which balances the stages' compute where the head is heavy."""
    parts = pp * vpp
    if pp == 1:
        return [None]
    weighted = weighted_split(num_layers, parts)
    uneven = weighted if weighted and len(set(weighted)) > 1 else None
    if rule is PipelineSplit.WEIGHTED:
        return [uneven] if weighted else []
    even = num_layers % parts == 0
    out: list[tuple[int, ...] | None] = [None] if even else []
    # beside an even split, only without interleaving: there the head's share is a whole
    # stage's imbalance; with chunks the split is searched where no even one exists
    if uneven and min(uneven) >= MIN_STAGE_LAYERS and (not even or vpp == 1):
        out.append(uneven)
    elif not even and num_layers + 2 == parts:  # one layer a chunk: embedding- and head-only
        out.append((0,) + (1,) * num_layers + (0,))
    return out


def vpp_choices(num_layers: int, pp: int) -> list[int]:
    """Model chunks per pipeline rank searched: 1 to ``MAX_VPP``, and up to ``MAX_SPLIT_VPP``
    those at which the layers split evenly, or evenly with the embedding and the loss counted
    as a layer each."""
    if pp == 1:
        return [1]
    return [v for v in range(1, MAX_SPLIT_VPP + 1)
            if v <= MAX_VPP or num_layers % (pp * v) == 0 or (num_layers + 2) % (pp * v) == 0]


def layouts(spec: ModelSpec, num_gpus: int, seq_len: int, *, max_tp: int,
            fixed: dict[str, object], rejected: Counter,
            split_rule: PipelineSplit = PipelineSplit.EVEN,
            node_size: int = 8) -> list[ParallelConfig]:
    """Every layout of ``num_gpus`` the model can be split into, with ``fixed`` values kept.
    With tp > 1 sequence parallelism is searched both ways unless fixed. Pipeline degrees
    are the divisors of the layers and the powers of two up to them (with uneven splits,
    ``pipeline_splits``); ZeRO-3 is searched with the shard group over all of dp and, where
    smaller, over one node (HSDP: ``dp_shard`` ranks of a node, replicated across nodes)."""
    def choices(name: str, default: list) -> list:
        return [fixed[name]] if fixed.get(name) is not None else default

    fixed = _fixed_checked(fixed)
    out = []
    for tp in choices("tp", [t for t in _powers_of_two(max_tp)]):
        if (err := tp_rule(spec, tp)) is not None:
            rejected[err.rule] += 1
            continue
        pps = sorted({p for p in divisors(spec.num_layers) if p <= MAX_PP}
                     | set(_powers_of_two(min(spec.num_layers, MAX_PP))))
        for pp in choices("pp", pps):
            for cp in choices("cp", [c for c in _powers_of_two(8 if seq_len >= LONG_SEQ else 1)
                                     if cp_rule(seq_len, c) is None]):
                if (err := gpus_rule(num_gpus, tp, pp, cp)) is not None:
                    rejected[err.rule] += 1
                    continue
                dp = num_gpus // (tp * pp * cp)
                expert_splits = _expert_splits(spec, tp, dp * cp, fixed)  # any vpp and split
                node_shard = node_size // (tp * cp) if node_size % (tp * cp) == 0 else 0
                vpps = vpp_choices(spec.num_layers, pp)
                given = fixed.get("stage_layers")
                if given is not None:  # a given split says how many virtual stages
                    vpps = [len(given) // pp] if len(given) % pp == 0 else [1]
                for vpp in choices("vpp", vpps):
                    splits = ([fixed["stage_layers"]] if fixed.get("stage_layers") is not None
                              else pipeline_splits(spec.num_layers, pp, vpp, split_rule))
                    if not splits:
                        rejected["no pipeline split of the layers"] += 1
                        continue
                    for split, (ep, etp), zero, sp in (
                            (sl, e, z, s) for sl in splits
                            for e in expert_splits
                            for z in choices("zero", [0, 1, 2, 3])
                            for s in choices("sp", [True, False] if tp > 1 else [False])):
                        for shard in choices("dp_shard", _shards(dp, zero, ep, node_shard,
                                                                 etp)):
                            out.append(_layout(tp, pp, vpp, dp, cp, ep, zero, bool(sp), split,
                                               shard, etp,
                                               fixed.get("vpp_group") if vpp > 1 else None,
                                               fixed.get("offload") or frozenset()))
    return out


# ``layouts``' fixed values and the layout fields they set
FIXED_FIELDS = {"tp": "tp", "pp": "pp", "vpp": "vpp", "cp": "cp", "ep": "ep", "etp": "etp",
                "vpp_group": "vpp_group", "zero": "zero", "sp": "sequence_parallel",
                "stage_layers": "stage_layers", "dp_shard": "dp_shard", "offload": "offload"}


def _fixed_checked(fixed: dict[str, object]) -> dict[str, object]:
    """``fixed`` with each layout value given converted and checked as its field
    (``ParallelConfig``'s checks, once a plan): the layouts are then made unchecked
    (``_layout``)."""
    given = [k for k, v in fixed.items() if k in FIXED_FIELDS and v is not None]
    par = ParallelConfig(**{FIXED_FIELDS[k]: fixed[k] for k in given})  # type: ignore[arg-type]
    return {**fixed, **{k: getattr(par, FIXED_FIELDS[k]) for k in given}}


def _expert_splits(spec: ModelSpec, tp: int, dp_cp: int,
                   fixed: dict[str, object]) -> list[tuple[int, int | None]]:
    """(ep, etp) pairs searched: each ep dividing the experts, with the experts split by tp
    (etp None) where ``ep_rule`` allows it, else by the largest etp below tp that allows it
    (``expert_rule``: ep * etp within tp * dp * cp, as Megatron-LM's MoE layouts use). A
    smaller etp for the same ep is not searched: it holds more of the expert weights and
    their inner activations, and the step-time model times both alike. A given etp is kept."""
    if spec.moe is None:  # a dense model: ep 1 (another given ep is not a layout of it)
        return [(1, None)] if fixed.get("ep") in (None, 1) else []
    experts, ffn = spec.moe.num_experts, spec.moe.expert_ffn_hidden_size
    eps = [fixed["ep"]] if fixed.get("ep") is not None else divisors(experts)
    given = fixed.get("etp")
    # in order of preference: by tp (None; a given etp equal to tp is tp's split), else the
    # etps below tp, largest first
    below = sorted((t for t in divisors(tp) if t < tp), reverse=True)
    etps: list[int | None] = ([None, *below] if given is None
                              else [None if given == tp else given])  # type: ignore[list-item]
    out: list[tuple[int, int | None]] = []
    for ep in eps:
        for etp in etps:
            broken = (ep_rule(experts, ep, dp_cp) if etp is None
                      else expert_rule(experts, ffn, ep, etp, tp * dp_cp))
            if broken is None:
                out.append((ep, etp))
                break
    return out


def _shards(dp: int, zero: int, ep: int, node_shard: int,
            etp: int | None = None) -> list[int | None]:
    """Shard groups searched: all of dp, and for ZeRO-3 one node's worth where smaller."""
    out: list[int | None] = [None]
    if zero == 3 and ep == 1 and etp is None and 1 < node_shard < dp and dp % node_shard == 0:
        out.append(node_shard)
    return out


@lru_cache(maxsize=16384)
def _layout(tp: int, pp: int, vpp: int, dp: int, cp: int, ep: int, zero: int,
            sp: bool, split: tuple[int, ...] | None = None,
            shard: int | None = None, etp: int | None = None,
            group: int | None = None, offload: frozenset = frozenset()) -> ParallelConfig:
    """One object per layout, so caches keyed by it hit by identity across plans. Made
    without the fields' checks (``model_construct``): the search's own values, each of its
    field's type and within its bounds (``layouts`` enumerates them; the record checked
    field by field is the same, tests/unit/test_layouts.py); the layout's rules are
    ``validate``'s, which the search runs on each (``_usable``)."""
    return ParallelConfig.model_construct(
        tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep, zero=ZeroStage(zero),
        sequence_parallel=sp, stage_layers=split, dp_shard=shard, etp=etp, vpp_group=group,
        offload=offload)


@lru_cache(maxsize=4096)
def _fewest_layers(num_layers: int, pp: int, vpp: int, split: tuple[int, ...] | None) -> int:
    """The fewest decoder layers a pipeline rank holds (``rank_layers``)."""
    return min(rank_layers(num_layers, pipeline_only(pp, vpp, split)))


def _policies(allowed: tuple[Recompute, ...] | list[Recompute], stage_layers: int
              ) -> list[tuple[Recompute, int | None]]:
    """``_policy_tuple`` as a list of each layout's own."""
    return list(_policy_tuple(tuple(allowed), stage_layers))


@lru_cache(maxsize=1024)
def _policy_tuple(allowed: tuple[Recompute, ...], stage_layers: int
                  ) -> tuple[tuple[Recompute, int | None], ...]:
    """Recompute policies in order of extra compute: none, selective, full on an eighth,
    a quarter, ... seven eighths of each stage's layers (every k of a stage of 8 layers or
    fewer: Llama 3's 405B layout recomputes k of 8), full on all."""
    out: list[tuple[Recompute, int | None]] = []
    for policy in (*RECOMPUTE_ORDER[:2], *ASKED_ONLY, *RECOMPUTE_ORDER[2:]):
        if policy not in allowed:
            continue
        if policy is Recompute.OPS:  # keeping nothing first: the set is chosen per fit
            out.append((policy, ()))  # type: ignore[arg-type]
            continue
        if policy is Recompute.FULL:
            parts = sorted({stage_layers * q // 8 for q in range(1, 8)} - {0, stage_layers})
            out += [(policy, k) for k in parts]
            out.append((policy, None))
        else:
            out.append((policy, None))
    return tuple(out)


@with_older_frozen  # its collections walk only what it makes (``memplan.model.collector``)
def plan(spec: ModelSpec, gpu: GpuSpec, num_gpus: int, wl: Workload, *,
         capacity_bytes: int | None = None, safety: float = DEFAULT_SAFETY,
         max_tp: int | None = None, fixed: dict[str, object] | None = None,
         recompute: list[Recompute] | None = None, top: int | None = None,
         reserved: bool = False) -> PlanResult:
    """Feasible candidates ranked by step time (fastest first), and rejections by reason.

    The search fits each layout's tensor peak and fixed overheads (a lower bound of what the
    device holds); with ``reserved`` each candidate, fastest first, is then checked against
    the caching allocator's reserved peak (``_fit_reserved``), its micro-batch lowered until
    that fits, and its peak is that reserved one.

    With ``top`` only the ``top`` fastest are sure to be among the candidates: a recompute
    policy of a layout is not searched when no micro-batch it could fit would be faster than
    the ``top``-th fastest candidate found with cheaper policies (``_fastest_possible``), so
    the first ``top`` candidates are those of the full search (in the same order). With
    ``reserved`` as well, the check may turn down some of those and take slower ones: where
    it took one that a skipped policy could have beaten, the search runs again with every
    policy kept that could be as fast (``_plan_once``), and where fewer than ``top`` passed
    it, again for twice as many, so the ``top`` shown are those the check gives over the
    full search."""
    if not 0 <= safety < 1:
        raise MemplanError(f"safety must be in [0, 1), got {safety}")
    if top is not None and top < 1:
        raise MemplanError(f"top must be at least 1, got {top}")
    wl = te_fp8.for_gpu(wl, gpu)  # (the GPU decides TE fp8's transposes)
    capacity = capacity_bytes or gpu.memory_bytes
    gbs = wl.global_batch_size or max(1, DEFAULT_TOKENS_PER_STEP // wl.seq_len)
    result = PlanResult(candidates=[], global_batch_size=gbs)
    pars = _sp_on_where_possible([
        par for par in layouts(spec, num_gpus, wl.seq_len, max_tp=max_tp or gpu.gpus_per_node,
                               fixed=fixed or {}, rejected=result.rejected,
                               split_rule=wl.pipeline_split, node_size=gpu.gpus_per_node)
        if _usable(spec, par, wl, gbs, result.rejected)], result.rejected)
    ctx = _Context(spec, gpu, _with_gbs(wl, gbs), int(capacity * (1 - safety)),
                   with_library_workspaces(default_overheads(gpu), gpu, wl.te_grouped_gemm,
                                           wl.te_gemm_workspace, wl.te_ub_workspace),
                   capacity)
    allowed = _expressible(spec, wl, tuple(recompute or RECOMPUTE_ORDER), result.notes)
    if Recompute.OPS in allowed and Recompute.NONE in allowed:
        ctx.per_layout = frozenset({Recompute.OPS, Recompute.NONE})
    policies = [_policies(allowed, _fewest_layers(spec.num_layers, p.pp, p.vpp, p.stage_layers))
                for p in pars]
    workers = jobs() if reserved and _AHEAD[0] is None else 1
    if workers > 1:  # the reserved check's replays made ahead (``memplan.planning.ahead``)
        _AHEAD[0] = Ahead(_replay_peak, workers)
    try:
        return _searched(ctx, pars, policies, top, reserved, result)
    finally:
        if workers > 1:
            _AHEAD[0].close()  # type: ignore[union-attr]
            _AHEAD[0] = None


def _searched(ctx: _Context, pars: list[ParallelConfig],
              policies: list[list[tuple[Recompute, int | None]]], top: int | None,
              reserved: bool, result: PlanResult) -> PlanResult:
    """``plan``'s searches, again while the reserved check is not sure (``_plan_once``)."""
    keep, spent, wanted = 0.0, (0, 0), top
    while True:  # (with ``top`` and ``reserved``: until the reserved check is sure)
        found, again = _plan_once(ctx, pars, policies, top, reserved, keep,
                                  replace(result, rejected=Counter(result.rejected)), wanted)
        found.evaluated += spent[0]
        found.replayed += spent[1]
        if again is None:
            return found
        spent = (found.evaluated, found.replayed)
        ctx.again = True  # (the rows the searches timed are read back from now on)
        if again == float("inf"):
            # Fewer than ``top`` fit the reserved check: search again for twice as many
            # (each search skips less than the last, so this ends; at the latest with
            # nothing skipped, when the answer is the full search's whatever it is).
            wanted = 2 * wanted  # type: ignore[operator]  (again is set: top is set)
            continue
        # The reserved check took candidates slower than the search was sure of: search
        # again, keeping every policy that could be as fast as the slowest it took (a
        # larger ``keep`` each time, so this ends; at the latest with nothing skipped).
        keep = again


def _plan_once(ctx: _Context, pars: list[ParallelConfig],
               policies: list[list[tuple[Recompute, int | None]]], top: int | None,
               reserved: bool, keep: float, result: PlanResult,
               wanted: int | None = None) -> tuple[PlanResult, float | None]:
    """One search for the ``wanted`` fastest (``top`` unless given; no policy skipped that
    could be as fast as ``keep`` step seconds) and its ranking (``plan``), the reserved
    check stopping at ``top``; beside it None where the check's answer is the full
    search's, inf where fewer than ``top`` passed it, else the ``keep`` to search again
    with."""
    before = ctx.evaluated
    wanted = top if wanted is None else wanted
    levels, pruned, sure = _search_levels(ctx, pars, policies, wanted, keep)
    fits, sure_ops = _with_all_save_sets(ctx, [fit for level in levels
                                               for fit in level.fits(pars, policies)], wanted,
                                         result.rejected, keep, top)
    fits.sort(key=lambda f: (f.layout, f.level))  # a layout's policies in order of compute
    without = set(range(len(pars))) - {f.layout for f in fits}
    if without - pruned:
        result.rejected["out of memory at the smallest micro-batch with every recompute policy"] \
            += len(without - pruned)
    if without & pruned:
        result.rejected[SLOWER_THAN_TOP.format(top=top)] += len(without & pruned)
    result.budget_bytes = ctx.budget
    result.closest_miss = _closest_miss(ctx, levels)
    taken: list[float] = []  # step seconds of each candidate the reserved check took
    result.candidates = (_fit_reserved(ctx, _ranked(ctx, fits), top, result, taken)
                         if reserved else _ranked(ctx, fits))
    if result.closest_miss is not None:
        result.oom_excess_bytes = result.closest_miss.peak_bytes - ctx.budget
    result.evaluated = (ctx.evaluated - before
                        + sum(level.search.evaluated for level in levels))
    result.searched = sum(level.found.searched for level in levels)
    # Every candidate of the full search faster than ``sure`` is among these, the same (what
    # was skipped could be no faster). The reserved check takes candidates in order of
    # their step time until ``top`` fit: its answer is the full search's where each it took
    # is faster than ``sure`` and ``top`` fit (else the full search has more to take).
    sure = min(sure, sure_ops)
    if not reserved or sure == float("inf"):
        return result, None
    if len(result.candidates) < top:  # type: ignore[operator]  (sure < inf: top is set)
        return result, float("inf")
    slowest = max(taken, default=0.0)
    return result, (None if slowest < sure else slowest)


OPS_NOT_MODELLED = ("recompute ops: op-level save sets are not modelled here ({why}); "
                    "searched the whole recompute levels instead (none, selective, full, "
                    "full on k layers)")


def _expressible(spec: ModelSpec, wl: Workload, allowed: tuple[Recompute, ...],
                 notes: list[str]) -> tuple[Recompute, ...]:
    """The recompute policies to search: op-level checkpointing (``--recompute auto``)
    where memplan models the layer's ops (``memplan.model.sac_ops.ops_refusal``; the
    refusal reads the model and the workload, not the layout), else the whole levels in
    its place, with a note saying why in ``notes``: a plan that answers with what it can
    express, and says what it could not, rather than none."""
    if Recompute.OPS not in allowed:
        return allowed
    from memplan.model.sac_ops import ops_refusal

    why = ops_refusal(spec, wl)
    if why is None:
        return allowed
    notes.append(OPS_NOT_MODELLED.format(why=why))
    levels = [r for r in allowed if r is not Recompute.OPS]
    return tuple(levels + [r for r in RECOMPUTE_ORDER if r not in levels])


def merge(results: list[PlanResult]) -> PlanResult:
    """Plans of one model, GPUs and global batch over different workloads (DeepSpeed's reduce
    bucket sizes) as one: every candidate, fastest first and among equals the one with most
    headroom (as ``_ranked``); rejections and evaluations summed (a layout counts once per
    workload); the closest miss the smallest peak of theirs. Of candidates with the same
    layout, micro-batch and recompute only the one with the smallest peak is kept (the first
    workload's where they are equal)."""
    if len(results) == 1:
        return results[0]
    best: dict[tuple, Candidate] = {}
    for r in results:
        for c in r.candidates:
            key = (c.layout, c.micro_batch_size, c.recompute, c.recompute_layers)
            if key not in best or c.peak_bytes < best[key].peak_bytes:
                best[key] = c
    out = PlanResult(candidates=sorted(best.values(),
                                       key=lambda c: (c.time.step_s, c.peak_bytes)),
                     global_batch_size=results[0].global_batch_size,
                     budget_bytes=results[0].budget_bytes)
    for r in results:
        out.rejected.update(r.rejected)
        out.evaluated += r.evaluated
        out.searched += r.searched
        out.notes += [n for n in r.notes if n not in out.notes]
    misses = [r.closest_miss for r in results if r.closest_miss is not None]
    if misses:
        out.closest_miss = min(misses, key=lambda m: m.peak_bytes)
        out.oom_excess_bytes = out.closest_miss.peak_bytes - out.budget_bytes
    return out


NO_SINGLE_MICRO_BATCH = (f"optimizer_in_backward needs one micro-batch per step: gbs = mbs x dp "
                         f"with mbs at most {MAX_MBS} (give --gbs)")


def _sizes(par: ParallelConfig, wl: Workload, gbs: int) -> tuple[int, ...]:
    """The micro-batch sizes searched: ``micro_batch_sizes``; with the optimizer stepped in
    backward, or a layout the framework offers without accumulation only
    (``presets.accumulation_refused``), the one that makes a single micro-batch per step."""
    sizes = micro_batch_sizes(par, gbs)
    single = wl.optimizer_in_backward or _accumulation_refused(par, wl) is not None
    return tuple(b for b in sizes if b * par.dp == gbs) if single else sizes


@lru_cache(maxsize=4096)
def _accumulation_refused(par: ParallelConfig, wl: Workload) -> str | None:
    return accumulation_refused(par, wl)


def _usable(spec: ModelSpec, par: ParallelConfig, wl: Workload, gbs: int,
            rejected: Counter) -> bool:
    """Whether ``estimate`` can evaluate ``par`` at some micro-batch; if not, its rule is
    counted in ``rejected``."""
    if (err := gbs_rule(gbs, par.dp)) is not None:
        rejected[err.rule] += 1
        return False
    sizes = _sizes(par, wl, gbs)
    refused = _accumulation_refused(par, wl)
    if not sizes:
        rejected[NO_INTERLEAVED_SPLIT if not micro_batch_sizes(par, gbs) else
                 NO_SINGLE_MICRO_BATCH if wl.optimizer_in_backward else
                 f"{refused} at any micro-batch: gbs = mbs x dp with mbs at most {MAX_MBS}"] += 1
        return False
    try:  # (at the one micro-batch searched where the framework refuses accumulation)
        validate(spec, par, wl if refused is None else wl.model_copy(
            update={"micro_batch_size": sizes[0], "global_batch_size": gbs}))
    except LayoutError as err:
        rejected[err.rule] += 1
        return False
    except MemplanError as err:  # a check not yet raising LayoutError: its whole message
        rejected[str(err)] += 1
        return False
    return True


def _sp_on_where_possible(pars: list[ParallelConfig], rejected: Counter) -> list[ParallelConfig]:
    """Layouts with sequence parallelism off (tp > 1) are dropped where the same layout with
    it on is one of ``pars``: sequence parallelism splits the residual-stream activations by
    tp and leaves everything else a rank holds as it is (``memplan.model.dims``), and it
    splits the pipeline sends by tp (``memplan.planning.timing``), so with it on a layout needs no
    more memory and no more time at every micro-batch (tests/unit/test_planner_vector.py checks this
    over a grid). Off stays where on is not possible (tp does not divide the sequence) or was
    ruled out by the caller."""
    usable = set(pars)
    out = []
    for par in pars:
        if par.tp > 1 and not par.sequence_parallel and _layout(
                par.tp, par.pp, par.vpp, par.dp, par.cp, par.ep, int(par.zero), True,
                par.stage_layers, par.dp_shard, par.etp, par.vpp_group, par.offload) in usable:
            rejected[SP_OFF_DOMINATED] += 1
        else:
            out.append(par)
    return out


@dataclass
class _Context:
    spec: ModelSpec
    gpu: GpuSpec
    wl: Workload  # the plan's workload with its global batch size
    budget: int  # bytes a configuration may peak at
    ovh: Overheads
    capacity: int
    evaluated: int = 0  # exact evaluations beyond the searches'
    # every search's evaluations, by (layout, workload, size): a search again repeats some
    known: dict = field(default_factory=dict)
    # the step seconds of every (layout, policy, micro-batch, parameters) row timed
    # (``_row_seconds``): in the first search kept as timed (``timed``, rows and seconds),
    # by row once a search runs again (``again``)
    step_s: dict = field(default_factory=dict)
    timed: list = field(default_factory=list)
    again: bool = False
    # op-level save sets' peaks, by (layout, workload, micro-batch) (``_with_save_set``: the
    # most loaded rank's) and by (layout, workload, micro-batches) (``_with_stage_sets``: every
    # stage's): a search again chooses many of the same sets
    ops_peaks: dict = field(default_factory=dict)
    # the policies of which a layout's fastest micro-batch alone is a candidate: op-level
    # checkpointing's, and under ``recompute auto`` no recompute's too (``_ranked``)
    per_layout: frozenset = frozenset({Recompute.OPS})

    def workload(self, policy: tuple[Recompute, int | None]) -> Workload:
        return _policy_workload(self.wl, *policy)


@lru_cache(maxsize=256)
def _with_gbs(wl: Workload, gbs: int) -> Workload:
    return wl.model_copy(update={"global_batch_size": gbs})


@lru_cache(maxsize=256)
def _policy_workload(wl: Workload, policy: Recompute, layers: object) -> Workload:
    if policy is Recompute.OPS:  # (OPS, the save set)
        return wl.model_copy(update={"recompute": policy, "recompute_layers": None,
                                     "recompute_save": tuple(sorted(layers))})  # type: ignore
    return wl.model_copy(update={"recompute": policy, "recompute_layers": layers})


def _with_save_sets(ctx: _Context, fit: _Fit,
                    bounds: list[float] | None = None) -> list[_Fit]:
    """A fit of op-level checkpointing (found keeping nothing at its largest micro-batch)
    at that micro-batch and at each smaller one that splits the batch (halving it), each with
    its save set of least recompute that fits (``_with_save_set``); ``_ranked`` keeps the
    fastest of a layout's. ``bounds``: the least step seconds at each of those micro-batches
    (every item kept): one whose bound is above the time a larger micro-batch took is not
    searched (``_ranked`` would not keep it)."""
    if fit.policy[0] is not Recompute.OPS:
        return [fit]
    sizes = _ops_sizes(ctx, fit)
    out: list[_Fit] = []
    known = 0  # a smaller micro-batch fits at least the larger one's set
    fastest = float("inf")
    for k, b in enumerate(sizes):
        if bounds is not None and bounds[k] > fastest:
            continue
        out.append(_with_save_set(ctx, replace(fit, mbs=b), known))
        known = max(known, _set_index(ctx, out[-1]))
        if bounds is not None:
            fastest = min(fastest, _seconds(ctx, out[-1:])[0])
    return out


def _ops_sizes(ctx: _Context, fit: _Fit) -> list[int]:
    """The micro-batch sizes ``_with_save_sets`` tries for a fit."""
    per_replica = ctx.wl.global_batch_size // fit.par.dp
    sizes, mbs = [], fit.mbs
    while mbs >= 1:
        if per_replica % mbs == 0:
            sizes.append(mbs)
        mbs //= 2
    return sizes


def _with_all_save_sets(ctx: _Context, fits: list[_Fit], top: int | None,
                        rejected: Counter, keep: float = 0.0,
                        shown: int | None = None) -> tuple[list[_Fit], float]:
    """``_with_save_sets`` for every fit of op-level checkpointing; with ``top``, in order of
    the fastest each could be (every item kept, at its fastest micro-batch), stopping once
    that bound is no faster than the ``top``-th fastest fit found, nor than ``keep`` (the
    first ``top`` are those of the full search). Beside them: the least step seconds a fit
    not upgraded could take (inf: none). ``shown``: the plan's own ``top``, which the
    rejection's reason names (a search for more than it shows skips what is slower than
    every one shown once the plan is sure: ``_plan_once``)."""
    plain = [f for f in fits if f.policy[0] is not Recompute.OPS]
    ops = [f for f in fits if f.policy[0] is Recompute.OPS]
    if not ops or top is None:
        return plain + [w for f in ops for w in _with_save_sets(ctx, f)], float("inf")
    rows = [(f.par, _fastest_policy(ctx, f.policy), b, f.num_params)
            for f in ops for b in _ops_sizes(ctx, f)]
    step = _row_seconds(ctx, rows)
    bounds, at = [], 0
    for f in ops:
        n = len(_ops_sizes(ctx, f))
        bounds.append(step[at:at + n])
        at += n
    best = sorted(_seconds(ctx, plain)) if plain else []
    out = list(plain)
    for n, (each, f) in enumerate(sorted(zip(bounds, ops), key=lambda x: min(x[0]))):
        bound = min(each)
        if len(best) >= top and bound >= best[top - 1] and bound > keep:
            rejected[SLOWER_THAN_TOP.format(top=shown or top)] += len(ops) - n
            return out, bound
        found = _with_save_sets(ctx, f, each)
        out += found
        # the ranking keeps a layout's fastest micro-batch only (``_ranked``): one time a fit
        if found:
            best = sorted(best + [min(_seconds(ctx, found))])
    return out, float("inf")


def _set_index(ctx: _Context, fit: _Fit) -> int:
    """The position of a fit's save set on its layer's frontier."""
    from memplan.model.dims import Dims
    from memplan.model.layer import ops_search_items
    from memplan.planning.save_sets import frontier

    from memplan.model.sac_ops import for_stage

    wl = ctx.workload(fit.policy).model_copy(update={"micro_batch_size": fit.mbs})
    index = _frontier_index(frontier(ops_search_items(ctx.spec, wl,
                                                      Dims.of(ctx.spec, fit.par, wl))))
    # (a list per stage: every stage fits at least the smallest stage's set)
    return min(index.get(frozenset(for_stage(fit.policy[1], s)), 0)  # type: ignore[arg-type]
               for s in range(fit.par.pp))


_INDEXES: dict[int, tuple[tuple, dict[frozenset[str], int]]] = {}


def _frontier_index(sets: tuple) -> dict[frozenset[str], int]:
    """Each save set of a frontier (``save_sets.frontier``, one object per layer's items),
    by its items, at its first position; kept per frontier object (by identity: hashing a
    frontier of thousands of sets would cost more than the scan it saves)."""
    got = _INDEXES.get(id(sets))
    if got is not None and got[0] is sets:
        return got[1]
    index: dict[frozenset[str], int] = {}
    for i, c in enumerate(sets):
        index.setdefault(frozenset(c.kept), i)
    if len(_INDEXES) >= 256:
        del _INDEXES[next(iter(_INDEXES))]
    _INDEXES[id(sets)] = (sets, index)  # (holding the frontier: its id stays its own)
    return index


def _with_save_set(ctx: _Context, fit: _Fit, known: int = 0,
                   budget: int | None = None) -> _Fit:
    """A fit of op-level checkpointing (found keeping nothing) with the save set of least
    recompute that fits its layout at its micro-batch (``memplan.planning.save_sets``): a
    bisection of the layer's frontier, one evaluation per probe. ``budget``: the bytes the
    set's peak may reach (the plan's budget unless given); ``fit`` itself back where not even
    the empty set fits it."""
    from memplan.model.dims import Dims
    from memplan.model.layer import ops_forward_peaks, ops_search_items
    from memplan.planning.save_sets import choose, frontier

    wl = ctx.workload(fit.policy).model_copy(update={"micro_batch_size": fit.mbs})
    peaks: dict[tuple[str, ...], int] = {}
    budget = ctx.budget if budget is None else budget

    def fits(kept: tuple[str, ...]) -> int:
        key = (fit.par, ctx.workload((Recompute.OPS, kept)), fit.mbs)
        if key not in ctx.ops_peaks:  # (asked before: by an earlier search's choice)
            ctx.ops_peaks[key] = evaluate(ctx.spec, *key, ctx.ovh).peak_bytes
            ctx.evaluated += 1
        peaks[kept] = ctx.ops_peaks[key]
        return budget - peaks[kept]  # (how far from the budget: choose guesses with it)

    dm = Dims.of(ctx.spec, fit.par, wl)
    sets = frontier(ops_search_items(ctx.spec, wl, dm))
    forward = ops_forward_peaks(ctx.spec, wl, dm, sets)
    if fit.par.pp > 1:
        return _with_stage_sets(ctx, fit, sets, known, forward, budget)
    choice, _ = choose(sets, fits, known, forward)
    if choice is None:
        return fit
    if choice.kept not in peaks:  # ``known`` taken unasked: its peak at this micro-batch
        fits(choice.kept)
    return replace(fit, policy=(Recompute.OPS, choice.kept),  # type: ignore[arg-type]
                   peak_bytes=peaks[choice.kept])


def _with_stage_sets(ctx: _Context, fit: _Fit, sets: tuple, known: int,
                     forward: tuple[int, ...], budget: int) -> _Fit:
    """``_with_save_set`` under pipeline parallelism: each stage's own set
    (``save_sets.choose_per_stage``), one evaluation of every stage per probe."""
    from memplan.model.estimate import stage_peaks
    from memplan.model.sac_ops import stage_lists
    from memplan.planning.save_sets import choose_per_stage

    m = ctx.wl.global_batch_size // (fit.mbs * fit.par.dp)
    peaks: dict[tuple[str, ...], tuple[int, ...]] = {}

    def at(kept: tuple[str, ...]) -> tuple[int, ...]:
        wl = _with_mbs(ctx.workload((Recompute.OPS, kept)), fit.mbs)  # type: ignore[arg-type]
        key = (fit.par, wl, m)
        if key not in ctx.ops_peaks:  # (asked before: by an earlier search's choice)
            ctx.ops_peaks[key] = stage_peaks(ctx.spec, fit.par, wl, m, ctx.ovh)
            ctx.evaluated += 1
        peaks[kept] = ctx.ops_peaks[key]
        return peaks[kept]

    chosen, _ = choose_per_stage(sets, at, budget, known, forward)
    if any(c is None for c in chosen):
        return fit
    for c in {c.kept for c in chosen} - set(peaks):  # ``known`` taken unasked
        at(c)  # type: ignore[arg-type]
    kept = stage_lists([c.kept for c in chosen])  # type: ignore[union-attr]
    return replace(fit, policy=(Recompute.OPS, kept),  # type: ignore[arg-type]
                   peak_bytes=max(peaks[c.kept][i]  # type: ignore[union-attr]
                                  for i, c in enumerate(chosen)))


@dataclass(frozen=True)
class _Fit:
    """A fitting (layout, policy) at its largest micro-batch, as the search found it."""

    layout: int  # index into the plan's layouts
    level: int
    par: ParallelConfig
    policy: tuple[Recompute, int | None]
    mbs: int
    peak_bytes: int
    num_params: int  # of the most loaded rank, before ZeRO sharding


@dataclass(frozen=True)
class _Level:
    """The search of one recompute level: the i-th policy of each layout still searched."""

    index: int
    search: Search
    found: Found
    layouts: list[int]  # layout of each job

    def fits(self, pars: list[ParallelConfig],
             policies: list[list[tuple[Recompute, int | None]]]) -> list[_Fit]:
        f = self.found
        return [_Fit(i, self.index, pars[i], policies[i][self.index], int(f.mbs[k]),
                     int(f.peak_bytes[k]), int(f.num_params[k]))
                for k, i in enumerate(self.layouts) if f.mbs[k]]


def _search_levels(ctx: _Context, pars: list[ParallelConfig],
                   policies: list[list[tuple[Recompute, int | None]]],
                   top: int | None = None,
                   keep: float = 0.0) -> tuple[list[_Level], set[int], float]:
    """One search per recompute level, in order of extra compute. A policy with more recompute
    is kept only if it fits a larger micro-batch than the cheaper ones did (otherwise it costs
    compute for nothing), so each level searches above the largest fit before it, starting
    from the bytes per sample the cheaper policy showed (at most what this one needs).

    With ``top``, a layout's policy is searched only if it could beat the ``top``-th fastest
    fit so far (``_fastest_possible``). The layouts are then searched in batches, each through
    every level, those that could be fastest first (at their cheapest policy), so that the
    fits of a few set a bound that rules out the others' policies without a walk; a batch's
    search of a level is a ``_Level`` of its own. A policy that could be as fast as ``keep``
    step seconds is searched whatever the ``top``-th. Returned beside the levels: the layouts
    whose policies were skipped, and the least step seconds any skipped policy could take
    (inf: none skipped), below which every candidate of the full search is found."""
    above, slope = [0] * len(pars), [0.0] * len(pars)
    sizes = [_sizes(p, ctx.wl, ctx.wl.global_batch_size) for p in pars]
    levels: list[_Level] = []
    fit_times: list[float] = []  # step seconds of every fit so far (with ``top``)
    pruned: set[int] = set()
    skipped: dict[int, list[int]] = {}  # per layout, its levels skipped since one searched
    sure = float("inf")
    everyone = list(range(len(pars)))
    if top is None:
        batches = [everyone]
    else:  # in order of the fastest their cheapest policy could be
        fastest = _fastest_possible(ctx, [(pars[i], policies[i][0], sizes[i])
                                          for i in everyone if policies[i]], with_params=True)
        order = sorted((t, i) for t, i in zip(fastest, (i for i in everyone if policies[i])))
        batches = _batches([i for _, i in order], top)
        first = {i: t for t, i in order}
    for at, batch in enumerate(batches):
        if top is not None and len(fit_times) >= top:
            bound = max(sorted(fit_times)[top - 1] * (1 + ROUNDING), keep)
            if first[batch[0]] > bound:  # this batch and every later one: none could beat it
                pruned.update(i for rest in batches[at:] for i in rest)
                sure = min(sure, first[batch[0]])
                break
        for level in range(max((len(policies[i]) for i in batch), default=0)):
            index = [i for i in batch if level < len(policies[i]) and sizes[i][-1] > above[i]]
            if top is not None and len(fit_times) >= top and index:
                bound = max(sorted(fit_times)[top - 1] * (1 + ROUNDING), keep)
                # with the fewest parameters any of their stages holds (at the first level,
                # over every micro-batch: the bound they were ordered by)
                tight = ([first[i] for i in index] if level == 0 else
                         _fastest_possible(ctx, [(pars[i], policies[i][level],
                                                  [b for b in sizes[i] if b > above[i]])
                                                 for i in index], with_params=True))
                pruned.update(i for i, t in zip(index, tight) if t > bound)
                sure = min([sure, *(t for t in tight if t > bound)])
                for i, t in zip(index, tight):
                    if t > bound:
                        skipped.setdefault(i, []).append(level)
                index = [i for i, t in zip(index, tight) if t <= bound]
                index = _catch_up(ctx, pars, policies, index, skipped, sizes, above, slope,
                                  levels, fit_times)
            if not index:
                continue
            levels.append(_search_one(ctx, pars, policies, level, index, sizes, above, slope))
            if top is not None and (new := levels[-1].fits(pars, policies)):
                fit_times.extend(_seconds(ctx, new))
    return levels, pruned, sure


def _catch_up(ctx: _Context, pars: list[ParallelConfig],
              policies: list[list[tuple[Recompute, int | None]]], index: list[int],
              skipped: dict[int, list[int]], sizes: list[tuple[int, ...]], above: list[int],
              slope: list[float], levels: list[_Level], fit_times: list[float]) -> list[int]:
    """Of layouts ``index``, to be searched at a level, those with cheaper policies skipped
    have these searched first, in order: a level searches above the largest micro-batch the
    cheaper policies fit, and a skipped one's could be larger than what was searched (the
    step-time model does not always rank the policies as their order: selective recompute
    is slower than full recompute of a few layers on some layouts), so without them this
    level could report a fit the full search does not. Their fits are the full search's
    (slower than the ``top``-th: kept, as every fit found). Returns those of ``index`` with
    micro-batches still above their fits."""
    late = [i for i in index if skipped.get(i)]
    for level in sorted({lv for i in late for lv in skipped[i]}):
        again = [i for i in late if level in skipped[i] and sizes[i][-1] > above[i]]
        if again:
            levels.append(_search_one(ctx, pars, policies, level, again, sizes, above, slope))
            if new := levels[-1].fits(pars, policies):
                fit_times.extend(_seconds(ctx, new))
    for i in late:
        skipped[i] = []
    return [i for i in index if sizes[i][-1] > above[i]]


# With ``top``, layouts are searched in batches: the first of FIRST_BATCH, each next one
# GROWTH times the last (few searches, each vectorised over many layouts, the first small
# enough to set a bound early). Measured on seven top-10 plans (DeepSeek-V3 x 2048, Mixtral
# x 64, Qwen3-30B-A3B x 64, GPT-OSS-120B x 64, GLM-4.5 x 2048, Llama 3 70B x 64, Llama 3.1
# 8B x 8): 16 then x2 needed 3,610 evaluations in all, 32 then x1.5 3,589, 64 then x2 4,104;
# 16 then x1.5 the least wall time of those.
FIRST_BATCH = 16
GROWTH = 1.5


def _batches(index: list[int], top: int) -> list[list[int]]:
    """``index`` cut into consecutive batches of growing size."""
    out, at, size = [], 0, float(max(FIRST_BATCH, top))
    while at < len(index):
        out.append(index[at:at + int(size)])
        at, size = at + int(size), size * GROWTH
    return out


def _search_one(ctx: _Context, pars: list[ParallelConfig],
                policies: list[list[tuple[Recompute, int | None]]], level: int,
                index: list[int], sizes: list[tuple[int, ...]], above: list[int],
                slope: list[float]) -> _Level:
    """The search of the ``level``-th policy of layouts ``index``; ``above`` and ``slope``
    updated with what it found."""
    jobs = [Job(pars[i], ctx.workload(policies[i][level]), sizes[i], above[i]) for i in index]
    # Layouts differing only in ZeRO stage (or shard group) hold the same activations: one
    # leads its class.
    classes = None if level else [(p.tp, p.pp, p.vpp, p.cp, p.ep, p.etp,
                                   p.sequence_parallel, p.stage_layers)
                                  for p in (pars[i] for i in index)]
    search = Search(ctx.spec, jobs, ctx.budget, ctx.ovh, slopes=[slope[i] for i in index],
                    classes=classes, known=ctx.known)
    found = search.run()
    for k, i in enumerate(index):
        above[i], slope[i] = max(above[i], found.mbs[k]), found.slope[k]
    return _Level(level, search, found, index)


def _fastest_possible(ctx: _Context, rows: list[tuple[ParallelConfig,
                                                      tuple[Recompute, int | None],
                                                      list[int]]],
                      with_params: bool = False) -> list[float]:
    """For each (layout, recompute policy, micro-batch sizes): the smallest step seconds the
    step-time model gives it at any of the sizes, whatever the size it fits. Every term of the
    time grows with the parameters of the most loaded rank (the data-parallel reductions and
    gathers, the offloaded step), so none is faster than with no parameters on the rank, or,
    ``with_params``, with the fewest any of its pipeline stages holds (which needs the
    layout's ``stage_parts``, as its search does)."""
    fewest = [_fewest_params(ctx, par, policy) if with_params else 0 for par, policy, _ in rows]
    flat = [(par, _fastest_policy(ctx, policy), b, n)
            for (par, policy, bs), n in zip(rows, fewest) for b in bs]
    step = _row_seconds(ctx, flat)
    out, at = [], 0
    for _, _, bs in rows:
        out.append(min(step[at:at + len(bs)]) if bs else float("inf"))
        at += len(bs)
    return out


def _fastest_policy(ctx: _Context, policy: tuple[Recompute, int | None]
                    ) -> tuple[Recompute, int | None]:
    """Op-level checkpointing is searched keeping nothing, its slowest; its time is bounded
    by keeping every item a save set may hold (the least rerun; the rerun's FLOPs do not
    depend on the layout: ``memplan.planning.timing.ops_rerun_flops``)."""
    if policy[0] is not Recompute.OPS:
        return policy
    from memplan.model.dims import Dims
    from memplan.model.layer import ops_search_items
    from memplan.planning.save_sets import frontier

    wl = ctx.workload(policy)
    sets = frontier(ops_search_items(ctx.spec, wl, Dims.of(ctx.spec, ParallelConfig(), wl)))
    return (Recompute.OPS, sets[-1].kept)  # type: ignore[return-value]


def _fewest_params(ctx: _Context, par: ParallelConfig,
                   policy: tuple[Recompute, int | None]) -> int:
    """The fewest parameters (before ZeRO sharding) a pipeline stage of ``par`` holds."""
    return fewest_stage_params(ctx.spec, par, ctx.workload(policy).mtp_layers)


def _times(ctx: _Context, fits: list[_Fit]) -> StepTimes:
    """The step-time model of every fit in one vectorised pass."""
    return _row_times(ctx, [(f.par, f.policy, f.mbs, f.num_params) for f in fits])


def _seconds(ctx: _Context, fits: list[_Fit]) -> list[float]:
    """``_times(ctx, fits).step_s``, each fit timed once per plan (``_row_seconds``)."""
    return _row_seconds(ctx, [(f.par, f.policy, f.mbs, f.num_params) for f in fits])


def _row_seconds(ctx: _Context, rows: list[tuple[ParallelConfig, tuple[Recompute, int | None],
                                                 int, int]]) -> list[float]:
    """``_row_times(ctx, rows).step_s`` as floats. A row's time is its own (``step_times``
    is elementwise: ``timing.step_time`` gives the same floats one row at a time,
    tests/unit/test_planner_vector.py), so a row timed before is read back
    (``_Context.step_s``): a search again (``plan``'s next ``_plan_once``) times the same
    bounds and fits, and a fit's save sets are timed one by one. Hashing a row costs
    about what timing it does (its layout's and policy's hashes are Python calls), so the
    first search only keeps them, and they are keyed when a search runs again."""
    if not ctx.again:
        seconds = _floats(_row_times(ctx, rows).step_s)
        ctx.timed.append((rows, seconds))
        return seconds
    done = ctx.step_s
    for timed, seconds in ctx.timed:
        done.update(zip(timed, seconds))
    ctx.timed.clear()
    new = [row for row in dict.fromkeys(rows) if row not in done]
    if new:
        done.update(zip(new, _floats(_row_times(ctx, new).step_s)))
    return [done[row] for row in rows]


def _floats(values: Any) -> list[float]:
    """A ``StepTimes`` field as plain floats (numpy's array or the list of plain numbers)."""
    return values if isinstance(values, list) else values.tolist()


def _row_times(ctx: _Context, rows: list[tuple[ParallelConfig, tuple[Recompute, int | None],
                                               int, int]]) -> StepTimes:
    """The step-time model of (layout, recompute policy, micro-batch, parameters of the most
    loaded rank) rows in one vectorised pass."""
    gbs = ctx.wl.global_batch_size
    # recompute of k layers reruns k per pipeline stage: the FLOPs depend on the stages too
    keys = [(policy, par.pp, par.vpp, par.stage_layers) for par, policy, _, _ in rows]
    flops = {key: step_flops(ctx.spec, ctx.workload(key[0]), gbs, pp=key[1], vpp=key[2],
                             split=key[3]) for key in set(keys)}
    balance = {key: stage_balance(ctx.spec, ctx.workload(key[0]), key[1], key[2], key[3])
               for key in set(keys)}
    shares = {(r[1], r[0]): 0.0 for r in rows}  # once per policy and layout
    for policy, par in shares:
        shares[policy, par] = recomputed_share(ctx.workload(policy), ctx.spec.num_layers, par)
    rerun = [shares[r[1], r[0]] for r in rows]
    m = [gbs // (r[2] * r[0].dp) for r in rows]
    if not _vectorised(len(rows)):
        return step_times_rows(ctx.spec, ctx.gpu, ctx.wl, gbs, [
            Columns.one(r[0], r[2], n, r[3], num_layers=ctx.spec.num_layers,
                        balance=balance[key], rerun=share)
            for r, n, key, share in zip(rows, m, keys, rerun)],
            [flops[key] for key in keys])
    import numpy as np

    cols = Columns.of([r[0] for r in rows], [r[2] for r in rows], m, [r[3] for r in rows],
                      num_layers=ctx.spec.num_layers, balance=[balance[key] for key in keys],
                      rerun=rerun)
    model = np.array([flops[key][0] for key in keys])
    hardware = np.array([flops[key][1] for key in keys])
    return step_times(ctx.spec, ctx.gpu, ctx.wl, gbs, cols, model, hardware)


# Rows timed one by one below this many in one call, unless numpy is imported already: a
# row takes about 30 us on plain numbers and 6 us in numpy's vectorised pass, whose import
# costs about 90 ms (2-core AMD EPYC, CPython 3.11, numpy 2; the plans of the catalog's
# models at 8 GPUs time at most 924 rows in one call and about 2,000 in all, those at 64 and
# 2,048 GPUs up to 6,898 in one and 31,326 in all). Both give the same floats
# (tests/unit/test_planner_vector.py), so the choice changes no answer.
VECTOR_ROWS = 1_500


def _vectorised(rows: int) -> bool:
    """Whether ``rows`` rows are timed in numpy's vectorised pass."""
    return rows >= VECTOR_ROWS or "numpy" in sys.modules


def _ranked(ctx: _Context, fits: list[_Fit]) -> list[Candidate]:
    """Candidates fastest first; among equals the one with most headroom."""
    times = _times(ctx, fits)
    out = []
    for n, fit in enumerate(fits):
        ops = fit.policy[0] is Recompute.OPS
        out.append(Candidate(fit.par, fit.mbs, fit.policy[0], None if ops else fit.policy[1],
                             None, times.at(n), fit.peak_bytes,
                             (ctx.spec, ctx.gpu, ctx.workload(fit.policy), ctx.capacity),
                             tuple(fit.policy[1]) if ops else (),  # type: ignore[arg-type]
                             fit.num_params))
    out.sort(key=lambda c: (c.time.step_s, c.peak_bytes))
    seen: set[ParallelConfig] = set()  # op-level checkpointing: a layout's fastest micro-batch
    kept = []
    for c in out:
        if c.recompute in ctx.per_layout:
            if c.layout in seen:
                continue
            seen.add(c.layout)
        kept.append(c)
    return kept


OUT_OF_RESERVED = ("out of memory once the caching allocator's reserved memory is replayed, at "
                   "every micro-batch whose tensors fit")


@lru_cache(maxsize=4096)
def _reserved_peak(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload,
                   capacity: int, above: int | None = None) -> tuple[int, int, bool, bool]:
    """(the per-GPU peak with the allocator's reserved memory replayed, its stage, whether
    the allocator runs out of memory although the tensors fit, whether every stage was
    replayed) of one configuration (``memplan.model.reserved.reserved_rank``; with
    ``above``, its stages replayed only up to the first over it: the peak then a lower
    bound). Cached: a configuration replays once per process, whatever plan asks for it;
    without ``above``, the stages a call with it replayed are taken from it
    (``_stopped``), not replayed again. Where a worker replayed it ahead
    (``memplan.planning.ahead``), its figures are taken."""
    key = (spec, gpu, par, wl, capacity)
    ahead = _AHEAD[0]
    got = ahead.take((*key, above)) if ahead is not None else None
    if got is None:
        got = _replay_peak(*key, above, _stopped.pop(key, ()) if above is None else ())
    elif above is None:
        _stopped.pop(key, None)
    peak, stage, oom, exact, stages = got
    if len(_SEEN) >= SEEN_MAX:
        _SEEN.clear()
    _SEEN.add((*key, above))
    if not exact:
        if len(_stopped) >= STOPPED_MAX:
            del _stopped[next(iter(_stopped))]
        _stopped[key] = stages
    return peak, stage, oom, exact


def _replay_peak(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload,
                 capacity: int, above: int | None = None, done: tuple = ()
                 ) -> tuple[int, int, bool, bool, tuple]:
    """``_reserved_peak``'s figures and, where the replay stopped at a stage over ``above``,
    the stages it replayed (``done``: the first stages' figures, as an earlier replay of the
    same configuration gave them). What a worker runs ahead (module level: a forked worker
    calls it by name)."""
    from memplan.model.reserved import reserved_rank

    est = estimate(spec, gpu, par, wl, capacity_bytes=capacity)
    got = reserved_rank(est, above, done=done)
    return (got.peak_bytes, got.stage, got.oom_step is not None, got.exact,
            () if got.exact else got.stages)


# the stages each ``_reserved_peak`` call with ``above`` that stopped early replayed, per
# configuration (the same figures as a call without it replays first); the oldest goes first
STOPPED_MAX = 4096
_stopped: dict = {}
# the plan's workers replaying ahead (None: none), and the configurations ``_reserved_peak``
# has made (not sent ahead again: the cache answers them; one sent all the same is never
# read, and only takes a worker's turn)
_AHEAD: list[Ahead | None] = [None]
_SEEN: set = set()
# cleared past this many (a long-lived process): four times what ``_reserved_peak``'s cache
# (4,096 entries) keeps, so most of those it has let go
SEEN_MAX = 4 * 4096


def _miss_ahead(ctx: _Context, misses: list[Candidate]) -> None:
    """``_reserved_miss``'s next configurations (whole replays) sent to the workers, if any."""
    ahead = _AHEAD[0]
    if ahead is not None:
        keys = [(*_replayed(ctx, c), None) for c in misses[:2 * ahead.workers]]
        ahead.submit([k for k in keys if k not in _SEEN])


def _ahead(ctx: _Context, heap: list) -> None:
    """The next candidates of ``_fit_reserved``'s order sent to the workers, if any, so
    that their replays are made while the check reads the one before."""
    ahead = _AHEAD[0]
    if ahead is None:
        return
    import heapq

    keys = [(*_replayed(ctx, c), ctx.budget)
            for *_, c in heapq.nsmallest(2 * ahead.workers, heap)]
    ahead.submit([k for k in keys if k not in _SEEN])


def _fit_reserved(ctx: _Context, ranked: list[Candidate], top: int | None,
                  result: PlanResult, taken: list[float] | None = None) -> list[Candidate]:
    """The candidates whose reserved peak fits the budget, fastest first: each, in order of
    its step time, is replayed (``_reserved_peak``); one that does not fit is tried again at
    its next smaller micro-batch (re-timed, back in the order), down to the smallest; under
    op-level checkpointing first keeping less at its micro-batch (``_retry_reserved``). With
    ``top`` only until ``top`` fit (the rest would not be shown). The search's peaks are
    lower bounds of the reserved ones (reserved memory holds the live tensors), so no
    configuration the search ruled out could fit here. A configuration's stages are replayed
    until one is over the budget; the closest miss is then made exact (``_reserved_miss``)."""
    import heapq

    heap = [(c.time.step_s, c.peak_bytes, n, c) for n, c in enumerate(ranked)]
    heapq.heapify(heap)
    out: list[Candidate] = []
    misses: list[tuple[int, int, Candidate]] = []  # (lower bound, order, configuration)
    retried: dict = {}  # op-level: (layout, micro-batch) -> (margin, save sets tried)
    count = len(heap)
    while heap and (top is None or len(out) < top):
        _ahead(ctx, heap)
        t, _, _, c = heapq.heappop(heap)
        if taken is not None:
            taken.append(t)
        before = _reserved_peak.cache_info().misses
        peak, _, oom, _ = _reserved_peak(*_replayed(ctx, c), ctx.budget)
        result.replayed += _reserved_peak.cache_info().misses - before
        if peak <= ctx.budget and not oom:
            out.append(replace(c, known_peak_bytes=peak))
            continue
        misses.append((peak, len(misses), c))
        down = _retry_reserved(ctx, c, peak, retried)
        if down is None:
            result.rejected[OUT_OF_RESERVED] += 1
            continue
        heapq.heappush(heap, (down.time.step_s, c.peak_bytes, count, down))
        count += 1
    _reserved_miss(ctx, misses, result)
    return sorted(out, key=lambda c: (c.time.step_s, c.peak_bytes))


def _retry_reserved(ctx: _Context, c: Candidate, peak: int, retried: dict
                    ) -> Candidate | None:
    """What ``_fit_reserved`` tries after ``c``, whose reserved peak (``peak``; a lower bound
    where the replay stopped at the first stage over the budget) did not fit: the same
    layout at its next smaller micro-batch, same policy (None: none smaller). Op-level
    checkpointing first keeps less at the same micro-batch: the save set is chosen again
    (``_with_save_set``) against the budget less the most the allocator was seen to reserve
    beyond a set's tensors at this layout and micro-batch (``peak`` less ``c``'s tensor
    peak), and replayed in its turn; at a smaller micro-batch (where no set not tried fits
    that budget) it is chosen again against the whole budget. Before, the same set was kept
    at half the micro-batch (llama-7b x 8, seq 4,096: the second and third candidates of
    ``--top 3``, ZeRO 2 at micro-batch 2 and ZeRO 3 at 4, went to 1 and 2; now they keep
    15 and 9 items at 2 and 4, tests/unit/test_sac_ops.py)."""
    ops = c.recompute is Recompute.OPS
    if ops:
        key = (c.layout, c.micro_batch_size)
        margin, tried = retried.get(key, (0, set()))
        margin = max(margin, peak - c.peak_bytes, 1)
        tried.add(tuple(c.recompute_save))
        retried[key] = (margin, tried)
        less = _ops_fit(ctx, c, c.micro_batch_size, ctx.budget - margin)
        if less is not None and tuple(less.recompute_save) not in tried:
            return less
    smaller = [b for b in _sizes(c.layout, ctx.wl, ctx.wl.global_batch_size)
               if b < c.micro_batch_size]
    if not smaller:
        return None
    if ops and (fresh := _ops_fit(ctx, c, smaller[-1], ctx.budget)) is not None:
        return fresh
    policy = (c.recompute, c.recompute_layers if not ops else c.recompute_save)
    t = _row_times(ctx, [(c.layout, policy, smaller[-1], c.num_params)]).at(0)
    return replace(c, micro_batch_size=smaller[-1], time=t, known_peak_bytes=None)


def _ops_fit(ctx: _Context, c: Candidate, mbs: int, budget: int) -> Candidate | None:
    """``c``'s layout under op-level checkpointing at micro-batch ``mbs`` with the save set
    of least recompute whose peak is within ``budget`` (``_with_save_set``); None where not
    even the empty set is."""
    fit = _Fit(-1, 0, c.layout, (Recompute.OPS, ()), mbs, -1, c.num_params)
    found = _with_save_set(ctx, fit, 0, budget)
    return None if found.peak_bytes < 0 else _ranked(ctx, [found])[0]


def _replayed(ctx: _Context, c: Candidate) -> tuple[ModelSpec, GpuSpec, ParallelConfig,
                                                     Workload, int]:
    """``_reserved_peak``'s configuration of a candidate (its workload at its micro-batch)."""
    wl = ctx.workload((c.recompute, c.recompute_layers) if c.recompute is not Recompute.OPS
                      else (c.recompute, c.recompute_save))
    return (ctx.spec, ctx.gpu, c.layout,
            wl.model_copy(update={"micro_batch_size": c.micro_batch_size}), ctx.capacity)


def _reserved_miss(ctx: _Context, misses: list[tuple[int, int, Candidate]],
                   result: PlanResult) -> None:
    """The closest miss among the configurations the reserved check turned down: each one's
    peak is a lower bound of its own (its stages replayed up to the first over the budget),
    so exact peaks are replayed in order of the bound until no bound can beat the best (the
    search's closest miss, when closer, stays)."""
    best = result.closest_miss
    ordered = sorted(misses, key=lambda m: m[:2])
    for at, (bound, _, c) in enumerate(ordered):
        if best is not None and bound >= best.peak_bytes:
            break
        _miss_ahead(ctx, [m[2] for m in ordered[at:]
                          if best is None or m[0] < best.peak_bytes])
        before = _reserved_peak.cache_info().misses
        peak, stage, _, _ = _reserved_peak(*_replayed(ctx, c))
        result.replayed += _reserved_peak.cache_info().misses - before
        if best is None or peak < best.peak_bytes:
            best = Miss(c.layout, c.micro_batch_size, c.recompute, c.recompute_layers, peak,
                        stage)
    result.closest_miss = best


def _closest_miss(ctx: _Context, levels: list[_Level]) -> Miss | None:
    """The configuration with the smallest overshoot among those found not to fit. The
    searches' bytes for those are lower bounds (an evaluation stops at the first stage over
    the budget), so exact ones are computed in order of the bound until no bound can beat the
    best."""
    misses = sorted((bound, at, job, b) for at, level in enumerate(levels)
                    for bound, job, b in level.found.misses)
    best: Miss | None = None
    for bound, at, job, b in misses:
        if best is not None and bound >= best.peak_bytes:
            break
        j = levels[at].search.jobs[job]
        peak = evaluate(ctx.spec, j.par, j.wl, b, ctx.ovh)
        ctx.evaluated += 1
        if best is None or peak.peak_bytes < best.peak_bytes:
            best = Miss(j.par, b, j.wl.recompute, j.wl.recompute_layers, peak.peak_bytes,
                        peak.stage)
    return best
