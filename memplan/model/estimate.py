"""``estimate()``: per-GPU bytes of every pipeline stage and the most loaded rank.

Phases of one training step, each a sum of what is alive at that moment (never a sum of all):

- forward: weights, optimizer states (from step 2 on), gradients when an earlier micro-batch of
  the same step has produced them (m > 1), the saved activations of every micro-batch in flight,
  the loss's logits, and ZeRO-3's gathered units.
- backward: the same at its two extremes. At its start the loss's logits-sized gradients join
  all saved activations; at its end every gradient exists while only the first layer's inputs
  remain. With m > 1 the gradients exist throughout.
- optimizer: weights, gradients, states (created here in step 1) and the step's temporaries.

Gradients are freed after each step (``zero_grad(set_to_none=True)``, PyTorch's default), so
step 1's forward and backward run without optimizer moments (fp32 master weights exist from
the optimizer's construction) and the steady state has them:
the peak is reported for both. Fixed overheads (CUDA context, workspaces, allocator share) are
separate lines on top of the tensor peak. One stage's walk through these phases is
``memplan.model.stage``; this module assembles the stages and finds the most loaded rank.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

from memplan import presets
from memplan.hardware import GpuSpec
from memplan.model import adapters, compiled, fsdp1, memo, sac_ops, step_in_backward, te_fp8
from memplan.model.collector import with_older_frozen
from memplan.model.dims import Dims
from memplan.model.head import in_loss
from memplan.model.layer import ops_items, ops_kinds
from memplan.model.optimizer import optimizer_policy
from memplan.model.pipeline import Schedule, chunks_in_flight
from memplan.model.stage_terms import StageTerms
from memplan.model.stage import (
    PHASES,
    PhasePeaks,
    StageMemory,
    Prepared,
    backward_floor,
    rank_peak_bytes,
    stage_record,
    walk_stage,
)
from memplan.model.offload import offload_assumptions
from memplan.model.stage_parts import StageKinds, StageStates
from memplan.overheads import Overheads, default_overheads, with_library_workspaces
from memplan.parallel import (
    GradBuffers,
    LayoutError,
    Offload,
    ParallelConfig,
    ZeroStage,
    optimizer_on_host,
    pipeline_stage,
    resolve_batch,
    resolve_split,
    validate,
    zero_offload,
)
from memplan.spec import ModelSpec
from memplan.workload import DeltaNetKernel, Framework, MambaKernel, MoeImpl, Recompute, Workload

# PHASES, PhasePeaks and StageMemory are defined with the stage walk and re-exported here,
# beside the Estimate that holds them.
__all__ = ["PHASES", "Estimate", "PhasePeaks", "RankPeak", "StageMemory", "batch_regime",
           "cached_estimate", "estimate", "most_loaded", "optimizer_floor_bytes"]


class Estimate(NamedTuple):
    """Per-GPU memory of a training job: every stage, and the most loaded rank. A tuple, so that
    it is cheap to build and to derive (``_replace``)."""

    spec: ModelSpec
    gpu: GpuSpec
    parallel: ParallelConfig
    workload: Workload
    num_microbatches: int
    global_batch_size: int
    capacity_bytes: int
    stages: tuple[StageMemory, ...]
    overheads: Overheads
    schedule: Schedule = Schedule.ONE_F_ONE_B
    calibration: Any = None  # memplan.calibrate.apply.Calibration when a profile was applied
    # what the caller chose for the user and why (``memplan.api``'s recompute auto where
    # op-level save sets are not modelled), printed after the assumptions
    notes: tuple[str, ...] = ()

    @property
    def assumptions(self) -> tuple[str, ...]:
        """What the numbers assume, each with its source (printed with every result)."""
        base = _assumptions(self.spec, self.parallel, self.workload, self.schedule,
                            self.overheads)
        wl, par = self.workload, self.parallel
        fields = {**wl.model_dump(mode="json"), **par.model_dump(mode="json")}
        base = (f"framework: {wl.framework.value}"
                + ("" if wl.framework is not Framework.GENERIC else
                   " (plain PyTorch as memplan's reference model runs it)"),
                *presets.assumptions(wl.framework, self.spec, fields.get), *base)
        base = base if self.calibration is None else self.calibration.amend(base)
        return (*base, *self.notes)

    @property
    def caveats(self) -> tuple[str, ...]:
        """Choices of this configuration that do not always lower memory, stated beside the
        assumptions: ZeRO-3 at small dp, a chunked loss at few tokens (``ZERO3_CAVEAT``,
        ``LOSS_CHUNKS_CAVEAT``)."""
        return (*((ZERO3_CAVEAT,) if self.parallel.zero >= ZeroStage.PARAMETERS else ()),
                *(((IN_LOSS_CAVEAT if in_loss(self.workload) else LOSS_CHUNKS_CAVEAT),)
                  if self.workload.loss_checkpointed else ()))

    @property

    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: (s.peak_bytes, -s.stage))

    @property
    def peak_bytes(self) -> int:
        return self.worst.peak_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes

    def stage_of_rank(self, rank: int | None) -> StageMemory:
        """The stage of global rank ``rank`` (``parallel.pipeline_stage``), else, for no rank
        or one outside the layout, the most loaded stage."""
        if rank is not None:
            stage = pipeline_stage(self.parallel, rank)
            if stage < len(self.stages):
                return self.stages[stage]
        return self.worst


@with_older_frozen  # its collections walk only what it makes (``memplan.model.collector``)
def estimate(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload, *,
             capacity_bytes: int | None = None, overheads: Overheads | None = None,
             schedule: Schedule = Schedule.ONE_F_ONE_B) -> Estimate:
    """Per-GPU memory of every pipeline stage for one training job.

    ``capacity_bytes`` defaults to the GPU's reported memory; ``overheads`` to the uncalibrated
    defaults for the GPU (``memplan.overheads``).
    """
    par = resolve_split(spec, par, wl)
    wl = te_fp8.for_gpu(wl, gpu)
    validate(spec, par, wl)
    gbs, m = resolve_batch(par, wl)
    if wl.optimizer_in_backward and (why := step_in_backward.refusal(m)) is not None:
        raise LayoutError(f"optimizer_in_backward does not combine with {why[0]}",
                          f"optimizer_in_backward with {why[0]}: {why[1]}")
    ovh = with_library_workspaces(overheads if overheads is not None
                                  else default_overheads(gpu), gpu, wl.te_grouped_gemm,
                                  wl.te_gemm_workspace, wl.te_ub_workspace)
    if wl.recompute_save:
        sac_ops.check_scopes(wl.recompute_save, spec, par.pp)
    parts = memo.stage_parts(spec, par, wl)
    # (a list per stage: each stage's terms are built with its own list)
    shared = None if staged(wl) else _shared(spec, par, wl, parts)
    stages = _stages(spec, par, wl, m, schedule, ovh, shared, parts)
    return Estimate(  # (positional, in the fields' order)
        spec, gpu, par, wl, m, gbs,  # ..., num_microbatches, global_batch_size
        gpu.memory_bytes if capacity_bytes is None else capacity_bytes,  # capacity_bytes
        stages, ovh, schedule)


def _stages(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, schedule: Schedule,
            ovh: Overheads, shared: StageTerms | None,
            parts: tuple[tuple[StageStates, StageKinds], ...]) -> tuple[StageMemory, ...]:
    """Every stage. Interior stages with the same layer kinds differ only in micro-batches in
    flight, which shift their forward and backward peaks by whole micro-batches (chunks,
    when interleaved): one is computed, the others follow from it."""
    out: list[StageMemory] = []
    per_stage = staged(wl)
    template = None if per_stage else _template(par, parts)
    for i in range(par.pp):
        if per_stage:
            swl = stage_workload(wl, i)
            out.append(stage_record(spec, par, swl, m, i, schedule, ovh,
                                    _shared(spec, par, swl, parts), parts[i]))
        elif _follows(par, parts, template, i):
            flight = memo.in_flight(par.pp, par.vpp, m, i, schedule, par.vpp_group)
            out.append(_shifted(out[template], i, flight, par.vpp,
                                memo.in_flight(par.pp, par.vpp, m, template, schedule,
                                               par.vpp_group), ovh))
        else:
            assert shared is not None
            out.append(stage_record(spec, par, wl, m, i, schedule, ovh, shared, parts[i]))
    return tuple(out)


def staged(wl: Workload) -> bool:
    """Whether ``wl``'s op-level save list differs by pipeline stage (``sac_ops.for_stage``):
    each stage is then walked with its own list."""
    return bool(wl.recompute_save) and sac_ops.stage_scoped(wl.recompute_save)


def stage_workload(wl: Workload, stage: int) -> Workload:
    """``wl`` with the save list of pipeline stage ``stage``."""
    return memo.canonical(wl, recompute_save=sac_ops.for_stage(wl.recompute_save, stage))


def _shared(spec: ModelSpec, par: ParallelConfig, wl: Workload,
            parts: tuple[tuple[StageStates, StageKinds], ...]) -> StageTerms:
    return memo.shared_terms(spec, wl, Dims.of(spec, par, wl), par.experts, parts)


def _template(par: ParallelConfig,
              parts: tuple[tuple[StageStates, StageKinds], ...]) -> int | None:
    """The first interior stage others can follow from (with interleaving every chunk must hold
    the same kinds of layer)."""
    for i in range(1, par.pp - 1):
        kinds = parts[i][1]
        if par.vpp == 1 or (len(set(kinds.keys)) == 1
                            and len({sum(c.values()) for c in kinds.chunks}) == 1):
            return i
    return None


def _follows(par: ParallelConfig, parts: tuple[tuple[StageStates, StageKinds], ...],
             template: int | None, stage: int) -> bool:
    """Whether interior ``stage`` follows from the template: it holds the same kinds of layer."""
    return (template is not None and template < stage < par.pp - 1
            and parts[stage][1].keys == parts[template][1].keys
            and parts[stage][1].chunks == parts[template][1].chunks)


class RankPeak(NamedTuple):
    """The most loaded rank: its stage, peak_bytes and parameters (before ZeRO sharding)."""

    stage: int
    peak_bytes: int  # a lower bound when not ``walked``
    num_params: int
    walked: bool = True  # False: found over the limit by ``stage.backward_floor``, unwalked


def most_loaded(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, ovh: Overheads, *,
                schedule: Schedule = Schedule.ONE_F_ONE_B,
                limit_bytes: int | None = None,
                parts: tuple[tuple[StageStates, StageKinds], ...] | None = None) -> RankPeak:
    """``estimate(...).worst`` for a valid layout (``validate``) with ``m`` micro-batches, without
    the stages' records: for searches that evaluate many configurations. An interior stage
    that follows from another (``_stages``) is walked only if it holds more micro-batches in
    flight. With ``limit_bytes`` it returns the first stage whose peak_bytes exceed the limit
    (the configuration does not fit; another stage may peak higher), or, unwalked, the first
    whose floor (``stage.backward_floor``, a lower bound) does. ``parts``: the layout's
    ``stage_parts``, the same at every micro-batch size (looked up when not given)."""
    parts = parts or memo.stage_parts(spec, par, wl)
    shared = None if staged(wl) else _shared(spec, par, wl, parts)
    template = None if staged(wl) else _template(par, parts)
    held = (0 if template is None else  # (the template's micro-batches in flight, once)
            sum(memo.in_flight(par.pp, par.vpp, m, template, schedule, par.vpp_group)))
    stages = [i for i in range(par.pp) if not (_follows(par, parts, template, i) and (
        sum(memo.in_flight(par.pp, par.vpp, m, i, schedule, par.vpp_group)) <= held))]
    each = [(i, stage_workload(wl, i) if staged(wl) else wl) for i in stages]
    terms = [(i, swl, shared or _shared(spec, par, swl, parts)) for i, swl in each]
    prepared: dict[int, Prepared] = {}  # the walk's inputs each floor made, for its walk
    if limit_bytes is not None:
        # a stage whose floor is over the limit decides it without a walk of any stage (the
        # floor, a prefix of the walk's fold, costs a small part of it)
        for i, swl, sh in terms:
            made: list[Prepared] = []
            floor = rank_peak_bytes(backward_floor(spec, par, swl, m, i, schedule, sh,
                                                   parts[i], made), ovh)
            if floor > limit_bytes:
                return RankPeak(i, floor, parts[i][0].params.total, walked=False)
            if made:
                prepared[i] = made[0]
    worst: RankPeak | None = None
    for i, swl, sh in terms:
        tensor = walk_stage(spec, par, swl, m, i, schedule, sh, parts[i],
                            prepared=prepared.get(i)).tensor_peak
        peak = rank_peak_bytes(tensor, ovh)
        if worst is None or peak > worst.peak_bytes:
            worst = RankPeak(i, peak, parts[i][0].params.total)
            if limit_bytes is not None and peak > limit_bytes:
                break
    assert worst is not None
    return worst


def stage_peaks(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, ovh: Overheads, *,
                schedule: Schedule = Schedule.ONE_F_ONE_B,
                parts: tuple[tuple[StageStates, StageKinds], ...] | None = None
                ) -> tuple[int, ...]:
    """Every stage's peak_bytes (``estimate(...).stages``' without their records), for a
    search per stage; an interior stage that follows from another is shifted from it by its
    micro-batches in flight (``_shifted``)."""
    parts = parts or memo.stage_parts(spec, par, wl)
    shared = None if staged(wl) else _shared(spec, par, wl, parts)
    template = None if staged(wl) else _template(par, parts)
    walked: dict[int, Any] = {}
    out = []
    for i in range(par.pp):
        flight = memo.in_flight(par.pp, par.vpp, m, i, schedule, par.vpp_group)
        if _follows(par, parts, template, i) and template in walked:
            t = walked[template]
            delta = (sum(flight) - sum(t.in_flight)) * t.one_mb // par.vpp
            tensor = max(t.steady.peak + delta, t.first_step.peak + delta, t.states.load)
        else:
            swl = stage_workload(wl, i) if staged(wl) else wl
            w = walk_stage(spec, par, swl, m, i, schedule,
                           shared or _shared(spec, par, swl, parts), parts[i])
            walked[i], tensor = w, w.tensor_peak
        out.append(rank_peak_bytes(tensor, ovh))
    return tuple(out)


def optimizer_floor_bytes(spec: ModelSpec, par: ParallelConfig, wl: Workload,
                          ovh: Overheads) -> int:
    """peak_bytes of the most loaded rank at its optimizer step, where no activation is alive:
    the same at every micro-batch size, so no micro-batch of this layout peaks lower."""
    return rank_peak_bytes(memo.optimizer_phase_bytes(spec, par, wl), ovh)


def batch_regime(par: ParallelConfig, m: int, schedule: Schedule = Schedule.ONE_F_ONE_B) -> tuple:
    """Everything the stages' bytes read from the micro-batch count ``m``: the micro-batches
    each stage holds in flight and whether gradients exist before a backward starts. Between
    micro-batch sizes of one regime every activation term grows with the micro-batch and
    nothing else changes, so the peak never decreases with it."""
    return m > 1, tuple(tuple(chunks_in_flight(par, m, i, schedule)) for i in range(par.pp))


def _shifted(template: StageMemory, stage: int, flight: tuple[int, ...], vpp: int,
             template_flight: tuple[int, ...], ovh: Overheads) -> StageMemory:
    """``template`` with other micro-batch counts in flight (identical chunks: each in-flight
    chunk-forward holds 1/vpp of a micro-batch's activations on the stage)."""
    delta = (sum(flight) - sum(template_flight)) * template.microbatch_bytes // vpp

    def shift(p: PhasePeaks) -> PhasePeaks:
        return PhasePeaks(p.forward + delta, p.backward + delta, p.optimizer)

    steady, first_step = shift(template.steady), shift(template.first_step)
    tensor_peak = max(steady.peak, first_step.peak, template.load_bytes)
    return template._replace(stage=stage, activations_bytes=template.activations_bytes + delta,
                   microbatches_in_flight=max(flight), steady=steady, first_step=first_step,
                   tensor_peak_bytes=tensor_peak, allocator_bytes=ovh.allocator_bytes(tensor_peak),
                   peak_bytes=rank_peak_bytes(tensor_peak, ovh))


# Two changes that do not always save memory (both found by fuzzing pairs of estimates, and
# traced: tests/traced/test_ground_truth.py), stated wherever they apply, and never offered
# as a saving where they cost more (memplan.diagnose.fixes drops them).
ZERO3_CAVEAT = (
    "ZeRO-3 gathers each unit's parameters, and holds its unsharded gradients until the "
    "reduce-scatter, in buffers beside the shards: at small dp these can outweigh what "
    "sharding the parameters saves, so ZeRO-3 can need more memory than ZeRO-2 "
    "(compare --zero 2)")
LOSS_CHUNKS_CAVEAT = (
    "a chunked loss sums its chunks' head-weight gradients in backward (up to three "
    "vocab x hidden tensors at once): with few tokens per micro-batch that outweighs the "
    "logits it saves, so more chunks can need more memory (compare --loss-chunks 1)")
IN_LOSS_CAVEAT = (
    "a chunked loss that runs the head's backward inside the loss call holds the head's "
    "weight gradient whole (unsharded, in the gradients' dtype) through the loss, and under "
    "FSDP2 its reduce-scatter input into the backward: with few tokens per micro-batch that "
    "outweighs the logits it saves (compare --loss-chunks 1)")


def _zero3_offload_lines(par: ParallelConfig, wl: Workload) -> tuple[str, ...]:
    """The line of DeepSpeed's ZeRO-3 with offload_optimizer (and offload_param)."""
    if not (optimizer_on_host(par) and wl.flat_partition and par.zero >= ZeroStage.PARAMETERS):
        return ()
    return ("optimizer offloaded to host memory (DeepSpeed ZeRO-3, stage3.py offload_optimizer): "
            "the fp32 partitions, their fp32 gradient, the gradient partitions and the states on "
            "the CPU, stepped there; the GPU keeps the bf16/fp16 partitions"
            + (" (offload_param: those on the host too)" if Offload.PARAMS in par.offload
               else "")
            + ", the gathered weights, the reduce bucket and at each reduce a device and an fp64 "
            "copy of a gradient partition",)


def _ops_line(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> str:
    """``sac_ops.assumption`` with each layer kind's items (``memplan.model.layer.
    ops_kinds``)."""
    dm = Dims.of(spec, par, wl)
    return sac_ops.assumption(spec, wl, {kind: ops_items(spec, wl, dm, moe,
                                                          sac_ops.kind_variant(kind))
                                         for kind, moe, _ in ops_kinds(spec)}, par.pp)


def _deltanet_line(wl: Workload) -> str:
    """The assumption line of a model with gated DeltaNet layers: which kernels they run."""
    if wl.deltanet_kernel is DeltaNetKernel.FLA:
        return ("gated DeltaNet layers on flash-linear-attention's chunk_gated_delta_rule and "
                "FusedRMSNormGated with causal-conv1d's causal_conv1d_fn (the default: both "
                "installed, as transformers then runs them; --deltanet-kernel torch for its "
                "torch fallbacks as transformers up to 5.16 writes them, torch-solve from 5.17 "
                "on)")
    return ("gated DeltaNet layers on transformers' torch fallbacks (torch_chunk_gated_delta_"
            "rule, nn.Conv1d, Qwen3NextRMSNormGated)" + (
                " as transformers 5.17 on writes the rule (torch.linalg.solve_triangular)"
                if wl.deltanet_kernel is DeltaNetKernel.TORCH_SOLVE else
                " as transformers up to 5.16 writes the rule (forward substitution)"))


def _mamba_line(spec: ModelSpec, wl: Workload) -> str:
    """The assumption line of a model with Mamba2 layers (memplan.model.mamba): which code
    runs them."""
    if spec.mamba is not None and spec.mamba.parallel_attention:
        falcon = ("as transformers 5.23 writes it (FalconH1Mixer.forward: causal_conv1d_fn's "
                  "torch fallback, mamba2_chunk_scan's einsums in fp32, which under autocast "
                  "run in bf16 and are not modelled so; its cache with use_cache; "
                  "--mamba-kernel torch: 5.3's naive torch_forward, no cache)"
                  if wl.mamba_kernel is MambaKernel.TORCH_EINSUM else
                  "as transformers 5.3 wrote it (FalconH1Mixer.torch_forward: the naive chunked "
                  "scan's fp32 products saved and held; no cache)")
        return ("Falcon-H1's Mamba2 mixers (beside attention on every layer) on transformers' "
                f"torch path {falcon}; mamba_ssm's and causal-conv1d's CUDA kernels "
                "(mamba_split_conv1d_scan_combined, mamba_chunk_scan_combined) are not "
                "modelled")
    path = ("as transformers 5.23 writes it (causal_conv1d_fn's torch fallback, "
            "mamba2_chunk_scan's einsums in fp32; --mamba-kernel torch: as 5.3 wrote it)"
            if wl.mamba_kernel is MambaKernel.TORCH_EINSUM else
            "as transformers 5.3 wrote it (GraniteMoeHybridMambaLayer.torch_forward: the naive "
            "chunked scan's fp32 products saved and held)")
    return (f"Mamba2 layers on transformers' torch path {path}; mamba_ssm's fused kernel on "
            "CUDA (mamba_split_conv1d_scan_combined) saves far less and is not modelled")


def _compiled_loss_saves(spec: ModelSpec, par: ParallelConfig, wl: Workload) -> str:
    """What a compiled cross-entropy saves (``memplan.model.head``, ``chunked_output``,
    ``loss_in_call``), in words."""
    split = (wl.loss_impl.value == "torchtitan"
             and par.vocab_shard(spec.vocab_size) < spec.vocab_size)
    saves = ("the fp32 softmax less the one-hot targets and the out-of-shard mask (loss "
             "parallel)" if split else "its logits and two fp32 row statistics")
    if wl.loss_chunk_backward.value == "in-loss" and wl.loss_checkpointed:
        return f"each chunk's graph saves {saves}, freed with its backward in the loss call"
    return f"each chunk saves {saves}" if not split else f"saves {saves}"


def _assumptions(spec: ModelSpec, par: ParallelConfig, wl: Workload, schedule: Schedule,

                 ovh: Overheads) -> tuple[str, ...]:
    sched = ("interleaved 1F1B" if par.vpp > 1 else schedule.value) if par.pp > 1 else "none"
    return (
        f"pipeline schedule: {sched}",
        f"attention kernel: {wl.attention.value}; norms: {wl.norm_impl.value}; "
        f"optimizer: {wl.optimizer.value} {wl.optimizer_impl.value}; "
        f"loss on {'fp32' if wl.logits_fp32 else wl.compute_dtype.value} logits"
        + (f", in {wl.loss_chunks} checkpointed chunks of the tokens" if wl.loss_checkpointed
           else "")
        + (f", torchtune's chunked output and loss in {wl.loss_chunks} chunks (none "
           "checkpointed)" if wl.loss_impl.value == "torchtune-chunked" else "")
        + (f", its cross-entropy compiled ({_compiled_loss_saves(spec, par, wl)})"
           if wl.compile_loss else "")
        + f"; logits held: {wl.logits_held.value}",
        ("data-parallel gradients in persistent buffers they are views of (Megatron-LM, "
         "DDP gradient_as_bucket_view=True)" if par.grad_buffers is GradBuffers.VIEW else
         "DDP gradient buckets: a persistent gradient-sized copy (PyTorch DDP default)")
        if par.data_parallel_buffers and not wl.zero_bucket_buffers else
        ("gradients whole through backward, reduced after it through DeepSpeed's bucket into "
         "the rank's partition, the others freed (stage_1_and_2.py reduce_gradients, "
         "_clear_param_grad_only)") if par.data_parallel_buffers else
        ("each parameter's optimizer step in backward, in its post-accumulate-grad hook, which "
         "frees its gradient: one gradient and its step's temporaries at a time"
         if wl.optimizer_in_backward else
         "gradients freed after each optimizer step (zero_grad(set_to_none=True))"),
        "MoE routing balanced across experts (no capacity drop, no imbalance)",
        *adapters.assumptions(wl),
        *_compile_float8_lines(spec, par, wl),
        *((_PIPELINE_BUFFERS_LINE,) if par.pp > 1 and wl.pipeline_buffers.value == "torch"
          else ()),
        *fsdp1.assumptions(spec, par, wl),
        *((_deltanet_line(wl),) if spec.linear_attention is not None else ()),
        *((_mamba_line(spec, wl),) if spec.mamba is not None else ()),
        *((_ops_line(spec, par, wl),) if wl.recompute is Recompute.OPS else ()),
        *(("optimizer offloaded to host memory: fp32 master weights, states, an fp32 gradient "
           "copy and the step on the CPU (ZeRO-Offload); the GPU keeps weights and gradients",)
          if zero_offload(par) and not wl.flat_partition else ()),
        *(("optimizer offloaded to host memory (DeepSpeed ZeRO-Offload, stage_1_and_2.py "
           "cpu_offload): the fp32 partition, its fp32 gradient, a bf16/fp16 copy and the "
           "states on the CPU, stepped there; the GPU keeps the weights, the reduce bucket, a "
           "buffer of the largest parameter and at each reduce an fp64 copy of a gradient "
           "slice for its norm, no gradient partition",)
          if zero_offload(par) and wl.flat_partition and par.zero < ZeroStage.PARAMETERS
          else ()),
        *_zero3_offload_lines(par, wl),
        # DeepSpeed's offload_param has its own line above
        *offload_assumptions(par if not wl.flat_partition else par.model_copy(
            update={"offload": par.offload - {Offload.PARAMS}})),
        *((note,) if (note := optimizer_policy(wl.optimizer).note) else ()),
        f"cuda context: {ovh.cuda_context_source}",
        f"workspace: {ovh.workspace_source}",
        f"allocator: {ovh.allocator_source}",
        "NCCL buffers are not included (outside PyTorch's allocator; measured by calibration)",
    )


_PIPELINE_BUFFERS_LINE = (
    "pipeline stages as torch.distributed.pipelining's PipelineStage runs them: a receive "
    "buffer per micro-batch for each stage's input and its output's gradient, each output "
    "(the last stage's logits too) kept until its backward (memplan.model.pipeline_buffers); "
    "not counted: the sends an interleaved schedule keeps un-waited to the step's end, step "
    "1's metadata inference")


def _compile_float8_lines(spec: ModelSpec, par: ParallelConfig, wl: Workload
                          ) -> tuple[str, ...]:
    """What the output says of ``Workload.compile``, ``float8`` and ``async_tp``, each modelled
    where the layer model reads it."""
    lines = []
    tokens = wl.micro_batch_size * wl.seq_len // par.cp  # a micro-batch's, on this rank
    if wl.compile:
        lines.append(
            "each decoder layer compiled (torch.compile, Inductor): its saved tensors from "
            "AOTAutograd's min-cut partitioner, its backward's buffers from Inductor's kernels "
            "(memplan.model.compiled)"
            + ("; the activation checkpoint around the compiled layer" if
               wl.compile_in_checkpoint else "")
            + ("; the cross-entropy compiled" if wl.compile_loss else ""))
        threshold = compiled.mlp_grad_threshold_tokens(spec, par.tp)
        if threshold is not None and tokens < threshold:
            lines.append(COMPILED_BELOW_THRESHOLD_LINE.format(tokens=tokens,
                                                              threshold=threshold))
        if (spec.moe is not None and wl.moe_impl is MoeImpl.TITAN
                and wl.recompute is Recompute.FULL):
            lines.append(TITAN_MOE_FULL_AC_LINE)
    if wl.float8.value != "none":
        lines.append(
            f"float8 linears ({wl.float8.value} scaling; torchao convert_to_float8_training "
            "as torchtitan applies it, the output head not converted): their casts and "
            "scales (memplan.model.linear float8_forward_bytes)"
            + ("; weights all-gathered by FSDP2 in float8" if wl.float8_all_gather else ""))
    if (wl.compile and wl.float8.value == "rowwise" and wl.recompute is Recompute.NONE
            and spec.moe is None):
        lines.append(FLOAT8_ROWWISE_DFS_LINE.format(
            bytes=compiled.float8_rowwise_dfs_bytes(spec, par.tp, tokens)))
    if wl.async_tp:
        lines.append("async TP (Inductor's micro-pipelined all-gather and reduce-scatter "
                     "matmuls): step time only, memory as plain tensor parallelism")
    return tuple(lines)


# benchmarks/data/compiled_backward.json: the rows below the threshold (2 x 32 to 2 x 96 tokens
# at h 256, 1 x 256 at h 512), memplan's backward against the GPU rules' trace
COMPILED_BELOW_THRESHOLD_LINE = (
    "{tokens:,} tokens a micro-batch, fewer than the compiled MLP's weight-gradient "
    "threshold of {threshold:,} (T (f + h) < f h: its weight gradients outweigh its "
    "activations), where Inductor reorders the layer's backward by its own memory estimates "
    "(torch/_inductor/memory.py reorder_for_peak_memory), which memplan follows for "
    "torchtitan's fused-q/k/v block under full AC or per-op SAC, and in bf16 where lpmf's "
    "estimated peak is below the eager order's (compiled_order.with_mlp_grads_last), else "
    "the eager order: the traced layers' backward peaks there run from 1.2% under to 1.6% "
    "over, float8 rowwise to 7.0% under; whole traced steps below it within 0.5% over")


# compiled.float8_rowwise_dfs_bytes (benchmarks/data/compiled_backward.json's rowwise rows)
FLOAT8_ROWWISE_DFS_LINE = (
    "float8 rowwise without recompute, compiled: where Inductor orders a layer's backward by "
    "its dfs sort, it holds the output projection's and a gate/up projection's float8 weight "
    "casts and the incoming gradient's float8 cast at the MLP's activation kernel, not "
    "counted here: up to {bytes:,} B more at one layer's backward (traced layers: 1.05% to "
    "7.0% of the backward peak under this estimate)")


# (memplan.model.moe_titan_compiled.full_ac_backward; tests/traced/test_compile_trace.py
# test_compiled_titan_moe_block_under_full_ac)
TITAN_MOE_FULL_AC_LINE = (
    "torchtitan's compiled MoE block inside full AC: its backward from Inductor's order "
    "(traced exact, routed experts alone and with a shared expert); its forward inside the "
    "checkpoint counted as the block's no-recompute working set, above the traced forward "
    "(+73% to +145% of the block's own forward peak at 2 x 64 to 2 x 256 tokens): the forward "
    "phase's peak over, never under")


# A configuration asked again (a sweep run twice, a notebook cell re-run, the same candidate in
# several plans, an explanation's re-estimate) is answered from this cache. The key is the
# typed inputs themselves, all frozen (a model file is read again on every call, so an edited
# file is a new key), and an ``Estimate`` is immutable: a hit is the model's result for exactly
# those inputs. ``memplan.estimate`` and ``memplan.report.explain`` share it. An entry holds
# about 5 KB (768 mixed-grid estimates added 4.1 MB, tracemalloc): 4096 hold a grid of a
# thousand configurations with their explanations' two or three re-estimates each.
cached_estimate = lru_cache(maxsize=4096)(estimate)
