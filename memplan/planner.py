"""Search layouts, micro-batch sizes and recompute policies that fit, ranked by step time.

For every layout (tp, pp with virtual stages, cp, ep, dp derived, ZeRO stage, sequence
parallelism) and recompute policy the planner finds the largest micro-batch that fits in
``capacity * (1 - safety)`` by a doubling and bisection search over ``estimate`` (peak memory
never decreases with the micro-batch, so the search equals a brute force), then ranks the
feasible candidates by the step-time model. Every rejected layout keeps its reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

from memplan.errors import MemplanError
from memplan.hardware import GpuSpec
from memplan.memory import Estimate, estimate, resolve_batch
from memplan.parallel import ParallelConfig, ZeroStage
from memplan.spec import ModelSpec
from memplan.timing import StepTime, step_time
from memplan.units import GiB
from memplan.workload import Recompute, Workload

DEFAULT_SAFETY = 0.05  # keep 5% of capacity free for what no model counts (stated assumption)
# Llama 2 and 3 trained with about 4M tokens per step (Touvron et al. 2023; Dubey et al. 2024)
DEFAULT_TOKENS_PER_STEP = 4 * 1024 * 1024
MAX_MBS = 64
# Search bounds, stated: up to 4 model chunks per pipeline rank (Megatron-LM's interleaving
# gains little beyond), and context parallelism only from 8k tokens on (below, attention's
# share of the work is too small for CP to pay; give --cp to search it anyway).
MAX_VPP = 4
LONG_SEQ = 8192
RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)


@dataclass(frozen=True)
class Candidate:
    """A feasible configuration: the largest micro-batch that fits with this recompute."""

    layout: ParallelConfig
    micro_batch_size: int
    recompute: Recompute
    recompute_layers: int | None  # full recompute of this many layers per stage; None: all
    estimate: Estimate
    time: StepTime

    @property
    def peak_bytes(self) -> int:
        return self.estimate.peak_bytes


@dataclass
class PlanResult:
    candidates: list[Candidate]
    rejected: Counter = field(default_factory=Counter)
    evaluated: int = 0  # estimates computed
    global_batch_size: int = 0
    oom_excess_bytes: int | None = None  # smallest overshoot of a configuration that did not fit


@lru_cache(maxsize=1024)
def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def layouts(spec: ModelSpec, num_gpus: int, seq_len: int, *, max_tp: int,
            fixed: dict[str, object], rejected: Counter) -> list[ParallelConfig]:
    """Every layout of ``num_gpus`` the model can be split into, with ``fixed`` values kept."""
    def choices(name: str, default: list) -> list:
        return [fixed[name]] if fixed.get(name) is not None else default

    out = []
    experts = spec.moe.num_experts if spec.moe else 1
    for tp in choices("tp", [t for t in _powers_of_two(max_tp)]):
        if spec.num_kv_heads % tp or spec.num_attention_heads % tp or spec.ffn_hidden_size % tp:
            rejected[f"tp {tp} does not divide heads, KV heads or FFN"] += 1
            continue
        for pp in choices("pp", _divisors(spec.num_layers)):
            for cp in choices("cp", [c for c in _powers_of_two(8 if seq_len >= LONG_SEQ else 1)
                                     if seq_len % (2 * c) == 0]):
                if num_gpus % (tp * pp * cp):
                    rejected["gpus not divisible by tp*pp*cp"] += 1
                    continue
                dp = num_gpus // (tp * pp * cp)
                vpps = ([v for v in _divisors(spec.num_layers // pp) if v <= MAX_VPP]
                        if pp > 1 else [1])
                for vpp in choices("vpp", vpps):
                    for ep in choices("ep", [e for e in _divisors(experts) if (dp * cp) % e == 0]):
                        for zero in choices("zero", [0, 1, 2, 3]):
                            sp = fixed.get("sp")
                            out.append(ParallelConfig(
                                tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep,
                                zero=ZeroStage(zero),
                                sequence_parallel=tp > 1 if sp is None else bool(sp)))
    return out


def plan(spec: ModelSpec, gpu: GpuSpec, num_gpus: int, wl: Workload, *,
         capacity_bytes: int | None = None, safety: float = DEFAULT_SAFETY, max_tp: int | None = None,
         fixed: dict[str, object] | None = None,
         recompute: list[Recompute] | None = None) -> PlanResult:
    """Feasible candidates ranked by step time (fastest first), and rejections by reason."""
    if not 0 <= safety < 1:
        raise MemplanError(f"safety must be in [0, 1), got {safety}")
    budget = int((capacity_bytes or gpu.memory_bytes) * (1 - safety))
    gbs = wl.global_batch_size or max(1, DEFAULT_TOKENS_PER_STEP // wl.seq_len)
    result = PlanResult(candidates=[], global_batch_size=gbs)
    for par in layouts(spec, num_gpus, wl.seq_len, max_tp=max_tp or gpu.gpus_per_node,
                       fixed=fixed or {}, rejected=result.rejected):
        if gbs % par.dp:
            result.rejected[f"gbs ({gbs}) not divisible by dp"] += 1
            continue
        # A policy with more recompute is kept only if it fits a larger micro-batch than the
        # cheaper ones did: otherwise it costs compute for nothing (dominated).
        largest = 0
        for policy, layers in _policies(recompute or list(RECOMPUTE_ORDER),
                                        spec.num_layers // par.pp):
            cand = _largest_fitting(spec, gpu, par, wl, policy, layers, gbs, budget, result,
                                    above=largest)
            if cand is not None:
                result.candidates.append(cand)
                largest = cand.micro_batch_size
        if not largest:
            result.rejected["out of memory at mbs 1 with every recompute policy"] += 1
    # fastest first; among equals the one with most headroom
    result.candidates.sort(key=lambda c: (c.time.step_s, c.peak_bytes))
    return result


def _policies(allowed: list[Recompute], stage_layers: int) -> list[tuple[Recompute, int | None]]:
    """Recompute policies in order of extra compute: none, selective, full on a quarter, half
    and three quarters of each stage's layers, full on all."""
    out: list[tuple[Recompute, int | None]] = []
    for policy in RECOMPUTE_ORDER:
        if policy not in allowed:
            continue
        if policy is Recompute.FULL:
            parts = sorted({stage_layers * q // 4 for q in (1, 2, 3)} - {0, stage_layers})
            out += [(policy, k) for k in parts]
            out.append((policy, None))
        else:
            out.append((policy, None))
    return out


def _try(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload, policy: Recompute,
         layers: int | None, mbs: int, gbs: int, result: PlanResult) -> Estimate | None:
    if gbs % (mbs * par.dp):
        return None
    m = gbs // (mbs * par.dp)
    if par.vpp > 1 and m % par.pp:
        return None
    try:
        est = estimate(spec, gpu, par, wl.model_copy(update={
            "micro_batch_size": mbs, "recompute": policy, "global_batch_size": gbs,
            "recompute_layers": layers}))
    except MemplanError as err:
        result.rejected[str(err).split(" (")[0]] += 1
        return None
    result.evaluated += 1
    return est


def _largest_fitting(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload,
                     policy: Recompute, layers: int | None, gbs: int, budget: int,
                     result: PlanResult, above: int = 0) -> Candidate | None:
    """The largest micro-batch above ``above`` dividing the per-replica batch that fits. The
    peak is monotone in the micro-batch, so bisection over the divisors finds what a brute
    force finds."""
    per_replica = gbs // par.dp
    sizes = [b for b in _divisors(per_replica) if b <= MAX_MBS]
    valid = [b for b in sizes if b > above
             and not (par.vpp > 1 and (gbs // (b * par.dp)) % par.pp)]
    best: Estimate | None = None
    lo, hi = 0, len(valid) - 1
    while lo <= hi:  # bisection: the peak never decreases with the micro-batch
        mid = (lo + hi) // 2
        est = _try(spec, gpu, par, wl, policy, layers, valid[mid], gbs, result)
        if est is not None and est.peak_bytes <= budget:
            best, lo = est, mid + 1
        else:
            if est is not None:
                over = est.peak_bytes - budget
                if result.oom_excess_bytes is None or over < result.oom_excess_bytes:
                    result.oom_excess_bytes = over
            hi = mid - 1
    if best is None:
        return None
    _, m = resolve_batch(best.parallel, best.workload)
    time = step_time(spec, gpu, par, best.workload, gbs, m, best.worst.num_params)
    return Candidate(par, best.workload.micro_batch_size, policy, layers, best, time)


def check(est: Estimate, *, safety: float = DEFAULT_SAFETY) -> Estimate:
    """Raise MemplanError with the breakdown when ``est`` does not fit; return it otherwise."""
    budget = int(est.capacity_bytes * (1 - safety))
    if est.peak_bytes <= budget:
        return est
    w = est.worst
    parts = ", ".join(f"{name} {getattr(w, attr) / GiB:.2f} GiB" for name, attr in (
        ("params", "params_bytes"), ("grads", "grads_bytes"), ("optimizer", "optimizer_bytes"),
        ("activations", "activations_bytes")))
    raise MemplanError(
        f"does not fit: stage {w.stage} peaks at {w.peak_bytes / GiB:.2f} GiB ({w.peak_phase}) "
        f"> {budget / GiB:.2f} GiB usable ({est.capacity_bytes / GiB:.2f} GiB, "
        f"{safety:.0%} kept free); {parts}")
