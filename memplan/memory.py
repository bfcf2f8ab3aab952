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


def _layer_recompute(wl: Workload, position: int) -> Recompute:
    """Full recompute of k of a stage's layers applies to its first k (Megatron-LM's 'block')."""
    if wl.recompute is Recompute.FULL and wl.recompute_layers is not None:
        return Recompute.FULL if position < wl.recompute_layers else Recompute.NONE
    return wl.recompute


@dataclass(frozen=True)
class _LayerKind:
    """What one layer of a kind (MoE or dense, recompute policy) holds for one micro-batch."""

    terms: tuple[act.Term, ...]
    saved_bytes: int
    recomputed_bytes: int  # rebuilt at the start of its backward (full recompute), else 0
    backward_extra_bytes: int
    peak_in_mlp: bool  # the backward peaks in the MLP, else in attention (after the MLP)


def _layer_kind(spec: ModelSpec, wl: Workload, dm: act.Dims, moe: bool,
                policy: Recompute) -> _LayerKind:
    terms = tuple(act.layer_terms(spec, wl, dm, moe_layer=moe, recompute=policy))
    full = 0
    if policy is Recompute.FULL:
        full = act.total(act.layer_terms(spec, wl, dm, moe_layer=moe, recompute=Recompute.NONE))
    return _LayerKind(terms, act.total(terms), full,
                      act.layer_backward_extra_bytes(spec, wl, dm, moe_layer=moe),
                      act.backward_peak_in_mlp(spec, wl, dm, moe_layer=moe))


def _merge(groups: list[tuple[int, tuple[act.Term, ...]]]) -> tuple[act.Term, ...]:
    """Sum ``count`` copies of each term list by name."""
    sums: dict[str, int] = {}
    for count, terms in groups:
        for term in terms:
            sums[term.name] = sums.get(term.name, 0) + count * term.size_bytes
    return tuple(act.Term(name, size) for name, size in sums.items())


@dataclass(frozen=True)
class _Walk:
    """Inputs of the backward walk of one stage (one micro-batch, bytes)."""

    layers: list[tuple[_LayerKind, int, int]]  # (kind, grads, grads before its peak), in order
    other_bytes: int  # activations of the other micro-batches in flight, kept throughout
    head_saved: int  # final norm and loss terms (last stage)
    rest_saved: int  # rope tables, embedding ids: alive until the step's backward ends
    loss_bwd: int
    head_linear_bwd: int  # logits grad in the compute dtype + the head's weight grad
    head_grads: int
    embed_grads: int
    tied_extra: int  # tied embedding: the head's pending grad and the sum, beyond the grad
    grad_buffer: int  # ZeRO-2/3 unsharded gradients awaiting reduce-scatter, once grads flow


def _backward_peak(w: _Walk, grads_prior: int, grads_total: int) -> int:
    """Largest bytes alive (activations + gradients + transients) during one backward.

    ``grads_prior`` is what exists when it starts: 0 for a step's only micro-batch, all
    gradients when earlier micro-batches produced them (they then accumulate in place).
    """
    growing = grads_prior == 0
    acts = w.other_bytes + w.rest_saved + w.head_saved + sum(k.saved_bytes for k, *_ in w.layers)
    grads = grads_prior
    peak = acts + grads + w.loss_bwd
    peak = max(peak, acts - w.head_saved + grads + w.head_linear_bwd)
    acts -= w.head_saved
    grads += w.head_grads if growing else 0
    pending = w.tied_extra // 2  # a tied head's weight grad waits for the embedding's
    for kind, layer_grads, early_grads in reversed(w.layers):
        peak = max(peak, acts + grads + (early_grads if growing else 0) + pending
                   + kind.recomputed_bytes + kind.backward_extra_bytes + w.grad_buffer)
        acts -= kind.saved_bytes
        grads += layer_grads if growing else 0
    end_grads = grads_total if growing or grads_prior else grads
    return max(peak, acts + end_grads + w.tied_extra + w.grad_buffer)


def _mlp_output_params(spec: ModelSpec, par: ParallelConfig, i: int) -> int:
    """Parameters of a layer's MLP output projection(s) on one rank."""
    h, t = spec.hidden_size, par.tp
    if spec.is_moe_layer(i) and spec.moe is not None:
        moe = spec.moe
        routed = moe.num_experts // par.ep * moe.expert_ffn_hidden_size
        return h * (routed + moe.num_shared_experts * moe.shared_expert_ffn_hidden_size) // t
    return h * spec.ffn_hidden_size // t + (h if spec.mlp_bias else 0)


def _mlp_params(spec: ModelSpec, par: ParallelConfig, i: int) -> int:
    """All parameters of a layer's MLP (or MoE block) and its norm on one rank."""
    norm = spec.hidden_size * (2 if spec.norm_bias else 1)
    mult = (3 if spec.mlp.gated else 2)
    out = _mlp_output_params(spec, par, i)
    total = out * mult + norm
    if spec.is_moe_layer(i) and spec.moe is not None:
        total += spec.hidden_size * spec.moe.num_experts
    return total


