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
separate lines on top of the tensor peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan import activations as act
from memplan.errors import MemplanError
from memplan.hardware import GpuSpec
from memplan.overheads import Overheads, default_overheads
from memplan.parallel import ParallelConfig, validate_layout
from memplan.pipeline import Schedule, chunks_in_flight, stage_layers
from memplan.spec import ModelSpec
from memplan.states import (
    optimizer_step_temp_bytes, sharding_buffers, stage_params, state_bytes,
)
from memplan.workload import Recompute, Workload

PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class PhasePeaks:
    """Tensor bytes alive at each phase's peak (fixed overheads excluded)."""

    forward: int
    backward: int
    optimizer: int

    @property
    def peak(self) -> int:
        return max(self.forward, self.backward, self.optimizer)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=lambda name: getattr(self, name))


@dataclass(frozen=True)
class StageMemory:
    """One rank of pipeline stage ``stage``. All sizes are int bytes for that one GPU."""

    stage: int
    num_layers: int
    num_params: int  # parameters this rank holds before ZeRO sharding
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # saved activations of all micro-batches in flight
    microbatches_in_flight: int
    activation_terms: tuple[act.Term, ...]  # one micro-batch, summed over the stage's layers
    loss_bytes: int  # logits-sized tensors alive at the loss, beyond what is saved
    sharding_buffers_bytes: int  # ZeRO-3 gathered units / ZeRO-2 bucket, at their peak
    optimizer_temp_bytes: int
    steady: PhasePeaks
    first_step: PhasePeaks
    tensor_peak_bytes: int
    cuda_context_bytes: int
    workspace_bytes: int
    allocator_bytes: int
    peak_bytes: int

    @property
    def peak_phase(self) -> str:
        which = self.steady if self.steady.peak >= self.first_step.peak else self.first_step
        step = "steady" if which is self.steady else "first step"
        return f"{which.peak_phase} ({step})"


@dataclass(frozen=True)
class Estimate:
    """Per-GPU memory of a training job: every stage, and the most loaded rank."""

    spec: ModelSpec
    gpu: GpuSpec
    parallel: ParallelConfig
    workload: Workload
    num_microbatches: int
    global_batch_size: int
    capacity_bytes: int
    stages: tuple[StageMemory, ...]
    overheads: Overheads
    assumptions: tuple[str, ...] = field(default=())

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


def resolve_batch(par: ParallelConfig, wl: Workload) -> tuple[int, int]:
    """(global batch, micro-batches per step). Default global batch fills the pipeline:
    mbs * dp * pp, i.e. m = p micro-batches."""
    per_step = wl.micro_batch_size * par.dp
    gbs = wl.global_batch_size or per_step * par.pp
    if gbs % per_step:
        raise MemplanError(
            f"gbs ({gbs}) must be divisible by mbs*dp ({wl.micro_batch_size}*{par.dp} = {per_step})")
    m = gbs // per_step
    if par.vpp > 1 and m % par.pp:
        raise MemplanError(
            f"interleaved pipeline needs micro-batches per step ({m}) divisible by pp ({par.pp})")
    return gbs, m


def _layer_recompute(wl: Workload, position: int, num_stage_layers: int) -> Recompute:
    """Full recompute of k of a stage's layers applies to its first k (Megatron-LM's 'block')."""
    if wl.recompute is Recompute.FULL and wl.recompute_layers is not None:
        return Recompute.FULL if position < wl.recompute_layers else Recompute.NONE
    return wl.recompute


def _chunk_terms(spec: ModelSpec, wl: Workload, dm: act.Dims, layers: list[int], *,
                 embedding: bool, head: bool, position0: int, stage_layer_count: int
                 ) -> tuple[list[act.Term], int]:
    """Saved terms of one micro-batch in one chunk, and its largest full layer (for recompute)."""
    terms = act.rope_terms(spec, dm)
    if embedding:
        terms += act.embedding_terms(spec, dm)
    largest_recomputed = 0
    for pos, i in enumerate(layers, start=position0):
        policy = _layer_recompute(wl, pos, stage_layer_count)
        moe = spec.is_moe_layer(i)
        terms += act.layer_terms(spec, wl, dm, moe_layer=moe, recompute=policy)
        if policy is Recompute.FULL:  # its backward first rebuilds the whole layer
            full = act.layer_terms(spec, wl, dm, moe_layer=moe, recompute=Recompute.NONE)
            largest_recomputed = max(largest_recomputed, act.total(full))
    if head:
        terms += act.head_terms(spec, wl, dm)
    return terms, largest_recomputed


def _merge(terms: list[act.Term]) -> tuple[act.Term, ...]:
    sums: dict[str, int] = {}
    for term in terms:
        sums[term.name] = sums.get(term.name, 0) + term.size_bytes
    return tuple(act.Term(name, size) for name, size in sums.items())


