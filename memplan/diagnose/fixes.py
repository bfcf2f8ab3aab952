"""Fixes for a configuration that does not fit, each checked by re-running the estimator.

A fix is a change of ``memplan.estimate``'s arguments. Each is estimated again (``peak_bytes``,
whether it fits) and timed with the step-time model (``memplan.planning.timing``), then ranked:
those that fit with the planner's safety margin free first, fastest first; then those that fit
only inside the margin; then the rest by bytes saved. The global batch is held fixed,
so a smaller micro-batch means more accumulation steps and a larger TP/PP/CP degree a smaller
data-parallel one. The planner's fastest layout that fits is offered too.

Offloading is offered for the optimizer (``memplan.parallel.Offload``; ZeRO stage 1 with it
where the job has none), the saved activations, and under ZeRO-3 the sharded weights, each with
the host memory it needs per GPU; the fine-tuning savers beside them: the pure-bf16 recipe
(no fp32 master copy) and AdamW's states in 8 bits, paged or not (bitsandbytes).
Chunked cross-entropy is offered with ceil(vocab / hidden) chunks, the count Liger Kernel's
fused linear cross-entropy uses so that one chunk's logits are about the size of the hidden
states (``liger_kernel/ops/fused_linear_cross_entropy.py``: ``inc_factor = cdiv(V, H)``);
the estimator models it as checkpointed chunks (``memplan.model.head``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from memplan.errors import MemplanError
from memplan.model.estimate import ZERO3_CAVEAT, Estimate
from memplan.parallel import Offload, ZeroStage, local_seq
from memplan.planning.planner import DEFAULT_SAFETY
from memplan.planning.timing import StepTime, estimate_step_time
from memplan.units import ceil_div
from memplan.workload import Optimizer, OptimizerImpl, Precision, Recompute

# With expandable segments a segment grows in place instead of being split, so reserved
# memory follows allocated memory up to page rounding (PyTorch docs, "CUDA memory management:
# expandable_segments"): modelled as no allocator share on top of the tensor peak.
EXPANDABLE_SOURCE = ("expandable_segments: reserved memory follows allocated memory up to page "
                     "rounding (PyTorch docs, CUDA memory management); allocator share 0")


# Recipes that keep fp32 weights (a master copy, or fp32 parameters under autocast) with fp32
# optimizer states: the pure-bf16 recipe keeps neither (``memplan.workload.Precision``), at the
# cost of updating bf16 weights directly (the reason mixed precision keeps a master copy).
_MASTER_RECIPES = frozenset({Precision.BF16_MIXED, Precision.BF16_FP32_GRADS,
                             Precision.FP16_MIXED, Precision.FP32, Precision.AMP_BF16,
                             Precision.AMP_FP16})


@dataclass(frozen=True)
class Fix:
    """One change, re-estimated. Sizes in int bytes; ``step_s`` from the step-time model."""

    name: str
    flags: str  # the command-line options that apply it
    change: dict[str, Any]  # memplan.estimate keyword arguments changed
    estimate: Estimate
    time: StepTime
    saved_bytes: int  # baseline peak_bytes - this fix's peak_bytes
    capacity_bytes: int
    note: str = ""  # in words; memplan.report.diagnose.fix_note adds the host memory it needs
    # what the job held beyond the estimate when it failed (``unexplained_bytes``), added to
    # the peak before deciding that a fix fits
    margin_bytes: int = 0
    # it shrinks what the phase the traceback names allocates (``addresses``)
    addresses_failure: bool = False
    # what it saves in the step phase the traceback names (``_phase_peak``), 0 without one
    phase_saved_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return self.estimate.peak_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes + self.margin_bytes <= self.capacity_bytes

    @property
    def safe(self) -> bool:
        """Fits with the planner's safety margin free (memplan.planning.planner.DEFAULT_SAFETY)."""
        return self.peak_bytes + self.margin_bytes <= self.capacity_bytes * (1 - DEFAULT_SAFETY)


@dataclass(frozen=True)
class Fixes:
    baseline: Estimate
    baseline_time: StepTime
    ranked: tuple[Fix, ...]
    skipped: tuple[tuple[str, str], ...]  # (fix, why it does not apply)


def time_of(est: Estimate) -> StepTime:
    """The step-time model for an estimate's configuration (most loaded rank's parameters),
    as ``memplan estimate`` reports it."""
    return estimate_step_time(est)