def _stage(spec: ModelSpec, par: ParallelConfig, wl: Workload, m: int, stage: int,
           schedule: Schedule, ovh: Overheads) -> StageMemory:
    dm = act.Dims.of(par, wl)
    first, last = stage == 0, stage == par.pp - 1
    chunks = stage_layers(spec.num_layers, par, stage)
    in_flight = chunks_in_flight(par, m, stage, schedule)
    all_layers = [i for chunk in chunks for i in chunk]
    sp = stage_params(spec, par, all_layers, first=first, last=last)
    st = state_bytes(sp, par, wl)
    grad_per_param = st.grads_bytes / max(sp.total, 1)

    kinds: dict[tuple[bool, Recompute], _LayerKind] = {}
    layer_list = []
    for pos, (i, n_params) in enumerate(zip(all_layers, sp.layers)):
        key = (spec.is_moe_layer(i), _layer_recompute(wl, pos))
        if key not in kinds:
            kinds[key] = _layer_kind(spec, wl, dm, *key)
        kind = kinds[key]
        early = _mlp_output_params(spec, par, i) if kind.peak_in_mlp else _mlp_params(spec, par, i)
        layer_list.append((kind, int(n_params * grad_per_param), int(early * grad_per_param)))

    rope = act.rope_terms(spec, dm)  # computed by every chunk's forward
    embed = act.embedding_terms(spec, dm) if first else []
    head = act.head_terms(spec, wl, dm) if last else []
    batch = act.total(act.batch_terms(dm)) if last else 0  # held by the loop, not the graph
    per_chunk = len(all_layers) // par.vpp
    activations = 0
    groups: list[tuple[int, tuple[act.Term, ...]]] = [
        (par.vpp, tuple(rope)), (1, tuple(embed)), (1, tuple(head))]
    for c, count in enumerate(in_flight):
        chunk_layers = layer_list[c * per_chunk:(c + 1) * per_chunk]
        activations += count * (sum(k.saved_bytes for k, *_ in chunk_layers) + act.total(rope))
        groups += [(1, k.terms) for k, *_ in chunk_layers]
    # The embedding belongs to the first chunk, the loss to the last.
    activations += in_flight[0] * act.total(embed) + in_flight[-1] * act.total(head)
    rest = rope + embed
    one_mb = (sum(k.saved_bytes for k, *_ in layer_list) + par.vpp * act.total(rope)
              + act.total(embed) + act.total(head))

    opt_temp = optimizer_step_temp_bytes(sp, st, par, wl)
    shard = sharding_buffers(sp, par, wl)
    e = dm.e
    loss_fwd = act.head_forward_extra_bytes(spec, wl, dm) if last else 0
    mask = act.eager_mask_bytes(wl, dm)
    tied = spec.tied_embeddings and first and last
    vocab_grad = -(-spec.vocab_size // par.tp) * spec.hidden_size * e
    walk = _Walk(
        layers=layer_list, other_bytes=max(0, activations - one_mb),
        head_saved=act.total(head) - batch, rest_saved=act.total(rest) + batch,
        loss_bwd=act.head_backward_extra_bytes(spec, wl, dm) if last else 0,
        head_linear_bwd=(act.head_linear_backward_bytes(spec, wl, dm) + vocab_grad) if last else 0,
        head_grads=int(sp.head * grad_per_param), embed_grads=int(sp.embedding * grad_per_param),
        tied_extra=2 * vocab_grad if tied else 0, grad_buffer=shard.grad_bytes,
    )
    grads_in_forward = st.grads_bytes if m > 1 else 0
    bwd_tensors = _backward_peak(walk, grads_in_forward, st.grads_bytes)

    def peaks(opt_bytes: int) -> PhasePeaks:
        base = st.params_bytes + opt_bytes
        return PhasePeaks(
            forward=base + grads_in_forward + activations + loss_fwd + mask + shard.gathered_bytes,
            backward=base + bwd_tensors + shard.gathered_bytes,
            optimizer=st.params_bytes + st.grads_bytes + st.optimizer_bytes + opt_temp,
        )

    # Master weights exist from optimizer setup; moments appear at step 1's optimizer step.
    steady, first_step = peaks(st.optimizer_bytes), peaks(st.master_bytes)
    tensor_peak = max(steady.peak, first_step.peak)
    alloc = ovh.allocator_bytes(tensor_peak)
    return StageMemory(
        stage=stage, num_layers=len(all_layers), num_params=sp.total,
        params_bytes=st.params_bytes, grads_bytes=st.grads_bytes,
        optimizer_bytes=st.optimizer_bytes, activations_bytes=activations,
        microbatches_in_flight=max(in_flight), activation_terms=_merge(groups),
        loss_bytes=max(loss_fwd, walk.loss_bwd), sharding_buffers_bytes=shard.peak_bytes,
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
    per_stage = spec.num_layers // par.pp
    if wl.recompute_layers is not None and wl.recompute_layers > per_stage:
        raise MemplanError(f"recompute_layers ({wl.recompute_layers}) must be at most the layers "
                           f"per pipeline stage ({per_stage})")
    ovh = overheads if overheads is not None else default_overheads(gpu)
    stages = tuple(_stage(spec, par, wl, m, i, schedule, ovh) for i in range(par.pp))
    return Estimate(
        spec=spec, gpu=gpu, parallel=par, workload=wl, num_microbatches=m,
        global_batch_size=gbs,
        capacity_bytes=gpu.memory_bytes if capacity_bytes is None else capacity_bytes,
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