def _stage(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, stage: int,
           schedule: Schedule, ovh: Overheads) -> StageMemory:
    dm = act.Dims.of(par, wl)
    first, last = stage == 0, stage == par.pp - 1
    chunks = stage_layers(spec.num_layers, par, stage)
    in_flight = chunks_in_flight(par, m, stage, schedule)
    n_stage_layers = sum(len(c) for c in chunks)

    activations = 0
    per_mb_terms: list[act.Term] = []
    largest_recomputed = 0
    for c, (layers, count) in enumerate(zip(chunks, in_flight)):
        terms, recomputed = _chunk_terms(
            spec, wl, dm, layers, embedding=first and c == 0, head=last and c == par.vpp - 1,
            position0=c * len(layers), stage_layer_count=n_stage_layers)
        activations += count * act.total(terms)
        per_mb_terms += terms
        largest_recomputed = max(largest_recomputed, recomputed)

    all_layers = [i for chunk in chunks for i in chunk]
    sp = stage_params(spec, par, all_layers, first=first, last=last)
    st = state_bytes(sp, par, wl)
    opt_temp = optimizer_step_temp_bytes(sp, st, par, wl)
    shard_fwd, shard_bwd = sharding_buffers(sp, par, wl)
    loss_fwd = act.head_forward_extra_bytes(spec, wl, dm) if last else 0
    mask = act.eager_mask_bytes(wl, dm)
    loss_bwd = act.head_backward_extra_bytes(spec, wl, dm) if last else 0

    grads_in_forward = st.grads_bytes if m > 1 else 0
    # At the end of backward only the first layer's inputs of this micro-batch remain, plus the
    # other micro-batches still in flight; a fully recomputed layer is rebuilt whole first.
    one_mb = act.total(per_mb_terms)
    end_of_backward = activations - one_mb + largest_recomputed
    bwd_start = activations + loss_bwd + largest_recomputed + grads_in_forward
    bwd_end = end_of_backward + st.grads_bytes

    def peaks(opt_bytes: int) -> PhasePeaks:
        base = st.params_bytes + opt_bytes
        return PhasePeaks(
            forward=base + grads_in_forward + activations + loss_fwd + mask + shard_fwd,
            backward=base + max(bwd_start, bwd_end) + shard_bwd,
            optimizer=st.params_bytes + st.grads_bytes + st.optimizer_bytes + opt_temp,
        )

    # Master weights exist from optimizer setup; moments appear at step 1's optimizer step.
    steady, first_step = peaks(st.optimizer_bytes), peaks(st.master_bytes)
    tensor_peak = max(steady.peak, first_step.peak)
    alloc = ovh.allocator_bytes(tensor_peak)
    return StageMemory(
        stage=stage, num_layers=n_stage_layers, num_params=sp.total,
        params_bytes=st.params_bytes, grads_bytes=st.grads_bytes,
        optimizer_bytes=st.optimizer_bytes, activations_bytes=activations,
        microbatches_in_flight=max(in_flight), activation_terms=_merge(per_mb_terms),
        loss_bytes=max(loss_fwd, loss_bwd), sharding_buffers_bytes=max(shard_fwd, shard_bwd),
        optimizer_temp_bytes=opt_temp, steady=steady, first_step=first_step,
        tensor_peak_bytes=tensor_peak, cuda_context_bytes=ovh.cuda_context_bytes,
        workspace_bytes=ovh.workspace_bytes, allocator_bytes=alloc,
        peak_bytes=tensor_peak + ovh.fixed_bytes + alloc,
    )


def estimate(spec: ModelSpec, gpu: GpuSpec, par: ParallelConfig, wl: Workload, *,
             capacity_bytes: int | None = None, overheads: Overheads | None = None,
             schedule: Schedule = Schedule.ONE_F_ONE_B) -> Estimate:
    """Per-GPU memory of every pipeline stage for one training job.

    ``capacity_bytes`` defaults to the GPU's reported memory; ``overheads`` to the uncalibrated
    defaults for the GPU (``memplan.overheads``).
    """
    validate_layout(spec, par, seq_len=wl.seq_len)
    if wl.seq_len > spec.max_seq_len and spec.position.value == "learned":
        raise MemplanError(
            f"seq ({wl.seq_len}) exceeds {spec.name}'s learned positions ({spec.max_seq_len})")
    gbs, m = resolve_batch(par, wl)
    ovh = overheads if overheads is not None else default_overheads(gpu)
    stages = tuple(_stage(spec, par, wl, m, i, schedule, ovh) for i in range(par.pp))
    return Estimate(
        spec=spec, gpu=gpu, parallel=par, workload=wl, num_microbatches=m,
        global_batch_size=gbs, capacity_bytes=capacity_bytes or gpu.memory_bytes,
        stages=stages, overheads=ovh, assumptions=_assumptions(par, wl, schedule, ovh),
    )


def _assumptions(par: ParallelConfig, wl: Workload, schedule: Schedule,
                 ovh: Overheads) -> tuple[str, ...]:
    sched = ("interleaved 1F1B" if par.vpp > 1 else schedule.value) if par.pp > 1 else "none"
    return (
        f"pipeline schedule: {sched}",
        f"attention kernel: {wl.attention.value}; norms: {wl.norm_impl.value}; "
        f"loss on {'fp32' if wl.logits_fp32 else wl.compute_dtype.value} logits",
        "gradients freed after each optimizer step (zero_grad(set_to_none=True))",
        "MoE routing balanced across experts (no capacity drop, no imbalance)",
        f"cuda context: {ovh.cuda_context_source}",
        f"workspace: {ovh.workspace_source}",
        f"allocator: {ovh.allocator_source}",
        "NCCL buffers are not included (outside PyTorch's allocator; measured by calibration)",
    )