def baseline_kwargs(est: Estimate, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` (the estimate's keyword arguments) with the global batch fixed at the one the
    estimate resolved, so that fixes keep the tokens per step."""
    return {**given, "global_batch_size": est.global_batch_size}


def candidates(est: Estimate) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, flags, estimate keyword changes) of every single change worth estimating."""
    par, wl = est.parallel, est.workload
    out = []
    for policy in (Recompute.SELECTIVE, Recompute.FULL):
        partial = wl.recompute_layers is not None or wl.recompute_every is not None
        if policy > wl.recompute or (policy == wl.recompute == Recompute.FULL and partial):
            out.append((f"recompute {policy.label}", f"--recompute {policy.label}",
                        {"recompute": policy.label, "recompute_layers": None,
                         "recompute_every": None}))
    for zero in range(int(par.zero) + 1, 4):
        out.append((f"ZeRO stage {zero}", f"--zero {zero}", {"zero": zero}))
    for dim in ("tp", "pp", "cp"):
        value = 2 * getattr(par, dim)
        out.append((f"{dim.upper()} {value}", f"--{dim} {value}", {dim: value, "dp": None}))
    if wl.micro_batch_size > 1:
        mbs = wl.micro_batch_size // 2
        out.append((f"micro-batch {mbs} with more accumulation", f"--mbs {mbs}",
                    {"micro_batch_size": mbs}))
    chunks = loss_chunks_for(est)
    if wl.loss_chunks == 1 and chunks > 1:
        out.append((f"chunked cross-entropy ({chunks} chunks)", f"--loss-chunks {chunks}",
                    {"loss_chunks": chunks}))
    if not par.offload and wl.precision is not Precision.FSDP_BF16:
        zero = {} if par.zero >= ZeroStage.OPTIMIZER else {"zero": 1}
        out.append(("optimizer offloaded to the host",
                    "--offload optimizer" + (" --zero 1" if zero else ""),
                    {"offload": Offload.OPTIMIZER.value, **zero}))
    out += _saver_candidates(par, wl)
    out += _bucket_candidates(est)
    if wl.precision in _MASTER_RECIPES:
        out.append(("bf16 weights, gradients and states without an fp32 master copy",
                    "--precision bf16-pure", {"precision": Precision.BF16_PURE}))
    if wl.optimizer_impl is not OptimizerImpl.FUSED:
        out.append(("fused optimizer", "--optimizer-impl fused",
                    {"optimizer_impl": OptimizerImpl.FUSED}))
    if est.overheads.allocator_fraction > 0:
        out.append(("expandable segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                    {"overheads": replace(est.overheads, allocator_fraction=0.0,
                                          allocator_source=EXPANDABLE_SOURCE)}))
    return out


# The rank the LoRA savers propose: peft's default (peft/tuners/lora/config.py LoraConfig.r = 8,
# peft 0.21.2); the adapters' bytes scale with it and are small beside the base either way
_LORA_RANK = 8


def _offloading(par: Any, more: Offload) -> tuple[str, dict[str, Any]]:
    """(the --offload flag, the estimate keyword) of the layout's offloads and ``more``."""
    names = ",".join(sorted(o.value for o in {*par.offload, more}))
    return f"--offload {names}", {"offload": names}


def _bucket_candidates(est: Estimate) -> list[tuple[str, str, dict[str, Any]]]:
    """DeepSpeed's reduce buckets (``memplan.model.deepspeed_zero``), allocated whole in
    backward: one buffer instead of two (overlap_comm off), and a bucket of hidden^2 elements
    (what the transformers Trainer's "auto" gives) where the bucket is larger. Each is a
    ds_config key; both change only when the gradient partition is made (first_reduce)."""
    wl, h = est.workload, est.spec.hidden_size
    out = []
    if wl.zero_bucket_buffers == 2:
        out.append(("one reduce bucket instead of two (DeepSpeed overlap_comm off)",
                    "ds_config zero_optimization.overlap_comm = false",
                    {"zero_bucket_buffers": 1}))
    if wl.zero_bucket_buffers and wl.zero_bucket_numel > h * h:
        out.append((f"a reduce bucket of hidden^2 = {h * h:,} elements (DeepSpeed)",
                    f"ds_config zero_optimization.reduce_bucket_size = {h * h}",
                    {"zero_bucket_numel": h * h}))
    return out + _coordinator_candidates(est)


def _coordinator_candidates(est: Estimate) -> list[tuple[str, str, dict[str, Any]]]:
    """DeepSpeed's ZeRO-3 parameter coordinator (``memplan.model.deepspeed_coordinator``): no
    weight kept gathered for its reuse (stage3_max_reuse_distance 0), a tenth of the live
    parameters (stage3_max_live_parameters, which bounds the prefetch), and the Trainer's
    "auto" prefetch bucket (0.9 x hidden^2) where the bucket is larger. Each a ds_config key,
    re-estimated."""
    par, wl, h = est.parallel, est.workload, est.spec.hidden_size
    if (wl.framework != "deepspeed" or par.zero != ZeroStage.PARAMETERS
            or wl.zero3_plain_gathers):
        return []
    out = []
    if wl.zero3_reuse_distance_numel:
        out.append(("no weights kept gathered for reuse (DeepSpeed ZeRO-3)",
                    "ds_config zero_optimization.stage3_max_reuse_distance = 0",
                    {"zero3_reuse_distance_numel": 0}))
    if wl.zero3_prefetch_numel and wl.zero3_max_live_numel >= 10:
        live = wl.zero3_max_live_numel // 10
        out.append((f"stage3_max_live_parameters {live:,} (a tenth; DeepSpeed ZeRO-3)",
                    f"ds_config zero_optimization.stage3_max_live_parameters = {live}",
                    {"zero3_max_live_numel": live}))
    auto = int(0.9 * h * h)
    if wl.zero3_prefetch_numel > auto:
        out.append((f"a prefetch bucket of 0.9 x hidden^2 = {auto:,} elements (DeepSpeed "
                    "ZeRO-3)", f"ds_config zero_optimization.stage3_prefetch_bucket_size = "
                    f"{auto}", {"zero3_prefetch_numel": auto}))
    return out


def _saver_candidates(par: Any, wl: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """The fine-tuning savers: LoRA and QLoRA (another method: the base frozen), AdamW's
    states in 8 bits
    (bitsandbytes; paged: the large ones in unified memory the driver pages to the host), the
    saved activations on the host (``torch.autograd.graph.save_on_cpu``), and under ZeRO-3
    the sharded weights on the host (FSDP2's ``CPUOffloadPolicy``). Each is re-estimated;
    one that does not combine with the job is skipped with the estimator's reason."""
    out = []
    if wl.optimizer is Optimizer.ADAMW:
        out += [("8-bit AdamW states (bitsandbytes AdamW8bit)", "--optimizer adamw8bit",
                 {"optimizer": Optimizer.ADAMW8BIT}),
                ("paged 8-bit AdamW states (bitsandbytes PagedAdamW8bit)",
                 "--optimizer paged-adamw8bit", {"optimizer": Optimizer.PAGED_ADAMW8BIT})]
    if not wl.lora_rank:  # another method: the base weights frozen, adapters trained
        out += [(f"LoRA adapters of rank {_LORA_RANK} on frozen weights (trains the adapters "
                 "only)", f"--lora-rank {_LORA_RANK}", {"lora_rank": _LORA_RANK}),
                (f"QLoRA: LoRA rank {_LORA_RANK} on NF4 base weights (trains the adapters "
                 "only)", f"--lora-rank {_LORA_RANK} --base-quant nf4",
                 {"lora_rank": _LORA_RANK, "base_quant": "nf4"})]
    elif not wl.base_quant.value.startswith("nf4"):  # already NF4 (bitsandbytes or torchao)
        out.append(("NF4 base weights under the adapters (QLoRA)", "--base-quant nf4",
                    {"base_quant": "nf4"}))
    if Offload.ACTIVATIONS not in par.offload:
        flags, change = _offloading(par, Offload.ACTIVATIONS)
        out.append(("saved activations offloaded to the host (save_on_cpu)", flags, change))
    if par.zero == ZeroStage.PARAMETERS and Offload.PARAMS not in par.offload:
        flags, change = _offloading(par, Offload.PARAMS)
        out.append(("the bf16/fp16 partitions offloaded to the host (DeepSpeed offload_param)"
                    if wl.flat_partition else
                    "sharded weights offloaded to the host (FSDP2 CPUOffloadPolicy)", flags,
                    change))
    return out


def loss_chunks_for(est: Estimate) -> int:
    """Chunks for a chunked loss: ceil(vocab / hidden), as Liger Kernel picks them (see the
    module docstring), at most one per token of the micro-batch."""
    spec, wl = est.spec, est.workload
    tokens = wl.micro_batch_size * local_seq(wl.seq_len, est.parallel.cp)
    return max(1, min(tokens, ceil_div(spec.vocab_size, spec.hidden_size)))


# What each phase a traceback names allocates, and so which changes shrink it (the estimate
# keyword a fix changes): the optimizer step's states and temporaries (fused step, ZeRO-1 and
# up, 8-bit states, offloaded optimizer, no fp32 master copy); the gradient reduction's
# buckets and gradients (DeepSpeed's reduce buckets, ZeRO-2 and up); the weights a loading or
# a setup places (ZeRO-3, TP, PP, quantised or frozen base weights, offloaded weights); the
# activations of a forward or backward (recomputation, micro-batch, chunked loss, CP, TP,
# offloaded activations; ZeRO-2's gradients in backward).
_PHASE_KEYS = {
    "optimizer step": {"optimizer_impl", "optimizer", "precision"},
    "gradient communication": {"zero_bucket_buffers", "zero_bucket_numel"},
    "loading": {"tp", "pp", "base_quant", "lora_rank"},
    "forward": {"recompute", "micro_batch_size", "loss_chunks", "cp", "tp",
                "zero3_reuse_distance_numel", "zero3_max_live_numel", "zero3_prefetch_numel"},
}
_PHASE_KEYS["setup"] = _PHASE_KEYS["loading"] | _PHASE_KEYS["optimizer step"]
_PHASE_KEYS["backward"] = _PHASE_KEYS["forward"]
_MIN_ZERO = {"optimizer step": 1, "setup": 1, "gradient communication": 2, "backward": 2,
             "loading": 3}
_OFFLOADS = {"optimizer step": "optimizer", "setup": "optimizer", "loading": "params",
             "forward": "activations", "backward": "activations"}


def addresses(phase: str | None, change: dict[str, Any]) -> bool:
    """Whether ``change`` shrinks what ``phase`` (``memplan.diagnose.traceback.PHASES``)
    allocates: see ``_PHASE_KEYS``."""
    if phase is None:
        return False
    if set(change) & _PHASE_KEYS.get(phase, set()):
        return True
    zero = change.get("zero")
    if zero is not None and phase in _MIN_ZERO and int(zero) >= _MIN_ZERO[phase]:
        return True
    offload = change.get("offload")
    return bool(offload) and phase in _OFFLOADS and _OFFLOADS[phase] in str(offload)


# the step phase of the estimate each phase a traceback names runs in
# (memplan.diagnose.explain.STEP_PHASE)
_STEP_PHASES = {"forward": "forward", "backward": "backward",
                "gradient communication": "backward", "optimizer step": "optimizer"}


def _phase_peak(est: Estimate, phase: str | None) -> int:
    """The most loaded stage's tensor bytes in the step phase of ``phase`` (step 1's or the
    steady state's, the larger); 0 when ``phase`` is none of a step's."""
    name = _STEP_PHASES.get(phase or "")
    if name is None:
        return 0
    s = est.worst
    return max(getattr(s.first_step, name), getattr(s.steady, name))


def suggest(model: Any, est: Estimate, given: dict[str, Any], *, capacity_bytes: int,
            with_plan: bool = True, margin_bytes: int = 0, phase: str | None = None) -> Fixes:
    """Every candidate change of ``est`` (made by ``memplan.estimate(model, **given)``),
    re-estimated and timed, ranked. ``margin_bytes``: bytes the failed job held beyond the
    estimate (``explain.unexplained_bytes``), assumed to stay with every fix. ``phase``: where
    the traceback says the job died; among the fixes that fit, those that shrink what that
    phase allocates (``addresses``) come first."""
    from memplan.api import estimate

    base = baseline_kwargs(est, given)
    fixes, skipped = [], []
    for name, flags, change in candidates(est):
        try:
            new = estimate(model, **{**base, **change})
        except MemplanError as err:
            skipped.append((name, str(err)))
            continue
        # an offload fix's host memory is in its estimate; the report names it
        fixes.append(_fix(name, flags, change, new, est, capacity_bytes))
    if with_plan:
        planned = _planned(model, est, base, capacity_bytes, margin_bytes)
        if isinstance(planned, Fix):
            fixes.append(planned)
        elif planned:
            skipped.append(("layout from memplan plan", planned))
    # the global batch is held fixed: say so in the flags, so each fix re-runs as estimated
    gbs = f" --gbs {est.global_batch_size}"
    fixes = [replace(f, margin_bytes=margin_bytes, addresses_failure=addresses(phase, f.change),
                     phase_saved_bytes=_phase_peak(est, phase) - _phase_peak(f.estimate, phase),
                     flags=f.flags + gbs if f.flags.startswith("--") else f.flags)
             for f in fixes]
    # a fix that lowers the phase the job died in is kept although the estimate's peak lies
    # in another phase: the traceback says where the job really ran out
    keep = [f for f in fixes if f.saved_bytes > 0 or (
        f.addresses_failure and f.phase_saved_bytes > 0)]
    skipped += [(f.name, (f"lowers no peak: its peak_bytes {f.peak_bytes} is not below "
                          f"the baseline's {est.peak_bytes}"))
                for f in fixes if f not in keep]
    fixes = keep
    fixes, dominated = _drop_dominated_zero(fixes, est.parallel.dp)
    skipped += dominated
    # fits first, those for the phase the job died in before the others; safe fits fastest
    # first, then fits inside the safety margin; then the rest by bytes saved
    fixes.sort(key=lambda f: (not f.fits, not f.addresses_failure, not f.safe,
                              f.time.step_s if f.fits else -f.saved_bytes, -f.saved_bytes))
    return Fixes(est, time_of(est), tuple(fixes), tuple(skipped))


def _drop_dominated_zero(fixes: list[Fix], dp: int) -> tuple[list[Fix], list[tuple[str, str]]]:
    """A higher ZeRO stage is not always smaller: ZeRO-3's gathered parameter buffers can
    outweigh what sharding the parameters saves at small dp (``ZERO3_CAVEAT``). A stage whose
    peak is not below a lower stage's, offered beside it, saves nothing more and costs more
    communication: it is not offered, and the reason is kept."""
    stages = {f.change["zero"]: f for f in fixes if set(f.change) == {"zero"}}
    kept, dropped = [], []
    for f in fixes:
        lower = [stages[z] for z in stages
                 if set(f.change) == {"zero"} and z < f.change["zero"]
                 and stages[z].peak_bytes <= f.peak_bytes]
        if lower:
            best = min(lower, key=lambda g: g.peak_bytes)
            dropped.append((f.name, f"saves less than {best.name}: its peak_bytes "
                            f"{f.peak_bytes} is not below {best.peak_bytes} ({ZERO3_CAVEAT}; "
                            f"dp {dp})"))
        else:
            kept.append(f)
    return kept, dropped


def _fix(name: str, flags: str, change: dict[str, Any], new: Estimate, base: Estimate,
         capacity_bytes: int, note: str = "") -> Fix:
    return Fix(name=name, flags=flags, change=change, estimate=new, time=time_of(new),
               saved_bytes=base.peak_bytes - new.peak_bytes, capacity_bytes=capacity_bytes,
               note=note)


_LAYOUT_FIELDS = ("tp", "pp", "vpp", "cp", "ep", "etp", "dp")


def _planned(model: Any, est: Estimate, base: dict[str, Any], capacity_bytes: int,
             margin_bytes: int) -> Fix | str | None:
    """The planner's fastest configuration for the same GPUs and global batch in the capacity
    less ``margin_bytes``, re-estimated with ``memplan.estimate`` (the planner keeps a 5%
    safety margin, memplan.planning.planner)."""
    if margin_bytes >= capacity_bytes:
        return "the job held more than the capacity beyond the estimate"
    from memplan.api import estimate, plan

    wl = est.workload
    try:
        result = plan(model, gpus=est.parallel.world_size, gpu=est.gpu,
                      gpu_memory=capacity_bytes - margin_bytes,
                      global_batch_size=est.global_batch_size,
                      seq_len=wl.seq_len, precision=wl.precision, optimizer=wl.optimizer,
                      optimizer_impl=wl.optimizer_impl, attention=wl.attention,
                      norm_impl=wl.norm_impl, logits_fp32=wl.logits_fp32,
                      loss_chunks=wl.loss_chunks)
    except MemplanError as err:
        return str(err)
    if not result.candidates:
        return "no layout of these GPUs fits at this global batch"
    c = result.candidates[0]
    p = c.layout
    change: dict[str, Any] = {name: getattr(p, name) for name in _LAYOUT_FIELDS}
    change.update(zero=int(p.zero), sequence_parallel=p.sequence_parallel,
                  micro_batch_size=c.micro_batch_size, recompute=c.recompute.label,
                  recompute_layers=c.recompute_layers, recompute_every=None)
    flags = (f"--tp {p.tp} --pp {p.pp} --vpp {p.vpp} --cp {p.cp} --ep {p.ep} --dp {p.dp} "
             f"--zero {int(p.zero)} {'--sp' if p.sequence_parallel else '--no-sp'} "
             f"--mbs {c.micro_batch_size} --recompute {c.recompute.label}"
             + (f" --etp {p.etp}" if p.etp is not None else "")
             + (f" --recompute-layers {c.recompute_layers}" if c.recompute_layers else ""))
    try:
        new = estimate(model, **{**base, **change})
    except MemplanError as err:
        return str(err)
    return _fix("layout from memplan plan", flags, change, new, est, capacity_bytes,
                note="fastest configuration `memplan plan` finds for these GPUs")


# The estimate keywords a plan already searches: a saver changes none of them
_SEARCHED = frozenset({*_LAYOUT_FIELDS, "zero", "sequence_parallel", "micro_batch_size",
                       "recompute", "recompute_layers", "recompute_every"})


def savers(model: Any, given: dict[str, Any], miss: Any, budget_bytes: int,
           global_batch_size: int) -> Fixes:
    """For a plan where nothing fits: the savers (``candidates`` that change no layout,
    micro-batch or recompute, which the plan searched) applied to its closest configuration
    ``miss`` (``memplan.planning.planner.Miss``), re-estimated and timed; one that does not
    fit there is tried again under full recompute, which the flags then say. Ranked as
    ``suggest`` ranks them; ``budget_bytes``: what a configuration may peak at (the capacity
    less the plan's safety margin), so a saver that fits fits the plan's budget; the plan's
    ``global_batch_size`` is kept."""
    p = miss.layout
    layout: dict[str, Any] = {name: getattr(p, name) for name in _LAYOUT_FIELDS}
    layout.update(zero=int(p.zero), sequence_parallel=p.sequence_parallel,
                  micro_batch_size=miss.micro_batch_size, recompute=miss.recompute.label,
                  recompute_layers=miss.recompute_layers, global_batch_size=global_batch_size)
    found = _savers_at(model, {**given, **layout}, budget_bytes)
    if miss.recompute is Recompute.FULL and miss.recompute_layers is None:
        return found
    full = {**given, **layout, "recompute": Recompute.FULL.label, "recompute_layers": None}
    again = {f.name: f for f in _savers_at(model, full, budget_bytes).ranked}
    ranked = [f if f.fits or f.name not in again or not again[f.name].fits
              else replace(again[f.name], flags=again[f.name].flags + " --recompute full",
                           saved_bytes=found.baseline.peak_bytes - again[f.name].peak_bytes)
              for f in found.ranked]
    ranked.sort(key=lambda f: (not f.fits, not f.safe,
                               f.time.step_s if f.fits else -f.saved_bytes, -f.saved_bytes))
    return replace(found, ranked=tuple(ranked))


def _savers_at(model: Any, base: dict[str, Any], budget_bytes: int) -> Fixes:
    """``suggest``'s savers of the configuration ``base`` (estimate keywords)."""
    from memplan.api import estimate

    est = estimate(model, **base)
    found = suggest(model, est, base, capacity_bytes=budget_bytes, with_plan=False)
    # a plan is re-run with a saver's flags beside its own (its global batch among them)
    gbs = f" --gbs {est.global_batch_size}"
    kept = tuple(replace(f, flags=f.flags.removesuffix(gbs)) for f in found.ranked
                 if not set(f.change) & _SEARCHED)
    return replace(found, ranked=kept,
                   skipped=tuple((n, why) for n, why in found.skipped
                                 if not why.startswith("lowers no peak")))
